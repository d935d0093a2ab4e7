"""Row sources (``pingpong.rowsource``): tables whose rows are fetched, not read in place.

A row source of the user's own -- the protocol ``shape``, ``dtype``,
``__getitem__(ids)`` -- stands for a ``DistTensor`` here (the DistDGL tests
use the real one).  Every batch is compared bit for bit with the reference;
bad ids are refused before any fetch; a failing fetch reaches the training
loop with its own exception; a stuck one honours ``timeout=``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import wait_until
from test_reliability import (
    CUDA_MODE_KINDS,
    Expected,
    SeqSource,
    Verifier,
    loader_device,
    make_table,
    seq_triples,
)
from test_reliability_lifecycle import producer_threads

import pingpong
from pingpong import PingPongLoader, _lifecycle, _rpc, rowsource

N = 400


class Rows:
    """A row source backed by a tensor it never lends out; counts and can break fetches."""

    def __init__(self, table: torch.Tensor) -> None:
        self._table = table.clone()
        self.shape = tuple(table.shape)
        self.dtype = table.dtype
        self.fetches: list[int] = []
        self.fail_at: int | None = None
        self.gate: threading.Event | None = None
        self.result_dtype: torch.dtype | None = None

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.dtype == torch.int64
        assert ids.dim() == 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail_at is not None and len(self.fetches) == self.fail_at:
            raise ConnectionError("server 1 is gone")
        self.fetches.append(len(ids))
        rows = self._table[ids]
        return rows if self.result_dtype is None else rows.to(self.result_dtype)


@pytest.mark.parametrize("device_kind", ["cpu", "fake", *CUDA_MODE_KINDS])
def test_row_source_features_and_labels_are_bit_identical(device_kind):
    triples = seq_triples(N, 12)
    features, labels = make_table(N, (5,)), make_table(N, (), torch.int64)
    where = loader_device(device_kind, seed=7)
    verifier = Verifier(where["device"], Expected(features, labels, triples))
    with PingPongLoader(SeqSource(triples), Rows(features), Rows(labels), **where) as loader:
        for _ in range(2):
            for batch in loader:
                verifier.submit(batch)
        verifier.resolve()
        assert loader.stats["fetch_s"] > 0
    assert (verifier.checked, verifier.corrupted) == (24, 0)


def ids_of_every_layout() -> list[tuple[Any, Any, dict[str, int]]]:
    """Triples whose ids come in the layouts users hand over: a reversed NumPy view
    (negative stride, which ``torch.from_numpy`` refuses), a read-only array (which
    it warns about), a strided tensor view, int32 -- inputs and outputs alike."""
    base = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    frozen = base.numpy()[:40].copy()
    frozen.flags.writeable = False
    return [
        (base.numpy()[::-1][:50], base.numpy()[200:180:-1], {"seq": 0}),
        (frozen, frozen[:9], {"seq": 1}),
        (base[::3], base[1::7][:16], {"seq": 2}),
        (base.to(torch.int32).numpy()[::-2], base.to(torch.int32)[:5], {"seq": 3}),
    ]


def dense_ids(ids: Any) -> torch.Tensor:
    """``ids`` as a contiguous int64 tensor (a copy; any layout)."""
    return torch.tensor(ids.tolist(), dtype=torch.int64)


@pytest.mark.parametrize("device_kind", ["cpu", "fake", *CUDA_MODE_KINDS])
def test_row_sources_take_ids_of_every_layout(device_kind):
    triples = ids_of_every_layout()
    features, labels = make_table(N, (5,)), make_table(N, (), torch.int64)
    dense = [(dense_ids(i), dense_ids(o), b) for i, o, b in triples]
    where = loader_device(device_kind, seed=5)
    verifier = Verifier(where["device"], Expected(features, labels, dense))
    with PingPongLoader(triples, Rows(features), Rows(labels), **where) as loader:
        for batch in loader:
            verifier.submit(batch)
        verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (4, 0)


def test_row_sources_mix_with_host_tables_in_a_dict():
    triples = seq_triples(N, 6)
    host, remote = make_table(N, (3,)), make_table(N, (2,), torch.float64)
    source = Rows(remote)
    with PingPongLoader(SeqSource(triples, shuffle=False), {"host": host, "remote": source}) \
            as loader:
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x["host"], host[inputs])
            assert torch.equal(batch.x["remote"], remote[inputs])
    assert source.fetches == [len(t[0]) for t in triples]


def test_heterogeneous_row_sources():
    features = {"paper": make_table(50, (4,)), "author": make_table(30, (2,))}
    items = [({"paper": torch.arange(10), "author": torch.arange(5)},
              {"paper": torch.arange(3)}, None)]
    labels = {"paper": make_table(50, (), torch.int64)}
    with PingPongLoader(items, {k: Rows(v) for k, v in features.items()},
                        {"paper": Rows(labels["paper"])}, heterogeneous=True) as loader:
        batch = next(iter(loader))
    assert torch.equal(batch.x["paper"], features["paper"][:10])
    assert torch.equal(batch.x["author"], features["author"][:5])
    assert torch.equal(batch.y["paper"], labels["paper"][:3])


@pytest.mark.parametrize("device_kind", ["cpu", *CUDA_MODE_KINDS])
def test_a_node_type_absent_from_a_batch_is_not_fetched(device_kind):
    """DGL leaves out of a batch the node types it did not sample: their row sources
    are not asked for zero rows (for a DistTensor: no round trip for nothing).  (Not on
    the fake device: its batches are read through the Verifier, which takes one id
    tensor per batch.)"""
    features = {"paper": make_table(50, (4,)), "author": make_table(30, (2,))}
    labels = {"paper": make_table(50, (), torch.int64), "author": make_table(30, (), torch.int64)}
    items = [({"paper": torch.arange(10)}, {"paper": torch.arange(3)}, None),
             ({"paper": torch.arange(4), "author": torch.arange(7)}, {"author": torch.arange(2)},
              None)]
    x_sources = {k: Rows(v) for k, v in features.items()}
    y_sources = {k: Rows(v) for k, v in labels.items()}
    with PingPongLoader(items, x_sources, y_sources, heterogeneous=True,
                        **loader_device(device_kind, seed=2)) as loader:
        batches = [({k: v.cpu() for k, v in batch.x.items()},
                    {k: v.cpu() for k, v in batch.y.items()}) for batch in loader]
    for (x, y), (inputs, outputs, _) in zip(batches, items, strict=True):
        for ntype in features:
            want = inputs.get(ntype, torch.empty(0, dtype=torch.int64))
            assert torch.equal(x[ntype], features[ntype][want])
            want = outputs.get(ntype, torch.empty(0, dtype=torch.int64))
            assert torch.equal(y[ntype], labels[ntype][want])
    assert [x_sources[k].fetches for k in features] == [[10, 4], [7]]
    assert [y_sources[k].fetches for k in labels] == [[3], [2]]


def test_bad_ids_are_refused_before_any_fetch():
    source = Rows(make_table(N, (2,)))
    items = [(torch.arange(5), torch.arange(1), None), (torch.tensor([1, N]), torch.arange(1),
                                                       None)]
    with PingPongLoader(items, source) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(pingpong.IdRangeError, match=f"= {N}"):
            next(it)
    assert source.fetches == [5]  # the bad batch fetched nothing


def test_a_failing_fetch_reaches_the_training_loop_with_its_own_exception():
    source = Rows(make_table(N, (2,)))
    source.fail_at = 2
    triples = seq_triples(N, 5)
    with PingPongLoader(triples, source) as loader:
        it = iter(loader)
        for inputs, _outputs, _blocks in triples[:2]:  # the batches before it, intact
            assert torch.equal(next(it).x, source._table[inputs])
        with pytest.raises(ConnectionError, match="server 1 is gone") as info:
            next(it)
        assert "pingpong thread" in "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(pingpong.EpochFailedError, match="server 1 is gone"):
            next(it)


def test_a_stuck_fetch_honours_timeout_and_close_does_not_wait_for_it():
    """The fetch stays stuck (up to 30 s) through the timeout and the close: each
    returns within its bound, and the producer leaves once the fetch returns."""
    source = Rows(make_table(N, (2,)))
    triples = seq_triples(N, 5)
    loader = PingPongLoader(triples, source, timeout=0.5)
    try:
        it = iter(loader)
        assert torch.equal(next(it).x, source._table[triples[0][0]])
        source.gate = threading.Event()  # the next fetches hang
        start = time.monotonic()
        with pytest.raises(pingpong.BatchTimeoutError):
            for _ in range(5):
                next(it)
        assert time.monotonic() - start < 0.5 + 1.5
        start = time.monotonic()
        loader.close()  # the fetch is still stuck
        assert time.monotonic() - start < _lifecycle.JOIN_TIMEOUT_S + 1.5
        assert producer_threads()  # ... inside the source, which close() did not wait for
    finally:
        if source.gate is not None:
            source.gate.set()
        loader.close()
    assert wait_until(lambda: not producer_threads(), 10.0)


def test_conjugated_rows_from_a_source_arrive_as_their_values():
    """``source[ids]`` may be a lazy view (``.conj()``): the batch holds its values."""
    table = torch.complex(make_table(N, (3,)), make_table(N, (3,)).flip(0))

    class Conjugating:
        shape, dtype = tuple(table.shape), table.dtype

        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            return table[ids].conj()

    triples = seq_triples(N, 3)
    with PingPongLoader(triples, Conjugating()) as loader:
        for batch, (ids, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, table[ids].conj())
            assert not batch.x.is_conj()


def test_a_fetch_of_the_wrong_dtype_is_a_table_error():
    source = Rows(make_table(N, (2,)))
    source.result_dtype = torch.float64
    with PingPongLoader(seq_triples(N, 2), source) as loader:
        with pytest.raises(pingpong.TableError, match=r"expected .* torch\.float32"):
            next(iter(loader))


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (type("NoDtype", (), {"shape": (3, 2), "dtype": "float32",
                              "__getitem__": lambda self, i: None})(), "torch.dtype"),
        (type("Empty", (), {"shape": (0, 2), "dtype": torch.float32,
                            "__getitem__": lambda self, i: None})(), "empty"),
        (type("IntShape", (), {"shape": 3, "dtype": torch.float32,
                               "__getitem__": lambda self, i: None})(), "sequence of non-neg"),
        (type("NegativeWidth", (), {"shape": (100, -1), "dtype": torch.float32,
                                    "__getitem__": lambda self, i: None})(), r"\(100, -1\)"),
        (type("NegativeRows", (), {"shape": (-100, 4), "dtype": torch.float32,
                                   "__getitem__": lambda self, i: None})(), r"\(-100, 4\)"),
        (type("FloatWidth", (), {"shape": (100, 4.7), "dtype": torch.float32,
                                 "__getitem__": lambda self, i: None})(), r"\(100, 4\.7\)"),
        (type("WholeFloatWidth", (), {"shape": (100, 4.0), "dtype": torch.float32,
                                      "__getitem__": lambda self, i: None})(), r"\(100, 4\.0\)"),
        (type("BoolWidth", (), {"shape": (100, True), "dtype": torch.float32,
                                "__getitem__": lambda self, i: None})(), r"\(100, True\)"),
        (type("ZeroWidth", (), {"shape": (100, 0), "dtype": torch.float32,
                                "__getitem__": lambda self, i: None})(),
         r"features is empty \(shape \(100, 0\)\)"),
        (type("Quantized", (), {"shape": (100, 4), "dtype": torch.qint8,
                                "__getitem__": lambda self, i: None})(),
         r"row source of quantized rows \(torch.qint8\)"),
    ],
    ids=["dtype-not-torch", "empty", "int-shape", "negative-width", "negative-rows",
         "float-width", "whole-float-width", "bool-width", "zero-width", "quantized"],
)
def test_bad_row_sources_are_refused_at_construction(bad: Any, needle: str):
    with pytest.raises(pingpong.TableError, match=needle):
        PingPongLoader([], bad)


@pytest.mark.parametrize(("attributes", "missing"), [
    ({"__len__": lambda self: 3}, "shape or dtype"),
    ({"shape": (3, 2)}, "dtype"),
    ({"dtype": torch.float32}, "shape"),
], ids=["len-only", "no-dtype", "no-shape"])
def test_a_would_be_row_source_is_told_what_it_lacks(attributes: dict[str, Any], missing: str):
    """From a row-source review: an object with ``__getitem__`` (and a length) but
    no ``shape``/``dtype`` got "features must be a torch.Tensor", which says
    nothing of row sources."""
    bad = type("Rowish", (), {"__getitem__": lambda self, ids: None, **attributes})()
    with pytest.raises(pingpong.TableError,
                       match=rf"Rowish has __getitem__ but no {missing}: a row source"):
        PingPongLoader([], bad)


def test_a_list_of_rows_is_told_to_be_a_tensor():
    with pytest.raises(pingpong.TableError, match=r"must be a torch.Tensor, got list$"):
        PingPongLoader([], [[1.0, 2.0], [3.0, 4.0]])  # type: ignore[arg-type]


@pytest.mark.parametrize(("make_rows", "needle"), [
    (lambda rows: rows.to_sparse(), r"returned rows of layout torch.sparse_coo"),
    (lambda rows: torch.empty(rows.shape, device="meta"), r"returned rows on the meta device"),
], ids=["sparse", "meta"])
def test_rows_that_are_not_dense_host_values_are_a_table_error(make_rows: Any, needle: str):
    """They reached torch's own errors (RuntimeError, NotImplementedError)."""
    table = make_table(N, (3,))

    class OddRows(Rows):
        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            return make_rows(super().__getitem__(ids))

    with PingPongLoader(seq_triples(N, 2), OddRows(table)) as loader:
        with pytest.raises(pingpong.TableError, match=rf"features\[ids\] {needle}"):
            next(iter(loader))


def test_a_numpy_shape_is_read_as_ints():
    """A source reporting ``shape`` entries as NumPy integers (a memmap's, say) or 0-d
    integer tensors works."""
    table = make_table(N, (3,))
    source: Any = Rows(table)
    source.shape = (np.int64(table.shape[0]), torch.tensor(table.shape[1]))  # 0-d tensor
    triples = seq_triples(N, 2)
    with PingPongLoader(SeqSource(triples, shuffle=False), source) as loader:
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, table[inputs])


class RowsNeedingGrad(Rows):
    """Rows looked up in a learnable embedding: they require grad."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        self.embedding = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


def test_rows_that_require_grad_are_refused():
    """pingpong copies fetched rows outside autograd: a source whose rows need grad
    would never train, so its first fetch is a TableError (it used to be detached)."""
    with PingPongLoader(seq_triples(N, 2), RowsNeedingGrad(make_table(N, (4,)))) as loader:
        with pytest.raises(pingpong.TableError, match=r"features\[ids\] returned rows that "
                                                      r"require grad.*rows\.detach\(\)"):
            next(iter(loader))


class RewritesIds(Rows):
    """A source that turns the ids it is given into its own, in place."""

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().__getitem__(ids)
        ids.zero_()
        return rows


def test_a_source_that_changes_its_ids_changes_nothing_else():
    """The source gets a copy of the ids: rewriting them in place leaves the batch's
    ids and the other tables' rows as they were (int64 ids were shared before)."""
    host, remote = make_table(N, (3,)), make_table(N, (2,))
    triples = [(torch.arange(10, 20), torch.arange(10, 14), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False),
                        {"remote": RewritesIds(remote), "host": host}) as loader:
        batch = next(iter(loader))
        assert torch.equal(batch.input_nodes, torch.arange(10, 20))
        assert torch.equal(batch.x["remote"], remote[10:20])
        assert torch.equal(batch.x["host"], host[10:20])


class ScratchRows:
    """A row source that is not thread-safe: it builds each result in one scratch
    buffer (then returns a copy), and counts calls inside it at once."""

    def __init__(self, table: torch.Tensor) -> None:
        self._table = table
        self.shape = tuple(table.shape)
        self.dtype = table.dtype
        self._scratch = torch.empty_like(table)
        self._inside = 0
        self.most_inside = 0
        self.calls = 0
        self.gate: threading.Event | None = None

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self._inside += 1
        self.most_inside = max(self.most_inside, self._inside)
        try:
            if self.gate is not None:
                self.gate.wait(30)
            scratch = self._scratch[:len(ids)]
            torch.index_select(self._table, 0, ids, out=scratch)
            time.sleep(0.002)  # another call overwriting the scratch now corrupts this one
            return scratch.clone()
        finally:
            self._inside -= 1


@contextlib.contextmanager
def stuck_fetch(source: ScratchRows) -> Iterator[PingPongLoader]:
    """A loader over ``source`` whose first fetch is stuck inside it, past the
    loader's ``timeout=`` (1 s), until ``source.gate`` is set."""
    source.gate = threading.Event()
    with PingPongLoader(seq_triples(N, 4), source, timeout=1.0) as stuck:
        with pytest.raises(pingpong.BatchTimeoutError):
            next(iter(stuck))
        yield stuck


def test_a_loader_started_while_a_fetch_is_stuck_waits_for_it():
    """A fetch of one loader stuck past its ``timeout=``: another loader over the
    same source, started then, waits for that call to return rather than calling
    the source alongside it, and everything it delivers is exact."""
    table = make_table()
    source = ScratchRows(table)
    with stuck_fetch(source), \
            PingPongLoader(seq_triples(N, 4, seed=3), source, timeout=30) as later:
        assert source.gate is not None
        threading.Timer(2.0, source.gate.set).start()  # the stuck call returns later
        exact = [torch.equal(b.x, table[b.input_nodes]) for b in later]
    assert exact == [True] * 4
    assert source.most_inside == 1


def test_an_epoch_ended_while_its_fetch_waits_for_a_stuck_call_makes_no_call():
    """An epoch whose producer waits for the source's call lock (another loader's
    fetch is stuck) and then ends -- its ``timeout=``, then ``close()`` -- leaves
    without calling the source once the stuck call returns (it made one more call,
    for an epoch no one would read)."""
    table = make_table()
    source = ScratchRows(table)
    with stuck_fetch(source) as stuck, \
            PingPongLoader(seq_triples(N, 4, seed=3), source, timeout=1.0) as waiting:
        assert source.gate is not None
        with pytest.raises(pingpong.BatchTimeoutError):
            next(iter(waiting))  # its producer waits behind the stuck call
        waiting.close()
        source.gate.set()  # the stuck call returns
        stuck.close()
    assert wait_until(lambda: not producer_threads(), 10.0)
    assert source.calls == 1


def test_a_fetch_for_an_ended_epoch_does_not_call_the_source():
    """``stop`` already set when the call lock is free (it came free as the epoch
    ended): no call, and the lock is given back."""
    source = ScratchRows(make_table())
    table = rowsource.make_remote_table(source, "features")
    stop = threading.Event()
    stop.set()
    with pytest.raises(rowsource.FetchStopped):
        table.fetch(np.arange(3), stop, poll_s=0.01)
    assert source.calls == 0
    assert not table.call_lock.locked()
    assert torch.equal(table.fetch(np.arange(3)), source._table[:3])  # no stop: a call


def test_a_row_source_freed_while_the_lock_registry_is_held_does_not_deadlock():
    """From a self-review: the finaliser that drops a freed row source's call lock
    took the registry's lock, and the garbage collector can run it on a thread
    already holding that lock (an allocation inside ``call_lock_for`` while an
    earlier source sat in a reference cycle): that thread hung for ever."""

    source: Rows | None = Rows(make_table())
    key = id(source)
    rowsource.call_lock_for(source)
    finished = threading.Event()

    def free_it_holding_the_registry() -> None:
        nonlocal source
        with rowsource._call_locks_lock:  # as inside call_lock_for
            source = None  # its finaliser runs now, on this thread
        finished.set()

    threading.Thread(target=free_it_holding_the_registry, daemon=True).start()
    assert finished.wait(10), "the finaliser deadlocked on the registry's lock"
    assert key not in rowsource._call_locks


class ScratchPolicy:
    """A ``part_policy`` that is not thread-safe: ``to_local`` builds its answer in
    one scratch buffer (then returns a copy), and counts calls inside it at once.
    Partition 0 -- this process's -- holds the even ids."""

    def __init__(self, num_rows: int) -> None:
        self.part_id = 0
        self._local_row = torch.full((num_rows,), -1, dtype=torch.int64)
        self._local_row[0::2] = torch.arange((num_rows + 1) // 2)
        self._scratch = torch.empty(num_rows, dtype=torch.int64)
        self._inside = 0
        self.most_inside = 0

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        self._inside += 1
        self.most_inside = max(self.most_inside, self._inside)
        try:
            yield
        finally:
            self._inside -= 1

    def get_part_size(self) -> int:
        with self._counted():
            time.sleep(0.002)
            return int((self._local_row >= 0).sum())

    def to_partid(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(self._local_row[ids] >= 0, 0, 1)

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        with self._counted():
            scratch = self._scratch[:len(ids)]
            torch.index_select(self._local_row, 0, ids, out=scratch)
            time.sleep(0.002)  # another call overwriting the scratch now corrupts this one
            return scratch.clone()


class ScratchRowsHeldInPart(ScratchRows):
    """:class:`ScratchRows` whose even rows are held locally, with a :class:`ScratchPolicy`."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        self.local_partition = table[0::2].clone()
        self.part_policy = ScratchPolicy(len(table))


@pytest.mark.parametrize("held_in_part", [False, True], ids=["fetched", "local-part"])
def test_two_loaders_over_one_row_source_call_it_one_at_a_time(held_in_part: bool):
    """From a DistDGL review: ``zip`` of two loaders sharing one row source called it
    from both producers at once, which a plain ``zip`` never does; a source that
    is not thread-safe returned wrong rows (138 of 180 batches in the review's
    script), with no error.  Calls to one source object now take turns.  From a
    row-source review, the same for a source with a local part: the
    ``part_policy`` calls that find a batch's local rows ran outside the turn
    (86 to 90 of 180 batches wrong); they take it now."""
    table = make_table()
    source = ScratchRowsHeldInPart(table) if held_in_part else ScratchRows(table)
    first, second = seq_triples(N, 30, seed=1), seq_triples(N, 30, seed=2)
    with PingPongLoader(first, source) as a, PingPongLoader(second, source) as b:
        for _ in range(2):
            pairs = [(torch.equal(x.x, table[x.input_nodes]),
                      torch.equal(y.x, table[y.input_nodes])) for x, y in zip(a, b, strict=True)]
            assert pairs == [(True, True)] * 30
        assert (a.stats["rows_read_in_place"] > 0) == held_in_part  # the policy was asked
    if isinstance(source, ScratchRowsHeldInPart):
        assert source.part_policy.most_inside == 1
    assert source.most_inside == 1


def test_a_loader_built_while_another_reads_the_source_asks_its_policy_in_turn():
    """Building a loader asks the source's ``part_policy`` about the local part
    (``get_part_size``, the partition book): in turn with the producers already
    calling the policy, as the calls of batches take turns."""
    table = make_table()
    source = ScratchRowsHeldInPart(table)
    done = threading.Event()

    def build_loaders() -> None:
        while not done.is_set():
            PingPongLoader([], source).close()

    builder = threading.Thread(target=build_loaders)
    with PingPongLoader(seq_triples(N, 40, seed=1), source) as loader:
        builder.start()
        try:
            exact = [torch.equal(b.x, table[b.input_nodes]) for _ in range(2) for b in loader]
        finally:
            done.set()
            builder.join(30)
    assert exact == [True] * 80
    assert source.part_policy.most_inside == 1


class ReusedBuffer:
    """A row source that returns views of one buffer it rewrites on every call."""

    def __init__(self, table: torch.Tensor) -> None:
        self._table = table
        self.shape = tuple(table.shape)
        self.dtype = table.dtype
        self._buffer = torch.empty_like(table)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._buffer[:len(ids)]
        torch.index_select(self._table, 0, ids, out=out)
        return out


def test_one_row_source_behind_features_and_labels_keeps_each_tables_rows():
    """From a row-source review: one source object passed as features and labels
    was called for both tables of a batch before either was copied into the slot,
    so a source that reuses its result buffer gave the labels' rows as features
    (8 of 8 batches).  Rows fetched through the same loader are now kept apart
    before the source's next call, as the docs promise."""
    table = make_table()
    source = ReusedBuffer(table)
    triples = seq_triples(N, 8)
    with PingPongLoader(triples, source, labels=source,
                        form=lambda item: (item[0], item[1].flip(0))) as loader:
        exact = [(torch.equal(batch.x, table[inputs]), torch.equal(batch.y, table[outputs.flip(0)]))
                 for batch, (inputs, outputs, _) in zip(loader, triples, strict=True)]
    assert exact == [(True, True)] * 8


def test_a_loader_built_behind_a_stuck_call_waits_for_its_turn_a_bounded_time(caplog):
    """From a self-review: building a loader took the source's turn to read its
    local part with no bound, so a call stuck in the source (a server gone, the
    case the timeouts exist for) hung the constructor until it returned.  It
    waits ``CONSTRUCTION_TURN_WAIT_S``, then reads without the turn (logged)."""
    table = make_table()
    source = ScratchRowsHeldInPart(table)
    with stuck_fetch(source):  # its fetch is stuck inside the source, in its turn
        assert source.gate is not None
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="pingpong.rowsource"):
            later = PingPongLoader(seq_triples(N, 4, seed=3), source, timeout=30)
        built_in = time.monotonic() - start
        source.gate.set()
        with later:
            exact = [torch.equal(b.x, table[b.input_nodes]) for b in later]
    assert built_in < rowsource.CONSTRUCTION_TURN_WAIT_S + 2.0
    assert "reading its local part without waiting for it" in caplog.text
    assert exact == [True] * 4


class TurnTakingPolicy(ScratchPolicy):
    """A policy that makes a DGL call of its own, in a turn, as ``rpc_turn``'s
    docs ask of DGL calls off the producers."""

    def get_part_size(self) -> int:
        with pingpong.rpc_turn():
            return super().get_part_size()


def test_a_loader_built_in_a_distdgl_client_takes_the_rpc_turn_first(monkeypatch):
    """From a self-review: building a loader took the source's turn and then,
    inside the policy, the RPC turn -- the producers take them the other way
    round -- and a loader built while another trained deadlocked both."""
    monkeypatch.setattr(_rpc, "lock_for_process", lambda: _rpc.RPC_LOCK)  # a DistDGL client
    table = make_table()
    source = ScratchRowsHeldInPart(table)
    source.part_policy = TurnTakingPolicy(len(table))
    done = threading.Event()
    built: list[int] = []

    def build_loaders() -> None:
        while not done.is_set():
            PingPongLoader([], source).close()
            built.append(1)

    builder = threading.Thread(target=build_loaders, daemon=True)
    with PingPongLoader(seq_triples(N, 40, seed=1), source, timeout=10) as loader:
        builder.start()
        try:
            exact = [torch.equal(b.x, table[b.input_nodes]) for b in loader]
        finally:
            done.set()
            builder.join(10)
    assert not builder.is_alive()
    assert exact == [True] * 40
    assert built


def test_only_an_object_with_a_callable_getitem_that_is_no_array_is_a_row_source():
    """A tensor or a NumPy array has shape, dtype and ``[ids]`` too, but is a host table
    (an array read as a row source was refused: its dtype is no torch.dtype); an object
    with shape and dtype whose ``__getitem__`` is not callable is no row source, refused
    at construction rather than failing at its first fetch."""
    table = make_table(N, (2,))
    assert rowsource.is_row_source(Rows(table))
    assert not rowsource.is_row_source(table)
    assert not rowsource.is_row_source(table.numpy())
    unindexable = type("Unindexable", (), {"shape": (N, 2), "dtype": torch.float32,
                                           "__getitem__": None})()
    assert not rowsource.is_row_source(unindexable)
    with pytest.raises(pingpong.TableError, match=r"must be a torch.Tensor, got Unindexable$"):
        PingPongLoader([], unindexable)
    triples = seq_triples(N, 2)
    with PingPongLoader(SeqSource(triples, shuffle=False), table.numpy()) as loader:
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, table[inputs])


class WrongRows(Rows):
    """A source whose results are of another kind or shape than its ``shape`` says."""

    def __init__(self, table: torch.Tensor, wrong: Any) -> None:
        super().__init__(table)
        self.wrong = wrong

    def __getitem__(self, ids: torch.Tensor) -> Any:
        return self.wrong(super().__getitem__(ids))


@pytest.mark.parametrize(("wrong", "needle"), [
    (lambda rows: rows.numpy(), r"features\[ids\] returned ndarray, not a torch.Tensor"),
    (lambda rows: rows[:-1], r"features\[ids\] returned shape \(9, 2\) torch.float32 for 10 "
                             r"ids; expected \(10, 2\) torch.float32"),
    (lambda rows: rows[:, :1], r"features\[ids\] returned shape \(10, 1\) torch.float32 for "
                               r"10 ids; expected \(10, 2\) torch.float32"),
], ids=["ndarray", "a-row-short", "narrower-rows"])
def test_a_fetch_of_another_kind_or_shape_is_a_table_error(wrong: Any, needle: str):
    source = WrongRows(make_table(N, (2,)), wrong)
    triples = [(torch.arange(10, 20), torch.arange(2), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False), source) as loader:
        with pytest.raises(pingpong.TableError, match=needle):
            next(iter(loader))


def test_negated_view_rows_from_a_source_arrive_as_their_values():
    """``source[ids]`` may be a lazily negated view (``.conj().imag`` of a complex
    tensor): the batch holds its values, not the bits under the negation (a view of
    one row is contiguous, so ``.contiguous()`` alone would keep the bit)."""
    table = make_table(N, ())

    class NegatedViews:
        shape, dtype = tuple(table.shape), table.dtype

        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            rows = torch.complex(torch.zeros(len(ids)), -table[ids]).conj().imag
            assert rows.is_neg()
            return rows

    triples = [(torch.tensor([i]), torch.tensor([i]), {"seq": k})
               for k, i in enumerate((3, 0, N - 1, 77))]
    with PingPongLoader(SeqSource(triples, shuffle=False), NegatedViews()) as loader:
        for batch, (ids, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, table[ids])
            assert not batch.x.is_neg()


def test_non_contiguous_rows_from_a_source_arrive_as_their_values():
    """``source[ids]`` may be a strided view (a transposed copy, every other column):
    the batch holds its values."""
    table = make_table(N, (3,))

    class Strided:
        shape, dtype = tuple(table.shape), table.dtype

        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            rows = table[ids].repeat_interleave(2, dim=1)[:, ::2]
            assert not rows.is_contiguous()
            return rows

    triples = seq_triples(N, 3)
    with PingPongLoader(SeqSource(triples, shuffle=False), Strided()) as loader:
        for batch, (ids, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, table[ids])
