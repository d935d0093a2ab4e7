"""The sorted-scatter gather ``zerocopy`` uses by default, under Numba's CUDA simulator.

On a GPU the loader sorts each batch's ids with ``torch.sort`` on the copy
stream (``pingpong/devices/cuda/_streams.py``, ``IdStager``) and the kernel
writes row ``i`` of the sorted order to output position ``order[i]``.  Here
``torch.sort`` runs on CPU tensors (same values and indices semantics) and the
kernel runs in the simulator; every output is compared bit for bit with
``table[ids]``, for every dtype, odd row widths, duplicate ids, one id, an
empty batch, ids already sorted and reversed.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

cuda = pytest.importorskip("numba.cuda")
kc = importlib.import_module("pingpong.kernels.cuda")

if not kc.is_simulator() and not cuda.is_available():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (Numba's CUDA simulator) or a CUDA GPU",
                allow_module_level=True)

SMALL = {"threads_per_block": 32, "max_blocks": 2}
SENTINEL = 0xAB
DTYPES = [np.float32, np.float16, np.int8, np.int64, np.uint8, np.uint16]


def _gpu_sorted_gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """What the loader does on a GPU: sort the ids with torch, gather with positions."""
    values, order = torch.sort(torch.from_numpy(ids.astype(np.int64)))
    out = cuda.to_device(np.full(table.shape[1] * len(ids) * table.itemsize, SENTINEL,
                                 dtype=np.uint8).view(table.dtype).reshape(len(ids),
                                                                           table.shape[1]))
    kc.gather_rows_cuda_unchecked(
        cuda.to_device(table),
        cuda.to_device(values.numpy()),
        out,
        positions=cuda.to_device(order.numpy()),
        **SMALL,
    )
    return out.copy_to_host()


def _same_bytes(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(
        np.ascontiguousarray(got).reshape(-1).view(np.uint8),
        np.ascontiguousarray(want).reshape(-1).view(np.uint8),
    )


def _table(rows: int, width: int, dtype: type, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    nbytes = rows * width * np.dtype(dtype).itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(rows, width)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sorted_scatter_is_bit_identical_for_every_dtype_and_odd_widths(dtype):
    rng = np.random.default_rng(1)
    for width in (1, 3, 7, 33):
        table = _table(40, width, dtype, seed=width)
        ids = rng.integers(0, 40, 37)
        assert _same_bytes(_gpu_sorted_gather(table, ids), table[ids]), f"width {width}"


@pytest.mark.parametrize(
    "ids",
    [
        np.array([5, 5, 5, 2, 2, 9, 5]),  # duplicates
        np.array([17]),  # one id
        np.arange(0, 40, 3),  # already sorted
        np.arange(39, -1, -2),  # reversed
        np.zeros(12, dtype=np.int64),  # all the same
    ],
    ids=["duplicates", "one-id", "sorted", "reversed", "all-equal"],
)
def test_sorted_scatter_edge_cases(ids):
    table = _table(40, 5, np.float32)
    assert _same_bytes(_gpu_sorted_gather(table, ids), table[ids])


def test_empty_batch_launches_nothing_and_writes_nothing():
    table = _table(10, 4, np.float32)
    out = _gpu_sorted_gather(table, np.empty(0, dtype=np.int64))
    assert out.shape == (0, 4)


def test_without_positions_the_sorted_ids_would_land_in_sorted_order():
    """Shows the test above can fail: drop the scatter and the rows come out sorted."""
    table = _table(40, 3, np.float32)
    ids = np.array([30, 2, 17, 2, 39])
    values, _order = torch.sort(torch.from_numpy(ids))
    out = cuda.to_device(np.zeros((len(ids), 3), dtype=np.float32))
    kc.gather_rows_cuda_unchecked(cuda.to_device(table), cuda.to_device(values.numpy()), out,
                                  **SMALL)
    assert not _same_bytes(out.copy_to_host(), table[ids])
    assert _same_bytes(out.copy_to_host(), table[np.sort(ids)])
