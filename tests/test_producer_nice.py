"""``producer_nice``: each epoch's producer thread lowers its own priority.

What it promises (``PingPongLoader`` docstring, :mod:`pingpong._producer_nice`):
on Linux each epoch's producer raises its own nice value by ``producer_nice``
(capped at 19) before it iterates the source -- by default 10 on the CPU, 0 on
a device standing in for CUDA -- so threads it starts inherit it, and no other
thread's priority changes.  Batches stay bit for bit the reference; bad values
are refused at construction with ``ConfigError``; an OS that refuses is a
logged warning, not a failed epoch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import same_bits, same_bits_on_the_consumer_stream, wait_for_no_pingpong_threads
from test_reliability import make_table, seq_triples
from test_threading_layer import tbb_env

import pingpong._producer_nice
from pingpong import ConfigError, PingPongLoader
from pingpong._producer_nice import MAX_NICE, lower_this_thread_priority
from pingpong.devices.cpu import CPUDevice
from pingpong.devices.fake import FakeAsyncDevice

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="nice is per thread on Linux only")

N = 300


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def nice_of_a_thread_started_here() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(nice_of_this_thread()))
    thread.start()
    thread.join()
    return seen[0]


class NiceLoggingSource:
    """Triples that record, per pass, the nice values of the thread iterating them
    (pingpong's producer) -- in ``iter()`` and at every step -- and of a thread
    that thread starts (as DGL's or Numba's pools would be)."""

    def __init__(self, num_batches: int = 5) -> None:
        self.triples = seq_triples(N, num_batches)
        self.seen: list[set[int]] = []
        self.child: list[int] = []

    def __len__(self) -> int:
        return len(self.triples)

    def __iter__(self) -> Iterator[Any]:
        values = {nice_of_this_thread()}
        self.child.append(nice_of_a_thread_started_here())
        return self._steps(values)

    def _steps(self, values: set[int]) -> Iterator[Any]:
        for item in self.triples:
            values.add(nice_of_this_thread())
            yield item
        self.seen.append(values)


def check_batches(loader: Any, features: torch.Tensor, labels: torch.Tensor) -> int:
    count = 0
    for batch in loader:
        assert same_bits(batch.x, features[batch.input_nodes])
        assert same_bits(batch.y, labels[batch.output_nodes])
        count += 1
    return count


@linux_only
@pytest.mark.parametrize(("asked", "raised_by"), [(None, 10), (3, 3), (0, 0)])
def test_each_epochs_producer_lowers_its_own_priority_only(asked, raised_by):
    source = NiceLoggingSource()
    features, labels = make_table(N, (4,)), make_table(N, (), torch.int64)
    mine = nice_of_this_thread()
    want = min(MAX_NICE, mine + raised_by)
    with PingPongLoader(source, features, labels, producer_nice=asked) as loader:
        assert loader.producer_nice == raised_by
        for _epoch in range(2):
            assert check_batches(loader, features, labels) == len(source)
            assert nice_of_this_thread() == mine  # the training thread's: untouched
        assert loader.stats["niced_epochs"] == (2 if raised_by else 0)
    assert source.seen == [{want}, {want}]  # from iter() on, every epoch's new thread
    assert source.child == [want, want]  # threads the producer starts inherit it
    assert nice_of_this_thread() == mine
    assert nice_of_a_thread_started_here() == mine  # nor any other thread's
    assert not wait_for_no_pingpong_threads()


@linux_only
def test_on_a_device_standing_in_for_cuda_the_default_leaves_the_priority_alone():
    """The default on CUDA is 0 (not measured there); the fake device stands in for
    it.  An explicit value still applies."""
    source = NiceLoggingSource()
    features = make_table(N, (4,))
    mine = nice_of_this_thread()
    device = FakeAsyncDevice(seed=0)
    with PingPongLoader(source, features, device=device) as loader:
        assert loader.producer_nice == 0
        for batch in loader:
            assert same_bits_on_the_consumer_stream(device, batch.x, features[batch.input_nodes])
    with PingPongLoader(source, features, device=FakeAsyncDevice(seed=1),
                        producer_nice=2) as loader:
        for _batch in loader:
            pass
    assert source.seen == [{mine}, {min(MAX_NICE, mine + 2)}]


@linux_only
def test_in_a_distdgl_client_the_default_leaves_the_priority_alone(monkeypatch):
    """A loader in a DistDGL client process (servers share the cores) defaults to 0
    even on the CPU, whose default is otherwise 10; an explicit value still applies."""
    import pingpong.loader

    monkeypatch.setattr(pingpong.loader, "has_dgl_client", lambda: True)
    source = NiceLoggingSource()
    features = make_table(N, (4,))
    mine = nice_of_this_thread()
    with PingPongLoader(source, features, device="cpu") as loader:
        assert loader.producer_nice == 0
        assert sum(1 for _ in loader) == len(source)
        assert loader.stats["niced_epochs"] == 0
    with PingPongLoader(source, features, device="cpu", producer_nice=2) as loader:
        assert loader.producer_nice == 2
        assert sum(1 for _ in loader) == len(source)
    assert source.seen == [{mine}, {min(MAX_NICE, mine + 2)}]


@linux_only
def test_lower_this_thread_priority_returns_the_capped_value():
    """Documented: the thread's nice value afterwards -- 19 from 15 + 10, not 25 (the
    kernel caps what it sets; the returned value must say what it set)."""
    got: list[Any] = []

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       max(15, nice_of_this_thread()))
        got.append(lower_this_thread_priority(10))
        got.append(nice_of_this_thread())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert got == [MAX_NICE, MAX_NICE]


@linux_only
def test_the_nice_value_is_capped_at_19():
    """Started from a thread already at nice 15, a producer asked for +10 ends at 19
    (the loader is made and iterated on that thread, whose nice its producer
    inherits; a raised nice value cannot be lowered again, hence a thread of its own)."""
    source = NiceLoggingSource(2)
    features = make_table(N, (4,))
    counted: list[int] = []
    errors: list[BaseException] = []

    def train() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           max(15, nice_of_this_thread()))
            with PingPongLoader(source, features, producer_nice=10) as loader:
                counted.append(sum(1 for _ in loader))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert not errors, errors
    assert counted == [2]
    assert source.seen == [{MAX_NICE}]


@linux_only
def test_an_os_that_refuses_is_a_warning_and_the_epoch_goes_on(monkeypatch, caplog):
    def refuse(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    monkeypatch.setattr(pingpong._producer_nice, "_refusal_logged", False)
    source = NiceLoggingSource()
    features, labels = make_table(N, (4,)), make_table(N, (), torch.int64)
    mine = nice_of_this_thread()
    with caplog.at_level(logging.DEBUG, logger="pingpong._producer_nice"):
        with PingPongLoader(source, features, labels, producer_nice=5) as loader:
            for _epoch in range(3):
                assert check_batches(loader, features, labels) == len(source)
            assert loader.stats["niced_epochs"] == 0  # asked, not applied
            assert loader.producer_nice == 5
    assert source.seen == [{mine}] * 3
    refusals = [r for r in caplog.records if "producer_nice=5" in r.getMessage()
                and "Operation not permitted" in r.getMessage()]
    # One warning per process, not per epoch; the later ones at debug level.
    assert [r.levelno for r in refusals] == [logging.WARNING, logging.DEBUG, logging.DEBUG]


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True, "2"])
def test_bad_values_are_refused_at_construction(bad):
    with pytest.raises(ConfigError, match="producer_nice"):
        PingPongLoader(seq_triples(N, 1), make_table(N, (4,)), producer_nice=bad)
    assert not wait_for_no_pingpong_threads()


@pytest.mark.parametrize("value", [np.int64(3), np.int32(0), 19])
def test_numpy_and_boundary_ints_are_accepted(value):
    with PingPongLoader(seq_triples(N, 1), make_table(N, (4,)), producer_nice=value) as loader:
        assert loader.producer_nice == int(value)
        assert type(loader.producer_nice) is int


@linux_only
def test_the_priority_is_lowered_before_producer_started_and_iter():
    """``producer_started`` may start pools of threads (Numba's layer): they must
    start at the producer's new priority, as must whatever ``iter(source)`` starts."""
    mine = nice_of_this_thread()

    class Recording(CPUDevice):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def producer_started(self) -> None:
            self.seen.append(nice_of_this_thread())
            super().producer_started()

    source = NiceLoggingSource(2)
    device = Recording()
    with PingPongLoader(source, make_table(N, (4,)), device=device, producer_nice=4) as loader:
        assert sum(1 for _ in loader) == 2
    assert device.seen == [min(MAX_NICE, mine + 4)]
    assert source.seen == [{min(MAX_NICE, mine + 4)}]


def test_off_linux_nothing_is_done(monkeypatch):
    """Nice is per process elsewhere: raising it would slow the training thread too."""
    calls: list[Any] = []
    monkeypatch.setattr(pingpong._producer_nice, "PER_THREAD_NICE", False)
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args))
    assert lower_this_thread_priority(5) is None
    assert calls == []


def test_the_cuda_devices_default_is_zero():
    cuda = pytest.importorskip("pingpong.devices.cuda")
    assert "default_producer_nice" not in vars(cuda.CUDADevice)  # the base's:
    # The property on an instance that was never initialised (no GPU needed).
    assert object.__new__(cuda.CUDADevice).default_producer_nice == 0
    assert CPUDevice().default_producer_nice == 10


LAYER_STARTED_AT_CONSTRUCTION = """
import os, sys, threading
import numba, torch
sys.path.insert(0, sys.argv[1])
from test_reliability import make_table, seq_triples
from pingpong import PingPongLoader

torch.set_num_threads(1)
features = make_table(300, (8,))
loader = PingPongLoader(seq_triples(300, 4), features, producer_nice=10)
# The training thread's OpenMP count is its own (not NUMBA_NUM_THREADS=2).
assert torch.get_num_threads() == 1, torch.get_num_threads()
for _epoch in range(2):
    for batch in loader:
        assert torch.equal(batch.x, features[batch.input_nodes])
assert loader.stats["niced_epochs"] == 2

@numba.njit(parallel=True, cache=False)
def total(n):
    acc = 0
    for i in numba.prange(n):
        acc += i
    return acc

assert total(100_000) == sum(range(100_000))  # the user's own parallel code
assert torch.get_num_threads() == 1
loader.close()
nices = {}
for task in os.listdir("/proc/self/task"):
    try:
        with open(f"/proc/self/task/{task}/stat") as fh:
            nices[int(task)] = int(fh.read().rsplit(")", 1)[1].split()[16])
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
        continue
print(numba.threading_layer(), sorted(set(nices.values())))
"""


@linux_only
@pytest.mark.parametrize("layer", ["workqueue", "omp", "tbb"])
def test_numbas_pools_are_started_at_the_constructing_threads_priority(layer):
    """The ``workqueue`` layer keeps one pool of workers for the process: started by
    a niced producer, the training thread's own parallel Numba code ran at nice +10.
    The loader starts the layer at construction instead -- from a helper thread, so
    the training thread's OpenMP count (``torch.set_num_threads(1)``) stays.  After
    two epochs and the user's own parallel kernel, every thread left in the process
    is at the process's nice value (the producers, gone, were the only niced ones).
    ``workqueue`` catches the niced pool; ``omp`` (per-thread teams, never niced)
    catches a layer started on the training thread itself, which set its OpenMP
    count to NUMBA_NUM_THREADS over ``torch.set_num_threads(1)``; ``tbb`` (where it
    loads) is the other process-wide pool (its workers start asynchronously: without
    the start at construction, 5 of 6 runs saw one at nice 10)."""
    env = {**(tbb_env() if layer == "tbb" else os.environ), "NUMBA_THREADING_LAYER": layer,
           "NUMBA_NUM_THREADS": "2", "DGLBACKEND": "pytorch"}
    done = subprocess.run([sys.executable, "-c", LAYER_STARTED_AT_CONSTRUCTION,
                           str(Path(__file__).parent)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [layer, f"[{os.getpriority(os.PRIO_PROCESS, 0)}]"]


POOL_ON_THE_PRODUCERS_CPUS = """
import os, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_reliability import make_table, seq_triples
from pingpong import PingPongLoader

os.sched_setaffinity(0, {0})  # the training thread keeps core 0
features = make_table(300, (8,))
with PingPongLoader(seq_triples(300, 4), features, producer_cpus=[1]) as loader:
    for batch in loader:
        assert torch.equal(batch.x, features[batch.input_nodes])
cpus = []
for task in os.listdir("/proc/self/task"):
    try:
        cpus.append(sorted(os.sched_getaffinity(int(task))))
    except (ProcessLookupError, FileNotFoundError):
        continue
print(sum(c == [1] for c in cpus))
"""


@linux_only
@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                    else True, reason="needs CPUs 0 and 1")
def test_a_process_wide_pool_runs_on_producer_cpus_not_the_training_core():
    """``workqueue`` has one pool of workers for the process, which runs pingpong's
    gathers: started at construction, it must start on ``producer_cpus`` (both its
    NUMBA_NUM_THREADS=2 workers), not on the constructing thread's one core."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2",
           "DGLBACKEND": "pytorch"}
    done = subprocess.run([sys.executable, "-c", POOL_ON_THE_PRODUCERS_CPUS,
                           str(Path(__file__).parent)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 2
