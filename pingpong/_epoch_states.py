"""The states an epoch can be in, and what ``next()`` raises in each one that ended.

An epoch is one pass over the source: a producer thread and the training
loop's iterator.  Its states (:class:`EpochState`) and every transition::

    RUNNING --(next() reads the producer's end-of-epoch marker)---------> EXHAUSTED
            --(next() re-raises a producer error; a timeout, Ctrl-C,
               dead producer or failed debug check in next(); a timeout,
               Ctrl-C or health-check error while iter(loader) waits for
               iter(source); Ctrl-C inside the producer's start)-------> FAILED
            --(iterator.close(); the iterator is garbage-collected)-----> CLOSED
            --(a newer iter(loader): a nested loop over one loader)-----> SUPERSEDED
            --(loader.close() from any thread; the loader is
               garbage-collected; the interpreter exits)----------------> LOADER_CLOSED

Ended states are final and the first reason wins.  What ``next()`` then
does is :func:`ended_error`: ``StopIteration`` for an epoch that ran out or
was closed through its own iterator, :class:`~pingpong.errors.EpochFailedError`
after a failure (a loop that catches the failure and calls ``next()`` again),
:class:`~pingpong.errors.EpochSupersededError` or
:class:`~pingpong.errors.LoaderClosedError` when something else ended it --
never a silent stop for an epoch the training loop did not end itself.
"""

from __future__ import annotations

import enum

from .errors import EpochFailedError, EpochSupersededError, LoaderClosedError


class EpochState(enum.Enum):
    """Where an epoch is; every state but RUNNING is final (see the module docstring)."""

    RUNNING = "running"
    EXHAUSTED = "exhausted"
    FAILED = "failed"
    CLOSED = "closed"
    SUPERSEDED = "superseded"
    LOADER_CLOSED = "loader closed"


#: the sources whose iter() ends or resets an open iterator (``loader._shares_its_iterator``)
SHARED_ITERATOR_SOURCES = ("a DataLoader with persistent_workers=True, or a datapipe or "
                           "a DataLoader over one, such as GraphBolt's gb.DataLoader, or "
                           "DGL's DistNodeDataLoader")


def describe_failure(exc: BaseException) -> str:
    """``exc`` in one line for :func:`ended_error`: its type and (cut to 300
    characters) its message.  A string, not the exception: the epoch keeps it,
    and an exception's traceback would keep the epoch's iterator and loader
    alive in a reference cycle."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 -- a failing __str__ must not replace the failure
        message = ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def ended_error(state: EpochState, delivered: int, failure: str | None = None) -> BaseException:
    """What ``next()`` raises on an epoch that ended in ``state``; ``failure``
    is what ended a FAILED one (:func:`describe_failure`)."""
    if state is EpochState.FAILED:
        return EpochFailedError(
            f"this epoch failed after {delivered} batches ({failure or 'no reason recorded'}) "
            "and delivers no more: the next() (or iter()) that raised that error ended "
            "it. iter(loader) starts a new epoch"
        )
    if state is EpochState.SUPERSEDED:
        return EpochSupersededError(
            f"this epoch was ended after {delivered} batches because iter() was called "
            "on the same PingPongLoader again (a nested loop, or zip(loader, loader)), "
            "or on another PingPongLoader over the same source whose iter() ends or "
            f"resets the iterator both would read ({SHARED_ITERATOR_SOURCES}); a loader "
            "runs one epoch at a time -- use one loader, over its own DataLoader, per "
            "concurrent loop"
        )
    if state is EpochState.LOADER_CLOSED:
        return LoaderClosedError(
            f"the PingPongLoader was closed after {delivered} batches of this epoch"
        )
    return StopIteration()
