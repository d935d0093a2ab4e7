"""A fake asynchronous device: CUDA-like streams and events on the CPU, for tests.

:class:`FakeAsyncDevice` keeps slots in host memory but, unlike
:class:`~pingpong.devices.cpu.CPUDevice`, it does not do the work when it is
asked to.  Like a GPU it has two ordered queues of work (*streams*), each
executed later by its own worker thread (``pingpong-fake-<n>-copy`` and
``pingpong-fake-<n>-consumer``), each operation after a seeded random delay:

- the copy stream runs ``wait_event``, ``gather``, ``move_graphs`` and
  ``record`` in the order the producer enqueued them;
- the consumer stream runs ``consumer_wait``, ``consumer_record`` and whatever
  the training loop enqueues with :meth:`FakeAsyncDevice.consumer_submit`
  ("kernels" that read the batch).

A wait blocks the *stream's worker* until the event completes, never the
host.  So every missing or misplaced wait in the slot protocol becomes a data
race that the seeded delays make likely, and poisoning makes visible:

- fresh slot storage is filled with poison (NaN for floating dtypes, the
  dtype's minimum for signed integers, its maximum for unsigned ones);
- when a slot's ``release_event`` completes on the consumer stream, the rows
  the consumer held are poisoned before the event reports complete.

So a consumer read after the release, or a producer write before the release
event, or a consumer read before the ready event, shows up as wrong data.

The only host waits are the ones a CUDA host has too: :meth:`synchronize`,
:meth:`FakeEvent.synchronize` and :meth:`FakeFuture.result` (like ``.item()``).

Not thread-safe beyond the protocol's own use: one producer thread calls the
copy-stream methods, the training thread the consumer-stream ones.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._threads import join_within
from ..errors import ConfigError
from ..rowsource import RemoteTable
from ..store import HostTable, byte_rows
from .base import COMPLETED, Device, Event

__all__ = ["FakeAsyncDevice", "FakeEvent", "FakeFuture", "FakeStreamError", "poison_"]

#: How often a worker blocked on an event re-checks whether it must abort.
_POLL_S = 0.05
#: How long :meth:`FakeAsyncDevice.close` lets queued work drain before aborting it.
CLOSE_DRAIN_S = 5.0
#: At interpreter exit, how long all devices' workers get to finish their current item.
EXIT_JOIN_S = 1.0

_device_ids = itertools.count()
_live_devices: weakref.WeakSet[FakeAsyncDevice] = weakref.WeakSet()


class FakeStreamError(RuntimeError):
    """Queued work failed on a fake stream (reported at the next enqueue, like CUDA)."""


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` in place with a value no real batch is expected to hold."""
    if tensor.numel() == 0:
        return tensor
    try:
        if tensor.dtype == torch.bool:
            tensor.fill_(True)
        elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.fill_(float("nan"))
        elif tensor.dtype == torch.uint8 or str(tensor.dtype).startswith("torch.uint"):
            tensor.fill_(torch.iinfo(tensor.dtype).max)
        else:
            tensor.fill_(torch.iinfo(tensor.dtype).min)
    except (RuntimeError, TypeError, NotImplementedError):
        # dtypes torch cannot fill (packed float4, bits8/16, sub-byte ints): every
        # byte 0xFF, a NaN pattern where the format has one
        tensor.view(torch.uint8).fill_(0xFF)
    return tensor


class FakeEvent:
    """An event on a fake stream: complete once the stream's worker reached it.

    Attributes:
        stream: ``"copy"``, ``"consumer"`` or ``"host"`` (already complete).
        tensors: slot rows written before a copy-stream event (the batch it
            makes ready); the consumer stream poisons them on release.
    """

    __slots__ = ("__weakref__", "_done", "stream", "tensors")

    def __init__(self, stream: str, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self._done = threading.Event()
        self.stream = stream
        self.tensors = tensors

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        """Host wait (like ``cudaEventSynchronize``); False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def _complete(self) -> None:
        self._done.set()

    def __repr__(self) -> str:
        return f"FakeEvent({self.stream}, done={self.query()})"


class FakeFuture(FakeEvent):
    """The event of a :meth:`FakeAsyncDevice.consumer_submit` call, with its result."""

    __slots__ = ("_error", "_value")

    def __init__(self) -> None:
        super().__init__("consumer")
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = 30.0) -> Any:
        """Wait for the function to have run on the consumer stream; return its value."""
        if not self._done.wait(timeout):
            raise TimeoutError("consumer-stream work did not run within the timeout")
        if self._error is not None:
            raise self._error
        return self._value


class _Stream:
    """A FIFO of work items executed by one worker thread (see :func:`_run_stream`)."""

    def __init__(self, name: str, seed: int, max_delay_s: float) -> None:
        self.name = name
        self.items: deque[tuple[str, Any]] = deque()
        self.cond = threading.Condition()
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.closing = False  # drain what is queued without delays, then exit
        self.abort = False  # exit now; waits give up
        self.error: BaseException | None = None
        self.ops = 0
        self.thread = threading.Thread(target=_run_stream, args=(self,), name=name, daemon=True)
        self.thread.start()

    def put(self, kind: str, payload: Any) -> None:
        with self.cond:
            if self.closing or self.abort:
                raise RuntimeError(f"{self.name}: the FakeAsyncDevice is closed")
            self.items.append((kind, payload))
            self.cond.notify()

    def delay(self) -> float:
        if self.max_delay_s <= 0 or self.closing:
            return 0.0
        # Mostly short, sometimes close to the maximum: reorders a lot, costs little.
        return self.max_delay_s * self.rng.random() ** 3

    def stop(self, drain: bool) -> None:
        with self.cond:
            self.closing = True
            if not drain:
                self.abort = True
            self.cond.notify_all()


def _run_stream(stream: _Stream) -> None:
    """Worker loop: execute queued items in order, each after a seeded delay."""
    while True:
        with stream.cond:
            while not stream.items and not stream.closing:
                stream.cond.wait(_POLL_S)
            if stream.abort or not stream.items:
                return
            kind, payload = stream.items.popleft()
        pause = stream.delay()
        if pause > 0:
            time.sleep(pause)
        try:
            _execute(stream, kind, payload)
        except BaseException as exc:  # noqa: BLE001 - reported at the next enqueue
            if stream.error is None:
                stream.error = exc
        stream.ops += 1


def _execute(stream: _Stream, kind: str, payload: Any) -> None:
    if kind == "wait":
        event: FakeEvent = payload
        while not event._done.wait(_POLL_S):
            if stream.abort:
                return
    elif kind == "call":
        fn, future = payload
        if future is None:
            fn()
            return
        try:
            future._value = fn()
        except BaseException as exc:  # noqa: BLE001 - the caller gets it from result()
            future._error = exc
        finally:
            future._complete()
    elif kind == "record":
        event, poison = payload
        for tensor in poison:
            poison_(tensor)
        event._complete()
    else:  # pragma: no cover - programming error
        raise AssertionError(kind)


class FakeAsyncDevice(Device):
    """A CPU device whose copy and consumer streams run later, on worker threads.

    Args:
        seed: seeds both streams' delays (copy: ``seed``, consumer: ``seed + 1``).
        max_delay_s: the longest random delay before a copy-stream operation.
        consumer_max_delay_s: the same for the consumer stream (default:
            ``max_delay_s``).
        poison: poison fresh storage and released slot rows (see module docs).
        host_jitter_s: if > 0, the *calling* thread also sleeps a random
            ``[0, host_jitter_s)`` in every device call -- delays at the
            protocol's hand-off points (producer before gather/record, consumer
            before release/wait), drawn from a third seeded generator.
        edge_blocks: deliver DGL graphs as :class:`~pingpong.blocks.EdgeBlock` /
            :class:`~pingpong.blocks.HeteroEdgeBlock`, as on a GPU with a
            CPU-only DGL build (PyPI's).

    Fault injection (for failure-path tests): :meth:`inject_fault` makes the
    n-th host call of ``gather``/``move_graphs``/``record``/``wait_event``
    raise, in the producer thread.  Counters: :attr:`calls` (host calls per
    method) -- e.g. "no gather was enqueued for a bad batch".

    A loader given this device owns it: ``loader.close()`` closes it, and so
    does a loader constructor that raises.
    """

    gather_mode = "fake"

    def __init__(
        self,
        seed: int = 0,
        max_delay_s: float = 0.002,
        poison: bool = True,
        *,
        consumer_max_delay_s: float | None = None,
        host_jitter_s: float = 0.0,
        edge_blocks: bool = False,
    ) -> None:
        if max_delay_s < 0 or (consumer_max_delay_s or 0) < 0 or host_jitter_s < 0:
            raise ConfigError("delays must be >= 0")
        name = f"pingpong-fake-{next(_device_ids)}"
        self.seed = seed
        self.poison = poison
        self.host_jitter_s = host_jitter_s
        self.dgl_graphs_as_edge_blocks = edge_blocks
        self._host_rng = random.Random(seed + 2)
        self._lock = threading.Lock()
        self._pending: list[torch.Tensor] = []  # copy-stream writes since the last record
        self._held: list[torch.Tensor] = []  # rows the consumer waited for since its last record
        self._faults: dict[str, tuple[int, Callable[[], BaseException]]] = {}
        self.calls: dict[str, int] = dict.fromkeys(
            ("wait_event", "gather", "move_graphs", "record", "consumer_wait", "consumer_record"),
            0,
        )
        self.fault_times: list[float] = []
        #: id(table) -> (cached byte rows, slot of every row or -1): set_cache's builds.
        self._caches: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: Rows the copy stream served from a cache so far (for tests).
        self.cache_hits = 0
        self._closed = False
        self._close_done = False  # close() ran to its end
        self.copy_stream = _Stream(f"{name}-copy", seed, max_delay_s)
        self.consumer_stream = _Stream(
            f"{name}-consumer",
            seed + 1,
            max_delay_s if consumer_max_delay_s is None else consumer_max_delay_s,
        )
        _live_devices.add(self)

    # -- helpers -----------------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def closed(self) -> bool:
        return self._closed

    def _host_call(self, method: str) -> None:
        """Count the call, apply host jitter and injected faults, report stream errors."""
        with self._lock:
            self.calls[method] += 1
            count = self.calls[method]
            fault = self._faults.get(method)
            jitter = self._host_rng.random() * self.host_jitter_s if self.host_jitter_s else 0
        if jitter:
            time.sleep(jitter)
        if fault is not None and fault[0] == count:
            self.fault_times.append(time.monotonic())
            raise fault[1]()
        for stream in (self.copy_stream, self.consumer_stream):
            if stream.error is not None:
                error, stream.error = stream.error, None
                raise FakeStreamError(f"work queued on {stream.name} failed: {error!r}") from error

    def inject_fault(
        self, method: str, at_call: int, make_exc: Callable[[], BaseException]
    ) -> None:
        """Make the ``at_call``-th (1-based, counted from now on) host call of
        ``method`` raise ``make_exc()`` in the calling thread."""
        if method not in self.calls:
            raise ConfigError(f"unknown device method {method!r}")
        with self._lock:
            self._faults[method] = (self.calls[method] + at_call, make_exc)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    # -- Device interface ------------------------------------------------------
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        return poison_(tensor) if self.poison else tensor

    def begin_fill(self) -> None:
        # Writes of an earlier fill that failed before its record() belong to
        # no batch, so no consumer release may poison them.
        self._pending = []

    def wait_event(self, event: Event) -> None:
        self._host_call("wait_event")
        if isinstance(event, FakeEvent):
            self.copy_stream.put("wait", event)

    @property
    def supports_cache(self) -> bool:
        return True

    def set_cache(self, table: HostTable, hot_ids: np.ndarray) -> None:
        """Copy stream: copy the hot rows into "device memory" (a separate array)."""
        hot = np.array(hot_ids, dtype=np.int64, copy=True)
        rows = table.byte_rows

        def build() -> None:
            slot_of = np.full(len(rows), -1, dtype=np.int64)
            slot_of[hot] = np.arange(len(hot))
            self._caches[id(table)] = (rows[hot].copy(), slot_of)

        self.copy_stream.put("call", (build, None))

    def gather(self, table: HostTable, ids: np.ndarray, out: torch.Tensor) -> None:
        self._host_call("gather")
        # Like a CUDA device, take the ids now (the kernel runs later).
        staged = np.array(ids, dtype=np.int64, copy=True)
        rows = table.byte_rows
        out_rows = byte_rows(out).numpy()

        def run() -> None:
            cache = self._caches.get(id(table))  # set by a build earlier on this stream
            if cache is not None and len(staged):
                cached_rows, slot_of = cache
                slots = slot_of[staged]
                hit = slots >= 0
                out_rows[hit] = cached_rows[slots[hit]]
                out_rows[~hit] = rows[staged[~hit]]
                with self._lock:
                    self.cache_hits += int(np.count_nonzero(hit))
            elif len(staged):
                np.take(rows, staged, axis=0, out=out_rows)

        self._pending.append(out)
        self.copy_stream.put("call", (run, None))

    @property
    def supports_local_rows(self) -> bool:
        return True

    def gather_at(self, table: HostTable, ids: np.ndarray, positions: np.ndarray,
                  out: torch.Tensor) -> None:
        self._host_call("gather")
        staged = np.array(ids, dtype=np.int64, copy=True)  # taken now, run later
        places = np.array(positions, dtype=np.int64, copy=True)
        rows = table.byte_rows
        out_rows = byte_rows(out).numpy()

        def run() -> None:
            out_rows[places] = rows[staged]

        self._pending.append(out)
        self.copy_stream.put("call", (run, None))

    def copy_rows_at(self, table: RemoteTable, rows: torch.Tensor, positions: np.ndarray,
                     out: torch.Tensor) -> None:
        self._host_call("gather")
        source = byte_rows(rows).numpy().copy()  # like a pinned staging copy: taken now
        places = np.array(positions, dtype=np.int64, copy=True)
        out_rows = byte_rows(out).numpy()

        def run() -> None:
            out_rows[places] = source

        self._pending.append(out)
        self.copy_stream.put("call", (run, None))

    def copy_rows(self, table: RemoteTable, rows: torch.Tensor, out: torch.Tensor) -> None:
        self._host_call("gather")
        source = byte_rows(rows).clone()  # like a pinned staging copy: taken now
        out_rows = byte_rows(out)

        def run() -> None:
            out_rows.copy_(source)

        self._pending.append(out)
        self.copy_stream.put("call", (run, None))

    def move_graphs(self, graphs: list[Any]) -> list[Any]:
        self._host_call("move_graphs")
        self.copy_stream.put("call", (_nothing, None))
        return graphs

    def record(self) -> Event:
        self._host_call("record")
        event = FakeEvent("copy", tuple(self._pending))
        self._pending = []
        self.copy_stream.put("record", (event, ()))
        return event

    def resolve_consumer_stream(self, stream: Any = None) -> Any:
        return None  # one consumer stream

    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        """The fake device has one consumer stream: ``stream`` is ignored."""
        self._host_call("consumer_wait")
        if isinstance(event, FakeEvent):
            with self._lock:
                self._held.extend(event.tensors)
            self.consumer_stream.put("wait", event)
        return None

    def consumer_record(self, stream: Any = None) -> Event:
        if self._closed:
            return COMPLETED
        self._host_call("consumer_record")
        with self._lock:
            held, self._held = self._held, []
        event = FakeEvent("consumer")
        self.consumer_stream.put("record", (event, tuple(held) if self.poison else ()))
        return event

    # -- for tests: the training loop's own work -----------------------------
    def consumer_submit(self, fn: Callable[[], Any]) -> FakeFuture:
        """Enqueue ``fn()`` on the consumer stream (a "kernel" reading the batch).

        It runs after everything the consumer stream was given before --
        in particular after the wait for the current batch's ready event --
        and before the release of the current batch.  ``result()`` waits.
        """
        future = FakeFuture()
        self.consumer_stream.put("call", (fn, future))
        return future

    def wait_for_fills(self) -> None:
        """The copy stream's gathers read the table when they run: wait for them."""
        if self._closed:
            return  # close() ran what was queued
        done = FakeEvent("copy")
        try:
            self.copy_stream.put("record", (done, ()))
        except RuntimeError:
            if self._closed:  # closed from another thread meanwhile: it ran the queue
                return
            raise
        if not done.synchronize(30.0):
            raise TimeoutError("FakeAsyncDevice.wait_for_fills timed out (the copy stream "
                               "is stuck)")

    def synchronize(self, timeout: float = 30.0) -> None:
        """Host wait until both streams ran everything queued so far."""
        copy_done = FakeEvent("copy")
        consumer_done = FakeEvent("consumer")
        self.copy_stream.put("record", (copy_done, ()))
        self.consumer_stream.put("record", (consumer_done, ()))
        if not (copy_done.synchronize(timeout) and consumer_done.synchronize(timeout)):
            raise TimeoutError("FakeAsyncDevice.synchronize timed out (a stream is stuck)")

    def close(self) -> None:
        """Run what is queued (without delays), then stop both workers.  Idempotent;
        a close that raised (Ctrl-C) is done again by the next call, as on CUDA."""
        if self._close_done:
            return
        self._closed = True  # from now on the consumer's releases are no-ops
        _stop_streams(self.copy_stream, self.consumer_stream, CLOSE_DRAIN_S)
        self.detach()
        self._close_done = True

    def __repr__(self) -> str:
        return f"FakeAsyncDevice(seed={self.seed}, closed={self._closed})"


def _nothing() -> None:
    return None


def _stop_streams(copy: _Stream, consumer: _Stream, drain_s: float) -> None:
    for stream in (copy, consumer):
        stream.stop(drain=True)
    join_within((copy.thread, consumer.thread), drain_s)
    for stream in (copy, consumer):
        if stream.thread.is_alive():  # a wait that can never complete: give up on it
            stream.stop(drain=False)
            join_within((stream.thread,), 1.0)


@atexit.register
def _close_all_devices() -> None:
    """At exit, stop the workers at once (later consumer releases are no-ops), then
    wait for them, ``EXIT_JOIN_S`` for all: a worker still running a torch op when
    the interpreter finalises can abort the process (see
    :func:`pingpong._exit_hook._end_all_epochs`)."""
    devices = list(_live_devices)
    streams = [s for device in devices for s in (device.copy_stream, device.consumer_stream)]
    for device in devices:
        device._closed = True
    for stream in streams:
        stream.stop(drain=False)
    join_within([stream.thread for stream in streams], EXIT_JOIN_S)


def tensor_digest(tensor: torch.Tensor | None) -> bytes:
    """A hash of a tensor's dtype, shape and bytes (how tests compare batches)."""
    if tensor is None:
        return b"none"
    h = hashlib.blake2b(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), digest_size=16)
    if tensor.numel():
        h.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()

