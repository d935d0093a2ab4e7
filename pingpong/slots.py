"""Slots: the preallocated buffers that batches are gathered into.

A :class:`Slot` owns one device buffer per feature table and per label table.
Its capacity (rows) only grows, with headroom, when a batch is larger than
any it held before -- so after the first few batches no allocation happens.

Ownership invariant (the slot protocol): at any moment a slot is in exactly
one place -- the free queue, being filled by the producer, the ready queue, or
held by the consumer (through a :class:`Lease`).  ``release_events`` are the
events the copy stream must wait for before overwriting the slot: one per
stream the consumer read the batch on, recorded by whoever ends the lease,
before the slot goes back to the free queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .errors import BatchExpiredError
from .store import FeatureStore, Table, TableKey

if TYPE_CHECKING:
    from .devices.base import Device, Event

#: Capacity is rounded up to a multiple of this many rows.
ROW_GRANULE = 256
#: Growth headroom: a slot that must grow gets this factor more rows than needed.
GROWTH = 1.25


Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def grown_capacity(needed: int) -> int:
    """Capacity to allocate for ``needed`` rows (headroom, rounded to a granule)."""
    target = max(int(needed * GROWTH), needed, 1)
    return -(-target // ROW_GRANULE) * ROW_GRANULE


@dataclass
class Buffer:
    """A growable device buffer for rows of one table.

    It keeps the table's row shape and dtype, not the table: a slot outlives
    what the loader's finaliser may hold (an epoch's free slots), and a row
    source is the user's object, which may refer back to the loader.
    """

    table: InitVar[Table]
    storage: torch.Tensor | None = None
    grow_count: int = 0
    row_shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self, table: Table) -> None:
        self.row_shape = tuple(table.row_shape)
        self.dtype = table.dtype

    @property
    def capacity(self) -> int:
        return 0 if self.storage is None else int(self.storage.shape[0])

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel() * self.storage.element_size()

    def reserve(self, rows: int, allocate: Allocator) -> bool:
        """Make room for ``rows`` rows; return True if it had to reallocate."""
        if self.storage is not None and rows <= self.capacity:
            return False
        self.storage = allocate((grown_capacity(rows), *self.row_shape), self.dtype)
        self.grow_count += 1
        return True

    def rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows: a view, valid until the slot is refilled."""
        if self.storage is None:
            raise RuntimeError("buffer used before reserve()")
        return self.storage[:n]


@dataclass
class Slot:
    """One ping-pong slot: buffers for every feature table and label table.

    ``x`` and ``y`` have the keys of the store's ``tables`` and
    ``label_tables`` (``y`` is ``{}`` without labels).
    """

    index: int
    x: dict[TableKey, Buffer]
    y: dict[TableKey, Buffer]
    release_events: tuple[Any, ...]
    #: Incremented each time the producer refills the slot (the ``debug`` check).
    generation: int = 0

    @property
    def buffers(self) -> list[Buffer]:
        """Every feature and label buffer of the slot."""
        return [*self.x.values(), *self.y.values()]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def grow_count(self) -> int:
        return sum(b.grow_count for b in self.buffers)


def make_slots(store: FeatureStore, count: int, initial_event: Any) -> list[Slot]:
    """``count`` empty slots for ``store`` (memory is reserved on first use)."""
    return [
        Slot(
            index=i,
            x={key: Buffer(table) for key, table in store.tables.items()},
            y={key: Buffer(table) for key, table in store.label_tables.items()},
            release_events=(initial_event,),
        )
        for i in range(count)
    ]


@dataclass
class Lease:
    """The consumer's hold on one filled slot: the batch delivered from it.

    Created when ``next()`` delivers the batch, with the consumer stream it
    was made ready on; :meth:`use_on` adds streams (``batch.record_stream``);
    :meth:`end` records a release event on every one of them and gives them
    to the slot -- the copy stream waits for all before it refills it.  After
    :meth:`end` the lease is spent: the slot belongs to the producer again.
    Thread-safe: the training thread and a closer on another thread may race.
    """

    slot: Slot
    device: Device
    ready_event: Event
    streams: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ended: bool = False

    def check_not_ended(self, doing: str) -> None:
        """:class:`~pingpong.errors.BatchExpiredError` naming ``doing`` once the
        slot was handed back: its rows may be another batch's by now."""
        if self._ended:
            raise BatchExpiredError(
                f"{doing}: this batch's slot was handed back when the next batch was "
                "requested (or a new epoch started), and may hold another batch's rows; "
                "clone() a batch before the next one to keep it longer"
            )

    def use_on(self, stream: Any) -> None:
        """Make ``stream`` wait for the batch, and hold the slot until its work is done."""
        with self._lock:
            self.check_not_ended("record_stream()")
            # Held before the wait is queued: a Ctrl-C (or device error) that lands
            # once the stream waits must not leave it off the release events --
            # the producer would refill the slot under its work.  A stream held
            # that never got to wait costs one spare release event.
            used = self.device.resolve_consumer_stream(stream)
            self._hold(used)
            # And what the wait says it used: a device of the user's own may
            # resolve the stream only there.
            self._hold(self.device.consumer_wait(self.ready_event, used))

    def _hold(self, stream: Any) -> None:
        """Add ``stream`` to the streams :meth:`end` records on (once)."""
        if not any(stream == known for known in self.streams):
            self.streams.append(stream)

    def end(self) -> tuple[Any, ...] | None:
        """Record release events on every stream that used the batch and give them
        to the slot (its ``release_events``); idempotent.

        Returns the events (``None`` if the lease had already ended).  The lease
        ends only once the slot has every event: if recording raises (a Ctrl-C,
        a device error), it is still held, and a later call records them all.
        """
        with self._lock:
            if self._ended:
                return None
            streams = self.streams or [None]
            events = tuple(self.device.consumer_record(stream) for stream in streams)
            self.slot.release_events = events
            self._ended = True
        return events
