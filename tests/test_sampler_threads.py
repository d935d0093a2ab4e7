"""``sampler_threads``: DGL's OpenMP thread count on each epoch's producer thread.

What it promises (``PingPongLoader`` docstring): each epoch's producer sets
DGL's OpenMP count for itself before ``iter(source)`` -- by default, on the CPU,
as many as ``gather_threads``; on a device standing in for CUDA, DGL's own
setting -- and no other thread's count changes (OpenMP keeps it per thread).
Batches stay bit for bit the reference; bad values are refused at
construction with ``ConfigError``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import same_bits_on_the_consumer_stream, wait_for_no_pingpong_threads
from test_reliability import make_table, seq_triples

from pingpong import ConfigError, PingPongLoader
from pingpong._sampler_threads import limit_dgl_threads
from pingpong.devices.fake import FakeAsyncDevice

N = 300


class ThreadCountLoggingSource:
    """A DGL DataLoader that records, per pass, DGL's OpenMP thread count as seen
    by the thread iterating it (pingpong's producer): in ``iter()`` (DGL's
    shuffle runs there) and after each step -- the ones after a gather too."""

    def __init__(self, dgl: Any, loader: Any) -> None:
        self.dgl = dgl
        self.loader = loader
        self.seen: list[int | set[int]] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        counts = {self.dgl.utils.get_num_threads()}
        return self._steps(iter(self.loader), counts)

    def _steps(self, steps: Iterator[Any], counts: set[int]) -> Iterator[Any]:
        for item in steps:
            counts.add(self.dgl.utils.get_num_threads())
            yield item
        self.seen.append(counts.pop() if len(counts) == 1 else counts)


def dgl_source(dgl: Any) -> ThreadCountLoggingSource:
    graph = dgl.rand_graph(N, 3 * N)
    sampler = dgl.dataloading.NeighborSampler([4, 4])
    loader = dgl.dataloading.DataLoader(graph, torch.arange(N), sampler, batch_size=64)
    return ThreadCountLoggingSource(dgl, loader)


def count_on_a_new_thread(dgl: Any) -> int:
    """DGL's count on a thread that never set it (what a producer starts with)."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(dgl.utils.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def check_batches(loader: PingPongLoader, features: torch.Tensor, labels: torch.Tensor) -> int:
    count = 0
    for batch in loader:
        assert torch.equal(batch.x, features[batch.input_nodes])
        assert torch.equal(batch.y, labels[batch.output_nodes])
        count += 1
    return count


@pytest.mark.parametrize("asked", [None, 3])
def test_each_epochs_producer_sets_dgls_count_for_itself_only(dgl, asked):
    source = dgl_source(dgl)
    features, labels = make_table(N, (4,)), make_table(N, (), torch.int64)
    mine = dgl.utils.get_num_threads()
    fresh = count_on_a_new_thread(dgl)
    with PingPongLoader(source, features, labels, sampler_threads=asked) as loader:
        expected = loader._device.gather_threads if asked is None else asked  # type: ignore[attr-defined]
        assert loader.sampler_threads == expected
        for _epoch in range(2):
            assert check_batches(loader, features, labels) == len(source)
            assert dgl.utils.get_num_threads() == mine  # the training thread's: untouched
    assert source.seen == [expected, expected]
    assert dgl.utils.get_num_threads() == mine
    assert count_on_a_new_thread(dgl) == fresh  # nor any other thread's
    assert not wait_for_no_pingpong_threads()


def test_default_sampler_threads_on_the_cpu_equal_gather_threads(dgl):
    fresh = count_on_a_new_thread(dgl)
    source = dgl_source(dgl)
    with PingPongLoader(source, make_table(N, (4,)),
                        gather_threads=1 if fresh > 1 else 2) as loader:
        expected = loader._device.gather_threads  # type: ignore[attr-defined]
        if expected == fresh:
            pytest.skip("NUMBA_NUM_THREADS leaves no gather count unlike the default")
        assert loader.sampler_threads == expected
        for _batch in loader:
            pass
    assert source.seen == [expected]


def test_on_a_device_standing_in_for_cuda_dgl_keeps_its_own_count(dgl):
    """The default on CUDA leaves DGL alone (not measured there); the fake device
    stands in for it.  An explicit count is still set."""
    fresh = count_on_a_new_thread(dgl)
    source = dgl_source(dgl)
    features = make_table(N, (4,))
    device = FakeAsyncDevice(seed=0)
    with PingPongLoader(source, features, device=device) as loader:
        assert loader.sampler_threads is None
        for batch in loader:
            assert same_bits_on_the_consumer_stream(device, batch.x, features[batch.input_nodes])
    with PingPongLoader(source, features, device=FakeAsyncDevice(seed=1),
                        sampler_threads=fresh + 1) as loader:
        for _batch in loader:
            pass
    assert source.seen == [fresh, fresh + 1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_are_refused_at_construction(bad):
    with pytest.raises(ConfigError, match="sampler_threads"):
        PingPongLoader(seq_triples(N, 1), make_table(N, (4,)), sampler_threads=bad)
    assert not wait_for_no_pingpong_threads()


def test_without_dgl_imported_nothing_is_set_and_dgl_is_not_imported():
    script = (
        "import sys, torch\n"
        "from pingpong import PingPongLoader\n"
        "from pingpong._sampler_threads import limit_dgl_threads\n"
        "assert limit_dgl_threads(1) is False\n"
        "t = [(torch.arange(4), torch.arange(2), [])]\n"
        "with PingPongLoader(t, torch.zeros(4, 2), sampler_threads=1) as loader:\n"
        "    assert sum(1 for _ in loader) == 1\n"
        "assert 'dgl' not in sys.modules, 'pingpong imported dgl'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_count_holds_through_torchs_first_parallel_op_on_a_new_thread(dgl):
    """torch sets a thread's OpenMP count at its first parallel op there: the count
    set for the producer must survive it (and torch's ops then use it too)."""
    seen: list[tuple[int, int]] = []

    def fresh_thread() -> None:
        assert limit_dgl_threads(3)
        torch.randn(200_000).mul_(2)  # big enough for torch to go parallel
        seen.append((dgl.utils.get_num_threads(), torch.get_num_threads()))

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert seen == [(3, 3)]


NUMBA_STARTS_ON_THE_PRODUCER = """
import dgl, torch
from pingpong import PingPongLoader
from pingpong.devices.cpu import CPUDevice

torch.set_num_threads(2)  # torch's own count, unlike OMP_NUM_THREADS

class NoDefault(CPUDevice):
    # CUDA's defaults (no count, the priority left alone: no layer started at
    # construction) and no warm-up thread, so that Numba's OpenMP layer starts
    # in the producer's producer_started.
    default_sampler_threads = None
    default_producer_nice = 0
    def attach(self, store):
        pass

seen = []
class Source:
    def __iter__(self):
        seen.append(dgl.utils.get_num_threads())
        torch.randn(200_000).mul_(2)  # torch's first parallel op on this thread
        seen.append(dgl.utils.get_num_threads())
        return iter([(torch.arange(4), torch.arange(2), [])])

with PingPongLoader(Source(), torch.zeros(4, 2), device=NoDefault(1)) as loader:
    assert loader.sampler_threads is None
    assert sum(1 for _ in loader) == 1
print(seen)
"""


def test_with_no_count_the_producer_keeps_the_count_it_started_with(dgl):
    """Numba's OpenMP layer, started on the producer thread, sets that thread's count
    to NUMBA_NUM_THREADS; with no count asked for (CUDA's default) the producer
    puts back the process default (OMP_NUM_THREADS=1 here) before iter(source), and
    leaves torch's per-thread set-up to come later, as on a thread Numba never
    touched: torch's first parallel op then sets torch's own count (2 here).  Running
    that set-up first (``torch_first=True``) kept 1 on the producer for good."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2",
           "NUMBA_THREADING_LAYER": "omp"}
    done = subprocess.run([sys.executable, "-c", NUMBA_STARTS_ON_THE_PRODUCER], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[1, 2]"
