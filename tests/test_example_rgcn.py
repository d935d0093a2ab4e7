"""examples/train_rgcn.py: R-GCN on a heterogeneous graph through pingpong (needs DGL)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from test_example import run_example

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_rgcn.py"
HAVE_DGL = importlib.util.find_spec("dgl") is not None
TINY = ["--num-papers", "2000", "--num-authors", "600", "--num-fields", "16",
        "--batch-size", "128", "--epochs", "3", "--hidden", "32"]
CHANCE = 1 / 8


@pytest.mark.slow  # two subprocess runs (~10 s each)
@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("loader", ["pingpong", "dgl"])
def test_rgcn_learns_through_either_loader(tmp_path: Path, loader: str) -> None:
    result, stdout = run_example(tmp_path, loader, *TINY, "--loader", loader, script=SCRIPT)
    assert "2000 papers, 600 authors, 16 fields" in stdout
    assert len(re.findall(r"^Epoch \d{5} \| Loss ", stdout, re.M)) == 3
    assert result["loader"] == loader
    assert result["batches"] == 3 * 8  # 1,000 training papers in batches of 128
    assert result["test_acc"] > CHANCE + 0.3


def test_rgcn_without_dgl_is_a_clear_error(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if HAVE_DGL:
        pytest.skip("DGL is installed")
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_rgcn

    with pytest.raises(SystemExit) as exc:
        train_rgcn.main([])
    assert exc.value.code == 2




@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("argv", [
    ["--num-buffers", "1"], ["--fanouts", "10,0"], ["--dropout", "1.5"], ["--lr", "0"],
    ["--epochs", "0"], ["--json", "/no/such/folder/run.json"],
])
def test_rgcn_bad_flags_are_argparse_errors(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_rgcn

    with pytest.raises(SystemExit) as exc:
        train_rgcn.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_fewer_fields_and_authors_than_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node type with fewer nodes than ``--num-classes`` (3 fields, 5 authors, 8
    classes): classes that type lacks link to any of its nodes, instead of the
    generator failing on an empty pool."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_rgcn

    data = train_rgcn.make_mag_like(400, 5, 3, 8, 8, 0)
    assert [data.graph.num_nodes(t) for t in ("paper", "author", "field")] == [400, 5, 3]
    _, fields = data.graph.edges(etype="in_field")
    _, papers = data.graph.edges(etype="writes")
    assert int(fields.max()) < 3
    assert len(papers) == 3 * 400
