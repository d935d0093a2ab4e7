"""First-epoch time: pingpong against the plain loop, each run in a fresh process.

A process's first epoch pays one-time costs the later ones do not: for
pingpong, loading Numba (its target registries, the threading layer) and
compiling or loading each kernel specialisation; for both, torch's and
DGL's own first-use costs. This benchmark measures exactly that: every run
is a new Python process that builds the default synthetic graph and trains
GraphSAGE through ``examples/train_sage.py``'s ``train()`` (``--epochs``
epochs; the first is the one measured, the second, if any, is shown for
reference), so nothing compiled or imported by an earlier run helps it --
except Numba's on-disk cache, which is controlled per run:

- ``cold``  ``NUMBA_CACHE_DIR`` is a new empty folder: every kernel compiles
            (a first run after installing or upgrading pingpong);
- ``warm``  ``NUMBA_CACHE_DIR`` is a folder an untimed run filled first: the
            kernels load from disk (every later run).

Contenders: ``plain`` (``--loader dgl``: sample, ``index_select`` and train on
the training thread; it runs no Numba code, so it runs once per round, with
the warm folder); ``pingpong`` (``--loader pingpong``: the kernels warm up on
a background thread from the loader's construction; the producer gathers with
``torch.index_select`` until they are ready); ``pingpong no-warmup`` (the same
with the warm-up switched off in the child, as before it existed: the
producer compiles on its first batch).

Runs alternate in a fresh random order each round; medians over rounds are
reported, with the ratio of each median first epoch to the plain loop's.
CPU used by other processes during each run is recorded (cores' worth).

    python benchmarks/first_epoch.py --quick                   # < 2 min smoke run
    python benchmarks/first_epoch.py --out docs/benchmarks --name first-epoch-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
GOAL_RATIO = 1.1
#: Other processes' CPU (cores' worth, the most in one run) above which the goal is
#: not judged: the runs then measure contention as much as one-time costs.
JUDGE_MAX_OTHER_CORES = 0.25

#: name -> train_sage.py options
CONTENDERS: dict[str, list[str]] = {
    "plain": ["--loader", "dgl"],
    "pingpong": ["--loader", "pingpong"],
    "pingpong no-warmup": ["--loader", "pingpong"],
}
CACHES = ("cold", "warm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small graph, 1 round (< 2 min)")
    p.add_argument("--num-nodes", type=int, default=100_000)
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--sampler", choices=("dgl", "builtin"), default=None,
                   help="default: train_sage.py's (dgl when installed)")
    p.add_argument("--epochs", type=int, default=2, help="per run; the first is measured")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to SECONDS for other processes to go quiet")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch (OpenMP) threads in every run (default: torch's own choice); "
                   "1 makes the runs far less sensitive to other load on a shared machine")
    p.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    p.add_argument("--seed", type=int, default=0, help="shuffles the run order")
    p.add_argument("--out", type=_common.out_dir, default=None)
    p.add_argument("--name", default="first-epoch-cpu")
    p.add_argument("--from-json", type=_common.json_file, default=None, help="re-render only")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _common.rerender_target(p, args)
    _common.refuse_sizes_with_quick(p, args, ("num_nodes", "rounds", "epochs"))
    if args.quick:
        args.num_nodes, args.rounds, args.epochs = 20_000, 1, 1
    if args.epochs < 1 or args.rounds < 1:
        p.error("--epochs and --rounds must be >= 1")
    return args


# --------------------------------------------------------------------------- child
def child(args: argparse.Namespace) -> int:
    """One run: build the graph, train, write what was measured to ``--child-json``."""
    t_start = time.perf_counter()
    sys.path.insert(0, str(HERE.parent / "examples"))
    import torch
    import train_sage as ts

    import pingpong

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    t_imported = time.perf_counter()
    loaders: list[Any] = []
    if args.child == "pingpong no-warmup":
        from pingpong.devices.cpu import CPUDevice

        CPUDevice.attach = lambda self, store: None  # type: ignore[method-assign]
    original = ts.make_loader

    def make_loader(*a: Any, **k: Any) -> Any:
        loader = original(*a, **k)
        loaders.append(loader)
        return loader

    ts.make_loader = make_loader
    flags = ["--num-nodes", str(args.num_nodes), "--feat-dim", str(args.feat_dim),
             "--epochs", str(args.epochs), "--log-every", "1000000", "--progress", "off",
             *CONTENDERS[args.child]]
    if args.sampler:
        flags += ["--sampler", args.sampler]
    targs = ts.build_parser().parse_args(flags)
    data = ts.load_dataset(targs)
    data.features = data.features.contiguous()
    t_data = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        result = ts.train(targs, data, torch.device("cpu"))
    t_end = time.perf_counter()
    warm_ups = []
    for loader in loaders:
        device = getattr(loader, "_device", None)
        warm_up = getattr(device, "warm_up", None)
        if warm_up is not None:
            warm_ups.append({"seconds": warm_up.seconds,
                             "error": None if warm_up.error is None else repr(warm_up.error)})
    args.child_json.write_text(json.dumps({
        "epoch_times": result["epoch_times"],
        "test_acc": result["test_acc"],
        "import_s": t_imported - t_start,
        "dataset_s": t_data - t_imported,
        "train_and_eval_s": t_end - t_data,
        "consumer_stall_s": result["stats"].get("consumer_stall_s"),
        "warm_ups": warm_ups,
        "pingpong": pingpong.__version__,
        "torch_threads": torch.get_num_threads(),
    }))
    return 0


# --------------------------------------------------------------------------- parent
def _busy_seconds() -> float | None:
    return _common._system_busy_seconds()


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(name: str, cache_dir: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"run-{time.monotonic_ns()}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name,
               "--child-json", str(out), "--num-nodes", str(args.num_nodes),
               "--feat-dim", str(args.feat_dim), "--epochs", str(args.epochs)]
    if args.sampler:
        command += ["--sampler", args.sampler]
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    if args.torch_threads:
        command += ["--torch-threads", str(args.torch_threads)]
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    busy0, own0, wall0 = _busy_seconds(), _children_cpu() + _own_cpu(), time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    wall = time.perf_counter() - wall0
    busy1, own1 = _busy_seconds(), _children_cpu() + _own_cpu()
    other = None
    if busy0 is not None and busy1 is not None and wall > 0:
        other = max(0.0, (busy1 - busy0 - (own1 - own0)) / wall)
    if proc.returncode != 0:
        raise SystemExit(
            f"run {name!r} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    record = json.loads(out.read_text())
    record.update(process_wall_s=wall, other_processes_cores=other)
    return record


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(args: argparse.Namespace) -> dict[str, Any]:
    plan: list[tuple[str, str]] = []
    for name in args.contenders:
        if name == "plain":
            plan.append((name, "n/a"))
        else:
            plan += [(name, cache) for cache in args.caches]
    runs: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="first_epoch_") as tmp_name:
        tmp = Path(tmp_name)
        warm_dir = tmp / "numba-cache-warm"
        warm_dir.mkdir()
        if any(cache == "warm" for _, cache in plan):
            print("# priming the warm cache (untimed run)", flush=True)
            run_child("pingpong", str(warm_dir), args, tmp)
        for round_index in range(args.rounds):
            order = plan[:]
            rng.shuffle(order)
            for name, cache in order:
                waited = 0.0
                if args.wait_quiet:
                    waited, _ = _common.wait_for_quiet(args.wait_quiet)
                if cache == "cold":
                    cache_dir = tempfile.mkdtemp(prefix="numba-cache-cold-", dir=tmp)
                else:
                    cache_dir = str(warm_dir)
                record = run_child(name, cache_dir, args, tmp)
                record.update(contender=name, cache=cache, round=round_index,
                              waited_for_quiet_s=waited, load_1min=_load1())
                runs.append(record)
                print(f"round {round_index} {name:>18} {cache:>4}: first epoch "
                      f"{record['epoch_times'][0]:.2f} s, epochs "
                      f"{[round(t, 2) for t in record['epoch_times']]}, other "
                      f"{_fmt(record['other_processes_cores'])} cores", flush=True)
    return {
        "benchmark": "first_epoch",
        "command": _common.command_line(),
        "machine": _common.machine_info(),
        "settings": {"num_nodes": args.num_nodes, "feat_dim": args.feat_dim,
                     "sampler": args.sampler or "train_sage.py default", "epochs": args.epochs,
                     "rounds": args.rounds, "contenders": args.contenders, "caches": args.caches,
                     "torch_threads": args.torch_threads,
                     "wait_quiet_s": args.wait_quiet, "seed": args.seed},
        "runs": runs,
        "elapsed_s": time.perf_counter() - t0,
    }


def _load1() -> float | None:
    load = _common.load_average()
    return None if load is None else load[0]


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


# --------------------------------------------------------------------------- report
def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in report["runs"]:
        groups.setdefault((run["contender"], run["cache"]), []).append(run)
    plain = [r["epoch_times"][0] for r in groups.get(("plain", "n/a"), [])]
    plain_median = statistics.median(plain) if plain else None
    rows = []
    for (name, cache), runs in groups.items():
        first = [r["epoch_times"][0] for r in runs]
        later = [t for r in runs for t in r["epoch_times"][1:]]
        median = statistics.median(first)
        rows.append({
            "contender": name, "cache": cache, "runs": len(runs),
            "first_epoch_s": median, "first_min_s": min(first), "first_max_s": max(first),
            "later_epoch_s": statistics.median(later) if later else None,
            "vs_plain_first": median / plain_median if plain_median else None,
            "import_s": statistics.median(r["import_s"] for r in runs),
            "stall_s": _median_or_none(r.get("consumer_stall_s") for r in runs),
            "warm_up_s": _median_or_none(w["seconds"] for r in runs for w in r["warm_ups"][:1]),
            "warm_up_errors": sorted({w["error"] for r in runs for w in r["warm_ups"]
                                      if w["error"]}),
            "test_acc": statistics.median(r["test_acc"] for r in runs),
            "other_max": None if any(r["other_processes_cores"] is None for r in runs)
            else max(r["other_processes_cores"] for r in runs),
        })
    order = {name: i for i, name in enumerate(CONTENDERS)}
    rows.sort(key=lambda r: (order.get(r["contender"], 99), r["cache"]))
    return rows


def _median_or_none(values: Any) -> float | None:
    items = [v for v in values if v is not None]
    return statistics.median(items) if items else None


def render_markdown(report: dict[str, Any]) -> str:
    rows = summarize(report)
    s = report["settings"]
    lines = [
        "# First epoch in a fresh process (CPU)", "", "Command (from the repository root):", "",
        "```", report["command"], "```", "",
        "Machine: " + _common.describe_machine(report["machine"]), "",
        f"GraphSAGE through `examples/train_sage.py`'s `train()` on the synthetic graph "
        f"({s['num_nodes']} nodes, {s['feat_dim']} float32 features; sampler: {s['sampler']}; "
        f"fanouts 15,10,5, batch 1024; torch threads: "
        f"{s.get('torch_threads') or 'torch default'}), {s['epochs']} epoch(s) per run, "
        "every run a new "
        f"process; {s['rounds']} round(s), runs in a fresh random order each round; "
        f"{report['elapsed_s']:.0f} s in all. `cold`: an empty Numba cache folder "
        "(`NUMBA_CACHE_DIR`); `warm`: one an untimed run filled. Medians over the rounds; "
        "`x plain` is the median first epoch divided by the plain loop's; `later` is the "
        "median of the epochs after the first; `stall` is how long the training loop waited "
        "for batches in the run (pingpong's `consumer_stall_s`; the one-time costs that are "
        "not hidden show up here); `warm-up` is the background warm-up's duration (train "
        "loader); `other` the most CPU (cores' worth) other processes used during one run.",
        "",
        _common.markdown_table(
            ["loader", "Numba cache", "runs", "first epoch s", "min", "max", "x plain",
             "later s", "stall s", "warm-up s", "test acc", "other"],
            [[r["contender"], r["cache"], r["runs"], r["first_epoch_s"], r["first_min_s"],
              r["first_max_s"], "-" if r["vs_plain_first"] is None else r["vs_plain_first"],
              "-" if r["later_epoch_s"] is None else r["later_epoch_s"],
              "-" if r.get("stall_s") is None else r["stall_s"],
              "-" if r["warm_up_s"] is None else r["warm_up_s"], f"{r['test_acc']:.4f}",
              "?" if r["other_max"] is None else f"{r['other_max']:.2f}"] for r in rows]), "",
    ]
    goal = [r for r in rows if r["contender"] == "pingpong" and r["vs_plain_first"] is not None]
    if goal:
        lines += ["## Goal", ""]
        loads = [r["other_max"] for r in rows]
        other = None if None in loads else max(loads)
        for r in goal:
            if other is None:
                met = "not judged (other processes' CPU was not measured in every run)"
            elif other > JUDGE_MAX_OTHER_CORES:
                met = (f"not judged (other processes used up to {other:.2f} cores during a "
                       f"run; judged only up to {JUDGE_MAX_OTHER_CORES})")
            else:
                met = "met" if r["vs_plain_first"] <= GOAL_RATIO else "NOT met"
            lines.append(f"- {r['cache']} Numba cache: pingpong's first epoch is "
                         f"{r['vs_plain_first']:.2f}x the plain loop's (goal <= {GOAL_RATIO}x): "
                         f"{met}.")
    errors = sorted({e for r in rows for e in r["warm_up_errors"]})
    if errors:
        lines += ["", "Warm-up errors: " + "; ".join(errors)]
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> None:
    return None  # a table says it all


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        report["summary"] = summarize(report)
    else:
        report = measure(args)
        report["summary"] = summarize(report)
    _common.write_results(args.out, args.name, report, render_markdown(report), render_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
