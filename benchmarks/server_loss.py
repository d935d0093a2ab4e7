"""A DistDGL server killed at a random moment: how often does the training loop get an
exception, and how often does DGL abort the trainer process instead?

Runs ``tests/_subprocess_scripts/distdgl_job.py server-kill-random`` (2
partitions, 2 servers, 2 DDP trainers on 127.0.0.1; server 1 gets SIGKILL
once rank 0 is three steps into its second epoch) ``--runs`` times for each
training-step time in ``--step-s``, with pingpong's server watch
(:mod:`pingpong.serverwatch`) and, for comparison, ``--baseline-runs`` times
without it (``PINGPONG_DISTDGL_BREAK=no-watch``). Every trainer's end is
classified:

- ``ServerGoneError``: its training loop got the exception (the job then
  leaves with ``os._exit(3)``);
- ``other exception``: its loop got another one (``BatchTimeoutError``, or
  gloo's error after the other trainer went);
- ``SIGABRT``: DGL's sender thread aborted the process (a send to the dead
  server);
- ``hung``: still running 60 s after the kill (the job kills it).

With step time 0 the producer thread is busy with DGL calls nearly all the
time; with 0.2 s it is idle most of the time, waiting for a free slot.

    python benchmarks/server_loss.py --runs 2 --baseline-runs 1                 # ~2 min
    python benchmarks/server_loss.py --out docs/benchmarks --name server-loss-cpu
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "_subprocess_scripts" / "distdgl_job.py"
OUTCOMES = ("ServerGoneError", "other exception", "SIGABRT", "other exit", "hung")


def classify(end: dict[str, Any], report: dict[str, Any]) -> str:
    if end.get("hung"):
        return "hung"
    if end.get("returncode") == -6:
        return "SIGABRT"
    if end.get("returncode") == 3 and report.get("exception"):
        return "ServerGoneError" if report["exception"] == "ServerGoneError" else "other exception"
    return "other exit"


def run_once(step_s: float, watch: bool, part_dir: Path) -> list[dict[str, Any]]:
    """One job; one entry per trainer: outcome, seconds from the kill to its end, exception."""
    with tempfile.TemporaryDirectory(prefix="pingpong-server-loss-") as tmp:
        out = Path(tmp) / "out"
        env = dict(os.environ, OMP_NUM_THREADS="1", PINGPONG_DISTDGL_STEP_S=str(step_s))
        env.pop("PINGPONG_DISTDGL_BREAK", None)
        if not watch:
            env["PINGPONG_DISTDGL_BREAK"] = "no-watch"
        proc = subprocess.run([sys.executable, str(JOB), "server-kill-random", str(out),
                               str(part_dir)], env=env, capture_output=True, text=True,
                              timeout=300, start_new_session=True)
        if proc.returncode != 0:
            raise RuntimeError(f"job failed ({proc.returncode}): {proc.stderr[-2000:]}")
        job = json.loads((out / "job.json").read_text())
        if not job["events"]:
            raise RuntimeError("the job never killed the server")
        ends = []
        for rank, end in sorted(job["trainers"].items()):
            path = out / f"rank{rank}.json"
            report = json.loads(path.read_text()) if path.exists() else {}
            ends.append({"rank": int(rank), "outcome": classify(end, report),
                         "after_kill_s": end.get("after_disturbance_s"),
                         "exit": end.get("exit"), "exception": report.get("exception"),
                         "message": (report.get("message") or "")[:160]})
        return ends


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", type=int, default=15, help="jobs per step time, with the watch")
    parser.add_argument("--baseline-runs", type=int, default=3,
                        help="jobs per step time without the watch")
    parser.add_argument("--step-s", type=float, nargs="+", default=[0.0, 0.2])
    parser.add_argument("--out", type=_common.out_dir, default=None)
    parser.add_argument("--name", default="server-loss-cpu")
    parser.add_argument("--render", type=Path, default=None,
                        help="only rewrite NAME.md from this JSON of an earlier run")
    args = parser.parse_args()
    if args.render is not None:
        report = json.loads(args.render.read_text())
        _common.write_markdown(args.render.with_suffix(".md"), markdown(report))
        return 0

    info = _common.machine_info()
    start = time.perf_counter()
    load_at_start = _common.load_average()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pingpong-server-loss-parts-") as parts:
        for step_s in args.step_s:
            for watch, runs in ((True, args.runs), (False, args.baseline_runs)):
                for i in range(runs):
                    ends = run_once(step_s, watch, Path(parts))
                    print(f"step {step_s} s, watch {watch}, run {i + 1}/{runs}: "
                          + ", ".join(f"rank {e['rank']} {e['outcome']}" for e in ends),
                          flush=True)
                    results.append({"step_s": step_s, "watch": watch, "run": i, "ends": ends})
    report = {"machine": info, "command": _common.command_line(),
              "seconds": time.perf_counter() - start, "load_average_at_start": load_at_start,
              "results": results}
    _common.write_results(args.out, args.name, report, markdown(report), lambda r, p: None)
    return 0


def markdown(report: dict[str, Any]) -> str:
    rows = []
    groups: dict[tuple[float, bool], list[dict[str, Any]]] = collections.defaultdict(list)
    for result in report["results"]:
        groups[(result["step_s"], result["watch"])].extend(result["ends"])
    for (step_s, watch), ends in sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        counts = collections.Counter(e["outcome"] for e in ends)
        gone = [e["after_kill_s"] for e in ends if e["outcome"] == "ServerGoneError"]
        rows.append([step_s, "yes" if watch else "no (before this change)", len(ends) // 2,
                     len(ends), *(counts[o] for o in OUTCOMES),
                     f"{statistics.median(gone):.2f}" if gone else "-"])
    table = _common.markdown_table(
        ["step s", "server watch", "jobs", "trainers", *OUTCOMES,
         "median s kill -> exception"], rows)
    others = collections.Counter(
        (r["step_s"], r["watch"], e["exception"]) for r in report["results"] for e in r["ends"]
        if e["outcome"] == "other exception")
    other_lines = "\n".join(
        f"- step {step} s, watch {'yes' if watch else 'no'}: {name} x{n}"
        for (step, watch, name), n in sorted(others.items())) or "- none"
    load = report["load_average_at_start"]
    notes = f"\n## Notes\n\n{report['notes']}\n" if report.get("notes") else ""
    return f"""# A DistDGL server killed mid-epoch (CPU)

```
{report['command']}
```

{_common.describe_machine(report['machine'])}

Job: `tests/_subprocess_scripts/distdgl_job.py server-kill-random`: 2 partitions, 2 DGL
servers and 2 DDP (gloo) trainers on 127.0.0.1, `PingPongLoader(DistNodeDataLoader,
DistTensor, DistTensor, timeout=15)`; SIGKILL to server 1 once rank 0 is three steps into
its second epoch; each training step sleeps `step s`. One row per step time and
watch setting; each cell counts trainers. Whole run {report['seconds']:.0f} s; load
average at start {[round(x, 2) for x in load] if load else None}.

{table}

The other exceptions:

{other_lines}

`ServerGoneError`: the training loop got pingpong's exception. `SIGABRT`: DGL's
sender thread aborted the process on a send to the dead server (`socket_communicator.cc:
Check failed: tmp != -1`). `other exception`: the loop got another exception: gloo's
`RuntimeError` ("Connection closed by peer") when the *other* trainer had already left
(after its own exception) while this one waited in DDP's all-reduce, or
`BatchTimeoutError` when a pull was in flight to the dead server and never returned
(only `timeout=` ends that wait without the watch). Without the watch, a trainer's next
send to the dead server aborts it; with it, the residual risk is a kill that lands while
one of DGL's messages is in flight (queued for, or being written by, DGL's sender
thread) -- the producer is inside DGL calls nearly all the time at step 0, and rarely
at 0.2 s. The deterministic test (`tests/test_distdgl.py`, mode `server-kill`) kills the
server while no message is in flight.
{notes}"""


if __name__ == "__main__":
    sys.exit(main())
