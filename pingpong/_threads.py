"""Waiting for threads: a group against one deadline (the exit hooks' wait), and
one producer thread's exit, safely under Ctrl-C (:class:`ExitMark`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ExitMark", "join_within", "run_marking_exit"]


class ExitMark:
    """Whether a thread has left its target, set by that thread (:func:`run_marking_exit`).

    What pingpong asks of its producer threads instead of ``Thread.join`` and
    ``Thread.is_alive`` alone: in CPython 3.11 a ``join`` that Ctrl-C interrupts
    can mark a thread that is still running as stopped (cpython#90882), and a
    new pass then started under the old producer (a persistent-worker
    DataLoader: "Invalid iterator state").  :meth:`wait` is a plain lock's
    timed acquire, clean under Ctrl-C (``Event.wait`` runs Python-level
    ``Condition`` code); ``exited`` stays true however a wait was interrupted.
    """

    def __init__(self) -> None:
        self.exited = False
        self._running = threading.Lock()
        self._running.acquire()

    def mark(self) -> None:
        """The thread's last step (once)."""
        self.exited = True
        self._running.release()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`mark`; whether it ran."""
        if not self.exited and self._running.acquire(timeout=max(0.0, timeout)):
            self._running.release()
        return self.exited


def run_marking_exit(mark: ExitMark, target: Callable[..., Any], *args: Any) -> None:
    """A thread's target: ``target(*args)``, then ``mark.mark()`` however it ends."""
    try:
        target(*args)
    finally:
        mark.mark()


def join_within(threads: Iterable[threading.Thread], budget_s: float) -> list[threading.Thread]:
    """Join each of ``threads``, waiting at most ``budget_s`` seconds for all of them
    together, not each; returns those still alive after it.

    The calling thread and threads never started are skipped (joining either would
    raise) and never counted as alive.
    """
    current = threading.current_thread()
    joinable = [t for t in threads if t is not current and t.ident is not None]
    deadline = time.monotonic() + budget_s
    for thread in joinable:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in joinable if t.is_alive()]
