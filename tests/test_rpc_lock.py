"""The producers' turn-taking in DGL's RPC client (:mod:`pingpong._rpc`).

The DistDGL test ``test_an_epoch_left_early_then_another_loader_and_a_zip_of_two``
runs it with real servers (and fails without the lock); here the waiting itself:
a producer waiting for the lock leaves as soon as its epoch is stopped.
"""

from __future__ import annotations

import threading
import time

import pytest

from pingpong import _rpc
from pingpong._rpc import holding


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
