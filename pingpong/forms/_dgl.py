"""What pingpong knows about DGL objects, without importing DGL until it meets one.

Graph detection, the original ids a sampler stores on a graph
(``ndata[dgl.NID]``, ``edata[dgl.EID]``), the conversion of a graph to an
:class:`~pingpong.blocks.EdgeBlock` for devices DGL cannot put graphs on, and
the probe that tells which devices those are.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..blocks import EdgeBlock
from ..errors import BatchFormError

#: DGL's key for original node / edge ids (``dgl.NID`` / ``dgl.EID``), as DGL spells them.
NID = "_ID"
EID = "_ID"


def is_dgl_graph(obj: Any) -> bool:
    """True for a DGL graph or block (any ``DGLGraph``), checked without importing DGL."""
    return type(obj).__module__.startswith("dgl.") and hasattr(obj, "num_src_nodes")


def original_node_ids(graph: Any, what: str) -> Any:
    """``graph.ndata[dgl.NID]`` (a dict by node type for a heterogeneous graph).

    Raises :class:`~pingpong.errors.BatchFormError` if the graph has none (it
    was not made by a sampler that records them).
    """
    try:
        return graph.ndata[NID]
    except KeyError:
        raise BatchFormError(
            f"{what} has no ndata[dgl.NID]: pingpong gathers features at the original "
            "node ids a sampler stores there (ClusterGCN, SAINT, ShaDow do); for "
            "another graph, pass form= to say which ids to gather"
        ) from None


def original_edge_ids(graph: Any, what: str) -> Any:
    """``graph.edata[dgl.EID]`` (edge-prediction pair graphs carry the seed edges' ids)."""
    try:
        edge_ids = graph.edata[EID]
    except KeyError:
        raise BatchFormError(
            f"{what} has no edata[dgl.EID], so there are no edge ids to gather "
            "edge_labels at"
        ) from None
    if isinstance(edge_ids, Mapping):  # several edge types: one id tensor per type
        types = ", ".join(repr(etype) for etype in edge_ids)
        raise BatchFormError(
            f"edge_labels= is one table indexed by {what}.edata[dgl.EID], but this "
            f"graph has several edge types ({types}), each with its own edge ids.  "
            "On a graph of one node type, for one edge type's labels pass that type's "
            "table as edge_labels= with form=lambda item: (item[0], "
            "item[1].edata[dgl.EID][canonical_etype]), canonical_etype one of the keys "
            "above"
        )
    return edge_ids


def edge_block_from_dgl(graph: Any) -> EdgeBlock:
    """The :class:`EdgeBlock` of a DGL block or graph (same local ids, on its device).

    A block keeps its source/destination node counts; a plain graph (a pair
    graph, a subgraph) has ``num_src_nodes == num_dst_nodes == num_nodes``.
    ``TypeError`` for a heterogeneous graph (more than one edge type, or more
    than one source or destination node type, as in a bipartite ``user ->
    item`` block): an :class:`EdgeBlock` has one edge list over one id space
    per side, and merging the types would mix their local ids.
    """
    etypes = getattr(graph, "canonical_etypes", [])
    srctypes = getattr(graph, "srctypes", [])
    dsttypes = getattr(graph, "dsttypes", [])
    if max(len(etypes), len(srctypes), len(dsttypes)) > 1:
        raise TypeError(
            f"a heterogeneous DGL graph ({len(etypes)} edge types, source node types "
            f"{list(srctypes)}, destination node types {list(dsttypes)}) has no "
            "single-edge-list EdgeBlock form; on CUDA this needs a DGL build that can "
            "move graphs to the GPU"
        )
    src, dst = graph.edges()
    return EdgeBlock(
        src.to(torch.int64),
        dst.to(torch.int64),
        int(graph.num_src_nodes()),
        int(graph.num_dst_nodes()),
    )


@functools.cache
def _dgl_can_hold_graphs_on(device: torch.device) -> bool:
    import dgl

    try:
        dgl.graph(([0], [0])).to(device)
    except Exception:  # noqa: BLE001 - DGLError, RuntimeError...: any means "no"
        return False
    return True


def dgl_can_hold_graphs_on(device: torch.device) -> bool:
    """True if this DGL build can put graphs on ``device`` (PyPI's builds: CPU only)."""
    return device.type == "cpu" or _dgl_can_hold_graphs_on(device)
