"""The lifecycle of a loader: the one epoch it runs at a time, and closing it.

An epoch's states and what ``next()`` raises once one ended are in
:mod:`pingpong._epoch_states`; the process-wide part (the exit hook, closer
threads) is in :mod:`pingpong._exit_hook`; which epoch iterates a source that
runs one pass at a time is in :mod:`pingpong._source_claims`.

Ending (``Epoch.end``) never blocks and is safe on any thread, finalisers
included: it sets the state and the producer's stop flag and wakes a
``next()`` waiting on another thread.  *Retiring* (``Epoch.retire``) blocks:
it waits until no slot write is in flight, then joins the producer for at
most a join timeout (:func:`join_timeout`).  After that no slot is written
again; the batch the training loop holds stays intact until a new epoch of
the same loader starts, which is when its slot is handed back.

A loader is OPEN (at most one RUNNING epoch) or CLOSED (final).  Its entry
points, all in :class:`LoaderCore`:

====================  =========================================================
``iter(loader)``      retire the previous epoch (SUPERSEDED), hand its held slot
                      back, start a new epoch; return once its producer called
                      ``iter(source)`` (``Epoch.wait_for_source_start``)
``close()``           end + retire the epoch (LOADER_CLOSED), close the device
loader finaliser      the same as ``close()``; it runs only once no iterator is
                      left, because every iterator keeps its loader alive
iterator ``close()``  end + retire its epoch (CLOSED)
iterator garbage      end its epoch (CLOSED); the loader retires it later
interpreter exit      :func:`pingpong._exit_hook._end_all_epochs`: end every
                      epoch; wait (at most 10 s) for a producer still inside
                      DGL's RPC client to leave it; then short joins of every
                      producer thread (retired epochs' included) and closer
                      thread, and up to 5 s more for a producer still in its
                      own steps (not inside the source or a row source's fetch)
====================  =========================================================

Whatever would block, or close the device, and is asked for on a pingpong
thread (a finaliser the garbage collector runs on a producer thread) is
handed to a short-lived ``pingpong-closer-*`` thread instead: no thread
waits for itself, and no device is closed under its own producer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._epoch_states import EpochState
from ._exit_hook import process_exiting, run_off_pingpong_threads
from ._source_claims import start_claiming
from .errors import LoaderClosedError

if TYPE_CHECKING:
    from ._epoch import Epoch
    from .devices.base import Device

#: How often blocked waits wake up to check stop flags and thread liveness.
POLL_S = 0.05
#: How long retiring an epoch waits for its producer thread to exit.
JOIN_TIMEOUT_S = 2.0
#: The same after a failure in ``next()`` (timeout, Ctrl-C: the producer is
#: likely stuck inside the source) and at interpreter exit.
SHORT_JOIN_TIMEOUT_S = 0.1


def join_timeout(after_failure: bool = False) -> float:
    """How long retiring an epoch may wait for its producer."""
    if after_failure or process_exiting():
        return SHORT_JOIN_TIMEOUT_S
    return JOIN_TIMEOUT_S


def _inside_on_this_thread(mark: int | None, lock: threading.Lock) -> bool:
    """Whether this thread is inside the section that ``lock`` guards and ``mark``
    names the thread of -- so a signal handler interrupted it there.  A mark
    that a Ctrl-C at the line clearing it left behind is stale: the ``with``
    released the lock all the same."""
    return mark == threading.get_ident() and lock.locked()


class LoaderCore:
    """What a loader, its iterators and its finaliser share: the one running epoch.

    The core owns ``device`` and closes it once, after the last epoch was
    retired.  Thread-safe.

    The loader's finaliser holds the core for as long as the loader lives, so
    the core holds nothing of the user's (the source, a ``form=`` callable, the
    health check): a loader reachable from one of those (a trainer that keeps
    ``self.loader`` and passes ``health_check=self.check``) would never be
    freed.  They come with each :meth:`start_epoch`; an epoch keeps them in its
    producer thread's arguments, which the thread drops when it ends, and its
    health check until it ends (:meth:`~pingpong._epoch.Epoch.end`).
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.epoch: Epoch | None = None
        self.closed = False
        #: the last epoch retired and the device closed (``closed`` comes first)
        self.fully_closed = False
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()  # one closer at a time
        # The thread inside start_epoch's hold of _lock, and inside _close's hold
        # of _close_lock (idents): a close() a signal handler runs there must not
        # wait for a lock its own thread holds (see close()).
        self._starting_on: int | None = None
        self._closing_on: int | None = None

    def start_epoch(self, make_epoch: Callable[[], Epoch],
                    shared_iterator_source: object | None = None) -> Epoch:
        """``iter(loader)``: supersede the running epoch, start the one
        ``make_epoch`` builds (the core holds it before it starts it: see
        :meth:`~pingpong._epoch.Epoch.start`).

        ``shared_iterator_source``: the source, if its ``iter()`` ends or resets
        an iterator already open (persistent DataLoader workers, datapipes): one
        loader's epoch at a time, and no new pass while an ended epoch's
        producer is inside it.

        Raises :class:`LoaderClosedError` on a closed loader -- also when a signal
        handler closed it while this ran (it then finishes that close)."""
        try:
            with self._lock:
                try:  # set inside: a Ctrl-C before the try leaves no stale mark
                    self._starting_on = threading.get_ident()
                    epoch = self._start_epoch(make_epoch, shared_iterator_source)
                finally:
                    self._starting_on = None
        finally:
            # Closed while this ran -- by a signal handler on this thread (see
            # close()), then returning or raising -- or a close left unfinished:
            # finish it, whatever this call ends with.
            if self.closed and not self.fully_closed:
                self.close()
        if self.closed:
            raise LoaderClosedError("this PingPongLoader was closed while iter() started "
                                    "an epoch")
        assert epoch is not None
        return epoch

    def _start_epoch(self, make_epoch: Callable[[], Epoch],
                     shared_iterator_source: object | None) -> Epoch | None:
        """:meth:`start_epoch` holding the lock; None if closed during the retire."""
        if self.closed:
            raise LoaderClosedError("this PingPongLoader is closed")
        # The previous epoch stays recorded until it is retired: a Ctrl-C
        # anywhere in here leaves it to the next iter() or close() (each
        # step below is idempotent), never a running epoch nobody holds.
        previous = self.epoch
        if previous is not None:
            previous.end(EpochState.SUPERSEDED)
            # The full join, even after a failure: a producer still inside the
            # source exits when it returns, without another step.
            previous.retire(JOIN_TIMEOUT_S)
            previous.hand_back_lease()
        self.epoch = None
        if self.closed:
            return None
        epoch = self.epoch = make_epoch()
        if previous is not None and shared_iterator_source is not None:
            # Its iter() would end or reset the iterator that producer (or one it
            # waited for) may be in (torchdata #1482): the new pass starts once
            # they have left.
            epoch.start_after(previous.producers_to_outlast())
        try:
            # held first: a Ctrl-C from here on leaves no orphan producer
            start_claiming(shared_iterator_source, epoch)
        except BaseException:
            if epoch.thread.ident is None:
                self.epoch = None  # never started: nothing to retire
            raise
        return epoch

    def close(self) -> None:
        """``loader.close()`` and the loader's finaliser; idempotent, any thread.

        From a signal handler (a SIGTERM handler) that interrupted this loader's
        ``iter()`` or ``close()`` on its own thread -- which hold locks the close
        needs -- it marks the loader closed and returns; the interrupted call
        finishes the close when it resumes (``iter()`` then raises
        :class:`LoaderClosedError`).
        """
        if _inside_on_this_thread(self._closing_on, self._close_lock):
            return  # this thread's close() was interrupted: it finishes
        if _inside_on_this_thread(self._starting_on, self._lock):
            self.closed = True  # this thread's iter() was interrupted: it finishes
            return
        run_off_pingpong_threads(self._close)

    def _close(self) -> None:
        """Refuse new epochs, retire the running one, close the device.  A Ctrl-C in
        the retire's join leaves the epoch in place (ended) and the device open: the
        next call retires it and closes the device, never under a live producer."""
        with self._close_lock:
            try:  # set inside: a Ctrl-C before the try leaves no stale mark
                self._closing_on = threading.get_ident()
                self._close_holding_the_close_lock()
            finally:
                self._closing_on = None

    def _close_holding_the_close_lock(self) -> None:
        with self._lock:
            if self.fully_closed:
                return
            self.closed = True
            epoch = self.epoch
        if epoch is not None:
            epoch.end(EpochState.LOADER_CLOSED)
            epoch.retire(join_timeout())
        with self._lock:
            self.epoch = None
        self.device.close()  # idempotent: a Ctrl-C before the mark below repeats it
        with self._lock:
            self.fully_closed = True
