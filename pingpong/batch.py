"""The batch the training loop receives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from .slots import Lease

Features = torch.Tensor | dict[str, torch.Tensor]
#: Edge labels: one tensor, or a dict by edge type (names or canonical triples).
EdgeLabels = torch.Tensor | dict[str | tuple[str, str, str], torch.Tensor]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return value


class LeasedBatch:
    """What every pingpong batch type adds to its fields: the slot lease.

    Mixed into the named tuples below (their instances have a ``__dict__``
    for it); ``_lease`` is set by the consumer when ``next()`` delivers the
    batch, and ``None`` for a clone.  :meth:`_replace` keeps it; a batch built
    anew from the fields (``Batch(*batch)``) has none, though its ``x`` and
    ``y`` are still the slot's views: use ``_replace`` or :meth:`clone`.
    """

    #: The slot lease this batch was delivered with (``None`` for a clone).
    _lease: Lease | None = None

    def record_stream(self, stream: Any) -> Any:
        """Use this batch on ``stream`` too: ``stream`` waits until the batch is ready,
        and the slot is not refilled before the work queued on ``stream`` up to
        the next ``next()`` is done.  Returns the batch.

        Raises :class:`~pingpong.errors.BatchExpiredError` once the slot was
        handed back.  A clone owns its memory: this does nothing for it.
        """
        if self._lease is not None:
            self._lease.use_on(stream)
        return self

    def _replace(self, **fields: Any) -> Any:
        """The named tuple's ``_replace``, keeping the slot lease whatever is
        replaced: the new batch's ``x`` and ``y`` may still be the slot's views,
        so :meth:`record_stream` on it waits for the batch and holds the slot
        (and raises :class:`~pingpong.errors.BatchExpiredError` once the slot was
        handed back).  A batch whose ``x`` and ``y`` own their memory:
        :meth:`clone`."""
        replaced = super()._replace(**fields)  # type: ignore[misc]
        replaced._lease = self._lease
        return replaced

    def clone(self) -> Any:
        """A copy whose ``x`` and ``y`` own their memory (safe to keep).

        Raises :class:`~pingpong.errors.BatchExpiredError` once the slot was
        handed back (the next batch was requested, or a new epoch started):
        the copy would be of whatever the slot holds now.  Clone before the
        next ``next()``.  (A clone, and a batch built anew from the fields,
        carry no lease: nothing is checked for them.)
        """
        if self._lease is not None:
            self._lease.check_not_ended("clone()")
        fields = self._asdict()  # type: ignore[attr-defined]
        fields["x"] = _clone(fields["x"])
        fields["y"] = _clone(fields["y"])
        return type(self)(**fields)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """``pickle``, ``copy.copy``/``deepcopy`` and ``torch.save`` take what
        :meth:`clone` returns: the fields, ``x`` and ``y`` owning their rows (not
        the whole slot they are views of), and no lease (it holds a lock).  Like
        :meth:`clone`, they raise :class:`~pingpong.errors.BatchExpiredError`
        once the slot was handed back."""
        return (type(self), tuple(self.clone()))


class _BatchFields(NamedTuple):
    input_nodes: Any
    output_nodes: Any
    blocks: Any
    x: Features
    y: Features | None


class Batch(LeasedBatch, _BatchFields):
    """One node-classification mini-batch, with features and labels on the loader's device.

    What a DGL ``(input_nodes, output_nodes, blocks)`` item becomes (and
    ShaDow's ``(input_nodes, output_nodes, subgraph)``: then ``blocks`` is the
    subgraph).  Unpacks as ``input_nodes, output_nodes, blocks, x, y = batch``.

    Lifetime contract: ``x`` and ``y`` are *views into a slot* that pingpong
    reuses.  They stay valid until the training loop asks the same iterator
    for the next batch (the next turn of the ``for`` loop) or a new epoch of
    the same loader starts (``iter(loader)`` again).  Ending an epoch early
    (``break``, ``close()``, dropping the loader) does not overwrite them.
    Keep data beyond that with :meth:`clone` (``copy.copy``/``deepcopy``,
    ``pickle`` and ``torch.save`` copy as it does).  The same holds for every
    batch type below.

    Stream contract (CUDA): the batch is ready on the CUDA stream that was
    current when ``next()`` returned it, and its slot is refilled only after
    the work queued on that stream up to the next ``next()`` is done.  To read
    it on another stream, call :meth:`record_stream` first (as with
    ``Tensor.record_stream``).  On the CPU there are no streams: the batch is
    ready when ``next()`` returns it, and :meth:`record_stream` only checks that
    the slot was not handed back yet (:class:`~pingpong.errors.BatchExpiredError`).

    Attributes:
        input_nodes: ids of the nodes whose features are in ``x`` (as the source
            gave them).
        output_nodes: ids of the seed nodes whose labels are in ``y``.
        blocks: the sampled layers (DGL blocks, or :class:`~pingpong.blocks.EdgeBlock`
            where DGL cannot put blocks on the device), on the device.
        x: ``features[input_nodes]`` -- a tensor, or a dict of tensors when the
            loader was given a dict of feature tables (heterogeneous loaders:
            ``{t: features[t][input_nodes[t]]}``).
        y: ``labels[output_nodes]``, or ``None`` when the loader has no labels
            (heterogeneous loaders: ``{t: labels[t][output_nodes[t]]}``).
    """


class _EdgeFields(NamedTuple):
    input_nodes: Any
    pair_graph: Any
    blocks: Any
    x: Features
    y: EdgeLabels | None


class EdgeBatch(LeasedBatch, _EdgeFields):
    """An edge-prediction mini-batch without negatives.

    What DGL's ``as_edge_prediction_sampler(sampler)`` item ``(input_nodes,
    pair_graph, blocks)`` becomes: the same fields, graphs on the device, plus
    ``x = features[input_nodes]`` and ``y = edge_labels[pair_graph.edata[dgl.EID]]``
    (``None`` without ``edge_labels``; with a dict of edge label tables, a dict
    ``{key: edge_labels[key][pair_graph.edata[dgl.EID][etype]]}``, ``etype``
    the canonical edge type ``key`` names).
    """


class _NegativeEdgeFields(NamedTuple):
    input_nodes: Any
    pair_graph: Any
    neg_pair_graph: Any
    blocks: Any
    x: Features
    y: EdgeLabels | None


class NegativeEdgeBatch(LeasedBatch, _NegativeEdgeFields):
    """An edge-prediction mini-batch with negative sampling.

    What ``as_edge_prediction_sampler(sampler, negative_sampler=...)``'s item
    ``(input_nodes, pair_graph, neg_pair_graph, blocks)`` becomes, plus ``x``
    and ``y`` as in :class:`EdgeBatch` (``y`` labels the positive edges).
    """


class _SubgraphFields(NamedTuple):
    subgraph: Any
    x: Features
    y: Features | None


class SubgraphBatch(LeasedBatch, _SubgraphFields):
    """A node-induced subgraph (``ClusterGCNSampler``, ``SAINTSampler``).

    ``subgraph`` on the device, ``x = features[subgraph.ndata[dgl.NID]]`` and
    ``y = labels[subgraph.ndata[dgl.NID]]``: one row per subgraph node, in the
    subgraph's node order.
    """


class _CustomFields(NamedTuple):
    item: Any
    x: Features
    y: Features | EdgeLabels | None


class CustomBatch(LeasedBatch, _CustomFields):
    """An item read through the loader's ``form=`` callable.

    ``item`` is the source's item as it was (nothing in it is moved);
    ``x``/``y`` are gathered at the ids the callable returned.
    """
