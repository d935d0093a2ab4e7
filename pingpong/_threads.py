"""Waiting for threads: a group against one deadline (the exit hooks' wait), and
one-shot signals that a producer thread sets and other threads wait for safely
under Ctrl-C (:class:`Latch`: the producer's exit, its source's start;
:class:`ThreadExit`: a thread with its exit latch), and whether a producer is
inside the user's open-ended calls (:class:`OpenEndedCalls`).  And which thread runs this
code, asked without :func:`threading.current_thread` (:func:`is_current`,
:func:`current_thread_name`)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Latch", "OpenEndedCalls", "ThreadExit", "current_thread_name", "is_current",
           "join_within", "run_marking_exit"]


# Why not threading.current_thread(): pingpong's closes and finalisers may run on a
# thread that threading has already stopped listing -- one exiting, whose last
# references (a threading.Timer's ``loader.close``) are freed then.  There,
# current_thread() registers a _DummyThread for it, which stays listed in
# threading.enumerate() (and counted by active_count()) after the thread is gone.
def is_current(thread: threading.Thread) -> bool:
    """Whether ``thread`` is the thread running this code."""
    return thread.ident == threading.get_ident() and thread.is_alive()


def current_thread_name() -> str | None:
    """The name of the thread running this code; None for one threading does not
    list (exiting, or started outside :mod:`threading`)."""
    ident = threading.get_ident()
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return None


class Latch:
    """A one-shot signal: set once, by one thread; waited for by any number.

    What pingpong uses instead of ``threading.Event`` (and, for a producer's
    exit, instead of ``Thread.join`` and ``Thread.is_alive`` alone):

    - :meth:`wait` is a plain lock's timed acquire, so a Ctrl-C in it is a clean
      ``KeyboardInterrupt``; ``Event.wait`` runs Python-level ``Condition``
      code that an interrupt can leave half done;
    - in CPython 3.11 a ``join`` that Ctrl-C interrupts can mark a thread that
      is still running as stopped (cpython#90882), and a new pass then started
      under the old producer (a persistent-worker DataLoader: "Invalid iterator
      state").  A producer's exit is therefore a latch the producer sets itself
      (:func:`run_marking_exit`), and :meth:`is_set` stays true however a wait
      was interrupted.
    """

    def __init__(self) -> None:
        self._set = False
        self._unset = threading.Lock()
        self._unset.acquire()

    def set(self) -> None:
        """Set the latch; at most once."""
        self._set = True
        self._unset.release()

    def is_set(self) -> bool:
        """Whether :meth:`set` has run."""
        return self._set

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`set`; whether it has run."""
        if not self._set and self._unset.acquire(timeout=max(0.0, timeout)):
            self._unset.release()
        return self._set


class OpenEndedCalls:
    """Whether one thread is inside a call that may block without bound -- the
    source's ``iter()`` or ``next()``, a row source's fetch: the user's code -- or
    in its own steps, each bounded (unless the device hangs).

    Set and cleared by that thread only (:meth:`inside`); read by any thread
    (the exit hook waits longer for a producer outside such a call).
    """

    def __init__(self) -> None:
        self._inside = False

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Mark the calling thread as inside an open-ended call for the block."""
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def now(self) -> bool:
        """Whether the thread is inside such a call right now."""
        return self._inside


@dataclass(frozen=True)
class ThreadExit:
    """A thread (weakly: a running thread stays reachable through ``threading``)
    whose target runs in :func:`run_marking_exit`, and the latch it sets there."""

    thread: weakref.ref[threading.Thread]
    exited: Latch

    @classmethod
    def of(cls, thread: threading.Thread, exited: Latch) -> ThreadExit:
        return cls(weakref.ref(thread), exited)

    def pending(self) -> bool:
        """The thread started and has not marked its exit (a thread never started,
        or gone from memory, is not pending: it never sets the latch)."""
        thread = self.thread()
        return thread is not None and thread.ident is not None and not self.exited.is_set()


def run_marking_exit(exited: Latch, target: Callable[..., Any], *args: Any,
                     **kwargs: Any) -> None:
    """A thread's target: ``target(*args, **kwargs)``, then ``exited.set()`` however
    it ends."""
    try:
        target(*args, **kwargs)
    finally:
        exited.set()


def join_within(threads: Iterable[threading.Thread], budget_s: float) -> list[threading.Thread]:
    """Join each of ``threads``, waiting at most ``budget_s`` seconds for all of them
    together, not each; returns those still alive after it.

    The calling thread and threads never started are skipped (joining either would
    raise) and never counted as alive.
    """
    joinable = [t for t in threads if not is_current(t) and t.ident is not None]
    deadline = time.monotonic() + budget_s
    for thread in joinable:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in joinable if t.is_alive()]
