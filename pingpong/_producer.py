"""The producer loop: sample, validate, gather into a free slot, hand it over.

:func:`produce` is a free function that receives everything it touches as
arguments -- it holds no reference to the iterator or the loader, so dropping
the iterator (``break``) lets it be collected and stop the producer.

Hand-off messages on the ready queue are :class:`Delivery`, then exactly one
:class:`EndOfEpoch` or :class:`Failure`.  The producer never blocks without a
timeout: every wait polls ``stop`` every ``poll_s`` seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _rpc
from ._ids import TableIds, batch_ids
from ._producer_nice import lower_this_thread_priority
from ._sampler_threads import dgl_threads_of_this_thread, limit_dgl_threads
from ._threads import Latch, OpenEndedCalls, ThreadExit
from .cache import FeatureCache
from .devices.base import Device, Event
from .forms import ItemPlan, ItemReader, place_graphs
from .rowsource import FetchedRows, FetchStopped, RemoteTable
from .slots import Buffer, Slot
from .stats import LoaderStats
from .store import FeatureStore, Table, TableKey


@dataclass(frozen=True)
class Delivery:
    """A filled slot and the batch that points into it.

    ``generation`` is ``slot.generation`` right after this fill (see the
    loader's ``debug`` option).
    """

    generation: int
    slot: Slot
    ready_event: Event
    batch: Any


@dataclass(frozen=True)
class EndOfEpoch:
    """The source is exhausted after ``batches`` deliveries."""

    batches: int


@dataclass(frozen=True)
class Failure:
    """The producer raised ``exc`` (its ``__traceback__`` holds the producer frames)."""

    exc: BaseException


#: What the producer puts on the ready queue.
Message = Delivery | EndOfEpoch | Failure


def _take_free_slot(
    free_q: queue.SimpleQueue[Slot], stop: threading.Event, poll_s: float
) -> Slot | None:
    while not stop.is_set():
        try:
            return free_q.get(timeout=poll_s)
        except queue.Empty:
            continue
    return None


@dataclass
class _Prepared:
    """One batch sampled and checked, not yet fetched or gathered (``*_s``: its timings)."""

    plan: ItemPlan
    x_ids: TableIds
    y_ids: TableIds
    graphs: list[Any]
    sample_s: float
    validate_s: float


class _Stopped:
    """:func:`_prepare_next`'s answer when the epoch ended (``stop``) before the source step."""


_STOPPED = _Stopped()


def _prepare_next(
    iterator: Iterator[Any], seq: int, *, store: FeatureStore, reader: ItemReader,
    device: Device, stop: threading.Event, poll_s: float,
    health: Callable[[], None] | None, rpc_lock: threading.Lock | None,
    open_calls: OpenEndedCalls,
) -> _Prepared | _Stopped | None:
    """Take the source's next item (holding the RPC turn, after ``health``; marked in
    ``open_calls``), read and check its ids, place its graphs: the batch's
    :class:`_Prepared`, None when the source is exhausted, or ``_STOPPED``."""
    t0 = time.perf_counter()
    if stop.is_set():  # an ended epoch asks nothing more of the user's code
        return _STOPPED
    if health is not None:
        health()
    with _rpc.holding(rpc_lock, stop, poll_s) as held:
        if not held or stop.is_set():  # no source step for an ended epoch
            return _STOPPED
        try:
            with open_calls.inside():
                item = next(iterator)
        except StopIteration:
            return None
        if stop.is_set():  # ended during the step: the item is dropped, not read
            return _STOPPED
        t1 = time.perf_counter()
        plan = reader.read(item, seq)
        x_ids, y_ids = batch_ids(
            store, plan.feature_ids, plan.label_ids, plan.feature_ids_name,
            plan.label_ids_name,
        )
        graphs = place_graphs(plan.graphs, device.torch_device,
                              device.dgl_graphs_as_edge_blocks)
    return _Prepared(plan, x_ids, y_ids, graphs, sample_s=t1 - t0,
                     validate_s=time.perf_counter() - t1)


def produce(
    *,
    source: Iterable[Any],
    store: FeatureStore,
    reader: ItemReader,
    device: Device,
    free_q: queue.SimpleQueue[Slot],
    ready_q: queue.SimpleQueue[Any],
    stop: threading.Event,
    write_lock: threading.Lock,
    stats: LoaderStats,
    poll_s: float,
    cache: FeatureCache | None = None,
    health: TrackedCheck | None = None,
    rpc_lock: threading.Lock | None = None,
    sample_ahead: bool = False,
    cpus: frozenset[int] | None = None,
    source_started: Latch | None = None,
    sampler_threads: int | None = None,
    producer_nice: int = 0,
    after: Sequence[ThreadExit] = (),
    open_calls: OpenEndedCalls | None = None,
) -> None:
    """Run one epoch of ``source`` into slots taken from ``free_q``.

    Per batch: the source step (sampling) and the id checks, the row-source
    fetches, a free slot, the gather into it, the hand-off.  With
    ``sample_ahead`` the source step of batch k+1 runs *before* batch k is
    handed off, so what follows a hand-off -- while the training step runs on
    it -- is batch k+1's fetches and gather (waits for a server, kernels that
    release the GIL), not sampling, which competes with the training step for
    the cores and the GIL.  Batch k then waits for that source step; a source
    that fails at k+1 still delivers batch k first.

    With ``cpus`` the thread first restricts itself to those CPUs
    (``os.sched_setaffinity``); the OS refusing them fails the epoch.  With
    ``sampler_threads`` it sets its OpenMP thread count -- DGL's, torch's --
    before ``iter(source)``; without, it keeps the count it started with
    (:mod:`pingpong._sampler_threads`).  With ``producer_nice`` it raises its own
    nice value by that much, after the affinity and before ``producer_started``
    and ``iter(source)``, so that threads it starts inherit it
    (:mod:`pingpong._producer_nice`).

    ``after``: ended epochs' producers (with their exit marks) that may still be
    inside ``source``, one whose ``iter()`` ends or resets the iterator they
    are in; ``iter(source)`` waits until each has left (checking ``stop``
    every ``poll_s``), so a new pass never starts under an old producer.

    ``open_calls`` is marked while the thread is inside ``iter(source)``, a
    source step or a row source's fetch -- the calls that may block without
    bound -- and only then (the exit hook waits longer for a producer outside them).

    ``source_started`` is set exactly once: when
    ``iter(source)`` has returned or raised, or the thread leaves before calling
    it (stopped, or its set-up failed).  ``iter(loader)`` waits for it, so each
    ``iter(loader)`` calls ``iter(source)`` once, before it returns, as the
    plain loop does.

    With ``rpc_lock`` (:mod:`pingpong._rpc`), starting the source's iterator, each
    source step (with its id checks) and each batch's row-source fetches happen
    while holding it.

    With a hot-row ``cache`` (:mod:`pingpong.cache`), each fill first tells it
    the batch's feature ids (counted in the first epoch, looked up after).
    ``health`` (the loader's ``health_check``, wrapped by the epoch, which
    releases it at its end) is called before every step of the source and
    every row-source fetch; what it raises ends the epoch like a failing source.

    Contract with the consumer:
    - a slot is written only while holding ``write_lock`` and only if ``stop``
      is not set, so a closer that sets ``stop`` and then takes the lock once
      knows no slot will be written again;
    - the copy stream waits for every one of the slot's ``release_events`` before writing;
    - exactly one terminal message (``EndOfEpoch`` or ``Failure``) is queued
      unless ``stop`` was set first.
    """
    seq = 0
    cpu_mark = time.thread_time()
    open_calls = OpenEndedCalls() if open_calls is None else open_calls
    try:
        try:
            try:
                if cpus is not None:  # first, so that threads it starts inherit it
                    _run_on(cpus)
                if lower_this_thread_priority(producer_nice) is not None:
                    stats.add(niced_epochs=1)
                started_with = None if sampler_threads is not None else dgl_threads_of_this_thread()
                with write_lock:  # like a fill: a closing loader waits for it
                    if stop.is_set():
                        return
                    device.producer_started()
                # After producer_started (Numba's OpenMP layer, started there on
                # first use, sets the thread's count) and before iter(source),
                # which may run parallel code (DGL's shuffle): see _sampler_threads.
                if sampler_threads is not None:
                    limit_dgl_threads(sampler_threads)
                elif started_with is not None:  # as if Numba had not touched it
                    limit_dgl_threads(started_with, torch_first=False)
                for mark in after:  # the last passes' producers leave the source first
                    while not mark.exited.wait(poll_s):
                        if stop.is_set():
                            return
                t_iter = time.perf_counter()
                with _rpc.holding(rpc_lock, stop, poll_s) as held:
                    if not held or stop.is_set():
                        return
                    with open_calls.inside():
                        iterator = iter(source)  # may fork DataLoader workers: sampling time
                stats.add(sample_s=time.perf_counter() - t_iter)
            finally:
                if source_started is not None:
                    source_started.set()
            prepare = functools.partial(_prepare_next, iterator, store=store, reader=reader,
                                        device=device, stop=stop, poll_s=poll_s,
                                        health=health, rpc_lock=rpc_lock,
                                        open_calls=open_calls)
            pending = prepare(seq)
            while isinstance(pending, _Prepared) and not stop.is_set():
                batch = pending
                t2 = time.perf_counter()
                with _rpc.holding(rpc_lock, stop, poll_s) as held:
                    if not held or stop.is_set():
                        return
                    try:
                        with open_calls.inside():
                            fetched = _fetch_remote(store, batch.x_ids, batch.y_ids,
                                                    device.supports_local_rows, stop, poll_s,
                                                    health)
                    except FetchStopped:  # ended while waiting behind another call
                        return
                t_fetched = time.perf_counter()
                slot = _take_free_slot(free_q, stop, poll_s)
                if slot is None:
                    return
                t3 = time.perf_counter()
                with write_lock:
                    if stop.is_set():
                        return
                    # Here, not when sampled: the batch may have waited for a slot.
                    store.check_memory_unchanged(device.supports_local_rows)
                    cache_counts = cache.on_fill(batch.x_ids) if cache is not None else {}
                    delivery = _fill(slot, store, device, batch.x_ids, batch.y_ids, fetched,
                                     batch.plan, batch.graphs)
                t4 = time.perf_counter()
                failed: BaseException | None = None
                if sample_ahead:
                    try:
                        pending = prepare(seq + 1)
                    except BaseException as exc:  # noqa: BLE001 - after batch k's hand-off
                        failed = exc
                # Counted before the hand-off: stats read right after next() include it.
                cpu_now = time.thread_time()
                stats.add(
                    **cache_counts,
                    producer_cpu_s=cpu_now - cpu_mark,
                    sample_s=batch.sample_s,  # with any wait for the RPC lock
                    validate_s=batch.validate_s,
                    fetch_s=t_fetched - t2,
                    gather_s=t4 - t3,
                    rows_gathered=_input_rows(store, batch.x_ids),
                    **_fetched_counts(fetched),
                    bytes_gathered=(_bytes(store.tables, batch.x_ids)
                                    + _bytes(store.label_tables, batch.y_ids)),
                )
                cpu_mark = cpu_now
                ready_q.put(delivery)
                seq += 1
                if failed is not None:
                    try:
                        raise failed
                    finally:
                        failed = None  # no frame -> exception -> traceback -> frame cycle
                if not sample_ahead:
                    pending = prepare(seq)
        finally:  # the CPU since the last delivery: the source's last step, a failure...
            stats.add(producer_cpu_s=time.thread_time() - cpu_mark)
        if pending is None and not stop.is_set():
            ready_q.put(EndOfEpoch(seq))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
        exc.add_note(
            f"(raised in pingpong thread {threading.current_thread().name!r} "
            f"while preparing batch {seq}; re-raised in the training loop)"
        )
        ready_q.put(Failure(exc if health is None else health.diagnosed(exc)))


def _run_on(cpus: frozenset[int]) -> None:
    """Restrict the calling thread to ``cpus``; an ``OSError`` says it was pingpong's
    ``producer_cpus`` that the OS refused."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        exc.add_note(f"(pingpong: the OS refused producer_cpus={sorted(cpus)} for the producer "
                     "thread; os.sched_getaffinity(0) lists the CPUs a thread may use)")
        raise


class TrackedCheck:
    """The loader's health check on the producer thread; remembers the exception it
    raised, so that a failure that *is* the check's is not diagnosed by it again.

    The check should raise a new exception object each time (:meth:`diagnosed` sets
    the ``__cause__`` of what it raises). :meth:`release` (the epoch's end) drops
    the check: a producer still inside the source then holds nothing of the
    user's through it (a bound method of the user's trainer, say), and calls
    nothing more.
    """

    def __init__(self, health: Callable[[], None]) -> None:
        self._health: Callable[[], None] | None = health
        self._raised: BaseException | None = None

    def release(self) -> None:
        """Drop the check; calls after this do nothing."""
        self._health = None

    def __call__(self) -> None:
        health = self._health  # release() on another thread may drop it
        if health is None:
            return
        try:
            health()
        except BaseException as exc:
            self._raised = exc
            raise

    def diagnosed(self, exc: BaseException) -> BaseException:
        """What the training loop gets for the producer's failure ``exc``: what the
        check raises now, with ``exc`` as its ``__cause__``, if it fails -- the likely
        cause of a failure that surfaced elsewhere first (a DGL sampler process whose
        server died: the trainer's read from it raises ``ConnectionResetError`` or
        ``EOFError``; the server watch, ``ServerGoneError``) -- else ``exc`` itself.
        ``exc`` is kept when it came from the check, or says what the check says
        (the server watch also raises from inside DGL's send), or is not an
        ``Exception`` (``KeyboardInterrupt``...), or the check raises no ``Exception``."""
        health = self._health
        if health is None or exc is self._raised or not isinstance(exc, Exception):
            return exc
        try:
            health()
        except BaseException as problem:  # noqa: BLE001 - whatever it raises is the diagnosis
            if not isinstance(problem, Exception) or _same(problem, exc):
                return exc
            problem.__cause__ = exc
            problem.__suppress_context__ = True
            problem.add_note(
                f"(pingpong's health check failed after the producer's "
                f"{type(exc).__name__}, shown above as its cause)")
            return problem
        return exc


def _same(a: BaseException, b: BaseException) -> bool:
    """The same diagnosis: one type, one message."""
    return type(a) is type(b) and str(a) == str(b)


def _input_rows(store: FeatureStore, x_ids: TableIds) -> int:
    """Input nodes of a batch: the one id array of a homogeneous batch, or all types' ids."""
    if not store.heterogeneous:
        return len(next(iter(x_ids.values())))
    return sum(len(ids) for ids in x_ids.values())


def _bytes(tables: dict[TableKey, Table], ids: TableIds) -> int:
    """Bytes gathered from ``tables`` when each is read at ``ids[key]`` (none
    from a table without ids: labels of a batch whose form gave none)."""
    return sum(len(ids[key]) * table.row_bytes for key, table in tables.items() if key in ids)


#: Rows fetched from row sources for one batch, by (feature or label) table.
Fetched = dict[int, FetchedRows]


def _fetch_remote(
    store: FeatureStore, x_ids: TableIds, y_ids: TableIds, read_local: bool,
    stop: threading.Event, poll_s: float, health: Callable[[], None] | None = None,
) -> Fetched:
    """Fetch the batch's rows from every row source (before a slot is taken),
    calling ``health`` before each fetch; with ``read_local``, the rows a
    source holds locally are left to be read in place (:class:`FetchedRows`).

    Keyed by ``id(table)``; a homogeneous store's tables share one id array.
    Raises :class:`~pingpong.rowsource.FetchStopped` once ``stop`` is set (checked
    before each fetch and while one waits behind another call to its source).
    """
    fetched: Fetched = {}
    for tables, ids in ((store.tables, x_ids), (store.label_tables, y_ids)):
        for key, table in tables.items():
            if isinstance(table, RemoteTable) and key in ids:
                if stop.is_set():
                    raise FetchStopped(table.name)
                if health is not None:
                    health()
                rows = table.fetch_split(ids[key], read_local, stop, poll_s)
                if id(table.source) in store.shared_sources and rows.rows is not None:
                    # One source object behind several tables: its next call for
                    # this batch may come before the copy into the slot.
                    rows = dataclasses.replace(rows, rows=rows.rows.clone())
                fetched[id(table)] = rows
    return fetched


def _fetched_counts(fetched: Fetched) -> dict[str, int]:
    """Rows that came through row sources' ``[ids]`` and rows read in place, for the stats."""
    through_source = sum(0 if f.rows is None else int(f.rows.shape[0])
                         for f in fetched.values())
    in_place = sum(int(f.local_rows.shape[0]) for f in fetched.values())
    return {"rows_fetched": through_source, "rows_read_in_place": in_place}


def _gather_all(
    buffers: dict[TableKey, Buffer], tables: dict[TableKey, Table], ids: TableIds,
    fetched: Fetched, device: Device,
) -> dict[TableKey, Any]:
    """Queue the gather of every buffer's table (``tables[key]``) at ``ids[key]`` into the buffer
    (for a row source: the copy of its fetched rows); a buffer whose key has no
    ids (labels of a batch whose form gave none) is left alone.

    Returns the row views (valid until the slot is refilled), by key.
    """
    out = {}
    for key, buffer in buffers.items():
        if key not in ids:
            continue
        n = len(ids[key])
        buffer.reserve(n, device.allocate)
        out[key] = buffer.rows(n)
        table = tables[key]
        if isinstance(table, RemoteTable):
            _place_fetched(table, fetched[id(table)], out[key], device)
        else:
            device.gather(table, ids[key], out[key])
    return out


def _place_fetched(table: RemoteTable, rows: FetchedRows, out: torch.Tensor,
                   device: Device) -> None:
    """Queue the writes that put a row source's batch rows into ``out``."""
    if rows.positions is None:
        assert rows.rows is not None
        device.copy_rows(table, rows.rows, out)
    else:
        device.place_rows(table, rows, out)


def _fill(
    slot: Slot,
    store: FeatureStore,
    device: Device,
    x_ids: TableIds,
    y_ids: TableIds,
    fetched: Fetched,
    plan: ItemPlan,
    graphs: list[Any],
) -> Delivery:
    """Gather one batch into ``slot`` on the copy stream; caller holds the write lock
    and has just checked the tables (``store.check_memory_unchanged()``, here rather
    than when the batch was sampled: a batch may wait for a free slot while the
    training loop gives a table new memory or a new layout; its ids were checked
    against the rows of the memory every gather reads, which cannot change)."""
    device.begin_fill()
    for event in slot.release_events:
        device.wait_event(event)
    slot.generation += 1
    xs = _gather_all(slot.x, store.tables, x_ids, fetched, device)
    ys = _gather_all(slot.y, store.label_tables, y_ids, fetched, device)
    moved = device.move_graphs(graphs)
    ready_event = device.record()
    x = xs if store.is_dict else xs[None]
    y = ys.get(None) if not store.labels_by_type else (ys or None)
    return Delivery(slot.generation, slot, ready_event, plan.build(moved, x, y))
