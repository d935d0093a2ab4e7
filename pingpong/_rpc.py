"""A process-wide lock for producers whose sources share a client that is not thread-safe.

DGL's distributed RPC client (``dgl.distributed``) is one per process and not
thread-safe: two threads inside it at once receive each other's replies
(``KeyError`` in ``dgl.distributed.rpc.recv_responses``). In a DistDGL client
process (one with a DGL RPC client: after ``dgl.distributed.initialize``,
not in standalone mode; :func:`lock_for_process`) every loader hands
:data:`RPC_LOCK` to its producers, which hold it while they step
the source (distributed sampling) and fetch rows from row sources (pulls). So
the producers of several loaders take turns: an epoch left early whose producer
is still inside a DGL call and the next loader's, or two loaders in one
``zip``. The training thread's own DGL calls take their turn through
:func:`rpc_turn` (public as ``pingpong.rpc_turn``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .errors import RpcTurnError

#: The lock of DGL's RPC client (see the module docstring); None turns it off. Set it,
#: if at all, once, before any loader starts: threads holding an old lock are not seen.
RPC_LOCK: threading.Lock | None = threading.Lock()

#: The thread that holds :data:`RPC_LOCK` -- inside :func:`rpc_turn`, or a producer
#: inside its step (:func:`holding`) -- if any (its ident). Written only by that thread.
_turn_holder: int | None = None


@contextlib.contextmanager
def rpc_turn() -> Iterator[None]:
    """Take a turn in DGL's RPC client for the block, between pingpong's producers.

    DGL's RPC client (one per process) is not thread-safe, and while a loader's
    epoch runs its producer thread is in it, sampling and pulling rows. Wrap your own
    DGL calls on another thread -- ``DistTensor`` pulls, sampling on the
    ``DistGraph``, ``g.barrier()`` -- in this to make them mid-epoch::

        for batch in loader:
            with pingpong.rpc_turn():
                extra = g.ndata["extra"][batch.output_nodes]
            ...

    The block waits until the producer that holds the client finishes its current
    step (one source step, or one batch's pulls), and producers wait for the block.
    Inside it, do not ask a DistDGL loader for a batch (``next()`` raises
    :class:`~pingpong.RpcTurnError`: its producer could never take its turn) and
    do not wait for anything that waits for a producer. A thread that already has
    the turn -- an enclosing ``rpc_turn()``, or a producer running your source or
    row source -- keeps it: the inner block takes nothing. Costs a lock in a
    process without a DGL RPC client; does nothing if ``pingpong._rpc.RPC_LOCK``
    was set to None.
    """
    global _turn_holder
    lock = RPC_LOCK
    me = threading.get_ident()
    if lock is None or _turn_holder == me:
        yield
        return
    with lock:
        try:
            _turn_holder = me
            yield
        finally:
            _turn_holder = None


def has_turn() -> bool:
    """True on the thread that has the turn in DGL's RPC client."""
    return _turn_holder == threading.get_ident()


def refuse_inside_turn() -> None:
    """Raise :class:`~pingpong.RpcTurnError` if this thread has the turn -- inside
    :func:`rpc_turn`, or a producer inside its step (called by ``next()`` of a loader
    whose producers take turns)."""
    if has_turn():
        raise RpcTurnError(
            "next() on a DistDGL loader by a thread that has the turn in DGL's RPC client "
            "(inside pingpong.rpc_turn(), or a pingpong producer): the loader's producer "
            "needs that turn to prepare the batch and would wait for ever; ask for the "
            "batch outside the `with pingpong.rpc_turn():` block")


@contextlib.contextmanager
def holding(lock: threading.Lock | None, stop: threading.Event,
            poll_s: float) -> Iterator[bool]:
    """Hold ``lock`` (if any) for the block; yields False, holding nothing, when
    ``stop`` was set while waiting for it. Holding :data:`RPC_LOCK`, the thread has
    the turn (an :func:`rpc_turn` inside the block takes nothing)."""
    if lock is None:
        yield True
        return
    if not acquire(lock, stop, poll_s):
        yield False
        return
    with _taken(lock):
        yield True


@contextlib.contextmanager
def turn_within(timeout: float) -> Iterator[bool]:
    """Take the turn in DGL's RPC client (in a process with one:
    :func:`lock_for_process`) for the block, waiting at most ``timeout`` s; yields
    False, holding nothing, if a producer kept it that long (stuck in a DGL call).
    True at once without a client, or on a thread that has the turn already."""
    lock = lock_for_process()
    if lock is None or has_turn():
        yield True
        return
    if not lock.acquire(timeout=timeout):
        yield False
        return
    with _taken(lock):
        yield True


@contextlib.contextmanager
def _taken(lock: threading.Lock) -> Iterator[None]:
    """For the block, ``lock`` -- just acquired -- is this thread's (the turn, if it
    is :data:`RPC_LOCK`); released at the end."""
    global _turn_holder
    turn = lock is RPC_LOCK
    try:
        if turn:
            _turn_holder = threading.get_ident()
        yield
    finally:
        if turn:
            _turn_holder = None
        lock.release()


def wait_until_no_turn(timeout: float) -> bool:
    """Wait until no other thread has the turn (take it, give it back: a producer that
    gets it next sees its epoch ended and leaves); False if one still had it after
    ``timeout`` s. Returns at once when there is no lock or this thread has the turn."""
    lock = RPC_LOCK
    if lock is None or not lock.locked() or _turn_holder == threading.get_ident():
        return True
    if not lock.acquire(timeout=timeout):
        return False
    lock.release()
    return True


def acquire(lock: threading.Lock, stop: threading.Event, poll_s: float) -> bool:
    """Take ``lock``, checking ``stop`` every ``poll_s`` s; False (not taken) once it is set."""
    while not lock.acquire(timeout=poll_s):
        if stop.is_set():
            return False
    return True


def lock_for_process() -> threading.Lock | None:
    """:data:`RPC_LOCK` if this process has a DGL RPC client, else None (also when
    :data:`RPC_LOCK` was set to None). A client that cannot be read counts as one."""
    if RPC_LOCK is None:
        return None
    from .serverwatch import has_dgl_client

    return RPC_LOCK if has_dgl_client() else None

