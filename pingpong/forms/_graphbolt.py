"""GraphBolt ``MiniBatch`` items (DGL 2.x), both generations of field names.

DGL 2.0-2.1 name a node task's seeds ``seed_nodes`` (and link prediction's
``node_pairs``); DGL 2.2+ use ``seeds`` for both (1-D for nodes, ``(N, 2)``
for pairs), and DGL 2.1's ``ItemSet`` already accepts ``names="seeds"``.
pingpong fills ``node_features`` (and ``labels``) itself, so the pipeline
must not fetch features too: a ``MiniBatch`` that arrives with
``node_features`` is refused rather than gathered twice.  A ``copy_to`` stage is
allowed but not needed: ids already on a GPU are copied back to the host for the
gather (``pingpong._ids`` reads them there).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import torch

from ..errors import BatchFormError

#: What to remove from a pipeline that already fetches features.
_REMOVE_FETCH = (
    "remove the .fetch_feature(...) stage from the GraphBolt pipeline (a .copy_to(...) "
    "stage is not needed either): pingpong gathers the features into its slots and "
    "moves the MiniBatch to the device itself.  With num_workers > 0, fetch from an "
    "empty store instead, .fetch_feature(gb.BasicFeatureStore({}), "
    "node_feature_keys=None): DGL 2.1 starts the workers only before a fetch stage"
)


def is_minibatch(obj: Any) -> bool:
    """True for a GraphBolt ``MiniBatch`` (checked without importing DGL)."""
    return (
        type(obj).__name__ == "MiniBatch"
        and hasattr(obj, "input_nodes")
        and hasattr(obj, "node_features")
        and hasattr(obj, "sampled_subgraphs")
    )


def node_seeds(minibatch: Any) -> Any:
    """The seed nodes of a node task, or ``None`` for a link task.

    ``seed_nodes`` (DGL 2.0-2.1) or 1-D ``seeds`` (DGL 2.2+; a dict of 1-D
    tensors for a heterogeneous graph).
    """
    seeds = getattr(minibatch, "seed_nodes", None)
    if seeds is not None:
        return seeds
    seeds = getattr(minibatch, "seeds", None)
    if seeds is None:
        return None
    values = seeds.values() if isinstance(seeds, dict) else [seeds]
    if all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in values):
        return seeds
    return None


#: DGL's name for the one node type of a homogeneous graph.
HOMOGENEOUS_NTYPE = "_N"


def pipeline_node_types(source: Any) -> list[str] | None:
    """The node types of the sampling graph(s) in a GraphBolt ``DataLoader``'s
    pipeline, or None (no GraphBolt, no pipeline).

    A GraphBolt ``DataLoader`` has no ``graph``; its stages hold the
    ``FusedCSCSamplingGraph``, whose ``node_type_to_id`` names the types. A
    homogeneous graph has none (``None``): its one type is ``"_N"``, as a DGL
    graph's is.
    """
    types: set[str] = set()
    for graph in _sampling_graphs(source):
        names = getattr(graph, "node_type_to_id", None)
        if isinstance(names, dict):
            types.update(names)
        elif names is None:
            types.add(HOMOGENEOUS_NTYPE)
    return sorted(types) or None


class SamplingGraphNodes:
    """A GraphBolt pipeline's node types and counts, asked as of a DGL graph
    (``ntypes``, ``num_nodes(ntype)``; a homogeneous graph's one type is ``"_N"``).
    ``described``: how an error names where the counts come from."""

    def __init__(self, counts: dict[str, int], described: str = "the source's graph") -> None:
        self.counts = counts
        self.ntypes = list(counts)
        self.described = described

    def num_nodes(self, ntype: str) -> int:
        return self.counts[ntype]


def pipeline_graph_nodes(source: Any) -> SamplingGraphNodes | None:
    """The node counts a GraphBolt ``DataLoader``'s tables must cover, from the
    sampling graph(s) in its pipeline; None without GraphBolt or a pipeline, or
    when a graph's counts are unknown.

    With several sampling graphs (stages over different graph objects), each
    type's count is the smallest among the graphs that have it: which graph's
    ids reach the features is not known here, and a table short against every
    one is short against that one. Each batch's ids are still checked against
    the tables, so no table is gathered past its end either way.
    """
    graphs = _sampling_graphs(source)
    merged: dict[str, int] = {}
    for graph in graphs:
        counts = _node_counts(graph)
        if counts is None:
            return None
        for ntype, nodes in counts.items():
            merged[ntype] = min(nodes, merged.get(ntype, nodes))
    if not merged:
        return None
    if len(graphs) == 1:
        return SamplingGraphNodes(merged)
    return SamplingGraphNodes(
        merged, described=f"the smallest of the source's {len(graphs)} sampling graphs")


def _node_counts(graph: Any) -> dict[str, int] | None:
    """A sampling graph's ``{type: nodes}`` (``num_nodes`` is an int, or a dict
    for a heterogeneous graph), or None if it says no ints."""
    counts = getattr(graph, "num_nodes", None)
    if isinstance(counts, dict) and all(isinstance(n, int) for n in counts.values()):
        return dict(counts)
    if isinstance(counts, int):
        return {HOMOGENEOUS_NTYPE: counts}
    return None


def _sampling_graphs(source: Any) -> list[Any]:
    """The distinct ``FusedCSCSamplingGraph`` s held by a GraphBolt ``DataLoader``'s
    stages (DGL 2.1: as ``SamplePerLayer.sampler``, a bound method of the graph).
    Every attribute of every stage is looked at, and bound methods' owners."""
    dataset = getattr(source, "dataset", None)
    if "dgl.graphbolt" not in sys.modules or dataset is None:
        return []
    try:
        from torch.utils.data.graph import traverse_dps

        stages = _stages(traverse_dps(dataset))
    except Exception:  # noqa: BLE001 -- not a datapipe graph torch can walk: no check
        return []
    found: dict[int, Any] = {}
    for stage in stages:
        for value in vars(stage).values():
            for candidate in (value, getattr(value, "__self__", None)):
                if hasattr(candidate, "csc_indptr") and hasattr(candidate, "node_type_to_id"):
                    found.setdefault(id(candidate), candidate)
    return list(found.values())


def _stages(graph: dict[Any, Any]) -> list[Any]:
    """Every datapipe of a ``traverse_dps`` graph ``{id: (datapipe, children)}``."""
    found = []
    for datapipe, children in graph.values():
        found.append(datapipe)
        found.extend(_stages(children))
    return found


def copy_for_move(value: Any) -> Any:
    """A copy of ``value`` (a ``MiniBatch``) that moving it cannot change the
    original through: GraphBolt's ``MiniBatch.to()`` -- and its sampled
    subgraphs' and CSC formats' -- set the moved tensors on the object itself.
    Dataclass objects, lists, tuples and dicts are copied, all the way down;
    tensors (and anything else) are shared, never copied."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list):
        return [copy_for_move(item) for item in value]
    if type(value) is tuple:
        return tuple(copy_for_move(item) for item in value)
    if isinstance(value, dict):
        return type(value)((key, copy_for_move(item)) for key, item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for name, item in vars(value).items():
            object.__setattr__(copied, name, copy_for_move(item))
        return copied
    return value


def check_unfetched(minibatch: Any) -> None:
    """Refuse a ``MiniBatch`` whose features were already fetched by the pipeline."""
    if minibatch.node_features:
        raise BatchFormError(
            f"the GraphBolt MiniBatch already has node_features "
            f"{sorted(map(str, minibatch.node_features))}: {_REMOVE_FETCH}"
        )


def feature_name(key: str | None, heterogeneous: bool, ntype: str | None = None) -> Any:
    """The ``node_features`` key GraphBolt code reads for pingpong's table ``key``.

    A single feature tensor is ``"feat"``; a dict of tables keeps its names;
    a heterogeneous table of node type ``t`` is ``(t, "feat")``.
    """
    if heterogeneous:
        return (ntype, "feat")
    return "feat" if key is None else key


def fill(minibatch: Any, x: Any, y: Any, heterogeneous: bool, labels_from_pingpong: bool) -> Any:
    """Put the gathered rows into the (already moved) ``minibatch``; return it.

    ``minibatch`` is pingpong's copy of the source's (:func:`copy_for_move`,
    made before the move: GraphBolt's ``MiniBatch.to()`` moves in place), so the source's own
    object is left as it was: a source that yields the same ``MiniBatch``
    objects every pass (a list of them, an ``in_memory_cache`` stage) would
    otherwise hold slot views that later batches overwrite, and be refused on
    its next pass as one that already has ``node_features``.  Heterogeneous
    labels keep the node types the minibatch has seeds of, as GraphBolt's
    item-set labels do (no zero-row entries for the others).
    """
    if heterogeneous:
        features = {feature_name(None, True, ntype): rows for ntype, rows in x.items()}
    elif isinstance(x, dict):
        features = {feature_name(key, False): rows for key, rows in x.items()}
    else:
        features = {feature_name(None, False): x}
    minibatch.node_features = features
    if labels_from_pingpong:
        seeds = node_seeds(minibatch)
        if isinstance(y, dict) and isinstance(seeds, dict):
            # GraphBolt's own labels have the seeds' node types only; a zero-row entry
            # for a type with no seeds in this batch would make a per-type loss NaN.
            y = {ntype: rows for ntype, rows in y.items() if ntype in seeds}
        minibatch.labels = y
    return minibatch
