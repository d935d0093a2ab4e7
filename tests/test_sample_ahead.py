"""``sample_ahead``: the producer samples batch k+1 before it hands batch k over.

What it promises (``PingPongLoader`` docstring): the order itself (checked
both ways, so each setting's test fails under the other), every batch still
bit for bit the reference, a source failing at k+1 still delivers batch k,
a source stuck at k+1 holds batch k back until it returns, and the default
(on for row sources, off for host tables).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from conftest import wait_for_no_pingpong_threads
from test_reliability import Expected, SeqSource, Verifier, make_table, seq_triples
from test_rowsource import Rows

import pingpong
from pingpong import PingPongLoader

N = 300
BATCHES = 5


class WatchingSource:
    """Yields ``triples``; asked for item k+1, it waits up to ``wait_s`` for batch k to
    have been delivered, and records whether it was (``delivered_before_next``)."""

    def __init__(self, triples: list[Any], wait_s: float) -> None:
        self.triples = triples
        self.wait_s = wait_s
        self.delivered = [threading.Event() for _ in triples]
        self.delivered_before_next: list[bool] = []

    def __iter__(self):
        for k, triple in enumerate(self.triples):
            if k > 0:
                self.delivered_before_next.append(self.delivered[k - 1].wait(self.wait_s))
            yield triple


class FailingAt:
    """Yields ``triples[:k]``, then raises ``SamplerGone`` where item k would be."""

    def __init__(self, triples: list[Any], k: int) -> None:
        self.triples, self.k = triples, k

    def __iter__(self):
        yield from self.triples[: self.k]
        raise SamplerGone(f"the sampler died at batch {self.k}")


class SamplerGone(RuntimeError):
    pass


def tables() -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    return seq_triples(N, BATCHES), make_table(N, (4,)), make_table(N, (), torch.int64)


@pytest.mark.parametrize("sample_ahead", [True, False])
def test_the_producer_samples_the_next_batch_before_handing_one_over(sample_ahead):
    triples, features, labels = tables()
    # With sample_ahead batch k cannot be delivered while item k+1 is being taken, so
    # the source waits its full wait_s each time: keep it short.
    source = WatchingSource(triples, wait_s=0.3 if sample_ahead else 10.0)
    with PingPongLoader(source, features, labels, sample_ahead=sample_ahead,
                        timeout=30) as loader:
        assert loader.sample_ahead is sample_ahead
        for k, batch in enumerate(loader):
            assert torch.equal(batch.x, features[triples[k][0]])
            assert torch.equal(batch.y, labels[triples[k][1]])
            source.delivered[k].set()
    # item k+1 was taken before batch k was handed over -- or, off, only after
    assert source.delivered_before_next == [not sample_ahead] * (BATCHES - 1)


@pytest.mark.parametrize("sample_ahead", [True, False])
@pytest.mark.parametrize("fail_at", [0, 1, BATCHES - 1])
def test_a_source_failing_at_batch_k_plus_1_still_delivers_batch_k(sample_ahead, fail_at):
    triples, features, labels = tables()
    got = []
    with PingPongLoader(FailingAt(triples, fail_at), features, labels,
                        sample_ahead=sample_ahead) as loader:
        with pytest.raises(SamplerGone, match=f"died at batch {fail_at}") as caught:
            for batch in loader:
                got.append(batch.blocks["seq"])
                assert torch.equal(batch.x, features[triples[len(got) - 1][0]])
        assert got == list(range(fail_at))
        assert f"while preparing batch {fail_at}" in "\n".join(caught.value.__notes__)
        # and the loader goes on: a new epoch starts the source again
        with pytest.raises(SamplerGone):
            list(loader)


class GatedAtOne:
    """Yields batch 0, then waits (at most 10 s) for ``gate`` before the rest."""

    def __init__(self, triples: list[Any]) -> None:
        self.triples, self.gate = triples, threading.Event()

    def __iter__(self):
        yield self.triples[0]
        self.gate.wait(10)
        yield from self.triples[1:]


def test_a_source_stuck_at_batch_k_plus_1_holds_batch_k_back_until_it_returns():
    triples, features, labels = tables()
    stuck = GatedAtOne(triples)
    with PingPongLoader(stuck, features, labels, sample_ahead=True, timeout=0.3) as loader:
        with pytest.raises(pingpong.BatchTimeoutError, match="after 0 batches"):
            next(iter(loader))  # batch 0 is ready, but waits for item 1
        stuck.gate.set()
    slow = GatedAtOne(triples)
    opener = threading.Timer(0.3, slow.gate.set)
    with PingPongLoader(slow, features, labels, sample_ahead=True, timeout=None) as loader:
        opener.start()
        seqs = [b.blocks["seq"] for b in loader]  # nothing lost, only later
    opener.join()
    assert seqs == list(range(BATCHES))


def test_close_from_another_thread_while_the_producer_samples_ahead():
    """next() waits for batch 0, which waits for the stuck look-ahead: close() from
    another thread ends the wait at once, and the producer leaves once the source
    returns."""
    triples, features, labels = tables()
    stuck = GatedAtOne(triples)
    loader = PingPongLoader(stuck, features, labels, sample_ahead=True, timeout=None)
    closer = threading.Timer(0.3, loader.close)
    closer.start()
    start = time.monotonic()
    with pytest.raises(pingpong.LoaderClosedError):
        next(iter(loader))
    assert time.monotonic() - start < 5.0
    closer.join()
    stuck.gate.set()
    assert wait_for_no_pingpong_threads(5.0) == []


def test_the_default_is_on_for_row_sources_and_off_for_host_tables():
    triples, features, labels = tables()
    assert not PingPongLoader(triples, features, labels).sample_ahead
    assert PingPongLoader(triples, Rows(features), labels).sample_ahead
    assert PingPongLoader(triples, features, Rows(labels)).sample_ahead
    assert PingPongLoader(triples, {"a": features, "b": Rows(features)}, labels).sample_ahead
    assert not PingPongLoader(triples, Rows(features), labels, sample_ahead=False).sample_ahead
    assert PingPongLoader(triples, features, labels, sample_ahead=True).sample_ahead


@pytest.mark.parametrize("bad", [1, 0, "yes", "auto"])
def test_a_bad_sample_ahead_is_a_config_error(bad):
    triples, features, labels = tables()
    with pytest.raises(pingpong.ConfigError, match="sample_ahead must be None, True or False"):
        PingPongLoader(triples, features, labels, sample_ahead=bad)


@pytest.mark.parametrize("sample_ahead", [True, False])
def test_every_batch_is_the_reference_over_shuffled_epochs(sample_ahead):
    triples = seq_triples(N, 9, max_inputs=64)
    features, labels = make_table(N, (3,)), make_table(N, (), torch.int64)
    source = SeqSource(triples, seed=3)
    verifier = Verifier("cpu", Expected(features, labels, triples))
    with PingPongLoader(source, Rows(features), labels, sample_ahead=sample_ahead) as loader:
        for epoch in range(3):
            seqs = []
            for batch in loader:
                seqs.append(batch.blocks["seq"])
                verifier.submit(batch)
            assert seqs == source.order[epoch]
    verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (27, 0)


def test_a_shuffled_dgl_loader_with_sample_ahead_delivers_each_batch_exactly(dgl):
    graph = dgl.rand_graph(500, 4000)
    features, labels = make_table(500, (8,)), make_table(500, (), torch.int64)
    source = dgl.dataloading.DataLoader(graph, torch.arange(500),
                                        dgl.dataloading.NeighborSampler([4, 4]),
                                        batch_size=64, shuffle=True)
    with PingPongLoader(source, features, labels, sample_ahead=True) as loader:
        for _ in range(2):
            seeds = []
            for batch in loader:
                assert torch.equal(batch.x, features[batch.input_nodes])
                assert torch.equal(batch.y, labels[batch.output_nodes])
                # the blocks are this batch's own: their node ids are its ids
                assert torch.equal(batch.blocks[0].srcdata[dgl.NID], batch.input_nodes)
                assert torch.equal(batch.blocks[-1].dstdata[dgl.NID], batch.output_nodes)
                seeds.append(batch.output_nodes.clone())
            assert torch.equal(torch.cat(seeds).sort().values, torch.arange(500))
