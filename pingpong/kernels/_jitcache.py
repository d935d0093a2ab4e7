"""Numba's on-disk cache where it can be written, and compiling in each process where not.

The kernels are compiled with ``cache=True``: the compiled code is kept next to
the module (``__pycache__``) or in ``~/.cache/numba`` and loaded by later
processes.  Numba decides where when a function is *decorated* -- at import --
and raises ``RuntimeError`` ("cannot cache function ...: no locator
available") when no location is writable: a read-only install whose user has
no writable home, as in a hardened container.  :func:`jit_cached` then
compiles the function without the cache (each process pays the compile
time) and warns once per process, instead of making ``import pingpong``
fail.  ``NUMBA_CACHE_DIR`` pointing at a writable folder brings the cache
back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Whether this process has warned yet: the first function compiled without the
#: cache is a warning, the rest are logged at DEBUG.
_warned = False


def jit_cached(jit: Callable[..., Any], **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """A decorator: ``jit(cache=True, **options)``, or ``jit(**options)`` (with a
    warning) when Numba has nowhere to keep the cache.

    ``jit`` is ``numba.njit`` or ``numba.cuda.jit``; other errors pass through.
    """

    def decorate(func: Callable[..., Any]) -> Any:
        global _warned
        try:
            return jit(cache=True, **options)(func)
        except RuntimeError as exc:
            if "cannot cache function" not in str(exc):
                raise
            log = logger.debug if _warned else logger.warning
            _warned = True
            log("pingpong: Numba has nowhere to cache %s (%s); compiling it in every "
                "process instead. Set NUMBA_CACHE_DIR to a writable folder to keep the "
                "compiled code", func.__qualname__, exc)
            return jit(**options)(func)

    return decorate
