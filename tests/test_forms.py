"""Every kind of DGL loader through pingpong (the batch-form layer, ``pingpong.forms``).

Each delivered batch is compared bit for bit with the synchronous reference
computed from the ids the batch itself carries (``features[input_nodes]``,
``edge_labels[pair_graph.edata[dgl.EID]]``, ``features[subgraph.ndata[dgl.NID]]``
...), over two epochs; where a sampler covers its seeds once per epoch, that is
checked too.  On the fake asynchronous device the reads run on its consumer
stream, after the ready wait and before the release.  Runs in both DGL
environments (DGL 1.1.3 and 2.1.0); the GraphBolt cases need DGL 2.x.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from test_reliability import fake
from test_usage_patterns import CountingCPUDevice

import pingpong
from pingpong import PingPongLoader
from pingpong.devices.fake import FakeAsyncDevice, tensor_digest

dgl = pytest.importorskip("dgl")

NUM_NODES = 300
NUM_EDGES = 3000
DEVICE_KINDS = ["cpu", "fake"]


def _graph() -> Any:
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, NUM_NODES, (NUM_EDGES,), generator=gen)
    dst = torch.randint(0, NUM_NODES, (NUM_EDGES,), generator=gen)
    return dgl.graph((src, dst), num_nodes=NUM_NODES)


FEATURES = (torch.arange(NUM_NODES * 6, dtype=torch.float32).reshape(NUM_NODES, 6) / 7)
LABELS = torch.arange(NUM_NODES) % 5
EDGE_LABELS = (torch.arange(NUM_EDGES) * 7) % 3


def _device(kind: str) -> Any:
    return fake(seed=5) if kind == "fake" else "cpu"


class Checker:
    """Compares ``got`` with ``want`` where the model would read it.

    On the fake device the comparison is queued on the consumer stream (it
    runs after the ready wait, before the release); elsewhere it runs now.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.pending: list[Any] = []
        self.checked = 0

    def equal(self, got: Any, want: torch.Tensor | None) -> None:
        expected = tensor_digest(want)
        if isinstance(self.device, FakeAsyncDevice):
            self.pending.append((self.device.consumer_submit(lambda: tensor_digest(got)),
                                 expected))
        else:
            assert tensor_digest(got) == expected
            self.checked += 1

    def resolve(self) -> None:
        for future, expected in self.pending:
            assert future.result() == expected
            self.checked += 1
        self.pending.clear()


def _epochs(loader: PingPongLoader, check: Callable[[Any], Any], epochs: int = 2) -> list[Any]:
    """``check(batch)`` for every batch of ``epochs`` epochs; their results per epoch."""
    return [[check(batch) for batch in loader] for _ in range(epochs)]


# -- edge prediction --------------------------------------------------------------------
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("negatives", [True, False], ids=["negatives", "no-negatives"])
def test_edge_prediction_with_edge_labels(device_kind, negatives):
    g = _graph()
    sampler = dgl.dataloading.NeighborSampler([3, 3])
    negative = dgl.dataloading.negative_sampler.Uniform(2) if negatives else None
    seeds = torch.arange(0, NUM_EDGES, 3)
    source = dgl.dataloading.DataLoader(
        g, seeds, dgl.dataloading.as_edge_prediction_sampler(sampler, negative_sampler=negative),
        batch_size=128, shuffle=True,
    )
    device = _device(device_kind)
    checker = Checker(device)
    want_type = pingpong.NegativeEdgeBatch if negatives else pingpong.EdgeBatch

    def check(batch: Any) -> torch.Tensor:
        assert type(batch) is want_type
        if isinstance(batch, pingpong.NegativeEdgeBatch):
            input_nodes, pair_graph, neg_pair_graph, blocks, x, y = batch
            assert neg_pair_graph.num_edges() == 2 * pair_graph.num_edges()
        else:
            assert isinstance(batch, pingpong.EdgeBatch)
            input_nodes, pair_graph, blocks, x, y = batch
        assert len(blocks) == 2
        edge_ids = pair_graph.edata[dgl.EID]
        checker.equal(x, FEATURES[input_nodes])
        checker.equal(y, EDGE_LABELS[edge_ids])
        return edge_ids

    with PingPongLoader(source, FEATURES, edge_labels=EDGE_LABELS, device=device) as loader:
        per_epoch = _epochs(loader, check)
        checker.resolve()
    for edge_ids in per_epoch:  # every seed edge exactly once per epoch
        assert torch.equal(torch.cat(edge_ids).sort().values, seeds)
    assert checker.checked == 2 * sum(len(ids) for ids in per_epoch)


def test_edge_prediction_without_labels_has_y_none():
    g = _graph()
    sampler = dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2]))
    source = dgl.dataloading.DataLoader(g, torch.arange(200), sampler, batch_size=50)
    with PingPongLoader(source, FEATURES) as loader:
        for batch in loader:
            assert batch.y is None
            assert torch.equal(batch.x, FEATURES[batch.input_nodes])


def test_heterogeneous_edge_prediction():
    gen = torch.Generator().manual_seed(1)
    users, items = 60, 40
    clicks = (torch.randint(0, users, (400,), generator=gen),
              torch.randint(0, items, (400,), generator=gen))
    g = dgl.heterograph({
        ("user", "clicks", "item"): clicks,
        ("item", "clicked-by", "user"): (clicks[1], clicks[0]),
    })
    features = {"user": torch.randn(users, 4), "item": torch.randn(items, 3)}
    sampler = dgl.dataloading.as_edge_prediction_sampler(
        dgl.dataloading.NeighborSampler([3]),
        negative_sampler=dgl.dataloading.negative_sampler.Uniform(1),
    )
    source = dgl.dataloading.DataLoader(
        g, {"clicks": torch.arange(400)}, sampler, batch_size=64, shuffle=True)
    with PingPongLoader(source, features, heterogeneous=True) as loader:
        for _ in range(2):
            seen = []
            for batch in loader:
                assert isinstance(batch, pingpong.NegativeEdgeBatch)
                assert isinstance(batch.x, dict)
                for ntype, table in features.items():
                    assert torch.equal(batch.x[ntype], table[batch.input_nodes[ntype]])
                seen.append(batch.pair_graph.edges[("user", "clicks", "item")].data[dgl.EID])
            assert torch.equal(torch.cat(seen).sort().values, torch.arange(400))


# -- node classification: every block sampler --------------------------------------------
NODE_SAMPLERS: dict[str, Callable[[], Any]] = {
    "neighbor": lambda: dgl.dataloading.NeighborSampler([4, 3]),
    "full": lambda: dgl.dataloading.MultiLayerFullNeighborSampler(2),
    "labor": lambda: dgl.dataloading.LaborSampler([4, 3]),
}
AUTHOR_FEATURES = torch.arange(40 * 3, dtype=torch.float64).reshape(40, 3) / 9


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("sampler", sorted(NODE_SAMPLERS))
@pytest.mark.parametrize("heterogeneous", [False, True], ids=["homogeneous", "heterograph"])
def test_block_samplers_give_triples_whose_rows_are_the_reference(device_kind, sampler,
                                                                  heterogeneous):
    """The README's first row: NeighborSampler, MultiLayerFullNeighborSampler and
    LaborSampler, on a graph and a heterograph; the blocks are the sampler's own
    (their node ids are the batch's), every seed once per epoch."""
    g = _hetero_graph() if heterogeneous else _graph()
    seeds = torch.arange(1, NUM_NODES, 3)
    source = dgl.dataloading.DataLoader(g, {"paper": seeds} if heterogeneous else seeds,
                                        NODE_SAMPLERS[sampler](), batch_size=40, shuffle=True)
    features: Any = ({"paper": FEATURES, "author": AUTHOR_FEATURES} if heterogeneous
                     else FEATURES)
    labels: Any = {"paper": LABELS} if heterogeneous else LABELS
    device = _device(device_kind)
    checker = Checker(device)

    def check(batch: Any) -> torch.Tensor:
        assert type(batch) is pingpong.Batch
        input_nodes, output_nodes, blocks = batch.input_nodes, batch.output_nodes, batch.blocks
        x: Any = batch.x
        y: Any = batch.y
        assert len(blocks) == 2
        if heterogeneous:
            for ntype, table in features.items():
                assert torch.equal(blocks[0].srcnodes[ntype].data[dgl.NID], input_nodes[ntype])
                checker.equal(x[ntype], table[input_nodes[ntype]])
            assert torch.equal(blocks[-1].dstnodes["paper"].data[dgl.NID],
                               output_nodes["paper"])
            checker.equal(y["paper"], LABELS[output_nodes["paper"]])
            return output_nodes["paper"]
        assert torch.equal(blocks[0].srcdata[dgl.NID], input_nodes)
        assert torch.equal(blocks[-1].dstdata[dgl.NID], output_nodes)
        checker.equal(x, FEATURES[input_nodes])
        checker.equal(y, LABELS[output_nodes])
        return output_nodes

    with PingPongLoader(source, features, labels, device=device,
                        heterogeneous=heterogeneous) as loader:
        per_epoch = _epochs(loader, check)
        checker.resolve()
    assert checker.checked == sum(map(len, per_epoch)) * (3 if heterogeneous else 2)
    for outputs in per_epoch:
        assert torch.equal(torch.cat(outputs).sort().values, seeds)


# -- subgraph samplers -------------------------------------------------------------------
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_shadow_items_gather_at_input_and_output_nodes(device_kind):
    g = _graph()
    seeds = torch.arange(0, NUM_NODES, 2)
    source = dgl.dataloading.DataLoader(
        g, seeds, dgl.dataloading.ShaDowKHopSampler([3, 2]), batch_size=32, shuffle=True)
    device = _device(device_kind)
    checker = Checker(device)

    def check(batch: Any) -> torch.Tensor:
        assert type(batch) is pingpong.Batch
        input_nodes, output_nodes, subgraph, x, y = batch
        assert torch.equal(subgraph.ndata[dgl.NID], input_nodes)
        checker.equal(x, FEATURES[input_nodes])
        checker.equal(y, LABELS[output_nodes])
        return output_nodes

    with PingPongLoader(source, FEATURES, LABELS, device=device) as loader:
        per_epoch = _epochs(loader, check)
        checker.resolve()
    for outputs in per_epoch:
        assert torch.equal(torch.cat(outputs).sort().values, seeds)


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
# DGL's METIS partitioning leaves /proc/self/status open (dgl/partition.py, get_peak_mem)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_cluster_gcn_subgraphs_cover_every_node_once_per_epoch(device_kind, tmp_path):
    g = _graph()
    sampler = dgl.dataloading.ClusterGCNSampler(g, 12, cache_path=str(tmp_path / "parts.pkl"))
    source = dgl.dataloading.DataLoader(g, torch.arange(12), sampler, batch_size=3,
                                        shuffle=True)
    device = _device(device_kind)
    checker = Checker(device)

    def check(batch: Any) -> torch.Tensor:
        assert type(batch) is pingpong.SubgraphBatch
        subgraph, x, y = batch
        node_ids = subgraph.ndata[dgl.NID]
        checker.equal(x, FEATURES[node_ids])
        checker.equal(y, LABELS[node_ids])
        return node_ids

    with PingPongLoader(source, FEATURES, LABELS, device=device) as loader:
        per_epoch = _epochs(loader, check)
        checker.resolve()
    assert len(per_epoch[0]) == 4
    for node_ids in per_epoch:  # partitions are disjoint and cover the graph
        assert torch.equal(torch.cat(node_ids).sort().values, torch.arange(NUM_NODES))


def test_saint_subgraphs():
    g = _graph()
    source = dgl.dataloading.DataLoader(
        g, torch.arange(6), dgl.dataloading.SAINTSampler("node", 80), batch_size=1)
    with PingPongLoader(source, {"a": FEATURES, "b": FEATURES[:, :2].contiguous()},
                        LABELS) as loader:
        for batch in loader:
            node_ids = batch.subgraph.ndata[dgl.NID]
            assert torch.equal(batch.x["a"], FEATURES[node_ids])
            assert torch.equal(batch.x["b"], FEATURES[node_ids, :2])
            assert torch.equal(batch.y, LABELS[node_ids])
        assert loader.stats["batches"] == 6


# -- a form of the user's own ---------------------------------------------------------------
def test_custom_form_callable():
    items = [{"nodes": torch.arange(i, i + 20), "seeds": torch.arange(i, i + 4)}
             for i in range(0, 100, 10)]
    with PingPongLoader(items, FEATURES, LABELS,
                        form=lambda item: (item["nodes"], item["seeds"])) as loader:
        for batch, item in zip(loader, items, strict=True):
            assert type(batch) is pingpong.CustomBatch
            got_item, x, y = batch
            assert isinstance(x, torch.Tensor)
            assert isinstance(y, torch.Tensor)
            assert got_item is item
            assert torch.equal(x, FEATURES[item["nodes"]])
            assert torch.equal(y, LABELS[item["seeds"]])
            kept = batch.clone()
            assert type(kept) is pingpong.CustomBatch
            assert isinstance(kept.x, torch.Tensor)
            assert torch.equal(kept.x, x)


class ItemProblem(ValueError):
    """A user's own exception, raised by a user's own form callable."""


def test_an_exception_of_the_form_callable_reaches_the_loop_unchanged():
    """The callable's own errors are the user's, like the sampler's: not rewritten into
    BatchFormError (a TypeError, which ``except ValueError`` would miss), and the next
    epoch works."""
    items = [{"nodes": torch.arange(i, i + 20), "seeds": torch.arange(i, i + 4)}
             for i in range(0, 40, 10)]
    problem = ItemProblem("item 2 has no seeds")
    fail = [True]

    def form(item: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if fail[0] and int(item["nodes"][0]) == 20:
            raise problem
        return item["nodes"], item["seeds"]

    device = CountingCPUDevice()
    with PingPongLoader(items, FEATURES, LABELS, device=device, form=form) as loader:
        delivered = []
        with pytest.raises(ItemProblem) as info:
            for batch in loader:
                delivered.append(batch.clone())
        assert info.value is problem
        assert not isinstance(info.value, pingpong.BatchFormError)
        assert len(delivered) == 2
        fail[0] = False
        again = [batch.clone() for batch in loader]
    assert [torch.equal(b.x, FEATURES[item["nodes"]]) for b, item in zip(again, items, strict=True)
            ] == [True] * 4


def test_a_form_may_return_any_pair_that_unpacks():
    """A (2, n) tensor (``torch.stack([feature_ids, label_ids])``) unpacks into its two
    rows, as it always did: only a dict or a DGL graph is refused before unpacking."""
    items = [torch.arange(i, i + 6) for i in range(0, 30, 6)]
    def stacked(ids: torch.Tensor) -> Any:  # typed a tuple at the API; unpacking is the rule
        return torch.stack([ids, ids.flip(0)])

    with PingPongLoader(items, FEATURES, LABELS, form=stacked) as loader:
        for batch, ids in zip(loader, items, strict=True):
            assert torch.equal(batch.x, FEATURES[ids])
            assert torch.equal(batch.y, LABELS[ids.flip(0)])


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("heterogeneous", [False, True], ids=["homogeneous", "heterogeneous"])
def test_a_form_may_give_no_label_ids_for_some_items(device_kind, heterogeneous):
    """``(feature ids, None)``: that batch has no labels (``y`` None), the others do."""
    items = [{"nodes": torch.arange(i, i + 20),
              "seeds": torch.arange(i, i + 4) if i % 20 else None}  # every other item
             for i in range(0, 100, 10)]

    def typed(ids: torch.Tensor | None) -> Any:
        return {"n": ids} if heterogeneous and ids is not None else ids

    features: Any = {"n": FEATURES} if heterogeneous else FEATURES
    labels: Any = {"n": LABELS} if heterogeneous else LABELS
    device = _device(device_kind)
    checker = Checker(device)
    with PingPongLoader(items, features, labels, device=device, heterogeneous=heterogeneous,
                        form=lambda item: (typed(item["nodes"]), typed(item["seeds"]))) as loader:
        for _ in range(2):
            labelled = 0
            for batch, item in zip(loader, items, strict=True):
                x = batch.x["n"] if heterogeneous else batch.x
                checker.equal(x, FEATURES[item["nodes"]])
                if item["seeds"] is None:
                    assert batch.y is None
                else:
                    y = batch.y["n"] if heterogeneous else batch.y
                    checker.equal(y, LABELS[item["seeds"]])
                    labelled += 1
            checker.resolve()
            assert labelled == 5
        # two epochs of ten 20-row feature batches and five 4-row label batches
        assert loader.stats["bytes_gathered"] == 2 * (
            10 * 20 * FEATURES[0].numel() * FEATURES.element_size()
            + 5 * 4 * LABELS.element_size())


def test_a_form_giving_node_label_ids_for_some_node_types_only():
    """Heterogeneous node labels through form=: label ids keyed by node type, one of the
    two types left out -- it gets no rows, as for a DGL item (they are node types,
    not edge label keys to be matched by edge type)."""
    features = {"paper": FEATURES, "author": torch.arange(40.0).reshape(20, 2)}
    labels = {"paper": LABELS, "author": torch.arange(20) * 3}
    items = [torch.arange(i, i + 6) for i in range(0, 18, 6)]
    with PingPongLoader(items, features, labels, heterogeneous=True,
                        form=lambda ids: ({"paper": ids, "author": ids}, {"paper": ids})
                        ) as loader:
        for batch, ids in zip(loader, items, strict=True):
            assert isinstance(batch.x, dict)
            assert isinstance(batch.y, dict)
            assert torch.equal(batch.x["author"], features["author"][ids])
            assert torch.equal(batch.y["paper"], LABELS[ids])
            assert batch.y["author"].shape == (0,)


def test_blocks_keep_their_container():
    """A node triple's blocks come back in the container the source gave: a tuple as
    a tuple, a list as a list, one graph as that graph -- each block the source's
    own, bit for bit (a tuple came back as a list would break ``a, b = blocks``
    only for some models; ``blocks == (b0, b1)``-style checks for all)."""
    base = list(_node_source())
    for wrap in (tuple, list, lambda blocks: blocks[0]):
        items = [(i, o, wrap(b)) for i, o, b in base]
        with PingPongLoader(items, FEATURES, LABELS) as loader:
            for batch, (inputs, outputs, blocks) in zip(loader, items, strict=True):
                assert type(batch.blocks) is type(blocks)
                assert torch.equal(batch.x, FEATURES[inputs])
                assert torch.equal(batch.y, LABELS[outputs])
                got = batch.blocks if isinstance(blocks, tuple | list) else [batch.blocks]
                want = blocks if isinstance(blocks, tuple | list) else [blocks]
                assert len(got) == len(want)
                for a, b in zip(got, want, strict=True):
                    assert all(torch.equal(x, y) for x, y in zip(a.edges(), b.edges(),
                                                                 strict=True))
                    assert torch.equal(a.srcdata[dgl.NID], b.srcdata[dgl.NID])


def _is_edge_block_of(got: Any, graph: Any) -> bool:
    """``got`` is the homogeneous DGL ``graph`` as an EdgeBlock: same edges, same counts."""
    src, dst = graph.edges()
    return (type(got) is pingpong.EdgeBlock and torch.equal(got.src, src)
            and torch.equal(got.dst, dst)
            and (got.num_src_nodes, got.num_dst_nodes)
            == (graph.num_src_nodes(), graph.num_dst_nodes()))


def _all_equal(*pairs: tuple[Any, torch.Tensor]) -> bool:
    return all(torch.equal(got, want) for got, want in pairs)


def test_subgraphs_and_pair_graphs_arrive_in_the_devices_form():
    """On a device that takes no DGL graphs (the fake one with ``edge_blocks=True``,
    standing in for a GPU with a CPU-only DGL) a subgraph and a pair graph without
    negatives arrive as the EdgeBlocks the device got, not as the source's own CPU
    graphs (the NegativeEdgeBatch and the blocks: test_hetero_edge_blocks.py)."""
    graph = _graph()
    graph.ndata[dgl.NID] = torch.arange(NUM_NODES)
    subgraphs = [dgl.node_subgraph(graph, torch.arange(i, NUM_NODES, 3)) for i in range(3)]
    pairs = list(_edge_source())
    device = FakeAsyncDevice(seed=4, edge_blocks=True)
    with PingPongLoader(subgraphs, FEATURES, LABELS, device=device) as loader:
        for batch, subgraph in zip(loader, subgraphs, strict=True):
            assert _is_edge_block_of(batch.subgraph, subgraph)
            ids = subgraph.ndata[dgl.NID]
            assert device.consumer_submit(functools.partial(
                _all_equal, (batch.x, FEATURES[ids]), (batch.y, LABELS[ids]))).result()
    device = FakeAsyncDevice(seed=4, edge_blocks=True)
    with PingPongLoader(pairs, FEATURES, edge_labels=EDGE_LABELS, device=device) as loader:
        for batch, (input_nodes, pair_graph, blocks) in zip(loader, pairs, strict=True):
            assert type(batch) is pingpong.EdgeBatch
            assert _is_edge_block_of(batch.pair_graph, pair_graph)
            assert all(_is_edge_block_of(b, w) for b, w in zip(batch.blocks, blocks,
                                                                strict=True))
            edge_ids = pair_graph.edata[dgl.EID]
            assert device.consumer_submit(functools.partial(
                _all_equal, (batch.x, FEATURES[input_nodes]),
                (batch.y, EDGE_LABELS[edge_ids]))).result()


# -- refusals: before any row is read -------------------------------------------------------
def _edge_source(**kwargs: Any) -> Any:
    sampler = dgl.dataloading.as_edge_prediction_sampler(
        dgl.dataloading.NeighborSampler([2]), **kwargs)
    return dgl.dataloading.DataLoader(_graph(), torch.arange(64), sampler, batch_size=32)


def _node_source() -> Any:
    return dgl.dataloading.DataLoader(
        _graph(), torch.arange(64), dgl.dataloading.NeighborSampler([2]), batch_size=32)


@pytest.mark.parametrize(
    ("make_source", "kwargs", "needle"),
    [
        # lists: a DGL DataLoader's seed kind is known when the loader is built (below)
        (lambda: list(_edge_source()), {"labels": LABELS},
         "labels=, but an edge-prediction item has no seed nodes .* go in edge_labels="),
        (lambda: list(_node_source()), {"edge_labels": EDGE_LABELS},
         "edge_labels=, but a node-classification"),
        (lambda: [dgl.graph(([0, 1], [1, 2]))], {}, r"no ndata\[dgl.NID\]"),
        (lambda: [(torch.arange(3), torch.arange(3), [], "extra", "fields")], {},
         "tuple of length 5"),
        (lambda: [{"nodes": torch.arange(3)}], {"form": lambda item: item["nodes"]},
         "form= must return"),
        # a DGL graph unpacks by edge type (DGL's own error); a dict of two into its keys
        (lambda: [dgl.graph(([0, 1], [1, 2]))], {"form": lambda graph: graph},
         r"form= must return a pair .* it returned a dgl\.heterograph\.DGLGraph"),
        (lambda: [{"nodes": torch.arange(3)}],
         {"form": lambda item: {"paper": item["nodes"], "author": item["nodes"]}},
         r"form= must return a pair .* it returned a builtins\.dict"),
        # four fields whose third is no negative graph: not read as negative sampling
        (lambda: [(lambda item: (item[0], item[1], "negatives", item[2]))(
            next(iter(_edge_source())))], {}, "tuple of length 4"),
    ],
    ids=["node-labels-edge-item", "edge-labels-node-item", "graph-without-nid",
         "five-fields", "bad-form-callable", "form-returns-a-graph", "form-returns-a-dict",
         "four-fields-no-negative-graph"],
)
def test_refusals_name_the_problem_before_any_row_is_read(make_source, kwargs, needle):
    device = CountingCPUDevice()
    with PingPongLoader(make_source(), FEATURES, device=device, **kwargs) as loader:
        with pytest.raises(pingpong.BatchFormError, match=needle) as info:
            next(iter(loader))
    assert isinstance(info.value, TypeError)
    assert device.gathers == 0


@pytest.mark.parametrize(
    ("make_source", "kwargs", "needle"),
    [(_edge_source, {"labels": LABELS}, r"seeds are edges .* go in edge_labels="),
     (_node_source, {"edge_labels": EDGE_LABELS}, r"seeds are nodes.* go in labels=")],
    ids=["node-labels-edge-seeds", "edge-labels-node-seeds"],
)
def test_labels_of_the_wrong_kind_for_a_dgl_loader_are_refused_when_built(make_source, kwargs,
                                                                          needle):
    """The DGL DataLoader's sampler says what its seeds are: node labels over an edge
    prediction sampler (or edge labels over a node sampler) would fail every batch."""
    with pytest.raises(pingpong.ConfigError, match=needle):
        PingPongLoader(make_source(), FEATURES, **kwargs)
    # with form= the form says what is gathered: not refused when built
    with PingPongLoader(make_source(), FEATURES, form=lambda item: (item[0], None),
                        **kwargs):
        pass


def test_a_pair_graph_without_edge_ids_of_a_labelled_type_is_a_batch_form_error():
    """A hand-built pair graph with dgl.EID on one edge type only (found by review:
    a KeyError, not a pingpong error)."""
    pair = dgl.heterograph({RATES: ([0, 1], [1, 0]), FOLLOWS: ([0], [1])},
                           num_nodes_dict={"user": USERS, "item": ITEMS})
    pair.edges[RATES].data[dgl.EID] = torch.tensor([3, 4])
    items: list[Any] = [({"user": torch.arange(2), "item": torch.arange(2)}, pair, [])]
    device = CountingCPUDevice()
    with PingPongLoader(items, TYPED_FEATURES, edge_labels={"follows": FOLLOW_WEIGHTS},
                        heterogeneous=True, device=device) as loader:
        with pytest.raises(pingpong.BatchFormError, match=r"no edge ids of type .*follows"):
            next(iter(loader))
    assert device.gathers == 0


def test_bad_edge_ids_are_refused_before_any_row_is_read():
    source = list(_edge_source())  # no graph to check the table against when built
    device = CountingCPUDevice()
    short = EDGE_LABELS[:10].contiguous()  # pair graphs carry edge ids far beyond 10
    with PingPongLoader(source, FEATURES, edge_labels=short, device=device) as loader:
        with pytest.raises(pingpong.IdRangeError, match=r"pair_graph.edata\[dgl.EID\]"):
            next(iter(loader))
    assert device.gathers == 0


def _two_edge_type_source() -> tuple[Any, tuple[str, str, str]]:
    """Edge prediction on one node type with two edge types (cites, cited-by)."""
    g = _graph()
    src, dst = g.edges()
    cites = ("paper", "cites", "paper")
    graph = dgl.heterograph({cites: (src, dst), ("paper", "cited-by", "paper"): (dst, src)},
                            num_nodes_dict={"paper": NUM_NODES})
    sampler = dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2]))
    return dgl.dataloading.DataLoader(graph, {"cites": torch.arange(64)}, sampler,
                                      batch_size=32), cites


@pytest.mark.parametrize("where", ["built", "read"])
def test_one_edge_label_table_on_several_edge_types_is_refused_naming_them(where):
    """The pair graph's edge ids are a dict by edge type: one edge_labels= table is
    refused naming the types and the dict that works -- when the loader is built
    over DGL's DataLoader (it knows its graph), else before any row is read."""
    source, _ = _two_edge_type_source()
    needle = r"several edge types .*'cites'.*edge_labels as a dict"
    if where == "built":
        with pytest.raises(pingpong.TableError, match=needle):
            PingPongLoader(source, FEATURES, edge_labels=EDGE_LABELS)
        return
    device = CountingCPUDevice()
    with PingPongLoader(list(source), FEATURES, edge_labels=EDGE_LABELS,
                        device=device) as loader:
        with pytest.raises(pingpong.BatchFormError, match=needle):
            next(iter(loader))
    assert device.gathers == 0


# -- edge labels per edge type ----------------------------------------------------------
RATES, FOLLOWS, RATED_BY = ("user", "rates", "item"), ("user", "follows", "user"), \
    ("item", "rated-by", "user")
USERS, ITEMS = 50, 80
TYPED_EDGES = {RATES: 600, RATED_BY: 300, FOLLOWS: 200}


def _rating_graph() -> Any:
    """Users rate items and follow users: two node types, three edge types."""
    gen = torch.Generator().manual_seed(3)
    sizes = {"user": USERS, "item": ITEMS}
    return dgl.heterograph({
        etype: (torch.randint(0, sizes[etype[0]], (count,), generator=gen),
                torch.randint(0, sizes[etype[2]], (count,), generator=gen))
        for etype, count in TYPED_EDGES.items()
    }, num_nodes_dict=sizes)


TYPED_FEATURES = {"user": torch.arange(USERS * 4.0).reshape(USERS, 4) / 3,
                  "item": torch.arange(ITEMS * 3, dtype=torch.float64).reshape(ITEMS, 3)}
RATINGS = (torch.arange(TYPED_EDGES[RATES]) * 5) % 7  # one rating per rates edge
FOLLOW_WEIGHTS = torch.arange(TYPED_EDGES[FOLLOWS] * 2, dtype=torch.float16).reshape(-1, 2)


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("negatives", [True, False], ids=["negatives", "no-negatives"])
def test_edge_labels_per_edge_type_on_a_heterograph(device_kind, negatives):
    """A user-item rating task: edge_labels={edge type: table} (a name and a canonical
    triple as keys), heterogeneous=True; y[key] is that type's labels at that type's
    edge ids, bit for bit, two epochs, every seed edge once per epoch."""
    seeds = {"rates": torch.arange(0, TYPED_EDGES[RATES], 2), "follows": torch.arange(90)}
    negative = dgl.dataloading.negative_sampler.Uniform(1) if negatives else None
    source = dgl.dataloading.DataLoader(
        _rating_graph(), seeds,
        dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([3, 3]),
                                                   negative_sampler=negative),
        batch_size=40, shuffle=True)
    edge_labels = {"rates": RATINGS, FOLLOWS: FOLLOW_WEIGHTS}
    device = _device(device_kind)
    checker = Checker(device)

    def check(batch: Any) -> dict[Any, torch.Tensor]:
        assert type(batch) is (pingpong.NegativeEdgeBatch if negatives else pingpong.EdgeBatch)
        edge_ids = batch.pair_graph.edata[dgl.EID]
        assert isinstance(batch.y, dict)
        assert set(batch.y) == {"rates", FOLLOWS}  # the keys as the loader was given them
        checker.equal(batch.y["rates"], RATINGS[edge_ids[RATES]])
        checker.equal(batch.y[FOLLOWS], FOLLOW_WEIGHTS[edge_ids[FOLLOWS]])
        assert isinstance(batch.x, dict)
        for ntype, table in TYPED_FEATURES.items():
            checker.equal(batch.x[ntype], table[batch.input_nodes[ntype]])
        return {etype: edge_ids[etype] for etype in (RATES, FOLLOWS)}

    with PingPongLoader(source, TYPED_FEATURES, edge_labels=edge_labels, device=device,
                        heterogeneous=True) as loader:
        per_epoch = _epochs(loader, check)
        checker.resolve()
    for batches in per_epoch:
        for etype, name in ((RATES, "rates"), (FOLLOWS, "follows")):
            got = torch.cat([ids[etype] for ids in batches]).sort().values
            assert torch.equal(got, seeds[name])
    assert checker.checked == 4 * sum(len(batches) for batches in per_epoch)  # 4 tables


def test_edge_labels_per_edge_type_on_a_graph_of_one_node_type():
    """One node type, two edge types: features stay one tensor (no heterogeneous=True),
    and only the edge types with a table are gathered."""
    source, cites = _two_edge_type_source()
    with PingPongLoader(source, FEATURES, edge_labels={"cites": EDGE_LABELS}) as loader:
        batches = 0
        for batch in loader:
            assert torch.equal(batch.x, FEATURES[batch.input_nodes])
            assert isinstance(batch.y, dict)
            assert list(batch.y) == ["cites"]
            assert torch.equal(batch.y["cites"],
                               EDGE_LABELS[batch.pair_graph.edata[dgl.EID][cites]])
            batches += 1
    assert batches == 2


@pytest.mark.parametrize("key", [None, "rates", RATES], ids=["one-table", "name", "triple"])
def test_edge_labels_on_a_bipartite_graph_of_one_edge_type(key):
    """Two node types, one edge type: the pair graph's edge ids are one tensor, so one
    edge_labels= table works with heterogeneous=True (batch.y a tensor), and so does
    a dict keyed by the type's name or triple (batch.y a dict)."""
    gen = torch.Generator().manual_seed(4)
    graph = dgl.heterograph({RATES: (torch.randint(0, USERS, (600,), generator=gen),
                                     torch.randint(0, ITEMS, (600,), generator=gen))})
    source = dgl.dataloading.DataLoader(
        graph, torch.arange(100),
        dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2])),
        batch_size=32)
    edge_labels = RATINGS if key is None else {key: RATINGS}
    with PingPongLoader(source, TYPED_FEATURES, edge_labels=edge_labels,
                        heterogeneous=True) as loader:
        seen = []
        for batch in loader:
            edge_ids = batch.pair_graph.edata[dgl.EID]
            y = batch.y if key is None else batch.y[key]  # type: ignore[index]
            assert torch.equal(y, RATINGS[edge_ids])
            for ntype, table in TYPED_FEATURES.items():
                assert torch.equal(batch.x[ntype], table[batch.input_nodes[ntype]])
            seen.append(edge_ids)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(100))


def _twin_named_graph() -> Any:
    """Two edge types both named 'to' (user->item, item->user)."""
    return dgl.heterograph({("user", "to", "item"): ([0, 1], [1, 2]),
                            ("item", "to", "user"): ([2, 1], [0, 1])})


@pytest.mark.parametrize(
    ("graph", "edge_labels", "needle"),
    [
        (_rating_graph, {"rate": RATINGS}, r"edge_labels\['rate'\] names no edge type .*"
                                          r"\('user', 'rates', 'item'\)"),
        (_rating_graph, {("user", "rates", "user"): RATINGS}, "names no edge type"),
        (_twin_named_graph, {"to": torch.zeros(2)},
         r"edge_labels\['to'\] is the name of several edge types .* canonical triple"),
        (_rating_graph, {"rates": RATINGS, RATES: RATINGS},
         r"edge_labels\[\('user', 'rates', 'item'\)\] and edge_labels\['rates'\] are both"),
    ],
    ids=["misspelt-name", "wrong-triple", "ambiguous-name", "same-type-twice"],
)
@pytest.mark.parametrize("where", ["built", "read"])
def test_edge_label_keys_that_name_no_single_edge_type_are_refused(graph, edge_labels,
                                                                   needle, where):
    """When the loader is built if the source knows its graph (DGL's DataLoader.graph:
    TableError), else at the first batch, before any row is read (BatchFormError)."""
    g = graph()
    dl = dgl.dataloading.DataLoader(
        g, {g.canonical_etypes[0]: torch.arange(2)},
        dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([1])),
        batch_size=2)
    features = {ntype: torch.zeros(g.num_nodes(ntype), 2) for ntype in g.ntypes}
    if where == "built":
        with pytest.raises(pingpong.TableError, match=needle):
            PingPongLoader(dl, features, edge_labels=edge_labels, heterogeneous=True)
        return
    device = CountingCPUDevice()
    with PingPongLoader(list(dl), features, edge_labels=edge_labels, heterogeneous=True,
                        device=device) as loader:
        with pytest.raises(pingpong.BatchFormError, match=needle):
            next(iter(loader))
    assert device.gathers == 0


@pytest.mark.parametrize(
    ("edge_labels", "error", "needle"),
    [
        ({}, pingpong.TableError, "edge_labels is an empty dict"),
        ({3: RATINGS}, pingpong.TableError, "edge_labels dict keys must be edge types"),
        ({("user", "rates"): RATINGS}, pingpong.TableError, "tuple of three str"),
        ({"rates": [1, 2]}, pingpong.TableError, r"edge_labels\['rates'\]"),
    ],
    ids=["empty", "int-key", "pair-key", "list-table"],
)
def test_bad_edge_label_dicts_are_refused_at_construction(edge_labels, error, needle):
    with pytest.raises(error, match=needle):
        PingPongLoader([], TYPED_FEATURES, edge_labels=edge_labels, heterogeneous=True)


def _rates_source(seeds: torch.Tensor) -> Any:
    return dgl.dataloading.DataLoader(
        _rating_graph(), {"rates": seeds},
        dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2])),
        batch_size=40)


def test_bad_edge_ids_of_one_edge_type_are_refused_before_any_row_is_read():
    source = list(_rates_source(torch.arange(300, 340)))  # no graph to check against
    device = CountingCPUDevice()
    short = {"rates": RATINGS[:300].contiguous(), FOLLOWS: FOLLOW_WEIGHTS}
    with PingPongLoader(source, TYPED_FEATURES, edge_labels=short, heterogeneous=True,
                        device=device) as loader:
        with pytest.raises(pingpong.IdRangeError,
                           match=r"pair_graph.edata\[dgl.EID\]\['rates'\]\[0\] = 300 "):
            next(iter(loader))
    assert device.gathers == 0


def _hetero_graph() -> Any:
    g = _graph()
    src, dst = g.edges()
    return dgl.heterograph({("paper", "cites", "paper"): (src, dst),
                            ("author", "writes", "paper"): (src % 40, dst)},
                           num_nodes_dict={"paper": NUM_NODES, "author": 40})


@pytest.mark.parametrize(
    ("make_loader", "needle"),
    [
        (lambda: dgl.dataloading.DataLoader(
            _graph(), torch.tensor([1, 2, NUM_NODES]), dgl.dataloading.NeighborSampler([2]),
            batch_size=2), rf"seed node ids include {NUM_NODES}, outside the graph's "
                           rf"{NUM_NODES} nodes"),
        (lambda: dgl.dataloading.DataLoader(
            _graph(), torch.tensor([5, -1], dtype=torch.int32),
            dgl.dataloading.MultiLayerFullNeighborSampler(1), batch_size=2),
         r"seed node ids include -1"),
        (lambda: dgl.dataloading.DataLoader(
            _graph(), torch.tensor([0, 10_000]), dgl.dataloading.ShaDowKHopSampler([2]),
            batch_size=2), r"seed node ids include 10000"),
        (lambda: dgl.dataloading.DataLoader(
            _hetero_graph(), {"paper": torch.arange(5), "author": torch.tensor([3, 40])},
            dgl.dataloading.NeighborSampler([2]), batch_size=2),
         r"seed node ids\['author'\] include 40, outside the graph's 40 nodes of type "
         r"'author'"),
        (lambda: dgl.dataloading.DataLoader(
            _graph(), torch.tensor([0, NUM_EDGES]),
            dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2])),
            batch_size=2), rf"seed edge ids include {NUM_EDGES}, outside the graph's "
                           rf"{NUM_EDGES} edges"),
        (lambda: dgl.dataloading.DataLoader(
            _graph(), np.array([3, NUM_NODES + 7]), dgl.dataloading.NeighborSampler([2]),
            batch_size=2), rf"seed node ids include {NUM_NODES + 7}"),
        (lambda: dgl.dataloading.DataLoader(
            _hetero_graph(), {"author": [1, 41]}, dgl.dataloading.NeighborSampler([2]),
            batch_size=2), r"seed node ids\['author'\] include 41"),
    ],
    ids=["neighbor", "negative-int32", "shadow", "hetero-dict", "edge-prediction",
         "numpy-seeds", "list-seeds-in-a-dict"],
)
def test_dgl_seeds_outside_the_graph_are_refused_when_the_loader_is_built(make_loader, needle):
    """DGL's samplers do not check their seeds, and an out-of-range one has crashed the
    process (SIGSEGV) when sampled in the producer thread: the loader refuses it first."""
    source = make_loader()
    with pytest.raises(pingpong.IdRangeError, match=needle):
        PingPongLoader(source, FEATURES)


@pytest.mark.parametrize("make_seeds", [
    lambda: np.array([1, 2, NUM_NODES + 5], dtype=np.uint32),
    lambda: torch.tensor([1, 2, NUM_NODES + 5], dtype=torch.uint64),  # torch >= 2.3
    lambda: torch.tensor([1, 2, NUM_NODES + 5], dtype=torch.int16),
], ids=["numpy-uint32", "uint64", "int16"])
@pytest.mark.parametrize("kind", ["node", "edge"])
def test_seeds_of_a_dtype_dgl_refuses_are_left_to_dgls_own_error(make_seeds, kind):
    """DGL samples int64 (or int32) seeds only and names the dtype it got; the
    loader's construction checks (the seed range, the label tables' rows) skip such
    seeds -- ``max()`` of uint32 or uint64 is torch's NotImplementedError, and an
    int16 seed past the graph was blamed on the label table -- so the first batch
    raises what the plain DGL loop raises."""
    sampler = dgl.dataloading.NeighborSampler([2])
    if kind == "edge":
        sampler = dgl.dataloading.as_edge_prediction_sampler(sampler)
        tables: dict[str, Any] = {"edge_labels": torch.arange(NUM_EDGES)}
    else:
        tables = {"labels": torch.arange(NUM_NODES)}
    try:
        seeds = make_seeds()
        source = dgl.dataloading.DataLoader(_graph(), seeds, sampler, batch_size=4)
    except (AttributeError, TypeError) as exc:  # an older torch holds no such seeds
        pytest.skip(f"this torch/DGL takes no such seeds: {exc}")
    with pytest.raises(Exception) as plain:  # whatever DGL raises
        next(iter(source))
    with PingPongLoader(source, FEATURES, **tables) as loader, \
            pytest.raises(Exception) as through:
        next(iter(loader))
    assert type(through.value) is type(plain.value)
    assert str(through.value) == str(plain.value)
    if hasattr(torch, "uint64"):  # torch >= 2.3 holds every such seed: DGL's dtype error
        assert isinstance(plain.value, dgl.DGLError)
        assert "data type torch.int64. But got torch." in str(plain.value)


def test_seeds_of_another_meaning_are_not_checked_as_node_ids():
    """SAINT's seeds count iterations, not nodes: more of them than nodes is fine."""
    g = _graph()
    source = dgl.dataloading.DataLoader(
        g, torch.arange(NUM_NODES + 2), dgl.dataloading.SAINTSampler("node", 40), batch_size=1)
    with PingPongLoader(source, FEATURES) as loader:
        assert len(loader) == NUM_NODES + 2


def test_a_feature_dict_of_different_row_counts_is_refused_with_edge_labels_too():
    """A homogeneous feature dict is several features of the same nodes, whatever the
    labels: with edge_labels= as with labels=, tables of different lengths are refused
    (pointing at heterogeneous=True) -- a short one would fail part-way through."""
    features = {"feat": FEATURES, "short": FEATURES[:200].contiguous()}
    for kwargs in ({"edge_labels": EDGE_LABELS}, {"edge_labels": {"rates": RATINGS}},
                   {"labels": LABELS}):
        with pytest.raises(pingpong.TableError,
                           match=r"different numbers of rows.*heterogeneous=True"):
            PingPongLoader(list(_edge_source()), features, **kwargs)


def test_labels_and_edge_labels_together_are_a_config_error():
    with pytest.raises(pingpong.ConfigError, match="not both"):
        PingPongLoader(_edge_source(), FEATURES, LABELS, edge_labels=EDGE_LABELS)


# -- GraphBolt (DGL 2.x) ------------------------------------------------------------------
def _graphbolt() -> Any:
    try:
        from dgl import graphbolt
    except ImportError:
        pytest.skip("GraphBolt needs DGL 2.x")
    return graphbolt


def _graphbolt_pipeline(gb: Any, seeds: torch.Tensor, *, fetch: bool = False,
                        item_labels: bool = False, copy_to: str | None = None,
                        names: str = "seed_nodes") -> Any:
    g = _graph()
    graph = gb.from_dglgraph(g, is_homogeneous=True)
    if item_labels:
        item_set = gb.ItemSet((seeds, LABELS[seeds]), names=(names, "labels"))
    else:
        item_set = gb.ItemSet(seeds, names=names)
    pipe = gb.ItemSampler(item_set, batch_size=32, shuffle=True)
    pipe = pipe.sample_neighbor(graph, [3, 3])
    if fetch:
        store = gb.BasicFeatureStore(
            {("node", None, "feat"): gb.TorchBasedFeature(FEATURES)})
        pipe = pipe.fetch_feature(store, node_feature_keys=["feat"])
    if copy_to is not None:
        pipe = pipe.copy_to(copy_to)
    return gb.DataLoader(pipe)


@pytest.mark.parametrize("names", ["seed_nodes", "seeds"])
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_graphbolt_minibatch_gets_node_features_and_labels(device_kind, names):
    """Both generations of GraphBolt's field names: ``seed_nodes`` (DGL 2.0-2.1)
    and ``seeds`` (DGL 2.2's, which DGL 2.1's ``ItemSet`` already takes)."""
    gb = _graphbolt()
    seeds = torch.arange(0, NUM_NODES, 2)
    source = _graphbolt_pipeline(gb, seeds, names=names)
    device = _device(device_kind)
    checker = Checker(device)

    def check(minibatch: Any) -> torch.Tensor:
        assert type(minibatch).__name__ == "MiniBatch"
        seed_nodes = getattr(minibatch, names)
        checker.equal(minibatch.node_features["feat"], FEATURES[minibatch.input_nodes])
        checker.equal(minibatch.labels, LABELS[seed_nodes])
        assert len(minibatch.blocks) == 2
        return seed_nodes

    with PingPongLoader(source, FEATURES, LABELS, device=device) as loader:
        with pytest.raises(TypeError, match="no len"):
            len(loader)  # gb.DataLoader has none
        per_epoch = _epochs(loader, check)
        checker.resolve()
    for seen in per_epoch:
        assert torch.equal(torch.cat(seen).sort().values, seeds)


def test_graphbolt_item_set_labels_pass_through():
    gb = _graphbolt()
    seeds = torch.arange(NUM_NODES)
    with PingPongLoader(_graphbolt_pipeline(gb, seeds, item_labels=True), FEATURES) as loader:
        for minibatch in loader:
            assert torch.equal(minibatch.node_features["feat"], FEATURES[minibatch.input_nodes])
            assert torch.equal(minibatch.labels, LABELS[minibatch.seed_nodes])


@pytest.mark.parametrize("copy_to", ["cpu", "cuda"])
def test_graphbolt_pipeline_with_a_copy_to_stage(copy_to: str) -> None:
    """A ``copy_to`` stage is allowed (docs/guide.rst): the MiniBatch arrives with its
    ids on that device, and its features and labels are still the tables' rows."""
    gb = _graphbolt()
    if copy_to == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seeds = torch.arange(0, NUM_NODES, 3)
    source = _graphbolt_pipeline(gb, seeds, copy_to=copy_to)
    seen = []
    with PingPongLoader(source, FEATURES, LABELS, device=copy_to) as loader:
        for minibatch in loader:
            ids = minibatch.input_nodes.cpu()
            assert torch.equal(minibatch.node_features["feat"].cpu(), FEATURES[ids])
            assert torch.equal(minibatch.labels.cpu(), LABELS[minibatch.seed_nodes.cpu()])
            seen.append(minibatch.seed_nodes.cpu())
    assert torch.equal(torch.cat(seen).sort().values, seeds)


def test_two_loaders_over_one_graphbolt_loader_take_turns_loudly() -> None:
    """Found in a GraphBolt user review: torchdata allows one live iterator per
    datapipe, and behind ``copy_to``'s prefetcher the older one just stops, so
    an evaluation pass nested in the training loop (a second loader over the
    same ``gb.DataLoader``) cut the training epoch short with no error, or
    raised "generator already executing".  Now the nested ``iter()`` ends the
    training epoch (``EpochSupersededError``) and each pass that runs is whole."""
    gb = _graphbolt()
    seeds = torch.arange(0, NUM_NODES, 3)
    source = _graphbolt_pipeline(gb, seeds, copy_to="cpu")

    def exact_pass(batches: Any) -> torch.Tensor:
        seen = []
        for minibatch in batches:
            assert torch.equal(minibatch.node_features["feat"], FEATURES[minibatch.input_nodes])
            seen.append(minibatch.seed_nodes)
        return torch.cat(seen).sort().values

    with PingPongLoader(source, FEATURES, LABELS, timeout=60) as train, \
            PingPongLoader(source, FEATURES, LABELS, timeout=60) as evaluate:
        outer = iter(train)
        for _ in range(3):
            next(outer)
        assert torch.equal(exact_pass(evaluate), seeds)
        with pytest.raises(pingpong.EpochSupersededError, match="GraphBolt"):
            next(outer)
        assert torch.equal(exact_pass(train), seeds)


def test_a_short_table_over_a_graphbolt_loader_is_refused_when_the_loader_is_built():
    """Found in a GraphBolt user review: a feature table shorter than the pipeline's
    sampling graph was caught only at the first batch that sampled a node past its
    end (IdRangeError, every epoch); DGL's own loaders were refused when built."""
    gb = _graphbolt()
    source = _graphbolt_pipeline(gb, torch.arange(0, NUM_NODES, 2))
    with pytest.raises(pingpong.TableError, match=f"the source's graph has {NUM_NODES} nodes"):
        PingPongLoader(source, FEATURES[:NUM_NODES - 1], LABELS[:NUM_NODES - 1])


def _two_graph_pipeline(gb: Any, small_last: bool) -> tuple[Any, int]:
    """A GraphBolt pipeline sampling over two graph objects: the whole graph and its
    first half (a node subgraph keeps the ids); the last stage's graph gives the
    features' ids. Returns it and the half's node count."""
    g = _graph()
    half = NUM_NODES // 2
    whole = gb.from_dglgraph(g, is_homogeneous=True)
    first_half = gb.from_dglgraph(dgl.node_subgraph(g, torch.arange(half)),
                                  is_homogeneous=True)
    pipe = gb.ItemSampler(gb.ItemSet(torch.arange(half), names="seed_nodes"), batch_size=32)
    for graph in ((whole, first_half) if small_last else (first_half, whole)):
        pipe = pipe.sample_neighbor(graph, [3])
    return gb.DataLoader(pipe), half


def test_a_graphbolt_pipeline_over_several_graphs_is_checked_against_the_smallest():
    """Which sampling graph's ids reach the features is not known when the loader is
    built: a table short against the smallest graph is refused then (short against
    every one); one that covers the smallest but not the graph the last stage samples
    is refused at its first batch past its end (IdRangeError), as any short table."""
    gb = _graphbolt()
    source, half = _two_graph_pipeline(gb, small_last=True)
    with pytest.raises(pingpong.TableError,
                       match=f"the smallest of the source's 2 sampling graphs has {half} nodes"):
        PingPongLoader(source, FEATURES[:half - 1])
    with PingPongLoader(source, FEATURES[:half]) as loader:  # the last stage's graph: enough
        seen = []
        for minibatch in loader:
            assert torch.equal(minibatch.node_features["feat"], FEATURES[minibatch.input_nodes])
            seen.append(minibatch.seed_nodes)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(half))
    source, half = _two_graph_pipeline(gb, small_last=False)
    with PingPongLoader(source, FEATURES[:half]) as loader, \
            pytest.raises(pingpong.IdRangeError):
        for _ in loader:
            pass


def test_graphbolt_pipeline_that_fetches_features_is_refused():
    gb = _graphbolt()
    source = _graphbolt_pipeline(gb, torch.arange(64), fetch=True)
    device = CountingCPUDevice()
    with PingPongLoader(source, FEATURES, device=device) as loader:
        with pytest.raises(pingpong.BatchFormError, match=r"remove the \.fetch_feature"):
            next(iter(loader))
    assert device.gathers == 0


def test_graphbolt_minibatches_kept_with_deepcopy_stay_intact():
    """A MiniBatch has no clone(); its features are views of a slot, so the guide says
    copy.deepcopy: every kept copy still equals the tables' rows after the epoch."""
    gb = _graphbolt()
    with PingPongLoader(_graphbolt_pipeline(gb, torch.arange(NUM_NODES)), FEATURES,
                        LABELS) as loader:
        kept = [copy.deepcopy(minibatch) for minibatch in loader]
    assert len(kept) == math.ceil(NUM_NODES / 32)
    for minibatch in kept:
        assert torch.equal(minibatch.node_features["feat"], FEATURES[minibatch.input_nodes])
        assert torch.equal(minibatch.labels, LABELS[minibatch.seed_nodes])


@pytest.mark.parametrize("labels", [True, False])
def test_graphbolt_minibatches_sampled_once_and_reused_every_epoch(labels):
    """From a GraphBolt review: a list of sampled MiniBatches (fixed neighbourhoods,
    sampled once) is a re-iterable like any other, but pingpong filled the list's own
    objects: the second pass was refused as a pipeline that fetches features (or
    carries labels), and the list held slot views that later batches overwrote.
    pingpong now fills copies: every pass is exact and the list stays as it was."""
    gb = _graphbolt()
    sampled = list(_graphbolt_pipeline(gb, torch.arange(0, NUM_NODES, 2)))
    tables = (FEATURES, LABELS) if labels else (FEATURES,)
    with PingPongLoader(sampled, *tables, num_buffers=2) as loader:
        for _ in range(3):
            got = [(mb.input_nodes, mb.seed_nodes, mb.node_features["feat"].clone(),
                    mb.labels.clone() if labels else None) for mb in loader]
            assert len(got) == len(sampled)
            for input_nodes, seed_nodes, x, y in got:
                assert torch.equal(x, FEATURES[input_nodes])
                if labels:
                    assert y is not None
                    assert torch.equal(y, LABELS[seed_nodes])
    for minibatch in sampled:
        assert not minibatch.node_features
        assert minibatch.labels is None


class _MovesToMeta(FakeAsyncDevice):
    """The fake device, moving each batch's graphs as the CUDA device does
    (``graph.to(device)``), to a device the move is visible on afterwards."""

    def move_graphs(self, graphs: list[Any]) -> list[Any]:
        super().move_graphs(graphs)
        return [graph.to(torch.device("meta")) for graph in graphs]


def test_graphbolt_minibatches_reused_are_not_moved_in_place():
    """From a self-review: GraphBolt's ``MiniBatch.to()`` (and its subgraphs')
    moves in place, and pingpong copied the MiniBatch only after the move, so on a
    GPU the source's own MiniBatches ended up holding GPU copies of their subgraphs
    and seeds. pingpong now moves a copy of the whole structure."""
    gb = _graphbolt()
    sampled = list(_graphbolt_pipeline(gb, torch.arange(0, NUM_NODES, 2)))[:3]

    def devices(minibatch: Any) -> set[str]:
        found = {minibatch.seed_nodes.device.type, minibatch.input_nodes.device.type}
        for subgraph in minibatch.sampled_subgraphs:
            found |= {subgraph.sampled_csc.indices.device.type,
                      subgraph.sampled_csc.indptr.device.type}
        return found

    with PingPongLoader(sampled, FEATURES, LABELS,
                        device=_MovesToMeta(seed=1, max_delay_s=0.0)) as loader:
        moved = [devices(minibatch) for minibatch in loader]
    assert all("meta" in found for found in moved)  # what the loop got was moved
    assert [devices(minibatch) for minibatch in sampled] == [{"cpu"}] * 3
    assert all(not minibatch.node_features for minibatch in sampled)


def test_graphbolt_workers_through_an_empty_fetch_stage():
    """The guide's way to keep gb.DataLoader's workers (DGL 2.1 starts them only before
    a fetch_feature stage): an empty fetch, accepted, every batch bit for bit."""
    gb = _graphbolt()
    seeds = torch.arange(0, NUM_NODES, 2)
    pipe = gb.ItemSampler(gb.ItemSet(seeds, names="seed_nodes"), batch_size=16, shuffle=True)
    pipe = pipe.sample_neighbor(gb.from_dglgraph(_graph(), is_homogeneous=True), [3, 3])
    pipe = pipe.fetch_feature(gb.BasicFeatureStore({}), node_feature_keys=None)
    before = {child.pid for child in psutil.Process().children()}
    source = gb.DataLoader(pipe, num_workers=2)
    with PingPongLoader(source, FEATURES, LABELS) as loader:
        for _ in range(2):
            seen = []
            for minibatch in loader:
                assert torch.equal(minibatch.node_features["feat"],
                                   FEATURES[minibatch.input_nodes])
                assert torch.equal(minibatch.labels, LABELS[minibatch.seed_nodes])
                seen.append(minibatch.seed_nodes)
                workers = {child.pid for child in psutil.Process().children()} - before
            assert torch.equal(torch.cat(seen).sort().values, seeds)
            assert len(workers) == 2  # the workers did start, during the pass
    # DGL 2.1 frees such a DataLoader only through the garbage collector, which then
    # waits 5 s per worker: here, not in whichever later test collects next.
    del loader, source, pipe
    gc.collect()


def _graphbolt_hetero(gb: Any, seeds: dict[str, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    """A GraphBolt pipeline over paper/author with seeds of each type given, and the
    tables: features of both types, labels of both."""
    g = _graph()
    src, dst = g.edges()
    hetero = dgl.heterograph({("author", "writes", "paper"): (src % 40, dst),
                              ("paper", "cites", "paper"): (src, dst)},
                             num_nodes_dict={"paper": NUM_NODES, "author": 40})
    graph = gb.from_dglgraph(hetero, is_homogeneous=False)
    items = gb.ItemSetDict({ntype: gb.ItemSet(ids, names="seed_nodes")
                            for ntype, ids in seeds.items()})
    pipe = gb.ItemSampler(items, batch_size=10).sample_neighbor(graph, [3])
    tables = {"features": {"paper": FEATURES, "author": FEATURES[:40] * 3},
              "labels": {"paper": LABELS, "author": LABELS[:40] + 1}}
    return gb.DataLoader(pipe), tables


def test_graphbolt_heterogeneous_labels_have_the_seed_types_only():
    """Batches of paper seeds and of author seeds: minibatch.labels has exactly the
    types of minibatch.seed_nodes (a zero-row entry for the other made a per-type
    cross-entropy NaN), each the labels' rows bit for bit."""
    gb = _graphbolt()
    source, tables = _graphbolt_hetero(gb, {"paper": torch.arange(30),
                                            "author": torch.arange(20)})
    with PingPongLoader(source, tables["features"], tables["labels"],
                        heterogeneous=True) as loader:
        seed_types = []
        for minibatch in loader:
            assert set(minibatch.labels) == set(minibatch.seed_nodes)
            for ntype, ids in minibatch.seed_nodes.items():
                assert torch.equal(minibatch.labels[ntype], tables["labels"][ntype][ids])
            for ntype, ids in minibatch.input_nodes.items():
                assert torch.equal(minibatch.node_features[(ntype, "feat")],
                                   tables["features"][ntype][ids])
            seed_types.append(tuple(sorted(minibatch.seed_nodes)))
    assert set(seed_types) == {("paper",), ("author",)}  # batches of one type each


def test_graphbolt_heterogeneous_tables_must_name_the_graph_types():
    gb = _graphbolt()
    source, _ = _graphbolt_hetero(gb, {"paper": torch.arange(30)})
    misspelt = {"paper": FEATURES, "Author": FEATURES[:40]}
    with pytest.raises(pingpong.TableError,
                       match=r"features\['Author'\]: .* node types are \['author', 'paper'\]"):
        PingPongLoader(source, misspelt, heterogeneous=True)


@pytest.mark.parametrize(("ntype", "nodes"), [("author", 40), ("paper", NUM_NODES)])
def test_a_short_heterogeneous_table_over_a_graphbolt_loader_is_refused_when_built(ntype, nodes):
    """The row check above over a heterogeneous sampling graph, whose ``num_nodes`` is a
    dict by node type: a table one row short of its type's nodes is refused when the
    loader is built, naming the type (from a mutation audit: with the dict branch of
    the check removed, every test still passed)."""
    gb = _graphbolt()
    source, tables = _graphbolt_hetero(gb, {"paper": torch.arange(30)})
    features = dict(tables["features"])
    features[ntype] = features[ntype][:nodes - 1]
    with pytest.raises(pingpong.TableError,
                       match=rf"features\['{ntype}'\] has {nodes - 1} rows, but the source's "
                             rf"graph has {nodes} nodes of type '{ntype}'"):
        PingPongLoader(source, features, heterogeneous=True)


def test_heterogeneous_tables_over_a_homogeneous_graphbolt_loader():
    """heterogeneous=True over a homogeneous sampling graph (no ``node_type_to_id``):
    its one node type is ``"_N"``, as a DGL graph's; a table of that type is
    gathered at the plain input_nodes, and one short of the graph's nodes is refused
    when built (from a mutation audit: reading the types of a graph that has none
    raised TypeError when built, and no test failed)."""
    gb = _graphbolt()
    seeds = torch.arange(0, NUM_NODES, 2)
    source = _graphbolt_pipeline(gb, seeds)
    with PingPongLoader(source, {"_N": FEATURES}, heterogeneous=True) as loader:
        seen = []
        for minibatch in loader:
            assert torch.equal(minibatch.node_features[("_N", "feat")],
                               FEATURES[minibatch.input_nodes])
            seen.append(minibatch.seed_nodes)
    assert torch.equal(torch.cat(seen).sort().values, seeds)
    with pytest.raises(pingpong.TableError,
                       match=rf"has {NUM_NODES - 1} rows, but the source's graph has "
                             rf"{NUM_NODES} nodes of type '_N'"):
        PingPongLoader(source, {"_N": FEATURES[:NUM_NODES - 1]}, heterogeneous=True)
    # Any other key is refused, as over a homogeneous DGL graph. (It was taken: the
    # graph's types read as unknown, and a short table of that key went unchecked.)
    for table in (FEATURES, FEATURES[:NUM_NODES - 1]):
        with pytest.raises(pingpong.TableError,
                           match=r"features\['node'\]: the source's graph has no node type "
                                 r"'node'; its node types are \['_N'\]"):
            PingPongLoader(source, {"node": table}, heterogeneous=True)


def test_a_torch_data_loader_of_sampled_triples_is_searched_for_no_sampling_graph():
    """Where GraphBolt is imported, a source with a ``dataset`` and no ``graph`` is
    searched for a pipeline's sampling graph; a torch DataLoader over a list of
    sampled DGL triples has none (its dataset is no datapipe torch can walk), and is
    taken as the list is (from a mutation audit: with the walk's errors let through,
    torch's "Expected IterDataPipe" refused it when built, and no test failed)."""
    _graphbolt()  # without DGL 2.x no source is searched
    triples: Any = list(_node_source())  # a list: a map-style dataset to torch
    source = torch.utils.data.DataLoader(triples, batch_size=None)
    with PingPongLoader(source, FEATURES) as loader:
        for _ in range(2):
            seen = []
            for batch in loader:
                assert torch.equal(batch.x, FEATURES[batch.input_nodes])
                seen.append(batch.output_nodes)
            assert torch.equal(torch.cat(seen).sort().values, torch.arange(64))


@dataclasses.dataclass
class MiniBatch:
    """A stand-in with DGL 2.2+'s field names (``seeds`` instead of ``seed_nodes``);
    PyPI has no DGL 2.2 wheel, so this is the only test of those names."""

    seeds: Any = None
    input_nodes: Any = None
    labels: Any = None
    node_features: Any = None
    sampled_subgraphs: Any = None

    def to(self, device: Any) -> MiniBatch:
        return self


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_graphbolt_2_2_field_names(device_kind):
    gen = torch.Generator().manual_seed(3)
    items = [MiniBatch(seeds=torch.randperm(NUM_NODES, generator=gen)[:16],
                       input_nodes=torch.randperm(NUM_NODES, generator=gen)[:50])
             for _ in range(5)]
    device = _device(device_kind)
    checker = Checker(device)
    with PingPongLoader(items, FEATURES, LABELS, device=device) as loader:
        for _ in range(2):  # the same objects each pass: pingpong fills copies
            for minibatch, item in zip(loader, items, strict=True):
                assert minibatch.input_nodes is item.input_nodes
                checker.equal(minibatch.node_features["feat"], FEATURES[item.input_nodes])
                checker.equal(minibatch.labels, LABELS[item.seeds])
        checker.resolve()
    assert all(item.node_features is None and item.labels is None for item in items)
    pairs = MiniBatch(seeds=torch.tensor([[0, 1], [2, 3]]), input_nodes=torch.arange(4))
    with PingPongLoader([pairs], FEATURES, LABELS) as loader:  # a link task: no seed nodes
        with pytest.raises(pingpong.BatchFormError, match="link task"):
            next(iter(loader))
    with PingPongLoader([pairs], FEATURES) as loader:  # features only: fine
        assert torch.equal(next(iter(loader)).node_features["feat"], FEATURES[:4])


def test_graph_ids_as_numpy_work_too():
    """Forms accept NumPy ids as the node triple always did."""
    items: list[tuple[np.ndarray, np.ndarray, list]] = [(np.arange(5), np.arange(2), [])]
    with PingPongLoader(items, FEATURES, LABELS) as loader:
        batch = next(iter(loader))
    assert torch.equal(batch.x, FEATURES[:5])


def test_an_edge_label_table_too_short_for_its_seed_edges_is_refused_when_built():
    """Over DGL's DataLoader the seeds are known: a table without rows for some of
    them would fail part-way through an epoch; it is refused at once."""
    short = {"rates": RATINGS[:300].contiguous(), FOLLOWS: FOLLOW_WEIGHTS}
    with pytest.raises(pingpong.TableError,
                       match=r"edge_labels\['rates'\] has 300 rows, but the loader's seed "
                             r"edges of type \('user', 'rates', 'item'\) include id 339"):
        PingPongLoader(_rates_source(torch.arange(300, 340)), TYPED_FEATURES,
                       edge_labels=short, heterogeneous=True)
    with pytest.raises(pingpong.TableError, match=r"edge_labels has 10 rows, .* include id 63"):
        PingPongLoader(_edge_source(), FEATURES, edge_labels=EDGE_LABELS[:10].contiguous())
    # the boundary: the largest seed id (63) needs row 63, so 63 rows are one short
    with pytest.raises(pingpong.TableError, match=r"edge_labels has 63 rows, .* include id 63"):
        PingPongLoader(_edge_source(), FEATURES, edge_labels=EDGE_LABELS[:63].contiguous())
    just_enough = EDGE_LABELS[:64].contiguous()
    with PingPongLoader(_edge_source(), FEATURES, edge_labels=just_enough) as loader:
        for batch in loader:
            assert torch.equal(batch.y, just_enough[batch.pair_graph.edata[dgl.EID]])


@pytest.mark.parametrize("edge_label_rows", [40, NUM_EDGES])
def test_input_nodes_are_checked_against_the_features_rows_not_the_edge_labels(
        edge_label_rows):
    """With edge labels the feature tables still bound the input node ids: an edge label
    table of fewer rows than nodes refuses no input node, and one of more rows lets
    no input node past the features' last row (an id there is an IdRangeError before
    any row is read, not a gather beyond the table)."""
    edge_labels = EDGE_LABELS[:edge_label_rows].contiguous()
    items = list(dgl.dataloading.DataLoader(
        _graph(), torch.arange(40),
        dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2])),
        batch_size=20))
    assert all(int(item[0].max()) >= 40 for item in items)  # beyond the edge label rows
    with PingPongLoader(items, FEATURES, edge_labels=edge_labels) as loader:
        for batch in loader:
            assert torch.equal(batch.x, FEATURES[batch.input_nodes])
            assert torch.equal(batch.y, edge_labels[batch.pair_graph.edata[dgl.EID]])
    input_nodes, pair_graph, blocks = items[0]
    beyond = [(torch.cat([input_nodes, torch.tensor([NUM_NODES])]), pair_graph, blocks)]
    device = CountingCPUDevice()
    with PingPongLoader(beyond, FEATURES, edge_labels=edge_labels, device=device) as loader:
        with pytest.raises(pingpong.IdRangeError, match=rf"{NUM_NODES}"):
            next(iter(loader))
    assert device.gathers == 0


def test_an_edge_label_table_of_another_length_than_its_edge_type_is_used_as_given():
    """Labels for the first half of a graph with reverse edges added (the seeds are
    there), or more rows than edges: no complaint, gathered bit for bit."""
    g = _graph()
    doubled = dgl.add_reverse_edges(g)
    source = dgl.dataloading.DataLoader(
        doubled, torch.arange(0, NUM_EDGES, 7),
        dgl.dataloading.as_edge_prediction_sampler(
            dgl.dataloading.NeighborSampler([2]), exclude="reverse_id",
            reverse_eids=torch.cat([torch.arange(NUM_EDGES, 2 * NUM_EDGES),
                                    torch.arange(NUM_EDGES)])),
        batch_size=64)
    longer = torch.cat([EDGE_LABELS, EDGE_LABELS]).repeat(2)
    for table in (EDGE_LABELS, longer):
        with PingPongLoader(source, FEATURES, edge_labels=table) as loader:
            for batch in loader:
                assert torch.equal(batch.y, table[batch.pair_graph.edata[dgl.EID]])


def test_with_form_the_tables_are_not_checked_against_the_graph():
    """form= says what each table is gathered at: one edge_labels table over a graph of
    two edge types (one type's labels, read by the form) and a feature table indexed
    by the form's own ids are taken as given."""
    source, cites = _two_edge_type_source()
    with PingPongLoader(source, FEATURES, edge_labels=EDGE_LABELS,
                        form=lambda item: (item[0], item[1].edata[dgl.EID][cites])) as loader:
        batches = 0
        for batch in loader:
            input_nodes, pair_graph = batch.item[0], batch.item[1]
            assert torch.equal(batch.x, FEATURES[input_nodes])
            assert torch.equal(batch.y, EDGE_LABELS[pair_graph.edata[dgl.EID][cites]])
            batches += 1
    assert batches == 2
    per_batch = torch.arange(8.0).reshape(4, 2)  # one row per batch, not per node
    items = iter(range(1000))
    with PingPongLoader(_node_source(), per_batch,
                        form=lambda item: (torch.tensor([next(items) % 2]), None)) as loader:
        assert [batch.x.tolist() for batch in loader] == [[[0.0, 1.0]], [[2.0, 3.0]]]


def test_edge_labels_per_edge_type_with_heterogeneous_true_on_one_node_type():
    """One node type, two edge types, heterogeneous=True and a table per edge type:
    DGL's plain input_nodes are the one feature table's (the edge label tables are
    no node types)."""
    source, cites = _two_edge_type_source()
    cited_by = ("paper", "cited-by", "paper")
    edge_labels = {"cites": EDGE_LABELS, cited_by: EDGE_LABELS.flip(0).contiguous()}
    with PingPongLoader(source, {"paper": FEATURES}, edge_labels=edge_labels,
                        heterogeneous=True) as loader:
        batches = 0
        for batch in loader:
            edge_ids = batch.pair_graph.edata[dgl.EID]
            assert isinstance(batch.x, dict)
            assert isinstance(batch.y, dict)
            assert torch.equal(batch.x["paper"], FEATURES[batch.input_nodes])
            assert torch.equal(batch.y["cites"], EDGE_LABELS[edge_ids[cites]])
            assert torch.equal(batch.y[cited_by], edge_labels[cited_by][edge_ids[cited_by]])
            batches += 1
    assert batches == 2


def test_a_form_may_key_edge_label_ids_by_name_or_canonical_triple():
    """form= returning DGL's own edata dict (canonical keys) for tables keyed by name
    and by triple gathers each table's type, and so do ids keyed by name for tables
    keyed by triple and the reverse; a dict with no entry for a table is a
    BatchFormError before any row is read (it was zero rows, silently)."""
    items = list(dgl.dataloading.DataLoader(
        _rating_graph(), {"rates": torch.arange(80), "follows": torch.arange(40)},
        dgl.dataloading.as_edge_prediction_sampler(dgl.dataloading.NeighborSampler([2])),
        batch_size=40))
    edge_labels = {"rates": RATINGS, FOLLOWS: FOLLOW_WEIGHTS}
    with PingPongLoader(items, TYPED_FEATURES, edge_labels=edge_labels, heterogeneous=True,
                        form=lambda item: (item[0], item[1].edata[dgl.EID])) as loader:
        for batch in loader:
            edge_ids = batch.item[1].edata[dgl.EID]
            assert isinstance(batch.y, dict)
            assert torch.equal(batch.y["rates"], RATINGS[edge_ids[RATES]])
            assert torch.equal(batch.y[FOLLOWS], FOLLOW_WEIGHTS[edge_ids[FOLLOWS]])
    named = {"rates": RATINGS, "follows": FOLLOW_WEIGHTS}
    with PingPongLoader(items, TYPED_FEATURES, edge_labels=named, heterogeneous=True,
                        form=lambda item: (item[0], {
                            "rates": item[1].edata[dgl.EID][RATES],
                            FOLLOWS: item[1].edata[dgl.EID][FOLLOWS]})) as loader:
        batch = next(iter(loader))
        assert isinstance(batch.y, dict)
        assert torch.equal(batch.y["follows"],
                           FOLLOW_WEIGHTS[batch.item[1].edata[dgl.EID][FOLLOWS]])
    # the other way round: tables keyed by triple, the form's ids by name
    by_triple = {RATES: RATINGS, "follows": FOLLOW_WEIGHTS}
    with PingPongLoader(items, TYPED_FEATURES, edge_labels=by_triple, heterogeneous=True,
                        form=lambda item: (item[0], {
                            "rates": item[1].edata[dgl.EID][RATES],
                            "follows": item[1].edata[dgl.EID][FOLLOWS]})) as loader:
        for batch in loader:
            edge_ids = batch.item[1].edata[dgl.EID]
            assert isinstance(batch.y, dict)
            assert torch.equal(batch.y[RATES], RATINGS[edge_ids[RATES]])
            assert torch.equal(batch.y["follows"], FOLLOW_WEIGHTS[edge_ids[FOLLOWS]])
    device = CountingCPUDevice()
    with PingPongLoader(items, TYPED_FEATURES, edge_labels=edge_labels, heterogeneous=True,
                        device=device, form=lambda item: (item[0], {
                            "rate": item[1].edata[dgl.EID][RATES]})) as loader:
        with pytest.raises(pingpong.BatchFormError,
                           match=r"keyed \{'rate'\}: none for edge_labels\['rates'\]"):
            next(iter(loader))
    assert device.gathers == 0


def test_edge_label_ids_by_type_for_one_edge_label_table_say_to_key_the_tables():
    """One edge_labels table, and a form= returning the pair graph's ids by edge type:
    the IdTypeError says to pass the tables by edge type (it said heterogeneous=True,
    which the loader already had)."""
    items = list(_rates_source(torch.arange(40)))
    device = CountingCPUDevice()
    with PingPongLoader(items, TYPED_FEATURES, edge_labels=RATINGS, heterogeneous=True,
                        device=device,
                        form=lambda item: (item[0], item[1].edata[dgl.EID])) as loader:
        with pytest.raises(pingpong.IdTypeError,
                           match=r"form\(item\)\[1\] is a dict by edge type .*one edge_labels "
                                 r"table: pass edge_labels as a dict"):
            next(iter(loader))
    assert device.gathers == 0


# -- node tables against the source's graph -------------------------------------------------
def test_a_feature_table_shorter_than_the_graph_is_refused_when_built():
    """Any node may be sampled as an input node: a table without a row for each would
    fail part-way through an epoch (IdRangeError at a random batch); refused at once.
    More rows than nodes are fine (a graph made from an edge list ends at its last
    connected node)."""
    with pytest.raises(pingpong.TableError,
                       match=r"features has 299 rows, but the source's graph has 300 nodes"):
        PingPongLoader(_node_source(), FEATURES[:299].contiguous())
    longer = torch.cat([FEATURES, FEATURES[:5]])
    with PingPongLoader(_node_source(), longer, LABELS.repeat(2)[:305].contiguous()) as loader:
        for batch in loader:
            assert torch.equal(batch.x, longer[batch.input_nodes])
    with pytest.raises(pingpong.TableError, match=r"features\['author'\] has 39 rows, but the "
                                                  r"source's graph has 40 nodes of type 'author'"):
        PingPongLoader(dgl.dataloading.DataLoader(
            _hetero_graph(), {"paper": torch.arange(8)}, dgl.dataloading.NeighborSampler([2]),
            batch_size=4), {"paper": FEATURES, "author": torch.zeros(39, 2)}, heterogeneous=True)


def test_a_homogeneous_loader_over_a_graph_of_several_node_types_points_at_heterogeneous():
    """heterogeneous=True forgotten over a graph of two node types: the graph's node
    counts say nothing about a homogeneous table (no 'pad it' TableError against the
    first node type's count); the first batch's dict ids point at heterogeneous=True."""
    source = dgl.dataloading.DataLoader(
        _hetero_graph(), {"author": torch.arange(8)}, dgl.dataloading.NeighborSampler([2]),
        batch_size=4)
    author_features = torch.zeros(20, 2)  # fewer rows than the graph's 40 authors
    with PingPongLoader(source, author_features) as loader:
        with pytest.raises(pingpong.IdTypeError, match="heterogeneous=True"):
            next(iter(loader))


def test_a_label_table_too_short_for_its_seed_nodes_is_refused_when_built():
    source = dgl.dataloading.DataLoader(
        _hetero_graph(), {"author": torch.arange(5, 20)}, dgl.dataloading.NeighborSampler([2]),
        batch_size=5)
    with pytest.raises(pingpong.TableError, match=r"labels\['author'\] has 10 rows, but the "
                                                  r"loader's seed nodes of type 'author' "
                                                  r"include id 19"):
        PingPongLoader(source, {"paper": FEATURES}, {"author": torch.arange(10)},
                       heterogeneous=True)
    with pytest.raises(pingpong.TableError, match=r"labels\['author'\] has 19 rows, but .* "
                                                  r"include id 19"):  # one row short
        PingPongLoader(source, {"paper": FEATURES}, {"author": torch.arange(19)},
                       heterogeneous=True)
    with PingPongLoader(source, {"paper": FEATURES}, {"author": torch.arange(20)},
                        heterogeneous=True) as loader:
        for batch in loader:
            assert isinstance(batch.y, dict)
            assert torch.equal(batch.y["author"], batch.output_nodes["author"])


def test_a_parent_graphs_table_over_a_subgraph_is_warned_about():
    """A DataLoader over a node subgraph yields the subgraph's own ids: the parent's
    feature table (more rows, and the graph has ndata[dgl.NID]) gathers the wrong
    rows -- a warning saying so; the subgraph's own table is taken silently."""
    sub = dgl.node_subgraph(_graph(), torch.arange(0, NUM_NODES, 2))
    source = dgl.dataloading.DataLoader(sub, torch.arange(20),
                                        dgl.dataloading.NeighborSampler([2]), batch_size=10)
    with pytest.warns(UserWarning, match=r"features has 300 rows, but the source's graph is "
                                         r"a subgraph \(it has ndata\[dgl.NID\]\) of 150 "
                                         r"nodes") as caught:
        PingPongLoader(source, FEATURES).close()
    assert len(caught) == 1
    own = FEATURES[sub.ndata[dgl.NID]]
    with PingPongLoader(source, own) as loader:
        for batch in loader:
            assert torch.equal(batch.x, FEATURES[sub.ndata[dgl.NID][batch.input_nodes]])


def test_with_form_table_keys_need_not_be_node_types():
    """form= says what each table is gathered at: per-edge-type features keyed by edge
    type on a heterogeneous loader are taken as given."""
    source, cites = _two_edge_type_source()
    edge_feats = {"cites": torch.arange(NUM_EDGES * 2.0).reshape(NUM_EDGES, 2)}
    with PingPongLoader(source, edge_feats, heterogeneous=True,
                        form=lambda item: ({"cites": item[1].edata[dgl.EID][cites]},
                                           None)) as loader:
        for batch in loader:
            assert isinstance(batch.x, dict)
            assert torch.equal(batch.x["cites"],
                               edge_feats["cites"][batch.item[1].edata[dgl.EID][cites]])
