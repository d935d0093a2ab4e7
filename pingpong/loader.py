"""PingPongLoader: the public, pipelined wrapper around a sampler."""

from __future__ import annotations

import functools
import itertools
import numbers
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, SupportsIndex

import numpy as np
import torch
from torch.utils.data import IterDataPipe

from . import _rpc
from ._dgl_seeds import check_dgl_loader_seeds, dgl_loader_seeds
from ._epoch import Epoch, EpochIterator
from ._integers import Count, integer
from ._lifecycle import LoaderCore
from ._numba_threads import start_threading_layer
from ._producer_nice import MAX_NICE
from ._table_types import check_tables_against_graph, edge_label_keys
from .cache import make_feature_cache
from .devices import Device, make_device
from .errors import ConfigError
from .forms import FormCallable, ItemReader
from .forms._dgl_dist import restartable_dgl_loader
from .rowsource import RemoteTable, RowSource
from .serverwatch import ServerWatch, dgl_server_watch, has_dgl_client
from .slots import Slot, make_slots
from .stats import LoaderStats
from .store import FeatureStore, make_feature_store

_loader_ids = itertools.count()


class PingPongLoader(Iterable[Any]):
    """Pipelined loader: batches arrive with features and labels on ``device``.

    A producer thread iterates ``source``, checks the ids, and gathers
    ``features[input_nodes]`` and ``labels[output_nodes]`` into one of
    ``num_buffers`` preallocated slots while the training loop works on another.

    Args:
        source: a re-iterable (DGL ``DataLoader``, GraphBolt ``DataLoader``,
            DGL's ``DistNodeDataLoader``/``DistEdgeDataLoader``, list, ...)
            yielding items of a form :mod:`pingpong.forms` reads:
            DGL node triples ``(input_nodes, output_nodes, blocks)``, ShaDow
            items, edge-prediction items with or without negatives, subgraphs
            (ClusterGCN, SAINT), GraphBolt ``MiniBatch`` es, or anything with
            ``form=``.  Each ``iter(loader)`` makes one pass over it.  One-shot
            iterators (generators) are refused.
        features: a host tensor ``(N, ...)`` (or NumPy array) or a dict of such tables
            (then ``batch.x`` is a dict with the same keys).  Used in place, never copied
            (except by ``gather="device"``, and ``auto`` where it picks it, which
            copy the tables to GPU memory once).
            With ``heterogeneous=True``: a dict ``{node type: table}``.
        labels: node labels: ``None`` or a host tensor with first dimension
            ``N``, gathered at a batch's seed nodes; with ``heterogeneous=True``,
            ``None`` or a dict ``{node type: table}``.
        edge_labels: edge labels for edge-prediction items, instead of
            ``labels``: a host tensor with one row per edge id of the graph,
            gathered at ``pair_graph.edata[dgl.EID]`` into ``batch.y``; or a
            dict ``{edge type: table}`` (keys: edge type names or canonical
            triples), each gathered at that type's edge ids into ``batch.y[key]``.
        form: a callable ``form(item) -> (feature_ids, label_ids or None)`` for
            items of any other form; the batch is then a
            :class:`~pingpong.CustomBatch` ``(item, x, y)``.
        device: where batches are delivered: ``"cpu"`` or ``"cuda[:k]"``, or a
            :class:`~pingpong.devices.Device` instance (such as the tests'
            :class:`~pingpong.devices.fake.FakeAsyncDevice`), which the loader
            then owns: ``close()`` closes it, and so does a constructor that
            raises; ``gather_threads`` and ``sort_ids`` configure a device the
            loader makes and are refused with one given.
        num_buffers: number of slots (>= 2).  The producer runs at most
            ``num_buffers - 1`` batches ahead of the training loop.
        gather: ``"auto" | "cpu" | "zerocopy" | "staged" | "device"``; ``auto`` is
            ``cpu`` on the CPU; on CUDA it is ``device`` when the tables take at
            most half of the GPU's free memory, else ``zerocopy`` (logged at
            INFO; ``loader.gather_mode`` says which).
        timeout: seconds to wait for a batch -- or, in ``iter()``, for the
            source's ``iter()`` -- before raising ``TimeoutError``; ``None``
            waits as long as the source needs (a dead producer is still
            noticed).  The next ``iter()`` waits up to 2 s for the
            producer still inside the source, then starts the new pass -- or,
            for a ``DataLoader`` with ``persistent_workers=True``, a datapipe
            such as GraphBolt's ``gb.DataLoader``, or DGL's
            ``DistNodeDataLoader`` (whose ``iter()`` ends or resets the
            iterator that producer is in), starts it once that producer has
            left, a wait that ``timeout`` bounds like ``iter(source)``'s.
        gather_threads: Numba threads the CPU gather uses in the producer thread
            (default: half the cores).  The training loop's torch threads are
            not changed; see the tuning guide.
        sampler_threads: OpenMP threads on the producer thread for DGL's C++
            code -- its samplers and GraphBolt's, with ``num_workers=0`` -- and
            torch's CPU ops there (OpenMP's count is per thread: the training
            thread keeps its own).  Default (``None``): on the CPU, as many as
            ``gather_threads`` (half the cores), leaving the rest to the
            training step, which DGL's own default (every core) preempts; on
            CUDA, the count the thread starts with.  Does nothing without DGL
            imported, nor on threads DGL starts itself (a CUDA ``DataLoader``'s
            prefetch thread).  ``loader.sampler_threads`` says which (``None`` resolved).
        sort_ids: ``"auto"`` (default), ``"gpu"`` or ``"none"``: whether the
            CUDA kernel gathers read each batch's rows in ascending id order --
            the ids are sorted *on the GPU*, on the copy stream, and each row
            is written to its original position (the output order is
            unchanged).  ``auto`` sorts in ``zerocopy`` (reading host memory
            in address order) and not in ``device``; ``staged`` and the CPU
            never sort.
        debug: check the slot protocol at every ``next()``: the slot holding
            the previous batch must not have been refilled while the training
            loop held it (``SlotOverwriteError`` if it was).  Off by default;
            costs two integer compares per batch when on.
        heterogeneous: the source is a heterogeneous graph's loader: it yields
            ``input_nodes`` and ``output_nodes`` as dicts ``{node type: ids}``
            (as DGL does), and ``features``/``labels`` are dicts keyed by node
            type, each table with its own row count, row shape and dtype.
            ``batch.x[t]`` is ``features[t][input_nodes[t]]`` and ``batch.y[t]``
            is ``labels[t][output_nodes[t]]``; node types without a table are
            passed through untouched (e.g. for learned embeddings).
        cache_bytes: device memory for a cache of hot feature rows (``0``: none),
            with ``gather="zerocopy"`` on CUDA: the cached rows are read from
            device memory, the rest over PCIe, in one kernel; batches are
            bit-identical either way.  Which rows: ``hot_ids``, or else the
            rows the first epoch gathered most (counted by the producer; the
            cache is built when the second epoch starts).  One feature tensor
            only.  It also takes 4 bytes of device memory per table row (its
            slot map), outside ``cache_bytes``.  See :mod:`pingpong.cache`;
            ``loader.stats`` reports the hit rate.
        hot_ids: rows to cache, hottest first (e.g. nodes by descending
            degree); the first ``cache_bytes // row_bytes`` are cached before
            the first batch.
        health_check: a cheap, thread-safe callable that raises when something the
            source or a row source depends on is gone (a server, a
            connection).  It is called on the producer thread before every
            step of the source and every row-source fetch, and on the
            training thread every 50 ms while ``next()`` waits; what it raises
            ends the epoch and reaches the training loop -- also when the
            source or a fetch failed first and the check fails right after
            (the failure is then its ``__cause__``; so raise a new exception
            object each time, and keep the check fast: a failure waits for
            it once more).  In a DistDGL
            client process (after ``dgl.distributed.initialize``) the loader
            also watches the connections to the DGL servers by itself
            (:mod:`pingpong.serverwatch`): a dead server raises
            :class:`~pingpong.errors.ServerGoneError`.
        sample_ahead: the producer takes batch k+1 from the source (samples it)
            *before* it hands batch k over, so that while the training step
            runs on batch k the producer is in batch k+1's row fetches and
            gather (waits for a server, kernels that release the GIL) rather
            than in sampling, which competes with the step for the GIL and
            the cores.  The price: batch k waits for batch k+1's sampling (the
            first batch comes one sampling later), and a source stuck at batch
            k+1 holds batch k back (``timeout=`` then counts from batch k).  A
            source that raises at k+1 still delivers batch k first.
            ``None`` (default): on when a feature or label table is a row
            source (e.g. a ``DistTensor``: its fetch is a wait), off for host
            tensors only.  ``loader.sample_ahead`` says which.
        producer_cpus: CPU ids the producer thread runs on (Linux,
            ``os.sched_setaffinity``), set by each epoch's producer as it
            starts; threads it starts inherit them, threads started before
            keep their own (a pool Numba already runs; the kernel warm-up
            thread the loader starts at construction, which inherits the
            constructing thread's).  By default (``None``) the producer
            keeps the affinity of the thread that starts the epoch.  For a
            training thread pinned to a core of its own (a small machine
            shared with DistDGL servers): without it the producer would
            inherit that single core.  ``ConfigError`` for an empty set,
            anything but ints >= 0, or a platform without
            ``os.sched_setaffinity``.  The OS decides the rest: it keeps
            the CPUs of the set the process's cgroup allows (not a
            ``taskset`` mask of another thread: the producer may get CPUs
            the training thread has not), and refuses a set with none of
            them -- the epoch then ends with its ``OSError``.
        producer_nice: how much each epoch's producer thread raises its own nice
            value (an int 0-19, capped at nice 19; Linux, where nice is per
            thread: the training thread keeps its priority, threads the
            producer starts inherit the new one).  A lower priority lets the
            training step's threads have the cores when they want them and
            gives the producer the gaps; where the data side is the longer one
            the training loop waits and the producer gets the cores anyway.
            Default (``None``): on the CPU 10, where the training step's torch
            threads use every core (a 2-core VM: ``train_sage.py``'s epochs
            went from slower than the plain loop to level with it; the
            guide); on
            CUDA 0 (not measured there); in a DistDGL client process 0
            (measured mixed).  ``loader.producer_nice`` says which,
            ``stats["niced_epochs"]`` how many epochs applied it.  Only ever
            raised: an unprivileged process cannot lower a nice value back.
            With a value above 0 (or ``producer_cpus``) the constructor starts
            Numba's threading layer, from a helper thread at the calling
            thread's priority (on ``producer_cpus`` if given), so that the
            process-wide pools of its ``workqueue`` and ``tbb`` layers do not
            inherit a producer's priority; under those layers pingpong's CPU
            gathers run on that pool, at the calling thread's priority (under
            ``omp``, pingpong's first choice wherever it loads, at the
            producer's).

    Batch lifetime: ``batch.x``/``batch.y`` are views into a slot, valid until
    the same iterator is asked for the next batch or a new epoch of the loader
    starts (ending an epoch early does not overwrite them); ``batch.clone()``
    keeps one.

    Raises (at construction): ``TableError`` for unusable tables,
    ``ConfigError``/``GatherModeUnavailable`` for bad arguments, ``ConfigError``
    (also a ``TypeError``) for a source that is not a re-iterable,
    ``IdRangeError`` for a DGL ``DataLoader`` whose seeds lie outside its
    graph; Numba's ``ValueError`` for a threading layer it cannot load
    (``NUMBA_THREADING_LAYER=tbb`` without tbb) where ``producer_nice`` or
    ``producer_cpus`` starts the layer (otherwise the first epoch raises it).
    """

    def __init__(
        self,
        source: Iterable[Any],
        features: torch.Tensor | np.ndarray | RowSource
        | Mapping[str, torch.Tensor | np.ndarray | RowSource],
        labels: torch.Tensor | np.ndarray | RowSource
        | Mapping[str, torch.Tensor | np.ndarray | RowSource] | None = None,
        *,
        device: str | torch.device | Device = "cpu",
        num_buffers: Count = 2,
        gather: str = "auto",
        timeout: float | None = None,
        gather_threads: Count | None = None,
        sampler_threads: Count | None = None,
        sort_ids: str = "auto",
        debug: bool = False,
        heterogeneous: bool = False,
        # keys: edge type names or canonical triples, checked at run time (a dict
        # literal mixing both is a Mapping[Sequence[str], ...] to a type checker)
        edge_labels: torch.Tensor | np.ndarray | RowSource
        | Mapping[Any, torch.Tensor | np.ndarray | RowSource] | None = None,
        form: FormCallable | None = None,
        cache_bytes: Count = 0,
        hot_ids: torch.Tensor | None = None,
        health_check: Callable[[], None] | None = None,
        sample_ahead: bool | None = None,
        producer_cpus: Iterable[int] | None = None,
        producer_nice: Count | None = None,
    ) -> None:
        # A given device is the loader's from this call on (see ``device``): if the
        # constructor raises, it is closed too, whatever refused.
        given_device = device if isinstance(device, Device) else None
        try:
            if not isinstance(source, Iterable):
                raise ConfigError(f"source must be iterable, got {type(source).__name__}")
            seeds = dgl_loader_seeds(source)  # a DistNodeDataLoader's before it is wrapped
            check_dgl_loader_seeds(source, seeds)
            # What another loader's iter() over it would end or reset: the DGL loader
            # itself, never the wrapper each loader builds around it below.
            shared_iterator_source = source if _shares_its_iterator(source) else None
            if isinstance(source, Iterator):
                restartable = restartable_dgl_loader(source)  # DistNodeDataLoader & co.
                if restartable is None:
                    raise ConfigError(
                        f"source is a one-shot iterator ({type(source).__name__}); pass a "
                        "re-iterable such as a DGL DataLoader or a list, since every epoch "
                        "iterates it again. A class of your own whose __iter__ resets it and "
                        "returns self counts as an iterator (it has __next__): give it an "
                        "__iter__ that returns a new iterator instead (a generator method), "
                        "and no __next__"
                    )
                source = restartable
            if (count := integer(num_buffers)) is None or count < 2:
                raise ConfigError(f"num_buffers must be an int >= 2, got {num_buffers!r}")
            num_buffers = count
            if timeout is not None and (
                isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                or not timeout > 0
            ):
                raise ConfigError(
                    f"timeout must be None or a positive number of seconds, got {timeout!r}"
                )
            if form is not None and not callable(form):
                raise ConfigError(
                    f"form must be a callable item -> (feature ids, label ids), got {form!r}"
                )
            if health_check is not None and not callable(health_check):
                raise ConfigError(f"health_check must be a callable, got {health_check!r}")
            if sample_ahead is not None and not isinstance(sample_ahead, bool):
                raise ConfigError(f"sample_ahead must be None, True or False, got {sample_ahead!r}")
            cpus = _cpu_set(producer_cpus)
            if sampler_threads is not None and (
                (threads := integer(sampler_threads)) is None or threads < 1
            ):
                raise ConfigError(
                    f"sampler_threads must be None or a positive int, got {sampler_threads!r}"
                )
            if producer_nice is not None and (
                (nice := integer(producer_nice)) is None or not 0 <= nice <= MAX_NICE
            ):
                raise ConfigError(
                    f"producer_nice must be None or an int from 0 to {MAX_NICE} (how much the "
                    f"producer thread raises its nice value), got {producer_nice!r}"
                )
            self._source = source
            self._store: FeatureStore = make_feature_store(
                features, labels, bool(heterogeneous), edge_labels
            )
            check_tables_against_graph(source, self._store, seeds, form=form is not None)
            self._sample_ahead = (any(isinstance(t, RemoteTable) for t in self._store.all_tables)
                                  if sample_ahead is None else sample_ahead)
            reader = ItemReader(self._store.label_kind, self._store.heterogeneous, form,
                                edge_label_keys(self._store))
            table_bytes = sum(t.nbytes_local for t in self._store.all_tables)
            self._device: Device = make_device(
                device, gather, gather_threads, sort_ids, table_bytes
            )
        except BaseException:
            if given_device is not None:
                given_device.close()
            raise
        watch: ServerWatch | None = None
        try:
            # In a DistDGL client the default is 0: the servers share the cores, and
            # +10 there was measured mixed (docs/distributed.rst).
            self._producer_nice = (
                int(producer_nice) if producer_nice is not None
                else 0 if has_dgl_client() else self._device.default_producer_nice
            )
            if self._producer_nice or cpus is not None:
                # Numba's process-wide pools at this thread's priority, the producer's CPUs
                start_threading_layer(cpus)
            self._cache = make_feature_cache(self._store, self._device, cache_bytes, hot_ids)
            self._device.attach(self._store)
            self._slots: list[Slot] = make_slots(
                self._store, num_buffers, self._device.initial_event
            )
            if self._cache is not None:
                self._cache.build_if_ready(self._device)  # hot_ids: before the first batch
            self._sampler_threads = (self._device.default_sampler_threads
                                     if sampler_threads is None else int(sampler_threads))
            # None unless this is a DistDGL client
            watch = self._server_watch = dgl_server_watch()
            self._stats = LoaderStats()
            self._timeout = None if timeout is None else float(timeout)
            self._debug = bool(debug)
            self._name = str(next(_loader_ids))
            self._new_epoch = self._epoch_factory(reader, cpus, health_check)
            self._shared_iterator_source = shared_iterator_source
            self._core = LoaderCore(self._device)
        except BaseException:
            # No finaliser exists yet to release them.
            if watch is not None:
                watch.close()
            self._device.close()
            raise
        self._finalizer = weakref.finalize(self, _close, self._core, self._server_watch)

    def _epoch_factory(self, reader: ItemReader, cpus: frozenset[int] | None,
                       health_check: Callable[[], None] | None) -> Callable[[], Epoch]:
        """What builds each epoch (:mod:`pingpong._lifecycle`).  The loader holds
        it, not the core: the finaliser holds the core, and this holds the
        user's objects (see :class:`~pingpong._lifecycle.LoaderCore`)."""
        health = _combine_checks(self._server_watch, health_check)
        new_epoch = functools.partial(
            Epoch,
            self._source,
            self._store,
            reader,
            self._device,
            self._slots,
            self._stats,
            self._timeout,
            self._name,
            debug=self._debug,
            cache=self._cache,
            health=health,
            # DGL's RPC client is one per process and not thread-safe: producers take turns
            rpc_lock=_rpc.lock_for_process(),
            sample_ahead=self._sample_ahead,
            producer_cpus=cpus,
            sampler_threads=self._sampler_threads,
            producer_nice=self._producer_nice,
        )
        cache, device = self._cache, self._device

        def start_epoch() -> Epoch:
            # The previous producer is retired by now: no fill runs during a build.
            if cache is not None:
                cache.build_if_ready(device)
            return new_epoch()

        return start_epoch

    # -- iteration -----------------------------------------------------------
    def __iter__(self) -> EpochIterator:
        """Start a new epoch.

        A previous epoch still running is ended first; its iterator then
        raises :class:`~pingpong.errors.EpochSupersededError` (a loader runs
        one epoch at a time).  The iterator keeps the loader alive.

        Returns once the epoch's producer thread has called ``iter(source)``
        (what that raised comes out of the first ``next()``), so every
        ``iter(loader)`` starts exactly one pass of the source, in order, as
        ``iter(source)`` in the plain loop would -- also one superseded or
        closed at once on the same thread.  The wait honours ``timeout=``
        (:class:`~pingpong.errors.BatchTimeoutError`), ``close()`` from
        another thread, ``health_check`` and Ctrl-C; it ends early (that pass may not start)
        when another thread supersedes this epoch, and is skipped inside
        :func:`pingpong.rpc_turn` for a loader that takes turns.
        """
        epoch = self._core.start_epoch(self._new_epoch, self._shared_iterator_source)
        epoch.wait_for_source_start()
        return EpochIterator(self, epoch)

    def __len__(self) -> int:
        """Batches per epoch: ``len(source)``; :class:`ConfigError` (a ``TypeError``)
        if the source has no length."""
        try:
            return len(self._source)  # type: ignore[arg-type]
        except TypeError as exc:
            # A source without __len__, or one whose __len__ says it has none (a
            # DataLoader over an IterableDataset) -- or a bug inside __len__: its
            # words are kept, and it is the cause.
            raise ConfigError(
                f"the source ({type(self._source).__name__}) has no len(), so neither "
                f"has the loader (len(source) raised TypeError: {exc})"
            ) from exc

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Stop the producer, release host registrations.  Idempotent, any thread.

        A ``next()`` waiting on another thread raises
        :class:`~pingpong.errors.LoaderClosedError` promptly.  A ``close()``
        interrupted (Ctrl-C while it joins the producer) is finished by the next.
        """
        # Not through the finaliser, which stays armed: if this close() is
        # interrupted and the loader then dropped, the garbage collector finishes it.
        _close(self._core, self._server_watch, finish_on_interrupt=False)

    @property
    def server_watch(self) -> ServerWatch | None:
        """The watch over DGL server connections (:mod:`pingpong.serverwatch`), if any."""
        return self._server_watch

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called (or the ``with`` block left); ``iter()``
        then raises :class:`LoaderClosedError`."""
        return self._core.closed

    def __enter__(self) -> PingPongLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device batches are delivered on."""
        return self._device.torch_device

    @property
    def gather_mode(self) -> str:
        """The gather mode in use (``auto`` resolved)."""
        return self._device.gather_mode

    @property
    def num_buffers(self) -> int:
        """How many slots the loader has (the ``num_buffers`` it was built with)."""
        return len(self._slots)

    @property
    def sample_ahead(self) -> bool:
        """Whether the producer samples batch k+1 before handing batch k over
        (``sample_ahead=None`` resolved)."""
        return self._sample_ahead

    @property
    def sampler_threads(self) -> int | None:
        """OpenMP threads DGL's sampler uses on the producer thread
        (``sampler_threads=None`` resolved; None: the count the thread started with)."""
        return self._sampler_threads

    @property
    def producer_nice(self) -> int:
        """How much each producer thread raises its nice value
        (``producer_nice=None`` resolved; 0: not at all)."""
        return self._producer_nice

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot of the loader's counters since creation or :meth:`reset_stats`.

        See :mod:`pingpong.stats` for every key.
        """
        cache = self._cache
        return self._stats.snapshot(
            slot_bytes=sum(slot.nbytes for slot in self._slots),
            slot_grows=sum(slot.grow_count for slot in self._slots),
            cache_rows=cache.cached_rows if cache is not None else 0,
        )

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after a warm-up epoch)."""
        self._stats.reset()

    def refresh_cache(self) -> None:
        """Copy the hot-row cache's rows from the feature table again when the next
        epoch starts (``iter(loader)``), before its first gather.

        The cache (``cache_bytes=``) is a copy made when it was built: writes to
        the table after that do not reach the cached rows, so batches would hold
        their old values there.  Write, call this, then start the epoch: the
        copy is enqueued in ``iter(loader)`` and runs after it returns, ahead of
        the epoch's gathers, so a write made during that epoch may reach the
        cached rows in part.  The same rows are cached; a copy that fails (the
        error comes from ``iter(loader)``) is tried again at the next
        ``iter()``.  No-op without a cache or before it was built.
        """
        if self._cache is not None:
            self._cache.refresh()

    def __repr__(self) -> str:
        return (
            f"PingPongLoader(device={str(self.device)!r}, gather={self.gather_mode!r}, "
            f"num_buffers={self.num_buffers}, closed={self.closed})"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Refuse ``pickle``, ``copy.copy`` and ``copy.deepcopy``: a loader owns its
        producer thread, slots and pinned memory, and a copy would share or lose them
        (:class:`ConfigError`, a ``TypeError``)."""
        raise ConfigError(
            "a PingPongLoader cannot be pickled or copied (it owns a producer thread, its "
            "slot buffers and, on CUDA, pinned memory): build one from the source and "
            "tables where it is used -- in each process, for torch.multiprocessing or "
            "DataLoader workers"
        )


def _cpu_set(cpus: Iterable[int] | None) -> frozenset[int] | None:
    """``producer_cpus`` checked: None, or a non-empty set of CPU ids (ints >= 0; which
    of them the OS allows is its to say, when the producer asks)."""
    if cpus is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("producer_cpus needs os.sched_setaffinity (Linux); this platform "
                          "has none")
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
        raise ConfigError(f"producer_cpus must be an iterable of CPU ids, got {cpus!r}")
    ids = list(cpus)
    bad = [c for c in ids if isinstance(c, bool) or not isinstance(c, numbers.Integral)
           or int(c) < 0]
    if bad or not ids:
        raise ConfigError(f"producer_cpus must be one or more CPU ids (ints >= 0), got {ids!r}")
    return frozenset(int(c) for c in ids)


def _shares_its_iterator(source: Any) -> bool:
    """Whether a new ``iter(source)`` ends or resets an iterator already open:

    - a torch (or DGL) ``DataLoader`` with ``persistent_workers=True`` and
      workers: its ``iter()`` resets and returns one iterator object;
    - a datapipe (``IterDataPipe``), or a ``DataLoader`` over one without
      workers (GraphBolt's ``gb.DataLoader``): one live iterator per datapipe
      -- the old one raises, or, behind GraphBolt's ``copy_to`` prefetcher,
      just stops -- and ``reset()`` rebinds state (a shuffle buffer) that the
      old one, woken inside a step, would write into.  With workers (not
      persistent) each pass sends its own copy of the datapipe to them;
    - an iterator whose ``iter()`` resets and returns itself (DGL's
      ``DistNodeDataLoader`` and ``DistDataLoader``, the only iterators a
      loader accepts).

    A ``num_workers`` that is not an int counts as none.
    """
    if isinstance(source, Iterator):
        return True
    workers = integer(getattr(source, "num_workers", 0)) or 0
    if workers > 0:
        return bool(getattr(source, "persistent_workers", False))
    return isinstance(source, IterDataPipe) or \
        isinstance(getattr(source, "dataset", None), IterDataPipe)


def _combine_checks(
    watch: ServerWatch | None, health_check: Callable[[], None] | None
) -> Callable[[], None] | None:
    """One callable running the server watch's check, then the user's."""
    checks = [c for c in (watch.check if watch is not None else None, health_check) if c]
    if not checks:
        return None
    if len(checks) == 1:
        return checks[0]

    def check_all() -> None:
        for check in checks:
            check()

    return check_all


def _close(core: LoaderCore, watch: ServerWatch | None,
           finish_on_interrupt: bool = True) -> None:
    """The loader's finaliser (and ``close()``): stop the lifecycle, then drop the
    watch's descriptors.  Idempotent.

    As the finaliser (``finish_on_interrupt``), a Ctrl-C in the close is let
    through only once a second close has finished it: run by the garbage
    collector, nothing would call ``close()`` again (Python prints and drops
    the exception), and the device stayed open.
    """
    try:
        try:
            core.close()
        except KeyboardInterrupt:
            if finish_on_interrupt and not core.fully_closed:
                core.close()
            raise
    finally:
        if watch is not None:
            watch.close()
