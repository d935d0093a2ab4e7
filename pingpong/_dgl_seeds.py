"""A DGL ``DataLoader``'s seed ids, checked against its graph before DGL samples them.

DGL's samplers do not check their seeds: a node id past the graph's end makes
the fused neighbour sampler read outside its arrays.  On the training thread
that usually ends in an ``IndexError`` a few lines later; in pingpong's
producer thread it has ended in a segmentation fault, which takes the process
down with no Python traceback.  So the loader checks the seeds once, when it
is built, for the samplers whose seeds are known to be node or edge ids of
``loader.graph``:

- node ids: DGL's ``BlockSampler`` family (``NeighborSampler``,
  ``MultiLayerFullNeighborSampler``, ``LaborSampler``) and ``ShaDowKHopSampler``;
- edge ids: ``as_edge_prediction_sampler`` (``EdgePredictionSampler``);
- DistDGL's ``DistNodeDataLoader`` (node ids) and ``DistEdgeDataLoader`` (edge
  ids) against their ``DistGraph``, whatever the sampler: there an
  out-of-range seed is looked up in the partition book.

Seeds may be tensors, NumPy arrays or lists, plain or in a dict by type.
Other samplers (ClusterGCN's seeds are partition numbers, SAINT's iteration
numbers) and seeds of another kind (a ``Dataset``) are not checked.  A key
of a dict of seeds that is no type of the graph is left to DGL's own error.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import IdRangeError

#: What a DGL loader samples from: ``(kind, graph, seeds)``, ``kind`` ``"node"``
#: or ``"edge"`` (what the seeds are ids of); see :func:`dgl_loader_seeds`.
Seeds = tuple[str, Any, Any]


def dgl_loader_seeds(source: Any) -> Seeds | None:
    """``(kind, graph, seeds)`` of a DGL ``DataLoader`` with a sampler of known
    seeds, or of a ``DistNodeDataLoader`` / ``DistEdgeDataLoader`` (see the module
    docstring); ``None`` for any other source.  Never imports DGL: a source of
    DGL's exists only once DGL is imported."""
    dataloading = getattr(sys.modules.get("dgl"), "dataloading", None)
    if dataloading is None:
        return None
    if not isinstance(source, dataloading.DataLoader):
        return _dist_seeds(dataloading, source)
    kind = _seed_kind(dataloading, getattr(source, "graph_sampler", None))
    graph = getattr(source, "graph", None)
    if kind is None or graph is None:
        return None
    return kind, graph, getattr(source, "indices", None)


def check_dgl_loader_seeds(source: Any, seeds: Seeds | None) -> None:
    """Check a DGL loader's ``seeds`` (:func:`dgl_loader_seeds`) against its graph.

    Raises:
        IdRangeError: a seed id is negative or not below the number of nodes (or
            edges) of its type.
    """
    if seeds is None:
        return
    kind, graph, indices = seeds
    loader = type(source).__name__
    if isinstance(indices, Mapping):
        for key, ids in indices.items():
            _check(graph, kind, key, _as_tensor(ids), loader)
    elif (ids := _as_tensor(indices)) is not None:
        types = getattr(graph, "ntypes" if kind == "node" else "canonical_etypes", None)
        if isinstance(types, list | tuple) and len(types) == 1:  # ids of its only type
            _check(graph, kind, None, ids, loader)


def seed_ids(seeds: Any, *names: Any) -> torch.Tensor | None:
    """The seeds of one type among a loader's ``seeds``: in a dict, under any of
    ``names`` (an edge type's canonical triple and name: DGL takes either), or
    all of plain seeds (the caller's graph has one type of them); ``None`` when
    there are none."""
    if not isinstance(seeds, Mapping):
        return _as_tensor(seeds)
    for given, ids in seeds.items():
        if given in names:
            return _as_tensor(ids)
    return None


def _dist_seeds(dataloading: Any, source: Any) -> tuple[str, Any, Any] | None:
    """``(kind, DistGraph, seeds)`` of a ``DistNodeDataLoader`` or
    ``DistEdgeDataLoader`` (its collator holds them), else None."""
    for name, kind, field in (("DistNodeDataLoader", "node", "nids"),
                              ("DistEdgeDataLoader", "edge", "eids")):
        cls = getattr(dataloading, name, None)
        collator = getattr(source, "collator", None) or \
            getattr(getattr(source, "collate_fn", None), "__self__", None)
        graph = getattr(collator, "g", None)
        if cls is not None and isinstance(source, cls) and graph is not None:
            return kind, graph, getattr(collator, field, None)
    return None


_ID_DTYPES = (torch.int32, torch.int64)


def _as_tensor(ids: Any) -> torch.Tensor | None:
    """Seeds as DGL takes them -- a tensor, NumPy array or list of int32 or int64
    ids -- as a tensor, or None for anything else (a ``Dataset``, a dtype torch
    cannot hold or DGL refuses when sampling: int16, unsigned, float -- DGL's own
    error then names it; torch cannot even take the max of uint32 and uint64)."""
    if not isinstance(ids, torch.Tensor):
        if not isinstance(ids, np.ndarray | list | tuple):
            return None
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            return None
    return ids if ids.dtype in _ID_DTYPES else None


def _seed_kind(dataloading: Any, sampler: Any) -> str | None:
    """``"node"``, ``"edge"`` or None (seeds of another meaning, or unknown)."""
    edge_prediction = getattr(dataloading, "EdgePredictionSampler", None)
    if edge_prediction is not None and isinstance(sampler, edge_prediction):
        return "edge"
    node_seeded = tuple(
        cls for cls in (getattr(dataloading, "BlockSampler", None),
                        getattr(dataloading, "ShaDowKHopSampler", None))
        if cls is not None
    )
    return "node" if node_seeded and isinstance(sampler, node_seeded) else None


def _check(graph: Any, kind: str, key: Any, ids: torch.Tensor | None, loader: str) -> None:
    if ids is None or ids.numel() == 0:
        return  # what is no id tensor (of int32 or int64) is DGL's to refuse
    try:
        count = int(graph.num_nodes(key) if kind == "node" else graph.num_edges(key))
    except Exception:  # noqa: BLE001 -- not a type of this graph: DGL's own error says so
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < count:
        return
    bad = low if low < 0 else high
    where = "" if key is None else f"[{key!r}]"
    raise IdRangeError(
        f"the DGL {loader}'s seed {kind} ids{where} include {bad}, outside the graph's "
        f"{count} {kind}s{'' if key is None else f' of type {key!r}'} (valid ids are "
        f"0 <= id < {count}); DGL's sampler does not check its seeds and would read "
        "outside its arrays"
    )
