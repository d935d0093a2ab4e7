"""The loader's tables checked against its source's graph, when the loader is built.

A source that knows its graph -- DGL's ``DataLoader.graph``, a
``DistNodeDataLoader``'s or ``DistEdgeDataLoader``'s ``DistGraph``, the
sampling graph of a GraphBolt pipeline -- lets a misspelt table key or a
mixed-up edge label table be refused before the first batch, instead of
failing part-way through an epoch or, worse, gathering the wrong rows.
Sources that do not know their graph are checked batch by batch only.
"""

from __future__ import annotations

import warnings
from typing import Any

from ._dgl_seeds import Seeds, seed_ids
from .errors import ConfigError, TableError
from .forms._dgl import NID, match_edge_types
from .forms._graphbolt import pipeline_graph_nodes, pipeline_node_types
from .store import FeatureStore, TableKey

__all__ = ["check_tables_against_graph", "edge_label_keys"]


def edge_label_keys(store: FeatureStore) -> tuple[TableKey, ...] | None:
    """The keys of edge label tables by edge type; ``None`` for one table or node labels."""
    if store.label_kind == "edge" and store.labels_by_type:
        return tuple(store.label_tables)
    return None


def check_tables_against_graph(source: Any, store: FeatureStore, seeds: Seeds | None,
                               form: bool = False) -> None:
    """Check the store's table keys and row counts against the graph of
    ``source`` (a GraphBolt ``DataLoader``'s: its one sampling graph) and its seeds (``seeds``: what
    :func:`~pingpong._dgl_seeds.dgl_loader_seeds` said about it before it was
    wrapped).  Nothing with ``form`` (the loader
    has a ``form=`` callable, which says what each table is gathered at).

    - a heterogeneous store's feature and node label keys must be node types
      of the graph: a misspelt type would get zero rows in every batch, silently;
    - edge label keys must each name one edge type of the graph, and one edge
      label table needs a graph of one edge type;
    - an edge label table with fewer rows than a seed edge id of its type needs
      is refused (more or fewer rows than edges are fine: labels for the first
      half of a graph with reverse edges added, say);
    - a feature table needs a row for every node of its type (DGL may sample
      any node; more rows are fine: a graph made from an edge list ends at its
      last connected node -- but over a subgraph, one with ``ndata[dgl.NID]``,
      more rows are a ``UserWarning``: the parent's table, gathered at the
      subgraph's ids), and a node label table one for every seed node of its
      type.

    Raises:
        TableError: as above.
        ConfigError: node labels over a loader of edge seeds, or edge labels
            over one of node seeds (every batch would be refused).
    """
    graph = seeds[1] if seeds is not None else getattr(source, "graph", None)
    if form:
        return
    _check_label_kind(seeds, store)
    if store.heterogeneous:
        _check_node_types(source, graph, store)
    if store.label_kind == "edge":
        _check_edge_label_tables(graph, store, seeds[2] if seeds and seeds[0] == "edge" else None)
    # A GraphBolt DataLoader has no graph: its sampling graph's node counts
    counted = graph if graph is not None else pipeline_graph_nodes(source)
    _check_node_rows(counted, store, seeds[2] if seeds and seeds[0] == "node" else None)


def _check_label_kind(seeds: Seeds | None, store: FeatureStore) -> None:
    """Node labels over a loader of edge seeds, or edge labels over one of node seeds:
    every batch would be refused (BatchFormError), so refuse the loader."""
    if seeds is None or store.label_kind not in ("node", "edge") or seeds[0] == store.label_kind:
        return
    if store.label_kind == "node":
        raise ConfigError(
            "labels= are node labels, gathered at each batch's seed nodes, but this DGL "
            "loader's seeds are edges (as_edge_prediction_sampler): its batches have no "
            "seed nodes. Labels per edge go in edge_labels="
        )
    raise ConfigError(
        "edge_labels= are gathered at each batch's edge ids (a pair graph's), but this "
        "DGL loader's seeds are nodes: its batches have no pair graph. Node labels go "
        "in labels=; edge prediction needs dgl.dataloading.as_edge_prediction_sampler"
    )


def _check_edge_label_tables(graph: Any, store: FeatureStore, seeds: Any) -> None:
    canonical = getattr(graph, "canonical_etypes", None)
    if not isinstance(canonical, list | tuple) or not canonical:
        return
    canonical = [tuple(c) for c in canonical]
    keys = edge_label_keys(store)
    if keys is not None:
        etypes = match_edge_types(keys, canonical, "the source's graph", TableError)
    elif len(canonical) > 1:
        raise TableError(
            "edge_labels= is one table, but the source's graph has several edge types "
            f"({sorted(canonical)}), each with its own edge ids: pass edge_labels as a "
            "dict {edge type: table}, keyed by edge type names or canonical triples"
        )
    else:
        etypes = {None: canonical[0]}
    for key, etype in etypes.items():
        table = store.label_tables[key]
        name = "edge_labels" if key is None else f"edge_labels[{key!r}]"
        edges = int(graph.num_edges(etype))
        ids = None if seeds is None else seed_ids(seeds, etype, etype[1])
        if ids is not None and ids.numel() and int(ids.max()) >= table.num_rows:
            raise TableError(
                f"{name} has {table.num_rows} rows, but the loader's seed edges of type "
                f"{etype!r} include id {int(ids.max())}: a seed edge's label is the row "
                f"at its id (the graph has {edges} edges of that type)"
            )


def _check_node_types(source: Any, graph: Any, store: FeatureStore) -> None:
    ntypes = getattr(graph, "ntypes", None)
    if not isinstance(ntypes, list | tuple):
        ntypes = pipeline_node_types(source)  # a GraphBolt DataLoader's sampling graph
    if ntypes is None:
        return
    node_keyed = [("features", store.tables)]
    if store.label_kind == "node":
        node_keyed.append(("labels", store.label_tables))
    for what, tables in node_keyed:
        for key in tables:
            if key not in ntypes:
                raise TableError(
                    f"{what}[{key!r}]: the source's graph has no node type {key!r}; "
                    f"its node types are {sorted(ntypes)}"
                )


def _check_node_rows(graph: Any, store: FeatureStore, seeds: Any) -> None:
    ntypes = getattr(graph, "ntypes", None)
    if not isinstance(ntypes, list | tuple) or not callable(getattr(graph, "num_nodes", None)):
        return
    if not store.heterogeneous and len(ntypes) != 1:
        return  # a homogeneous store's ids are plain: not this graph's, or form= made them
    # A GraphBolt pipeline's counts say where they come from (pipeline_graph_nodes)
    where = getattr(graph, "described", "the source's graph")
    for key, table in store.tables.items():
        ntype = key if store.heterogeneous else ntypes[0]
        if ntype not in ntypes:
            continue
        nodes = int(graph.num_nodes(ntype))
        of_type = f" of type {ntype!r}" if store.heterogeneous else ""
        if table.num_rows < nodes:
            raise TableError(
                f"{table.name} has {table.num_rows} rows, but {where} has {nodes} "
                f"nodes{of_type}: a feature table needs a row for each, as DGL may sample any node "
                "(a neighbour, a negative, a cluster member) -- pad it if some can never be "
                "reached"
            )
        if table.num_rows > nodes and _is_subgraph(graph, ntype):
            warnings.warn(
                f"{table.name} has {table.num_rows} rows, but the source's graph is a "
                f"subgraph (it has ndata[dgl.NID]) of {nodes} nodes{of_type}: its "
                "input_nodes are the subgraph's own ids, so a table of the parent graph "
                "gathers the wrong rows -- pass the subgraph's (sg.ndata[...], or "
                "table[sg.ndata[dgl.NID]])",
                UserWarning, stacklevel=4,
            )
    if store.label_kind != "node" or seeds is None:
        return
    for key, table in store.label_tables.items():
        ids = seed_ids(seeds, key) if store.heterogeneous else seed_ids(seeds, ntypes[0])
        if ids is not None and ids.numel() and int(ids.max()) >= table.num_rows:
            raise TableError(
                f"{table.name} has {table.num_rows} rows, but the loader's seed nodes"
                f"{f' of type {key!r}' if store.heterogeneous else ''} include id "
                f"{int(ids.max())}: labels are gathered at the seed nodes"
            )


def _is_subgraph(graph: Any, ntype: Any) -> bool:
    """The graph records parent node ids (``ndata[dgl.NID]``): a subgraph."""
    try:
        return NID in graph.nodes[ntype].data
    except Exception:  # noqa: BLE001 - a graph-like without DGL's views: unknown
        return False
