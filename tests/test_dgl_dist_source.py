""":class:`pingpong.forms._dgl_dist.DistLoaderSource` over a stand-in for DGL's
``DistDataLoader`` (its iterator protocol: ``__iter__`` restarts the pass and returns
the loader itself). The real loaders, with servers, are in ``tests/test_distdgl.py``;
here the parts DGL's servers cannot make happen on demand."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pingpong.forms._dgl_dist import DistLoaderSource, requested_exclude, seed_edges_in_blocks

dgl = pytest.importorskip("dgl")


class EdgeCollator:  # named like DGL's: pingpong reads `exclude` from it
    def __init__(self, exclude: Any) -> None:
        self.exclude = exclude

    def collate(self, items: Any) -> Any:
        return items


class StandInDistLoader:
    """Restarts (and counts) on ``iter()``, yields ``items`` then stops, like DGL's."""

    def __init__(self, items: list[Any], exclude: Any = None) -> None:
        self.items = items
        self.collate_fn = EdgeCollator(exclude).collate
        self.restarts = 0
        self.pos = 0
        self.expected_idxs = len(items)

    def __iter__(self) -> StandInDistLoader:
        self.restarts += 1
        self.pos = 0
        return self

    def __next__(self) -> Any:
        if self.pos == len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]


def edge_item(seed_eids: list[int], block_eids: list[int]) -> tuple[Any, ...]:
    """``(input_nodes, pair_graph, blocks)`` with those original edge ids."""
    pair = dgl.graph((torch.arange(len(seed_eids)), torch.arange(len(seed_eids))))
    pair.edata[dgl.EID] = torch.tensor(seed_eids)
    block = dgl.create_block((torch.arange(len(block_eids)), torch.zeros(len(block_eids),
                                                                       dtype=torch.int64)))
    block.edata[dgl.EID] = torch.tensor(block_eids)
    return torch.arange(3), pair, [block]


def test_the_exclude_check_restarts_dgls_pass_once_and_warns_once():
    items = [edge_item([5, 6], [1, 5, 9]), edge_item([7], [7, 8])]
    loader = StandInDistLoader(items, exclude="self")
    source = DistLoaderSource(loader)
    assert len(source) == loader.expected_idxs == 2  # DGL's own count of the pass's batches
    with pytest.warns(RuntimeWarning, match=r"exclude='self'.*hold 1 edges among its 2"):
        first = one_pass(source)
    assert loader.restarts == 1  # one pass, one restart (no second shuffle)
    assert first == items
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once: no second warning
        assert one_pass(source) == items
    assert loader.restarts == 2
    assert source.seed_edges_kept == 1


def test_no_warning_when_the_blocks_hold_no_seed_edge_or_no_exclude_was_asked():
    clean = [edge_item([5, 6], [1, 9])]
    leaky = [edge_item([5], [5])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source = DistLoaderSource(StandInDistLoader(clean, exclude="self"))
        assert one_pass(source) == clean
        assert source.seed_edges_kept == 0
        plain = DistLoaderSource(StandInDistLoader(leaky, exclude=None))
        assert one_pass(plain) == leaky
        assert plain.seed_edges_kept is None  # nothing asked, nothing checked


def test_an_item_the_exclude_check_cannot_read_is_passed_on(caplog):
    """The check reads ``(input_nodes, pair_graph, ..., blocks)``; an item of another
    shape is logged and the pass goes on, every item as DGL gave it, nothing warned."""
    odd = [("not", "an edge item"), ("nor", "this")]
    source = DistLoaderSource(StandInDistLoader(odd, exclude="self"))
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="pingpong.forms._dgl_dist"):
        warnings.simplefilter("error")
        assert one_pass(source) == odd
        assert one_pass(source) == odd
    assert source.seed_edges_kept == -1  # checked, and could not tell
    assert caplog.text.count("could not check DGL's exclude='self'") == 1


def test_exclude_is_read_from_dgls_collator_only():
    assert requested_exclude(StandInDistLoader([], exclude="reverse_id")) == "reverse_id"
    assert requested_exclude(object()) is None

    class NodeCollator:
        exclude = "self"

        def collate(self, items: Any) -> Any:
            return items

    loader = StandInDistLoader([])
    loader.collate_fn = NodeCollator().collate
    assert requested_exclude(loader) is None


def test_seed_edges_are_counted_per_edge_type():
    pair = dgl.heterograph({("a", "r", "b"): (torch.tensor([0]), torch.tensor([0])),
                            ("b", "s", "a"): (torch.tensor([0]), torch.tensor([0]))})
    pair.edges["r"].data[dgl.EID] = torch.tensor([4])
    pair.edges["s"].data[dgl.EID] = torch.tensor([4])
    block = dgl.create_block({("a", "r", "b"): (torch.tensor([0, 1]), torch.tensor([0, 0])),
                              ("b", "s", "a"): (torch.tensor([0]), torch.tensor([0]))})
    block.edges["r"].data[dgl.EID] = torch.tensor([4, 5])
    block.edges["s"].data[dgl.EID] = torch.tensor([3])  # id 4 of type r, not of type s
    assert seed_edges_in_blocks((None, pair, [block])) == (1, 2)


def one_pass(source: DistLoaderSource) -> list[Any]:
    """A pass as pingpong's producer makes it: ``iter()`` once, then ``next()``."""
    iterator: Iterator[Any] = iter(source)
    items = []
    while True:
        try:
            items.append(next(iterator))
        except StopIteration:
            return items


class WithSamplerProcesses(StandInDistLoader):
    """DGL's loader with a sampler pool: ``num_pending`` batches on their way."""

    def __init__(self, pending: list[Any]) -> None:
        super().__init__([])
        self.pool = object()
        self.in_flight = list(pending)
        self.num_pending = len(pending)

    def _get_data_from_result_queue(self, timeout: float = 1800) -> Any:
        return self.in_flight.pop(0)


def test_batches_still_on_their_way_are_received_and_dropped_before_the_next_pass():
    loader = WithSamplerProcesses(["old 1", "old 2", "old 3"])
    source = DistLoaderSource(loader)
    assert one_pass(source) == []
    assert (loader.in_flight, loader.num_pending, source.dropped_batches) == ([], 0, 3)
    assert source.drop_abandoned_batches() == 0  # nothing left


def test_without_sampler_processes_or_dgls_attributes_nothing_is_drained(caplog):
    no_pool = StandInDistLoader([])
    no_pool.num_pending = 2  # type: ignore[attr-defined]
    assert DistLoaderSource(no_pool).drop_abandoned_batches() == 0
    unknown = StandInDistLoader([])
    unknown.pool = object()  # type: ignore[attr-defined]
    with caplog.at_level("WARNING", logger="pingpong.forms._dgl_dist"):
        assert DistLoaderSource(unknown).drop_abandoned_batches() == 0
    assert "has no num_pending" in caplog.text
