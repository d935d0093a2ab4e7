"""Torch <-> Numba-CUDA interop: the one module that needs a real GPU.

Everything here touches real CUDA: torch streams seen by Numba, Numba arrays
over torch memory, and in-place page-locking of host tensors.  Under Numba's
CUDA simulator none of it exists, so the loader's CUDA device (the only user)
is tested on a real GPU; the kernels themselves are simulator-tested.

Pinning contract (:func:`pin_in_place` -> :class:`PinnedTable`): a host
tensor is page-locked *where it lies* -- never copied, so pinning a table
larger than half of RAM does not double its memory.  A process-wide reference
count per address makes two loaders over the same table share one
registration (no "already mapped" error, DGL #3800/#3939); it is unregistered
when the last handle is released, and can be registered again afterwards.
Memory that was already pinned by someone else (``tensor.is_pinned()``) is
used as it is and never unregistered by pingpong.
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
    memory: Any  # numba MappedMemory; unregisters when freed
    count: int


_pin_lock = threading.Lock()
_registrations: dict[int, _Registration] = {}


class PinnedTable:
    """A zero-copy device view of a host table, and the pin it holds.

    ``array`` is a Numba device array that reads the host rows directly over
    PCIe.  :meth:`release` drops this handle's share of the registration
    (idempotent); the memory is unregistered when the last handle of
    pingpong's goes.  Memory pinned by someone else is never unregistered.
    """

    def __init__(self, array: Any, ptr: int | None) -> None:
        self.array = array
        self._ptr = ptr  # None: not registered by pingpong

    def release(self) -> None:
        ptr, self._ptr = self._ptr, None
        self.array = None
        if ptr is None:
            return
        with _pin_lock:
            registration = _registrations[ptr]
            registration.count -= 1
            if registration.count > 0:
                return
            del _registrations[ptr]
            from numba import cuda

            registration.memory.free()
            # Numba defers the unregistration; flush it now so that registering
            # the same table again (a new loader) cannot find it "already mapped".
            cuda.current_context().deallocations.clear()


def pin_in_place(byte_rows: np.ndarray, owner: torch.Tensor) -> PinnedTable:
    """Page-lock and map ``byte_rows``' memory in place (no copy); see :class:`PinnedTable`.

    Registrations are reference-counted per address, so two loaders over one
    table share one registration (no "already mapped" error, DGL #3800/#3939).
    Memory pinned by torch or another library (``owner.is_pinned()``, and not
    by pingpong) is used as it is.  Registration goes through Numba's driver
    API (``cuMemHostRegister``), so a failure leaves no sticky error in
    torch's CUDA runtime.

    Raises:
        TableError: registration failed (e.g. ``ulimit -l`` too low); the
            message carries the driver's error and the size.
    """
    from numba import cuda
    from numba.cuda.cudadrv import devicearray

    ptr = int(byte_rows.ctypes.data)
    nbytes = int(byte_rows.nbytes)
    with _pin_lock:
        registration = _registrations.get(ptr)
        if registration is None and owner.is_pinned():
            interface = {
                "shape": tuple(byte_rows.shape),
                "typestr": byte_rows.dtype.str,
                "data": (ptr, False),
                "strides": None,
                "version": 3,
            }
            return PinnedTable(
                cuda.from_cuda_array_interface(interface, owner=owner, sync=False), None
            )
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
        array = devicearray.DeviceNDArray(
            shape=byte_rows.shape,
            strides=byte_rows.strides,
            dtype=byte_rows.dtype,
            gpu_data=registration.memory,
        )
    return PinnedTable(array, ptr)


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
