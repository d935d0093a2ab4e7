"""Numba-CUDA zero-copy gather: ``out[i] = table[ids[i]]`` on the GPU.

``table`` is a Numba device array: either real device memory or -- the point
of the ``zerocopy`` mode -- a device view of pinned, mapped host memory, so
each row travels over PCIe exactly once, straight into ``out``.

Speed recipe (PyTorch-Direct, Min et al., VLDB 2021):

- A group of ``threads_per_row`` threads (one warp by default) copies one row;
  groups walk the rows in a grid-stride loop, so any grid size covers every
  row and the grid can be capped to a small share of the SMs.
- Rows are copied as raw unsigned words, the widest of 8/4/2/1 bytes that
  divides the row size and both base addresses (like
  :func:`pingpong.kernels.cpu.as_words`): dtype-agnostic and bit-exact
  (float16, bfloat16 stored as int16/uint16, NaN payloads...).
- Row ``r`` starts at ``table_address + r * row_bytes``, rarely on a 128-byte
  boundary. Each group's reads are shifted so that every step of
  ``threads_per_row`` words starts on an aligned window: lanes that fall
  before the row's first word (the unaligned head) or after its last word
  (the tail) load a clamped in-row word of the same window and store
  nothing. Every PCIe read is then a whole, aligned window.
- Each thread issues ``UNROLL`` independent loads before storing, so a group
  keeps ``UNROLL`` windows in flight per PCIe round trip.

Contracts:

- :func:`gather_rows_cuda` validates everything on the host *before*
  anything is launched; an invalid id raises :class:`~pingpong.errors.IdRangeError`
  and leaves ``out`` untouched.
- :func:`gather_rows_cuda_unchecked` trusts its caller (the loader validates
  ids once, when it stages them). An invalid id there reads outside the table.
- Both enqueue work on ``stream`` and return without waiting, except where a
  docstring says they synchronise. ``out`` holds the rows once the stream's
  work up to this call has completed.

Compiled kernels are cached on disk (``cache=True``: one entry per compute
capability, next to this file or in Numba's user-wide cache directory;
compiled in each process, with a warning, when neither is writable:
:mod:`._jitcache`), and
:func:`warm_up_cuda` compiles or loads the gather kernel's specialisations for
a loader's tables before the first batch.

Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in Numba's simulator, on
Numba's fake device arrays or plain NumPy arrays, with small default grids.
Without a GPU and without the simulator this module still imports; the gather
functions raise :class:`~pingpong.errors.GatherModeUnavailable`.

Importing this module changes no process-wide state: NumPy's namespace is the
same afterwards (see :mod:`pingpong.kernels._numpy_compat`), and no warning
filter is installed (Numba's low-occupancy warning is switched off only around
pingpong's own launches: :func:`_launch`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from ..errors import ConfigError, GatherModeUnavailable, IdTypeError, TableError
from . import _numpy_compat
from ._checks import (
    check_gather_shapes,
    check_id_array,
    check_id_range,
    raise_out_of_range,
)
from ._jitcache import jit_cached
from .cpu import word_bytes

__all__ = [
    "DEFAULT_THREADS_PER_BLOCK",
    "GatherPlan",
    "check_ids_in_range",
    "default_max_blocks",
    "gather_kernel_signature",
    "gather_rows_cuda",
    "gather_rows_cuda_unchecked",
    "is_simulator",
    "plan_gather",
    "warm_up_cuda",
]

#: A Numba device array (real or simulated), an object exposing
#: ``__cuda_array_interface__``, or (ids; everything under the simulator) a
#: NumPy array.
Array = Any

#: Bytes of one aligned read window (one L2 line / PCIe read request).
SEGMENT_BYTES = 128
#: Independent loads each thread issues before storing them (the kernel body
#: is written out for exactly 4).
UNROLL = 4
#: Threads per block: 8 warps, a common sweet spot for memory-bound kernels.
DEFAULT_THREADS_PER_BLOCK = 256
#: Share of the GPU's SMs the gather may occupy by default. 10% of an H200
#: (13 of 132 SMs, 8 blocks of 256 threads each) keeps ~830 warps with up to
#: ``UNROLL`` 256-byte reads each in flight: by Little's law (~2 us PCIe read
#: latency) several times what PCIe Gen5 needs, while 90% of the SMs stay
#: free for training.
DEFAULT_SM_SHARE = 0.10
#: Floor on the SMs used by default, so small GPUs still saturate PCIe.
MIN_SMS = 4
#: Largest threads_per_row picked automatically: one warp per row.
_WARP = 32

#: Stand-ins for device limits under the simulator, which runs one Python
#: thread per simulated thread (~85 us each): the default grid there is one
#: block of at most 256 threads.
_SIM_MULTIPROCESSORS = 1
_SIM_THREADS_PER_SM = 256

_WORD_DTYPES = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


def is_simulator() -> bool:
    """True when ``numba.cuda`` is Numba's CUDA simulator (read at its import)."""
    try:
        from numba.cuda.core import config as cuda_config
    except ImportError:  # pragma: no cover - older numba-cuda layouts
        return bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
    return bool(cuda_config.ENABLE_CUDASIM)


def _load_cuda_target_registries() -> None:
    """Load the CUDA target's typing and lowering registries now.

    numba-cuda does this at the first kernel compile (``refresh()`` at the
    start of every compilation; the registries are imported once); its NumPy
    registries read the aliases NumPy 2.4 removed, so this must happen while
    :func:`~pingpong.kernels._numpy_compat.missing_names_filled` is active.
    Needs no GPU. A numba-cuda without ``numba.cuda.descriptor`` is left as it
    is (its first compile then fails as it would without pingpong).
    """
    try:
        from numba.cuda.descriptor import cuda_target
    except ImportError:  # pragma: no cover - other numba-cuda layouts
        return
    try:
        from numba.cuda.core.compiler_lock import global_compiler_lock
    except ImportError:  # pragma: no cover - older numba-cuda layouts
        from numba.core.compiler_lock import global_compiler_lock
    with global_compiler_lock:
        cuda_target.typing_context.refresh()
        cuda_target.target_context.refresh()


def _import_numba_cuda() -> Any:
    """``numba.cuda``, imported with NumPy's removed aliases filled in only meanwhile.

    When NumPy lacks any of them (NumPy >= 2.4), the CUDA target's registries
    are loaded inside the same window (see :func:`_load_cuda_target_registries`),
    so that kernels still compile once the placeholders are gone. The simulator
    compiles nothing and needs no registries.
    """
    with _numpy_compat.missing_names_filled() as added:
        cuda_module = importlib.import_module("numba.cuda")
        if added and not is_simulator():
            _load_cuda_target_registries()
    return cuda_module


cuda = _import_numba_cuda()


def _require_cuda() -> None:
    if not is_simulator() and not cuda.is_available():
        raise GatherModeUnavailable(
            "the CUDA gather needs a CUDA GPU and none is available "
            "(set NUMBA_ENABLE_CUDASIM=1 before importing numba to use Numba's simulator)"
        )


@functools.cache
def _limits_of_device(device_id: int) -> tuple[int, int]:
    device = cuda.get_current_device()
    sms = int(device.MULTIPROCESSOR_COUNT)
    threads = int(device.MAX_THREADS_PER_MULTIPROCESSOR)
    return sms, threads


def _device_limits() -> tuple[int, int]:
    """(SM count, max resident threads per SM) of the current device."""
    if is_simulator():
        return _SIM_MULTIPROCESSORS, _SIM_THREADS_PER_SM
    return _limits_of_device(int(cuda.get_current_device().id))


def full_grid_blocks(threads_per_block: int = DEFAULT_THREADS_PER_BLOCK) -> int:
    """Blocks that fill every SM of the current device (for device-resident tables)."""
    sms, threads_per_sm = _device_limits()
    return max(1, sms * max(1, threads_per_sm // threads_per_block))


def default_max_blocks(threads_per_block: int = DEFAULT_THREADS_PER_BLOCK) -> int:
    """Default grid cap: ``DEFAULT_SM_SHARE`` of the SMs (at least ``MIN_SMS``,
    at most all of them), each filled with as many blocks as can be resident.

    Under the simulator this is one block (see ``_SIM_THREADS_PER_SM``).
    """
    sms, threads_per_sm = _device_limits()
    used_sms = min(sms, max(MIN_SMS, round(sms * DEFAULT_SM_SHARE)))
    return max(1, used_sms * max(1, threads_per_sm // threads_per_block))


# --------------------------------------------------------------------------- arrays


def _is_device_array(obj: object) -> bool:
    return bool(getattr(obj, "__cuda_ndarray__", False))


def _plain_device_array(arr: Array) -> Array:
    """A plain ``DeviceNDArray`` for Numba's mapped/managed arrays.

    ``cuda.mapped_array`` returns a NumPy subclass whose ``view(dtype)`` fails
    (it lacks ``is_c_contiguous``); a device array over the same memory does
    not. Other arrays are returned unchanged.
    """
    if isinstance(arr, np.ndarray) and _is_device_array(arr) and not is_simulator():
        return cuda.as_cuda_array(arr)
    return arr


def _as_gather_array(obj: object, name: str) -> Array:
    """Return ``obj`` as an array a kernel may take without an implicit copy."""
    if _is_device_array(obj):
        return _plain_device_array(obj)
    if not is_simulator() and hasattr(obj, "__cuda_array_interface__"):
        return cuda.as_cuda_array(obj)
    if isinstance(obj, np.ndarray):
        if is_simulator():
            return obj
        raise TableError(
            f"{name} must be a CUDA device array, got a NumPy array (Numba would copy it "
            f"to the GPU on every launch); for a zero-copy host table pass a device view "
            f"of pinned mapped memory, e.g. numba.cuda.mapped_array"
        )
    raise TableError(f"{name} must be a CUDA device array, got {type(obj).__name__}")


def _as_ids_array(ids: object) -> Array:
    """Device ids as Numba device arrays, host ids as NumPy arrays."""
    if _is_device_array(ids):
        return ids
    if isinstance(ids, np.ndarray):
        return ids
    if not is_simulator() and hasattr(ids, "__cuda_array_interface__"):
        return cuda.as_cuda_array(ids)
    raise IdTypeError(f"ids must be a NumPy array or a CUDA device array, got {type(ids).__name__}")


def _is_c_contiguous(arr: Array) -> bool:
    if isinstance(arr, np.ndarray):
        return bool(arr.flags.c_contiguous)
    return bool(arr.is_c_contiguous())


def _address(arr: Array) -> int:
    """The address of ``arr``'s first element (device address where it has one)."""
    if not isinstance(arr, np.ndarray) or _is_device_array(arr):
        try:
            return int(arr.__cuda_array_interface__["data"][0])
        except AttributeError:
            pass  # a simulator array: it wraps a NumPy array
    return int(arr.__array_interface__["data"][0])


def _words(arr: Array, word_bytes: int) -> Array:
    """View a C-contiguous 2-D array as rows of unsigned ``word_bytes`` words."""
    return _plain_device_array(arr).view(_WORD_DTYPES[word_bytes])


#: Numba's warning for launches of fewer than 128 blocks (its text starts with
#: a terminal colour code, hence the leading ``.*``: filters match from the start).
#: pingpong's own launches never emit it (:func:`_launch`); the pattern is for
#: callers that want to filter it in their own launches.
LOW_OCCUPANCY_WARNING = r".*Grid size \d+ will likely result in GPU under-utilization"


def _occupancy_config_modules() -> tuple[Any, ...]:
    """The Numba config modules whose ``CUDA_LOW_OCCUPANCY_WARNINGS`` gates the warning.

    numba-cuda 0.30 reads ``numba.cuda.core.config``; older layouts read
    ``numba.core.config``. Both are switched, where present.
    """
    modules: list[Any] = []
    for name in ("numba.cuda.core.config", "numba.core.config"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "CUDA_LOW_OCCUPANCY_WARNINGS") and not any(
            module is seen for seen in modules
        ):
            modules.append(module)
    return tuple(modules)


_OCCUPANCY_CONFIGS = _occupancy_config_modules()
_occupancy_lock = threading.Lock()
#: How many pingpong launches are inside :func:`_low_occupancy_warnings_off`, and
#: the config values the first of them saved.
_occupancy_users = 0
_occupancy_saved: list[tuple[Any, Any]] = []


@contextmanager
def _low_occupancy_warnings_off() -> Iterator[None]:
    """Numba's low-occupancy warning switched off for the duration of the block.

    Small grids are deliberate here (the gather is capped to a share of the
    SMs), so "Grid size N will likely result in GPU under-utilization" is
    noise. Numba checks ``CUDA_LOW_OCCUPANCY_WARNINGS`` when a launch is
    configured (numba-cuda 0.30) or run (other versions), possibly in the
    producer thread; ``warnings.catch_warnings`` is not thread-safe and a
    ``warnings.filterwarnings`` call would change every other launch in the
    process. So the flag is set to 0 while at least one pingpong launch is
    being configured or run, and the value saved by the first is put back
    when the last leaves (reference-counted under a lock; a value someone
    else set meanwhile is kept). Launches made by other code *at the same
    time* on other threads are not warned either; outside pingpong's launches
    nothing changes.
    """
    global _occupancy_users
    with _occupancy_lock:
        if _occupancy_users == 0:
            _occupancy_saved[:] = [
                (module, module.CUDA_LOW_OCCUPANCY_WARNINGS) for module in _OCCUPANCY_CONFIGS
            ]
            for module, _ in _occupancy_saved:
                module.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        _occupancy_users += 1
    try:
        yield
    finally:
        with _occupancy_lock:
            _occupancy_users -= 1
            if _occupancy_users == 0:
                for module, value in _occupancy_saved:
                    if module.CUDA_LOW_OCCUPANCY_WARNINGS == 0:
                        module.CUDA_LOW_OCCUPANCY_WARNINGS = value
                _occupancy_saved.clear()


def _launch(kernel: Any, blocks: int, threads: int, stream: Any, *args: Any) -> None:
    """``kernel[blocks, threads, stream](*args)`` without Numba's low-occupancy warning."""
    with _low_occupancy_warnings_off():
        kernel[blocks, threads, stream](*args)


def _read_only(arr: Array) -> Any:
    """``arr`` as an argument the kernel only reads.

    Under the simulator a bare NumPy argument is treated as ``cuda.InOut``: copied
    in, and after the launch copied back over the caller's array -- a write made
    to it during the launch is lost, a read-only array (``np.load(mmap_mode="r")``)
    fails after the kernel ran, and a strided one is refused.  ``cuda.In`` (of a
    contiguous copy) is copied in only.  Device arrays are returned as they are.
    """
    if is_simulator() and isinstance(arr, np.ndarray) and not _is_device_array(arr):
        return cuda.In(np.ascontiguousarray(arr))
    return arr


def _to_device(host: np.ndarray, stream: Any) -> Array:
    return cuda.to_device(np.ascontiguousarray(host), stream=stream)


def _to_host(dev: Array, stream: Any) -> np.ndarray:
    """Copy a device array to the host and wait for it (synchronises ``stream``)."""
    if isinstance(dev, np.ndarray):
        return dev
    host = dev.copy_to_host(stream=stream)
    if not isinstance(stream, int):
        stream.synchronize()
    return host


# --------------------------------------------------------------------------- plan


def _shift_words(
    table_offset: int, row: int, row_bytes: int, word_bytes: int, align_bytes: int
) -> int:
    """Words between row ``row``'s aligned window start and its first word.

    ``table_offset`` is the table address modulo ``SEGMENT_BYTES``; ``row`` must
    be a 64-bit integer. Always ``< threads_per_row`` (see :class:`GatherPlan`).
    """
    return ((table_offset + row * row_bytes) & (align_bytes - 1)) // word_bytes


_shift_words_device = cuda.jit(device=True)(_shift_words)


@dataclass(frozen=True)
class GatherPlan:
    """How one gather launch copies rows; pure host arithmetic, no device work.

    Invariants: ``word_bytes`` divides ``row_bytes`` and both base addresses;
    ``align_bytes == min(SEGMENT_BYTES, threads_per_row * word_bytes)``, so a
    row's shift is below ``threads_per_row``; ``threads_per_row`` divides
    ``threads_per_block``.
    """

    row_bytes: int
    word_bytes: int
    row_words: int
    table_offset: int
    align_bytes: int
    threads_per_row: int
    threads_per_block: int
    blocks: int

    def shift_words(self, row: int) -> int:
        """The head shift of table row ``row`` (what the kernel computes)."""
        return _shift_words(
            self.table_offset, int(row), self.row_bytes, self.word_bytes, self.align_bytes
        )


def _is_power_of_two(value: object) -> bool:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        return False
    number = int(value)
    return number > 0 and number & (number - 1) == 0


def _check_tuning(
    threads_per_row: int | None, threads_per_block: int, max_blocks: int | None
) -> None:
    if not _is_power_of_two(threads_per_block) or threads_per_block > 1024:
        raise ConfigError(
            f"threads_per_block must be a power of two in [1, 1024], got {threads_per_block!r}"
        )
    if threads_per_row is not None and (
        not _is_power_of_two(threads_per_row) or threads_per_row > threads_per_block
    ):
        raise ConfigError(
            f"threads_per_row must be a power of two <= threads_per_block "
            f"({threads_per_block}), got {threads_per_row!r}"
        )
    if max_blocks is not None and (
        not isinstance(max_blocks, (int, np.integer))
        or isinstance(max_blocks, bool)
        or max_blocks < 1
    ):
        raise ConfigError(f"max_blocks must be a positive int or None, got {max_blocks!r}")


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


def plan_gather(
    table: Array,
    out: Array,
    num_ids: int,
    *,
    threads_per_row: int | None = None,
    threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
    max_blocks: int | None = None,
    other_sources: Iterable[Array] = (),
) -> GatherPlan:
    """Choose word width, alignment window and launch shape for a gather.

    ``threads_per_row=None`` picks one warp per row, or the smallest power of
    two covering the row's words when a row is shorter than a warp.
    ``max_blocks=None`` uses :func:`default_max_blocks`. The block shrinks to
    the threads actually needed (in whole warps) for small batches.
    ``other_sources`` are further arrays the same launch reads rows of (a
    device cache): the word width divides their addresses too.
    """
    _check_tuning(threads_per_row, threads_per_block, max_blocks)
    row_bytes = int(table.shape[1]) * np.dtype(table.dtype).itemsize
    addresses: tuple[int, ...] = (0, 0)
    if num_ids and row_bytes:
        addresses = (_address(table), _address(out), *(_address(a) for a in other_sources))
    word = word_bytes(row_bytes, *addresses)
    row_words = row_bytes // word
    if threads_per_row is None:
        threads_per_row = min(_WARP, threads_per_block, _next_power_of_two(row_words))
    threads_per_row = int(threads_per_row)
    # Whole groups per block: block is a multiple of threads_per_row (powers of two).
    threads_needed = max(1, num_ids) * threads_per_row
    unit = max(_WARP, threads_per_row)
    block = min(int(threads_per_block), unit * math.ceil(threads_needed / unit))
    cap = default_max_blocks(int(threads_per_block)) if max_blocks is None else int(max_blocks)
    blocks = max(1, min(cap, math.ceil(threads_needed / block)))
    return GatherPlan(
        row_bytes=row_bytes,
        word_bytes=word,
        row_words=row_words,
        table_offset=addresses[0] % SEGMENT_BYTES,
        align_bytes=min(SEGMENT_BYTES, threads_per_row * word),
        threads_per_row=threads_per_row,
        threads_per_block=block,
        blocks=blocks,
    )


# --------------------------------------------------------------------------- kernels


@cuda.jit(device=True)
def _row_group(threads_per_row):  # pragma: no cover - compiled
    """``(first row, lane, groups)`` of this thread's group of ``threads_per_row``."""
    tid = cuda.grid(1)
    group = tid // threads_per_row
    return group, tid - group * threads_per_row, cuda.gridsize(1) // threads_per_row


@cuda.jit(device=True)
def _destination(k, dst, use_dst):  # pragma: no cover - compiled
    """The output row of input row ``k``: ``dst[k]`` with ``use_dst``, else ``k``."""
    if use_dst:
        return np.int64(dst[k])
    return np.int64(k)


@cuda.jit(device=True)
def _copy_row(source, src, shift, out, d, lane, step):  # pragma: no cover - compiled
    """One group's share of ``out[d] = source[src]``; ``lane`` in ``[0, step)``.

    ``shift`` is the row's head shift (:func:`_shift_words`), so every pass of
    ``step`` words reads whole aligned windows; ``UNROLL`` windows per pass.
    """
    row_words = source.shape[1]
    last = row_words - 1
    end = shift + row_words
    base = 0
    while base < end:
        p0 = base + lane
        p1 = p0 + step
        p2 = p1 + step
        p3 = p2 + step
        # Loads first (clamped into the row: same aligned windows), then stores.
        v0 = source[src, min(max(p0 - shift, 0), last)]
        v1 = v0
        v2 = v0
        v3 = v0
        if base + step < end:
            v1 = source[src, min(p1 - shift, last)]
        if base + 2 * step < end:
            v2 = source[src, min(p2 - shift, last)]
        if base + 3 * step < end:
            v3 = source[src, min(p3 - shift, last)]
        if p0 >= shift and p0 < end:
            out[d, p0 - shift] = v0
        if p1 < end:
            out[d, p1 - shift] = v1
        if p2 < end:
            out[d, p2 - shift] = v2
        if p3 < end:
            out[d, p3 - shift] = v3
        base += UNROLL * step


@jit_cached(cuda.jit)
def _gather_kernel(  # pragma: no cover - compiled (or simulated thread by thread)
    table,
    out,
    ids,
    dst,
    use_dst,
    table_offset,
    row_bytes,
    word_bytes,
    align_bytes,
    threads_per_row,
):
    """Each group of ``threads_per_row`` threads copies rows ``k, k + groups, ...``:
    ``out[dst[k] if use_dst else k] = table[ids[k]]``.
    """
    k, lane, groups = _row_group(threads_per_row)
    while k < ids.shape[0]:
        src = np.int64(ids[k])
        d = _destination(k, dst, use_dst)
        shift = _shift_words_device(table_offset, src, row_bytes, word_bytes, align_bytes)
        _copy_row(table, src, shift, out, d, lane, threads_per_row)
        k += groups


@jit_cached(cuda.jit)
def _minmax_kernel(ids, result):  # pragma: no cover - compiled
    """``result[0] = min(result[0], ids...)``, ``result[1] = max(...)`` (atomics)."""
    n = ids.shape[0]
    start = cuda.grid(1)
    if start < n:
        lo = np.int64(ids[start])
        hi = lo
        i = start + cuda.gridsize(1)
        while i < n:
            v = np.int64(ids[i])
            lo = min(lo, v)
            hi = max(hi, v)
            i += cuda.gridsize(1)
        cuda.atomic.min(result, 0, lo)
        cuda.atomic.max(result, 1, hi)


# --------------------------------------------------------------------------- entry points


def check_ids_in_range(ids: Array, num_rows: int, stream: Any = None) -> None:
    """Raise :class:`~pingpong.errors.IdRangeError` unless all ids lie in ``[0, num_rows)``.

    Host ids are checked with NumPy. Device ids are reduced to (min, max) by
    a small kernel on ``stream`` and the two numbers are read back: this
    *synchronises* ``stream``. Only on failure are the ids copied to the host
    to name the first bad value. ``ids`` must already be 1-D int32/int64.
    """
    ids = _as_ids_array(ids)
    if not _is_device_array(ids):
        check_id_range(ids, num_rows)
        return
    n = int(ids.shape[0])
    if n == 0:
        return
    launch_stream = 0 if stream is None else stream
    limits = np.iinfo(np.int64)
    result = _to_device(np.array([limits.max, limits.min], dtype=np.int64), launch_stream)
    threads = min(DEFAULT_THREADS_PER_BLOCK, _WARP * math.ceil(n / _WARP))
    blocks = max(1, min(math.ceil(n / threads), default_max_blocks(threads)))
    _launch(_minmax_kernel, blocks, threads, launch_stream, ids, result)
    lo, hi = (int(v) for v in _to_host(result, launch_stream))
    if lo < 0 or hi >= num_rows:
        raise_out_of_range(_to_host(ids, launch_stream), num_rows)


def gather_rows_cuda_unchecked(
    table: Array,
    ids: Array,
    out: Array,
    stream: Any = None,
    *,
    sort_ids: bool = False,
    max_blocks: int | None = None,
    threads_per_row: int | None = None,
    threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
    positions: Array | None = None,
) -> None:
    """Enqueue ``out[:] = table[ids]`` on ``stream`` without validating ids or shapes.

    With ``positions`` (a device int64 array of ``len(ids)``), the caller has
    already sorted the ids: ``out[positions[i]] = table[ids[i]]``. This is
    how the loader gathers in ascending id order without a host round trip.

    The caller guarantees what :func:`gather_rows_cuda` checks: 1-D int32/int64
    ids, every id in ``[0, N)``, C-contiguous 2-D ``table`` and ``out`` of one
    dtype with ``out.shape == (len(ids), table.shape[1])``. Tuning arguments
    are still checked (:class:`~pingpong.errors.ConfigError`).

    Host (NumPy) ids are copied to the device first (from pageable memory:
    the copy is synchronous). ``sort_ids=True`` argsorts the ids on the host
    (device ids are copied back first, synchronising ``stream``) and gathers
    rows in ascending id order for host-memory locality; ``out``'s row order
    is unchanged. The ``ids`` array must stay alive and unmodified until the
    stream has run the gather.
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
    )
    launch_stream = 0 if stream is None else stream
    on_device = _is_device_array(ids)
    if positions is not None:
        src, dst, permuted = ids, positions, True
    elif sort_ids:
        host_ids = _to_host(ids, launch_stream)
        order = np.argsort(host_ids, kind="stable")
        src = _to_device(host_ids[order], launch_stream)
        dst = _to_device(order.astype(np.int64, copy=False), launch_stream)
        permuted = True
    else:
        src = ids if on_device or is_simulator() else _to_device(ids, launch_stream)
        dst = src
        permuted = False
    # Read-only: under the simulator a bare NumPy argument is written back (_read_only).
    table_words = _read_only(_words(table, plan.word_bytes))
    src, dst = _read_only(src), _read_only(dst)
    _launch(
        _gather_kernel,
        plan.blocks,
        plan.threads_per_block,
        launch_stream,
        table_words,
        _words(out, plan.word_bytes),
        src,
        dst,
        permuted,
        plan.table_offset,
        plan.row_bytes,
        plan.word_bytes,
        plan.align_bytes,
        plan.threads_per_row,
    )


def gather_rows_cuda(
    table: Array,
    ids: Array,
    out: Array,
    stream: Any = None,
    *,
    sort_ids: bool = False,
    max_blocks: int | None = None,
    threads_per_row: int | None = None,
    threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
) -> None:
    """Enqueue ``out[:] = table[ids]`` on ``stream`` after validating everything.

    Args:
        table: C-contiguous 2-D ``(N, F)`` device array of any dtype -- device
            memory or a device view of pinned mapped host memory (zero-copy).
        ids: 1-D int32/int64 ids, each in ``[0, N)``; a device array or a
            NumPy array (copied to the device).
        out: C-contiguous device array ``(len(ids), F)`` of ``table``'s dtype.
        stream: a Numba stream; ``None`` is the default stream.
        sort_ids: gather in ascending id order (output order unchanged);
            costs a host argsort. Default off: DGL's input nodes are
            usually already clustered.
        max_blocks: grid cap; ``None`` uses :func:`default_max_blocks`
            (about 10% of the SMs). Any cap covers all rows (grid-stride).
        threads_per_row: threads copying one row (power of two); ``None``
            means one warp, or fewer for rows shorter than a warp.
        threads_per_block: power of two in ``[1, 1024]``, default 256.

    Under the simulator, ``table``, ``ids`` and ``out`` may also be NumPy arrays
    (``table`` and ``ids`` read-only or strided ids too): only ``out`` is written.

    Raises:
        IdShapeError / IdTypeError: ids are not 1-D int32/int64.
        IdRangeError: an id is outside ``[0, N)``; raised before any launch
            that reads ``table``, so ``out`` is untouched. Device ids are
            range-checked by a reduction whose result is read back
            (synchronises ``stream``).
        TableError: shapes, dtypes, layout or array kinds do not match.
        ConfigError: a tuning argument is invalid.
        GatherModeUnavailable: no GPU and no simulator.
    """
    _require_cuda()
    ids = _as_ids_array(ids)
    table = _as_gather_array(table, "table")
    out = _as_gather_array(out, "out")
    check_id_array(ids)
    check_gather_shapes(table, ids, out)
    if not _is_c_contiguous(table) or not _is_c_contiguous(out):
        raise TableError("table and out must be C-contiguous")
    _check_tuning(threads_per_row, threads_per_block, max_blocks)
    check_ids_in_range(ids, int(table.shape[0]), stream)
    gather_rows_cuda_unchecked(
        table,
        ids,
        out,
        stream,
        sort_ids=sort_ids,
        max_blocks=max_blocks,
        threads_per_row=threads_per_row,
        threads_per_block=threads_per_block,
    )


# --------------------------------------------------------------------------- warm-up


def gather_kernel_signature(word_bytes: int, ids: object = np.int64) -> tuple[Any, ...]:
    """Argument types of the gather kernel for ``word_bytes``-byte words and ``ids``' dtype.

    What :func:`gather_rows_cuda_unchecked` launches: table and out as 2-D
    C-contiguous unsigned words, ids and the destination rows as 1-D arrays
    (the destination is the ids themselves, or int64 ``positions`` -- the same
    type for int64 ids, which is what the loader stages), a bool, five int64
    scalars.
    """
    from numba.core import types

    if word_bytes not in _WORD_DTYPES:
        raise ConfigError(f"word_bytes must be 1, 2, 4 or 8, got {word_bytes!r}")
    id_type = np.dtype(ids)  # type: ignore[call-overload]
    if id_type not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise IdTypeError(f"ids must have dtype int32 or int64, got {id_type}")
    words = types.Array(numba.from_dtype(np.dtype(_WORD_DTYPES[word_bytes])), 2, "C")
    id_array = types.Array(numba.from_dtype(id_type), 1, "C")
    return (words, words, id_array, id_array, types.boolean, *([types.int64] * 5))


def _table_word_bytes(table: int | Array) -> int:
    """The word a gather from ``table`` (a row size, or the array the kernel reads) uses.

    Slots and device tables start on 256-byte boundaries, so only the host
    table's own address can narrow the word (see :func:`plan_gather`).
    """
    if isinstance(table, int | np.integer) and not isinstance(table, bool):
        row_bytes, address = int(table), 0
        if row_bytes < 1:
            raise TableError(f"a row size must be a positive int, got {table!r}")
    else:
        if len(table.shape) != 2:
            raise TableError(f"warm-up tables must be 2-D, got shape {tuple(table.shape)}")
        row_bytes = int(table.shape[1]) * np.dtype(table.dtype).itemsize
        address = _address(table)
    return word_bytes(row_bytes, address)


def warm_up_cuda(
    tables: Iterable[int | Array],
    id_dtypes: Iterable[object] = (np.int64,),
    *,
    device_index: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[tuple[Any, ...]]:
    """Compile, or load from the disk cache, the gather kernels for ``tables`` on one GPU.

    Args:
        tables: per table, its row size in bytes (table assumed 8-byte
            aligned) or the array the kernel will read (a NumPy array of
            the host rows, or a Numba device array: its address counts).
        id_dtypes: dtypes of the device ids; the loader stages int64.
        device_index: the GPU to compile for (its compute capability);
            ``None``: the calling thread's current device. From a
            background thread, pass the loader's device index.
        should_stop: checked between kernels; True ends the warm-up.

    Nothing is launched and no memory is allocated: each kernel is compiled
    for its exact argument types (``dispatcher.compile``), so the first
    launch finds it. Under the simulator there is nothing to compile and
    ``[]`` is returned.

    Returns:
        The signatures made ready.

    Raises:
        GatherModeUnavailable: no GPU (and not the simulator).
    """
    if is_simulator():
        return []
    _require_cuda()
    stop = should_stop or (lambda: False)
    dtypes = list(dict.fromkeys(np.dtype(d) for d in id_dtypes))  # type: ignore[call-overload]
    sizes = sorted({_table_word_bytes(table) for table in tables}, reverse=True)
    signatures = [gather_kernel_signature(size, dtype) for size in sizes for dtype in dtypes]
    context = cuda.gpus[device_index] if device_index is not None else contextlib.nullcontext()
    ready = []
    with context:
        for signature in signatures:
            if stop():
                break
            _gather_kernel.compile(signature)
            ready.append(signature)
    return ready
