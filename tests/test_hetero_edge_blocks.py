"""DGL graphs as EdgeBlocks and HeteroEdgeBlocks: the form batches take on a device
that a CPU-only DGL build (PyPI's) cannot put graphs on, such as a GPU.

The conversion is checked against DGL's own per-type edge lists; whole loaders run
on the fake asynchronous device with ``edge_blocks=True`` (it delivers graphs as on
such a GPU, with its copy and consumer streams), every batch's structure compared
with the batch it came from and its rows bit for bit, two epochs.  The CUDA case is
in ``tests/test_cuda.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import same_bits

import pingpong
from pingpong import EdgeBlock, HeteroEdgeBlock, PingPongLoader
from pingpong.devices.fake import FakeAsyncDevice

dgl = pytest.importorskip("dgl")

SIZES = {"paper": 300, "author": 120, "field": 10}
CITES, WRITES, WRITTEN_BY, HAS = (("paper", "cites", "paper"), ("author", "writes", "paper"),
                                  ("paper", "written_by", "author"), ("field", "has", "paper"))
FEATURES = {"paper": torch.arange(SIZES["paper"] * 6.0).reshape(-1, 6) / 7,
            "author": torch.arange(SIZES["author"] * 2, dtype=torch.int16).reshape(-1, 2)}
LABELS = {"paper": torch.arange(SIZES["paper"]) % 5}
HAS_LABELS = torch.arange(300, dtype=torch.float64) / 3  # one per ``has`` edge


def _heterograph() -> Any:
    gen = torch.Generator().manual_seed(4)
    counts = {CITES: 1500, WRITES: 600, WRITTEN_BY: 600, HAS: 300}
    return dgl.heterograph({
        etype: (torch.randint(0, SIZES[etype[0]], (m,), generator=gen),
                torch.randint(0, SIZES[etype[2]], (m,), generator=gen))
        for etype, m in counts.items()
    }, num_nodes_dict=SIZES)


def _same_structure(got: Any, want: Any) -> None:
    """``got`` is ``want`` (a DGL graph) as an EdgeBlock or HeteroEdgeBlock, on any device."""
    if isinstance(got, EdgeBlock):
        src, dst = want.edges()
        assert (got.num_src_nodes, got.num_dst_nodes) == (want.num_src_nodes(),
                                                          want.num_dst_nodes())
        assert torch.equal(got.src.cpu(), src)
        assert torch.equal(got.dst.cpu(), dst)
        assert got.src.dtype == got.dst.dtype == torch.int64
        return
    assert isinstance(got, HeteroEdgeBlock), type(got)
    assert got.canonical_etypes == [tuple(e) for e in want.canonical_etypes]
    assert got.num_src_nodes == {t: want.num_src_nodes(t) for t in want.srctypes}
    assert got.num_dst_nodes == {t: want.num_dst_nodes(t) for t in want.dsttypes}
    for etype, block in got.edges.items():
        src, dst = want.edges(etype=etype)
        assert torch.equal(block.src.cpu(), src), etype
        assert torch.equal(block.dst.cpu(), dst), etype
        assert (block.num_src_nodes, block.num_dst_nodes) == (
            want.num_src_nodes(etype[0]), want.num_dst_nodes(etype[2]))


# -- the conversion ------------------------------------------------------------------------
def test_heterogeneous_blocks_keep_every_edge_type_in_its_own_local_ids() -> None:
    source = dgl.dataloading.DataLoader(
        _heterograph(), {"paper": torch.arange(64)}, dgl.dataloading.NeighborSampler([3, 2]),
        batch_size=16)
    empty_types = 0
    for _, _, blocks in source:
        for block in blocks:
            converted = pingpong.as_hetero_edge_block(block)
            _same_structure(converted, block)
            empty_types += sum(b.num_edges == 0 for b in converted.edges.values())
            targets = {etype[2] for etype in converted.canonical_etypes}
            for ntype, n_dst in converted.num_dst_nodes.items():  # DGL's prefix convention
                if ntype in targets:  # (not kept by DGL for a type no edge points to)
                    assert torch.equal(block.srcdata[dgl.NID][ntype][:n_dst],
                                       block.dstdata[dgl.NID][ntype])
    assert empty_types > 0  # seeds only of papers: some types had no edges in a layer


def test_a_bipartite_block_and_a_homogeneous_graph() -> None:
    buys = ("user", "buys", "item")
    g = dgl.heterograph({buys: (torch.tensor([0, 1, 2, 2]), torch.tensor([1, 1, 0, 2]))})
    block = dgl.to_block(g, {"item": torch.tensor([1, 0])})
    converted = pingpong.as_hetero_edge_block(block)
    _same_structure(converted, block)
    assert converted.num_dst_nodes == {"item": 2, "user": 0}  # DGL keeps every type
    with pytest.raises(TypeError, match="as_hetero_edge_block"):
        pingpong.as_edge_block(block)

    plain = dgl.graph((torch.tensor([0, 2]), torch.tensor([1, 1])), num_nodes=3)
    one_type = pingpong.as_hetero_edge_block(plain)
    assert one_type.canonical_etypes == [("_N", "_E", "_N")]
    _same_structure(one_type, plain)
    with pytest.raises(TypeError, match="HeteroEdgeBlock or a DGL graph"):
        pingpong.as_hetero_edge_block(torch.zeros(2))


def test_to_moves_every_type_and_keeps_the_counts() -> None:
    """A graph, and a sampled block (whose source and destination counts differ: a
    ``to`` that mixed them up passed with the graph alone)."""
    graph = pingpong.as_hetero_edge_block(_heterograph())
    source = dgl.dataloading.DataLoader(
        _heterograph(), {"paper": torch.arange(16)}, dgl.dataloading.NeighborSampler([3]),
        batch_size=16)
    (_, _, (dgl_block,)), = list(source)
    block = pingpong.as_hetero_edge_block(dgl_block)
    assert block.num_src_nodes != block.num_dst_nodes
    assert graph.num_src_nodes == graph.num_dst_nodes == SIZES
    for original in (graph, block):
        moved = original.to("meta")
        assert moved.device.type == "meta"
        assert original.device.type == "cpu"
        assert all(b.src.device.type == b.dst.device.type == "meta"
                   for b in moved.edges.values())
        assert moved.num_src_nodes == original.num_src_nodes
        assert moved.num_dst_nodes == original.num_dst_nodes
        assert moved.canonical_etypes == original.canonical_etypes
        for etype, edges in moved.edges.items():
            kept = original.edges[etype]
            assert (edges.num_edges, edges.num_src_nodes, edges.num_dst_nodes) == (
                kept.num_edges, kept.num_src_nodes, kept.num_dst_nodes), etype
        back = original.to("cpu")  # moved where it is: the same values
        _same_structure(back, dgl_block if original is block else _heterograph())


# -- whole loaders, delivered as on a GPU with a CPU-only DGL ---------------------------------
def _rows_where_the_model_reads(device: FakeAsyncDevice, got: torch.Tensor,
                                want: torch.Tensor) -> None:
    assert device.consumer_submit(lambda: same_bits(got, want)).result()


@pytest.mark.parametrize("heterogeneous", [True, False], ids=["heterograph", "homogeneous"])
def test_node_classification_blocks_arrive_as_edge_blocks(heterogeneous: bool) -> None:
    seeds: Any
    features: Any
    labels: Any
    if heterogeneous:
        graph, seeds, features, labels = _heterograph(), {"paper": torch.arange(90)}, \
            FEATURES, LABELS
    else:
        graph = dgl.to_homogeneous(_heterograph())
        seeds, features, labels = torch.arange(90), torch.randn(graph.num_nodes(), 5), None
    source = dgl.dataloading.DataLoader(graph, seeds, dgl.dataloading.NeighborSampler([3, 2]),
                                        batch_size=32, shuffle=True)
    items = list(source)  # sampled once: the reference every delivered batch came from
    device = FakeAsyncDevice(seed=2, edge_blocks=True)
    with PingPongLoader(items, features, labels, device=device,
                        heterogeneous=heterogeneous) as loader:
        for _ in range(2):
            delivered = 0
            for batch, (input_nodes, output_nodes, blocks) in zip(loader, items, strict=True):
                assert len(batch.blocks) == len(blocks) == 2
                for got, want in zip(batch.blocks, blocks, strict=True):
                    assert type(got) is (HeteroEdgeBlock if heterogeneous else EdgeBlock)
                    _same_structure(got, want)
                if heterogeneous:
                    for ntype, table in features.items():
                        _rows_where_the_model_reads(device, batch.x[ntype],
                                                    table[input_nodes[ntype]])
                    _rows_where_the_model_reads(device, batch.y["paper"],
                                                labels["paper"][output_nodes["paper"]])
                else:
                    _rows_where_the_model_reads(device, batch.x, features[input_nodes])
                delivered += 1
            assert delivered == len(items) == 3


def test_link_prediction_pair_graphs_arrive_as_hetero_edge_blocks() -> None:
    """Negatives and edge labels by edge type: the pair graphs become HeteroEdgeBlocks,
    the labels are still gathered at the pair graph's own edge ids."""
    source = dgl.dataloading.DataLoader(
        _heterograph(), {"has": torch.arange(0, 300, 2), "cites": torch.arange(100)},
        dgl.dataloading.as_edge_prediction_sampler(
            dgl.dataloading.NeighborSampler([2, 2]),
            negative_sampler=dgl.dataloading.negative_sampler.Uniform(2)),
        batch_size=50, shuffle=True)
    items = list(source)
    device = FakeAsyncDevice(seed=3, edge_blocks=True)
    with PingPongLoader(items, FEATURES, edge_labels={"has": HAS_LABELS}, device=device,
                        heterogeneous=True) as loader:
        for _ in range(2):
            pairs = 0
            for batch, item in zip(loader, items, strict=True):
                input_nodes, pair_graph, neg_pair_graph, blocks = item
                assert type(batch) is pingpong.NegativeEdgeBatch
                _same_structure(batch.pair_graph, pair_graph)
                _same_structure(batch.neg_pair_graph, neg_pair_graph)
                for got, want in zip(batch.blocks, blocks, strict=True):
                    _same_structure(got, want)
                has_ids = pair_graph.edata[dgl.EID][HAS]
                assert isinstance(batch.y, dict)
                assert isinstance(batch.x, dict)
                _rows_where_the_model_reads(device, batch.y["has"], HAS_LABELS[has_ids])
                for ntype, table in FEATURES.items():
                    _rows_where_the_model_reads(device, batch.x[ntype],
                                                table[input_nodes[ntype]])
                pairs += batch.pair_graph.edges[HAS].num_edges
            assert pairs == 150  # every seed ``has`` edge once per epoch
