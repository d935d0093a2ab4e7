"""The hot-row feature cache through the loader, on the fake asynchronous device.

The fake device implements the cache like the CUDA ``zerocopy`` mode: built on
the copy stream, cached rows read from a separate array, the rest from the
table (the CUDA kernel itself is tested under the simulator:
``test_cached_gather_cudasim.py``). Every batch is compared bit for bit with
``features[input_nodes]``; hit counts are checked against counts by hand.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_triples, same_bits

from pingpong import PingPongLoader
from pingpong.devices.fake import FakeAsyncDevice
from pingpong.errors import ConfigError, IdRangeError, PingPongError, TableError

N = 2000


def _skewed_triples(seed: int, count: int = 12) -> list:
    """Batches whose ids favour low node ids (a few hot rows, like hubs)."""
    gen = torch.Generator().manual_seed(seed)
    triples = []
    for _ in range(count):
        inputs = torch.unique((torch.rand(300, generator=gen) ** 3 * N).long())
        inputs = inputs[torch.randperm(len(inputs), generator=gen)]
        triples.append((inputs, inputs[:20], None))
    return triples


def _fake() -> FakeAsyncDevice:
    return FakeAsyncDevice(seed=1, max_delay_s=0.001)


def _run_epoch(loader, triples, features) -> int:
    count = 0
    for batch, (inputs, _outputs, _blocks) in zip(loader, triples, strict=True):
        loader._device.synchronize()
        assert same_bits(batch.x, features[inputs])
        count += 1
    return count


@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [(torch.float32, (8,)), (torch.float16, (7,)), (torch.int8, (3,)), (torch.float64, (1,))],
    ids=str,
)
@pytest.mark.parametrize("share", [0.0, 0.1, 1.5], ids=["nothing", "tenth", "everything"])
def test_given_hot_ids_are_cached_before_the_first_batch(dtype, row_shape, share):
    features = (torch.randn((N, *row_shape)) * 50).to(dtype)
    triples = _skewed_triples(0)
    row_bytes = features[0].numel() * features.element_size()
    hot = torch.arange(N - 1, -1, -1)  # a deliberately poor choice: bytes stay exact
    cache_bytes = int(share * N * row_bytes)
    kwargs: dict[str, Any] = {"cache_bytes": cache_bytes, "hot_ids": hot} if cache_bytes else {}
    device = _fake()
    with PingPongLoader(triples, features, device=device, **kwargs) as loader:
        assert _run_epoch(loader, triples, features) == len(triples)
        stats = loader.stats
    cached = set(hot[: min(N, cache_bytes // row_bytes)].tolist())
    expected_hits = sum(int(i) in cached for t in triples for i in t[0])
    assert device.cache_hits == expected_hits
    if cache_bytes:
        assert stats["cache_rows"] == len(cached)
        assert stats["cache_lookups"] == sum(len(t[0]) for t in triples)
        assert stats["cache_hits"] == expected_hits
        assert stats["cache_bytes_saved"] == expected_hits * row_bytes
        assert stats["cache_hit_rate"] == pytest.approx(expected_hits / stats["cache_lookups"])
    else:
        assert (stats["cache_rows"], stats["cache_lookups"], stats["cache_hits"]) == (0, 0, 0)


def test_the_first_epoch_counts_and_the_second_serves_its_hottest_rows():
    features = torch.randn(N, 16)
    triples = _skewed_triples(1)
    k = 100
    device = _fake()
    with PingPongLoader(triples, features, device=device, cache_bytes=k * 16 * 4) as loader:
        assert _run_epoch(loader, triples, features) == len(triples)
        first = loader.stats
        assert (first["cache_rows"], first["cache_lookups"], first["cache_hits"]) == (0, 0, 0)
        assert device.cache_hits == 0
        it = iter(loader)  # the epoch boundary: the cache is built here, before any fill
        assert loader.stats["cache_rows"] == k
        it.close()  # its producer may have filled a batch or two: count from here
        device.synchronize()
        loader.reset_stats()
        hits_before = device.cache_hits
        assert _run_epoch(loader, triples, features) == len(triples)
        second = loader.stats
    counts = Counter(int(i) for t in triples for i in t[0])
    hottest = {i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]}
    expected_hits = sum(counts[i] for i in hottest)  # the same batches again in epoch 2
    assert second["cache_rows"] == k
    assert second["cache_hits"] == expected_hits == device.cache_hits - hits_before
    assert second["cache_lookups"] == sum(counts.values())
    assert second["cache_hit_rate"] > 4 * k / N  # skewed ids: 5% of the rows, ~25% of reads


@pytest.mark.parametrize("how", ["hot_ids", "learned"])
def test_writes_reach_the_cached_rows_after_refresh_cache(how):
    """The cache is a copy: a write to the table between epochs reaches the
    uncached rows at once and the cached rows only after ``refresh_cache()``
    (before it, every batch of the epoch after such a write differed from
    ``features[input_nodes]`` and nothing said so).  Refreshing copies the same
    rows again at the next ``iter()``, and every batch is exact again."""
    gen = torch.Generator().manual_seed(5)
    triples = [(torch.randperm(N, generator=gen)[:300], torch.arange(4), None)
               for _ in range(6)]
    features = torch.randn(N, 8, generator=gen)
    extra: dict[str, Any] = {"hot_ids": torch.arange(N)} if how == "hot_ids" else {}
    device = _fake()
    with PingPongLoader(triples, features, device=device, cache_bytes=200 * 32,
                        **extra) as loader:
        loader.refresh_cache()  # before any build: nothing to copy again
        assert _run_epoch(loader, triples, features) == len(triples)
        if how == "learned":  # the build, at this iter(), reads the table as it is
            features.mul_(3)
            assert _run_epoch(loader, triples, features) == len(triples)
        (_rows, slot_of), = device._caches.values()
        cached = {int(i) for i in np.flatnonzero(slot_of >= 0)}
        assert len(cached) == 200
        before = features.clone()
        features.mul_(-2).add_(1)  # between epochs, no refresh: cached rows keep old values
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            device.synchronize()
            was_cached = torch.tensor([int(i) in cached for i in inputs])
            assert same_bits(batch.x[was_cached], before[inputs][was_cached])
            assert same_bits(batch.x[~was_cached], features[inputs][~was_cached])
        loader.refresh_cache()
        assert _run_epoch(loader, triples, features) == len(triples)
        assert _run_epoch(loader, triples, features) == len(triples)  # refreshed once, kept


def test_a_refresh_that_fails_is_tried_again_at_the_next_iter(monkeypatch):
    """The copy's error comes from ``iter(loader)``; the request is kept, so the
    next ``iter()`` copies the rows (it was dropped: every later epoch read the old
    cached rows without a word, found by a review)."""
    gen = torch.Generator().manual_seed(6)
    triples = [(torch.randperm(N, generator=gen)[:300], torch.arange(4), None)
               for _ in range(4)]
    features = torch.randn(N, 8, generator=gen)
    device = _fake()
    with PingPongLoader(triples, features, device=device, cache_bytes=400 * 32,
                        hot_ids=torch.arange(0, N, 2)) as loader:
        assert _run_epoch(loader, triples, features) == len(triples)
        features.mul_(-2).add_(1)
        loader.refresh_cache()
        real = device.set_cache

        def out_of_memory(*args: Any) -> None:
            raise RuntimeError("out of memory (simulated)")

        monkeypatch.setattr(device, "set_cache", out_of_memory)
        with pytest.raises(RuntimeError, match="simulated"):
            iter(loader)
        monkeypatch.setattr(device, "set_cache", real)
        assert _run_epoch(loader, triples, features) == len(triples)


def test_an_epoch_cut_short_still_teaches_the_cache():
    features = torch.randn(N, 4)
    triples = _skewed_triples(2)
    device = _fake()
    with PingPongLoader(triples, features, device=device, cache_bytes=50 * 16) as loader:
        it = iter(loader)
        next(it)
        next(it)  # batch 0's slot is back: the producer fills batch 2, then waits for a slot
        deadline = time.monotonic() + 5
        while device.calls["gather"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        it.close()  # three batches were counted, no more
        assert device.calls["gather"] == 3
        assert _run_epoch(loader, triples, features) == len(triples)
        stats = loader.stats
    counts = Counter(int(i) for t in triples[:3] for i in t[0])
    hottest = {i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:50]}
    assert stats["cache_rows"] == 50
    assert stats["cache_hits"] == sum(int(i) in hottest for t in triples for i in t[0])


def test_labels_duplicates_and_empty_batches_are_exact_in_every_epoch():
    features = torch.randn(N, 5).to(torch.bfloat16)
    labels = torch.randint(0, 7, (N,))
    triples: list[tuple[torch.Tensor, torch.Tensor, list[str] | None]] = list(
        make_triples(N, 10, max_inputs=400))
    hot = triples[0][0][:5]
    triples.append((torch.cat([hot, hot, hot[:1]]), hot[:2], None))  # duplicate ids
    triples.append((torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), None))
    device = _fake()
    with PingPongLoader(triples, features, labels, device=device,
                        cache_bytes=N * 10 // 4) as loader:
        for _ in range(3):
            for batch, (inputs, outputs, _b) in zip(loader, triples, strict=True):
                device.synchronize()
                assert same_bits(batch.x, features[inputs])
                assert torch.equal(batch.y, labels[outputs])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cache_bytes": -1}, ConfigError, "cache_bytes"),
        ({"cache_bytes": 1.5}, ConfigError, "cache_bytes"),
        ({"cache_bytes": True}, ConfigError, "cache_bytes"),
        ({"cache_bytes": 15}, ConfigError, "holds no row of 16 bytes"),
        ({"hot_ids": torch.arange(3)}, ConfigError, "hot_ids needs cache_bytes"),
        ({"cache_bytes": 64, "hot_ids": torch.tensor([1, N])}, IdRangeError, "outside"),
        ({"cache_bytes": 64, "hot_ids": torch.tensor([1, 1])}, TableError, "distinct"),
        ({"cache_bytes": 64, "hot_ids": torch.tensor([[1]])}, ConfigError, "1-D"),
        ({"cache_bytes": 64, "hot_ids": torch.tensor([1.0])}, ConfigError, "1-D"),
        ({"cache_bytes": 64, "hot_ids": torch.tensor([1.0], requires_grad=True)}, ConfigError,
         "1-D"),
        ({"cache_bytes": 64, "hot_ids": torch.tensor([], dtype=torch.int64)}, ConfigError,
         "hot_ids is empty"),
        ({"cache_bytes": 64, "hot_ids": np.array([2**63 + 5], dtype=np.uint64)}, IdRangeError,
         "hot id 9223372036854775813 is outside"),
    ],
)
def test_bad_cache_arguments_are_refused_at_construction(kwargs, error, match):
    device = _fake()
    with pytest.raises(error, match=match) as info:
        PingPongLoader(_skewed_triples(3), torch.randn(N, 4), device=device, **kwargs)
    assert isinstance(info.value, PingPongError)
    assert device.closed  # the loader that failed to construct closed its device


class _DeviceModeFake(FakeAsyncDevice):
    """The fake device, reporting the CUDA device's ``gather="device"`` mode (tables
    in GPU memory, where no cache is built)."""

    gather_mode = "device"


@pytest.mark.parametrize(
    ("features", "kwargs", "error", "match"),
    [
        (None, {"hot_ids": torch.tensor([1, N])}, IdRangeError, "outside"),
        (None, {"hot_ids": torch.tensor([1, 1])}, TableError, "distinct"),
        (None, {"hot_ids": torch.tensor([1.5])}, ConfigError, "1-D"),
        (None, {"hot_ids": torch.tensor([], dtype=torch.int64)}, ConfigError,
         "hot_ids is empty"),
        (None, {"cache_bytes": 15, "hot_ids": torch.tensor([10**9])}, ConfigError,
         "holds no row of 16 bytes"),
        ({"a": torch.randn(N, 4)}, {}, ConfigError, "one feature tensor"),
    ],
)
def test_bad_cache_arguments_are_refused_where_no_cache_is_built_too(
        features, kwargs, error, match):
    """From a code review: with ``gather="device"`` the cache is skipped, and so were
    the checks of its arguments -- so ``gather="auto"`` on a GPU accepted or refused
    the same arguments depending on its free memory. Each case is refused on a device
    with a cache too (the fake one)."""
    for device in (_DeviceModeFake(seed=1, max_delay_s=0.001), _fake()):
        with pytest.raises(error, match=match):
            PingPongLoader(_skewed_triples(3),
                           torch.randn(N, 4) if features is None else features,
                           device=device, **{"cache_bytes": 64, **kwargs})
        assert device.closed
    good = PingPongLoader(_skewed_triples(3), torch.randn(N, 4),
                          device=_DeviceModeFake(seed=1, max_delay_s=0.001),
                          cache_bytes=64, hot_ids=torch.tensor([3, 1]))
    assert good._cache is None  # nothing to cache: every row is on the device
    good.close()


def test_gather_modes_without_a_cache_say_so():
    with pytest.raises(ConfigError, match=r"gather='zerocopy' on a CUDA device.*'cpu'"):
        PingPongLoader(_skewed_triples(3), torch.randn(N, 4), cache_bytes=1024)


def test_a_dict_of_tables_is_refused():
    with pytest.raises(ConfigError, match="one feature tensor"):
        PingPongLoader(_skewed_triples(3), {"a": torch.randn(N, 4)}, device=_fake(),
                       cache_bytes=1024)


def test_the_cache_stats_exist_without_a_cache():
    """The stats keys exist even without a cache (dashboards read them)."""
    with PingPongLoader(_skewed_triples(4), torch.randn(N, 2)) as loader:
        stats = loader.stats
    for key in ("cache_rows", "cache_lookups", "cache_hits", "cache_hit_rate",
                "cache_bytes_saved"):
        assert stats[key] == 0


def test_read_only_ids_are_counted_without_a_warning(recwarn):
    features = torch.randn(N, 4)
    triples = _skewed_triples(5, count=4)
    read_only = []
    for inputs, outputs, blocks in triples:
        array = inputs.numpy().copy()
        array.setflags(write=False)
        read_only.append((array, outputs, blocks))
    with PingPongLoader(read_only, features, device=_fake(), cache_bytes=64 * 16) as loader:
        for _ in range(2):
            assert _run_epoch(loader, triples, features) == len(triples)
        assert loader.stats["cache_rows"] == 64
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_a_budget_larger_than_what_was_gathered_caches_only_rows_seen():
    features = torch.randn(N, 4)
    triples = [(torch.arange(10, 30), torch.arange(10, 12), None)] * 3  # 20 distinct rows
    device = _fake()
    with PingPongLoader(triples, features, device=device, cache_bytes=N * 16) as loader:
        for _ in range(2):
            assert _run_epoch(loader, triples, features) == 3
        stats = loader.stats
    assert stats["cache_rows"] == 20  # never-gathered rows are not cached
    assert stats["cache_hits"] == stats["cache_lookups"] == 60


def test_an_id_gathered_twice_in_a_batch_counts_twice():
    """Duplicates within a batch: each occurrence is a gathered row, so each is
    counted towards the hot rows, looked up and (when cached) a hit.  Row 5 is
    gathered three times in one batch, row 7 once in each of two: a cache of
    one row learns row 5 (counting each batch's distinct ids would pick row 7),
    and the stats count 5 lookups and 3 hits (not 3 and 1)."""
    features = torch.randn(N, 4)
    five, seven = torch.tensor([5, 5, 9, 5]), torch.tensor([7, 9])
    triples = [(five, five[:1], None), (seven, seven[:1], None), (seven, seven[:1], None)]
    device = _fake()
    # row 9 (three times, like row 5) loses the tie to the lower id
    with PingPongLoader(triples, features, device=device, cache_bytes=16) as loader:
        assert _run_epoch(loader, triples, features) == 3
        iter(loader).close()  # builds the cache
        device.synchronize()
        loader.reset_stats()
        hits_before = device.cache_hits
        assert _run_epoch(loader, triples, features) == 3
        stats = loader.stats
    (_rows, slot_of), = device._caches.values()
    assert np.flatnonzero(slot_of >= 0).tolist() == [5]
    assert stats["cache_rows"] == 1
    assert stats["cache_lookups"] == 8
    assert stats["cache_hits"] == 3 == device.cache_hits - hits_before
    assert stats["cache_bytes_saved"] == 3 * 16
