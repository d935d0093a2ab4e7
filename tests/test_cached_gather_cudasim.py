"""One gather for cache hits and misses, under Numba's CUDA simulator.

Every output is compared bit for bit with ``table[ids]``: every dtype, odd row
widths, 0%, part and 100% of the rows cached, duplicates, an empty batch, the
sorted-scatter composition (``positions``), and a hit count checked against a
count by hand. Bad arguments (a bad hit counter and a strided cache included)
raise before any launch and leave ``out`` as it was; a cache off the word
boundary narrows the launch's word.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

cuda = pytest.importorskip("numba.cuda")
kc = importlib.import_module("pingpong.kernels.cuda")
cached = importlib.import_module("pingpong.kernels.cuda_cached")
hotrows = importlib.import_module("pingpong.hotrows")
errors = importlib.import_module("pingpong.errors")

if not kc.is_simulator() and not cuda.is_available():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (Numba's CUDA simulator) or a CUDA GPU",
                allow_module_level=True)

SMALL = {"threads_per_block": 32, "max_blocks": 2}
SENTINEL = 0xAB
DTYPES = [np.float32, np.float16, np.int8, np.int64, np.uint16]


def _table(rows: int, width: int, dtype: type, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    nbytes = rows * width * np.dtype(dtype).itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(rows, width)


def _out(table: np.ndarray, n: int) -> np.ndarray:
    raw = np.full(n * table.shape[1] * table.itemsize, SENTINEL, dtype=np.uint8)
    return raw.view(table.dtype).reshape(n, table.shape[1])


def _same_bytes(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(
        np.ascontiguousarray(got).reshape(-1).view(np.uint8),
        np.ascontiguousarray(want).reshape(-1).view(np.uint8),
    )


def _cache_of(table: np.ndarray, hot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.ascontiguousarray(table[hot]), hotrows.build_slot_map(len(table), hot)


def _gather(table, hot, ids, *, sort=False, count=False):
    cache, slot_of = _cache_of(table, hot)
    out = cuda.to_device(_out(table, len(ids)))
    hits = cuda.to_device(np.zeros(1, dtype=np.int64)) if count else None
    if sort:
        values, order = torch.sort(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
        cached.gather_rows_cached_unchecked(
            cuda.to_device(table), cuda.to_device(cache), cuda.to_device(slot_of),
            cuda.to_device(values.numpy()), out, positions=cuda.to_device(order.numpy()),
            hits=hits, **SMALL,
        )
    else:
        cached.gather_rows_cached(
            cuda.to_device(table), cuda.to_device(cache), cuda.to_device(slot_of),
            cuda.to_device(ids), out, hits=hits, **SMALL,
        )
    return out.copy_to_host(), (None if hits is None else int(hits.copy_to_host()[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0], ids=["none", "part", "all"])
def test_bit_identical_for_every_dtype_width_and_cached_share(dtype, share):
    rng = np.random.default_rng(2)
    for width in (1, 3, 33):
        table = _table(40, width, dtype, seed=width)
        hot = rng.permutation(40)[: round(share * 40)]
        ids = rng.integers(0, 40, 29)
        got, _ = _gather(table, hot, ids)
        assert _same_bytes(got, table[ids]), f"width {width}"


@pytest.mark.parametrize(
    "ids",
    [np.array([5, 5, 5, 2, 2, 9, 5]), np.array([17]), np.arange(39, -1, -2),
     np.zeros(12, dtype=np.int64), np.array([3, 7, 3], dtype=np.int32)],
    ids=["duplicates", "one-id", "reversed", "all-equal", "int32"],
)
@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "gpu-sorted"])
def test_duplicates_edge_cases_and_the_sorted_scatter(ids, sort):
    table = _table(40, 7, np.float16, seed=4)
    hot = np.array([5, 2, 39, 0, 21])
    got, _ = _gather(table, hot, ids, sort=sort)
    assert _same_bytes(got, table[ids])


def test_hits_equal_a_count_by_hand():
    rng = np.random.default_rng(6)
    table = _table(50, 5, np.float32)
    hot = rng.permutation(50)[:12]
    ids = rng.integers(0, 50, 64)
    for sort in (False, True):
        got, hits = _gather(table, hot, ids, sort=sort, count=True)
        assert _same_bytes(got, table[ids])
        assert hits == sum(1 for i in ids if i in set(hot.tolist()))


def test_rows_really_come_from_the_cache():
    """A cache whose rows differ from the table shows which source served each row."""
    table = _table(10, 4, np.int64)
    hot = np.array([1, 8])
    cache = np.full((2, 4), -7, dtype=np.int64)
    slot_of = hotrows.build_slot_map(10, hot)
    ids = np.array([0, 1, 8, 9, 1])
    out = cuda.to_device(_out(table, len(ids)))
    cached.gather_rows_cached(cuda.to_device(table), cuda.to_device(cache),
                              cuda.to_device(slot_of), cuda.to_device(ids), out, **SMALL)
    got = out.copy_to_host()
    assert (got[[1, 2, 4]] == -7).all()
    assert _same_bytes(got[[0, 3]], table[[0, 9]])


def test_an_empty_batch_writes_nothing():
    table = _table(10, 4, np.float32)
    got, hits = _gather(table, np.array([1, 2]), np.zeros(0, dtype=np.int64), count=True)
    assert got.shape == (0, 4)
    assert hits == 0


def test_build_slot_map():
    slot_of = hotrows.build_slot_map(6, torch.tensor([4, 0, 2]))
    assert slot_of.dtype == np.int32
    assert slot_of.tolist() == [1, -1, 2, -1, 0, -1]
    assert hotrows.build_slot_map(3, np.zeros(0, dtype=np.int64)).tolist() == [-1, -1, -1]
    with pytest.raises(errors.IdRangeError):
        hotrows.build_slot_map(6, np.array([1, 6]))
    with pytest.raises(errors.IdRangeError):
        hotrows.build_slot_map(6, np.array([-1]))
    with pytest.raises(errors.TableError, match="distinct"):
        hotrows.build_slot_map(6, np.array([1, 1]))
    with pytest.raises(errors.IdTypeError):
        hotrows.build_slot_map(6, np.array([[1]]))


def _bad_calls():
    table = _table(10, 4, np.float32)
    cache, slot_of = _cache_of(table, np.array([3, 4]))
    ids = np.array([1, 3, 9])
    good = dict(table=table, cache=cache, slot_of=slot_of, ids=ids)
    return table, [
        ("id beyond the table and its slot map", {**good, "ids": np.array([1, 10, 2])},
         errors.IdRangeError),
        ("negative id", {**good, "ids": np.array([-1, 2, 3])}, errors.IdRangeError),
        ("slot map too short", {**good, "slot_of": slot_of[:9]}, errors.TableError),
        ("slot map of int64", {**good, "slot_of": slot_of.astype(np.int64)}, errors.TableError),
        ("slot beyond the cache", {**good, "slot_of": np.where(slot_of == 1, 2, slot_of)
                                   .astype(np.int32)}, errors.TableError),
        ("slot below -1", {**good, "slot_of": np.full(10, -2, dtype=np.int32)},
         errors.TableError),
        ("cache of another dtype", {**good, "cache": cache.astype(np.float64)},
         errors.TableError),
        ("cache of another width", {**good, "cache": np.zeros((2, 5), np.float32)},
         errors.TableError),
        ("2-D ids", {**good, "ids": ids[None, :]}, errors.IdTypeError),
    ]


@pytest.mark.skipif(not kc.is_simulator(), reason="NumPy arrays are device arrays only "
                    "under the simulator")
@pytest.mark.parametrize("gather", ["plain", "cached"])
@pytest.mark.parametrize("case", ["read-only out", "object", "structured"])
def test_host_arrays_the_kernels_cannot_write_or_copy_are_refused_by_name(case, gather):
    """From a code review: the cached gather launched into a read-only ``out``
    (NumPy's ``ValueError`` from the kernel), and object or structured dtypes
    failed in the word view."""
    dtype = {"object": np.dtype(object),
             "structured": np.dtype([("a", np.int8), ("b", np.float64)])}.get(case, np.float32)
    table = np.zeros((10, 4), dtype)
    out = np.zeros((2, 4), dtype)
    out.flags.writeable = case != "read-only out"
    ids = np.array([1, 3])
    needle = {"read-only out": "writeable", "object": "Python objects",
              "structured": "structured"}[case]
    with pytest.raises(errors.TableError, match=needle):
        if gather == "plain":
            kc.gather_rows_cuda(table, ids, out, **SMALL)
        else:
            cache, slot_of = np.zeros((1, 4), dtype), np.full(10, -1, np.int32)
            cached.gather_rows_cached(table, cache, slot_of, ids, out, **SMALL)


@pytest.mark.parametrize("case", range(9))
def test_bad_arguments_raise_before_any_launch_and_out_is_untouched(case):
    table, cases = _bad_calls()
    name, call, error = cases[case]
    out = cuda.to_device(_out(table, 3))
    with pytest.raises(error):
        cached.gather_rows_cached(
            cuda.to_device(call["table"]), cuda.to_device(call["cache"]),
            cuda.to_device(call["slot_of"]), cuda.to_device(call["ids"]), out, **SMALL,
        )
    assert (out.copy_to_host().view(np.uint8) == SENTINEL).all(), name


def test_without_a_hit_counter_nothing_but_out_is_written():
    table = _table(30, 3, np.float32)
    cache, slot_of = _cache_of(table, np.array([4, 7, 9]))
    ids = np.array([4, 4, 7, 1, 9, 0])
    device_ids, device_slots = cuda.to_device(ids), cuda.to_device(slot_of)
    out = cuda.to_device(_out(table, len(ids)))
    cached.gather_rows_cached(cuda.to_device(table), cuda.to_device(cache), device_slots,
                              device_ids, out, **SMALL)
    assert _same_bytes(out.copy_to_host(), table[ids])
    assert np.array_equal(device_ids.copy_to_host(), ids)
    assert np.array_equal(device_slots.copy_to_host(), slot_of)


class _NoLaunch:
    """Stands in for the kernel: configuring a launch fails the test."""

    def __getitem__(self, config: object) -> object:
        raise AssertionError(f"kernel launched with {config} despite invalid input")


def test_a_bad_hit_counter_or_a_strided_cache_raises_before_any_launch(monkeypatch):
    """The hit counter must be int64 of shape (1,) and the cache C-contiguous (a
    row-strided cache was served as if it were, a 2-element or int32 counter taken)."""
    monkeypatch.setattr(cached, "_cached_gather_kernel", _NoLaunch())
    table = _table(10, 4, np.float32)
    cache, slot_of = _cache_of(table, np.array([3, 4]))
    strided = cuda.to_device(np.repeat(cache, 2, axis=0))[::2]  # cache's rows, every other
    cases = [
        ("int32 hits", cuda.to_device(cache), np.zeros(1, np.int32), "hits"),
        ("two hits", cuda.to_device(cache), np.zeros(2, np.int64), "hits"),
        ("0-D hits", cuda.to_device(cache), np.zeros((), np.int64), "hits"),
        ("strided cache", strided, None, "C-contiguous"),
    ]
    for name, device_cache, host_hits, needle in cases:
        out = cuda.to_device(_out(table, 3))
        hits = None if host_hits is None else cuda.to_device(host_hits)
        with pytest.raises(errors.TableError, match=needle):
            cached.gather_rows_cached(
                cuda.to_device(table), device_cache, cuda.to_device(slot_of),
                cuda.to_device(np.array([1, 3, 9])), out, hits=hits, **SMALL,
            )
        assert (out.copy_to_host().view(np.uint8) == SENTINEL).all(), name
        if hits is not None:
            assert not hits.copy_to_host().any(), name


def test_a_cache_off_the_word_boundary_narrows_the_word(monkeypatch):
    """The word divides the cache's address too, not only the table's and out's. The
    simulator reads misaligned words anyway (a GPU does not), so besides the rows the
    launch's word is checked: 4 bytes would suit the table and out, the cache needs 2."""
    table = _table(12, 6, np.int16, seed=9)  # 12-byte rows
    hot = np.array([7, 2, 11])
    rows = np.ascontiguousarray(table[hot])
    raw = cuda.device_array(rows.nbytes + 256, np.uint8)
    start = (2 - kc._address(raw)) % kc.SEGMENT_BYTES
    cache = raw[start : start + rows.nbytes]
    cache.copy_to_device(rows.reshape(-1).view(np.uint8))
    cache = cache.view(np.int16).reshape(rows.shape)
    assert kc._address(cache) % 4 == 2
    ids = np.array([2, 0, 11, 7, 5, 2])
    device_table, out = cuda.to_device(table), cuda.to_device(_out(table, len(ids)))
    assert kc.plan_gather(device_table, out, len(ids)).word_bytes == 4
    words = []

    def recording_launch(kernel, blocks, threads, stream, *args):
        words.append(tuple(np.dtype(args[i].dtype).itemsize for i in (0, 1, 3)))
        real_launch(kernel, blocks, threads, stream, *args)

    real_launch = cached._launch
    monkeypatch.setattr(cached, "_launch", recording_launch)
    cached.gather_rows_cached(device_table, cache, cuda.to_device(hotrows.build_slot_map(12, hot)),
                              cuda.to_device(ids), out, **SMALL)
    assert words == [(2, 2, 2)]
    assert _same_bytes(out.copy_to_host(), table[ids])


@pytest.mark.skipif(not kc.is_simulator(), reason="NumPy arguments: the simulator's only")
@pytest.mark.parametrize("count", [False, True], ids=["no-count", "count"])
def test_numpy_arguments_in_simulator_are_only_read(count):
    """A NumPy table, cache, slot map and ids are read, never written (the simulator
    copies a bare NumPy argument back over the caller's after the launch, which a
    read-only one makes fail); strided host ids gather like contiguous ones."""
    table = _table(40, 3, np.float16)
    cache, slot_of = _cache_of(table, np.array([1, 5, 9, 30]))
    for array in (table, cache, slot_of):
        array.flags.writeable = False
    ids = np.array([5, 0, 30, 9, 9, 2, 39, 1, 6, 5], dtype=np.int64)
    frozen_ids = ids.copy()
    frozen_ids.flags.writeable = False
    for case, case_ids in (("read-only ids", frozen_ids), ("strided ids", ids[::2])):
        out = _out(table, len(case_ids))
        hits = np.zeros(1, dtype=np.int64) if count else None
        cached.gather_rows_cached(table, cache, slot_of, case_ids, out, hits=hits, **SMALL)
        assert _same_bytes(out, table[case_ids]), case
        if hits is not None:
            assert int(hits[0]) == int(np.isin(case_ids, [1, 5, 9, 30]).sum()), case
