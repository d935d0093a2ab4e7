"""A framework-free message-flow block: one layer of a sampled subgraph.

DGL's blocks cannot live on a GPU when DGL is a CPU build (the only kind on
PyPI), and the built-in sampler must work without DGL at all.  Both then use
:class:`EdgeBlock`: the edges of one bipartite layer in *local* ids, which a
pure-torch GraphSAGE layer consumes with ``index_add_``/``scatter``.

Local-id convention (the same as DGL's blocks): the first ``num_dst_nodes``
source nodes are the destination nodes, in the same order, so
``h_src[:num_dst_nodes]`` are the destination nodes' own features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
        return int(self.src.shape[0])

    @property
    def device(self) -> torch.device:
        return self.src.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EdgeBlock:
        """Copy the edge tensors to ``device`` (node counts are plain ints)."""
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


def is_dgl_block(block: Any) -> bool:
    """True if ``block`` is a DGL graph/block (without importing DGL)."""
    return type(block).__module__.startswith("dgl.") and hasattr(block, "num_src_nodes")


def edge_block_from_dgl(block: Any) -> EdgeBlock:
    """The :class:`EdgeBlock` of a DGL block (same local ids, on its device).

    ``TypeError`` for a heterogeneous block (more than one edge type, or more
    than one source or destination node type, as in a bipartite ``user ->
    item`` block): an :class:`EdgeBlock` has one edge list over one id space
    per side, and merging the types would mix their local ids.
    """
    etypes = getattr(block, "canonical_etypes", [])
    srctypes = getattr(block, "srctypes", [])
    dsttypes = getattr(block, "dsttypes", [])
    if max(len(etypes), len(srctypes), len(dsttypes)) > 1:
        raise TypeError(
            f"a heterogeneous DGL block ({len(etypes)} edge types, source node types "
            f"{list(srctypes)}, destination node types {list(dsttypes)}) has no "
            "single-edge-list EdgeBlock form; on CUDA this needs a DGL build that can "
            "move blocks to the GPU"
        )
    src, dst = block.edges()
    return EdgeBlock(
        src.to(torch.int64),
        dst.to(torch.int64),
        int(block.num_src_nodes()),
        int(block.num_dst_nodes()),
    )


def as_edge_block(block: Any) -> EdgeBlock:
    """Return ``block`` as an :class:`EdgeBlock` (DGL blocks are converted)."""
    if isinstance(block, EdgeBlock):
        return block
    if is_dgl_block(block):
        return edge_block_from_dgl(block)
    raise TypeError(f"expected an EdgeBlock or a DGL block, got {type(block).__name__}")
