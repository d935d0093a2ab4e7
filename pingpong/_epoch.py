"""One epoch: a producer thread, its queues, and the consumer's side of the slot protocol.

The states an epoch goes through are in :mod:`pingpong._epoch_states`, and
who moves it in :mod:`pingpong._lifecycle`.  The producer thread receives
only the queues, locks and flags it needs (:func:`pingpong._producer.produce`),
never the epoch, the iterator or the loader, so dropping them stops it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

from . import _rpc
from ._epoch_states import EpochState, describe_failure, ended_error
from ._exit_hook import register_epoch
from ._lifecycle import JOIN_TIMEOUT_S, POLL_S, SHORT_JOIN_TIMEOUT_S, join_timeout
from ._producer import Delivery, Failure, Message, TrackedCheck, produce
from ._threads import Latch, OpenEndedCalls, ThreadExit, is_current, run_marking_exit
from .batch import LeasedBatch
from .cache import FeatureCache
from .devices.base import Device
from .errors import (
    BatchExpiredError,
    BatchTimeoutError,
    ConfigError,
    ProducerDiedError,
    SlotOverwriteError,
    StrayStopIterationError,
)
from .forms import ItemReader
from .slots import Lease, Slot
from .stats import LoaderStats
from .store import FeatureStore

if TYPE_CHECKING:
    from .loader import PingPongLoader

logger = logging.getLogger(__name__)

_epoch_ids = itertools.count()


class _Wakeup:
    """Put on the ready queue by :meth:`Epoch.end` so that a waiting ``next()`` returns."""


_WAKEUP = _Wakeup()

#: :meth:`Epoch._deliver`'s answer when the epoch ended before the batch was returned.
_ENDED_WHILE_DELIVERING = object()


def _stop_iteration_error() -> StrayStopIterationError:
    """What the training loop gets, caused by it, for a ``StopIteration`` raised
    by code pingpong ran for it (the source's ``iter()``, a ``form=``, a row
    source, a health check):
    raised out of ``next()`` as it is, it would end the loop's ``for`` as if the
    epoch were over -- the rule PEP 479 set for generators."""
    return StrayStopIterationError(
        "StopIteration raised inside pingpong's pipeline (the source's iter(), a form=, "
        "a row source or a health check; see the cause above): not the end of the "
        "epoch, which would have ended the training loop early"
    )


class Epoch:
    """One pass over the source; see :mod:`pingpong._epoch_states` for its states.

    Invariants: once :meth:`retire` returned, the producer writes no slot
    again (it may still be blocked inside the source, and exits when that
    returns).  The slot of the batch the training loop holds (``lease``) is
    handed back only by the next ``next()`` or, after the epoch ended, by the
    loader when its next epoch starts (:meth:`hand_back_lease`).
    """

    def __init__(
        self,
        source: Iterable[Any],
        store: FeatureStore,
        reader: ItemReader,
        device: Device,
        slots: list[Slot],
        stats: LoaderStats,
        timeout: float | None,
        name: str,
        *,
        debug: bool = False,
        cache: FeatureCache | None = None,
        health: Callable[[], None] | None = None,
        rpc_lock: threading.Lock | None = None,
        sample_ahead: bool = False,
        producer_cpus: frozenset[int] | None = None,
        sampler_threads: int | None = None,
        producer_nice: int = 0,
    ) -> None:
        self.device = device
        #: the loader's health check while the epoch runs; None once it ended
        #: (the loader's core holds the last epoch, and must reach nothing of
        #: the user's: see :class:`~pingpong._lifecycle.LoaderCore`)
        self.health = health
        #: the same check as the producer calls it, released when the epoch ends
        self._producer_check = None if health is None else TrackedCheck(health)
        self.takes_rpc_turns = rpc_lock is not None
        self.debug = debug
        self.stats = stats
        self.timeout = timeout
        self.state = EpochState.RUNNING
        self.failure: str | None = None  # what ended a FAILED epoch (describe_failure)
        self.delivered = 0
        self.lease: Lease | None = None
        self.held_generation = 0
        self._lock = threading.Lock()  # state, lease, delivered
        self._lease_lock = threading.Lock()  # one lease hand-back at a time (_end_lease)
        self.free_q: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for slot in slots:
            self.free_q.put(slot)
        # SimpleQueue, not Queue: its get() is one C-level lock wait, so Ctrl-C in
        # next() raises a clean KeyboardInterrupt.  Queue.get() runs Python-level
        # Condition code that a KeyboardInterrupt can leave half done.  Measured
        # (benchmarks/sigint_queue.py and an earlier copy of it; five runs of
        # ~12,000 interrupts each): Queue ended two gets in "RuntimeError: release
        # unlocked lock" and hung once; SimpleQueue always raised KeyboardInterrupt.
        self.ready_q: queue.SimpleQueue[Message | _Wakeup] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.write_lock = threading.Lock()
        # Set once the producer has called iter(source) (or left without); a
        # Latch, not an Event, for a clean Ctrl-C in the wait (see Latch).
        self._source_started = Latch()
        #: set by the producer as its thread's last step (not Thread.join: see Latch)
        self.producer_exited = Latch()
        #: ended epochs' producers that may still be inside the source, which this
        #: epoch's producer lets leave before iter(source) (:meth:`start_after`)
        self._after: list[ThreadExit] = []
        #: whether the producer is inside the source or a row source's fetch (calls
        #: that may block without bound): the exit hook waits longer for one outside
        self.open_calls = OpenEndedCalls()
        self.thread = threading.Thread(
            target=run_marking_exit,
            args=(self.producer_exited, produce),
            kwargs={
                "source": source,
                "store": store,
                "reader": reader,
                "device": device,
                "free_q": self.free_q,
                "ready_q": self.ready_q,
                "stop": self.stop,
                "write_lock": self.write_lock,
                "stats": stats,
                "poll_s": POLL_S,
                "cache": cache,
                "health": self._producer_check,
                "rpc_lock": rpc_lock,
                "sample_ahead": sample_ahead,
                "cpus": producer_cpus,
                "source_started": self._source_started,
                "sampler_threads": sampler_threads,
                "producer_nice": producer_nice,
                "after": self._after,
                "open_calls": self.open_calls,
            },
            name=f"pingpong-producer-{name}-{next(_epoch_ids)}",
            daemon=True,
        )

    def start_after(self, earlier: Iterable[ThreadExit]) -> None:
        """Before :meth:`start`: this epoch's producer calls ``iter(source)`` only
        once each of the ``earlier`` producers still pending has left -- ended
        epochs' producers that may be inside a source whose ``iter()`` ends or
        resets the iterator they are in (pass :meth:`producers_to_outlast` of
        the last epoch over the source).  ``iter(loader)`` waits for that as for
        ``iter(source)``: with ``timeout=``, ``close()``, health checks, Ctrl-C."""
        for mark in earlier:
            if mark.pending() and mark not in self._after:
                self._after.append(mark)

    def producers_to_outlast(self) -> tuple[ThreadExit, ...]:
        """What a later pass over the same source must let leave first: this
        epoch's producer and the earlier ones it waits for (which it may stop
        waiting for, ended, before they have left)."""
        return (*self._after, ThreadExit.of(self.thread, self.producer_exited))

    def start(self) -> None:
        """Start the producer thread; once, after the loader holds this epoch.

        Two steps, so that a Ctrl-C that lands once the thread runs finds the
        epoch held by its loader (``close()``, the next ``iter()`` and
        interpreter exit stop it) -- never an orphan producer refilling the
        loader's slots under later epochs.
        """
        register_epoch(self)
        self.stats.add(epochs=1)
        try:
            self.thread.start()
        except BaseException as exc:
            # Ctrl-C inside Thread.start(), which waits in Python code for the new
            # thread: it may be running already.
            self.end(EpochState.FAILED, describe_failure(exc))
            self.retire(SHORT_JOIN_TIMEOUT_S)  # returns at once for a thread not started
            raise

    # -- consumer side -------------------------------------------------------
    def wait_for_source_start(self) -> None:
        """``iter(loader)``: return once the producer has called ``iter(source)``.

        So each ``iter(loader)`` starts one pass of the source before it
        returns, as the plain loop does, however soon the epoch is superseded
        or closed.  What ``iter(source)`` raised is raised by the first
        ``next()``.  Returns early if the epoch is ended from another thread
        (``close()``) or the producer thread is gone; raises
        :class:`~pingpong.errors.BatchTimeoutError` after the loader's
        ``timeout`` and what ``health_check`` raises, ending the epoch as a
        failing ``next()`` does.  Skipped (returns at once) on a thread that
        has the turn in DGL's RPC client, which the producer needs to start
        the source.
        """
        if self.takes_rpc_turns and _rpc.has_turn():
            return
        start = time.perf_counter()
        said = not self._after  # whether a long wait for an earlier producer was logged
        try:
            for wait in self._polls(start, self._what_the_source_start_waits_for):
                if self._source_started.wait(wait):
                    return
                if self.state is not EpochState.RUNNING or not self.producer_alive():
                    return  # next() says why
                health = self.health  # end() on another thread may drop it
                if health is not None:
                    health()
                if not said and time.perf_counter() - start > JOIN_TIMEOUT_S:
                    said = True
                    self._say_who_is_waited_for()
        except BaseException as exc:  # noqa: BLE001 - re-raised by _fail_and_raise
            self._fail_and_raise(SHORT_JOIN_TIMEOUT_S, exc)
        finally:
            self.stats.add(consumer_stall_s=time.perf_counter() - start)

    def _earlier_producers_inside(self) -> list[str]:
        """The names of the earlier producers this epoch's pass still waits for."""
        return [thread.name for mark in self._after if mark.pending()
                if (thread := mark.thread()) is not None]

    def _say_who_is_waited_for(self) -> None:
        """Log (a warning, once per epoch) the earlier producers still inside the
        source that this epoch's pass waits for -- without a ``timeout`` the wait
        has no end of its own."""
        inside = self._earlier_producers_inside()
        if inside:
            logger.warning(
                "iter() has waited %.1f s for %s, an ended epoch's producer still inside "
                "the source, to leave it: the source's iter() would end or reset the "
                "iterator it is in; the new pass starts once it returns", JOIN_TIMEOUT_S,
                ", ".join(inside))

    def _what_the_source_start_waits_for(self) -> str:
        """What :meth:`wait_for_source_start`'s timeout says did not happen: the
        earlier producers still inside the source, by name, if any."""
        inside = self._earlier_producers_inside()
        what = "the source's iter() did not return"
        if inside:
            return what + (f" (or has not started: the last epoch's producer over this "
                           f"source, {', '.join(inside)}, which must leave it before a new "
                           "pass starts, is still inside it)")
        if self.takes_rpc_turns:
            return what + (" (or has not started: its producer first needs the turn in "
                           "DGL's RPC client, which another thread may hold)")
        return what

    def next_batch(self) -> Any:
        """Hand back the held slot, wait for the next delivery, return it as a Batch."""
        self._raise_if_ended()
        if self.takes_rpc_turns:
            _rpc.refuse_inside_turn()
        try:
            if self.debug:
                self._check_held("while the training loop held it")
            self._hand_back_held()
            message = self._wait_for_message()
            # Off the queue now: until the batch is returned, whatever is raised
            # here (a Ctrl-C) fails the epoch -- it never goes on a batch short.
            with self._lock:
                running = self.state is EpochState.RUNNING
                if running and isinstance(message, Delivery):
                    lease = self.lease = Lease(message.slot, self.device, message.ready_event)
            if running and isinstance(message, Delivery):
                batch = self._deliver(message, lease)
                if batch is not _ENDED_WHILE_DELIVERING:
                    return batch
                running = False
        except BaseException as exc:  # noqa: BLE001 - re-raised by _fail_and_raise
            # Timeout, Ctrl-C, dead producer: the producer may be stuck in the
            # source, so do not wait long for it (slots are safe regardless).
            self._fail_and_raise(SHORT_JOIN_TIMEOUT_S, exc)
        if not running:
            # Ended from another thread while we waited or delivered.  A delivery
            # taken here is dropped: its slot was never given to the training
            # loop, and the next epoch starts with every slot free.
            raise ended_error(self.state, self.delivered, self.failure)
        if isinstance(message, Failure):
            self._fail_and_raise(join_timeout(), message.exc)
        self.end(EpochState.EXHAUSTED)
        self.retire(join_timeout())
        # Before the loop's `for` ends: a write to a table after it must reach no
        # batch of this epoch, and a GPU gather may not have run yet.
        self.device.wait_for_fills()
        raise StopIteration

    def _deliver(self, message: Delivery, lease: Lease) -> Any:
        """The batch of ``message``, held by ``lease`` (the epoch's now) -- or
        ``_ENDED_WHILE_DELIVERING`` when the epoch ended meanwhile: an ``iter()``
        on another thread then handed the lease back, and the new epoch's producer
        may refill the slot before this batch could be used."""
        try:
            lease.use_on(None)  # the stream current now waits for the batch
        except BatchExpiredError:
            if self.state is not EpochState.RUNNING:
                return _ENDED_WHILE_DELIVERING
            raise
        if self.debug:
            self.held_generation = message.generation
            self._check_held("between its hand-off and its delivery")
        batch = message.batch
        if isinstance(batch, LeasedBatch):
            batch._lease = lease
        self.stats.add(batches=1)  # not under the lock: it allocates (see _end_lease)
        with self._lock:
            if self.state is EpochState.RUNNING:
                self.delivered += 1  # last: the count is what the loop got
                return batch
        self.stats.add(batches=-1)
        return _ENDED_WHILE_DELIVERING

    def _raise_if_ended(self) -> None:
        state = self.state
        if state is not EpochState.RUNNING:
            raise ended_error(state, self.delivered, self.failure)

    def _fail_and_raise(self, join_s: float, exc: BaseException) -> NoReturn:
        """:meth:`_fail` because of ``exc``, then raise it -- a ``StopIteration``
        (from the source's side, or a health check) as the
        :class:`StrayStopIterationError` it causes, which the epoch records."""
        if isinstance(exc, StopIteration):
            error = _stop_iteration_error()
            self._fail(join_s, error)
            raise error from exc
        self._fail(join_s, exc)
        raise exc

    def _fail(self, join_s: float, exc: BaseException) -> None:
        """End the epoch in FAILED because of ``exc`` (unless it has ended
        already) and retire it."""
        self.stop.set()  # first: a Ctrl-C in describe_failure leaves no producer going
        self.end(EpochState.FAILED, describe_failure(exc))
        self.retire(join_s)

    def _check_held(self, when: str) -> None:
        lease = self.lease
        if lease is not None and lease.slot.generation != self.held_generation:
            self.lease = None  # it is not ours any more: do not hand it back again
            error = SlotOverwriteError(
                f"slot {lease.slot.index} was refilled {when} (generation "
                f"{self.held_generation} -> {lease.slot.generation}, after "
                f"{self.delivered} batches this epoch): the slot protocol is broken "
                "and batch data may be corrupt"
            )
            self._fail(SHORT_JOIN_TIMEOUT_S, error)
            raise error

    def _hand_back_held(self) -> None:
        """``next()``: the held slot goes back to this epoch's producer."""
        slot = self._end_lease()
        if slot is not None:
            self.free_q.put(slot)

    def hand_back_lease(self) -> None:
        """After the epoch ended and retired: record the held slot's release events.

        Called by the loader when its next epoch starts; from then on the
        slot may be refilled, so the batch the training loop kept is invalid.
        """
        self._end_lease()

    def _end_lease(self) -> Slot | None:
        """End the held lease, if any, and give its slot the release events; the slot.

        One step under the epoch's lease lock: a ``next()`` on one thread ending
        the lease while ``iter()`` on another starts the next epoch, whose
        producer may take that slot at once, must have set the events before
        that ``iter()`` goes on (it waited in :meth:`hand_back_lease` for the lock).
        """
        with self._lease_lock:
            with self._lock:
                lease = self.lease
            if lease is None:
                return None
            # Not under self._lock: recording allocates, the garbage collector may
            # run there, and a finaliser it runs (a dropped EpochIterator's) ends
            # this epoch, which takes self._lock.  The lease stays recorded until
            # its slot has the events (Lease.end gives them): a Ctrl-C or a device
            # error anywhere before leaves it to the next hand-back.
            events = lease.end()
            with self._lock:
                if self.lease is lease:
                    self.lease = None
            # None: an earlier call ended it and was interrupted before it could
            # clear it -- its slot has its events, and is not handed back twice.
            return None if events is None else lease.slot

    def _polls(self, start: float, what: str | Callable[[], str],
               when: str = "", why: Callable[[], str] | None = None) -> Iterator[float]:
        """How long each poll of a wait that began at ``start`` may block: at most
        ``POLL_S``, endless without a timeout; at the loader's ``timeout``
        :class:`~pingpong.errors.BatchTimeoutError` saying ``what`` did not
        happen ``when``, and ``why()`` (default: the source may be stalled).
        There is always one poll, if only a look (0 s): a timeout shorter than
        the time it takes to get here still finds a batch that is ready."""
        deadline = None if self.timeout is None else start + self.timeout
        polled = False
        while True:
            if deadline is None:
                yield POLL_S
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0 and polled:
                reason = ("the source (or a row source's fetch) may be stalled"
                          if why is None else why())
                raise BatchTimeoutError(
                    f"{what() if callable(what) else what} within timeout={self.timeout} "
                    f"s{when}; {reason} -- raise `timeout`, or pass timeout=None to wait")
            polled = True
            yield min(POLL_S, max(remaining, 0.0))

    def _where_the_producer_is(self) -> str:
        """Why a batch may be late, by where the producer is now (``open_calls``)."""
        if self.open_calls.now():
            return ("the producer is inside the source (or a row source's fetch), which "
                    "may be stalled")
        return ("the producer is in a step of its own, not inside the source or a row "
                "source's fetch: a form= callable, the health check, moving graphs to the "
                "device, the gather or a wait for DGL's RPC turn may be slow")

    def _wait_for_message(self) -> Message | _Wakeup:
        start = time.perf_counter()
        ending_since: float | None = None
        try:
            for wait in self._polls(start, "no batch", f" (after {self.delivered} batches "
                                    "this epoch)", self._where_the_producer_is):
                try:
                    return self.ready_q.get(timeout=wait)
                except queue.Empty:
                    pass
                health = self.health  # end() on another thread may drop it
                if health is not None:
                    health()  # a fetch in flight to a dead server never returns
                if not self.producer_alive():
                    try:  # it may have queued its last message just before exiting
                        return self.ready_q.get_nowait()
                    except queue.Empty:
                        if self.state is not EpochState.RUNNING:
                            return _WAKEUP  # ended (close() from another thread): next() says so
                        if self.stop.is_set() and ending_since is None:
                            # Being ended on another thread (end() sets stop, then the
                            # state, then wakes us): its wakeup comes next.
                            ending_since = time.perf_counter()
                        if ending_since is not None and \
                                time.perf_counter() - ending_since < JOIN_TIMEOUT_S:
                            continue
                        raise ProducerDiedError(
                            f"producer thread {self.thread.name} exited without "
                            "delivering a batch, an end of epoch or an error"
                        ) from None
            raise AssertionError("unreachable: _polls never ends without raising")
        finally:
            self.stats.add(consumer_stall_s=time.perf_counter() - start)

    # -- ending --------------------------------------------------------------
    def end(self, state: EpochState, failure: str | None = None) -> bool:
        """Move a RUNNING epoch to ``state``; never blocks, any thread.

        ``failure`` says what ended a FAILED epoch (``next()`` names it).

        Sets the producer's stop flag and wakes a ``next()`` waiting on
        another thread.  Returns False if the epoch had already ended (the
        first reason wins).  The stop flag comes first, and again for an epoch
        already ended: a Ctrl-C that lands in here never leaves an ended epoch
        whose producer goes on.
        """
        if not self.stop.is_set():
            self.stop.set()
        with self._lock:
            if self.state is not EpochState.RUNNING:
                return False
            self.failure = failure
            self.state = state
        self.health = None
        if self._producer_check is not None:
            self._producer_check.release()
        self.ready_q.put(_WAKEUP)
        return True

    def producer_alive(self) -> bool:
        """The producer thread started and has not left yet (by its own mark)."""
        return self.thread.is_alive() and not self.producer_exited.is_set()

    def retire(self, join_s: float) -> None:
        """Wait until the ended epoch's producer writes nothing more; join it.

        Blocks for the slot fill in flight, if any (not bounded: a device that
        hangs inside it hangs this too), plus at most ``join_s`` seconds.
        Idempotent.  On the producer thread itself (a finaliser run by the
        garbage collector there) it does nothing: that thread is about to
        see ``stop`` and leave; nor for a producer that never started.  Nor
        does it wait for the write lock once the producer has exited: in a
        process forked while the producer filled a slot, the lock stays held
        by a thread that does not exist there.
        """
        if is_current(self.thread) or self.thread.ident is None:
            return  # the producer's own finaliser, or a thread that never started
        if not self.stop.is_set():
            self.stop.set()  # ended by end(), unless a Ctrl-C landed inside it
        if not self.thread.is_alive():
            return
        if not self.producer_exited.is_set():
            with self.write_lock:
                pass  # a fill in flight finishes; the producer re-checks `stop` before the next
            if not self.producer_exited.wait(join_s):
                log = logger.warning if join_s >= join_timeout() else logger.debug
                if self.open_calls.now():
                    log("%s is still blocked inside the source after %.1f s; it will "
                        "write nothing more and exits when the source returns",
                        self.thread.name, join_s)
                else:  # its own steps, or the source iterator's clean-up at its exit
                    log("%s is still running after %.1f s, not inside the source or a "
                        "fetch (a form= callable, the health check, moving graphs to the "
                        "device, or the source iterator's clean-up); it will write nothing "
                        "more and exits when that returns", self.thread.name, join_s)
                return
        # Past its mark, the thread still tears down: Thread.run drops the source,
        # device and queues it was given (their last references, maybe), then its
        # thread state.  Joined all the same, whether it marked its exit before this
        # call or during it: a process that exits right after (a DDP rank after its
        # last epoch) would otherwise finalise under it, and a producer that takes
        # the GIL back inside C++ then is ended there -- the process aborts
        # ("terminate called without an active exception").  A niced producer on a
        # busy machine can take long to get the CPU back for it.  A join that a
        # Ctrl-C interrupts here marks nothing wrong.
        self.thread.join(join_s)


class EpochIterator(Iterator[Any]):
    """What ``iter(loader)`` returns: one epoch of batches.

    It keeps its loader alive, so ``for batch in PingPongLoader(...)`` works.
    Dropping it ends the epoch (the producer stops at once); the loader
    finishes the shutdown when the next epoch starts or when it is closed.
    Like a generator, it runs one ``next()`` at a time: a ``next()`` on another
    thread while one runs is refused (:class:`ConfigError`).
    """

    def __init__(self, loader: PingPongLoader, epoch: Epoch) -> None:
        self._loader = loader
        self._epoch = epoch
        self._next_lock = threading.Lock()
        #: the thread inside __next__, if any
        self._next_on: int | None = None

    def __next__(self) -> Any:
        me = threading.get_ident()
        with self._next_lock:
            if self._next_on not in (None, me):
                # Each next() hands back the batch before it, which the other
                # thread holds: its slot could be refilled under it, and the
                # lease one of the two calls takes would be lost with its slot.
                raise ConfigError(
                    "next() on this epoch's iterator is already running on another "
                    "thread; an iterator runs one next() at a time, as a generator "
                    "does (each next() hands back the batch before it). Give each "
                    "thread its own loader, or pass batches on from one thread "
                    "(clone() one to keep it past the next next())")
            self._next_on = me
        try:
            return self._epoch.next_batch()
        finally:
            self._next_on = None

    @property
    def batches_delivered(self) -> int:
        """How many batches this epoch has delivered so far."""
        return self._epoch.delivered

    @property
    def state(self) -> EpochState:
        """Where this epoch is (see :mod:`pingpong._epoch_states`)."""
        return self._epoch.state

    def close(self) -> None:
        """End the epoch now and wait for its producer and for the gathers of the
        batches it delivered (a write to a table then reaches none of them);
        ``next()`` then stops."""
        if self._epoch.end(EpochState.CLOSED):
            self._epoch.retire(join_timeout())
            self._epoch.device.wait_for_fills()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Refuse ``copy.copy``, ``copy.deepcopy`` and ``pickle`` (:class:`ConfigError`,
        a ``TypeError``): a copy would share this epoch, and dropping it would end
        the epoch under the original, which would then stop early without a word."""
        raise ConfigError(
            "an epoch's iterator cannot be copied or pickled: a copy would share its "
            "producer and slots, and end the epoch when dropped. Keep using the one "
            "iterator (batch.clone() keeps a batch), or call iter(loader) for a new epoch"
        )

    def __del__(self) -> None:
        epoch = getattr(self, "_epoch", None)
        if epoch is not None:
            epoch.end(EpochState.CLOSED)
