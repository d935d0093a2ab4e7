"""Reliability checklist items 1-4 on a CPU: data, order, overwrite guard, schedule fuzzing.

Most tests run the loader on :class:`~pingpong.devices.fake.FakeAsyncDevice`,
whose copy and consumer streams execute later on worker threads with seeded
random delays and poison released slots.  "The model reads the batch" is
enqueued on the consumer stream (``device.consumer_submit``), the way GPU
kernels are, and checked once it ran.  The tests parametrized over
:data:`DEVICE_KINDS` also run on a real GPU when there is one (marked ``cuda``;
``benchmarks/gpu_check.sh`` runs them): there the reads are copies queued on
the consumer's CUDA stream behind ``torch.cuda._sleep``.

The helpers at the top are shared by the other ``test_reliability_*`` modules.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import wait_for_no_pingpong_threads, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import pingpong
import pingpong._epoch as epoch_module
from pingpong import PingPongLoader
from pingpong.devices import COMPLETED
from pingpong.devices.fake import FakeAsyncDevice, tensor_digest
from pingpong.errors import SlotOverwriteError

N = 400

#: Marks for a test (or parameter) that needs a real GPU.
ON_CUDA = (
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
)
#: The real-GPU case of a ``device_kind`` parametrization.
CUDA_KIND = pytest.param("cuda", marks=ON_CUDA)
#: The devices the loader-level reliability tests run on.
DEVICE_KINDS = ["cpu", "fake", CUDA_KIND]
#: Each CUDA gather mode as a ``device_kind`` (``"cuda-<mode>"``; see :func:`loader_device`).
CUDA_MODE_KINDS = [pytest.param(f"cuda-{mode}", marks=ON_CUDA)
                   for mode in ("zerocopy", "staged", "device")]
#: ``torch.cuda._sleep`` cycles per second of sleep (about one GPU clock; rough is fine).
CUDA_SLEEP_CYCLES_PER_S = 1.5e9


# -- shared helpers ------------------------------------------------------------
digest = tensor_digest  # the shared batch hash


def make_device(kind: str, seed: int = 0, max_delay_s: float = 0.002) -> Any:
    """``"cpu"``/``"cuda"`` as they are; ``"fake"`` becomes a seeded FakeAsyncDevice."""
    return fake(seed=seed, max_delay_s=max_delay_s) if kind == "fake" else kind


def loader_device(kind: str, seed: int = 0) -> dict[str, Any]:
    """The loader's ``device=`` (and ``gather=``) for a ``device_kind``: ``"cpu"``,
    ``"fake"`` (seeded) or ``"cuda-<gather mode>"``."""
    if kind.startswith("cuda-"):
        return {"device": "cuda", "gather": kind.removeprefix("cuda-")}
    return {"device": make_device(kind, seed)}


def make_table(
    num_rows: int = N, row_shape: tuple[int, ...] = (8,), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A seeded table whose rows differ from each other and from the poison values."""
    gen = torch.Generator().manual_seed(num_rows)
    if dtype == torch.bool:
        return torch.rand((num_rows, *row_shape), generator=gen) > 0.5
    values = torch.randint(-100, 100, (num_rows, *row_shape), generator=gen)
    if dtype.is_floating_point:
        return (values.double() / 7).to(dtype)
    if dtype == torch.uint8:
        return values.abs().to(dtype)
    return values.to(dtype)


def seq_triples(
    num_rows: int, num_batches: int, *, seed: int = 0, max_inputs: int = 64, batch_out: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, int]]]:
    """Triples whose ``blocks`` is ``{"seq": i}``; distinct ids per batch, sizes vary."""
    gen = torch.Generator().manual_seed(seed)
    triples = []
    for i in range(num_batches):
        n_in = int(torch.randint(1, max_inputs + 1, (1,), generator=gen))
        inputs = torch.randperm(num_rows, generator=gen)[:n_in]
        outputs = torch.randperm(num_rows, generator=gen)[:batch_out]
        triples.append((inputs, outputs, {"seq": i}))
    return triples


class SeqSource:
    """A re-iterable over ``triples``; every pass is shuffled (seeded) and logged.

    ``order[e]`` is the list of seq numbers pass ``e`` yielded, ``delay_s``
    sleeps before each item (slow sampling), ``fail`` maps a pass number to
    ``(position, exception factory)``.
    """

    def __init__(self, triples: list[Any], *, shuffle: bool = True, seed: int = 0) -> None:
        self.triples = triples
        self.shuffle = shuffle
        self.seed = seed
        self.order: list[list[int]] = []
        self.delay_s = 0.0
        self.iter_delay_s = 0.0  # before a pass starts: a producer slow to begin
        self.fail: dict[int, tuple[int, Any]] = {}
        self.fail_times: list[float] = []
        self._fail_new_thread: tuple[set[threading.Thread], int, Any] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.triples)

    def fail_next_pass_of_a_new_thread(self, fail_at: int, make_exc: Any) -> None:
        """Fail (like ``fail``) the next pass started by a thread not alive now.

        For a pass whose number is not known in advance: a producer already
        running when this is called may still start a pass of its own first.
        """
        with self._lock:
            self._fail_new_thread = (set(threading.enumerate()), fail_at, make_exc)

    def __iter__(self) -> Iterator[Any]:
        time.sleep(self.iter_delay_s)
        with self._lock:
            epoch = len(self.order)
            self.order.append([])
            if (self._fail_new_thread is not None
                    and threading.current_thread() not in self._fail_new_thread[0]):
                self.fail[epoch] = self._fail_new_thread[1:]
                self._fail_new_thread = None
        perm = list(range(len(self.triples)))
        if self.shuffle:
            random.Random(self.seed * 1000 + epoch).shuffle(perm)
        return self._run(epoch, perm)

    def _run(self, epoch: int, perm: list[int]) -> Iterator[Any]:
        fail_at, make_exc = self.fail.get(epoch, (None, None))
        rng = random.Random(epoch)
        for position, index in enumerate(perm):
            if self.delay_s:
                time.sleep(rng.random() * self.delay_s)
            if position == fail_at:
                assert make_exc is not None
                self.fail_times.append(time.monotonic())
                raise make_exc()
            self.order[epoch].append(index)
            yield self.triples[index]


class Expected:
    """Reference digests of every triple (computed once, synchronously)."""

    def __init__(self, features: Any, labels: torch.Tensor | None, triples: list[Any]) -> None:
        self.features = features
        self.labels = labels
        self.x: list[Any] = []
        self.y: list[bytes] = []
        for inputs, outputs, _ in triples:
            if isinstance(features, dict):
                self.x.append({k: digest(v[inputs]) for k, v in features.items()})
            else:
                self.x.append(digest(features[inputs]))
            self.y.append(digest(labels[outputs] if labels is not None else None))


def batch_digest(batch: Any) -> tuple[Any, bytes]:
    x = {k: digest(v) for k, v in batch.x.items()} if isinstance(batch.x, dict) else digest(batch.x)
    return x, digest(batch.y)


class GpuRead:
    """Copies of ``batch.x`` / ``batch.y`` queued on the current CUDA stream.

    ``result()`` waits for them and returns their digest, like a fake-stream future.
    """

    def __init__(self, batch: Any) -> None:
        x = batch.x
        self.x = {k: v.clone() for k, v in x.items()} if isinstance(x, dict) else x.clone()
        self.y = None if batch.y is None else batch.y.clone()

    def result(self) -> tuple[Any, bytes]:
        x = {k: v.cpu() for k, v in self.x.items()} if isinstance(self.x, dict) else self.x.cpu()
        y = None if self.y is None else self.y.cpu()
        return batch_digest(types.SimpleNamespace(x=x, y=y))


class Verifier:
    """Checks each batch where the model would read it; counts what went wrong.

    On a :class:`FakeAsyncDevice` the reads run on the consumer stream:
    hash on receipt, optionally sleep on the stream, hash again.  On a GPU
    the reads are copies queued on the current CUDA stream, the second behind
    a ``torch.cuda._sleep`` (at least ~1 ms), hashed on the host at
    :meth:`resolve`: a missing ready wait shows in the first copy, a missing
    release wait in the second.  On the CPU device they run on the host at once.
    """

    def __init__(self, device: Any, expected: Expected, *, stream_sleep_s: float = 0.0) -> None:
        self.device = device
        self.expected = expected
        self.stream_sleep_s = stream_sleep_s
        self.pending: list[tuple[int, Any, Any]] = []
        self.checked = 0
        self.corrupted = 0
        self.changed_while_held = 0

    def submit(self, batch: Any, sleep_s: float | None = None) -> None:
        seq = batch.blocks["seq"]
        pause = self.stream_sleep_s if sleep_s is None else sleep_s
        first: Any  # the first read of the batch: a future, a GPU read or a digest
        if isinstance(self.device, FakeAsyncDevice):
            first = self.device.consumer_submit(lambda: batch_digest(batch))
            if pause:
                self.device.consumer_submit(lambda: time.sleep(pause))
            second = self.device.consumer_submit(lambda: batch_digest(batch))
            self.pending.append((seq, first, second))
        elif _on_gpu(batch):
            first = GpuRead(batch)
            torch.cuda._sleep(int(max(pause, 0.001) * CUDA_SLEEP_CYCLES_PER_S))
            self.pending.append((seq, first, GpuRead(batch)))
        else:
            first = batch_digest(batch)
            if pause:
                time.sleep(pause)
            self.pending.append((seq, first, batch_digest(batch)))

    def resolve(self) -> None:
        for seq, first, second in self.pending:
            a = first.result() if hasattr(first, "result") else first
            b = second.result() if hasattr(second, "result") else second
            want = (self.expected.x[seq], self.expected.y[seq])
            self.checked += 1
            self.corrupted += int(a != want or b != want)
            self.changed_while_held += int(a != b)
        self.pending.clear()


def _on_gpu(batch: Any) -> bool:
    x = next(iter(batch.x.values())) if isinstance(batch.x, dict) else batch.x
    return bool(x.is_cuda)


def fake(seed: int = 0, max_delay_s: float = 0.002, **kwargs: Any) -> FakeAsyncDevice:
    return FakeAsyncDevice(seed=seed, max_delay_s=max_delay_s, **kwargs)


@contextlib.contextmanager
def jittery_queues(seed: int, max_s: float) -> Iterator[None]:
    """Random sleeps before and after every put/get on the epoch's queues."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def jitter() -> None:
        with lock:
            pause = rng.random() * max_s
        time.sleep(pause)

    class JitterQueue(queue.SimpleQueue):  # type: ignore[type-arg]
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            jitter()
            super().put(item, block, timeout)
            jitter()

        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            jitter()
            item = super().get(block, timeout)
            jitter()
            return item

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            epoch_module,
            "queue",
            types.SimpleNamespace(SimpleQueue=JitterQueue, Empty=queue.Empty),
        )
        yield


# -- 1. bit-identical ------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [
        (torch.float32, (3,)),
        (torch.float16, (7,)),
        (torch.bfloat16, (5,)),
        (torch.float64, ()),
        (torch.int8, (3,)),
        (torch.uint8, (1,)),
        (torch.int64, (2, 3)),
        (torch.bool, (9,)),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_bit_identical_on_the_fake_device(dtype, row_shape):
    features = make_table(N, row_shape, dtype)
    labels = make_table(N, (), torch.int64)
    empty = torch.empty(0, dtype=torch.int64)
    triples = seq_triples(N, 10)
    triples[3] = (empty, empty, {"seq": 3})  # an empty batch
    triples[-1] = (triples[-1][0], triples[-1][1][:3], {"seq": 9})  # a final partial batch
    source = SeqSource(triples, shuffle=False)
    device = fake(seed=1)
    verifier = Verifier(device, Expected(features, labels, triples))
    with PingPongLoader(source, features, labels, device=device) as loader:
        for _ in range(2):
            for batch in loader:
                verifier.submit(batch)
        verifier.resolve()
    assert verifier.checked == 20
    assert verifier.corrupted == 0


def test_bit_identical_dict_features_without_labels_on_the_fake_device():
    features = {"a": make_table(N, (5,)), "b": make_table(N, (2,), torch.int32)}
    triples = seq_triples(N, 8)
    device = fake(seed=2)
    verifier = Verifier(device, Expected(features, None, triples))
    with PingPongLoader(SeqSource(triples), features, device=device, num_buffers=3) as loader:
        for batch in loader:
            assert batch.y is None
            verifier.submit(batch)
        verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (8, 0)


def test_gpu_read_keeps_what_the_batch_held_when_it_was_queued():
    """The GPU Verifier's read (here on CPU tensors): later writes do not reach it."""
    x = {"a": make_table(6, (3,)), "b": make_table(6, (), torch.int64)}
    batch = types.SimpleNamespace(x=x, y=torch.arange(6))
    want = batch_digest(batch)
    read = GpuRead(batch)
    x["a"].fill_(0)
    batch.y.fill_(-1)
    assert read.result() == want
    assert batch_digest(batch) != want


# -- 2. exactly once, in order ------------------------------------------------------
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_exactly_once_in_order_over_many_epochs(device_kind):
    triples = seq_triples(N, 15, max_inputs=16)
    source = SeqSource(triples, shuffle=True, seed=5)
    features, labels = make_table(), make_table(N, (), torch.int64)
    device = make_device(device_kind, seed=5, max_delay_s=0.001)
    delivered: list[list[int]] = []
    with PingPongLoader(source, features, labels, device=device, num_buffers=3) as loader:
        verifier = Verifier(loader._device, Expected(features, labels, triples))
        for _ in range(40):
            seqs = []
            for batch in loader:
                seqs.append(batch.blocks["seq"])
                verifier.submit(batch)
            delivered.append(seqs)
        verifier.resolve()
    assert delivered == source.order  # same items, same order, every epoch
    assert all(sorted(seqs) == list(range(15)) for seqs in delivered)  # no gap, no duplicate
    assert len({tuple(s) for s in delivered}) > 1  # the source really shuffled
    assert verifier.corrupted == 0


# -- 3. no overwrite while in use ---------------------------------------------------
@pytest.mark.parametrize("num_buffers", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_hash_sleep_hash_never_changes(num_buffers, seed):
    """Hash on receipt, sleep (on the stream and on the host), hash again: equal."""
    triples = seq_triples(N, 12)
    features, labels = make_table(), make_table(N, (), torch.int64)
    device = fake(seed=seed, max_delay_s=0.003)
    loader = PingPongLoader(
        SeqSource(triples), features, labels, device=device, num_buffers=num_buffers
    )
    with loader:
        verifier = hash_sleep_hash(loader, Expected(features, labels, triples), seed)
    assert verifier.checked == 24
    assert verifier.changed_while_held == 0
    assert verifier.corrupted == 0


def hash_sleep_hash(loader: PingPongLoader, expected: Expected, seed: int) -> Verifier:
    """Two epochs: each batch is read, the reader sleeps 0-10 ms, it is read again.

    The host sleeps 0-5 ms between batches too, so it runs ahead of the
    streams or lags behind them.  Returns the resolved verifier.
    """
    verifier = Verifier(loader._device, expected)
    rng = random.Random(seed)
    for _ in range(2):
        for batch in loader:
            verifier.submit(batch, sleep_s=rng.random() * 0.01)
            time.sleep(rng.random() * 0.005)
    verifier.resolve()
    return verifier


@pytest.mark.parametrize("num_buffers", [2, 3])
@pytest.mark.parametrize(
    "mode", [pytest.param(mode, marks=ON_CUDA) for mode in ("zerocopy", "staged", "device")]
)
@pytest.mark.parametrize("seed", [0, 1], ids=["seed0", "seed1"])
def test_hash_sleep_hash_never_changes_on_gpu(mode, num_buffers, seed):
    """The same check on a real GPU: the reads are queued behind ``torch.cuda._sleep``.

    Batches are large (up to 60k rows of 1 KB), so a copy stream that did not
    wait for the consumer's release would overwrite a slot the sleeping
    consumer stream has yet to read.
    """
    num_rows = 100_000
    triples = seq_triples(num_rows, 12, seed=seed, max_inputs=60_000, batch_out=1024)
    features = make_table(num_rows, (256,))
    labels = make_table(num_rows, (), torch.int64)
    with PingPongLoader(
        SeqSource(triples), features, labels, device="cuda", gather=mode, num_buffers=num_buffers
    ) as loader:
        verifier = hash_sleep_hash(loader, Expected(features, labels, triples), seed)
    assert verifier.checked == 24
    assert verifier.changed_while_held == 0
    assert verifier.corrupted == 0


def test_a_producer_that_took_a_slot_before_the_epoch_ended_writes_nothing_into_it():
    """The producer's contract with a closer: once ``stop`` is set, whoever then
    takes the write lock knows no slot is written again -- also by a producer that
    had already taken a free slot and was waiting for the lock (``retire`` relies on
    it when its join times out: a producer still writing would race the next
    epoch's).  The test holds the epoch's write lock as ``retire`` does, lets the
    producer take the slot handed back, ends the epoch, releases the lock: no gather
    may be queued for batch 2."""
    triples = seq_triples(N, 6)
    device = fake(seed=3, max_delay_s=0.0)
    with PingPongLoader(SeqSource(triples), make_table(), device=device) as loader:
        it = iter(loader)
        epoch = it._epoch
        next(it)  # batch 0, in slot 0
        assert wait_until(lambda: device.calls["gather"] == 2, 10.0), "batch 1 was never gathered"
        with epoch.write_lock:  # once batch 1's fill (in slot 1) has let go of it
            next(it)  # hands slot 0 back, returns batch 1
            assert wait_until(epoch.free_q.empty, 10.0), "the producer never took the free slot"
            epoch.end(epoch_module.EpochState.CLOSED)  # ... and the epoch ends under it
        loader.close()  # retires the epoch: its producer has left
        assert not epoch.producer_alive()
        assert device.calls["gather"] == 2  # batches 0 and 1 only


def test_the_fake_devices_streams_delay_their_work():
    """The races the checks above rely on: each stream operation waits a seeded
    random time up to the maximum (and none once the device closes)."""
    device = fake(seed=7, max_delay_s=0.01)
    try:
        for stream in (device.copy_stream, device.consumer_stream):
            delays = [stream.delay() for _ in range(50)]
            assert all(0 <= d <= 0.01 for d in delays)
            assert len(set(delays)) > 40
    finally:
        device.close()
    assert device.copy_stream.delay() == 0.0


def _broken(device: FakeAsyncDevice, how: str) -> None:
    if how == "copy stream does not wait for the release event":
        device.wait_event = lambda event: None  # type: ignore[method-assign]
    elif how == "consumer stream does not wait for the ready event":
        device.consumer_wait = lambda event, stream=None: None  # type: ignore[method-assign]
    elif how == "release recorded as already complete":
        device.consumer_record = lambda stream=None: COMPLETED  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "how",
    [
        "intact protocol (control)",
        "copy stream does not wait for the release event",
        "consumer stream does not wait for the ready event",
        "release recorded as already complete",
    ],
)
def test_fake_device_catches_a_broken_protocol(how):
    """Break the protocol on purpose: the fake device must show corrupt data.

    The delays are chosen so the race always goes the wrong way: the model's
    read of each batch sits behind a 30 ms "forward pass" on the consumer
    stream while the copy stream is immediate -- or, when the consumer skips
    its wait, the copy stream is 30 ms late and the consumer immediate.
    """
    skip_consumer_wait = how.startswith("consumer stream")
    device = FakeAsyncDevice(seed=0, max_delay_s=0.0, consumer_max_delay_s=0.0, host_jitter_s=0.0)
    if skip_consumer_wait:  # every copy-stream operation starts 30 ms late
        device.copy_stream.delay = lambda: 0.03  # type: ignore[method-assign]
    _broken(device, how)
    triples = seq_triples(N, 10)
    features, labels = make_table(), make_table(N, (), torch.int64)
    verifier = Verifier(device, Expected(features, labels, triples))
    with PingPongLoader(SeqSource(triples), features, labels, device=device) as loader:
        for batch in loader:
            # hash, 30 ms "forward pass" on the stream, hash (the second read races)
            verifier.submit(batch, sleep_s=0.0 if skip_consumer_wait else 0.03)
        verifier.resolve()
    assert verifier.checked == 10
    if how.startswith("intact"):
        assert verifier.corrupted == 0
    else:
        assert verifier.corrupted >= 5, f"only {verifier.corrupted} of 10 batches corrupt"


def test_fake_device_poisons_a_batch_read_after_its_slot_was_handed_back():
    """The other half of the fake device's detection: a read queued on the consumer
    stream after ``next()`` handed the batch's slot back finds poison there, not
    the batch -- even when the refill comes late (copy stream 30 ms behind), so
    only the poisoning on release can show it."""
    device = FakeAsyncDevice(seed=0, max_delay_s=0.0, consumer_max_delay_s=0.0, host_jitter_s=0.0)
    device.copy_stream.delay = lambda: 0.03  # type: ignore[method-assign]
    triples = seq_triples(N, 6)
    features, labels = make_table(), make_table(N, (), torch.int64)
    verifier = Verifier(device, Expected(features, labels, triples))
    with PingPongLoader(SeqSource(triples), features, labels, device=device) as loader:
        previous = None
        for batch in loader:
            if previous is not None:
                verifier.submit(previous)  # queued behind the release of its slot
            previous = batch
        verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (5, 5)


def test_the_batch_digest_tells_dtypes_and_shapes_apart():
    """The bit-identical checks compare digests: the same bytes as another dtype or
    shape (an empty batch's ``(0, 3)`` against ``(0,)``) must not compare equal."""
    rows = torch.arange(12, dtype=torch.int32)
    digests = {digest(rows), digest(rows.view(torch.float32)), digest(rows.view(3, 4)),
               digest(torch.empty(0, 3)), digest(torch.empty(0)), digest(None)}
    assert len(digests) == 6
    assert digest(rows) == digest(rows.clone())


def _release_on_receipt(monkeypatch):
    """A broken consumer: it hands a slot back to the producer while still holding it."""
    original = epoch_module.Epoch._wait_for_message

    def broken(self):
        message = original(self)
        if isinstance(message, epoch_module.Delivery):
            self.free_q.put(message.slot)
        return message

    monkeypatch.setattr(epoch_module.Epoch, "_wait_for_message", broken)


def test_debug_check_catches_a_slot_refilled_while_held(monkeypatch):
    _release_on_receipt(monkeypatch)
    triples = seq_triples(N, 10)
    with PingPongLoader(SeqSource(triples), make_table(), debug=True) as loader:
        it = iter(loader)
        next(it)
        time.sleep(0.3)  # the producer refills the slot we hold
        # Slot 0 held batch 0 (generation 1); the broken hand-back let the producer
        # refill it with batch 2 (generation 2) -- and no more: slot 1 is still queued.
        with pytest.raises(SlotOverwriteError,
                           match=r"^slot 0 was refilled while the training loop held it "
                                 r"\(generation 1 -> 2, after 1 batches this epoch\)"):
            next(it)
        with pytest.raises(pingpong.EpochFailedError, match=r"\(SlotOverwriteError: slot "):
            next(it)


def test_without_debug_the_same_bug_corrupts_silently(monkeypatch):
    """Why the debug check exists: without it only the data shows the bug."""
    _release_on_receipt(monkeypatch)
    triples = seq_triples(N, 6)
    features = make_table()
    verifier = Verifier("cpu", Expected(features, None, triples))
    with PingPongLoader(SeqSource(triples, shuffle=False), features) as loader:
        for batch in loader:
            verifier.submit(batch, sleep_s=0.1)
        verifier.resolve()
    assert verifier.corrupted > 0


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_debug_check_is_silent_on_a_correct_run(device_kind):
    triples = seq_triples(N, 12)
    features = make_table()
    device = make_device(device_kind, seed=4)
    with PingPongLoader(SeqSource(triples), features, device=device, debug=True) as loader:
        verifier = Verifier(loader._device, Expected(features, None, triples))
        for _ in range(3):
            for i, batch in enumerate(loader):
                verifier.submit(batch)
                if i == 7:
                    break
        verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (24, 0)


# -- 4. schedule fuzzing ----------------------------------------------------------------
DELAYS = st.sampled_from([0.0, 0.0003, 0.002, 0.008])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    copy_delay=DELAYS,
    consumer_delay=DELAYS,
    host_jitter=st.sampled_from([0.0, 0.0005, 0.003]),
    queue_jitter=st.sampled_from([0.0, 0.0005, 0.003]),
    source_delay=st.sampled_from([0.0, 0.002]),
    model_sleep=st.sampled_from([0.0, 0.002]),
    num_buffers=st.integers(2, 4),
    num_batches=st.integers(0, 12),
    break_at=st.none() | st.integers(0, 12),
)
def test_schedule_fuzzing(
    seed,
    copy_delay,
    consumer_delay,
    host_jitter,
    queue_jitter,
    source_delay,
    model_sleep,
    num_buffers,
    num_batches,
    break_at,
):
    """Random delays at every hand-off: sampling, queue put/get, device calls, streams."""
    triples = seq_triples(N, num_batches, seed=seed, max_inputs=48)
    source = SeqSource(triples, seed=seed)
    source.delay_s = source_delay
    features, labels = make_table(), make_table(N, (), torch.int64)
    device = FakeAsyncDevice(
        seed=seed,
        max_delay_s=copy_delay,
        consumer_max_delay_s=consumer_delay,
        host_jitter_s=host_jitter,
    )
    verifier = Verifier(device, Expected(features, labels, triples), stream_sleep_s=model_sleep)
    rng = random.Random(seed)
    with jittery_queues(seed, queue_jitter):
        loader = PingPongLoader(
            source, features, labels, device=device, num_buffers=num_buffers, timeout=20
        )
        with loader:
            delivered = []
            for epoch in range(2):
                seqs = []
                for i, batch in enumerate(loader):
                    if epoch == 0 and i == break_at:
                        break
                    seqs.append(batch.blocks["seq"])
                    verifier.submit(batch)
                    time.sleep(rng.random() * model_sleep)
                delivered.append(seqs)
            verifier.resolve()
    assert delivered[1] == source.order[1]
    assert delivered[0] == source.order[0][: len(delivered[0])]
    if break_at is None or break_at >= num_batches:
        assert delivered[0] == source.order[0]
    assert verifier.corrupted == 0
    assert wait_for_no_pingpong_threads(3.0) == []


class SamplerFault(Exception):
    """Raised by the state machine's source at a chosen position."""


class ConsumerFault(Exception):
    """Raised by the state machine's training loop."""


class LoaderLifecycle(RuleBasedStateMachine):
    """next / break / close / new epoch / faults, in any order, on the fake device."""

    NUM_BATCHES = 6

    def __init__(self) -> None:
        super().__init__()
        self.triples = seq_triples(N, self.NUM_BATCHES, max_inputs=32)
        self.features, self.labels = make_table(), make_table(N, (), torch.int64)
        self.expected = Expected(self.features, self.labels, self.triples)
        self.source = SeqSource(self.triples, seed=11)
        self.seed = 0
        self.loader: PingPongLoader | None = None
        self.verifier: Verifier | None = None
        self.it: Any = None
        self.epochs_started = 0  # iter(loader) calls == iter(source) calls, in order
        self.position = 0
        self.fail_at: int | None = None
        self.stale: list[Any] = []
        self._open_loader()

    def _open_loader(self) -> None:
        self.seed += 1
        device = FakeAsyncDevice(seed=self.seed, max_delay_s=0.002, host_jitter_s=0.0005)
        self.loader = PingPongLoader(  # both producer orders, loader by loader
            self.source, self.features, self.labels, device=device, timeout=20,
            sample_ahead=self.seed % 2 == 0,
        )
        self.verifier = Verifier(device, self.expected, stream_sleep_s=0.001)

    def _start(self, fail_at: int | None) -> None:
        assert self.loader is not None
        self.epochs_started += 1
        if fail_at is not None:
            # The pass of this epoch's producer, a thread iter(loader) starts: not
            # simply the source's next pass, which the producer of an epoch left
            # with break_out can still start (at the latest while iter(loader)
            # retires it, which joins it before the new epoch starts).
            self.source.fail_next_pass_of_a_new_thread(fail_at, lambda: SamplerFault(fail_at))
        self.it = iter(self.loader)
        self.position = 0
        self.fail_at = fail_at

    @rule()
    def new_epoch(self) -> None:
        self._start(None)

    @precondition(lambda self: self.it is None)
    @rule(fail_at=st.integers(0, NUM_BATCHES - 1))
    def new_epoch_with_sampler_fault(self, fail_at: int) -> None:
        self._start(fail_at)

    @precondition(lambda self: self.it is not None)
    @rule(steps=st.integers(1, 6))
    def take(self, steps: int) -> None:
        assert self.verifier is not None
        for _ in range(steps):
            if self.position == self.fail_at:
                with pytest.raises(SamplerFault):
                    next(self.it)
                self.it = None
                return
            if self.position == self.NUM_BATCHES:
                with pytest.raises(StopIteration):
                    next(self.it)
                self.it = None
                return
            batch = next(self.it)
            # this epoch's pass is the source's latest: a new one starts only after
            # iter(loader) retired this epoch
            assert batch.blocks["seq"] == self.source.order[-1][self.position]
            self.verifier.submit(batch)
            self.position += 1

    @precondition(lambda self: self.it is not None)
    @rule()
    def take_one(self) -> None:
        self.take(1)

    @precondition(lambda self: self.it is not None)
    @rule(keep_reference=st.booleans())
    def break_out(self, keep_reference: bool) -> None:
        if keep_reference:
            self.stale.append(self.it)
        self.it = None

    @precondition(lambda self: self.it is not None)
    @rule()
    def close_iterator(self) -> None:
        self.it.close()
        with pytest.raises(StopIteration):
            next(self.it)
        self.it = None

    @precondition(lambda self: self.it is not None and self.position < self.NUM_BATCHES)
    @rule()
    def consumer_raises(self) -> None:
        if self.position == self.fail_at:
            return
        it, self.it = self.it, None
        with pytest.raises(ConsumerFault):
            for _batch in it:
                raise ConsumerFault
        del it

    @precondition(lambda self: self.stale and self.it is not None)
    @rule()
    def stale_iterator_is_over(self) -> None:
        """An iterator left behind by a newer epoch says so; it never stops silently."""
        with pytest.raises(pingpong.EpochSupersededError):
            next(self.stale.pop())

    @precondition(lambda self: self.it is None)
    @rule()
    def reopen_loader(self) -> None:
        assert self.loader is not None
        assert self.verifier is not None
        self.verifier.resolve()
        assert self.verifier.corrupted == 0
        self.loader.close()
        self.stale.clear()
        self.it = None
        self._open_loader()

    @invariant()
    def data_is_right(self) -> None:
        if self.verifier is not None and len(self.verifier.pending) > 8:
            self.verifier.resolve()
            assert self.verifier.corrupted == 0

    @invariant()
    def at_most_one_producer(self) -> None:
        producers = [t for t in threading.enumerate() if t.name.startswith("pingpong-producer")]
        assert len(producers) <= 2  # the current one, and one still exiting

    def teardown(self) -> None:
        if self.loader is not None and self.verifier is not None:
            self.verifier.resolve()
            self.loader.close()
            assert self.verifier.corrupted == 0
        self.it = None
        self.stale.clear()
        assert wait_for_no_pingpong_threads(3.0) == []


LoaderLifecycle.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_loader_lifecycle_state_machine = LoaderLifecycle.TestCase


@pytest.mark.parametrize("keep_reference", [False, True])
def test_fault_in_a_new_epoch_after_an_epoch_left_before_its_pass_began(
        keep_reference: bool) -> None:
    """The state machine's steps new epoch, break out, new epoch with a sampler fault
    (seen once in CI, when ``iter()`` returned before the producer's ``iter(source)``:
    the first epoch's pass began only while the second epoch retired it).  Now
    ``iter()`` waits through ``iter_delay_s``, so the left epoch's pass has begun
    before the second starts; the second must still run a pass of its own -- the
    source's latest -- and its loop must get the fault, at the right position."""
    machine = LoaderLifecycle()
    try:
        machine.source.iter_delay_s = 0.05
        machine.new_epoch()
        assert len(machine.source.order) == 1  # iter() returned after iter(source) did
        machine.break_out(keep_reference=keep_reference)
        machine.new_epoch_with_sampler_fault(2)
        machine.source.iter_delay_s = 0.0
        machine.take(3)  # two batches of the latest pass, then SamplerFault
        assert machine.it is None
        assert machine.position == 2
        assert len(machine.source.order) == 2  # the left epoch's pass began, and ended
    finally:
        machine.teardown()
