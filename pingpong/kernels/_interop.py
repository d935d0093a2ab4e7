"""Torch <-> Numba-CUDA interop: the one module that needs a real GPU.

Everything here touches real CUDA: torch streams seen by Numba, Numba arrays
over torch memory, and in-place page-locking of host tensors.  Under Numba's
CUDA simulator none of it exists, so the loader's CUDA device (the only user)
is tested on a real GPU; the kernels themselves are simulator-tested.

Pinning contract (:func:`pin_in_place` -> :class:`PinnedTable`): a host
tensor is page-locked *where it lies* -- never copied, so pinning a table
larger than half of RAM does not double its memory.  A process-wide reference
count per registered range makes two loaders over the same table, or over a
table and a view inside it, share one registration (no "already mapped"
error, DGL #3800/#3939); a table that overlaps a registered range without
lying inside it is refused.  A registration is unregistered when the last
handle is released, and can be registered again afterwards.
Memory that was already pinned by someone else (``tensor.is_pinned()``) is
used as it is and never unregistered by pingpong.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import TableError


@dataclass
class _Registration:
    memory: Any  # numba MappedMemory; unregisters when freed
    ptr: int
    nbytes: int
    count: int = 0


class _Registry:
    """pingpong's page-locked host ranges, by start address (use under ``_pin_lock``).

    A table is pinned at most once: a range inside a registered one shares
    that registration; a range that overlaps one without lying inside it is
    refused (the driver cannot register the same page twice, and reading it
    through the smaller registration would leave the mapping).
    """

    def __init__(self) -> None:
        self.by_ptr: dict[int, _Registration] = {}

    def holding(self, ptr: int, nbytes: int) -> _Registration | None:
        """The registration whose range holds all of ``[ptr, ptr + nbytes)``, or None.

        Raises:
            TableError: a registration holds part of that range only.
        """
        end = ptr + nbytes
        for registration in self.by_ptr.values():
            if registration.ptr <= ptr and end <= registration.ptr + registration.nbytes:
                return registration
        for registration in self.by_ptr.values():
            if ptr < registration.ptr + registration.nbytes and registration.ptr < end:
                raise TableError(
                    f"the table's {nbytes} bytes at {ptr:#x} overlap the "
                    f"{registration.nbytes} bytes at {registration.ptr:#x} that pingpong "
                    "pinned for another table without lying inside them (a view of the "
                    "same tensor, say); build the loader over the whole table first, "
                    "give it a copy, or use gather='staged'"
                )
        return None

    def add(self, memory: Any, ptr: int, nbytes: int) -> _Registration:
        registration = self.by_ptr[ptr] = _Registration(memory, ptr, nbytes)
        return registration

    def remove(self, registration: _Registration) -> None:
        del self.by_ptr[registration.ptr]


_pin_lock = threading.Lock()
_registrations = _Registry()


class PinnedTable:
    """A zero-copy device view of a host table, and the pin it holds.

    ``array`` is a Numba device array that reads the host rows directly over
    PCIe.  :meth:`release` drops this handle's share of the registration
    (idempotent); the memory is unregistered when the last handle of
    pingpong's goes.  Memory pinned by someone else is never unregistered.
    """

    def __init__(self, array: Any, registration: _Registration | None) -> None:
        self.array = array
        self._registration = registration  # None: not registered by pingpong

    def release(self) -> None:
        registration, self._registration = self._registration, None
        self.array = None
        if registration is None:
            return
        with _pin_lock:
            registration.count -= 1
            if registration.count > 0:
                return
            _registrations.remove(registration)
            from numba import cuda

            registration.memory.free()
            # Numba defers the unregistration; flush it now so that registering
            # the same table again (a new loader) cannot find it "already mapped".
            cuda.current_context().deallocations.clear()


def pin_in_place(byte_rows: np.ndarray, owner: torch.Tensor) -> PinnedTable:
    """Page-lock and map ``byte_rows``' memory in place (no copy); see :class:`PinnedTable`.

    Registrations are reference-counted, so two loaders over one table -- or
    over a table and a view inside it -- share one registration (no "already
    mapped" error, DGL #3800/#3939).  Memory pinned by torch or another
    library (``owner.is_pinned()``, and not by pingpong) is used as it is.
    Registration goes through Numba's driver API (``cuMemHostRegister``), so
    a failure leaves no sticky error in torch's CUDA runtime.

    Raises:
        TableError: the range overlaps one pingpong registered for another
            table without lying inside it, or registration failed (e.g.
            ``ulimit -l`` too low; the message carries the driver's error and
            the size).
    """
    from numba import cuda
    from numba.cuda.cudadrv import devicearray

    ptr = int(byte_rows.ctypes.data)
    nbytes = int(byte_rows.nbytes)
    with _pin_lock:
        registration = _registrations.holding(ptr, nbytes)
        if registration is not None:
            _check_same_device(registration, cuda.get_current_device().id)
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
                    "check the locked-memory limit (`ulimit -l`) and free RAM, and whether "
                    "the table's pages are read-only (np.load(..., mmap_mode='r'): CUDA "
                    "may refuse to register those), or use gather='staged'"
                ) from exc
            registration = _registrations.add(memory, ptr, nbytes)
        registration.count += 1
        array = devicearray.DeviceNDArray(
            shape=byte_rows.shape,
            strides=byte_rows.strides,
            dtype=byte_rows.dtype,
            gpu_data=_device_memory_at(registration, ptr),
        )
    return PinnedTable(array, registration)


def _check_same_device(registration: _Registration, device_id: int) -> None:
    """``TableError`` unless ``registration`` was made in device ``device_id``'s context.

    Numba's ``mempin`` maps the memory into the context current when it pinned
    (not ``CU_MEMHOSTREGISTER_PORTABLE``): its device pointer means nothing on
    another GPU, and the range cannot be registered a second time.
    """
    pinned_on = registration.memory.context.device.id
    if pinned_on != device_id:
        raise TableError(
            f"the table is already page-locked by pingpong for a loader on cuda:{pinned_on}; "
            f"zero-copy reads of one table from two GPUs of one process are not supported "
            f"(the registration is mapped for cuda:{pinned_on} only): use gather='staged' "
            f"for the loader on cuda:{device_id}, or one process per GPU"
        )


def _device_memory_at(registration: _Registration, ptr: int) -> Any:
    """The registration's mapped memory from host address ``ptr`` on: the memory
    itself at its start; past it, a plain pointer that frees nothing (the
    registration lives as long as a :class:`PinnedTable` counts on it)."""
    offset = ptr - registration.ptr
    if offset == 0:
        return registration.memory
    from numba.cuda.cudadrv import driver

    memory = registration.memory
    return driver.MemoryPointer(
        memory.context, ctypes.c_void_p(memory.device_pointer_value + offset),
        registration.nbytes - offset)


def registered_count() -> int:
    """How many distinct host ranges pingpong holds registered (for leak tests)."""
    with _pin_lock:
        return len(_registrations.by_ptr)


def numba_stream(stream: torch.cuda.Stream) -> Any:
    """A Numba stream object for a torch stream (no new stream is created)."""
    from numba import cuda

    return cuda.external_stream(stream.cuda_stream)


def device_array(tensor: torch.Tensor) -> Any:
    """A Numba device array over a CUDA tensor's memory (no copy, no sync)."""
    from numba import cuda

    return cuda.as_cuda_array(tensor.detach(), sync=False)
