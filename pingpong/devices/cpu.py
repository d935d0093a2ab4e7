"""The CPU device: slots in host memory, gathered by the Numba kernel in the producer."""

from __future__ import annotations

import os
from typing import Any

import numba
import numpy as np
import torch

from ..errors import ConfigError
from ..kernels.cpu import gather_rows_cpu_unchecked
from ..store import HostTable, byte_rows
from .base import COMPLETED, Device, Event


def default_gather_threads() -> int:
    """Numba threads the producer uses by default: half the cores, at least one.

    The other half is left to the training loop's torch threads; on a 2-core
    machine that means one core gathers while the other computes.
    """
    return max(1, (os.cpu_count() or 2) // 2)


class CPUDevice(Device):
    """Host-memory slots; ``gather`` runs synchronously in the producer thread.

    Every event is complete when recorded: the producer has finished writing a
    slot before it hands it over, and the consumer has finished reading a slot
    when it asks for the next batch.
    """

    gather_mode = "cpu"

    def __init__(self, gather_threads: int | None = None) -> None:
        if gather_threads is None:
            gather_threads = default_gather_threads()
        if not isinstance(gather_threads, int) or gather_threads < 1:
            raise ConfigError(f"gather_threads must be a positive int, got {gather_threads!r}")
        self.gather_threads = min(gather_threads, numba.config.NUMBA_NUM_THREADS)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def producer_started(self) -> None:
        # Numba's thread count is per calling thread: this affects the producer only.
        numba.set_num_threads(self.gather_threads)

    def wait_event(self, event: Event) -> None:
        return None

    def gather(self, table: HostTable, ids: np.ndarray, out: torch.Tensor) -> None:
        gather_rows_cpu_unchecked(table.byte_rows, ids, byte_rows(out).numpy())

    def record(self) -> Event:
        return COMPLETED

    def consumer_wait(self, event: Event, stream: Any = None) -> Any:
        return None

    def consumer_record(self, stream: Any = None) -> Event:
        return COMPLETED
