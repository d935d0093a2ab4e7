"""Torch <-> Numba-CUDA interop: the one module that needs a real GPU.

Everything here touches real CUDA: torch streams seen by Numba, Numba arrays
over torch memory, and in-place page-locking of host tensors.  Under Numba's
CUDA simulator none of it exists, so the loader's CUDA device (the only user)
is tested on a real GPU; the kernels themselves are simulator-tested.

Pinning contract (:func:`pin_in_place` / :func:`unpin`): a host tensor is
page-locked *where it lies* with ``cudaHostRegister`` -- never copied, so
pinning a table larger than half of RAM does not double its memory.  A
process-wide reference count per address makes two loaders over the same
table register it once (no "already mapped" error, DGL #3800/#3939) and
unregister it when the last one closes; memory that was already pinned by
someone else (``tensor.is_pinned()`` or ``cudaErrorHostMemoryAlreadyRegistered``)
is used as it is and never unregistered by pingpong.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import TableError


@dataclass
class _Registration:
    memory: Any  # numba MappedMemory; unregisters when released
    count: int


_pin_lock = threading.Lock()
_registrations: dict[int, _Registration] = {}


def pin_in_place(byte_rows: np.ndarray, owner: torch.Tensor) -> Any:
    """Page-lock and map ``byte_rows``' memory in place; return a zero-copy device array.

    The returned Numba device array reads the host rows directly over PCIe.
    Memory already pinned by torch (``owner.is_pinned()``) is used as it is
    and never unregistered by pingpong; otherwise the range is registered with
    ``cuMemHostRegister`` (through Numba's driver API, so a failure does not
    leave a sticky error in torch's CUDA runtime) and reference-counted.

    Raises:
        TableError: registration failed (e.g. ``ulimit -l`` too low); the
            message carries the driver's error and the size.
    """
    from numba import cuda
    from numba.cuda.cudadrv import devicearray

    ptr = int(byte_rows.ctypes.data)
    nbytes = int(byte_rows.nbytes)
    if owner.is_pinned():
        interface = {
            "shape": tuple(byte_rows.shape),
            "typestr": byte_rows.dtype.str,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }
        return cuda.from_cuda_array_interface(interface, owner=owner, sync=False)
    with _pin_lock:
        registration = _registrations.get(ptr)
        if registration is None:
            try:
                memory = cuda.current_context().mempin(owner, ptr, nbytes, mapped=True)
            except Exception as exc:
                raise TableError(
                    f"pinning {nbytes / 2**30:.2f} GiB of host memory in place failed: {exc}; "
                    "check the locked-memory limit (`ulimit -l`) and free RAM, or use "
                    "gather='staged'"
                ) from exc
            registration = _registrations[ptr] = _Registration(memory, 0)
        registration.count += 1
        memory = registration.memory
    return devicearray.DeviceNDArray(
        shape=byte_rows.shape, strides=byte_rows.strides, dtype=byte_rows.dtype, gpu_data=memory
    )


def unpin(byte_rows: np.ndarray) -> None:
    """Drop one registration made by :func:`pin_in_place`; unregister at zero."""
    ptr = int(byte_rows.ctypes.data)
    with _pin_lock:
        registration = _registrations.get(ptr)
        if registration is None:
            return
        registration.count -= 1
        if registration.count > 0:
            return
        del _registrations[ptr]
        from numba import cuda

        registration.memory.free()
        # Numba defers the unregistration; flush it now so that registering
        # the same table again (a new loader) cannot find it "already mapped".
        cuda.current_context().deallocations.clear()


def registered_count() -> int:
    """How many distinct host ranges pingpong holds registered (for leak tests)."""
    with _pin_lock:
        return len(_registrations)


def numba_stream(stream: torch.cuda.Stream) -> Any:
    """A Numba stream object for a torch stream (no new stream is created)."""
    from numba import cuda

    return cuda.external_stream(stream.cuda_stream)


def device_array(tensor: torch.Tensor) -> Any:
    """A Numba device array over a CUDA tensor's memory (no copy, no sync)."""
    from numba import cuda

    return cuda.as_cuda_array(tensor.detach(), sync=False)
