"""Tables written while a loader uses them: what each batch sees (docs/guide.rst,
"Tables that change").

pingpong reads a table's memory in place, when it gathers a batch -- up to
``num_buffers - 1`` batches before the training loop gets it.  In-place writes
between epochs are seen by every batch of the next epoch; writes during an epoch
by the batches gathered after them; a table given new memory (``.data =``,
``set_``) is refused before any row is read.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from test_reliability import fake, seq_triples
from test_usage_patterns import CountingCPUDevice

import pingpong
from pingpong import PingPongLoader
from pingpong.devices.cpu import CPUDevice
from pingpong.slots import Buffer
from pingpong.store import make_feature_store

N = 200
BATCHES = 12


def _device(kind: str) -> Any:
    return fake(seed=7) if kind == "fake" else "cpu"


def _values_seen(device: Any, batch: Any) -> torch.Tensor:
    """The batch's rows, read where the model reads them (the fake device's consumer
    stream, after the ready wait)."""
    if isinstance(device, pingpong.devices.fake.FakeAsyncDevice):
        return device.consumer_submit(lambda: batch.x.clone()).result()
    return batch.x.clone()


@pytest.mark.parametrize("device_kind", ["cpu", "fake"])
def test_in_place_writes_between_epochs_reach_every_batch_of_the_next(device_kind):
    triples = seq_triples(N, BATCHES)
    features = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3)
    device = _device(device_kind)
    with PingPongLoader(triples, features, device=device) as loader:
        for epoch in range(3):
            for batch, (inputs, _, _) in zip(loader, triples, strict=True):
                assert torch.equal(_values_seen(device, batch), features[inputs]), epoch
            features.mul_(-2).add_(1)  # after the epoch's last batch, before the next iter()


@pytest.mark.parametrize("writeable", [True, False], ids=["writeable", "read-only view"])
def test_a_numpy_table_is_read_in_place_so_writes_to_the_array_reach_the_next_epoch(
        writeable):
    """A NumPy table is wrapped, not copied (``torch.from_numpy``): writes to the
    array between epochs are in the next epoch's batches, as for a tensor.  A
    read-only array (``np.load(..., mmap_mode="r")``; here a read-only view of an
    array the test writes through) is read in place too."""
    triples = seq_triples(N, 4)
    array = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    table = array if writeable else array.view()
    table.flags.writeable = writeable
    labels = np.arange(N, dtype=np.int64)
    with PingPongLoader(triples, table, labels) as loader:
        for epoch in range(3):
            for batch, (inputs, outputs, _) in zip(loader, triples, strict=True):
                assert torch.equal(batch.x, torch.from_numpy(array)[inputs]), epoch
                assert torch.equal(batch.y, torch.from_numpy(labels)[outputs]), epoch
            array *= -2  # between epochs, in place, through the caller's array
            labels += 1


@pytest.mark.parametrize("num_buffers", [2, 3])
def test_a_write_after_the_epoch_reaches_none_of_its_batches_on_an_async_device(num_buffers):
    """Found in a review of the CUDA path: an asynchronous gather reads the table when
    it runs on the device, possibly after ``next()`` returned; a training loop that
    never waits on the host (here: each batch read by a "kernel" on the consumer
    stream) ended its epoch with gathers still queued, and a write after the loop
    reached up to every batch of the epoch just ended (37 of 40 on this fake device).
    The epoch's ``StopIteration`` now waits for the copy stream."""
    triples = seq_triples(N, 8)
    features = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3)
    device = pingpong.devices.fake.FakeAsyncDevice(seed=3, max_delay_s=0.002,
                                                   consumer_max_delay_s=0.03)
    with PingPongLoader(triples, features, device=device, num_buffers=num_buffers) as loader:
        for epoch in range(3):
            before = features.clone()
            reads = [(device.consumer_submit(batch.x.clone), inputs)
                     for batch, (inputs, _, _) in zip(loader, triples, strict=True)]
            features.mul_(-2).add_(1)  # right after the loop: no host wait
            stale = [j for j, (read, inputs) in enumerate(reads)
                     if not torch.equal(read.result(), before[inputs])]
            assert stale == [], (epoch, stale)


def test_a_write_after_closing_the_epochs_iterator_reaches_none_of_its_batches():
    """``iterator.close()`` waits for the gathers of the batches it delivered, as the
    end of an epoch does (found in review: 26 of 30 batches read the later write)."""
    triples = seq_triples(N, 8)
    features = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3)
    device = pingpong.devices.fake.FakeAsyncDevice(seed=5, max_delay_s=0.002,
                                                   consumer_max_delay_s=0.03)
    with PingPongLoader(triples, features, device=device) as loader:
        for epoch in range(3):
            before = features.clone()
            it = iter(loader)
            reads = []
            for batch, (inputs, _, _) in zip(it, triples[:5], strict=False):
                reads.append((device.consumer_submit(batch.x.clone), inputs))
            it.close()
            features.mul_(-2).add_(1)
            stale = [j for j, (read, inputs) in enumerate(reads)
                     if not torch.equal(read.result(), before[inputs])]
            assert len(reads) == 5
            assert stale == [], (epoch, stale)


@pytest.mark.parametrize("device_kind", ["cpu", "fake"])
@pytest.mark.parametrize("num_buffers", [2, 3])
def test_a_write_made_while_holding_batch_k_reaches_batch_k_plus_num_buffers(
        device_kind, num_buffers):
    """Each step k fills the table with k.  Batch j was gathered into the slot batch
    j - num_buffers left, after the training loop asked for batch j - num_buffers + 1:
    every row it holds is a value written at a step in [j - num_buffers, j - 1]."""
    triples = seq_triples(N, BATCHES)
    features = torch.full((N, 4), -1.0)
    device = _device(device_kind)
    staleness = set()
    with PingPongLoader(triples, features, device=device, num_buffers=num_buffers) as loader:
        for j, batch in enumerate(loader):
            seen = _values_seen(device, batch)
            lowest = max(j - num_buffers, -1)
            assert bool(((seen >= lowest) & (seen <= j - 1)).all()), (j, seen.unique())
            staleness.add(j - int(seen.max()))
            time.sleep(0.01)  # a training step: the producer gathers ahead meanwhile
            features.fill_(float(j))  # the step's update, while holding batch j
    assert max(staleness) >= 2  # some batch was gathered before the last step's write


@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_table_given_new_memory_is_refused_before_any_row_is_read(how):
    triples = seq_triples(N, 4)
    features = torch.randn(N, 5)
    device = CountingCPUDevice()
    with PingPongLoader(triples, features, device=device) as loader:
        assert len(list(loader)) == 4
        gathers = device.gathers
        replacement = torch.zeros(N, 5)
        if how == "data":
            features.data = replacement
        else:
            features.set_(replacement)  # type: ignore[call-overload]  # stubs lack set_(Tensor)
        with pytest.raises(pingpong.TableError, match=r"features was given new memory.*copy_"):
            next(iter(loader))
        assert device.gathers == gathers


@pytest.mark.parametrize("which", ["labels", "second feature table"])
def test_every_table_given_new_memory_is_refused_not_only_the_first(which):
    """The check covers each host table: a label table, and a feature table after
    the first of a dict (each is read at its own memory)."""
    triples = seq_triples(N, 4)
    features = {"a": torch.randn(N, 5), "b": torch.randn(N, 2)}
    labels = torch.arange(N)
    device = CountingCPUDevice()
    with PingPongLoader(triples, features, labels, device=device) as loader:
        assert len(list(loader)) == 4
        gathers = device.gathers
        if which == "labels":
            labels.data = torch.zeros(N, dtype=torch.int64)
            name = "labels"
        else:
            features["b"].data = torch.zeros(N, 2)
            name = r"features\['b'\]"
        with pytest.raises(pingpong.TableError, match=name + " was given new memory"):
            next(iter(loader))
        assert device.gathers == gathers


@pytest.mark.parametrize("how", ["resize_", "set_ narrower", "unsqueeze_", "data as int32",
                                 "set_ transposed strides", "resize_ fewer rows"])
def test_a_table_given_a_new_layout_over_the_same_memory_is_refused(how):
    """Same memory, same row count, but another row shape, dtype or strides: the
    gathers would read the rows in the layout they had when the loader was built.
    (``set_ transposed strides`` keeps shape and dtype: only the strides say that
    row i is now elements i, N + i, ... -- caught only if strides are compared;
    ``resize_ fewer rows`` keeps the row shape: only the row count changed.)"""
    triples = seq_triples(N, 4)
    features = torch.randn(N, 4)
    address = features.data_ptr()
    device = CountingCPUDevice()
    with PingPongLoader(triples, features, device=device) as loader:
        assert len(list(loader)) == 4
        gathers = device.gathers
        if how == "resize_":
            features.resize_(N, 2)
        elif how == "set_ narrower":
            features.set_(features.untyped_storage(), 0, (N, 2))  # type: ignore[call-overload]
        elif how == "unsqueeze_":
            features.unsqueeze_(1)
        elif how == "resize_ fewer rows":  # the rows beyond are no longer the table's
            features.resize_(N - 10, 4)
        elif how == "set_ transposed strides":
            features.set_(features.untyped_storage(), 0, (N, 4), (1, N))  # type: ignore[call-overload]
            assert features.shape == (N, 4)
            assert features.dtype == torch.float32
        else:
            features.data = features.data.view(torch.int32)
        assert features.data_ptr() == address  # the same memory
        with pytest.raises(pingpong.TableError,
                           match=r"features was given a new shape, strides or dtype "
                                 r"\(shape \(200, 4\), strides \(4, 1\), torch.float32 when"):
            next(iter(loader))
        assert device.gathers == gathers


@pytest.mark.parametrize("how", ["shape wider rows", "shape fewer rows", "dtype",
                                 "labels shape", "new memory"])
def test_a_numpy_table_given_a_new_layout_in_place_is_refused(how):
    """The same for a NumPy table, whose attributes change in place
    (``arr.shape = ...``, ``arr.dtype = ...``): from an input review, the loader
    compared only its own tensor over the array's memory -- which nothing
    changes -- and went on gathering rows in the old layout, ids past the new
    row count included."""
    triples = seq_triples(N, 4)
    features = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    labels = np.arange(N, dtype=np.int64)
    device = CountingCPUDevice()
    with PingPongLoader(triples, features, labels, device=device) as loader:
        assert len(list(loader)) == 4
        gathers = device.gathers
        name, was = "features", r"shape \(200, 4\), strides \(16, 4\), float32 when"
        change = rf"a new shape, strides or dtype \({was}"
        replacement = np.zeros_like(features)
        if how == "new memory":  # same layout: only the address tells
            change = "new memory"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # NumPy: "unsafe"
                try:
                    features.data = replacement.data  # type: ignore[misc]
                except AttributeError:
                    pytest.skip("this NumPy no longer lets an array's data be assigned")
        elif how == "shape wider rows":
            features.shape = (N // 2, 8)
        elif how == "shape fewer rows":
            features.shape = (N // 2, 2, 4)
        elif how == "dtype":
            features.dtype = np.int32  # type: ignore[misc,assignment]
        else:
            labels.shape = (N // 2, 2)
            change = r"a new shape, strides or dtype \(shape \(200,\), strides \(8,\), int64 when"
            name = "labels"
        with pytest.raises(pingpong.TableError,
                           match=rf"{name} was given {change}.*"
                                 rf"\(arr.shape = ..., arr.dtype = ...,.*{name}\[...\] = new"):
            next(iter(loader))
        assert device.gathers == gathers


def _wait_until_producer_waits_for_a_slot(timeout_s: float = 10.0) -> None:
    """Until a producer thread is blocked taking a free slot: the batch after the
    ones in slots has been sampled and checked, and waits to be gathered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for frame in sys._current_frames().values():
            while frame is not None:
                if frame.f_code.co_name == "_take_free_slot":
                    return
                frame = frame.f_back  # type: ignore[assignment]
        time.sleep(0.005)
    raise AssertionError("the producer never waited for a slot")


def _change(features: torch.Tensor, how: str) -> None:
    if how == "new memory":
        features.data = torch.full_like(features, -1.0)
    elif how == "new narrower memory":
        features.data = torch.full((features.shape[0], 2), -1.0)
    else:  # "resize_": the same memory, a narrower row
        features.resize_(features.shape[0], 2)


@pytest.mark.parametrize("num_buffers", [2, 3])
@pytest.mark.parametrize("how", ["new memory", "new narrower memory", "resize_"])
def test_a_table_changed_mid_epoch_is_refused_before_the_batches_already_checked(
        how, num_buffers):
    """The table is replaced while the loop holds batch 0; the next batch to be
    gathered was already sampled and checked, and waits for a free slot (it needs a
    bigger slot buffer than batch 0 had).  The batches gathered before the change
    are delivered as they were gathered (old rows, old shape); the next one is a
    ``TableError`` and no row is gathered after the change -- not rows of the old
    width written into a buffer sized for the new one."""
    width = 256
    features = torch.arange(N * width, dtype=torch.float32).reshape(N, width)
    old = features.clone()
    gen = torch.Generator().manual_seed(3)
    sizes = [8] * num_buffers + [N] + [8]  # the checked, waiting batch grows its slot
    triples = [(torch.randint(0, N, (n,), generator=gen), torch.arange(1), {"seq": i})
               for i, n in enumerate(sizes)]
    device = CountingCPUDevice()
    with PingPongLoader(triples, features, device=device, num_buffers=num_buffers) as loader:
        batches = iter(loader)
        first = next(batches)
        assert torch.equal(first.x, old[triples[0][0]])
        _wait_until_producer_waits_for_a_slot()
        gathers = device.gathers
        assert gathers == num_buffers  # batch 0 and those after it in the other slots
        _change(features, how)
        for k in range(1, num_buffers):  # already in slots: gathered before the change
            batch = next(batches)
            assert batch.x.shape == (sizes[k], width)
            assert torch.equal(batch.x, old[triples[k][0]]), k
        with pytest.raises(pingpong.TableError,
                           match=r"features was given (new memory|a new shape)"):
            next(batches)
        assert device.gathers == gathers


def test_slot_buffers_are_sized_from_the_layout_the_table_was_built_with():
    """A buffer that grows after the caller's tensor changed is still sized for the
    rows the gathers copy: the memory and layout recorded when the table was made."""
    features = torch.randn(N, 64)
    store = make_feature_store(features)
    buffer = Buffer(store.tables[None])
    features.data = torch.zeros(N + 5, 2, dtype=torch.float64)
    buffer.reserve(10, CPUDevice(1).allocate)
    assert buffer.storage is not None
    assert buffer.storage.shape[1:] == (64,)
    assert buffer.storage.dtype == torch.float32
    assert store.tables[None].num_rows == N
