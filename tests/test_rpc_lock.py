"""The producers' turn-taking in DGL's RPC client (:mod:`pingpong._rpc`).

The DistDGL test ``test_an_epoch_left_early_then_another_loader_and_a_zip_of_two``
runs it with real servers (and fails without the lock); here the waiting itself:
a producer waiting for the lock leaves as soon as its epoch is stopped; and the
training thread's own turn, ``pingpong.rpc_turn()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import same_bits
from test_reliability import N, make_table, seq_triples

import pingpong
from pingpong import _rpc
from pingpong._rpc import holding


def rpc_lock_held() -> bool:
    """Whether pingpong's process-wide RPC lock is held (there must be one)."""
    lock = _rpc.RPC_LOCK
    assert lock is not None
    return lock.locked()


def test_a_free_lock_is_taken_and_released():
    lock, stop = threading.Lock(), threading.Event()
    with holding(lock, stop, 0.01) as held:
        assert held
        assert lock.locked()
    assert not lock.locked()


def test_no_lock_means_no_wait():
    with holding(None, threading.Event(), 0.01) as held:
        assert held


def test_a_wait_for_a_held_lock_ends_when_stop_is_set():
    lock, stop = threading.Lock(), threading.Event()
    lock.acquire()  # another producer, inside a DGL call
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(_rpc.acquire(lock, stop, 0.01)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()  # waiting its turn
    stop.set()
    waiter.join(2)
    assert not waiter.is_alive()
    assert result == [False]
    assert lock.locked()  # still the other producer's
    lock.release()


def test_a_waiting_producer_gets_the_lock_when_the_other_releases_it():
    lock, stop = threading.Lock(), threading.Event()
    lock.acquire()
    order: list[str] = []

    def second() -> None:
        with holding(lock, stop, 0.01) as held:
            order.append(f"second {held}")

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.05)
    order.append("first done")
    lock.release()
    waiter.join(2)
    assert order == ["first done", "second True"]
    assert not lock.locked()


def test_a_process_without_a_dgl_rpc_client_takes_no_turns():
    """``import dgl`` imports ``dgl.distributed`` too; without ``initialize`` there is
    no RPC client, so loaders get no lock (they keep their full overlap)."""
    pytest.importorskip("dgl")
    import sys

    assert "dgl.distributed" in sys.modules
    assert _rpc.lock_for_process() is None


def test_a_dgl_rpc_client_means_turns_and_none_turns_them_off(monkeypatch):
    """With a client (its servers readable, or not readable at all) loaders share
    :data:`~pingpong._rpc.RPC_LOCK`; ``RPC_LOCK = None`` turns it off."""
    import sys

    import pingpong.serverwatch as serverwatch

    monkeypatch.setitem(sys.modules, "dgl.distributed", sys.modules.get("dgl.distributed", _rpc))
    monkeypatch.setattr(serverwatch, "dgl_servers", lambda: [])
    assert _rpc.lock_for_process() is _rpc.RPC_LOCK is not None

    def unreadable() -> None:
        raise AttributeError("a DGL laid out differently")

    monkeypatch.setattr(serverwatch, "dgl_servers", unreadable)
    assert _rpc.lock_for_process() is _rpc.RPC_LOCK
    monkeypatch.setattr(_rpc, "RPC_LOCK", None)
    assert _rpc.lock_for_process() is None


# --------------------------------------------------------------------------- rpc_turn
class TurnWatch:
    """A source whose steps (the producer, inside DGL's client) -- and the fetches of
    its :meth:`rows` -- and the training thread's ``rpc_turn`` blocks note each other:
    any overlap is recorded."""

    def __init__(self, triples: list[Any], step_s: float) -> None:
        self.triples = triples
        self.step_s = step_s
        self.in_step = self.in_turn = False
        self.overlaps: list[str] = []

    def __iter__(self) -> Iterator[Any]:
        for item in self.triples:
            self.in_step = True
            if self.in_turn:
                self.overlaps.append("a source step began inside the training thread's turn")
            time.sleep(self.step_s)
            self.in_step = False
            yield item

    def rows(self, table: torch.Tensor) -> WatchedRows:
        """A row source over ``table`` whose fetches (DistTensor pulls) note overlaps too."""
        return WatchedRows(self, table)

    def user_call(self, hold_s: float) -> None:
        """The training thread's own 'DGL call'."""
        self.in_turn = True
        if self.in_step:
            self.overlaps.append("the training thread's turn began inside a source step")
        time.sleep(hold_s)
        self.in_turn = False


class WatchedRows:
    """A row source whose fetches are DGL calls of the producer, watched by a TurnWatch."""

    def __init__(self, watch: TurnWatch, table: torch.Tensor) -> None:
        self.watch, self.table = watch, table
        self.shape, self.dtype = table.shape, table.dtype
        self.fetches = 0

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        watch = self.watch
        watch.in_step = True
        if watch.in_turn:
            watch.overlaps.append("a row fetch began inside the training thread's turn")
        time.sleep(watch.step_s)
        self.fetches += 1
        watch.in_step = False
        return self.table[ids]


@pytest.fixture
def takes_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaders made now take turns, as they do in a process with a DGL RPC client."""
    monkeypatch.setattr(_rpc, "lock_for_process", lambda: _rpc.RPC_LOCK)


def test_the_training_threads_turn_and_the_producers_steps_never_overlap(takes_turns):
    """Source steps and row-source fetches (a DistTensor pull) alike: each is the
    producer's DGL call, taken in its turn."""
    triples = seq_triples(N, 30)
    features = make_table(N, (4,))
    source = TurnWatch(triples, step_s=0.003)
    rows = source.rows(features)
    with pingpong.PingPongLoader(source, rows, timeout=30) as loader:
        for _ in range(2):
            for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
                with pingpong.rpc_turn():
                    source.user_call(hold_s=0.004)
                assert same_bits(batch.x, features[inputs])
    assert rows.fetches == 2 * len(triples)
    assert source.overlaps == []


class RestartsInDGL:
    """A source whose ``iter()`` itself is a DGL call (DGL's ``DistDataLoader``
    restarts its pass there): it notes whether the training thread had the turn."""

    def __init__(self, triples: list[Any]) -> None:
        self.triples = triples
        self.in_turn = False
        self.restarts_in_turn = 0
        self.restarts = 0

    def __iter__(self) -> Iterator[Any]:
        self.restarts += 1
        self.restarts_in_turn += self.in_turn
        return iter(self.triples)


def test_the_producers_iter_of_the_source_waits_for_the_training_threads_turn(takes_turns):
    triples = seq_triples(N, 3)
    features = make_table(N, (4,))
    source = RestartsInDGL(triples)
    with pingpong.PingPongLoader(source, features, timeout=5) as loader:
        with pingpong.rpc_turn():
            source.in_turn = True
            it = iter(loader)  # returns at once inside the turn; the producer waits
            time.sleep(0.3)  # the producer's iter(source) would run now, were it not waiting
            source.in_turn = False
        assert [same_bits(b.x, features[t[0]]) for b, t in zip(it, triples, strict=True)
                ] == [True] * 3
    assert (source.restarts, source.restarts_in_turn) == (1, 0)


def test_next_inside_the_turn_raises_and_the_epoch_goes_on(takes_turns):
    triples = seq_triples(N, 4)
    features = make_table(N, (4,))
    with pingpong.PingPongLoader(triples, features, timeout=5) as loader:
        it = iter(loader)
        assert torch.equal(next(it).x, features[triples[0][0]])
        with pingpong.rpc_turn(), pytest.raises(pingpong.RpcTurnError, match="inside pingpong"):
            next(it)
        assert [torch.equal(b.x, features[t[0]]) for b, t in zip(it, triples[1:], strict=True)
                ] == [True] * 3
    assert not rpc_lock_held()


def test_iter_inside_the_turn_does_not_wait_for_the_producer(takes_turns):
    """``iter(loader)`` waits for the producer's ``iter(source)``, which needs the
    turn: inside the training thread's turn it returns at once instead."""
    triples = seq_triples(N, 4)
    features = make_table(N, (4,))
    with pingpong.PingPongLoader(triples, features, timeout=5) as loader:
        start = time.monotonic()
        with pingpong.rpc_turn():
            it = iter(loader)
        assert time.monotonic() - start < 2.0
        assert [torch.equal(b.x, features[t[0]]) for b, t in zip(it, triples, strict=True)
                ] == [True] * 4
    assert not rpc_lock_held()


def test_a_turn_inside_a_turn_is_the_same_turn_and_is_free_again_after_an_error():
    with pingpong.rpc_turn():
        with pingpong.rpc_turn():  # takes nothing: this thread has the turn
            assert rpc_lock_held()
        assert rpc_lock_held()  # still the outer block's
    assert not rpc_lock_held()
    with pytest.raises(KeyError), pingpong.rpc_turn():
        raise KeyError("a failing DGL call")
    assert not rpc_lock_held()


class TurnTakingSource:
    """A source whose steps make DGL calls of their own inside ``rpc_turn()`` (as a
    user's sampler might): run by a producer that already has the turn."""

    def __init__(self, triples: list[Any]) -> None:
        self.triples = triples
        self.turns = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.triples:
            with pingpong.rpc_turn():
                self.turns += 1
            yield item


def test_a_producer_that_has_the_turn_keeps_it_in_the_users_rpc_turn(takes_turns):
    """A source (or row source) calling ``rpc_turn()`` runs on a producer holding the
    turn: the inner block takes nothing, instead of waiting for ever for itself."""
    triples = seq_triples(N, 5)
    features = make_table(N, (4,))
    source = TurnTakingSource(triples)
    with pingpong.PingPongLoader(source, features, timeout=5) as loader:
        assert [torch.equal(b.x, features[t[0]]) for b, t in zip(loader, triples, strict=True)
                ] == [True] * 5
    assert source.turns == 5
    assert not rpc_lock_held()


def test_a_loader_that_takes_no_turns_is_iterated_inside_one():
    """Without a DGL RPC client the producers take no turns: no reason to refuse."""
    triples = seq_triples(N, 3)
    features = make_table(N, (4,))
    with pingpong.rpc_turn(), pingpong.PingPongLoader(triples, features, timeout=5) as loader:
        assert [torch.equal(b.x, features[t[0]]) for b, t in zip(loader, triples, strict=True)
                ] == [True] * 3
