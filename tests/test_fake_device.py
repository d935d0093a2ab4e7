"""The fake asynchronous device itself: streams run later, in order, and poison."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_triples, pingpong_threads

from pingpong import ConfigError, PingPongLoader
from pingpong.devices import COMPLETED, make_device
from pingpong.devices.fake import FakeAsyncDevice, FakeEvent, FakeStreamError, poison_
from pingpong.store import make_host_table

N = 50


@pytest.fixture
def device():
    dev = FakeAsyncDevice(seed=3, max_delay_s=0.0)
    yield dev
    dev.close()


def test_worker_threads_are_named_and_stop_on_close():
    dev = FakeAsyncDevice()
    names = sorted(t.name for t in pingpong_threads())
    assert len(names) == 2
    assert all(name.startswith("pingpong-fake-") for name in names)
    assert {name.rsplit("-", 1)[1] for name in names} == {"copy", "consumer"}
    dev.close()
    dev.close()  # idempotent
    assert pingpong_threads() == []
    assert dev.consumer_record() is COMPLETED  # after close, like the CUDA device
    with pytest.raises(RuntimeError, match="closed"):
        dev.consumer_submit(lambda: None)


def test_gather_runs_later_and_record_completes_after_it(device):
    table = make_host_table(torch.arange(N * 3, dtype=torch.float32).reshape(N, 3), "t")
    out = device.allocate((4, 3), torch.float32)
    assert torch.isnan(out).all()  # fresh storage is poisoned
    gate = threading.Event()
    device.copy_stream.put("call", (gate.wait, None))  # hold the copy stream back
    ids = np.array([4, 0, 7, 7])
    device.gather(table, ids, out)
    ids[:] = 0  # the device took the ids at enqueue time, like a CUDA device
    ready = device.record()
    assert isinstance(ready, FakeEvent)
    time.sleep(0.05)
    assert not ready.query()  # the host was not blocked, nothing ran yet
    assert torch.isnan(out).all()
    gate.set()
    assert ready.synchronize(5)
    assert torch.equal(out, table.tensor[[4, 0, 7, 7]])
    assert ready.tensors == (out,)


def test_wait_blocks_the_stream_not_the_host(device):
    consumer_done = FakeEvent("consumer")
    gate = threading.Event()
    device.consumer_submit(gate.wait)
    device.consumer_stream.put("record", (consumer_done, ()))
    start = time.monotonic()
    device.wait_event(consumer_done)  # enqueued, returns at once
    marker = device.record()
    assert time.monotonic() - start < 0.05
    time.sleep(0.05)
    assert not marker.query()  # the copy stream waits for the consumer stream
    gate.set()
    assert marker.synchronize(5)


def test_consumer_work_is_ordered_and_release_poisons_held_rows(device):
    table = make_host_table(torch.arange(N * 2, dtype=torch.int64).reshape(N, 2), "t")
    out = device.allocate((3, 2), torch.int64)
    device.gather(table, np.array([1, 2, 3]), out)
    ready = device.record()
    device.consumer_wait(ready)
    seen = device.consumer_submit(out.clone)
    release = device.consumer_record()
    late = device.consumer_submit(out.clone)  # a read after the release: a bug
    assert release.synchronize(5)
    assert torch.equal(seen.result(), table.tensor[1:4])
    assert (late.result() == torch.iinfo(torch.int64).min).all()


def test_held_rows_are_poisoned_before_the_release_event_completes(device, monkeypatch):
    """The copy stream may refill a slot as soon as its release event completes: the
    poison must be written by then, or it would land on the next batch."""
    import pingpong.devices.fake as fake

    table = make_host_table(torch.arange(N * 2, dtype=torch.int64).reshape(N, 2), "t")
    out = device.allocate((3, 2), torch.int64)
    device.gather(table, np.array([1, 2, 3]), out)
    device.consumer_wait(device.record())
    gate = threading.Event()
    device.consumer_submit(gate.wait)  # hold the consumer stream until `release` is known
    release = device.consumer_record()
    complete_when_poisoned = []

    def poison_and_look(tensor: torch.Tensor) -> torch.Tensor:
        complete_when_poisoned.append(release.query())
        return poison_(tensor)

    monkeypatch.setattr(fake, "poison_", poison_and_look)
    gate.set()
    assert release.synchronize(5)
    assert complete_when_poisoned == [False]
    assert (out == torch.iinfo(torch.int64).min).all()


def test_poison_values_per_dtype():
    assert torch.isnan(poison_(torch.empty(3, dtype=torch.bfloat16))).all()
    assert (poison_(torch.empty(3, dtype=torch.uint8)) == 255).all()
    assert (poison_(torch.empty(3, dtype=torch.int32)) == -(2**31)).all()
    assert poison_(torch.empty(3, dtype=torch.bool)).all()
    assert poison_(torch.empty(0)).numel() == 0


@pytest.mark.parametrize("dtype_name", ["float4_e2m1fn_x2", "bits8", "bits16", "uint4", "int2"])
def test_dtypes_torch_cannot_fill_are_poisoned_and_gathered_exactly(dtype_name):
    """From a code review: the CPU device gathers these bit for bit, but the fake
    device could not poison a slot of them (NotImplementedError, TypeError), so no
    loader over such a table ran on it. Their slots now get 0xFF bytes."""
    dtype = getattr(torch, dtype_name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {dtype_name}")
    assert (poison_(torch.empty(3, 2, dtype=dtype)).view(torch.uint8) == 0xFF).all()
    raw = torch.randint(0, 256, (50, 6), dtype=torch.uint8, generator=torch.Generator()
                        .manual_seed(0))
    table = raw.view(dtype)
    triples = make_triples(50, 6, seed=2)
    device = FakeAsyncDevice(seed=5, max_delay_s=0.001)
    with PingPongLoader(triples, table, device=device) as loader:
        for batch, (inputs, _outputs, _blocks) in zip(loader, triples, strict=True):
            got = device.consumer_submit(functools.partial(_bytes_of, batch.x))
            assert torch.equal(got.result(10), raw[inputs])


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8).clone()


def test_stream_errors_surface_at_the_next_enqueue(device):
    def boom() -> None:
        raise ZeroDivisionError("in a kernel")

    device.copy_stream.put("call", (boom, None))
    device.synchronize()
    with pytest.raises(FakeStreamError, match="ZeroDivisionError") as info:
        device.record()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    device.record()  # reported once


def test_consumer_submit_returns_results_and_errors(device):
    assert device.consumer_submit(lambda: 41 + 1).result() == 42
    with pytest.raises(KeyError):
        device.consumer_submit(lambda: dict[str, int]()["missing"]).result()


def test_injected_fault_raises_in_the_calling_thread(device):
    table = make_host_table(torch.randn(N, 2), "t")
    out = device.allocate((1, 2), torch.float32)
    device.gather(table, np.array([0]), out)  # before the injection: not counted
    device.inject_fault("gather", 2, lambda: MemoryError("injected"))
    device.gather(table, np.array([0]), out)
    with pytest.raises(MemoryError, match="injected"):
        device.gather(table, np.array([0]), out)
    assert len(device.fault_times) == 1
    device.gather(table, np.array([0]), out)  # only the one call fails
    with pytest.raises(ValueError, match="unknown"):
        device.inject_fault("nope", 1, RuntimeError)


def test_seeded_delays_are_reproducible():
    a, b = FakeAsyncDevice(seed=7), FakeAsyncDevice(seed=7)
    try:
        assert [a.copy_stream.delay() for _ in range(5)] == [
            b.copy_stream.delay() for _ in range(5)
        ]
    finally:
        a.close()
        b.close()


def test_close_drains_queued_work_then_stops():
    dev = FakeAsyncDevice(max_delay_s=0.5)
    results = [dev.consumer_submit(functools.partial(int, i)) for i in range(20)]
    start = time.monotonic()
    dev.close()  # runs what is queued without the delays
    assert time.monotonic() - start < 2
    assert [r.result(0) for r in results] == list(range(20))


def test_close_gives_up_on_a_wait_that_never_completes(monkeypatch):
    import pingpong.devices.fake as fake

    monkeypatch.setattr(fake, "CLOSE_DRAIN_S", 0.2)
    dev = FakeAsyncDevice()
    dev.wait_event(FakeEvent("consumer"))  # recorded nowhere: never completes
    start = time.monotonic()
    dev.close()
    assert time.monotonic() - start < 2
    assert pingpong_threads() == []


def test_make_device_accepts_a_device_instance(device):
    assert make_device(device, "auto") is device
    assert make_device(device, "fake") is device
    with pytest.raises(ConfigError, match="does not match"):
        make_device(device, "cpu")
    with pytest.raises(ConfigError, match="sort_ids"):
        make_device(device, "auto", sort_ids="gpu")
    with pytest.raises(ConfigError, match="gather_threads"):
        make_device(device, "auto", gather_threads=2)


def test_loader_uses_and_closes_the_fake_device():
    dev = FakeAsyncDevice(seed=1)
    features = torch.randn(N, 3)
    source = make_triples(N, 4, max_inputs=20)
    loader = PingPongLoader(source, features, device=dev)
    assert loader.gather_mode == "fake"
    assert str(loader.device) == "cpu"
    out = [dev.consumer_submit(b.x.clone) for b in loader]
    assert all(torch.equal(o.result(), features[t[0]]) for o, t in zip(out, source, strict=True))
    loader.close()
    assert dev.closed
    assert pingpong_threads() == []


def test_a_fill_that_failed_before_its_record_is_never_poisoned_later(device):
    """Found by the soak: rows written by a fill that failed before ``record()``
    (e.g. the block transfer raised) were attached to the *next* ready event,
    so that batch's release poisoned a slot that held another batch by then."""
    table = make_host_table(torch.arange(N * 2, dtype=torch.float32).reshape(N, 2), "t")
    failed_out = device.allocate((2, 2), torch.float32)
    device.begin_fill()
    device.wait_event(COMPLETED)
    device.gather(table, np.array([1, 2]), failed_out)
    device.inject_fault("move_graphs", 1, lambda: RuntimeError("transfer failed"))
    with pytest.raises(RuntimeError):
        device.move_graphs([])
    out = device.allocate((2, 2), torch.float32)
    device.begin_fill()  # the next fill
    device.wait_event(COMPLETED)
    device.gather(table, np.array([3, 4]), out)
    device.move_graphs([])
    ready = device.record()
    assert ready.tensors == (out,)
    device.consumer_wait(ready)
    device.consumer_record().synchronize(5)
    assert torch.equal(failed_out, table.tensor[1:3])  # not poisoned by that release


def test_a_loader_that_fails_to_construct_closes_its_device(monkeypatch):
    dev = FakeAsyncDevice()

    def failing_attach(store):
        raise MemoryError("could not pin the table")

    monkeypatch.setattr(dev, "attach", failing_attach)
    with pytest.raises(MemoryError):
        PingPongLoader(make_triples(N, 1), torch.randn(N, 2), device=dev)
    assert dev.closed
    assert pingpong_threads() == []


EXIT_WHILE_A_WORKER_RUNS = """
import threading, time, torch
from pingpong.devices import fake
from pingpong.devices.fake import FakeAsyncDevice
fake.EXIT_JOIN_S = 10.0  # the join under test; a loaded machine cannot make it run out
started = threading.Event()
def busy():
    started.set()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        torch.ones(10_000).sum()  # gives the GIL up inside torch's C++
    print("DONE", flush=True)
device = FakeAsyncDevice(max_delay_s=0)
device.consumer_submit(busy)
assert started.wait(30)
print("EXITING", flush=True)
"""


def test_exit_waits_for_a_worker_inside_a_torch_op():
    """At interpreter exit the fake device's workers are stopped and waited for: one
    taking the GIL back inside a torch op while the interpreter finalises aborts the
    process ("terminate called without an active exception")."""
    proc = subprocess.run([sys.executable, "-c", EXIT_WHILE_A_WORKER_RUNS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["EXITING", "DONE"], proc.stdout + proc.stderr
