"""DGL's distributed loaders (``DistNodeDataLoader``, ``DistEdgeDataLoader``) as sources.

:class:`DistLoaderSource` makes one of them a re-iterable source with a length,
receives the batches a pass left early still has on their way from DGL's sampler
processes, and checks the first batch of an edge loader given ``exclude`` (DGL's
``DistGraph.sample_neighbors`` ignores ``exclude_edges``: see
:func:`seed_edges_in_blocks`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ._dgl import EID

logger = logging.getLogger(__name__)


class DistLoaderSource:
    """A DGL ``DistDataLoader`` (``DistNodeDataLoader``, ``DistEdgeDataLoader``) as a
    re-iterable source with a length.

    DGL's distributed loaders return themselves from ``__iter__`` (which
    restarts the epoch) and have no ``len()``; this makes every
    ``iter()`` one new pass and ``len()`` the number of batches DGL expects.
    No two passes ever advance the shared iterator at once: a loader retires an
    epoch's producer before it starts the next one, and two loaders over one
    DGL loader follow the one-loader rule (each wraps it in its own
    ``DistLoaderSource``; the rule is keyed by the DGL loader,
    ``loader._shares_its_iterator``).

    A pass left early with DGL sampler processes (``DGL_NUM_SAMPLER`` > 0) still
    has batches on their way: DGL keeps up to ``queue_size`` requests in flight
    (``num_pending``), and its ``__iter__`` forgets them without receiving them,
    so they would come out first in the next pass -- which would then stop
    ``num_pending`` batches short of its own and hand those to the pass after.
    ``iter()`` here receives and drops them first (:meth:`drop_abandoned_batches`).

    An edge loader built with ``exclude`` has its first batch checked: if DGL
    left any of the batch's seed edges in its blocks, a ``RuntimeWarning`` says
    so, once per source (the batches are passed on as DGL made them).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.dropped_batches = 0
        self.exclude = requested_exclude(loader)
        self.seed_edges_kept: int | None = None  # in the checked batch; None: not checked

    def __iter__(self) -> Iterator[Any]:
        self.drop_abandoned_batches()
        iterator = iter(self.loader)
        if self.exclude is None or self.seed_edges_kept is not None:
            return iterator
        return self._checking_first_batch(iterator)

    def _checking_first_batch(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # next(), not `for`: iter() on DGL's loader would restart (and reshuffle) the pass
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            if self.seed_edges_kept is None:
                self._check_exclusion(item)
            yield item

    def _check_exclusion(self, item: Any) -> None:
        try:
            kept, seeds = seed_edges_in_blocks(item)
        except Exception as exc:  # noqa: BLE001 - an item of another shape: say so, go on
            logger.info("pingpong: could not check DGL's exclude=%r on a batch: %r",
                        self.exclude, exc)
            self.seed_edges_kept = -1
            return
        self.seed_edges_kept = kept
        if kept:
            warnings.warn(
                f"DGL's DistEdgeDataLoader was given exclude={self.exclude!r}, yet the "
                f"first batch's blocks hold {kept} edges among its {seeds} seed edges: "
                "DGL's DistGraph.sample_neighbors ignores exclude_edges (DGL 1.1.3 and "
                "2.1.0), so the model sees the edges it is asked to predict. pingpong "
                "passes DGL's batches on as they are.", RuntimeWarning, stacklevel=2)

    def drop_abandoned_batches(self) -> int:
        """Receive and drop the batches DGL's sampler processes are still preparing for
        the last pass (none if it ended, or without sampler processes); how many."""
        loader = self.loader
        if getattr(loader, "pool", None) is None:  # no sampler processes: nothing in flight
            return 0
        if not (hasattr(loader, "num_pending") and hasattr(loader, "_get_data_from_result_queue")):
            _warn_once("pingpong: this DGL's DistDataLoader has no num_pending or "
                       "_get_data_from_result_queue (pingpong knows DGL 1.1.3 and 2.1.0): a "
                       "pass left early may leave batches that the next pass receives first")
            return 0
        pending = int(loader.num_pending or 0)
        if pending <= 0:
            return 0
        for _ in range(pending):
            loader._get_data_from_result_queue()  # DGL's own wait (its 1800 s default)
            loader.num_pending -= 1
        self.dropped_batches += pending
        logger.debug("pingpong: dropped %d batches DGL prepared for a pass left early",
                     pending)
        return pending

    def __len__(self) -> int:
        return int(self.loader.expected_idxs)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def restartable_dgl_loader(source: Any) -> DistLoaderSource | None:
    """``source`` as a re-iterable if it is a DGL distributed loader, else ``None``."""
    for cls in type(source).__mro__:
        if cls.__name__ == "DistDataLoader" and cls.__module__.startswith("dgl."):
            return DistLoaderSource(source)
    return None


def requested_exclude(loader: Any) -> Any:
    """The ``exclude`` a ``DistEdgeDataLoader`` was built with (its ``EdgeCollator``'s),
    or None (none asked for, or not an edge loader)."""
    collator = getattr(getattr(loader, "collate_fn", None), "__self__", None)
    if type(collator).__name__ != "EdgeCollator":
        return None
    return getattr(collator, "exclude", None)


def seed_edges_in_blocks(item: Any) -> tuple[int, int]:
    """``(kept, seeds)`` for an edge loader's item ``(input_nodes, pair_graph, ...,
    blocks)``: how many edges of the blocks are seed edges of the pair graph, by
    original edge id (``edata[dgl.EID]``, per edge type), and how many seeds."""
    pair, blocks = item[1], item[-1]
    kept = seeds = 0
    for etype in pair.canonical_etypes:
        seed_ids = pair.edges[etype].data[EID]
        seeds += int(seed_ids.numel())
        for block in blocks:
            if etype in block.canonical_etypes:
                block_ids = block.edges[etype].data[EID]
                kept += int(torch.isin(block_ids, seed_ids).sum())
    return kept, seeds
