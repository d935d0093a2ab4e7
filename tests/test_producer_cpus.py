"""``producer_cpus``: the CPUs each epoch's producer thread runs on (Linux).

What it promises (``PingPongLoader`` docstring): every epoch's producer
restricts itself to those CPUs as it starts, the training thread keeps its
own affinity, batches stay bit for bit the reference, and bad values are
refused at construction with ``ConfigError``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import wait_for_no_pingpong_threads
from test_reliability import make_table, seq_triples

from pingpong import ConfigError, PingPongLoader

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="os.sched_setaffinity is Linux-only")

N = 200


class AffinityLoggingSource:
    """Yields ``triples``; records, per pass, the id of the thread iterating it
    (pingpong's producer) and every affinity it saw there: in ``iter()`` itself
    (where a DataLoader starts its workers), of a thread started in ``iter()``
    (which inherits it, as those workers do), and at every step."""

    def __init__(self, triples: list[Any]) -> None:
        self.triples = triples
        self.seen: list[tuple[int, set[frozenset[int]]]] = []

    def __iter__(self) -> Iterator[Any]:
        affinities = {frozenset(os.sched_getaffinity(0))}
        worker = threading.Thread(
            target=lambda: affinities.add(frozenset(os.sched_getaffinity(0))))
        worker.start()
        worker.join()
        self.seen.append((threading.get_native_id(), affinities))
        return self._steps(affinities)

    def _steps(self, affinities: set[frozenset[int]]) -> Iterator[Any]:
        for triple in self.triples:
            affinities.add(frozenset(os.sched_getaffinity(0)))
            yield triple


def the_other_cpus() -> frozenset[int]:
    """Every CPU this process may use but one (a proper subset), or skip."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    return frozenset(allowed - {min(allowed)})


@linux_only
def test_every_epochs_producer_runs_on_the_cpus_given_and_the_training_thread_is_untouched():
    cpus = the_other_cpus()
    triples = seq_triples(N, 4)
    features, labels = make_table(N, (4,)), make_table(N, (), torch.int64)
    source = AffinityLoggingSource(triples)
    mine = os.sched_getaffinity(0)
    with PingPongLoader(source, features, labels, producer_cpus=cpus) as loader:
        for _epoch in range(2):
            for k, batch in enumerate(loader):
                inputs, outputs, _ = triples[k]
                assert torch.equal(batch.x, features[inputs])
                assert torch.equal(batch.y, labels[outputs])
                assert os.sched_getaffinity(0) == mine
    assert [aff for _, aff in source.seen] == [{cpus}, {cpus}]  # from iter(source) on
    assert source.seen[0][0] != source.seen[1][0]  # one producer thread per epoch
    assert threading.get_native_id() not in {tid for tid, _ in source.seen}
    assert not wait_for_no_pingpong_threads()


@linux_only
def test_without_it_the_producer_inherits_the_affinity_of_the_thread_starting_the_epoch():
    cpus = the_other_cpus()
    triples = seq_triples(N, 2)
    source = AffinityLoggingSource(triples)
    mine = os.sched_getaffinity(0)
    result: list[Any] = []

    def pinned_training_thread() -> None:
        os.sched_setaffinity(0, cpus)
        with PingPongLoader(source, make_table(N, (4,))) as loader:
            result.append(sum(1 for _ in loader))

    thread = threading.Thread(target=pinned_training_thread)
    thread.start()
    thread.join(60)
    assert result == [2]
    assert source.seen[0][1] == {cpus}  # what producer_cpus exists to avoid
    assert os.sched_getaffinity(0) == mine


@linux_only
@pytest.mark.parametrize("bad", [set(), [], [-1], [1.0], [True], "0", 10_000])
def test_bad_cpu_sets_are_refused_at_construction(bad):
    with pytest.raises(ConfigError, match="producer_cpus"):
        PingPongLoader(seq_triples(N, 1), make_table(N, (4,)), producer_cpus=bad)
    assert not wait_for_no_pingpong_threads()


@linux_only
def test_a_set_the_os_refuses_ends_every_epoch_with_its_oserror_and_leaves_no_thread():
    """CPU 100000 exists nowhere: construction accepts it (which CPUs a thread may use
    is the OS's to say), the producer's request fails, and the training loop gets that
    OSError, naming producer_cpus, in each epoch."""
    triples = seq_triples(N, 2)
    with PingPongLoader(triples, make_table(N, (4,)), producer_cpus=[100_000]) as loader:
        for _epoch in range(2):
            with pytest.raises(OSError) as info:
                next(iter(loader))
            assert "producer_cpus=[100000]" in "\n".join(getattr(info.value, "__notes__", []))
    assert not wait_for_no_pingpong_threads()


def test_a_platform_without_sched_setaffinity_is_refused(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    with pytest.raises(ConfigError, match="sched_setaffinity"):
        PingPongLoader(seq_triples(N, 1), make_table(N, (4,)), producer_cpus={0})
