"""What pingpong knows about DGL objects, without importing DGL until it meets one.

Graph detection, the original ids a sampler stores on a graph
(``ndata[dgl.NID]``, ``edata[dgl.EID]``), the conversion of a graph to an
:class:`~pingpong.blocks.EdgeBlock` (homogeneous) or a
:class:`~pingpong.blocks.HeteroEdgeBlock` for devices DGL cannot put graphs
on, and the probe that tells which devices those are.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..blocks import EdgeBlock, HeteroEdgeBlock
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


def original_edge_ids(graph: Any, what: str, label_keys: tuple[Any, ...] | None = None) -> Any:
    """``graph.edata[dgl.EID]`` (edge-prediction pair graphs carry the seed edges' ids).

    With ``label_keys`` (the keys of edge label tables by edge type: names or
    canonical triples), a dict ``{key: that edge type's ids}``; without, the
    one id tensor of a graph of one edge type.  Raises
    :class:`~pingpong.errors.BatchFormError` for a graph without edge ids,
    several edge types without ``label_keys``, or a key that names no edge
    type of the graph, or several.
    """
    try:
        edge_ids = graph.edata[EID]
    except KeyError:
        raise BatchFormError(
            f"{what} has no edata[dgl.EID], so there are no edge ids to gather "
            "edge_labels at"
        ) from None
    if label_keys is not None:
        canonical = list(graph.canonical_etypes)
        by_type = edge_ids if isinstance(edge_ids, Mapping) else {canonical[0]: edge_ids}
        matched = match_edge_types(label_keys, canonical, f"the {what}", BatchFormError)
        lacking = [etype for etype in matched.values() if etype not in by_type]
        if lacking:
            raise BatchFormError(
                f"{what}.edata[dgl.EID] has no edge ids of type {lacking[0]!r} (it has "
                f"{sorted(by_type)}), so there are none to gather that type's edge "
                "labels at"
            )
        return {key: by_type[etype] for key, etype in matched.items()}
    if isinstance(edge_ids, Mapping):  # several edge types: one id tensor per type
        types = ", ".join(repr(etype) for etype in edge_ids)
        raise BatchFormError(
            f"edge_labels= is one table indexed by {what}.edata[dgl.EID], but this "
            f"graph has several edge types ({types}), each with its own edge ids.  "
            "Pass edge_labels as a dict {edge type: table}, keyed by edge type names "
            "or canonical triples as above (batch.y is then a dict by the same keys)"
        )
    return edge_ids


def match_edge_types(keys: tuple[Any, ...], canonical: list[tuple[str, str, str]],
                     graph: str, error: type[Exception]) -> dict[Any, tuple[str, str, str]]:
    """The canonical edge type each key names: a canonical triple itself, or the
    one whose name (middle part) is the key.  ``graph`` is what messages call
    the graph the types are of.

    Raises ``error`` naming the key for a key that names no edge type of
    ``canonical``, a name shared by several (spell it out as a triple), or two
    keys naming the same edge type.
    """
    types: dict[Any, tuple[str, str, str]] = {}
    for key in keys:
        found = [c for c in canonical if key == c or key == c[1]]
        if len(found) != 1:
            problem = "names no edge type" if not found else "is the name of several edge types"
            raise error(
                f"edge_labels[{key!r}] {problem} of {graph}; its edge types are "
                f"{sorted(canonical)}" + (" -- key it by the canonical triple" if found else "")
            )
        twin = next((k for k, c in types.items() if c == found[0]), None)
        if twin is not None:
            raise error(
                f"edge_labels[{key!r}] and edge_labels[{twin!r}] are both edge type "
                f"{found[0]!r}; give each edge type one table"
            )
        types[key] = found[0]
    return types


def edge_block_from_dgl(graph: Any) -> EdgeBlock:
    """The :class:`EdgeBlock` of a DGL block or graph (same local ids, on its device).

    A block keeps its source/destination node counts; a plain graph (a pair
    graph, a subgraph) has ``num_src_nodes == num_dst_nodes == num_nodes``.
    :class:`~pingpong.BatchFormError` (a ``TypeError``) for a heterogeneous graph
    (more than one edge type, or more
    than one source or destination node type, as in a bipartite ``user ->
    item`` block): an :class:`EdgeBlock` has one edge list over one id space
    per side, and merging the types would mix their local ids (its form is a
    :class:`~pingpong.blocks.HeteroEdgeBlock`).
    """
    if is_heterogeneous_dgl_graph(graph):
        raise BatchFormError(
            f"a heterogeneous DGL graph ({len(graph.canonical_etypes)} edge types, source "
            f"node types {list(graph.srctypes)}, destination node types "
            f"{list(graph.dsttypes)}) has no "
            "single-edge-list EdgeBlock form; use pingpong.as_hetero_edge_block (a "
            "HeteroEdgeBlock: an EdgeBlock per edge type)"
        )
    src, dst = graph.edges()
    return EdgeBlock(
        src.to(torch.int64),
        dst.to(torch.int64),
        int(graph.num_src_nodes()),
        int(graph.num_dst_nodes()),
    )


def is_heterogeneous_dgl_graph(graph: Any) -> bool:
    """More than one edge type, or more than one node type on a side."""
    return max(len(getattr(graph, "canonical_etypes", [])), len(getattr(graph, "srctypes", [])),
               len(getattr(graph, "dsttypes", []))) > 1


def hetero_edge_block_from_dgl(graph: Any) -> HeteroEdgeBlock:
    """The :class:`HeteroEdgeBlock` of a DGL block or graph, of any number of types.

    Each canonical edge type's edges in the local ids of its own node types,
    as ``graph.edges(etype=...)`` gives them; node counts per source and
    destination type (a plain graph's source and destination nodes are its
    nodes).
    """
    edges = {}
    for etype in graph.canonical_etypes:
        src, dst = graph.edges(etype=etype)
        edges[tuple(etype)] = EdgeBlock(
            src.to(torch.int64),
            dst.to(torch.int64),
            int(graph.num_src_nodes(etype[0])),
            int(graph.num_dst_nodes(etype[2])),
        )
    return HeteroEdgeBlock(
        edges,
        {ntype: int(graph.num_src_nodes(ntype)) for ntype in graph.srctypes},
        {ntype: int(graph.num_dst_nodes(ntype)) for ntype in graph.dsttypes},
    )


def edge_blocks_from_dgl(graph: Any) -> EdgeBlock | HeteroEdgeBlock:
    """A DGL graph in the form a device without DGL graphs takes: an
    :class:`EdgeBlock` if it is homogeneous, else a :class:`HeteroEdgeBlock`."""
    if is_heterogeneous_dgl_graph(graph):
        return hetero_edge_block_from_dgl(graph)
    return edge_block_from_dgl(graph)


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
