"""The hot-row feature cache: which rows, when it is built, and what it counts.

``PingPongLoader(..., cache_bytes=B)`` keeps ``k = B // row_bytes`` rows of
the feature table in device memory; a batch's gather reads those from there
and the rest over PCIe, in one kernel
(:func:`pingpong.kernels.cuda_cached.gather_rows_cached`). It exists for the
``zerocopy`` mode on CUDA (the fake asynchronous device implements it too,
for tests); ``gather="device"`` already holds every row on the GPU (the cache
is then not used, and the loader says so at INFO), and other modes refuse it
with a :class:`~pingpong.errors.ConfigError`.

Which rows:

- ``hot_ids=`` given (for instance the nodes by descending degree): the first
  ``k`` of them, cached before the first batch.
- Otherwise learned from the sampler: during the first epoch the producer
  counts every feature id it gathers (:class:`~pingpong.hotrows.RowCounter`,
  one ``index_add_`` per batch, on the producer thread), and when the next
  epoch starts the ``k`` most gathered rows are cached. That happens in
  ``iter(loader)`` after the previous epoch's producer was retired and before
  the new one starts, so no fill runs during the build, and the build is
  enqueued on the copy stream ahead of every later gather. If the first epoch
  was cut short, its partial counts are used. Counting then stops.

The cache is a copy: a cached row keeps the values it had when the cache was
built, whatever is written to the table afterwards (like ``gather="device"``'s
copy of the whole table).  :meth:`FeatureCache.refresh` (the loader's
``refresh_cache()``) copies the same rows again when the next epoch starts:
enqueued in ``iter(loader)`` on the copy stream, ahead of that epoch's
gathers, so it reads the table as it is when the copy runs -- finish writing
before ``iter(loader)``.

Supported: one feature tensor (not a dict of tables, not a row source);
anything else is refused at construction with a ``ConfigError``.

Counters (``loader.stats``): ``cache_rows`` (rows held), ``cache_lookups``
(feature rows gathered while the cache existed), ``cache_hits`` (those
served from it, counted on the host from the slot map), ``cache_hit_rate``
and ``cache_bytes_saved`` (``cache_hits * row_bytes``: bytes that did not
cross PCIe).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from ._ids import TableIds
from ._integers import integer
from .devices.base import Device
from .errors import ConfigError, IdRangeError
from .hotrows import RowCounter, build_slot_map, rows_within
from .store import FeatureStore, HostTable

logger = logging.getLogger(__name__)

__all__ = ["FeatureCache", "make_feature_cache"]


class FeatureCache:
    """One loader's cache of hot feature rows (see the module docstring).

    Thread contract: :meth:`on_fill` runs on the producer thread, under the
    epoch's write lock; :meth:`build_if_ready` runs in ``iter(loader)`` (or
    at construction) while no producer fills. ``lock`` orders the two.
    """

    def __init__(self, table: HostTable, rows: int, hot_ids: np.ndarray | None) -> None:
        self.table = table
        self.rows = rows
        self._hot = hot_ids
        self.counter: RowCounter | None = RowCounter(table.num_rows) if hot_ids is None else None
        self.slot_of: np.ndarray | None = None  # host copy of the device slot map, once built
        self._cached_ids: np.ndarray | None = None  # the rows cached, once built
        self._refresh = False
        #: Rows actually cached (at most ``rows``: fewer if fewer were ever gathered).
        self.cached_rows = 0
        self.lock = threading.Lock()

    @property
    def built(self) -> bool:
        """True once the hot rows are on the device (batches read them from the cache)."""
        return self.slot_of is not None

    def build_if_ready(self, device: Device) -> bool:
        """Cache the hot rows on ``device`` if they are known, or copy the cached rows
        again if :meth:`refresh` asked for it; True if it built now."""
        with self.lock:
            if self.built:
                if not self._refresh or self._cached_ids is None:
                    return False
                device.set_cache(self.table, self._cached_ids)
                self._refresh = False  # only once done: a failed copy is tried again
                logger.info("pingpong feature cache: %d rows of %r copied again",
                            len(self._cached_ids), self.table.name)
                return True
            hot = self._hot
            if hot is None:
                if self.counter is None or self.counter.total == 0:
                    return False  # nothing counted yet: the first epoch has not run
                hot = self.counter.hottest(self.rows).numpy()
            slot_of = build_slot_map(self.table.num_rows, hot)
            device.set_cache(self.table, hot)
            self.slot_of, self.counter, self._hot = slot_of, None, None
            self._cached_ids = hot
            self.cached_rows = len(hot)
        logger.info(
            "pingpong feature cache: %d of %d rows of %r on the device (%.1f MB)",
            len(hot), self.table.num_rows, self.table.name,
            len(hot) * self.table.row_bytes / 1e6,
        )
        return True

    def refresh(self) -> None:
        """Copy the cached rows from the table again at the next :meth:`build_if_ready`
        (the next ``iter(loader)``); nothing to do before the cache is built, whose
        build reads the table then."""
        with self.lock:
            self._refresh = self.built

    def on_fill(self, x_ids: TableIds) -> dict[str, float]:
        """Producer, before a fill: count the ids (first epoch) or the cache's hits.

        Returns the counters to add to the loader's stats.
        """
        ids = x_ids[None]
        with self.lock:
            if self.slot_of is None:
                if self.counter is not None:
                    self.counter.add(torch.from_numpy(ids))  # host_ids: writeable, contiguous
                return {}
            hits = int(np.count_nonzero(self.slot_of[ids] >= 0))
        return {
            "cache_lookups": len(ids),
            "cache_hits": hits,
            "cache_bytes_saved": hits * self.table.row_bytes,
        }


def make_feature_cache(
    store: FeatureStore, device: Device, cache_bytes: Any, hot_ids: Any
) -> FeatureCache | None:
    """Check ``cache_bytes``/``hot_ids`` against the store and the device.

    Returns None when no cache is wanted (``cache_bytes=0``), or when the
    tables are already in device memory (``gather="device"``; logged).

    Raises:
        ConfigError: a bad ``cache_bytes`` or ``hot_ids``, ``hot_ids`` without
            ``cache_bytes``, a gather mode without a cache, or tables the
            cache does not support (see the module docstring).
        IdRangeError: a hot id outside the feature table.
        TableError: a hot id given twice.

    Everything but the gather mode is checked in ``gather="device"`` too, where
    no cache is built.
    """
    if (budget := integer(cache_bytes)) is None or budget < 0:
        raise ConfigError(f"cache_bytes must be a non-negative int, got {cache_bytes!r}")
    cache_bytes = budget
    if cache_bytes == 0:
        if hot_ids is not None:
            raise ConfigError("hot_ids needs cache_bytes > 0 (the size of the cache)")
        return None
    if device.gather_mode != "device" and not device.supports_cache:
        raise ConfigError(
            f"cache_bytes needs gather='zerocopy' on a CUDA device; this loader gathers "
            f"with {device.gather_mode!r}"
        )
    # The other checks run in gather="device" too (where no cache is built):
    # gather="auto" must not accept or refuse the same arguments depending on the
    # GPU's free memory (it picks "device" or "zerocopy" by it).
    table = store.tables.get(None)
    if store.is_dict or store.heterogeneous or not isinstance(table, HostTable):
        raise ConfigError(
            "cache_bytes supports one feature tensor; a dict of tables, a heterogeneous "
            "store or a row source cannot be cached (yet)"
        )
    rows = rows_within(cache_bytes, table.row_bytes, table.num_rows)
    if rows == 0:
        raise ConfigError(
            f"cache_bytes={cache_bytes} holds no row of {table.row_bytes} bytes"
        )
    hot = None if hot_ids is None else _checked_hot_ids(hot_ids, table, rows)
    if device.gather_mode == "device":
        logger.info("pingpong: cache_bytes is not used: gather='device' holds every row on the GPU")
        return None
    return FeatureCache(table, rows, hot)


def _checked_hot_ids(hot_ids: Any, table: HostTable, rows: int) -> np.ndarray:
    """The first ``rows`` (at least 1) of ``hot_ids`` as int64, checked: 1-D integers,
    not empty, each within the table and each once (the errors of
    :func:`make_feature_cache`)."""
    if isinstance(hot_ids, torch.Tensor):
        hot_ids = hot_ids.detach().cpu().numpy()
    hot = np.asarray(hot_ids)
    if hot.ndim != 1 or (hot.size and not np.issubdtype(hot.dtype, np.integer)):
        raise ConfigError(f"hot_ids must be 1-D integers, got {hot.dtype} {hot.shape}")
    if hot.size == 0:
        raise ConfigError(
            "hot_ids is empty: it would cache nothing; leave it out to cache the "
            "rows the first epoch gathers most")
    hot = hot[:rows]
    if hot.dtype.kind == "u" and int(hot.max()) > np.iinfo(np.int64).max:
        raise IdRangeError(
            f"hot id {int(hot.max())} is outside the table's {table.num_rows} rows")
    hot = hot.astype(np.int64)
    build_slot_map(table.num_rows, hot)  # range and duplicates, before anything runs
    return hot
