"""DGL's sampler processes sending small tensors by value: a cheaper hand-over per batch.

With ``DGL_NUM_SAMPLER`` > 0, DGL's distributed loaders sample in processes of
their own and send every batch to the trainer through a ``multiprocessing``
queue. torch pickles each CPU tensor for such a queue as shared memory: the
sender copies the tensor into a new shared-memory segment, and the receiver
asks the sender for the segment's file descriptor over a fresh, authenticated
socket connection, one per tensor -- about nine per batch of a two-layer
neighbour sampler. For the small tensors of a batch (ids, a block's edges)
that costs far more than the bytes: a profile of pingpong's producer thread
(``benchmarks/dist_epoch.py --samplers 1 --profile-producer``, the thread's CPU
time) found about 8 of the 10.7 ms it took to receive a batch spent on those
connections -- CPU, much of it Python, that the training step then competes
with for the cores and the GIL.

:func:`send_sampler_batches_by_value` has every DGL sampler process of this
trainer pickle a plain CPU tensor of at most ``max_bytes`` by value (its bytes
go through the queue's pipe) and leave larger ones, and every other object, to
torch. The trainer needs nothing installed: unpickling a tensor sent by value
rebuilds it with :func:`rebuild_tensor`.  A tensor received this way is a
private copy (``is_shared()`` is False), equal bit for bit to what was sent,
with the same dtype and shape (the strides of a contiguous tensor).
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_tensor  # imported by torch itself

from ._integers import Count, integer
from .errors import ConfigError

__all__ = ["DEFAULT_MAX_BYTES", "by_value_reduction", "install_in_this_process",
           "installed_max_bytes", "rebuild_tensor", "send_sampler_batches_by_value"]

#: Tensors up to this many bytes go by value by default (1 MiB: a batch's ids and edges
#: at usual batch sizes and fan-outs; a big feature block still goes as shared memory).
DEFAULT_MAX_BYTES = 1 << 20

#: This process's limit, once :func:`install_in_this_process` ran.
_max_bytes: int | None = None


def rebuild_tensor(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor that :func:`by_value_reduction` sent: ``data`` (its bytes, uint8)
    viewed as ``dtype`` and shaped ``shape``; it owns ``data``, no copy."""
    return torch.from_numpy(data).view(dtype).reshape(shape)


def by_value_reduction(tensor: torch.Tensor, max_bytes: int) -> tuple[Any, tuple[Any, ...]] | None:
    """``(rebuild_tensor, args)`` sending ``tensor`` by value, or None when it is not
    a plain, dense CPU tensor of at most ``max_bytes`` without autograd history
    (those are left to torch)."""
    if (type(tensor) is not torch.Tensor or tensor.device.type != "cpu"
            or tensor.layout != torch.strided or tensor.requires_grad
            or tensor.is_quantized or tensor.is_conj() or tensor.is_neg()
            or tensor.numel() * tensor.element_size() > max_bytes):
        return None
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return rebuild_tensor, (data, tensor.dtype, tuple(tensor.shape))


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """The ``ForkingPickler`` reduction this module installs for ``torch.Tensor``."""
    assert _max_bytes is not None
    reduced = by_value_reduction(tensor, _max_bytes)
    return reduce_tensor(tensor) if reduced is None else reduced


def install_in_this_process(max_bytes: int) -> None:
    """From now on, ``multiprocessing`` pickling in this process (queues, pipes) sends
    plain CPU tensors of at most ``max_bytes`` by value (see the module docstring).
    Called in each DGL sampler process by :func:`send_sampler_batches_by_value`."""
    global _max_bytes
    _max_bytes = _checked_max_bytes(max_bytes)
    # torch registered its own reductions at ``import torch``: this one replaces torch's
    ForkingPickler.register(torch.Tensor, _reduce_tensor)


def installed_max_bytes() -> int | None:
    """This process's limit, or None when :func:`install_in_this_process` did not run."""
    return _max_bytes


def send_sampler_batches_by_value(max_bytes: Count = DEFAULT_MAX_BYTES) -> int:
    """Have this trainer's DGL sampler processes send each batch's tensors of at most
    ``max_bytes`` by value, not as shared memory (see the module docstring); the
    number of sampler processes told (0 without any: nothing to do).

    Call it after ``dgl.distributed.initialize`` (which starts the sampler
    processes), before the loaders are iterated. Each sampler process installs it
    before the next batch request it receives, so batches requested earlier may
    still come as shared memory; either way every batch is the same, bit for bit.
    It lasts as long as the sampler processes, for every DGL loader of this trainer.

    Raises:
        ValueError: ``max_bytes`` is not a non-negative int.
        ImportError: DGL is not installed.
    """
    max_bytes = _checked_max_bytes(max_bytes)
    from dgl.distributed.dist_context import get_sampler_pool

    pool, num_samplers = get_sampler_pool()
    if pool is None or not num_samplers:
        return 0
    pool.submit_task_to_all_workers(install_in_this_process, max_bytes)
    return int(num_samplers)


def _checked_max_bytes(max_bytes: Any) -> int:
    if (number := integer(max_bytes)) is None or number < 0:
        raise ConfigError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    return number
