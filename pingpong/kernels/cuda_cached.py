"""One gather for cache hits and misses: hot rows from device memory, the rest over PCIe.

A feature cache keeps a table's hot rows (:mod:`pingpong.hotrows`) in a
device array ``cache``; ``slot_of`` (int32, one entry per table row, on the
device) maps a row to its place in ``cache`` or to ``-1``. One kernel then
serves a batch: for each id, the group of threads that copies its row reads
``cache[slot_of[id]]`` when the row is cached and ``table[id]`` (pinned host
memory, zero-copy) when it is not, with the same aligned-window copy as
:func:`pingpong.kernels.cuda.gather_rows_cuda`. The output is bit-identical
to ``table[ids]`` whatever is cached, and the kernel composes with the GPU-side
id sort (``positions``).

Contracts:

- :func:`~pingpong.hotrows.build_slot_map` checks the hot ids (1-D, distinct, in range) and
  returns the host ``slot_of``: ``slot_of[hot_ids[i]] == i``, ``-1`` elsewhere;
  the caller fills ``cache[i] = table[hot_ids[i]]`` (the ``i``-th row of
  ``table[hot_ids]``).
- :func:`gather_rows_cached` validates ids, shapes, dtypes and the slot map
  against the cache *before* any launch: a bad argument raises and ``out`` is
  untouched. :func:`gather_rows_cached_unchecked` trusts its caller.
- With ``hits`` (a device int64 array of one element), each cached row served
  adds 1 to ``hits[0]`` (one atomic per row): hit rate and the bytes that
  crossed PCIe (``(len(ids) - hits) * row_bytes``) follow.
- Both enqueue on ``stream`` and return without waiting, except for the id
  and slot range checks of the checked entry point on device arrays, which
  read two numbers back (they synchronise ``stream``).

The kernel is compiled on first use (``cache=True``: loaded from Numba's disk
cache afterwards); :func:`pingpong.kernels.warm_up_cuda` does not warm it up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import TableError
from ..hotrows import NOT_CACHED, build_slot_map
from ._checks import check_gather_shapes, check_id_array
from ._jitcache import jit_cached
from .cuda import (
    DEFAULT_THREADS_PER_BLOCK,
    SEGMENT_BYTES,
    Array,
    _address,
    _as_gather_array,
    _as_ids_array,
    _check_tuning,
    _copy_row,
    _destination,
    _is_c_contiguous,
    _is_device_array,
    _launch,
    _read_only,
    _require_cuda,
    _row_group,
    _shift_words_device,
    _to_device,
    _to_host,
    _words,
    check_ids_in_range,
    cuda,
    is_simulator,
    plan_gather,
)

__all__ = ["build_slot_map", "gather_rows_cached", "gather_rows_cached_unchecked"]

@jit_cached(cuda.jit)
def _cached_gather_kernel(  # pragma: no cover - compiled (or simulated thread by thread)
    table,
    cache,
    slot_of,
    out,
    ids,
    dst,
    use_dst,
    table_offset,
    cache_offset,
    row_bytes,
    word_bytes,
    align_bytes,
    threads_per_row,
    hits,
    count_hits,
):
    """``out[dst[k] if use_dst else k] = cache[slot] if slot >= 0 else table[ids[k]]``
    with ``slot = slot_of[ids[k]]``; one group of ``threads_per_row`` threads per row."""
    k, lane, groups = _row_group(threads_per_row)
    while k < ids.shape[0]:
        src = np.int64(ids[k])
        d = _destination(k, dst, use_dst)
        slot = np.int64(slot_of[src])
        if slot >= 0:
            shift = _shift_words_device(cache_offset, slot, row_bytes, word_bytes, align_bytes)
            _copy_row(cache, slot, shift, out, d, lane, threads_per_row)
            if count_hits and lane == 0:
                cuda.atomic.add(hits, 0, 1)
        else:
            shift = _shift_words_device(table_offset, src, row_bytes, word_bytes, align_bytes)
            _copy_row(table, src, shift, out, d, lane, threads_per_row)
        k += groups


def gather_rows_cached_unchecked(
    table: Array,
    cache: Array,
    slot_of: Array,
    ids: Array,
    out: Array,
    stream: Any = None,
    *,
    positions: Array | None = None,
    hits: Array | None = None,
    max_blocks: int | None = None,
    threads_per_row: int | None = None,
    threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
) -> None:
    """Enqueue ``out[:] = table[ids]``, cached rows read from ``cache``, without checks.

    ``positions`` (device int64, ``len(ids)``): the ids are already sorted and
    ``out[positions[i]] = row(ids[i])``. The caller guarantees what
    :func:`gather_rows_cached` checks. Host (NumPy) ids, positions and slot
    maps are copied to the device first (synchronously).
    """
    _check_tuning(threads_per_row, threads_per_block, max_blocks)
    n = int(ids.shape[0])
    if n == 0 or int(table.shape[1]) == 0:
        return
    plan = plan_gather(
        table,
        out,
        n,
        threads_per_row=threads_per_row,
        threads_per_block=threads_per_block,
        max_blocks=max_blocks,
        other_sources=(cache,) if int(cache.shape[0]) else (),
    )
    launch_stream = 0 if stream is None else stream

    def on_device(array: Array) -> Array:
        if _is_device_array(array) or is_simulator():
            return array
        return _to_device(np.ascontiguousarray(array), launch_stream)

    ids = on_device(ids)
    dst = ids if positions is None else on_device(positions)
    count_hits = hits is not None
    # Read-only: under the simulator a bare NumPy argument is written back (_read_only).
    ids, dst = _read_only(ids), _read_only(dst)
    if hits is None:
        hits = ids  # a placeholder of the right kind: never written without count_hits
    # An empty cache still needs a 2-D array of the table's words to launch with.
    cache_rows = cache if int(cache.shape[0]) else table[:1]
    cache_offset = _address(cache_rows) % SEGMENT_BYTES
    _launch(
        _cached_gather_kernel,
        plan.blocks,
        plan.threads_per_block,
        launch_stream,
        _read_only(_words(table, plan.word_bytes)),
        _read_only(_words(cache_rows, plan.word_bytes)),
        _read_only(on_device(slot_of)),
        _words(out, plan.word_bytes),
        ids,
        dst,
        positions is not None,
        plan.table_offset,
        cache_offset,
        plan.row_bytes,
        plan.word_bytes,
        plan.align_bytes,
        plan.threads_per_row,
        hits,
        count_hits,
    )


def _check_slot_map(slot_of: Array, num_rows: int, cache_rows: int, stream: Any) -> None:
    """``slot_of``: 1-D int32 of ``num_rows`` entries, each ``-1`` or in ``[0, cache_rows)``."""
    if len(slot_of.shape) != 1 or np.dtype(slot_of.dtype) != np.int32:
        raise TableError(
            f"slot_of must be 1-D int32, got {np.dtype(slot_of.dtype)} of shape "
            f"{tuple(slot_of.shape)}"
        )
    if int(slot_of.shape[0]) != num_rows:
        raise TableError(
            f"slot_of has {int(slot_of.shape[0])} entries; the table has {num_rows} rows"
        )
    if num_rows == 0:
        return
    values = _to_host(slot_of, 0 if stream is None else stream)
    lo, hi = int(values.min()), int(values.max())
    if lo < NOT_CACHED or hi >= cache_rows:
        raise TableError(
            f"slot_of holds slots in [{lo}, {hi}]; the cache has {cache_rows} rows "
            f"(-1 marks a row that is not cached)"
        )


def gather_rows_cached(
    table: Array,
    cache: Array,
    slot_of: Array,
    ids: Array,
    out: Array,
    stream: Any = None,
    *,
    hits: Array | None = None,
    max_blocks: int | None = None,
    threads_per_row: int | None = None,
    threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
) -> None:
    """Enqueue ``out[:] = table[ids]`` with cached rows read from ``cache``, after checks.

    Args:
        table: C-contiguous 2-D ``(N, F)`` device array (a device view of
            pinned host memory in the ``zerocopy`` mode).
        cache: C-contiguous 2-D ``(C, F)`` device array of ``table``'s dtype;
            ``cache[slot_of[i]] == table[i]`` for every cached row ``i``.
        slot_of: 1-D int32 ``(N,)``: a row's slot in ``cache``, or ``-1``
            (:func:`build_slot_map`).
        ids, out, stream, tuning: as :func:`pingpong.kernels.cuda.gather_rows_cuda`.
        hits: optional device int64 ``(1,)``; the number of cached rows served
            is added to ``hits[0]``.

    Raises:
        IdShapeError / IdTypeError / IdRangeError: as ``gather_rows_cuda``.
        TableError: shapes, dtypes or layouts do not match, or ``slot_of`` points
            outside ``cache`` (its values are read back: this synchronises).
        ConfigError: a tuning argument is invalid.
        GatherModeUnavailable: no GPU and no simulator.
    """
    _require_cuda()
    ids = _as_ids_array(ids)
    table = _as_gather_array(table, "table")
    cache = _as_gather_array(cache, "cache")
    out = _as_gather_array(out, "out")
    check_id_array(ids)
    check_gather_shapes(table, ids, out)
    if not all(_is_c_contiguous(a) for a in (table, cache, out)):
        raise TableError("table, cache and out must be C-contiguous")
    if len(cache.shape) != 2 or int(cache.shape[1]) != int(table.shape[1]):
        raise TableError(
            f"cache must be 2-D with the table's {int(table.shape[1])} columns, got shape "
            f"{tuple(cache.shape)}"
        )
    if np.dtype(cache.dtype) != np.dtype(table.dtype):
        raise TableError(f"cache dtype {cache.dtype} differs from the table's {table.dtype}")
    if hits is not None and (tuple(hits.shape) != (1,) or np.dtype(hits.dtype) != np.int64):
        raise TableError(f"hits must be int64 of shape (1,), got {hits.dtype} {hits.shape}")
    _check_tuning(threads_per_row, threads_per_block, max_blocks)
    _check_slot_map(slot_of, int(table.shape[0]), int(cache.shape[0]), stream)
    check_ids_in_range(ids, int(table.shape[0]), stream)
    gather_rows_cached_unchecked(
        table,
        cache,
        slot_of,
        ids,
        out,
        stream,
        hits=hits,
        max_blocks=max_blocks,
        threads_per_row=threads_per_row,
        threads_per_block=threads_per_block,
    )
