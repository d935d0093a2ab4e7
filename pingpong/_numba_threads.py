"""Numba threading-layer safety for kernels launched from the producer thread.

Numba's default ``workqueue`` layer aborts the whole process when two Python
threads run ``parallel=True`` code at once (Numba #8563, #9288).  pingpong's
CPU gather runs in the producer thread while the training thread may run Numba
code of its own, so before the first parallel launch pingpong asks Numba for a
thread-safe layer (``omp`` or ``tbb``) -- unless the user already chose a layer
or Numba's layer is already running.  If only ``workqueue`` is available,
pingpong serialises its own launches behind a lock and warns once: its kernels
are then safe against each other, but not against the user's parallel Numba
code running in another thread at the same moment.

Of the two safe layers pingpong tries ``omp`` first (Numba's own order puts
``tbb`` first), unless the user gave Numba an order
(``NUMBA_THREADING_LAYER_PRIORITY``), which it then follows.  A DGL
``DataLoader`` with ``num_workers > 0`` forks its workers in ``iter()``,
which pingpong calls on the producer thread; TBB expects forks from the
thread that started it only, so under ``tbb`` such forks printed Numba's
"Attempted to fork from a non-main thread" to stderr (in the children TBB "may
be in an invalid state", Numba's words).  libgomp's teams belong to the thread
that starts them, so under ``omp`` the gathers also run at the producer's
priority (:func:`start_threading_layer`).

Nothing here runs at import time; :func:`parallel_launch_lock` is called by
the CPU kernel on first use, :func:`start_threading_layer` by a loader whose
producer lowers its priority or runs on CPUs of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator

import numba

logger = logging.getLogger(__name__)

_SAFE_LAYERS = ("omp", "tbb")  # tried in this order
_NUMBAS_DEFAULT_PRIORITY = ["tbb", "omp", "workqueue"]
_state_lock = threading.Lock()
_serialise: bool | None = None
_launch_lock = threading.Lock()


def _layer_initialised() -> bool:
    from numba.np.ufunc import parallel

    return bool(getattr(parallel, "_is_initialized", False))


def _safe_layers_in_order() -> tuple[str, ...]:
    """The thread-safe layers in the order to try them: the user's, if they set
    Numba's ``THREADING_LAYER_PRIORITY`` -- in the environment, or in
    ``numba.config`` to an order other than Numba's default (a config set to
    exactly the default cannot be told from no choice) -- else omp, tbb."""
    priority = list(numba.config.THREADING_LAYER_PRIORITY)
    if "NUMBA_THREADING_LAYER_PRIORITY" in os.environ or priority != _NUMBAS_DEFAULT_PRIORITY:
        return tuple(layer for layer in priority if layer in _SAFE_LAYERS)
    return _SAFE_LAYERS


def _choose_layer() -> bool:
    """Make sure a layer is running; return True if launches must be serialised."""
    # numba.get_num_threads() starts the layer (milliseconds; no compilation).
    if not _layer_initialised() and numba.config.THREADING_LAYER == "default":
        for candidate in (*_safe_layers_in_order(), "workqueue"):
            numba.config.THREADING_LAYER = candidate
            try:
                numba.get_num_threads()
                break
            except ValueError:  # Numba could not load it: try the next
                logger.debug("numba threading layer %s could not be loaded", candidate)
    numba.get_num_threads()
    layer = numba.threading_layer()
    if layer in _SAFE_LAYERS:
        logger.debug("numba threading layer %s is thread-safe", layer)
        return False
    warnings.warn(
        f"Numba's '{layer}' threading layer cannot run parallel code from two "
        "threads at once; pingpong serialises its own CPU gathers, but your "
        "own parallel Numba code must not run while a loader iterates. "
        "Install an OpenMP runtime or `tbb` for a thread-safe layer.",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def must_serialise() -> bool:
    """True when parallel launches from different threads must not overlap."""
    global _serialise
    if _serialise is None:
        with _state_lock:
            if _serialise is None:
                _serialise = _choose_layer()
    return _serialise


def start_threading_layer(cpus: frozenset[int] | None = None) -> None:
    """Start Numba's threading layer (the choice above), if no thread has, from a
    short-lived thread that the calling thread starts and joins -- on ``cpus``
    (``os.sched_setaffinity``; the OS refusing them is ignored here) if given.

    The loader calls it at construction when its producers will lower their
    priority or run on ``producer_cpus`` (:mod:`pingpong._producer_nice`): a
    layer's worker threads are created by the thread that starts it and inherit
    its nice value and CPUs.  The ``workqueue`` and TBB layers keep one pool for
    the whole process, which runs both pingpong's gathers and the training
    thread's own parallel Numba code: started by a niced producer, the latter ran
    at nice +10; so the pool gets the constructing thread's priority (pingpong's
    gathers then run at it too, only the producer's sampling at the lower one)
    and the producer's CPUs.  OpenMP gives each thread that starts a parallel
    region a team of its own, which inherits that thread's.  The helper is not
    the calling thread itself because the ``omp`` layer sets its starter's
    OpenMP count to ``NUMBA_NUM_THREADS``, which on the training thread would
    override ``torch.set_num_threads``.  Raises what Numba raises for a layer it
    cannot load (``NUMBA_THREADING_LAYER`` naming one that is not installed).
    """
    if _serialise is not None:  # chosen, so started
        return
    failed: list[BaseException] = []

    def start() -> None:
        if cpus is not None:
            with contextlib.suppress(OSError):  # the producer then fails its epoch
                os.sched_setaffinity(0, cpus)
        try:
            must_serialise()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            failed.append(exc)

    starter = threading.Thread(target=start, name="pingpong-numba-layer", daemon=True)
    starter.start()
    starter.join()
    if failed:
        raise failed.pop()  # popped: no cycle through this frame


@contextlib.contextmanager
def parallel_launch_lock() -> Iterator[None]:
    """Context in which one parallel Numba kernel may be launched safely."""
    if must_serialise():
        with _launch_lock:
            yield
    else:
        yield
