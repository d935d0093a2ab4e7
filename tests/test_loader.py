"""The core loader on the CPU: every batch equals the synchronous reference."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import make_triples, pingpong_threads, same_bits, wait_for_no_pingpong_threads

import pingpong
from pingpong import Batch, PingPongLoader

N = 500


def reference(features, labels, triple):
    inputs, outputs, blocks = triple
    if isinstance(features, dict):
        x = {k: v[inputs] for k, v in features.items()}
    else:
        x = features[inputs]
    return x, (labels[outputs] if labels is not None else None), blocks


def check_epoch(loader, source, features, labels) -> int:
    count = 0
    for batch, triple in zip(loader, source, strict=True):
        x_ref, y_ref, blocks = reference(features, labels, triple)
        assert isinstance(batch, Batch)
        assert batch.input_nodes is triple[0]
        assert batch.output_nodes is triple[1]
        assert batch.blocks is blocks
        if isinstance(x_ref, dict):
            assert set(batch.x) == set(x_ref)
            for key in x_ref:
                assert same_bits(batch.x[key], x_ref[key]), key
        else:
            assert isinstance(batch.x, torch.Tensor)
            assert same_bits(batch.x, x_ref)
        if y_ref is None:
            assert batch.y is None
        else:
            assert isinstance(batch.y, torch.Tensor)
            assert same_bits(batch.y, y_ref)
        count += 1
    return count


@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [
        (torch.float32, (16,)),
        (torch.float32, (3,)),
        (torch.float16, (7,)),
        (torch.bfloat16, (5,)),
        (torch.int8, (3,)),
        (torch.uint8, (1,)),
        (torch.int64, (2, 3)),
        (torch.float64, ()),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
@pytest.mark.parametrize("num_buffers", [2, 3])
def test_bit_identical_over_epochs(dtype, row_shape, num_buffers):
    gen = torch.Generator().manual_seed(1)
    features = (torch.randn((N, *row_shape), generator=gen) * 100).to(dtype)
    if dtype.is_floating_point:
        features.view(-1)[::17] = float("nan")
    labels = torch.randint(0, 7, (N,), generator=gen)
    source = make_triples(N, 12, last_out=5)
    with PingPongLoader(source, features, labels, num_buffers=num_buffers) as loader:
        for _ in range(3):
            assert check_epoch(loader, source, features, labels) == len(source)


def test_dict_features_and_no_labels():
    gen = torch.Generator().manual_seed(2)
    features = {"feat": torch.randn(N, 8, generator=gen), "pos": torch.randint(0, 9, (N, 3))}
    source = make_triples(N, 6)
    with PingPongLoader(source, features) as loader:
        assert check_epoch(loader, source, features, None) == 6


@pytest.mark.parametrize("row_shape", [(1,), (1, 1)], ids=["N-by-1", "N-by-1-by-1"])
def test_column_tables_whose_size_1_dims_have_odd_strides_are_read_in_place(row_shape):
    """``torch.tensor([values]).T`` is an (N, 1) table with strides (1, N), which
    torch calls contiguous: accepted, read where it lies, rows bit for bit."""
    features = (torch.arange(N, dtype=torch.float32) / 3).reshape(1, N).T.reshape(N, *row_shape)
    labels = torch.arange(N).reshape(1, N).T
    assert features.is_contiguous()
    assert features.stride()[-1] != 1
    assert labels.is_contiguous()
    assert labels.stride() == (1, N)
    source = make_triples(N, 4)
    with PingPongLoader(source, features, labels) as loader:
        for _epoch in range(2):
            assert check_epoch(loader, source, features, labels) == 4


def test_empty_and_partial_batches():
    features = torch.arange(N * 4, dtype=torch.float32).reshape(N, 4)
    labels = torch.arange(N)
    empty = torch.empty(0, dtype=torch.int64)
    source: list[tuple[torch.Tensor, torch.Tensor, list]] = [
        (torch.tensor([3, 1, 4]), torch.tensor([1]), []),
        (empty, empty, []),
        (torch.arange(200), torch.arange(64), []),
        (torch.tensor([499]), torch.tensor([0, 499]), []),
    ]
    with PingPongLoader(source, features, labels) as loader:
        batches = [b.clone() for b in loader]
    assert [tuple(b.x.shape) for b in batches] == [(3, 4), (0, 4), (200, 4), (1, 4)]
    for batch, triple in zip(batches, source, strict=True):
        assert torch.equal(batch.x, features[triple[0]])
        assert torch.equal(batch.y, labels[triple[1]])


def test_int32_ids_and_numpy_ids():
    features = torch.randn(N, 6)
    ids32 = torch.randint(0, N, (50,), dtype=torch.int32)
    ids_np = torch.randint(0, N, (40,)).numpy()
    source = [(ids32, ids32, None), (ids_np, ids_np, None)]
    with PingPongLoader(source, features, features[:, 0].clone()) as loader:
        out = [b.clone() for b in loader]
    assert torch.equal(out[0].x, features[ids32.long()])
    assert torch.equal(out[1].x, features[torch.from_numpy(ids_np)])
    assert torch.equal(out[1].y, features[torch.from_numpy(ids_np), 0])


def test_real_dgl_dataloader_shuffled(dgl):
    g = dgl.rand_graph(N, 4000)
    features = torch.randn(N, 12)
    labels = torch.randint(0, 4, (N,))
    sampler = dgl.dataloading.NeighborSampler([4, 3])
    source = dgl.dataloading.DataLoader(
        g, torch.arange(300), sampler, batch_size=64, shuffle=True, drop_last=False
    )
    with PingPongLoader(source, features, labels) as loader:
        assert len(loader) == len(source) == 5
        seen_orders = []
        for _ in range(3):
            order = []
            for batch in loader:
                assert torch.equal(batch.x, features[batch.input_nodes])
                assert torch.equal(batch.y, labels[batch.output_nodes])
                assert batch.blocks[0].num_src_nodes() == len(batch.input_nodes)
                assert batch.blocks[-1].num_dst_nodes() == len(batch.output_nodes)
                order.append(batch.output_nodes.clone())
            seeds = torch.cat(order)
            assert torch.equal(seeds.sort().values, torch.arange(300))
            seen_orders.append(seeds)
        assert not torch.equal(seen_orders[0], seen_orders[1])  # shuffled per epoch


def test_len_and_iteration_semantics():
    source = make_triples(N, 4)
    loader = PingPongLoader(source, torch.randn(N, 2))
    assert len(loader) == 4
    it = iter(loader)
    assert iter(it) is it
    assert sum(1 for _ in it) == 4
    with pytest.raises(StopIteration):
        next(it)
    loader.close()
    loader.close()  # idempotent
    assert loader.closed
    with pytest.raises(pingpong.LoaderClosedError):
        iter(loader)


def test_the_with_block_closes_the_loader_also_when_the_loop_raises():
    with PingPongLoader(make_triples(N, 3), torch.randn(N, 2)) as loader:
        assert not loader.closed
        assert sum(1 for _ in loader) == 3
    assert loader.closed
    with pytest.raises(pingpong.LoaderClosedError):
        iter(loader)
    with pytest.raises(ZeroDivisionError):
        with PingPongLoader(make_triples(N, 3), torch.randn(N, 2)) as other:
            it = iter(other)
            next(it)
            raise ZeroDivisionError
    assert other.closed
    with pytest.raises(pingpong.LoaderClosedError):
        next(it)  # the epoch ended with its loader


def test_a_closed_loader_starts_no_pass_of_its_source():
    """``iter()`` on a closed loader raises before any epoch starts: no producer,
    no ``iter(source)``, nothing counted."""
    passes: list[int] = []

    class Counting:
        def __iter__(self):
            passes.append(1)
            return iter(make_triples(N, 2))

    loader = PingPongLoader(Counting(), torch.randn(N, 2))
    loader.close()
    with pytest.raises(pingpong.LoaderClosedError):
        iter(loader)
    assert loader.stats["epochs"] == 0
    assert not [t for t in pingpong_threads() if t.name.startswith("pingpong-producer")]
    assert passes == []


def test_len_without_source_length():
    class NoLen:
        def __iter__(self):
            return iter(make_triples(N, 2))

    with PingPongLoader(NoLen(), torch.randn(N, 2)) as loader:
        with pytest.raises(TypeError, match="no len"):
            len(loader)
        assert sum(1 for _ in loader) == 2


def test_early_break_then_new_epoch():
    source = make_triples(N, 20)
    features = torch.randn(N, 5)
    with PingPongLoader(source, features) as loader:
        for i, _batch in enumerate(loader):
            if i == 3:
                break
        assert wait_for_no_pingpong_threads(2.0) == []
        assert check_epoch(loader, source, features, None) == 20


def test_reiterating_while_previous_epoch_runs():
    source = make_triples(N, 10)
    features = torch.randn(N, 5)
    with PingPongLoader(source, features) as loader:
        first = iter(loader)
        held = next(first)
        second = iter(loader)  # ends the first epoch, loudly
        with pytest.raises(pingpong.BatchExpiredError):
            held.record_stream(None)  # its slot is the new epoch's now
        with pytest.raises(pingpong.EpochSupersededError, match="after 1 batches"):
            next(first)
        with pytest.raises(pingpong.EpochSupersededError):
            next(first)  # and stays ended
        count = 0
        for batch, triple in zip(second, source, strict=True):
            assert torch.equal(batch.x, features[triple[0]])
            count += 1
        assert count == 10


def test_dropping_iterator_stops_producer():
    with PingPongLoader(make_triples(N, 50), torch.randn(N, 5)) as loader:
        it = iter(loader)
        next(it)
        assert pingpong_threads()
        del it
        gc.collect()
        assert wait_for_no_pingpong_threads(2.0) == []


def test_dropping_loader_stops_everything():
    loader = PingPongLoader(make_triples(N, 50), torch.randn(N, 5))
    it = iter(loader)
    next(it)
    del loader, it
    gc.collect()
    assert wait_for_no_pingpong_threads(2.0) == []


def test_dropping_loader_closes_the_device_it_owns():
    """The loader's finaliser closes it as ``close()`` would: a device given as
    ``device=`` is the loader's to close (on CUDA: pinned tables, streams)."""
    from pingpong.devices.fake import FakeAsyncDevice

    device = FakeAsyncDevice()
    loader = PingPongLoader(make_triples(N, 50), torch.randn(N, 5), device=device)
    it = iter(loader)
    next(it)
    del loader, it
    gc.collect()
    assert device.closed


def test_producer_runs_at_most_num_buffers_minus_one_ahead():
    pulled: list[int] = []

    class Counting:
        def __iter__(self):
            for i, triple in enumerate(make_triples(N, 10)):
                pulled.append(i)
                yield triple

    for num_buffers in (2, 4):
        pulled.clear()
        with PingPongLoader(Counting(), torch.randn(N, 3), num_buffers=num_buffers) as loader:
            it = iter(loader)
            next(it)  # the consumer holds batch 0's slot and does not release it
            # The producer fills the other num_buffers - 1 slots, then samples one
            # more item and blocks waiting for a free slot.
            expected = num_buffers + 1
            deadline = time.monotonic() + 2
            while len(pulled) < expected and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # give an over-eager producer time to overrun
            assert len(pulled) == expected
            it.close()


def test_stats_are_consistent():
    source = make_triples(N, 8)
    features = torch.randn(N, 10)
    labels = torch.randint(0, 3, (N,))
    with PingPongLoader(source, features, labels) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        stats = loader.stats
    rows = 2 * sum(len(t[0]) for t in source)
    label_rows = 2 * sum(len(t[1]) for t in source)
    assert stats["epochs"] == 2
    assert stats["batches"] == 16
    assert stats["rows_gathered"] == rows
    assert stats["bytes_gathered"] == rows * 40 + label_rows * 8
    for key in ("sample_s", "gather_s", "consumer_stall_s", "producer_busy_s", "wall_s"):
        assert stats[key] >= 0
    assert 0.0 <= stats["overlap_ratio"] <= 1.0
    assert stats["slot_bytes"] > 0
    assert stats["rss_bytes"] > 0
    # slots grow rarely: at most a few times each, never once per batch
    assert stats["slot_grows"] <= 2 * 2 * 3
    assert stats["slot_grows"] >= 2 * 2  # each slot's feature and label buffers, once
    for key in ("epochs", "batches", "rows_gathered", "bytes_gathered"):
        assert type(stats[key]) is int, key


def test_slot_stats_count_every_slot():
    """Same-sized batches through three slots: each buffer of each slot is
    allocated once, at the capacity its first batch asked for."""
    from pingpong.slots import grown_capacity

    source = [(torch.arange(i, i + 10), torch.arange(i, i + 4), None) for i in range(6)]
    with PingPongLoader(source, torch.randn(N, 4), torch.arange(N), num_buffers=3) as loader:
        assert sum(1 for _ in loader) == 6
        stats = loader.stats
    assert stats["slot_grows"] == 3 * 2
    assert stats["slot_bytes"] == 3 * (grown_capacity(10) * 16 + grown_capacity(4) * 8)


def test_rows_gathered_counts_each_node_once_however_many_tables():
    source = make_triples(N, 3)
    features = {"a": torch.randn(N, 2), "b": torch.randint(0, 9, (N, 3))}
    with PingPongLoader(source, features) as loader:
        assert sum(1 for _ in loader) == 3
        stats = loader.stats
    rows = sum(len(t[0]) for t in source)
    assert stats["rows_gathered"] == rows
    assert stats["bytes_gathered"] == rows * (2 * 4 + 3 * 8)


def test_reset_stats_zeroes_the_counters_and_restarts_the_clock():
    source = make_triples(N, 4)
    with PingPongLoader(source, torch.randn(N, 10), torch.arange(N)) as loader:
        assert sum(1 for _ in loader) == 4
        before = loader.stats
        assert before["batches"] == 4
        reset_at = time.perf_counter()
        loader.reset_stats()
        after = loader.stats
        assert after["wall_s"] <= time.perf_counter() - reset_at  # since the reset
        for key in ("epochs", "batches", "rows_gathered", "bytes_gathered", "sample_s",
                    "gather_s", "consumer_stall_s", "producer_busy_s"):
            assert after[key] == 0, key
        assert after["slot_bytes"] == before["slot_bytes"]  # memory held, not a counter
        assert after["slot_grows"] == before["slot_grows"]
        assert sum(1 for _ in loader) == 4  # the next epoch counts from zero
        again = loader.stats
    assert again["epochs"] == 1
    assert again["batches"] == 4
    assert again["rows_gathered"] == sum(len(t[0]) for t in source)


def test_overlap_ratio_is_clamped_to_0_and_1():
    """A loop that waited longer than the producer worked (threads started, the
    GIL) has an overlap of 0, not a negative one; one that never waited, 1."""
    stats = pingpong.stats.LoaderStats()
    stats.add(sample_s=0.1, gather_s=0.1, consumer_stall_s=0.5)
    assert stats.snapshot()["overlap_ratio"] == 0.0
    stats.reset()
    stats.add(sample_s=0.1, gather_s=0.1)
    assert stats.snapshot()["overlap_ratio"] == 1.0


@pytest.mark.parametrize("sample_ahead", [False, True])
def test_a_delivered_batch_is_already_counted(monkeypatch, sample_ahead):
    """``loader.stats`` read right after ``next()`` counts the batch it returned (the
    producer's counters used to be added after the hand-off, so they could lag a
    batch behind).  A slow ``Stats.add`` on the producer thread makes the old
    order visible every time."""
    real_add = pingpong.stats.LoaderStats.add

    def slow_on_the_producer(self: Any, **amounts: float) -> None:
        if "rows_gathered" in amounts:
            time.sleep(0.05)
        real_add(self, **amounts)

    monkeypatch.setattr(pingpong.stats.LoaderStats, "add", slow_on_the_producer)
    source = make_triples(N, 6)
    rows = 0
    with PingPongLoader(source, torch.randn(N, 4), sample_ahead=sample_ahead) as loader:
        for batch in loader:
            rows += len(batch.input_nodes)
            assert loader.stats["rows_gathered"] >= rows
    assert loader.stats["rows_gathered"] == rows


def test_slots_are_reused_not_reallocated():
    source = make_triples(N, 30, max_inputs=100)
    with PingPongLoader(source, torch.randn(N, 4)) as loader:
        for _ in loader:
            pass
        grows = loader.stats["slot_grows"]
        for _ in range(3):
            for _ in loader:
                pass
        assert loader.stats["slot_grows"] == grows


def test_batch_clone_survives_slot_reuse():
    """Four batches through two slots: batch 0's slot is refilled by batch 2.

    The un-cloned batch 0 is overwritten by then (so the test can tell), the
    clone is not.
    """
    features = torch.randn(N, 4)
    source = [(torch.arange(10 * i, 10 * i + 10), torch.arange(2), None) for i in range(4)]
    with PingPongLoader(source, features, num_buffers=2) as loader:
        it = iter(loader)
        first = next(it)
        kept = first.clone()
        for _ in it:
            pass
        assert torch.equal(first.x, features[20:30])  # the slot was reused by batch 2
    assert torch.equal(kept.x, features[:10])


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
@pytest.mark.parametrize("heterogeneous", [False, True], ids=["tensor", "dict"])
def test_a_copied_or_pickled_batch_owns_its_rows(how, heterogeneous):
    """As a clone: the fields only, ``x``/``y`` compact and unchanged by slot reuse."""
    features = torch.randn(N, 4)
    labels = torch.arange(N)
    source: list[Any] = [(torch.arange(10 * i, 10 * i + 10), torch.arange(2 * i, 2 * i + 2), None)
                         for i in range(4)]
    if heterogeneous:
        source = [({"n": i}, {"n": o}, b) for i, o, b in source]
    tables: Any = ({"n": features}, {"n": labels}) if heterogeneous else (features, labels)
    with PingPongLoader(source, *tables, num_buffers=2, heterogeneous=heterogeneous) as loader:
        it = iter(loader)
        first = next(it)
        kept = COPIES[how](first)
        for _ in it:
            pass
    assert type(kept) is Batch
    rows: Any = kept  # x and y are dicts by node type, or tensors
    x, y = (rows.x["n"], rows.y["n"]) if heterogeneous else (rows.x, rows.y)
    assert isinstance(x, torch.Tensor)
    assert isinstance(y, torch.Tensor)
    assert same_bits(x, features[:10])
    assert same_bits(y, labels[:2])
    assert x.untyped_storage().nbytes() == x.nbytes  # its own rows, not the whole slot
    assert kept._lease is None
    assert kept.record_stream(None) is kept  # nothing to release: it owns its memory


def _torch_round_trip(batch: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(batch, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
    "pickle": lambda batch: pickle.loads(pickle.dumps(batch)),
    "torch.save": _torch_round_trip,
}


def test_producer_cpu_counts_the_sources_cpu_not_its_waits():
    """``producer_cpu_s`` is the producer thread's CPU time: a source that computes
    adds its CPU (its last, empty step included); one that sleeps adds next to nothing."""

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    class Source:
        def __init__(self, work) -> None:
            self.work = work

        def __iter__(self):
            for item in make_triples(N, 4):
                self.work()
                yield item
            self.work()  # the step that ends the epoch costs too

    features = torch.randn(N, 4)
    with PingPongLoader(Source(lambda: burn(0.02)), features) as loader:
        assert sum(1 for _ in loader) == 4
        busy = loader.stats
    assert 5 * 0.02 <= busy["producer_cpu_s"] <= busy["wall_s"]
    with PingPongLoader(Source(lambda: time.sleep(0.02)), features) as loader:
        assert sum(1 for _ in loader) == 4
        idle = loader.stats
    assert idle["sample_s"] >= 4 * 0.02 * 0.9  # the ending step is not in sample_s
    assert idle["producer_cpu_s"] < 0.5 * idle["sample_s"]


def test_consumer_stall_s_counts_the_wait_in_next():
    """The source takes 1 s for its first item, after its ``iter()`` returned:
    the training loop waits about that long, in ``iter()`` and then in ``next()``."""

    class SlowFirstItem:
        def __iter__(self):
            time.sleep(1.0)  # runs at the first next(), not in iter()
            yield from make_triples(N, 2)

    with PingPongLoader(SlowFirstItem(), torch.randn(N, 4)) as loader:
        assert sum(1 for _ in loader) == 2
        stats = loader.stats
    # 1 s, less the moment between iter() returning and next() starting to wait
    # (generous: a loaded 2-core machine may not run the loop at once)
    assert stats["consumer_stall_s"] >= 0.5


def test_sample_s_counts_the_sources_iter():
    """A source whose ``iter()`` is slow (a DataLoader forking its workers) adds
    that wait to ``sample_s``, as it does to ``consumer_stall_s``."""

    class SlowStart:
        def __iter__(self):
            time.sleep(0.3)
            return iter(make_triples(N, 2))

    with PingPongLoader(SlowStart(), torch.randn(N, 4)) as loader:
        assert sum(1 for _ in loader) == 2
        stats = loader.stats
    assert stats["consumer_stall_s"] >= 0.3 * 0.9
    assert stats["sample_s"] >= 0.3 * 0.9
