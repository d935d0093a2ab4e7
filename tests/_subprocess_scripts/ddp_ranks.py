"""Parent of a real torch.distributed (gloo) job: one PingPongLoader per rank.

Usage: ``python ddp_ranks.py WORLD_SIZE SOURCE OUT_DIR [DEVICE]`` with SOURCE
``builtin`` (:class:`pingpong.sources.BuiltinLoader` with ``use_ddp=True``) or
``dgl`` (DGL's ``DataLoader`` with ``use_ddp=True``), and DEVICE ``cpu``
(default) or ``cuda``: every rank then delivers batches on ``cuda:0`` with the
``zerocopy`` gather, so each rank page-locks the same shared-memory table in
its own process (the model stays on the CPU: gloo, one GPU).

The parent builds the feature and label tables once, in shared memory, and
spawns WORLD_SIZE ranks that all gather from those same pages.  To show that
they are the same pages, the feature table is the first rows of one storage
whose last WORLD_SIZE rows are a probe: after training, rank ``r`` fills probe
row ``r`` with ``r + 1`` and the parent, after the ranks have exited, reports
what it sees there (``OUT_DIR/parent.json``).  Each rank
trains a DDP-wrapped linear model for two epochs through its loader, checks
every batch against the synchronous reference (``features[input_nodes]``,
``labels[output_nodes]``, compared bit for bit), and writes
``OUT_DIR/rank{r}.json``: per epoch the output nodes of every batch, the
number of batches that differed from the reference, and a digest of the
final parameters.  The test reads those files; this script asserts nothing
itself, so a wrong result shows up there, not as a crash here.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pingpong import PingPongLoader
from pingpong.sources import BuiltinLoader, NeighborSampler, make_synthetic_graph

NUM_NODES = 4000  # 1,200 training nodes
NUM_TRAIN = 1001  # odd: with two ranks, one seed is padded in (DistributedSampler-style)
EPOCHS = 2
BATCH_SIZE = 64


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equality is bit equality (NaN == NaN)."""
    return t.contiguous().view(torch.uint8)


def make_source(kind: str, graph, train_idx: torch.Tensor):
    if kind == "builtin":
        return BuiltinLoader(graph.to_csr(), train_idx, NeighborSampler([5, 5]), BATCH_SIZE,
                             shuffle=True, seed=3, use_ddp=True)
    import dgl

    return dgl.dataloading.DataLoader(
        graph.to_dgl(), train_idx, dgl.dataloading.NeighborSampler([5, 5]),
        batch_size=BATCH_SIZE, shuffle=True, drop_last=False, use_ddp=True)


def rank_main(rank: int, world: int, kind: str, out_dir: str, init_file: str,
              storage: torch.Tensor, labels: torch.Tensor, device: str) -> None:
    torch.set_num_threads(1)
    features, probe = storage[:NUM_NODES], storage[NUM_NODES:]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        graph = make_synthetic_graph(num_nodes=NUM_NODES, num_classes=4, feat_dim=8, seed=1)
        train_idx = graph.train_idx[:NUM_TRAIN]
        assert train_idx.shape[0] == NUM_TRAIN, "the graph has too few training nodes"
        torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(features.shape[1], 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        initial = [p.detach().clone() for p in model.parameters()]
        epochs = []
        source = make_source(kind, graph, train_idx)
        with PingPongLoader(source, features, labels, device=device, gather_threads=1,
                            debug=True) as loader:
            for _ in range(EPOCHS):
                outputs, mismatches = [], 0
                for batch in loader:
                    x, y = batch.x.cpu(), batch.y.cpu()
                    same = (torch.equal(bits(x), bits(features[batch.input_nodes.cpu()]))
                            and torch.equal(bits(y), bits(labels[batch.output_nodes.cpu()])))
                    mismatches += not same
                    outputs.append(batch.output_nodes.tolist())
                    # Output nodes are the prefix of input nodes (DGL's convention).
                    logits = model(x[: y.shape[0]])
                    loss = torch.nn.functional.cross_entropy(logits, y)
                    opt.zero_grad()
                    loss.backward()  # all-reduce: hangs if ranks' batch counts differ
                    opt.step()
                epochs.append({"outputs": outputs, "mismatches": mismatches})
            stats = loader.stats
            delivered_on = str(loader.device), loader.gather_mode
        params = b"".join(bits(p.detach()).numpy().tobytes() for p in model.parameters())
        result = {
            "rank": rank,
            "world_size": world,
            "epochs": epochs,
            "train_idx": train_idx.tolist(),
            "probe_is_same_storage": storage.untyped_storage().data_ptr()
            == features.untyped_storage().data_ptr() == probe.untyped_storage().data_ptr(),
            "device": delivered_on[0],
            "gather_mode": delivered_on[1],
            "params_sha256": hashlib.sha256(params).hexdigest(),
            "params_changed": any(not torch.equal(a, b.detach())
                                  for a, b in zip(initial, model.parameters(), strict=True)),
            "batches_stat": int(stats["batches"]),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # every rank is done reading the table
        probe[rank] = rank + 1
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    world, kind, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    graph = make_synthetic_graph(num_nodes=NUM_NODES, num_classes=4, feat_dim=8, seed=1)
    storage = torch.zeros(NUM_NODES + world, graph.features.shape[1])
    storage[:NUM_NODES] = graph.features
    storage.share_memory_()
    labels = graph.labels.share_memory_()
    init_file = str(Path(out_dir, "dist_init"))
    mp.spawn(rank_main, args=(world, kind, out_dir, init_file, storage, labels, device),
             nprocs=world, join=True)
    parent = {"probe": storage[NUM_NODES:].tolist(),
              "features_unchanged": torch.equal(storage[:NUM_NODES], graph.features)}
    Path(out_dir, "parent.json").write_text(json.dumps(parent))


if __name__ == "__main__":
    main()
