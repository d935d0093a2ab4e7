"""Integer arguments: what counts as an int when a user passes a count or a size."""

from __future__ import annotations

import numbers
from typing import Any, TypeAlias

import numpy as np

#: The type of a count or size argument: a Python ``int`` or a NumPy integer
#: scalar (``np.int64(3)``), both accepted at run time by :func:`integer`.
#: (A NumPy bool is no ``np.integer``; a Python bool type-checks as an int but
#: is refused at run time.)
Count: TypeAlias = int | np.integer[Any]


def integer(value: object) -> int | None:
    """``value`` as a Python ``int`` when it is an integer, else None.

    An integer is anything :class:`numbers.Integral` -- ``int``, a NumPy integer
    scalar (``np.int64(3)``, as hyperparameter sweeps hand them out) -- except a
    bool: ``True`` is refused, not taken as 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
