"""CPU gather kernels: ``out[i] = table[ids[i]]`` with Numba, many threads, no GIL,
and the positioned ``out[positions[i]] = table[ids[i]]`` (a row source's local rows).

Rows are copied as raw machine words (the widest integer type that divides
the row's byte size and the addresses of both ``table`` and ``out``), so the
kernel is dtype-agnostic and bit-exact: NaN payloads, negative zeros and
bfloat16 bit patterns arrive unchanged.

Compiled code is cached on disk (``cache=True``: ``__pycache__`` next to this
file, or Numba's user-wide cache directory when that is not writable; compiled
in each process, with a warning, when neither is: :mod:`._jitcache`), and
:func:`warm_up_cpu` compiles or loads exactly the specialisations a gather
will use -- one per (word width, id dtype) -- ahead of the first batch;
:func:`warm_up_cpu_at` the positioned kernel's (int64 ids and positions, one per
word width).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numba
import numpy as np

from .._numba_threads import must_serialise, parallel_launch_lock
from ..errors import ConfigError, TableError
from ._checks import (
    check_gather_shapes,
    check_id_array,
    check_id_range,
    id_dtype,
    warm_up_id_bounds,
)
from ._jitcache import jit_cached

#: Rows per parallel work item: large enough to amortise scheduling, small
#: enough to balance two to a few dozen threads on 100k-row batches.
_ROWS_PER_CHUNK = 256


@jit_cached(numba.njit, parallel=True, nogil=True)
def _gather_words(table, ids, out, rows_per_chunk):  # pragma: no cover - compiled
    n = ids.shape[0]
    width = table.shape[1]
    num_chunks = (n + rows_per_chunk - 1) // rows_per_chunk
    for c in numba.prange(num_chunks):
        start = c * rows_per_chunk
        stop = min(start + rows_per_chunk, n)
        for i in range(start, stop):
            row = ids[i]
            for j in range(width):
                out[i, j] = table[row, j]


@jit_cached(numba.njit, parallel=True, nogil=True)
def _gather_words_at(table, ids, positions, out, rows_per_chunk):  # pragma: no cover - compiled
    n = ids.shape[0]
    width = table.shape[1]
    num_chunks = (n + rows_per_chunk - 1) // rows_per_chunk
    for c in numba.prange(num_chunks):
        start = c * rows_per_chunk
        stop = min(start + rows_per_chunk, n)
        for i in range(start, stop):
            row = ids[i]
            dst = positions[i]
            for j in range(width):
                out[dst, j] = table[row, j]


#: Word dtype per word size; ``as_words`` views rows as these.
_WORDS: dict[int, np.dtype] = {
    8: np.dtype(np.int64),
    4: np.dtype(np.int32),
    2: np.dtype(np.int16),
    1: np.dtype(np.uint8),
}


def word_bytes(row_bytes: int, *addresses: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing ``row_bytes`` and every address."""
    for size in (8, 4, 2):
        if row_bytes % size == 0 and all(address % size == 0 for address in addresses):
            return size
    return 1


def _address(rows: np.ndarray) -> int:
    return int(rows.__array_interface__["data"][0])


def as_words(rows: np.ndarray, size: int | None = None) -> np.ndarray:
    """View a C-contiguous 2-D array as rows of ``size``-byte integer words.

    ``size=None`` picks the widest word fitting the row size and the
    array's address (:func:`word_bytes`). The view shares memory with
    ``rows``; its row count is unchanged.
    """
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    if size is None:
        size = word_bytes(row_bytes, _address(rows))
    words: np.ndarray = rows.view(_WORDS[size])
    return words.reshape(rows.shape[0], row_bytes // size)


def gather_rows_cpu_unchecked(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """Gather without checks: callers must have validated ``ids`` and shapes.

    ``table`` and ``out`` must be C-contiguous 2-D arrays of one dtype. Both
    are viewed with the *same* word, one that suits both addresses (a table
    that starts off a word boundary is copied in narrower words).
    """
    if ids.shape[0] == 0 or table.shape[1] == 0:
        return
    size = word_bytes(table.shape[1] * table.dtype.itemsize, _address(table), _address(out))
    with parallel_launch_lock():
        _gather_words(as_words(table, size), ids, as_words(out, size), _ROWS_PER_CHUNK)


def gather_rows_at_cpu_unchecked(
    table: np.ndarray, ids: np.ndarray, positions: np.ndarray, out: np.ndarray
) -> None:
    """``out[positions[k]] = table[ids[k]]`` for every ``k``, without checks.

    Callers must have validated ``ids`` (in ``[0, len(table))``), ``positions``
    (int64, same length, distinct, in ``[0, len(out))``) and the shapes; as for
    :func:`gather_rows_cpu_unchecked`, ``table`` and ``out`` are C-contiguous
    2-D arrays of one dtype.
    """
    if ids.shape[0] != positions.shape[0]:  # cheap, and a short one would leave rows unwritten
        raise TableError(f"{ids.shape[0]} ids but {positions.shape[0]} positions")
    if ids.shape[0] == 0 or table.shape[1] == 0:
        return
    size = word_bytes(table.shape[1] * table.dtype.itemsize, _address(table), _address(out))
    with parallel_launch_lock():
        _gather_words_at(as_words(table, size), ids, positions, as_words(out, size),
                         _ROWS_PER_CHUNK)


def gather_rows_cpu(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """Write ``table[ids]`` into ``out`` using Numba's parallel threads.

    Args:
        table: C-contiguous 2-D array ``(N, F)`` of any dtype.
        ids: 1-D int32 or int64 array; every value must lie in ``[0, N)``.
        out: C-contiguous array of shape ``(len(ids), F)`` and ``table``'s dtype.

    Raises:
        IdShapeError / IdTypeError: ids are not 1-D int32/int64.
        IdRangeError: an id is outside ``[0, N)`` -- checked before any row
            is read, so ``out`` is untouched.
        TableError: shapes, dtypes or memory layout do not match.

    Numba's thread count for the call is the calling thread's
    (``numba.set_num_threads`` is per thread).
    """
    for name, arr in (("table", table), ("ids", ids), ("out", out)):
        if not isinstance(arr, np.ndarray):
            raise ConfigError(f"{name} must be a numpy.ndarray, got {type(arr).__name__}")
    check_id_array(ids)
    check_gather_shapes(table, ids, out)
    if not table.flags.c_contiguous or not out.flags.c_contiguous:
        raise TableError("table and out must be C-contiguous")
    check_id_range(ids, table.shape[0])
    gather_rows_cpu_unchecked(table, ids, out)


# --------------------------------------------------------------------------- warm-up


def gather_signature(size: int, ids: object) -> tuple[object, ...]:
    """The Numba signature of the gather over ``size``-byte words with ``ids``' dtype."""
    words = numba.typeof(np.empty((1, 1), dtype=_WORDS[size]))
    id_array = numba.typeof(np.empty(1, dtype=id_dtype(ids)))
    return (words, id_array, words, numba.typeof(_ROWS_PER_CHUNK))


def _table_word(table: int | np.ndarray) -> int:
    """The word a gather from ``table`` into a slot will use (slots are 64-byte aligned)."""
    if isinstance(table, np.ndarray):
        if table.ndim != 2:
            raise TableError(f"warm-up tables must be 2-D byte rows, got shape {table.shape}")
        return word_bytes(table.shape[1] * table.dtype.itemsize, _address(table))
    if isinstance(table, bool) or not isinstance(table, int | np.integer) or table < 1:
        raise TableError(f"a row size must be a positive int, got {table!r}")
    return word_bytes(int(table))


#: The id dtypes a loader warms up, most common first (DGL and torch default to int64).
WARM_UP_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))
#: (word bytes, id dtype) of every gather specialisation a warm-up made ready.
_ready: set[tuple[int, np.dtype]] = set()


#: Word bytes of every positioned gather (int64 ids and positions) a warm-up made ready.
_ready_at: set[int] = set()


def gather_is_ready(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> bool:
    """True if a warm-up made ready the specialisation this gather would run."""
    size = word_bytes(table.shape[1] * table.dtype.itemsize, _address(table), _address(out))
    return (size, ids.dtype) in _ready


def gather_at_is_ready(table: np.ndarray, out: np.ndarray) -> bool:
    """True if a warm-up made ready the positioned gather from ``table`` into ``out``."""
    return word_bytes(table.shape[1] * table.dtype.itemsize, _address(table),
                      _address(out)) in _ready_at


def warm_up_cpu_at(
    tables: Iterable[int | np.ndarray], should_stop: Callable[[], bool] | None = None
) -> list[tuple[object, ...]]:
    """Compile, or load from the disk cache, the positioned gather (int64 ids and
    positions) for every word width ``tables`` need (see :func:`warm_up_cpu`);
    record each as ready. Returns the signatures made ready."""
    stop = should_stop or (lambda: False)
    ready: list[tuple[object, ...]] = []
    int64s = numba.typeof(np.empty(1, dtype=np.int64))
    for size in sorted({_table_word(table) for table in tables}, reverse=True):
        if stop():
            break
        words = numba.typeof(np.empty((1, 1), dtype=_WORDS[size]))
        signature = (words, int64s, int64s, words, numba.typeof(_ROWS_PER_CHUNK))
        _gather_words_at.compile(signature)
        _ready_at.add(size)
        ready.append(signature)
    return ready


def warm_up_cpu(
    tables: Iterable[int | np.ndarray],
    id_dtypes: Iterable[object] = WARM_UP_ID_DTYPES,
    *,
    threading_layer: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> list[tuple[object, ...]]:
    """Compile, or load from the disk cache, what a CPU gather over ``tables`` will run.

    Args:
        tables: for each table, its row size in bytes (the table assumed to
            start on an 8-byte boundary, as torch allocates), or the table's
            2-D C-contiguous array (its address counts too: see
            :func:`word_bytes`).
        id_dtypes: the id dtypes batches will carry (int64 and/or int32), in
            the order to warm them up.
        threading_layer: also start Numba's threading layer (pingpong's
            thread-safe choice, :mod:`pingpong._numba_threads`).
        should_stop: checked between steps; return True to end early.

    Per id dtype, in order: its id-bounds check, (before the first gather)
    the threading layer, then the gather for every word width the tables
    need -- the specialisations the loader's ``gather="cpu"`` (and
    ``"staged"``) calls hit. Each step is one compilation or cache load
    under Numba's compiler lock (the layer's start, milliseconds, is none);
    no kernel is launched. Safe from any thread. Each gather made ready is recorded
    (:func:`gather_is_ready`) as soon as it is, so a caller can use it
    before the rest are done.

    Returns:
        The signatures of the gather specialisations made ready (all of them
        unless stopped early).

    Raises:
        IdTypeError: an id dtype other than int32/int64.
        TableError: a row size that is not a positive int, or a table that is not 2-D.
    """
    stop = should_stop or (lambda: False)
    dtypes = list(dict.fromkeys(id_dtype(d) for d in id_dtypes))
    sizes = sorted({_table_word(table) for table in tables}, reverse=True)
    ready: list[tuple[object, ...]] = []
    layer_started = not threading_layer
    for dtype in dtypes:
        if stop():
            return ready
        warm_up_id_bounds(dtype)
        if not layer_started and not stop():
            must_serialise()
            layer_started = True
        for size in sizes:
            if stop():
                return ready
            signature = gather_signature(size, dtype)
            _gather_words.compile(signature)
            _ready.add((size, dtype))
            ready.append(signature)
    return ready
