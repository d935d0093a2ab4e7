"""How pingpong's epoch time and memory scale with graph size, feature width and batch size.

Three sweeps around a base configuration (100k nodes, 128 float32 features,
batch 1024; synthetic graph, avg degree 15, fanouts 15,10,5, GraphSAGE
hidden 128, ``PingPongLoader(num_buffers=2)`` over DGL's ``NeighborSampler``):

- nodes:        ``--nodes``      (default 100k, 1M, 2M)
- feature width ``--feat-dims``  (default 64 .. 512)
- batch size    ``--batch-sizes`` (default 256 .. 4096)

To keep the epoch comparable across graph sizes, every epoch trains on the
same number of seed nodes (``--seeds``, a fixed random subset of the training
nodes), so "epoch" here means ``seeds / batch`` steps, not the whole graph.

Each configuration runs in a fresh subprocess (so its peak RSS is its own) for
``--epochs`` epochs; per epoch it records the time, ``loader.stats``
(``slot_bytes``, ``slot_grows``, consumer stall) and the process RSS.  Peak
RSS is sampled with psutil every 20 ms (and cross-checked with
``ru_maxrss``).  Slot memory must stay constant after epoch 1: the check
``slot_grows unchanged after epoch 1`` is reported per configuration.

    python benchmarks/scaling.py --quick                         # < 60 s smoke run
    python benchmarks/scaling.py --out docs/benchmarks --name scaling-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import _common
import psutil
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_sage as ts

import pingpong

BASE = {"num_nodes": 100_000, "feat_dim": 128, "batch_size": 1024}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="< 60 s smoke run")
    p.add_argument("--nodes", type=int, nargs="+", default=[100_000, 1_000_000, 2_000_000])
    p.add_argument("--feat-dims", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--seeds", type=int, default=16_384, help="seed nodes per epoch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", type=_common.out_dir, default=None)
    p.add_argument("--name", default="scaling-cpu")
    p.add_argument("--from-json", type=_common.json_file, default=None, help="re-render only")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one config
    args = p.parse_args(argv)
    _common.rerender_target(p, args)
    if args.epochs < 2:
        p.error("--epochs must be >= 2: the first is a warm-up, and the slot check "
                "compares later epochs with it")
    _common.refuse_sizes_with_quick(
        p, args, ("nodes", "feat_dims", "batch_sizes", "seeds", "epochs"))
    if args.quick:
        args.nodes, args.feat_dims, args.batch_sizes = [20_000, 50_000], [64, 256], [512, 2048]
        args.seeds, args.epochs = 2048, 2
        BASE.update(num_nodes=20_000, feat_dim=64, batch_size=512)
    return args


class PeakRSS:
    """Samples this process's RSS with psutil in a background thread."""

    def __init__(self, interval: float = 0.02) -> None:
        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# --------------------------------------------------------------------------- child
def run_one(config: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    rss = PeakRSS()
    args = ts.build_parser().parse_args(
        ["--num-nodes", str(config["num_nodes"]), "--feat-dim", str(config["feat_dim"]),
         "--batch-size", str(config["batch_size"])])
    t0 = time.perf_counter()
    data = ts.load_dataset(args)
    data.features = data.features.contiguous()
    setup_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    seeds = data.train_idx[torch.randperm(len(data.train_idx), generator=gen)]
    seeds = seeds[: config["seeds"]].sort().values
    rss_data = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    model = ts.SAGE(config["feat_dim"], args.hidden, data.num_classes, len(args.fanouts),
                    args.dropout)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    source = ts.make_source(data, args, seeds, args.batch_size, shuffle=True)
    loader = pingpong.PingPongLoader(source, data.features, data.labels, device="cpu",
                                     num_buffers=2)
    epochs = []
    try:
        for _ in range(config["epochs"]):
            t = time.perf_counter()
            for batch in loader:
                loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            wall = time.perf_counter() - t
            s = loader.stats
            epochs.append({
                "epoch_s": wall, "slot_bytes": int(s["slot_bytes"]),
                "slot_grows": int(s["slot_grows"]), "batches": int(s["batches"]),
                "consumer_stall_s": float(s["consumer_stall_s"]),
                "bytes_gathered": int(s["bytes_gathered"]),
                "rss_bytes": psutil.Process().memory_info().rss,
            })
    finally:
        loader.close()
    return {
        **config, "setup_s": setup_s, "epochs_detail": epochs,
        "table_bytes": data.features.numel() * data.features.element_size(),
        "rss_after_data_bytes": rss_data, "peak_rss_bytes": rss.stop(),
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


# --------------------------------------------------------------------------- parent
def configs(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    sweeps = [("nodes", "num_nodes", args.nodes), ("feat_dim", "feat_dim", args.feat_dims),
              ("batch_size", "batch_size", args.batch_sizes)]
    for sweep, key, values in sweeps:
        for v in values:
            out.append({**BASE, key: v, "sweep": sweep, "seeds": args.seeds,
                        "epochs": args.epochs})
    return out


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = []
    for config in configs(args):
        other = _common.OtherLoad()
        other.start()
        la = _common.load_average()
        before, wall0 = os.times(), time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(config)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            result = {**config, "error": proc.stderr.strip().splitlines()[-1:]}
        else:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        # OtherLoad counts only this process's CPU as its own: take the child's off too.
        after, wall = os.times(), time.perf_counter() - wall0
        child = (after.children_user + after.children_system
                 - before.children_user - before.children_system)
        raw = other.stop()
        result["child_cpu_s"], result["wall_s"] = child, wall
        result["other_processes_cores"] = None if raw is None else max(0.0, raw - child / wall)
        result["load_average_before"] = la
        results.append(result)
        print(f"# {config['sweep']} {config} done at {time.perf_counter() - t0:.0f} s",
              flush=True)
    return {"command": _common.command_line(), "machine": _common.machine_info(),
            "torch_threads": torch.get_num_threads(), "base": BASE, "seeds": args.seeds,
            "epochs": args.epochs, "results": results,
            "elapsed_s": time.perf_counter() - t0}


def row(r: dict[str, Any]) -> list[Any]:
    ep = r["epochs_detail"]
    timed = [e["epoch_s"] for e in ep[1:]]
    grows_after_1 = ep[-1]["slot_grows"] - ep[0]["slot_grows"]
    constant = all(e["slot_bytes"] == ep[0]["slot_bytes"] for e in ep)
    if len(ep) < 2:
        slots_verdict = "not checked (1 epoch)"
    else:
        slots_verdict = "yes" if grows_after_1 == 0 and constant else f"NO (+{grows_after_1})"
    return [r["num_nodes"], r["feat_dim"], r["batch_size"],
            statistics.median(timed) if timed else float("nan"),
            ep[-1]["batches"] // len(ep), ep[-1]["consumer_stall_s"] / len(ep),
            r["table_bytes"] / 2**20, ep[0]["slot_bytes"] / 2**20,
            r["peak_rss_bytes"] / 2**20, ep[0]["slot_grows"],
            slots_verdict,
            f"{r['other_processes_cores']:.2f}" if r["other_processes_cores"] is not None
            else "?"]


def render_markdown(report: dict[str, Any]) -> str:
    headers = ["nodes", "feat", "batch", "epoch s", "steps", "stall s", "table MiB",
               "slots MiB", "peak RSS MiB", "grows ep1", "slots constant after ep1", "other"]
    lines = [
        "# pingpong scaling (CPU)", "", "```", report["command"], "```", "",
        _common.describe_machine(report["machine"]), "",
        f"torch threads {report['torch_threads']}; base: {report['base']}; every epoch "
        f"trains on the same {report['seeds']} seed nodes (`steps` = seeds / batch), so "
        "epoch time reflects the per-step cost, not the graph's training-set size; "
        f"{report['epochs']} epochs per configuration, the first a warm-up (`epoch s` is "
        "the median of the rest); each configuration in a fresh process. `stall s`: "
        "consumer stall per epoch; `slots MiB`: `loader.stats['slot_bytes']` after "
        "epoch 1 (both slots, features + labels); `grows ep1`: `slot_grows` after "
        "epoch 1; `slots constant after ep1`: `slot_grows` and `slot_bytes` unchanged "
        "in later epochs. `other`: cores' worth of CPU used by other processes "
        f"meanwhile. {report['elapsed_s']:.0f} s in all.", "",
    ]
    for sweep in ("nodes", "feat_dim", "batch_size"):
        rs = [r for r in report["results"] if r["sweep"] == sweep]
        ok = [r for r in rs if "error" not in r]
        lines += [f"## Sweep: {sweep}", "", _common.markdown_table(headers, [row(r) for r in ok])]
        lines += [f"- failed: {r['num_nodes']}/{r['feat_dim']}/{r['batch_size']}: {r['error']}"
                  for r in rs if "error" in r]
        lines.append("")
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    key = {"nodes": "num_nodes", "feat_dim": "feat_dim", "batch_size": "batch_size"}
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for sweep, k in key.items():
        rs = [r for r in report["results"] if r["sweep"] == sweep and "error" not in r]
        x = [r[k] / (1000 if sweep == "nodes" else 1) for r in rs]
        rows = [row(r) for r in rs]
        panels[f"epoch s vs {sweep}" + (" (thousands)" if sweep == "nodes" else "")] = {
            "epoch s": list(zip(x, [rw[3] for rw in rows], strict=True))}
        panels[f"memory MiB vs {sweep}"] = {
            "slots": list(zip(x, [rw[7] for rw in rows], strict=True)),
            "peak RSS": list(zip(x, [rw[8] for rw in rows], strict=True)),
            "table": list(zip(x, [rw[6] for rw in rows], strict=True))}
    return _common.plot_lines(path, panels, "", "",
                              "pingpong on the CPU: epoch time and memory vs scale")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    report = run_all(args) if args.from_json is None else json.loads(args.from_json.read_text())
    markdown = render_markdown(report)
    _common.write_results(args.out, args.name, report, markdown, render_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
