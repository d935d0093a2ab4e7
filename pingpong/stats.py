"""Loader statistics: is the pipeline overlapping, and how fast does data move?

The producer and the consumer each add to their own counters under one lock;
:meth:`LoaderStats.snapshot` returns a plain dict.  Keys:

========================  ==========================================================
key                       meaning
========================  ==========================================================
``epochs``                epochs started
``niced_epochs``          epochs whose producer applied ``producer_nice`` (the OS
                          accepted it; capped at nice 19, so a thread already
                          there counts; 0 where it was 0, off Linux, or the OS
                          refused: :mod:`pingpong._producer_nice`)
``batches``               batches delivered to the training loop
``rows_gathered``         feature rows gathered (all tables count once per node)
``bytes_gathered``        feature + label bytes written into slots
``rows_fetched``          rows that came through row sources' ``source[ids]``
                          (``DistTensor`` pulls: :mod:`pingpong.rowsource`)
``rows_read_in_place``    rows of row sources read from their local part
                          (``DistTensor.local_partition``) straight into slots
``sample_s``              producer time spent waiting for the source (sampling,
                          and its ``iter()``; in a DistDGL process also for the other loaders'
                          producers to leave DGL's RPC client, :mod:`pingpong._rpc`)
``validate_s``            producer time spent checking ids
``fetch_s``               producer time spent fetching rows from row sources
                          (``DistTensor`` pulls: :mod:`pingpong.rowsource`)
``gather_s``              producer time spent issuing gathers and block transfers
                          (on the CPU: doing them)
``producer_busy_s``       ``sample_s + validate_s + fetch_s + gather_s``
``producer_cpu_s``        CPU seconds the producer threads used (``time.thread_time``):
                          what the pipeline takes from the training loop's cores,
                          the source's (sampler's) work included
``consumer_stall_s``      time the training loop waited inside ``next()`` (and
                          ``iter()``, for the source's ``iter()``)
``overlap_ratio``         share of the producer's work hidden behind training:
                          ``1 - consumer_stall_s / producer_busy_s`` (clamped to
                          [0, 1]); 1.0 means the loop never waited for data
``gather_gbps``           ``bytes_gathered / gather_s / 1e9`` (CPU: achieved gather
                          bandwidth; CUDA: issue rate, not bandwidth)
``cache_rows``            feature rows held by the hot-row cache (0: no cache, or
                          not built yet; :mod:`pingpong.cache`)
``cache_lookups``         feature rows gathered while the cache existed
``cache_hits``            those served from the cache (not over PCIe)
``cache_hit_rate``        ``cache_hits / cache_lookups`` (0.0 before any lookup)
``cache_bytes_saved``     ``cache_hits * row_bytes``
``slot_bytes``            device memory held by all slots now
``slot_grows``            how many times a slot buffer was (re)allocated
``wall_s``                seconds since the loader was created or the last
                          ``reset_stats()``
``process_cpu_s``         CPU seconds the whole process used since then (psutil;
                          in a forked child, since the fork)
``rss_bytes``             the process's resident memory now (psutil)
========================  ==========================================================
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any

import psutil


class LoaderStats:
    """Thread-safe counters shared by a loader's producer and consumer."""

    _COUNTERS = (
        "epochs",
        "niced_epochs",
        "batches",
        "rows_gathered",
        "bytes_gathered",
        "rows_fetched",
        "rows_read_in_place",
        "sample_s",
        "validate_s",
        "fetch_s",
        "gather_s",
        "producer_cpu_s",
        "consumer_stall_s",
        "cache_lookups",
        "cache_hits",
        "cache_bytes_saved",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process = psutil.Process()
        self.reset()
        _every_stats.add(self)

    def _after_fork_in_child(self) -> None:
        # The producer may have held the lock at the fork, and the process is
        # another one now: its CPU clock starts at zero.
        self._lock = threading.Lock()
        self._process = psutil.Process()
        self._cpu0 = 0.0

    def reset(self) -> None:
        """Zero every counter and restart the wall and CPU clocks."""
        with self._lock:
            self._values: dict[str, float] = dict.fromkeys(self._COUNTERS, 0.0)
            self._t0 = time.perf_counter()
            self._cpu0 = self._cpu_seconds()

    def _cpu_seconds(self) -> float:
        times = self._process.cpu_times()
        return float(times.user + times.system)

    def add(self, **amounts: float) -> None:
        """Add to named counters (unknown names raise ``KeyError``)."""
        with self._lock:
            for key, amount in amounts.items():
                self._values[key] += amount

    def snapshot(
        self, slot_bytes: int = 0, slot_grows: int = 0, cache_rows: int = 0
    ) -> dict[str, Any]:
        """A consistent copy of every counter plus derived figures."""
        with self._lock:
            values: dict[str, Any] = dict(self._values)
            wall = time.perf_counter() - self._t0
            cpu = self._cpu_seconds() - self._cpu0
            process = self._process
        for key in ("epochs", "niced_epochs", "batches", "rows_gathered", "bytes_gathered",
                    "rows_fetched", "rows_read_in_place", "cache_lookups", "cache_hits",
                    "cache_bytes_saved"):
            values[key] = int(values[key])
        values["cache_rows"] = int(cache_rows)
        lookups = values["cache_lookups"]
        values["cache_hit_rate"] = values["cache_hits"] / lookups if lookups else 0.0
        busy = values["sample_s"] + values["validate_s"] + values["fetch_s"] + values["gather_s"]
        values["producer_busy_s"] = busy
        if busy > 0:
            values["overlap_ratio"] = min(1.0, max(0.0, 1.0 - values["consumer_stall_s"] / busy))
        else:
            values["overlap_ratio"] = 0.0
        gather_s = values["gather_s"]
        values["gather_gbps"] = values["bytes_gathered"] / gather_s / 1e9 if gather_s > 0 else 0.0
        values["slot_bytes"] = int(slot_bytes)
        values["slot_grows"] = int(slot_grows)
        values["wall_s"] = wall
        values["process_cpu_s"] = cpu
        values["rss_bytes"] = int(process.memory_info().rss)
        return values


#: Every live :class:`LoaderStats`, so that a forked child gets a fresh lock and its
#: own process in each (``loader.stats`` in the child reported the parent's memory
#: and CPU, and waited forever on a lock the producer held at the fork).
_every_stats: weakref.WeakSet[LoaderStats] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for stats in list(_every_stats):
        stats._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)
