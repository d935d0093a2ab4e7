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
``zip``. The training thread's own DGL calls do not take it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

#: The lock of DGL's RPC client (see the module docstring); None turns it off.
RPC_LOCK: threading.Lock | None = threading.Lock()


@contextlib.contextmanager
def holding(lock: threading.Lock | None, stop: threading.Event,
            poll_s: float) -> Iterator[bool]:
    """Hold ``lock`` (if any) for the block; yields False, holding nothing, when
    ``stop`` was set while waiting for it."""
    if lock is None:
        yield True
        return
    if not acquire(lock, stop, poll_s):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def acquire(lock: threading.Lock, stop: threading.Event, poll_s: float) -> bool:
    """Take ``lock``, checking ``stop`` every ``poll_s`` s; False (not taken) once it is set."""
    while not lock.acquire(timeout=poll_s):
        if stop.is_set():
            return False
    return True


def lock_for_process() -> threading.Lock | None:
    """:data:`RPC_LOCK` if this process has a DGL RPC client, else None (also when
    :data:`RPC_LOCK` was set to None). A client that cannot be read counts as one."""
    if RPC_LOCK is None or "dgl.distributed" not in sys.modules:  # `import dgl` imports it
        return None
    from .serverwatch import dgl_servers

    try:
        has_client = dgl_servers() is not None
    except Exception:  # noqa: BLE001 - cannot tell: take turns, which is always safe
        has_client = True
    return RPC_LOCK if has_client else None

