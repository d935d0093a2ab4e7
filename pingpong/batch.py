"""The batch the training loop receives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from .slots import Lease

Features = torch.Tensor | dict[str, torch.Tensor]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return value


class _BatchFields(NamedTuple):
    input_nodes: Any
    output_nodes: Any
    blocks: Any
    x: Features
    y: Features | None


class Batch(_BatchFields):
    """One mini-batch, with features and labels already on the loader's device.

    Unpacks as ``input_nodes, output_nodes, blocks, x, y = batch``.

    Lifetime contract: ``x`` and ``y`` are *views into a slot* that pingpong
    reuses.  They stay valid until the training loop asks the same iterator
    for the next batch (the next turn of the ``for`` loop) or a new epoch of
    the same loader starts (``iter(loader)`` again).  Ending an epoch early
    (``break``, ``close()``, dropping the loader) does not overwrite them.
    Keep data beyond that with :meth:`clone`.

    Stream contract (CUDA): the batch is ready on the CUDA stream that was
    current when ``next()`` returned it, and its slot is refilled only after
    the work queued on that stream up to the next ``next()`` is done.  To read
    it on another stream, call :meth:`record_stream` first (as with
    ``Tensor.record_stream``).  On the CPU both are no-ops.

    Attributes:
        input_nodes: ids of the nodes whose features are in ``x`` (as the source
            gave them).
        output_nodes: ids of the seed nodes whose labels are in ``y``.
        blocks: the sampled layers (DGL blocks, or :class:`~pingpong.blocks.EdgeBlock`
            where DGL cannot put blocks on the device).
        x: ``features[input_nodes]`` -- a tensor, or a dict of tensors when the
            loader was given a dict of feature tables (heterogeneous loaders:
            ``{t: features[t][input_nodes[t]]}``).
        y: ``labels[output_nodes]``, or ``None`` when the loader has no labels
            (heterogeneous loaders: ``{t: labels[t][output_nodes[t]]}``).
    """

    #: The slot lease this batch was delivered with (``None`` for a clone).
    _lease: Lease | None = None

    @classmethod
    def leased(
        cls,
        lease: Lease,
        input_nodes: Any,
        output_nodes: Any,
        blocks: Any,
        x: Features,
        y: Features | None,
    ) -> Batch:
        """A batch whose fields live in ``lease``'s slot."""
        batch = cls(input_nodes, output_nodes, blocks, x, y)
        batch._lease = lease
        return batch

    def record_stream(self, stream: Any) -> Batch:
        """Use this batch on ``stream`` too: ``stream`` waits until the batch is ready,
        and the slot is not refilled before the work queued on ``stream`` up to
        the next ``next()`` is done.  Returns the batch.

        Raises :class:`~pingpong.errors.BatchExpiredError` once the slot was
        handed back.  A clone owns its memory: this does nothing for it.
        """
        if self._lease is not None:
            self._lease.use_on(stream)
        return self

    def clone(self) -> Batch:
        """A copy whose ``x`` and ``y`` own their memory (safe to keep)."""
        return Batch(
            self.input_nodes, self.output_nodes, self.blocks, _clone(self.x), _clone(self.y)
        )
