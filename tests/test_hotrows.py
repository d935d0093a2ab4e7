"""Counting gathered ids, choosing hot rows and mapping them to cache slots, checked
against counts and maps done by hand."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from pingpong.errors import (
    ConfigError,
    IdRangeError,
    IdShapeError,
    IdTypeError,
    PingPongError,
    TableError,
)
from pingpong.hotrows import RowCounter, build_slot_map, hit_rate, rows_within


def _batches(seed: int = 0, n: int = 500, count: int = 20) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Skewed ids with duplicates, an empty batch and int32 ids among them.
    batches = [(torch.rand(int(torch.randint(1, 300, (1,), generator=gen)), generator=gen) ** 3
                * n).long() for _ in range(count)]
    batches.append(torch.empty(0, dtype=torch.int64))
    batches.append(torch.tensor([n - 1, 0, 0], dtype=torch.int32))
    return batches


def test_counts_equal_a_count_by_hand() -> None:
    batches = _batches()
    counter = RowCounter(500)
    counter.add_all(batches)
    by_hand = Counter(int(i) for b in batches for i in b)
    assert counter.counts.tolist() == [by_hand.get(i, 0) for i in range(500)]
    assert counter.total == sum(by_hand.values())


def test_hottest_is_most_counted_first_ties_to_the_lower_id_and_never_unseen() -> None:
    counter = RowCounter(10)
    counter.add(torch.tensor([7, 7, 7, 3, 3, 9, 9, 1, 5]))
    assert counter.hottest(3).tolist() == [7, 3, 9]  # 3 and 9 tie at 2: 3 first
    assert counter.hottest(4).tolist() == [7, 3, 9, 1]  # 1 and 5 tie at 1: 1 first
    assert counter.hottest(10).tolist() == [7, 3, 9, 1, 5]  # rows never seen are left out
    assert counter.hottest(0).tolist() == []


def test_hottest_matches_a_sort_by_hand() -> None:
    batches = _batches(seed=3)
    counter = RowCounter(500)
    counter.add_all(batches)
    by_hand = Counter(int(i) for b in batches for i in b)
    ranked = sorted(by_hand, key=lambda i: (-by_hand[i], i))
    for k in (1, 10, 50, 1000):
        assert counter.hottest(k).tolist() == ranked[:k]


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (torch.tensor([1, 2, 10]), IdRangeError),
        (torch.tensor([-1, 2]), IdRangeError),
        (torch.tensor([1.0, 2.0]), IdTypeError),
        (torch.tensor([[1, 2]]), IdShapeError),
        ([1, 2], IdTypeError),
        (torch.tensor([1, 2], dtype=torch.int16), IdTypeError),
        (torch.tensor([1, 2], dtype=torch.uint8), IdTypeError),
        (torch.tensor([True, False]), IdTypeError),
    ],
)
def test_bad_ids_are_refused_before_anything_is_counted(ids, error) -> None:
    counter = RowCounter(10)
    counter.add(torch.tensor([4, 4]))
    with pytest.raises(error) as info:
        counter.add(ids)
    assert isinstance(info.value, PingPongError)
    assert counter.counts.tolist() == [0, 0, 0, 0, 2, 0, 0, 0, 0, 0]
    assert counter.total == 2


def test_reset_forgets_every_count() -> None:
    counter = RowCounter(4)
    counter.add(torch.tensor([0, 1, 1]))
    counter.reset()
    assert counter.counts.tolist() == [0, 0, 0, 0]
    assert counter.total == 0
    assert counter.hottest(4).tolist() == []


def test_hit_rate_equals_a_count_by_hand() -> None:
    batches = _batches(seed=5)
    counter = RowCounter(500)
    counter.add_all(batches)
    hot = torch.tensor([0, 1, 2, 3, 499, 2])  # a duplicate counts once
    held = {0, 1, 2, 3, 499}
    gathered = [int(i) for b in batches for i in b]
    expected = sum(1 for i in gathered if i in held) / len(gathered)
    assert hit_rate(hot, counter.counts) == pytest.approx(expected, abs=1e-12)
    assert hit_rate(torch.arange(500), counter.counts) == 1.0
    assert hit_rate(torch.empty(0, dtype=torch.int64), counter.counts) == 0.0
    assert hit_rate(hot, torch.zeros(500, dtype=torch.int64)) == 0.0
    # bad hot ids are refused also when nothing was gathered (it returned 0.0)
    with pytest.raises(IdRangeError, match="id -5 is outside the table's 500 rows"):
        hit_rate(torch.tensor([-5, 499]), torch.zeros(500, dtype=torch.int64))


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "torch"])
def test_build_slot_map_puts_each_hot_row_in_its_slot(as_tensor) -> None:
    """``slot_of[hot_ids[i]] == i``, -1 elsewhere: a cache filled with ``table[hot_ids]``
    then serves every cached row bit for bit (hot ids unsorted, as ``hottest`` gives)."""
    rng = np.random.default_rng(0)
    table = rng.integers(0, 256, (50, 12), dtype=np.uint8)
    hot = rng.permutation(50)[:17]
    slot_of = build_slot_map(50, torch.from_numpy(hot) if as_tensor else hot)
    by_hand = np.full(50, -1, np.int32)
    for slot, row in enumerate(hot.tolist()):
        by_hand[row] = slot
    assert slot_of.dtype == np.int32
    assert np.array_equal(slot_of, by_hand)
    cache = table[hot]
    cached_rows = np.flatnonzero(slot_of >= 0)
    assert np.array_equal(np.sort(cached_rows), np.sort(hot))
    assert np.array_equal(cache[slot_of[cached_rows]], table[cached_rows])
    assert np.array_equal(build_slot_map(3, np.zeros(0, np.int64)), [-1, -1, -1])


@pytest.mark.parametrize(("hot_ids", "error", "needle"), [
    (np.array([1, 6]), IdRangeError, "hot id 6 is outside the table's 6 rows"),
    (np.array([-1, 2]), IdRangeError, "hot id -1 is outside"),
    (np.array([4, 1, 4]), TableError, "distinct"),
])
def test_build_slot_map_refuses_ids_outside_the_table_and_duplicates(hot_ids, error,
                                                                     needle) -> None:
    with pytest.raises(error, match=needle):
        build_slot_map(6, hot_ids)


@pytest.mark.parametrize(("hot_ids", "error", "needle"), [
    (np.array([[0, 1]]), IdShapeError, "1-D"),
    (torch.tensor([[0, 1]]), IdShapeError, "1-D"),
    (np.array([0.0, 1.0]), IdTypeError, "float64"),
    (torch.tensor([0.0, 1.0], requires_grad=True), IdTypeError, "float32"),
])
def test_build_slot_map_names_the_problem_with_hot_ids(hot_ids, error, needle) -> None:
    with pytest.raises(error, match=needle):
        build_slot_map(5, hot_ids)


def test_hottest_rows_are_the_best_static_choice() -> None:
    """No other set of k rows serves more of the counted ids."""
    batches = _batches(seed=7)
    counter = RowCounter(500)
    counter.add_all(batches)
    best = hit_rate(counter.hottest(25), counter.counts)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        other = torch.randperm(500, generator=gen)[:25]
        assert hit_rate(other, counter.counts) <= best


def test_rows_within_a_budget() -> None:
    assert rows_within(1000, 512, 10) == 1
    assert rows_within(10 * 512, 512, 10) == 10
    assert rows_within(100 * 512, 512, 10) == 10  # never more than the table
    assert rows_within(511, 512, 10) == 0
    assert rows_within(0, 0, 7) == 7  # zero-width rows: everything fits
    bad_budgets: tuple[Any, ...] = (-1, 1.5, True)
    for bad in bad_budgets:
        with pytest.raises(ConfigError):
            rows_within(bad, 512, 10)
    with pytest.raises(ConfigError):
        RowCounter(-1)
    with pytest.raises(ConfigError):
        RowCounter(3).hottest(-1)


def test_numpy_integer_counts_are_ints() -> None:
    """``RowCounter``/``hottest``/``rows_within`` with NumPy integers: the same answers
    as with Python ints (typed ``int | numpy.integer``; mypy checks this call)."""
    counter = RowCounter(np.int64(10))
    counter.add(torch.tensor([3, 3, 7, 1, 3, 7]))
    assert type(counter.num_rows) is int
    assert torch.equal(counter.hottest(np.int32(2)), torch.tensor([3, 7]))
    got = rows_within(np.int64(1100), np.int64(512), np.int64(10))
    assert type(got) is int
    assert got == 2


def test_a_uint64_hot_id_past_int64_is_named_as_given() -> None:
    with pytest.raises(IdRangeError, match=r"hot id 9223372036854775808 is outside"):
        build_slot_map(5, np.array([0, 2**63], dtype=np.uint64))
