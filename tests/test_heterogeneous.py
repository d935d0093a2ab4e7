"""Heterogeneous graphs: ids, features and labels keyed by node type."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
from conftest import same_bits
from test_reliability import DEVICE_KINDS, make_device

import pingpong
from pingpong import PingPongLoader
from pingpong.devices.cpu import CPUDevice
from pingpong.devices.fake import FakeAsyncDevice

HAVE_DGL = importlib.util.find_spec("dgl") is not None
ROWS = {"paper": 300, "author": 120}


def tables() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-type tables that differ in rows, width and dtype."""
    gen = torch.Generator().manual_seed(0)
    features = {
        "paper": torch.randn(ROWS["paper"], 16, generator=gen),
        "author": torch.randn(ROWS["author"], 3, 5, generator=gen).to(torch.bfloat16),
    }
    labels = {"paper": torch.randint(0, 7, (ROWS["paper"],), generator=gen)}
    return features, labels


def typed_triples(num_batches: int, seed: int = 0) -> list[tuple[Any, Any, list[int]]]:
    """Dict-id triples as a heterograph loader yields them, plus an untabled type.

    Output ids are drawn independently of the input ids (so mixing them up
    shows); batch 2 has no author ids (an empty tensor) and batch 3 no
    ``paper`` entry in ``output_nodes`` at all (DGL omits seed types a batch
    does not contain).
    """
    gen = torch.Generator().manual_seed(seed)
    triples = []
    for b in range(num_batches):
        n_paper, n_author = (int(v) for v in torch.randint(1, 90, (2,), generator=gen))
        if b == 2:
            n_author = 0
        inputs = {
            "paper": torch.randint(0, ROWS["paper"], (n_paper,), generator=gen),
            "author": torch.randint(0, ROWS["author"], (n_author,), generator=gen).int(),
            "field": torch.arange(b),  # no table: passed through untouched
        }
        outputs = {"paper": torch.randint(0, ROWS["paper"], (8,), generator=gen)}
        if b == 3:
            outputs = {}
        triples.append((inputs, outputs, [b]))
    return triples


def check_batch(batch: Any, features: dict[str, torch.Tensor],
                labels: dict[str, torch.Tensor] | None) -> None:
    """Every typed table of the batch equals its synchronous reference, bit for bit."""
    assert set(batch.x) == set(features)
    for ntype, table in features.items():
        ids = typed(batch.input_nodes, ntype)
        assert batch.x[ntype].shape == (len(ids), *table.shape[1:]), ntype
        assert same_bits(batch.x[ntype], table[ids]), ntype
    if labels is None:
        assert batch.y is None
        return
    assert set(batch.y) == set(labels)
    for ntype, table in labels.items():
        ids = typed(batch.output_nodes, ntype)
        assert batch.y[ntype].shape == (len(ids), *table.shape[1:]), ntype
        assert same_bits(batch.y[ntype], table[ids]), ntype


def typed(ids: dict[str, torch.Tensor], ntype: str) -> torch.Tensor:
    """``ids[ntype]`` as int64 CPU ids; none when the type is absent."""
    return ids[ntype].cpu().long() if ntype in ids else torch.empty(0, dtype=torch.int64)


def check_where_the_model_reads(device: Any, batch: Any, features: dict[str, torch.Tensor],
                                labels: dict[str, torch.Tensor] | None) -> None:
    """:func:`check_batch` on the consumer stream (fake device) or the current stream."""
    if isinstance(device, FakeAsyncDevice):
        device.consumer_submit(lambda: check_batch(batch, features, labels)).result()
    else:  # CPU, or CUDA: .cpu() reads on the current stream, which waited for the batch
        check_batch(batch, features, labels)


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("with_labels", [True, False])
def test_typed_batches_equal_the_reference(device_kind: str, with_labels: bool) -> None:
    features, labels = tables()
    source = typed_triples(12)
    used_labels = labels if with_labels else None
    device = make_device(device_kind)
    with PingPongLoader(source, features, used_labels, device=device,
                        heterogeneous=True, debug=True) as loader:
        for _ in range(2):
            seen = 0
            for batch, (inputs, _, blocks) in zip(loader, source, strict=True):
                check_where_the_model_reads(device, batch, features, used_labels)
                assert batch.blocks == blocks
                assert torch.equal(batch.input_nodes["field"].cpu(), inputs["field"])
                seen += 1
            assert seen == len(source)
        stats = loader.stats
    rows = sum(len(i["paper"]) + len(i["author"]) for i, _, _ in source)
    row_bytes = {"paper": 16 * 4, "author": 15 * 2}
    expected_bytes = sum(len(i[t]) * row_bytes[t] for i, _, _ in source for t in row_bytes)
    if with_labels:
        expected_bytes += sum(len(o.get("paper", ())) * 8 for _, o, _ in source)
    assert stats["rows_gathered"] == 2 * rows
    assert stats["bytes_gathered"] == 2 * expected_bytes


class CountingCPUDevice(CPUDevice):
    """The real CPU device, counting the tables it gathers from."""

    def __init__(self) -> None:
        super().__init__(gather_threads=1)
        self.gathered: list[str] = []

    def gather(self, table: Any, ids: np.ndarray, out: torch.Tensor) -> None:
        self.gathered.append(table.name)
        super().gather(table, ids, out)


@pytest.mark.parametrize(
    ("bad", "exc", "needle"),
    [
        (lambda i, o: ({**i, "author": torch.tensor([0, ROWS["author"]])}, o),
         pingpong.IdRangeError, "input_nodes['author'][1] = 120"),
        (lambda i, o: (i, {"paper": torch.tensor([-3])}), pingpong.IdRangeError,
         "output_nodes['paper'][0] = -3"),
        (lambda i, o: (i["paper"], o), pingpong.IdTypeError, "input_nodes must be a dict"),
        (lambda i, o: (i, o["paper"]), pingpong.IdTypeError, "output_nodes must be a dict"),
        (lambda i, o: ({**i, "paper": i["paper"].float()}, o), pingpong.IdTypeError,
         "input_nodes['paper'] must have dtype"),
        (lambda i, o: ({**i, "author": i["author"].tolist()}, o), pingpong.IdTypeError,
         "input_nodes['author'] must be a torch.Tensor or numpy array, got list"),
    ],
    ids=["author-range", "label-range", "ids-not-dict", "outputs-not-dict", "float-ids",
         "list-ids"],
)
@pytest.mark.parametrize("device_kind", ["counting-cpu", "fake"])
def test_bad_typed_ids_are_refused_before_any_table_is_read(bad: Any, exc: type, needle: str,
                                                            device_kind: str) -> None:
    features, labels = tables()
    good = typed_triples(3)
    inputs, outputs, blocks = good[1]
    source = [good[0], (*bad(inputs, outputs), blocks), good[2]]
    device = CountingCPUDevice() if device_kind == "counting-cpu" else make_device("fake")
    with PingPongLoader(source, features, labels, device=device, heterogeneous=True) as loader:
        it = iter(loader)
        check_where_the_model_reads(device, next(it), features, labels)
        with pytest.raises(exc) as info:
            next(it)
        assert needle in str(info.value)
        if isinstance(device, CountingCPUDevice):
            # Batch 0 read each of its three tables once; the bad batch read none.
            assert sorted(device.gathered) == sorted(
                ["features['paper']", "features['author']", "labels['paper']"])
        with pytest.raises(pingpong.EpochFailedError, match="failed after 1 batches"):
            next(it)  # the bad batch ended the epoch
        # the next epoch works
        check_where_the_model_reads(device, next(iter(loader)), features, labels)


@pytest.mark.parametrize(
    ("features", "labels", "needle"),
    [
        (torch.randn(5, 2), None, "features must be a dict {node type: table}"),
        ({"paper": torch.randn(5, 2)}, torch.arange(5), "labels must be None or a dict"),
        ({"paper": torch.randn(5, 2)}, {"paper": torch.arange(6)},
         "labels['paper'] has 6 rows but features['paper'] has 5"),
        ({"paper": torch.randn(5, 2)}, {"paper": torch.arange(4)},
         "labels['paper'] has 4 rows but features['paper'] has 5"),
        ({}, None, "empty dict"),
        ({"paper": torch.randn(5, 2).t()}, None, "not contiguous"),
    ],
    ids=["tensor-features", "tensor-labels", "row-mismatch", "fewer-label-rows", "empty",
         "strided"],
)
def test_bad_typed_tables_are_refused_at_construction(features: Any, labels: Any,
                                                      needle: str) -> None:
    with pytest.raises(pingpong.TableError) as info:
        PingPongLoader([], features, labels, heterogeneous=True)
    assert needle in str(info.value)


def test_typed_tables_may_differ_in_rows_and_a_label_type_may_lack_features() -> None:
    features = {"paper": torch.randn(10, 2)}
    labels = {"paper": torch.arange(10), "author": torch.arange(4) * 10}
    source = [({"paper": torch.tensor([9, 0])},
               {"paper": torch.tensor([1]), "author": torch.tensor([3])}, None)]
    with PingPongLoader(source, features, labels, heterogeneous=True) as loader:
        (batch,) = list(loader)
        assert torch.equal(batch.y["author"], torch.tensor([30]))
        assert torch.equal(batch.x["paper"], features["paper"][[9, 0]])


def test_a_type_missing_from_the_ids_gets_no_rows() -> None:
    features, labels = tables()
    source: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], None]] = [
        ({"paper": torch.tensor([4, 2])}, {}, None)]  # no "author" ids, no outputs
    with PingPongLoader(source, features, labels, heterogeneous=True) as loader:
        (batch,) = list(loader)
        assert batch.x["author"].shape == (0, 3, 5)
        assert batch.y["paper"].shape == (0,)
        assert torch.equal(batch.x["paper"], features["paper"][[4, 2]])


def test_a_homogeneous_loader_points_dict_ids_at_heterogeneous_true() -> None:
    source = [({"paper": torch.arange(3)}, torch.arange(2), None)]
    with PingPongLoader(source, torch.randn(5, 2)) as loader:
        with pytest.raises(pingpong.IdTypeError, match="heterogeneous=True"):
            list(loader)


def test_dict_labels_on_a_homogeneous_loader_point_at_heterogeneous_true() -> None:
    with pytest.raises(pingpong.TableError, match="heterogeneous=True"):
        PingPongLoader([], torch.randn(5, 2), {"paper": torch.arange(5)})


def test_per_type_features_on_a_homogeneous_loader_point_at_heterogeneous_true() -> None:
    """A dict of tables keyed by node type, ``heterogeneous=True`` forgotten: their row
    counts differ, and the error says what the dict was taken for and what to pass."""
    features = {"paper": torch.randn(5, 2), "author": torch.randn(3, 2)}
    with pytest.raises(pingpong.TableError,
                       match=r"different numbers of rows: .*'paper'.*: 5.*'author'.*: 3.*"
                             r"heterogeneous=True"):
        PingPongLoader([], features)


# --------------------------------------------------------------------------- DGL
@pytest.fixture(scope="module")
def mag_like() -> Any:
    """A small heterograph shaped like ogbn-mag: papers, authors, fields."""
    dgl = pytest.importorskip("dgl")
    gen = torch.Generator().manual_seed(1)

    def edges(n_src: int, n_dst: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, n_src, (m,), generator=gen),
                torch.randint(0, n_dst, (m,), generator=gen))

    return dgl.heterograph({
        ("paper", "cites", "paper"): edges(300, 300, 1500),
        ("author", "writes", "paper"): edges(120, 300, 600),
        ("paper", "written_by", "author"): edges(300, 120, 600),
        ("field", "has", "paper"): edges(10, 300, 300),
    }, num_nodes_dict={"paper": 300, "author": 120, "field": 10})


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_dgl_heterograph_loader_batches_equal_the_reference(mag_like: Any,
                                                            device_kind: str) -> None:
    import dgl

    features, labels = tables()
    source = dgl.dataloading.DataLoader(
        mag_like, {"paper": torch.arange(200)}, dgl.dataloading.NeighborSampler([4, 4]),
        batch_size=32, shuffle=True)
    device = make_device(device_kind)
    with PingPongLoader(source, features, labels, device=device,
                        heterogeneous=True) as loader:
        for _ in range(2):
            batches = 0
            for batch in loader:
                check_where_the_model_reads(device, batch, features, labels)
                assert set(batch.input_nodes) == {"paper", "author", "field"}
                assert len(batch.blocks) == 2
                batches += 1
            assert batches == len(source) == 7


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_dgl_loader_seeded_on_two_types_with_labels_for_both(mag_like: Any) -> None:
    """DGL leaves a seed type out of ``output_nodes`` when a batch has none of it."""
    import dgl

    features, labels = tables()
    labels["author"] = torch.arange(ROWS["author"]) * 3
    seeds = {"paper": torch.arange(40), "author": torch.arange(30)}
    source = dgl.dataloading.DataLoader(mag_like, seeds, dgl.dataloading.NeighborSampler([3]),
                                        batch_size=16)
    device = make_device("fake")
    with PingPongLoader(source, features, labels, device=device, heterogeneous=True) as loader:
        seen = {"paper": 0, "author": 0}
        lacking_a_type = 0
        for batch in loader:
            check_where_the_model_reads(device, batch, features, labels)
            lacking_a_type += len(batch.output_nodes) < 2
            for ntype in seen:
                seen[ntype] += int(batch.y[ntype].shape[0])
    assert seen == {"paper": 40, "author": 30}
    assert lacking_a_type >= 1  # the case this test is about did occur


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_dgl_graph_of_one_node_type_and_two_edge_types(device_kind: str) -> None:
    """DGL gives it ``input_nodes`` as a tensor and ``output_nodes`` as the seeds
    were given (a dict here): plain ids are the one table's."""
    import dgl

    gen = torch.Generator().manual_seed(2)
    src, dst = torch.randint(0, 300, (2, 1200), generator=gen)
    g = dgl.heterograph({("paper", "cites", "paper"): (src[:600], dst[:600]),
                         ("paper", "extends", "paper"): (src[600:], dst[600:])})
    features, labels = tables()
    features, labels = {"paper": features["paper"]}, {"paper": labels["paper"]}
    source = dgl.dataloading.DataLoader(
        g, {"paper": torch.arange(100)}, dgl.dataloading.NeighborSampler([3, 3]),
        batch_size=32, shuffle=True)
    device = make_device(device_kind)
    with PingPongLoader(source, features, labels, device=device,
                        heterogeneous=True) as loader:
        for _ in range(2):
            seeds = []
            for batch in loader:
                assert isinstance(batch.input_nodes, torch.Tensor)  # as DGL gives them
                assert isinstance(batch.output_nodes, dict)
                check_where_the_model_reads(
                    device, batch._replace(input_nodes={"paper": batch.input_nodes}),
                    features, labels)
                seeds.append(batch.output_nodes["paper"])
            assert torch.equal(torch.cat(seeds).sort().values, torch.arange(100))


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("where", ["features", "labels"])
def test_a_table_keyed_by_a_type_the_graph_lacks_is_refused(mag_like: Any, where: str) -> None:
    """A misspelt type would get zero rows in every batch: DGL's loader knows its graph."""
    import dgl

    features, labels = tables()
    tables_by_kind = {"features": features, "labels": labels}
    tables_by_kind[where]["Paper"] = tables_by_kind[where].pop("paper")
    if where == "features":
        labels = {}
    source = dgl.dataloading.DataLoader(
        mag_like, {"paper": torch.arange(40)}, dgl.dataloading.NeighborSampler([2]), batch_size=16)
    with pytest.raises(pingpong.TableError,
                       match=rf"{where}\['Paper'\]: the source's graph has no node type 'Paper'; "
                             r"its node types are \['author', 'field', 'paper'\]"):
        PingPongLoader(source, features, labels or None, heterogeneous=True)


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize(("short", "seed_count"), [("paper", 40), ("author", 30)])
def test_a_label_table_short_of_its_types_seeds_is_refused(mag_like: Any, short: str,
                                                           seed_count: int) -> None:
    """Each label table against the seeds of its own type, when the loader is built
    (checked against another type's seeds, a short table passed to fail mid-epoch)."""
    import dgl

    seeds = {"paper": torch.arange(40), "author": torch.arange(30)}
    labels = {"paper": torch.arange(ROWS["paper"]), "author": torch.arange(ROWS["author"])}
    labels[short] = labels[short][: seed_count - 5]
    source = dgl.dataloading.DataLoader(mag_like, seeds, dgl.dataloading.NeighborSampler([2]),
                                        batch_size=16)
    with pytest.raises(pingpong.TableError,
                       match=rf"labels\['{short}'\] has {seed_count - 5} rows, but the "
                             rf"loader's seed nodes of type '{short}' include id "
                             rf"{seed_count - 1}"):
        PingPongLoader(source, {"field": torch.randn(10, 2)}, labels, heterogeneous=True)


@pytest.mark.parametrize("several", ["feature tables", "label tables"])
def test_plain_ids_with_several_tables_are_refused(several: str) -> None:
    """Plain ids are a type's only with one feature table and at most one label
    table: with two label tables, plain ``output_nodes`` would gather both types'
    labels at the same ids (the author labels at paper ids)."""
    features, labels = tables()
    item: tuple[Any, Any, None]
    if several == "feature tables":
        item, used_labels = (torch.arange(3), {}, None), None
    else:
        features = {"paper": features["paper"]}
        used_labels = {**labels, "author": torch.arange(ROWS["author"]) * 3}
        item = ({"paper": torch.arange(3)}, torch.arange(2), None)
    with PingPongLoader([item], features, used_labels, heterogeneous=True) as loader:
        with pytest.raises(pingpong.IdTypeError, match="one feature table and at most"):
            list(loader)


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_a_bipartite_block_has_no_edge_block_form() -> None:
    """One edge type but two node types: merging them would mix their local ids."""
    import dgl

    g = dgl.heterograph({("user", "buys", "item"): (torch.tensor([0, 1, 2]),
                                                    torch.tensor([1, 1, 0]))})
    block = dgl.to_block(g, {"item": torch.tensor([0, 1])})
    with pytest.raises(TypeError, match="source node types"):
        pingpong.as_edge_block(block)


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_a_heterogeneous_block_has_no_edge_block_form(mag_like: Any) -> None:
    import dgl

    source = dgl.dataloading.DataLoader(
        mag_like, {"paper": torch.arange(8)}, dgl.dataloading.NeighborSampler([2]),
        batch_size=8)
    _, _, blocks = next(iter(source))
    with pytest.raises(TypeError, match="4 edge types"):
        pingpong.as_edge_block(blocks[0])
