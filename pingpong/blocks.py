"""Framework-free message-flow blocks: one layer of a sampled subgraph.

DGL's blocks cannot live on a GPU when DGL is a CPU build (the only kind on
PyPI), and the built-in sampler must work without DGL at all.  Both then use
:class:`EdgeBlock`: the edges of one bipartite layer in *local* ids, which a
pure-torch GraphSAGE layer consumes with ``index_add_``/``scatter``.  A
heterogeneous layer (several edge types, or several node types on a side)
becomes a :class:`HeteroEdgeBlock`: one :class:`EdgeBlock` per canonical edge
type, each in the local ids of its own source and destination node types.

Local-id convention (the same as DGL's blocks): the first ``num_dst_nodes``
source nodes are the destination nodes, in the same order, so
``h_src[:num_dst_nodes]`` are the destination nodes' own features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import BatchFormError


@dataclass(frozen=True)
class EdgeBlock:
    """Edges ``src[e] -> dst[e]`` of one sampled layer, in local ids.

    Attributes:
        src: int64 tensor ``(E,)``, values in ``[0, num_src_nodes)``.
        dst: int64 tensor ``(E,)``, values in ``[0, num_dst_nodes)``.
        num_src_nodes: number of source (input) nodes of the layer.
        num_dst_nodes: number of destination (output) nodes; a prefix of the
            source nodes.
    """

    src: torch.Tensor
    dst: torch.Tensor
    num_src_nodes: int
    num_dst_nodes: int

    @property
    def num_edges(self) -> int:
        """How many edges the block has (the length of ``src`` and ``dst``)."""
        return int(self.src.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the edge tensors are."""
        return self.src.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EdgeBlock:
        """Copy the edge tensors to ``device`` (node counts are plain ints);
        ``non_blocking`` is passed to ``Tensor.to`` (asynchronous from pinned memory)."""
        return EdgeBlock(
            self.src.to(device, non_blocking=non_blocking),
            self.dst.to(device, non_blocking=non_blocking),
            self.num_src_nodes,
            self.num_dst_nodes,
        )

    def in_degrees(self) -> torch.Tensor:
        """In-degree of each destination node, as float32 on the block's device."""
        deg = torch.zeros(self.num_dst_nodes, dtype=torch.float32, device=self.device)
        deg.index_add_(0, self.dst, torch.ones_like(self.dst, dtype=torch.float32))
        return deg


CanonicalEdgeType = tuple[str, str, str]


@dataclass(frozen=True)
class HeteroEdgeBlock:
    """One sampled layer of a heterogeneous graph, an :class:`EdgeBlock` per edge type.

    The form of a heterogeneous DGL block (or pair graph, or subgraph) on a
    device a CPU-only DGL build cannot put graphs on: what a pure-torch
    relational layer needs, in DGL's own local ids.

    Attributes:
        edges: canonical edge type ``(src type, relation, dst type)`` ->
            :class:`EdgeBlock` of that type's edges, ``src`` in the local ids of
            the source node type (``[0, num_src_nodes[src type])``), ``dst`` in
            those of the destination node type.  Every edge type of the DGL
            graph is present, in its order, those without edges in this
            layer too (empty tensors).
        num_src_nodes: source node type -> its number of source nodes.
        num_dst_nodes: destination node type -> its number of destination
            nodes.  The local ids are the DGL graph's own: in DGL's blocks the
            first ``num_dst_nodes[t]`` source nodes of type ``t`` are its
            destination nodes, in the same order (seen not to hold, in DGL
            1.1.3, for a type no edge type points to: no layer computes those
            nodes).
    """

    edges: dict[CanonicalEdgeType, EdgeBlock]
    num_src_nodes: dict[str, int]
    num_dst_nodes: dict[str, int]

    @property
    def canonical_etypes(self) -> list[CanonicalEdgeType]:
        """The canonical edge types, in the DGL graph's order."""
        return list(self.edges)

    @property
    def device(self) -> torch.device:
        """Where the edge tensors are (the CPU for a layer without edge types)."""
        first = next(iter(self.edges.values()), None)
        return torch.device("cpu") if first is None else first.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> HeteroEdgeBlock:
        """Copy every edge type's tensors to ``device`` (node counts are plain ints);
        ``non_blocking`` is passed to ``Tensor.to``."""
        return HeteroEdgeBlock(
            {etype: block.to(device, non_blocking=non_blocking)
             for etype, block in self.edges.items()},
            dict(self.num_src_nodes),
            dict(self.num_dst_nodes),
        )


def as_edge_block(block: Any) -> EdgeBlock:
    """Return ``block`` as an :class:`EdgeBlock` (DGL blocks and graphs are converted).

    :class:`~pingpong.BatchFormError` (a ``TypeError``) for anything else, and for
    heterogeneous DGL graphs (see
    :func:`pingpong.forms._dgl.edge_block_from_dgl`).
    """
    if isinstance(block, EdgeBlock):
        return block
    from .forms._dgl import edge_block_from_dgl, is_dgl_graph

    if is_dgl_graph(block):
        return edge_block_from_dgl(block)
    raise BatchFormError(f"expected an EdgeBlock or a DGL block, got {type(block).__name__}")


def as_hetero_edge_block(block: Any) -> HeteroEdgeBlock:
    """Return ``block`` as a :class:`HeteroEdgeBlock` (DGL graphs of any kind are converted).

    A homogeneous DGL graph becomes one edge type, DGL's own
    (``("_N", "_E", "_N")`` unless named).  :class:`~pingpong.BatchFormError` (a
    ``TypeError``) for anything else.
    """
    if isinstance(block, HeteroEdgeBlock):
        return block
    from .forms._dgl import hetero_edge_block_from_dgl, is_dgl_graph

    if is_dgl_graph(block):
        return hetero_edge_block_from_dgl(block)
    raise BatchFormError(
        f"expected a HeteroEdgeBlock or a DGL graph, got {type(block).__name__}")
