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


def as_edge_block(block: Any) -> EdgeBlock:
    """Return ``block`` as an :class:`EdgeBlock` (DGL blocks and graphs are converted).

    ``TypeError`` for anything else, and for heterogeneous DGL graphs (see
    :func:`pingpong.forms._dgl.edge_block_from_dgl`).
    """
    if isinstance(block, EdgeBlock):
        return block
    from .forms._dgl import edge_block_from_dgl, is_dgl_graph

    if is_dgl_graph(block):
        return edge_block_from_dgl(block)
    raise TypeError(f"expected an EdgeBlock or a DGL block, got {type(block).__name__}")
