"""Let numba-cuda <= 0.30 load under NumPy >= 2.4, without changing NumPy for anyone else.

numba-cuda registers overloads for ``np.row_stack``, ``np.trapz``, ``np.in1d``
and a few other aliases; NumPy 2.4+ removed them, so numba-cuda fails with
``AttributeError`` where it reads them (seen on a GPU machine with NumPy 2.5.2).
Depending on the numba-cuda version that happens at ``from numba import cuda``
or when the CUDA target loads its NumPy registries, at the first kernel compile
(numba-cuda 0.30.4: ``numba.cuda.np.arrayobj`` reads ``np.row_stack``).

:func:`missing_names_filled` adds a placeholder for each *missing* name -- a
function that raises if called -- for the duration of a ``with`` block, and
removes exactly the placeholders it added when the block ends, so that
``hasattr(np, "trapz")`` keeps telling the truth to every other library.
Nothing is changed when NumPy still has the names. While the block runs (an
import, on the importing thread), other threads can see the placeholders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

#: NumPy names that numba-cuda <= 0.30 overloads and NumPy >= 2.4 lacks.
REMOVED_NAMES = ("row_stack", "trapz", "in1d", "round_", "asfarray")


def _placeholder(name: str) -> Callable[..., Any]:
    def removed(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f"numpy.{name} was removed from NumPy {np.__version__}")

    removed.__name__ = name
    return removed


@contextmanager
def missing_names_filled() -> Iterator[tuple[str, ...]]:
    """Placeholders for the missing :data:`REMOVED_NAMES` inside the block.

    Yields the names added (empty when NumPy has them all). On exit each
    added name is deleted again, unless something else replaced it meanwhile.
    """
    added = {}
    for name in REMOVED_NAMES:
        if not hasattr(np, name):
            placeholder = _placeholder(name)
            setattr(np, name, placeholder)
            added[name] = placeholder
    try:
        yield tuple(added)
    finally:
        for name, placeholder in added.items():
            if vars(np).get(name) is placeholder:
                delattr(np, name)
