"""Sources that two loaders must not iterate at once, and which epoch iterates each.

A source whose ``iter()`` ends or resets an iterator already open (persistent
DataLoader workers, datapipes, GraphBolt's ``gb.DataLoader``, DGL's
``DistNodeDataLoader``) can run one pass at a time, whichever loader asks.
:func:`start_claiming` records the epoch that iterates such a source now and
ends the one before it as superseded.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from ._epoch_states import EpochState
from ._threads import ThreadExit

if TYPE_CHECKING:
    from ._epoch import Epoch

# Sources whose iter() ends or resets an open iterator, and the last epoch (of
# any loader) that iterates each: a weak reference to it, and the producers a
# later pass must let leave the source first (its own and those it waits for).
_shared_sources: weakref.WeakKeyDictionary[
    object, tuple[weakref.ref[Epoch], tuple[ThreadExit, ...]]] = weakref.WeakKeyDictionary()
_shared_sources_lock = threading.Lock()


def start_claiming(source: object | None, epoch: Epoch) -> None:
    """Start ``epoch`` as the one that iterates ``source`` now; its producer first
    lets the last epoch's producer over ``source`` leave it.

    ``source`` is None for every other source (the epoch is just started).
    Another loader's epoch still running over ``source`` (``zip`` or nested
    loops over two loaders of one DataLoader, or an iterator kept from an
    earlier loader) is ended as superseded -- its iterator then raises
    :class:`~pingpong.errors.EpochSupersededError`, as for two ``iter()`` of one loader.  Its
    producer, or that of the last epoch over ``source`` that ended for any
    reason, may still be inside the source: ``epoch``'s producer calls
    ``iter(source)`` only once it has left (:meth:`Epoch.start_after`).  So the
    last ``iter()`` wins, also when two threads call it at once: each epoch's
    producer waits for the one recorded before it, which, superseded, leaves.
    """
    if source is None or not _can_key(source):
        epoch.start()
        return
    with _shared_sources_lock:
        record = _shared_sources.get(source)
        if record is not None:
            epoch.start_after(record[1])
            other = record[0]()
            if other is not None:  # before the start: a Ctrl-C leaves one epoch running
                other.end(EpochState.SUPERSEDED)
        _shared_sources[source] = (weakref.ref(epoch), epoch.producers_to_outlast())
        epoch.start()  # under the lock: no other claim sees it unstarted


def _can_key(source: object) -> bool:
    """Whether ``source`` can key :data:`_shared_sources` (hashable, weakly referable)."""
    try:
        hash(source)
        weakref.ref(source)
    except TypeError:
        return False
    return True
