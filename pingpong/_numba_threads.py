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

Nothing here runs at import time; :func:`parallel_launch_lock` is called by
the CPU kernel on first use.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator

import numba

logger = logging.getLogger(__name__)

_SAFE_LAYERS = ("omp", "tbb")
_state_lock = threading.Lock()
_serialise: bool | None = None
_launch_lock = threading.Lock()


def _layer_initialised() -> bool:
    from numba.np.ufunc import parallel

    return bool(getattr(parallel, "_is_initialized", False))


@numba.njit(parallel=True, cache=False)
def _probe(n: int) -> int:  # pragma: no cover - compiled
    acc = 0
    for i in numba.prange(n):
        acc += i
    return acc


def _choose_layer() -> bool:
    """Make sure a layer is running; return True if launches must be serialised."""
    if not _layer_initialised() and numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = "threadsafe"
        try:
            _probe(4)
        except ValueError:
            # Neither omp nor tbb could be loaded: fall back to workqueue.
            numba.config.THREADING_LAYER = "workqueue"
    _probe(4)
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


@contextlib.contextmanager
def parallel_launch_lock() -> Iterator[None]:
    """Context in which one parallel Numba kernel may be launched safely."""
    if must_serialise():
        with _launch_lock:
            yield
    else:
        yield
