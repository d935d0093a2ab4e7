"""One epoch: a producer thread, its queues, and the consumer's side of the protocol.

An :class:`Epoch` is shared by the loader (which closes it before the next
epoch starts) and the :class:`EpochIterator` the training loop holds.  The
producer thread receives only the queues, locks and flags it needs, so the
iterator can be garbage-collected while the producer runs; its finaliser
only *requests* a stop (it may run on any thread, even the producer's).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ._producer import Delivery, EndOfEpoch, Failure, produce
from .batch import Batch
from .devices.base import Device
from .errors import BatchTimeoutError, ProducerDiedError, SlotOverwriteError
from .slots import Slot
from .stats import LoaderStats
from .store import FeatureStore

logger = logging.getLogger(__name__)

#: How often blocked waits wake up to check stop flags and thread liveness.
POLL_S = 0.05
#: How long closing an epoch waits for its producer thread to exit.
JOIN_TIMEOUT_S = 2.0
#: The same after a timeout or interrupt, when the producer is likely stuck in the source.
ERROR_JOIN_TIMEOUT_S = 0.1

_live_epochs: weakref.WeakSet[Epoch] = weakref.WeakSet()
_epoch_ids = itertools.count()
#: Set by the exit hook: from then on, joins are short (a daemon producer stuck
#: in the source writes nothing more, and waiting for it only delays exit).
_exiting = False
_exit_hook_registered = False


class Epoch:
    """The state of one pass over the source.  See the module docstring.

    Invariants: after :meth:`close` returns, the producer writes no slot again
    (it may still be blocked inside the source, and exits when that returns);
    every slot this epoch took is either back in the loader's hands or held
    by nobody.
    """

    def __init__(
        self,
        source: Iterable[Any],
        store: FeatureStore,
        device: Device,
        slots: list[Slot],
        stats: LoaderStats,
        timeout: float | None,
        name: str,
        *,
        debug: bool = False,
    ) -> None:
        self.device = device
        self.debug = debug
        self.held_generation = 0
        self.stats = stats
        self.timeout = timeout
        self.free_q: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for slot in slots:
            self.free_q.put(slot)
        # SimpleQueue, not Queue: its get() is one C-level lock wait, so Ctrl-C in
        # next() raises a clean KeyboardInterrupt.  Queue.get() runs Python-level
        # Condition code that a KeyboardInterrupt can leave half done.  Measured
        # (benchmarks/sigint_queue.py and an earlier copy of it; five runs of
        # ~12,000 interrupts each): Queue ended two gets in "RuntimeError: release
        # unlocked lock" and hung once; SimpleQueue always raised KeyboardInterrupt.
        self.ready_q: queue.SimpleQueue[Delivery | EndOfEpoch | Failure] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.write_lock = threading.Lock()
        self.held: Slot | None = None
        self.delivered = 0
        self.finished = False
        self.closed = False
        self._close_lock = threading.Lock()
        self.thread = threading.Thread(
            target=produce,
            args=(
                source,
                store,
                device,
                self.free_q,
                self.ready_q,
                self.stop,
                self.write_lock,
                stats,
                POLL_S,
            ),
            name=f"pingpong-producer-{name}-{next(_epoch_ids)}",
            daemon=True,
        )
        _live_epochs.add(self)
        _register_exit_hook()
        stats.add(epochs=1)
        self.thread.start()

    # -- consumer side -------------------------------------------------------
    def next_batch(self) -> Batch:
        """Release the held slot, wait for the next delivery, return it as a Batch."""
        if self.finished:
            raise StopIteration
        try:
            if self.debug and self.held is not None:
                self._check_held("while the training loop held it")
            self._release_held()
            message = self._wait_for_message()
        except BaseException:
            # Timeout, Ctrl-C, dead producer: the producer may be stuck in the
            # source, so do not wait long for it (slots are safe regardless).
            self.close(join_timeout=ERROR_JOIN_TIMEOUT_S)
            raise
        if isinstance(message, Delivery):
            self.device.consumer_wait(message.ready_event)
            self.held = message.slot
            if self.debug:
                self.held_generation = message.generation
                self._check_held("between its hand-off and its delivery")
            self.delivered += 1
            self.stats.add(batches=1)
            return Batch(
                message.input_nodes, message.output_nodes, message.blocks, message.x, message.y
            )
        self.close()
        if isinstance(message, Failure):
            raise message.exc
        raise StopIteration

    def _check_held(self, when: str) -> None:
        slot = self.held
        if slot is not None and slot.generation != self.held_generation:
            self.held = None  # it is not ours any more: do not release it again
            self.close(join_timeout=ERROR_JOIN_TIMEOUT_S)
            raise SlotOverwriteError(
                f"slot {slot.index} was refilled {when} (generation "
                f"{self.held_generation} -> {slot.generation}, after {self.delivered} "
                "batches this epoch): the slot protocol is broken and batch data "
                "may be corrupt"
            )

    def _release_held(self) -> None:
        if self.held is not None:
            slot, self.held = self.held, None
            slot.release_event = self.device.consumer_record()
            self.free_q.put(slot)

    def _wait_for_message(self) -> Delivery | EndOfEpoch | Failure:
        start = time.perf_counter()
        deadline = None if self.timeout is None else start + self.timeout
        try:
            while True:
                wait = POLL_S
                if deadline is not None:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        raise BatchTimeoutError(
                            f"no batch within timeout={self.timeout} s (after "
                            f"{self.delivered} batches this epoch); the source may be "
                            "stalled -- raise `timeout`, or pass timeout=None to wait"
                        )
                    wait = min(wait, remaining)
                try:
                    return self.ready_q.get(timeout=wait)
                except queue.Empty:
                    pass
                if not self.thread.is_alive():
                    try:  # it may have queued its last message just before exiting
                        return self.ready_q.get_nowait()
                    except queue.Empty:
                        raise ProducerDiedError(
                            f"producer thread {self.thread.name} exited without "
                            "delivering a batch, an end of epoch or an error"
                        ) from None
        finally:
            self.stats.add(consumer_stall_s=time.perf_counter() - start)

    # -- shutdown ------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the producer to stop; never blocks (safe from finalisers)."""
        self.finished = True
        self.stop.set()

    def close(self, join_timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop the producer and take every slot back.  Idempotent.

        Blocks for at most one in-flight gather plus ``join_timeout`` seconds.
        """
        if threading.current_thread() is self.thread:
            self.request_stop()
            return  # a finaliser running on the producer thread itself
        with self._close_lock:  # two threads closing at once: the second waits
            if self.closed:
                return
            self.closed = True
            self._close(join_timeout)

    def _close(self, join_timeout: float) -> None:
        self.request_stop()
        with self.write_lock:
            pass  # a producer mid-write finishes; it re-checks `stop` before the next
        if self.held is not None:
            self.held.release_event = self.device.consumer_record()
            self.held = None
        self.join_producer(join_timeout)
        _drain(self.ready_q)
        _drain(self.free_q)

    def join_producer(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Wait up to ``timeout`` s for the (stopped) producer thread to exit.

        The loader calls this before it starts the next epoch even when this
        one was closed after a timeout or Ctrl-C with a short join: a producer
        still blocked inside the source would otherwise call ``next()`` on it
        concurrently with the new epoch's producer, and a source whose
        ``iter()`` resets one shared iterator (e.g. persistent workers) would
        hand it an item meant for the new epoch (torchdata #1482).
        """
        if threading.current_thread() is self.thread:
            return
        if _exiting:
            timeout = min(timeout, ERROR_JOIN_TIMEOUT_S)
        self.thread.join(timeout)
        if self.thread.is_alive():
            log = logger.warning if timeout >= JOIN_TIMEOUT_S else logger.debug
            log(
                "%s is still blocked inside the source after %.1f s; it will write "
                "nothing more and exits when the source returns",
                self.thread.name,
                timeout,
            )


def _drain(q: queue.SimpleQueue[Any]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


class EpochIterator(Iterator[Batch]):
    """What ``iter(loader)`` returns: one epoch of batches.

    Dropping it (``break`` out of a ``for`` loop) stops the producer; the loader
    finishes the shutdown when the next epoch starts or on ``close()``.
    """

    def __init__(self, epoch: Epoch) -> None:
        self._epoch = epoch

    def __next__(self) -> Batch:
        return self._epoch.next_batch()

    @property
    def batches_delivered(self) -> int:
        """How many batches this epoch has delivered so far."""
        return self._epoch.delivered

    def close(self) -> None:
        """End the epoch now: stop the producer and release the slots."""
        self._epoch.close()

    def __del__(self) -> None:
        epoch = getattr(self, "_epoch", None)
        if epoch is not None:
            epoch.request_stop()


def _register_exit_hook() -> None:
    """Register :func:`_stop_all_epochs` once, at the first epoch.

    Registered lazily so that it runs *before* the loaders' ``weakref.finalize``
    exit hook (``atexit`` runs hooks last-registered first), and those
    finalisers then see ``_exiting`` and do not wait long.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_stop_all_epochs)


def _stop_all_epochs() -> None:
    """At interpreter exit, stop every producer before daemon threads are frozen.

    A producer inside a gather finishes it and exits (0.5 s in all at most);
    one blocked inside the source is left behind: it writes nothing more.
    """
    global _exiting
    _exiting = True
    epochs = list(_live_epochs)
    for epoch in epochs:
        epoch.request_stop()
    deadline = time.monotonic() + 0.5
    for epoch in epochs:
        if epoch.thread.is_alive() and epoch.thread is not threading.current_thread():
            epoch.thread.join(max(0.0, deadline - time.monotonic()))
