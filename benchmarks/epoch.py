"""GraphSAGE epoch time: pingpong against the plain loop and DGL's DataLoader (CPU).

Everything trains the same model on the same synthetic graph through
``examples/train_sage.py``'s own ``train()`` (imported, not re-implemented);
only the loader differs.  Contenders (``--feat-dims`` picks the widths):

- ``sync``            the plain loop (``--loader dgl``): DGL ``DataLoader``
                      (num_workers 0) samples, ``index_select`` on the training thread;
- ``dgl w1``          the same with ``num_workers=1`` (sampling in a worker process);
- ``dgl prefetch w1`` DGL 1.1's own feature loading: ``NeighborSampler(
                      prefetch_node_feats=["feat"], prefetch_labels=["label"])``,
                      ``num_workers=1``, so the worker process slices the rows;
- ``pp b2 g2``        ``PingPongLoader(num_buffers=2, gather_threads=2)`` (``b3``: 3 slots,
                      ``g1``: one Numba gather thread);
- ``pp b2 g1 t1``     as ``pp b2 g1`` with ``torch.set_num_threads(1)`` for training.

Besides the end-to-end runs it times *loading alone* (iterate the loader for
an epoch without training) and *compute alone* (train for an epoch on batches
gathered beforehand and held in memory), so each row shows the pipelining
bound ``max(load, compute)`` and the overlap efficiency ``bound / epoch``.

All runs of one width alternate in a fresh random order each round
(``_common.alternate``); each run trains ``--epochs`` epochs, the first a
warm-up; medians over the timed epochs of all rounds are reported.

    python benchmarks/epoch.py --quick                       # < 60 s smoke run
    python benchmarks/epoch.py --out docs/benchmarks --name epoch-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_sage as ts

import pingpong

GOAL_SPEEDUP = 1.3
GOAL_EFFICIENCY = 0.9
DGL_NAMES = ("sync", "dgl w1", "dgl prefetch w1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="< 60 s smoke run")
    p.add_argument("--num-nodes", type=int, default=100_000)
    p.add_argument("--feat-dims", type=int, nargs="+", default=[128, 512])
    p.add_argument("--epochs", type=int, default=2, help="per run; the first is a warm-up")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--contenders", nargs="+", default=None, help="subset of contender names")
    p.add_argument("--wait-quiet", type=float, default=0.0)
    p.add_argument("--out", type=_common.out_dir, default=None)
    p.add_argument("--name", default="epoch-cpu")
    p.add_argument("--from-json", type=_common.json_file, default=None, help="re-render only")
    args = p.parse_args(argv)
    _common.rerender_target(p, args)
    _common.refuse_sizes_with_quick(p, args, ("num_nodes", "feat_dims", "epochs", "rounds"))
    if args.quick:
        args.num_nodes, args.feat_dims, args.epochs, args.rounds = 20_000, [128], 2, 1
        args.contenders = args.contenders or ["sync", "pp b2 g2"]
    if args.epochs < 2:  # the first is a warm-up: no epoch would be left to time
        p.error(f"--epochs must be at least 2 (the first is a warm-up), got {args.epochs}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


# --------------------------------------------------------------------------- loaders
class PrefetchBatches:
    """DGL's DataLoader with ``prefetch_node_feats``: rows come in ``blocks``."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.stats: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Any:
        for input_nodes, output_nodes, blocks in self.source:
            yield ts.SyncBatch(input_nodes, output_nodes, blocks,
                               blocks[0].srcdata["feat"], blocks[-1].dstdata["label"])

    def close(self) -> None:
        pass


def make_source(data: ts.Dataset, args: argparse.Namespace, idx: torch.Tensor,
                batch_size: int, shuffle: bool, use_ddp: bool = False) -> Any:
    if not getattr(args, "dgl_prefetch", False):
        return ORIGINAL_MAKE_SOURCE(data, args, idx, batch_size, shuffle, use_ddp)
    import dgl

    g = data.sampling_graph("dgl")
    g.ndata["feat"], g.ndata["label"] = data.features, data.labels
    sampler = dgl.dataloading.NeighborSampler(args.fanouts, prefetch_node_feats=["feat"],
                                              prefetch_labels=["label"])
    return dgl.dataloading.DataLoader(g, idx, sampler, batch_size=batch_size, shuffle=shuffle,
                                      drop_last=False, num_workers=args.num_workers,
                                      use_ddp=use_ddp)


def make_loader(source: Any, data: ts.Dataset, args: argparse.Namespace,
                device: torch.device) -> Any:
    if getattr(args, "dgl_prefetch", False):
        return PrefetchBatches(source)
    if args.loader == "dgl":
        return ts.SyncLoader(source, data.features, data.labels, device)
    return pingpong.PingPongLoader(source, data.features, data.labels, device=str(device),
                                   num_buffers=args.num_buffers,
                                   gather_threads=args.gather_threads)


ORIGINAL_MAKE_SOURCE = ts.make_source
ts.make_source = make_source  # train() looks both up in its module
ts.make_loader = make_loader
warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")

#: name -> (train_sage.py options, extra attributes, torch threads or None)
CONTENDERS: dict[str, tuple[list[str], dict[str, Any], int | None]] = {
    "sync": (["--loader", "dgl"], {}, None),
    "dgl w1": (["--loader", "dgl", "--num-workers", "1"], {}, None),
    "dgl prefetch w1": (["--loader", "dgl", "--num-workers", "1"], {"dgl_prefetch": True},
                        None),
    "pp b2 g2": (["--num-buffers", "2"], {"gather_threads": 2}, None),
    "pp b3 g2": (["--num-buffers", "3"], {"gather_threads": 2}, None),
    "pp b2 g1": (["--num-buffers", "2"], {"gather_threads": 1}, None),
    "pp b2 g1 t1": (["--num-buffers", "2"], {"gather_threads": 1}, 1),
}


def make_args(name: str, bench: argparse.Namespace, feat_dim: int) -> argparse.Namespace:
    opts, extra, _ = CONTENDERS[name]
    args = ts.build_parser().parse_args(
        ["--num-nodes", str(bench.num_nodes), "--feat-dim", str(feat_dim), "--epochs",
         str(bench.epochs), "--log-every", "1000000", *opts])
    args.gather_threads = None
    args.dgl_prefetch = False
    for key, value in extra.items():
        setattr(args, key, value)
    return args


@contextlib.contextmanager
def torch_threads(n: int | None) -> Any:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- runs
def train_run(name: str, bench: argparse.Namespace, data: ts.Dataset,
              sink: list[dict[str, Any]]) -> Callable[[], None]:
    def run() -> None:
        args = make_args(name, bench, data.features.shape[1])
        other = _common.OtherLoad()
        other.start()
        with torch_threads(CONTENDERS[name][2]), contextlib.redirect_stdout(io.StringIO()):
            result = ts.train(args, data, torch.device("cpu"))
        stats = result["stats"]
        sink.append({
            "epoch_times": result["epoch_times"],
            "test_acc": result["test_acc"],
            "val_acc": result["val_acc"],
            "stall_s_per_epoch": stats.get("consumer_stall_s", 0.0) / bench.epochs,
            "producer_busy_s_per_epoch": stats.get("producer_busy_s", 0.0) / bench.epochs,
            "gather_s_per_epoch": stats.get("gather_s", 0.0) / bench.epochs,
            "sample_s_per_epoch": stats.get("sample_s", 0.0) / bench.epochs,
            "other_processes_cores": other.stop(),
        })
    return run


def load_run(name: str, bench: argparse.Namespace, data: ts.Dataset,
             sink: list[float]) -> Callable[[], None]:
    """Iterate the loader (``--epochs`` passes, first untimed), touching each batch."""

    def run() -> None:
        args = make_args(name, bench, data.features.shape[1])
        torch.manual_seed(args.seed)
        import dgl

        dgl.seed(args.seed)
        loader = make_loader(make_source(data, args, data.train_idx, args.batch_size, True),
                             data, args, torch.device("cpu"))
        try:
            for epoch in range(bench.epochs):
                t0 = time.perf_counter()
                for batch in loader:
                    batch.x[0, 0].item()
                if epoch > 0:
                    sink.append(time.perf_counter() - t0)
        finally:
            loader.close()
    return run


def gather_batches(bench: argparse.Namespace, data: ts.Dataset) -> list[Any]:
    args = make_args("sync", bench, data.features.shape[1])
    torch.manual_seed(args.seed)
    source = make_source(data, args, data.train_idx, args.batch_size, True)
    return list(ts.SyncLoader(source, data.features, data.labels, torch.device("cpu")))


def compute_run(threads: int | None, bench: argparse.Namespace, data: ts.Dataset,
                batches: list[Any], sink: list[float]) -> Callable[[], None]:
    """Train on batches held in memory: the same steps as ``train_sage.train``."""

    def run() -> None:
        args = make_args("sync", bench, data.features.shape[1])
        torch.manual_seed(args.seed)
        model = ts.SAGE(data.features.shape[1], args.hidden, data.num_classes,
                        len(args.fanouts), args.dropout)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        with torch_threads(threads):
            for epoch in range(bench.epochs):
                t0 = time.perf_counter()
                for batch in batches:
                    loss = F.cross_entropy(model(batch.blocks, batch.x).float(), batch.y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    float(loss.detach())
                if epoch > 0:
                    sink.append(time.perf_counter() - t0)
    return run


def run_width(bench: argparse.Namespace, feat_dim: int, names: list[str]) -> dict[str, Any]:
    ns = argparse.Namespace(**{**vars(make_args("sync", bench, feat_dim))})
    data = ts.load_dataset(ns)
    data.features = data.features.contiguous()
    batches = gather_batches(bench, data)
    train_s: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load_s: dict[str, list[float]] = {}
    compute_s: dict[str, list[float]] = {}
    contenders: dict[str, Callable[[], None]] = {}
    for n in names:
        contenders[f"train: {n}"] = train_run(n, bench, data, train_s[n])
        key = load_key(n)
        if key not in load_s:
            load_s[key] = []
            contenders[f"load: {key}"] = load_run(n, bench, data, load_s[key])
        ckey = compute_key(n)
        if ckey not in compute_s:
            compute_s[ckey] = []
            contenders[f"compute: {ckey}"] = compute_run(
                CONTENDERS[n][2], bench, data, batches, compute_s[ckey])
    if bench.wait_quiet:
        _common.wait_for_quiet(bench.wait_quiet)
    other = _common.OtherLoad()
    other.start()
    la0 = _common.load_average()
    wall = _common.alternate(contenders, rounds=bench.rounds, warmup=0)
    num_batches = len(batches)
    del batches
    return {
        "feat_dim": feat_dim,
        "training": {"train_nodes": len(data.train_idx), "batch_size": ns.batch_size,
                     "fanouts": list(ns.fanouts), "hidden": ns.hidden},
        "num_batches": num_batches,
        "train": train_s,
        "load_alone_s": load_s,
        "compute_alone_s": compute_s,
        "wall_s": wall,
        "load_average_before": la0,
        "load_average_after": _common.load_average(),
        "other_processes_cores": other.stop(),
    }


def load_key(name: str) -> str:
    return name.removesuffix(" t1")


def compute_key(name: str) -> str:
    threads = CONTENDERS[name][2]
    return f"torch threads {threads}" if threads else "torch threads default"


# --------------------------------------------------------------------------- report
def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for width in report["widths"]:
        for name, runs in width["train"].items():
            epochs = [t for r in runs for t in r["epoch_times"][1:]]
            load = statistics.median(width["load_alone_s"][load_key(name)])
            compute = statistics.median(width["compute_alone_s"][compute_key(name)])
            epoch = statistics.median(epochs)
            rows.append({
                "feat_dim": width["feat_dim"], "name": name, "epoch_s": epoch,
                "epoch_min_s": min(epochs), "epoch_max_s": max(epochs),
                "load_s": load, "compute_s": compute, "bound_s": max(load, compute),
                "efficiency": max(load, compute) / epoch,
                "stall_s": statistics.median(r["stall_s_per_epoch"] for r in runs),
                "producer_busy_s": statistics.median(r["producer_busy_s_per_epoch"]
                                                     for r in runs),
                "test_acc": statistics.median(r["test_acc"] for r in runs),
                "other": max((r["other_processes_cores"] or 0.0) for r in runs),
            })
    for width_dim in {r["feat_dim"] for r in rows}:
        group = [r for r in rows if r["feat_dim"] == width_dim]
        dgl = [r for r in group if r["name"] in DGL_NAMES]
        best = min(dgl, key=lambda r: r["epoch_s"]) if dgl else None
        for r in group:
            r["best_dgl"] = best["name"] if best else None
            r["vs_best_dgl"] = best["epoch_s"] / r["epoch_s"] if best else None
    return rows


def efficiency_verdict(efficiency: float) -> str:
    """The overlap goal's verdict; an efficiency above 1 (faster than the bound, which
    separate runs measured) says the bound is off, not that the goal is met."""
    if efficiency > 1.0:
        return "not judged (above 1: the bound, from separate runs, is too rough here)"
    return "met" if efficiency >= GOAL_EFFICIENCY else "NOT met"


def describe_training(report: dict[str, Any]) -> str:
    """What each epoch trains on, as the run recorded it (older runs recorded only
    their batch count)."""
    width = report["widths"][0]
    training = width.get("training")
    if training is None:
        return (f"{width['num_batches']} batches per epoch (batch size, fanouts and "
                "hidden width not recorded by this run)")
    fanouts = ",".join(map(str, training["fanouts"]))
    return (f"{training['train_nodes']} train nodes, batch {training['batch_size']} "
            f"({width['num_batches']} batches per epoch), fanouts {fanouts}, "
            f"hidden {training['hidden']}")


def render_markdown(report: dict[str, Any]) -> str:
    rows = summarize(report)
    m = report["machine"]
    lines = [
        "# GraphSAGE epoch time (CPU)", "", "```", report["command"], "```", "",
        _common.describe_machine(m), "",
        f"torch.get_num_threads() at start: {report['torch_threads']}; "
        f"graph: synthetic, {report['num_nodes']} nodes, avg degree 15, 16 classes, "
        f"{describe_training(report)}; "
        f"{report['epochs']} epochs per run (first = warm-up), {report['rounds']} round(s), "
        f"runs alternated in random order; {report['elapsed_s']:.0f} s in all.", "",
        "`epoch s`: median timed training epoch (evaluation excluded). `load`: iterating "
        "the loader alone for an epoch; `compute`: training an epoch on batches gathered "
        "beforehand; `bound` = max(load, compute); `eff` = bound / epoch. `stall`: "
        "pingpong's consumer stall per epoch (loader.stats, averaged over all epochs "
        "incl. warm-up). `x best DGL`: best of sync / dgl w1 / dgl prefetch w1 "
        "divided by this row. `other`: cores' worth of CPU other processes used "
        "during the run (1.00 = one of the 2 cores). `eff` above 1 means the run beat a "
        "bound measured in a separate run under different background load: read "
        "`load`/`compute` and `eff` as rough. For `dgl w1` / `dgl prefetch w1` the DGL "
        "worker process's own CPU is counted in `other`.", "",
    ]
    for dim in sorted({r["feat_dim"] for r in rows}):
        group = [r for r in rows if r["feat_dim"] == dim]
        lines += [f"## {dim} features (float32)", "", _common.markdown_table(
            ["loader", "epoch s", "min", "max", "load", "compute", "bound", "eff", "stall",
             "x best DGL", "test acc", "other"],
            [[r["name"], r["epoch_s"], r["epoch_min_s"], r["epoch_max_s"], r["load_s"],
              r["compute_s"], r["bound_s"], r["efficiency"], r["stall_s"],
              r["vs_best_dgl"] if r["vs_best_dgl"] is not None else "-",
              f"{r['test_acc']:.4f}", f"{r['other']:.2f}"] for r in group]), ""]
    pp = [r for r in rows if r["name"].startswith("pp")]
    if pp:
        lines += ["## Goals", ""]
        for dim in sorted({r["feat_dim"] for r in pp}):
            best = max((r for r in pp if r["feat_dim"] == dim), key=lambda r: r["vs_best_dgl"]
                       or 0)
            if best["vs_best_dgl"] is None:
                continue
            lines.append(
                f"- {dim} features: best pingpong ({best['name']}) is "
                f"{best['vs_best_dgl']:.2f}x the best DGL ({best['best_dgl']}); goal "
                f">= {GOAL_SPEEDUP}x: {'met' if best['vs_best_dgl'] >= GOAL_SPEEDUP else 'NOT met'}"
                f". Overlap efficiency {best['efficiency']:.2f}; goal >= {GOAL_EFFICIENCY}: "
                f"{efficiency_verdict(best['efficiency'])}.")
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    rows = summarize(report)
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {
        "epoch time (s)": {}, "overlap efficiency (bound / epoch)": {}}
    for r in rows:
        panels["epoch time (s)"].setdefault(r["name"], []).append((r["feat_dim"], r["epoch_s"]))
        panels["overlap efficiency (bound / epoch)"].setdefault(r["name"], []).append(
            (r["feat_dim"], r["efficiency"]))
    return _common.plot_lines(path, panels, "feature width", "",
                              "GraphSAGE epoch on the CPU: median seconds and efficiency")


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    if bench.from_json is not None:
        report = json.loads(bench.from_json.read_text())
    else:
        names = bench.contenders or list(CONTENDERS)
        unknown = [n for n in names if n not in CONTENDERS]
        if unknown:
            print(f"epoch.py: unknown contenders {unknown}; known: {list(CONTENDERS)}",
                  file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        report = {
            "command": _common.command_line(), "machine": _common.machine_info(),
            "torch_threads": torch.get_num_threads(), "num_nodes": bench.num_nodes,
            "epochs": bench.epochs, "rounds": bench.rounds, "widths": [],
        }
        for dim in bench.feat_dims:
            report["widths"].append(run_width(bench, dim, names))
            print(f"# {dim} features done at {time.perf_counter() - t0:.0f} s", flush=True)
        report["elapsed_s"] = time.perf_counter() - t0
        report["summary"] = summarize(report)
    markdown = render_markdown(report)
    _common.write_results(bench.out, bench.name, report, markdown, render_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
