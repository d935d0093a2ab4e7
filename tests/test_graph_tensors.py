"""What of a moved graph the CUDA device marks with ``record_stream``
(``pingpong.devices.cuda._streams.parts_to_record``), checked on the CPU.

A tensor it misses is one the caching allocator may hand to the copy stream
while the training stream still reads it.  The stand-ins below are laid out as
GraphBolt's (DGL 2.1-2.4): ``MiniBatch.sampled_subgraphs`` is a list of
``SampledSubgraphImpl`` whose ``sampled_csc`` is a ``CSCFormatBase`` or, on a
heterogeneous graph, a dict of them by edge type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import pingpong.devices.cuda._streams as streams
from pingpong.devices.cuda._streams import MAX_LOOKED_INTO, parts_to_record


@dataclass
class CSCFormatBase:
    indptr: torch.Tensor
    indices: torch.Tensor


@dataclass
class SampledSubgraphImpl:
    sampled_csc: Any
    original_column_node_ids: Any = None
    original_row_node_ids: Any = None
    original_edge_ids: Any = None


@dataclass
class MiniBatch:
    seeds: Any = None
    input_nodes: Any = None
    labels: Any = None
    sampled_subgraphs: list[SampledSubgraphImpl] = field(default_factory=list)
    node_features: Any = None


class Slotted:
    __slots__ = ("__pair", "__weakref__", "unset")

    def __init__(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.__pair = pair

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__pair

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"__getattr__({name!r}) ran")


class Graph:
    """Stands in for a DGL graph: its own ``record_stream`` covers what it holds."""

    def __init__(self) -> None:
        self.recorded: list[Any] = []
        self.inner = _t(7)

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


def _t(n: int) -> torch.Tensor:
    return torch.arange(n)


def _ids(tensors: list[torch.Tensor]) -> set[int]:
    return {id(t) for t in tensors}


def test_every_tensor_of_a_heterogeneous_minibatch_is_found():
    """Found in a review of the CUDA path: the walk stopped at depth 4, so the
    per-edge-type CSC tensors of a heterogeneous MiniBatch were never marked."""
    want: list[torch.Tensor] = []

    def t(n: int) -> torch.Tensor:
        want.append(_t(n))
        return want[-1]

    layers = [
        SampledSubgraphImpl(
            sampled_csc={etype: CSCFormatBase(t(4), t(6)) for etype in
                         ("user:rates:item", "item:rev:user")},
            original_column_node_ids={"user": t(3), "item": t(2)},
            original_row_node_ids={"user": t(5), "item": t(4)},
            original_edge_ids={"user:rates:item": t(6)},
        )
        for _ in range(3)
    ]
    minibatch = MiniBatch(seeds={"user": t(3)}, input_nodes={"user": t(9), "item": t(7)},
                          sampled_subgraphs=layers)
    assert _ids(parts_to_record(minibatch, lambda tensor: True)) == _ids(want)
    assert len(want) == 30


def test_homogeneous_slots_pairs_cycles_and_the_filter():
    csc = CSCFormatBase(_t(4), _t(6))
    pair = Slotted((_t(2), _t(3)))
    layer = SampledSubgraphImpl(sampled_csc=csc, original_edge_ids=pair)
    minibatch = MiniBatch(seeds=_t(3), sampled_subgraphs=[layer, layer])
    layer.original_row_node_ids = minibatch  # a cycle ends, each object once
    found = parts_to_record(minibatch, lambda tensor: True)
    assert _ids(found) == _ids([minibatch.seeds, csc.indptr, csc.indices, *pair.pair])
    assert len(found) == 5
    assert _ids(parts_to_record(minibatch, lambda tensor: len(tensor) == 3)) == \
        _ids([minibatch.seeds, pair.pair[1]])


def test_objects_with_their_own_record_stream_are_marked_not_looked_into():
    graph = Graph()
    minibatch = MiniBatch(seeds=_t(3), sampled_subgraphs=[SampledSubgraphImpl(graph)])
    assert _ids(parts_to_record(minibatch, lambda tensor: True)) == \
        {id(minibatch.seeds), id(graph)}
    assert parts_to_record(graph, lambda tensor: True) == [graph]  # the top level too


def test_the_walk_is_bounded_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(streams, "_warned_bound", False)
    chain: Any = _t(1)
    for _ in range(MAX_LOOKED_INTO + 10):
        chain = [chain]
    with caplog.at_level("WARNING"):
        assert parts_to_record(chain, lambda tensor: True) == []  # deeper than the bound
    assert "not marked with record_stream" in caplog.text
    wide = [[_t(1)]] + [float(i) for i in range(3 * MAX_LOOKED_INTO)]  # leaves: not counted
    assert len(parts_to_record(wide, lambda tensor: True)) == 1
