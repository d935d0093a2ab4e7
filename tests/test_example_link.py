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


def test_link_without_dgl_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Without DGL (here: hidden from the import system) the script says so in one line."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_link

    monkeypatch.setitem(sys.modules, "dgl", None)  # find_spec("dgl") -> None
    with pytest.raises(SystemExit) as exc:
        train_link.main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "needs DGL" in err, err


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("argv", [
    ["--num-buffers", "1"], ["--gather", "zerocopy"], ["--gather", "device"],
    ["--json", "/no/such/folder/run.json"], ["--fanouts", "10,0"],
])
def test_link_bad_flags_are_argparse_errors(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the parser, before any training: one slot (ping-pong needs two), a
    GPU gather mode on the CPU, a ``--json`` file in a missing folder."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_link

    with pytest.raises(SystemExit) as exc:
        train_link.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
