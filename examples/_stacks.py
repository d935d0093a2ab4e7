"""Ask a running process where it is: every thread's Python stack, on a signal.

The DistDGL example's launcher (``train_dist.py``) asks each server and trainer
still running for its stacks before it stops a job that overran, so that a
hang shows where every process was.

Two signals, because neither way works alone:

- **SIGUSR1** runs a Python handler (:func:`write_stacks`) in the main thread,
  holding the GIL: the other threads stand still while their frames are read,
  so it is safe however busy they are. It runs only when the main thread next
  executes Python code, so a main thread inside native code (a C call that
  holds the GIL, or one that retries its wait after a signal) never answers.
- **SIGUSR2** goes to :mod:`faulthandler`, which answers at once from the
  C signal handler, native code or not. It reads the other threads' frames
  without the GIL, and a thread that runs Python meanwhile can free what it
  reads: the process may die of SIGSEGV (seen: a DistDGL trainer, its
  producer thread sampling, crashed on a SIGUSR1 handed to faulthandler).

:func:`request_stacks` sends SIGUSR1, waits for the process to note that it
answered, and only then falls back on SIGUSR2.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

#: The folder where a process notes (an empty file named after its pid) that
#: it wrote its stacks; set by the launcher in the processes it starts.
ANSWERED_DIR_ENV = "PINGPONG_STACKS_ANSWERED_DIR"


def answer_stack_requests() -> None:
    """In this process: SIGUSR1 writes every thread's Python stack to stderr
    (:func:`write_stacks`), SIGUSR2 asks :mod:`faulthandler` for the same.

    Call it from the main thread, early: until then either signal kills the
    process (their default action).
    """
    signal.signal(signal.SIGUSR1, write_stacks)
    faulthandler.register(signal.SIGUSR2, all_threads=True)


def format_stacks(current: FrameType | None = None) -> str:
    """Every thread's Python stack, most recent call first, in faulthandler's layout.

    ``current``: the frame to show for the calling thread (a signal handler
    passes the frame it interrupted, so that the handler itself is left out).
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    lines = []
    for ident, frame in sys._current_frames().items():
        top = current if ident == me and current is not None else frame
        label = "Current thread" if ident == me else "Thread"
        lines.append(f"{label} {ident:#018x} [{names.get(ident, '?')}] "
                     "(most recent call first):")
        lines.extend(f'  File "{f.f_code.co_filename}", line {lineno} in {f.f_code.co_name}'
                     for f, lineno in traceback.walk_stack(top))
        lines.append("")
    return "\n".join(lines) + "\n"


def write_stacks(signum: int = 0, frame: FrameType | None = None) -> None:
    """Write :func:`format_stacks` to file descriptor 2, then note the answer.

    A signal handler: it writes with ``os.write`` (not ``sys.stderr``, whose
    buffer the interrupted code may be in the middle of writing) and touches
    ``$PINGPONG_STACKS_ANSWERED_DIR/<pid>`` when that variable is set.
    """
    data = memoryview(format_stacks(below_handler(frame)).encode(errors="replace"))
    with contextlib.suppress(OSError):  # stderr closed: nowhere to write, go on
        while data:
            data = data[os.write(2, data):]
    answered_dir = os.environ.get(ANSWERED_DIR_ENV)
    if answered_dir:
        with contextlib.suppress(OSError):
            (Path(answered_dir) / str(os.getpid())).touch()


def below_handler(frame: FrameType | None) -> FrameType | None:
    """``frame``, or -- when it is inside :func:`write_stacks` -- the frame that
    handler interrupted.

    A request that arrives while the handler for the previous one is still
    returning (after it noted its answer) runs the handler again, nested: the
    frame it interrupted is then the first handler's own.
    """
    shown = frame
    while frame is not None:
        if frame.f_code is write_stacks.__code__:
            shown = frame.f_back
        frame = frame.f_back
    return shown


def request_stacks(pid: int, answered_dir: Path, *, answer_s: float = 5.0,
                   settle_s: float = 0.5, alive: Callable[[], bool] | None = None,
                   log: Callable[[str], None] | None = None) -> str:
    """Ask process ``pid`` (running :func:`answer_stack_requests`) for its stacks.

    Sends SIGUSR1 and waits up to ``answer_s`` for ``answered_dir/<pid>``.
    A process that does not answer in time gets SIGUSR2 (faulthandler), and
    ``settle_s`` to write. ``alive`` (say ``lambda: popen.poll() is None``)
    stops the wait early for a child that exits. Returns how it answered:
    ``"python"``, ``"faulthandler"`` or ``"gone"`` (the process exited).
    """
    marker = answered_dir / str(pid)
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()  # an answer to an earlier request
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "gone"
    end = time.monotonic() + answer_s
    while time.monotonic() < end:
        if marker.exists():
            return "python"
        if alive is not None and not alive():
            return "gone"
        time.sleep(0.01)
    if log is not None:
        log(f"  pid {pid} did not answer within {answer_s:g} s (its main thread is in "
            "native code): asking faulthandler instead (SIGUSR2)")
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        return "gone"
    time.sleep(settle_s)
    return "faulthandler"
