"""The CPU device: slots in host memory, gathered by the Numba kernel in the producer.

Warm-up: :meth:`CPUDevice.attach` starts a ``pingpong-warmup-N`` thread that
compiles (or loads from Numba's disk cache) the kernels this loader's tables
need (:func:`pingpong.kernels.warm_up_cpu`: int64 ids first, then the
positioned kernel for row sources' local parts, then int32 ids).
While it runs, a gather whose specialisation is not ready yet runs
``torch.index_select`` (and ``index_copy_`` for the positioned one) on the same
byte rows (bit-exact, no JIT), so the first
batches never wait for Numba; the rest run the Numba kernel. If the warm-up
fails, the kernels compile on first use, as they would without it.
:meth:`CPUDevice.detach` (``close()``) stops the warm-up and joins it (for at
most ``WARM_UP_JOIN_S``: it then ends with its current step).
"""

from __future__ import annotations

import os
from typing import Any

import numba
import numpy as np
import torch

from .._integers import Count, integer
from ..errors import ConfigError
from ..kernels._warmup import WarmUpThread, start_warm_up
from ..kernels.cpu import (
    gather_at_is_ready,
    gather_is_ready,
    gather_rows_at_cpu_unchecked,
    gather_rows_cpu_unchecked,
    warm_up_cpu,
    warm_up_cpu_at,
)
from ..rowsource import RemoteTable
from ..store import FeatureStore, HostTable, byte_rows, make_host_table
from .base import COMPLETED, Device, Event

#: How long ``close()`` waits for a warm-up's step in progress. A step is one
#: compilation or cache load (the first, loading Numba itself, ~1 s in a fresh
#: process); a warm-up still in its step after that ends with the step, in the
#: background, touching nothing of the loader's.
WARM_UP_JOIN_S = 1.0


def default_gather_threads() -> int:
    """Numba threads the producer uses by default: half the cores, at least one.

    The other half is left to the training loop's torch threads; on a 2-core
    machine that means one core gathers while the other computes.
    """
    return max(1, (os.cpu_count() or 2) // 2)


def _arange(n: int) -> np.ndarray:
    """``0..n-1`` as int64 (a view of a cached array; read only by the kernel).

    The global is read once: another producer may replace it meanwhile (with a
    longer or shorter array), never the array this call returns a view of.
    """
    global _ARANGE
    cached = _ARANGE
    if len(cached) < n:
        cached = np.arange(max(n, 2 * len(cached)), dtype=np.int64)
        _ARANGE = cached
    return cached[:n]


_ARANGE = np.arange(4096, dtype=np.int64)


def gather_host_rows(table: HostTable, ids: np.ndarray, out_rows: torch.Tensor,
                     warm_up: WarmUpThread | None) -> None:
    """``out_rows[:] = table.byte_rows[ids]``, ``out_rows`` a host byte-row tensor:
    Numba's gather, or -- while ``warm_up`` is still loading the specialisation
    it needs -- ``torch.index_select``: the same bytes, without waiting for the
    compiler.  ``ids`` validated (:func:`pingpong._ids.host_ids`)."""
    out_np = out_rows.numpy()
    if (
        warm_up is not None
        and not warm_up.done.is_set()
        and not gather_is_ready(table.byte_rows, ids, out_np)
    ):
        if len(ids):
            index = torch.from_numpy(ids)  # contiguous and writeable (host_ids)
            torch.index_select(torch.from_numpy(table.byte_rows), 0, index, out=out_rows)
        return
    gather_rows_cpu_unchecked(table.byte_rows, ids, out_np)


class CPUDevice(Device):
    """Host-memory slots; ``gather`` runs synchronously in the producer thread.

    Every event is complete when recorded: the producer has finished writing a
    slot before it hands it over, and the consumer has finished reading a slot
    when it asks for the next batch.
    """

    gather_mode = "cpu"

    def __init__(self, gather_threads: Count | None = None) -> None:
        if gather_threads is None:
            gather_threads = default_gather_threads()
        if (threads := integer(gather_threads)) is None or threads < 1:
            raise ConfigError(f"gather_threads must be a positive int, got {gather_threads!r}")
        self.gather_threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        self._warm_up: WarmUpThread | None = None

    def attach(self, store: FeatureStore) -> None:
        tables = [table.byte_rows for table in store.host_tables]
        self.start_warm_up(tables, local_parts(store))

    def start_warm_up(self, tables: list[np.ndarray], local: list[np.ndarray]) -> None:
        """Start loading the kernels for the byte rows of ``tables`` (gathers) and of
        ``local`` (row sources' local parts: the positioned kernel); once per device."""
        if self._warm_up is not None:
            return

        def warm_up(should_stop: Any) -> list[tuple[object, ...]]:
            ready = warm_up_cpu(tables, id_dtypes=(np.int64,), should_stop=should_stop)
            ready += warm_up_cpu_at(local, should_stop=should_stop)
            return ready + warm_up_cpu(tables, id_dtypes=(np.int32,), threading_layer=False,
                                       should_stop=should_stop)

        self._warm_up = start_warm_up(warm_up)

    def detach(self) -> None:
        warm_up = self._warm_up
        if warm_up is not None:
            # Stops at its next step; waits for the step in progress (one
            # compilation or cache load) at most WARM_UP_JOIN_S.
            warm_up.stop(WARM_UP_JOIN_S)

    @property
    def warm_up(self) -> WarmUpThread | None:
        """The warm-up started by :meth:`attach` (None before it)."""
        return self._warm_up

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def producer_started(self) -> None:
        # Numba's thread count is per calling thread: this affects the producer only.
        numba.set_num_threads(self.gather_threads)

    @property
    def default_sampler_threads(self) -> int:
        """As many as the gather: the rest of the cores are the training step's."""
        return self.gather_threads

    #: How much the producer raises its nice value by default: the training step's
    #: torch threads use every core, and the producer beside them at the same
    #: priority slowed the step more than it saved (:mod:`pingpong._producer_nice`).
    PRODUCER_NICE = 10

    @property
    def default_producer_nice(self) -> int:
        """:attr:`PRODUCER_NICE`."""
        return self.PRODUCER_NICE

    def wait_event(self, event: Event) -> None:
        return None

    def gather(self, table: HostTable, ids: np.ndarray, out: torch.Tensor) -> None:
        gather_host_rows(table, ids, byte_rows(out), self._warm_up)

    @property
    def supports_local_rows(self) -> bool:
        return True

    def gather_at(self, table: HostTable, ids: np.ndarray, positions: np.ndarray,
                  out: torch.Tensor) -> None:
        out_rows = byte_rows(out)
        warm_up = self._warm_up
        if (warm_up is not None and not warm_up.done.is_set()
                and not gather_at_is_ready(table.byte_rows, out_rows.numpy())):
            # Not loaded yet: the same bytes, without a JIT.
            if len(ids):
                rows = torch.index_select(torch.from_numpy(table.byte_rows), 0,
                                          torch.from_numpy(ids))
                out_rows.index_copy_(0, torch.from_numpy(positions), rows)
            return
        gather_rows_at_cpu_unchecked(table.byte_rows, ids, positions, out_rows.numpy())

    def copy_rows_at(self, table: RemoteTable, rows: torch.Tensor, positions: np.ndarray,
                     out: torch.Tensor) -> None:
        # The positioned kernel over rows 0..n-1 (torch's index_copy_ on byte rows
        # copies byte by byte: ~10x slower on 512-byte rows).
        self.gather_at(make_host_table(rows, table.name), _arange(len(positions)), positions,
                       out)

    def record(self) -> Event:
        return COMPLETED

    def resolve_consumer_stream(self, stream: Any = None) -> Any:
        return None  # one consumer "stream": the calling thread

    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        return None

    def consumer_record(self, stream: Any = None) -> Event:
        return COMPLETED


def local_parts(store: FeatureStore) -> list[np.ndarray]:
    """The byte rows of the row sources' local parts (read in place by the positioned
    kernel; the other rows of row sources are fetched and copied)."""
    return [table.local.table.byte_rows for table in store.all_tables
            if isinstance(table, RemoteTable) and table.local is not None]
