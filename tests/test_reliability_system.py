"""Reliability checklist items 11, 13, 14: bad input, threads and forks, leaks.

Item 12 (kernels under the Numba CUDA simulator) is tests/test_kernels_cudasim.py
(run with ``NUMBA_ENABLE_CUDASIM=1``, the tox ``cudasim`` env).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import numba
import numpy as np
import psutil
import pytest
import torch
from conftest import still_running
from test_reliability import (
    CUDA_KIND,
    DEVICE_KINDS,
    Expected,
    SeqSource,
    Verifier,
    make_device,
    make_table,
    seq_triples,
)
from test_rowsource import dense_ids

import pingpong
from pingpong import PingPongLoader
from pingpong._ids import host_ids
from pingpong.devices.fake import FakeAsyncDevice

N = 400


# -- 11. bad input is refused before any memory is read ------------------------------
@pytest.mark.parametrize(
    ("ids", "exc", "needle"),
    [
        (np.array([1.0, 2.0]), TypeError, "float64"),
        (torch.tensor([1, 2], dtype=torch.int16), TypeError, "int16"),
        (np.array([1, 2], dtype=np.uint64), TypeError, "uint64"),
        (np.array([1, 2], dtype=np.int8), TypeError, "int8"),
        (torch.tensor(3), TypeError, "1-D"),
        (np.zeros((2, 2), dtype=np.int64), TypeError, "1-D"),
        (np.array([1, None], dtype=object), TypeError, "object"),
        (7, TypeError, "int"),
        (None, TypeError, "NoneType"),
        ({"user": torch.arange(3)}, TypeError, "dict"),
        (np.array([0, N], dtype=np.int32), IndexError, f"= {N}"),
        (torch.tensor([0, -(2**31)], dtype=torch.int32), IndexError, str(-(2**31))),
        (torch.arange(2**31, 2**31 + 3), IndexError, str(2**31)),
    ],
    ids=lambda v: repr(v)[:28],
)
@pytest.mark.parametrize("device_kind", ["fake", CUDA_KIND])
def test_bad_ids_are_refused_before_any_gather(ids, exc, needle, device_kind):
    """The error names the problem, no gather was enqueued, the next epoch is intact.

    On the fake device the enqueued gathers are counted; on a GPU a later
    ``torch.cuda.synchronize()`` must not surface an asynchronous fault.
    """
    triples = seq_triples(N, 4)
    features, labels = make_table(), make_table(N, (), torch.int64)
    expected = Expected(features, labels, triples)
    good = list(triples)
    triples[2] = (ids, triples[2][1], triples[2][2])
    source = SeqSource(triples, shuffle=False)
    with PingPongLoader(source, features, labels, device=make_device(device_kind, 1)) as loader:
        device = loader._device
        verifier = Verifier(device, expected, stream_sleep_s=0.01)
        it = iter(loader)
        for _ in range(2):
            verifier.submit(next(it))
        with pytest.raises(exc, match="input_nodes") as info:
            next(it)
        assert needle in str(info.value)
        assert isinstance(info.value, pingpong.PingPongError)
        if isinstance(device, FakeAsyncDevice):
            assert device.calls["gather"] == 2 * 2  # batches 0 and 1 only
        verifier.resolve()
        assert verifier.corrupted == 0  # the batches before it are intact
        source.triples = good
        for batch in loader:  # the next epoch works
            verifier.submit(batch)
        verifier.resolve()
        assert (verifier.checked, verifier.corrupted) == (2 + 4, 0)
    if device_kind == "cuda":
        torch.cuda.synchronize()  # no asynchronous fault was left behind


def test_bad_output_ids_dtype_is_refused_when_labels_are_used():
    triples = [(torch.arange(4), torch.tensor([0.5]), {"seq": 0})]
    with PingPongLoader(triples, make_table(), torch.arange(N)) as loader:
        with pytest.raises(TypeError, match=r"output_nodes.*float32"):
            list(loader)


def _read_only(array: np.ndarray) -> np.ndarray:
    array = array.copy()
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("layout", [
    lambda base: base,
    lambda base: base.numpy(),
    lambda base: base[::2],
    lambda base: base.numpy()[::-1],
    lambda base: _read_only(base.numpy()),
    lambda base: base.to(torch.int32).numpy()[::-2],
    lambda base: base.numpy().astype(">i8"),
    lambda base: base.numpy().astype(">i4")[::-1],
], ids=["tensor", "array", "tensor[::2]", "array[::-1]", "read-only", "int32[::-2]",
        "big-endian", "big-endian int32[::-1]"])
def test_host_ids_are_a_contiguous_writeable_copy(layout):
    """What every consumer of a batch's ids (``torch.from_numpy`` in the CPU fallback,
    a row source's fetch, the CUDA id staging) relies on; and never the caller's
    memory, which it could write between the check and the gather."""
    given = layout(torch.randperm(N))
    array = host_ids(given, N, "input_nodes")
    assert array.flags.c_contiguous
    assert array.flags.writeable
    assert array.tolist() == given.tolist()
    narrow = given.dtype == torch.int32 or (isinstance(given, np.ndarray)
                                             and given.dtype.itemsize == 4)
    assert array.dtype == (np.int32 if narrow else np.int64)  # this machine's byte order
    given_memory = given.numpy() if isinstance(given, torch.Tensor) else given
    assert not np.shares_memory(array, given_memory)


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_non_contiguous_and_int32_ids_are_gathered_correctly(device_kind):
    """Strided, narrow or big-endian ids are valid input, not an error (on CUDA:
    through the id staging, which hands the ids to ``torch.from_numpy``)."""
    base = torch.randperm(N)
    triples = [
        (base[::3], base[1::5], {"seq": 0}),
        (base.to(torch.int32)[::2], base[:7].to(torch.int32), {"seq": 1}),
        (base.numpy()[::-1], base.numpy()[:3], {"seq": 2}),  # a negative stride
        # the other byte order (ids read from a big-endian file)
        (base.numpy()[:20].astype(">i8"), base.numpy()[:4].astype(">i4"), {"seq": 3}),
    ]
    features, labels = make_table(), make_table(N, (), torch.int64)
    dense = [(dense_ids(t[0]), dense_ids(t[1]), t[2]) for t in triples]
    expected = Expected(features, labels, dense)
    with PingPongLoader(triples, features, labels,
                        device=make_device(device_kind, seed=2)) as loader:
        verifier = Verifier(loader._device, expected)
        for batch in loader:
            verifier.submit(batch)
        verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (4, 0)


_READ_ONLY_TABLE_CHILD = """
import sys, warnings
import numpy as np, torch
from pingpong import PingPongLoader
# torch warns once per process (so a fresh one), and only this warning is asked about
warnings.filterwarnings("error", "The given NumPy array is not writable")
table = np.load(sys.argv[1], mmap_mode="r")
ids = torch.tensor([7, 0, 3])
with PingPongLoader([(ids, ids[:1], None)], table) as loader:
    batch = next(iter(loader))
    assert torch.equal(batch.x, torch.from_numpy(np.array(table[ids.numpy()])))
print("ok")
"""


def test_a_read_only_memory_mapped_table_is_read_without_a_warning(tmp_path):
    """``np.load(path, mmap_mode="r")`` -- how large feature files are opened -- is a
    table like any other: pingpong only reads it (torch warns on read-only arrays)."""
    path = tmp_path / "features.npy"
    np.save(path, np.arange(40, dtype=np.float32).reshape(10, 4))
    child = subprocess.run([sys.executable, "-c", _READ_ONLY_TABLE_CHILD, str(path)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("features", "labels", "needle"),
    [
        (np.asfortranarray(np.ones((N, 4), np.float32)), None, "not contiguous"),
        (np.ones((N, 4), np.float32)[::-1], None, "not contiguous.*ascontiguousarray"),
        ({"a": torch.randn(N, 2), "b": torch.randn(4, N).t()}, None, "not contiguous"),
        (torch.empty(N, 4, device="meta"), None, "host memory"),
        (torch.randn(N, 4), torch.tensor(3), "0-D"),
        (torch.randn(N, 4), [1, 2, 3], "torch.Tensor"),
        (torch.randn(N, 4), torch.empty(0), "labels has 0 rows|empty"),
        ([[1.0, 2.0]], None, "torch.Tensor"),
    ],
    ids=[
        "fortran-numpy",
        "reversed-numpy",
        "dict-member-strided",
        "meta",
        "labels-0d",
        "labels-list",
        "labels-empty",
        "nested-list",
    ],
)
def test_more_bad_tables_are_refused_at_construction(features, labels, needle):
    with pytest.raises((ValueError, TypeError), match=needle) as info:
        PingPongLoader(seq_triples(N, 1), features, labels)
    assert isinstance(info.value, pingpong.TableError)


# -- 13. threads and forks -----------------------------------------------------------
def test_dgl_dataloader_with_worker_processes(dgl):
    """DGL ``num_workers=2`` (forked worker processes) under the producer thread."""
    g = dgl.rand_graph(N, 3000)
    features, labels = make_table(), make_table(N, (), torch.int64)
    sampler = dgl.dataloading.NeighborSampler([4, 3])
    source = dgl.dataloading.DataLoader(
        g, torch.arange(N), sampler, batch_size=50, shuffle=True, num_workers=2
    )
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    with PingPongLoader(source, features, labels, timeout=60) as loader:
        for epoch in range(2):
            seeds = []
            for batch in loader:
                assert torch.equal(batch.x, features[batch.input_nodes])
                assert torch.equal(batch.y, labels[batch.output_nodes])
                seeds.append(batch.output_nodes)
            assert torch.equal(torch.cat(seeds).sort().values, torch.arange(N)), epoch
        for i, _batch in enumerate(loader):  # early exit with live worker processes
            if i == 1:
                break
        assert len(list(loader)) == len(source)
    gc.collect()
    deadline = time.monotonic() + 10
    while _running_children(me, before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running_children(me, before) == []  # the worker processes are gone


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_stats_in_a_forked_child_are_the_childs_own():
    """``loader.stats`` in a child forked by the training process reports the child:
    its memory (it reported the parent's: a ``psutil.Process`` kept from before the
    fork, found by a lifecycle review), its CPU time since the fork (not the
    parent's), and it does not wait for a stats lock held at the fork by another
    thread.  The CPU time is told apart by what it counts, not by its size: a
    child of a long test session may itself use more CPU than the parent's 0.6 s
    (0.57 and 0.7 s in two CI runs; a garbage collection there touches the whole
    inherited heap), so the child spins 0.3 s of its own, which the figure must
    count -- the parent's, sleeping in ``waitpid`` meanwhile, would not."""
    triples = seq_triples(N, 4)
    features = make_table()
    with PingPongLoader(triples, features) as loader:
        assert len(list(loader)) == 4
        while loader.stats["process_cpu_s"] < 0.6:  # the parent's CPU time: 0.6 s
            pass
        held, release = threading.Event(), threading.Event()

        def hold_the_stats_lock() -> None:
            with loader._stats._lock:  # as the producer does while it counts a batch
                held.set()
                release.wait(30)

        holder = threading.Thread(target=hold_the_stats_lock)
        holder.start()
        assert held.wait(30)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                before = loader.stats["rss_bytes"]
                ballast = np.ones(100 * 2**20, dtype=np.uint8)  # 100 MiB only the child has
                stats = loader.stats
                real = psutil.Process().memory_info().rss
                times = psutil.Process().cpu_times()
                spin_from = time.thread_time()
                while time.thread_time() - spin_from < 0.3:  # CPU only the child uses
                    pass
                after_spin = loader.stats["process_cpu_s"]
                line = (f"{stats['rss_bytes']} {real} {stats['process_cpu_s']} {before} "
                        f"{times.user + times.system} {after_spin} {ballast[-1]}\n")
                os.write(write_end, line.encode())
                code = 0
            finally:
                os._exit(code)
        release.set()
        holder.join()
        os.close(write_end)
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not done[0]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        with os.fdopen(read_end) as pipe:
            report = pipe.read().split()
        assert done[0], "the child hung reading loader.stats"
        assert os.waitstatus_to_exitcode(done[1]) == 0
        reported_rss, real_rss, cpu_s = int(report[0]), int(report[1]), float(report[2])
        before_ballast = int(report[3])
        assert abs(reported_rss - real_rss) < 20 * 2**20, (reported_rss, real_rss)
        assert reported_rss - before_ballast > 80 * 2**20, (reported_rss, before_ballast)
        childs_cpu_s = float(report[4])
        assert 0.0 <= cpu_s <= childs_cpu_s + 0.05, (cpu_s, childs_cpu_s)
        after_spin = float(report[5])
        assert after_spin - cpu_s >= 0.28, (cpu_s, after_spin)  # the child's spin


def _running_children(me: psutil.Process, before: set[int]) -> list[psutil.Process]:
    """Children of ``me`` not in ``before`` that still run (a zombie counts as gone:
    torch terminates a slow worker without reaping it)."""
    return [c for c in me.children() if c.pid not in before and still_running(c.pid)]


@numba.njit(parallel=True, nogil=True)
def _user_parallel_sum(a):  # pragma: no cover - compiled
    total = 0.0
    for i in numba.prange(a.shape[0]):
        total += a[i]
    return total


def test_user_parallel_numba_while_the_producer_gathers():
    """The producer's parallel Numba gather and the training thread's own
    parallel Numba code run at the same time without aborting (Numba #8563)."""
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(20_000, 64, generator=gen)
    triples = [
        (torch.randint(0, 20_000, (20_000,), generator=gen), torch.arange(4), {"seq": i})
        for i in range(20)
    ]
    data = np.ones(200_000)
    with PingPongLoader(triples, features, num_buffers=3) as loader:
        for _ in range(2):
            for batch, triple in zip(loader, triples, strict=True):
                for _ in range(3):
                    assert _user_parallel_sum(data) == 200_000
                assert torch.equal(batch.x, features[triple[0]])
    # on this machine a thread-safe layer must have been chosen (no serialising fallback)
    assert not pingpong._numba_threads.must_serialise()
    assert numba.threading_layer() in ("omp", "tbb")


# -- 14. leaks ------------------------------------------------------------------------
def _cycle(kind: str, features: torch.Tensor, triples: list, seed: int) -> None:
    loader = PingPongLoader(triples, features, device=make_device(kind, seed, 0.0005))
    for i, _batch in enumerate(loader):
        if i == 2:
            break
    loader.close()


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_no_leak_over_100_lifecycles(kind):
    """create / iterate / break / close x 100: RSS < 5 MB, fds and threads unchanged.

    On a GPU also: no pinned-memory registration and no device memory survive.
    """
    process = psutil.Process()
    features = make_table(2000, (32,))
    triples = seq_triples(2000, 6, max_inputs=256)
    for i in range(10):  # warm up: compilation, allocator pools, lazy imports
        _cycle(kind, features, triples, i)
    gc.collect()
    assert wait_until_no_pingpong_threads()
    rss0 = process.memory_info().rss
    fds0 = process.num_fds()
    threads0 = threading.active_count()
    gpu0 = _gpu_memory_and_pins() if kind == "cuda" else None
    for i in range(100):
        _cycle(kind, features, triples, i)
    gc.collect()
    assert wait_until_no_pingpong_threads()
    growth = process.memory_info().rss - rss0
    assert growth < 5 * 2**20, f"RSS grew by {growth / 2**20:.1f} MB"
    assert process.num_fds() == fds0
    assert threading.active_count() == threads0
    if kind == "cuda":
        assert _gpu_memory_and_pins() == gpu0  # (bytes allocated on the GPU, registered tables)
        assert not features.is_pinned()


def _gpu_memory_and_pins() -> tuple[int, int]:
    from pingpong.kernels import _interop

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), _interop.registered_count()


def wait_until_no_pingpong_threads(timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name.startswith("pingpong-")]:
            return True
        time.sleep(0.01)
    return False
