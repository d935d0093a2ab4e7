"""The stream and event plumbing every CUDA gather mode shares.

:class:`CopyStream` owns the loader's dedicated high-priority copy stream
(and its Numba twin for the kernels), allocates slot storage on it, records
ready events, moves graphs, and makes consumer streams wait.  It also holds
the *per-fill state* -- the copy-stream tensors and graphs the consumer must
``record_stream``, and the ids staged for this fill -- and clears it in one
place only, :meth:`CopyStream.begin_fill` (also after :meth:`record`).

:class:`IdStager` copies a fill's ids to the GPU through a ring of pinned
buffers; with ``sort=True`` it also sorts them *on the GPU*, on the copy
stream (no host wait), and returns the permutation that scatters each row
back to its output position.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...blocks import EdgeBlock, HeteroEdgeBlock
from ...kernels import _interop
from ..base import COMPLETED, Event

logger = logging.getLogger(__name__)

#: Staging buffers kept per kind; a buffer is reused after this many fills.
STAGING_RING = 4


@dataclass
class CudaEvent:
    """A recorded CUDA event and the copy-stream tensors a consumer must ``record_stream``."""

    event: torch.cuda.Event
    tensors: tuple[torch.Tensor, ...] = ()
    #: Graph-like objects moved on the copy stream (``record_stream`` like the tensors).
    graphs: tuple[Any, ...] = ()

    def query(self) -> bool:
        return bool(self.event.query())


@dataclass
class Staging:
    """A pinned host buffer (and its device twin) reused round-robin."""

    host: torch.Tensor | None = None
    device: torch.Tensor | None = None
    done: torch.cuda.Event | None = None


@dataclass
class Ring:
    """Staging buffers taken round-robin; ``size`` = takes per fill x ``STAGING_RING``."""

    size: int = STAGING_RING
    buffers: list[Staging] = field(default_factory=list)
    next: int = 0

    def __post_init__(self) -> None:
        self.buffers = [Staging() for _ in range(self.size)]

    def take(self) -> Staging:
        """The next buffer, after the copy that last read it completed."""
        buffer = self.buffers[self.next]
        self.next = (self.next + 1) % len(self.buffers)
        if buffer.done is not None:
            buffer.done.synchronize()  # normally complete: it was STAGING_RING fills ago
        return buffer


def capacity(rows: int) -> int:
    """Staging capacity for ``rows``: a power of two, at least 1024."""
    return max(1024, 1 << (max(rows, 1) - 1).bit_length())


#: Staged ids as the kernels take them: ``(ids, positions or None)``, Numba device arrays.
StagedIds = tuple[Any, Any]


class CopyStream:
    """The copy stream, its events, and the per-fill state (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.numba_stream: Any = None
        self.closed = False
        # Per-fill state, reset by begin_fill() only.
        self.pending: list[torch.Tensor] = []
        self.pending_graphs: list[Any] = []
        self.staged: tuple[np.ndarray, StagedIds] | None = None
        self.upload_rings: dict[int, Ring] = {}

    def producer_started(self) -> None:
        """In the producer thread: select the device for torch and Numba."""
        from numba import cuda

        torch.cuda.set_device(self.device)
        cuda.select_device(self.device.index)
        self.kernel_stream()

    def kernel_stream(self) -> Any:
        """The copy stream as Numba's launches take it, made on first use in the
        device's Numba context, on any thread.  A launch before any producer
        started -- the cache built from ``hot_ids`` in the loader's constructor --
        goes on the copy stream too: never on stream 0, which torch's streams
        (non-blocking) are not ordered with."""
        if self.numba_stream is None:
            from numba import cuda

            with cuda.gpus[self.device.index]:
                self.numba_stream = _interop.numba_stream(self.stream)
        return self.numba_stream

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    # -- per fill --------------------------------------------------------------
    def begin_fill(self) -> None:
        self.pending = []
        self.pending_graphs = []
        self.staged = None

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.stream.wait_event(event.event)

    def upload(
        self, key: int, n: int, row_bytes: int, fill: Callable[[torch.Tensor], None],
        out_rows: torch.Tensor,
    ) -> None:
        """Enqueue ``out_rows[:n] =`` rows that ``fill`` writes into a pinned staging buffer.

        ``fill(staging)`` runs now, on the host, into ``(n, row_bytes)`` uint8
        pinned memory; the staging ring of ``key`` (one per table) is reused
        ``STAGING_RING`` uploads later, after the copy that read it.
        """
        staging = self.upload_rings.setdefault(key, Ring()).take()
        host = staging.host
        if host is None or host.shape[0] < n or host.shape[1] != row_bytes:
            host = staging.host = torch.empty((capacity(n), row_bytes), dtype=torch.uint8,
                                              pin_memory=True)
        fill(host[:n])
        with torch.cuda.stream(self.stream):
            out_rows[:n].copy_(host[:n], non_blocking=True)
        staging.done = torch.cuda.Event()
        staging.done.record(self.stream)

    def move_graph(self, graph: Any) -> Any:
        """Put a graph-like object on the device, on the copy stream."""
        if isinstance(graph, EdgeBlock):
            src, dst = self._upload_edges([graph.src, graph.dst])
            return EdgeBlock(src, dst, graph.num_src_nodes, graph.num_dst_nodes)
        if isinstance(graph, HeteroEdgeBlock):
            moved = iter(self._upload_edges(
                [t for block in graph.edges.values() for t in (block.src, block.dst)]))
            edges = {etype: EdgeBlock(next(moved), next(moved), block.num_src_nodes,
                                      block.num_dst_nodes)
                     for etype, block in graph.edges.items()}
            return HeteroEdgeBlock(edges, dict(graph.num_src_nodes), dict(graph.num_dst_nodes))
        # A DGL graph (on a DGL build that can hold it here) or a GraphBolt
        # MiniBatch: moved by its own .to(), on the copy stream.
        with torch.cuda.stream(self.stream):
            moved_graph = graph.to(self.device)
        self.pending_graphs.append(moved_graph)
        return moved_graph

    def _upload_edges(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Edge tensors to the device in one pinned copy on the copy stream; the
        moved tensors are views of one device tensor, kept for ``record_stream``."""
        if not parts:
            return []
        flat = torch.cat(parts).pin_memory()
        with torch.cuda.stream(self.stream):
            moved = flat.to(self.device, non_blocking=True)
        self.pending.append(moved)
        return list(moved.split([t.numel() for t in parts]))

    def record(self) -> CudaEvent:
        """The fill's ready event, carrying what the consumer must ``record_stream``."""
        event = torch.cuda.Event()
        event.record(self.stream)
        ready = CudaEvent(event, tuple(self.pending), tuple(self.pending_graphs))
        self.begin_fill()
        return ready

    # -- consumer streams --------------------------------------------------------
    def resolve_consumer_stream(self, stream: Any = None) -> Any:
        """``stream``, or the current stream of this device for ``None``."""
        return torch.cuda.current_stream(self.device) if stream is None else stream

    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        stream = self.resolve_consumer_stream(stream)
        if isinstance(event, CudaEvent):
            stream.wait_event(event.event)
            for tensor in event.tensors:
                tensor.record_stream(stream)
            for graph in event.graphs:
                _record_graph(graph, stream)
        return stream

    def consumer_record(self, stream: Any = None) -> Event:
        if self.closed:
            return COMPLETED
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return CudaEvent(event)

    def close(self) -> None:
        """Wait for every queued copy-stream operation (before unpinning tables)."""
        self.closed = True
        self.stream.synchronize()


class IdStager:
    """A fill's ids on the GPU, staged once per fill through pinned buffers.

    With ``sort=True`` the staged ids are sorted on the GPU (``torch.sort`` on
    the copy stream: no host wait) and the kernel gathers rows in ascending
    address order, writing row ``i`` of the sorted order to output position
    ``positions[i]``; the output order is unchanged.
    """

    def __init__(self, copy: CopyStream, sort: bool) -> None:
        self.copy = copy
        self.sort = sort
        self.ring = Ring()

    def size_ring(self, ids_per_fill: int) -> None:
        """One pinned buffer per id array a fill stages, ``STAGING_RING`` fills deep."""
        self.ring = Ring(STAGING_RING * ids_per_fill)

    def stage(self, ids: np.ndarray) -> StagedIds:
        """``(ids, positions)`` on the GPU; the same arrays for the same ids this fill."""
        staged = self.copy.staged
        if staged is not None and staged[0] is ids:
            return staged[1]
        n = len(ids)
        staging = self.ring.take()
        host, device = staging.host, staging.device
        if host is None or device is None or host.shape[0] < n:
            size = capacity(n)
            host = staging.host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            with torch.cuda.stream(self.copy.stream):
                device = staging.device = torch.empty(size, dtype=torch.int64,
                                                      device=self.copy.device)
        host[:n].copy_(torch.from_numpy(ids))
        with torch.cuda.stream(self.copy.stream):
            device[:n].copy_(host[:n], non_blocking=True)
            # Right after the copy that reads ``host``: a sort that raises must not
            # leave the buffer with an older event while this copy may still read it.
            staging.done = torch.cuda.Event()
            staging.done.record(self.copy.stream)
            if self.sort:
                # Allocated on the copy stream and used only there: freed memory is
                # reused only by later copy-stream work, after these kernels.
                sorted_ids, order = torch.sort(device[:n])
                result = (_interop.device_array(sorted_ids), _interop.device_array(order))
            else:
                result = (_interop.device_array(device[:n]), None)
        self.copy.staged = (ids, result)
        return result


def _record_graph(graph: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream`` for a moved graph: its own method (DGL graphs), else that
    of every CUDA tensor -- or object with its own method -- it holds (a GraphBolt
    MiniBatch: its subgraphs, their CSC per edge type, ids by type)."""
    for part in parts_to_record(graph, lambda t: t.is_cuda):
        part.record_stream(stream)


#: The most containers and objects :func:`parts_to_record` looks into.
MAX_LOOKED_INTO = 100_000
#: What :func:`parts_to_record` does not look into: no batch keeps tensors there.
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, np.ndarray,
           torch.device, torch.dtype)
_warned_bound = False


def parts_to_record(obj: Any, keep: Callable[[torch.Tensor], bool]) -> list[Any]:
    """What ``record_stream`` must be called on for ``obj``: every tensor ``keep``
    accepts, and every other object with a ``record_stream`` method of its own (a
    DGL graph: its method covers what it holds, so it is not looked into), found
    at any depth through dicts, sequences, sets and objects' attributes
    (``__dict__`` and slots, read through their descriptors: no ``__getattr__``
    runs), each object once.  At most ``MAX_LOOKED_INTO`` containers and objects
    are looked into; past that a warning is logged, once per process.
    """
    global _warned_bound
    found: list[Any] = []
    seen: set[int] = set()
    todo = [obj]
    looked_into = 0
    while todo:
        item = todo.pop()
        if id(item) in seen or isinstance(item, _LEAVES):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if keep(item):
                found.append(item)
            continue
        if callable(getattr(type(item), "record_stream", None)):
            found.append(item)
            continue
        if looked_into >= MAX_LOOKED_INTO:
            if not _warned_bound:
                _warned_bound = True
                logger.warning("pingpong: a moved graph holds more than %d objects; "
                               "tensors past them are not marked with record_stream",
                               MAX_LOOKED_INTO)
            break
        looked_into += 1
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            todo.extend(item)
        else:
            todo.extend(_attributes(item))
    return found


def _attributes(obj: Any) -> list[Any]:
    """``obj``'s instance attributes: its ``__dict__`` and the slots that are set."""
    try:
        values = list(object.__getattribute__(obj, "__dict__").values())
    except (AttributeError, TypeError):  # no __dict__ (slots only), or not a plain dict
        values = []
    for cls in type(obj).__mro__:
        for descriptor in vars(cls).values():
            if isinstance(descriptor, types.MemberDescriptorType):
                with contextlib.suppress(AttributeError):  # a slot never set
                    values.append(descriptor.__get__(obj, cls))
    return values
