"""The synthetic graph: determinism, shapes, skew, and that the graph matters."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from pingpong import ConfigError
from pingpong.sources import SyntheticGraph, make_synthetic_graph

FIELDS = ("src", "dst", "features", "labels", "train_idx", "val_idx", "test_idx")


@pytest.fixture(scope="module")
def graph() -> SyntheticGraph:
    return make_synthetic_graph(num_nodes=20_000, num_classes=8, feat_dim=64, avg_degree=12,
                                seed=1)


def test_deterministic_by_seed(graph: SyntheticGraph) -> None:
    again = make_synthetic_graph(num_nodes=20_000, num_classes=8, feat_dim=64, avg_degree=12,
                                 seed=1)
    other = make_synthetic_graph(num_nodes=20_000, num_classes=8, feat_dim=64, avg_degree=12,
                                 seed=2)
    for name in FIELDS:
        assert torch.equal(getattr(graph, name), getattr(again, name)), name
    assert not torch.equal(graph.labels, other.labels)
    assert not torch.equal(graph.features, other.features)
    assert not torch.equal(graph.src, other.src)
    for name in ("train_idx", "val_idx", "test_idx"):  # the splits are drawn from it too
        assert not torch.equal(getattr(graph, name), getattr(other, name)), name


def test_shapes_and_dtypes(graph: SyntheticGraph) -> None:
    n = graph.num_nodes
    assert graph.features.shape == (n, 64)
    assert graph.features.dtype == torch.float32
    assert graph.labels.shape == (n,)
    assert graph.labels.dtype == torch.int64
    assert int(graph.labels.min()) >= 0
    assert int(graph.labels.max()) < graph.num_classes == 8
    assert torch.equal(torch.unique(graph.labels), torch.arange(8))  # every class occurs
    assert graph.src.dtype == graph.dst.dtype == torch.int64
    assert 9 < graph.num_edges / n <= 12  # duplicates and self-loops cost a little
    splits = [graph.train_idx, graph.val_idx, graph.test_idx]
    assert [len(s) for s in splits] == [int(0.3 * n), int(0.05 * n), int(0.1 * n)]
    everything = torch.cat(splits)
    assert len(torch.unique(everything)) == len(everything)
    for s in splits:
        assert torch.equal(s, torch.sort(s).values)


def test_edges_simple_and_symmetric(graph: SyntheticGraph) -> None:
    n = graph.num_nodes
    assert not bool((graph.src == graph.dst).any())
    fwd = graph.src * n + graph.dst
    assert len(torch.unique(fwd)) == len(fwd)
    assert torch.equal(torch.sort(fwd).values, torch.sort(graph.dst * n + graph.src).values)


def test_skewed_degrees(graph: SyntheticGraph) -> None:
    degree = torch.bincount(graph.dst, minlength=graph.num_nodes).float()
    assert float(degree.max()) > 15 * float(degree.median())
    assert float(degree.mean()) > 1.3 * float(degree.median())


def test_communities_follow_labels(graph: SyntheticGraph) -> None:
    same = float((graph.labels[graph.src] == graph.labels[graph.dst]).float().mean())
    expected = 0.6 + 0.4 / graph.num_classes  # homophily + chance of a random edge
    assert abs(same - expected) < 0.03


def test_neighbours_carry_the_signal(graph: SyntheticGraph) -> None:
    """Nearest class centroid: own features are mediocre, neighbour means much better."""
    x, y = graph.features, graph.labels
    centroids = torch.stack([x[graph.train_idx][y[graph.train_idx] == c].mean(0)
                             for c in range(graph.num_classes)])
    degree = torch.bincount(graph.dst, minlength=graph.num_nodes).clamp(min=1)
    neigh = torch.zeros_like(x).index_add_(0, graph.dst, x[graph.src]) / degree[:, None]
    test = graph.test_idx

    def accuracy(h: torch.Tensor) -> float:
        return float((torch.cdist(h[test], centroids).argmin(1) == y[test]).float().mean())

    own, with_neighbours = accuracy(x), accuracy(x + neigh)
    assert 0.2 < own < 0.7
    assert with_neighbours > own + 0.15


def test_to_csr(graph: SyntheticGraph) -> None:
    csr = graph.to_csr()
    assert csr.num_nodes == graph.num_nodes
    assert csr.num_edges == graph.num_edges
    assert torch.equal(csr.in_degrees(), torch.bincount(graph.dst, minlength=graph.num_nodes))


@pytest.mark.dgl
@pytest.mark.skipif(importlib.util.find_spec("dgl") is None, reason="DGL is not installed")
def test_to_dgl(graph: SyntheticGraph) -> None:
    g = graph.to_dgl()
    assert g.num_nodes() == graph.num_nodes
    assert g.num_edges() == graph.num_edges
    assert torch.equal(g.ndata["feat"], graph.features)
    assert torch.equal(g.ndata["label"], graph.labels)
    for name in ("train", "val", "test"):
        mask = g.ndata[f"{name}_mask"]
        assert mask.dtype == torch.bool
        assert torch.equal(torch.nonzero(mask, as_tuple=True)[0], getattr(graph, f"{name}_idx"))


def test_feat_dtype() -> None:
    g = make_synthetic_graph(num_nodes=500, num_classes=4, feat_dim=8, avg_degree=4,
                             feat_dtype=torch.bfloat16)
    assert g.features.dtype == torch.bfloat16


def test_numpy_integer_sizes_give_the_same_graph_of_python_ints() -> None:
    """Sizes and seed as NumPy integers (typed ``Count``): the same graph, and its
    ``num_nodes``/``num_classes`` are Python ints (they were stored as given)."""
    plain = make_synthetic_graph(num_nodes=500, num_classes=4, feat_dim=8, avg_degree=4, seed=3)
    numpy = make_synthetic_graph(num_nodes=np.int64(500), num_classes=np.int32(4),
                                 feat_dim=np.int64(8), avg_degree=4, seed=np.int64(3))
    assert type(numpy.num_nodes) is int
    assert type(numpy.num_classes) is int
    for name in FIELDS:
        assert torch.equal(getattr(plain, name), getattr(numpy, name)), name


@pytest.mark.parametrize(("kwargs", "names"), [
    (dict(num_nodes=0), "num_nodes"), (dict(num_classes=0), "num_classes"),
    (dict(feat_dim=-1), "feat_dim"), (dict(avg_degree=-1.0), "avg_degree"),
    (dict(seed=-1), "seed"), (dict(feat_dtype=torch.int64), "feat_dtype"),
    (dict(homophily=1.5), "homophily"), (dict(homophily=-0.1), "homophily"),
    (dict(power_law_exponent=1.5), "power_law_exponent"),
    (dict(train_frac=0.9, val_frac=0.2), "split fractions"),
    (dict(train_frac=-0.1), "split fractions"), (dict(test_frac=-0.05), "split fractions"),
    (dict(num_nodes=3, num_classes=4), "num_classes"),
])
def test_validation(kwargs: dict, names: str) -> None:
    """Each bad argument is refused with a ``ConfigError`` (a ``ValueError``) naming it."""
    with pytest.raises(ConfigError, match=names):
        make_synthetic_graph(**kwargs)


def test_the_limits_themselves_are_accepted() -> None:
    """Split fractions summing to exactly 1 split every node; as many classes as
    nodes is allowed (the checks are ``> 1`` and ``>``, not ``>=``)."""
    g = make_synthetic_graph(num_nodes=400, num_classes=4, feat_dim=2, avg_degree=4,
                             train_frac=0.5, val_frac=0.25, test_frac=0.25)
    assert [len(s) for s in (g.train_idx, g.val_idx, g.test_idx)] == [200, 100, 100]
    assert torch.equal(torch.sort(torch.cat([g.train_idx, g.val_idx, g.test_idx])).values,
                       torch.arange(400))
    assert make_synthetic_graph(num_nodes=5, num_classes=5, feat_dim=2).num_classes == 5


def test_fractions_that_sum_to_one_in_decimal_are_accepted() -> None:
    """0.34 + 0.56 + 0.1 is 1.0000000000000002 in floats: not a bad argument."""
    g = make_synthetic_graph(num_nodes=1000, num_classes=4, feat_dim=2, avg_degree=4,
                             train_frac=0.34, val_frac=0.56, test_frac=0.1)
    sizes = [len(s) for s in (g.train_idx, g.val_idx, g.test_idx)]
    assert sizes == [int(0.34 * 1000), int(0.56 * 1000), int(0.1 * 1000)]
    assert sum(sizes) <= 1000
    assert len(torch.unique(torch.cat([g.train_idx, g.val_idx, g.test_idx]))) == sum(sizes)


def _ccdf_slope(degree: torch.Tensor, lo: float, hi: float) -> float:
    """Least-squares slope of log P(D >= x) against log x, for x in [lo, hi]."""
    xs = torch.logspace(math.log10(lo), math.log10(hi), 12, dtype=torch.float64)
    ys = torch.stack([(degree >= x).double().mean() for x in xs])
    lx, ly = xs.log(), ys.log()
    dx = lx - lx.mean()
    return -float((dx * (ly - ly.mean())).sum() / (dx * dx).sum())


@pytest.mark.parametrize("exponent", [2.2, 2.5, 3.0])
def test_powerlaw_degrees_follow_the_exponent(exponent: float) -> None:
    """The degree CCDF falls as x ** -(exponent - 1) between degree 30 and 300
    (measured: within 0.035 of it for these three exponents, seed 3)."""
    g = make_synthetic_graph(num_nodes=200_000, num_classes=4, feat_dim=1, avg_degree=15,
                             power_law_exponent=exponent, seed=3)
    degree = torch.bincount(g.dst, minlength=g.num_nodes)
    assert abs(_ccdf_slope(degree, 30, 300) - (exponent - 1)) < 0.1


def test_uniform_degrees_are_poisson() -> None:
    g = make_synthetic_graph(num_nodes=200_000, num_classes=4, feat_dim=1, avg_degree=15,
                             graph_kind="uniform", seed=3)
    degree = torch.bincount(g.dst, minlength=g.num_nodes).double()
    mean = float(degree.mean())
    assert 14 < mean <= 15
    assert abs(float(degree.var()) / mean - 1) < 0.1  # Poisson: variance = mean
    assert float(degree.max()) < 3 * mean  # no hubs


def test_graph_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="graph_kind"):
        make_synthetic_graph(num_nodes=100, graph_kind="rmat")
