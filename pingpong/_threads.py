"""Joining a group of threads against one deadline (the exit hooks' wait)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

__all__ = ["join_within"]


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
