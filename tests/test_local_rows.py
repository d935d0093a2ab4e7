"""Row sources with a local part (``local_partition`` + ``part_policy``): local rows in place.

:class:`PartitionedRows` is a row source of the user's own shaped like a
``DistTensor`` on a machine that holds one range partition: its
``local_partition`` is a copy of that partition's rows, its ``__getitem__``
serves any id (as a pull would) and records the ids it was asked for.  The
DistDGL tests (``test_distdgl.py``) run the same path with the real one.

Every batch is compared bit for bit with ``table[ids]``; the source must never
be asked for an id of the local partition; local row numbers are checked
before the kernel reads; a local part pingpong cannot use is fetched whole.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import warm_up_of
from test_reliability import (
    CUDA_MODE_KINDS,
    Expected,
    SeqSource,
    Verifier,
    loader_device,
    make_table,
    seq_triples,
)
from test_rowsource import dense_ids, ids_of_every_layout

import pingpong
from pingpong import PingPongLoader, rowsource
from pingpong.devices.cpu import CPUDevice
from pingpong.kernels.cpu import gather_rows_at_cpu_unchecked
from pingpong.rowsource import LocalPart, local_id_range, make_remote_table
from pingpong.store import byte_rows, make_host_table

N = 400
BOUNDS = (0, 150, 260, N)  # three range partitions


class RangePolicy:
    """DGL's PartitionPolicy, reduced to what pingpong reads: partitions are id ranges."""

    def __init__(self, bounds: tuple[int, ...], part_id: int) -> None:
        self.bounds = torch.tensor(bounds)
        self.part_id = part_id
        self.to_local_shift = 0  # a broken policy for the tests: shifts local rows
        self.partid_sizes: list[int] = []  # how many ids each to_partid call got

    def to_partid(self, ids: torch.Tensor) -> torch.Tensor:
        self.partid_sizes.append(len(ids))
        return torch.searchsorted(self.bounds, ids, right=True) - 1

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids - self.bounds[self.part_id] + self.to_local_shift

    def get_part_size(self) -> int:
        return int(self.bounds[self.part_id + 1] - self.bounds[self.part_id])


class PartitionedRows:
    """A row source holding partition ``part_id`` of ``table`` locally."""

    def __init__(self, table: torch.Tensor, part_id: int = 1,
                 bounds: tuple[int, ...] = BOUNDS) -> None:
        self._table = table.clone()
        self.shape = tuple(table.shape)
        self.dtype = table.dtype
        self.part_policy = RangePolicy(bounds, part_id)
        lo, hi = bounds[part_id], bounds[part_id + 1]
        self.local_partition = table[lo:hi].clone()
        self.asked: list[torch.Tensor] = []

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        self.asked.append(ids.clone())
        return self._table[ids]

    def local_ids_asked(self) -> int:
        lo, hi = (int(b) for b in self.part_policy.bounds[self.part_policy.part_id:][:2])
        return sum(int(((ids >= lo) & (ids < hi)).sum()) for ids in self.asked)


def split_counts(triples: list[Any], lo: int, hi: int, epochs: int) -> tuple[int, int]:
    """(local, remote) rows of the features over ``epochs`` passes of ``triples``."""
    local = sum(int(((t[0] >= lo) & (t[0] < hi)).sum()) for t in triples)
    total = sum(len(t[0]) for t in triples)
    return epochs * local, epochs * (total - local)


@pytest.mark.parametrize("device_kind", ["cpu", "fake", *CUDA_MODE_KINDS])
@pytest.mark.parametrize("shape_dtype", [((5,), torch.float32), ((3,), torch.float16),
                                         ((2, 3), torch.int64), ((7,), torch.uint8)])
def test_local_rows_are_read_in_place_and_batches_are_bit_identical(device_kind, shape_dtype):
    row_shape, dtype = shape_dtype
    triples = seq_triples(N, 12)
    features = make_table(N, row_shape, dtype)
    labels = make_table(N, (), torch.int64)
    x_source, y_source = PartitionedRows(features), PartitionedRows(labels)
    with PingPongLoader(SeqSource(triples), x_source, y_source,
                        **loader_device(device_kind, seed=3)) as loader:
        check_two_epochs(loader, features, labels, triples, x_source, y_source)


def check_two_epochs(loader: PingPongLoader, features: torch.Tensor, labels: torch.Tensor,
                     triples: list[Any], x_source: PartitionedRows,
                     y_source: PartitionedRows) -> None:
    """Two epochs of ``loader`` (over ``triples``, partition 1 local) are bit-identical;
    the sources were asked for the other partitions' rows only; the stats count both."""
    device = "cuda" if loader._device.torch_device.type == "cuda" else loader._device
    verifier = Verifier(device, Expected(features, labels, triples))
    for _ in range(2):
        for batch in loader:
            verifier.submit(batch)
    verifier.resolve()
    assert (verifier.checked, verifier.corrupted) == (2 * len(triples), 0)
    assert x_source.local_ids_asked() == y_source.local_ids_asked() == 0
    local_x, remote_x = split_counts(triples, BOUNDS[1], BOUNDS[2], 2)
    local_y, remote_y = split_counts([(t[1],) for t in triples], BOUNDS[1], BOUNDS[2], 2)
    assert sum(len(ids) for ids in x_source.asked) == remote_x
    assert sum(len(ids) for ids in y_source.asked) == remote_y
    assert loader.stats["rows_read_in_place"] == local_x + local_y > 0
    assert loader.stats["rows_fetched"] == remote_x + remote_y > 0


@pytest.mark.parametrize("device_kind", ["cpu", *CUDA_MODE_KINDS])
def test_a_batch_of_local_rows_only_asks_the_source_for_nothing(device_kind):
    features = make_table(N, (4,))
    local_only = [(torch.arange(150, 260)[torch.randperm(110)][:40], torch.arange(150, 166),
                   {"seq": 0})]
    source = PartitionedRows(features)
    with PingPongLoader(SeqSource(local_only, shuffle=False), source,
                        **loader_device(device_kind)) as loader:
        batches = [batch.x.cpu() for batch in loader]  # the epoch's end: stats complete
        assert len(batches) == 1
        assert torch.equal(batches[0], features[local_only[0][0]])
        assert loader.stats["rows_fetched"] == 0
        assert loader.stats["rows_read_in_place"] == 40
    assert source.asked == []


@pytest.mark.parametrize("shape_dtype", [((5,), torch.float32), ((3,), torch.float16),
                                         ((7,), torch.uint8)])
def test_a_batch_put_together_in_a_byte_staging_buffer_is_the_batch(shape_dtype):
    """What the CUDA device's ``place_rows`` runs on the host before its upload: the
    CPU device places local and fetched rows into (n, row_bytes) uint8 staging rows
    (a prefix of a larger, poisoned buffer); those bytes are ``table[ids]``'s."""
    row_shape, dtype = shape_dtype
    features = make_table(N, row_shape, dtype)
    table = make_remote_table(PartitionedRows(features), "features")
    ids = torch.randperm(N, generator=torch.Generator().manual_seed(1))[:90].numpy()
    fetched = table.fetch_split(ids, read_local=True)
    assert 0 < len(fetched.local_rows) < len(ids)
    staging = torch.full((128, table.row_bytes), 0xAB, dtype=torch.uint8)
    CPUDevice().place_rows(table, fetched, staging[:len(ids)])
    assert torch.equal(staging[:len(ids)], byte_rows(features[torch.from_numpy(ids)]))
    assert bool((staging[len(ids):] == 0xAB).all())  # nothing written past the batch


def test_a_dict_of_partitioned_and_host_tables():
    triples = seq_triples(N, 6)
    host, part = make_table(N, (3,)), make_table(N, (2,), torch.float64)
    with PingPongLoader(SeqSource(triples, shuffle=False),
                        {"host": host, "part": PartitionedRows(part, part_id=0)}) as loader:
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x["host"], host[inputs])
            assert torch.equal(batch.x["part"], part[inputs])


def test_a_policy_that_maps_outside_the_local_rows_is_refused_before_any_read():
    """``to_local`` past the end: TableError in the training loop, naming the row;
    the slot of the failed batch was never written."""
    features = make_table(N, (4,))
    source = PartitionedRows(features)
    source.part_policy.to_local_shift = 110  # the last local ids map past 110 rows
    triples = [(torch.tensor([0, 259, 300]), torch.tensor([0]), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False), source, debug=True) as loader:
        with pytest.raises(pingpong.TableError, match=r"maps an id of partition 1 to row 219, "
                                                      r"outside its 110 local rows"):
            next(iter(loader))
        assert loader.stats["rows_read_in_place"] == 0


class Broken:
    """What can be wrong with a local part; each is fetched whole instead."""

    @staticmethod
    def other_dtype(source: PartitionedRows) -> None:
        source.local_partition = source.local_partition.double()

    @staticmethod
    def not_contiguous(source: PartitionedRows) -> None:
        source.local_partition = torch.cat([source.local_partition] * 2, 1)[:, ::2]

    @staticmethod
    def size_differs(source: PartitionedRows) -> None:
        source.local_partition = source.local_partition[:-1].clone()

    @staticmethod
    def book_size_differs(source: PartitionedRows) -> None:
        source.part_policy = BookedPolicy(BOUNDS, 1)
        source.part_policy.partition_book.bounds = (0, 150, 259, N)

    @staticmethod
    def empty(source: PartitionedRows) -> None:
        source.local_partition = source.local_partition[:0]

    @staticmethod
    def no_to_local(source: PartitionedRows) -> None:
        source.part_policy.to_local = None  # type: ignore[assignment]

    @staticmethod
    def raises(source: PartitionedRows) -> None:
        class Raising(PartitionedRows):
            @property
            def local_partition(self) -> torch.Tensor:
                raise KeyError("feat")

            @local_partition.setter
            def local_partition(self, value: torch.Tensor) -> None:
                pass

        source.__class__ = Raising


@pytest.mark.parametrize(("break_it", "reason"), [
    (Broken.other_dtype, "local_partition has rows (4,) torch.float64, the table (4,) "
                         "torch.float32"),
    (Broken.not_contiguous, "local_partition is not contiguous"),
    (Broken.size_differs, "get_part_size() is 110, local_partition has 109 rows"),
    (Broken.book_size_differs, "part_policy.partition_book lists 109 ids for partition 1, "
                               "local_partition has 110 rows"),
    (Broken.empty, "local_partition is empty"),
    (Broken.no_to_local, "part_policy has no to_partid/to_local"),
    (Broken.raises, "reading it raised KeyError('feat')"),
])
def test_an_unusable_local_part_is_fetched_whole_and_logged(break_it, reason, caplog):
    features = make_table(N, (4,))
    source = PartitionedRows(features)
    break_it(source)
    triples = seq_triples(N, 5)
    with caplog.at_level(logging.INFO, logger="pingpong.rowsource"):
        loader = PingPongLoader(SeqSource(triples, shuffle=False), source)
    assert any(reason in r.getMessage() and "features" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    # a reason found by looking, not an exception's message (pingpong's own refusal
    # of the table, say, which names it too)
    raised = any("reading it raised" in r.getMessage() for r in caplog.records)
    assert raised == (break_it is Broken.raises)
    with loader:
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[inputs])
        assert loader.stats["rows_read_in_place"] == 0
    assert sum(len(ids) for ids in source.asked) == sum(len(t[0]) for t in triples)


@pytest.mark.parametrize("row_bytes", [1, 3, 8, 12, 40])
def test_positioned_kernel_and_its_warm_up_fallback_write_the_same_bytes(row_bytes,
                                                                        monkeypatch):
    gen = np.random.default_rng(row_bytes)
    table = gen.integers(0, 256, (90, row_bytes), dtype=np.uint8)
    ids = gen.integers(0, 90, 700).astype(np.int64)
    positions = gen.permutation(1000)[:700].astype(np.int64)
    expected = np.zeros((1000, row_bytes), dtype=np.uint8)
    expected[positions] = table[ids]
    kernel_out = np.zeros_like(expected)
    gather_rows_at_cpu_unchecked(table, ids, positions, kernel_out)
    assert np.array_equal(kernel_out, expected)
    # Before the warm-up has loaded the kernel, the device writes the same bytes with torch.
    device = CPUDevice()

    class Loading:
        class done:  # mimics the WarmUpThread's Event
            @staticmethod
            def is_set() -> bool:
                return False

    device._warm_up = Loading()  # type: ignore[assignment]
    monkeypatch.setattr("pingpong.devices.cpu.gather_at_is_ready", lambda *a: False)
    fallback_out = torch.zeros(1000, row_bytes, dtype=torch.uint8)
    device.gather_at(make_host_table(torch.from_numpy(table), "t"), ids, positions,
                     fallback_out)
    assert np.array_equal(fallback_out.numpy(), expected)


def test_the_warm_up_loads_the_positioned_kernel_and_the_loader_then_uses_it(monkeypatch):
    import pingpong.devices.cpu as cpu_device

    calls = []
    real = cpu_device.gather_rows_at_cpu_unchecked

    def counting(*args: Any) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(cpu_device, "gather_rows_at_cpu_unchecked", counting)
    features = make_table(N, (16,))  # 64-byte rows: 8-byte words
    triples = seq_triples(N, 4)
    with PingPongLoader(SeqSource(triples, shuffle=False), PartitionedRows(features)) as loader:
        warm_up = warm_up_of(loader)
        assert warm_up.done.wait(120)
        assert warm_up.error is None
        assert sum(len(signature) == 5 for signature in warm_up.result) == 1  # positioned
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[inputs])
    # One call per batch for its local rows, one for its fetched rows (written to their places).
    local = [((t[0] >= 150) & (t[0] < 260)) for t in triples]
    assert len(calls) == sum(bool(m.any()) + bool((~m).any()) for m in local) > len(triples)


def test_heterogeneous_partitioned_row_sources_and_a_type_without_ids():
    """Per node type its own local part; a batch without ids of a type asks for nothing."""
    paper, author = make_table(N, (4,)), make_table(N, (2,), torch.float64)
    sources = {"paper": PartitionedRows(paper, part_id=0), "author": PartitionedRows(author)}
    with_authors = {"paper": torch.tensor([5, 160, 399, 0]), "author": torch.tensor([300, 200])}
    papers_only = {"paper": torch.tensor([151, 7])}
    items = [(with_authors, {"paper": torch.tensor([5])}, None),
             (papers_only, {"paper": torch.tensor([7])}, None)]
    tables = {"paper": paper, "author": author}
    with PingPongLoader(items, sources, heterogeneous=True) as loader:
        for batch, (inputs, _o, _b) in zip(loader, items, strict=True):
            assert batch.x.keys() == tables.keys()
            for ntype, table in tables.items():  # a type without ids: no rows
                want = inputs.get(ntype, torch.empty(0, dtype=torch.int64))
                assert torch.equal(batch.x[ntype], table[want])
        assert loader.stats["rows_read_in_place"] == 2 + 1 + 1  # papers 5, 0, 7; author 200
    assert [ids.tolist() for ids in sources["paper"].asked] == [[160, 399], [151]]
    assert [ids.tolist() for ids in sources["author"].asked] == [[300]]
    # nor is the policy asked about the batch without authors
    assert [s.part_policy.partid_sizes for s in sources.values()] == [[4, 2], [2]]


def test_a_policy_whose_to_partid_has_another_shape_is_refused():
    source = PartitionedRows(make_table(N, (4,)))
    real = source.part_policy.to_partid
    source.part_policy.to_partid = lambda ids: real(ids).reshape(-1, 1)  # type: ignore[method-assign]
    triples = [(torch.tensor([0, 200, 300]), torch.tensor([0]), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False), source) as loader:
        with pytest.raises(pingpong.TableError,
                           match=r"to_partid returned shape \(3, 1\) for 3 ids"):
            next(iter(loader))


def test_a_policy_that_changes_its_ids_in_place_changes_nothing_else():
    """``to_partid`` gets a copy of the batch's ids, as ``__getitem__`` does: a policy
    that rewrote them in place moved the batch's ids and the host table's gather
    past the range check (a shift past the table's end crashed the process)."""
    features, host = make_table(N, (4,)), make_table(N, (3,))
    source = PartitionedRows(features)
    real = source.part_policy.to_partid

    def to_partid_then_shift(ids: torch.Tensor) -> torch.Tensor:
        parts = real(ids)
        ids += 1  # stays inside the tables: wrong rows rather than a crash
        return parts

    source.part_policy.to_partid = to_partid_then_shift  # type: ignore[method-assign]
    inputs = torch.tensor([0, 150, 200, 258, 300])
    triples = [(inputs.clone(), torch.tensor([0]), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False),
                        {"part": source, "host": host}) as loader:
        for _epoch in range(2):  # the first may gather on the warm-up's fallback
            batch = next(iter(loader))
            assert torch.equal(batch.input_nodes, inputs)
            assert torch.equal(batch.x["part"], features[inputs])
            assert torch.equal(batch.x["host"], host[inputs])
        warm_up_of(loader).done.wait(120)
        batch = next(iter(loader))  # the Numba kernels
        assert torch.equal(batch.x["host"], host[inputs])
        assert torch.equal(batch.input_nodes, inputs)


def test_the_positioned_kernel_refuses_ids_and_positions_of_different_lengths():
    table = np.zeros((4, 8), dtype=np.uint8)
    out = np.zeros((4, 8), dtype=np.uint8)
    with pytest.raises(pingpong.TableError, match="3 ids but 2 positions"):
        gather_rows_at_cpu_unchecked(table, np.arange(3), np.arange(2), out)


# --------------------------------------------------------------------------- id ranges
class RangeBook:
    """DGL's RangePartitionBook, reduced to ``partid2nids``: partitions are id ranges."""

    def __init__(self, bounds: tuple[int, ...]) -> None:
        self.bounds = bounds
        self.asked: list[tuple[int, str]] = []

    def partid2nids(self, partid: int, ntype: str) -> torch.Tensor:
        self.asked.append((partid, ntype))
        return torch.arange(self.bounds[partid], self.bounds[partid + 1])


class BookedPolicy(RangePolicy):
    """A :class:`RangePolicy` with a partition book, like DGL's NodePartitionPolicy;
    counts its per-id calls."""

    is_node = True
    type_name = "_N"

    def __init__(self, bounds: tuple[int, ...], part_id: int) -> None:
        super().__init__(bounds, part_id)
        self.partition_book = RangeBook(bounds)
        self.calls = 0

    def to_partid(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().to_partid(ids)

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().to_local(ids)

    def get_part_size(self) -> int:  # as DGL's: it asks the book
        return len(self.partition_book.partid2nids(self.part_id, self.type_name))


def booked_rows(table: torch.Tensor, part_id: int = 1) -> PartitionedRows:
    source = PartitionedRows(table, part_id)
    source.part_policy = BookedPolicy(BOUNDS, part_id)
    return source


def booked_policy(source: PartitionedRows) -> BookedPolicy:
    """The policy :func:`booked_rows` gave ``source``."""
    assert isinstance(source.part_policy, BookedPolicy)
    return source.part_policy


def local_part(table: object) -> LocalPart:
    """The local part the loader found in a row-source table (it must have one)."""
    assert isinstance(table, rowsource.RemoteTable)
    assert table.local is not None
    return table.local


@pytest.mark.parametrize("device_kind", ["cpu", "fake", *CUDA_MODE_KINDS])
def test_a_range_partition_is_split_without_calling_the_policy_per_batch(device_kind):
    triples = seq_triples(N, 12)
    features, labels = make_table(N, (6,)), make_table(N, (), torch.int64)
    x_source, y_source = booked_rows(features), booked_rows(labels)
    with PingPongLoader(SeqSource(triples), x_source, y_source,
                        **loader_device(device_kind, seed=5)) as loader:
        assert [local_part(t).id_range for t in loader._store.all_tables] == [(150, 260)] * 2
        policies = [booked_policy(s) for s in (x_source, y_source)]
        # The book (DGL: an arange of the partition's ids) was asked once per table.
        assert [p.partition_book.asked for p in policies] == [[(1, "_N")]] * 2
        calls_at_construction = [p.calls for p in policies]
        check_two_epochs(loader, features, labels, triples, x_source, y_source)
    assert [p.calls for p in policies] == calls_at_construction


@pytest.mark.parametrize("device_kind", ["cpu", "fake", *CUDA_MODE_KINDS])
@pytest.mark.parametrize("make_source", [PartitionedRows, booked_rows],
                         ids=["policy", "range"])
def test_local_rows_take_ids_of_every_layout(device_kind, make_source):
    """Reversed, read-only, strided and int32 ids, split by the policy or by the range."""
    triples = ids_of_every_layout()
    features, labels = make_table(N, (5,)), make_table(N, (), torch.int64)
    dense = [(dense_ids(i), dense_ids(o), b) for i, o, b in triples]
    where = loader_device(device_kind, seed=6)
    device = "cuda" if device_kind.startswith("cuda") else where["device"]
    verifier = Verifier(device, Expected(features, labels, dense))
    with PingPongLoader(triples, make_source(features), make_source(labels), **where) as loader:
        for batch in loader:
            verifier.submit(batch)
        verifier.resolve()
        assert loader.stats["rows_read_in_place"] > 0
    assert (verifier.checked, verifier.corrupted) == (4, 0)


@pytest.mark.parametrize("part_id", [0, 1, 2])
def test_the_range_split_equals_the_policy_split(part_id):
    """For any ids (none local, all local, mixed, repeated, the range's edges) the
    split from the id range is the one the policy's calls give."""
    source = booked_rows(make_table(N, (2,)), part_id)
    table = make_remote_table(source, "features")
    assert table.local is not None
    lo, hi = BOUNDS[part_id], BOUNDS[part_id + 1]
    assert table.local.id_range == (lo, hi)
    by_policy = replace(table.local, id_range=None)
    gen = np.random.default_rng(part_id)
    cases = [np.empty(0, np.int64), np.arange(lo, hi), np.array([lo - 1, lo, hi - 1, hi]),
             np.array([0, N - 1, lo, lo, hi - 1])] + [gen.integers(0, N, 300) for _ in range(5)]
    for ids in cases:
        ids = ids[(ids >= 0) & (ids < N)].astype(np.int64)
        got, want = table.local.locate(ids), by_policy.locate(ids)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, w)
            assert g.dtype == np.int64


class NotARange:
    """Books and policies whose local ids must not be taken as one range."""

    @staticmethod
    def gap(policy: BookedPolicy) -> None:  # 150..259 without 200, and 260
        policy.partition_book.partid2nids = lambda partid, ntype: torch.cat(  # type: ignore[method-assign]
            [torch.arange(150, 200), torch.arange(201, 261)])

    @staticmethod
    def unsorted(policy: BookedPolicy) -> None:
        policy.partition_book.partid2nids = lambda partid, ntype: torch.arange(150, 260).flip(0)  # type: ignore[method-assign]

    @staticmethod
    def shifted(policy: BookedPolicy) -> None:  # the policy puts 150 in the partition too
        policy.partition_book.bounds = (0, 151, 261, N)

    @staticmethod
    def reordered(policy: BookedPolicy) -> None:  # the book's ends and size, 200 and 201 swapped
        ids = torch.arange(150, 260)
        ids[[50, 51]] = ids[[51, 50]]
        policy.partition_book.partid2nids = lambda partid, ntype: ids  # type: ignore[method-assign]

    @staticmethod
    def narrower(policy: BookedPolicy) -> None:  # the policy's partition lacks 259
        policy.bounds = torch.tensor((0, 150, 259, N))

    @staticmethod
    def wider(policy: BookedPolicy) -> None:  # the policy's partition also holds 149
        policy.bounds = torch.tensor((0, 149, 260, N))
        policy.to_local_shift = -1  # ... and still maps 150 to row 0

    @staticmethod
    def other_size(policy: BookedPolicy) -> None:
        policy.partition_book.bounds = (0, 150, 259, N)

    @staticmethod
    def offset_rows(policy: BookedPolicy) -> None:  # to_local(150) is 1, not 0
        policy.to_local_shift = 1

    @staticmethod
    def raises(policy: BookedPolicy) -> None:
        def partid2nids(partid: int, ntype: str) -> torch.Tensor:
            raise RuntimeError("not this partition")

        policy.partition_book.partid2nids = partid2nids  # type: ignore[method-assign]

    @staticmethod
    def edges(policy: BookedPolicy) -> None:  # an edge policy asks partid2eids: none here
        policy.is_node = False  # type: ignore[misc]


@pytest.mark.parametrize("break_it", [NotARange.gap, NotARange.unsorted, NotARange.shifted,
                                      NotARange.wider, NotARange.other_size, NotARange.offset_rows,
                                      NotARange.raises, NotARange.edges, NotARange.reordered,
                                      NotARange.narrower],
                         ids=lambda f: f.__name__)
def test_no_range_unless_the_book_and_the_policy_agree_on_one(break_it):
    policy = BookedPolicy(BOUNDS, 1)
    assert local_id_range(policy, 110, N) == (150, 260)
    break_it(policy)
    assert local_id_range(policy, 110, N) is None


def test_a_gap_anywhere_is_found_chunk_by_chunk(monkeypatch):
    """The consecutiveness check reads the ids in chunks: a gap at any position, at a
    chunk's edge included, means no range."""
    monkeypatch.setattr("pingpong.rowsource._CHECK_CHUNK", 4)
    assert rowsource._consecutive(torch.arange(7, 30))
    for gap in range(1, 23):
        ids = torch.cat([torch.arange(7, 7 + gap), torch.arange(8 + gap, 31)])
        assert not rowsource._consecutive(ids), gap


def test_a_single_partition_is_the_whole_range():
    policy = BookedPolicy((0, N), 0)
    assert local_id_range(policy, N, N) == (0, N)


def _dgl_partition_books(tmp_path: Any, graph: Any, parts: int) -> list[Any]:
    from dgl.distributed import load_partition_book, partition_graph

    partition_graph(graph, "g", parts, str(tmp_path), part_method="random")
    return [load_partition_book(str(tmp_path / "g.json"), p)[0] for p in range(parts)]


# DGL's partition_graph leaves /proc/self/status open (dgl/partition.py, get_peak_mem)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_dgl_range_partition_books_give_the_range_and_the_same_split(tmp_path):
    """The real thing: DGL's partition books (``partition_graph``, loaded offline) for
    a homogeneous graph's nodes and edges and a heterogeneous graph's node and edge
    types."""
    dgl = pytest.importorskip("dgl")
    from dgl.distributed.graph_partition_book import EdgePartitionPolicy, NodePartitionPolicy

    gen = np.random.default_rng(0)
    homo = dgl.rand_graph(3000, 12000)
    hetero = dgl.heterograph({
        ("paper", "cites", "paper"): (torch.randint(0, 900, (4000,)),
                                      torch.randint(0, 900, (4000,))),
        ("author", "writes", "paper"): (torch.randint(0, 500, (3000,)),
                                        torch.randint(0, 900, (3000,)))})
    policies = []
    for book in _dgl_partition_books(tmp_path / "homo", homo, 3):
        policies += [(NodePartitionPolicy(book, "_N"), homo.num_nodes()),
                     (EdgePartitionPolicy(book, book.canonical_etypes[0]), homo.num_edges())]
    for book in _dgl_partition_books(tmp_path / "hetero", hetero, 2):
        policies += [(NodePartitionPolicy(book, ntype), hetero.num_nodes(ntype))
                     for ntype in ("paper", "author")]
        policies += [(EdgePartitionPolicy(book, etype), hetero.num_edges(etype))
                     for etype in hetero.canonical_etypes]
    for policy, num_ids in policies:
        num_local = policy.get_part_size()
        id_range = local_id_range(policy, num_local, num_ids)
        assert id_range is not None, (policy.type_name, policy.part_id)
        assert id_range[1] - id_range[0] == num_local
        local = LocalPart(make_host_table(torch.zeros(num_local, 1), "t"), policy.part_id,
                          policy, id_range)
        by_policy = replace(local, id_range=None)
        for ids in (gen.integers(0, num_ids, 500), np.arange(num_ids)):
            for g, w in zip(local.locate(ids), by_policy.locate(ids), strict=True):
                assert np.array_equal(g, w)


def test_fetched_rows_that_require_grad_are_refused_as_without_a_local_part():
    """With a local part, the rows fetched for the other partitions are checked the
    same way: a TableError naming ``features[ids]`` (it used to be the host-table
    message, advising a .detach() a row source cannot take)."""
    class NeedingGrad(PartitionedRows):
        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            return super().__getitem__(ids).requires_grad_()

    source = NeedingGrad(make_table(N, (4,)))
    triples = [(torch.tensor([0, 200, 300]), torch.tensor([0]), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False), source) as loader:
        with pytest.raises(pingpong.TableError,
                           match=r"features\[ids\] returned rows that require grad"):
            next(iter(loader))


@pytest.mark.parametrize(("shift", "inputs", "bad_row"), [
    (1, [0, 258, 259, 300], 110),  # the last local id one row past the end
    (-1, [0, 150, 151, 300], -1),  # the first local id one row before the start
], ids=["one-past-the-end", "one-before-the-start"])
def test_a_policy_one_row_off_the_local_rows_is_refused_before_any_read(shift, inputs,
                                                                         bad_row):
    """The edges of the check before the kernel reads: row ``len(local_partition)``
    and row -1 are outside, named in the TableError."""
    source = PartitionedRows(make_table(N, (4,)))
    source.part_policy.to_local_shift = shift
    triples = [(torch.tensor(inputs), torch.tensor([0]), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False), source, debug=True) as loader:
        with pytest.raises(pingpong.TableError,
                           match=rf"maps an id of partition 1 to row {bad_row}, "
                                 r"outside its 110 local rows"):
            next(iter(loader))
        assert loader.stats["rows_read_in_place"] == 0


def test_a_policy_whose_to_local_returns_too_few_rows_is_refused():
    source = PartitionedRows(make_table(N, (4,)))
    real = source.part_policy.to_local
    source.part_policy.to_local = lambda ids: real(ids)[:-1]  # type: ignore[method-assign]
    triples = [(torch.tensor([0, 150, 200, 259, 300]), torch.tensor([0]), {"seq": 0})]
    with PingPongLoader(SeqSource(triples, shuffle=False), source) as loader:
        with pytest.raises(pingpong.TableError,
                           match=r"part_policy.to_local returned 2 rows for 3 ids"):
            next(iter(loader))


def test_a_source_without_a_part_policy_is_fetched_without_a_word(caplog):
    """A ``local_partition`` without a ``part_policy`` is no local part: the
    source is fetched whole, and nothing is logged -- there is nothing to read in place,
    rather than a local part pingpong could not use."""
    features = make_table(N, (4,))
    source = PartitionedRows(features)
    del source.part_policy
    triples = seq_triples(N, 3)
    with caplog.at_level(logging.DEBUG, logger="pingpong.rowsource"):
        loader = PingPongLoader(SeqSource(triples, shuffle=False), source)
    assert [r.getMessage() for r in caplog.records] == []
    with loader:
        for batch, (inputs, _o, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[inputs])
        assert loader.stats["rows_read_in_place"] == 0


@pytest.mark.parametrize("part_id", [0, 2], ids=["first", "last"])
def test_the_range_of_an_edge_partition_asks_the_policy_about_no_id_outside_the_table(part_id):
    """At the first (last) partition the id before (after) the range is no id: a policy
    that refuses it, as DGL's may, still gives the range."""
    policy = BookedPolicy(BOUNDS, part_id)
    real = policy.to_partid

    def to_partid_of_ids_only(ids: torch.Tensor) -> torch.Tensor:
        if bool(((ids < 0) | (ids >= N)).any()):
            raise IndexError(f"no ids {ids.tolist()} among {N}")
        return real(ids)

    policy.to_partid = to_partid_of_ids_only  # type: ignore[method-assign]
    lo, hi = BOUNDS[part_id], BOUNDS[part_id + 1]
    assert local_id_range(policy, hi - lo, N) == (lo, hi)


class NoLocalRowsDevice(CPUDevice):
    """A device without :meth:`place_rows` support, as :class:`~pingpong.devices.base.Device`
    says by default: a row source's local rows are then fetched like the others."""

    @property
    def supports_local_rows(self) -> bool:
        return False


def test_a_device_without_local_rows_fetches_the_local_part_too():
    triples = seq_triples(N, 6)
    features, labels = make_table(N, (3,)), make_table(N, (), torch.int64)
    x_source, y_source = booked_rows(features), PartitionedRows(labels)
    with PingPongLoader(SeqSource(triples, shuffle=False), x_source, y_source,
                        device=NoLocalRowsDevice()) as loader:
        for batch, (inputs, outputs, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[inputs])
            assert torch.equal(batch.y, labels[outputs])
        assert loader.stats["rows_read_in_place"] == 0
    for source, asked in ((x_source, [t[0] for t in triples]),
                          (y_source, [t[1] for t in triples])):
        assert torch.equal(torch.cat(source.asked), torch.cat(asked))
    # the local part is not consulted either
    table = make_remote_table(booked_rows(features), "features")
    ids = np.array([0, 150, 259, 300], dtype=np.int64)
    fetched = table.fetch_split(ids, read_local=False)
    assert fetched.positions is None
    assert len(fetched.local_rows) == 0
    assert fetched.rows is not None
    assert torch.equal(fetched.rows, features[torch.from_numpy(ids)])


class PlacingCPUDevice(CPUDevice):
    """The CPU device, counting the rows it read from local parts in place."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_placed = 0

    def gather_at(self, table: Any, ids: np.ndarray, positions: np.ndarray,
                  out: torch.Tensor) -> None:
        self.rows_placed += len(ids)
        super().gather_at(table, ids, positions, out)


def _change_local_part(source: PartitionedRows, how: str) -> None:
    rows = source.local_partition
    if how == "data":
        rows.data = torch.zeros_like(rows)
    elif how == "set_":
        rows.set_(rows.clone())  # type: ignore[call-overload]  # stubs lack set_(Tensor)
    else:  # "resize_ fewer rows": the same memory, another layout
        rows.resize_(rows.shape[0] - 10, *rows.shape[1:])


@pytest.mark.parametrize("how", ["data", "set_", "resize_ fewer rows"])
def test_a_local_part_given_new_memory_or_a_new_layout_is_refused_before_it_is_read(how):
    """A local part is read in place like a host table, and checked like one at
    every fill: changed after the loader was built, the next batch is a
    ``TableError`` naming it, and no row is read from it (the rows would be the
    memory it had, stale)."""
    triples = seq_triples(N, 4)
    features = make_table(N, (3,))
    x_source = PartitionedRows(features)
    device = PlacingCPUDevice()
    with PingPongLoader(SeqSource(triples, shuffle=False), x_source, device=device) as loader:
        for batch, (inputs, _outputs, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[inputs])
        placed = device.rows_placed
        assert placed > 0
        _change_local_part(x_source, how)
        change = "new memory" if how != "resize_ fewer rows" else "a new shape"
        with pytest.raises(pingpong.TableError,
                           match=rf"features\.local_partition was given {change}"):
            next(iter(loader))
        assert device.rows_placed == placed


def test_a_local_part_the_device_does_not_read_is_not_checked():
    """A device that fetches every row (no local rows in place) never reads the
    local part: a change to it is no reason to refuse a batch."""
    triples = seq_triples(N, 4)
    features = make_table(N, (3,))
    x_source = PartitionedRows(features)
    with PingPongLoader(SeqSource(triples, shuffle=False), x_source,
                        device=NoLocalRowsDevice()) as loader:
        _change_local_part(x_source, "data")
        for batch, (inputs, _outputs, _b) in zip(loader, triples, strict=True):
            assert torch.equal(batch.x, features[inputs])
