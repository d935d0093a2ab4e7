"""The loader on a real GPU (marked ``cuda``; skipped cleanly without one).

Run by ``benchmarks/gpu_check.sh`` on a GPU machine.  Every batch is compared
bit for bit with ``features[input_nodes]`` on the host.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from conftest import make_triples

import pingpong
from pingpong import EdgeBlock, PingPongLoader

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = 4096
MODES = ["zerocopy", "staged", "device"]


def _host_equal(device_tensor: torch.Tensor, reference: torch.Tensor) -> bool:
    got = device_tensor.cpu()
    return got.dtype == reference.dtype and torch.equal(
        got.reshape(-1).view(torch.uint8), reference.reshape(-1).view(torch.uint8)
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [(torch.float32, (128,)), (torch.float16, (7,)), (torch.bfloat16, (33,)), (torch.int8, (3,))],
    ids=str,
)
def test_bit_identical_on_gpu(mode, dtype, row_shape):
    features = (torch.randn((N, *row_shape)) * 50).to(dtype)
    labels = torch.randint(0, 40, (N,))
    source = make_triples(N, 10, max_inputs=3000, last_out=3)
    source.append((torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), []))
    with PingPongLoader(source, features, labels, device="cuda", gather=mode) as loader:
        assert loader.gather_mode == mode
        for _ in range(3):
            for batch, (inputs, outputs, _blocks) in zip(loader, source, strict=True):
                assert batch.x.device.type == "cuda"
                assert _host_equal(batch.x, features[inputs])
                assert _host_equal(batch.y, labels[outputs])


@pytest.mark.parametrize("mode", MODES)
def test_long_consumer_kernel_before_reading_changes_nothing(mode):
    """A slow consumer stream amplifies any missing ready/release wait."""
    features = torch.randn(N, 64)
    source = make_triples(N, 16, max_inputs=2000)
    with PingPongLoader(source, features, device="cuda", gather=mode, num_buffers=2) as loader:
        sums = []
        for batch in loader:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time queued before the read
            sums.append(batch.x.double().sum(dim=1))
        torch.cuda.synchronize()
        for got, (inputs, _o, _b) in zip(sums, source, strict=True):
            assert torch.equal(got.cpu(), features[inputs].double().sum(dim=1))


def test_dict_features_and_edge_blocks_move_to_gpu():
    features = {"a": torch.randn(N, 5), "b": torch.randint(0, 9, (N, 2))}
    block = EdgeBlock(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1]), 3, 2)
    source = [(torch.arange(3), torch.arange(2), [block])]
    with PingPongLoader(source, features, device="cuda") as loader:
        (batch,) = list(loader)
    moved = batch.blocks[0]
    assert isinstance(moved, EdgeBlock)
    assert moved.src.device.type == "cuda"
    assert torch.equal(moved.src.cpu(), block.src)
    assert moved.num_dst_nodes == 2
    assert _host_equal(batch.x["a"], features["a"][:3])


def test_pinning_is_released_and_can_be_repeated():
    from pingpong.kernels import _interop

    # zerocopy registers the host table; auto would copy this small table to the GPU

    features = torch.randn(N, 16)
    before = _interop.registered_count()
    for _ in range(3):
        with PingPongLoader(make_triples(N, 3), features, device="cuda",
                            gather="zerocopy") as loader:
            assert _interop.registered_count() == before + 1
            assert sum(1 for _ in loader) == 3
        assert _interop.registered_count() == before
    # two loaders over one table at once share one registration
    with PingPongLoader(make_triples(N, 2), features, device="cuda", gather="zerocopy") as a:
        with PingPongLoader(make_triples(N, 2), features, device="cuda", gather="zerocopy") as b:
            assert _interop.registered_count() == before + 1
            list(a)
            list(b)
        assert _interop.registered_count() == before + 1
    assert _interop.registered_count() == before
    gc.collect()


def test_a_view_inside_a_pinned_table_shares_its_registration():
    """Found in review: a table starting inside a registered range was taken as
    "pinned by someone else" (no count): closing the first loader unpinned it."""
    from pingpong.kernels import _interop

    features = torch.randn(N, 16)
    inner = features[100:]  # starts 6400 bytes into the registered range
    before = _interop.registered_count()
    outer_loader = PingPongLoader(make_triples(N, 2), features, device="cuda", gather="zerocopy")
    with PingPongLoader(make_triples(N - 100, 3), inner, device="cuda",
                        gather="zerocopy") as inner_loader:
        assert _interop.registered_count() == before + 1
        outer_loader.close()  # the inner loader still counts on the registration
        assert _interop.registered_count() == before + 1
        for _ in range(2):
            for batch, (ids, _o, _b) in zip(inner_loader, make_triples(N - 100, 3), strict=True):
                assert _host_equal(batch.x, inner[ids])
    assert _interop.registered_count() == before


def test_a_table_overlapping_a_pinned_one_is_refused():
    """A view registered first, then the whole tensor: the driver cannot register
    its pages twice, and the view's mapping does not cover the rest."""
    features = torch.randn(N, 16)
    with PingPongLoader(make_triples(10, 2), features[:10], device="cuda", gather="zerocopy"):
        with pytest.raises(pingpong.TableError, match="overlap"):
            PingPongLoader(make_triples(N, 2), features, device="cuda", gather="zerocopy")


def test_staged_gathers_with_torch_while_its_kernel_warms_up(monkeypatch):
    """Found in review: ``staged`` called Numba's CPU gather at once, so a batch
    that came while the warm-up compiled waited for the compiler."""
    import threading
    import time

    from pingpong.devices import cpu as cpu_device
    from pingpong.devices.cuda import _modes
    from pingpong.kernels import cpu as cpu_kernels

    started = threading.Event()

    def endless_warm_up(tables: Any, should_stop: Any = None, **_kw: Any) -> list[Any]:
        started.set()
        while not should_stop():
            time.sleep(0.005)
        return []

    def numba_must_not_run(*args: Any) -> None:
        raise AssertionError("the Numba gather ran while the warm-up was in progress")

    monkeypatch.setattr(_modes, "warm_up_cpu", endless_warm_up)
    monkeypatch.setattr(cpu_kernels, "_ready", set())  # as in a fresh process
    monkeypatch.setattr(cpu_device, "gather_rows_cpu_unchecked", numba_must_not_run)
    features = torch.randn(N, 12).to(torch.bfloat16)
    triples = make_triples(N, 6, max_inputs=700)
    with PingPongLoader(triples, features, device="cuda", gather="staged") as loader:
        assert started.wait(5)
        for _ in range(2):
            for batch, (ids, _o, _b) in zip(loader, triples, strict=True):
                assert _host_equal(batch.x, features[ids])


def test_already_pinned_table_is_used_as_is():
    from pingpong.kernels import _interop

    features = torch.randn(N, 16).pin_memory()
    before = _interop.registered_count()
    with PingPongLoader(make_triples(N, 3), features, device="cuda") as loader:
        assert _interop.registered_count() == before
        for batch, (inputs, _o, _b) in zip(loader, make_triples(N, 3), strict=True):
            assert _host_equal(batch.x, features[inputs])
    assert features.is_pinned()


def test_bad_ids_raise_before_any_kernel_on_gpu():
    features = torch.randn(N, 8)
    source = [(torch.tensor([0, N]), torch.tensor([0]), None)]
    with PingPongLoader(source, features, device="cuda") as loader:
        with pytest.raises(pingpong.IdRangeError, match=f"N = {N}"):
            list(loader)
    torch.cuda.synchronize()  # no asynchronous fault was left behind


def test_gather_rows_cuda_on_device_arrays():
    from numba import cuda

    from pingpong.kernels import gather_rows_cuda

    table = torch.randint(0, 255, (1000, 37), dtype=torch.uint8)
    ids = torch.randint(0, 1000, (5000,))
    d_table = cuda.to_device(table.numpy())
    d_out = cuda.device_array((5000, 37), dtype=table.numpy().dtype)
    gather_rows_cuda(d_table, cuda.to_device(ids.numpy()), d_out)
    assert (d_out.copy_to_host() == table[ids].numpy()).all()


@pytest.mark.parametrize(("mode", "sort_ids"), [("zerocopy", "auto"), ("zerocopy", "none"),
                                               ("zerocopy", "gpu"), ("device", "gpu")])
def test_sorted_id_gather_keeps_output_order(mode, sort_ids):
    """ids sorted on the GPU (the zerocopy default), rows scattered back to their places."""
    features = torch.randn(N, 40)
    labels = torch.randint(0, 9, (N,))
    source = make_triples(N, 8, max_inputs=3000)
    source.append((torch.tensor([5, 5, 1, 4095, 0, 5]), torch.tensor([3]), []))  # duplicates
    with PingPongLoader(source, features, labels, device="cuda", gather=mode,
                        sort_ids=sort_ids) as loader:
        for _ in range(2):
            for batch, (inputs, outputs, _b) in zip(loader, source, strict=True):
                assert _host_equal(batch.x, features[inputs])
                assert _host_equal(batch.y, labels[outputs])


def test_auto_chooses_device_resident_for_small_tables():
    """A 4096 x 40 float32 table is far below half of any GPU's free memory."""
    with PingPongLoader(make_triples(N, 2), torch.randn(N, 40), device="cuda") as loader:
        assert loader.gather_mode == "device"
        for batch, (inputs, _o, _b) in zip(loader, make_triples(N, 2), strict=True):
            assert batch.x.is_cuda
            assert inputs.shape[0] == batch.x.shape[0]


# -- the stream contract (docs/guide.rst, "CUDA streams") ------------------------------
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time queued before each read


@pytest.mark.parametrize("mode", MODES)
def test_reading_on_a_side_stream_after_record_stream(mode):
    """``batch.record_stream(side)``: side waits for the batch, the slot waits for side.

    Without it the side stream's delayed read would see the slot refilled.
    """
    features = torch.randn(N, 64)
    source = make_triples(N, 16, max_inputs=2000)
    side = torch.cuda.Stream()
    with PingPongLoader(source, features, device="cuda", gather=mode, num_buffers=2) as loader:
        sums = []
        for batch in loader:
            batch.record_stream(side)
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                sums.append(batch.x.double().sum(dim=1))
        torch.cuda.synchronize()
        for got, (inputs, _o, _b) in zip(sums, source, strict=True):
            assert torch.equal(got.cpu(), features[inputs].double().sum(dim=1))


@pytest.mark.parametrize("mode", MODES)
def test_switching_streams_between_batches_keeps_each_batch_until_its_stream_is_done(mode):
    """Batch k is read on stream k % 2; its release is recorded on that stream,
    not on the stream current at the next ``next()`` (the other one)."""
    features = torch.randn(N, 64)
    source = make_triples(N, 16, max_inputs=2000)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    with PingPongLoader(source, features, device="cuda", gather=mode, num_buffers=2) as loader:
        it = iter(loader)
        sums = []
        for k in range(len(source)):
            with torch.cuda.stream(streams[k % 2]):
                batch = next(it)
                torch.cuda._sleep(SLEEP_CYCLES)
                sums.append(batch.x.double().sum(dim=1))
        it.close()
        torch.cuda.synchronize()
        for got, (inputs, _o, _b) in zip(sums, source, strict=True):
            assert torch.equal(got.cpu(), features[inputs].double().sum(dim=1))


def test_dgl_graphs_moved_on_the_copy_stream_are_recorded_on_the_consumer_stream(dgl):
    """Needs a DGL build that can put graphs on the GPU (PyPI's cannot: skipped there)."""
    g = dgl.rand_graph(N, 8 * N)
    try:
        g.to("cuda")
    except Exception as exc:  # noqa: BLE001 - any failure means a CPU-only DGL build
        pytest.skip(f"this DGL build cannot move graphs to the GPU: {exc}")
    sampler = dgl.dataloading.NeighborSampler([4, 4])
    source = dgl.dataloading.DataLoader(g, torch.arange(512), sampler, batch_size=64)
    features = torch.randn(N, 16)
    with PingPongLoader(source, features, device="cuda") as loader:
        for batch in loader:
            torch.cuda._sleep(SLEEP_CYCLES)
            assert all(block.device.type == "cuda" for block in batch.blocks)
            edges = [block.edges()[0].sum() for block in batch.blocks]
            assert _host_equal(batch.x, features[batch.input_nodes.cpu()])
            assert all(int(e) >= 0 for e in edges)



@pytest.mark.parametrize("mode", MODES)
def test_heterogeneous_dgl_blocks_arrive_as_hetero_edge_blocks_on_gpu(dgl, mode):
    """With a CPU-only DGL (PyPI's), a heterograph loader's blocks become
    HeteroEdgeBlocks, moved on the copy stream: every type's edges equal DGL's."""
    if pingpong.forms.dgl_can_hold_graphs_on(torch.device("cuda")):
        pytest.skip("this DGL build puts graphs on the GPU: they stay DGL blocks")
    gen = torch.Generator().manual_seed(0)
    sizes = {"paper": 600, "author": 200}
    etypes = [("paper", "cites", "paper"), ("author", "writes", "paper"),
              ("paper", "written_by", "author")]
    graph = dgl.heterograph({et: (torch.randint(0, sizes[et[0]], (3000,), generator=gen),
                                  torch.randint(0, sizes[et[2]], (3000,), generator=gen))
                             for et in etypes}, num_nodes_dict=sizes)
    features = {"paper": torch.randn(600, 16), "author": torch.randn(200, 8)}
    items = list(dgl.dataloading.DataLoader(graph, {"paper": torch.arange(256)},
                                            dgl.dataloading.NeighborSampler([4, 4]),
                                            batch_size=64, shuffle=True))
    with PingPongLoader(items, features, device="cuda", gather=mode,
                        heterogeneous=True) as loader:
        for batch, (inputs, _outputs, blocks) in zip(loader, items, strict=True):
            torch.cuda._sleep(SLEEP_CYCLES)
            for got, want in zip(batch.blocks, blocks, strict=True):
                assert isinstance(got, pingpong.HeteroEdgeBlock)
                assert got.canonical_etypes == [tuple(et) for et in want.canonical_etypes]
                for etype, edges in got.edges.items():
                    assert edges.src.is_cuda
                    assert edges.dst.is_cuda
                    src, dst = want.edges(etype=etype)
                    assert torch.equal(edges.src.cpu(), src)
                    assert torch.equal(edges.dst.cpu(), dst)
            for ntype, table in features.items():
                assert _host_equal(batch.x[ntype], table[inputs[ntype]])



@pytest.mark.parametrize("mode", MODES)
def test_host_writes_between_epochs_reach_every_mode_but_device(mode):
    """docs/guide.rst, "Tables that change": zerocopy and staged read the host table
    per batch; device mode gathers from the copy made when the loader was built."""
    features = torch.arange(N * 4, dtype=torch.float32).reshape(N, 4)
    before = features.clone()
    source = make_triples(N, 6, max_inputs=500)
    with PingPongLoader(source, features, device="cuda", gather=mode) as loader:
        for batch, (inputs, _o, _b) in zip(loader, source, strict=True):
            assert _host_equal(batch.x, features[inputs])
        features.mul_(-1)
        want = before if mode == "device" else features
        for batch, (inputs, _o, _b) in zip(loader, source, strict=True):
            assert _host_equal(batch.x, want[inputs])


@pytest.mark.parametrize("mode", ["zerocopy", "staged"])
def test_a_write_after_the_epoch_reaches_none_of_its_batches(mode):
    """The epoch's StopIteration waits for its gathers (``wait_for_fills``): a loop
    that never waits on the host (each batch copied on the stream behind ~10 ms of
    GPU work) and writes the table right after its ``for`` sees none of the write."""
    features = torch.arange(N * 4, dtype=torch.float32).reshape(N, 4)
    before = features.clone()
    source = make_triples(N, 8, max_inputs=500)
    with PingPongLoader(source, features, device="cuda", gather=mode) as loader:
        copies = []
        for batch in loader:
            torch.cuda._sleep(SLEEP_CYCLES)
            copies.append(batch.x.clone())
        features.mul_(-1)  # no host wait since the last next()
        for got, (inputs, _o, _b) in zip(copies, source, strict=True):
            assert _host_equal(got, before[inputs])


# -- batch forms on the GPU (no DGL on the GPU machine: GraphBolt stand-in, form=) -----
class MiniBatch:
    """Stands in for a GraphBolt MiniBatch (DGL 2.2+ field names) whose ``to()``
    moves its structure, as GraphBolt's does."""

    def __init__(self, seeds: torch.Tensor, input_nodes: torch.Tensor) -> None:
        self.seeds = seeds
        self.input_nodes = input_nodes
        self.labels = None
        self.node_features = None
        self.sampled_subgraphs = [torch.stack((input_nodes, input_nodes.flip(0)))]

    def to(self, device: torch.device) -> MiniBatch:
        self.sampled_subgraphs = [t.to(device) for t in self.sampled_subgraphs]
        return self


@pytest.mark.parametrize("mode", MODES)
def test_graphbolt_like_minibatches_move_and_fill_on_gpu(mode):
    gen = torch.Generator().manual_seed(0)
    features, labels = torch.randn(N, 32), torch.randint(0, 9, (N,))
    items = [MiniBatch(torch.randperm(N, generator=gen)[:64],
                       torch.randperm(N, generator=gen)[:1500]) for _ in range(12)]
    with PingPongLoader(items, features, labels, device="cuda", gather=mode) as loader:
        for minibatch in loader:
            torch.cuda._sleep(SLEEP_CYCLES)
            structure = minibatch.sampled_subgraphs[0]
            assert structure.is_cuda
            assert torch.equal(structure[0].cpu(), minibatch.input_nodes)
            assert _host_equal(minibatch.node_features["feat"], features[minibatch.input_nodes])
            assert _host_equal(minibatch.labels, labels[minibatch.seeds])


def test_custom_form_on_gpu():
    features = torch.randn(N, 16)
    items = [{"nodes": torch.randint(0, N, (700,)), "seeds": torch.arange(k, k + 8)}
             for k in range(10)]
    with PingPongLoader(items, features, form=lambda item: (item["nodes"], None),
                        device="cuda") as loader:
        for batch, item in zip(loader, items, strict=True):
            assert isinstance(batch, pingpong.CustomBatch)
            assert isinstance(batch.x, torch.Tensor)
            assert _host_equal(batch.x, features[item["nodes"]])


@pytest.mark.parametrize("how", ["hot_ids", "learned"])
@pytest.mark.parametrize(
    ("dtype", "row_shape"), [(torch.float32, (128,)), (torch.float16, (7,))], ids=str
)
def test_zerocopy_with_a_hot_row_cache_is_bit_identical(how, dtype, row_shape):
    """Cached rows from device memory, the rest over PCIe, in one kernel (pingpong.cache)."""
    features = (torch.randn((N, *row_shape)) * 50).to(dtype)
    source = make_triples(N, 10, max_inputs=3000)
    row_bytes = features[0].numel() * features.element_size()
    extra: dict[str, Any] = {"hot_ids": torch.arange(0, N, 3)} if how == "hot_ids" else {}
    with PingPongLoader(source, features, device="cuda", gather="zerocopy",
                        cache_bytes=400 * row_bytes, **extra) as loader:
        for _ in range(3):
            for batch, (inputs, _outputs, _blocks) in zip(loader, source, strict=True):
                assert _host_equal(batch.x, features[inputs])
        stats = loader.stats
    assert stats["cache_rows"] == 400
    assert 0 < stats["cache_hits"] < stats["cache_lookups"]


def test_refresh_cache_copies_the_cached_rows_again():
    """A write between epochs reaches the cached rows after ``refresh_cache()``."""
    features = torch.randn(N, 8)
    source = make_triples(N, 4, max_inputs=3000)
    with PingPongLoader(source, features, device="cuda", gather="zerocopy",
                        cache_bytes=400 * 32, hot_ids=torch.arange(0, N, 2)) as loader:
        for batch, (inputs, _o, _b) in zip(loader, source, strict=True):
            assert _host_equal(batch.x, features[inputs])
        features.mul_(-2).add_(1)
        loader.refresh_cache()
        for _ in range(2):
            for batch, (inputs, _o, _b) in zip(loader, source, strict=True):
                assert _host_equal(batch.x, features[inputs])
        assert loader.stats["cache_hits"] > 0


def test_a_cache_from_hot_ids_is_built_on_the_copy_stream(monkeypatch):
    """The constructor builds it, before any producer started: on the copy stream
    still (stream 0 is not ordered with torch's streams: a first gather could read
    the cache before the build wrote it)."""
    from pingpong.devices.cuda import CUDADevice, _modes

    launches: list[Any] = []
    real = _modes.gather_rows_cuda_unchecked

    def recording(*args: Any, **kwargs: Any) -> None:
        launches.append(args[3])
        real(*args, **kwargs)

    monkeypatch.setattr(_modes, "gather_rows_cuda_unchecked", recording)
    features = torch.randn(N, 8)
    loader = PingPongLoader(make_triples(N, 2), features, device="cuda", gather="zerocopy",
                            cache_bytes=100 * 32, hot_ids=torch.arange(100))
    with loader:
        assert len(launches) == 1  # the build, in the constructor
        device = loader._device
        assert isinstance(device, CUDADevice)
        assert launches[0] is not None
        assert launches[0] is device._copy.numba_stream  # made from the copy stream
        for batch, (inputs, _o, _b) in zip(loader, make_triples(N, 2), strict=True):
            assert _host_equal(batch.x, features[inputs])


def test_the_cache_is_not_used_when_the_tables_are_on_the_gpu():
    features = torch.randn(N, 8)
    with PingPongLoader(make_triples(N, 3), features, device="cuda", gather="device",
                        cache_bytes=1 << 20) as loader:
        for _batch in loader:
            pass
        assert loader.stats["cache_rows"] == 0
