"""examples/train_link.py: GraphSAGE link prediction with negatives (needs DGL).

Each loader trains once on a small synthetic graph (a subprocess run of a few
seconds); the tests read the runs' ``--json`` records.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_example import PINGPONG_ONLY_STATS, run_example

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_link.py"
HAVE_DGL = importlib.util.find_spec("dgl") is not None
EPOCHS = 4
BATCH = 256
EVAL_NEGS = 20
SMALL = ["--num-nodes", "3000", "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
         "--hidden", "32", "--num-negs", "1", "--eval-num-negs", str(EVAL_NEGS)]
#: A scorer that knows nothing ranks the true tail uniformly among k + 1.
CHANCE_MRR = sum(1 / r for r in range(1, EVAL_NEGS + 2)) / (EVAL_NEGS + 1)  # 0.174
# Trained, these runs reach MRR 0.34-0.40 and AUC 0.68-0.73 (a scorer that
# knows only whether two nodes share a community gets AUC ~0.78 here); with
# the features shuffled in the model, MRR ~0.17 and AUC ~0.5.
MIN_MRR = 1.6 * CHANCE_MRR
MIN_AUC = 0.64

needs_dgl = pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")


def _run(tmp_path_factory: pytest.TempPathFactory, loader: str) -> tuple[dict[str, Any], str]:
    return run_example(tmp_path_factory.mktemp(loader), loader, *SMALL, "--loader", loader,
                       script=SCRIPT, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    """One run per loader: ``{loader: (json record, stdout)}``.

    On a busy machine (more runnable threads than cores) OpenMP threads that
    spin while waiting burned 8x the CPU time of a run (54 s instead of 6.5 s
    of user time on the 2-core VM); passive waiting keeps the runs short.
    """
    with pytest.MonkeyPatch.context() as mp:
        if "OMP_WAIT_POLICY" not in os.environ:
            mp.setenv("OMP_WAIT_POLICY", "passive")
        return {loader: _run(tmp_path_factory, loader) for loader in ("pingpong", "dgl")}


@pytest.mark.slow  # two subprocess runs (~8 s each)
@pytest.mark.dgl
@needs_dgl
@pytest.mark.parametrize("loader", ["pingpong", "dgl"], ids=["pingpong", "plain-loop"])
def test_link_prediction_learns_through_either_loader(
        runs: dict[str, tuple[dict[str, Any], str]], loader: str) -> None:
    result, stdout = runs[loader]
    assert (result["loader"], result["device"]) == (loader, "cpu")
    assert "Dataset synthetic: 3000 nodes, 128 features" in stdout
    assert len(re.findall(r"^Epoch Time\(s\): \d+\.\d{4}$", stdout, re.M)) == EPOCHS
    assert len(re.findall(r"^Eval MRR \d\.\d{4} \| Eval AUC \d\.\d{4}$", stdout, re.M)) == EPOCHS
    assert re.search(r"^Test MRR: \d\.\d{4} \| Test AUC: \d\.\d{4}", stdout, re.M)
    assert len(result["epoch_times"]) == len(result["val_mrr"]) == EPOCHS
    assert math.isclose(result["chance_mrr"], CHANCE_MRR)
    summary = {k: result[k] for k in ("test_mrr", "test_auc", "val_mrr", "val_auc")}
    assert result["test_mrr"] > MIN_MRR, summary
    assert result["test_auc"] > MIN_AUC, summary
    assert result["val_mrr"][-1] > MIN_MRR, summary
    losses = result["losses"]
    per_epoch = len(losses) // EPOCHS
    first, last = losses[:per_epoch], losses[-per_epoch:]
    assert sum(last) / len(last) < sum(first) / len(first) - 0.02, summary


@pytest.mark.slow
@pytest.mark.dgl
@needs_dgl
def test_pingpong_run_delivered_its_batches_and_both_saw_as_many(
        runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    pingpong_result, plain_result = runs["pingpong"][0], runs["dgl"][0]
    # The batches really came through PingPongLoader, and the plain loop's did not.
    stats = pingpong_result["stats"]
    assert stats.keys() >= PINGPONG_ONLY_STATS, stats
    assert not PINGPONG_ONLY_STATS & plain_result["stats"].keys(), plain_result["stats"]
    assert stats["epochs"] == EPOCHS
    per_epoch = math.ceil(pingpong_result["train_edges"] / BATCH)
    assert pingpong_result["batches_per_epoch"] == per_epoch
    assert stats["batches"] == pingpong_result["batches"] == EPOCHS * per_epoch
    assert stats["rows_gathered"] > 0
    assert stats["bytes_gathered"] > 0
    # Same split, same number of training batches through either loader.
    assert plain_result["train_edges"] == pingpong_result["train_edges"]
    assert plain_result["batches"] == plain_result["stats"]["batches"] == stats["batches"]
    assert len(plain_result["losses"]) == len(pingpong_result["losses"]) == EPOCHS * per_epoch


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The example's module (its helpers, tested without a training run)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_link

    return train_link


def test_link_without_dgl_is_a_clear_error(link: Any, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Without DGL (here: hidden from the import system) the script says so in one line."""
    monkeypatch.setitem(sys.modules, "dgl", None)  # find_spec("dgl") -> None
    with pytest.raises(SystemExit) as exc:
        link.main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "needs DGL" in err, err


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("argv", [
    ["--num-buffers", "1"], ["--gather", "zerocopy"], ["--gather", "device"],
    ["--json", "/no/such/folder/run.json"], ["--fanouts", "10,0"],
    # a folder, and a file nobody can create: the run finished, then crashed writing it
    ["--json", "/"], ["--json", "/proc/no-such-run.json"],
])
def test_link_bad_flags_are_argparse_errors(argv: list[str], link: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the parser, before any training: one slot (ping-pong needs two), a
    GPU gather mode on the CPU, a ``--json`` file in a missing folder."""
    with pytest.raises(SystemExit) as exc:
        link.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def _tiny_split(link: Any, *flags: str) -> tuple[Any, Any]:
    args = link.build_parser().parse_args(["--num-nodes", "400", "--eval-num-negs", "3",
                                           "--batch-size", "64", "--eval-batch-size", "64",
                                           *flags])
    data, _ = link.split_edges(args)
    return args, data


def _pairs(src: Any, dst: Any) -> set[tuple[int, int]]:
    """Undirected edges as sorted node pairs."""
    return {(min(a, b), max(a, b)) for a, b in zip(src.tolist(), dst.tolist(), strict=True)}


@pytest.mark.dgl
@needs_dgl
def test_the_split_keeps_held_out_edges_apart_and_pairs_each_edge_with_its_reverse(
        link: Any) -> None:
    """What the module docstring promises the model never sees: a held-out edge in
    the training graph (either direction), or a val edge among the test edges; and
    ``reverse_eids`` (what ``exclude="reverse_id"`` drops) maps each training edge
    to its reverse."""
    _, data = _tiny_split(link)
    g, t = data.train_graph, data.num_train
    src, dst = g.edges()
    assert g.num_edges() == 2 * t
    rsrc, rdst = g.find_edges(data.reverse_eids)
    assert torch.equal(rsrc, dst)
    assert torch.equal(rdst, src)
    train = _pairs(src, dst)
    assert len(train) == t  # each undirected training edge once, in both directions
    held = {}
    for split, eg in data.eval_graphs.items():
        esrc, edst = eg.edges()
        assert torch.equal(esrc[:2 * t], src)
        assert torch.equal(edst[:2 * t], dst)
        held[split] = _pairs(esrc[2 * t:], edst[2 * t:])
        assert len(held[split]) == eg.num_edges() - 2 * t == len(data.eval_tails[split]) > 0
        assert not held[split] & train
    assert not held["val"] & held["test"]


@pytest.mark.dgl
@needs_dgl
def test_neighbourhoods_never_hold_a_seed_edge_its_reverse_or_a_held_out_edge(
        link: Any) -> None:
    """Training batches sample around their seed edges minus those edges and their
    reverses; evaluation batches around training edges only."""
    import dgl

    args, data = _tiny_split(link)
    sources = link.make_sources(data, args)
    for _, pair_graph, _, blocks in sources["train"]:
        seeds = pair_graph.edata[dgl.EID]
        banned = set(seeds.tolist()) | set(data.reverse_eids[seeds].tolist())
        for block in blocks:
            assert not banned & set(block.edata[dgl.EID].tolist())
    first = 2 * data.num_train
    for split in ("val", "test"):
        for _, pair_graph, _, blocks in sources[split]:
            assert bool((pair_graph.edata[dgl.EID] >= first).all())
            for block in blocks:
                assert bool((block.edata[dgl.EID] < first).all()), split


@pytest.mark.dgl
@needs_dgl
def test_fixed_tails_corrupt_each_held_out_edge_with_its_own_candidates(link: Any) -> None:
    import dgl

    g = dgl.graph((torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 0])))
    tails = torch.tensor([[5, 6], [7, 8]])  # the candidates of edges 2 and 3
    src, dst = link.FixedTails(tails, first_eid=2)(g, torch.tensor([3, 2]))
    assert src.tolist() == [3, 3, 2, 2]  # negative i * k + j corrupts positive i
    assert dst.tolist() == [7, 8, 5, 6]


def test_link_metrics_on_known_scores(link: Any) -> None:
    """MRR with ties counted half (OGB), AUC as Mann-Whitney U, chance MRR H(k+1)/(k+1)."""
    ranks = link.reciprocal_ranks(torch.tensor([1.0, 3.0, 0.0]),
                                  torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 2.0],
                                                [1.0, 2.0, 3.0]]))
    # ranks 2.5 (one above, one tie), 1 (top), 4 (bottom)
    assert torch.allclose(ranks, torch.tensor([0.4, 1.0, 0.25], dtype=torch.float64))
    assert link.auc(torch.tensor([3.0, 1.0]), torch.tensor([2.0, 0.0])) == 0.75
    assert link.auc(torch.tensor([1.0]), torch.tensor([1.0])) == 0.5  # a tie: half
    assert link.auc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0, 1.5])) == 1.0
    assert math.isclose(link.chance_mrr(1), (1 + 1 / 2) / 2)
    assert math.isclose(link.chance_mrr(EVAL_NEGS), CHANCE_MRR)


@pytest.mark.dgl
@needs_dgl
def test_link_loader_flags_reach_the_loader(link: Any) -> None:
    args, data = _tiny_split(link, "--num-buffers", "3", "--sampler-threads", "1",
                             "--producer-nice", "5", "--gather", "cpu")
    source = link.make_sources(data, args)["train"]
    loader = link.make_loader(source, data, args, torch.device("cpu"))
    try:
        assert (loader.num_buffers, loader.sampler_threads, loader.producer_nice,
                loader.gather_mode) == (3, 1, 5, "cpu")
    finally:
        loader.close()
