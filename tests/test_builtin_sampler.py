"""The built-in sampler against brute force on small graphs (and against DGL)."""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from conftest import wait_for_no_pingpong_threads

import pingpong
from pingpong.blocks import EdgeBlock
from pingpong.sources import BuiltinLoader, CSRGraph, NeighborSampler

HAVE_DGL = importlib.util.find_spec("dgl") is not None


def random_graph(num_nodes: int = 120, num_edges: int = 900, seed: int = 0) -> CSRGraph:
    """A simple directed graph (no duplicate edges) with a hub of in-degree > 64
    and nodes without in-edges."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, num_nodes, num_edges)
    dst = rng.integers(0, num_nodes - 5, num_edges)  # the last 5 nodes: no in-edges
    hub_src = np.arange(num_nodes)
    hub_src = hub_src[hub_src != 0]
    src = np.concatenate([src, hub_src])  # node 0: in-degree ~ num_nodes
    dst = np.concatenate([dst, np.zeros_like(hub_src)])
    keep = src != dst
    pairs = np.unique(np.stack([src[keep], dst[keep]], 1), axis=0)
    return CSRGraph.from_edges(pairs[:, 0], pairs[:, 1], num_nodes)


def in_neighbours(graph: CSRGraph) -> list[set[int]]:
    ip, ix = graph.indptr.tolist(), graph.indices.tolist()
    return [set(ix[ip[v]:ip[v + 1]]) for v in range(graph.num_nodes)]


def check_triple(graph: CSRGraph, fanouts: list[int], triple, seeds: torch.Tensor) -> None:
    """Every documented invariant of one sampled batch, checked by brute force."""
    input_nodes, output_nodes, blocks = triple
    nbrs = in_neighbours(graph)
    assert input_nodes.dtype == torch.int64
    assert output_nodes.dtype == torch.int64
    assert torch.equal(output_nodes, seeds)
    assert len(blocks) == len(fanouts)
    assert all(isinstance(b, EdgeBlock) for b in blocks)
    assert blocks[0].num_src_nodes == len(input_nodes)
    assert blocks[-1].num_dst_nodes == len(output_nodes)
    assert len(set(input_nodes.tolist())) == len(input_nodes)  # distinct
    assert torch.equal(input_nodes[: len(output_nodes)], output_nodes)
    for i in range(len(blocks) - 1):
        assert blocks[i].num_dst_nodes == blocks[i + 1].num_src_nodes
    ids = input_nodes.tolist()
    for block, fanout in zip(blocks, fanouts, strict=True):
        assert block.src.dtype == torch.int64
        assert block.dst.dtype == torch.int64
        assert block.num_dst_nodes <= block.num_src_nodes
        src, dst = block.src.tolist(), block.dst.tolist()
        assert all(0 <= s < block.num_src_nodes for s in src)
        assert all(0 <= d < block.num_dst_nodes for d in dst)
        per_dst: dict[int, list[int]] = {d: [] for d in range(block.num_dst_nodes)}
        for s, d in zip(src, dst, strict=True):
            # local id j of any layer is global node input_nodes[j]
            assert ids[s] in nbrs[ids[d]], "sampled edge not in the graph"
            per_dst[d].append(ids[s])
        for d, got in per_dst.items():
            degree = len(nbrs[ids[d]])
            assert len(got) == (degree if fanout == -1 else min(degree, fanout))
            assert len(set(got)) == len(got), "sampled with replacement"
        # the source nodes are exactly the destination nodes plus the sampled neighbours
        sampled = {ids[s] for s in src}
        assert set(ids[: block.num_src_nodes]) == set(ids[: block.num_dst_nodes]) | sampled


@pytest.mark.parametrize("fanouts", [[3], [4, 2], [-1, 5], [70, 2], [2, 3, 100]],
                         ids=lambda f: ",".join(map(str, f)))
def test_invariants_brute_force(fanouts: list[int]) -> None:
    graph = random_graph()
    seeds = torch.tensor([0, 7, 119, 3, 50, 118, 22])
    triple = NeighborSampler(fanouts).sample_blocks(graph, seeds, rng_seed=5)
    check_triple(graph, fanouts, triple, seeds)


def test_loader_batches_obey_invariants_and_cover_seeds() -> None:
    graph = random_graph()
    seeds = torch.arange(0, 120, 3)
    loader = BuiltinLoader(graph, seeds, NeighborSampler([5, 3]), batch_size=8, shuffle=True,
                           seed=1)
    seen = []
    for triple in loader:
        check_triple(graph, [5, 3], triple, triple[1])
        seen.append(triple[1])
    assert sorted(torch.cat(seen).tolist()) == seeds.tolist()


def test_csr_from_edges_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    src, dst = rng.integers(0, 30, 200), rng.integers(0, 30, 200)
    graph = CSRGraph.from_edges(src, dst, 30)
    for v in range(30):
        got = graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist()
        assert got == src[dst == v].tolist()  # stable: edge order kept, duplicates kept
    assert torch.equal(graph.in_degrees(), torch.bincount(torch.from_numpy(dst), minlength=30))
    assert graph.num_edges == 200


def test_numpy_inputs_of_any_layout_are_taken() -> None:
    """Reversed views and read-only arrays (``np.load(..., mmap_mode="r")``) for the
    edges and the seeds: the same graph and batches as from contiguous copies."""
    rng = np.random.default_rng(5)
    src, dst = rng.integers(0, 30, 200), rng.integers(0, 30, 200)
    frozen_src, frozen_dst = src.copy(), dst.copy()
    frozen_src.flags.writeable = frozen_dst.flags.writeable = False
    graph = CSRGraph.from_edges(frozen_src, frozen_dst, 30)
    same = CSRGraph.from_edges(src, dst, 30)
    assert torch.equal(graph.indptr, same.indptr)
    assert torch.equal(graph.indices, same.indices)
    reversed_graph = CSRGraph.from_edges(src[::-1], dst[::-1], 30)
    assert torch.equal(reversed_graph.indices,
                       CSRGraph.from_edges(src[::-1].copy(), dst[::-1].copy(), 30).indices)
    seeds = np.arange(30)[::-1]
    loader = BuiltinLoader(graph, seeds, NeighborSampler([3]), 8, seed=1)
    copied = BuiltinLoader(graph, seeds.copy(), NeighborSampler([3]), 8, seed=1)
    for (i, o, _), (ci, co, _) in zip(loader, copied, strict=True):
        assert torch.equal(i, ci)
        assert torch.equal(o, co)


def test_csr_validation() -> None:
    with pytest.raises(IndexError):
        CSRGraph.from_edges([0, 5], [1, 2], 5)
    with pytest.raises(ValueError):
        CSRGraph.from_edges([0, 1], [1], 5)
    with pytest.raises(TypeError):
        CSRGraph.from_edges([0.0, 1.0], [1, 2], 5)
    with pytest.raises(ValueError):
        CSRGraph(torch.tensor([0, 1]), torch.tensor([0, 0]), 1)  # indptr[-1] != len(indices)
    with pytest.raises(TypeError):
        CSRGraph(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]), 1)


@pytest.mark.parametrize("bad", [10**10, 2, -1], ids=["far", "num_nodes", "negative"])
def test_csr_neighbour_ids_outside_the_graph_are_refused(bad: int) -> None:
    """Before any sampler reads them (the Numba sampler would read out of bounds)."""
    with pytest.raises(IndexError, match=r"CSRGraph.indices must lie in \[0, 2\)"):
        CSRGraph(torch.tensor([0, 1, 2]), torch.tensor([1, bad]), 2)


def test_csr_decreasing_indptr_is_refused() -> None:
    with pytest.raises(ValueError, match="non-decreasing: node 1's in-edges would run from"):
        CSRGraph(torch.tensor([0, 10**9, 1]), torch.tensor([0]), 2)


def test_seed_nodes_changed_after_the_loader_was_built_reach_no_epoch() -> None:
    """From an input review: the loader kept the caller's seed tensor, checked
    once, and the Numba sampler reads it unchecked -- an id set past the graph
    afterwards killed the process (SIGSEGV). It keeps a copy now."""
    graph = random_graph()
    seeds = torch.arange(40)
    loader = BuiltinLoader(graph, seeds, NeighborSampler([3, 2]), batch_size=16, seed=3)
    reference = BuiltinLoader(graph, torch.arange(40), NeighborSampler([3, 2]),
                              batch_size=16, seed=3)
    seeds[5] = 100  # in range, so the old code sampled it without a crash
    loader.seed_nodes[6] = 101  # a copy: nor through the attribute
    for got, want in zip(loader, reference, strict=True):
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])
        assert all(torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst)
                   for a, b in zip(got[2], want[2], strict=True))


def _sample_all(graph: CSRGraph, seeds: torch.Tensor, node_map: np.ndarray) -> Any:
    return NeighborSampler([-1, -1]).sample_blocks(graph, seeds, 0, node_map=node_map)


@pytest.mark.parametrize("change", ["neighbour past the graph", "negative neighbour",
                                    "indptr backwards", "indptr past indices",
                                    "indptr resized"])
def test_a_graph_changed_after_its_checks_is_refused_where_it_is_sampled(change: str) -> None:
    """CSRGraph's tensors are read in place: a change after construction that
    breaks its rules raises at the batch that reaches it -- the Numba sampler
    checks every index it reads -- instead of reading or writing out of bounds;
    the scratch ``node_map`` stays all -1, so the next batch after the tensors
    are put back samples as before."""
    graph = random_graph()
    seeds = torch.tensor([3, 0, 7])
    node_map = np.full(graph.num_nodes, -1, dtype=np.int64)
    before = _sample_all(graph, seeds, node_map)
    saved_indptr, saved_indices = graph.indptr.clone(), graph.indices.clone()
    first = int(graph.indptr[3])  # node 3's first in-edge
    expected: type[Exception]
    if change == "neighbour past the graph":
        graph.indices[first] = graph.num_nodes
        expected, message = pingpong.IdRangeError, r"CSRGraph.indices holds a node id outside"
    elif change == "negative neighbour":
        graph.indices[first] = -(10**12)
        expected, message = pingpong.IdRangeError, r"CSRGraph.indices holds a node id outside"
    elif change == "indptr backwards":
        graph.indptr[4] = graph.indptr[3] - 1
        expected, message = pingpong.ConfigError, "CSRGraph.indptr is decreasing"
    elif change == "indptr past indices":
        graph.indptr[4] = graph.num_edges + 10**6
        expected, message = pingpong.ConfigError, "runs past the end of CSRGraph.indices"
    else:
        graph.indptr.resize_(4)
        expected, message = pingpong.ConfigError, "CSRGraph.indptr has 4 entries now"
    with pytest.raises(expected, match=message) as info:
        _sample_all(graph, seeds, node_map)
    assert "changed after CSRGraph checked them" in str(info.value)
    assert (node_map == -1).all()
    graph.indptr.resize_(saved_indptr.shape[0]).copy_(saved_indptr)
    graph.indices.copy_(saved_indices)
    after = _sample_all(graph, seeds, node_map)
    assert torch.equal(after[0], before[0])
    assert all(torch.equal(a.src, b.src) for a, b in zip(after[2], before[2], strict=True))


def test_a_graph_changed_under_a_temporary_loader_fails_its_training_loop() -> None:
    """The same through pingpong, written as users write it: the sampler's error
    reaches the loop from the producer thread, and no producer is left."""
    graph = random_graph()
    features = torch.randn(graph.num_nodes, 4)
    graph.indices[int(graph.indptr[0])] = 10**12  # node 0, the hub, is in every batch
    got = 0
    with pytest.raises(pingpong.IdRangeError, match="changed after CSRGraph checked them"):
        for _batch in pingpong.PingPongLoader(
                BuiltinLoader(graph, torch.tensor([0, 1, 2]), NeighborSampler([-1]),
                              batch_size=3), features):
            got += 1
    assert got == 0
    assert wait_for_no_pingpong_threads(3.0) == []


def test_fanout_all_and_isolated_nodes() -> None:
    graph = random_graph()
    _, _, blocks = NeighborSampler([-1]).sample_blocks(graph, torch.tensor([119, 0]), 0)
    degree = graph.in_degrees()
    assert blocks[0].num_edges == int(degree[119] + degree[0])
    assert int(degree[119]) == 0
    assert int((blocks[0].dst == 0).sum()) == 0


def test_determinism_by_seed() -> None:
    graph = random_graph()
    seeds = torch.arange(100)

    def epochs(seed: int) -> list:
        loader = BuiltinLoader(graph, seeds, NeighborSampler([4, 4]), 16, shuffle=True,
                               seed=seed)
        return [list(loader) for _ in range(2)]

    def flat(run: list) -> list[torch.Tensor]:
        out = []
        for epoch in run:
            for inp, outp, blocks in epoch:
                out += [inp, outp] + [t for b in blocks for t in (b.src, b.dst)]
        return out

    a, b, c = flat(epochs(7)), flat(epochs(7)), flat(epochs(8))
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert len(a) != len(c) or not all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_the_seed_sets_both_the_order_and_the_draws() -> None:
    """Each on its own: another seed reorders the seeds (shuffle=True), and draws other
    neighbours for the same seeds (shuffle=False).  A shuffle or a sampler that ignored
    ``seed`` passed the test above, the other one still differing."""
    graph = random_graph()
    seeds = torch.arange(100)

    def order(seed: int) -> torch.Tensor:
        loader = BuiltinLoader(graph, seeds, NeighborSampler([2]), 10, shuffle=True, seed=seed)
        return torch.cat([o for _, o, _ in loader])

    def draws(seed: int) -> list[torch.Tensor]:
        loader = BuiltinLoader(graph, seeds, NeighborSampler([4]), 10, seed=seed)
        return [i for i, _, _ in loader]

    assert torch.equal(order(7), order(7))
    assert not torch.equal(order(7), order(8))
    assert sorted(order(8).tolist()) == seeds.tolist()
    same, other = draws(7), draws(8)
    assert all(torch.equal(x, y) for x, y in zip(same, draws(7), strict=True))
    assert not all(x.shape == y.shape and torch.equal(x, y)
                   for x, y in zip(same, other, strict=True))


def test_each_batch_draws_its_own_neighbours() -> None:
    """Seeds with the same in-neighbour list, one per batch: every batch must not pick
    the same positions of it (a sampler seeded alike for every batch of an epoch did)."""
    hubs = np.arange(50, 100)
    src = np.tile(hubs, 50)
    dst = np.repeat(np.arange(50), len(hubs))  # nodes 0..49: in-neighbours 50..99, in order
    graph = CSRGraph.from_edges(src, dst, 100)
    loader = BuiltinLoader(graph, torch.arange(50), NeighborSampler([3]), 1, seed=4)
    picked = {tuple(sorted(inputs[1:].tolist())) for inputs, _, _ in loader}
    assert len(picked) > 25  # 50 batches, C(50, 3) = 19600 choices each


def test_reshuffle_per_epoch_and_set_epoch() -> None:
    graph = random_graph()
    seeds = torch.arange(100)
    loader = BuiltinLoader(graph, seeds, NeighborSampler([2]), 10, shuffle=True, seed=3)
    e0 = torch.cat([o for _, o, _ in loader])
    e1 = torch.cat([o for _, o, _ in loader])
    assert loader.epoch == 2
    assert not torch.equal(e0, e1)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == seeds.tolist()
    loader.set_epoch(0)
    again = list(loader)
    assert torch.equal(torch.cat([o for _, o, _ in again]), e0)

    ordered = BuiltinLoader(graph, seeds, NeighborSampler([2]), 10, shuffle=False)
    first = list(ordered)
    second = list(ordered)
    assert torch.equal(torch.cat([o for _, o, _ in first]), seeds)
    # no shuffle: same seed order, but each epoch draws fresh neighbours
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=True))


def test_numpy_integer_arguments_are_the_same_as_ints() -> None:
    """``np.int64`` batch size, seed and epoch: the same epochs as with Python ints."""
    graph = random_graph()
    seeds = torch.arange(100)
    plain = BuiltinLoader(graph, seeds, NeighborSampler([2]), 10, shuffle=True, seed=3)
    numpy = BuiltinLoader(graph, seeds, NeighborSampler([2]), np.int64(10), shuffle=True,
                          seed=np.int64(3))
    plain.set_epoch(2)
    numpy.set_epoch(np.int64(2))
    a, b = list(plain), list(numpy)
    assert len(a) == len(b) == 10
    for (ia, oa, _), (ib, ob, _) in zip(a, b, strict=True):
        assert torch.equal(oa, ob)
        assert torch.equal(ia, ib)
    with pytest.raises(ValueError, match="batch_size"):
        yes: Any = np.bool_(True)
        BuiltinLoader(graph, seeds, NeighborSampler([2]), yes)


@pytest.mark.parametrize(("drop_last", "expected"), [(False, [4, 4, 2]), (True, [4, 4])])
def test_len_and_drop_last(drop_last: bool, expected: list[int]) -> None:
    graph = random_graph()
    loader = BuiltinLoader(graph, torch.arange(10), NeighborSampler([2]), 4,
                           drop_last=drop_last)
    assert len(loader) == len(expected)
    assert [len(o) for _, o, _ in loader] == expected


def test_iterators_are_independent() -> None:
    graph = random_graph()
    loader = BuiltinLoader(graph, torch.arange(40), NeighborSampler([3, 3]), 8, seed=2)
    it0, it1 = iter(loader), iter(loader)  # epochs 0 and 1, interleaved
    mixed0 = []
    for a, b in zip(it0, it1, strict=True):
        mixed0.append(a)
        del b
    loader.set_epoch(0)
    for (i0, o0, b0), (i1, o1, b1) in zip(mixed0, loader, strict=True):
        assert torch.equal(i0, i1)
        assert torch.equal(o0, o1)
        assert all(torch.equal(x.src, y.src) for x, y in zip(b0, b1, strict=True))


@pytest.mark.parametrize(("degree", "fanout"), [(10, 3), (100, 70)], ids=["floyd", "fisher-yates"])
def test_uniform_without_replacement(degree: int, fanout: int) -> None:
    graph = CSRGraph.from_edges(torch.arange(1, degree + 1), torch.zeros(degree, dtype=torch.long),
                                degree + 1)
    sampler = NeighborSampler([fanout])
    counts: Counter[int] = Counter()
    draws = 3000
    for r in range(draws):
        inp, _, (block,) = sampler.sample_blocks(graph, torch.tensor([0]), rng_seed=r)
        picked = inp[block.src].tolist()
        assert len(set(picked)) == fanout
        counts.update(picked)
    expected = draws * fanout / degree
    assert set(counts) == set(range(1, degree + 1))
    # Each count is Binomial(draws, fanout / degree): within 5 standard deviations.
    # (Floyd's draw off by one -- randint(0, j) for randint(0, j + 1) -- leaves the
    # last positions about 25% short: 10 standard deviations here.)
    sd = math.sqrt(draws * fanout / degree * (1 - fanout / degree))
    assert max(abs(c - expected) for c in counts.values()) < 5 * sd


def test_argument_validation() -> None:
    graph = random_graph()
    for bad in ([], [0], [-2], [1.5], "10,10"):
        with pytest.raises((TypeError, ValueError)):
            NeighborSampler(bad)  # type: ignore[arg-type]
    sampler = NeighborSampler([2])
    with pytest.raises(IndexError):
        sampler.sample_blocks(graph, torch.tensor([120]), 0)
    with pytest.raises(ValueError):
        sampler.sample_blocks(graph, torch.tensor([1, 1]), 0)
    with pytest.raises(ValueError):
        BuiltinLoader(graph, torch.tensor([1, 2, 1]), sampler, 2)
    with pytest.raises(ValueError):
        BuiltinLoader(graph, torch.arange(4), sampler, 0)
    with pytest.raises(TypeError):
        BuiltinLoader(graph, torch.arange(4), [2], 2)  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        BuiltinLoader(graph, torch.tensor([-1]), sampler, 2)


# --------------------------------------------------------------------------- DGL parity


def _dgl_graph(graph: CSRGraph):
    import dgl

    ip = graph.indptr
    dst = torch.repeat_interleave(torch.arange(graph.num_nodes), ip[1:] - ip[:-1])
    return dgl.graph((graph.indices, dst), num_nodes=graph.num_nodes)


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
def test_from_dgl_matches_from_edges() -> None:
    graph = random_graph()
    other = CSRGraph.from_dgl(_dgl_graph(graph))
    assert torch.equal(other.indptr, graph.indptr)
    assert in_neighbours(other) == in_neighbours(graph)


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
@pytest.mark.parametrize("fanouts", [[4, 3], [-1, -1]], ids=["sampled", "full"])
def test_same_triple_conventions_as_dgl(fanouts: list[int]) -> None:
    import dgl

    graph = random_graph()
    g = _dgl_graph(graph)
    seeds = torch.arange(0, 120, 2)
    ours = list(BuiltinLoader(graph, seeds, NeighborSampler(fanouts), 16))
    theirs = list(dgl.dataloading.DataLoader(g, seeds, dgl.dataloading.NeighborSampler(fanouts),
                                             batch_size=16, shuffle=False))
    assert len(ours) == len(theirs)
    for (i0, o0, b0), (i1, o1, b1) in zip(ours, theirs, strict=True):
        assert (i0.dtype, o0.dtype, i0.dim()) == (i1.dtype, o1.dtype, i1.dim())
        assert torch.equal(o0, o1)
        assert len(b0) == len(b1)
        # DGL's own prefix convention, which ours documents and mirrors
        assert torch.equal(b1[0].srcdata[dgl.NID], i1)
        assert torch.equal(b1[-1].dstdata[dgl.NID], o1)
        for blk in b1:
            nid = blk.srcdata[dgl.NID]
            assert torch.equal(nid, i1[: blk.num_src_nodes()])
            assert torch.equal(blk.dstdata[dgl.NID], nid[: blk.num_dst_nodes()])
        assert b0[-1].num_dst_nodes == b1[-1].num_dst_nodes()
        if fanouts == [-1, -1]:  # no randomness: the same nodes and global edges
            assert set(i0.tolist()) == set(i1.tolist())
            for ours_b, dgl_b in zip(b0, b1, strict=True):
                assert ours_b.num_src_nodes == dgl_b.num_src_nodes()
                assert ours_b.num_dst_nodes == dgl_b.num_dst_nodes()
                s, d = dgl_b.edges()
                ours_edges = zip(i0[ours_b.src].tolist(), i0[ours_b.dst].tolist(), strict=True)
                dgl_edges = zip(i1[s.long()].tolist(), i1[d.long()].tolist(), strict=True)
                assert sorted(ours_edges) == sorted(dgl_edges)


def test_uint64_seeds_past_int64_are_named_as_given() -> None:
    """A uint64 seed of 2**63 + 1 is refused with its own value (it was reported as
    the negative number it wraps to)."""
    with pytest.raises(IndexError, match=r"seed_nodes holds 9223372036854775809"):
        BuiltinLoader(random_graph(), np.array([1, 2**63 + 1], dtype=np.uint64),
                      NeighborSampler([2]), 4)
