"""The CUDA device: slots in GPU memory, filled on a dedicated copy stream.

:class:`CUDADevice` is the :class:`~pingpong.devices.base.Device` the loader
talks to; it combines the shared stream/event plumbing
(:class:`~pingpong.devices.cuda._streams.CopyStream`) with one gather-mode
strategy (:mod:`pingpong.devices.cuda._modes`): ``zerocopy``, ``staged`` or
``device``.  :func:`choose_gather_mode` is what ``gather="auto"`` does.

Stream/event choreography, per slot (see docs/design):

1. producer: ``copy_stream.wait_event(e)`` for each of the slot's release
   events -- the consumer streams' reads of its previous batch come first;
2. ids are copied into a pinned staging buffer, then to the GPU, on the copy
   stream (and, in ``zerocopy``, sorted there); the gather kernels, labels and
   graphs follow on the copy stream; a row source's batch (its fetched rows,
   and the rows of its local part, gathered on the host) is put together in a
   pinned staging buffer and copied on the copy stream;
3. ``ready_event`` is recorded on the copy stream and travels with the batch;
4. consumer (``next()``): the stream current at that moment (looked up
   every time, never cached) waits for ``ready_event``, and ``record_stream``
   marks every tensor and graph made on the copy stream as used there;
   ``batch.record_stream(s)`` does the same for another stream ``s``;
5. on the following ``next()`` a release event is recorded on *each* of those
   streams (not on whatever stream is current then), and the slot returns to
   the free queue with them; the copy stream waits for all before refilling.

The only host waits: reusing a pinned *id or row staging buffer* waits for the
copy that read it ``STAGING_RING`` fills ago (normally long complete), and
``close()`` synchronises the copy stream before unpinning the tables.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ..._integers import Count
from ...errors import ConfigError, GatherModeUnavailable
from ...rowsource import FetchedRows, RemoteTable
from ...store import FeatureStore, HostTable, byte_rows
from .. import SORT_IDS
from ..base import Device, Event
from ..cpu import CPUDevice, local_parts
from ._modes import DeviceGather, GatherMode, StagedGather, ZeroCopyGather
from ._streams import STAGING_RING, CopyStream, CudaEvent

__all__ = [
    "AUTO_DEVICE_SHARE",
    "CUDADevice",
    "CudaEvent",
    "STAGING_RING",
    "SORT_IDS",
    "choose_gather_mode",
    "make_cuda_device",
]

logger = logging.getLogger(__name__)

#: ``gather="auto"`` keeps the tables in GPU memory (``device``) when they take
#: at most this share of the GPU's free memory, leaving the rest to the model,
#: its activations and the slots; otherwise ``zerocopy``.
AUTO_DEVICE_SHARE = 0.5


def choose_gather_mode(table_bytes: int, free_bytes: int) -> str:
    """``device`` if the tables fit in ``AUTO_DEVICE_SHARE`` of the free GPU memory,
    else ``zerocopy`` (what ``gather="auto"`` picks on CUDA)."""
    return "device" if table_bytes <= AUTO_DEVICE_SHARE * free_bytes else "zerocopy"


class CUDADevice(Device):
    """Slots on a CUDA device, filled on one dedicated high-priority copy stream."""

    def __init__(
        self,
        device: torch.device,
        gather_mode: str,
        gather_threads: Count | None = None,
        *,
        max_blocks: int | None = None,
        sort_ids: str = "auto",
    ) -> None:
        if sort_ids not in SORT_IDS:
            raise ConfigError(f"sort_ids must be one of {SORT_IDS}, got {sort_ids!r}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        # The host-side kernels: the staged mode's gather (its Numba threads), and
        # place_rows' assembly of row sources' batches in staging buffers.
        self._cpu = CPUDevice(gather_threads)
        self._copy = CopyStream(self._device)
        self._mode = _make_mode(gather_mode, self._copy, sort_ids, max_blocks)
        self.gather_mode = self._mode.name
        self._closed = False

    @property
    def torch_device(self) -> torch.device:
        return self._device

    # -- lifecycle -------------------------------------------------------------
    def attach(self, store: FeatureStore) -> None:
        self._mode.attach(store)
        local = local_parts(store)
        if local:  # the positioned CPU kernel that place_rows runs
            self._cpu.start_warm_up([], local)

    def detach(self) -> None:
        """Wait for the copy stream, then release the tables (pins, GPU copies) and
        the warm-up.  Done once it has completed: a detach that raised (Ctrl-C in
        the stream's wait, a CUDA error) is done again by the next call, never
        skipped -- each step is idempotent."""
        if self._closed:
            return
        try:
            self._copy.close()  # no kernel may still read what the mode releases
            self._mode.detach()
        finally:
            self._cpu.detach()  # its warm-up thread, whatever the copy stream says
        self._closed = True

    def producer_started(self) -> None:
        self._copy.producer_started()
        self._cpu.producer_started()
        self._mode.producer_started()

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._copy.allocate(shape, dtype)

    # -- copy stream -------------------------------------------------------------
    def begin_fill(self) -> None:
        self._copy.begin_fill()

    def wait_event(self, event: Event) -> None:
        self._copy.wait_event(event)

    @property
    def supports_cache(self) -> bool:
        return isinstance(self._mode, ZeroCopyGather)

    def set_cache(self, table: HostTable, hot_ids: np.ndarray) -> None:
        if not isinstance(self._mode, ZeroCopyGather):
            super().set_cache(table, hot_ids)
            return
        with torch.cuda.device(self._device):
            self._mode.set_cache(table, hot_ids)

    def gather(self, table: HostTable, ids: np.ndarray, out: torch.Tensor) -> None:
        self._copy.pending.append(out)
        if len(ids):
            self._mode.gather(table, ids, byte_rows(out))

    def copy_rows(self, table: RemoteTable, rows: torch.Tensor, out: torch.Tensor) -> None:
        self._copy.pending.append(out)
        if len(rows):
            source = byte_rows(rows)

            def fill(staging: torch.Tensor) -> None:
                staging.copy_(source)

            self._copy.upload(id(table), len(rows), table.row_bytes, fill, byte_rows(out))

    @property
    def supports_local_rows(self) -> bool:
        return True

    def place_rows(self, table: RemoteTable, fetched: FetchedRows, out: torch.Tensor) -> None:
        """The batch is put together in a pinned staging buffer by the CPU device --
        the local rows gathered from the local part by the positioned kernel, the
        fetched rows copied to their places -- then uploaded like :meth:`copy_rows`."""
        self._copy.pending.append(out)
        if len(out):

            def fill(staging: torch.Tensor) -> None:
                self._cpu.place_rows(table, fetched, staging)

            self._copy.upload(id(table), len(out), table.row_bytes, fill, byte_rows(out))

    def move_graphs(self, graphs: list[Any]) -> list[Any]:
        return [self._copy.move_graph(graph) for graph in graphs]

    def record(self) -> Event:
        return self._copy.record()

    def wait_for_fills(self) -> None:
        """The kernels of ``zerocopy`` (and of the hot-row cache) read the host
        table when they run on the GPU, which may be after ``next()`` returned:
        wait for the copy stream (at the end of an epoch, the last fills)."""
        self._copy.stream.synchronize()

    # -- consumer streams --------------------------------------------------------
    def resolve_consumer_stream(self, stream: Any = None) -> Any:
        return self._copy.resolve_consumer_stream(stream)

    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        return self._copy.consumer_wait(event, stream)

    def consumer_record(self, stream: Any = None) -> Event:
        return self._copy.consumer_record(stream)


def _make_mode(
    gather_mode: str, copy: CopyStream, sort_ids: str, max_blocks: int | None
) -> GatherMode:
    if gather_mode == "zerocopy":
        return ZeroCopyGather(copy, sort_on_gpu=sort_ids != "none", max_blocks=max_blocks)
    if gather_mode == "device":
        return DeviceGather(copy, sort_on_gpu=sort_ids == "gpu", max_blocks=max_blocks)
    if gather_mode == "staged":
        if sort_ids == "gpu":
            raise ConfigError("sort_ids='gpu' needs a kernel gather: 'zerocopy' or 'device'")
        return StagedGather(copy)
    raise GatherModeUnavailable(f"unknown CUDA gather mode {gather_mode!r}")


def make_cuda_device(
    device: torch.device,
    gather: str,
    gather_threads: Count | None,
    sort_ids: str = "auto",
    table_bytes: int | None = None,
) -> CUDADevice:
    """The CUDA device for ``gather`` (``auto``, ``zerocopy``, ``staged`` or ``device``).

    ``auto`` measures the free memory of the GPU (``torch.cuda.mem_get_info``)
    and applies :func:`choose_gather_mode` to ``table_bytes``; the choice is
    logged at INFO and readable as ``loader.gather_mode``.
    """
    mode = gather
    if gather == "auto":
        free, _total = torch.cuda.mem_get_info(device)
        mode = choose_gather_mode(table_bytes or 0, free)
        logger.info(
            "gather='auto' chose %r on %s: tables %.2f GiB, %.0f%% of the %.2f GiB free "
            "(device-resident up to %.0f%%)",
            mode,
            device,
            (table_bytes or 0) / 2**30,
            100 * (table_bytes or 0) / max(free, 1),
            free / 2**30,
            100 * AUTO_DEVICE_SHARE,
        )
    return CUDADevice(device, mode, gather_threads, sort_ids=sort_ids)
