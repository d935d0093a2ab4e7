"""The device interface the slot protocol is written against.

The producer and consumer never touch streams or kernels directly; they call
a :class:`Device`.  A device models two ordered queues of work:

- the *copy stream*, used by the producer: ``begin_fill`` (a new slot fill
  starts: forget what an earlier, failed fill left), ``wait_event`` (do not
  start later work before an event completed), ``gather`` and ``move_graphs``
  (enqueue work), ``record`` (an event that completes when the work enqueued
  since ``begin_fill`` is done);
- the *consumer streams*, used by the training thread: ``consumer_wait``
  (later work on a stream starts only after an event; returns the stream it
  used) and ``consumer_record`` (an event on that stream).  A batch is made
  ready on the stream current at ``next()`` and, through
  ``batch.record_stream``, on any other stream the training loop names.

On the CPU both "streams" are the calling threads themselves and every event
is complete when recorded.  On CUDA they are real streams and events, and the
host never blocks on them.  A fake asynchronous device used in tests runs
queued work later on a worker thread, so a missing wait shows up as wrong data.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import ConfigError
from ..rowsource import FetchedRows, RemoteTable
from ..store import FeatureStore, HostTable, byte_rows


class Event(Protocol):
    """Something recorded on a stream; ``query()`` is True once it completed."""

    def query(self) -> bool: ...


class CompletedEvent:
    """An event that is complete from the start (CPU streams are synchronous)."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "CompletedEvent()"


COMPLETED = CompletedEvent()


class Device(abc.ABC):
    """Where slots live and how rows reach them.  See the module docstring."""

    #: The gather mode this device implements ("cpu", "zerocopy", ...).
    gather_mode: str
    #: Deliver DGL graphs as :class:`~pingpong.blocks.EdgeBlock` /
    #: :class:`~pingpong.blocks.HeteroEdgeBlock` even where DGL could hold them
    #: (the fake device sets it to stand in for a GPU with a CPU-only DGL build).
    dgl_graphs_as_edge_blocks: bool = False

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device:
        """The device batches are delivered on."""

    @abc.abstractmethod
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Allocate uninitialised slot storage."""

    def attach(self, store: FeatureStore) -> None:  # noqa: B027 - optional hook
        """Prepare the host tables (e.g. pin them).  Called once per loader."""

    def detach(self) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`attach` (e.g. unpin).  Idempotent."""

    def producer_started(self) -> None:  # noqa: B027 - optional hook
        """Called in each producer thread before its first batch."""

    @property
    def default_sampler_threads(self) -> int | None:
        """OpenMP threads DGL's sampler gets on the producer thread when the loader
        is not told (``sampler_threads=None``); None: the count the thread
        started with (the process default)."""
        return None

    @property
    def default_producer_nice(self) -> int:
        """How much the producer thread raises its nice value when the loader is
        not told (``producer_nice=None``); 0: not at all."""
        return 0

    @property
    def initial_event(self) -> Event:
        """The release event of a slot that was never used."""
        return COMPLETED

    # -- copy stream (producer thread) --------------------------------------
    def begin_fill(self) -> None:  # noqa: B027 - optional hook
        """A new fill starts: drop per-fill state an earlier fill left (it may have failed)."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Copy stream: later work waits for ``event`` (no host block on CUDA)."""

    @abc.abstractmethod
    def gather(self, table: HostTable, ids: np.ndarray, out: torch.Tensor) -> None:
        """Copy stream: enqueue ``out[:] = table[ids]`` (ids already validated)."""

    @property
    def supports_cache(self) -> bool:
        """Whether :meth:`set_cache` works (the hot-row cache, :mod:`pingpong.cache`)."""
        return False

    def set_cache(self, table: HostTable, hot_ids: np.ndarray) -> None:
        """Copy stream: from the next :meth:`gather` on, serve ``table``'s rows
        ``hot_ids`` (int64, distinct, in range; slot ``i`` holds row
        ``hot_ids[i]``) from device memory, bit-identically.  Called while no
        fill runs; replaces an earlier cache of ``table``.
        """
        raise ConfigError(f"gather mode {self.gather_mode!r} has no feature cache")

    def copy_rows(self, table: RemoteTable, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Copy stream: enqueue ``out[:] = rows`` -- rows fetched from a row source
        (:mod:`pingpong.rowsource`), a contiguous host tensor of ``out``'s shape.

        Default: a synchronous copy (right where slots live in host memory).
        """
        byte_rows(out).copy_(byte_rows(rows))

    @property
    def supports_local_rows(self) -> bool:
        """Whether :meth:`place_rows` works: a row source's local rows are then read
        in place (:class:`~pingpong.rowsource.LocalPart`), not fetched."""
        return False

    def place_rows(self, table: RemoteTable, fetched: FetchedRows, out: torch.Tensor) -> None:
        """Copy stream: enqueue the writes that put a batch of ``table`` -- split into
        rows read in place and rows fetched (``fetched.positions`` is not None) --
        into ``out``: ``out[fetched.local_positions[k]] = table.local.table[
        fetched.local_rows[k]]`` and ``out[fetched.positions[k]] = fetched.rows[k]``.
        The two position arrays together name every row of ``out`` once.

        Default: :meth:`gather_at`, then :meth:`copy_rows_at` (when rows were fetched).
        """
        assert table.local is not None
        assert fetched.positions is not None
        self.gather_at(table.local.table, fetched.local_rows, fetched.local_positions, out)
        if fetched.rows is not None:
            self.copy_rows_at(table, fetched.rows, fetched.positions, out)

    def gather_at(self, table: HostTable, ids: np.ndarray, positions: np.ndarray,
                  out: torch.Tensor) -> None:
        """Copy stream: enqueue ``out[positions[k]] = table[ids[k]]`` for every ``k``
        (ids validated; positions int64, distinct, in range)."""
        raise ConfigError(f"gather mode {self.gather_mode!r} does not read rows in place")

    def copy_rows_at(self, table: RemoteTable, rows: torch.Tensor, positions: np.ndarray,
                     out: torch.Tensor) -> None:
        """Copy stream: enqueue ``out[positions[k]] = rows[k]`` (rows fetched from a row
        source, a contiguous host tensor; positions as for :meth:`gather_at`)."""
        raise ConfigError(f"gather mode {self.gather_mode!r} does not read rows in place")

    def move_graphs(self, graphs: list[Any]) -> list[Any]:
        """Copy stream: put a fill's graphs on this device (default: as they are).

        ``graphs`` are graph-like objects (``.to(device)``: DGL graphs, GraphBolt
        minibatches, :class:`~pingpong.blocks.EdgeBlock` s,
        :class:`~pingpong.blocks.HeteroEdgeBlock` s) that the batch-form
        layer (:mod:`pingpong.forms`) already turned into a form this device
        can hold; called once per fill, also with an empty list.
        """
        return graphs

    @abc.abstractmethod
    def record(self) -> Event:
        """Copy stream: an event completing when all work enqueued so far is done."""

    # -- consumer stream (training thread) ----------------------------------
    def resolve_consumer_stream(self, stream: Any = None) -> Any:
        """The stream ``stream`` names (``None``: the current one), as
        :meth:`consumer_wait` will use it and :meth:`consumer_record` takes it;
        asked before the wait is queued, so that the slot is held on it first.
        Here: ``stream`` itself; a device that resolves ``None`` only inside
        :meth:`consumer_wait` still works (its return value is held too)."""
        return stream

    @abc.abstractmethod
    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        """Later work on ``stream`` (default: the current one) waits for ``event``.

        Tensors made on the copy stream are marked as used on that stream.
        Returns the stream it made wait (what :meth:`consumer_record` takes);
        any thread.
        """

    @abc.abstractmethod
    def consumer_record(self, stream: Any = None) -> Event:
        """An event completing when the work queued on ``stream`` so far is done.

        ``stream`` is what :meth:`resolve_consumer_stream` or
        :meth:`consumer_wait` returned; any thread.
        """

    def wait_for_fills(self) -> None:  # noqa: B027 - optional hook
        """Host wait until every gather queued so far has read its rows, so that a
        write to a host table from now on reaches none of those batches.  Called
        by the training thread when an epoch ends (``StopIteration``).  Here:
        nothing to wait for (the gathers ran in the producer thread, retired by then)."""

    def close(self) -> None:
        """Release streams and host registrations.  Idempotent."""
        self.detach()
