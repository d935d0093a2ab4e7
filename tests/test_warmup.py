"""Kernels compiled before the first batch: the right specialisations, on a thread that
never outlives its loader, and a loader that works whatever the warm-up does."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from conftest import make_triples, warm_up_of

import pingpong
from pingpong.devices import cpu as cpu_device
from pingpong.kernels import WarmUpThread, _checks, _warmup, start_warm_up, warm_up_cpu
from pingpong.kernels import cpu as cpu_kernels

REPO = Path(__file__).resolve().parents[1]


def _signatures() -> set[tuple[object, ...]]:
    return set(cpu_kernels._gather_words.signatures)


def _misaligned(rows: int, row_bytes: int) -> np.ndarray:
    """Byte rows starting one byte after an aligned address."""
    raw = np.random.default_rng(0).integers(0, 256, rows * row_bytes + 1, dtype=np.uint8)
    return raw[1:].reshape(rows, row_bytes)


@pytest.mark.parametrize(
    ("row_bytes", "word"), [(512, np.int64), (12, np.int32), (6, np.int16), (3, np.uint8)]
)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_warm_up_compiles_exactly_what_the_gather_calls(row_bytes, word, id_dtype):
    table = np.random.default_rng(1).integers(0, 256, (100, row_bytes), dtype=np.uint8)
    ready = warm_up_cpu([table], [id_dtype], threading_layer=False)
    expected = cpu_kernels.gather_signature(np.dtype(word).itemsize, id_dtype)
    assert ready == [expected]
    assert expected in _signatures()
    assert (numba.typeof(np.empty(1, id_dtype)),) in _checks._id_bounds.signatures
    before = _signatures()
    ids = np.array([5, 0, 99], dtype=id_dtype)
    out = np.zeros((3, row_bytes), np.uint8)
    cpu_kernels.gather_rows_cpu(table, ids, out)  # what the loader runs, after the checks
    assert _signatures() == before  # nothing new compiled: the warm-up hit it
    assert np.array_equal(out, table[ids])


def test_a_misaligned_table_warms_up_its_narrower_word():
    table = _misaligned(50, 16)
    assert warm_up_cpu([table], [np.int64], threading_layer=False) == [
        cpu_kernels.gather_signature(1, np.int64)
    ]
    assert warm_up_cpu([16], [np.int64], threading_layer=False) == [
        cpu_kernels.gather_signature(8, np.int64)
    ]


def test_warm_up_starts_the_threading_layer(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernels, "must_serialise", lambda: calls.append(1))
    warm_up_cpu([8], threading_layer=False)
    assert calls == []
    warm_up_cpu([8])  # the default
    assert calls == [1]


def test_int64_ids_are_warmed_up_first():
    ready = warm_up_cpu([8, 6], threading_layer=False)
    assert ready == [cpu_kernels.gather_signature(8, np.int64),
                     cpu_kernels.gather_signature(2, np.int64),
                     cpu_kernels.gather_signature(8, np.int32),
                     cpu_kernels.gather_signature(2, np.int32)]
    # each (word, id dtype) once, however often tables and dtypes repeat it
    assert warm_up_cpu([8, 16, 24], [np.int64, "int64"], threading_layer=False) == [
        cpu_kernels.gather_signature(8, np.int64)]


def test_warm_up_stops_between_steps():
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > 1  # allow the first step only

    assert warm_up_cpu([8, 4], [np.int32, np.int64], should_stop=should_stop) == []


def test_each_specialisation_is_marked_ready_as_soon_as_it_is_made(monkeypatch):
    """A loader may use a gather while the rest warm up: each one is recorded
    (``gather_is_ready``) right after its step, before the next step's stop check."""
    monkeypatch.setattr(cpu_kernels, "_ready", set())
    i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
    seen: list[set[tuple[int, np.dtype]]] = []

    def should_stop() -> bool:
        seen.append(set(cpu_kernels._ready))
        return False

    warm_up_cpu([8, 6], [i64, i32], threading_layer=False, should_stop=should_stop)
    a, b, c, d = (8, i64), (2, i64), (8, i32), (2, i32)
    # one check before each id dtype and before each gather
    assert seen == [set(), set(), {a}, {a, b}, {a, b}, {a, b, c}]
    assert cpu_kernels._ready == {a, b, c, d}
    table = np.zeros((4, 6), np.uint8)
    assert cpu_kernels.gather_is_ready(table, np.zeros(2, i32), np.zeros((2, 6), np.uint8))


def test_a_stop_after_one_id_dtype_starts_no_step_of_the_next(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_ready", set())
    monkeypatch.setattr(_checks, "_bounds_ready", set())

    def stop_once_int64_is_ready() -> bool:
        return bool(cpu_kernels._ready)

    ready = warm_up_cpu([8], [np.int64, np.int32], threading_layer=False,
                        should_stop=stop_once_int64_is_ready)
    assert ready == [cpu_kernels.gather_signature(8, np.int64)]
    assert _checks._bounds_ready == {np.dtype(np.int64)}  # int32's bounds pass not started


def test_the_positioned_warm_up_marks_each_word_ready_and_stops_between_steps(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_ready_at", set())
    assert cpu_kernels.warm_up_cpu_at([8, 6], should_stop=lambda: True) == []
    assert cpu_kernels._ready_at == set()
    ready = cpu_kernels.warm_up_cpu_at([8, 6])
    int64s = numba.typeof(np.empty(1, np.int64))
    assert ready == [(words, int64s, int64s, words, numba.typeof(cpu_kernels._ROWS_PER_CHUNK))
                     for words in (numba.typeof(np.empty((1, 1), dtype)) for dtype in
                                   (np.int64, np.int16))]
    assert cpu_kernels._ready_at == {8, 2}
    rows = np.zeros((4, 6), np.uint8)
    assert cpu_kernels.gather_at_is_ready(rows, np.zeros((9, 6), np.uint8))
    assert not cpu_kernels.gather_at_is_ready(_misaligned(4, 6), np.zeros((9, 6), np.uint8))


@pytest.mark.parametrize(
    ("tables", "dtypes", "error"),
    [([8], [np.int16], pingpong.IdTypeError), ([8], ["float32"], pingpong.IdTypeError),
     ([0], [np.int64], pingpong.TableError), ([np.zeros(4)], [np.int64], pingpong.TableError),
     ([True], [np.int64], pingpong.TableError)],
    ids=["int16", "float32", "zero-row-bytes", "1-D", "bool"],
)
def test_warm_up_arguments_are_checked(tables, dtypes, error):
    with pytest.raises(error):
        warm_up_cpu(tables, dtypes)


def test_the_kernels_are_cached_on_disk():
    for dispatcher in (cpu_kernels._gather_words, _checks._id_bounds):
        assert type(dispatcher._cache).__name__ == "FunctionCache"


def test_warm_up_thread_records_its_result_and_is_joined():
    warm_up = start_warm_up(lambda stop: warm_up_cpu([8], should_stop=stop))
    assert warm_up.name.startswith("pingpong-warmup-")
    assert warm_up.stop()  # joins
    assert warm_up.done.is_set()
    assert warm_up.error is None
    assert warm_up.seconds is not None
    assert not _warmup.in_progress


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failing_warm_up_is_kept_not_raised(error):
    def fail(stop):
        raise error("no compiler today")

    warm_up = start_warm_up(fail)
    assert warm_up.stop()
    assert isinstance(warm_up.error, error)
    assert not _warmup.in_progress
    assert warm_up.error.__traceback__ is None  # keeps no frames (tables) alive


def test_stop_from_the_warm_up_thread_itself_only_asks():
    """E.g. a loader's finaliser run by a garbage collection on the warm-up thread:
    stop() cannot join the thread it runs on, so it only asks."""
    go = threading.Event()
    box: dict[str, object] = {}

    def work(should_stop):
        go.wait(5)
        box["returned"] = box["warm_up"].stop()  # type: ignore[attr-defined]
        return should_stop()

    warm_up = start_warm_up(work)
    box["warm_up"] = warm_up
    go.set()
    assert warm_up.done.wait(5)
    assert warm_up.error is None
    assert box["returned"] is False  # still running when it asked
    assert warm_up.result is True  # and the request was recorded


def test_stop_waits_for_the_step_in_progress():
    """Without a timeout, stop() joins: it returns once the step it interrupted ended."""
    def step_in_progress(should_stop):
        while not should_stop():
            time.sleep(0.005)
        time.sleep(0.5)  # the rest of the step: a compilation cannot be interrupted
        return "stopped"

    warm_up = start_warm_up(step_in_progress)
    assert warm_up.stop()
    assert warm_up.done.is_set()
    assert warm_up.result == "stopped"


def test_a_warm_up_thread_that_cannot_start_leaves_nothing_in_progress(monkeypatch):
    warm_up = WarmUpThread(lambda stop: None)

    def no_thread_left() -> None:  # the environment: out of threads
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(warm_up._thread, "start", no_thread_left)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        warm_up.start()
    assert warm_up.done.is_set()
    assert not _warmup.in_progress
    assert warm_up.stop() is True  # never started: nothing to join


class _Gate:
    """A warm-up that runs until its owner stops it, and says when it started."""

    def __init__(self) -> None:
        self.started = threading.Event()

    def __call__(self, tables, should_stop=None, **_kw):
        self.started.set()
        while not should_stop():
            time.sleep(0.005)
        return []


def test_in_progress_stays_set_while_any_warm_up_runs():
    gates = [_Gate(), _Gate()]
    first, second = (start_warm_up(functools.partial(gate, [])) for gate in gates)
    try:
        assert all(gate.started.wait(5) for gate in gates)
        assert first.stop()
        assert _warmup.in_progress  # the second one still compiles
    finally:
        second.stop()
    assert not _warmup.in_progress


def _check_epochs(loader, triples, features, labels, epochs=2):
    for _ in range(epochs):
        count = 0
        for batch, (inputs, outputs, _) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x.view(torch.uint8), features[inputs].view(torch.uint8))
            assert torch.equal(batch.y, labels[outputs])
            count += 1
        assert count == len(triples)


def test_loader_gathers_bit_identically_while_the_warm_up_runs(monkeypatch):
    """Until the warm-up is done the producer gathers with torch; close() joins the thread."""
    gate = _Gate()
    monkeypatch.setattr(cpu_device, "warm_up_cpu", gate)
    monkeypatch.setattr(cpu_kernels, "_ready", set())  # as in a fresh process
    num_rows = 3000
    features = torch.randn(num_rows, 33).to(torch.bfloat16)
    labels = torch.randint(0, 9, (num_rows,))
    triples = make_triples(num_rows, 10, max_inputs=700)
    triples[3] = (triples[3][0].to(torch.int32), triples[3][1].to(torch.int32), triples[3][2])

    def numba_must_not_run(*args):
        raise AssertionError("the Numba gather ran while the warm-up was in progress")

    monkeypatch.setattr(cpu_device, "gather_rows_cpu_unchecked", numba_must_not_run)
    loader = pingpong.PingPongLoader(triples, features, labels=labels, device="cpu")
    try:
        warm_up = warm_up_of(loader)
        assert gate.started.wait(5)
        assert warm_up.name.startswith("pingpong-warmup-")
        assert not warm_up.done.is_set()
        assert _warmup.in_progress
        _check_epochs(loader, triples, features, labels)
    finally:
        loader.close()
    assert warm_up.done.is_set()
    assert not any(t.name == warm_up.name for t in threading.enumerate())


def test_a_ready_specialisation_is_used_while_the_rest_warm_up(monkeypatch):
    """Per (word, id dtype): int64 batches use Numba as soon as theirs is ready."""
    gate = _Gate()
    monkeypatch.setattr(cpu_device, "warm_up_cpu", gate)
    warm_up_cpu([8], [np.int64], threading_layer=False)  # compiled (or loaded)...
    monkeypatch.setattr(cpu_kernels, "_ready", {(8, np.dtype(np.int64))})  # ...and only it
    used: list[np.dtype] = []
    real = cpu_device.gather_rows_cpu_unchecked

    def counted(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        used.append(ids.dtype)
        real(table, ids, out)

    monkeypatch.setattr(cpu_device, "gather_rows_cpu_unchecked", counted)
    features = torch.randn(300, 16)  # 64-byte rows: 8-byte words
    wide, narrow = make_triples(300, 2)
    triples = [wide, (narrow[0].to(torch.int32), narrow[1].to(torch.int32), narrow[2])]
    with pingpong.PingPongLoader(triples, features, device="cpu") as loader:
        assert gate.started.wait(5)
        got = [batch.x.clone() for batch in loader]
        assert not warm_up_of(loader).done.is_set()
    assert used == [np.dtype(np.int64)]  # the int32 batch took the fallback
    for batch, (inputs, _, _) in zip(got, triples, strict=True):
        assert torch.equal(batch, features[inputs])


def test_loader_uses_numba_once_warm(monkeypatch):
    calls = []
    real = cpu_device.gather_rows_cpu_unchecked

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cpu_device, "gather_rows_cpu_unchecked", counting)
    features = torch.randn(500, 16)
    labels = torch.arange(500)
    triples = make_triples(500, 4)
    with pingpong.PingPongLoader(triples, features, labels=labels, device="cpu") as loader:
        warm_up = warm_up_of(loader)
        assert warm_up.done.wait(120)
        assert warm_up.error is None
        ready = warm_up.result
        # 64-byte rows: 8-byte words; int64 ids (torch's and DGL's) first
        assert ready == [cpu_kernels.gather_signature(8, np.int64),
                         cpu_kernels.gather_signature(8, np.int32)]
        before = _signatures()
        _check_epochs(loader, triples, features, labels, epochs=1)
        assert _signatures() == before
    assert calls  # the Numba kernel gathered every batch


def _break_the_warm_up_and_count(monkeypatch, ready: str, kernel: str) -> list[int]:
    """Make ``warm_up_cpu`` fail, with nothing made ready (``cpu_kernels.<ready>``
    emptied); return a list that each call of ``cpu_device.<kernel>`` appends to."""
    def broken(*args, **kwargs):
        raise RuntimeError("warm-up broke")

    monkeypatch.setattr(cpu_device, "warm_up_cpu", broken)
    monkeypatch.setattr(cpu_kernels, ready, set())
    calls: list[int] = []
    real = getattr(cpu_device, kernel)

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cpu_device, kernel, counting)
    return calls


def test_a_failed_warm_up_does_not_break_the_loader(monkeypatch):
    calls = _break_the_warm_up_and_count(monkeypatch, "_ready", "gather_rows_cpu_unchecked")
    features = torch.randn(800, 24)
    labels = torch.arange(800)
    triples = make_triples(800, 5)
    with pingpong.PingPongLoader(triples, features, labels=labels, device="cpu") as loader:
        warm_up = warm_up_of(loader)
        assert warm_up.done.wait(10)
        assert isinstance(warm_up.error, RuntimeError)
        _check_epochs(loader, triples, features, labels, epochs=1)
        calls.clear()
        _check_epochs(loader, triples, features, labels, epochs=1)
    # every gather after the failure ran the kernel (compiled on first use, as without
    # a warm-up), not torch's fallback for good: features and labels of each batch
    assert len(calls) == 2 * len(triples)


def test_a_device_starts_one_warm_up(monkeypatch):
    gate = _Gate()
    monkeypatch.setattr(cpu_device, "warm_up_cpu", gate)
    device = cpu_device.CPUDevice()
    device.start_warm_up([np.zeros((4, 8), np.uint8)], [])
    first = device.warm_up
    assert first is not None
    assert gate.started.wait(5)
    device.start_warm_up([np.zeros((4, 6), np.uint8)], [])  # once per device: ignored
    assert device.warm_up is first
    device.detach()
    assert first.done.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("pingpong-warmup-")]


def test_a_failed_warm_up_leaves_the_positioned_gather_to_the_kernel(monkeypatch):
    """The same for a row source's rows (the positioned kernel): not torch for good."""
    from test_local_rows import N, PartitionedRows
    from test_reliability import SeqSource, make_table, seq_triples

    calls = _break_the_warm_up_and_count(monkeypatch, "_ready_at",
                                         "gather_rows_at_cpu_unchecked")
    features = make_table(N, (16,))
    triples = seq_triples(N, 4)
    with pingpong.PingPongLoader(SeqSource(triples, shuffle=False), PartitionedRows(features),
                                 device="cpu") as loader:
        warm_up = warm_up_of(loader)
        assert warm_up.done.wait(10)
        assert isinstance(warm_up.error, RuntimeError)
        for _ in range(2):  # the first epoch may have started before the failure
            calls.clear()
            for batch, (inputs, _, _) in zip(loader, triples, strict=True):
                assert torch.equal(batch.x, features[inputs])
    assert len(calls) >= len(triples)  # local rows, and fetched ones, by the kernel


def test_closing_at_once_leaves_no_thread_behind(monkeypatch):
    gate = _Gate()
    monkeypatch.setattr(cpu_device, "warm_up_cpu", gate)
    loader = pingpong.PingPongLoader(make_triples(100, 2), torch.randn(100, 4), device="cpu")
    assert gate.started.wait(5)
    t0 = time.perf_counter()
    loader.close()
    assert time.perf_counter() - t0 < 1.0
    assert not [t for t in threading.enumerate() if t.name.startswith("pingpong-warmup-")]


def test_id_check_never_waits_for_a_compiling_warm_up(monkeypatch):
    """While a warm-up compiles, a dtype whose bounds pass is not ready is checked by NumPy."""
    monkeypatch.setattr(_checks, "_bounds_ready", set())

    def compiled_bounds_must_not_run(ids):
        raise AssertionError("waited for Numba")

    real_bounds = _checks._id_bounds
    monkeypatch.setattr(_checks, "_id_bounds", compiled_bounds_must_not_run)
    gate = _Gate()
    warm_up = start_warm_up(lambda stop: gate([], should_stop=stop))
    used: list[np.dtype] = []

    def counted_bounds(ids):
        used.append(ids.dtype)
        return real_bounds(ids)

    try:
        assert gate.started.wait(5)
        _checks.check_id_range(np.array([0, 9], np.int64), 10)
        with pytest.raises(pingpong.IdRangeError, match=r"ids\[1\] = 10"):
            _checks.check_id_range(np.array([3, 10], np.int32), 10)
        monkeypatch.setattr(_checks, "_id_bounds", counted_bounds)
        _checks._bounds_ready.add(np.dtype(np.int32))  # this one's pass is ready: Numba
        with pytest.raises(pingpong.IdRangeError, match=r"ids\[1\] = 10"):
            _checks.check_id_range(np.array([3, 10], np.int32), 10)
        assert used == [np.dtype(np.int32)]
    finally:
        warm_up.stop()
    _checks.check_id_range(np.array([0, 9], np.int64), 10)  # Numba again once done
    assert used == [np.dtype(np.int32), np.dtype(np.int64)]


def _unshare_works() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


CHILD = """
import json, sys
import pingpong
from pingpong.kernels import cpu, warm_up_cpu
warm_up_cpu([8], ["int64"], threading_layer=False)
stats = cpu._gather_words.stats
print(json.dumps({"file": pingpong.__file__, "cache_path": stats.cache_path,
                  "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -m` (root, mount namespaces)")
def test_cache_falls_back_to_the_user_cache_dir_when_the_package_is_read_only(tmp_path):
    """In a read-only install Numba caches under ~/.cache/numba, and the second run loads."""
    import json

    site = tmp_path / "site"
    shutil.copytree(REPO / "pingpong", site / "pingpong",
                    ignore=shutil.ignore_patterns("__pycache__"))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env.update(HOME=str(home), PYTHONPATH=str(site), XDG_CACHE_HOME=str(home / ".cache"),
               PYTHONDONTWRITEBYTECODE="1")
    script = (f"mount --bind {site} {site} && mount -o remount,bind,ro {site} && "
              f"exec {sys.executable} -c \"$CHILD\"")
    reports = []
    for _ in range(2):
        run = subprocess.run(["unshare", "-m", "sh", "-c", script], env={**env, "CHILD": CHILD},
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        reports.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = reports
    assert first["file"].startswith(str(site))
    assert first["cache_path"].startswith(str(home / ".cache" / "numba"))
    assert first["misses"] == 1
    assert second["hits"] == 1
    assert second["misses"] == 0
    assert not list((site / "pingpong").rglob("*.nbi"))  # nothing written into the package


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("row_bytes", [512, 12, 6, 3])
def test_cuda_warm_up_compiles_what_the_gather_launches(row_bytes):
    from numba import cuda

    from pingpong.kernels import _interop
    from pingpong.kernels.cuda import _gather_kernel, gather_rows_cuda_unchecked, warm_up_cuda

    host = torch.randint(0, 256, (1000, row_bytes), dtype=torch.uint8)
    pinned = _interop.pin_in_place(host.numpy(), host)
    try:
        ready = warm_up_cuda([pinned.array], device_index=0)
        assert ready
        before = set(_gather_kernel.overloads)
        ids = torch.randint(0, 1000, (300,), device="cuda")
        out = torch.empty((300, row_bytes), dtype=torch.uint8, device="cuda")
        stream = cuda.default_stream()
        gather_rows_cuda_unchecked(pinned.array, cuda.as_cuda_array(ids),
                                   cuda.as_cuda_array(out), stream)
        sorted_ids, order = torch.sort(ids)
        gather_rows_cuda_unchecked(pinned.array, cuda.as_cuda_array(sorted_ids),
                                   cuda.as_cuda_array(out), stream,
                                   positions=cuda.as_cuda_array(order))
        torch.cuda.synchronize()
        assert set(_gather_kernel.overloads) == before  # both launches found the warm-up's
        assert torch.equal(out.cpu(), host[ids.cpu()])
    finally:
        torch.cuda.synchronize()
        pinned.release()


def test_fallback_takes_read_only_reversed_and_empty_ids(monkeypatch):
    gate = _Gate()
    monkeypatch.setattr(cpu_device, "warm_up_cpu", gate)
    monkeypatch.setattr(cpu_kernels, "_ready", set())
    features = torch.randn(50, 6)
    frozen = np.array([4, 0, 49])
    frozen.flags.writeable = False  # e.g. ids a source hands out read-only
    reversed_ids = np.arange(50)[::-3]  # a negative stride (torch.from_numpy refuses it)
    triples: list[tuple[np.ndarray, np.ndarray, list]] = [
        (frozen, np.array([1]), []), (reversed_ids, np.array([2]), []),
        (np.empty(0, np.int64), np.empty(0, np.int64), [])]
    with pingpong.PingPongLoader(triples, features, device="cpu") as loader:
        assert gate.started.wait(5)
        batches = [batch.x.clone() for batch in loader]
        assert not warm_up_of(loader).done.is_set()  # all gathered by the fallback
    assert torch.equal(batches[0], features[torch.tensor([4, 0, 49])])
    assert torch.equal(batches[1], features[torch.tensor(reversed_ids.tolist())])
    assert batches[2].shape == (0, 6)


def test_close_waits_at_most_a_bounded_time_for_a_step_in_progress(monkeypatch):
    """A step that cannot be interrupted (one compilation) delays close() by at most
    WARM_UP_JOIN_S; the warm-up then ends with its step, on its own."""
    release = threading.Event()

    def one_long_step(tables, should_stop=None, **_kw):
        release.wait(10)  # ignores should_stop, as a compilation would
        return []

    monkeypatch.setattr(cpu_device, "warm_up_cpu", one_long_step)
    monkeypatch.setattr(cpu_device, "WARM_UP_JOIN_S", 0.2)
    loader = pingpong.PingPongLoader(make_triples(100, 2), torch.randn(100, 4), device="cpu")
    warm_up = warm_up_of(loader)
    t0 = time.perf_counter()
    loader.close()
    assert time.perf_counter() - t0 < 2.0
    assert not warm_up.done.is_set()
    release.set()
    assert warm_up.done.wait(5)


def test_at_interpreter_exit_stop_only_asks(monkeypatch):
    """Once the interpreter shuts down, stop() (a loader finaliser's close) never waits."""
    release = threading.Event()
    asked = threading.Event()

    def one_long_step(should_stop):
        release.wait(10)  # a compilation in progress
        if should_stop():
            asked.set()

    warm_up = start_warm_up(one_long_step)
    monkeypatch.setattr(_warmup, "_exiting", False)
    try:
        _warmup._stop_all()  # what threading._shutdown calls
        assert _warmup._exiting
        t0 = time.perf_counter()
        assert warm_up.stop() is False  # no timeout given, and still it returns at once
        assert time.perf_counter() - t0 < 1.0
    finally:
        monkeypatch.setattr(_warmup, "_exiting", False)
        release.set()
        warm_up.stop()
    assert asked.is_set()


_EXIT_DURING_A_STEP = """
import sys, time
from pingpong.kernels import start_warm_up

def two_steps(should_stop):
    time.sleep(1.0)  # the step in progress when the script ends: a compilation
    print("STEP 1 DONE", flush=True)
    if should_stop():
        print("STOPPED BEFORE STEP 2", flush=True)
        return
    print("STEP 2 RAN", flush=True)

start_warm_up(two_steps)
time.sleep(0.2)
print("LEAVING", flush=True)
"""


def test_interpreter_exit_waits_for_the_step_in_progress_then_stops_the_warm_up():
    """A script ending while a warm-up compiles: the interpreter lets the step
    finish (a thread killed inside Numba's compiler at finalisation can abort the
    whole process) and the warm-up starts no other step."""
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_A_STEP],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["LEAVING", "STEP 1 DONE", "STOPPED BEFORE STEP 2"], (
        proc.stdout + proc.stderr
    )
    assert "STEP 2 RAN" not in proc.stdout


_EXIT_DURING_A_STEP_THAT_NEVER_ENDS = """
import threading, time
from pingpong.kernels import start_warm_up

start_warm_up(lambda should_stop: threading.Event().wait())  # stuck for good
time.sleep(0.2)
print("LEAVING", flush=True)
"""


def test_interpreter_exit_waits_for_a_stuck_warm_up_only_a_bounded_time():
    """The wait at exit is bounded: a warm-up stuck for good (seen after a Ctrl-C
    in a fresh process) delays exit by at most ``EXIT_JOIN_S``, never forever."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_A_STEP_THAT_NEVER_ENDS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "LEAVING"
    assert _warmup.EXIT_JOIN_S <= took < _warmup.EXIT_JOIN_S + 15  # + a fresh interpreter


def test_the_cuda_modes_id_check_warm_up_compiles_both_id_dtypes():
    """The part of the zerocopy/device warm-up that runs on the CPU (the GPU test
    below checks that those modes run it)."""
    from pingpong.devices.cuda._modes import _warm_up_id_checks

    expected = [(numba.typeof(np.empty(1, dtype)),) for dtype in cpu_kernels.WARM_UP_ID_DTYPES]
    assert _warm_up_id_checks(lambda: False) == expected
    assert all(dtype in _checks._bounds_ready for dtype in cpu_kernels.WARM_UP_ID_DTYPES)
    assert _warm_up_id_checks(lambda: True) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gather", ["zerocopy", "device"])
def test_cuda_kernel_modes_warm_up_the_host_id_check_too(gather):
    """From a code review: the zerocopy and device warm-ups compiled only the CUDA
    kernel, so once they were done the first batch's id check compiled (or loaded)
    the Numba bounds pass on the producer -- 0.3 s on a CPU. They now warm it too."""
    features = torch.randn(1000, 8)
    batches = [(torch.randint(0, 1000, (50,)), torch.arange(4), None)]
    with pingpong.PingPongLoader(batches, features, device="cuda", gather=gather) as loader:
        warm_up = loader._device._mode.warm_up  # type: ignore[attr-defined]
        assert warm_up is not None
        assert warm_up.done.wait(60)  # finished on its own (stop() would cut it short)
        assert warm_up.error is None
        id_dtypes = cpu_kernels.WARM_UP_ID_DTYPES
        expected = [(numba.typeof(np.empty(1, dtype)),) for dtype in id_dtypes]
        assert warm_up.result[:len(expected)] == expected
        assert all(dtype in _checks._bounds_ready for dtype in id_dtypes)
        for batch in loader:
            assert torch.equal(batch.x.cpu(), features[batch.input_nodes])
