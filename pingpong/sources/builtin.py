"""A built-in uniform neighbour sampler that needs no DGL.

It yields exactly the triples a DGL ``DataLoader`` with a ``NeighborSampler``
yields, with :class:`~pingpong.blocks.EdgeBlock` in place of DGL blocks, so the
loader, the example and the GPU benchmark run where DGL cannot be installed.

Conventions (the same as DGL's):

- ``blocks[0]`` is the outermost layer (it reads ``input_nodes``) and
  ``blocks[-1]`` produces the seeds; ``fanouts[i]`` is the fanout of
  ``blocks[i]``, so sampling starts from the seeds with ``fanouts[-1]``.
- The destination nodes of every block are the prefix of its source nodes,
  and ``blocks[i + 1]``'s source nodes are ``blocks[i]``'s destination nodes.
  Hence every layer's nodes are a prefix of ``input_nodes``: local id ``j`` of
  any block is global node ``input_nodes[j]``, and
  ``input_nodes[:len(output_nodes)] == output_nodes``.
- Edges are in-edges: a sampled edge ``src -> dst`` means ``src`` is one of the
  graph's in-neighbours of ``dst`` (``indices[indptr[dst]:indptr[dst + 1]]``).
- Neighbours are drawn uniformly *without replacement*: a node with in-degree
  ``d`` gets ``min(d, fanout)`` in-edges, all ``d`` for ``fanout == -1``.
  Edges are sampled by position, so a multigraph's parallel edges can both be
  drawn.

Sampling runs in plain (not ``parallel=True``) Numba code that releases the
GIL, so pingpong's producer thread samples while the training thread computes.
Results depend only on the graph, the seeds and the integer seed, not on the
thread or process that samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch

from .._integers import Count, integer
from ..blocks import EdgeBlock
from ..errors import ConfigError, IdRangeError
from ..kernels._jitcache import jit_cached
from ._shard import resolve_rank, seeds_per_rank, shard_seeds

__all__ = ["BuiltinLoader", "CSRGraph", "NeighborSampler", "SampledTriple"]

#: What :class:`BuiltinLoader` yields: ``(input_nodes, output_nodes, blocks)``.
SampledTriple = tuple[torch.Tensor, torch.Tensor, list[EdgeBlock]]

#: Above this fanout, Floyd's sampler (quadratic in the fanout) gives way to a
#: partial Fisher-Yates shuffle (linear in the degree).
_FLOYD_MAX_FANOUT = 64

#: What :func:`_sample_layer` found wrong with a graph that passed its checks at
#: construction and changed since (its tensors are read in place).
_SAMPLED = 0
_NODE_OUT_OF_RANGE = 1  # a seed or a layer's node outside [0, num_nodes)
_BAD_INDPTR = 2  # a node's in-edges run backwards or past the end of indices
_NEIGHBOUR_OUT_OF_RANGE = 3  # an entry of indices outside [0, num_nodes)


def _as_int64_vector(values: Any, name: str) -> torch.Tensor:
    """``values`` as a contiguous 1-D int64 CPU tensor (copied only if needed)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "u" and values.size:  # uint64 past 2**63 would wrap
            _check_fits_int64(int(values.max()), name)
            values = values.astype(np.int64)  # torch < 2.3 refuses uint64 arrays
        # torch.from_numpy refuses negative strides and warns on read-only arrays
        values = torch.from_numpy(np.require(values, requirements=("C", "W")))
    elif not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values)
    if values.dim() != 1:
        raise ConfigError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ConfigError(f"{name} must hold integers, got {values.dtype}")
    if not values.dtype.is_signed and values.numel():  # torch's unsigned types
        _check_fits_int64(int(values.cpu().numpy().max()), name)
    return values.to(device="cpu", dtype=torch.int64).contiguous()


def _check_fits_int64(largest: int, name: str) -> None:
    if largest > np.iinfo(np.int64).max:
        raise IdRangeError(f"{name} holds {largest}, which no node id can be")


def _check_range(ids: torch.Tensor, num_nodes: int, name: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_nodes):
        raise IdRangeError(
            f"{name} must lie in [0, {num_nodes}), got [{int(ids.min())}, {int(ids.max())}]"
        )


@dataclass(frozen=True, eq=False)
class CSRGraph:
    """A homogeneous graph stored by in-edges (CSC of the adjacency).

    The in-neighbours of node ``v`` are ``indices[indptr[v]:indptr[v + 1]]``.

    Attributes:
        indptr: int64 CPU tensor ``(num_nodes + 1,)``, non-decreasing, from 0
            to ``len(indices)``.
        indices: int64 CPU tensor ``(E,)`` of source node ids in
            ``[0, num_nodes)``.
        num_nodes: number of nodes (ids ``0 .. num_nodes - 1``).

    Construction validates shapes, dtypes, that ``indptr`` never decreases and
    that every id in ``indices`` lies in ``[0, num_nodes)`` (``ValueError`` /
    ``TypeError`` / ``IndexError``), before any sampler reads them.  The
    samplers read the tensors in place (no copy): a change made afterwards
    reaches later batches, and one that breaks those rules at a sampled node
    raises there (:class:`~pingpong.IdRangeError` or
    :class:`~pingpong.ConfigError`) before anything is read out of bounds.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_nodes: int

    def __post_init__(self) -> None:
        for name in ("indptr", "indices"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
                raise ConfigError(f"CSRGraph.{name} must be an int64 tensor")
            if value.dim() != 1 or value.device.type != "cpu" or not value.is_contiguous():
                raise ConfigError(f"CSRGraph.{name} must be a contiguous 1-D CPU tensor")
        if int(self.num_nodes) < 0 or self.indptr.shape[0] != int(self.num_nodes) + 1:
            raise ConfigError("CSRGraph.indptr must have num_nodes + 1 entries")
        if int(self.indptr[0]) != 0 or int(self.indptr[-1]) != self.indices.shape[0]:
            raise ConfigError("CSRGraph.indptr must run from 0 to len(indices)")
        # The samplers' Numba loops index with these unchecked: check them here.
        falls = torch.nonzero(self.indptr[1:] < self.indptr[:-1])
        if falls.numel():
            node = int(falls[0])
            raise ConfigError(
                f"CSRGraph.indptr must be non-decreasing: node {node}'s in-edges would "
                f"run from {int(self.indptr[node])} to {int(self.indptr[node + 1])}")
        _check_range(self.indices, int(self.num_nodes), "CSRGraph.indices")
        object.__setattr__(self, "num_nodes", int(self.num_nodes))

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    def in_degrees(self) -> torch.Tensor:
        """In-degree of every node, int64 ``(num_nodes,)``."""
        return self.indptr[1:] - self.indptr[:-1]

    @classmethod
    def from_edges(cls, src: Any, dst: Any, num_nodes: int) -> CSRGraph:
        """Build from directed edges ``src[e] -> dst[e]``.

        Each node's in-neighbours keep the order in which their edges appear
        (a stable sort by ``dst``). Duplicate edges are kept.

        Raises:
            ValueError / TypeError: ``src``/``dst`` are not equal-length 1-D
                integer sequences.
            IndexError: an id is outside ``[0, num_nodes)``.
        """
        src_t = _as_int64_vector(src, "src")
        dst_t = _as_int64_vector(dst, "dst")
        if src_t.shape != dst_t.shape:
            raise ConfigError(f"src and dst differ in length: {src_t.shape[0]} != {dst_t.shape[0]}")
        num_nodes = int(num_nodes)
        if num_nodes < 0:
            raise ConfigError(f"num_nodes must be >= 0, got {num_nodes}")
        _check_range(src_t, num_nodes, "src")
        _check_range(dst_t, num_nodes, "dst")
        order = torch.sort(dst_t, stable=True).indices
        indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(dst_t, minlength=num_nodes), 0, out=indptr[1:])
        return cls(indptr, src_t[order].contiguous(), num_nodes)

    @classmethod
    def from_dgl(cls, g: Any) -> CSRGraph:
        """Build from a homogeneous DGL graph (its in-edges; DGL's edge order)."""
        if len(g.ntypes) != 1 or len(g.etypes) != 1:
            raise ConfigError("CSRGraph.from_dgl needs a homogeneous graph")
        if hasattr(g, "adj_tensors"):  # DGL >= 1.0
            indptr, indices, _ = g.adj_tensors("csc")
        else:  # pragma: no cover - DGL 0.x
            indptr, indices, _ = g.adj_sparse("csc")
        return cls(
            indptr.to("cpu", torch.int64).contiguous(),
            indices.to("cpu", torch.int64).contiguous(),
            int(g.num_nodes()),
        )


@jit_cached(numba.njit, nogil=True)
def _sample_layer(indptr, indices, seeds, fanout, rng_seed, node_map):  # pragma: no cover
    """One layer: sample in-edges of ``seeds`` and relabel to local ids.

    ``node_map`` is an all ``-1`` int64 scratch of ``num_nodes`` entries; it is
    all ``-1`` again on return; ``indptr`` has ``num_nodes + 1``. Returns
    ``(status, src_nodes, edge_src, edge_dst)``: ``src_nodes`` starts with
    ``seeds``; edges are in local ids.  Every index it reads is checked first
    (the graph may have changed since :class:`CSRGraph` checked it): a status
    other than ``_SAMPLED`` says what was out of range, with empty arrays,
    before ``node_map`` is touched.
    """
    empty = np.empty(0, np.int64)
    num_nodes = node_map.shape[0]
    num_indices = indices.shape[0]
    np.random.seed(rng_seed)
    n = seeds.shape[0]
    # Each value is read once into a local and checked there: the GIL is released,
    # so another thread may write the tensors between two reads.
    nodes = np.empty(n, np.int64)
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    for i in range(n):
        v = seeds[i]
        if v < 0 or v >= num_nodes:
            return _NODE_OUT_OF_RANGE, empty, empty, empty
        nodes[i] = v
        lo = indptr[v]
        hi = indptr[v + 1]
        if lo < 0 or hi < lo or hi > num_indices:
            return _BAD_INDPTR, empty, empty, empty
        d = hi - lo
        k = d if (fanout < 0 or d <= fanout) else fanout
        offsets[i + 1] = offsets[i] + k
    num_edges = offsets[n]
    nbrs = np.empty(num_edges, np.int64)
    edge_dst = np.empty(num_edges, np.int64)
    shuffle = np.empty(0, np.int64)
    for i in range(n):
        v = nodes[i]
        start = indptr[v]
        end = indptr[v + 1]
        out = offsets[i]
        k = offsets[i + 1] - out
        if start < 0 or end < start or end > num_indices or end - start < k:  # changed
            return _BAD_INDPTR, empty, empty, empty
        d = end - start
        for j in range(k):
            edge_dst[out + j] = i
        if k == d:
            for j in range(d):
                nbrs[out + j] = indices[start + j]
        elif k <= _FLOYD_MAX_FANOUT:  # Floyd: k distinct positions of [0, d)
            for m in range(k):
                j = d - k + m
                t = np.random.randint(0, j + 1)
                for q in range(m):
                    if nbrs[out + q] == t:
                        t = j
                        break
                nbrs[out + m] = t
            for j in range(k):
                nbrs[out + j] = indices[start + nbrs[out + j]]
        else:  # partial Fisher-Yates over the d positions
            if shuffle.shape[0] < d:
                shuffle = np.empty(d, np.int64)
            for j in range(d):
                shuffle[j] = j
            for j in range(k):
                t = np.random.randint(j, d)
                tmp = shuffle[j]
                shuffle[j] = shuffle[t]
                shuffle[t] = tmp
                nbrs[out + j] = indices[start + shuffle[j]]
    for e in range(num_edges):
        if nbrs[e] < 0 or nbrs[e] >= num_nodes:
            return _NEIGHBOUR_OUT_OF_RANGE, empty, empty, empty
    src_nodes = np.empty(n + num_edges, np.int64)
    for i in range(n):
        src_nodes[i] = nodes[i]
        node_map[nodes[i]] = i
    count = n
    edge_src = np.empty(num_edges, np.int64)
    for e in range(num_edges):
        u = nbrs[e]
        local = node_map[u]
        if local < 0:
            local = count
            node_map[u] = count
            src_nodes[count] = u
            count += 1
        edge_src[e] = local
    for i in range(count):
        node_map[src_nodes[i]] = -1
    return _SAMPLED, src_nodes[:count].copy(), edge_src, edge_dst


_CHANGED = ("the graph's tensors changed after CSRGraph checked them (the sampler reads "
            "them in place: build a new CSRGraph after changing them)")


def _changed_graph_error(status: int, num_nodes: int) -> Exception:
    """The error for a :func:`_sample_layer` status other than ``_SAMPLED``."""
    if status == _BAD_INDPTR:
        return ConfigError(f"CSRGraph.indptr is decreasing or runs past the end of "
                           f"CSRGraph.indices at a sampled node: {_CHANGED}")
    if status == _NEIGHBOUR_OUT_OF_RANGE:
        return IdRangeError(f"CSRGraph.indices holds a node id outside [0, {num_nodes}) at "
                            f"sampling time: {_CHANGED}")
    return IdRangeError(f"a seed lies outside [0, {num_nodes}) at sampling time: the seeds "
                        "were changed after they were checked")


def _parse_fanouts(fanouts: Sequence[int]) -> tuple[int, ...]:
    if isinstance(fanouts, (str, bytes)) or not isinstance(fanouts, Sequence):
        raise ConfigError(f"fanouts must be a sequence of ints, got {type(fanouts).__name__}")
    parsed = []
    for f in fanouts:
        if isinstance(f, bool) or not isinstance(f, (int, np.integer)):
            raise ConfigError(f"fanouts must be ints, got {f!r}")
        if f == 0 or f < -1:
            raise ConfigError(f"each fanout must be positive or -1 (all), got {f}")
        parsed.append(int(f))
    if not parsed:
        raise ConfigError("fanouts must not be empty")
    return tuple(parsed)


class NeighborSampler:
    """Uniform multi-layer in-neighbour sampler (DGL ``NeighborSampler`` semantics).

    Args:
        fanouts: one entry per layer, outermost first; ``fanouts[i]`` in-edges
            per destination node of ``blocks[i]``; ``-1`` takes all of them.

    Stateless and thread-safe: every call allocates its own scratch unless the
    caller passes one.
    """

    def __init__(self, fanouts: Sequence[int]) -> None:
        self.fanouts = _parse_fanouts(fanouts)

    def __repr__(self) -> str:
        return f"NeighborSampler(fanouts={list(self.fanouts)})"

    @property
    def num_layers(self) -> int:
        return len(self.fanouts)

    def sample_blocks(
        self,
        graph: CSRGraph,
        seeds: Any,
        rng_seed: int | Sequence[int],
        *,
        node_map: np.ndarray | None = None,
    ) -> SampledTriple:
        """Sample the blocks of one mini-batch.

        Args:
            graph: the graph to sample from.
            seeds: distinct node ids (1-D integers) in ``[0, graph.num_nodes)``.
            rng_seed: an int or a sequence of ints (entropy for NumPy's
                ``SeedSequence``); the same value gives the same blocks.
            node_map: optional int64 scratch of ``graph.num_nodes`` entries,
                all ``-1``; it is all ``-1`` again on return. Pass one to avoid
                an allocation per batch; never share it between threads.

        Returns:
            ``(input_nodes, output_nodes, blocks)`` as described in the module
            docstring; ``output_nodes`` holds ``seeds`` as int64.

        Raises:
            IndexError: a seed is out of range. ValueError: seeds repeat.
        """
        seeds_t = _as_int64_vector(seeds, "seeds")
        _check_range(seeds_t, graph.num_nodes, "seeds")
        if torch.unique(seeds_t).shape[0] != seeds_t.shape[0]:
            raise ConfigError("seeds must be distinct")
        if node_map is None:
            node_map = np.full(graph.num_nodes, -1, dtype=np.int64)
        elif node_map.dtype != np.int64 or node_map.shape != (graph.num_nodes,):
            raise ConfigError("node_map must be an int64 array of graph.num_nodes entries")
        return self._sample(graph, seeds_t, rng_seed, node_map)

    def _sample(
        self,
        graph: CSRGraph,
        seeds: torch.Tensor,
        rng_seed: int | Sequence[int],
        node_map: np.ndarray,
    ) -> SampledTriple:
        """:meth:`sample_blocks` without argument checks."""
        layer_seeds = np.random.SeedSequence(rng_seed).generate_state(len(self.fanouts))
        indptr = graph.indptr.numpy()
        indices = graph.indices.numpy()
        if indptr.shape != (graph.num_nodes + 1,):  # resized in place since its checks
            raise ConfigError(
                f"CSRGraph.indptr has {indptr.shape[0]} entries now, not num_nodes + 1 = "
                f"{graph.num_nodes + 1}: {_CHANGED}")
        nodes = seeds.numpy()
        blocks: list[EdgeBlock] = []
        for layer in range(len(self.fanouts) - 1, -1, -1):
            status, src_nodes, edge_src, edge_dst = _sample_layer(
                indptr, indices, nodes, self.fanouts[layer], int(layer_seeds[layer]), node_map
            )
            if status != _SAMPLED:
                raise _changed_graph_error(status, graph.num_nodes)
            blocks.append(
                EdgeBlock(
                    torch.from_numpy(edge_src),
                    torch.from_numpy(edge_dst),
                    int(src_nodes.shape[0]),
                    int(nodes.shape[0]),
                )
            )
            nodes = src_nodes
        blocks.reverse()
        return torch.from_numpy(nodes), seeds, blocks


class BuiltinLoader:
    """Mini-batches of sampled blocks over ``seed_nodes``, DGL ``DataLoader`` style.

    A re-iterable: every ``iter()`` starts a new epoch (epoch ``0, 1, ...``,
    counted per loader). Epoch ``e`` is fully determined by ``seed``, ``e``
    and (when sharded) the rank and world size: the seed order
    (``shuffle=True``) and every batch's neighbour draws, so two loaders built
    alike yield identical epochs. Use :meth:`set_epoch` to pick the next epoch
    explicitly (e.g. to resume).

    Data-parallel training: with ``use_ddp=True`` (DGL's name for the same
    option) each rank of a torch.distributed job yields only its share of
    every epoch, and all ranks yield the same number of batches (see
    :mod:`pingpong.sources._shard`: the epoch's permutation is padded by
    repeating its first seeds, or its tail dropped with ``drop_last``).  All
    ranks must be built with the same ``seed_nodes``, ``shuffle`` and
    ``seed``: they shuffle with the same permutation and then split it, so
    their shares are disjoint apart from the padding.  ``num_replicas`` and
    ``rank`` set the split explicitly, as for
    ``torch.utils.data.DistributedSampler``.

    Args:
        graph: the graph to sample from.
        seed_nodes: distinct node ids to train on (1-D integers).
        sampler: the :class:`NeighborSampler`.
        batch_size: seeds per batch (the last batch may be smaller).
        shuffle: reshuffle the seeds each epoch.
        drop_last: drop the last batch if it is smaller than ``batch_size``;
            when sharded, also drop the epoch's last ``n % world_size`` seeds
            instead of padding.
        seed: base integer seed.
        use_ddp: split each epoch across the ranks of the default
            torch.distributed process group (``init_process_group`` must have
            run; :class:`~pingpong.ConfigError` otherwise).  Rank and world size are read
            once, here.
        num_replicas, rank: split each epoch into ``num_replicas`` shares and
            yield share ``rank`` (both or neither; they override ``use_ddp``'s
            lookup).  ``ValueError`` if a share would be empty.

    Yields ``(input_nodes, output_nodes, blocks)``: int64 CPU tensors and a
    list of CPU :class:`EdgeBlock`, freshly allocated per batch.
    """

    def __init__(
        self,
        graph: CSRGraph,
        seed_nodes: Any,
        sampler: NeighborSampler,
        batch_size: Count,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: Count = 0,
        use_ddp: bool = False,
        num_replicas: Count | None = None,
        rank: Count | None = None,
    ) -> None:
        if not isinstance(graph, CSRGraph):
            raise ConfigError(f"graph must be a CSRGraph, got {type(graph).__name__}")
        if not isinstance(sampler, NeighborSampler):
            raise ConfigError(f"sampler must be a NeighborSampler, got {type(sampler).__name__}")
        if (size := integer(batch_size)) is None or size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if (number := integer(seed)) is None or number < 0:
            raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
        batch_size, seed = size, number
        # A private copy: checked once, and an in-place change of the caller's
        # tensor afterwards reaches no epoch (nor the sampler's unchecked reads).
        seeds = _as_int64_vector(seed_nodes, "seed_nodes").clone()
        _check_range(seeds, graph.num_nodes, "seed_nodes")
        if torch.unique(seeds).shape[0] != seeds.shape[0]:
            raise ConfigError("seed_nodes must be distinct")
        self.graph = graph
        self._seed_nodes = seeds
        self.sampler = sampler
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = seed
        self.use_ddp = bool(use_ddp)
        self.rank, self.world_size = resolve_rank(self.use_ddp, num_replicas, rank)
        self.sharded = self.use_ddp or num_replicas is not None
        if self.sharded and seeds_per_rank(seeds.shape[0], self.world_size, self.drop_last) == 0:
            raise ConfigError(
                f"{seeds.shape[0]} seed nodes leave rank {self.rank} of "
                f"{self.world_size} with none"
            )
        self._epoch = 0

    @property
    def seed_nodes(self) -> torch.Tensor:
        """The seed nodes, int64 (a copy: the loader's own are checked once, when built)."""
        return self._seed_nodes.clone()

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will produce."""
        return self._epoch

    def set_epoch(self, epoch: Count) -> None:
        """Make the next ``iter()`` produce epoch ``epoch``."""
        if (number := integer(epoch)) is None or number < 0:
            raise ConfigError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch = number

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        n = seeds_per_rank(self._seed_nodes.shape[0], self.world_size, self.drop_last)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[SampledTriple]:
        epoch = self._epoch
        self._epoch += 1
        seeds = self._seed_nodes
        if self.shuffle:
            gen = torch.Generator().manual_seed(
                int(np.random.SeedSequence([self.seed, epoch, 0]).generate_state(1)[0])
            )
            seeds = seeds[torch.randperm(seeds.shape[0], generator=gen)]
        seeds = shard_seeds(seeds, self.rank, self.world_size, self.drop_last)
        # A rank's neighbour draws are keyed on its rank too (single-process keys unchanged).
        batch_key = [self.seed, epoch, 1] + ([self.rank] if self.world_size > 1 else [])
        return _epoch_batches(
            self.graph, seeds, self.sampler, self.batch_size, len(self), batch_key
        )

    def __repr__(self) -> str:
        return (
            f"BuiltinLoader(num_seeds={self._seed_nodes.shape[0]}, {self.sampler!r}, "
            f"batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, seed={self.seed}"
            + (f", rank={self.rank}/{self.world_size}" if self.sharded else "")
            + ")"
        )


def _epoch_batches(
    graph: CSRGraph,
    seeds: torch.Tensor,
    sampler: NeighborSampler,
    batch_size: int,
    num_batches: int,
    batch_key: list[int],
) -> Iterator[SampledTriple]:
    """The batches of one epoch (a free function: holds no loader reference).

    Batch ``b``'s neighbour draws are seeded with ``batch_key + [b]``.
    """
    node_map = np.full(graph.num_nodes, -1, dtype=np.int64)
    for b in range(num_batches):
        batch = seeds[b * batch_size : (b + 1) * batch_size]
        yield sampler._sample(graph, batch, [*batch_key, b], node_map)
