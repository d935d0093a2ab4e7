"""GraphSAGE link prediction with negative sampling through pingpong (needs DGL).

    python examples/train_link.py                       # synthetic graph, pingpong
    python examples/train_link.py --loader dgl          # plain loop: index_select per step
    python examples/train_link.py --device cuda --gather zerocopy

The graph is pingpong's built-in synthetic graph (the one ``train_sage.py``
uses by default, :func:`pingpong.sources.make_synthetic_graph`; undirected,
every edge stored in both directions), smaller by default so that a run takes
seconds on a 2-core CPU. DGL's ``as_edge_prediction_sampler`` wraps its
``NeighborSampler``; during training every positive edge gets ``--num-negs``
corrupted tails from ``dgl.dataloading.negative_sampler.Uniform``.
``--loader pingpong`` wraps that loader in :class:`pingpong.PingPongLoader`,
which delivers :class:`pingpong.NegativeEdgeBatch` es with
``x = features[input_nodes]`` already gathered by its producer thread;
``--loader dgl`` is the classic loop: iterate DGL's loader, then
``features.index_select(0, input_nodes)`` on the training thread. DGL's
sampling does not repeat from a seed across threads (see the troubleshooting
page), so the two loaders see different samples: compare metrics and times,
not losses.

The split, and what the model may see:

- The undirected edges are split at random into train / val / test
  (``--val-frac`` and ``--test-frac``, 10% each by default).
- The training graph holds the training edges only (both directions): no
  held-out edge is ever used for message passing, in training or evaluation.
- Training seeds are the training edges, one direction each. DGL's
  ``exclude="reverse_id"`` removes every seed edge *and its reverse* from the
  neighbourhoods sampled for its own batch, so the model cannot read a
  positive pair off the graph it aggregates over.
- Evaluation ranks each held-out edge ``(u, v)`` against ``--eval-num-negs``
  corrupted tails ``(u, v')``, ``v'`` uniform over all nodes, drawn once from
  ``--seed`` (the same candidates in every epoch and for both loaders; not
  filtered against true edges, which at the defaults hit a candidate about
  once in a thousand). The eval loader's graph is the training graph plus the
  split's held-out edges (one direction, as seeds only): ``exclude=`` drops
  all of them from every sampled neighbourhood, so the embeddings come from
  training edges alone. Neighbours are sampled with the training fanouts.

Metrics: MRR, the mean of ``1 / rank`` of the true tail among itself and its
candidates (ties count half, as OGB does; a scorer that knows nothing gets
``H(k+1) / (k+1)``, printed as "chance"), and AUC over all positive and
candidate scores (chance 0.5).
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
    FANOUTS_HOW,
    add_producer_flags,
    buffer_count,
    check_device_flags,
    check_json_target,
    fanout_list,
    positive_float,
    positive_int,
    probability,
    seed_value,
)
from sage_model import SAGE

import pingpong
from pingpong.blocks import EdgeBlock, as_edge_block
from pingpong.sources import make_synthetic_graph


# --------------------------------------------------------------------------- arguments
def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 0.5:
        raise argparse.ArgumentTypeError(f"must lie in (0, 0.5), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="GraphSAGE link prediction with negative sampling through "
                    "pingpong.PingPongLoader (needs DGL).")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--loader", choices=["pingpong", "dgl"], default="pingpong",
                   help="pingpong: PingPongLoader; dgl: plain loop with synchronous "
                        "index_select gather (the A/B baseline)")
    p.add_argument("--gather", choices=["auto", "cpu", "zerocopy", "staged", "device"],
                   default="auto", help="pingpong gather mode")
    p.add_argument("--num-buffers", type=buffer_count, default=2)
    add_producer_flags(p)
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--batch-size", type=positive_int, default=512,
                   help="positive edges per training batch")
    p.add_argument("--eval-batch-size", type=positive_int, default=1024)
    p.add_argument("--fanouts", type=fanout_list, default=[10, 5],
                   help="comma-separated, outermost layer first (default 10,5); "
                        + FANOUTS_HOW)
    p.add_argument("--num-negs", type=positive_int, default=1,
                   help="corrupted tails per positive edge in training (Uniform)")
    p.add_argument("--eval-num-negs", type=positive_int, default=20,
                   help="fixed corrupted tails per held-out edge for MRR/AUC")
    p.add_argument("--scorer", choices=["mlp", "dot"], default="mlp",
                   help="edge scorer on the two SAGE embeddings")
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--lr", type=positive_float, default=1e-2)
    p.add_argument("--num-nodes", type=positive_int, default=10_000)
    p.add_argument("--num-classes", type=positive_int, default=16,
                   help="communities of the synthetic graph")
    p.add_argument("--feat-dim", type=positive_int, default=128)
    p.add_argument("--avg-degree", type=positive_float, default=10.0)
    p.add_argument("--val-frac", type=fraction, default=0.1)
    p.add_argument("--test-frac", type=fraction, default=0.1)
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--log-every", type=positive_int, default=20)
    p.add_argument("--json", type=Path, default=None, help="write a JSON summary here")
    return p


# --------------------------------------------------------------------------- data
@dataclass
class LinkData:
    """Features, the three graphs and the held-out candidates."""

    features: torch.Tensor
    num_nodes: int
    train_graph: Any  # training edges, both directions: eids [0, T) and [T, 2T)
    num_train: int  # T
    reverse_eids: torch.Tensor  # eid -> eid of its reverse, in train_graph
    eval_graphs: dict[str, Any]  # split -> train_graph + that split's edges, appended
    eval_tails: dict[str, torch.Tensor]  # split -> (held-out edges, eval_num_negs)


def split_edges(args: argparse.Namespace) -> tuple[LinkData, int]:
    """The synthetic graph, split as the module docstring says; also the undirected edge count."""
    import dgl

    sg = make_synthetic_graph(num_nodes=args.num_nodes, num_classes=args.num_classes,
                              feat_dim=args.feat_dim, avg_degree=args.avg_degree,
                              seed=args.seed)
    # sg stores every undirected edge twice: pair i is (src[i], dst[i]), i < E/2,
    # and its reverse is edge i + E/2.
    num_pairs = sg.num_edges // 2
    u, v = sg.src[:num_pairs], sg.dst[:num_pairs]
    if not (torch.equal(sg.src[num_pairs:], v) and torch.equal(sg.dst[num_pairs:], u)):
        raise RuntimeError("the synthetic graph no longer stores edges as (pairs, reversed)")
    gen = torch.Generator().manual_seed(args.seed + 1)
    flip = torch.rand(num_pairs, generator=gen) < 0.5  # seed direction: no lo < hi pattern
    u, v = torch.where(flip, v, u), torch.where(flip, u, v)
    perm = torch.randperm(num_pairs, generator=gen)
    n_val, n_test = int(args.val_frac * num_pairs), int(args.test_frac * num_pairs)
    held = {"val": perm[:n_val], "test": perm[n_val:n_val + n_test]}
    train = perm[n_val + n_test:]
    if min(n_val, n_test, len(train)) < 1:
        raise ValueError(f"{num_pairs} undirected edges are too few to split "
                         f"{args.val_frac}/{args.test_frac}")
    tu, tv = u[train], v[train]
    t = int(train.shape[0])
    train_graph = dgl.graph((torch.cat([tu, tv]), torch.cat([tv, tu])), num_nodes=sg.num_nodes)
    reverse_eids = torch.cat([torch.arange(t, 2 * t), torch.arange(0, t)])
    eval_graphs, eval_tails = {}, {}
    for split, idx in held.items():
        g = dgl.graph((torch.cat([tu, tv, u[idx]]), torch.cat([tv, tu, v[idx]])),
                      num_nodes=sg.num_nodes)
        eval_graphs[split] = g
        eval_tails[split] = torch.randint(0, sg.num_nodes, (len(idx), args.eval_num_negs),
                                          generator=gen)
    data = LinkData(sg.features.contiguous(), sg.num_nodes, train_graph, t, reverse_eids,
                    eval_graphs, eval_tails)
    return data, num_pairs


class FixedTails:
    """DGL negative sampler for evaluation: the held-out edge ``e``'s candidates are
    ``tails[e - first_eid]``, drawn once, so every epoch and loader ranks the same ones.

    Like DGL's ``Uniform``, negative ``i * k + j`` corrupts positive ``i``'s tail.
    """

    def __init__(self, tails: torch.Tensor, first_eid: int) -> None:
        self.tails = tails
        self.first_eid = first_eid
        self.k = int(tails.shape[1])

    def __call__(self, g: Any, eids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src, _ = g.find_edges(eids)
        rows = eids.to(torch.int64) - self.first_eid
        return src.repeat_interleave(self.k), self.tails[rows].reshape(-1).to(src.dtype)


class ExcludeAll:
    """``exclude=`` callable: drop these edges from every sampled neighbourhood."""

    def __init__(self, eids: torch.Tensor) -> None:
        self.eids = eids

    def __call__(self, seed_edges: Any) -> torch.Tensor:
        return self.eids


def make_sources(data: LinkData, args: argparse.Namespace) -> dict[str, Any]:
    """DGL DataLoaders of ``(input_nodes, pair_graph, neg_pair_graph, blocks)`` items."""
    import dgl

    sources = {}
    sampler = dgl.dataloading.as_edge_prediction_sampler(
        dgl.dataloading.NeighborSampler(args.fanouts), exclude="reverse_id",
        reverse_eids=data.reverse_eids,
        negative_sampler=dgl.dataloading.negative_sampler.Uniform(args.num_negs))
    sources["train"] = dgl.dataloading.DataLoader(
        data.train_graph, torch.arange(data.num_train), sampler,
        batch_size=args.batch_size, shuffle=True, drop_last=False)
    first = 2 * data.num_train
    for split, g in data.eval_graphs.items():
        held = torch.arange(first, g.num_edges())
        sampler = dgl.dataloading.as_edge_prediction_sampler(
            dgl.dataloading.NeighborSampler(args.fanouts), exclude=ExcludeAll(held),
            negative_sampler=FixedTails(data.eval_tails[split], first))
        sources[split] = dgl.dataloading.DataLoader(
            g, held, sampler, batch_size=args.eval_batch_size, shuffle=False, drop_last=False)
    return sources


# --------------------------------------------------------------------------- loaders
class SyncBatch(NamedTuple):
    """Same fields as ``pingpong.NegativeEdgeBatch``."""

    input_nodes: torch.Tensor
    pair_graph: Any
    neg_pair_graph: Any
    blocks: list[Any]
    x: torch.Tensor
    y: None


class SyncLoader:
    """The plain loop pingpong replaces: sample, then gather on the training thread.

    On CUDA the gathered rows are copied synchronously and the graphs become
    :class:`~pingpong.blocks.EdgeBlock` s on the GPU (a CPU-only DGL cannot
    move graphs there), as pingpong delivers them.
    """

    def __init__(self, source: Iterable[Any], features: torch.Tensor,
                 device: torch.device) -> None:
        self.source = source
        self.features = features
        self.device = device
        self.stats: dict[str, float] = dict(batches=0, rows_gathered=0, bytes_gathered=0,
                                            sample_s=0.0, gather_s=0.0)

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[SyncBatch]:
        it = iter(self.source)
        row_bytes = self.features[0].numel() * self.features.element_size()
        while True:
            t0 = time.perf_counter()
            try:
                input_nodes, pair_graph, neg_pair_graph, blocks = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            x = self.features.index_select(0, input_nodes)
            if self.device.type != "cpu":
                x = x.to(self.device)
                pair_graph = as_edge_block(pair_graph).to(self.device)
                neg_pair_graph = as_edge_block(neg_pair_graph).to(self.device)
                blocks = [as_edge_block(b).to(self.device) for b in blocks]
            t2 = time.perf_counter()
            s = self.stats
            s["batches"] += 1
            s["rows_gathered"] += int(input_nodes.shape[0])
            s["bytes_gathered"] += int(input_nodes.shape[0]) * row_bytes
            s["sample_s"] += t1 - t0
            s["gather_s"] += t2 - t1
            yield SyncBatch(input_nodes, pair_graph, neg_pair_graph, list(blocks), x, None)

    def close(self) -> None:
        pass


def make_loader(source: Iterable[Any], data: LinkData, args: argparse.Namespace,
                device: torch.device) -> Any:
    if args.loader == "dgl":
        return SyncLoader(source, data.features, device)
    return pingpong.PingPongLoader(source, data.features, device=str(device),
                                   num_buffers=args.num_buffers, gather=args.gather,
                                   sampler_threads=args.sampler_threads,
                                   producer_nice=args.producer_nice)


# --------------------------------------------------------------------------- model
def endpoints(graph: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` of a pair graph in its local ids (a DGL graph or an EdgeBlock)."""
    if isinstance(graph, EdgeBlock):
        src, dst = graph.src, graph.dst
    else:
        src, dst = graph.edges()
    return src.to(device, torch.int64), dst.to(device, torch.int64)


class LinkPredictor(nn.Module):
    """``sage_model.SAGE`` as the encoder (its output width = ``hidden``) plus an edge scorer.

    The encoder returns one embedding per destination node of the last block,
    which DGL's edge-prediction sampler makes exactly the nodes of
    ``pair_graph`` and ``neg_pair_graph`` (compacted together), in their
    local-id order. ``dot`` scores ``<h_u, h_v>``; ``mlp`` scores
    ``MLP(h_u * h_v)`` (as in DGL's link-prediction example).
    """

    def __init__(self, in_feats: int, hidden: int, num_layers: int, dropout: float,
                 scorer: str) -> None:
        super().__init__()
        self.encoder = SAGE(in_feats, hidden, hidden, num_layers, dropout)
        self.mlp = (nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                    if scorer == "mlp" else None)

    def score(self, h: torch.Tensor, graph: Any) -> torch.Tensor:
        src, dst = endpoints(graph, h.device)
        if self.mlp is None:
            return (h[src] * h[dst]).sum(1)
        return self.mlp(h[src] * h[dst]).squeeze(1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of ``batch.pair_graph``'s edges and of ``batch.neg_pair_graph``'s."""
        h = self.encoder(batch.blocks, batch.x)
        return self.score(h, batch.pair_graph), self.score(h, batch.neg_pair_graph)


# --------------------------------------------------------------------------- metrics
def reciprocal_ranks(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """``1 / rank`` of each positive among itself and its row of ``neg`` ``(P, k)``
    (ties count half: OGB's average of optimistic and pessimistic rank)."""
    above = (neg > pos[:, None]).sum(1)
    at_or_above = (neg >= pos[:, None]).sum(1)
    return 1.0 / (0.5 * (above + at_or_above).double() + 1.0)


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with tie-averaged ranks)."""
    scores = torch.cat([pos, neg]).double()
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based, ties averaged
    p, n = pos.numel(), neg.numel()
    return float((ranks[:p].sum() - p * (p + 1) / 2) / (p * n))


def chance_mrr(k: int) -> float:
    """Expected MRR of a scorer that ranks the true tail uniformly among k + 1."""
    return sum(1.0 / r for r in range(1, k + 2)) / (k + 1)


def evaluate(model: LinkPredictor, loader: Any, k: int) -> tuple[float, float]:
    """``(MRR, AUC)`` of the held-out edges against their fixed candidates."""
    model.eval()
    pos_all, neg_all = [], []
    with torch.no_grad():
        for batch in loader:
            pos, neg = model(batch)
            dev = pos.device
            src, _ = endpoints(batch.pair_graph, dev)
            neg_src, _ = endpoints(batch.neg_pair_graph, dev)
            if not torch.equal(neg_src.view(-1, k), src[:, None].expand(-1, k)):
                raise RuntimeError("negative i*k+j does not corrupt positive i's tail")
            pos_all.append(pos.float().cpu())
            neg_all.append(neg.float().view(-1, k).cpu())
    model.train()
    pos, neg = torch.cat(pos_all), torch.cat(neg_all)
    return float(reciprocal_ranks(pos, neg).mean()), auc(pos, neg.reshape(-1))


# --------------------------------------------------------------------------- training
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: argparse.Namespace, data: LinkData, device: torch.device) -> dict[str, Any]:
    import dgl

    torch.manual_seed(args.seed)
    dgl.seed(args.seed)
    np.random.seed(args.seed)  # DGL shuffles with NumPy's global generator
    model = LinkPredictor(data.features.shape[1], args.hidden, len(args.fanouts),
                          args.dropout, args.scorer).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sources = make_sources(data, args)
    loaders = {split: make_loader(src, data, args, device) for split, src in sources.items()}
    train_loader = loaders["train"]
    epoch_times: list[float] = []
    losses: list[float] = []
    val_mrr: list[float] = []
    val_auc: list[float] = []
    try:
        for epoch in range(args.epochs):
            sync(device)
            t_epoch = t_log = time.perf_counter()
            seen_since_log = 0
            for step, batch in enumerate(train_loader):
                pos, neg = model(batch)
                scores = torch.cat([pos, neg]).float()
                targets = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)]).float()
                loss = F.binary_cross_entropy_with_logits(scores, targets)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                seen_since_log += int(pos.shape[0])
                if (step + 1) % args.log_every == 0:
                    now = time.perf_counter()
                    print(f"Epoch {epoch:05d} | Step {step + 1:05d} | Loss {losses[-1]:.4f} | "
                          f"Speed (edges/sec) {seen_since_log / (now - t_log):.1f}", flush=True)
                    t_log, seen_since_log = now, 0
            sync(device)
            epoch_times.append(time.perf_counter() - t_epoch)
            print(f"Epoch Time(s): {epoch_times[-1]:.4f}", flush=True)
            mrr, roc = evaluate(model, loaders["val"], args.eval_num_negs)
            val_mrr.append(mrr)
            val_auc.append(roc)
            print(f"Eval MRR {mrr:.4f} | Eval AUC {roc:.4f}", flush=True)
        test_mrr, test_auc = evaluate(model, loaders["test"], args.eval_num_negs)
        print(f"Test MRR: {test_mrr:.4f} | Test AUC: {test_auc:.4f} | chance MRR "
              f"{chance_mrr(args.eval_num_negs):.4f}, AUC 0.5", flush=True)
        stats = dict(train_loader.stats)
    finally:
        for loader in loaders.values():
            loader.close()
    return {
        "loader": args.loader,
        "device": str(device),
        "scorer": args.scorer,
        "epoch_times": epoch_times,
        "losses": losses,
        "val_mrr": val_mrr,
        "val_auc": val_auc,
        "test_mrr": test_mrr,
        "test_auc": test_auc,
        "num_negs": args.num_negs,
        "eval_num_negs": args.eval_num_negs,
        "chance_mrr": chance_mrr(args.eval_num_negs),
        "train_edges": data.num_train,
        "batches_per_epoch": len(train_loader),
        "batches": int(stats["batches"]),
        "edges_per_sec": data.num_train * len(epoch_times) / sum(epoch_times),
        "stats": _jsonable(stats),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _import_dgl_or_exit(parser: argparse.ArgumentParser) -> None:
    """One line on stderr and exit status 2 when DGL is missing or does not import."""
    if importlib.util.find_spec("dgl") is None:
        parser.exit(2, "train_link.py: this example needs DGL (edge-prediction sampling); "
                       "pip install 'pingpong-gnn[dgl]'\n")
    try:
        import dgl  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - e.g. DGL 2.1 next to a newer torch
        message = " ".join(str(exc).split()) or type(exc).__name__
        parser.exit(2, f"train_link.py: this example needs DGL, and `import dgl` failed: "
                       f"{type(exc).__name__}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _import_dgl_or_exit(parser)
    check_device_flags(parser, args)
    check_json_target(parser, args.json)
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    device = torch.device(args.device)
    try:
        data, num_pairs = split_edges(args)
    except ValueError as exc:
        parser.error(str(exc))
    n_val = int(data.eval_tails["val"].shape[0])
    n_test = int(data.eval_tails["test"].shape[0])
    print(f"Dataset synthetic: {data.num_nodes} nodes, {data.features.shape[1]} features, "
          f"{num_pairs} edges, {data.num_train}/{n_val}/{n_test} train/val/test | "
          f"loader {args.loader} | device {device} | model SAGE + {args.scorer} scorer | "
          f"{args.num_negs} neg/edge (train), {args.eval_num_negs} (eval)", flush=True)
    result = train(args, data, device)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
