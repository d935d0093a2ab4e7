"""What the process knows of every epoch: the threads to join at interpreter exit,
the exit hook that stops them, and closer threads.

Interpreter exit runs :func:`_end_all_epochs`: it ends every epoch, waits (at
most ``EXIT_RPC_WAIT_S``) for a producer still inside DGL's RPC client to
leave it, then gives every producer thread (retired epochs' included) and
closer thread a short join, ``EXIT_JOIN_BUDGET_S`` for all of them, and a
producer still in its own steps (not inside the source) up to
``EXIT_BUSY_WAIT_S`` more.

Whatever would block, or close the device, and is asked for on a pingpong
thread (a finaliser the garbage collector runs on a producer thread) is
handed to a short-lived ``pingpong-closer-*`` thread instead
(:func:`run_off_pingpong_threads`): no thread waits for itself, and no device
is closed under its own producer.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _rpc
from ._epoch_states import EpochState
from ._threads import OpenEndedCalls, current_thread_name, is_current, join_within

if TYPE_CHECKING:
    from ._epoch import Epoch

logger = logging.getLogger(__name__)

#: At interpreter exit, the total time given to all producer and closer threads to leave.
EXIT_JOIN_BUDGET_S = 0.5
#: At interpreter exit, how long a producer inside a DGL call is waited for (before
#: the joins).
EXIT_RPC_WAIT_S = 10.0
#: At interpreter exit, after the joins, how much longer a producer (retired
#: epochs' included) is waited for while it is in its own steps -- a gather, a
#: copy, a wait for a slot, dropping what it read: bounded, unless the device
#: hangs -- which a machine too busy may not run within the join budget. One
#: inside the source or a row source's fetch (which may never return) is not
#: waited for. At most this long in all, also when the hook runs twice.
EXIT_BUSY_WAIT_S = 5.0
#: How often that wait looks whether the producer has entered such a call.
BUSY_POLL_S = 0.02


class _Process:
    """Process-wide lifecycle state: live epochs, the threads the exit hook joins,
    and whether the interpreter exits."""

    def __init__(self) -> None:
        self.exiting = False
        self.live_epochs: weakref.WeakSet[Epoch] = weakref.WeakSet()
        # Every producer thread -- also those of retired epochs that outlived their
        # join (still inside the source) -- and closer thread: the exit hook joins them.
        self.threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        # Each producer thread's marks of the open-ended calls it is in (by thread,
        # not by epoch: a retired epoch may be gone while its producer still runs).
        self.open_calls: weakref.WeakKeyDictionary[threading.Thread, OpenEndedCalls] = (
            weakref.WeakKeyDictionary())
        # When the exit hook stops waiting for busy producers (set by its first run).
        self.busy_deadline: float | None = None
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
        with self.threads_lock:
            self.open_calls[epoch.thread] = epoch.open_calls
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


def process_exiting() -> bool:
    """Whether the exit hook has run (the interpreter is exiting)."""
    return _process.exiting


def on_pingpong_thread() -> bool:
    """True on a thread pingpong started (producer, fake device worker, closer)."""
    name = current_thread_name()
    return name is not None and name.startswith("pingpong-")


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
    inside the source is left behind and writes nothing more. A producer that
    is still in its own steps after that -- a machine too busy to run it within
    the budget -- is waited for up to ``EXIT_BUSY_WAIT_S`` more
    (:func:`_wait_for_busy_producers`). (Likely what
    aborted a run of the exit test's ``sys-exit`` scenario once, at nice 19
    beside a CI run.)

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
    _wait_for_busy_producers(EXIT_BUSY_WAIT_S)


def _wait_for_busy_producers(timeout: float) -> None:
    """Wait for each producer thread still alive (retired epochs' included) as long
    as it is not inside the source or a row source's fetch (``Epoch.open_calls``):
    one in its own steps has seen ``stop`` and leaves once it runs; one that
    enters such a call, or is in one, is left behind. ``timeout`` s at most in
    all, counted from this hook's first run (in a DistDGL process it runs twice)."""
    if _process.busy_deadline is None:
        _process.busy_deadline = time.monotonic() + timeout
    deadline = _process.busy_deadline
    with _process.threads_lock:
        producers = list(_process.open_calls.items())
    for thread, calls in producers:
        if is_current(thread) or thread.ident is None:
            continue
        while thread.is_alive() and not calls.now() and time.monotonic() < deadline:
            thread.join(BUSY_POLL_S)


def _wait_for_rpc_client(timeout: float) -> None:
    """Wait until no producer is inside DGL's RPC client
    (:func:`pingpong._rpc.wait_until_no_turn`); a warning if one still is."""
    if on_pingpong_thread():
        return
    if not _rpc.wait_until_no_turn(timeout):
        logger.warning("pingpong: at exit, a thread was still inside DGL's RPC client "
                       "after %.0f s; DGL's own exit hook may now send at the same time",
                       timeout)
