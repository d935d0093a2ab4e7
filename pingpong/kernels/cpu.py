"""CPU gather kernel: ``out[i] = table[ids[i]]`` with Numba, many threads, no GIL.

Rows are copied as raw machine words (the widest integer type that divides
the row's byte size), so the kernel is dtype-agnostic and bit-exact: NaN
payloads, negative zeros and bfloat16 bit patterns arrive unchanged.
"""

from __future__ import annotations

import numba
import numpy as np

from .._numba_threads import parallel_launch_lock
from ..errors import TableError
from ._checks import check_gather_shapes, check_id_array, check_id_range

#: Rows per parallel work item: large enough to amortise scheduling, small
#: enough to balance two to a few dozen threads on 100k-row batches.
_ROWS_PER_CHUNK = 256


@numba.njit(parallel=True, nogil=True, cache=True)
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


def as_words(rows: np.ndarray) -> np.ndarray:
    """View a C-contiguous 2-D array as rows of the widest fitting integer word.

    The view shares memory with ``rows``; its row count is unchanged.
    """
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    for word in (np.int64, np.int32, np.int16):
        size = np.dtype(word).itemsize
        if row_bytes % size == 0 and rows.ctypes.data % size == 0:
            return rows.view(word).reshape(rows.shape[0], row_bytes // size)
    return rows.view(np.uint8).reshape(rows.shape[0], row_bytes)


def gather_rows_cpu_unchecked(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """Gather without checks: callers must have validated ``ids`` and shapes.

    ``table`` and ``out`` must be C-contiguous 2-D arrays of one dtype.
    """
    if ids.shape[0] == 0 or table.shape[1] == 0:
        return
    with parallel_launch_lock():
        _gather_words(as_words(table), ids, as_words(out), _ROWS_PER_CHUNK)


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
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(arr).__name__}")
    check_id_array(ids)
    check_gather_shapes(table, ids, out)
    if not table.flags.c_contiguous or not out.flags.c_contiguous:
        raise TableError("table and out must be C-contiguous")
    if not out.flags.writeable:
        raise TableError("out must be writeable")
    check_id_range(ids, table.shape[0])
    gather_rows_cpu_unchecked(table, ids, out)
