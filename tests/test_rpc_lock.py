"""The producers' turn-taking in DGL's RPC client (:mod:`pingpong._rpc`).

The DistDGL test ``test_an_epoch_left_early_then_another_loader_and_a_zip_of_two``
runs it with real servers (and fails without the lock); here the waiting itself:
a producer waiting for the lock leaves as soon as its epoch is stopped.
"""

from __future__ import annotations

import threading
import time

from pingpong import _rpc
from pingpong._producer import _holding


def test_a_free_lock_is_taken_and_released():
    lock, stop = threading.Lock(), threading.Event()
    with _holding(lock, stop, 0.01) as held:
        assert held
        assert lock.locked()
    assert not lock.locked()


def test_no_lock_means_no_wait():
    with _holding(None, threading.Event(), 0.01) as held:
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
        with _holding(lock, stop, 0.01) as held:
            order.append(f"second {held}")

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.05)
    order.append("first done")
    lock.release()
    waiter.join(2)
    assert order == ["first done", "second True"]
    assert not lock.locked()
