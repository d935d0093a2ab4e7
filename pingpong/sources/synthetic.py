"""A seeded synthetic node-classification graph (no download, no DGL needed).

The graph is built so that neighbour aggregation matters, which makes it a
useful check that a pipeline really delivers the right features and blocks:

- **Skewed degrees** (``graph_kind="powerlaw"``, the default). Each node gets
  a Pareto weight ``w`` with ``P(w > x) = x ** -(power_law_exponent - 1)``,
  capped at ``sqrt(N * avg_degree) / 4``; edges pick both endpoints in
  proportion to the weights (a Chung-Lu graph), so the expected degree is
  proportional to the weight: the degree distribution has density exponent
  ``power_law_exponent`` (2.5 by default: real graphs such as ogbn-products
  and Reddit lie between 2 and 3), a few hubs have hundreds of neighbours and
  most nodes a handful. Under neighbour sampling the hubs are the hot rows a
  feature cache keeps. ``graph_kind="uniform"`` gives every node the same
  weight instead (Poisson degrees, no hot rows: a control).
- **Communities = labels.** With probability ``homophily`` an edge stays
  inside its first endpoint's label community; otherwise its second endpoint
  is drawn from the whole graph.
- **Noisy features.** ``x_v = signal * mu[label_v] + N(0, I)`` with random
  unit-variance class centres ``mu``; at the default ``feature_signal`` a
  features-only classifier is far from perfect while averaging over
  neighbours (mostly of the same class) removes most of the noise.

Edges are undirected (stored in both directions), without self-loops or
duplicates. Everything is generated from one ``torch.Generator`` seeded with
``seed``: the same arguments give bit-identical tensors on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._integers import Count, integer
from ..errors import ConfigError
from .builtin import CSRGraph

__all__ = ["GRAPH_KINDS", "SyntheticGraph", "make_synthetic_graph"]

#: The degree distributions :func:`make_synthetic_graph` generates.
GRAPH_KINDS = ("powerlaw", "uniform")


@dataclass(frozen=True, eq=False)
class SyntheticGraph:
    """A node-classification dataset: graph, features, labels and splits.

    Attributes:
        src, dst: int64 ``(E,)`` directed edges ``src -> dst``; every edge
            appears in both directions.
        num_nodes: number of nodes ``N``.
        features: ``(N, F)`` feature table (dtype chosen at generation).
        labels: int64 ``(N,)`` in ``[0, num_classes)``.
        train_idx, val_idx, test_idx: disjoint, sorted int64 node ids.
        num_classes: number of classes.
    """

    src: torch.Tensor
    dst: torch.Tensor
    num_nodes: int
    features: torch.Tensor
    labels: torch.Tensor
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int

    @property
    def num_edges(self) -> int:
        return int(self.src.shape[0])

    def to_csr(self) -> CSRGraph:
        """The graph as a :class:`~pingpong.sources.builtin.CSRGraph` (in-edges)."""
        return CSRGraph.from_edges(self.src, self.dst, self.num_nodes)

    def to_dgl(self) -> Any:
        """A DGL graph with ``ndata`` ``feat``, ``label``, ``train_mask``,
        ``val_mask`` and ``test_mask`` (bool). Imports DGL; raises
        ``ImportError`` when it is not installed."""
        import dgl

        g = dgl.graph((self.src, self.dst), num_nodes=self.num_nodes)
        g.ndata["feat"] = self.features
        g.ndata["label"] = self.labels
        for name, idx in (
            ("train", self.train_idx),
            ("val", self.val_idx),
            ("test", self.test_idx),
        ):
            mask = torch.zeros(self.num_nodes, dtype=torch.bool)
            mask[idx] = True
            g.ndata[f"{name}_mask"] = mask
        return g


def _positive(name: str, value: Any) -> int:
    """``value`` as a Python int; ValueError unless it is an integer >= 1."""
    if (number := integer(value)) is None or number < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return number


def make_synthetic_graph(
    num_nodes: Count = 100_000,
    num_classes: Count = 16,
    feat_dim: Count = 128,
    avg_degree: float = 15.0,
    seed: Count = 0,
    feat_dtype: torch.dtype = torch.float32,
    *,
    homophily: float = 0.6,
    feature_signal: float = 0.15,
    power_law_exponent: float = 2.5,
    graph_kind: str = "powerlaw",
    train_frac: float = 0.3,
    val_frac: float = 0.05,
    test_frac: float = 0.1,
) -> SyntheticGraph:
    """Generate a :class:`SyntheticGraph` (see the module docstring).

    Args:
        num_nodes: ``N``. num_classes: classes (= communities).
        feat_dim: feature width ``F``. avg_degree: target mean degree (before
            self-loops and duplicates are removed, which cost a few percent).
        seed: everything is a function of it. feat_dtype: floating dtype of
            the feature table.
        homophily: probability that an edge stays inside its community.
        feature_signal: class-centre scale relative to unit noise.
        power_law_exponent: density exponent of the degree distribution (> 2;
            ``graph_kind="powerlaw"`` only).
        graph_kind: ``"powerlaw"`` (Chung-Lu, skewed) or ``"uniform"`` (equal
            weights: Poisson degrees).
        train_frac, val_frac, test_frac: split sizes; the rest is unlabelled
            for training purposes (its labels still exist).

    Raises:
        ValueError: an argument is out of range.
    """
    num_nodes = _positive("num_nodes", num_nodes)
    num_classes = _positive("num_classes", num_classes)
    feat_dim = _positive("feat_dim", feat_dim)
    if num_classes > num_nodes:
        raise ConfigError("num_classes must not exceed num_nodes")
    if not avg_degree >= 0:
        raise ConfigError(f"avg_degree must be >= 0, got {avg_degree!r}")
    if (number := integer(seed)) is None or number < 0:
        raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
    seed = number
    if not isinstance(feat_dtype, torch.dtype) or not feat_dtype.is_floating_point:
        raise ConfigError(f"feat_dtype must be a floating torch dtype, got {feat_dtype!r}")
    if not 0.0 <= homophily <= 1.0:
        raise ConfigError(f"homophily must lie in [0, 1], got {homophily!r}")
    if graph_kind not in GRAPH_KINDS:
        raise ConfigError(f"graph_kind must be one of {GRAPH_KINDS}, got {graph_kind!r}")
    if not power_law_exponent > 2.0:
        raise ConfigError(f"power_law_exponent must be > 2, got {power_law_exponent!r}")
    fracs = (train_frac, val_frac, test_frac)
    # A tolerance: 0.34 + 0.56 + 0.1 is 1.0000000000000002 in floats.  Each split
    # size is floor(frac * n), so their total still cannot exceed n.
    if min(fracs) < 0 or sum(fracs) > 1.0 + 1e-9:
        raise ConfigError(f"split fractions must be >= 0 and sum to <= 1, got {fracs}")

    gen = torch.Generator().manual_seed(seed)
    n, c = num_nodes, num_classes
    labels = torch.randint(c, (n,), generator=gen)

    # Chung-Lu endpoints with capped Pareto weights (float64 CDFs: exact enough).
    uniform = torch.rand(n, generator=gen, dtype=torch.float64)
    if graph_kind == "uniform":
        weights = torch.ones(n, dtype=torch.float64)
    else:
        weights = (1.0 - uniform).pow(-1.0 / (power_law_exponent - 1.0))
        weights.clamp_(max=max(1.0, (n * max(avg_degree, 1.0)) ** 0.5 / 4.0))
    cdf = torch.cumsum(weights, 0)
    order = torch.sort(labels, stable=True).indices
    class_cdf = torch.cumsum(weights[order], 0)
    class_total = torch.zeros(c, dtype=torch.float64).index_add_(0, labels, weights)
    class_start = torch.cumsum(class_total, 0) - class_total
    class_size = torch.bincount(labels, minlength=c)
    class_first = torch.cumsum(class_size, 0) - class_size

    num_pairs = round(n * avg_degree / 2)
    u = torch.searchsorted(
        cdf, torch.rand(num_pairs, generator=gen, dtype=torch.float64) * cdf[-1]
    ).clamp_(max=n - 1)
    v_any = torch.searchsorted(
        cdf, torch.rand(num_pairs, generator=gen, dtype=torch.float64) * cdf[-1]
    ).clamp_(max=n - 1)
    cu = labels[u]
    pos = torch.searchsorted(
        class_cdf,
        class_start[cu]
        + torch.rand(num_pairs, generator=gen, dtype=torch.float64) * class_total[cu],
    )
    pos = torch.minimum(torch.maximum(pos, class_first[cu]), class_first[cu] + class_size[cu] - 1)
    v_same = order[pos]
    intra = torch.rand(num_pairs, generator=gen) < homophily
    v = torch.where(intra, v_same, v_any)

    keep = u != v
    lo = torch.minimum(u, v)[keep]
    hi = torch.maximum(u, v)[keep]
    key = torch.unique(lo * n + hi)  # sorted: a deterministic edge order
    lo, hi = key // n, key % n
    src = torch.cat([lo, hi])
    dst = torch.cat([hi, lo])

    centres = torch.randn(c, feat_dim, generator=gen)
    features = torch.randn(n, feat_dim, generator=gen)
    features.add_(centres[labels], alpha=feature_signal)
    features = features.to(feat_dtype)

    perm = torch.randperm(n, generator=gen)
    n_train, n_val, n_test = (int(f * n) for f in fracs)
    train_idx = torch.sort(perm[:n_train]).values
    val_idx = torch.sort(perm[n_train : n_train + n_val]).values
    test_idx = torch.sort(perm[n_train + n_val : n_train + n_val + n_test]).values
    return SyntheticGraph(src, dst, n, features, labels, train_idx, val_idx, test_idx, c)
