"""Compiling kernels before their first use, on a background thread.

A fresh process pays for Numba before its first gather: loading Numba's
target (its typing and lowering registries: ~0.7-1 s on a 2-core VM, even
when every kernel is in the disk cache), the threading layer, and each
kernel specialisation (loaded from the disk cache in milliseconds, or
compiled in ~0.5 s). :class:`WarmUpThread` runs that work on a thread named
``pingpong-warmup-N`` while the loader is being set up and the first batches
are sampled; the CPU device gathers with torch until it is done (see
:mod:`pingpong.devices.cpu`).

Contract:

- a warm-up never raises into its owner: an exception is kept in
  :attr:`WarmUpThread.error` (logged at debug level) and the kernels compile
  on first use, as without a warm-up;
- :meth:`WarmUpThread.stop` asks the work to stop at its next step (each step
  is one compilation or cache load, which cannot be interrupted) and joins
  the thread for as long as its caller allows (the devices give it 1 s): a
  step still compiling then finishes on its own after the device closed, and
  starts no other;
- the thread is a daemon, and interpreter exit waits for it, **bounded**.
  When the interpreter starts shutting down (``threading._register_atexit``,
  before finalisation) every warm-up is asked to stop, so none starts
  another step, and all are joined for up to ``EXIT_JOIN_S`` in all: the
  step in progress (one compilation or cache load, about a second in a fresh
  process) normally ends well within it. A daemon thread caught inside
  Numba's compiler by finalisation is killed where it stands, and one
  unwound through LLVM's C++ frames aborts the whole process ("terminate
  called without an active exception", seen once in CI). The wait is bounded
  so that exit can never hang on a warm-up whose step does not end (a
  compilation waiting on a lock, say): the process then still exits after
  ``EXIT_JOIN_S``, with the small risk above. From
  then on :meth:`WarmUpThread.stop` no longer joins (loader finalisers run at
  exit, after that wait). Known wart, from
  CPython itself (gh-128130, fixed in 3.14): a thread that runs
  ``exec``/``eval`` of a string -- Numba's compiler does -- while the main
  thread dies of an uncaught ``KeyboardInterrupt`` makes the process exit
  with status 1 instead of by SIGINT (130); the traceback is printed either
  way. Only a Ctrl-C in the first seconds after a process's first loader
  (while its warm-up still compiles) can meet it;
- :data:`in_progress` is True while any warm-up runs; hot paths read it to
  avoid waiting behind Numba's compiler lock (``_checks.check_id_range``).

Compiling holds Numba's global compiler lock: a thread that needs a new
specialisation while a warm-up compiles waits for the step in progress, and
then finds the specialisation already there if the warm-up made it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .._threads import is_current, join_within

logger = logging.getLogger(__name__)

#: What a warm-up runs: ``work(should_stop)``; ``should_stop()`` turns True
#: when the owner wants it to end (check it between steps).
Work = Callable[[Callable[[], bool]], Any]

_ids = itertools.count(1)
_lock = threading.Lock()
_running: set[WarmUpThread] = set()
_atexit_registered = False
#: Set when the interpreter starts shutting down (see :func:`_stop_all`).
_exiting = False

#: At interpreter exit, the longest wait for the warm-ups' steps in progress.
EXIT_JOIN_S = 5.0

#: True while at least one warm-up runs (read without the lock: a stale
#: value only means one batch takes the other path).
in_progress = False



class WarmUpThread:
    """One warm-up: ``work(should_stop)`` on a ``pingpong-warmup-N`` thread (or
    the thread ``name`` given).

    Attributes:
        done: set when the work ended (finished, failed or stopped).
        result: what ``work`` returned (None until done, or if it failed).
        error: the exception ``work`` raised (traceback dropped), or None.
        seconds: how long the work ran (None until done).
        finished_at: ``time.monotonic()`` when the work ended (None until done).
    """

    def __init__(self, work: Work, name: str | None = None) -> None:
        self._work: Work | None = work
        self._stop = threading.Event()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.finished_at: float | None = None
        # A daemon, joined (bounded) at interpreter exit: see the module docstring.
        self._thread = threading.Thread(
            target=self._run, name=name or f"pingpong-warmup-{next(_ids)}", daemon=True
        )

    @property
    def name(self) -> str:
        return self._thread.name

    def start(self) -> WarmUpThread:
        """Start the thread (once); returns ``self``."""
        global in_progress
        with _lock:
            _register_atexit()
            _running.add(self)
            in_progress = True
        try:
            self._thread.start()
        except BaseException:
            self._finish()
            raise
        return self

    def should_stop(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        started = time.perf_counter()
        work, self._work = self._work, None
        try:
            if work is not None:
                self.result = work(self.should_stop)
        except BaseException as exc:  # never raised: the kernels compile on first use
            logger.debug("pingpong warm-up %s failed", self.name, exc_info=True)
            self.error = exc.with_traceback(None)
        finally:
            self.seconds = time.perf_counter() - started
            self._finish()

    def _finish(self) -> None:
        global in_progress
        with _lock:
            _running.discard(self)
            in_progress = bool(_running)
        self.finished_at = time.monotonic()
        self.done.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the work to stop after its current step and join the thread.

        Returns True once the thread has ended (False if ``timeout`` ran out).
        Idempotent; from the warm-up thread itself, or once the interpreter is
        shutting down, it only asks.
        """
        self._stop.set()
        thread = self._thread
        if thread.ident is None:
            return True
        if is_current(thread) or _exiting:
            return not thread.is_alive()
        thread.join(timeout)
        return not thread.is_alive()


def _stop_all() -> None:
    """At interpreter exit (``threading._shutdown``): stop every warm-up, wait a little.

    Each warm-up is asked to stop, then all are joined for at most
    ``EXIT_JOIN_S`` in all, so that normally none is inside Numba's compiler
    when the interpreter finalises, and exit never waits for good.
    """
    global _exiting
    _exiting = True
    with _lock:
        running = list(_running)
    for warm_up in running:
        warm_up._stop.set()
    join_within([warm_up._thread for warm_up in running], EXIT_JOIN_S)


def _register_atexit() -> None:
    global _atexit_registered
    if _atexit_registered:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_stop_all)
        except RuntimeError:  # the interpreter is already shutting down
            return
    _atexit_registered = True


def start_warm_up(work: Work, name: str | None = None) -> WarmUpThread:
    """Start ``work(should_stop)`` on a new warm-up thread (named ``name``, by default
    ``pingpong-warmup-N``) and return it."""
    return WarmUpThread(work, name).start()
