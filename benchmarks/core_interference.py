"""How much does a busy second core slow a single-threaded workload on this machine?

The overlap bound of ``dist_epoch.py`` (an epoch can at best take max(fetch,
compute), each timed alone) assumes the two sides do not slow each other down
when they run at once on different cores. This measures that assumption
directly. A *workload* runs on core A in this process (one torch thread, one
Numba thread) while a *neighbour* process runs on core B:

workloads (CPU seconds per call, ``time.thread_time``):
  ``train``   GraphSAGE training steps on cached DGL batches (the DistDGL
              benchmark's shapes: fanouts 5,5, batch 200, 128 features,
              hidden 256 by default) -- the training thread's work;
  ``gather``  pingpong's Numba CPU gather of a batch's feature rows, random
              ids into a preallocated (8000, 128) buffer -- the copying a
              producer does.

neighbours, each started once and kept stopped (SIGSTOP) except while it is
measured against, so one runs at a time:
  ``none``    nothing on core B;
  ``spin``    a pure Python loop (the core busy, almost no memory traffic);
  ``copy``    NumPy copies of 64 MiB arrays (memory bandwidth);
  ``train``, ``gather``  the workloads above, in a loop.

Every round measures each (workload, neighbour) pair once, in a shuffled
order; the report gives medians, their ratio to ``none``'s, and the median
over rounds of each pair's ratio to the same round's ``none``. A neighbour
that has died stops the run. Linux only (``sched_setaffinity``).

    python benchmarks/core_interference.py --out docs/benchmarks --name core-interference-cpu
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import numpy as np
import torch

WORKLOADS = ("train", "gather")
NEIGHBOURS = ("none", "spin", "copy", "train", "gather")
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--rounds", type=_common.positive_int, default=7)
    p.add_argument("--hidden", type=_common.positive_int, default=256)
    p.add_argument("--cores", type=core_pair, default=(0, 1), metavar="A,B",
                   help="core A,core B: two different cores this process may run on "
                        "(default 0,1)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="first wait up to this many seconds for other processes to go quiet")
    p.add_argument("--out", type=_common.out_dir, default=None)
    p.add_argument("--name", default="core-interference")
    p.add_argument("--neighbour", choices=NEIGHBOURS[1:], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 2
    args.core_a, args.core_b = args.cores
    return args


def core_pair(text: str) -> tuple[int, int]:
    """An ``argparse`` type: ``A,B``, two different cores in this process's affinity
    mask (where the platform has one)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected two core numbers as A,B, got {text!r}")
    a, b = (int(p) for p in parts)
    if a == b:
        raise argparse.ArgumentTypeError(f"cores A and B must differ, got {text!r}")
    if hasattr(os, "sched_getaffinity"):
        allowed = os.sched_getaffinity(0)
        missing = [c for c in (a, b) if c not in allowed]
        if missing:
            raise argparse.ArgumentTypeError(
                f"core {missing[0]} is not one this process may run on "
                f"(allowed: {','.join(map(str, sorted(allowed)))})")
    return a, b


# --------------------------------------------------------------------------- workloads
def make_train(hidden: int, seed: int = 0) -> Callable[[], None]:
    """A pass of GraphSAGE training steps over 30 cached DGL batches."""
    import dgl
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE.parent / "examples"))
    from sage_model import SAGE

    from pingpong.sources import make_synthetic_graph

    graph = make_synthetic_graph(num_nodes=40_000, seed=seed)
    g = graph.to_dgl()
    loader = dgl.dataloading.DataLoader(g, graph.train_idx, dgl.dataloading.NeighborSampler([5, 5]),
                                        batch_size=200, shuffle=True)
    batches = []
    for input_nodes, output_nodes, blocks in loader:
        batches.append((blocks, graph.features[input_nodes], graph.labels[output_nodes]))
        if len(batches) == 30:
            break
    torch.manual_seed(seed)
    model = SAGE(graph.features.shape[1], hidden, graph.num_classes, 2, 0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.005)

    def run() -> None:
        for blocks, x, y in batches:
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return run


def make_gather(seed: int = 0) -> Callable[[], None]:
    """Gathers of 100 batches of 8,000 random rows of a 200,000 x 128 float32 table."""
    from pingpong.kernels.cpu import gather_rows_cpu

    rng = np.random.default_rng(seed)
    table = rng.standard_normal((200_000, 128), dtype=np.float32)
    ids = [rng.integers(0, len(table), 8_000) for _ in range(100)]
    out = np.empty((8_000, 128), dtype=np.float32)

    def run() -> None:
        for batch in ids:
            gather_rows_cpu(table, batch, out)

    return run


def make_copy() -> Callable[[], None]:
    src = np.ones(2**23)  # 64 MiB of float64
    dst = np.empty_like(src)

    def run() -> None:
        np.copyto(dst, src)

    return run


def make_spin() -> Callable[[], None]:
    def run() -> None:
        n = 0
        for i in range(100_000):
            n += i

    return run


def single_threaded(core: int) -> None:
    import numba

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    numba.set_num_threads(1)


def neighbour_main(kind: str, core: int, hidden: int) -> None:
    """A neighbour process: build ``kind``, say READY, then run it forever."""
    single_threaded(core)
    run = {"spin": make_spin, "copy": make_copy, "gather": lambda: make_gather(seed=1),
           "train": lambda: make_train(hidden, seed=1)}[kind]()
    run()
    print("READY", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nobody reads the pipe now
    while True:
        run()


# --------------------------------------------------------------------------- measuring
class Neighbours:
    """One stopped process per neighbour kind; :meth:`only` lets one of them run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for kind in NEIGHBOURS[1:]:
                proc = subprocess.Popen(
                    [sys.executable, __file__, "--neighbour", kind, "--cores",
                     f"{args.core_a},{args.core_b}", "--hidden", str(args.hidden)],
                    stdout=subprocess.PIPE, text=True)
                self.procs[kind] = proc
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "READY":
                    raise RuntimeError(f"neighbour {kind} did not start (exit {proc.poll()})")
                proc.send_signal(signal.SIGSTOP)
        except BaseException:
            self.close()
            raise

    def only(self, kind: str) -> None:
        """Let ``kind`` run (none: stop all) and give it 0.2 s to get going;
        raises if a neighbour has died."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"neighbour {name} died (exit {proc.returncode})")
            proc.send_signal(signal.SIGCONT if name == kind else signal.SIGSTOP)
        time.sleep(0.2)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


def measure(run: Callable[[], None]) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) of one call."""
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    run()
    return time.thread_time() - cpu0, time.perf_counter() - wall0


def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    single_threaded(args.core_a)
    workloads = {"train": make_train(args.hidden), "gather": make_gather()}
    for run in workloads.values():
        run()  # warm-up: compilations, allocator
    neighbours = Neighbours(args)
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    try:
        for rnd in range(args.rounds):
            pairs = [(w, n) for w in WORKLOADS for n in NEIGHBOURS]
            rng.shuffle(pairs)
            for workload, neighbour in pairs:
                neighbours.only(neighbour)
                load = _common.OtherLoad()
                load.start()
                cpu, wall = measure(workloads[workload])
                rows.append({"round": rnd, "workload": workload, "neighbour": neighbour,
                             "cpu_s": cpu, "wall_s": wall, "other_cores": load.stop()})
            print(f"round {rnd} done", flush=True)
    finally:
        neighbours.close()
    return rows


# --------------------------------------------------------------------------- report
def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for workload in WORKLOADS:
        alone = {r["round"]: r["cpu_s"] for r in rows
                 if r["workload"] == workload and r["neighbour"] == "none"}
        for neighbour in NEIGHBOURS:
            mine = [r for r in rows if r["workload"] == workload and r["neighbour"] == neighbour]
            out.append({
                "workload": workload, "neighbour": neighbour,
                "cpu_s": statistics.median(r["cpu_s"] for r in mine),
                "wall_s": statistics.median(r["wall_s"] for r in mine),
                "other_cores": _median_or_none([r["other_cores"] for r in mine]),
                "slowdown": statistics.median(r["cpu_s"] / alone[r["round"]] for r in mine),
                "slowdown_min": min(r["cpu_s"] / alone[r["round"]] for r in mine),
                "slowdown_max": max(r["cpu_s"] / alone[r["round"]] for r in mine),
            })
    return out


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def topology(core: int) -> str:
    path = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list")
    return path.read_text().strip() if path.exists() else "?"


def _load(values: Any) -> str:
    return "unknown" if values is None else ", ".join(f"{v:.2f}" for v in values)


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Two busy cores: how much a neighbour slows a single-threaded workload (CPU)",
        "", "```", report["command"], "```", "",
        _common.describe_machine(report["machine"]), "",
        f"Core A {s['core_a']} runs the workload (this process, one torch and one Numba "
        f"thread); core B {s['core_b']} runs the neighbour (another process, likewise). "
        f"The guest's topology: core {s['core_a']}'s SMT siblings {s['siblings_a']}, core "
        f"{s['core_b']}'s {s['siblings_b']} (a VM's host may still place both vCPUs on one "
        "physical core; that is not visible here).",
        "",
        f"`train`: one pass of GraphSAGE training steps (hidden {s['hidden']}, fanouts 5,5, "
        "batch 200, 128 features) over 30 cached DGL batches. `gather`: pingpong's Numba CPU "
        "gather of 100 batches of 8,000 random rows out of a 200,000 x 128 float32 table. "
        "Neighbours: `spin` a pure Python loop, `copy` NumPy copies of 64 MiB arrays, "
        "`train`/`gather` the workloads in a loop. "
        f"Medians of {s['rounds']} rounds, pairs shuffled per round; `cpu / none's` divides "
        "the medians; `slowdown` is the median over rounds of the pair's CPU seconds divided "
        "by the same round's `none` (range in brackets); `other` is the CPU other processes "
        "used meanwhile, in cores (the neighbour included). "
        f"Whole run {report['wall_s']:.0f} s; load average at start "
        f"{_load(report['load_before'])}.", "",
    ]
    table = []
    alone = {r["workload"]: r["cpu_s"] for r in report["summary"] if r["neighbour"] == "none"}
    for row in report["summary"]:
        paired = f"{row['slowdown']:.2f} ({row['slowdown_min']:.2f}-{row['slowdown_max']:.2f})"
        table.append([row["workload"], row["neighbour"], f"{row['cpu_s']:.3f}",
                      f"{row['wall_s']:.3f}", f"{row['cpu_s'] / alone[row['workload']]:.2f}",
                      paired, "?" if row["other_cores"] is None else f"{row['other_cores']:.2f}"])
    lines.append(_common.markdown_table(
        ["workload", "neighbour", "cpu s", "wall s", "cpu / none's", "slowdown", "other"],
        table))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.neighbour is not None:
        neighbour_main(args.neighbour, args.core_b, args.hidden)
        return 0
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("core_interference.py pins threads to cores: Linux only")
    command, machine = _common.command_line(), _common.machine_info()
    waited = _common.wait_for_quiet(args.wait_quiet)[0] if args.wait_quiet else 0.0
    load_before = _common.load_average()
    t0 = time.perf_counter()
    rows = collect(args)
    report = {
        "benchmark": "core_interference", "command": command, "machine": machine,
        "wall_s": time.perf_counter() - t0, "waited_for_quiet_s": waited,
        "load_before": load_before,
        "settings": {"rounds": args.rounds, "hidden": args.hidden, "core_a": args.core_a,
                     "core_b": args.core_b, "siblings_a": topology(args.core_a),
                     "siblings_b": topology(args.core_b)},
        "summary": summarize(rows), "rows": rows,
    }
    _common.write_results(args.out, args.name, report, render(report), lambda *_: None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
