"""Tests written to kill mutants that survived the lifecycle suite.

``mutmut`` (docs/reliability.md, *Mutation testing*) changed ``_epoch.py``,
``_producer.py``, ``slots.py`` and ``_lifecycle.py`` one edit at a time; each
test here names the edits it catches, and each was checked to fail with its
mutant applied.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import queue
import threading
import time
from typing import Any

import pytest
import torch
from test_reliability import SeqSource, make_table, seq_triples

import pingpong
from pingpong._epoch_states import EpochState
from pingpong._producer import Delivery
from pingpong.devices.fake import FakeAsyncDevice
from pingpong.slots import GROWTH, ROW_GRANULE, Buffer, grown_capacity
from pingpong.sources import BuiltinLoader, CSRGraph, NeighborSampler
from pingpong.store import make_host_table

N = 400


class Broken:
    """A source whose third item raises."""

    def __init__(self, triples: list) -> None:
        self.triples = triples

    def __iter__(self):
        for i, triple in enumerate(self.triples):
            if i == 2:
                raise ValueError("sampler failed")
            yield triple


def test_a_failed_epoch_says_failed():
    """``Epoch._fail`` ends the epoch in FAILED (mutant: ``end(None)``, which
    stops the epoch all the same but reports no state)."""
    with pingpong.PingPongLoader(Broken(seq_triples(N, 6)), make_table()) as loader:
        it = iter(loader)
        next(it)
        next(it)
        with pytest.raises(ValueError, match="sampler failed"):
            next(it)
        assert it.state is EpochState.FAILED
        with pytest.raises(pingpong.EpochFailedError,
                           match=r"failed after 2 batches \(ValueError: sampler failed\)"):
            next(it)


def test_dropping_the_iterator_closes_its_epoch():
    """``EpochIterator.__del__`` ends the epoch in CLOSED (mutants: ``end(None)``,
    no ``getattr`` default)."""
    with pingpong.PingPongLoader(seq_triples(N, 6), make_table()) as loader:
        it = iter(loader)
        next(it)
        epoch = it._epoch
        del it
        gc.collect()
        assert epoch.state is EpochState.CLOSED
        assert [b.x.shape[0] for b in loader] == [len(t[0]) for t in seq_triples(N, 6)]


def test_a_batch_held_across_an_epoch_switch_is_intact_for_reads_queued_before_it():
    """When the next epoch starts, the held slot's release events are recorded
    (``Epoch.hand_back_lease``): its producer must not refill that slot before
    the consumer stream ran the reads queued on the old batch (mutant:
    ``if events is None``, which drops the events)."""
    triples = seq_triples(N, 12)
    features = make_table()
    device = FakeAsyncDevice(seed=0, max_delay_s=0.0)
    source = SeqSource(triples, shuffle=True)  # epoch 2 fills the slots with other rows
    with pingpong.PingPongLoader(source, features, device=device, num_buffers=2) as loader:
        it = iter(loader)
        held = next(it)
        x = held.x
        device.consumer_submit(lambda: time.sleep(0.3))  # a long forward pass
        copy = device.consumer_submit(lambda: x.clone())  # then a read of the held batch
        seen = sum(1 for _ in loader)  # a new epoch: both slots refilled, several times
        assert seen == 12
        assert source.order[1] != source.order[0]  # other rows went into the slots
        assert torch.equal(copy.result(), features[triples[source.order[0][0]][0]])


# -- slots: growth policy (mutants of grown_capacity and Buffer.reserve) ---------------
def _buffer() -> Buffer:
    tensor = torch.zeros(10, 3, dtype=torch.float16)
    return Buffer(make_host_table(tensor, "features"))


@pytest.mark.parametrize("needed", [0, 1, 255, 256, 1000, 4097, 100_000])
def test_grown_capacity_has_headroom_and_whole_granules(needed):
    capacity = grown_capacity(needed)
    assert capacity % ROW_GRANULE == 0
    assert capacity >= max(int(needed * GROWTH), 1)  # never zero rows, 25% headroom
    assert capacity < max(needed * GROWTH, 1) + ROW_GRANULE  # and no more than a granule above


def test_a_buffer_grows_only_for_a_batch_larger_than_its_capacity():
    buffer = _buffer()
    allocations: list[tuple[int, ...]] = []

    def allocate(shape, dtype):
        allocations.append(shape)
        return torch.empty(shape, dtype=dtype)

    with pytest.raises(RuntimeError, match="before reserve"):
        buffer.rows(1)
    assert buffer.reserve(100, allocate) is True  # first use allocates
    assert buffer.grow_count == 1
    assert buffer.capacity == grown_capacity(100)
    assert buffer.reserve(buffer.capacity, allocate) is False  # exactly full: no growth
    assert buffer.reserve(7, allocate) is False
    assert buffer.grow_count == 1
    assert buffer.reserve(buffer.capacity + 1, allocate) is True
    assert buffer.grow_count == 2
    assert allocations == [(grown_capacity(100), 3), (grown_capacity(grown_capacity(100) + 1), 3)]
    assert buffer.rows(5).shape == (5, 3)


# -- what the errors say (mutants of their messages) ----------------------------------
def test_a_superseded_epoch_explains_itself():
    with pingpong.PingPongLoader(seq_triples(N, 6), make_table()) as loader:
        outer = iter(loader)
        next(outer)
        next(outer)
        iter(loader)  # a nested loop over the same loader
        with pytest.raises(pingpong.EpochSupersededError) as info:
            next(outer)
    message = str(info.value)
    assert message.startswith("this epoch was ended after 2 batches because iter() was called ")
    assert "on the same PingPongLoader again (a nested loop, or zip(loader, loader)), " in message
    assert "or on another PingPongLoader over the same source whose iter() ends or resets " \
        "the iterator both would read (a DataLoader with persistent_workers=True, or a " \
        "datapipe" in message
    assert message.endswith(
        "a loader runs one epoch at a time -- use one loader, over its own DataLoader, per "
        "concurrent loop"
    )


def test_a_closed_loader_says_how_far_the_epoch_got():
    loader = pingpong.PingPongLoader(seq_triples(N, 6), make_table())
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(pingpong.LoaderClosedError,
                       match=r"^the PingPongLoader was closed after 1 batches of this epoch$"):
        next(it)


EXPIRED_USES: dict[str, tuple[str, Any]] = {
    "record_stream": ("record_stream()", lambda batch: batch.record_stream(None)),
    "clone": ("clone()", lambda batch: batch.clone()),
    "copy": ("clone()", copy.copy),
    "deepcopy": ("clone()", copy.deepcopy),
    "pickle": ("clone()", pickle.dumps),
    "torch.save": ("clone()", lambda batch: torch.save(batch, io.BytesIO())),
}


@pytest.mark.parametrize("use", sorted(EXPIRED_USES))
def test_an_expired_batch_says_why_and_what_to_do(use):
    """A batch kept past the next ``next()``: its slot may hold the next batch's
    rows, so a copy of it would be another batch's data under this one's ids --
    found (from a lifecycle probe) for ``clone()``, ``copy``, ``pickle`` and
    ``torch.save``, which copied silently; ``record_stream`` refused already."""
    doing, act = EXPIRED_USES[use]
    with pingpong.PingPongLoader(seq_triples(N, 6), make_table()) as loader:
        it = iter(loader)
        first = next(it)
        kept = first.clone()  # before the next batch: a copy of its own
        next(it)
        with pytest.raises(pingpong.BatchExpiredError) as info:
            act(first)
        act(kept)  # a clone has no lease: nothing to refuse
    assert str(info.value) == (
        f"{doing}: this batch's slot was handed back when the next batch was requested "
        "(or a new epoch started), and may hold another batch's rows; clone() a batch "
        "before the next one to keep it longer"
    )


def test_a_batch_kept_after_a_break_is_still_cloned():
    """Ending an epoch early does not hand the slot back (the batch stays intact
    until the loader's next epoch): its clone is the batch."""
    triples, features = seq_triples(N, 6), make_table()
    with pingpong.PingPongLoader(triples, features) as loader:
        batch = next(iter(loader))  # the iterator dropped: the epoch ends early
        assert torch.equal(batch.clone().x, features[triples[0][0]])
        iter(loader)
        with pytest.raises(pingpong.BatchExpiredError):
            batch.clone()


# -- the producer delivers the item's own fields (mutants of produce and _fill) -------
@pytest.mark.parametrize("device_kind", ["cpu", "fake"])
def test_every_batch_carries_its_items_ids_and_blocks(device_kind):
    """The batch is the item's own ids and blocks plus x.  (The mutants that drop
    the moved graphs -- ``graphs = None``, ``move_graphs(None)`` -- are
    equivalent for node triples on the CPU, where the blocks stay as they
    are; test_forms.py's edge-prediction items kill them.)"""
    graph = CSRGraph.from_edges(torch.randint(0, N, (4000,)), torch.randint(0, N, (4000,)), N)
    source = list(BuiltinLoader(graph, torch.arange(0, N, 2), NeighborSampler([3, 2]), 32))
    features = make_table()
    device = FakeAsyncDevice(seed=5) if device_kind == "fake" else "cpu"
    with pingpong.PingPongLoader(source, features, device=device) as loader:
        for batch, (inputs, outputs, blocks) in zip(loader, source, strict=True):
            assert torch.equal(batch.input_nodes, inputs)
            assert torch.equal(batch.output_nodes, outputs)
            assert len(batch.blocks) == len(blocks) == 2
            for got, want in zip(batch.blocks, blocks, strict=True):
                assert isinstance(got, pingpong.EdgeBlock)
                assert torch.equal(got.src, want.src)
                assert torch.equal(got.dst, want.dst)
                assert (got.num_src_nodes, got.num_dst_nodes) == (
                    want.num_src_nodes, want.num_dst_nodes)


def test_an_unreadable_item_is_named_by_its_position():
    """``reader.read(item, seq)``: the error says which item (mutants: ``seq = 1``,
    ``read(item, None)``), and the note says which batch was being prepared."""
    items = [*seq_triples(N, 3), "not a batch"]
    with pingpong.PingPongLoader(items, make_table()) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        with pytest.raises(pingpong.BatchFormError, match=r"^source item 3 is ") as info:
            next(it)
    notes = getattr(info.value, "__notes__", [])
    assert any("while preparing batch 3;" in note for note in notes) or not hasattr(
        info.value, "add_note")


# -- next(): states, messages and the stall counter (mutants of next_batch & co.) -----
def test_an_exhausted_epoch_says_exhausted_and_the_stall_counter_is_a_duration():
    with pingpong.PingPongLoader(seq_triples(N, 5), make_table()) as loader:
        it = iter(loader)
        assert sum(1 for _ in it) == 5
        assert it.state is EpochState.EXHAUSTED
        stats = loader.stats
    assert 0.0 <= stats["consumer_stall_s"] <= stats["wall_s"]


class _Stalls:
    """One batch, then a source that blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __iter__(self):
        yield seq_triples(N, 1)[0]
        self.release.wait(10)


def test_close_from_another_thread_while_next_waits_says_how_far_it_got():
    """The epoch ends while ``next()`` waits: the error counts the batches
    delivered (mutant: ``ended_error(state, None)``)."""
    source = _Stalls()
    loader = pingpong.PingPongLoader(source, make_table())
    it = iter(loader)
    next(it)
    threading.Timer(0.2, loader.close).start()
    try:
        with pytest.raises(pingpong.LoaderClosedError,
                           match=r"^the PingPongLoader was closed after 1 batches of this epoch$"):
            next(it)
    finally:
        source.release.set()
    with pytest.raises(pingpong.LoaderClosedError, match=r"^this PingPongLoader is closed$"):
        iter(loader)


def test_a_dead_producer_is_named():
    """``ProducerDiedError`` names the thread that died (its message was not checked)."""
    with pingpong.PingPongLoader(seq_triples(N, 4), make_table()) as loader:
        it = iter(loader)
        next(it)
        epoch = it._epoch
        epoch.stop.set()  # the producer leaves without a terminal message, as if killed
        epoch.thread.join(5)
        while True:  # drain what it delivered before it saw the flag
            try:
                message = epoch.ready_q.get_nowait()
            except queue.Empty:
                break
            if not isinstance(message, Delivery):
                break
        with pytest.raises(pingpong.ProducerDiedError) as info:
            next(it)
    assert str(info.value) == (
        f"producer thread {epoch.thread.name} exited without delivering a batch, an end "
        "of epoch or an error"
    )


def test_the_producer_time_counters_are_durations():
    """Each producer stage's seconds are positive and within the wall clock
    (mutants: ``t1 + t0`` for ``t1 - t0``, a counter left out)."""
    with pingpong.PingPongLoader(seq_triples(N, 8), make_table()) as loader:
        assert sum(1 for _ in loader) == 8
        stats = loader.stats
    for key in ("sample_s", "validate_s", "gather_s"):
        assert 0.0 < stats[key] <= stats["wall_s"], key
    assert 0.0 <= stats["fetch_s"] <= stats["wall_s"]  # no row source: about zero
    assert stats["producer_busy_s"] == pytest.approx(
        stats["sample_s"] + stats["validate_s"] + stats["fetch_s"] + stats["gather_s"])


def test_producer_threads_are_daemons():
    """Documented (guide, "Shutdown"): a producer stuck in a source must not keep
    the interpreter alive (mutants: ``daemon=False``, ``daemon=None``)."""
    with pingpong.PingPongLoader(seq_triples(N, 4), make_table()) as loader:
        it = iter(loader)
        next(it)
        assert it._epoch.thread.daemon is True
        assert it._epoch.thread.name.startswith("pingpong-producer-")
