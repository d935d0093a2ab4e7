"""The Numba CPU gather kernel equals NumPy bit for bit and validates before reading."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

import pingpong
from pingpong.errors import TableError
from pingpong.kernels import gather_rows_cpu
from pingpong.kernels.cpu import as_words

DTYPES = [np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]


def random_table(rows: int, width: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=rows * width * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(rows, width)  # arbitrary bit patterns, NaNs included


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("width", [1, 3, 7, 16, 33, 128])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64], ids=["i32", "i64"])
def test_matches_numpy_bitwise(dtype, width, id_dtype):
    table = random_table(257, width, dtype)
    ids = np.random.default_rng(1).integers(0, 257, 1000).astype(id_dtype)
    out = np.full((1000, width * np.dtype(dtype).itemsize), 0x5A, np.uint8).view(dtype)
    gather_rows_cpu(table, ids, out)
    assert np.array_equal(out.view(np.uint8), table[ids].view(np.uint8))


def test_empty_ids_and_duplicates_and_single_row():
    table = random_table(10, 4, np.float32)
    out = np.empty((0, 4), np.float32)
    gather_rows_cpu(table, np.empty(0, np.int64), out)
    ids = np.array([9, 9, 0, 9], dtype=np.int64)
    out = np.empty((4, 4), np.float32)
    gather_rows_cpu(table, ids, out)
    assert np.array_equal(out.view(np.uint8), table[ids].view(np.uint8))


def test_word_view_picks_widest_aligned_word():
    assert as_words(np.zeros((4, 16), np.uint8)).dtype == np.int64
    assert as_words(np.zeros((4, 12), np.uint8)).dtype == np.int32
    assert as_words(np.zeros((4, 6), np.uint8)).dtype == np.int16
    assert as_words(np.zeros((4, 3), np.uint8)).dtype == np.uint8
    misaligned = np.zeros(4 * 16 + 1, np.uint8)[1:].reshape(4, 16)
    assert as_words(misaligned).dtype == np.uint8


@pytest.mark.parametrize(
    "bad",
    [[-1], [10], [2**31], [np.iinfo(np.int64).min], [np.iinfo(np.int64).max]],
    ids=str,
)
def test_out_of_range_ids_raise_before_any_write(bad):
    """The bad id alone at every position (first, second, middle, last: the bounds pass
    once skipped ``ids[1]`` unnoticed), then before a second bad id: the first is named."""
    table = random_table(10, 4, np.int32)
    (value,) = bad
    cases = []
    for pos in range(6):
        ids = np.array([0, 1, 9, 4, 2, 3], dtype=np.int64)
        ids[pos] = value
        cases.append((pos, ids))
    two_bad = cases[2][1].copy()
    two_bad[4] = -7 if value >= 10 else 11  # a later bad id of the other kind
    cases.append((2, two_bad))
    for pos, ids in cases:
        out = np.full((6, 4), 77, np.int32)
        with pytest.raises(IndexError, match=rf"ids\[{pos}\] = {value} .* N = 10") as info:
            gather_rows_cpu(table, ids, out)
        assert isinstance(info.value, pingpong.IdRangeError)
        assert (out == 77).all(), ids  # untouched


@pytest.mark.parametrize(
    ("ids", "exc"),
    [
        (np.array([0.0]), TypeError),
        (np.array([1], np.uint32), TypeError),
        (np.array([1], np.int16), TypeError),
        (np.zeros((1, 1), np.int64), TypeError),
        ([0, 1], TypeError),
    ],
    ids=str,
)
def test_bad_id_types(ids, exc):
    table = random_table(10, 4, np.int32)
    with pytest.raises(exc):
        gather_rows_cpu(table, ids, np.empty((1, 4), np.int32))


def test_bad_shapes_and_layouts():
    table = random_table(10, 4, np.int32)
    ids = np.array([1, 2])
    with pytest.raises(ValueError, match="expected"):
        gather_rows_cpu(table, ids, np.empty((3, 4), np.int32))
    with pytest.raises(TableError, match="expected"):  # rows wider than the table's
        gather_rows_cpu(table, ids, np.empty((2, 8), np.int32))
    with pytest.raises(ValueError, match="dtype"):
        gather_rows_cpu(table, ids, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        gather_rows_cpu(table.reshape(-1), ids, np.empty((2, 4), np.int32))
    # TableError, not NumPy's ValueError from the word view ("... must be contiguous"),
    # and strided arrays whose rows the word view would accept
    for strided_table, strided_out in (
        (np.asfortranarray(table), np.empty((2, 4), np.int32)),
        (random_table(20, 4, np.int32)[::2], np.empty((2, 4), np.int32)),
        (table, np.empty((4, 4), np.int32)[::2]),
        (table, np.empty((2, 8), np.int32)[:, ::2]),
    ):
        strided_out.fill(77)
        with pytest.raises(TableError, match="C-contiguous"):
            gather_rows_cpu(strided_table, ids, strided_out)
        assert (strided_out == 77).all()
    readonly = np.empty((2, 4), np.int32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        gather_rows_cpu(table, ids, readonly)


@pytest.mark.parametrize(("dtype", "needle"), [
    (np.dtype(object), "Python objects"),
    (np.dtype([("a", np.int8), ("b", np.float64)]), r"structured.*view\(np.uint8\)"),
])
def test_object_and_structured_tables_are_refused_by_name(dtype, needle):
    """From a code review: they failed inside the word view with NumPy's
    ``TypeError``/``ValueError`` (after the checks, before any write)."""
    table = np.zeros((10, 2), dtype)
    out = np.zeros((2, 2), dtype)
    with pytest.raises(TableError, match=needle):
        gather_rows_cpu(table, np.array([1, 2]), out)


def test_two_threads_running_parallel_numba_at_once():
    """The producer's kernel and the user's own parallel Numba code may overlap."""

    @numba.njit(parallel=True)
    def user_parallel_sum(a):
        total = 0.0
        for i in numba.prange(a.shape[0]):
            total += a[i]
        return total

    table = random_table(5000, 32, np.float32)
    ids = np.random.default_rng(0).integers(0, 5000, 20000)
    errors: list[BaseException] = []

    def gather_many() -> None:
        try:
            out = np.empty((len(ids), 32), np.float32)
            for _ in range(50):
                gather_rows_cpu(table, ids, out)
            assert np.array_equal(out.view(np.uint8), table[ids].view(np.uint8))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=gather_many, name="test-gatherer")
    thread.start()
    data = np.ones(100_000)
    for _ in range(200):
        assert user_parallel_sum(data) == 100_000
    thread.join()
    assert not errors
    assert numba.threading_layer() in ("omp", "tbb")


@pytest.mark.parametrize("offset", [1, 2, 4])
@pytest.mark.parametrize("row_bytes", [16, 24, 6])
def test_a_table_off_the_word_boundary_is_gathered_exactly_and_in_bounds(offset, row_bytes):
    """Table and out are viewed with one word: a table starting ``offset`` bytes past an
    aligned address once made the kernel copy words of one width into rows of another
    (wrong bytes, and writes past ``out``)."""
    rows = 64
    raw = np.random.default_rng(offset).integers(0, 256, rows * row_bytes + 8, dtype=np.uint8)
    table = raw[offset : offset + rows * row_bytes].reshape(rows, row_bytes)
    assert table.ctypes.data % 8 != 0
    guard = np.zeros((40, row_bytes), np.uint8)  # out is the first 10 rows; the rest must stay 0
    out = guard[:10]
    ids = np.random.default_rng(1).integers(0, rows, 10)
    gather_rows_cpu(table, ids, out)
    assert np.array_equal(out, table[ids])
    assert not guard[10:].any()


def test_word_view_takes_an_explicit_width():
    rows = np.zeros((4, 16), np.uint8)
    assert as_words(rows, 2).dtype == np.int16
    assert as_words(rows, 2).shape == (4, 8)
    assert as_words(rows, 1).shape == (4, 16)
