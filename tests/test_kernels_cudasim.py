"""Numba-CUDA gather kernels, under Numba's CUDA simulator or on a real GPU.

Run under the simulator with ``NUMBA_ENABLE_CUDASIM=1`` in the environment
(Numba reads it when ``numba.cuda`` is first imported, so test code cannot set
it). Without the simulator and without a GPU the module is skipped. Every
gathered row is compared bit-for-bit with NumPy's ``table[ids]``.

Simulated threads are slow (one Python thread each), so tables are small and
grids are capped: a launch here runs at most a few hundred threads. Each test
item also pays for the suite's per-test ``gc.collect()``, so cheap variations
(widths, offsets, id dtypes) loop inside one test and name themselves in the
assertion message.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numba.core.errors import NumbaPerformanceWarning

from pingpong.errors import (
    ConfigError,
    GatherModeUnavailable,
    IdRangeError,
    IdShapeError,
    IdTypeError,
    TableError,
)

cuda = pytest.importorskip("numba.cuda")
kc = importlib.import_module("pingpong.kernels.cuda")

SIM = kc.is_simulator()
if not SIM and not cuda.is_available():
    pytest.skip(
        "needs NUMBA_ENABLE_CUDASIM=1 (Numba's CUDA simulator) or a CUDA GPU",
        allow_module_level=True,
    )

sim_only = pytest.mark.skipif(
    not SIM, reason="NumPy arrays are kernel arguments only in the simulator"
)
gpu_only = pytest.mark.skipif(SIM, reason="needs a real CUDA GPU")

REPO = Path(__file__).resolve().parents[1]
SENTINEL = 0xAB
#: Small launches for the simulator: 2 blocks of 32 threads at most.
SMALL = {"threads_per_block": 32, "max_blocks": 2}

#: (label, dtype). bfloat16 has no NumPy dtype: its bit patterns travel as
#: int16/uint16, which the kernel copies like any other 2-byte word.
DTYPES = [
    ("float32", np.float32),
    ("float16", np.float16),
    ("int8", np.int8),
    ("int16", np.int16),
    ("int32", np.int32),
    ("int64", np.int64),
    ("uint8", np.uint8),
    ("bf16-as-uint16", np.uint16),
    ("bf16-as-int16", np.int16),
]


# --------------------------------------------------------------------------- helpers


def random_rows(rng: np.random.Generator, rows: int, width: int, dtype: type) -> np.ndarray:
    """Random bit patterns (NaN payloads, -0.0, subnormals...) as ``(rows, width)``."""
    nbytes = rows * width * np.dtype(dtype).itemsize
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8).view(dtype).reshape(rows, width)


def bfloat16_bits(values: np.ndarray, dtype: type = np.uint16) -> np.ndarray:
    """bfloat16 bit patterns of float32 ``values`` (truncated), as ``dtype``."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(dtype)


def device_at(host: np.ndarray, offset: int) -> Any:
    """A device copy of C-contiguous ``host`` whose address is ``offset`` mod 128."""
    nbytes = host.nbytes
    buf = cuda.device_array(nbytes + 256, dtype=np.uint8)
    start = (offset - kc._address(buf)) % kc.SEGMENT_BYTES
    view = buf[start : start + nbytes]
    view.copy_to_device(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    placed = view.view(host.dtype).reshape(host.shape)
    assert kc._address(placed) % kc.SEGMENT_BYTES == offset
    return placed


def host_at(host: np.ndarray, offset: int) -> np.ndarray:
    """A host copy of ``host`` whose address is ``offset`` mod 128 (maybe unaligned)."""
    buf = np.zeros(host.nbytes + 256, dtype=np.uint8)
    start = (offset - buf.ctypes.data) % kc.SEGMENT_BYTES
    placed = buf[start : start + host.nbytes].view(host.dtype).reshape(host.shape)
    placed[...] = host
    assert placed.ctypes.data % kc.SEGMENT_BYTES == offset
    return placed


def sentinel_out(rows: int, width: int, dtype: type) -> Any:
    """A device ``out`` filled with SENTINEL bytes."""
    host = np.full(rows * width * np.dtype(dtype).itemsize, SENTINEL, dtype=np.uint8)
    return cuda.to_device(host.view(dtype).reshape(rows, width))


def to_host(arr: Any) -> np.ndarray:
    return arr if isinstance(arr, np.ndarray) else arr.copy_to_host()


def assert_same_bytes(actual: object, expected: np.ndarray, case: str = "") -> None:
    actual = to_host(actual)
    assert actual.dtype == expected.dtype, case
    assert actual.shape == expected.shape, case
    a = np.ascontiguousarray(actual).reshape(-1).view(np.uint8)
    e = np.ascontiguousarray(expected).reshape(-1).view(np.uint8)
    assert np.array_equal(a, e), f"bytes differ: {case}"


def assert_all_sentinel(out: object) -> None:
    assert np.all(np.ascontiguousarray(to_host(out)).reshape(-1).view(np.uint8) == SENTINEL)


class _NoLaunch:
    """Stands in for a kernel: configuring a launch fails the test."""

    def __getitem__(self, config: object) -> object:
        raise AssertionError(f"kernel launched with {config} despite invalid input")


@pytest.fixture
def no_gather_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any launch of the gather kernel fails the test (validation comes first)."""
    monkeypatch.setattr(kc, "_gather_kernel", _NoLaunch())


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("sort_ids", [False, True], ids=["id-order", "sorted"])
@pytest.mark.parametrize("dtype", [d for _, d in DTYPES], ids=[name for name, _ in DTYPES])
def test_gather_matches_numpy(dtype: type, sort_ids: bool) -> None:
    """dtype x sort_ids here; width x id dtype in the loop."""
    rng = np.random.default_rng([np.dtype(dtype).num, sort_ids])
    for width in (1, 3, 7, 33):
        for id_dtype in (np.int32, np.int64):
            table = random_rows(rng, 24, width, dtype)
            ids = rng.integers(0, 24, size=17).astype(id_dtype)  # duplicates: 17 of 24
            out = sentinel_out(len(ids), width, dtype)
            kc.gather_rows_cuda(cuda.to_device(table), ids, out, sort_ids=sort_ids, **SMALL)
            assert_same_bytes(out, table[ids], f"width={width} ids={np.dtype(id_dtype)}")


@pytest.mark.parametrize("as_dtype", [np.uint16, np.int16], ids=["uint16", "int16"])
def test_bfloat16_bit_patterns(as_dtype: type) -> None:
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3.5, 65504.0], np.float32)
    table = bfloat16_bits(np.concatenate([special, np.linspace(-9, 9, 32)]), as_dtype)
    table = table.reshape(8, 5)
    ids = np.array([7, 0, 3, 3, 1, 6], dtype=np.int64)
    out = sentinel_out(len(ids), 5, as_dtype)
    kc.gather_rows_cuda(cuda.to_device(table), ids, out, **SMALL)
    assert_same_bytes(out, table[ids])


@pytest.mark.parametrize(
    ("dtype", "width"),
    [
        (np.uint8, 3),
        (np.float16, 3),
        (np.float16, 7),
        (np.float32, 10),
        (np.float32, 50),
        (np.int8, 97),
    ],
    ids=["3B", "6B", "14B", "40B", "200B", "97B"],
)
def test_unaligned_rows_and_bases(dtype: type, width: int) -> None:
    """Row starts land at many offsets inside a 128-byte window; all copy exactly."""
    rng = np.random.default_rng(width)
    row_bytes = width * np.dtype(dtype).itemsize
    for table_offset in (0, 1, 2, 4, 8, 40, 127):
        case = f"row_bytes={row_bytes} table_offset={table_offset}"
        host = random_rows(rng, 40, width, dtype)
        table = device_at(host, table_offset)
        ids = rng.permutation(40)[:24].astype(np.int64)
        out = sentinel_out(len(ids), width, dtype)

        plan = kc.plan_gather(table, out, len(ids), **SMALL)
        expected_word = max(w for w in (8, 4, 2, 1) if row_bytes % w == 0 and table_offset % w == 0)
        assert plan.word_bytes == expected_word, case
        assert plan.table_offset == table_offset, case
        shifts = {plan.shift_words(r) for r in ids}
        assert all(0 <= s < plan.threads_per_row for s in shifts), case
        if row_bytes % plan.align_bytes or table_offset % plan.align_bytes:
            assert shifts != {0}, f"the head shift was never exercised: {case}"

        kc.gather_rows_cuda(table, ids, out, **SMALL)
        assert_same_bytes(out, host[ids], case)


@pytest.mark.parametrize("out_offset", [0, 2, 3])
def test_unaligned_out_narrows_words(out_offset: int) -> None:
    host = random_rows(np.random.default_rng(out_offset), 12, 10, np.float32)  # 40-byte rows
    ids = np.array([11, 0, 5, 5, 9], dtype=np.int32)
    out = device_at(np.full((5, 10), np.nan, np.float32), out_offset)
    table = cuda.to_device(host)
    plan = kc.plan_gather(table, out, len(ids))
    assert plan.word_bytes == {0: 8, 2: 2, 3: 1}[out_offset]
    kc.gather_rows_cuda(table, ids, out, **SMALL)
    assert_same_bytes(out, host[ids])


@pytest.mark.parametrize("threads_per_row", [1, 2, 8, 32, 64])
def test_grid_stride_and_group_sizes(threads_per_row: int) -> None:
    """More rows than groups (grid-stride loop) and rows wider than one pass."""
    rng = np.random.default_rng(threads_per_row)
    for dtype, width in ((np.uint8, 301), (np.float32, 6)):
        for max_blocks in (1, 3):
            case = f"dtype={np.dtype(dtype)} width={width} max_blocks={max_blocks}"
            host = random_rows(rng, 50, width, dtype)
            table = device_at(host, 5)  # row starts shift in every window
            ids = rng.integers(0, 50, size=40).astype(np.int64)
            out = sentinel_out(len(ids), width, dtype)
            tuning = {
                "threads_per_row": threads_per_row,
                "threads_per_block": 4 * threads_per_row,
                "max_blocks": max_blocks,
            }
            plan = kc.plan_gather(table, out, len(ids), **tuning)
            groups = plan.blocks * plan.threads_per_block // plan.threads_per_row
            assert plan.blocks <= max_blocks, case
            assert groups < len(ids), case
            assert plan.threads_per_block % plan.threads_per_row == 0, case
            kc.gather_rows_cuda(table, ids, out, **tuning)
            assert_same_bytes(out, host[ids], case)


@pytest.mark.parametrize("ids_on", ["host", "device"])
@pytest.mark.parametrize("sort_ids", [False, True], ids=["id-order", "sorted"])
def test_device_ids(ids_on: str, sort_ids: bool) -> None:
    rng = np.random.default_rng(7)
    host = random_rows(rng, 30, 6, np.float16)
    ids = rng.integers(0, 30, size=45).astype(np.int32)
    out = sentinel_out(len(ids), 6, np.float16)
    kc.gather_rows_cuda(
        cuda.to_device(host),
        ids if ids_on == "host" else cuda.to_device(ids),
        out,
        sort_ids=sort_ids,
        **SMALL,
    )
    assert_same_bytes(out, host[ids])


class _CountingKernel:
    """Stands in for a kernel: counts launches, runs none."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, config: object) -> object:
        self.launches += 1
        return lambda *args: None


@pytest.mark.parametrize("ids_on", ["host", "device"])
def test_empty_ids(ids_on: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to copy: nothing is launched, and ``out`` is NumPy's ``table[ids]``."""
    host = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.zeros(0, dtype=np.int64)
    out = cuda.device_array((0, 3), dtype=np.float32)
    gather, minmax = _CountingKernel(), _CountingKernel()
    monkeypatch.setattr(kc, "_gather_kernel", gather)
    monkeypatch.setattr(kc, "_minmax_kernel", minmax)
    kc.gather_rows_cuda(cuda.to_device(host), ids if ids_on == "host" else cuda.to_device(ids),
                        out)
    assert (gather.launches, minmax.launches) == (0, 0)
    assert_same_bytes(out, host[ids])


def test_empty_table_with_empty_ids() -> None:
    """No ids from no rows give NumPy's ``table[ids]``; any id is out of range."""
    table = cuda.device_array((0, 4), dtype=np.int16)
    ids = np.zeros(0, np.int32)
    out = cuda.device_array((0, 4), np.int16)
    kc.gather_rows_cuda(table, ids, out)
    assert_same_bytes(out, np.zeros((0, 4), np.int16)[ids])
    out = sentinel_out(1, 4, np.int16)
    with pytest.raises(IdRangeError):
        kc.gather_rows_cuda(table, np.zeros(1, np.int32), out)
    assert_all_sentinel(out)


def test_zero_width_rows() -> None:
    """Rows of zero bytes: ids are still checked; ``out`` is ``table[ids]``, shape (3, 0)."""
    table = cuda.device_array((5, 0), dtype=np.float32)
    ids = np.array([4, 0, 4], np.int64)
    out = cuda.device_array((3, 0), dtype=np.float32)
    kc.gather_rows_cuda(table, ids, out)
    assert_same_bytes(out, np.zeros((5, 0), np.float32)[ids])
    with pytest.raises(IdRangeError):
        kc.gather_rows_cuda(table, np.array([0, 5], np.int64),
                            cuda.device_array((2, 0), dtype=np.float32))


def test_single_row_table_duplicate_ids() -> None:
    host = np.array([[1.5, -0.0, np.nan]], dtype=np.float32)
    ids = np.zeros(5, dtype=np.int32)
    out = sentinel_out(5, 3, np.float32)
    kc.gather_rows_cuda(cuda.to_device(host), ids, out)
    assert_same_bytes(out, host[ids])


def test_stream_argument() -> None:
    host = random_rows(np.random.default_rng(3), 16, 8, np.int32)
    ids = np.array([15, 2, 2, 9], dtype=np.int64)
    stream = cuda.stream()
    out = sentinel_out(len(ids), 8, np.int32)
    kc.gather_rows_cuda(cuda.to_device(host, stream=stream), ids, out, stream, sort_ids=True)
    stream.synchronize()
    assert_same_bytes(out, host[ids])


def test_default_tuning_emits_no_warning() -> None:
    """No warning at all, Numba's low-occupancy one included (real GPU: the default
    grid is far below Numba's 128 blocks), and no warning filter installed."""
    host = random_rows(np.random.default_rng(4), 8, 4, np.float32)
    ids = np.arange(8, dtype=np.int64)[::-1].copy()
    out = sentinel_out(8, 4, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        filters = list(warnings.filters)
        kc.gather_rows_cuda(cuda.to_device(host), cuda.to_device(ids), out)
        assert warnings.filters == filters
    assert_same_bytes(out, host[ids])


def _occupancy_flags() -> list[object]:
    """Numba's low-occupancy switch in each config module it may be read from."""
    return [module.CUDA_LOW_OCCUPANCY_WARNINGS for module in kc._OCCUPANCY_CONFIGS]


class _WarnsLikeNumba:
    """Wraps a kernel and warns as Numba does for a grid of under 128 blocks while
    ``CUDA_LOW_OCCUPANCY_WARNINGS`` is set -- both when the launch is configured
    (numba-cuda 0.30) and when it runs (other versions) -- recording the switch's
    values at each stage. The simulator's own launches never warn."""

    def __init__(self, kernel: Any, seen: list[tuple[str, list[object]]]) -> None:
        self.kernel = kernel
        self.seen = seen

    def check(self, stage: str, blocks: int) -> None:
        flags = _occupancy_flags()
        self.seen.append((stage, flags))
        if any(flags) and blocks < 128:
            warnings.warn(NumbaPerformanceWarning(
                f"\x1b[1mGrid size {blocks} will likely result in GPU under-utilization "
                "due to low occupancy.\x1b[0m"), stacklevel=2)

    def __getitem__(self, config: tuple) -> object:
        blocks = int(np.prod(config[0]))
        self.check("configure", blocks)
        launch = self.kernel[config]

        def run(*args: object) -> None:
            self.check("launch", blocks)
            launch(*args)

        return run


def test_low_occupancy_warning_is_off_only_inside_pingpongs_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both kernels' configure and launch run with Numba's warning switched off; no
    filter is installed, and the switch is back on for the caller's own launches."""
    flags = _occupancy_flags()
    if not any(flags):
        pytest.skip("Numba's low-occupancy warning is off in this environment")
    seen: list[tuple[str, list[object]]] = []
    gather = _WarnsLikeNumba(kc._gather_kernel, seen)
    monkeypatch.setattr(kc, "_gather_kernel", gather)
    monkeypatch.setattr(kc, "_minmax_kernel", _WarnsLikeNumba(kc._minmax_kernel, seen))
    host = random_rows(np.random.default_rng(8), 20, 6, np.float32)
    ids = np.array([19, 0, 7, 7, 3], dtype=np.int64)
    out = sentinel_out(len(ids), 6, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        filters = list(warnings.filters)
        kc.gather_rows_cuda(cuda.to_device(host), cuda.to_device(ids), out, **SMALL)
        assert warnings.filters == filters
    assert_same_bytes(out, host[ids])
    assert [stage for stage, _ in seen] == ["configure", "launch"] * 2  # min/max, gather
    assert all(not any(stage_flags) for _, stage_flags in seen), seen
    assert _occupancy_flags() == flags
    with pytest.warns(NumbaPerformanceWarning, match="under-utilization"):
        gather.check("the caller's own launch", 1)


def test_low_occupancy_switch_is_reference_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapping launches (two threads) restore the switch once the last one
    leaves; an exception restores it; a value set meanwhile by others is kept."""
    for module in kc._OCCUPANCY_CONFIGS:  # put back whatever this test leaves
        monkeypatch.setattr(module, "CUDA_LOW_OCCUPANCY_WARNINGS",
                            module.CUDA_LOW_OCCUPANCY_WARNINGS)
        module.CUDA_LOW_OCCUPANCY_WARNINGS = 1
    first_inside, second_inside, first_left = (threading.Event() for _ in range(3))

    def first_launch() -> None:
        with kc._low_occupancy_warnings_off():
            first_inside.set()
            assert second_inside.wait(10)
        first_left.set()

    thread = threading.Thread(target=first_launch)
    thread.start()
    try:
        assert first_inside.wait(10)
        with kc._low_occupancy_warnings_off():
            second_inside.set()
            assert first_left.wait(10)
            assert _occupancy_flags() == [0] * len(kc._OCCUPANCY_CONFIGS)  # still inside
    finally:
        second_inside.set()
        thread.join(10)
    assert _occupancy_flags() == [1] * len(kc._OCCUPANCY_CONFIGS)

    with pytest.raises(RuntimeError, match="launch failed"):
        with kc._low_occupancy_warnings_off():
            raise RuntimeError("launch failed")
    assert _occupancy_flags() == [1] * len(kc._OCCUPANCY_CONFIGS)

    with kc._low_occupancy_warnings_off():
        for module in kc._OCCUPANCY_CONFIGS:
            module.CUDA_LOW_OCCUPANCY_WARNINGS = 2  # someone else's choice, meanwhile
    assert _occupancy_flags() == [2] * len(kc._OCCUPANCY_CONFIGS)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_presorted_ids_with_positions(id_dtype) -> None:
    rng = np.random.default_rng(7)
    host = random_rows(rng, 40, 7, np.float16)
    ids = rng.integers(0, 40, 50).astype(id_dtype)
    order = np.argsort(ids, kind="stable")
    out = sentinel_out(50, 7, np.float16)
    kc.gather_rows_cuda_unchecked(
        cuda.to_device(host),
        cuda.to_device(ids[order]),
        out,
        positions=cuda.to_device(order.astype(np.int64)),
    )
    assert_same_bytes(out, host[ids])


def test_public_entry_point_is_lazy_export() -> None:
    from pingpong.kernels import gather_rows_cuda

    assert gather_rows_cuda is kc.gather_rows_cuda


@sim_only
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64], ids=["ids32", "ids64"])
def test_numpy_arrays_in_simulator(id_dtype: type) -> None:
    """Under the simulator plain NumPy arrays work, with the default tuning."""
    rng = np.random.default_rng(np.dtype(id_dtype).num)
    for dtype, width in (
        (np.float32, 5),
        (np.float16, 7),
        (np.uint8, 3),
        (np.int64, 2),
        (np.int8, 13),
        (np.uint16, 4),
    ):
        table = host_at(random_rows(rng, 20, width, dtype), 3)  # unaligned host table
        ids: np.ndarray = rng.integers(0, 20, size=12).astype(id_dtype)
        out = np.full((12, width), 7, dtype=dtype)
        kc.gather_rows_cuda(table, ids, out)
        assert_same_bytes(out, table[ids], f"dtype={np.dtype(dtype)} width={width}")


def read_only(array: np.ndarray) -> np.ndarray:
    """``array`` as ``np.load(..., mmap_mode="r")`` gives it: not writeable."""
    array.flags.writeable = False
    return array


@sim_only
@pytest.mark.parametrize("how", ["id-order", "sorted", "positions"])
def test_numpy_arguments_in_simulator_are_only_read(how: str) -> None:
    """A NumPy table and ids are read, never written: the simulator copies a bare
    NumPy argument back over the caller's array after the launch (a write made to
    it meanwhile would be lost), which a read-only table or ids make fail.  Strided
    host ids are as good as contiguous ones."""
    rng = np.random.default_rng(11)
    table = read_only(random_rows(rng, 30, 5, np.float32))
    ids = rng.integers(0, 30, 40)
    cases = {"read-only ids": read_only(ids.copy()), "strided ids": ids[::2]}
    for case, case_ids in cases.items():
        out = np.full((len(case_ids), 5), 7, dtype=np.float32)
        if how == "positions":
            order = np.argsort(case_ids, kind="stable")
            kc.gather_rows_cuda_unchecked(table, read_only(case_ids[order]), out,
                                          positions=read_only(order.astype(np.int64)))
        else:
            kc.gather_rows_cuda(table, case_ids, out, sort_ids=how == "sorted")
        assert_same_bytes(out, table[case_ids], case)


# --------------------------------------------------------------------------- unchecked path


def test_unchecked_skips_range_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the unchecked gather must not range-check ids")

    monkeypatch.setattr(kc, "check_ids_in_range", fail)
    monkeypatch.setattr(kc, "check_id_range", fail)
    host = random_rows(np.random.default_rng(5), 10, 3, np.uint8)
    ids = cuda.to_device(np.array([9, 1, 1, 0], dtype=np.int64))
    out = sentinel_out(4, 3, np.uint8)
    kc.gather_rows_cuda_unchecked(cuda.to_device(host), ids, out, sort_ids=True, **SMALL)
    assert_same_bytes(out, host[to_host(ids)])


def test_unchecked_still_checks_tuning(no_gather_launch: None) -> None:
    table = cuda.to_device(np.zeros((4, 2), np.float32))
    with pytest.raises(ConfigError):
        kc.gather_rows_cuda_unchecked(
            table,
            np.array([0], np.int64),
            cuda.device_array((1, 2), np.float32),
            threads_per_row=3,
        )


@pytest.mark.parametrize("ids_on", ["host", "device"])
def test_check_ids_in_range(ids_on: str) -> None:
    def put(ids: np.ndarray) -> object:
        return ids if ids_on == "host" else cuda.to_device(ids)

    kc.check_ids_in_range(put(np.array([0, 9, 4], np.int32)), 10)
    kc.check_ids_in_range(put(np.zeros(0, np.int64)), 0)
    with pytest.raises(IdRangeError, match=r"ids\[2\] = 10 .*N = 10"):
        kc.check_ids_in_range(put(np.array([0, 9, 10], np.int64)), 10)


# --------------------------------------------------------------------------- validation

N = 10
BAD_VALUES = [
    (np.int64, -1),
    (np.int64, N),
    (np.int64, 2**31),
    (np.int64, np.iinfo(np.int64).min),
    (np.int64, np.iinfo(np.int64).max),
    (np.int32, -1),
    (np.int32, N),
    (np.int32, np.iinfo(np.int32).min),
    (np.int32, np.iinfo(np.int32).max),
]


@pytest.mark.parametrize("ids_on", ["host", "device"])
def test_out_of_range_ids_raise_before_launch(ids_on: str, no_gather_launch: None) -> None:
    table = cuda.to_device(np.ones((N, 4), np.float32))
    for id_dtype, bad in BAD_VALUES:
        ids = np.array([0, 3, N - 1, bad, 1], dtype=id_dtype)
        out = sentinel_out(len(ids), 4, np.float32)
        with pytest.raises(IdRangeError) as info:
            kc.gather_rows_cuda(table, ids if ids_on == "host" else cuda.to_device(ids), out)
        message = str(info.value)
        assert f"ids[3] = {bad}" in message, message
        assert f"N = {N}" in message, message
        assert isinstance(info.value, IndexError)
        assert_all_sentinel(out)


def test_device_id_check_sees_a_bad_id_anywhere_in_a_batch_longer_than_its_grid(
    no_gather_launch: None,
) -> None:
    """The min/max reduction's grid-stride loop: a batch over twice the grid, one bad id
    at each boundary (first, a thread's first and second stride, last). A reduction that
    skipped a thread's first id, a stride, or the last id passed the shorter batches."""
    grid = kc.DEFAULT_THREADS_PER_BLOCK * kc.default_max_blocks(kc.DEFAULT_THREADS_PER_BLOCK)
    n = 2 * grid + 3
    valid = (np.arange(n) % N).astype(np.int64)
    kc.check_ids_in_range(cuda.to_device(valid), N)
    table = cuda.to_device(np.ones((N, 2), np.float32))
    for pos in (0, 1, grid - 1, grid, grid + 1, 2 * grid - 1, 2 * grid, n - 1):
        for bad in (-1, N):
            ids = valid.copy()
            ids[pos] = bad
            out = sentinel_out(n, 2, np.float32)
            with pytest.raises(IdRangeError, match=rf"ids\[{pos}\] = {bad} .*N = {N}"):
                kc.gather_rows_cuda(table, cuda.to_device(ids), out)
            assert_all_sentinel(out)


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (np.array([0.0, 1.0]), IdTypeError),
        (np.array([0, 1], np.float32), IdTypeError),
        (np.array([0, 1], np.uint32), IdTypeError),
        (np.array([0, 1], np.uint64), IdTypeError),
        (np.array([True, False]), IdTypeError),
        (np.array([[0, 1]], np.int64), IdShapeError),
        (np.array(1, np.int64), IdShapeError),
        ([0, 1], IdTypeError),
    ],
    ids=["float64", "float32", "uint32", "uint64", "bool", "2-D", "0-D", "list"],
)
def test_bad_id_arrays_raise_before_launch(
    ids: object, error: type, no_gather_launch: None
) -> None:
    out = sentinel_out(2, 3, np.int16)
    with pytest.raises(error):
        kc.gather_rows_cuda(cuda.to_device(np.zeros((N, 3), np.int16)), ids, out)
    assert_all_sentinel(out)


def test_bad_device_id_arrays_raise_before_launch(no_gather_launch: None) -> None:
    out = sentinel_out(2, 3, np.int16)
    table = cuda.to_device(np.zeros((N, 3), np.int16))
    with pytest.raises(IdTypeError):
        kc.gather_rows_cuda(table, cuda.to_device(np.array([0, 1], np.uint32)), out)
    with pytest.raises(IdShapeError):
        kc.gather_rows_cuda(table, cuda.to_device(np.zeros((2, 1), np.int64)), out)
    assert_all_sentinel(out)


def _bad_out(case: str) -> tuple[Any, Any]:
    """(table, out) pairs that must raise TableError; out holds sentinel bytes."""
    table = cuda.to_device(np.zeros((N, 4), np.float32))
    if case == "rows":
        return table, sentinel_out(3, 4, np.float32)
    if case == "width":
        return table, sentinel_out(2, 5, np.float32)
    if case == "dtype":
        return table, sentinel_out(2, 4, np.int32)
    if case == "1-D out":
        return table, sentinel_out(2, 4, np.float32).reshape(8)
    if case == "1-D table":
        return cuda.to_device(np.zeros(N, np.float32)), sentinel_out(2, 1, np.float32)
    if case == "strided out":
        return table, sentinel_out(2, 8, np.float32)[:, ::2]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["rows", "width", "dtype", "1-D out", "1-D table", "strided out"])
def test_bad_shapes_raise_before_launch(case: str, no_gather_launch: None) -> None:
    table, out = _bad_out(case)
    with pytest.raises(TableError):
        kc.gather_rows_cuda(table, np.array([0, 1], np.int64), out)
    if case != "strided out":  # a strided device array cannot be copied back whole
        assert_all_sentinel(out)


BAD_TUNING: list[dict[str, Any]] = [
    {"threads_per_row": 3},
    {"threads_per_row": 0},
    {"threads_per_row": 128, "threads_per_block": 64},
    {"threads_per_block": 48},
    {"threads_per_block": 2048},
    {"max_blocks": 0},
    {"max_blocks": -1},
    {"max_blocks": 1.5},
    {"max_blocks": True},
]


def test_bad_tuning_raises_config_error(no_gather_launch: None) -> None:
    table = cuda.to_device(np.zeros((N, 4), np.float32))
    out = sentinel_out(2, 4, np.float32)
    for tuning in BAD_TUNING:
        with pytest.raises(ConfigError, match=next(iter(tuning))):
            kc.gather_rows_cuda(table, np.array([0, 1], np.int64), out, **tuning)
    assert_all_sentinel(out)


def test_type_errors_come_before_range_errors(no_gather_launch: None) -> None:
    """Range errors come after type/shape errors: a wrong dtype is reported first."""
    out = sentinel_out(1, 4, np.float32)
    with pytest.raises(IdTypeError):
        kc.gather_rows_cuda(cuda.to_device(np.zeros((N, 4), np.float32)), np.array([-5.0]), out)


# --------------------------------------------------------------------------- planning


def test_default_max_blocks() -> None:
    blocks = kc.default_max_blocks()
    assert blocks >= 1
    if SIM:
        assert blocks == 1  # one 256-thread block keeps simulated launches fast
    assert kc.default_max_blocks(32) >= blocks


def test_plan_invariants() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        table_offset = int(rng.integers(0, kc.SEGMENT_BYTES))
        row_bytes = int(rng.integers(1, 600))
        word = max(w for w in (8, 4, 2, 1) if row_bytes % w == 0 and table_offset % w == 0)
        tpr = int(2 ** rng.integers(0, 7))
        align = min(kc.SEGMENT_BYTES, tpr * word)
        plan = kc.GatherPlan(row_bytes, word, row_bytes // word, table_offset, align, tpr, 128, 1)
        for row in rng.integers(0, 10**9, size=16):
            shift = plan.shift_words(row)
            assert 0 <= shift < tpr
            assert (table_offset + int(row) * row_bytes - shift * word) % align == 0


def test_auto_threads_per_row() -> None:
    tiny = cuda.device_array((4, 3), np.uint8)
    wide = cuda.device_array((4, 600), np.float32)
    assert kc.plan_gather(tiny, cuda.device_array((2, 3), np.uint8), 2).threads_per_row == 4
    assert kc.plan_gather(wide, cuda.device_array((2, 600), np.float32), 2).threads_per_row == 32


# --------------------------------------------------------------------------- environment


def test_import_without_simulator() -> None:
    """The module imports on a GPU-less machine; the gather says why it cannot run."""
    code = (
        "import numpy as np\n"
        "import pingpong.kernels.cuda as kc\n"
        "from numba import cuda\n"
        "from pingpong.errors import GatherModeUnavailable\n"
        "assert not kc.is_simulator()\n"
        "if not cuda.is_available():\n"
        "    try:\n"
        "        kc.gather_rows_cuda(np.zeros((2, 2)), np.zeros(1, np.int64), np.zeros((1, 2)))\n"
        "    except GatherModeUnavailable as exc:\n"
        "        print('unavailable:', exc)\n"
        "    else:\n"
        "        raise SystemExit('no error without a GPU')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert issubclass(GatherModeUnavailable, ValueError)


# --------------------------------------------------------------------------- real GPU


@pytest.mark.cuda
@gpu_only
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8], ids=["f32", "f16", "u8"])
def test_zero_copy_from_mapped_host_memory(dtype: type) -> None:
    rng = np.random.default_rng(11)
    host = random_rows(rng, 4096, 37, dtype)
    table = cuda.mapped_array(host.shape, dtype=host.dtype)
    table[...] = host
    ids = rng.integers(0, len(host), size=3000).astype(np.int64)
    out = cuda.device_array((len(ids), 37), dtype=dtype)
    stream = cuda.stream()
    kc.gather_rows_cuda(table, cuda.to_device(ids, stream=stream), out, stream, sort_ids=True)
    stream.synchronize()
    assert_same_bytes(out, host[ids])


@pytest.mark.cuda
@gpu_only
def test_numpy_table_rejected_on_gpu(no_gather_launch: None) -> None:
    out = cuda.device_array((1, 2), np.float32)
    with pytest.raises(TableError, match="NumPy"):
        kc.gather_rows_cuda(np.zeros((4, 2), np.float32), np.array([0], np.int64), out)


@pytest.mark.cuda
@gpu_only
def test_large_gather_default_tuning() -> None:
    rng = np.random.default_rng(12)
    host = random_rows(rng, 100_000, 100, np.float32)
    ids = rng.integers(0, len(host), size=50_000).astype(np.int32)
    out = cuda.device_array((len(ids), 100), np.float32)
    kc.gather_rows_cuda(cuda.to_device(host), cuda.to_device(ids), out)
    assert_same_bytes(out, host[ids])


# --------------------------------------------------------------------------- warm-up


@pytest.mark.parametrize("positions", [False, True], ids=["ids", "positions"])
@pytest.mark.parametrize(
    ("row_bytes", "word"), [(512, 8), (12, 4), (6, 2), (3, 1)], ids=["w8", "w4", "w2", "w1"]
)
def test_warm_up_signature_is_what_the_launch_passes(
    monkeypatch: pytest.MonkeyPatch, row_bytes: int, word: int, positions: bool
) -> None:
    """``gather_kernel_signature`` types exactly the arguments of a real launch
    (device int64 ids, as the loader stages them; with and without GPU-sorted positions)."""
    import numba

    launched: list[tuple[object, ...]] = []
    monkeypatch.setattr(kc, "_launch", lambda kernel, blocks, threads, stream, *args: (
        launched.append(args)))
    host = np.zeros((10, row_bytes), np.uint8)
    ids = np.array([3, 1, 4], np.int64)
    order = np.argsort(ids).astype(np.int64)
    kc.gather_rows_cuda_unchecked(
        cuda.to_device(host), cuda.to_device(ids[order] if positions else ids),
        cuda.device_array((3, row_bytes), np.uint8),
        positions=cuda.to_device(order) if positions else None,
    )
    (args,) = launched
    # the simulator's device arrays wrap NumPy arrays of the same dtype and layout
    typed = tuple(numba.typeof(getattr(a, "_ary", a)) for a in args)
    assert typed == kc.gather_kernel_signature(word, np.int64)
    assert kc._table_word_bytes(host) == word
    assert kc._table_word_bytes(row_bytes) == word


def test_warm_up_cuda_checks_and_is_a_no_op_in_the_simulator() -> None:
    with pytest.raises(ConfigError):
        kc.gather_kernel_signature(3)
    with pytest.raises(IdTypeError):
        kc.gather_kernel_signature(8, np.int16)
    if SIM:
        assert kc.warm_up_cuda([512, np.zeros((2, 6), np.uint8)]) == []  # nothing compiles
    from pingpong.kernels import warm_up_cuda

    assert warm_up_cuda is kc.warm_up_cuda


def test_kernels_are_cached_on_disk_on_a_gpu() -> None:
    if SIM:
        pytest.skip("the simulator compiles nothing")
    assert type(kc._gather_kernel._cache).__name__ == "CUDACache"
    assert type(kc._minmax_kernel._cache).__name__ == "CUDACache"
