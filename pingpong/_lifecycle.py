"""The lifecycle of a loader and of its epochs, in one place.

An epoch is one pass over the source: a producer thread and the training
loop's iterator.  Its states (:class:`EpochState`) and every transition::

    RUNNING --(next() reads the producer's end-of-epoch marker)---------> EXHAUSTED
            --(next() re-raises a producer error; a timeout, Ctrl-C,
               dead producer or failed debug check in next(); a timeout,
               Ctrl-C or health-check error while iter(loader) waits for
               iter(source); Ctrl-C inside the producer's start)-------> FAILED
            --(iterator.close(); the iterator is garbage-collected)-----> CLOSED
            --(a newer iter(loader): a nested loop over one loader)-----> SUPERSEDED
            --(loader.close() from any thread; the loader is
               garbage-collected; the interpreter exits)----------------> LOADER_CLOSED

Ended states are final and the first reason wins.  What ``next()`` then
does is :func:`ended_error`: ``StopIteration`` for an epoch that ran out or
was closed through its own iterator, :class:`~pingpong.errors.EpochFailedError`
after a failure (a loop that catches the failure and calls ``next()`` again),
:class:`~pingpong.errors.EpochSupersededError` or
:class:`~pingpong.errors.LoaderClosedError` when something else ended it --
never a silent stop for an epoch the training loop did not end itself.

Ending (``Epoch.end``) never blocks and is safe on any thread, finalisers
included: it sets the state and the producer's stop flag and wakes a
``next()`` waiting on another thread.  *Retiring* (``Epoch.retire``) blocks:
it waits until no slot write is in flight, then joins the producer for at
most a join timeout (:func:`join_timeout`).  After that no slot is written
again; the batch the training loop holds stays intact until a new epoch of
the same loader starts, which is when its slot is handed back.

A loader is OPEN (at most one RUNNING epoch) or CLOSED (final).  Its entry
points, all in :class:`LoaderCore`:

====================  =========================================================
``iter(loader)``      retire the previous epoch (SUPERSEDED), hand its held slot
                      back, start a new epoch; return once its producer called
                      ``iter(source)`` (``Epoch.wait_for_source_start``)
``close()``           end + retire the epoch (LOADER_CLOSED), close the device
loader finaliser      the same as ``close()``; it runs only once no iterator is
                      left, because every iterator keeps its loader alive
iterator ``close()``  end + retire its epoch (CLOSED)
iterator garbage      end its epoch (CLOSED); the loader retires it later
interpreter exit      :func:`_end_all_epochs`: end every epoch; wait (at most
                      10 s) for a producer still inside DGL's RPC client to
                      leave it; then short joins of every producer thread
                      (retired epochs' included) and closer thread
====================  =========================================================

Whatever would block, or close the device, and is asked for on a pingpong
thread (a finaliser the garbage collector runs on a producer thread) is
handed to a short-lived ``pingpong-closer-*`` thread instead: no thread
waits for itself, and no device is closed under its own producer.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _rpc
from ._threads import ThreadExit, join_within
from .errors import EpochFailedError, EpochSupersededError, LoaderClosedError

if TYPE_CHECKING:
    from ._epoch import Epoch
    from .devices.base import Device

logger = logging.getLogger(__name__)

#: How often blocked waits wake up to check stop flags and thread liveness.
POLL_S = 0.05
#: How long retiring an epoch waits for its producer thread to exit.
JOIN_TIMEOUT_S = 2.0
#: The same after a failure in ``next()`` (timeout, Ctrl-C: the producer is
#: likely stuck inside the source) and at interpreter exit.
SHORT_JOIN_TIMEOUT_S = 0.1
#: At interpreter exit, the total time given to all producer and closer threads to leave.
EXIT_JOIN_BUDGET_S = 0.5
#: At interpreter exit, how long a producer inside a DGL call is waited for (before
#: the joins).
EXIT_RPC_WAIT_S = 10.0


class EpochState(enum.Enum):
    """Where an epoch is; every state but RUNNING is final (see the module docstring)."""

    RUNNING = "running"
    EXHAUSTED = "exhausted"
    FAILED = "failed"
    CLOSED = "closed"
    SUPERSEDED = "superseded"
    LOADER_CLOSED = "loader closed"


#: the sources whose iter() ends or resets an open iterator (``loader._shares_its_iterator``)
SHARED_ITERATOR_SOURCES = ("a DataLoader with persistent_workers=True, or a datapipe or "
                           "a DataLoader over one, such as GraphBolt's gb.DataLoader, or "
                           "DGL's DistNodeDataLoader")


def describe_failure(exc: BaseException) -> str:
    """``exc`` in one line for :func:`ended_error`: its type and (cut to 300
    characters) its message.  A string, not the exception: the epoch keeps it,
    and an exception's traceback would keep the epoch's iterator and loader
    alive in a reference cycle."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 -- a failing __str__ must not replace the failure
        message = ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def ended_error(state: EpochState, delivered: int, failure: str | None = None) -> BaseException:
    """What ``next()`` raises on an epoch that ended in ``state``; ``failure``
    is what ended a FAILED one (:func:`describe_failure`)."""
    if state is EpochState.FAILED:
        return EpochFailedError(
            f"this epoch failed after {delivered} batches ({failure or 'no reason recorded'}) "
            "and delivers no more: the next() (or iter()) that raised that error ended "
            "it. iter(loader) starts a new epoch"
        )
    if state is EpochState.SUPERSEDED:
        return EpochSupersededError(
            f"this epoch was ended after {delivered} batches because iter() was called "
            "on the same PingPongLoader again (a nested loop, or zip(loader, loader)), "
            "or on another PingPongLoader over the same source whose iter() ends or "
            f"resets the iterator both would read ({SHARED_ITERATOR_SOURCES}); a loader "
            "runs one epoch at a time -- use one loader, over its own DataLoader, per "
            "concurrent loop"
        )
    if state is EpochState.LOADER_CLOSED:
        return LoaderClosedError(
            f"the PingPongLoader was closed after {delivered} batches of this epoch"
        )
    return StopIteration()


class _Process:
    """Process-wide lifecycle state: live epochs, the threads the exit hook joins,
    and whether the interpreter exits."""

    def __init__(self) -> None:
        self.exiting = False
        self.live_epochs: weakref.WeakSet[Epoch] = weakref.WeakSet()
        # Every producer thread -- also those of retired epochs that outlived their
        # join (still inside the source) -- and closer thread: the exit hook joins them.
        self.threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        # Re-entrant: a finaliser the garbage collector runs while this thread holds
        # it may start a closer thread (run_off_pingpong_threads).
        self.threads_lock = threading.RLock()
        self.hook_registered = False
        self.hook_after_dgl = False
        self.lock = threading.Lock()

    def add_thread(self, thread: threading.Thread) -> None:
        """Have the exit hook join ``thread`` (a producer or closer)."""
        with self.threads_lock:
            self.threads.add(thread)

    def register(self, epoch: Epoch) -> None:
        self.add_thread(epoch.thread)
        with self.lock:
            self.live_epochs.add(epoch)
            if not self.hook_registered:
                # Registered at the first epoch, i.e. after the loaders'
                # weakref.finalize exit hook: atexit runs it first.
                self.hook_registered = True
                atexit.register(_end_all_epochs)
            if epoch.takes_rpc_turns and not self.hook_after_dgl:
                # DGL's exit hook (registered by dgl.distributed.initialize, before any
                # epoch that takes turns) must run after ours: registered again now,
                # ours comes later in atexit's list, so it runs earlier. (Not
                # unregistered first: at exit, that could lose the pending one; a
                # second run finds every epoch ended.)
                self.hook_after_dgl = True
                atexit.register(_end_all_epochs)


_process = _Process()
_closer_ids = itertools.count()


def register_epoch(epoch: Epoch) -> None:
    """Track ``epoch`` so that interpreter exit can stop its producer."""
    _process.register(epoch)


def join_timeout(after_failure: bool = False) -> float:
    """How long retiring an epoch may wait for its producer."""
    if after_failure or _process.exiting:
        return SHORT_JOIN_TIMEOUT_S
    return JOIN_TIMEOUT_S


def on_pingpong_thread() -> bool:
    """True on a thread pingpong started (producer, fake device worker, closer)."""
    return threading.current_thread().name.startswith("pingpong-")


def run_off_pingpong_threads(work: Callable[[], None]) -> None:
    """Run ``work`` now, or -- on a pingpong thread -- on a new closer thread."""
    if not on_pingpong_thread():
        work()
        return
    closer = threading.Thread(
        target=work, name=f"pingpong-closer-{next(_closer_ids)}", daemon=True)
    _process.add_thread(closer)
    try:
        closer.start()
    except RuntimeError as exc:
        # At interpreter shutdown no new thread starts; the process is ending anyway.
        if not sys.is_finalizing() and not _process.exiting:
            logger.warning("pingpong: could not start a thread to close a loader (%s); "
                           "it stays open until close() is called again or the "
                           "process exits", exc)


def _end_all_epochs() -> None:
    """At interpreter exit, stop every producer before daemon threads are frozen.

    Every epoch is ended.  If producers take turns in DGL's RPC client
    (:mod:`pingpong._rpc`), one still inside a DGL call is waited for first --
    at most ``EXIT_RPC_WAIT_S`` -- through the lock: DGL's own exit hook, which
    runs after this one, sends through that client too.  Then every producer
    thread still alive -- also one whose epoch was retired while it was inside
    the source (``close()`` waits 2 s) -- and every closer thread is joined,
    ``EXIT_JOIN_BUDGET_S`` for all of them: a producer inside a gather finishes
    it, one just out of the source drops what it read, and exits; one blocked
    inside the source is left behind and writes nothing more.

    Why join one that will write nothing more: once the interpreter finalises,
    a daemon thread that takes the GIL back is ended with ``pthread_exit``, and
    where that happens inside C++ -- torch gives the GIL up while it frees a
    tensor -- the process aborts ("terminate called without an active
    exception"). Seen in CI, and in a core dump of the DGL-call exit scenario:
    the producer, just out of its call, was freeing the batch it had read.
    """
    _process.exiting = True
    for epoch in list(_process.live_epochs):
        epoch.end(EpochState.LOADER_CLOSED)
    # By the lock, not by the epochs: a producer whose epoch was retired while it was
    # inside a DGL call is no longer among the live epochs. Only in a process that
    # had producers taking turns (a DGL RPC client).
    if _process.hook_after_dgl:
        _wait_for_rpc_client(EXIT_RPC_WAIT_S)
    with _process.threads_lock:
        threads = list(_process.threads)
    join_within(threads, EXIT_JOIN_BUDGET_S)


def _wait_for_rpc_client(timeout: float) -> None:
    """Wait until no producer is inside DGL's RPC client
    (:func:`pingpong._rpc.wait_until_no_turn`); a warning if one still is."""
    if on_pingpong_thread():
        return
    if not _rpc.wait_until_no_turn(timeout):
        logger.warning("pingpong: at exit, a thread was still inside DGL's RPC client "
                       "after %.0f s; DGL's own exit hook may now send at the same time",
                       timeout)


# Sources whose iter() ends or resets an open iterator, and the last epoch (of
# any loader) that iterates each: a weak reference to it, and the producers a
# later pass must let leave the source first (its own and those it waits for).
_shared_sources: weakref.WeakKeyDictionary[
    object, tuple[weakref.ref[Epoch], tuple[ThreadExit, ...]]] = weakref.WeakKeyDictionary()
_shared_sources_lock = threading.Lock()


def _start_claiming(source: object | None, epoch: Epoch) -> None:
    """Start ``epoch`` as the one that iterates ``source`` now; its producer first
    lets the last epoch's producer over ``source`` leave it.

    ``source`` is None for every other source (the epoch is just started).
    Another loader's epoch still running over ``source`` (``zip`` or nested
    loops over two loaders of one DataLoader, or an iterator kept from an
    earlier loader) is ended as superseded -- its iterator then raises
    :class:`EpochSupersededError`, as for two ``iter()`` of one loader.  Its
    producer, or that of the last epoch over ``source`` that ended for any
    reason, may still be inside the source: ``epoch``'s producer calls
    ``iter(source)`` only once it has left (:meth:`Epoch.start_after`).  So the
    last ``iter()`` wins, also when two threads call it at once: each epoch's
    producer waits for the one recorded before it, which, superseded, leaves.
    """
    if source is None or not _can_key(source):
        epoch.start()
        return
    with _shared_sources_lock:
        record = _shared_sources.get(source)
        if record is not None:
            epoch.start_after(record[1])
            other = record[0]()
            if other is not None:  # before the start: a Ctrl-C leaves one epoch running
                other.end(EpochState.SUPERSEDED)
        _shared_sources[source] = (weakref.ref(epoch), epoch.producers_to_outlast())
        epoch.start()  # under the lock: no other claim sees it unstarted


def _can_key(source: object) -> bool:
    """Whether ``source`` can key :data:`_shared_sources` (hashable, weakly referable)."""
    try:
        hash(source)
        weakref.ref(source)
    except TypeError:
        return False
    return True


def _inside_on_this_thread(mark: int | None, lock: threading.Lock) -> bool:
    """Whether this thread is inside the section that ``lock`` guards and ``mark``
    names the thread of -- so a signal handler interrupted it there.  A mark
    that a Ctrl-C at the line clearing it left behind is stale: the ``with``
    released the lock all the same."""
    return mark == threading.get_ident() and lock.locked()


class LoaderCore:
    """What a loader, its iterators and its finaliser share: the one running epoch.

    ``make_epoch`` builds a new :class:`~pingpong._epoch.Epoch`, which the
    core holds before it starts it (see :meth:`~pingpong._epoch.Epoch.start`);
    the core owns ``device`` and closes it once, after the last epoch was
    retired.  Thread-safe.
    """

    def __init__(self, make_epoch: Callable[[], Epoch], device: Device,
                 shared_iterator_source: object | None = None) -> None:
        self._make_epoch = make_epoch
        self.device = device
        #: the source, if its iter() ends or resets an iterator already open
        #: (persistent DataLoader workers, datapipes): one loader's epoch at a
        #: time, and no new pass while an ended epoch's producer is inside it
        self.shared_iterator_source = shared_iterator_source
        self.epoch: Epoch | None = None
        self.closed = False
        #: the last epoch retired and the device closed (``closed`` comes first)
        self.fully_closed = False
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()  # one closer at a time
        # The thread inside start_epoch's hold of _lock, and inside _close's hold
        # of _close_lock (idents): a close() a signal handler runs there must not
        # wait for a lock its own thread holds (see close()).
        self._starting_on: int | None = None
        self._closing_on: int | None = None

    def start_epoch(self) -> Epoch:
        """``iter(loader)``: supersede the running epoch, start the next one.

        Raises :class:`LoaderClosedError` on a closed loader -- also when a signal
        handler closed it while this ran (it then finishes that close)."""
        try:
            with self._lock:
                try:  # set inside: a Ctrl-C before the try leaves no stale mark
                    self._starting_on = threading.get_ident()
                    epoch = self._start_epoch()
                finally:
                    self._starting_on = None
        finally:
            # Closed while this ran -- by a signal handler on this thread (see
            # close()), then returning or raising -- or a close left unfinished:
            # finish it, whatever this call ends with.
            if self.closed and not self.fully_closed:
                self.close()
        if self.closed:
            raise LoaderClosedError("this PingPongLoader was closed while iter() started "
                                    "an epoch")
        assert epoch is not None
        return epoch

    def _start_epoch(self) -> Epoch | None:
        """:meth:`start_epoch` holding the lock; None if closed during the retire."""
        if self.closed:
            raise LoaderClosedError("this PingPongLoader is closed")
        # The previous epoch stays recorded until it is retired: a Ctrl-C
        # anywhere in here leaves it to the next iter() or close() (each
        # step below is idempotent), never a running epoch nobody holds.
        previous = self.epoch
        if previous is not None:
            previous.end(EpochState.SUPERSEDED)
            # The full join, even after a failure: a producer still inside the
            # source exits when it returns, without another step.
            previous.retire(JOIN_TIMEOUT_S)
            previous.hand_back_lease()
        self.epoch = None
        if self.closed:
            return None
        epoch = self.epoch = self._make_epoch()
        if previous is not None and self.shared_iterator_source is not None:
            # Its iter() would end or reset the iterator that producer (or one it
            # waited for) may be in (torchdata #1482): the new pass starts once
            # they have left.
            epoch.start_after(previous.producers_to_outlast())
        try:
            # held first: a Ctrl-C from here on leaves no orphan producer
            _start_claiming(self.shared_iterator_source, epoch)
        except BaseException:
            if epoch.thread.ident is None:
                self.epoch = None  # never started: nothing to retire
            raise
        return epoch

    def close(self) -> None:
        """``loader.close()`` and the loader's finaliser; idempotent, any thread.

        From a signal handler (a SIGTERM handler) that interrupted this loader's
        ``iter()`` or ``close()`` on its own thread -- which hold locks the close
        needs -- it marks the loader closed and returns; the interrupted call
        finishes the close when it resumes (``iter()`` then raises
        :class:`LoaderClosedError`).
        """
        if _inside_on_this_thread(self._closing_on, self._close_lock):
            return  # this thread's close() was interrupted: it finishes
        if _inside_on_this_thread(self._starting_on, self._lock):
            self.closed = True  # this thread's iter() was interrupted: it finishes
            return
        run_off_pingpong_threads(self._close)

    def _close(self) -> None:
        """Refuse new epochs, retire the running one, close the device.  A Ctrl-C in
        the retire's join leaves the epoch in place (ended) and the device open: the
        next call retires it and closes the device, never under a live producer."""
        with self._close_lock:
            try:  # set inside: a Ctrl-C before the try leaves no stale mark
                self._closing_on = threading.get_ident()
                self._close_holding_the_close_lock()
            finally:
                self._closing_on = None

    def _close_holding_the_close_lock(self) -> None:
        with self._lock:
            if self.fully_closed:
                return
            self.closed = True
            epoch = self.epoch
        if epoch is not None:
            epoch.end(EpochState.LOADER_CLOSED)
            epoch.retire(join_timeout())
        with self._lock:
            self.epoch = None
        self.device.close()  # idempotent: a Ctrl-C before the mark below repeats it
        with self._lock:
            self.fully_closed = True
