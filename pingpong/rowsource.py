"""Row sources: feature or label tables whose rows are fetched per batch, not a host tensor.

A **row source** is any object with

- ``shape`` -- a sequence of non-negative ints whose first entry is the
  number of rows ``N``;
- ``dtype`` -- a ``torch.dtype``;
- ``__getitem__(ids)`` -- given a 1-D int64 CPU tensor of ids in ``[0, N)``
  (a copy of the batch's ids, the source's to change), return a tensor of
  shape ``(len(ids), *shape[1:])`` and that dtype with the rows in that
  order, not requiring grad.

DGL's ``dgl.distributed.DistTensor`` is one: ``dist_tensor[ids]`` pulls the
rows from the servers that own them (rows of the local partition come out of
shared memory, without a copy over the network), and so is anything of the
user's own (a memory-mapped file, a key-value store, a compressed table...).
A plain ``torch.Tensor`` is not treated as a row source: it is a host table,
gathered in place by the kernels.

The producer thread fetches each batch's rows from a row source *before* it
takes a slot -- so a slow fetch overlaps training like sampling does, and a
stuck one never holds a slot (``close()`` waits for it at most 2 s) -- then copies them into
the slot (on CUDA through a pinned staging buffer on the copy stream; rows held
locally: see below).  Ids
are checked against ``N`` before any fetch, and a table with no ids in a batch
(a node type absent from it) is not asked at all; a fetch that raises reaches the
training loop with its original exception; a fetch that returns the wrong
shape or dtype, or rows that require grad (pingpong's copies are outside
autograd: such a source would never train), raises
:class:`~pingpong.errors.TableError`.

**One call at a time.**  pingpong calls a row source (and its ``part_policy``,
below) from one thread at a time, as a plain loop would -- also when several
loaders read it (``zip`` of two loaders, an evaluation loop nested in
training), while a loader over it is built (for at most 2 s:
:data:`CONSTRUCTION_TURN_WAIT_S`), and when a new epoch starts
while the last one's fetch is still stuck (the new fetch waits for it, under the
loader's ``timeout=``; an epoch that ends meanwhile makes no call): the calls
to one source object take turns.  So a source need not be thread-safe.  The
rows it returns are copied before its next call through the same loader (also
when it backs several of the loader's tables), but a call for another loader
may come first: return rows the source will not write again (a new tensor per
call, as indexing does).

**Rows held locally are read in place.**  A row source may say which of its
rows live in this process's memory, the way a ``DistTensor`` does:

- ``local_partition`` -- a C-contiguous CPU tensor (for DGL: the shared-memory
  table of this machine's partition) with the source's row shape and dtype;
- ``part_policy`` -- with ``part_id`` (this machine's partition),
  ``to_partid(ids)`` (the partition of each id) and ``to_local(ids)`` (the
  row of ``local_partition`` that holds each id of partition ``part_id``), all
  taking and returning 1-D integer tensors.  The partition's size must equal
  ``len(local_partition)``: the number of ids its partition book lists (see
  below), or, for a policy without one, ``get_part_size()`` if it has that.
  The book is asked once per table and loader.

For such a source a batch's ids are split: the rows of this machine's
partition are gathered by the positioned CPU kernel straight from
``local_partition`` into their places, and only the other ids are fetched
through ``source[ids]`` (none, if every row is local), their rows then
copied to their places.  On the CPU device "their places" are the slot's
rows; on CUDA they are the pinned staging buffer that the batch then goes
to the GPU from, in one upload per table (the shared-memory partition is not
pinned for the zero-copy kernel).  Local row numbers are
checked against ``len(local_partition)`` before the kernel reads anything.
The batch is bit for bit what ``source[ids]`` would have returned.

Where the local ids are one range, the split costs no call into the policy:
if ``part_policy.partition_book.partid2nids(part_id, part_policy.type_name)``
(``partid2eids`` for a policy whose ``is_node`` is False) returns the
consecutive ids ``a, a+1, ..., b-1`` -- DGL's ``RangePartitionBook`` does,
and every partition ``dgl.distributed.partition_graph`` writes is one -- and
the policy agrees at the range's edges (``to_partid`` of ``a`` and ``b-1`` is
``part_id``, of ``a-1`` and ``b`` is not; ``to_local`` maps ``a`` to row 0 and
``b-1`` to the last), the local ids are taken to be exactly ``[a, b)`` and
row ``id - a`` holds id ``id``, found with NumPy in the producer; otherwise
``to_partid``/``to_local`` are called per batch.

A source whose local part is missing, of another shape or dtype, not contiguous, or
inconsistent with its policy is fetched whole, as any other row source (the
reason is logged).  To opt out, pass an object that forwards ``shape``,
``dtype`` and ``__getitem__`` only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from . import _rpc
from ._integers import integer
from ._rpc import acquire
from .errors import TableError

if TYPE_CHECKING:
    from .store import HostTable

__all__ = [
    "FetchedRows", "LocalPart", "RemoteTable", "RowSource", "is_row_source", "make_remote_table",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class RowSource(Protocol):
    """The row-source protocol (see the module docstring), for type checkers."""

    @property
    def shape(self) -> Any:
        """``(N, *row_shape)``: N rows (ids ``0 .. N-1``), each of ``row_shape``."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows ``__getitem__`` returns."""
        ...

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor: ...


def is_row_source(value: Any) -> bool:
    """True for an object with ``shape``, ``dtype`` and ``__getitem__`` that is no tensor."""
    return (
        not isinstance(value, torch.Tensor | np.ndarray)
        and hasattr(value, "shape")
        and hasattr(value, "dtype")
        and callable(getattr(value, "__getitem__", None))
    )


#: No rows (int64): the local rows of a batch without any.
_NO_ROWS = np.empty(0, dtype=np.int64)


class FetchStopped(Exception):
    """Raised by :meth:`RemoteTable.fetch` when the epoch ended (``stop``) while the
    fetch waited for the source's call lock: the source was not called."""


@dataclass(frozen=True)
class LocalPart:
    """The rows of a row source held in this process's memory (see the module docstring).

    Attributes:
        table: ``local_partition`` as a validated host table (never copied).
        part_id: the partition whose rows it holds.
        policy: maps global ids to partitions and to rows of ``table``.
        id_range: ``(a, b)`` when the local ids are exactly ``a..b-1``, row ``id - a``
            holding ``id`` (:func:`local_id_range`); then ``policy`` is not called.
    """

    table: HostTable
    part_id: int
    policy: Any
    id_range: tuple[int, int] | None = None

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(positions, rows, others)``: which of ``ids`` (validated, int64) are local,
        the row of ``table`` holding each of them, and the positions of the rest.

        Raises:
            TableError: the policy maps an id to a row outside ``table`` --
                checked here, before any kernel reads ``table``.
        """
        if self.id_range is not None:
            return self._locate_in_range(ids)
        # A copy: ``ids`` also back the batch's input_nodes and every other table's
        # gather, checked already; a policy that changed its argument in place would
        # move those gathers past the check (as fetch's copy guards __getitem__).
        id_tensor = torch.tensor(ids)
        is_local = torch.as_tensor(self.policy.to_partid(id_tensor)) == self.part_id
        if is_local.shape != id_tensor.shape:
            raise TableError(
                f"{self.table.name}: part_policy.to_partid returned shape "
                f"{tuple(is_local.shape)} for {id_tensor.shape[0]} ids"
            )
        positions = torch.nonzero(is_local).reshape(-1)
        others = torch.nonzero(~is_local).reshape(-1).numpy()
        if positions.numel() == 0:
            return _NO_ROWS, _NO_ROWS, others
        # from ``ids``, not ``id_tensor``, which to_partid may have changed
        local = torch.as_tensor(self.policy.to_local(torch.from_numpy(ids[positions.numpy()])))
        rows: np.ndarray = local.to(torch.int64).reshape(-1).numpy()
        if rows.shape[0] != positions.shape[0]:
            raise TableError(
                f"{self.table.name}: part_policy.to_local returned {rows.shape[0]} rows for "
                f"{positions.shape[0]} ids"
            )
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= self.table.num_rows:
            bad = low if low < 0 else high
            raise TableError(
                f"{self.table.name}: part_policy.to_local maps an id of partition "
                f"{self.part_id} to row {bad}, outside its {self.table.num_rows} local rows"
            )
        return positions.numpy(), rows, others

    def _locate_in_range(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`locate` for local ids ``a..b-1`` (``id_range``): rows ``ids - a``,
        in ``[0, b - a)`` = the table's rows by construction."""
        assert self.id_range is not None
        start, stop = self.id_range
        is_local = (ids >= start) & (ids < stop)
        positions = np.flatnonzero(is_local)
        return positions, ids[positions] - start, np.flatnonzero(~is_local)


@dataclass(frozen=True)
class FetchedRows:
    """A batch's rows of one row source, before they go into the slot.

    ``rows`` came through ``source[ids]``: all of the batch's rows in order
    (``positions is None``), or only those not held locally, row ``k`` going to
    batch position ``positions[k]``. ``local_rows[k]`` of the local part goes to
    batch position ``local_positions[k]`` (both empty without a local part).
    """

    rows: torch.Tensor | None
    positions: np.ndarray | None
    local_rows: np.ndarray
    local_positions: np.ndarray


@dataclass(frozen=True)
class RemoteTable:
    """A validated row source (see the module docstring).

    Attributes:
        name: what the table is called in error messages.
        source: the user's object.
        num_rows, row_shape, dtype: from its ``shape`` and ``dtype``.
        local: the rows it holds in this process's memory, or None.
    """

    name: str
    source: Any
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    local: LocalPart | None = None
    #: taken around every call to ``source[ids]``: one per source object, shared
    #: by every loader that reads it (:func:`call_lock_for`)
    call_lock: threading.Lock = field(default_factory=threading.Lock, compare=False,
                                      repr=False)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes_local(self) -> int:
        """Bytes of it held in this process's memory by pingpong: none."""
        return 0

    def fetch_split(self, ids: np.ndarray, read_local: bool,
                    stop: threading.Event | None = None, poll_s: float = 0.05) -> FetchedRows:
        """The batch's rows at ``ids`` (validated): with ``read_local`` and a
        local part, only the others are fetched (see :class:`FetchedRows`).
        No ids: neither the source nor its policy is called.  The policy's calls
        take their turn with the source's (:meth:`turn`).

        Raises what :meth:`fetch` and :meth:`LocalPart.locate` raise.
        """
        if not read_local or self.local is None or len(ids) == 0:
            return FetchedRows(self.fetch(ids, stop, poll_s), None, _NO_ROWS, _NO_ROWS)
        ids = np.asarray(ids, dtype=np.int64)
        with self.turn(stop, poll_s):
            local_positions, local_rows, positions = self.local.locate(ids)
            # None: every row is local
            rows = self._call(ids[positions]) if len(positions) else None
        return FetchedRows(rows, positions, local_rows, local_positions)

    def fetch(self, ids: np.ndarray, stop: threading.Event | None = None,
              poll_s: float = 0.05) -> torch.Tensor:
        """The rows at ``ids`` (validated), as a contiguous CPU tensor; checks what came back.

        No ids: no call to the source (an empty result of the table's row shape).
        The call takes its turn (:meth:`turn`).

        Raises what the source raises; :class:`FetchStopped` when ``stop`` was set
        while waiting for the turn (the source was not called); and
        :class:`~pingpong.errors.TableError` for a result of the wrong type, shape,
        dtype or layout (sparse), one on the meta device, or one that requires grad.
        """
        if len(ids) == 0:  # a node type absent from a batch: no round trip for nothing
            return torch.empty((0, *self.row_shape), dtype=self.dtype)
        with self.turn(stop, poll_s):
            return self._call(ids)

    @contextlib.contextmanager
    def turn(self, stop: threading.Event | None = None,
             poll_s: float = 0.05) -> Iterator[None]:
        """Hold the source's call lock for the block: one call at a time per source
        object, its ``part_policy``'s included (module docstring).  While another
        call runs, waits for it, checking ``stop`` (if given) every ``poll_s`` s.

        Raises :class:`FetchStopped` once ``stop`` is set while waiting -- an ended
        epoch's producer waiting behind a stuck call leaves without calling.
        """
        if stop is None:
            self.call_lock.acquire()
        elif not acquire(self.call_lock, stop, poll_s):
            raise FetchStopped(self.name)
        elif stop.is_set():  # set while the lock came free
            self.call_lock.release()
            raise FetchStopped(self.name)
        try:
            yield
        finally:
            self.call_lock.release()

    def _call(self, ids: np.ndarray) -> torch.Tensor:
        """``source[ids]`` (at least one id; the caller has the :meth:`turn`), checked."""
        # A copy: a source that changes the ids it is given (global to local, in
        # place) must not change the batch's ids or the other tables' gathers.
        rows = self.source[torch.tensor(ids, dtype=torch.int64)]
        want = (len(ids), *self.row_shape)
        if not isinstance(rows, torch.Tensor):
            raise TableError(
                f"{self.name}[ids] returned {type(rows).__name__}, not a torch.Tensor"
            )
        if tuple(rows.shape) != want or rows.dtype != self.dtype:
            raise TableError(
                f"{self.name}[ids] returned shape {tuple(rows.shape)} {rows.dtype} for "
                f"{len(ids)} ids; expected {want} {self.dtype}"
            )
        if rows.layout != torch.strided or rows.is_meta:
            kind = "on the meta device, which holds no values" if rows.is_meta else \
                f"of layout {rows.layout}"
            raise TableError(
                f"{self.name}[ids] returned rows {kind}; a row source returns dense rows "
                "(rows.to_dense())"
            )
        if rows.requires_grad:
            raise TableError(
                f"{self.name}[ids] returned rows that require grad (looked up in an "
                "nn.Embedding, say): pingpong copies rows into its own buffers, outside "
                "autograd, so the source would never train.  A frozen source: return "
                "rows.detach() (or look up under torch.no_grad()).  A learnable one: "
                "look its rows up in the model, indexed with batch.input_nodes"
            )
        if rows.device.type != "cpu":
            rows = rows.cpu()
        # A lazily conjugated or negated view holds other bits than its values:
        # the values, as source[ids] means them.
        return rows.resolve_conj().resolve_neg().contiguous()


def _row_source_shape(shape: Any, name: str) -> tuple[int, ...]:
    """A row source's ``shape`` as a tuple of Python ints; ``TableError`` for anything
    but a sequence of non-negative integers (NumPy's and ``torch.Size``'s included)."""
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    sizes = None if dims is None else [_dimension(d) for d in dims]
    if sizes is None or any(size is None or size < 0 for size in sizes):
        raise TableError(
            f"{name}.shape must be a sequence of non-negative ints, rows first; got {shape!r}"
        )
    return tuple(size for size in sizes if size is not None)


def _dimension(value: Any) -> int | None:
    """A shape entry as an int: an integer (NumPy's too) or what has ``__index__``
    (a 0-d integer tensor); None for anything else (a float, even 4.0)."""
    if (number := integer(value)) is not None:
        return number
    if isinstance(value, bool | float) or not hasattr(value, "__index__"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


def make_remote_table(value: Any, name: str) -> RemoteTable:
    """Validate a row source (``TableError`` naming what is wrong), with its local part
    (:func:`find_local_part`) if it has a usable one."""
    shape = _row_source_shape(value.shape, name)
    dtype = value.dtype
    if not isinstance(dtype, torch.dtype):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise TableError(
            f"{name} is a {kind}, neither a torch tensor nor a NumPy array; an object "
            f"with shape, dtype and [ids] is read as a row source, whose dtype must be a "
            f"torch.dtype, and this one's is {dtype!r}.  A SciPy sparse matrix, an h5py "
            f"or zarr array: give a dense tensor or array instead (for example "
            f"torch.from_numpy(x.toarray()) or np.asarray(x)), or wrap it in a row "
            f"source (docs: 'Row sources')"
        )
    if dtype in _QUANTIZED:
        raise TableError(
            f"{name} is a row source of quantized rows ({dtype}), whose values are their "
            f"integers with a scale and zero point pingpong would not carry over; give "
            f"rows of their integer representation (and dequantize in the model) or "
            f"dequantized rows"
        )
    if len(shape) < 1:
        raise TableError(f"{name} must have at least 1 dimension (rows), got shape {shape}")
    if shape[0] == 0 or math.prod(shape) == 0:
        raise TableError(f"{name} is empty (shape {shape})")
    table = RemoteTable(name, value, shape[0], shape[1:], dtype, call_lock=call_lock_for(value))
    local = find_local_part(table)
    return table if local is None else replace(table, local=local)


#: The call lock of each row source object alive, by ``id()`` (see :func:`call_lock_for`).
_call_locks: dict[int, threading.Lock] = {}
_call_locks_lock = threading.Lock()


def call_lock_for(source: Any) -> threading.Lock:
    """The one lock around calls to ``source[ids]``, shared by every loader that reads
    ``source``.  Kept while ``source`` lives (a source that takes no weak reference:
    for the process, and an object later given its ``id()`` shares it -- harmless,
    it only takes turns with nothing)."""
    key = id(source)
    with _call_locks_lock:
        lock = _call_locks.get(key)
        if lock is not None:
            return lock
        lock = _call_locks[key] = threading.Lock()
    with contextlib.suppress(TypeError):  # TypeError: no weak references to it
        weakref.finalize(source, _forget_call_lock, key, lock)
    return lock


def _forget_call_lock(key: int, lock: threading.Lock) -> None:
    """The finaliser of a row source: drop its lock.  Takes no lock -- the garbage
    collector may run it inside :func:`call_lock_for` on the same thread -- and
    needs none: no other object has this ``id()`` until the source is freed."""
    if _call_locks.get(key) is lock:
        _call_locks.pop(key, None)


def find_local_part(table: RemoteTable) -> LocalPart | None:
    """The source's ``local_partition`` and ``part_policy`` as a :class:`LocalPart`, or
    None -- logging why -- when it has none or one pingpong cannot read in place."""
    from .store import make_host_table  # store imports this module

    source = table.source
    names = ("local_partition", "part_policy")
    if not all(name in dir(source) for name in names):  # dir(): no property runs
        return None
    try:
        with _turn_at_construction(table):
            rows, policy = source.local_partition, source.part_policy
            problem, book_ids = _local_part_problem(table, rows, policy), None
            if problem is None:  # then ask the book, once: DGL builds an arange of the ids
                book_ids = partition_book_ids(policy)
                problem = _size_problem(policy, rows.shape[0], book_ids)
            if problem is None:
                id_range = (None if book_ids is None
                            else local_id_range(policy, rows.shape[0], table.num_rows,
                                                book_ids))
                return LocalPart(make_host_table(rows, f"{table.name}.local_partition"),
                                 int(policy.part_id), policy, id_range)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the rows are fetched instead
        problem = f"reading it raised {exc!r}"
    logger.info("pingpong: %s: rows of the local partition are fetched like the "
                "others, not read in place: %s", table.name, problem)
    return None


#: How long building a loader waits for a row source's turn (:func:`find_local_part`).
CONSTRUCTION_TURN_WAIT_S = 2.0


@contextlib.contextmanager
def _turn_at_construction(table: RemoteTable) -> Iterator[None]:
    """Take the source's turn for the block -- in a DistDGL client after the RPC
    turn, the producers' order -- so that reading its local part and asking its
    policy take turns with the loaders already calling them.  Each is waited for
    at most :data:`CONSTRUCTION_TURN_WAIT_S`: past that (a call stuck in the
    source, a server gone) the block runs without it, logged, rather than the
    constructor hanging."""
    with _rpc.turn_within(CONSTRUCTION_TURN_WAIT_S) as have_rpc_turn:
        if have_rpc_turn and table.call_lock.acquire(timeout=CONSTRUCTION_TURN_WAIT_S):
            try:
                yield
            finally:
                table.call_lock.release()
            return
        logger.warning(
            "pingpong: %s: another call to the row source (or to DGL's RPC client) has "
            "run for over %.0f s; reading its local part without waiting for it",
            table.name, CONSTRUCTION_TURN_WAIT_S)
        yield


def _local_part_problem(table: RemoteTable, rows: Any, policy: Any) -> str | None:
    """Why ``rows``/``policy`` cannot serve ``table``'s local rows in place, or None."""
    if not isinstance(rows, torch.Tensor):
        return f"local_partition is a {type(rows).__name__}, not a torch.Tensor"
    if rows.device.type != "cpu" or rows.layout != torch.strided:
        return f"local_partition is not a dense CPU tensor ({rows.device}, {rows.layout})"
    if tuple(rows.shape[1:]) != table.row_shape or rows.dtype != table.dtype:
        return (f"local_partition has rows {tuple(rows.shape[1:])} {rows.dtype}, the table "
                f"{table.row_shape} {table.dtype}")
    if rows.shape[0] == 0:
        return "local_partition is empty"
    if not rows.is_contiguous():
        return "local_partition is not contiguous"
    if not all(callable(getattr(policy, f, None)) for f in ("to_partid", "to_local")):
        return "part_policy has no to_partid/to_local"
    return None


def _size_problem(policy: Any, num_rows: int, book_ids: torch.Tensor | None) -> str | None:
    """Why a local partition of ``num_rows`` rows does not match ``policy``, or None.

    The partition's size is the number of ids its partition book lists
    (``book_ids``), or, without a book, ``get_part_size()`` if the policy has one --
    DGL's ``get_part_size`` asks the book, so it is not asked twice.
    """
    if book_ids is not None:
        if len(book_ids) != num_rows:
            return (f"part_policy.partition_book lists {len(book_ids)} ids for partition "
                    f"{policy.part_id}, local_partition has {num_rows} rows")
        return None
    size = getattr(policy, "get_part_size", None)
    if callable(size) and int(size()) != num_rows:
        return (f"part_policy.get_part_size() is {int(size())}, local_partition has "
                f"{num_rows} rows")
    return None


def partition_book_ids(policy: Any) -> torch.Tensor | None:
    """The ids ``policy.partition_book`` lists for the policy's partition
    (``partid2nids``, or ``partid2eids`` when ``is_node`` is False), as a 1-D tensor;
    None when the policy has no such book or asking raised (logged at debug level)."""
    try:
        book = policy.partition_book
        ids_of = book.partid2nids if policy.is_node else book.partid2eids
        return torch.as_tensor(ids_of(policy.part_id, policy.type_name)).reshape(-1)
    except Exception as exc:  # noqa: BLE001 - then there is no range, nor a size from it
        logger.debug("pingpong: part_policy's partition book gives no ids (%r)", exc)
        return None


def local_id_range(policy: Any, num_local: int, num_ids: int,
                   book_ids: torch.Tensor | None = None) -> tuple[int, int] | None:
    """``(a, b)`` if the local ids of ``policy`` are exactly ``a..b-1``, row ``id - a``
    holding ``id`` -- the policy's partition book says so, and the policy agrees at
    the range's edges (see the module docstring) -- else None (also when asking raised).

    ``book_ids``: what :func:`partition_book_ids` returned, if the caller has it
    (the book is asked otherwise).
    """
    ids = partition_book_ids(policy) if book_ids is None else book_ids
    if ids is None:
        return None
    try:
        if len(ids) != num_local or num_local == 0:
            return None
        start, stop = int(ids[0]), int(ids[-1]) + 1
        if stop - start != num_local or not _consecutive(ids):
            return None
        part_id = int(policy.part_id)
        inside = torch.tensor([start, stop - 1])
        outside = [i for i in (start - 1, stop) if 0 <= i < num_ids]
        agrees = (
            _as_list(policy.to_partid(inside)) == [part_id, part_id]
            and (not outside or part_id not in _as_list(policy.to_partid(torch.tensor(outside))))
            and _as_list(policy.to_local(inside)) == [0, num_local - 1]
        )
    except Exception as exc:  # noqa: BLE001 - the policy is called per batch instead
        logger.debug("pingpong: no local id range (%r); asking part_policy per batch", exc)
        return None
    return (start, stop) if agrees else None


def _as_list(values: Any) -> list[int]:
    """A policy's answer (a tensor or array of ints) as a flat list."""
    return [int(v) for v in torch.as_tensor(values).reshape(-1).tolist()]


#: Ids per step of :func:`_consecutive` (its temporaries stay this small).
_CHECK_CHUNK = 1 << 20


def _consecutive(ids: torch.Tensor) -> bool:
    """Whether each id is the one before plus 1, checked chunk by chunk (a partition
    may hold hundreds of millions of ids: no temporary of their size)."""
    for lo in range(0, len(ids) - 1, _CHECK_CHUNK):
        chunk = ids[lo:lo + _CHECK_CHUNK + 1]
        if not bool((chunk[1:] - chunk[:-1] == 1).all()):
            return False
    return True

