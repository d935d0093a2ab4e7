"""Batch forms: what a source item is, what to gather for it, what to deliver.

The producer asks :meth:`ItemReader.read` about every item before it reads
any row.  The answer, an :class:`ItemPlan`, says which ids to gather the
feature tables at, which ids to gather the label table at (if any), which
graphs must move to the device, and how to build the delivered batch from
the moved graphs and the gathered rows.  Devices therefore know tensors and
graph-like objects (anything with ``.to(device)``), never DGL.

Each form: the source item; where features / labels are gathered; what is delivered.

- ``(input_nodes, output_nodes, blocks)`` (node classification): at
  ``input_nodes`` / ``output_nodes``; a :class:`~pingpong.Batch`.
- ``(input_nodes, output_nodes, subgraph)`` (ShaDow): the same; a
  :class:`~pingpong.Batch` whose ``blocks`` is the subgraph.
- ``(input_nodes, pair_graph, blocks)`` (edge prediction): at ``input_nodes``
  / edge labels at ``pair_graph.edata[dgl.EID]``; an :class:`~pingpong.EdgeBatch`.
- ``(input_nodes, pair_graph, neg_pair_graph, blocks)`` (with negatives): the
  same; a :class:`~pingpong.NegativeEdgeBatch`.
- a DGL subgraph (ClusterGCN, SAINT): at ``ndata[dgl.NID]`` for both; a
  :class:`~pingpong.SubgraphBatch`.
- a GraphBolt ``MiniBatch`` whose pipeline fetches no features: at
  ``input_nodes`` / the seed nodes; the ``MiniBatch`` itself, moved, with
  ``node_features`` (and ``labels``) filled.
- anything, with ``form=callable``: at what the callable returns; a
  :class:`~pingpong.CustomBatch`.

Anything else raises :class:`~pingpong.errors.BatchFormError` (also a
``TypeError``) naming what was seen and listing these forms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..batch import Batch, CustomBatch, EdgeBatch, NegativeEdgeBatch, SubgraphBatch
from ..blocks import EdgeBlock, HeteroEdgeBlock
from ..errors import BatchFormError
from . import _graphbolt
from ._dgl import (
    dgl_can_hold_graphs_on,
    edge_blocks_from_dgl,
    is_dgl_graph,
    original_edge_ids,
    original_node_ids,
)

__all__ = ["FORMS", "ItemPlan", "ItemReader", "LabelKind", "place_graphs"]

#: The forms pingpong reads, as error messages list them.
FORMS = (
    "(input_nodes, output_nodes, blocks): DGL node classification",
    "(input_nodes, output_nodes, subgraph): DGL ShaDowKHopSampler",
    "(input_nodes, pair_graph, blocks): DGL edge prediction",
    "(input_nodes, pair_graph, neg_pair_graph, blocks): DGL edge prediction with negatives",
    "a DGL subgraph with ndata[dgl.NID]: ClusterGCNSampler, SAINTSampler",
    "a GraphBolt MiniBatch whose pipeline does not fetch features",
    "anything, with PingPongLoader(..., form=callable)",
)

#: Which label table the loader has: node labels, edge labels, or none.
LabelKind = str  # "node" | "edge" | "none"

#: ``form=`` callables return (feature ids, label ids or None).
FormCallable = Callable[[Any], tuple[Any, Any]]


@dataclass(frozen=True)
class ItemPlan:
    """What to do with one source item (see the module docstring).

    ``build(graphs, x, y)`` returns the batch, given ``graphs`` -- the
    entries of :attr:`graphs` as they are on the device -- and the gathered
    ``x``/``y``.
    """

    feature_ids: Any
    label_ids: Any
    feature_ids_name: str
    label_ids_name: str
    graphs: tuple[Any, ...]
    build: Callable[[list[Any], Any, Any], Any]


def _is_ids(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor | np.ndarray | Mapping)


def _describe(item: Any) -> str:
    if isinstance(item, tuple | list):
        parts = ", ".join(type(part).__name__ for part in item[:6])
        more = ", ..." if len(item) > 6 else ""
        return f"a {type(item).__name__} of length {len(item)} ({parts}{more})"
    return f"a {type(item).__module__}.{type(item).__name__}"


def _python_ids_hint(item: Any) -> str:
    """For an item that would be a known form but for ids given as a Python
    sequence: which element, and what ids must be."""
    if not isinstance(item, tuple | list) or len(item) not in (3, 4):
        return ""
    # (input_nodes, output_nodes, blocks); in an edge form element 1 is a graph
    named = ((0, "input_nodes"), (1, "output_nodes")) if len(item) == 3 else ((0, "input_nodes"),)
    for position, name in named:
        part = item[position]
        if isinstance(part, list | tuple | range) and all(
                isinstance(v, int | np.integer) and not isinstance(v, bool) for v in part):
            return (f"; its {name} (element {position}) is a Python {type(part).__name__}: "
                    "ids are a torch.Tensor or NumPy array (torch.as_tensor(ids))")
        if not _is_ids(part):
            return ""
    return ""


def _is_graph(obj: Any) -> bool:
    return is_dgl_graph(obj) or isinstance(obj, EdgeBlock | HeteroEdgeBlock)


def _graph_list(blocks: Any) -> list[Any]:
    """The graph-like entries to move from a ``blocks`` field (others pass through)."""
    if _is_graph(blocks):
        return [blocks]
    if isinstance(blocks, list | tuple) and blocks and all(_is_graph(b) for b in blocks):
        return list(blocks)
    return []


def _rebuild_blocks(blocks: Any, moved: list[Any]) -> Any:
    if not moved:
        return blocks
    if _is_graph(blocks):
        return moved[0]
    return type(blocks)(moved) if isinstance(blocks, tuple) else list(moved)


class ItemReader:
    """Reads source items for one loader.

    Args:
        label_kind: ``"node"`` (the loader has node ``labels``), ``"edge"``
            (``edge_labels``) or ``"none"``.
        heterogeneous: the loader's tables are per node type.
        form: the loader's ``form=`` callable, or ``None``.
        edge_label_keys: the keys of edge label tables by edge type (names or
            canonical triples), or ``None`` for one edge label table.
    """

    def __init__(
        self, label_kind: LabelKind, heterogeneous: bool, form: FormCallable | None,
        edge_label_keys: tuple[Any, ...] | None = None,
    ) -> None:
        self.label_kind = label_kind
        self.heterogeneous = heterogeneous
        self.form = form
        self.edge_label_keys = edge_label_keys

    def read(self, item: Any, seq: int) -> ItemPlan:
        """The plan for ``item`` (the ``seq``-th of its epoch); reads no row.

        Raises :class:`~pingpong.errors.BatchFormError` for an item of no
        known form, or labels that do not fit the form.
        """
        if self.form is not None:
            return self._custom(self.form, item, seq)
        if _graphbolt.is_minibatch(item):
            return self._minibatch(item)
        if is_dgl_graph(item):
            return self._subgraph(item)
        if isinstance(item, tuple | list) and item and _is_ids(item[0]):
            if len(item) == 3 and is_dgl_graph(item[1]):
                return self._edges(item, negatives=False)
            if len(item) == 4 and is_dgl_graph(item[1]) and is_dgl_graph(item[2]):
                return self._edges(item, negatives=True)
            if len(item) == 3 and _is_ids(item[1]):
                return self._node_triple(item)
        raise BatchFormError(
            f"source item {seq} is {_describe(item)}, a form pingpong cannot read"
            f"{_python_ids_hint(item)}; it reads:\n  - " + "\n  - ".join(FORMS)
        )

    # -- the forms -----------------------------------------------------------------
    def _no_labels_of(self, kind: str, form: str) -> None:
        if self.label_kind == kind:
            argument = "labels" if kind == "node" else "edge_labels"
            article = "an" if form[0] in "aeiou" else "a"
            raise BatchFormError(
                f"the loader has {argument}=, but {article} {form} item has no "
                f"{'seed nodes' if kind == 'node' else 'edge ids'} to gather them at"
                + ("; labels per edge go in edge_labels=" if kind == "node" else "")
            )

    def _node_triple(self, item: Sequence[Any]) -> ItemPlan:
        input_nodes, output_nodes, blocks = item
        self._no_labels_of("edge", "node-classification")
        graphs = _graph_list(blocks)

        def build(moved: list[Any], x: Any, y: Any) -> Batch:
            return Batch(input_nodes, output_nodes, _rebuild_blocks(blocks, moved), x, y)

        return ItemPlan(
            input_nodes,
            output_nodes if self.label_kind == "node" else None,
            "input_nodes",
            "output_nodes",
            tuple(graphs),
            build,
        )

    def _edges(self, item: Sequence[Any], negatives: bool) -> ItemPlan:
        self._no_labels_of("node", "edge-prediction")
        input_nodes, pair_graph = item[0], item[1]
        neg_pair_graph = item[2] if negatives else None
        blocks = item[-1]
        label_ids = (
            original_edge_ids(pair_graph, "pair_graph", self.edge_label_keys)
            if self.label_kind == "edge" else None
        )
        heads = [pair_graph, neg_pair_graph] if negatives else [pair_graph]
        block_graphs = _graph_list(blocks)

        def build(moved: list[Any], x: Any, y: Any) -> EdgeBatch | NegativeEdgeBatch:
            moved_blocks = _rebuild_blocks(blocks, moved[len(heads) :])
            if negatives:
                return NegativeEdgeBatch(input_nodes, moved[0], moved[1], moved_blocks, x, y)
            return EdgeBatch(input_nodes, moved[0], moved_blocks, x, y)

        return ItemPlan(
            input_nodes,
            label_ids,
            "input_nodes",
            "pair_graph.edata[dgl.EID]",
            (*heads, *block_graphs),
            build,
        )

    def _subgraph(self, graph: Any) -> ItemPlan:
        self._no_labels_of("edge", "subgraph")
        node_ids = original_node_ids(graph, "the subgraph")

        def build(moved: list[Any], x: Any, y: Any) -> SubgraphBatch:
            return SubgraphBatch(moved[0], x, y)

        return ItemPlan(
            node_ids,
            node_ids if self.label_kind == "node" else None,
            "subgraph.ndata[dgl.NID]",
            "subgraph.ndata[dgl.NID]",
            (graph,),
            build,
        )

    def _minibatch(self, minibatch: Any) -> ItemPlan:
        _graphbolt.check_unfetched(minibatch)
        self._no_labels_of("edge", "GraphBolt MiniBatch")
        label_ids = None
        if self.label_kind == "node":
            label_ids = _graphbolt.node_seeds(minibatch)
            if label_ids is None:
                raise BatchFormError(
                    "the loader has labels=, but this GraphBolt MiniBatch is a link task "
                    "(no seed nodes): its labels come from the item set"
                )
            if minibatch.labels is not None:
                raise BatchFormError(
                    "the GraphBolt MiniBatch already carries labels (from its item set); "
                    "drop labels= from the PingPongLoader, or the labels from the item set"
                )
        heterogeneous = self.heterogeneous
        with_labels = label_ids is not None

        def build(moved: list[Any], x: Any, y: Any) -> Any:
            return _graphbolt.fill(moved[0], x, y, heterogeneous, with_labels)

        return ItemPlan(
            minibatch.input_nodes,
            label_ids,
            "MiniBatch.input_nodes",
            "MiniBatch seed nodes",
            # a copy: GraphBolt's MiniBatch.to() moves in place, and the source's
            # own object must stay as it was (see _graphbolt.fill)
            (_graphbolt.copy_for_move(minibatch),),
            build,
        )

    def _custom(self, form: FormCallable, item: Any, seq: int) -> ItemPlan:
        result = form(item)  # what the callable raises reaches the training loop unchanged
        # A dict of two node types would unpack into its two keys, and unpacking a DGL
        # graph (form=lambda sg: sg) raises DGL's own error: both are no pair.
        try:
            if isinstance(result, Mapping) or is_dgl_graph(result):
                raise TypeError(type(result).__name__)
            feature_ids, label_ids = result
        except Exception as exc:  # whatever unpacking it raised
            raise BatchFormError(
                f"form= must return a pair (feature ids, label ids or None) for item {seq}; "
                f"it returned {_describe(result)}"
            ) from exc
        if label_ids is not None and self.label_kind == "none":
            label_ids = None  # nothing to gather them into
        if isinstance(label_ids, Mapping) and self.edge_label_keys is not None:
            label_ids = _ids_by_edge_label_key(label_ids, self.edge_label_keys, seq)

        def build(moved: list[Any], x: Any, y: Any) -> CustomBatch:
            return CustomBatch(item, x, y)

        return ItemPlan(feature_ids, label_ids, "form(item)[0]", "form(item)[1]", (), build)


def _ids_by_edge_label_key(ids: Mapping[Any, Any], keys: tuple[Any, ...],
                           seq: int) -> dict[Any, Any]:
    """A ``form=``'s label ids by edge type, keyed as the edge label tables are:
    each table's ids under its own key, or under the same edge type spelt the
    other way (the name for a canonical triple, or the reverse: DGL's own
    ``edata[dgl.EID]`` dicts are keyed by canonical triples).  Other entries
    are left out.  :class:`~pingpong.errors.BatchFormError` for a table with
    none, or with several."""
    matched = {}
    for key in keys:
        if key in ids:
            matched[key] = ids[key]
            continue
        found = [given for given in ids
                 if (isinstance(key, str) and isinstance(given, tuple) and given[1:2] == (key,))
                 or (isinstance(key, tuple) and given == key[1])]
        if len(found) != 1:
            given = ", ".join(repr(k) for k in ids)
            raise BatchFormError(
                f"form= returned label ids for item {seq} keyed {{{given}}}: "
                f"{'none' if not found else 'several'} for edge_labels[{key!r}]; key "
                "them as edge_labels is, or by canonical edge type"
            )
        matched[key] = ids[found[0]]
    return matched


def place_graphs(graphs: tuple[Any, ...], device: torch.device,
                 as_edge_blocks: bool = False) -> list[Any]:
    """The graphs in the form ``device`` can hold, before any row is read.

    DGL graphs stay DGL graphs where this DGL build can put them on
    ``device`` (always on the CPU) and ``as_edge_blocks`` is false; elsewhere
    a homogeneous one becomes an :class:`~pingpong.blocks.EdgeBlock`, a
    heterogeneous one a :class:`~pingpong.blocks.HeteroEdgeBlock`.
    """
    if not graphs or (device.type == "cpu" and not as_edge_blocks):
        return list(graphs)
    placed = []
    for graph in graphs:
        if is_dgl_graph(graph) and (as_edge_blocks or not dgl_can_hold_graphs_on(device)):
            graph = edge_blocks_from_dgl(graph)
        placed.append(graph)
    return placed
