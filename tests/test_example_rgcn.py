"""examples/train_rgcn.py: R-GCN on a heterogeneous graph through pingpong (needs DGL)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_example import run_example

import pingpong

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_rgcn.py"
HAVE_DGL = importlib.util.find_spec("dgl") is not None
TINY = ["--num-papers", "2000", "--num-authors", "600", "--num-fields", "16",
        "--batch-size", "128", "--epochs", "3", "--hidden", "32"]
CHANCE = 1 / 8


@pytest.fixture
def rgcn(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The example's module (its helpers, tested without a training run)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_rgcn

    return train_rgcn


@pytest.mark.slow  # two subprocess runs (~10 s each)
@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("loader", ["pingpong", "dgl"])
def test_rgcn_learns_through_either_loader(tmp_path: Path, loader: str) -> None:
    producer = ["--producer-nice", "5", "--sampler-threads", "1"] if loader == "pingpong" else []
    result, stdout = run_example(tmp_path, loader, *TINY, "--loader", loader, *producer,
                                 script=SCRIPT)
    assert "2000 papers, 600 authors, 16 fields" in stdout
    assert len(re.findall(r"^Epoch \d{5} \| Loss ", stdout, re.M)) == 3
    assert result["loader"] == loader
    assert result["batches"] == 3 * 8  # 1,000 training papers in batches of 128
    assert result["test_acc"] > CHANCE + 0.3
    if loader == "pingpong":  # the flags reach the loader
        assert (result["producer_nice"], result["sampler_threads"]) == (5, 1)


def test_rgcn_without_dgl_is_a_clear_error(tmp_path: Path,
                                           rgcn: Any) -> None:
    if HAVE_DGL:
        pytest.skip("DGL is installed")
    with pytest.raises(SystemExit) as exc:
        rgcn.main([])
    assert exc.value.code == 2




@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
@pytest.mark.parametrize("argv", [
    ["--num-buffers", "1"], ["--fanouts", "10,0"], ["--dropout", "1.5"], ["--lr", "0"],
    ["--epochs", "0"], ["--json", "/no/such/folder/run.json"], ["--gather", "zerocopy"],
    # a folder, and a file nobody can create: the run finished, then crashed writing it
    ["--json", "/"], ["--json", "/proc/no-such-run.json"],
    ["--producer-nice", "20"], ["--producer-nice", "-1"], ["--sampler-threads", "0"],
    ["--seed", "2147483648"], ["--num-papers", "3"],  # no validation papers: Acc 0.0000
    pytest.param(["--device", "cuda"], marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_rgcn_bad_flags_are_argparse_errors(argv: list[str], rgcn: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        rgcn.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_fewer_fields_and_authors_than_classes(rgcn: Any) -> None:
    """A node type with fewer nodes than ``--num-classes`` (3 fields, 5 authors, 8
    classes): classes that type lacks link to any of its nodes, instead of the
    generator failing on an empty pool."""
    data = rgcn.make_mag_like(400, 5, 3, 8, 8, 0)
    assert [data.graph.num_nodes(t) for t in ("paper", "author", "field")] == [400, 5, 3]
    _, fields = data.graph.edges(etype="in_field")
    _, papers = data.graph.edges(etype="writes")
    assert int(fields.max()) < 3
    assert len(papers) == 3 * 400


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_the_relational_layer_computes_what_dgls_hetero_graph_conv_does(
        rgcn: Any) -> None:
    """The example's plain-torch layer on HeteroEdgeBlocks against DGL's
    ``HeteroGraphConv({rel: SAGEConv(.., "mean")}, aggregate="sum")`` with the same
    weights, on sampled two-layer blocks of the example's graph."""
    import dgl
    import dgl.nn as dglnn

    data = rgcn.make_mag_like(400, 120, 6, 8, 4, 0)
    g = data.graph
    torch.manual_seed(0)
    ours = rgcn.RelationalSAGE(g.etypes, 5, 3)
    theirs = dglnn.HeteroGraphConv({r: dglnn.SAGEConv(5, 3, "mean") for r in g.etypes},
                                   aggregate="sum")
    with torch.no_grad():
        for r in g.etypes:
            theirs.mods[r].fc_self.weight.copy_(ours.fc_self[r].weight)
            theirs.mods[r].fc_self.bias.copy_(ours.fc_self[r].bias)
            theirs.mods[r].fc_neigh.weight.copy_(ours.fc_neigh[r].weight)
    source = dgl.dataloading.DataLoader(g, {"paper": torch.arange(64)},
                                        dgl.dataloading.NeighborSampler([4, 3]), batch_size=32)
    compared = 0
    for input_nodes, _, blocks in source:
        h = {nt: torch.randn(len(ids), 5) for nt, ids in input_nodes.items()}
        for block in blocks:
            want = theirs(block, (h, {nt: v[: block.num_dst_nodes(nt)] for nt, v in h.items()}))
            got = ours(pingpong.as_hetero_edge_block(block), h)
            assert set(got) == set(want)
            for nt in want:
                torch.testing.assert_close(got[nt], want[nt], rtol=1e-5, atol=1e-5)
                compared += 1
            h = {nt: torch.randn(v.shape[0], 5) for nt, v in want.items()}
    assert compared >= 4


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_rgcn_loader_flags_reach_the_loader(rgcn: Any) -> None:
    data = rgcn.make_mag_like(200, 50, 4, 8, 4, 0)
    args = rgcn.build_parser().parse_args(
        ["--num-buffers", "3", "--sampler-threads", "1", "--producer-nice", "5"])
    loader = rgcn.make_loader(args, data, data.val_idx, shuffle=False)
    try:
        assert (loader.num_buffers, loader.sampler_threads, loader.producer_nice) == (3, 1, 5)
    finally:
        loader.close()


@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_featureless_node_types_are_embedded_by_their_global_ids(
        rgcn: Any) -> None:
    """Authors and fields enter the model through ``embed[ntype]`` rows of the
    batch's ``input_nodes``: no other row changes the output."""
    import dgl

    data = rgcn.make_mag_like(400, 300, 300, 8, 4, 0)
    torch.manual_seed(0)
    model = rgcn.RGCN(data, 8, 2, dropout=0.0).eval()
    source = dgl.dataloading.DataLoader(data.graph, {"paper": data.train_idx[:8]},
                                        dgl.dataloading.NeighborSampler([3, 3]), batch_size=8)
    input_nodes, _, blocks = next(iter(source))
    x = {"paper": data.features["paper"][input_nodes["paper"]]}
    embeds = {nt: e for nt, e in model.embed.items() if isinstance(e, torch.nn.Embedding)}
    assert set(embeds) == {"author", "field"}
    with torch.no_grad():
        before = model(blocks, x, input_nodes)
        for nt, embed in embeds.items():
            unused = torch.ones(embed.num_embeddings, dtype=torch.bool)
            unused[input_nodes[nt]] = False
            assert unused.any()
            embed.weight[unused] += 100.0
        assert torch.equal(model(blocks, x, input_nodes), before)
        for nt, embed in embeds.items():
            embed.weight[input_nodes[nt]] += 1.0
        assert not torch.allclose(model(blocks, x, input_nodes), before)
