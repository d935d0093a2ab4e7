"""Rating prediction on a user-item graph through pingpong: edge labels by edge type (needs DGL).

    python examples/train_rating.py                 # a synthetic user-item rating graph
    python examples/train_rating.py --loader dgl    # the plain loop, for A/B runs

Users rate items (``("user", "rates", "item")``, with the reverse relation
``("item", "rated-by", "user")`` for message passing). Every rating edge has a
rating in [1, 5], the regression target. DGL's ``as_edge_prediction_sampler``
turns a batch of rating edges into ``(input_nodes, pair_graph, blocks)``;
``PingPongLoader(..., edge_labels={"rates": ratings}, heterogeneous=True)``
gathers the user and item features per node type and the batch's ratings at
``pair_graph.edata[dgl.EID][("user", "rates", "item")]`` in its producer
thread, so ``batch.y["rates"]`` is the target of ``pair_graph``'s rating edges.
``--loader dgl`` is the classic loop: sample, then index the tables on the
training thread. The two runs sample different neighbours (DGL's sampling is
not reproducible from a seed across threads; see the troubleshooting page),
so compare errors and time, not losses.

The ratings come from latent user and item factors; the features are a noisy
view of the same factors, so a model that reads both ends of an edge (and
their neighbourhoods) beats predicting the mean rating. The rating edges are
split at random into train / val / test; all of them stay in the graph for
message passing (an edge's existence is no label: its rating is).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
    add_minibatch_training_flags,
    add_producer_flags,
    parse_dgl_example_args,
    positive_int,
    refuse_empty_splits,
)

import pingpong

RATES = ("user", "rates", "item")
RATED_BY = ("item", "rated-by", "user")


# --------------------------------------------------------------------------- data
@dataclass
class RatingData:
    graph: Any
    features: dict[str, torch.Tensor]
    ratings: torch.Tensor  # one per rates edge, float32 in [1, 5]
    train_eids: torch.Tensor
    val_eids: torch.Tensor
    test_eids: torch.Tensor


def make_rating_graph(num_users: int, num_items: int, ratings_per_user: int, feat_dim: int,
                      seed: int) -> RatingData:
    """Each user rates ``ratings_per_user`` random items; rating = 3 + the scaled dot
    product of the two latent factors + noise, clipped to [1, 5]."""
    import dgl

    gen = torch.Generator().manual_seed(seed)
    rank = 8
    user_factor = torch.randn(num_users, rank, generator=gen)
    item_factor = torch.randn(num_items, rank, generator=gen)
    users = torch.arange(num_users).repeat_interleave(ratings_per_user)
    items = torch.randint(0, num_items, users.shape, generator=gen)
    affinity = (user_factor[users] * item_factor[items]).sum(1) / math.sqrt(rank)
    noise = 0.3 * torch.randn(users.shape, generator=gen)
    ratings = (3.0 + 1.2 * affinity + noise).clamp(1.0, 5.0).to(torch.float32)

    def view(factor: torch.Tensor) -> torch.Tensor:
        mix = torch.randn(rank, feat_dim, generator=gen)
        return (factor @ mix + 0.5 * torch.randn(len(factor), feat_dim, generator=gen)).contiguous()

    graph = dgl.heterograph({RATES: (users, items), RATED_BY: (items, users)},
                            num_nodes_dict={"user": num_users, "item": num_items})
    perm = torch.randperm(len(users), generator=gen)
    n_train, n_val = int(0.8 * len(users)), int(0.1 * len(users))
    return RatingData(graph, {"user": view(user_factor), "item": view(item_factor)}, ratings,
                      perm[:n_train].sort().values, perm[n_train:n_train + n_val].sort().values,
                      perm[n_train + n_val:].sort().values)


# --------------------------------------------------------------------------- model
class RatingModel(nn.Module):
    """Per-relation mean SAGE convolutions (summed per destination type); a rating
    is the mean training rating plus an MLP of the two ends' embeddings (and their
    product)."""

    def __init__(self, data: RatingData, hidden: int, num_layers: int) -> None:
        import dgl.nn as dglnn

        super().__init__()
        self.proj = nn.ModuleDict({nt: nn.Linear(t.shape[1], hidden)
                                   for nt, t in data.features.items()})
        self.layers = nn.ModuleList(
            dglnn.HeteroGraphConv({et: dglnn.SAGEConv(hidden, hidden, "mean")
                                   for et in data.graph.etypes}, aggregate="sum")
            for _ in range(num_layers))
        self.predict = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 1))
        self.bias = float(data.ratings[data.train_eids].mean())

    def forward(self, blocks: list[Any], x: dict[str, torch.Tensor],
                pair_graph: Any) -> torch.Tensor:
        h = {nt: self.proj[nt](x[nt]) for nt in self.proj}
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h_dst = {nt: v[: block.num_dst_nodes(nt)] for nt, v in h.items()}
            h = layer(block, (h, h_dst))
            if i < len(self.layers) - 1:
                h = {nt: F.relu(v) for nt, v in h.items()}
        src, dst = pair_graph.edges(etype=RATES)
        user, item = h["user"][src], h["item"][dst]
        both = torch.cat([user, item, user * item], dim=1)
        return self.bias + self.predict(both).squeeze(-1)


# --------------------------------------------------------------------------- loaders
class SyncBatch(NamedTuple):
    """The fields of ``pingpong.EdgeBatch`` that the training loop reads."""

    input_nodes: dict[str, torch.Tensor]
    pair_graph: Any
    blocks: list[Any]
    x: dict[str, torch.Tensor]
    y: dict[str, torch.Tensor]


class SyncLoader:
    """The plain loop pingpong replaces: sample, then index the tables per type."""

    def __init__(self, source: Iterable[Any], data: RatingData) -> None:
        self.source = source
        self.data = data
        self.stats: dict[str, float] = {"batches": 0}

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[SyncBatch]:
        import dgl

        for input_nodes, pair_graph, blocks in self.source:
            x = {nt: t[input_nodes[nt]] for nt, t in self.data.features.items()}
            y = {"rates": self.data.ratings[pair_graph.edges[RATES].data[dgl.EID]]}
            self.stats["batches"] += 1
            yield SyncBatch(input_nodes, pair_graph, blocks, x, y)

    def close(self) -> None:
        pass


def make_loader(args: argparse.Namespace, data: RatingData, eids: torch.Tensor,
                shuffle: bool) -> Any:
    import dgl

    sampler = dgl.dataloading.as_edge_prediction_sampler(
        dgl.dataloading.NeighborSampler(args.fanouts))
    source = dgl.dataloading.DataLoader(data.graph, {"rates": eids}, sampler,
                                        batch_size=args.batch_size, shuffle=shuffle)
    if args.loader == "dgl":
        return SyncLoader(source, data)
    return pingpong.PingPongLoader(source, data.features, edge_labels={"rates": data.ratings},
                                   heterogeneous=True, num_buffers=args.num_buffers,
                                   sampler_threads=args.sampler_threads,
                                   producer_nice=args.producer_nice)


# --------------------------------------------------------------------------- training
def rmse(model: nn.Module, loader: Any) -> float:
    model.eval()
    squared = count = 0.0
    with torch.no_grad():
        for batch in loader:
            predicted = model(batch.blocks, batch.x, batch.pair_graph)
            squared += float(((predicted - batch.y["rates"]) ** 2).sum())
            count += int(batch.y["rates"].shape[0])
    model.train()
    return math.sqrt(squared / max(count, 1))


def train(args: argparse.Namespace, data: RatingData) -> dict[str, Any]:
    import dgl

    torch.manual_seed(args.seed)
    dgl.seed(args.seed)
    np.random.seed(args.seed)  # DGL shuffles with NumPy's global generator
    model = RatingModel(data, args.hidden, len(args.fanouts))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loaders = [make_loader(args, data, data.train_eids, shuffle=True),
               make_loader(args, data, data.val_eids, shuffle=False),
               make_loader(args, data, data.test_eids, shuffle=False)]
    train_loader, val_loader, test_loader = loaders
    mean = float(data.ratings[data.train_eids].mean())
    mean_rmse = float(((data.ratings[data.test_eids] - mean) ** 2).mean().sqrt())
    epoch_times, losses = [], []
    try:
        for epoch in range(args.epochs):
            t0 = time.perf_counter()
            for batch in train_loader:
                loss = F.mse_loss(model(batch.blocks, batch.x, batch.pair_graph),
                                  batch.y["rates"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            epoch_times.append(time.perf_counter() - t0)
            val_rmse = rmse(model, val_loader)
            print(f"Epoch {epoch:05d} | Loss {losses[-1]:.4f} | Epoch Time(s): "
                  f"{epoch_times[-1]:.4f} | Val RMSE {val_rmse:.4f}", flush=True)
        test_rmse = rmse(model, test_loader)
        print(f"Test RMSE: {test_rmse:.4f} (predicting the mean: {mean_rmse:.4f})", flush=True)
        stats = dict(train_loader.stats)
    finally:
        for loader in loaders:
            loader.close()
    return {"loader": args.loader, "epoch_times": epoch_times, "losses": losses,
            "val_rmse": val_rmse, "test_rmse": test_rmse, "mean_rmse": mean_rmse,
            "batches": int(stats["batches"])}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Rating prediction on a user-item graph "
                                            "through pingpong (edge labels by edge type).")
    p.add_argument("--loader", choices=["pingpong", "dgl"], default="pingpong")
    p.add_argument("--num-users", type=positive_int, default=20_000)
    p.add_argument("--num-items", type=positive_int, default=5_000)
    p.add_argument("--ratings-per-user", type=positive_int, default=10)
    p.add_argument("--feat-dim", type=positive_int, default=64)
    add_minibatch_training_flags(p)
    add_producer_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_dgl_example_args(parser, argv, "heterogeneous edge sampling")
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    data = make_rating_graph(args.num_users, args.num_items, args.ratings_per_user,
                             args.feat_dim, args.seed)
    refuse_empty_splits(parser, {"train": data.train_eids, "val": data.val_eids,
                                 "test": data.test_eids}, "ratings",
                        "--num-users or --ratings-per-user")
    print(f"Graph: {data.graph.num_nodes('user')} users, {data.graph.num_nodes('item')} "
          f"items, {len(data.ratings)} ratings | loader {args.loader}", flush=True)
    result = train(args, data)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
