"""Let numba-cuda <= 0.30 import under NumPy >= 2.4.

numba-cuda registers overloads for ``np.row_stack``, ``np.trapz``, ``np.in1d``
and a few other aliases at import time; NumPy 2.4+ removed them, so
``from numba import cuda`` fails with ``AttributeError`` and no kernel can be
compiled (seen on a GPU machine with NumPy 2.5.2).  :func:`patch` adds a
placeholder for each *missing* name -- a function that raises if called --
before numba-cuda is imported.  Nothing is changed when NumPy still has them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: NumPy names that numba-cuda <= 0.30 overloads at import and NumPy >= 2.4 lacks.
REMOVED_NAMES = ("row_stack", "trapz", "in1d", "round_", "asfarray")


def _placeholder(name: str) -> Callable[..., Any]:
    def removed(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f"numpy.{name} was removed from NumPy {np.__version__}")

    removed.__name__ = name
    return removed


def patch() -> list[str]:
    """Add placeholders for the missing names; return the names added."""
    added = []
    for name in REMOVED_NAMES:
        if not hasattr(np, name):
            setattr(np, name, _placeholder(name))
            added.append(name)
    return added
