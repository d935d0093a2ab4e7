"""Train GraphSAGE through pingpong (or the plain synchronous loop, for A/B runs).

    python examples/train_sage.py                       # synthetic graph, pingpong
    python examples/train_sage.py --loader dgl          # plain loop: index_select per step
    python examples/train_sage.py --device cuda --gather zerocopy --feat-dtype float16
    python examples/train_sage.py --mlp                 # features-only baseline
    python examples/train_sage.py --nprocs 2            # DDP: 2 ranks, one loader each
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \
        --master-addr HOST0 --master-port 29500 examples/train_sage.py   # on HOST0; then
                                                          # --node-rank 1 on the other machine

``--loader pingpong`` wraps the sampler's loader in :class:`pingpong.PingPongLoader`,
which gathers features/labels into preallocated buffers in a background thread.
``--loader dgl`` is the classic loop: iterate the sampler, then
``features.index_select(0, input_nodes)`` (and ``.to(device)``) on the training
thread. Both see the same batches for the same ``--seed`` with
``--sampler builtin``.

Sampling uses DGL's ``NeighborSampler`` when DGL is installed and pingpong's
built-in sampler otherwise (``--sampler`` picks). Evaluation samples
neighbours of the val/test nodes with the training fanouts.

``--nprocs N`` trains data-parallel: N processes (torch.distributed, gloo on
the CPU, NCCL with one GPU per rank on CUDA), a DDP-wrapped model, and one
loader per rank over that rank's share of the training nodes (``use_ddp=True``
on the sampler's loader). The feature and label tables are put in shared
memory once, so every rank gathers from the same pages. Rank 0 prints and
evaluates; the speed it prints is rank 0's samples/sec times N.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment)
each process is one rank of the same DDP job, on one machine or several:
torch.distributed is initialised from the environment (``env://``; gloo on
the CPU, NCCL on ``cuda:LOCAL_RANK``), the training nodes are split across all
``WORLD_SIZE`` ranks and rank 0 evaluates. The ranks of one machine share one
copy of the feature and label tables: the machine's first rank writes them
into a file under ``--shm-dir`` (``/dev/shm``), the others map that file, and
the file is removed as soon as every rank has mapped it (the memory lives on
until the last rank exits), so a crash during training leaves nothing behind.
``--nprocs`` (which starts its own ranks on one machine) cannot be combined
with torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.util
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
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
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    seed_value,
)
from _batch_check import BatchCheck, params_digest
from sage_model import MLP, SAGE

import pingpong
from pingpong.blocks import as_edge_block
from pingpong.sources import (
    GRAPH_KINDS,
    BuiltinLoader,
    CSRGraph,
    NeighborSampler,
    make_synthetic_graph,
)

HAVE_DGL = importlib.util.find_spec("dgl") is not None
SHM_DIR = Path("/dev/shm")
FEAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="GraphSAGE node classification through pingpong.PingPongLoader.")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--loader", choices=["pingpong", "dgl"], default="pingpong",
                   help="pingpong: PingPongLoader; dgl: plain loop with synchronous "
                        "index_select gather (the A/B baseline)")
    p.add_argument("--gather", choices=["auto", "cpu", "zerocopy", "staged", "device"],
                   default="auto", help="pingpong gather mode")
    p.add_argument("--sort-ids", choices=["auto", "gpu", "none"], default="auto",
                   help="CUDA kernel gathers: sort each batch's ids on the GPU so rows are "
                        "read in address order (auto: in zerocopy only)")
    p.add_argument("--cache-bytes", type=non_negative_int, default=0,
                   help="zerocopy on CUDA: bytes of GPU memory for the hottest feature rows "
                        "(learned in the first epoch; pingpong.cache)")
    p.add_argument("--num-buffers", type=buffer_count, default=2)
    add_producer_flags(p)
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--batch-size", type=positive_int, default=1024)
    p.add_argument("--eval-batch-size", type=positive_int, default=4096)
    p.add_argument("--fanouts", type=fanout_list, default=[15, 10, 5],
                   help="comma-separated, outermost layer first (default 15,10,5); "
                        + FANOUTS_HOW)
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--dropout", type=probability, default=0.5)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--num-workers", type=non_negative_int, default=0,
                   help="DGL sampling worker processes (--sampler dgl only)")
    p.add_argument("--amp", choices=["off", "fp16", "bf16"], default="off")
    p.add_argument("--feat-dtype", choices=list(FEAT_DTYPES), default="float32")
    p.add_argument("--sampler", choices=["dgl", "builtin"],
                   default="dgl" if HAVE_DGL else "builtin",
                   help="default: dgl if importable, else builtin")
    p.add_argument("--dataset", choices=["synthetic", "reddit", "ogbn-products", "ogbn-arxiv"],
                   default="synthetic")
    p.add_argument("--graph", type=Path, default=None,
                   help="a dgl.save_graphs file with ndata feat/label "
                        "(and optionally train/val/test_mask); overrides --dataset")
    p.add_argument("--num-nodes", type=positive_int, default=100_000)
    p.add_argument("--num-classes", type=positive_int, default=16)
    p.add_argument("--feat-dim", type=positive_int, default=128)
    p.add_argument("--avg-degree", type=positive_float, default=15.0)
    p.add_argument("--graph-kind", choices=list(GRAPH_KINDS), default="powerlaw",
                   help="synthetic degree distribution: powerlaw (Chung-Lu, exponent 2.5, "
                        "hubs are hot rows) or uniform (Poisson degrees, no hot rows)")
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--mlp", action="store_true",
                   help="features-only baseline (same loop, the model ignores the blocks)")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: on a terminal, epochs of 50+ steps)")
    p.add_argument("--log-every", type=positive_int, default=20)
    p.add_argument("--json", type=Path, default=None, help="write a JSON summary here")
    p.add_argument("--nprocs", type=positive_int, default=1,
                   help="data-parallel ranks on this machine (torch.distributed + DDP), one "
                        "loader each; under torchrun use its --nproc-per-node instead")
    p.add_argument("--shm-dir", type=Path, default=None,
                   help="under torchrun: where the ranks of a machine share the feature and "
                        f"label tables (default {SHM_DIR}; a tmpfs)")
    # Test hooks: per-step digests of everything the training step reads and a
    # .meta.json per rank (output nodes, weights, each batch checked against the
    # rank's tables; under torchrun also what it saw of the shared tables), and
    # one rank that crashes, or hangs until torchrun stops it, while the
    # shared-table file exists.
    p.add_argument("--dump-batches", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-crash-rank", type=non_negative_int, default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--test-hang-rank", type=non_negative_int, default=None,
                   help=argparse.SUPPRESS)
    return p


# --------------------------------------------------------------------------- data
@dataclass
class Dataset:
    features: torch.Tensor
    labels: torch.Tensor
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int
    dgl_graph: Any = None
    csr: CSRGraph | None = None
    synthetic: Any = None

    def sampling_graph(self, sampler: str) -> Any:
        if sampler == "builtin":
            if self.csr is None:
                self.csr = (self.synthetic.to_csr() if self.synthetic is not None
                            else CSRGraph.from_dgl(self.dgl_graph))
            return self.csr
        if self.dgl_graph is None:
            self.dgl_graph = self.synthetic.to_dgl()
        return self.dgl_graph

    def replace_tables(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Train on ``features``/``labels`` and drop every reference to the old tables."""
        self.features, self.labels = features, labels
        if self.synthetic is not None:
            self.synthetic = replace(self.synthetic, features=features, labels=labels)
        if self.dgl_graph is not None:  # its ndata is read only when the dataset is loaded
            for key in ("feat", "label"):
                if key in self.dgl_graph.ndata:
                    self.dgl_graph.ndata.pop(key)


def _split_from_masks(g: Any, labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    if all(f"{s}_mask" in g.ndata for s in ("train", "val", "test")):
        # a label < 0 marks a node without one (as below), also under a mask
        return tuple(torch.nonzero(g.ndata[f"{s}_mask"].bool() & (labels >= 0),
                                   as_tuple=True)[0]
                     for s in ("train", "val", "test"))
    # no masks: a seeded 60/20/20 split of the labelled nodes (a label < 0 marks
    # a node without one, as in OGB's files)
    labelled = torch.nonzero(labels >= 0, as_tuple=True)[0]
    if len(labelled) == 0:
        raise ValueError("no node has a label (every ndata['label'] is negative)")
    order = torch.randperm(len(labelled), generator=torch.Generator().manual_seed(seed))
    perm = labelled[order]
    n_train, n_val = int(0.6 * len(perm)), int(0.2 * len(perm))
    return (perm[:n_train].sort().values, perm[n_train:n_train + n_val].sort().values,
            perm[n_train + n_val:].sort().values)


def _from_dgl_graph(g: Any, seed: int) -> Dataset:
    for key in ("feat", "label"):
        if key not in g.ndata:
            raise KeyError(f"graph has no ndata[{key!r}]")
    if g.ndata["feat"].dim() != 2:
        raise ValueError(f"ndata['feat'] must be 2-D (nodes x features), got shape "
                         f"{tuple(g.ndata['feat'].shape)}")
    labels = g.ndata["label"].reshape(-1).long()
    train_idx, val_idx, test_idx = _split_from_masks(g, labels, seed)
    num_classes = int(labels[labels >= 0].max()) + 1
    return Dataset(g.ndata["feat"], labels, train_idx, val_idx, test_idx, num_classes,
                   dgl_graph=g)


def check_splits(data: Dataset) -> None:
    """Refuse a split without nodes: its accuracy would print as 0.0000."""
    for name in ("train", "val", "test"):
        if len(getattr(data, f"{name}_idx")) == 0:
            raise ValueError(f"the {name} split has no labelled nodes (train/val/test "
                             f"{len(data.train_idx)}/{len(data.val_idx)}/"
                             f"{len(data.test_idx)}); use a larger graph")


def load_dataset(args: argparse.Namespace) -> Dataset:
    """Load or generate the data; raises on any failure (the caller reports it)."""
    if args.graph is not None:
        import dgl

        graphs, _ = dgl.load_graphs(str(args.graph))
        return _from_dgl_graph(graphs[0], args.seed)
    if args.dataset == "synthetic":
        sg = make_synthetic_graph(num_nodes=args.num_nodes, num_classes=args.num_classes,
                                  feat_dim=args.feat_dim, avg_degree=args.avg_degree,
                                  seed=args.seed, graph_kind=args.graph_kind)
        return Dataset(sg.features, sg.labels, sg.train_idx, sg.val_idx, sg.test_idx,
                       sg.num_classes, synthetic=sg)
    if args.dataset == "reddit":
        from dgl.data import RedditDataset

        return _from_dgl_graph(RedditDataset()[0], args.seed)
    import dgl
    from ogb.nodeproppred import DglNodePropPredDataset

    ogb = DglNodePropPredDataset(name=args.dataset)
    g, labels = ogb[0]
    if args.dataset == "ogbn-arxiv":  # directed citations: add the reverse edges
        g = dgl.to_bidirected(g, copy_ndata=True)
    split = ogb.get_idx_split()
    labels = labels.reshape(-1).long()
    return Dataset(g.ndata["feat"], labels, split["train"], split["valid"], split["test"],
                   int(labels.max()) + 1, dgl_graph=g)


def make_source(data: Dataset, args: argparse.Namespace, idx: torch.Tensor, batch_size: int,
                shuffle: bool, use_ddp: bool = False) -> Iterable[Any]:
    """A re-iterable of ``(input_nodes, output_nodes, blocks)`` triples on the CPU.

    ``use_ddp``: only this rank's share of ``idx`` (same batch count on every rank).
    """
    graph = data.sampling_graph(args.sampler)
    if args.sampler == "builtin":
        return BuiltinLoader(graph, idx, NeighborSampler(args.fanouts), batch_size,
                             shuffle=shuffle, seed=args.seed, use_ddp=use_ddp)
    import dgl

    return dgl.dataloading.DataLoader(
        graph, idx, dgl.dataloading.NeighborSampler(args.fanouts), batch_size=batch_size,
        shuffle=shuffle, drop_last=False, num_workers=args.num_workers, use_ddp=use_ddp)


# --------------------------------------------------------------------------- loaders
class SyncBatch(NamedTuple):
    """Same fields as ``pingpong.Batch``."""

    input_nodes: torch.Tensor
    output_nodes: torch.Tensor
    blocks: list[Any]
    x: torch.Tensor
    y: torch.Tensor


class SyncLoader:
    """The plain loop pingpong replaces: sample, then gather on the training thread.

    On CUDA the gathered rows are copied synchronously and the blocks become
    :class:`~pingpong.blocks.EdgeBlock` on the GPU (a CPU-only DGL cannot move
    blocks there), matching what pingpong delivers.
    """

    def __init__(self, source: Iterable[Any], features: torch.Tensor, labels: torch.Tensor,
                 device: torch.device) -> None:
        self.source = source
        self.features = features
        self.labels = labels
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
                input_nodes, output_nodes, blocks = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            x = self.features.index_select(0, input_nodes)
            y = self.labels.index_select(0, output_nodes)
            if self.device.type != "cpu":
                x = x.to(self.device)
                y = y.to(self.device)
                blocks = [as_edge_block(b).to(self.device) for b in blocks]
            t2 = time.perf_counter()
            s = self.stats
            s["batches"] += 1
            s["rows_gathered"] += int(input_nodes.shape[0])
            s["bytes_gathered"] += int(input_nodes.shape[0]) * row_bytes
            s["sample_s"] += t1 - t0
            s["gather_s"] += t2 - t1
            yield SyncBatch(input_nodes, output_nodes, list(blocks), x, y)

    def close(self) -> None:
        pass


def make_loader(source: Iterable[Any], data: Dataset, args: argparse.Namespace,
                device: torch.device) -> Any:
    if args.loader == "dgl":
        return SyncLoader(source, data.features, data.labels, device)
    if not hasattr(pingpong, "PingPongLoader"):
        raise RuntimeError("pingpong.PingPongLoader is not available in this checkout")
    # Several ranks on one machine share its cores: each gathers with its part.
    per_machine = ranks_per_machine(args)
    gather_threads = None if per_machine == 1 else max(1, cpu_count() // (2 * per_machine))
    return pingpong.PingPongLoader(source, data.features, data.labels, device=str(device),
                                   num_buffers=args.num_buffers, gather=args.gather,
                                   gather_threads=gather_threads, sort_ids=args.sort_ids,
                                   cache_bytes=args.cache_bytes,
                                   sampler_threads=args.sampler_threads,
                                   producer_nice=args.producer_nice)


# --------------------------------------------------------------------------- training
def batch_digest(batch: Any) -> str:
    """SHA-256 over ids, gathered rows, labels and block edges of one batch."""
    h = hashlib.sha256()
    tensors = [batch.input_nodes, batch.output_nodes, batch.x, batch.y]
    for block in batch.blocks:
        eb = as_edge_block(block)
        tensors += [eb.src, eb.dst, torch.tensor([eb.num_src_nodes, eb.num_dst_nodes])]
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def progress(iterable: Iterable[Any], total: int, desc: str, mode: str) -> Iterable[Any]:
    """A progress bar on stderr for long epochs (tqdm if installed, else a plain one).

    ``mode``: ``on``, ``off``, or ``auto`` -- on when stderr is a terminal and the
    epoch has at least 50 steps.
    """
    if mode == "off" or (mode == "auto" and not (sys.stderr.isatty() and total >= 50)):
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return _plain_progress(iterable, total, desc)
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)


def _plain_progress(iterable: Iterable[Any], total: int, desc: str) -> Iterator[Any]:
    shown = 0.0
    width = 30
    for step, item in enumerate(iterable, 1):
        now = time.perf_counter()
        if now - shown > 0.5 or step == total:
            done = int(width * step / max(total, 1))
            sys.stderr.write(f"\r{desc} [{'#' * done}{'.' * (width - done)}] {step}/{total}")
            sys.stderr.flush()
            shown = now
        yield item
    sys.stderr.write("\r" + " " * (len(desc) + width + 24) + "\r")
    sys.stderr.flush()


def make_grad_scaler(enabled: bool) -> Any:
    """A CUDA GradScaler (``torch.amp.GradScaler`` exists from torch 2.3 on)."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def autocast(args: argparse.Namespace, device: torch.device) -> Any:
    if args.amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[args.amp])


def evaluate(model: torch.nn.Module, loader: Any, args: argparse.Namespace,
             device: torch.device) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            with autocast(args, device):
                logits = model(batch.blocks, batch.x)
            correct += int((logits.argmax(1) == batch.y).sum())
            total += int(batch.y.shape[0])
    model.train()
    return correct / max(total, 1)


def gpu_column(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return f" | GPU {torch.cuda.max_memory_allocated(device) / 1e6:.1f} MB"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_count() -> int:
    return os.cpu_count() or 2


def ranks_per_machine(args: argparse.Namespace) -> int:
    """Ranks sharing this machine's cores: ``--nprocs``, or torchrun's ``LOCAL_WORLD_SIZE``."""
    return int(getattr(args, "local_world_size", None) or args.nprocs)


@dataclass
class Rank:
    """Where this process stands in a ``--nprocs`` job (rank 0 of 1 otherwise)."""

    rank: int = 0
    world_size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def barrier(self, device: torch.device) -> None:
        if self.world_size > 1:
            if device.type == "cuda":  # NCCL: name the GPU rather than let it guess
                torch.distributed.barrier(device_ids=[device.index])
            else:
                torch.distributed.barrier()


def train(args: argparse.Namespace, data: Dataset, device: torch.device,
          ranks: Rank | None = None, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train and evaluate; with several ranks, rank 0 prints, evaluates and reports.

    ``report`` (with ``--dump-batches``): filled with every step's output node
    ids, per epoch, digests of every step's gradients and weights and of the
    trained weights, what :class:`BatchCheck` found (``batch_check``) and how
    many evaluation batches this rank ran (``eval_batches``: 0 but on rank 0).
    """
    ranks = ranks or Rank()
    log = print if ranks.leader else _quiet
    torch.manual_seed(args.seed)
    if args.sampler == "dgl":
        import dgl

        dgl.seed(args.seed)
    in_feats = data.features.shape[1]
    model_cls = MLP if args.mlp else SAGE
    model = model_cls(in_feats, args.hidden, data.num_classes, len(args.fanouts),
                      args.dropout).to(device)
    net: torch.nn.Module = model
    if ranks.world_size > 1:  # averages gradients across ranks at every backward()
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    scaler = make_grad_scaler(enabled=args.amp == "fp16" and device.type == "cuda")

    train_loader = make_loader(
        make_source(data, args, data.train_idx, args.batch_size, shuffle=True,
                    use_ddp=ranks.world_size > 1), data, args, device)
    # Evaluation runs on rank 0 alone, over all val/test nodes.
    val_loader = test_loader = None
    if ranks.leader:
        val_loader = make_loader(
            make_source(data, args, data.val_idx, args.eval_batch_size, shuffle=False), data,
            args, device)
        test_loader = make_loader(
            make_source(data, args, data.test_idx, args.eval_batch_size, shuffle=False), data,
            args, device)
    epoch_times: list[float] = []
    losses: list[float] = []
    digests: list[str] = []
    outputs: list[list[list[int]]] = []
    step_sha256: list[list[str]] = []  # per step: [gradients, weights after the step]
    record_steps = report is not None and args.dump_batches is not None
    # Against the tables the loaders were built on (data's, as they are now).
    check = (BatchCheck(data.features, data.labels, len(args.fanouts))
             if args.dump_batches is not None else None)
    val_acc = 0.0
    try:
        for epoch in range(args.epochs):
            sync(device)
            t_epoch = t_log = time.perf_counter()
            seen_since_log = 0
            steps = progress(train_loader, len(train_loader), f"epoch {epoch}", args.progress)
            outputs.append([])
            for step, batch in enumerate(steps):
                if check is not None:
                    digests.append(batch_digest(batch))
                    check(epoch, step, batch)
                    if report is not None:
                        outputs[-1].append(batch.output_nodes.tolist())
                with autocast(args, device):
                    logits = net(batch.blocks, batch.x)
                    loss = F.cross_entropy(logits.float(), batch.y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if record_steps:  # under DDP: the averaged gradients, equal on every rank
                    step_sha256.append([grads_digest(model)])
                scaler.step(opt)
                scaler.update()
                if record_steps:
                    step_sha256[-1].append(params_digest(model))
                losses.append(float(loss.detach()))
                seen_since_log += int(batch.y.shape[0])
                if (step + 1) % args.log_every == 0:
                    acc = float((logits.argmax(1) == batch.y).float().mean())
                    now = time.perf_counter()
                    speed = seen_since_log * ranks.world_size / (now - t_log)
                    log(f"Epoch {epoch:05d} | Step {step + 1:05d} | Loss {losses[-1]:.4f} | "
                        f"Train Acc {acc:.4f} | Speed (samples/sec) "
                        f"{speed:.1f}{gpu_column(device)}", flush=True)
                    t_log, seen_since_log = now, 0
            sync(device)
            epoch_times.append(time.perf_counter() - t_epoch)
            log(f"Epoch Time(s): {epoch_times[-1]:.4f}", flush=True)
            if val_loader is not None:
                val_acc = evaluate(model, val_loader, args, device)
                log(f"Eval Acc {val_acc:.4f}", flush=True)
            ranks.barrier(device)  # the others wait while rank 0 evaluates
        if report is not None and check is not None:  # check: made with --dump-batches
            report.update(output_nodes=outputs, params_sha256=params_digest(model),
                          step_sha256=step_sha256, batch_check=check.summary())
        test_acc = evaluate(model, test_loader, args, device) if test_loader is not None else 0.0
        log(f"Test Acc: {test_acc:.4f}", flush=True)
        if report is not None and check is not None:  # the evaluation batches this rank ran
            report["eval_batches"] = sum(int(loader.stats["batches"])
                                         for loader in (val_loader, test_loader)
                                         if loader is not None)
        stats = dict(train_loader.stats)
    finally:
        for loader in (train_loader, val_loader, test_loader):
            if loader is not None:
                loader.close()
    if args.dump_batches is not None:
        rank_dump_path(args.dump_batches, ranks).write_text(json.dumps(digests))
    n_train = int(data.train_idx.shape[0])
    return {
        "epoch_times": epoch_times,
        "test_acc": test_acc,
        "val_acc": val_acc,
        "samples_per_sec": n_train * len(epoch_times) / sum(epoch_times),
        "loader": args.loader,
        "device": str(device),
        "sampler": args.sampler,
        "model": "mlp" if args.mlp else "sage",
        "world_size": ranks.world_size,
        "losses": losses,
        "stats": _jsonable(stats),
    }


def grads_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters' gradients, bit for bit (a missing one as ``none``)."""
    h = hashlib.sha256()
    for p in model.parameters():
        if p.grad is None:
            h.update(b"none")
        else:
            h.update(p.grad.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                     .numpy().tobytes())
    return h.hexdigest()


def _quiet(*_args: Any, **_kwargs: Any) -> None:
    """``print`` for ranks other than 0."""


def rank_dump_path(path: Path, ranks: Rank) -> Path:
    """``--dump-batches`` file of this rank: ``path`` itself on rank 0 of 1."""
    if ranks.world_size == 1:
        return path
    return path.with_name(f"{path.stem}.rank{ranks.rank}{path.suffix}")


def write_rank_report(args: argparse.Namespace, ranks: Rank, report: dict[str, Any]) -> None:
    """``--dump-batches``: this rank's ``report`` next to its digests, as ``<stem>.meta.json``."""
    dump = rank_dump_path(args.dump_batches, ranks)
    report.update(rank=ranks.rank, world_size=ranks.world_size)
    dump.with_name(f"{dump.stem}.meta.json").write_text(json.dumps(report))


def run_rank(rank: int, world_size: int, args: argparse.Namespace, data: Dataset,
             init_file: str) -> None:
    """One ``--nprocs`` rank (started by ``torch.multiprocessing.spawn``)."""
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(max(1, cpu_count() // world_size))  # ranks share the cores
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    # While rank 0 evaluates, the others wait in a barrier: allow 30 minutes
    # (NCCL's default is 10).
    torch.distributed.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init_file}",
        rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30))
    ranks = Rank(rank, world_size)
    try:
        report: dict[str, Any] | None = {} if args.dump_batches is not None else None
        result = train(args, data, device, ranks, report)
        if report is not None:
            write_rank_report(args, ranks, report)
        if rank == 0 and args.json is not None:
            args.json.write_text(json.dumps(result, indent=2))
        ranks.barrier(device)  # leave together (rank 0 evaluated the test set alone)
    finally:
        torch.distributed.destroy_process_group()


def train_data_parallel(args: argparse.Namespace, data: Dataset) -> None:
    """Spawn ``args.nprocs`` ranks that share ``data``'s tables (in shared memory).

    ``spawn`` would move the tables into shared memory anyway when it passes
    them to the ranks; doing it here says so.
    """
    data.features.share_memory_()
    data.labels.share_memory_()
    with tempfile.TemporaryDirectory(prefix="train_sage_ddp_") as tmp:
        torch.multiprocessing.spawn(
            run_rank, args=(args.nprocs, args, data, os.path.join(tmp, "init")),
            nprocs=args.nprocs, join=True)


# --------------------------------------------------------------------------- torchrun
#: What torchrun sets for every worker; any of the first four means "launched".
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process's place in a torchrun job, read from its environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: str
    run_id: str  # TORCHELASTIC_RUN_ID ("none" unless --rdzv-id is given)
    node: int  # GROUP_RANK (torchrun's node rank), else the node's first global rank


def launch_from_env(environ: dict[str, str] | None = None) -> Launch | None:
    """The torchrun launch described by ``environ``, or None when there is none.

    ``ValueError`` (with what is wrong) for a partial or inconsistent one.
    """
    env = dict(os.environ if environ is None else environ)
    if not any(name in env for name in TORCHRUN_VARS[:4]):
        return None
    missing = [name for name in TORCHRUN_VARS if not env.get(name)]
    if missing:
        raise ValueError(f"{', '.join(n for n in TORCHRUN_VARS if n in env)} set but not "
                         f"{', '.join(missing)}: start the script with torchrun (or unset them)")
    try:
        rank, world, local_rank, local_world = (
            int(env[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
        node = int(env.get("GROUP_RANK", rank - local_rank))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK must "
                         "be integers") from None
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise ValueError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world}, "
                         f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world}")
    return Launch(rank, world, local_rank, local_world, env["MASTER_ADDR"], env["MASTER_PORT"],
                  env.get("TORCHELASTIC_RUN_ID", "none"), node)


class RankFailure(Exception):
    """Some rank could not go on; the message says which and why."""


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """A barrier that also tells every rank whether all of them got this far unharmed."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def dataset_key(args: argparse.Namespace) -> str:
    """A short hash of the flags that decide the tables' contents."""
    flags = {name: str(getattr(args, name)) for name in (
        "dataset", "num_nodes", "num_classes", "feat_dim", "avg_degree", "graph_kind", "seed",
        "feat_dtype")}
    flags["graph"] = str(args.graph.resolve()) if args.graph is not None else ""
    return hashlib.sha256(json.dumps(flags, sort_keys=True).encode()).hexdigest()[:12]


def shared_table_paths(args: argparse.Namespace, launch: Launch, leader: int) -> dict[str, Path]:
    """The files one machine's ranks share, named after the job, the machine and the data.

    Job: ``TORCHELASTIC_RUN_ID`` and ``MASTER_ADDR:MASTER_PORT`` (torchrun's
    default run id is ``none``; the master's port tells concurrent jobs
    apart). Machine: the global rank of its first process (two torchrun
    "nodes" may share one host). Data: :func:`dataset_key`.
    """
    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.]+", "_", text)[:40]

    directory = args.shm_dir or SHM_DIR
    if args.shm_dir is None and not SHM_DIR.is_dir():  # no /dev/shm (macOS): page cache
        directory = Path(tempfile.gettempdir())
    stem = (f"pingpong-train_sage-u{os.getuid()}-{safe(launch.run_id)}-"
            f"{safe(launch.master_addr)}-{safe(launch.master_port)}-rank{leader}-"
            f"{dataset_key(args)}")
    return {name: directory / f"{stem}.{name}" for name in ("features", "labels")}


def write_shared_table(path: Path, table: torch.Tensor) -> torch.Tensor:
    """``table`` copied into a new file at ``path``, returned as a view of the shared mapping.

    The file's space is reserved first, so that a full tmpfs is an ``OSError``
    here rather than a SIGBUS while the rows are copied.
    """
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # left by a crashed run of the same job
    nbytes = table.numel() * table.element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        else:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    shared = torch.from_file(str(path), shared=True, size=table.numel(), dtype=table.dtype)
    shared = shared.view(table.shape)
    shared.copy_(table)
    return shared


def map_shared_table(path: Path, like: torch.Tensor) -> torch.Tensor:
    """The table another rank wrote at ``path``, mapped (not copied); it must equal ``like``."""
    nbytes = like.numel() * like.element_size()
    size = path.stat().st_size
    if size < nbytes or size > max(nbytes, 1):
        raise ValueError(f"{path} holds {size} bytes, but a {like.dtype} table of shape "
                         f"{tuple(like.shape)} takes {nbytes}")
    shared = torch.from_file(str(path), shared=True, size=like.numel(), dtype=like.dtype)
    shared = shared.view(like.shape)
    if not torch.equal(shared.reshape(-1).view(torch.uint8), like.reshape(-1).view(torch.uint8)):
        raise ValueError(f"{path} differs from the table this rank loaded")
    return shared


def _raise_system_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


@dataclass
class SharedTables:
    """How this rank's tables are shared with the other ranks of its machine."""

    paths: dict[str, Path]
    ranks: list[int]  # the global ranks sharing them, the writer first

    @property
    def index(self) -> int:
        """This rank's place among ``ranks``."""
        return self.ranks.index(torch.distributed.get_rank())


def share_tables(data: Dataset, args: argparse.Namespace, launch: Launch,
                 device: torch.device) -> SharedTables | None:
    """Give the ranks of each machine one copy of ``data``'s tables (collective: every rank).

    The machine's first rank writes the tables into files under the shm
    directory; after a barrier the others map those files and drop their own
    copies; after a second barrier the writer removes the files -- the mapped
    memory lives on until the last rank exits, and nothing is left behind
    whatever happens later. The writer removes them on failure too (a Python
    exception or torchrun's SIGTERM); only a SIGKILL between the two barriers
    leaves them (the next run of the same job replaces them).

    None when this rank is alone on its machine (nothing to share).
    """
    dist = torch.distributed
    me = (socket.gethostname(), launch.node, launch.rank)
    everyone: list[Any] = [None] * launch.world_size
    dist.all_gather_object(everyone, me)
    here = sorted(rank for host, node, rank in everyone if (host, node) == me[:2])
    alone = len(here) == 1
    leader = here[0] == launch.rank
    paths = shared_table_paths(args, launch, here[0])
    tables = {"features": data.features, "labels": data.labels}
    error: str | None = None
    writer = leader and not alone
    # torchrun stops the other workers with SIGTERM when one fails: unwind to
    # the finally below (Python's default would end the process on the spot).
    catch_sigterm = writer and threading.current_thread() is threading.main_thread()
    if catch_sigterm:
        previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        shared: dict[str, torch.Tensor] = {}
        if writer:
            try:
                shared = {k: write_shared_table(paths[k], t) for k, t in tables.items()}
            except Exception as exc:  # noqa: BLE001 -- reported to every rank
                error = f"could not write the tables to {paths['features'].parent}: {exc}"
        if not all_ranks_ok(error is None, device):
            raise RankFailure(error or "a machine's first rank could not write the tables")
        if not leader:
            try:
                shared = {k: map_shared_table(paths[k], t) for k, t in tables.items()}
            except Exception as exc:  # noqa: BLE001 -- reported to every rank
                error = f"could not map the shared tables: {exc}"
            if launch.rank in (args.test_crash_rank, args.test_hang_rank):
                # test hooks: die, or hang until torchrun's SIGTERM, holding the mapping
                crash = args.test_crash_rank == launch.rank
                print(f"test-{'crash' if crash else 'hang'}-rank: rank {launch.rank} "
                      f"{'dies' if crash else 'hangs'} with "
                      f"{json.dumps(sorted(map(str, paths.values())))} on disk: "
                      f"{json.dumps([p.exists() for p in paths.values()])}", file=sys.stderr,
                      flush=True)
                if crash:
                    os._exit(3)
                time.sleep(3600)
        if not all_ranks_ok(error is None, device):
            raise RankFailure(error or "a rank could not map the shared tables")
    finally:
        if writer:
            if catch_sigterm:  # none between the unlinks; a pending one comes after them
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                for path in paths.values():
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            finally:
                if catch_sigterm:
                    signal.signal(signal.SIGTERM,
                                  signal.SIG_DFL if previous is None else previous)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if alone:
        return None
    data.replace_tables(shared["features"], shared["labels"])
    return SharedTables(paths, here)


def table_mapping(table: torch.Tensor) -> dict[str, Any]:
    """The ``/proc/self/maps`` entry that holds ``table`` (Linux): its inode and file."""
    address = table.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return {"inode": int(fields[4]),
                        "file": fields[5].strip() if len(fields) > 5 else ""}
    return {}


def probe_shared_tables(data: Dataset, sharing: SharedTables | None, ranks: Rank,
                        device: torch.device) -> dict[str, Any]:
    """Test hook, after training: the ranks sharing a table each write one row of it.

    Every rank then reads what all of them wrote: on one set of pages each
    sees every write. Collective (every rank, sharing or not).
    """
    ranks.barrier(device)  # no rank reads the tables any more
    if sharing is not None:
        data.features[sharing.index] = sharing.index + 1
    ranks.barrier(device)
    if sharing is None:
        return {"shared": False}
    rows = data.features[: len(sharing.ranks)].reshape(len(sharing.ranks), -1)
    return {"shared": True, "ranks": sharing.ranks,
            "paths": {k: str(v) for k, v in sharing.paths.items()},
            "paths_exist": [v.exists() for v in sharing.paths.values()],
            "probe": [sorted(set(row.float().tolist())) for row in rows],
            "mapping": table_mapping(data.features)}


def run_torchrun(args: argparse.Namespace, launch: Launch) -> int:
    """This process is one rank of a torchrun job."""
    if args.device == "cuda":
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    else:
        device = torch.device("cpu")
    args.local_world_size = launch.local_world_size
    torch.set_num_threads(max(1, cpu_count() // launch.local_world_size))
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    # Rank 0 evaluates while the others wait in a barrier: allow 30 minutes.
    torch.distributed.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method="env://",
        timeout=datetime.timedelta(minutes=30))
    ranks = Rank(launch.rank, launch.world_size)
    source_name = str(args.graph) if args.graph is not None else args.dataset
    try:
        error = None
        try:
            data = load_dataset(args)
        except Exception as exc:  # noqa: BLE001 -- one line, and every rank stops
            message = " ".join(str(exc).split()) or type(exc).__name__
            error = f"cannot load dataset {source_name!r}: {type(exc).__name__}: {message}"
        if not all_ranks_ok(error is None, device):
            raise RankFailure(error or "another rank could not load the dataset")
        data.features = data.features.to(FEAT_DTYPES[args.feat_dtype]).contiguous()
        data.labels = data.labels.contiguous()
        if ranks.leader:
            print(f"Dataset {source_name}: {data.features.shape[0]} nodes, "
                  f"{data.features.shape[1]} features, {data.num_classes} classes, "
                  f"{len(data.train_idx)}/{len(data.val_idx)}/{len(data.test_idx)} "
                  f"train/val/test | loader {args.loader} | sampler {args.sampler} | "
                  f"device {device} | model {'MLP' if args.mlp else 'SAGE'} | "
                  f"{launch.world_size} ranks (DDP, torchrun)", flush=True)
        sharing = share_tables(data, args, launch, device)
        if sharing is not None and sharing.index == 0:
            print(f"Rank {launch.rank}: feature and label tables shared by ranks "
                  f"{sharing.ranks} of this machine (one copy)", flush=True)
        report: dict[str, Any] = {}
        result = train(args, data, device, ranks, report)
        if args.dump_batches is not None:
            report.update(local_rank=launch.local_rank, node=launch.node,
                          table=probe_shared_tables(data, sharing, ranks, device))
            write_rank_report(args, ranks, report)
        if ranks.leader and args.json is not None:
            args.json.write_text(json.dumps(result, indent=2))
        ranks.barrier(device)  # leave together (rank 0 evaluated the test set alone)
    except RankFailure as exc:
        print(f"train_sage.py: rank {launch.rank}: stopping: {exc}", file=sys.stderr,
              flush=True)
        return 1
    finally:
        torch.distributed.destroy_process_group()
    return 0


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_device_flags(parser, args)
    if args.sampler == "dgl" and not HAVE_DGL:
        parser.error("--sampler dgl: DGL is not installed (use --sampler builtin)")
    if args.graph is not None and not HAVE_DGL:
        parser.error("--graph needs DGL to read dgl.save_graphs files")
    if args.num_workers and args.sampler != "dgl":
        parser.error("--num-workers applies to --sampler dgl only")
    check_json_target(parser, args.json)
    if args.amp == "fp16" and args.device == "cpu":
        parser.error("--amp fp16 needs --device cuda (use --amp bf16 on the CPU)")
    if args.sort_ids != "auto" and (args.device != "cuda" or args.gather in ("cpu", "staged")):
        parser.error("--sort-ids applies to --device cuda with --gather zerocopy, device or auto")
    if args.cache_bytes and (args.device != "cuda" or args.gather not in ("zerocopy", "auto")
                             or args.loader != "pingpong"):
        parser.error("--cache-bytes applies to pingpong with --device cuda --gather zerocopy")
    if args.nprocs > 1 and args.device == "cuda" and args.nprocs > torch.cuda.device_count():
        parser.error(f"--nprocs {args.nprocs} --device cuda: this machine has "
                     f"{torch.cuda.device_count()} GPU(s), one per rank is needed")
    try:
        launch = launch_from_env()
    except ValueError as exc:
        parser.error(str(exc))
    if launch is not None:
        if args.nprocs > 1:
            parser.error("--nprocs starts its own ranks on one machine; under torchrun give "
                         "torchrun --nproc-per-node instead")
        if args.device == "cuda" and launch.local_rank >= torch.cuda.device_count():
            parser.error(f"LOCAL_RANK {launch.local_rank} --device cuda: this machine has "
                         f"{torch.cuda.device_count()} GPU(s), one per rank is needed")
        return run_torchrun(args, launch)
    if args.shm_dir is not None:
        parser.error("--shm-dir applies under torchrun only")
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")

    source_name = str(args.graph) if args.graph is not None else args.dataset
    try:
        data = load_dataset(args)
        check_splits(data)
    # Downloads, missing packages, bad files: one line, no traceback.
    except Exception as exc:  # noqa: BLE001
        message = " ".join(str(exc).split()) or type(exc).__name__
        parser.exit(1, f"train_sage.py: cannot load dataset {source_name!r}: "
                       f"{type(exc).__name__}: {message}\n")
    data.features = data.features.to(FEAT_DTYPES[args.feat_dtype]).contiguous()
    data.labels = data.labels.contiguous()
    print(f"Dataset {source_name}: {data.features.shape[0]} nodes, "
          f"{data.features.shape[1]} features, {data.num_classes} classes, "
          f"{len(data.train_idx)}/{len(data.val_idx)}/{len(data.test_idx)} train/val/test | "
          f"loader {args.loader} | sampler {args.sampler} | device {device} | "
          f"model {'MLP' if args.mlp else 'SAGE'}"
          + (f" | {args.nprocs} ranks (DDP)" if args.nprocs > 1 else ""), flush=True)
    if args.nprocs > 1:
        train_data_parallel(args, data)
        return 0
    report: dict[str, Any] | None = {} if args.dump_batches is not None else None
    result = train(args, data, device, report=report)
    if report is not None:
        write_rank_report(args, Rank(), report)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
