"""The loader used the way people write training loops (issue: "no batch is ever lost silently").

Temporary loaders in ``for``/``enumerate``/``zip``/``next(iter(...))``,
nested loops over one loader, ``close()`` from another thread, unreadable
source items, finalisers on the producer thread, the slot lease -- and a
hypothesis state machine that mixes all of them on the CPU and the fake
asynchronous device, checking every delivered batch against the reference.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from conftest import wait_for_no_pingpong_threads
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_reliability import Expected, SeqSource, Verifier, batch_digest, fake, make_table
from test_reliability import seq_triples as make_seq_triples

import pingpong
from pingpong import PingPongLoader
from pingpong.devices import COMPLETED
from pingpong.devices.cpu import CPUDevice
from pingpong.devices.fake import FakeAsyncDevice
from pingpong.slots import Lease, make_slots
from pingpong.store import make_feature_store

N = 300
BATCHES = 7


def triples_and_tables(num_batches: int = BATCHES) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    return make_seq_triples(N, num_batches), make_table(N, (6,)), make_table(N, (), torch.int64)


def expect_batch(batch: Any, triples: list[Any], features: torch.Tensor, labels: Any) -> int:
    """Assert ``batch`` is exactly its triple's reference; return its seq number."""
    seq = batch.blocks["seq"]
    inputs, outputs, _ = triples[seq]
    assert torch.equal(batch.x, features[inputs])
    if labels is not None:
        assert torch.equal(batch.y, labels[outputs])
    return int(seq)


# -- temporary loaders ---------------------------------------------------------------
@pytest.mark.parametrize("device_kind", ["cpu", "fake"])
def test_temporary_loader_in_a_for_loop_delivers_every_batch(device_kind):
    """The iterator keeps its loader alive: found delivering 0 batches, silently."""
    triples, features, labels = triples_and_tables()
    device = fake(seed=1) if device_kind == "fake" else "cpu"
    verifier = Verifier(device, Expected(features, labels, triples))
    seqs: list[int] = []
    for batch in PingPongLoader(SeqSource(triples, shuffle=False), features, labels,
                                device=device):
        if not seqs:
            gc.collect()  # nothing but the iterator holds the loader
        seqs.append(batch.blocks["seq"])
        verifier.submit(batch)
    verifier.resolve()
    assert seqs == list(range(BATCHES))
    assert (verifier.checked, verifier.corrupted) == (BATCHES, 0)
    gc.collect()
    assert wait_for_no_pingpong_threads(3.0) == []
    if isinstance(device, FakeAsyncDevice):
        assert device.closed  # the loader owned it and closed it once unreachable


def test_temporary_loader_with_enumerate_zip_and_next():
    triples, features, labels = triples_and_tables()

    def loader() -> PingPongLoader:
        return PingPongLoader(SeqSource(triples, shuffle=False), features, labels)

    seen = [(i, expect_batch(b, triples, features, labels)) for i, b in enumerate(loader())]
    assert seen == [(i, i) for i in range(BATCHES)]
    pairs = [(k, expect_batch(b, triples, features, labels))
             for k, b in zip(range(3), loader(), strict=False)]
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    first = next(iter(loader()))
    gc.collect()
    # the epoch ended when its iterator was dropped, but nothing refills the slot
    assert expect_batch(first, triples, features, labels) == 0
    assert len(list(loader())) == BATCHES
    gc.collect()
    assert wait_for_no_pingpong_threads(3.0) == []


def test_nested_loops_over_one_loader_raise_instead_of_truncating():
    triples, features, labels = triples_and_tables()
    with PingPongLoader(SeqSource(triples, shuffle=False), features, labels) as loader:
        outer = []
        with pytest.raises(pingpong.EpochSupersededError, match="after 2 batches"):
            for batch in loader:
                outer.append(expect_batch(batch, triples, features, labels))
                if len(outer) == 2:
                    inner = [expect_batch(b, triples, features, labels) for b in loader]
                    assert inner == list(range(BATCHES))
        assert outer == [0, 1]
        # the loader goes on normally afterwards
        assert [expect_batch(b, triples, features, labels) for b in loader] == list(range(BATCHES))


def test_zip_of_a_loader_with_itself_raises():
    triples, features, _ = triples_and_tables()
    with PingPongLoader(SeqSource(triples, shuffle=False), features) as loader:
        with pytest.raises(pingpong.EpochSupersededError):
            for _pair in zip(loader, loader, strict=False):
                pass


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_loader_cannot_be_copied_or_pickled_and_the_refusal_says_so(how):
    """``copy.copy`` used to return a second loader sharing the first one's producer and
    slots (closing one closed both); deepcopy and pickle failed on a lock. All three
    are refused by name, and the loader goes on working."""
    import copy
    import pickle

    triples, features, _ = triples_and_tables()
    copiers: dict[str, Any] = {"copy": copy.copy, "deepcopy": copy.deepcopy,
                               "pickle": pickle.dumps}
    copier = copiers[how]
    with PingPongLoader(SeqSource(triples, shuffle=False), features) as loader:
        with pytest.raises(TypeError, match="PingPongLoader cannot be pickled or copied"):
            copier(loader)
        for batch, (input_nodes, _, _) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[input_nodes])


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_an_epoch_iterator_cannot_be_copied_and_its_epoch_goes_on(how):
    """``copy.copy(iter(loader))`` returned a second iterator over the same epoch;
    dropping it ended the epoch, and the original then stopped early with a plain
    ``StopIteration`` (found by a lifecycle review). Copying is refused by name, and
    the epoch delivers every batch."""
    import copy
    import pickle

    triples, features, _ = triples_and_tables()
    copiers: dict[str, Any] = {"copy": copy.copy, "deepcopy": copy.deepcopy,
                               "pickle": pickle.dumps}
    with PingPongLoader(SeqSource(triples, shuffle=False), features) as loader:
        batches = iter(loader)
        first = next(batches)
        assert torch.equal(first.x, features[triples[0][0]])
        with pytest.raises(pingpong.ConfigError, match="iterator cannot be copied"):
            copiers[how](batches)
        gc.collect()
        for batch, (input_nodes, _, _) in zip(batches, triples[1:], strict=True):
            assert torch.equal(batch.x, features[input_nodes])


# -- close() from another thread -------------------------------------------------------
class GatedSource:
    """Yields ``triples``; item ``stall_at`` waits until ``gate`` opens (a stalled sampler)."""

    def __init__(self, triples: list[Any], stall_at: int) -> None:
        self.triples = triples
        self.stall_at = stall_at
        self.gate = threading.Event()

    def __len__(self) -> int:
        return len(self.triples)

    def __iter__(self) -> Any:
        for i, triple in enumerate(self.triples):
            if i == self.stall_at:
                self.gate.wait(30)
            yield triple


@pytest.mark.parametrize("device_kind", ["cpu", "fake"])
@pytest.mark.parametrize("what", ["loader", "iterator"])
def test_close_from_another_thread_ends_a_waiting_next_promptly(what, device_kind):
    """Found surfacing after 2 s as ProducerDiedError; now LoaderClosedError at once
    (or StopIteration for the iterator's own close)."""
    triples, features, _ = triples_and_tables()
    source = GatedSource(triples, stall_at=2)
    device = fake(seed=2) if device_kind == "fake" else "cpu"
    loader = PingPongLoader(source, features, device=device)
    it = iter(loader)
    next(it), next(it)
    closer = threading.Timer(0.3, loader.close if what == "loader" else it.close)
    closer.start()
    start = time.monotonic()
    expected = pingpong.LoaderClosedError if what == "loader" else StopIteration
    with pytest.raises(expected):
        next(it)  # blocks: the source stalls at item 2
    waited = time.monotonic() - start
    source.gate.set()
    closer.join()
    assert 0.25 <= waited < 1.0
    with pytest.raises(expected):
        next(it)  # stays ended
    loader.close()


# -- one pass of the source per iter(loader) ---------------------------------------------
class PassCountingSource:
    """Yields ``triples``; counts the calls of ``__iter__``, which first waits for
    ``gate`` (a source slow to start: DataLoader workers spawning) or raises
    ``iter_error``."""

    def __init__(self, triples: list[Any]) -> None:
        self.triples = triples
        self.passes = 0
        self.gate = threading.Event()
        self.gate.set()
        self.iter_error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.triples)

    def __iter__(self) -> Any:
        self.passes += 1
        self.gate.wait(30)
        if self.iter_error is not None:
            raise self.iter_error
        return iter(self.triples)


def test_every_iter_of_the_loader_is_one_pass_of_the_source():
    """Found: an iterator superseded before its producer started never called
    ``iter(source)``, so a source counting its passes (BuiltinLoader's epoch) saw
    fewer than the plain loop did, depending on timing (2 of 20 runs)."""
    triples, features, labels = triples_and_tables()
    source = PassCountingSource(triples)
    with PingPongLoader(source, features, labels) as loader:
        for made in range(1, 41):
            iter(loader)  # made and dropped unused, superseded by the next
            assert source.passes == made
        assert [expect_batch(b, triples, features, labels) for b in loader] == list(
            range(BATCHES))
        assert source.passes == 41


def test_superseded_iterators_leave_the_builtin_loaders_epochs_as_the_plain_loops():
    """``it1 = iter(loader); it2 = iter(loader)``: ``it2`` is the source's second pass
    (epoch 1), bit for bit, every time."""
    from pingpong.sources import BuiltinLoader, CSRGraph, NeighborSampler

    rng = np.random.default_rng(0)
    graph = CSRGraph.from_edges(rng.integers(0, N, 2000), rng.integers(0, N, 2000), N)
    features = make_table(N, (6,))

    def sampler_loader() -> BuiltinLoader:
        return BuiltinLoader(graph, torch.arange(N), NeighborSampler([3]), batch_size=64,
                             shuffle=True, seed=7)

    plain = sampler_loader()
    iter(plain)
    second_pass = list(plain)
    for _ in range(10):
        with PingPongLoader(sampler_loader(), features) as loader:
            _first = iter(loader)
            for batch, (inputs, outputs, blocks) in zip(loader, second_pass, strict=True):
                assert torch.equal(batch.input_nodes, inputs)
                assert torch.equal(batch.output_nodes, outputs)
                assert len(batch.blocks) == len(blocks)
                for got, want in zip(batch.blocks, blocks, strict=True):
                    assert (got.num_src_nodes, got.num_dst_nodes) == (
                        want.num_src_nodes, want.num_dst_nodes)
                    assert torch.equal(got.src, want.src)
                    assert torch.equal(got.dst, want.dst)
                assert torch.equal(batch.x, features[inputs])  # before the slot is reused


def test_iter_waits_for_a_slow_source_start_and_honours_timeout():
    triples, features, labels = triples_and_tables()
    source = PassCountingSource(triples)
    source.gate.clear()  # iter(source) blocks
    with PingPongLoader(source, features, labels, timeout=0.5) as loader:
        start = time.monotonic()
        try:
            with pytest.raises(pingpong.BatchTimeoutError, match="source's iter"):
                iter(loader)
            assert 0.45 <= time.monotonic() - start < 2.0
        finally:
            source.gate.set()
        assert [expect_batch(b, triples, features, labels) for b in loader] == list(
            range(BATCHES))
    assert source.passes == 2


def test_close_from_another_thread_ends_an_iter_waiting_for_the_source():
    triples, features, _ = triples_and_tables()
    source = PassCountingSource(triples)
    source.gate.clear()
    loader = PingPongLoader(source, features)
    closer = threading.Timer(0.3, loader.close)
    closer.start()
    start = time.monotonic()
    try:
        it = iter(loader)  # waits for iter(source), until the close
        waited = time.monotonic() - start
    finally:
        source.gate.set()  # before the join: close() waits for the producer
        closer.join()
    assert 0.25 <= waited < 1.5
    with pytest.raises(pingpong.LoaderClosedError):
        next(it)


def test_a_timer_that_holds_the_last_reference_to_a_loader_leaves_no_phantom_thread():
    """From a GraphBolt review: ``threading.Timer(t, loader.close).start()`` with the
    loader dropped meanwhile -- the timer thread frees it as it exits, after threading
    stopped listing it. pingpong asked ``threading.current_thread()`` there, which
    registered a ``_DummyThread`` for the exiting thread: it stayed in
    ``threading.enumerate()`` (and ``active_count()``) for good, 11 of 40 loaders."""
    triples, features, _ = triples_and_tables()
    before = threading.active_count()
    for i in range(30):
        loader = PingPongLoader(SeqSource(triples, shuffle=False), features)
        threading.Timer(0.002 * (i % 10), loader.close).start()  # not kept: it holds the last
        try:
            for _ in loader:
                time.sleep(0.001)
        except pingpong.LoaderClosedError:
            pass
        del loader
    deadline = time.monotonic() + 10
    while any(type(t) is threading.Timer for t in threading.enumerate()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    wait_for_no_pingpong_threads()
    assert [t.name for t in threading.enumerate() if t.name.startswith("Dummy")] == []
    assert threading.active_count() == before


def test_a_health_check_failing_while_iter_waits_for_the_source_is_raised_by_iter():
    triples, features, _ = triples_and_tables()
    source = PassCountingSource(triples)
    source.gate.clear()
    calls = []

    def health_check() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise ConnectionError("server 1 gone")

    with PingPongLoader(source, features, health_check=health_check) as loader:
        try:
            with pytest.raises(ConnectionError, match="server 1 gone"):
                iter(loader)
        finally:
            source.gate.set()


def test_what_iter_source_raises_comes_out_of_the_first_next():
    triples, features, _ = triples_and_tables()
    source = PassCountingSource(triples)
    source.iter_error = ValueError("workers failed to start")
    with PingPongLoader(source, features, timeout=5) as loader:
        it = iter(loader)
        with pytest.raises(ValueError, match="workers failed to start"):
            next(it)
        source.iter_error = StopIteration()  # not the end of a pass: PEP 479's rule
        with pytest.raises(RuntimeError, match=r"the source's iter\(\)") as raised:
            next(iter(loader))
        assert isinstance(raised.value.__cause__, StopIteration)
        source.iter_error = None
        assert len(list(loader)) == BATCHES


@pytest.mark.parametrize("where", ["Thread.start", "after Epoch.start"])
def test_ctrl_c_once_the_producer_runs_leaves_no_orphan(monkeypatch, where):
    """``Thread.start()`` waits in Python code for the new thread, so a Ctrl-C can
    land there after the producer runs -- or just after, before ``iter()`` returns.
    Found (user-style SIGINT storm; a review found the second window): that
    producer was held by nothing, ran on after ``close()`` and refilled slots
    under later epochs' held batches.  The signal is simulated where it lands."""
    from pingpong._epoch import Epoch

    triples, features, labels = triples_and_tables(12)
    source = SeqSource(triples, shuffle=False)
    source.delay_s = 0.05  # the orphan would still be mid-pass during the next epoch
    owner, name = (threading.Thread, "start") if where == "Thread.start" else (Epoch, "start")
    real_start = getattr(owner, name)

    def start_then_ctrl_c(self: Any) -> None:
        real_start(self)
        if where != "Thread.start" or self.name.startswith("pingpong-producer"):
            monkeypatch.setattr(owner, name, real_start)
            raise KeyboardInterrupt

    loader = PingPongLoader(source, features, labels, num_buffers=2)
    monkeypatch.setattr(owner, name, start_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    source.delay_s = 0.0
    seen = []
    for batch in loader:
        time.sleep(0.03)  # a training step, while an orphan would refill the slot
        seen.append(expect_batch(batch, triples, features, labels))
    assert seen == list(range(12))
    loader.close()
    assert wait_for_no_pingpong_threads() == []


# -- bad items ---------------------------------------------------------------------------
class CountingCPUDevice(CPUDevice):
    def __init__(self) -> None:
        super().__init__(1)
        self.gathers = 0

    def gather(self, table: Any, ids: np.ndarray, out: torch.Tensor) -> None:
        self.gathers += 1
        super().gather(table, ids, out)


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ({"input_nodes": torch.arange(3)}, "dict"),
        ((torch.arange(3), torch.arange(2)), "tuple of length 2"),
        (torch.arange(3), "Tensor"),
    ],
)
def test_an_unreadable_item_is_a_pingpong_error_before_any_row_is_read(item, named):
    device = CountingCPUDevice()
    with PingPongLoader([item], torch.randn(N, 2), device=device) as loader:
        with pytest.raises(pingpong.BatchFormError, match=named) as info:
            next(iter(loader))
    assert isinstance(info.value, pingpong.PingPongError)
    assert isinstance(info.value, TypeError)
    assert device.gathers == 0


# -- finalisers on the producer thread ---------------------------------------------------
class CloseOrderDevice(CPUDevice):
    """Records any gather that runs after close(); the first gather of batch 1 runs
    the garbage collector on the producer thread once the test dropped everything."""

    def __init__(self) -> None:
        super().__init__(1)
        self.closed = False
        self.after_close: list[str] = []
        self.dropped = threading.Event()
        self.collected_on: list[str] = []
        self.calls = 0

    def gather(self, table: Any, ids: np.ndarray, out: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 3:  # batch 1's feature gather (batch 0: features + labels)
            self.dropped.wait(10)
            gc.collect()  # collects the loader and its iterator, here
            self.collected_on.append(threading.current_thread().name)
        if self.closed:
            self.after_close.append(threading.current_thread().name)
        super().gather(table, ids, out)

    def close(self) -> None:
        self.closed = True
        super().close()


def test_a_finaliser_on_the_producer_thread_never_closes_the_device_under_it():
    """Found: a GC pass on the producer thread closed the device mid-fill (on CUDA:
    unpinned the tables while a zero-copy kernel could still be launched)."""
    triples, features, labels = triples_and_tables()
    device = CloseOrderDevice()
    gc.disable()
    try:
        loader = PingPongLoader(SeqSource(triples, shuffle=False), features, labels,
                                device=device)
        cycle: dict[str, Any] = {"loader": loader, "it": iter(loader)}
        cycle["self"] = cycle  # only the garbage collector can free them
        batch = next(cycle["it"])
        producer = next(t for t in threading.enumerate() if t.name.startswith("pingpong-prod"))
        del loader, cycle, batch
        device.dropped.set()
        producer.join(5)
        assert not producer.is_alive()
    finally:
        gc.enable()
    assert device.collected_on
    assert device.collected_on[0].startswith("pingpong-producer")
    assert wait_for_no_pingpong_threads(3.0) == []
    assert device.closed  # by a closer thread, once the producer had left
    assert device.after_close == []


# -- the slot lease -------------------------------------------------------------------------
class StreamLog(CPUDevice):
    """Logs which "streams" waited for a batch and were recorded on at release."""

    def __init__(self) -> None:
        super().__init__(1)
        self.log: list[tuple[str, Any]] = []
        self.interrupt_on: Any = None

    def resolve_consumer_stream(self, stream: Any = None) -> Any:
        return "current" if stream is None else stream

    def consumer_wait(self, event: Any, stream: Any = None) -> Any:
        used = self.resolve_consumer_stream(stream)
        self.log.append(("wait", used))
        if used == self.interrupt_on:
            raise KeyboardInterrupt  # a Ctrl-C once the stream waits for the batch
        return used

    def consumer_record(self, stream: Any = None) -> Any:
        self.log.append(("record", stream))
        return ("released-on", stream)


def test_a_lease_releases_on_every_stream_the_batch_was_used_on():
    device = StreamLog()
    store = make_feature_store(torch.zeros(4, 2))
    (slot,) = make_slots(store, 1, "initial")
    lease = Lease(slot, device, COMPLETED)
    lease.use_on(None)
    lease.use_on("side")
    lease.use_on("side")  # twice: one release event still
    assert lease.end() == (("released-on", "current"), ("released-on", "side"))
    assert lease.end() is None  # once only
    with pytest.raises(pingpong.BatchExpiredError):
        lease.use_on("late")
    assert [entry for entry in device.log if entry[0] == "record"] == [
        ("record", "current"), ("record", "side")]


def test_a_ctrl_c_inside_use_on_still_holds_the_slot_on_that_stream():
    """A Ctrl-C that lands once the stream waits for the batch, before ``use_on``
    returns: the stream may already run work on the batch, so the slot must not
    go back to the producer before that work is done -- ``end()`` records a
    release event on it too."""
    device = StreamLog()
    store = make_feature_store(torch.zeros(4, 2))
    (slot,) = make_slots(store, 1, "initial")
    lease = Lease(slot, device, COMPLETED)
    lease.use_on(None)
    device.interrupt_on = "side"
    with pytest.raises(KeyboardInterrupt):
        lease.use_on("side")
    assert ("wait", "side") in device.log
    assert lease.end() == (("released-on", "current"), ("released-on", "side"))


class ResolvesOnlyInWait(CPUDevice):
    """A device of a user's own written before ``resolve_consumer_stream``: its
    ``consumer_wait`` says which stream ``None`` meant."""

    def __init__(self) -> None:
        super().__init__(1)
        self.recorded: list[Any] = []

    def consumer_wait(self, event: Any, stream: Any = None) -> Any:
        return "current" if stream is None else stream

    def consumer_record(self, stream: Any = None) -> Any:
        self.recorded.append(stream)
        return COMPLETED


def test_a_device_that_resolves_the_stream_only_in_its_wait_is_released_there():
    """From a review: the lease held only ``resolve_consumer_stream``'s answer (the
    base class's: ``None``), so such a device got its release event on whatever
    stream was current at the release, not on the one that waited."""
    device = ResolvesOnlyInWait()
    store = make_feature_store(torch.zeros(4, 2))
    (slot,) = make_slots(store, 1, "initial")
    lease = Lease(slot, device, COMPLETED)
    lease.use_on(None)
    lease.end()
    assert "current" in device.recorded


def test_batch_record_stream_goes_through_the_lease_until_the_next_batch():
    triples, features, _ = triples_and_tables()
    device = StreamLog()
    with PingPongLoader(SeqSource(triples, shuffle=False), features, device=device) as loader:
        it = iter(loader)
        first = next(it)
        assert first.record_stream("side") is first
        assert ("wait", "side") in device.log
        second = next(it)
        releases = [entry for entry in device.log if entry[0] == "record"]
        assert releases == [("record", "current"), ("record", "side")]
        with pytest.raises(pingpong.BatchExpiredError):
            first.record_stream("other")
        assert second.clone().record_stream("other") is not None  # a clone owns its memory
        it.close()


def test_a_batch_replaced_field_by_field_keeps_its_slot_lease():
    """From a code review: ``batch._replace(...)`` (the named-tuple idiom, to move
    ``blocks`` say) returned a batch without the slot lease while its ``x`` was
    still the slot's view, so its ``record_stream`` neither waited for the batch
    nor held the slot, and raised nothing once the slot was handed back."""
    triples, features, _ = triples_and_tables()
    device = StreamLog()
    with PingPongLoader(SeqSource(triples, shuffle=False), features, device=device) as loader:
        it = iter(loader)
        first = next(it)
        moved = first._replace(blocks=["moved"])
        assert type(moved) is type(first)
        assert moved.blocks == ["moved"]
        assert moved.x is first.x
        assert moved.record_stream("side") is moved
        assert ("wait", "side") in device.log
        assert moved.clone()._lease is None
        next(it)
        releases = [entry for entry in device.log if entry[0] == "record"]
        assert releases == [("record", "current"), ("record", "side")]
        with pytest.raises(pingpong.BatchExpiredError):
            moved.record_stream("other")
        with pytest.raises(pingpong.BatchExpiredError):
            moved.clone()
        it.close()


def test_a_failing_consumer_wait_ends_the_epoch_instead_of_skipping_a_batch():
    """Found: the slot whose wait raised was never handed back, and the batch was lost."""
    triples, features, _ = triples_and_tables()
    device = fake(seed=4)
    with PingPongLoader(SeqSource(triples, shuffle=False), features, device=device) as loader:
        it = iter(loader)
        next(it)
        device.inject_fault("consumer_wait", 1, lambda: RuntimeError("stream broke"))
        with pytest.raises(RuntimeError, match="stream broke"):
            next(it)
        with pytest.raises(pingpong.EpochFailedError, match="stream broke"):
            next(it)  # no later batch is delivered as if nothing happened
        device.clear_faults()
        verifier = Verifier(device, Expected(features, None, triples))
        for batch in loader:
            verifier.submit(batch)
        verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (BATCHES, 0)


# -- every pattern, in any order -----------------------------------------------------------
class UsagePatterns(RuleBasedStateMachine):
    """create / iter / next / break / nested iter / close (also from another thread) /
    drop the loader / drop the iterator / GC, on the CPU and the fake device.

    The model tracks what each iterator must do next; every delivered batch is
    checked against the synchronous reference (on the fake device by reads
    queued on its consumer stream), and none may be skipped or repeated.
    """

    def __init__(self) -> None:
        super().__init__()
        self.triples, self.features, self.labels = triples_and_tables(5)
        self.expected = Expected(self.features, self.labels, self.triples)
        self.loaders: list[dict[str, Any]] = []  # {"loader": ..., "verifier": ...}
        self.iterators: list[dict[str, Any]] = []  # {"it", "owner", "state", "pos", "thread"}
        self.dropped_producers: list[threading.Thread] = []  # dropped iterators' producers
        self.verifiers: list[Verifier] = []
        self.seed = 0

    # -- model helpers
    @staticmethod
    def _pick(data: st.DataObject, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """Draw an index, not the entry: hypothesis keeps what it draws for its
        report, and a drawn loader would stay alive until the example ends."""
        return entries[data.draw(st.integers(0, len(entries) - 1))]

    def _open_loaders(self) -> list[dict[str, Any]]:
        return [entry for entry in self.loaders if not entry["dropped"]]

    def _running(self, owner: dict[str, Any]) -> list[dict[str, Any]]:
        return [i for i in self.iterators if i["owner"] is owner and i["state"] == "running"]

    @precondition(lambda self: len(self.loaders) < 2)
    @rule(on_fake=st.booleans(), num_buffers=st.integers(2, 3), sample_ahead=st.booleans(),
          pin_producer=st.booleans())
    def create(self, on_fake: bool, num_buffers: int, sample_ahead: bool,
               pin_producer: bool) -> None:
        self.seed += 1
        device = fake(seed=self.seed, max_delay_s=0.001) if on_fake else "cpu"
        # producer_cpus: one CPU of those this thread may use (Linux), or none
        cpus = (sorted(os.sched_getaffinity(0))[-1:]
                if pin_producer and hasattr(os, "sched_getaffinity") else None)
        loader = PingPongLoader(SeqSource(self.triples, shuffle=False), self.features,
                                self.labels, device=device, num_buffers=num_buffers, timeout=20,
                                sample_ahead=sample_ahead, producer_cpus=cpus)
        verifier = Verifier(device, self.expected)
        self.verifiers.append(verifier)
        self.loaders.append({"loader": loader, "verifier": verifier, "dropped": False})

    @precondition(lambda self: any(not entry["dropped"] for entry in self.loaders))
    @rule(data=st.data())
    def start_epoch(self, data: st.DataObject) -> None:
        owner = self._pick(data, self._open_loaders())
        for older in self._running(owner):
            older["state"] = "superseded"
        it = iter(owner["loader"])
        self.iterators.append({"it": it, "owner": owner, "state": "running", "pos": 0,
                               "thread": it._epoch.thread})

    @precondition(lambda self: bool(self.iterators))
    @rule(data=st.data(), steps=st.integers(1, 4))
    def advance(self, data: st.DataObject, steps: int) -> None:
        entry = self._pick(data, self.iterators)
        for _ in range(steps):
            state = entry["state"]
            if state == "running" and entry["pos"] < len(self.triples):
                batch = next(entry["it"])
                assert batch.blocks["seq"] == entry["pos"], "a batch was skipped or repeated"
                entry["owner"]["verifier"].submit(batch)
                entry["pos"] += 1
                continue
            error = {
                "running": StopIteration,
                "done": StopIteration,
                "closed": StopIteration,
                "superseded": pingpong.EpochSupersededError,
                "loader closed": pingpong.LoaderClosedError,
            }[state]
            with pytest.raises(error):
                next(entry["it"])
            if state == "running":
                entry["state"] = "done"

    @precondition(lambda self: bool(self.iterators))
    @rule(data=st.data())
    def close_iterator(self, data: st.DataObject) -> None:
        entry = self._pick(data, self.iterators)
        entry["it"].close()
        if entry["state"] == "running":
            entry["state"] = "closed"

    @precondition(lambda self: bool(self.iterators))
    @rule(data=st.data(), collect=st.booleans())
    def drop_iterator(self, data: st.DataObject, collect: bool) -> None:
        """``break`` without keeping the iterator (or ``del it``)."""
        entry = self._pick(data, self.iterators)
        self.iterators.remove(entry)
        self.dropped_producers.append(entry["thread"])  # it stops, but asynchronously
        del entry["it"]
        if collect:
            gc.collect(0)  # young generation only: a full pass costs ~0.2 s here

    @precondition(lambda self: any(not entry["dropped"] for entry in self.loaders))
    @rule(data=st.data(), other_thread=st.booleans())
    def close_loader(self, data: st.DataObject, other_thread: bool) -> None:
        owner = self._pick(data, self._open_loaders())
        if other_thread:
            closer = threading.Thread(target=owner["loader"].close)
            closer.start()
            closer.join(10)
            assert not closer.is_alive()
        else:
            owner["loader"].close()
        for entry in self._running(owner):
            entry["state"] = "loader closed"
        owner["dropped"] = True  # closed: no new epochs (iter raises; tested elsewhere)
        with pytest.raises(pingpong.LoaderClosedError):
            iter(owner["loader"])

    @precondition(lambda self: any(not entry["dropped"] for entry in self.loaders))
    @rule(data=st.data())
    def drop_loader(self, data: st.DataObject) -> None:
        """Keep only the iterators: they must go on working (a temporary loader)."""
        owner = self._pick(data, self._open_loaders())
        owner["dropped"] = True
        owner["loader"] = None

    @rule()
    def collect_garbage(self) -> None:
        gc.collect(1)

    @invariant()
    def producers_only_of_running_epochs(self) -> None:
        # finished, superseded, closed and failed epochs were retired: their
        # producers were joined (dropped iterators' producers stop too, but
        # asynchronously)
        producers = [t for t in threading.enumerate() if t.name.startswith("pingpong-producer")]
        may_run = {entry["thread"] for entry in self.iterators if entry["state"] == "running"}
        strays = [t.name for t in producers
                  if t not in may_run and t not in self.dropped_producers]
        assert strays == [], [(e["state"], e["thread"].name) for e in self.iterators]

    def teardown(self) -> None:
        while self.iterators:  # no loop variable may keep the last one alive
            self.iterators.pop()["it"].close()
        while self.loaders:
            loader = self.loaders.pop()["loader"]
            if loader is not None:
                loader.close()
            del loader
        gc.collect()
        for verifier in self.verifiers:
            verifier.resolve()
            assert verifier.corrupted == 0
        assert wait_for_no_pingpong_threads(5.0) == []


test_usage_patterns_state_machine = UsagePatterns.TestCase
test_usage_patterns_state_machine.settings = settings(
    # Fewer for mutation runs (docs/reliability.md, "Mutation testing").
    max_examples=int(os.environ.get("PINGPONG_STATE_MACHINE_EXAMPLES", "60")),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_state_machine_reads_what_the_batch_held():
    """The machine's verifier compares to the reference (a sanity check of the check)."""
    triples, features, labels = triples_and_tables(2)
    with PingPongLoader(SeqSource(triples, shuffle=False), features, labels) as loader:
        batch = next(iter(loader))
        assert batch_digest(batch) == (Expected(features, labels, triples).x[0],
                                       Expected(features, labels, triples).y[0])


class Trainer:
    """A user's trainer that keeps its loader and hands it one of its own: a bound
    method as ``health_check`` or ``form=``, or a source or a row source that
    refers back to it."""

    def __init__(self, link: str, device: Any, source: Any = None) -> None:
        triples, table, labels = triples_and_tables()
        self.checks = 0
        features: Any = table
        items: Any = triples if source is None else source
        kwargs: dict[str, Any] = {}
        if link == "health_check":
            kwargs["health_check"] = self.check
        elif link == "form":
            items = [{"nodes": i, "seeds": o} for i, o, _b in triples]
            kwargs["form"] = self.read
        elif link == "row source":
            features = TrainerRows(self, table)
        else:  # "source"
            items = TrainerSource(self, triples)
        self.loader = PingPongLoader(items, features, labels, device=device, **kwargs)

    def check(self) -> None:
        self.checks += 1

    def read(self, item: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return item["nodes"], item["seeds"]


class TrainerRows:
    """A row source of the trainer's (shape, dtype, [ids]) that refers back to it."""

    def __init__(self, trainer: Trainer, table: torch.Tensor) -> None:
        self.trainer, self.table = trainer, table
        self.shape, self.dtype = tuple(table.shape), table.dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


class TrainerSource:
    def __init__(self, trainer: Trainer, triples: list[Any]) -> None:
        self.trainer, self.triples = trainer, triples

    def __iter__(self) -> Any:
        return iter(self.triples)

    def __len__(self) -> int:
        return len(self.triples)


@pytest.mark.parametrize("end", ["epoch", "break", "close"])
@pytest.mark.parametrize("link", ["health_check", "form", "source", "row source"])
def test_a_loader_reached_from_what_it_was_given_is_freed_with_its_owner(link, end):
    """From a lifecycle probe: the loader's finaliser held the callables that start
    an epoch (the source, the form, the health check), and a finaliser's arguments
    live as long as it is armed -- so a loader reachable from one of them (a
    trainer that keeps ``self.loader`` and passes ``self.check``) was never freed,
    even after ``close()``: its slots, its device (on the fake device, two worker
    threads) and the whole trainer stayed for the life of the process, one more
    per trainer built.  Dropped, the trainer now takes its loader with it."""
    device = fake(seed=2, max_delay_s=0.0)
    trainer = Trainer(link, device)
    batches = 0
    for batch in trainer.loader:
        assert batch.x.shape[1] == 6
        batches += 1
        if end == "break":
            break
    if end == "close":
        trainer.loader.close()
    assert batches == (1 if end == "break" else BATCHES)
    loader = weakref.ref(trainer.loader)
    del trainer, batch
    # After a break the producer may still be on its way out (the epoch ended, not
    # retired): until it has left, its arguments reach the trainer.
    deadline = time.monotonic() + 5.0
    while gc.collect() is not None and loader() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loader() is None
    assert device.closed
    assert wait_for_no_pingpong_threads(5.0) == []


def test_a_trainer_is_freed_while_its_producer_is_still_inside_the_source():
    """From a probe of the GraphBolt path: after a ``break``, a trainer that passed
    ``health_check=self.check`` stayed alive until the producer left the source (a
    slow sampling step: 0.3 s there; for ever with a stalled one), because the
    producer thread held the check for its whole life. The epoch's end releases
    the check now: the trainer and its loader are freed at once, while the
    producer still waits inside the source, and it leaves once the source lets it."""
    triples, features, labels = triples_and_tables()  # the trainer's, made alike
    source = GatedSource(triples, stall_at=1)
    trainer = Trainer("health_check", "cpu", source=source)
    for batch in trainer.loader:
        assert expect_batch(batch, triples, features, labels) == 0
        break
    owner, loader = weakref.ref(trainer), weakref.ref(trainer.loader)
    del trainer, batch
    gc.collect()
    try:
        assert [t.name for t in threading.enumerate() if t.name.startswith("pingpong-producer")]
        assert owner() is None
        assert loader() is None
    finally:
        source.gate.set()
    assert wait_for_no_pingpong_threads(5.0) == []


def test_a_next_on_another_thread_while_one_runs_is_refused():
    """From a lifecycle probe: two threads calling ``next()`` on one iterator at
    once each took a lease over the other's (the second overwrote the first,
    whose slot was then never handed back: one slot fewer for the rest of the
    epoch), and each handed back the batch the other held.  The second ``next()``
    is refused now, as a generator's would be, and the epoch goes on as if it
    had not been asked: every batch exact, every slot back."""
    triples, features, labels = triples_and_tables()
    source = GatedSource(triples, stall_at=1)
    device = StreamLog()
    with PingPongLoader(source, features, labels, device=device) as loader:
        it = iter(loader)
        seqs = [expect_batch(next(it), triples, features, labels)]
        got: list[Any] = []
        waiting = threading.Thread(target=lambda: got.append(next(it)))
        waiting.start()  # waits in next() for item 1, behind the gate
        deadline = time.monotonic() + 5.0
        while it._next_on is None and time.monotonic() < deadline:
            time.sleep(0.005)
        with pytest.raises(pingpong.ConfigError, match="already running on another thread"):
            next(it)
        source.gate.set()
        waiting.join(10.0)
        assert len(got) == 1
        seqs.append(expect_batch(got[0], triples, features, labels))
        seqs += [expect_batch(batch, triples, features, labels) for batch in it]
        assert seqs == list(range(BATCHES))
        ends = [entry for entry in device.log if entry[0] == "record"]
        assert len(ends) == BATCHES  # each delivered batch's slot handed back once
        assert len(list(loader)) == BATCHES  # and every slot is back for the next epoch
