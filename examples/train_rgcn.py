"""Train an R-GCN-style model on a heterogeneous graph through pingpong (needs DGL).

    python examples/train_rgcn.py                 # a synthetic ogbn-mag-like graph
    python examples/train_rgcn.py --loader dgl    # the plain loop, for A/B runs
    python examples/train_rgcn.py --device cuda   # on a GPU, with PyPI's CPU-only DGL too

The graph has papers (features and labels), authors and fields of study (no
features: the model learns an embedding per node, looked up with
``batch.input_nodes[ntype]``). DGL's ``NeighborSampler`` samples every relation;
``PingPongLoader(..., heterogeneous=True)`` gathers the paper features and
labels per node type in its producer thread while the model trains.
``--loader dgl`` is the classic loop: sample, then index the tables on the
training thread. The two runs sample different neighbours (DGL's sampling is
not reproducible from a seed across threads; see the troubleshooting page),
so compare accuracy and time, not losses.

The model is plain torch over :class:`pingpong.HeteroEdgeBlock` (an edge list
per relation, in local ids): DGL blocks are converted with
:func:`pingpong.as_hetero_edge_block`, and on a GPU that a CPU-only DGL build
cannot put graphs on, pingpong delivers them in that form already.  Each layer
is what DGL's ``HeteroGraphConv({rel: SAGEConv(..., "mean")}, aggregate="sum")``
computes (``tests/test_example_rgcn.py`` checks it against DGL's modules).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

if importlib.util.find_spec("pingpong") is None:  # running from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _args import (
    add_device_flags,
    add_minibatch_training_flags,
    add_producer_flags,
    check_device_flags,
    parse_dgl_example_args,
    positive_int,
    probability,
    refuse_empty_splits,
)
from sage_model import mean_aggregate

import pingpong


# --------------------------------------------------------------------------- data
@dataclass
class HeteroData:
    graph: Any
    features: dict[str, torch.Tensor]
    labels: dict[str, torch.Tensor]
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int


def make_mag_like(num_papers: int, num_authors: int, num_fields: int, feat_dim: int,
                  num_classes: int, seed: int) -> HeteroData:
    """Papers cite papers, authors write papers, papers have fields (plus reverse edges).

    Each paper has a class; its features are a weak class signal plus noise,
    most of its citations, authors and fields share its class, so the graph
    carries most of the signal.
    """
    import dgl

    gen = torch.Generator().manual_seed(seed)
    paper_class = torch.randint(0, num_classes, (num_papers,), generator=gen)
    centres = torch.randn(num_classes, feat_dim, generator=gen)
    features = 0.2 * centres[paper_class] + torch.randn(num_papers, feat_dim, generator=gen)


    def same_class_pick(owner_class: torch.Tensor, pool_class: torch.Tensor,
                        pool_size: int, p_same: float) -> torch.Tensor:
        """For each owner, a pool member of its class with probability p_same, else any
        (any, too, where the pool has no member of the owner's class: a pool smaller
        than ``num_classes``)."""
        any_pick = torch.randint(0, pool_size, owner_class.shape, generator=gen)
        members = [torch.nonzero(pool_class == c, as_tuple=True)[0] for c in range(num_classes)]
        same = any_pick.clone()
        for c in range(num_classes):
            mask = owner_class == c
            if len(members[c]) == 0:
                continue
            choice = torch.randint(0, len(members[c]), (int(mask.sum()),), generator=gen)
            same[mask] = members[c][choice]
        keep_same = torch.rand(owner_class.shape, generator=gen) < p_same
        return torch.where(keep_same, same, any_pick)


    author_class = torch.randint(0, num_classes, (num_authors,), generator=gen)
    field_class = torch.arange(num_fields) % num_classes
    citing = torch.arange(num_papers).repeat_interleave(5)
    cited = same_class_pick(paper_class[citing], paper_class, num_papers, 0.3)
    written = torch.arange(num_papers).repeat_interleave(3)
    writer = same_class_pick(paper_class[written], author_class, num_authors, 0.3)
    field_of = same_class_pick(paper_class, field_class, num_fields, 0.2)
    papers = torch.arange(num_papers)
    graph = dgl.heterograph({
        ("paper", "cites", "paper"): (citing, cited),
        ("paper", "cited_by", "paper"): (cited, citing),
        ("author", "writes", "paper"): (writer, written),
        ("paper", "written_by", "author"): (written, writer),
        ("field", "has", "paper"): (field_of, papers),
        ("paper", "in_field", "field"): (papers, field_of),
    }, num_nodes_dict={"paper": num_papers, "author": num_authors, "field": num_fields})
    perm = torch.randperm(num_papers, generator=gen)
    n_train, n_val = int(0.5 * num_papers), int(0.2 * num_papers)
    return HeteroData(
        graph, {"paper": features.contiguous()}, {"paper": paper_class},
        perm[:n_train].sort().values, perm[n_train:n_train + n_val].sort().values,
        perm[n_train + n_val:].sort().values, num_classes)


# --------------------------------------------------------------------------- model
class RelationalSAGE(nn.Module):
    """One R-GCN-style layer: per relation ``(src type, rel, dst type)`` a mean SAGE
    convolution, ``fc_self(h_dst) + fc_neigh(mean of h_src over in-edges)``, summed
    per destination type -- DGL's ``HeteroGraphConv({rel: SAGEConv(in, out, "mean")},
    aggregate="sum")``, on a :class:`pingpong.HeteroEdgeBlock`.
    """

    def __init__(self, relations: list[str], in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc_self = nn.ModuleDict({r: nn.Linear(in_dim, out_dim) for r in relations})
        self.fc_neigh = nn.ModuleDict({r: nn.Linear(in_dim, out_dim, bias=False)
                                       for r in relations})

    def forward(self, block: pingpong.HeteroEdgeBlock,
                h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for (stype, rel, dtype), edges in block.edges.items():
            if stype not in h or dtype not in h:
                continue
            h_dst = h[dtype][: block.num_dst_nodes[dtype]]
            r = self.fc_self[rel](h_dst) + self.fc_neigh[rel](mean_aggregate(edges, h[stype]))
            out[dtype] = out[dtype] + r if dtype in out else r
        return out


class RGCN(nn.Module):
    """Relational mean SAGE layers summed per destination type (R-GCN style).

    Papers enter through a linear projection of their features; every other
    node type through a learned embedding indexed by its global ids.  Blocks
    may be DGL blocks or :class:`pingpong.HeteroEdgeBlock` s.
    """

    def __init__(self, data: HeteroData, hidden: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        g = data.graph
        self.proj = nn.ModuleDict({nt: nn.Linear(t.shape[1], hidden)
                                   for nt, t in data.features.items()})
        self.embed = nn.ModuleDict({nt: nn.Embedding(g.num_nodes(nt), hidden)
                                    for nt in g.ntypes if nt not in data.features})
        sizes = [hidden] * num_layers + [data.num_classes]
        self.layers = nn.ModuleList(RelationalSAGE(g.etypes, sizes[i], sizes[i + 1])
                                    for i in range(num_layers))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks: list[Any], x: dict[str, torch.Tensor],
                input_nodes: dict[str, torch.Tensor]) -> torch.Tensor:
        h = {nt: self.proj[nt](x[nt]) for nt in self.proj}
        h |= {nt: self.embed[nt](input_nodes[nt].to(x_device(x))) for nt in self.embed}
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h = layer(pingpong.as_hetero_edge_block(block), h)
            if i < len(self.layers) - 1:
                h = {nt: self.dropout(F.relu(v)) for nt, v in h.items()}
        return h["paper"]


def x_device(x: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(x.values())).device


# --------------------------------------------------------------------------- loaders
class SyncBatch(NamedTuple):
    """Same fields as ``pingpong.Batch``."""

    input_nodes: dict[str, torch.Tensor]
    output_nodes: dict[str, torch.Tensor]
    blocks: list[Any]
    x: dict[str, torch.Tensor]
    y: dict[str, torch.Tensor]


class SyncLoader:
    """The plain loop pingpong replaces: sample, then index the tables per node type."""

    def __init__(self, source: Iterable[Any], data: HeteroData, device: torch.device) -> None:
        self.source = source
        self.data = data
        self.device = device
        self.stats: dict[str, float] = {"batches": 0}

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[SyncBatch]:
        for input_nodes, output_nodes, blocks in self.source:
            x = {nt: t[input_nodes[nt]].to(self.device) for nt, t in self.data.features.items()}
            y = {nt: t[output_nodes[nt]].to(self.device) for nt, t in self.data.labels.items()}
            if self.device.type != "cpu":
                blocks = [pingpong.as_hetero_edge_block(b).to(self.device) for b in blocks]
            self.stats["batches"] += 1
            yield SyncBatch(input_nodes, output_nodes, blocks, x, y)

    def close(self) -> None:
        pass


def make_loader(args: argparse.Namespace, data: HeteroData, idx: torch.Tensor,
                shuffle: bool) -> Any:
    import dgl

    source = dgl.dataloading.DataLoader(
        data.graph, {"paper": idx}, dgl.dataloading.NeighborSampler(args.fanouts),
        batch_size=args.batch_size, shuffle=shuffle)
    if args.loader == "dgl":
        return SyncLoader(source, data, torch.device(args.device))
    return pingpong.PingPongLoader(source, data.features, data.labels, heterogeneous=True,
                                   num_buffers=args.num_buffers, device=args.device,
                                   gather=args.gather, sampler_threads=args.sampler_threads,
                                   producer_nice=args.producer_nice)


# --------------------------------------------------------------------------- training
def evaluate(model: nn.Module, loader: Any) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            logits = model(batch.blocks, batch.x, batch.input_nodes)
            correct += int((logits.argmax(1) == batch.y["paper"]).sum())
            total += int(batch.y["paper"].shape[0])
    model.train()
    return correct / max(total, 1)


def train(args: argparse.Namespace, data: HeteroData) -> dict[str, Any]:
    import dgl

    torch.manual_seed(args.seed)
    dgl.seed(args.seed)
    np.random.seed(args.seed)  # DGL shuffles with NumPy's global generator
    model = RGCN(data, args.hidden, len(args.fanouts), args.dropout).to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loaders = [make_loader(args, data, data.train_idx, shuffle=True),
               make_loader(args, data, data.val_idx, shuffle=False),
               make_loader(args, data, data.test_idx, shuffle=False)]
    train_loader, val_loader, test_loader = loaders
    epoch_times, losses = [], []
    try:
        for epoch in range(args.epochs):
            t0 = time.perf_counter()
            for batch in train_loader:
                logits = model(batch.blocks, batch.x, batch.input_nodes)
                loss = F.cross_entropy(logits, batch.y["paper"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            epoch_times.append(time.perf_counter() - t0)
            val_acc = evaluate(model, val_loader)
            print(f"Epoch {epoch:05d} | Loss {losses[-1]:.4f} | Epoch Time(s): "
                  f"{epoch_times[-1]:.4f} | Eval Acc {val_acc:.4f}", flush=True)
        test_acc = evaluate(model, test_loader)
        print(f"Test Acc: {test_acc:.4f}", flush=True)
        stats = dict(train_loader.stats)
        sampler_threads = getattr(train_loader, "sampler_threads", None)
        producer_nice = getattr(train_loader, "producer_nice", None)
    finally:
        for loader in loaders:
            loader.close()
    return {"loader": args.loader, "epoch_times": epoch_times, "losses": losses,
            "val_acc": val_acc, "test_acc": test_acc,
            "batches": int(stats["batches"]), "sampler_threads": sampler_threads,
            "producer_nice": producer_nice}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="R-GCN on a heterogeneous graph through pingpong.")
    p.add_argument("--loader", choices=["pingpong", "dgl"], default="pingpong")
    add_device_flags(p)
    p.add_argument("--num-papers", type=positive_int, default=30_000)
    p.add_argument("--num-authors", type=positive_int, default=10_000)
    p.add_argument("--num-fields", type=positive_int, default=64)
    p.add_argument("--feat-dim", type=positive_int, default=128)
    p.add_argument("--num-classes", type=positive_int, default=8)
    p.add_argument("--dropout", type=probability, default=0.2)
    add_minibatch_training_flags(p)
    add_producer_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_dgl_example_args(parser, argv, "heterogeneous sampling")
    check_device_flags(parser, args)
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    data = make_mag_like(args.num_papers, args.num_authors, args.num_fields, args.feat_dim,
                         args.num_classes, args.seed)
    refuse_empty_splits(parser, {"train": data.train_idx, "val": data.val_idx,
                                 "test": data.test_idx}, "papers", "--num-papers")
    print(f"Graph: {data.graph.num_nodes('paper')} papers, {data.graph.num_nodes('author')} "
          f"authors, {data.graph.num_nodes('field')} fields, {data.graph.num_edges()} edges | "
          f"loader {args.loader} | device {args.device}", flush=True)
    result = train(args, data)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
