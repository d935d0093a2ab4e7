"""The batch the training loop receives."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

Features = torch.Tensor | dict[str, torch.Tensor]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return value


class Batch(NamedTuple):
    """One mini-batch, with features and labels already on the loader's device.

    Lifetime contract: ``x`` and ``y`` are *views into a slot* that pingpong
    reuses.  They stay valid until the training loop asks for the next batch
    (``next()`` on the iterator, or the next turn of the ``for`` loop), or the
    epoch ends early.  Keep data beyond that with :meth:`clone`.

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

    input_nodes: Any
    output_nodes: Any
    blocks: Any
    x: Features
    y: Features | None

    def clone(self) -> Batch:
        """A copy whose ``x`` and ``y`` own their memory (safe to keep)."""
        return Batch(
            self.input_nodes, self.output_nodes, self.blocks, _clone(self.x), _clone(self.y)
        )
