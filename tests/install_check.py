"""What ``pip install pingpong-gnn[dgl]`` must give: run by ``tox -e install-dgl``.

Not a pytest module: a plain script, run in an environment where the built wheel
was installed with the ``dgl`` extra and nothing was pinned beforehand (pip
resolved torch and DGL from the package's own ranges). It checks that

- ``pingpong`` is the installed wheel, not this source tree;
- ``import dgl`` works next to the torch that was resolved (DGL 1.1.x; an
  unconstrained ``dgl`` resolves to 2.1.0, whose import fails);
- a DGL ``NeighborSampler`` ``DataLoader`` wrapped in ``PingPongLoader``
  delivers batches whose features and labels equal ``feats[input_nodes]`` and
  ``labels[output_nodes]`` bit for bit.

Exit status 0 on success; any failure raises (``SystemExit`` with a message
or the exception itself).
"""

from __future__ import annotations

import sys
import sysconfig
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fail(message: str) -> None:
    raise SystemExit(f"install check failed: {message}")


def main() -> None:
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    import dgl
    import torch

    import pingpong

    where = Path(pingpong.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if where.parent == REPO / "pingpong" or site not in where.parents:
        fail(f"pingpong was imported from {where}, not from the installed wheel in {site}")
    torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    dgl_version = tuple(int(p) for p in dgl.__version__.split(".")[:2])
    print(f"python {sys.version.split()[0]} | torch {torch.__version__} | dgl {dgl.__version__} "
          f"| pingpong {pingpong.__version__} from {where.parent}")
    if not (2, 0) <= torch_version < (2, 14):
        fail(f"torch {torch.__version__} is outside the supported range >=2.0,<2.14")
    if dgl_version != (1, 1):
        fail(f"the dgl extra resolved to DGL {dgl.__version__}, expected 1.1.x")

    gen = torch.Generator().manual_seed(0)
    num_nodes, feat_dim = 500, 12
    src = torch.randint(num_nodes, (4000,), generator=gen)
    dst = torch.randint(num_nodes, (4000,), generator=gen)
    g = dgl.graph((src, dst), num_nodes=num_nodes)
    feats = torch.randn(num_nodes, feat_dim, generator=gen)
    labels = torch.randint(5, (num_nodes,), generator=gen)
    source = dgl.dataloading.DataLoader(
        g, torch.arange(0, num_nodes, 3), dgl.dataloading.NeighborSampler([4, 4]),
        batch_size=64, shuffle=True)

    batches = 0
    with pingpong.PingPongLoader(source, feats, labels=labels, device="cpu",
                                 num_buffers=2) as loader:
        if len(loader) != len(source):
            fail(f"len(loader) = {len(loader)}, len(source) = {len(source)}")
        for input_nodes, output_nodes, blocks, x, y in loader:
            if len(blocks) != 2 or not isinstance(blocks[0], dgl.DGLGraph):
                fail(f"expected two DGL blocks, got {blocks!r}")
            if not torch.equal(x, feats[input_nodes]):
                fail(f"batch {batches}: x != feats[input_nodes]")
            if not torch.equal(y, labels[output_nodes]):
                fail(f"batch {batches}: y != labels[output_nodes]")
            batches += 1
        stats = loader.stats
    if batches != len(source) or stats["batches"] != batches:
        fail(f"{batches} batches delivered, {len(source)} expected (stats: {stats['batches']})")
    print(f"install check passed: {batches} batches through PingPongLoader over DGL's "
          f"NeighborSampler, each equal to feats[input_nodes] / labels[output_nodes]")


if __name__ == "__main__":
    main()
