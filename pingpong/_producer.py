"""The producer loop: sample, validate, gather into a free slot, hand it over.

:func:`produce` is a free function that receives everything it touches as
arguments -- it holds no reference to the iterator or the loader, so dropping
the iterator (``break``) lets it be collected and stop the producer.

Hand-off messages on the ready queue are :class:`Delivery`, then exactly one
:class:`EndOfEpoch` or :class:`Failure`.  The producer never blocks without a
timeout: every wait polls ``stop`` every ``poll_s`` seconds.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._ids import host_ids
from .devices.base import Device, Event
from .slots import Slot
from .stats import LoaderStats
from .store import FeatureStore


@dataclass(frozen=True)
class Delivery:
    """A filled slot and the batch fields that point into it.

    ``generation`` is ``slot.generation`` right after this fill (see the
    loader's ``debug`` option).
    """

    seq: int
    generation: int
    slot: Slot
    ready_event: Event
    input_nodes: Any
    output_nodes: Any
    blocks: Any
    x: Any
    y: Any


@dataclass(frozen=True)
class EndOfEpoch:
    """The source is exhausted after ``batches`` deliveries."""

    batches: int


@dataclass(frozen=True)
class Failure:
    """The producer raised ``exc`` (its ``__traceback__`` holds the producer frames)."""

    exc: BaseException


def _unpack(item: Any, seq: int) -> tuple[Any, Any, Any]:
    if not isinstance(item, tuple | list) or len(item) != 3:
        raise TypeError(
            f"source item {seq} is {type(item).__name__}"
            + (f" of length {len(item)}" if isinstance(item, tuple | list) else "")
            + "; expected an (input_nodes, output_nodes, blocks) triple"
        )
    return item[0], item[1], item[2]


def _take_free_slot(free_q: queue.Queue[Slot], stop: threading.Event, poll_s: float) -> Slot | None:
    while not stop.is_set():
        try:
            return free_q.get(timeout=poll_s)
        except queue.Empty:
            continue
    return None


def produce(
    source: Iterable[Any],
    store: FeatureStore,
    device: Device,
    free_q: queue.Queue[Slot],
    ready_q: queue.Queue[Delivery | EndOfEpoch | Failure],
    stop: threading.Event,
    write_lock: threading.Lock,
    stats: LoaderStats,
    poll_s: float,
) -> None:
    """Run one epoch of ``source`` into slots taken from ``free_q``.

    Contract with the consumer:
    - a slot is written only while holding ``write_lock`` and only if ``stop``
      is not set, so a closer that sets ``stop`` and then takes the lock once
      knows no slot will be written again;
    - the copy stream waits for the slot's ``release_event`` before writing;
    - exactly one terminal message (``EndOfEpoch`` or ``Failure``) is queued
      unless ``stop`` was set first.
    """
    seq = 0
    try:
        device.producer_started()
        iterator = iter(source)
        num_rows = store.num_rows
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                break
            t1 = time.perf_counter()
            input_nodes, output_nodes, blocks = _unpack(item, seq)
            x_ids = host_ids(input_nodes, num_rows, "input_nodes")
            y_ids = host_ids(output_nodes, num_rows, "output_nodes") if store.labels else None
            t2 = time.perf_counter()
            slot = _take_free_slot(free_q, stop, poll_s)
            if slot is None:
                return
            t3 = time.perf_counter()
            with write_lock:
                if stop.is_set():
                    return
                delivery = _fill(
                    slot, seq, store, device, x_ids, y_ids, input_nodes, output_nodes, blocks
                )
            t4 = time.perf_counter()
            ready_q.put(delivery)
            y_bytes = (
                0 if y_ids is None or store.labels is None else len(y_ids) * store.labels.row_bytes
            )
            stats.add(
                sample_s=t1 - t0,
                validate_s=t2 - t1,
                gather_s=t4 - t3,
                rows_gathered=len(x_ids),
                bytes_gathered=len(x_ids) * store.bytes_per_input_row + y_bytes,
            )
            seq += 1
        if not stop.is_set():
            ready_q.put(EndOfEpoch(seq))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
        if hasattr(exc, "add_note"):
            exc.add_note(
                f"(raised in pingpong thread {threading.current_thread().name!r} "
                f"while preparing batch {seq}; re-raised in the training loop)"
            )
        ready_q.put(Failure(exc))


def _fill(
    slot: Slot,
    seq: int,
    store: FeatureStore,
    device: Device,
    x_ids: Any,
    y_ids: Any,
    input_nodes: Any,
    output_nodes: Any,
    blocks: Any,
) -> Delivery:
    """Gather one batch into ``slot`` on the copy stream; caller holds the write lock."""
    device.wait_event(slot.release_event)
    slot.generation += 1
    xs = {}
    for key, buffer in slot.x.items():
        buffer.reserve(len(x_ids), device.allocate)
        out = buffer.rows(len(x_ids))
        device.gather(buffer.table, x_ids, out)
        xs[key] = out
    y = None
    if slot.y is not None and y_ids is not None:
        slot.y.reserve(len(y_ids), device.allocate)
        y = slot.y.rows(len(y_ids))
        device.gather(slot.y.table, y_ids, y)
    moved_blocks = device.move_blocks(blocks)
    moved_in = device.move_ids(input_nodes)
    moved_out = device.move_ids(output_nodes)
    ready_event = device.record()
    x = xs if store.is_dict else xs[None]
    return Delivery(
        seq, slot.generation, slot, ready_event, moved_in, moved_out, moved_blocks, x, y
    )
