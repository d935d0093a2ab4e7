"""Which rows a sampler gathers most: counting ids and choosing the hot rows.

On real graphs (power-law degrees) a few percent of the nodes appear in most
sampled batches. A feature cache keeps those rows in device memory; this
module is the part of it that needs no GPU: it counts the ids a loader
gathers, and picks the rows a cache of a given size should hold.

- :class:`RowCounter` counts how often each row of one table was gathered.
  One ``index_add_`` per batch; the ids are checked against the table's
  length first, so a bad id never touches the counts.
- :meth:`RowCounter.hottest` returns the ``k`` rows counted most (most
  counted first, ties broken by the lower id, so the choice is the same on
  every machine); rows never counted are never chosen.
- :func:`rows_within` converts a byte budget into a number of rows.
- :func:`build_slot_map` maps each row to its place in a cache (or -1).
- :func:`hit_rate` says which share of some gathered ids a given set of rows
  would have served (the measure ``benchmarks/cache_hit_rate.py`` reports).

A cache filled with the hottest rows of the epoch it serves is the best any
*static* cache of that size can do for that epoch; a cache learned from the
previous epoch is what a loader can actually have.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ._integers import Count, integer
from .errors import ConfigError, IdRangeError, IdShapeError, IdTypeError, TableError

__all__ = ["NOT_CACHED", "RowCounter", "build_slot_map", "hit_rate", "rows_within"]

#: ``slot_of`` entry of a row that is not cached (:func:`build_slot_map`).
NOT_CACHED = -1

_INT_DTYPES = (torch.int64, torch.int32)


def _checked_ids(ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``ids`` as a 1-D int64 CPU tensor, after checking type, shape and range."""
    if not isinstance(ids, torch.Tensor):
        raise IdTypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _INT_DTYPES:
        raise IdTypeError(f"ids must be int64 or int32, got {ids.dtype}")
    if ids.dim() != 1:
        raise IdShapeError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.to(device="cpu", dtype=torch.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        bad = ids[(ids < 0) | (ids >= num_rows)][0]
        raise IdRangeError(f"id {int(bad)} is outside the table's {num_rows} rows")
    return ids


class RowCounter:
    """How often each of a table's ``num_rows`` rows was gathered.

    Attributes:
        counts: int64 ``(num_rows,)``; ``counts[i]`` is how many times row
            ``i`` was passed to :meth:`add`.
        total: the sum of ``counts`` (every id added, duplicates included).
    """

    def __init__(self, num_rows: Count) -> None:
        if (count := integer(num_rows)) is None or count < 0:
            raise ConfigError(f"num_rows must be a non-negative int, got {num_rows!r}")
        num_rows = count
        self.num_rows = num_rows
        self.counts = torch.zeros(num_rows, dtype=torch.int64)
        self.total = 0
        self._ones = torch.ones(0, dtype=torch.int64)

    def add(self, ids: torch.Tensor) -> None:
        """Count one batch's ids (1-D int64/int32, any device).

        Raises:
            IdTypeError: not an int32/int64 tensor (:class:`IdShapeError`, a
                subclass, if it is not 1-D).
            IdRangeError: an id is negative or ``>= num_rows``; nothing is counted.
        """
        ids = _checked_ids(ids, self.num_rows)
        if len(ids) > len(self._ones):
            self._ones = torch.ones(len(ids), dtype=torch.int64)
        self.counts.index_add_(0, ids, self._ones[: len(ids)])
        self.total += len(ids)

    def add_all(self, batches: Iterable[torch.Tensor]) -> None:
        """:meth:`add` each tensor of ``batches``."""
        for ids in batches:
            self.add(ids)

    def hottest(self, k: Count) -> torch.Tensor:
        """The ids of the (at most) ``k`` most counted rows, most counted first.

        Ties go to the lower id; rows with a count of 0 are left out, so fewer
        than ``k`` ids come back when fewer rows were ever counted.
        """
        if (count := integer(k)) is None or count < 0:
            raise ConfigError(f"k must be a non-negative int, got {k!r}")
        k = count
        order = torch.sort(self.counts, descending=True, stable=True).indices[:k]
        return order[self.counts[order] > 0]

    def reset(self) -> None:
        """Forget every count."""
        self.counts.zero_()
        self.total = 0


def rows_within(budget_bytes: Count, row_bytes: Count, num_rows: Count) -> int:
    """How many whole rows of ``row_bytes`` fit in ``budget_bytes`` (at most ``num_rows``)."""
    for name, value in (("budget_bytes", budget_bytes), ("row_bytes", row_bytes),
                        ("num_rows", num_rows)):
        if (number := integer(value)) is None or number < 0:
            raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
    if row_bytes == 0:
        return int(num_rows)
    return int(min(num_rows, budget_bytes // row_bytes))


def hit_rate(hot_ids: torch.Tensor, counts: torch.Tensor) -> float:
    """The share of gathered rows a cache holding ``hot_ids`` would have served.

    ``counts`` is a :attr:`RowCounter.counts` (how often each row was
    gathered); duplicates in ``hot_ids`` count once. 0.0 when nothing was
    gathered. ``hot_ids`` is checked as by :meth:`RowCounter.add` (also when
    nothing was gathered).
    """
    hot_ids = _checked_ids(hot_ids, len(counts))
    total = int(counts.sum())
    if total == 0:
        return 0.0
    held = torch.zeros(len(counts), dtype=torch.bool)
    held[hot_ids] = True
    return int(counts[held].sum()) / total


def build_slot_map(num_rows: int, hot_ids: Any) -> np.ndarray:
    """The host int32 ``slot_of`` for a cache holding ``hot_ids`` (in that order).

    Raises:
        IdTypeError: ``hot_ids`` is not an integer array (:class:`IdShapeError`,
            a subclass, if it is not 1-D).
        IdRangeError: an id is outside ``[0, num_rows)``.
        TableError: an id appears twice, or more than 2**31 - 1 rows are cached.
    """
    hot = np.asarray(hot_ids.detach().cpu().numpy() if isinstance(hot_ids, torch.Tensor)
                     else hot_ids)
    if hot.ndim != 1:
        raise IdShapeError(f"hot_ids must be 1-D, got shape {hot.shape}")
    if hot.size and not np.issubdtype(hot.dtype, np.integer):
        raise IdTypeError(f"hot_ids must be integers, got {hot.dtype}")
    if len(hot) > np.iinfo(np.int32).max:
        raise TableError(f"at most {np.iinfo(np.int32).max} rows can be cached, got {len(hot)}")
    if len(hot) and (int(hot.min()) < 0 or int(hot.max()) >= num_rows):  # before any cast
        bad = hot[(hot < 0) | (hot >= num_rows)][0]
        raise IdRangeError(f"hot id {int(bad)} is outside the table's {num_rows} rows")
    hot = hot.astype(np.int64, copy=False)
    if len(np.unique(hot)) != len(hot):
        raise TableError("hot_ids must be distinct: a row is cached once")
    slot_of = np.full(num_rows, NOT_CACHED, dtype=np.int32)
    slot_of[hot] = np.arange(len(hot), dtype=np.int32)
    return slot_of
