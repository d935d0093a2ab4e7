"""The CUDA device: slots in GPU memory, filled on a dedicated copy stream.

Gather modes (all enqueue on the copy stream; the host never waits on the GPU
on the hot path):

- ``zerocopy`` -- the host tables are page-locked in place and mapped; a
  Numba-CUDA kernel reads the rows straight from host memory into the slot
  (:func:`pingpong.kernels.cuda.gather_rows_cuda_unchecked`), using a capped
  share of the SMs.
- ``staged`` -- the classic path, pipelined: the Numba CPU kernel gathers into
  a pinned host staging buffer, then an async host-to-device copy.
- ``device`` -- the tables are copied to GPU memory once at construction;
  the same kernel gathers on the GPU (the upper bound when tables fit).

Stream/event choreography, per slot (see docs/design):

1. producer: ``copy_stream.wait_event(slot.release_event)`` -- the consumer
   stream's reads of the slot's previous batch come first;
2. ids are copied into a pinned staging buffer, then to the GPU, on the copy
   stream; the gather kernels, labels and blocks follow on the copy stream;
3. ``ready_event`` is recorded on the copy stream and travels with the batch;
4. consumer (``next()``): the stream current at that moment (looked up
   every time, never cached) waits for ``ready_event``, and ``record_stream``
   marks every tensor and DGL graph made on the copy stream as used there;
   ``batch.record_stream(s)`` does the same for another stream ``s``;
5. on the following ``next()`` a release event is recorded on *each* of those
   streams (not on whatever stream is current then), and the slot returns to
   the free queue with them; the copy stream waits for all before refilling.

The only host waits: reusing a pinned *id or row staging buffer* waits for the
copy that read it ``STAGING_RING`` fills ago (normally long complete), and
``close()`` synchronises the copy stream before unpinning the tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..blocks import EdgeBlock
from ..errors import GatherModeUnavailable
from ..kernels import _interop
from ..kernels.cpu import gather_rows_cpu_unchecked
from ..kernels.cuda import full_grid_blocks, gather_rows_cuda_unchecked
from ..store import FeatureStore, HostTable, byte_rows
from .base import COMPLETED, Device, Event
from .cpu import CPUDevice

#: Staging buffers kept per kind; a buffer is reused after this many fills.
STAGING_RING = 4


@dataclass
class CudaEvent:
    """A recorded CUDA event and the copy-stream tensors a consumer must ``record_stream``."""

    event: torch.cuda.Event
    tensors: tuple[torch.Tensor, ...] = ()
    #: DGL graphs moved on the copy stream (``record_stream`` like the tensors).
    graphs: tuple[Any, ...] = ()

    def query(self) -> bool:
        return bool(self.event.query())


@dataclass
class _Staging:
    """A pinned host buffer (and its device twin) reused round-robin."""

    host: torch.Tensor | None = None
    device: torch.Tensor | None = None
    done: torch.cuda.Event | None = None


@dataclass
class _Ring:
    """Staging buffers taken round-robin; ``size`` = takes per fill x ``STAGING_RING``."""

    size: int = STAGING_RING
    buffers: list[_Staging] = field(default_factory=list)
    next: int = 0

    def __post_init__(self) -> None:
        self.buffers = [_Staging() for _ in range(self.size)]

    def take(self) -> _Staging:
        """The next buffer, after the copy that last read it completed."""
        buffer = self.buffers[self.next]
        self.next = (self.next + 1) % len(self.buffers)
        if buffer.done is not None:
            buffer.done.synchronize()  # normally complete: it was STAGING_RING fills ago
        return buffer


def _capacity(rows: int) -> int:
    return max(1024, 1 << (max(rows, 1) - 1).bit_length())


class CUDADevice(Device):
    """Slots on a CUDA device, filled on one dedicated high-priority copy stream."""

    def __init__(
        self,
        device: torch.device,
        gather_mode: str,
        gather_threads: int | None = None,
        *,
        max_blocks: int | None = None,
        sort_ids: bool = False,
    ) -> None:
        if gather_mode not in ("zerocopy", "staged", "device"):
            raise GatherModeUnavailable(f"unknown CUDA gather mode {gather_mode!r}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        self.gather_mode = gather_mode
        self._cpu = CPUDevice(gather_threads)  # the staged mode's CPU gather
        self._max_blocks = max_blocks
        self._sort_ids = bool(sort_ids)
        self._copy_stream = torch.cuda.Stream(device=self._device, priority=-1)
        self._numba_stream: Any = None
        self._sources: dict[int, Any] = {}  # id(HostTable) -> Numba array the kernel reads
        self._pins: list[_interop.PinnedTable] = []
        self._device_tables: list[torch.Tensor] = []
        self._id_ring = _Ring()
        self._row_rings: dict[int, _Ring] = {}
        # Per-fill state, reset by begin_fill() only: what this fill staged and
        # the copy-stream tensors/graphs the consumer must record_stream.
        self._staged_ids: tuple[np.ndarray, tuple[Any, Any]] | None = None
        self._pending: list[torch.Tensor] = []
        self._pending_graphs: list[Any] = []
        self._closed = False

    @property
    def torch_device(self) -> torch.device:
        return self._device

    # -- lifecycle -------------------------------------------------------------
    def _numba_gpu(self) -> Any:
        from numba import cuda

        return cuda.gpus[self._device.index]

    def attach(self, store: FeatureStore) -> None:
        tables = store.all_tables
        # Id arrays staged per fill: one shared by the feature tables and one for
        # the labels, or one per table for a heterogeneous store.
        ids_per_fill = len(tables) if store.heterogeneous else 1 + len(store.label_tables)
        self._id_ring = _Ring(STAGING_RING * ids_per_fill)
        if self.gather_mode == "staged":
            return
        with self._numba_gpu():
            for table in tables:
                if self.gather_mode == "zerocopy":
                    pin = _interop.pin_in_place(table.byte_rows, table.tensor)
                    self._pins.append(pin)
                    self._sources[id(table)] = pin.array
                else:  # device-resident copy, made once, ordered before every gather
                    with torch.cuda.stream(self._copy_stream):
                        resident = byte_rows(table.tensor).to(self._device)
                    self._device_tables.append(resident)
                    self._sources[id(table)] = _interop.device_array(resident)

    def detach(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._copy_stream.synchronize()  # no kernel may still read what we unpin
        with self._numba_gpu():
            for pin in self._pins:
                pin.release()
        self._pins.clear()
        self._sources.clear()
        self._device_tables.clear()

    def producer_started(self) -> None:
        from numba import cuda

        torch.cuda.set_device(self._device)
        cuda.select_device(self._device.index)
        self._cpu.producer_started()
        if self._numba_stream is None:
            self._numba_stream = _interop.numba_stream(self._copy_stream)
        if self.gather_mode == "device" and self._max_blocks is None:
            # Device-resident tables are the upper bound: let the gather use the whole GPU.
            self._max_blocks = full_grid_blocks()

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self._copy_stream):
            return torch.empty(shape, dtype=dtype, device=self._device)

    # -- copy stream -------------------------------------------------------------
    def begin_fill(self) -> None:
        self._staged_ids = None
        self._pending = []
        self._pending_graphs = []

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self._copy_stream.wait_event(event.event)

    def _device_ids(self, ids: np.ndarray) -> tuple[Any, Any]:
        """``ids`` on the GPU via a pinned staging buffer, once per fill (cached).

        Returns ``(ids, positions)`` as Numba device arrays.  With ``sort_ids``
        the ids are sorted on the host (in the producer thread, overlapping
        training) and ``positions`` says which output row each one fills, so
        the GPU reads host memory in ascending address order; else
        ``positions`` is None.
        """
        if self._staged_ids is not None and self._staged_ids[0] is ids:
            return self._staged_ids[1]
        n = len(ids)
        parts = 2 if self._sort_ids else 1
        staging = self._id_ring.take()
        host, device = staging.host, staging.device
        if host is None or device is None or host.shape[0] < parts * n:
            size = _capacity(parts * n)
            host = staging.host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            with torch.cuda.stream(self._copy_stream):
                device = staging.device = torch.empty(size, dtype=torch.int64, device=self._device)
        if self._sort_ids:
            order = np.argsort(ids, kind="stable")
            host_np = host.numpy()
            host_np[:n] = ids[order]
            host_np[n : 2 * n] = order
        else:
            host[:n].copy_(torch.from_numpy(ids))
        with torch.cuda.stream(self._copy_stream):
            device[: parts * n].copy_(host[: parts * n], non_blocking=True)
        staging.done = torch.cuda.Event()
        staging.done.record(self._copy_stream)
        staged = (
            _interop.device_array(device[:n]),
            _interop.device_array(device[n : 2 * n]) if self._sort_ids else None,
        )
        self._staged_ids = (ids, staged)
        return staged

    def gather(self, table: HostTable, ids: np.ndarray, out: torch.Tensor) -> None:
        self._pending.append(out)
        if len(ids) == 0:
            return
        out_rows = byte_rows(out)
        if self.gather_mode == "staged":
            self._gather_staged(table, ids, out_rows)
            return
        device_ids, positions = self._device_ids(ids)
        gather_rows_cuda_unchecked(
            self._sources[id(table)],
            device_ids,
            _interop.device_array(out_rows),
            self._numba_stream,
            max_blocks=self._max_blocks,
            positions=positions,
        )

    def _gather_staged(self, table: HostTable, ids: np.ndarray, out_rows: torch.Tensor) -> None:
        ring = self._row_rings.setdefault(id(table), _Ring())
        staging = ring.take()
        n = len(ids)
        if staging.host is None or staging.host.shape[0] < n:
            staging.host = torch.empty(
                (_capacity(n), table.row_bytes), dtype=torch.uint8, pin_memory=True
            )
        gather_rows_cpu_unchecked(table.byte_rows, ids, staging.host[:n].numpy())
        with torch.cuda.stream(self._copy_stream):
            out_rows.copy_(staging.host[:n], non_blocking=True)
        staging.done = torch.cuda.Event()
        staging.done.record(self._copy_stream)

    def move_graphs(self, graphs: list[Any]) -> list[Any]:
        return [self._move_graph(graph) for graph in graphs]

    def _move_graph(self, graph: Any) -> Any:
        if isinstance(graph, EdgeBlock):
            edges = torch.stack((graph.src, graph.dst)).pin_memory()
            with torch.cuda.stream(self._copy_stream):
                moved = edges.to(self._device, non_blocking=True)
            self._pending.append(moved)
            return EdgeBlock(moved[0], moved[1], graph.num_src_nodes, graph.num_dst_nodes)
        # A DGL graph (on a DGL build that can hold it here) or a GraphBolt
        # MiniBatch: moved by its own .to(), on the copy stream.
        with torch.cuda.stream(self._copy_stream):
            moved_graph = graph.to(self._device)
        self._pending_graphs.append(moved_graph)
        return moved_graph

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        ready = CudaEvent(event, tuple(self._pending), tuple(self._pending_graphs))
        self.begin_fill()
        return ready

    # -- consumer streams --------------------------------------------------------
    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        if isinstance(event, CudaEvent):
            stream.wait_event(event.event)
            for tensor in event.tensors:
                tensor.record_stream(stream)
            for graph in event.graphs:
                _record_graph(graph, stream)
        return stream

    def consumer_record(self, stream: Any = None) -> Event:
        if self._closed:
            return COMPLETED
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        event = torch.cuda.Event()
        event.record(stream)
        return CudaEvent(event)


def _record_graph(graph: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream`` for a moved graph: its own method (DGL graphs), else every
    CUDA tensor among its attributes (a GraphBolt MiniBatch and its subgraphs)."""
    record = getattr(graph, "record_stream", None)
    if callable(record):
        record(stream)
        return
    for tensor in _cuda_tensors(graph, depth=4):
        tensor.record_stream(stream)


def _cuda_tensors(obj: Any, depth: int) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_cuda else []
    if depth == 0:
        return []
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, list | tuple):
        children = obj
    elif hasattr(obj, "__dict__"):
        children = vars(obj).values()
    else:
        return []
    return [t for child in children for t in _cuda_tensors(child, depth - 1)]


def make_cuda_device(
    device: torch.device, gather_mode: str, gather_threads: int | None, sort_ids: bool = False
) -> CUDADevice:
    """The CUDA device for ``gather_mode`` (``zerocopy``, ``staged`` or ``device``)."""
    return CUDADevice(device, gather_mode, gather_threads, sort_ids=sort_ids)
