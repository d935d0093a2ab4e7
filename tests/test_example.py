"""examples/train_sage.py end to end, on a tiny synthetic graph (a few seconds a run)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_own_session

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_sage.py"
HAVE_DGL = importlib.util.find_spec("dgl") is not None

# Skipped only until the loader core lands; the lead removes this guard.
TINY = ["--sampler", "builtin", "--num-nodes", "4000", "--num-classes", "4",
        "--avg-degree", "10", "--fanouts", "5,5", "--batch-size", "64", "--hidden", "32",
        "--epochs", "3", "--lr", "0.01", "--log-every", "10", "--eval-batch-size", "512"]
CHANCE = 1 / 4


def run_example(tmp_path: Path, name: str, *args: str, timeout: float = 240,
                script: Path = SCRIPT) -> tuple[dict[str, Any], str]:
    """Run the script; return its --json summary and its stdout.

    The script runs in its own session, so that a hung run (including the
    ranks a ``--nprocs`` run spawns) is killed as a whole.
    """
    out = tmp_path / f"{name}.json"
    returncode, stdout, stderr = run_in_own_session(
        [sys.executable, str(script), *args, "--json", str(out)], timeout=timeout,
        env=dict(os.environ, PYTHONHASHSEED="0"), cwd=tmp_path)
    assert returncode == 0, stdout + stderr
    return json.loads(out.read_text()), stdout


#: Counters only PingPongLoader reports (the plain loop's SyncLoader has none of
#: them): a run's stats show which loader really delivered its batches.
PINGPONG_ONLY_STATS = {"validate_s", "consumer_stall_s", "overlap_ratio", "slot_bytes"}


def assert_every_batch_checked(dump: Path, world_size: int, batches: int) -> None:
    """Each rank of a ``--dump-batches`` run checked every batch it trained on, and none
    differed: ``x`` bit for bit ``features[input_nodes]`` and ``y``
    ``labels[output_nodes]`` of the rank's (shared) tables, blocks that fit the ids
    (DGL blocks: their ``dgl.NID``) -- the script's ``BatchCheck``, in its
    ``.meta.json`` per rank."""
    for rank in range(world_size):
        stem = dump.stem if world_size == 1 else f"{dump.stem}.rank{rank}"
        meta = json.loads(dump.with_name(f"{stem}.meta.json").read_text())
        assert (meta["rank"], meta["world_size"]) == (rank, world_size)
        if rank > 0:  # rank 0 alone evaluates
            assert meta["eval_batches"] == 0
        else:
            assert meta["eval_batches"] > 0
        assert sum(len(epoch) for epoch in meta["output_nodes"]) == batches
        assert meta["batch_check"] == {"batches_checked": batches, "batches_differing": 0,
                                       "first_differing": []}, f"rank {rank}"


def dumped_run(tmp_path_factory: pytest.TempPathFactory,
               loader: str) -> tuple[dict[str, Any], str, Path]:
    tmp = tmp_path_factory.mktemp(loader)
    dump = tmp / "batches.json"
    result, stdout = run_example(tmp, loader, *TINY, "--loader", loader,
                                 "--dump-batches", str(dump))
    return result, stdout, dump


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """The plain loop (``--loader dgl``) on TINY, with its batch digests."""
    return dumped_run(tmp_path_factory, "dgl")


@pytest.fixture(scope="module")
def pingpong_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """The same run through PingPongLoader (``--loader pingpong``)."""
    return dumped_run(tmp_path_factory, "pingpong")


@pytest.mark.slow  # a subprocess run of the script per loader (~4 s each)
@pytest.mark.parametrize("loader", ["dgl", "pingpong"], ids=["plain-loop", "pingpong"])
def test_sage_learns_and_reports_dgl_style(loader: str, request: pytest.FixtureRequest) -> None:
    """GraphSAGE learns through each loader, and the log has DGL's example format."""
    result, stdout, _ = request.getfixturevalue("plain_run" if loader == "dgl" else "pingpong_run")
    assert (result["loader"], result["device"], result["model"]) == (loader, "cpu", "sage")
    if loader == "pingpong":  # the batches really came through PingPongLoader
        assert result["stats"].keys() >= PINGPONG_ONLY_STATS, result["stats"]
    else:
        assert not PINGPONG_ONLY_STATS & result["stats"].keys(), result["stats"]
    assert result["test_acc"] > CHANCE + 0.4
    assert result["val_acc"] > CHANCE + 0.3
    assert len(result["epoch_times"]) == 3
    assert result["samples_per_sec"] > 0
    assert result["stats"]["batches"] == len(result["losses"])
    assert re.search(r"^Epoch 00000 \| Step 00010 \| Loss \d+\.\d{4} \| Train Acc \d\.\d{4} \| "
                     r"Speed \(samples/sec\) \d+\.\d$", stdout, re.M), stdout
    assert "GPU" not in stdout
    assert len(re.findall(r"^Epoch Time\(s\): \d+\.\d{4}$", stdout, re.M)) == 3
    assert len(re.findall(r"^Eval Acc \d\.\d{4}$", stdout, re.M)) == 3
    assert re.search(r"^Test Acc: \d\.\d{4}$", stdout, re.M)


@pytest.mark.slow  # a subprocess run of the script (~4 s)
def test_mlp_baseline_is_worse(tmp_path: Path,
                               plain_run: tuple[dict[str, Any], str, Path]) -> None:
    mlp, _ = run_example(tmp_path, "mlp", *TINY, "--loader", "dgl", "--mlp")
    assert mlp["model"] == "mlp"
    assert CHANCE < mlp["test_acc"] < plain_run[0]["test_acc"] - 0.08


@pytest.mark.slow  # uses the two module runs above
def test_pingpong_sees_the_same_batches_as_the_plain_loop(
        plain_run: tuple[dict[str, Any], str, Path],
        pingpong_run: tuple[dict[str, Any], str, Path]) -> None:
    """Bit-identical ids, features, labels and blocks per step, and identical losses."""
    plain, _, plain_dump = plain_run
    ours, _, dump = pingpong_run
    assert ours["loader"] == "pingpong"
    assert ours["stats"].keys() >= PINGPONG_ONLY_STATS
    digests, plain_digests = json.loads(dump.read_text()), json.loads(plain_dump.read_text())
    assert len(digests) == len(plain_digests) == ours["stats"]["batches"]
    assert digests == plain_digests
    for dumped in (plain_dump, dump):
        assert_every_batch_checked(dumped, 1, len(digests))
    assert ours["losses"] == plain["losses"]
    assert ours["test_acc"] == plain["test_acc"]


@pytest.mark.slow  # a subprocess run of the script (~4 s)
@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
def test_graph_file_dgl_blocks_bf16_through_pingpong(tmp_path: Path) -> None:
    """A dgl.save_graphs file, DGL's sampler (DGL blocks), bf16 features and autocast."""
    import dgl

    from pingpong.sources import make_synthetic_graph

    g = make_synthetic_graph(num_nodes=3000, num_classes=4, feat_dim=64, avg_degree=8).to_dgl()
    path = tmp_path / "g.bin"
    dgl.save_graphs(str(path), [g])
    result, stdout = run_example(
        tmp_path, "graph", "--graph", str(path), "--sampler", "dgl", "--loader", "pingpong",
        "--gather", "cpu", "--fanouts", "5,5", "--batch-size", "128", "--hidden", "32",
        "--epochs", "2", "--feat-dtype", "bfloat16", "--amp", "bf16", "--lr", "0.01")
    assert "3000 nodes, 64 features, 4 classes" in stdout
    assert (result["sampler"], result["loader"]) == ("dgl", "pingpong")
    stats = result["stats"]
    assert stats.keys() >= PINGPONG_ONLY_STATS, stats  # PingPongLoader delivered the batches
    assert stats["batches"] == len(result["losses"])
    # Features gathered as bfloat16: 64 x 2 bytes per input row, plus an int64 label
    # per output row (output nodes are a subset of the input nodes); float32 would
    # need 256 bytes per input row.
    assert 128 * stats["rows_gathered"] < stats["bytes_gathered"] <= 136 * stats["rows_gathered"]
    assert result["test_acc"] > CHANCE + 0.2


@pytest.mark.slow  # two runs of two spawned ranks each (~15 s a run)
def test_two_ddp_ranks_see_the_same_batches_through_pingpong_and_the_plain_loop(
        tmp_path: Path) -> None:
    """--nprocs 2: per rank, pingpong's batches equal the plain loop's bit for bit."""
    runs = {}
    for loader in ("dgl", "pingpong"):
        dump = tmp_path / f"{loader}.json"
        result, stdout = run_example(tmp_path, loader, *TINY, "--nprocs", "2",
                                     "--loader", loader, "--dump-batches", str(dump),
                                     timeout=240)
        ranks = [json.loads((tmp_path / f"{loader}.rank{r}.json").read_text())
                 for r in range(2)]
        runs[loader] = result, ranks
        assert "| 2 ranks (DDP)" in stdout
        assert len(re.findall(r"^Epoch Time\(s\): ", stdout, re.M)) == 3  # rank 0 only
        assert result["world_size"] == 2
        assert result["test_acc"] > CHANCE + 0.3
        # 1,200 training nodes split over two ranks: 600 seeds, 10 batches of 64 per epoch.
        assert [len(r) for r in ranks] == [30, 30]
        assert not set(ranks[0]) & set(ranks[1])  # the ranks trained on different batches
        assert_every_batch_checked(dump, 2, 30)
    (plain, plain_ranks), (ours, our_ranks) = runs["dgl"], runs["pingpong"]
    assert our_ranks == plain_ranks
    assert ours["losses"] == plain["losses"]
    assert ours["test_acc"] == plain["test_acc"]


@pytest.mark.slow  # two spawned ranks (~15 s)
@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
def test_two_ddp_ranks_with_dgls_sampler(tmp_path: Path) -> None:
    """--nprocs 2 with DGL's DataLoader(use_ddp=True), the default sampler when DGL is here.

    DGL's batches do not repeat from run to run, so there is no reference run to
    compare with: each rank checked every batch it trained on against the shared
    tables (``--dump-batches``).
    """
    args = [a for a in TINY if a not in ("--sampler", "builtin")]
    dump = tmp_path / "dgl-ddp-batches.json"
    result, stdout = run_example(tmp_path, "dgl-ddp", *args, "--sampler", "dgl",
                                 "--nprocs", "2", "--epochs", "2", "--dump-batches", str(dump),
                                 timeout=240)
    assert "sampler dgl" in stdout
    assert (result["world_size"], result["sampler"]) == (2, "dgl")
    assert len(result["losses"]) == 2 * 10  # rank 0: 600 of 1,200 seeds, batches of 64
    assert result["test_acc"] > CHANCE + 0.2
    # DDP: every rank takes rank 0's number of steps.
    assert_every_batch_checked(dump, 2, len(result["losses"]))


# --------------------------------------------------------------------------- CLI errors
@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_sage

    return train_sage


@pytest.mark.parametrize("argv", [
    ["--fanouts", "10,x"], ["--fanouts", "10,0"], ["--fanouts", ""], ["--loader", "torch"],
    ["--epochs", "0"], ["--batch-size", "-3"], ["--gather", "gpu"], ["--amp", "fp8"],
    ["--feat-dtype", "int8"], ["--lr", "0"], ["--dropout", "1.5"], ["--no-such-flag"],
    ["--nprocs", "0"], ["--cache-bytes", "1024"], ["--cache-bytes", "-1"],
    ["--graph-kind", "rmat"], ["--num-buffers", "1"],
    # a GPU gather mode on the CPU; a --json file in a folder that does not exist
    # (refused before training, not after it)
    ["--gather", "zerocopy"], ["--gather", "staged"], ["--gather", "device"],
    ["--json", "/no/such/folder/run.json"],
    # a folder, and a file nobody can create: the run finished, then crashed writing it
    ["--json", "/"], ["--json", "/proc/no-such-run.json"],
    # past DGL's C int: dgl.seed raised from deep inside training (an examples review)
    ["--seed", "2147483648"], ["--seed", "-1"],
])
def test_bad_flags_are_argparse_errors(script: Any, argv: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("sampler", [
    "builtin",
    pytest.param("dgl", marks=[pytest.mark.dgl,
                               pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")]),
])
def test_the_batch_check_names_every_wrong_batch(script: Any, sampler: str) -> None:
    """``--dump-batches``' ``BatchCheck`` (what the DDP and torchrun tests rely on when
    they find no differing batch): a right batch passes; each wrong one is counted and
    named -- x or y one element off or of another dtype, a layer missing, the layers
    reversed or not chained, output nodes that are not the input nodes' prefix and, for DGL blocks,
    ``dgl.NID`` ids that are not the batch's."""
    import torch
    from _batch_check import BatchCheck

    from pingpong.blocks import as_edge_block

    args = script.build_parser().parse_args([*TINY, "--sampler", sampler])
    data = script.load_dataset(args)
    loader = script.SyncLoader(
        script.make_source(data, args, data.train_idx, args.batch_size, shuffle=False),
        data.features, data.labels, torch.device("cpu"))
    right, *later = itertools.islice(loader, 6)
    # another batch's last layer: as many destination nodes, other source nodes (DGL's
    # unseeded draws can give one later batch as many source nodes by chance: seen once)
    second = next(b for b in later
                  if len(b.output_nodes) == len(right.output_nodes)
                  and (as_edge_block(b.blocks[1]).num_src_nodes
                       != as_edge_block(right.blocks[0]).num_dst_nodes))
    spliced = [right.blocks[0], second.blocks[1]]
    x, y = right.x.clone(), right.y.clone()
    x[3, 1] += 1
    y[5] = (y[5] + 1) % data.num_classes
    rolled = right.input_nodes.roll(1)
    wrong = [
        (right._replace(x=x), ["x"]),
        (right._replace(x=right.x.view(torch.int32)), ["x"]),  # the same bytes
        (right._replace(y=y), ["y"]),
        (right._replace(y=right.y.view(torch.float64)), ["y"]),  # the same bytes
        (right._replace(blocks=right.blocks[1:]), ["blocks"]),
        (right._replace(blocks=right.blocks[::-1]), ["blocks"]),
        (right._replace(blocks=spliced), ["blocks"]),  # the layers do not chain
        # the rows fit the ids, but the output nodes are no longer the input nodes' prefix
        (right._replace(input_nodes=rolled, x=data.features[rolled]), ["blocks"]),
        (right._replace(x=x, y=y, blocks=right.blocks[1:]), ["x", "y", "blocks"]),
    ]
    if sampler == "dgl":
        import dgl

        other = next(iter(loader))  # a batch of its own: its first block's src ids are
        first = other.blocks[0]  # moved by one place, everything else is right
        first.srcdata[dgl.NID] = first.srcdata[dgl.NID].roll(1)
        wrong.append((other, ["blocks"]))
    check = BatchCheck(data.features, data.labels, len(args.fanouts))
    check(0, 0, right)
    for step, (batch, _) in enumerate(wrong, start=1):
        check(0, step, batch)
    check(1, 0, right)
    assert check.summary() == {
        "batches_checked": len(wrong) + 2, "batches_differing": len(wrong),
        "first_differing": [{"epoch": 0, "step": step, "differs": differs}
                            for step, (_, differs) in enumerate(wrong, start=1)]}
    # A right batch of two layers, checked as one of three: its blocks do not fit.
    deeper = BatchCheck(data.features, data.labels, len(args.fanouts) + 1)
    deeper(0, 0, right)
    assert deeper.summary() == {"batches_checked": 1, "batches_differing": 1,
                                "first_differing": [{"epoch": 0, "step": 0,
                                                     "differs": ["blocks"]}]}


def test_fanouts_parse(script: Any) -> None:
    parser = script.build_parser()
    assert parser.parse_args(["--fanouts", "15,10,-1"]).fanouts == [15, 10, -1]
    assert parser.parse_args(["--fanouts=-1,10"]).fanouts == [-1, 10]  # as the help says


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
def test_a_graph_without_masks_is_split_among_its_labelled_nodes(script: Any) -> None:
    """``--graph`` with no train/val/test masks: the seeded 60/20/20 split takes only
    nodes with a label (>= 0; OGB marks the others -1), which cross-entropy needs."""
    import dgl
    import torch

    g = dgl.graph(([0, 1], [1, 2]), num_nodes=100)
    labels = torch.arange(100) % 3
    labels[::4] = -1  # 25 unlabelled nodes
    train, val, test = script._split_from_masks(g, labels, seed=0)
    chosen = torch.cat([train, val, test])
    assert sorted(chosen.tolist()) == torch.nonzero(labels >= 0).flatten().tolist()
    assert (len(train), len(val), len(test)) == (45, 15, 15)
    assert (labels[chosen] >= 0).all()
    again = script._split_from_masks(g, labels, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again, (train, val, test), strict=True))
    with pytest.raises(ValueError, match="no node has a label"):
        script._split_from_masks(g, torch.full((100,), -1), seed=0)


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
def test_masks_take_only_labelled_nodes(script: Any) -> None:
    """From an examples review: with train/val/test masks a node labelled -1 (no
    label) under a mask reached cross-entropy ("Target -1 is out of bounds")."""
    import dgl
    import torch

    g = dgl.graph(([0, 1], [1, 2]), num_nodes=12)
    labels = torch.arange(12) % 3
    labels[[0, 5, 10]] = -1
    for name, nodes in (("train", range(0, 6)), ("val", range(6, 9)), ("test", range(9, 12))):
        mask = torch.zeros(12, dtype=torch.bool)
        mask[list(nodes)] = True
        g.ndata[f"{name}_mask"] = mask
    train, val, test = script._split_from_masks(g, labels, seed=0)
    assert [t.tolist() for t in (train, val, test)] == [[1, 2, 3, 4], [6, 7, 8], [9, 11]]


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
@pytest.mark.parametrize(("feat_shape", "masks", "needle"), [
    ((30,), False, r"ndata\['feat'\] must be 2-D \(nodes x features\), got shape \(30,\)"),
    ((30, 2, 2), False, r"must be 2-D .* got shape \(30, 2, 2\)"),
    ((30, 4), True, r"the val split has no labelled nodes \(train/val/test 30/0/0\)"),
], ids=["1-D", "3-D", "empty-split"])
def test_a_bad_graph_file_is_one_line(script: Any, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      feat_shape: tuple[int, ...], masks: bool,
                                      needle: str) -> None:
    """From an examples review: a graph file with 1-D or 3-D features, or a split
    without nodes, ended in a traceback from inside training (or printed an
    accuracy of 0.0000 for an empty split), not the promised one line."""
    import dgl
    import torch

    g = dgl.graph((torch.arange(29), torch.arange(1, 30)), num_nodes=30)
    g.ndata["feat"] = torch.randn(feat_shape)
    g.ndata["label"] = torch.arange(30) % 2
    if masks:  # every node in training: nothing left to validate or test on
        g.ndata["train_mask"] = torch.ones(30, dtype=torch.bool)
        g.ndata["val_mask"] = g.ndata["test_mask"] = torch.zeros(30, dtype=torch.bool)
    path = tmp_path / "g.bin"
    dgl.save_graphs(str(path), [g])
    with pytest.raises(SystemExit) as exc:
        script.main(["--graph", str(path), "--epochs", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert err.count("\n") == 1
    assert re.search(needle, err), err


def test_unloadable_dataset_is_one_line(script: Any, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset that cannot be loaded ends the run with one line, not a traceback."""
    with pytest.raises(SystemExit) as exc:
        script.main(["--graph", str(tmp_path / "missing.bin"), "--epochs", "1"])
    err = capsys.readouterr().err
    if HAVE_DGL:
        assert exc.value.code == 1
        assert err.count("\n") == 1
        assert err.startswith("train_sage.py: cannot load dataset")
        assert "missing.bin" in err
    else:
        assert exc.value.code == 2
        assert "needs DGL" in err


# --------------------------------------------------------------------------- the model
@pytest.fixture
def model_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import sage_model

    return sage_model


def test_mean_aggregate_matches_gather_scatter(model_module: Any) -> None:
    import torch

    from pingpong.blocks import EdgeBlock

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(50, (300,), generator=gen)
    dst = torch.randint(17, (300,), generator=gen)  # unsorted; rows 17..19 have no edges
    block = EdgeBlock(src, dst, 50, 20)
    deg = torch.bincount(dst, minlength=20).clamp(min=1).double()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        h = torch.randn(50, 8, generator=gen, dtype=torch.float64)
        ref = torch.zeros(20, 8, dtype=torch.float64).index_add_(0, dst, h[src]) / deg[:, None]
        h_in = h.to(dtype).requires_grad_()
        out = model_module.mean_aggregate(block, h_in)
        assert out.dtype == dtype
        assert torch.allclose(out.double(), ref, atol=tol), dtype
        assert not out[17:].any()
        (out.double() * torch.arange(8.0, dtype=torch.float64)).sum().backward()
        ref_grad = torch.zeros(50, 8, dtype=torch.float64).index_add_(
            0, src, (torch.arange(8.0, dtype=torch.float64) / deg[dst, None]).expand(300, 8))
        assert h_in.grad is not None
        assert torch.allclose(h_in.grad.double(), ref_grad, atol=tol * 10), dtype


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="DGL is not installed")
def test_sage_gives_the_same_logits_for_dgl_and_edge_blocks(model_module: Any) -> None:
    import dgl
    import torch

    from pingpong.blocks import as_edge_block
    from pingpong.sources import make_synthetic_graph

    sg = make_synthetic_graph(num_nodes=500, num_classes=3, feat_dim=16, avg_degree=6)
    loader = dgl.dataloading.DataLoader(sg.to_dgl(), sg.train_idx[:64],
                                        dgl.dataloading.NeighborSampler([4, 4]), batch_size=64)
    input_nodes, _, blocks = next(iter(loader))
    model = model_module.SAGE(16, 8, 3, num_layers=2).eval()
    x = sg.features[input_nodes]
    with torch.no_grad():
        ours = model([as_edge_block(b) for b in blocks], x)
        theirs = model(blocks, x)
        reference = dgl.nn.SAGEConv(16, 8, "mean")
        reference.fc_self.load_state_dict(model.layers[0].fc_self.state_dict())
        reference.fc_neigh.load_state_dict(model.layers[0].fc_neigh.state_dict())
        first = model.layers[0](as_edge_block(blocks[0]), x)
        expected = reference(blocks[0], x)
    assert ours.shape == (64, 3)
    assert torch.equal(ours, theirs)
    assert torch.allclose(first, expected, atol=1e-5)
