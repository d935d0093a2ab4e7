"""Reliability checklist items 5-10: early exit, failures, stalls, Ctrl-C/exit, re-iteration."""

from __future__ import annotations

import contextlib
import dis
import gc
import inspect
import json
import logging
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import default_sigint, wait_for_no_pingpong_threads, wait_until
from test_reliability import (
    DEVICE_KINDS,
    Expected,
    SeqSource,
    Verifier,
    fake,
    make_device,
    make_table,
    seq_triples,
)

import pingpong
import pingpong._epoch as epoch_module
import pingpong._exit_hook as exit_hook_module
import pingpong._lifecycle as lifecycle_module
import pingpong.devices.cpu as cpu_device_module
import pingpong.kernels._warmup as warmup_module
from pingpong import PingPongLoader
from pingpong._epoch_states import EpochState
from pingpong._threads import run_marking_exit
from pingpong.devices.fake import FakeAsyncDevice
from pingpong.slots import Lease

N = 400
SCRIPTS = Path(__file__).parent / "_subprocess_scripts"


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pingpong-producer")]


def settled_thread_count() -> int:
    """``threading.active_count()`` once no kernel warm-up thread is running (a loader's
    first CPU device in a process starts one, which ends on its own)."""
    assert wait_until(lambda: not any(t.name.startswith("pingpong-warmup")
                                      for t in threading.enumerate()), 30.0)
    return threading.active_count()


# -- 5. early exit -----------------------------------------------------------------
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("keep_reference", [False, True], ids=["no-ref", "held-ref"])
@pytest.mark.parametrize("how", ["break", "close", "del"])
def test_early_exit(how, keep_reference, device_kind):
    """The producer exits within 2 s of the exit becoming known; a new epoch is clean.

    With a held reference after ``break`` (or ``del`` of one of two
    references) nothing tells the loader the epoch is over: the producer then
    parks on the free queue (no CPU, no run-ahead) until the next ``iter()``
    or ``close()``, which must stop it within 2 s.
    """
    # Earlier tests' garbage first: the timed gc.collect() below would collect it too,
    # and a GraphBolt DataLoader with workers (test_forms) takes 5 s per worker.
    gc.collect()
    triples = seq_triples(N, 30)
    features, labels = make_table(), make_table(N, (), torch.int64)
    baseline = settled_thread_count()
    device = make_device(device_kind, seed=3)
    loader = PingPongLoader(SeqSource(triples, shuffle=False), features, labels, device=device)
    after_create = settled_thread_count()
    with loader:
        it = iter(loader)
        alias = it if keep_reference else None
        for i, _batch in enumerate(it):
            if i == 3:
                break
        (producer,) = producer_threads()
        start = time.monotonic()
        if how == "close":
            it.close()
            assert not producer.is_alive()  # close() joins
            with pytest.raises(StopIteration):
                next(it)
        if how in ("break", "del"):
            del it
            gc.collect()
        if keep_reference and how != "close":
            time.sleep(0.2)
            assert producer.is_alive()  # parked: the iterator may still be used
            assert loader.stats["batches"] == 4
            start = time.monotonic()
            verifier = Verifier(loader._device, Expected(features, labels, triples))
            for batch in loader:  # a new epoch ends the old one
                verifier.submit(batch)
            assert not producer.is_alive()
            assert alias is not None
            with pytest.raises(pingpong.EpochSupersededError):
                next(alias)
        else:
            assert wait_until(lambda: not producer.is_alive(), 2.0)
            verifier = Verifier(loader._device, Expected(features, labels, triples))
            for batch in loader:
                verifier.submit(batch)
        assert time.monotonic() - start < 2.0 + 1.0  # exit + one 30-batch epoch
        verifier.resolve()
        assert (verifier.checked, verifier.corrupted) == (30, 0)
        assert wait_until(lambda: threading.active_count() == after_create, 2.0), (
            after_create, [t.name for t in threading.enumerate()])
    assert wait_until(lambda: threading.active_count() == baseline, 2.0), (
        baseline, [t.name for t in threading.enumerate()])


def test_the_end_of_an_epoch_waits_for_the_producers_teardown():
    """An epoch that runs to its end joins its producer before the loop's ``for``
    ends, even when the producer has already marked its exit: the thread's own
    teardown (``Thread.run`` dropping the source, device and queues it was given,
    then its thread state) comes after the mark.  A process that exits right
    after its last epoch (a DDP rank) otherwise finalises with that thread still
    running, and one that takes the GIL back inside C++ then is ended there: the
    process aborts ("terminate called without an active exception").  Here the
    teardown is slowed by a profile hook on the producer's return from
    ``run_marking_exit`` -- after its mark -- and the end of the epoch is asked
    for only once the producer is there.
    """
    triples = seq_triples(N, 5)
    features, labels = make_table(), make_table(N, (), torch.int64)
    marked = threading.Event()

    def slow_teardown(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is run_marking_exit.__code__:
            marked.set()
            time.sleep(1.0)  # past the mark, within retire's 2 s join

    threading.setprofile(slow_teardown)
    try:
        with PingPongLoader(SeqSource(triples, shuffle=False), features, labels,
                            device="cpu") as loader:
            it = iter(loader)
            (producer,) = producer_threads()
            for _ in triples:
                next(it)
            assert marked.wait(5.0)  # the producer queued the end and marked its exit
            with pytest.raises(StopIteration):
                next(it)
            assert not producer.is_alive()
    finally:
        threading.setprofile(None)


def test_dropping_an_iterator_in_a_reference_cycle():
    """A cycle delays ``__del__`` until the garbage collector runs; then it stops."""
    with PingPongLoader(seq_triples(N, 30), make_table()) as loader:
        holder: dict[str, Any] = {}
        holder["it"] = iter(loader)
        holder["self"] = holder
        next(holder["it"])
        (producer,) = producer_threads()
        del holder
        gc.collect()
        assert wait_until(lambda: not producer.is_alive(), 2.0)


# -- 6. producer failure ----------------------------------------------------------
class InjectedFault(Exception):
    """A custom exception type (with a non-message constructor) from a producer stage."""

    def __init__(self, stage: str, at: int) -> None:
        super().__init__(f"{stage} failed at batch {at}")
        self.stage = stage
        self.at = at


class InjectedBaseFault(BaseException):
    """Not an ``Exception``: must cross the thread too."""


STAGES = ["sampler", "validation", "gather", "transfer", "ready-event", "sampler-base"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("stage", STAGES)
def test_producer_failure_at_a_random_batch(stage, seed):
    fail_at = random.Random(f"{stage}{seed}").randrange(0, 12)
    triples = seq_triples(N, 12)
    features, labels = make_table(), make_table(N, (), torch.int64)
    device = fake(seed=seed, max_delay_s=0.002)
    source = SeqSource(triples, shuffle=False)
    fault_times = source.fail_times
    raised: list[BaseException] = []

    def make_fault() -> BaseException:
        exc: BaseException = (
            InjectedBaseFault(stage) if stage == "sampler-base" else InjectedFault(stage, fail_at)
        )
        raised.append(exc)
        return exc

    expected = Expected(features, labels, triples)
    expected_type: type[BaseException] = InjectedFault
    if stage in ("sampler", "sampler-base"):
        source.fail[0] = (fail_at, make_fault)
        expected_type = InjectedBaseFault if stage == "sampler-base" else InjectedFault
    elif stage == "validation":
        bad = triples[fail_at]
        triples[fail_at] = (torch.tensor([0, N + 7]), bad[1], bad[2])
        expected_type = pingpong.IdRangeError
        yielded = source._run

        def timed_run(epoch, perm):  # record when the bad item leaves the source
            for item in yielded(epoch, perm):
                if item is triples[fail_at]:
                    fault_times.append(time.monotonic())
                yield item

        source._run = timed_run  # type: ignore[method-assign]
    else:
        method = {"gather": "gather", "transfer": "move_graphs", "ready-event": "record"}[stage]
        # gather is called twice per batch (features, labels)
        device.inject_fault(method, fail_at * (2 if method == "gather" else 1) + 1, make_fault)
        fault_times = device.fault_times

    loader = PingPongLoader(source, features, labels, device=device, timeout=10)
    with loader:
        verifier = Verifier(device, expected)
        received = 0
        with pytest.raises(expected_type) as info:
            for batch in loader:
                verifier.submit(batch)
                received += 1
                time.sleep(0.002)  # the model works
        raised_at = time.monotonic()
        assert received == fail_at
        assert len(fault_times) == 1
        assert raised_at - fault_times[0] < 1.0
        if raised:
            assert info.value is raised[0]  # the original object, not a copy
        text = "".join(traceback.format_exception(info.value))
        assert "pingpong-producer" in text  # the note naming the thread
        assert "_run" in text or "_fill" in text or "host_ids" in text  # producer frames
        verifier.resolve()
        assert verifier.corrupted == 0
        assert wait_until(lambda: not producer_threads(), 2.0)
        # the next epoch works (until the same bad batch, for validation)
        device.clear_faults()
        verifier = Verifier(device, expected)
        again = []
        for batch in _until_error(loader):
            again.append(batch.blocks["seq"])
            verifier.submit(batch)
        verifier.resolve()
        assert verifier.corrupted == 0
        if stage == "validation":
            assert again == list(range(fail_at))
        else:
            assert again == list(range(12))


def _until_error(loader: PingPongLoader) -> Iterator[Any]:
    with contextlib.suppress(pingpong.IdRangeError):
        yield from loader


def test_cpu_gather_failure_keeps_type_and_traceback(monkeypatch):
    calls = {"n": 0}
    real = cpu_device_module.gather_rows_cpu_unchecked

    def failing(table, ids, out):
        calls["n"] += 1
        if calls["n"] == 5:
            raise InjectedFault("gather", 4)
        real(table, ids, out)

    monkeypatch.setattr(cpu_device_module, "gather_rows_cpu_unchecked", failing)
    with PingPongLoader(seq_triples(N, 10), make_table()) as loader:
        with pytest.raises(InjectedFault) as info:
            list(loader)
    assert "failing" in "".join(traceback.format_exception(info.value))


# -- 7. consumer failure ---------------------------------------------------------------
class ModelError(Exception):
    pass


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("fail_at", [0, 4])
def test_consumer_failure_mid_epoch(device_kind, fail_at):
    triples = seq_triples(N, 10)
    features, labels = make_table(), make_table(N, (), torch.int64)
    device = make_device(device_kind, seed=fail_at)
    # timeout: a slot lost by the failed epoch would hang the next one
    with PingPongLoader(
        SeqSource(triples, shuffle=False), features, labels, device=device, timeout=5
    ) as loader:
        for _ in range(3):
            with pytest.raises(ModelError):
                for i, _batch in enumerate(loader):
                    if i == fail_at:
                        raise ModelError
            # the exception (and its traceback) is alive here, the epoch is not
            assert wait_until(lambda: not producer_threads(), 2.0)
        verifier = Verifier(loader._device, Expected(features, labels, triples))
        for batch in loader:
            verifier.submit(batch)
        if device_kind == "fake":
            # each failed epoch's held slot was released (when the next epoch began)
            assert device.calls["consumer_record"] == 3 * fail_at + 3 + 10
        verifier.resolve()
        assert (verifier.checked, verifier.corrupted) == (10, 0)


# -- 8. stalled source -----------------------------------------------------------------
class StallOnce:
    """Pass 0 blocks before item ``at`` until ``release`` is set; later passes do not."""

    def __init__(self, triples: list[Any], at: int) -> None:
        self.triples = triples
        self.at = at
        self.release = threading.Event()
        self.passes = 0
        self.stalled_returned = threading.Event()

    def __len__(self) -> int:
        return len(self.triples)

    def __iter__(self):
        number = self.passes
        self.passes += 1
        for i, triple in enumerate(self.triples):
            if number == 0 and i == self.at:
                self.release.wait(30)
                self.stalled_returned.set()
            yield triple


def test_stalled_source_times_out_and_the_stuck_producer_never_writes(caplog):
    """Timeout, then a new epoch while the old producer is still inside the source.

    The old producer is released in the middle of the new epoch: it holds an
    item and the stop flag is set, so it must exit without writing a slot
    (hash-sleep-hash on the fake device would show it).
    """
    triples = seq_triples(N, 20)
    features, labels = make_table(), make_table(N, (), torch.int64)
    source = StallOnce(triples, at=3)
    device = fake(seed=8, max_delay_s=0.002)
    # One-time costs of a fresh process (kernel warm-up, imports) are not what
    # timeout=0.3 is about: pay them first, so the test passes run alone too.
    assert len(list(PingPongLoader(triples[:2], features, labels))) == 2
    caplog.set_level(logging.WARNING, logger="pingpong._epoch")
    with PingPongLoader(source, features, labels, device=device, timeout=0.3) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"timeout=0\.3") as info:
            next(it)
        assert 0.25 <= time.monotonic() - start < 1.0
        assert isinstance(info.value, pingpong.BatchTimeoutError)
        assert str(info.value) == (
            "no batch within timeout=0.3 s (after 3 batches this epoch); the producer is "
            "inside the source (or a row source's fetch), which may be stalled -- raise "
            "`timeout`, or pass timeout=None to wait"
        )
        (stuck,) = producer_threads()
        # After a failure the short join is expected to miss: logged at debug level only.
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        gathers_before = device.calls["gather"]
        start = time.monotonic()
        new_epoch = iter(loader)  # waits up to 2 s for the stuck producer, then goes on
        assert 1.9 <= time.monotonic() - start < 3.0
        assert f"{stuck.name} is still blocked inside the source after 2.0 s; it will " \
            "write nothing more and exits when the source returns" in caplog.text
        assert stuck.is_alive()
        verifier = Verifier(device, Expected(features, labels, triples), stream_sleep_s=0.002)
        for i, batch in enumerate(new_epoch):
            if i == 5:
                source.release.set()  # the old producer wakes up mid-epoch
                assert source.stalled_returned.wait(2)
            verifier.submit(batch)
        verifier.resolve()
        assert (verifier.checked, verifier.corrupted) == (20, 0)
        assert wait_until(lambda: not stuck.is_alive(), 2.0)
        assert device.calls["gather"] == gathers_before + 2 * 20  # nothing from the old one


def test_a_producer_slow_outside_the_source_is_not_said_to_be_inside_it(caplog):
    """The warning when a new epoch gives up waiting for the last epoch's producer
    says where that producer is: blocked inside the source (the test above), or
    -- here, a ``form=`` callable that takes long -- busy in a step of its own."""
    items = [{"nodes": torch.arange(i, i + 20), "seeds": torch.arange(i, i + 4)}
             for i in range(0, 200, 10)]
    features, labels = make_table(), make_table(N, (), torch.int64)
    inside, release = threading.Event(), threading.Event()

    def form(item: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if int(item["nodes"][0]) == 30 and not release.is_set():
            inside.set()
            release.wait(30)
        return item["nodes"], item["seeds"]

    caplog.set_level(logging.WARNING, logger="pingpong._epoch")
    try:
        with PingPongLoader(items, features, labels, form=form, timeout=0.3) as loader:
            it = iter(loader)
            for _ in range(3):
                next(it)
            assert inside.wait(10)
            with pytest.raises(pingpong.BatchTimeoutError,
                               match="the producer is in a step of its own, not inside the "
                                     "source or a row source's fetch: a form= callable"):
                next(it)
            (slow,) = producer_threads()
            new_epoch = iter(loader)  # waits up to 2 s for the slow producer, then goes on
            assert f"{slow.name} is still running after 2.0 s, not inside the source or " \
                "a fetch" in caplog.text
            assert "blocked inside the source" not in caplog.text
            release.set()
            for batch in new_epoch:
                assert torch.equal(batch.x, features[batch.item["nodes"]])
            assert wait_until(lambda: not slow.is_alive(), 5.0)
    finally:
        release.set()


def test_no_timeout_waits_for_slow_sampling_on_the_fake_device():
    triples = seq_triples(N, 4)
    source = SeqSource(triples, shuffle=False)
    source.delay_s = 0.5  # up to 0.5 s per item: slow, not an error
    with PingPongLoader(source, make_table(), device=fake(), timeout=None) as loader:
        assert [b.blocks["seq"] for b in loader] == [0, 1, 2, 3]


def test_a_batch_that_is_ready_is_delivered_however_short_the_timeout():
    """Every wait looks at least once: with a timeout shorter than the time it
    takes ``next()`` to reach the queue (1e-5 s raised ``BatchTimeoutError`` in 6
    of 20 tries with the batch already queued, found by a lifecycle review), a
    batch that is ready is delivered.  The epoch's timeout is made 1e-12 s once
    the epoch runs, so the deadline has always passed by the first look."""
    triples = seq_triples(N, 6)
    features = make_table()
    with PingPongLoader(triples, features, timeout=30) as loader:
        batches = iter(loader)
        epoch = loader._core.epoch
        assert epoch is not None
        epoch.timeout = 1e-12
        for inputs, _, _ in triples:
            assert wait_until(lambda: not epoch.ready_q.empty(), 10.0)
            assert torch.equal(next(batches).x, features[inputs])
        assert wait_until(lambda: not epoch.ready_q.empty(), 10.0)  # the end of the epoch
        with pytest.raises(StopIteration):
            next(batches)


def test_no_timeout_still_notices_a_producer_that_dies_mid_epoch(monkeypatch):
    """The producer delivers two batches, then its thread ends with no terminal message."""
    real_produce = epoch_module.produce

    class DieAfterTwo:
        """Passes two messages on; the third kills the producer loop, and its
        ``Failure`` message is lost too: the thread ends without a word."""

        def __init__(self, q):
            self.q = q
            self.count = 0

        def put(self, item, *args, **kwargs):
            self.count += 1
            if self.count <= 2:
                self.q.put(item, *args, **kwargs)
            elif self.count == 3:
                raise RuntimeError("producer thread dies")

    def dying_produce(*, ready_q, **rest):
        dying_q = DieAfterTwo(ready_q)  # puts only: a SimpleQueue to the producer
        real_produce(ready_q=dying_q, **rest)  # type: ignore[arg-type]

    monkeypatch.setattr(epoch_module, "produce", dying_produce)
    with PingPongLoader(seq_triples(N, 6), make_table(), timeout=None) as loader:
        it = iter(loader)
        next(it)
        next(it)
        start = time.monotonic()
        with pytest.raises(pingpong.ProducerDiedError):
            next(it)
        assert time.monotonic() - start < 1.0


# -- 9. Ctrl-C and interpreter exit (subprocesses) ------------------------------------
def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        preexec_fn=default_sigint,  # Ctrl-C works even if this run ignores SIGINT
    )


@contextlib.contextmanager
def _spawned(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """:func:`_spawn`, killed (and its pipes read) at the end of the block if still running."""
    proc = _spawn(script, *args)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for_line(proc: subprocess.Popen[str], line: str, timeout: float) -> None:
    """Read the child's stdout until ``line``; a silent child fails, never hangs."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
            break  # nothing within the time left
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no {line!r} from the child in {timeout} s; stderr: "
                         f"{proc.communicate()[1]}")


def test_sigint_while_blocked_in_next_or_iter():
    """Ctrl-C in ``next()``, or in ``iter(loader)`` waiting for the source's
    ``iter()``: KeyboardInterrupt at once; caught or not, a clean exit."""
    cases = [(mode, kind, where) for mode in ("catch", "uncaught")
             for kind, where in (("cpu", "next"), ("fake", "next"), ("cpu", "iter"))]
    procs = {case: _spawn("sigint_in_next.py", *case) for case in cases}
    try:
        _check_sigint_children(procs)
    finally:  # whatever failed, leave no child (or its pipes) behind
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def _check_sigint_children(procs: dict[tuple[str, str, str], subprocess.Popen[str]]) -> None:
    for proc in procs.values():
        _wait_for_line(proc, "READY", 90)
    time.sleep(0.3)  # let them block in next() or iter()
    failures = []
    for (mode, kind, where), proc in procs.items():
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if mode == "catch":
            _wait_for_line(proc, "INTERRUPTED", 5)
            if time.monotonic() - sent > 1.0:
                failures.append(f"{kind}/{where}: took {time.monotonic() - sent:.2f} s to let go")
        try:
            _, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            failures.append(f"{mode}/{kind}/{where}: the child did not exit after SIGINT")
            continue
        exit_s = time.monotonic() - sent
        if "Fatal Python error" in stderr:
            failures.append(f"{mode}/{kind}/{where}: fatal error\n{stderr}")
        # 3 s, plus the bounded wait close() grants a kernel warm-up still compiling
        # in a fresh process (cpu_device_module.WARM_UP_JOIN_S)
        if exit_s > 3.0 + cpu_device_module.WARM_UP_JOIN_S:
            failures.append(f"{mode}/{kind}/{where}: exit took {exit_s:.1f} s")
        if mode == "catch" and proc.returncode != 0:
            failures.append(f"{mode}/{kind}/{where}: rc {proc.returncode}\n{stderr}")
        if mode == "uncaught" and (proc.returncode == 0 or "KeyboardInterrupt" not in stderr):
            failures.append(f"{mode}/{kind}/{where}: rc {proc.returncode}\n{stderr}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow  # a 4-second storm of signals in a child process
def test_sigint_storm_in_next_only_ever_raises_keyboard_interrupt():
    """About 1,400 Ctrl-C's landing in ``next()``: each a clean KeyboardInterrupt.

    Afterwards the loader still delivers and closes promptly.  The bug this
    guards against (``queue.Queue`` in ``next()``: a ``RuntimeError`` or a hang
    about once per 12,000 interrupts, see ``benchmarks/sigint_queue.py``) was
    found by ``test_sigint_while_blocked_in_next`` under load; this storm would
    catch it only in roughly one run in ten, so it is a regression guard for
    the whole interrupt path rather than a sure test of that race.
    """
    with _spawned("sigint_storm.py", "4") as proc:
        _wait_for_line(proc, "READY", 90)
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.001)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["other"] == 0, report["others"]
    assert report["keyboard_interrupt"] >= 100  # the storm did land in next()
    assert report["delivered_after"]
    assert report["close_s"] < 2.0


@pytest.mark.parametrize(("where", "handler"), [
    ("iter", "returns"), ("iter", "raises"), ("close", "returns")])
def test_close_from_a_signal_handler_while_iter_or_close_waits_for_a_producer(where, handler):
    """From a code review: a SIGTERM handler calling ``loader.close()`` (a graceful
    stop under a job scheduler) hung for ever when the signal landed while the
    main thread was in that loader's ``iter()`` or ``close()`` waiting for the last
    epoch's producer: they hold locks that ``close()`` waits for, on the thread
    the handler runs on.  The handler's ``close()`` now returns; the interrupted
    call finishes the close (``iter()`` raising ``LoaderClosedError``) -- also
    when the handler raises after it (from a self-review: the close was left
    unfinished, the device open) -- and no producer is left."""
    with _spawned("close_in_signal_handler.py", where, handler) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # SIGKILL: SIGTERM would only run the handler again
            stdout, stderr = proc.communicate()
            pytest.fail(f"hung; stdout so far: {stdout!r}")
    assert proc.returncode == 0, stderr
    done = {("iter", "returns"): "ITER RAISED LoaderClosedError",
            ("iter", "raises"): "ITER RAISED Stop",
            ("close", "returns"): "CLOSED"}[where, handler]
    assert stdout.split() == ["HANDLED", *done.split(), "CLOSED=True", "FULLY_CLOSED=True",
                              "PRODUCERS_LEFT=0"], stdout


EXIT_SCENARIOS = {
    "stalled-source": 0,
    "stalled-fetch": 0,
    "stalled-iter": 0,
    "waiting-for-slot": 0,
    "mid-gather": 0,
    "slow-producer": 0,
    "stuck-producer": 0,
    "stuck-producer-hook-twice": 0,
    "fake-device": 0,
    "sys-exit": 3,
    "sys-exit-slow": 3,
    "exception": 1,
}


_EXIT_WHILE_THE_PRODUCER_IS_INSIDE_THE_SOURCE = """
import atexit, threading, time

@atexit.register  # registered first: runs after every other exit hook
def _report():
    alive = [t.name for t in threading.enumerate() if t.name.startswith("pingpong-producer")]
    print("PRODUCERS_ALIVE_AT_THE_LAST_HOOK", len(alive), flush=True)
    print("LAST_HOOK_AFTER", time.monotonic() - _exiting[0], flush=True)

_exiting = []

import torch
import pingpong._exit_hook as exit_hook
from pingpong import PingPongLoader

exit_hook.EXIT_JOIN_BUDGET_S = 60.0  # room for any load: the join, not its budget, is tested

class SlowToLeave:
    def __iter__(self):
        yield (torch.arange(10), torch.arange(4), None)
        time.sleep(1.5)  # the producer is in here at exit; it leaves after the sleep
        while True:
            yield (torch.arange(10), torch.arange(4), None)

loader = PingPongLoader(SlowToLeave(), torch.randn(20, 3), num_buffers=2)
it = iter(loader)
next(it)
time.sleep(0.3)
_exiting.append(time.monotonic())
print("EXITING", flush=True)
"""


def test_the_exit_hook_joins_a_producer_still_inside_the_source():
    """At interpreter exit the hook ends every epoch and joins every producer thread
    (``EXIT_JOIN_BUDGET_S``; made long here): a producer inside the source when the
    script ends has left it and exited before the last exit hook -- no daemon thread
    taking the GIL back during finalisation.  Without the join (or with the producer
    not among the threads it joins) the loader's own finaliser, at exit, waits only
    0.1 s and the producer is still alive then; with the epochs not ended first, the
    join waits out its whole budget for a producer that was never told to stop."""
    child = subprocess.run([sys.executable, "-c", _EXIT_WHILE_THE_PRODUCER_IS_INSIDE_THE_SOURCE],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    words = child.stdout.split()
    assert words[:3] == ["EXITING", "PRODUCERS_ALIVE_AT_THE_LAST_HOOK", "0"], \
        (child.stdout, child.stderr[-2000:])
    assert words[3] == "LAST_HOOK_AFTER", child.stdout
    # the producer leaves the source about 1.2 s after EXITING; the budget is 60 s
    assert float(words[4]) < 30.0, child.stdout


def test_a_ctrl_c_while_iter_retires_the_previous_epoch_leaves_it_to_the_next_iter(monkeypatch):
    """A Ctrl-C landing in ``iter()``'s join of the previous epoch: the loader keeps
    that epoch, and the next ``iter()`` retires it and hands its held slot back
    (found by reading: forgotten, its release events were never recorded, and
    the new producer refilled the slot under reads queued on the held batch)."""
    triples = seq_triples(N, 12)
    features = make_table()
    device = fake(seed=0, max_delay_s=0.0)
    source = SeqSource(triples, shuffle=True)
    real_retire = epoch_module.Epoch.retire

    def ctrl_c_in_the_join(self: epoch_module.Epoch, join_s: float) -> None:
        monkeypatch.setattr(epoch_module.Epoch, "retire", real_retire)
        raise KeyboardInterrupt

    with pingpong.PingPongLoader(source, features, device=device, num_buffers=2) as loader:
        it = iter(loader)
        held = next(it)
        x = held.x
        device.consumer_submit(lambda: time.sleep(0.3))
        copy = device.consumer_submit(lambda: x.clone())
        monkeypatch.setattr(epoch_module.Epoch, "retire", ctrl_c_in_the_join)
        with pytest.raises(KeyboardInterrupt):
            iter(loader)
        assert sum(1 for _ in loader) == 12
        assert torch.equal(copy.result(), features[triples[source.order[0][0]][0]])


def test_a_ctrl_c_while_close_joins_the_producer_is_finished_by_the_next_close(monkeypatch):
    """A Ctrl-C landing in ``close()``'s join of the producer: the loader is closed
    (no new epoch) but keeps the ended epoch and its device; the next ``close()``
    retires the epoch and closes the device (found by review: the device was never
    closed -- on CUDA the tables stayed pinned -- and a second close() did nothing)."""
    triples = seq_triples(N, 12)
    device = fake(seed=0, max_delay_s=0.0)
    real_retire = epoch_module.Epoch.retire

    def ctrl_c_in_the_join(self: epoch_module.Epoch, join_s: float) -> None:
        monkeypatch.setattr(epoch_module.Epoch, "retire", real_retire)
        raise KeyboardInterrupt

    loader = pingpong.PingPongLoader(triples, make_table(), device=device, num_buffers=2)
    it = iter(loader)
    next(it)
    monkeypatch.setattr(epoch_module.Epoch, "retire", ctrl_c_in_the_join)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert loader.closed
    assert not device.closed  # not under a producer that was never joined
    with pytest.raises(pingpong.LoaderClosedError):
        iter(loader)
    loader.close()
    assert device.closed
    assert wait_for_no_pingpong_threads(2.0) == []


def _body_lines(function: Any) -> list[int]:
    """The lines of ``function``'s body (after its ``def``) whose code starts with an
    instruction a signal can land at: not a NOP (``pass``, ``try:``), which 3.11
    may leave outside a ``with`` block's cleanup, so that a trace function raising
    there leaves the lock held -- where no real Ctrl-C lands."""
    code = function.__code__
    first_op: dict[int, str] = {}
    for instruction in dis.get_instructions(code):
        line = instruction.positions.lineno if instruction.positions else None
        if line is not None and line > code.co_firstlineno:
            first_op.setdefault(line, instruction.opname)
    return sorted(line for line, opname in first_op.items() if opname != "NOP")


@contextlib.contextmanager
def _ctrl_c_at_line(function: Any, lineno: int) -> Iterator[list[int]]:
    """Raise KeyboardInterrupt once, as the main thread reaches ``lineno`` of
    ``function`` (a Ctrl-C landing there); yields a list that holds the line once
    it fired (a line the call never reaches does not fire)."""
    code = function.__code__
    fired: list[int] = []

    def in_function(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == lineno and not fired:
            fired.append(lineno)
            raise KeyboardInterrupt
        return in_function

    sys.settrace(lambda frame, event, arg: in_function
                 if frame.f_code is code and not fired else None)
    try:
        yield fired
    finally:
        sys.settrace(None)


def _loader_one_batch_in(device: Any) -> tuple[PingPongLoader, Iterator[Any]]:
    """A loader on ``device`` and its epoch's iterator, one batch delivered."""
    loader = pingpong.PingPongLoader(seq_triples(N, 12), make_table(), device=device,
                                     num_buffers=2)
    it = iter(loader)
    next(it)
    return loader, it


HANDOVER = {"Epoch.end": epoch_module.Epoch.end,
            "Epoch.retire": epoch_module.Epoch.retire,
            "LoaderCore.start_epoch": lifecycle_module.LoaderCore.start_epoch,
            "LoaderCore._start_epoch": lifecycle_module.LoaderCore._start_epoch}


@pytest.mark.parametrize("where", sorted(HANDOVER))
def test_a_ctrl_c_at_any_line_of_the_epoch_handover_leaves_nothing_running(where):
    """From a randomized lifecycle review: a Ctrl-C inside ``iter()`` between
    ``start_epoch`` forgetting the running epoch and ending it left that epoch
    running after ``close()`` (its iterator went on delivering, and on the fake
    device ``close()`` closed the device under it); one inside ``Epoch.end``
    between its new state and the stop flag left an ended epoch whose producer
    was never stopped.  A Ctrl-C at each line in turn: afterwards ``close()``
    ends the old epoch, stops every thread and closes the device."""
    function = HANDOVER[where]
    fired_at = []
    for lineno in _body_lines(function):
        device = fake(seed=0, max_delay_s=0.0)
        loader, old = _loader_one_batch_in(device)
        with contextlib.suppress(KeyboardInterrupt), _ctrl_c_at_line(function, lineno) as fired:
            iter(loader)  # ends the old epoch: end(), retire(), start_epoch()
        fired_at += fired
        loader.close()
        with pytest.raises((pingpong.LoaderClosedError, pingpong.EpochSupersededError)):
            next(old)
        assert device.closed, lineno
        assert wait_for_no_pingpong_threads(5.0) == [], lineno
    assert len(fired_at) >= 3, fired_at


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", ["_close", "_close_holding_the_close_lock"])
def test_a_ctrl_c_at_any_line_of_the_finaliser_still_closes_the_device(where):
    """From a randomized lifecycle review: a Ctrl-C while the garbage collector
    ran a dropped loader's finaliser was swallowed by Python ("Exception ignored")
    with the device still open -- on CUDA, its pinned tables for the life of the
    process -- and nothing could call ``close()`` again."""
    function = getattr(lifecycle_module.LoaderCore, where)
    fired_at = []
    for lineno in _body_lines(function):
        device = fake(seed=0, max_delay_s=0.0)
        loader, it = _loader_one_batch_in(device)
        del it
        with contextlib.suppress(KeyboardInterrupt), _ctrl_c_at_line(function, lineno) as fired:
            del loader  # the last reference: the finaliser runs here
            gc.collect()
        fired_at += fired
        assert device.closed, lineno
        assert wait_for_no_pingpong_threads(5.0) == [], lineno
    assert len(fired_at) >= 3, fired_at


def test_a_close_descheduled_before_its_wakeup_still_reads_as_closed():
    """From a randomized lifecycle review: ``close()`` from another thread,
    descheduled between ending the epoch and waking the waiting ``next()``: the
    producer left, and ``next()`` found it gone with nothing queued and raised
    ``ProducerDiedError``; it is ``LoaderClosedError``, as the epoch says."""
    lines, first = inspect.getsourcelines(epoch_module.Epoch.end)
    wakeup = first + next(i for i, text in enumerate(lines)
                          if text.strip() == "self.ready_q.put(_WAKEUP)")
    code = epoch_module.Epoch.end.__code__

    def descheduled(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == wakeup:
            time.sleep(0.5)  # longer than the producer takes to see `stop` and leave
        return descheduled

    def close_from_another_thread(loader: PingPongLoader) -> None:
        sys.settrace(lambda frame, event, arg: descheduled if frame.f_code is code else None)
        loader.close()

    class SlowSampler:
        def __iter__(self) -> Iterator[Any]:
            for item in seq_triples(N, 20):
                time.sleep(0.3)
                yield item

    loader = PingPongLoader(SlowSampler(), make_table())
    it = iter(loader)
    next(it)
    closer = threading.Timer(0.1, close_from_another_thread, (loader,))
    closer.start()
    with pytest.raises(pingpong.LoaderClosedError):
        next(it)
    closer.join()


# this test takes SIGALRM for its Ctrl-C, which the suite's per-test limit also uses
@pytest.mark.timeout(600, method="thread")
@pytest.mark.parametrize("loaders", ["one loader", "two loaders"])
def test_a_real_ctrl_c_while_waiting_for_a_producer_inside_a_persistent_worker_loader(
        loaders):
    """From a randomized lifecycle review: on CPython 3.11 a ``Thread.join`` that a
    Ctrl-C interrupts can mark the still-running thread as stopped (cpython#90882);
    the next ``iter()`` then took the old producer for gone and reset the
    DataLoader's iterator under it (torch: "Invalid iterator state", every time).
    pingpong now waits on the producer's own exit mark: the next pass is whole."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    source = _persistent_source(SlowItems(0.3))
    features = torch.randn(8, 3)
    first = PingPongLoader(source, features, form=_item_form, timeout=20)
    second = first if loaders == "one loader" else PingPongLoader(
        source, features, form=_item_form, timeout=20)
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        kept = iter(first)  # its producer is now inside the DataLoader (0.3 s per item)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            iter(second)  # ends that epoch and waits for its producer: Ctrl-C there
        assert _exact_items(_iter_once_the_source_is_free(first), features) == list(range(8))
        with pytest.raises((pingpong.EpochSupersededError, pingpong.LoaderClosedError)):
            next(kept)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        first.close()
        second.close()


def test_interpreter_exit_with_a_live_iterator():
    """No "Fatal Python error", the expected exit status, and a prompt exit; no
    producer alive at the last exit hook but one blocked inside its source or a row
    source's fetch (left behind: waiting for it could take forever).
    ``slow-producer``'s producer takes a step of its own that lasts until 1.5 s
    into the exit hooks (a machine too busy to run it): the hook waits for it beyond its 0.5 s join
    (``EXIT_BUSY_WAIT_S``); a producer left alive then may abort the process
    during finalisation. So in ``sys-exit-slow``, whose loader is closed before
    the hook runs; and ``stuck-producer``'s 60 s step is waited for 5 s, no longer,
    also by a hook registered twice (``stuck-producer-hook-twice``: a DistDGL client's).

    Promptness is measured inside the child, from the last line of the script
    to the last exit hook: pingpong's shutdown (finalisers, joins) lies in
    between; the interpreter's own teardown afterwards is not pingpong's.
    """
    procs = {name: _spawn("exit_with_live_iterator.py", name) for name in EXIT_SCENARIOS}
    failures = []
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            failures.append(f"{name}: did not exit")
            continue
        if "Fatal Python error" in stderr:
            failures.append(f"{name}: fatal error\n{stderr}")
        if proc.returncode != EXIT_SCENARIOS[name]:
            failures.append(f"{name}: rc {proc.returncode}\n{stderr}")
        if EXIT_SCENARIOS[name] == 0 and ("Traceback" in stderr or "Exception ignored" in stderr):
            failures.append(f"{name}: an error while exiting\n{stderr}")
        lines = [line.split() for line in stdout.splitlines()]
        alive = [int(w[1]) for w in lines if w and w[0] == "PRODUCERS_ALIVE_AT_THE_LAST_HOOK"]
        if alive != [1 if name.startswith(("stalled-", "stuck-producer")) else 0]:
            failures.append(f"{name}: producers alive at the last exit hook: {alive}\n{stdout}")
        shutdown = [float(w[1]) for w in lines if w and w[0] == "LAST_HOOK_AFTER"]
        warm_up_ends = [float(w[1]) for w in lines if w and w[0] == "WARM_UP_ENDED_AFTER"]
        # One in-flight gather + a 0.5 s join, with room for load; a kernel
        # warm-up still compiling at exit is waited for first (its step in
        # progress: threading._shutdown runs before the atexit hooks), for at
        # most EXIT_JOIN_S (one CI run on a loaded VM: 5.13 s, its step unfinished).
        limit = 2.0 + max([0.0, *warm_up_ends])
        if "WARM_UP_UNFINISHED" in stdout:
            limit = 2.0 + warmup_module.EXIT_JOIN_S
        # mid-gather: shutdown waits for the gather in flight, which a loaded VM
        # makes slow (one run with load 6: shutdown 2.69 s, likely that gather);
        # past its end, the same 2 s. The producer starts at most one more gather after EXITING
        # (between the mark and the stop flag).
        started = [int(w[1]) for w in lines if w and w[0] == "GATHERS_STARTED_AFTER_EXITING"]
        gather_ends = [float(w[1]) for w in lines if w and w[0] == "GATHER_ENDED_AFTER"]
        if name == "mid-gather" and (not started or started[0] > 1):
            failures.append(f"{name}: gathers started after EXITING: {started}\n{stdout}")
        limit = max(limit, 2.0 + max([0.0, *gather_ends]))
        # slow-producer, sys-exit-slow: shutdown waits for the slow step; past its end,
        # the same 2 s. stuck-producer's is waited for EXIT_BUSY_WAIT_S, no longer.
        slow_ends = [float(w[1]) for w in lines if w and w[0] == "SLOW_STEP_ENDED_AFTER"]
        if name in ("slow-producer", "sys-exit-slow") and not slow_ends:
            failures.append(f"{name}: its producer took no slow step after EXITING\n{stdout}")
        limit = max(limit, 2.0 + max([0.0, *slow_ends]))
        if name.startswith("stuck-producer"):
            limit = max(limit, 2.0 + max([0.0, *warm_up_ends]) + exit_hook_module.EXIT_BUSY_WAIT_S)
        if name == "stuck-producer-hook-twice":  # each run joins; the busy wait is shared
            limit += exit_hook_module.EXIT_JOIN_BUDGET_S  # not shared: 11.7 s against ~8 s
        if "EXITING" not in stdout or not shutdown:
            failures.append(f"{name}: no exit marks in {stdout!r}\n{stderr}")
        elif shutdown[0] > limit:
            failures.append(
                f"{name}: pingpong's shutdown took {shutdown[0]:.2f} s (limit {limit:.2f} s)"
                f"\n{stdout}"
            )
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("scenario", ["exit", "close", "iter"])
def test_a_process_forked_while_the_producer_fills_a_slot(scenario):
    """The child of a fork made while the producer held the epoch's write lock
    (inside a gather) has no producer thread, and the lock stays held there: it
    still leaves, closes the loader, or runs a new exact epoch of it, without
    waiting for the lock (it hung in all three, found by a lifecycle review); the
    parent's own epoch goes on unharmed."""
    with _spawned("fork_mid_fill.py", scenario) as proc:
        stdout, stderr = proc.communicate(timeout=120)
    assert "CHILD_OK" in stdout, (stdout, stderr)
    assert "CHILD_EXIT 0" in stdout, (stdout, stderr)
    assert "PARENT_OK" in stdout, (stdout, stderr)
    assert proc.returncode == 0, (stdout, stderr)


# -- 10. re-iteration ---------------------------------------------------------------
class SharedStream:
    """Like a torch ``DataLoader(persistent_workers=True)``: ``iter()`` resets one
    shared iterator.  ``next()`` first waits for data (``gate``), then takes the
    next item -- so a stale caller waiting inside ``next()`` would take an item
    meant for the new pass (torchdata #1482)."""

    def __init__(self, triples: list[Any]) -> None:
        self.triples = triples
        self.lock = threading.Lock()
        self.cursor = 0
        self.gate = threading.Event()
        self.gate.set()
        self.taken: list[tuple[str, int]] = []

    def __len__(self) -> int:
        return len(self.triples)

    def __iter__(self) -> _SharedIterator:
        with self.lock:
            self.cursor = 0
        return _SharedIterator(self)


class _SharedIterator:
    def __init__(self, stream: SharedStream) -> None:
        self.stream = stream

    def __iter__(self) -> _SharedIterator:
        return self

    def __next__(self) -> Any:
        stream = self.stream
        stream.gate.wait(30)
        with stream.lock:
            index = stream.cursor
            if index >= len(stream.triples):
                raise StopIteration
            stream.cursor += 1
            stream.taken.append((threading.current_thread().name, index))
        return stream.triples[index]


def test_old_producer_does_not_steal_from_the_new_epoch():
    """Found a bug: after a timeout, the next ``iter()`` started a new producer while
    the old one was still waiting inside ``next(source)``; it then took item 0
    of the new pass and dropped it (silent data loss)."""
    triples = seq_triples(N, 8)
    source = SharedStream(triples)
    with PingPongLoader(source, make_table(), timeout=0.6) as loader:
        list(loader)  # warm up (first-call compilation)
        it = iter(loader)
        next(it)
        source.gate.clear()  # the sampler stalls
        time.sleep(0.1)
        with pytest.raises(TimeoutError):
            for _ in range(10):
                next(it)
        threading.Timer(0.3, source.gate.set).start()
        seqs = [batch.blocks["seq"] for batch in loader]
    assert seqs == list(range(8))


class SlowOnce(torch.utils.data.Dataset):
    """Items 0..7; item 2 takes ``stall_s`` while the shared flag ``stall`` is
    set, and sets the shared flag ``stalling`` as it starts."""

    def __init__(self, stall_s: float) -> None:
        self.stall = torch.zeros(1).share_memory_()
        self.stalling = torch.zeros(1).share_memory_()
        self.stall_s = stall_s

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 2 and self.stall[0] == 1:
            self.stalling[0] = 1
            time.sleep(self.stall_s)
        return i


class SlowItems(torch.utils.data.Dataset):
    """Items 0..7, each taking ``delay[0]`` s (shared with the workers)."""

    def __init__(self, delay_s: float) -> None:
        self.delay = torch.full((1,), delay_s).share_memory_()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        time.sleep(float(self.delay[0]))
        return i


def _item_form(ids: torch.Tensor) -> tuple[torch.Tensor, None]:
    return ids, None


def _persistent_source(dataset: torch.utils.data.Dataset) -> torch.utils.data.DataLoader:
    source = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=1,
                                         persistent_workers=True)
    assert [int(i) for i in source] == list(range(8))  # starts the persistent worker
    return source


def _iter_once_the_source_is_free(loader: PingPongLoader) -> Iterator[Any]:
    """``iter(loader)``, retried while it times out waiting for the last epoch's
    producer to leave the source (for up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return iter(loader)
        except pingpong.BatchTimeoutError as exc:
            message = str(exc)
        assert "the last epoch's producer over this source" in message
        assert time.monotonic() < deadline


def _exact_items(batches: Iterator[Any], features: torch.Tensor) -> list[int]:
    got = []
    for batch in batches:
        assert torch.equal(batch.x, features[batch.item])
        got.append(int(batch.item))
    return got


def test_a_persistent_worker_loader_is_not_reset_under_a_stuck_producer():
    """Found in review: after a timeout, ``iter()`` went on after 2 s while the old
    producer was still inside ``next()`` of the iterator that torch's persistent
    workers share between passes; resetting it broke the source
    ("Invalid iterator state") or lost item 0.  Now the new pass starts only
    once that producer has left: ``iter()`` times out (``timeout=2``) naming it,
    and a later one gets the whole pass."""
    dataset = SlowOnce(stall_s=8.0)
    source = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=1,
                                         persistent_workers=True)
    assert [int(i) for i in source] == list(range(8))  # starts the persistent worker
    features = torch.randn(8, 3)

    def form(ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ids, None

    # timeout: well under the stall, well over a worker's round trip on a busy CI box
    with PingPongLoader(source, features, form=form, timeout=2.0) as loader:
        assert [int(b.item) for b in loader] == list(range(8))
        dataset.stall[0] = 1
        with pytest.raises(pingpong.BatchTimeoutError):
            for _batch in loader:
                pass
        dataset.stall[0] = 0  # read by the worker on its next item, not the stalled one
        (stuck,) = producer_threads()
        with pytest.raises(pingpong.BatchTimeoutError,
                           match="the last epoch's producer over this source") as info:
            iter(loader)
        assert stuck.name in str(info.value)
        got = _exact_items(_iter_once_the_source_is_free(loader), features)
    assert got == list(range(8))


def _shared_iterator_source(kind: str) -> Any:
    """Items 0..7 from a source whose ``iter()`` ends or resets an open iterator."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    if kind == "persistent workers":
        return _persistent_source(SlowItems(0.0))
    if kind == "a datapipe":
        return IterableWrapper([torch.tensor([i]) for i in range(8)])
    return torch.utils.data.DataLoader(IterableWrapper(range(8)), batch_size=1)


@pytest.mark.parametrize("kind", ["persistent workers", "a datapipe",
                                  "DataLoader over a datapipe"])
def test_two_loaders_over_one_shared_iterator_source_take_turns_loudly(kind):
    """Found in user-style review: two loaders over one ``persistent_workers=True``
    DataLoader, in ``zip`` or nested loops, put two producers inside the one
    iterator its ``iter()`` resets: epochs of 0 batches with no error, or
    ``KeyError`` from torch.  A datapipe allows one live iterator (torchdata): a
    second ``iter()`` invalidates the first, which raises torch's "invalidated"
    error (or, behind GraphBolt's prefetcher, stops: ``test_forms.py``).  Now, as
    for two ``iter()`` of one loader, the newer ``iter()`` ends the running epoch,
    whose iterator raises ``EpochSupersededError``; every pass that runs is exact."""
    source = _shared_iterator_source(kind)
    features = torch.randn(8, 3)
    with PingPongLoader(source, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(source, features, form=_item_form, timeout=20) as second:
        with pytest.raises(pingpong.EpochSupersededError,
                           match="persistent_workers=True, or a datapipe"):
            for _pair in zip(first, second, strict=False):
                pass
        outer = iter(first)
        assert int(next(outer).item) == 0
        assert _exact_items(iter(second), features) == list(range(8))  # a nested loop
        with pytest.raises(pingpong.EpochSupersededError):
            next(outer)
        assert _exact_items(iter(first), features) == list(range(8))
        assert _exact_items(iter(second), features) == list(range(8))


def test_a_datapipe_source_without_a_hash_runs_its_passes_unclaimed():
    """A datapipe with value equality (``__eq__`` and so no ``__hash__``, as a
    dataclass has) cannot key the record of which epoch iterates a source: its
    loaders start their epochs as over any other source -- every pass exact, not
    a ``TypeError`` (unhashable) out of ``iter()``."""
    from torch.utils.data import IterDataPipe

    class ValueEqualItems(IterDataPipe):
        def __init__(self, count: int) -> None:
            self.count = count

        def __iter__(self) -> Iterator[torch.Tensor]:
            yield from (torch.tensor([i]) for i in range(self.count))

        def __eq__(self, other: object) -> bool:
            return isinstance(other, ValueEqualItems) and other.count == self.count

    source = ValueEqualItems(8)
    with pytest.raises(TypeError, match="unhashable"):
        hash(source)
    features = torch.randn(8, 3)
    with PingPongLoader(source, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(source, features, form=_item_form, timeout=20) as second:
        for loader in (first, second, first):
            assert _exact_items(iter(loader), features) == list(range(8))


def test_two_loaders_over_a_datapipe_loader_with_workers_run_side_by_side():
    """From a review: a ``DataLoader`` over a datapipe *with* workers (not
    persistent) sends each pass its own copy of the datapipe, and plain torch
    runs two passes side by side; so do two loaders over it (``zip``), exact."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    source = torch.utils.data.DataLoader(IterableWrapper(range(8)), batch_size=1,
                                         num_workers=1)
    features = torch.randn(8, 3)
    with PingPongLoader(source, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(source, features, form=_item_form, timeout=20) as second:
        pairs = [(int(a.item), int(b.item)) for a, b in zip(first, second, strict=True)
                 if torch.equal(a.x, features[a.item]) and torch.equal(b.x, features[b.item])]
    assert pairs == [(i, i) for i in range(8)]


class _StallOncePipe(torch.utils.data.IterDataPipe):
    """Items 0..7 as datapipe; item 2 stalls ``stall_s`` once, when armed."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.armed = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(8):
            if i == 2 and self.armed:
                self.armed = False
                time.sleep(self.stall_s)
            yield torch.tensor([i])


@pytest.mark.parametrize("next_pass", ["same loader", "another loader"])
def test_no_new_pass_of_a_datapipe_under_a_stuck_ended_producer(next_pass):
    """From a review: a datapipe's ``reset()`` rebinds state (a shuffle buffer) that
    the ended epoch's producer, stuck inside a step, writes into once the step
    returns: a new pass started under it delivered an item twice and lost one.
    The new pass now starts once that producer has left: a loader with a short
    ``timeout`` times out in ``iter()`` naming it (a later ``iter()`` works), one
    with a long one waits; either way the pass is whole and exact."""
    stalls = _StallOncePipe(stall_s=6.0)
    pipe = stalls.shuffle(buffer_size=4)
    features = torch.randn(8, 3)
    with PingPongLoader(pipe, features, form=_item_form, timeout=1.0) as first, \
            PingPongLoader(pipe, features, form=_item_form, timeout=20) as second:
        stalls.armed = True
        with pytest.raises(pingpong.BatchTimeoutError):
            for _batch in first:
                pass
        if next_pass == "same loader":
            with pytest.raises(pingpong.BatchTimeoutError,
                               match="the last epoch's producer over this source"):
                iter(first)
            items = _exact_items(_iter_once_the_source_is_free(first), features)
        else:
            items = _exact_items(iter(second), features)  # waits for that producer
        assert sorted(items) == list(range(8))


class _SignalledStallPipe(torch.utils.data.IterDataPipe):
    """Items 0..7 as a datapipe; item 2 stalls ``stall_s`` once, when armed, and
    sets ``stalling`` as it starts; while ``slow``, its ``iter()`` takes ``start_s``."""

    def __init__(self, stall_s: float, start_s: float = 0.0) -> None:
        self.stall_s, self.start_s = stall_s, start_s
        self.slow = self.armed = False
        self.stalling = threading.Event()

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.slow:
            time.sleep(self.start_s)
        return self._items()

    def _items(self) -> Iterator[torch.Tensor]:
        for i in range(8):
            if i == 2 and self.armed:
                self.armed = False
                self.stalling.set()
                time.sleep(self.stall_s)
            yield torch.tensor([i])


@pytest.mark.parametrize("turns", [False, True], ids=["", "rpc-turns"])
@pytest.mark.parametrize("next_pass", ["same loader", "another loader"])
@pytest.mark.parametrize("kind", ["a datapipe", "persistent workers"])
def test_a_new_pass_waits_for_the_stuck_producer_of_the_last_one(
        kind, next_pass, turns, monkeypatch):
    """From a GraphBolt review: a ``break`` out of an epoch whose producer was in
    a source step longer than 2 s, then a new epoch, raised ``SourceBusyError``
    (``timeout=None`` or not) -- a plain-loop pattern that must work.  Now the
    new pass's producer lets the stuck one leave before it calls
    ``iter(source)``, whose reset of the one iterator then comes after the
    stuck step: ``iter()`` waits (the loader's ``timeout`` bounds it) and the
    pass is whole and exact.  The same in a DistDGL client, where the producers
    also take turns in DGL's RPC client."""
    if turns:
        monkeypatch.setattr(pingpong._rpc, "lock_for_process",
                            lambda: pingpong._rpc.RPC_LOCK)
    features = torch.randn(8, 3)
    if kind == "a datapipe":
        pipe = _SignalledStallPipe(stall_s=4.0)
        source: Any = pipe.shuffle(buffer_size=4)
        pipe.armed = True
        stalling = pipe.stalling.is_set
    else:
        dataset = SlowOnce(stall_s=4.0)
        source = _persistent_source(dataset)
        dataset.stall[0] = 1
        stalling = lambda: bool(dataset.stalling[0] == 1)  # noqa: E731
    with PingPongLoader(source, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(source, features, form=_item_form, timeout=20) as second:
        epoch = iter(first)
        if kind == "persistent workers":
            next(epoch), next(epoch)  # the producer then waits for item 2, or 3
        assert wait_until(stalling, 10.0)
        if kind == "persistent workers":
            dataset.stall[0] = 0  # read by the worker on its next item, not the stalled one
        time.sleep(0.3)  # the producer is inside next(source), behind the stalled item
        del epoch  # ended; its producer is inside the stalled step
        loader = first if next_pass == "same loader" else second
        start = time.monotonic()
        items = _exact_items(iter(loader), features)
        assert time.monotonic() - start > 2.5  # it waited for the stalled step
        assert sorted(items) == list(range(8))
        if kind == "persistent workers":
            assert items == list(range(8))


def test_a_timeout_in_iter_blames_an_earlier_producer_only_while_it_is_inside():
    """From a self-review: ``iter()``'s timeout said the last epoch's producer was
    still inside the source whenever the new pass had had one to wait for, also
    once it had left and the source's own ``iter()`` was the slow part."""
    pipe = _SignalledStallPipe(stall_s=0.5, start_s=4.0)
    features = torch.randn(8, 3)
    with PingPongLoader(pipe, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(pipe, features, form=_item_form, timeout=2.0) as second:
        pipe.armed = True
        epoch = iter(first)
        assert pipe.stalling.wait(10)
        del epoch  # its producer is inside a 0.5 s step, then leaves
        pipe.slow = True  # the next pass's iter(source) takes 4 s
        with pytest.raises(pingpong.BatchTimeoutError) as info:
            iter(second)
        assert "the source's iter() did not return within timeout=2.0 s" in str(info.value)
        assert "producer over this source" not in str(info.value)
        pipe.slow = False
        assert sorted(_exact_items(iter(second), features)) == list(range(8))


class _GatedPipe(torch.utils.data.IterDataPipe):
    """Items 0..15 as a datapipe; item 2 waits for ``gate`` once, when armed."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.armed = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(16):
            if i == 2 and self.armed:
                self.armed = False
                self.gate.wait(30)
            yield torch.tensor([i])


def test_two_threads_claiming_a_shared_source_at_once_follow_the_last_iter_rule():
    """From session 40's note: two threads call ``iter()`` on two loaders over one
    datapipe while a third loader's producer is inside it.  The second to claim
    the source once refused the first one's fresh epoch with a false "still
    inside the source" error.  Each new epoch supersedes the last and its
    producer waits for that one's: one pass is whole and exact, the other
    raises ``EpochSupersededError``."""
    pipe = _GatedPipe()
    features = torch.randn(16, 3)
    loaders = [PingPongLoader(pipe, features, form=_item_form, timeout=20)
               for _ in range(3)]
    try:
        stuck = iter(loaders[0])
        pipe.armed = True
        assert int(next(stuck).item) == 0  # the producer goes on to item 2 and waits
        outcomes: dict[int, object] = {}

        def claim_and_read(k: int) -> None:
            try:
                outcomes[k] = _exact_items(iter(loaders[k]), features)
            except Exception as exc:  # noqa: BLE001 -- the outcome under test
                outcomes[k] = type(exc).__name__

        claimers = [threading.Thread(target=claim_and_read, args=(k,)) for k in (1, 2)]
        for claimer in claimers:
            claimer.start()
        time.sleep(0.5)  # both wait for the stuck producer
        pipe.gate.set()
        for claimer in claimers:
            claimer.join(30)
        assert sorted(map(str, outcomes.values())) == \
            ["EpochSupersededError", str(list(range(16)))]
        with pytest.raises(pingpong.EpochSupersededError):
            next(stuck)
    finally:
        pipe.gate.set()
        for loader in loaders:
            loader.close()


def test_a_kept_iterator_of_an_earlier_loader_does_not_block_the_next_one():
    """Found in review: ``it = iter(PingPongLoader(dl))`` each epoch, left early --
    the earlier epoch is still running (its iterator kept in ``it``) when the
    next loader's ``iter()`` runs; it is superseded, and every pass is exact."""
    source = _persistent_source(SlowItems(0.0))
    features = torch.randn(8, 3)
    it = None
    for epoch in range(4):
        it = iter(PingPongLoader(source, features, form=_item_form, timeout=20))
        got = [int(next(it).item) for _ in range(3)]  # steps_per_epoch = 3
        assert got == [0, 1, 2], epoch
        for batch in it if epoch == 3 else ():
            assert torch.equal(batch.x, features[batch.item])
            got.append(int(batch.item))
    assert got == list(range(8))


def test_an_iter_interrupted_as_its_producer_starts_still_ends_the_other_loaders_epoch(
        monkeypatch):
    """From a self-review: the claim of a shared source started the new epoch,
    then ended the other loader's; a Ctrl-C (or failure) in the start left both
    running over one source -- the old one read the rest of the pass.  The other
    epoch is now ended first."""
    pipe = _GatedPipe()
    features = torch.randn(16, 3)
    with PingPongLoader(pipe, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(pipe, features, form=_item_form, timeout=20) as second:
        running = iter(first)
        assert int(next(running).item) == 0
        real_start = threading.Thread.start

        def interrupted_start(thread: threading.Thread) -> None:
            monkeypatch.setattr(threading.Thread, "start", real_start)
            raise KeyboardInterrupt  # a Ctrl-C as the second loader's producer starts

        monkeypatch.setattr(threading.Thread, "start", interrupted_start)
        with pytest.raises(KeyboardInterrupt):
            iter(second)
        with pytest.raises(pingpong.EpochSupersededError):
            for _batch in running:
                pass
        assert sorted(_exact_items(iter(second), features)) == list(range(16))


@pytest.mark.parametrize("failure", ["thread start", "ctrl-c in the claim"])
def test_an_epoch_that_never_started_leaves_its_loader_usable_and_nothing_alive(
        failure, monkeypatch):
    """Found in review: an epoch whose producer never started (``Thread.start``
    failing, a Ctrl-C between building the epoch and starting it) made every later
    ``iter()`` and ``close()`` raise "cannot join thread before it is started",
    and the record of shared sources kept its device and slots alive."""
    import pingpong._source_claims as claims_module

    source = _persistent_source(SlowItems(0.0))
    features = torch.randn(8, 3)

    def fail_once(loader: PingPongLoader) -> None:
        if failure == "thread start":
            real_start = threading.Thread.start

            def failing_start(thread: threading.Thread) -> None:
                if thread.name.startswith("pingpong-producer"):
                    raise RuntimeError("can't start new thread")
                real_start(thread)

            monkeypatch.setattr(threading.Thread, "start", failing_start)
            expected: type[BaseException] = RuntimeError
        else:
            shared = claims_module._shared_sources

            class InterruptedOnce(weakref.WeakKeyDictionary):  # type: ignore[type-arg]
                def __setitem__(self, key: Any, value: Any) -> None:
                    monkeypatch.setattr(claims_module, "_shared_sources", shared)
                    raise KeyboardInterrupt  # a Ctrl-C just before the producer starts

            monkeypatch.setattr(claims_module, "_shared_sources", InterruptedOnce())
            expected = KeyboardInterrupt
        with pytest.raises(expected):
            iter(loader)
        monkeypatch.undo()

    loader = PingPongLoader(source, features, form=_item_form, timeout=20)
    fail_once(loader)
    device, slots = weakref.ref(loader._device), [weakref.ref(s) for s in loader._slots]
    loader.close()
    del loader
    gc.collect()
    assert device() is None
    assert all(slot() is None for slot in slots)

    loader = PingPongLoader(source, features, form=_item_form, timeout=20)
    fail_once(loader)
    assert _exact_items(iter(loader), features) == list(range(8))
    loader.close()


def test_a_second_loader_waits_for_the_first_ones_ended_producer(caplog):
    """After a ``break`` out of one loader's epoch (its iterator dropped, the loader
    kept), another loader over the same persistent-worker DataLoader waits for
    the first producer to leave the source, then gets the whole pass -- also a
    producer stuck there for 6 s (refused after 2 s, before), a wait that is
    logged once, naming that producer, after 2 s."""
    dataset = SlowItems(0.2)
    source = _persistent_source(dataset)
    features = torch.randn(8, 3)
    with PingPongLoader(source, features, form=_item_form, timeout=20) as first, \
            PingPongLoader(source, features, form=_item_form, timeout=20) as second:
        for round_ in range(3):
            for batch in first:
                assert torch.equal(batch.x, features[batch.item])
                break  # its producer is inside next(source) for the next item
            assert _exact_items(iter(second), features) == list(range(8)), round_
        dataset.delay[0] = 6.0
        epoch = iter(first)
        time.sleep(0.5)  # its producer is inside a 6 s item
        dataset.delay[0] = 0.0  # read by the worker on its next item
        (stuck,) = producer_threads()
        del epoch  # ended
        caplog.set_level(logging.WARNING, logger="pingpong._epoch")
        start = time.monotonic()
        assert _exact_items(iter(second), features) == list(range(8))
        assert time.monotonic() - start > 4.0
        said = [r.getMessage() for r in caplog.records if "iter() has waited" in r.getMessage()]
        assert len(said) == 1
        assert stuck.name in said[0]


def test_rapid_reiteration_never_lets_an_old_producer_advance():
    """``iter()`` twice quickly, many times: once a new pass began, no older
    iterator of the source is advanced again, and every full pass is exact."""
    log: list[tuple[int, str]] = []
    created: list[float] = []

    class Logged:
        def __len__(self) -> int:
            return 12

        def __iter__(self):
            number = len(created)
            created.append(time.monotonic())
            triples = seq_triples(N, 12, seed=number)
            for triple in triples:
                log.append((number, threading.current_thread().name))
                yield triple

    rng = random.Random(0)
    with PingPongLoader(Logged(), make_table(), num_buffers=3) as loader:
        for _ in range(25):
            first = iter(loader)
            for _ in range(rng.randrange(0, 4)):
                next(first)
            second = iter(loader)
            with pytest.raises(pingpong.EpochSupersededError):
                next(first)
            assert [b.blocks["seq"] for b in second] == list(range(12))
    # after pass k+1 started, pass k's iterator was never advanced again
    latest = -1
    for number, _thread in log:
        assert number >= latest, "an old iterator advanced after a newer one began"
        latest = number
    # each pass was advanced only by one producer thread
    threads_per_pass: dict[int, set[str]] = {}
    for number, thread in log:
        threads_per_pass.setdefault(number, set()).add(thread)
    assert all(len(names) == 1 for names in threads_per_pass.values())
    assert wait_for_no_pingpong_threads(2.0) == []


@pytest.mark.parametrize(
    "scenario", ["plain", "local-loader-first", "closed-while-inside", "slow-free"])
def test_exit_waits_for_a_producer_inside_a_dgl_call(scenario):
    """At exit, pingpong's hook waits (through the RPC lock) for a producer inside a
    DGL call before DGL's own exit hook, which sends through the same client, runs --
    also when a loader ran before DGL registered its hook, and when the producer's
    epoch was already closed (see the script). Then it joins the producer, which
    frees what it read as it leaves: freeing a tensor during finalisation aborted the
    process (``slow-free`` makes that free last 0.3 s)."""
    with _spawned("exit_in_dgl_call.py", scenario) as proc:
        _wait_for_line(proc, "INSIDE_AT_EXIT True", 90)  # the wait has something to wait for
        _wait_for_line(proc, "EXITING", 10)
        started = time.monotonic()
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "INSIDE_AT_DGL_EXIT False" in stdout.splitlines(), stdout + stderr
    if scenario == "slow-free":
        assert "FREED" in stdout.splitlines(), stdout + stderr
    assert time.monotonic() - started < 8  # the rest of one call, not the 10 s limit


class _SlowReleaseOnThread(FakeAsyncDevice):
    """A fake GPU whose release-event record is slow on one named thread: that
    thread is descheduled inside ``next()``'s hand-back of its slot."""

    def __init__(self, slow_thread: str) -> None:
        super().__init__(seed=1, max_delay_s=0.001)
        self.slow_thread = slow_thread

    def consumer_record(self, stream: Any = None) -> Any:
        if threading.current_thread().name == self.slow_thread:
            time.sleep(0.5)
        return super().consumer_record(stream)


def test_a_slot_handed_back_while_another_thread_starts_an_epoch_is_not_refilled_early():
    """From a code review: ``next()`` on one thread took the held lease and, before
    it gave the slot its release events, ``iter()`` on another thread started the
    next epoch, whose ``hand_back_lease`` found no lease; its producer then
    refilled that slot waiting only for the slot's old events -- under kernels
    still reading it (on the fake GPU: a poisoned batch in the new epoch).  The
    lease now ends and the events are set in one step under the epoch's lock."""
    features = torch.randn(4096, 32)
    batches: list[tuple[torch.Tensor, torch.Tensor, list[Any]]] = [
        (torch.randperm(4096)[:700], torch.arange(10), []) for _ in range(8)]
    device = _SlowReleaseOnThread("training thread")
    with PingPongLoader(batches, features, device=device, num_buffers=2) as loader:
        first_epoch = iter(loader)
        got_one = threading.Event()
        outcome: list[str] = []

        def train() -> None:
            next(first_epoch)
            got_one.set()
            try:
                next(first_epoch)  # hands its slot back, slowly; then superseded
                outcome.append("delivered")
            except pingpong.EpochSupersededError:
                outcome.append("superseded")

        trainer = threading.Thread(target=train, name="training thread")
        trainer.start()
        assert got_one.wait(30)
        time.sleep(0.2)  # the training thread is inside the slow release now
        second_epoch = iter(loader)
        time.sleep(1.0)  # the slow release ends: on the old code, over the new batch
        for _ in range(2):
            batch = next(second_epoch)
            x = device.consumer_submit(batch.x.clone).result()
            assert torch.equal(x, features[batch.input_nodes])
        trainer.join(30)
        assert outcome in (["delivered"], ["superseded"])


def test_a_ctrl_c_inside_the_devices_close_is_finished_by_the_next_close(monkeypatch):
    """From a code review: the fake GPU (and the CUDA device's detach) marked itself
    closed before the work, so a close that Ctrl-C interrupted was never done: the
    next ``close()`` returned at once, and the loader counted itself closed with
    the device's stream threads (on CUDA: the pinned tables) still there."""
    import pingpong.devices.fake as fake_module

    device = FakeAsyncDevice()
    features = torch.randn(8, 4)
    loader = PingPongLoader([(torch.arange(4), torch.arange(2), [])], features, device=device)
    assert [torch.equal(device.consumer_submit(b.x.clone).result(), features[:4])
            for b in loader] == [True]
    stop_streams = fake_module._stop_streams
    calls = []

    def interrupted_once(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        stop_streams(*args)

    monkeypatch.setattr(fake_module, "_stop_streams", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    loader.close()
    assert len(calls) == 2
    assert not device.copy_stream.thread.is_alive()
    assert not device.consumer_stream.thread.is_alive()


class _CollectingInRecord(FakeAsyncDevice):
    """A fake GPU whose release-event record runs the garbage collector once, when
    armed, off pingpong's threads: an automatic collection at an allocation there."""

    armed = False

    def consumer_record(self, stream: Any = None) -> Any:
        if self.armed and not threading.current_thread().name.startswith("pingpong-"):
            self.armed = False
            gc.collect()
        return super().consumer_record(stream)


def test_a_collection_inside_the_slot_hand_back_does_not_deadlock():
    """From a self-review: the slot hand-back recorded the release events holding the
    epoch's lock; a collection there that freed the epoch's iterator (kept in a
    reference cycle) ended the epoch from its finaliser, which takes that lock on
    the same thread: ``iter(loader)`` hung for ever."""
    features = torch.randn(100, 4)
    batches: list[tuple[torch.Tensor, torch.Tensor, list[Any]]] = [
        (torch.arange(10), torch.arange(2), []) for _ in range(4)]
    device = _CollectingInRecord(seed=0)
    # No `with`: on a deadlock, close() would wait for the core's lock for ever.
    loader = PingPongLoader(batches, features, device=device, num_buffers=2)
    it = iter(loader)
    batch = next(it)  # the loop holds a batch: a lease to hand back
    cycle: list[Any] = [it]
    cycle.append(cycle)
    del it, cycle, batch
    gc.disable()  # so that no collection before the armed one finds the cycle
    try:
        device.armed = True
        started = threading.Event()

        def next_epoch() -> None:
            iter(loader)  # hands the held lease back: the record collects
            started.set()

        threading.Thread(target=next_epoch, daemon=True).start()
        deadlocked = not started.wait(10)
    finally:
        gc.enable()
    assert not deadlocked, "iter(loader) deadlocked in the slot hand-back"
    loader.close()


class _CtrlCOnce:
    """Raises ``KeyboardInterrupt`` from the first call on the main thread (with
    ``keyword``, if given) -- a Ctrl-C landing there -- then passes every call on to
    ``original``."""

    def __init__(self, original: Any, keyword: str | None = None) -> None:
        self.original = original
        self.keyword = keyword
        self.fired = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.fired and threading.current_thread() is threading.main_thread() \
                and (self.keyword is None or self.keyword in kwargs):
            self.fired = True
            raise KeyboardInterrupt
        return self.original(*args, **kwargs)


@pytest.mark.parametrize("where", ["the lease", "the count"])
def test_a_ctrl_c_after_next_took_a_batch_off_the_queue_fails_the_epoch(monkeypatch, where):
    """From a code review: a Ctrl-C that landed in ``next()`` after it took the batch
    off the ready queue -- making its lease, or counting it -- escaped the handling
    that fails the epoch: the epoch went on, and a loop that caught the Ctrl-C (to
    save a checkpoint, say) and called ``next()`` again silently skipped that batch.
    Now the epoch fails, as for a Ctrl-C anywhere else in ``next()``."""
    triples = seq_triples(N, 6)
    features = make_table()
    with PingPongLoader(triples, features) as loader:
        it = iter(loader)
        next(it)
        if where == "the lease":
            monkeypatch.setattr(epoch_module, "Lease", _CtrlCOnce(epoch_module.Lease))
        else:
            stats = it._epoch.stats
            monkeypatch.setattr(stats, "add", _CtrlCOnce(stats.add, "batches"))
        with pytest.raises(KeyboardInterrupt):
            next(it)
        monkeypatch.undo()
        assert it.state is EpochState.FAILED
        # the count is what the loop got: the batch in flight is not among them
        assert it.batches_delivered == 1
        with pytest.raises(pingpong.EpochFailedError, match=r"after 1 batches \(KeyboardInterrupt"):
            next(it)
        assert [torch.equal(b.x, features[b.input_nodes]) for b in loader] == [True] * 6
    assert wait_until(lambda: not producer_threads(), 10.0)


class _SlowWaitOnThread(FakeAsyncDevice):
    """A fake GPU whose ``consumer_wait`` (a batch made ready for the training
    stream) is slow on one named thread, after saying it began."""

    def __init__(self, slow_thread: str) -> None:
        super().__init__(seed=2, max_delay_s=0.0)
        self.slow_thread = slow_thread
        self.inside = threading.Event()

    def consumer_wait(self, event: Any, stream: Any = None) -> Any:
        if threading.current_thread().name == self.slow_thread:
            self.inside.set()
            time.sleep(0.5)
        return super().consumer_wait(event, stream)


@pytest.mark.parametrize("where", ["before", "inside"])
def test_next_superseded_by_iter_on_another_thread_while_it_delivers_says_superseded(
        monkeypatch, where):
    """From a code review: ``iter(loader)`` on another thread while ``next()`` was
    between making the batch's lease and returning it handed that lease back --
    then ``next()`` raised ``BatchExpiredError`` ("handed back when the next batch
    was requested", which it was not), or, past the stream wait, returned the
    batch from a slot the new epoch's producer was free to refill (on the fake
    GPU: another batch's rows).  ``next()`` now raises ``EpochSupersededError``."""
    features = make_table()
    triples = seq_triples(N, 8)
    device = _SlowWaitOnThread("training thread" if where == "inside" else "nobody")
    if where == "before":  # descheduled after the lease is made, before the stream wait
        original = epoch_module.Epoch._deliver

        def slow_deliver(self: Any, message: Any, lease: Any) -> Any:
            if threading.current_thread().name == "training thread":
                device.inside.set()
                time.sleep(0.5)
            return original(self, message, lease)

        monkeypatch.setattr(epoch_module.Epoch, "_deliver", slow_deliver)
    with PingPongLoader(triples, features, device=device, num_buffers=2) as loader:
        first_epoch = iter(loader)
        outcome: list[Any] = []

        def train() -> None:
            try:
                outcome.append(next(first_epoch))
            except BaseException as exc:  # noqa: BLE001 - what next() raised is the result
                outcome.append(exc)

        trainer = threading.Thread(target=train, name="training thread")
        trainer.start()
        assert device.inside.wait(30)
        second_epoch = iter(loader)
        trainer.join(30)
        for _ in range(4):  # the new epoch refills the slots
            batch = next(second_epoch)
            x = device.consumer_submit(batch.x.clone).result()
            assert torch.equal(x, features[batch.input_nodes])
        assert len(outcome) == 1
        assert isinstance(outcome[0], pingpong.EpochSupersededError), outcome
        assert loader.stats["batches"] == 4  # what the loops got: not the dropped one


def test_close_from_another_thread_racing_a_producer_that_left_says_closed(monkeypatch):
    """From a code review: ``close()`` on another thread sets the producer's stop
    flag before it marks the epoch closed; a ``next()`` waiting meanwhile that saw
    the producer gone -- it had seen the flag and left -- and the epoch still
    running raised ``ProducerDiedError``, not the promised ``LoaderClosedError``.
    It now waits for the closer's word (at most 2 s)."""
    source = SeqSource(seq_triples(N, 6), shuffle=False)
    original_end = epoch_module.Epoch.end

    def descheduled_end(self: Any, state: Any, failure: Any = None) -> bool:
        if threading.current_thread().name == "closer":
            self.stop.set()  # end()'s first step ...
            time.sleep(1.0)  # ... then the closer loses the CPU
        return original_end(self, state, failure)

    monkeypatch.setattr(epoch_module.Epoch, "end", descheduled_end)
    loader = PingPongLoader(source, make_table())
    it = iter(loader)
    next(it)
    source.delay_s = 0.2  # the producer is in the source when the flag is set
    closer = threading.Timer(0.3, loader.close)
    closer.name = "closer"
    closer.start()
    with pytest.raises(pingpong.LoaderClosedError):
        while True:
            next(it)
    closer.join(30)
    assert wait_until(lambda: not producer_threads(), 10.0)


class _EpochNumberedSource:
    """Epoch ``e`` yields 8 batches of 16 copies of node ``8 e + i``: the rows of any
    batch name the epoch and step that gathered them."""

    def __init__(self) -> None:
        self.epoch = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[Any]]]:
        e, self.epoch = self.epoch, self.epoch + 1
        return iter([(torch.full((16,), 8 * e + i), torch.full((1,), 8 * e + i), [])
                      for i in range(8)])


@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
def test_a_failed_release_record_keeps_the_slot_until_a_later_hand_back_records_it(fault):
    """From a code review: when recording a batch's release events raised in the
    ``next()`` that hands its slot back (a Ctrl-C, a device error), the lease was
    spent but its events never reached the slot, so the next epoch (the cell run
    again) refilled the slot while work queued on the batch still read it: that
    work read the new epoch's rows. Now the lease stays held, and the new epoch's
    hand-back records the events first."""
    table = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    device = FakeAsyncDevice(seed=3, max_delay_s=0.0, consumer_max_delay_s=0.0, poison=False)

    def read(batch: Any) -> torch.Tensor:  # in stream order, as a training step reads
        return device.consumer_submit(batch.x.clone).result(10)

    with PingPongLoader(_EpochNumberedSource(), table, device=device) as loader:
        it = iter(loader)
        first = next(it)  # node 0's rows

        def slow_step(batch: Any = first) -> torch.Tensor:
            time.sleep(0.5)  # a long training step on the consumer stream
            return batch.x.clone()

        step = device.consumer_submit(slow_step)
        device.inject_fault("consumer_record", 1, fault)
        with pytest.raises(fault):
            next(it)  # hands the first batch's slot back: recording its events fails
        device.clear_faults()
        assert it.state is EpochState.FAILED
        again = iter(loader)  # while the step still reads the first batch
        assert torch.equal(read(next(again)), table[torch.full((16,), 8)])
        assert torch.equal(step.result(10), table[torch.zeros(16, dtype=torch.long)])
        assert [torch.equal(read(b), table[b.input_nodes]) for b in again] == [True] * 7


RELEASE = {"Lease.end": Lease.end, "Epoch._end_lease": epoch_module.Epoch._end_lease}


@pytest.mark.parametrize("via", ["next", "iter"])
@pytest.mark.parametrize("where", sorted(RELEASE))
def test_a_ctrl_c_at_any_line_of_a_slot_hand_back_never_refills_a_slot_still_read(where, via):
    """From a self-review: the fix above covered a raise inside the recording call
    only; a Ctrl-C right after ``Lease.end``'s locked block (the lease marked ended,
    its events not yet the slot's) or after ``_end_lease`` cleared the epoch's lease
    lost the events all the same. A Ctrl-C at each line in turn, in the ``next()``
    that hands the batch back or the ``iter()`` that starts the next epoch: the
    work queued on the batch still reads its rows, and every later batch is exact."""
    function = RELEASE[where]
    table = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    fired_at = []
    for lineno in _body_lines(function):
        device = FakeAsyncDevice(seed=3, max_delay_s=0.0, consumer_max_delay_s=0.0,
                                 poison=False)

        def read(batch: Any, device: Any = device) -> torch.Tensor:
            return device.consumer_submit(batch.x.clone).result(10)

        with PingPongLoader(_EpochNumberedSource(), table, device=device) as loader:
            it = iter(loader)
            first = next(it)

            def slow_step(batch: Any = first) -> torch.Tensor:
                time.sleep(0.3)
                return batch.x.clone()

            step = device.consumer_submit(slow_step)
            with contextlib.suppress(KeyboardInterrupt), \
                    _ctrl_c_at_line(function, lineno) as fired:
                if via == "next":
                    next(it)
                else:
                    iter(loader)
            fired_at += fired
            again = iter(loader)  # the cell run again, while the step still reads
            batches = [read(b) for b in again]
            assert torch.equal(step.result(10), table[torch.zeros(16, dtype=torch.long)]), \
                lineno
            expected = [table[torch.full((16,), 8 * loader_epoch + i)]
                        for loader_epoch in [_epoch_of(batches[0])] for i in range(8)]
            assert all(torch.equal(b, e) for b, e in zip(batches, expected, strict=True)), \
                lineno
        assert wait_for_no_pingpong_threads(5.0) == [], lineno
    assert len(fired_at) >= 3, fired_at


def _epoch_of(rows: torch.Tensor) -> int:
    """The source epoch whose first batch ``rows`` are (node ``8 e`` at step 0)."""
    return int(rows[0, 0]) // 8 // 8
