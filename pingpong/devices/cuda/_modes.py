"""One small strategy per CUDA gather mode, over the shared :class:`CopyStream`.

Each mode prepares the host tables once (:meth:`GatherMode.attach`), enqueues
one table's rows for one fill on the copy stream (:meth:`GatherMode.gather`),
and releases what it holds (:meth:`GatherMode.detach`, after the copy stream
was synchronised).  None of them keeps per-fill state of its own: what a fill
staged lives in the :class:`CopyStream`, cleared by its ``begin_fill``.

- :class:`ZeroCopyGather` -- tables page-locked in place; the Numba-CUDA kernel
  reads rows over PCIe into the slot, ids sorted on the GPU by default.
- :class:`StagedGather` -- the classic path, pipelined: the Numba CPU kernel
  gathers into a pinned staging buffer, then an async host-to-device copy.
- :class:`DeviceGather` -- tables copied to GPU memory once; the same kernel
  gathers there with the whole GPU (the upper bound when tables fit).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
import torch

from ...hotrows import build_slot_map
from ...kernels import _interop, start_warm_up, warm_up_cpu
from ...kernels._checks import warm_up_id_bounds
from ...kernels._warmup import WarmUpThread
from ...kernels.cpu import WARM_UP_ID_DTYPES
from ...kernels.cuda import full_grid_blocks, gather_rows_cuda_unchecked, warm_up_cuda
from ...kernels.cuda_cached import gather_rows_cached_unchecked
from ...store import FeatureStore, HostTable, byte_rows
from ..cpu import WARM_UP_JOIN_S, gather_host_rows
from ._streams import CopyStream, IdStager


class GatherMode(abc.ABC):
    """How rows of a host table reach a slot on the GPU (see the module docstring).

    :meth:`attach` also starts a ``pingpong-warmup-N`` thread that compiles
    (or loads from Numba's disk cache) the kernels the mode will launch, so
    that the first batches need not wait for the compiler: ``staged``
    gathers with torch until its CPU kernel is loaded; a CUDA kernel's
    first launch waits for a compilation still in progress (Numba's
    compiler lock).  :meth:`detach` stops it.
    """

    #: The ``gather=`` value this mode implements.
    name: str

    def __init__(self, copy: CopyStream) -> None:
        self.copy = copy
        self.warm_up: WarmUpThread | None = None

    def stop_warm_up(self) -> None:
        if self.warm_up is not None:
            self.warm_up.stop(WARM_UP_JOIN_S)

    def attach(self, store: FeatureStore) -> None:  # noqa: B027 - optional hook
        """Prepare the tables (pin them, copy them...); once per loader."""

    def producer_started(self) -> None:  # noqa: B027 - optional hook
        """In each producer thread, after the device was selected."""

    @abc.abstractmethod
    def gather(self, table: HostTable, ids: np.ndarray, out_rows: torch.Tensor) -> None:
        """Copy stream: enqueue ``out_rows[:] = table.byte_rows[ids]`` (ids validated, n > 0)."""

    def detach(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`attach` took; the copy stream is idle by now."""


def _ids_per_fill(store: FeatureStore) -> int:
    """Id arrays a fill stages: one shared by the feature tables and one per label
    table (one, or one per edge type), or one per table for a heterogeneous store."""
    return len(store.all_tables) if store.heterogeneous else 1 + len(store.label_tables)


class _KernelGather(GatherMode):
    """The Numba-CUDA kernel over a table view the subclass provides."""

    def __init__(self, copy: CopyStream, sort_on_gpu: bool, max_blocks: int | None) -> None:
        super().__init__(copy)
        self.ids = IdStager(copy, sort_on_gpu)
        self.max_blocks = max_blocks
        self.sources: dict[int, Any] = {}  # id(HostTable) -> Numba array the kernel reads

    def attach(self, store: FeatureStore) -> None:
        self.ids.size_ring(_ids_per_fill(store))
        from numba import cuda

        with cuda.gpus[self.copy.device.index]:
            for table in store.host_tables:  # row sources are fetched, not read here
                self.sources[id(table)] = self.table_view(table)
        views, index = list(self.sources.values()), self.copy.device.index
        self.warm_up = start_warm_up(
            lambda stop: _warm_up_id_checks(stop)
            + warm_up_cuda(views, device_index=index, should_stop=stop)
        )

    @abc.abstractmethod
    def table_view(self, table: HostTable) -> Any:
        """The Numba device array the kernel reads ``table`` through."""

    def gather(self, table: HostTable, ids: np.ndarray, out_rows: torch.Tensor) -> None:
        device_ids, positions = self.ids.stage(ids)
        gather_rows_cuda_unchecked(
            self.sources[id(table)],
            device_ids,
            _interop.device_array(out_rows),
            self.copy.kernel_stream(),
            max_blocks=self.max_blocks,
            positions=positions,
        )

    def detach(self) -> None:
        self.stop_warm_up()
        self.sources.clear()


class ZeroCopyGather(_KernelGather):
    """Tables page-locked in place and read over PCIe by the kernel.

    With a hot-row cache (:meth:`set_cache`, :mod:`pingpong.cache`) a table's
    gathers read its cached rows from device memory and the rest over PCIe,
    in one kernel (:func:`~pingpong.kernels.cuda_cached.gather_rows_cached_unchecked`).
    """

    name = "zerocopy"

    def __init__(self, copy: CopyStream, sort_on_gpu: bool = True,
                 max_blocks: int | None = None) -> None:
        super().__init__(copy, sort_on_gpu, max_blocks)
        self.pins: list[_interop.PinnedTable] = []
        #: id(table) -> (cached byte rows, slot_of): device tensors, built on the copy stream.
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def table_view(self, table: HostTable) -> Any:
        pin = _interop.pin_in_place(table.byte_rows, table.tensor)
        self.pins.append(pin)
        return pin.array

    def set_cache(self, table: HostTable, hot_ids: np.ndarray) -> None:
        """Copy stream: gather the hot rows from the pinned table into device memory.

        Every later gather of ``table`` is enqueued after this build on the
        same stream, so none reads a half-built cache; the temporaries are
        allocated on that stream too, so their memory is reused only by work
        ordered after the build.
        """
        device = self.copy.device
        # A refresh replaces the cache: free the old one first, so that it never
        # needs twice the memory (the memory is reused only by work on the copy
        # stream, ordered after the gathers that read the old cache).
        self.caches.pop(id(table), None)
        with torch.cuda.stream(self.copy.stream):
            hot = torch.from_numpy(np.ascontiguousarray(hot_ids, dtype=np.int64)).to(device)
            rows = torch.empty((len(hot_ids), table.row_bytes), dtype=torch.uint8, device=device)
            slot_of = torch.from_numpy(build_slot_map(table.num_rows, hot_ids)).to(device)
        if len(hot_ids) and table.row_bytes:
            from numba import cuda

            with cuda.gpus[device.index]:  # any thread: the constructor's, an epoch's start
                gather_rows_cuda_unchecked(
                    self.sources[id(table)],
                    _interop.device_array(hot),
                    _interop.device_array(rows),
                    self.copy.kernel_stream(),
                    max_blocks=self.max_blocks,
                )
        self.caches[id(table)] = (rows, slot_of)

    def gather(self, table: HostTable, ids: np.ndarray, out_rows: torch.Tensor) -> None:
        cache = self.caches.get(id(table))
        if cache is None:
            super().gather(table, ids, out_rows)
            return
        rows, slot_of = cache
        device_ids, positions = self.ids.stage(ids)
        gather_rows_cached_unchecked(
            self.sources[id(table)],
            _interop.device_array(rows),
            _interop.device_array(slot_of),
            device_ids,
            _interop.device_array(out_rows),
            self.copy.kernel_stream(),
            positions=positions,
            max_blocks=self.max_blocks,
        )

    def detach(self) -> None:
        self.caches.clear()
        super().detach()
        from numba import cuda

        with cuda.gpus[self.copy.device.index]:
            for pin in self.pins:
                pin.release()
        self.pins.clear()


class DeviceGather(_KernelGather):
    """Tables copied to GPU memory once; the kernel may use the whole GPU."""

    name = "device"

    def __init__(self, copy: CopyStream, sort_on_gpu: bool = False,
                 max_blocks: int | None = None) -> None:
        super().__init__(copy, sort_on_gpu, max_blocks)
        self.resident: list[torch.Tensor] = []

    def table_view(self, table: HostTable) -> Any:
        # On the copy stream, so every gather is ordered after the copy.
        with torch.cuda.stream(self.copy.stream):
            resident = byte_rows(table.tensor).to(self.copy.device)
        self.resident.append(resident)
        return _interop.device_array(resident)

    def producer_started(self) -> None:
        if self.max_blocks is None:  # the upper bound: let the gather use the whole GPU
            self.max_blocks = full_grid_blocks()

    def detach(self) -> None:
        super().detach()
        self.resident.clear()


def _warm_up_id_checks(stop: Any) -> list[tuple[object, ...]]:
    """Compile the host-side id-bounds check every batch runs in the producer, as
    the CPU warm-up does: once the CUDA kernels are ready, a first batch would
    otherwise compile it (or load it from the disk cache) on the producer."""
    ready = []
    for dtype in WARM_UP_ID_DTYPES:
        if stop():
            break
        ready.append(warm_up_id_bounds(dtype))
    return ready


class StagedGather(GatherMode):
    """CPU gather into pinned staging buffers, then an async copy to the slot."""

    name = "staged"

    def attach(self, store: FeatureStore) -> None:
        rows = [t.byte_rows for t in store.host_tables]
        self.warm_up = start_warm_up(lambda stop: warm_up_cpu(rows, should_stop=stop))

    def gather(self, table: HostTable, ids: np.ndarray, out_rows: torch.Tensor) -> None:
        warm_up = self.warm_up

        def fill(staging: torch.Tensor) -> None:  # while compiling: torch, not a wait
            gather_host_rows(table, ids, staging, warm_up)

        self.copy.upload(id(table), len(ids), table.row_bytes, fill, out_rows)

    def detach(self) -> None:
        self.stop_warm_up()
