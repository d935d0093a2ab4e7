"""DistDGL epoch time on 127.0.0.1: pingpong against the synchronous loop, with and without
an emulated network delay.

One DistDGL job (``examples/train_dist.py``'s launcher: 2 partitions, 2
servers, 2 DDP trainers, all on this machine) runs every measurement, so the
servers start once. Both loaders read the same row sources: the
``DistTensor`` s ``feat`` and ``label`` wrapped in ``DelayedRows``, which
sleeps ``delay`` ms in every pull (a network's latency; 0 = localhost as is).
For each delay, after a warm-up, each round runs four epochs in a shuffled
order (the same on both trainers):

- ``sync``      the plain loop: sample, ``feat[input_nodes]``, ``label[output_nodes]``,
                train -- all on the training thread;
- ``pingpong``  ``PingPongLoader(DistNodeDataLoader, feat, label)``: sampling
                and pulls in the producer thread, overlapping training;
- ``load``      the sync loop without training: sampling + pulls alone (the
                batches are kept for ``compute``);
- ``compute``   training alone, on the batches ``load`` kept.

An epoch's time is the slowest trainer's. Medians over the rounds are
reported, with ``bound = max(load, compute)`` (perfect overlap),
``efficiency = pingpong / bound`` (goal <= 1.1) and ``speedup = sync /
pingpong`` (goal >= 1.3 where load and compute take about the same time: the
delay whose load/compute ratio is closest to 1 is the one judged, if that ratio
is within [0.8, 1.25]; else the speedup goal is not judged).

Each epoch also records where rank 0's CPU went: its training thread
(``time.thread_time``), pingpong's producer thread (``stats["producer_cpu_s"]``)
and the rest of the process (DGL's RPC threads, gloo). ``--trainers 1`` runs
one trainer for both partitions (fewer processes than cores);
``--samplers K`` gives each trainer K DGL sampler processes
(``DGL_NUM_SAMPLER``), ``--by-value`` has them send small tensors by value
(:mod:`pingpong.samplerpickle`); ``--pin-training-core C`` (one trainer, Linux) keeps core C
for the training thread alone and moves every other thread of the job to the
other cores; ``--num-buffers N`` gives pingpong N slots; ``--producer-nice N`` is the loader's
``producer_nice`` (default: the loader's, 0 in a DistDGL trainer); ``--nice-data N``
(Linux) runs the data side (the producer thread unless ``--producer-nice`` is given, the
sampler processes, the servers) at nice N, the training thread at its own;
``--profile-producer PATH`` writes a cProfile of the producer threads (thread CPU time; it
slows them, so not for timing). The report also gives a CPU floor: the machine's CPU
seconds of a load and a compute epoch over its cores.

    python benchmarks/dist_epoch.py --quick                       # ~1.5 min smoke run
    python benchmarks/dist_epoch.py --out docs/benchmarks --name dist-epoch-cpu
    python benchmarks/dist_epoch.py --trainers 1 --out docs/benchmarks --name dist-epoch-cpu-t1
    python benchmarks/dist_epoch.py --trainers 1 --samplers 1 --out docs/benchmarks \
        --name dist-epoch-cpu-t1-s1
    python benchmarks/dist_epoch.py --trainers 1 --samplers 1 --by-value --out docs/benchmarks \
        --name dist-epoch-cpu-t1-s1-byvalue
    python benchmarks/dist_epoch.py --trainers 1 --pin-training-core 0 --out docs/benchmarks \
        --name dist-epoch-cpu-t1-pinned
    python benchmarks/dist_epoch.py --quick --trainers 1 --profile-producer producer.prof
    python benchmarks/dist_epoch.py --trainers 1 --samplers 1 --by-value --hidden 256 \
        --delays-ms 0,5,10,15 --out docs/benchmarks --name dist-epoch-cpu-t1-s1-byvalue-h256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _common
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_dist as td
from sage_model import SAGE

import pingpong
import pingpong.rowsource
from pingpong._producer_nice import MAX_NICE

KINDS = ("sync", "pingpong", "load", "compute")
GOAL_EFFICIENCY = 1.1  # pingpong epoch <= 1.1 x max(load, compute)
GOAL_SPEEDUP = 1.3  # sync / pingpong where load ~ compute
JUDGE_BAND = (0.8, 1.25)  # load/compute counted as "load ~ compute"
STALL_SMALL = 0.15  # pp stall under this share of the pingpong epoch: "hardly waits"
TURNS_CORES = 1.25  # a trainer process under this many cores busy: its threads took turns
IN_PLACE_COMMIT = "09f13be"  # since it, pingpong reads the trainer's own partition in place
# The one-trainer job whose py-spy profile (docs/benchmarks.rst: "Where the training thread
# waits") found the training thread's other blocked time mostly waiting for the GIL; a
# report whose run differs in these settings says so.
PROFILED_RUN: dict[str, Any] = {
    "cpu": "Intel(R) Xeon(R) Processor (family 6, model 167)", "trainers": 1, "samplers": 0,
    "hidden": 64, "feat_dim": 128, "num_nodes": 40_000, "delay_ms": 0.0, "net_type": "socket",
    "pin_training_core": None}
PROFILED_LABELS = {  # how a report names a setting of its run that differs
    "cpu": "CPU {}", "trainers": "trainers: {}", "samplers": "sampler processes: {}",
    "hidden": "hidden {}", "feat_dim": "{} features", "num_nodes": "{} nodes",
    "delay_ms": "{} ms delay", "net_type": "{} RPC",
    "pin_training_core": "training thread on core {}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--num-nodes", type=int, default=40_000)
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--num-classes", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--fanouts", type=td.fanout_list, default=[5, 5])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--delays-ms", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.0, 1.0, 2.0, 3.0, 5.0, 20.0],
                   help="per pull, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="timed epochs of each kind per delay")
    p.add_argument("--profile-producer", type=Path, default=None,
                   help="write a cProfile of the producer threads (thread CPU time) here")
    p.add_argument("--samplers", type=int, default=0,
                   help="DGL sampler processes per trainer (DGL_NUM_SAMPLER)")
    p.add_argument("--by-value", action="store_true",
                   help="(with --samplers) pingpong.send_sampler_batches_by_value(): the "
                        "sampler processes send each batch's small tensors by value, for "
                        "every kind of epoch (default: as shared memory, torch's way)")
    p.add_argument("--trainers", type=int, default=2, choices=(1, 2),
                   help="DDP trainers (2: one per partition; 1: one trainer, the cores less "
                        "oversubscribed)")
    p.add_argument("--no-local-rows", action="store_true",
                   help="pingpong pulls every row, also those of this machine's partition "
                        "(default: it reads them in place from shared memory)")
    p.add_argument("--no-id-range", action="store_true",
                   help="split the ids with the DistTensor's part_policy per batch, as before "
                        "the id-range split (for an A/B run; default: the range)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval(S) in the trainers (Python's default: 0.005): "
                        "how long a thread may hold the GIL while another waits for it")
    p.add_argument("--num-buffers", type=int, default=2,
                   help="PingPongLoader(num_buffers=N): the producer runs up to N-1 batches "
                        "ahead of the training loop")
    p.add_argument("--no-sample-ahead", action="store_true",
                   help="PingPongLoader(sample_ahead=False): the producer samples batch k+1 after "
                        "handing batch k over (for an A/B run; default: before, as the "
                        "loader does for row sources)")
    p.add_argument("--pin-training-core", type=int, default=None, metavar="CORE",
                   help="(Linux, --trainers 1) run the training thread alone on CORE: every "
                        "other thread of the trainer (pingpong's producer, DGL's RPC threads, "
                        "gloo), its DGL sampler processes and both servers on the other cores")
    p.add_argument("--producer-nice", type=int, default=None, metavar="N",
                   help=f"PingPongLoader(producer_nice=N), 0-{MAX_NICE}: how much pingpong's "
                        "producer thread raises its nice value (default: up to --nice-data's "
                        "N if given, else the loader's default, 0 in a DistDGL trainer)")
    p.add_argument("--nice-data", type=int, default=None, metavar="N",
                   help=f"(Linux) raise the nice value of the data side to N, 0-{MAX_NICE}: "
                        "pingpong's producer thread (unless --producer-nice says otherwise), "
                        "the trainer's DGL sampler processes and the servers (the training "
                        "thread keeps its own), for every kind of epoch")
    p.add_argument("--net-type", choices=("socket", "tensorpipe"), default=None,
                   help="DGL's RPC backend for the servers and trainers (default: DGL's own, "
                        "socket; DGL 2.x has no other)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="timed kinds of epoch, comma-separated (a subset for profiling the "
                        "trainer from outside, e.g. with py-spy; the report needs all four)")
    p.add_argument("--part-dir", type=Path, default=None)
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="first wait up to this many seconds for other processes to go quiet")
    p.add_argument("--out", type=_common.out_dir, default=None)
    p.add_argument("--name", default="dist-epoch-cpu")
    p.add_argument("--from-json", type=_common.json_file, default=None,
                   help="measure nothing: re-render NAME.json and NAME.md of an earlier run")
    args = p.parse_args(argv)
    _common.rerender_target(p, args)
    if args.pin_training_core is not None and args.trainers != 1:
        p.error("--pin-training-core needs --trainers 1")
    if args.by_value and not args.samplers:
        p.error("--by-value needs --samplers")
    for flag, value in (("--producer-nice", args.producer_nice), ("--nice-data", args.nice_data)):
        if value is not None and not 0 <= value <= MAX_NICE:
            p.error(f"{flag} must be 0-{MAX_NICE}, got {value}")
    if args.quick:
        args.num_nodes, args.delays_ms, args.rounds = 20_000, [0.0, 3.0], 3
    return args


# --------------------------------------------------------------------------- trainer
def profile_producer_threads(path: Path) -> None:
    """Profile every pingpong producer thread of this process (CPU time of the thread,
    ``time.thread_time``) into one cProfile file, rewritten after each epoch; a trainer
    other than rank 0 writes ``PATH.rankN``."""
    import cProfile

    import pingpong._epoch as epoch_module

    rank = int(os.environ.get("RANK", "0"))
    out = path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")
    profile = cProfile.Profile(time.thread_time)
    produce = epoch_module.produce

    def profiled_produce(*args: Any, **kwargs: Any) -> None:
        profile.enable()
        try:
            produce(*args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(str(out))

    epoch_module.produce = profiled_produce


def cores_besides(core: int) -> frozenset[int]:
    """The cores this process may use other than ``core`` (Linux), for
    ``PingPongLoader(producer_cpus=...)``; exits if ``core`` is not one of them or
    none is left."""
    allowed = os.sched_getaffinity(0)
    if core not in allowed or len(allowed) < 2:
        raise SystemExit(f"--pin-training-core {core}: needs that core and another among "
                         f"the cores this process may use, {sorted(allowed)}")
    return frozenset(allowed - {core})


def _move_threads(proc: psutil.Process, cpus: frozenset[int], but: int | None = None) -> None:
    """Every thread of ``proc`` except ``but`` onto ``cpus``; a thread (or process) that
    ends meanwhile is skipped."""
    with contextlib.suppress(psutil.Error):
        for thread in proc.threads():
            if thread.id != but:
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(thread.id, cpus)


def pin_training_thread(core: int, others: frozenset[int]) -> None:
    """Keep ``core`` for the calling (training) thread alone (Linux).

    Every other thread of this process (DGL's RPC threads, gloo's, pingpong's
    kernel warm-up: call this after building the loader), every thread of its
    child processes (DGL's sampler processes) and of the DGL servers that the
    same launcher started (siblings of this trainer with ``DGL_ROLE=server``)
    move to ``others``; the producer threads, started later, get there through
    ``producer_cpus``.
    """
    _move_threads(psutil.Process(), others, but=threading.get_native_id())
    for proc in data_side_processes("--pin-training-core"):
        _move_threads(proc, others)
    os.sched_setaffinity(0, {core})


def data_side_processes(option: str) -> list[psutil.Process]:
    """This trainer's child processes (DGL's sampler processes) and the launcher's DGL
    servers (:func:`launcher_servers`, which exits naming ``option`` if there is none)."""
    return psutil.Process().children(recursive=True) + launcher_servers(option)


def launcher_servers(option: str) -> list[psutil.Process]:
    """The DGL servers the launcher of this trainer started (its siblings with
    ``DGL_ROLE=server``; one that cannot be read is skipped); exits naming ``option``
    if there is none."""
    servers = []
    for sibling in psutil.Process(os.getppid()).children():
        with contextlib.suppress(psutil.Error):
            if sibling.environ().get("DGL_ROLE") == "server":
                servers.append(sibling)
    if not servers:
        raise SystemExit(f"{option}: found none of the launcher's DGL servers")
    return servers


def nice_data_processes(nice: int) -> None:
    """Every thread of this trainer's child processes (DGL's sampler processes) and of the
    launcher's DGL servers gets nice value ``nice``; exits if no server is found."""
    for proc in data_side_processes("--nice-data"):
        with contextlib.suppress(psutil.Error):
            for thread in proc.threads():
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, thread.id, nice)


def producer_nice(args: argparse.Namespace) -> int | None:
    """``PingPongLoader(producer_nice=)`` for this trainer, called on its training thread:
    ``--producer-nice``; else, with ``--nice-data N``, what takes the producer from this
    thread's nice value to N (the producer starts at its creator's); else None, the
    loader's default (0 in a DistDGL trainer)."""
    if args.producer_nice is not None:
        return int(args.producer_nice)
    if args.nice_data is not None:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return max(0, int(args.nice_data) - mine)
    return None


def trainer_main(args: argparse.Namespace) -> None:

    if args.profile_producer is not None:
        profile_producer_threads(args.profile_producer)
    tr = td.init_trainer(threads=1)
    if args.nice_data is not None:  # the servers and sampler processes run by now
        nice_data_processes(args.nice_data)
    if args.by_value and pingpong.send_sampler_batches_by_value() != args.samplers:
        raise RuntimeError("pingpong.send_sampler_batches_by_value() found no sampler processes")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    producer_cpus = (None if args.pin_training_core is None
                     else cores_besides(args.pin_training_core))
    if args.no_id_range:  # the loader then asks DGL's part_policy for every batch
        setattr(pingpong.rowsource, "local_id_range", lambda *_args: None)  # noqa: B010
    # local: pingpong reads this machine's partition in place (the sync loop pulls it)
    feat = td.DelayedRows(tr.g.ndata["feat"], local=not args.no_local_rows)
    label = td.DelayedRows(tr.g.ndata["label"], local=not args.no_local_rows)
    torch.manual_seed(0)
    model = SAGE(feat.shape[1], args.hidden, args.num_classes, len(args.fanouts), 0.5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.005)
    source = td.make_source(tr.g, tr.train_nids, args.fanouts, args.batch_size, shuffle=True)
    sync = td.SyncLoader(source, feat, label)
    cache: list[Any] = []
    rows: list[dict[str, Any]] = []

    with pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=300,
                                 num_buffers=args.num_buffers,
                                 sample_ahead=not args.no_sample_ahead,
                                 producer_cpus=producer_cpus,
                                 producer_nice=producer_nice(args)) as pp:
        if producer_cpus is not None:  # after the loader: its warm-up thread moves too
            pin_training_thread(args.pin_training_core, producer_cpus)

        def epoch(kind: str) -> dict[str, Any]:
            before_pp, before_sync = dict(pp.stats), dict(sync.stats)
            cpu0, main0 = time.process_time(), time.thread_time()
            busy0 = _common._system_busy_seconds()  # every process: servers included
            runq0 = _common.thread_runqueue_seconds()  # the training thread, off-core
            if kind == "load":
                t0 = time.perf_counter()
                cache[:] = list(sync)
                r = td.EpochResult(epoch_s=time.perf_counter() - t0, steps=len(cache))
            elif kind == "compute":
                r = td.train_epoch(ddp, opt, cache)
            else:
                r = td.train_epoch(ddp, opt, sync if kind == "sync" else pp)
            cpu = time.process_time() - cpu0  # this trainer process, all its threads
            main_cpu = time.thread_time() - main0  # the training thread alone
            runq1 = _common.thread_runqueue_seconds()
            runq = {} if runq0 is None or runq1 is None else {"main_runq_s": runq1 - runq0}
            busy1 = _common._system_busy_seconds()
            machine = {} if busy0 is None or busy1 is None else {"machine_cpu_s": busy1 - busy0}
            stats = pp.stats if kind == "pingpong" else sync.stats
            before = before_pp if kind == "pingpong" else before_sync
            delta = {k: float(stats[k]) - float(before.get(k, 0.0))
                     for k in ("sample_s", "fetch_s", "consumer_stall_s", "producer_cpu_s",
                               "rows_fetched", "rows_read_in_place")
                     if k in stats}
            return {"kind": kind, "epoch_s": td.all_max(r.epoch_s), "epoch_s_rank": r.epoch_s,
                    "cpu_s": cpu, "cpu_s_max": td.all_max(cpu), "main_cpu_s": main_cpu,
                    "compute_s": r.compute_s, "steps": r.steps, **machine, **runq, **delta}

        for delay in args.delays_ms:
            feat.delay_s = label.delay_s = delay / 1000
            for kind in ("load", "sync", "pingpong", "compute"):  # warm-up (fills the cache)
                epoch(kind)
            rng = random.Random(int(delay * 1000))  # the same order on every trainer
            for rnd in range(args.rounds):
                order = [k for k in KINDS if k in args.kinds.split(",")]
                rng.shuffle(order)
                for kind in order:
                    rows.append({"delay_ms": delay, "round": rnd, **epoch(kind)})
                    if tr.leader:
                        r = rows[-1]
                        print(f"delay {delay:g} ms round {rnd} {kind:8s} {r['epoch_s']:.3f} s",
                              flush=True)
    if tr.leader and os.environ.get(td.RESULT_ENV):
        Path(os.environ[td.RESULT_ENV]).write_text(json.dumps({
            "rows": rows, "train_nodes_per_trainer": len(tr.train_nids),
            "steps_per_epoch": math.ceil(len(tr.train_nids) / args.batch_size),
            "pulls_per_step": 2,
            # what the loader resolved, and whether its producers did lower their priority
            "producer_nice": pp.producer_nice,
            "niced_epochs": pp.stats["niced_epochs"], "epochs": pp.stats["epochs"]}))
    td.end_trainer(tr.rank)


# --------------------------------------------------------------------------- report
def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for delay in sorted({r["delay_ms"] for r in rows}):
        med = {k: statistics.median(r["epoch_s"] for r in rows
                                    if r["delay_ms"] == delay and r["kind"] == k) for k in KINDS}
        n = {k: sum(1 for r in rows if r["delay_ms"] == delay and r["kind"] == k) for k in KINDS}
        stall = [r.get("consumer_stall_s", 0.0) for r in rows
                 if r["delay_ms"] == delay and r["kind"] == "pingpong"]
        steps_s = {k: statistics.median(r["compute_s"] for r in rows
                                        if r["delay_ms"] == delay and r["kind"] == k)
                   for k in ("sync", "pingpong", "compute")}
        cpu = {k: statistics.median(r["cpu_s_max"] for r in rows
                                    if r["delay_ms"] == delay and r["kind"] == k) for k in KINDS}
        # rank 0's process split into its training thread, its producer thread, the rest
        # (DGL's and gloo's C++ threads); rows of results without the split are skipped.
        split = {}
        for k in KINDS:
            these = [r for r in rows if r["delay_ms"] == delay and r["kind"] == k
                     and "main_cpu_s" in r]
            if these:
                producer = [r.get("producer_cpu_s", 0.0) if k == "pingpong" else 0.0
                            for r in these]
                split[f"{k}_main_cpu_s"] = statistics.median(r["main_cpu_s"] for r in these)
                split[f"{k}_producer_cpu_s"] = statistics.median(producer)
                split[f"{k}_other_cpu_s"] = statistics.median(
                    r["cpu_s"] - r["main_cpu_s"] - p for r, p in zip(these, producer,
                                                                     strict=True))
                if all("main_runq_s" in r for r in these):
                    # the training thread's epoch: CPU + waiting for a core + blocked (for
                    # the GIL, a batch, a lock, DDP's reducer)
                    split[f"{k}_main_runq_s"] = statistics.median(
                        r["main_runq_s"] for r in these)
                    blocked = [r["epoch_s_rank"] - r["main_cpu_s"] - r["main_runq_s"]
                               for r in these]
                    split[f"{k}_main_blocked_s"] = statistics.median(blocked)
                    # blocked beyond the waits for a batch, row by row (the stall is wall
                    # time in next(), which may itself include time off-core)
                    split[f"{k}_main_other_blocked_s"] = statistics.median(
                        b - r.get("consumer_stall_s", 0.0)
                        for b, r in zip(blocked, these, strict=True))
                if all("machine_cpu_s" in r for r in these):  # rank 0's view of the machine
                    split[f"{k}_machine_cpu_s"] = statistics.median(
                        r["machine_cpu_s"] for r in these)
        bound = max(med["load"], med["compute"])
        out.append({"delay_ms": delay, **{f"{k}_s": med[k] for k in KINDS},
                    "epochs_each": min(n.values()), "bound_s": bound,
                    "load_over_compute": med["load"] / med["compute"],
                    "efficiency": med["pingpong"] / bound,
                    "speedup": med["sync"] / med["pingpong"],
                    "pingpong_stall_s": statistics.median(stall) if stall else 0.0,
                    **{f"{k}_steps_s": v for k, v in steps_s.items()},
                    **{f"{k}_cpu_s": v for k, v in cpu.items()}, **split})
    return out


def cpu_floor_s(row: dict[str, Any], cores: int) -> float | None:
    """The shortest an epoch that does both ``load``'s and ``compute``'s work could take
    on ``cores`` cores if nothing but their CPU mattered: the machine's CPU seconds in a
    ``load`` epoch plus in a ``compute`` epoch (every process: trainers, sampler processes,
    servers), divided by the cores. ``None`` for results without the machine columns."""
    if "load_machine_cpu_s" not in row or "compute_machine_cpu_s" not in row:
        return None
    return (row["load_machine_cpu_s"] + row["compute_machine_cpu_s"]) / cores


def judged_point(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The delay whose load/compute ratio is closest to 1: where the speedup is judged if
    :func:`in_judge_band` (the reports' JSON keeps this row either way)."""
    return min(summary, key=lambda r: abs(r["load_over_compute"] - 1.0))


def in_judge_band(row: dict[str, Any]) -> bool:
    """Whether ``row``'s load/compute ratio is within ``JUDGE_BAND`` (load ~ compute)."""
    return JUDGE_BAND[0] <= row["load_over_compute"] <= JUDGE_BAND[1]


def ratio_text(value: float, threshold: float) -> str:
    """``value`` as ``1.23x``, with more digits where two would print it as ``threshold``
    while it is not (1.1023 against 1.1: ``1.102x``), so that the verdict is visible."""
    digits = 2
    while (f"{value:.{digits}f}" == f"{threshold:.{digits}f}" and value != threshold
           and digits < 6):
        digits += 1
    return f"{value:.{digits}f}x"


def speedup_goal_line(summary: list[dict[str, Any]], judged: dict[str, Any]) -> str:
    """The report's speedup goal line: judged at ``judged`` if it is within
    ``JUDGE_BAND``, else not judged (naming the closest delay)."""
    band = f"[{JUDGE_BAND[0]:g}, {JUDGE_BAND[1]:g}]"
    every = ", ".join(f"{r['delay_ms']:g} ms {ratio_text(r['speedup'], GOAL_SPEEDUP)}"
                      for r in summary)
    if not in_judge_band(judged):
        return (f"- Speedup where load ~ compute (load/compute within {band}), goal sync / "
                f"pingpong >= {GOAL_SPEEDUP}x: not judged (no delay with load/compute within "
                f"{band}; closest: {judged['load_over_compute']:.2f} at "
                f"{judged['delay_ms']:g} ms) (all delays: {every}).")
    met = judged["speedup"] >= GOAL_SPEEDUP
    return (f"- Speedup where load ~ compute (delay {judged['delay_ms']:g} ms, load/compute "
            f"{judged['load_over_compute']:.2f}, within {band}): sync / pingpong = "
            f"{ratio_text(judged['speedup'], GOAL_SPEEDUP)}; goal >= {GOAL_SPEEDUP}x: "
            f"{'met' if met else 'NOT met'} (all delays: {every}).")


def stall_text(summary: list[dict[str, Any]]) -> str:
    """What the report says of ``pp stall``: "hardly waits" only where it is under
    ``STALL_SMALL`` of the pingpong epoch at every delay; else each delay's share."""
    shares = [(r, r["pingpong_stall_s"] / r["pingpong_s"]) for r in summary]
    worst, most = max(shares, key=lambda rs: rs[1])
    at_most = (f"at most {most:.0%} at {worst['delay_ms']:g} ms, "
               f"{worst['pingpong_stall_s']:.2f} s of {worst['pingpong_s']:.2f} s")
    if most < STALL_SMALL:
        return (" even though the training loop hardly waits for data (`pp stall` under "
                f"{STALL_SMALL:.0%} of the pingpong epoch at every delay; {at_most}). The "
                "overlap hides what is not CPU: the waits for RPC replies and the emulated "
                "network delay.")
    large = [f"{r['delay_ms']:g}" for r, s in shares if s >= STALL_SMALL]
    where = "every delay" if len(large) == len(shares) else ", ".join(large) + " ms"
    return ("; the training loop also waited for data (`pp stall`, share of the pingpong "
            "epoch: " + ", ".join(f"{r['delay_ms']:g} ms {s:.0%}" for r, s in shares)
            + f"; {STALL_SMALL:.0%} or more at {where}; {at_most}). The overlap can hide only "
            "what is not CPU: the waits for RPC replies and the emulated network delay.")


def turns_text(zero: dict[str, Any]) -> str:
    """Whether the trainer's threads ran side by side, from the cores its process kept
    busy in a pingpong epoch (``zero``): "mostly did not" only under ``TURNS_CORES``."""
    busy = zero["pingpong_cpu_s"] / zero["pingpong_s"]
    if busy < TURNS_CORES:
        return (f"; at {busy:.2f} cores busy (under {TURNS_CORES:g}) the trainer's two threads "
                "mostly did not run side by side (taking turns, or both waiting: the split "
                "between the two is not measured here).")
    return (f"; at {busy:.2f} cores busy ({TURNS_CORES:g} or more) the process's threads ran "
            "side by side for part of the epoch.")


def profile_differences(report: dict[str, Any], zero: dict[str, Any]) -> list[str]:
    """How this report's run differs from ``PROFILED_RUN`` (empty: the same settings)."""
    s = report["settings"]
    mine = {"cpu": report["machine"].get("cpu"), "trainers": int(s.get("trainers", 2)),
            "samplers": int(s.get("samplers") or 0), "hidden": s.get("hidden"),
            "feat_dim": s.get("feat_dim"), "num_nodes": s.get("num_nodes"),
            "delay_ms": zero["delay_ms"], "net_type": s.get("net_type") or "socket",
            "pin_training_core": s.get("pin_training_core")}
    return [PROFILED_LABELS[k].format(f"{mine[k]:g}" if isinstance(mine[k], float) else mine[k])
            for k, v in PROFILED_RUN.items() if mine[k] != v]


def profile_text(report: dict[str, Any], zero: dict[str, Any]) -> str:
    """The docs' py-spy finding (mostly the GIL), as this run's where its settings are the
    profiled job's, else as a different run's, naming what differs."""
    differs = profile_differences(report, zero)
    if not differs:
        return ("a py-spy profile of a run with this job's settings (one trainer, hidden 64, "
                "no delay, `--kinds pingpong`) found mostly the GIL: docs/benchmarks.rst")
    return ("a py-spy profile of a different run (one trainer, no sampler processes, hidden "
            "64, 128 features, 40000 nodes, no delay, socket RPC, not pinned, on the Xeon VM; "
            "this run: " + ", ".join(differs) + ") found mostly the GIL there: "
            "docs/benchmarks.rst")


def _commit_contains(commit: str, ancestor: str) -> bool | None:
    """Whether git commit ``commit`` has ``ancestor`` in its history (None: unknown)."""
    try:
        rc = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit],
                            cwd=Path(__file__).resolve().parent, capture_output=True,
                            timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(rc)


def reads_local_rows(report: dict[str, Any]) -> bool | None:
    """Whether pingpong read the trainer's own partition in place: the recorded setting;
    for reports from before it was recorded, whether their commit has in-place reading
    (``IN_PLACE_COMMIT``); None where neither tells."""
    s = report["settings"]
    if "local_rows" in s:
        return bool(s["local_rows"])
    if "no_local_rows" in s:
        return not s["no_local_rows"]
    commit = report["machine"].get("git_commit") or ""
    base, _, uncommitted = commit.partition("+")
    has = _commit_contains(base, IN_PLACE_COMMIT) if base else None
    return None if has is None or (uncommitted and not has) else has


def local_rows_text(report: dict[str, Any]) -> str:
    """The report's words for how pingpong got the rows of the trainer's own partition."""
    s = report["settings"]
    local = reads_local_rows(report)
    if local is None:
        return ("whether pingpong read the rows of the trainer's own partition in place is "
                "not recorded")
    if not local:
        if "local_rows" in s or "no_local_rows" in s:
            return "pingpong pulls every row"
        return (f"pingpong pulls every row -- the run's commit, "
                f"{report['machine']['git_commit']}, is older than {IN_PLACE_COMMIT}, which "
                "reads the trainer's own partition in place")
    return ("pingpong reads the rows of the trainer's own partition in place and pulls the "
            "others" + ("; the ids split by DGL's part_policy per batch, not by the "
                        "partition's id range" if s.get("no_id_range") else ""))


def producer_priority_text(settings: dict[str, Any]) -> str:
    """The report's words for pingpong's producer priority, from what rank 0's loader
    resolved and applied (reports from before that was recorded: what was asked)."""
    asked = settings.get("producer_nice_used")
    applied, epochs = settings.get("producer_niced_epochs"), settings.get("pingpong_epochs")
    if not asked:
        return "; pingpong's producer thread at the trainer's priority" if asked == 0 else ""
    if applied is None:
        return f"; pingpong's producer thread at nice +{asked}"
    if applied == epochs:
        return f"; pingpong's producer thread at nice +{asked} (every epoch)"
    return (f"; pingpong's producer asked for nice +{asked}, applied in {applied} of "
            f"{epochs} epochs (the OS refused, or not Linux)")


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    trainers = int(s.get("trainers", 2))
    trainer_words = "1 trainer" if trainers == 1 else f"{trainers} DDP (gloo) trainers"
    samplers = int(s.get("samplers", 0))
    if samplers:
        trainer_words += (f" with {samplers} DGL sampler process{'es' if samplers > 1 else ''}"
                          " each (sampling out of the trainer process"
                          + ("; small tensors sent by value, "
                             "`pingpong.send_sampler_batches_by_value()`, for every kind"
                             if s.get("by_value") else "") + ")")
    table = _common.markdown_table(
        ["delay ms/pull", "sync s", "pingpong s", "load s", "compute s", "bound s",
         "load/compute", "pp / bound", "sync / pp", "pp stall s", "pp steps s",
         "load cpu s", "compute cpu s", "pp cpu s"],
        [[f"{r['delay_ms']:g}", r["sync_s"], r["pingpong_s"], r["load_s"], r["compute_s"],
          r["bound_s"], r["load_over_compute"], r["efficiency"], r["speedup"],
          r["pingpong_stall_s"], r["pingpong_steps_s"], r["load_cpu_s"], r["compute_cpu_s"],
          r["pingpong_cpu_s"]] for r in report["summary"]])
    judged = report["judged"]
    summary = report["summary"]
    split_table = ""
    machine_cols = bool(summary) and "pingpong_machine_cpu_s" in summary[0]
    if summary and "pingpong_main_cpu_s" in summary[0]:
        split_table = _common.markdown_table(
            ["delay ms/pull", "load: main", "load: other", "compute: main", "compute: other",
             "pp: main", "pp: producer", "pp: other"]
            + (["load: machine", "compute: machine", "pp: machine"] if machine_cols else []),
            [[f"{r['delay_ms']:g}", r["load_main_cpu_s"], r["load_other_cpu_s"],
              r["compute_main_cpu_s"], r["compute_other_cpu_s"], r["pingpong_main_cpu_s"],
              r["pingpong_producer_cpu_s"], r["pingpong_other_cpu_s"]]
             + ([r["load_machine_cpu_s"], r["compute_machine_cpu_s"],
                 r["pingpong_machine_cpu_s"]] if machine_cols else [])
             for r in summary])
    thread_table = ""
    if summary and "pingpong_main_runq_s" in summary[0]:
        thread_table = _common.markdown_table(
            ["delay ms/pull", "compute: cpu", "compute: waiting for a core",
             "compute: blocked", "pp: cpu", "pp: waiting for a core", "pp: blocked",
             "pp: stall"],
            [[f"{r['delay_ms']:g}", r["compute_main_cpu_s"], r["compute_main_runq_s"],
              r["compute_main_blocked_s"], r["pingpong_main_cpu_s"],
              r["pingpong_main_runq_s"], r["pingpong_main_blocked_s"],
              r["pingpong_stall_s"]] for r in summary])
    share = statistics.median(r["compute_cpu_s"] / r["compute_s"] for r in summary)
    cpu_line = "; ".join(f"{r['delay_ms']:g} ms: pp {r['pingpong_cpu_s']:.2f} s vs load "
                         f"{r['load_cpu_s']:.2f} + compute {r['compute_cpu_s']:.2f} s"
                         for r in summary)
    eff_ok = [r for r in report["summary"] if r["efficiency"] <= GOAL_EFFICIENCY]
    cores = int(report["machine"]["logical_cores"])
    floors = [(r, cpu_floor_s(r, cores)) for r in summary]
    floor_line = ""
    if summary and all(f is not None for _, f in floors):
        floor_line = (
            f"- Cores: the machine's CPU seconds of a load epoch plus a compute epoch (every "
            f"process), over its {cores} cores, give the shortest epoch that doing both at "
            "once allows here (`floor`, if overlapping saves no CPU); where floor > "
            f"{GOAL_EFFICIENCY}x bound, this machine's cores alone keep the overlap goal out "
            "of reach. "
            + "; ".join(f"{r['delay_ms']:g} ms: floor {f:.2f} s = "
                        f"{ratio_text(f / r['bound_s'], GOAL_EFFICIENCY)} bound, pingpong "
                        f"{ratio_text(r['pingpong_s'] / max(f, r['bound_s']), GOAL_EFFICIENCY)}"
                        " max(bound, floor)" for r, f in floors) + ".")
    thread_line = ""
    if split_table:
        zero = min(summary, key=lambda r: r["delay_ms"])
        thread_line = (
            "\n"
            f"By thread (second table; at {zero['delay_ms']:g} ms): the training thread used "
            f"{zero['pingpong_main_cpu_s']:.2f} s in a pingpong epoch against "
            f"{zero['compute_main_cpu_s']:.2f} s alone, the producer "
            f"{zero['pingpong_producer_cpu_s']:.2f} s against {zero['load_main_cpu_s']:.2f} s "
            "for the same sampling and pulls on the training thread, and the process as a "
            f"whole kept {zero['pingpong_cpu_s'] / zero['pingpong_s']:.2f} cores busy over "
            "the epoch. ")
        if trainers < report["machine"]["logical_cores"]:
            thread_line += (
                f"The machine has {report['machine']['logical_cores']} cores for "
                f"{trainers} trainer process{'es' if trainers > 1 else ''} and the two "
                "servers ("
                + ("their CPU is in the `machine` columns" if machine_cols
                   else "whose CPU is not measured here") + ")" + turns_text(zero))
            if "pingpong_main_other_blocked_s" in zero:
                thread_line += (
                    " In a pingpong epoch (third table) the training thread waited "
                    f"{zero['pingpong_main_runq_s']:.2f} s for a core, "
                    f"{zero['pingpong_stall_s']:.2f} s for batches and "
                    f"{zero['pingpong_main_other_blocked_s']:.2f} s otherwise blocked "
                    f"(for the GIL, DDP's reducer or a lock; {profile_text(report, zero)}).")
        else:
            thread_line += (
                "With as many trainer processes as cores (and the servers besides), the "
                "cores themselves are short.")
    lines = [
        "# DistDGL epoch time on localhost (CPU)", "",
        "```", report["command"], "```", "",
        _common.describe_machine(report["machine"]), "",
        f"Job: 2 partitions, 2 DGL servers and {trainer_words} on 127.0.0.1, "
        f"one torch thread per trainer, one OMP thread per server; synthetic graph "
        f"{s['num_nodes']} nodes, {s['feat_dim']} float32 features, {s['num_classes']} "
        f"classes; DistNodeDataLoader, fanouts {s['fanouts']}, batch {s['batch_size']}, "
        f"{report['steps_per_epoch']} steps per epoch per trainer, 2 pulls per step "
        f"(features, labels; {local_rows_text(report)}"
        + (f"; {s['num_buffers']} slots (the producer up to {s['num_buffers'] - 1} batches "
           "ahead)" if s.get("num_buffers", 2) != 2 else "")
        + (f"; DGL's sampler processes and servers at nice {s['nice_data']}"
           if s.get("nice_data") is not None else "")
        + producer_priority_text(s)
        + ("; the producer samples batch k+1 after handing batch k over (no sample-ahead)"
           if s.get("no_sample_ahead") else "")
        + (f"; GIL switch interval {s['switch_interval'] * 1e3:g} ms in the trainers "
           "(Python's default 5 ms)" if s.get("switch_interval") is not None else "")
        + (f"; DGL's {s['net_type']} RPC backend"
           if s.get("net_type") not in (None, "socket") else "")
        + (f"; the training thread alone on core {s['pin_training_core']}, the producer, "
           "DGL's RPC threads, "
           + ("the sampler processes " if s.get("samplers") else "")
           + "and both servers on the other cores"
           if s.get("pin_training_core") is not None else "")
        + f"); GraphSAGE hidden {s['hidden']}. Medians of "
        f"{min(r['epochs_each'] for r in report['summary'])} timed epochs of each kind per "
        f"delay (after a warm-up of each), kinds shuffled per round; an epoch's time is the "
        f"slowest trainer's. Whole run {report['wall_s']:.0f} s; load average at start "
        f"{report['load_before']}, other processes' CPU during the run "
        f"{report['other_cores']} cores (of {report['machine']['logical_cores']}).", "",
        "`sync`: the plain loop (sample, pull, train on the training thread). `pingpong`: "
        "PingPongLoader over the same DataLoader and row sources. `load`: sampling + pulls "
        "alone (sync loop, no training); `compute`: training alone on batches kept from "
        "`load`. `bound` = max(load, compute). The delay is a `time.sleep` in a row-source "
        "wrapper around each DistTensor, in every pull of both loaders. `pp stall`: how long "
        "pingpong's training loop waited for batches in an epoch; `pp steps`: the time inside "
        "its training steps (compare `compute`: the same steps without a producer running); "
        "`cpu`: CPU seconds of the busiest trainer process in an epoch of that kind (its "
        "server's CPU not included).", "",
        table, "",
        *(["Where rank 0's CPU seconds went in an epoch (medians): `main` the training "
           "thread (in `load`, the loop that samples and pulls), `producer` pingpong's "
           "producer thread (`stats[\"producer_cpu_s\"]`: DGL's sampling, the pulls, the "
           "copies into the slot), `other` the rest of the process (DGL's RPC threads, gloo)"
           + ("; `machine` every process on the machine over rank 0's epoch (/proc/stat: "
              "the servers, the trainers, anything else)" if machine_cols else "") + ".",
           "", split_table, ""] if split_table else []),
        *(["Where rank 0's training thread spent an epoch (medians, seconds): running "
           "(`cpu`), runnable but waiting for a core (`waiting for a core`: "
           "/proc/thread-self/schedstat), and the rest `blocked`: waiting for the GIL, for a "
           "batch (`stall`, the same as `pp stall` above), for DDP's reducer or a lock.", "",
           thread_table, ""] if thread_table else []),
        "## Goals", "",
        f"- Overlap: pingpong's epoch <= {GOAL_EFFICIENCY}x max(load, compute): "
        + ("met at delays " + ", ".join(f"{r['delay_ms']:g}" for r in eff_ok) + " ms"
           if eff_ok else "NOT met at any delay")
        + "; " + ", ".join(f"{r['delay_ms']:g} ms: "
                           f"{ratio_text(r['efficiency'], GOAL_EFFICIENCY)}"
                           for r in report["summary"]) + ".",
        speedup_goal_line(summary, judged),
        *([floor_line] if floor_line else []),
        "", "## Why", "",
        f"In compute-only epochs a trainer process used {share:.2f} cores (CPU s / wall s, "
        f"median over delays): {trainers} trainer process{'es' if trainers > 1 else ''}, "
        f"2 servers and the other processes share the {report['machine']['logical_cores']} "
        f"cores. A pingpong epoch costs about the CPU of load plus compute "
        f"({cpu_line}), so the steps slow down while the producer samples (`pp steps` vs "
        "`compute`)" + stall_text(summary),
        *([thread_line] if thread_line else []),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if td.run_role(lambda: trainer_main(args)):
        return 0
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        # the summary again from the rows, as this version of summarize() makes it
        report["summary"] = summarize(report["rows"])
        report["judged"] = judged_point(report["summary"])
        _common.write_results(args.out, args.name, report, render(report), lambda r, p: None)
        return 0
    return launcher(args, sys.argv[1:] if argv is None else argv)


def launcher(args: argparse.Namespace, argv: list[str]) -> int:
    import tempfile

    spec = td.GraphSpec(args.num_nodes, args.feat_dim, args.num_classes, 15.0, 0)
    if args.net_type is not None:
        os.environ[td.NET_TYPE_ENV] = args.net_type  # the job's processes inherit it
    machine = _common.machine_info()
    if args.wait_quiet > 0:
        waited, other_load = _common.wait_for_quiet(args.wait_quiet)
        print(f"waited {waited:.0f} s for quiet (other load {other_load})", file=sys.stderr)
    load_before = _common.load_average()
    t0 = time.perf_counter()
    busy0, own0 = _common._system_busy_seconds(), sum(os.times()[:4])
    with tempfile.TemporaryDirectory(prefix="pingpong-parts-") as tmp:
        part_config = td.partition_synthetic(spec, args.part_dir or Path(tmp), 2,
                                             log=lambda m: print(m, file=sys.stderr))
        command = [sys.executable, str(Path(__file__).resolve()), *argv]
        status, result = td.launch(command, part_config, num_parts=2,
                                   num_trainers=args.trainers, num_samplers=args.samplers,
                                   log=lambda m: print(m, file=sys.stderr))
    wall = time.perf_counter() - t0
    busy1, own1 = _common._system_busy_seconds(), sum(os.times()[:4])
    other = (None if busy0 is None or busy1 is None
             else round(max(0.0, (busy1 - busy0 - (own1 - own0)) / wall), 2))
    if status != 0 or result is None:
        print(f"the job failed (status {status})", file=sys.stderr)
        return 1
    if set(args.kinds.split(",")) != set(KINDS):
        print("--kinds: a profiling run, no report", file=sys.stderr)
        return 0
    summary = summarize(result["rows"])
    judged = judged_point(summary)
    report = {
        "command": _common.command_line(), "machine": machine, "wall_s": wall,
        "load_before": [round(x, 2) for x in load_before] if load_before else None,
        "other_cores": other,
        "settings": {k: (",".join(map(str, v)) if isinstance(v, list) else v)
                     for k, v in vars(args).items()
                     if k in ("num_nodes", "feat_dim", "num_classes", "batch_size", "fanouts",
                              "hidden", "delays_ms", "rounds", "trainers", "samplers",
                              "by_value", "num_buffers", "nice_data", "producer_nice",
                              "no_local_rows", "no_id_range", "switch_interval",
                              "no_sample_ahead", "pin_training_core", "net_type")}
        | {"local_rows": not args.no_local_rows,
           "producer_nice_used": result.get("producer_nice"),
           "producer_niced_epochs": result.get("niced_epochs"),
           "pingpong_epochs": result.get("epochs")},
        "steps_per_epoch": result["steps_per_epoch"],
        "train_nodes_per_trainer": result["train_nodes_per_trainer"],
        "summary": summary, "judged": judged,
        "goals": {"efficiency_max": GOAL_EFFICIENCY, "speedup_min": GOAL_SPEEDUP,
                  "efficiency_met": {str(r["delay_ms"]): r["efficiency"] <= GOAL_EFFICIENCY
                                     for r in summary},
                  "speedup_band": list(JUDGE_BAND),
                  # None: no delay with load ~ compute, the speedup goal not judged
                  "speedup_met": (judged["speedup"] >= GOAL_SPEEDUP if in_judge_band(judged)
                                  else None)},
        "rows": result["rows"],
    }
    _common.write_results(args.out, args.name, report, render(report), lambda r, p: None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
