"""The bookkeeping of pingpong's page-locked host ranges (no GPU needed).

The pinning itself needs a GPU (``tests/test_cuda.py``); which range a table
may share, and which it must be refused, is decided here first.
"""

from __future__ import annotations

import pytest

from pingpong.errors import TableError
from pingpong.kernels._interop import _Registry

BASE = 0x10000
SIZE = 640


def registry_with_one_range() -> tuple[_Registry, object]:
    registry = _Registry()
    memory = object()  # what the driver returned; the registry only keeps it
    registry.add(memory, BASE, SIZE)
    return registry, memory


@pytest.mark.parametrize(
    ("start", "nbytes"),
    [(BASE, SIZE), (BASE, 64), (BASE + 64, 128), (BASE + SIZE - 1, 1)],
    ids=["the-same", "a-prefix", "inside", "the-last-byte"],
)
def test_a_range_inside_a_registered_one_shares_it(start: int, nbytes: int) -> None:
    registry, memory = registry_with_one_range()
    found = registry.holding(start, nbytes)
    assert found is not None
    assert (found.memory, found.ptr, found.nbytes) == (memory, BASE, SIZE)


@pytest.mark.parametrize(
    ("start", "nbytes"),
    [(BASE, SIZE + 1), (BASE + SIZE - 1, 2), (BASE - 1, 2), (BASE - 64, SIZE + 128)],
    ids=["longer-from-the-same-start", "across-the-end", "across-the-start", "around-it"],
)
def test_a_range_overlapping_a_registered_one_is_refused(start: int, nbytes: int) -> None:
    registry, _ = registry_with_one_range()
    with pytest.raises(TableError, match=f"overlap the {SIZE} bytes at {BASE:#x}"):
        registry.holding(start, nbytes)


@pytest.mark.parametrize(
    ("start", "nbytes"), [(BASE + SIZE, 8), (BASE - 8, 8), (0, 16)],
    ids=["right-after", "right-before", "elsewhere"],
)
def test_a_range_apart_from_every_registered_one_has_none(start: int, nbytes: int) -> None:
    registry, _ = registry_with_one_range()
    assert registry.holding(start, nbytes) is None


def test_a_removed_range_holds_nothing() -> None:
    registry, _ = registry_with_one_range()
    found = registry.holding(BASE, SIZE)
    assert found is not None
    registry.remove(found)
    assert registry.holding(BASE + 8, 8) is None
    assert registry.by_ptr == {}


def test_releasing_a_handle_twice_drops_one_share_only() -> None:
    """``PinnedTable.release`` is idempotent: a second release of the same handle must
    not take another loader's share (which would unregister memory still in use).
    With two shares nothing reaches the driver, so no GPU is needed."""
    from pingpong.kernels._interop import PinnedTable, _pin_lock, _registrations

    memory = object()
    with _pin_lock:
        registration = _registrations.add(memory, BASE, SIZE)
    registration.count = 2
    try:
        handle = PinnedTable(array=object(), registration=registration)
        handle.release()
        handle.release()
        assert handle.array is None
        assert registration.count == 1
        with _pin_lock:
            assert _registrations.holding(BASE, SIZE) is registration
    finally:
        with _pin_lock:
            _registrations.remove(registration)


def test_with_several_ranges_each_is_looked_up() -> None:
    """Two loaders' tables pinned side by side: a range inside the later one shares it,
    one across its end is refused, one between them has none -- whichever was added
    first -- and removing one leaves the other registered."""
    registry = _Registry()
    first, second = object(), object()
    other = BASE + 4 * SIZE
    registry.add(first, BASE, SIZE)
    registry.add(second, other, SIZE)
    found = registry.holding(other + 64, 64)
    assert found is not None
    assert found.memory is second
    with pytest.raises(TableError, match=f"overlap the {SIZE} bytes at {other:#x}"):
        registry.holding(other + SIZE - 8, 16)
    assert registry.holding(BASE + SIZE, 2 * SIZE) is None
    registry.remove(found)
    assert registry.holding(other + 64, 64) is None
    kept = registry.holding(BASE, SIZE)
    assert kept is not None
    assert kept.memory is first
