"""Distributed GraphSAGE with DistDGL through pingpong (2 partitions, one machine or a cluster).

    python examples/train_dist.py                      # pingpong, 2 partitions, all on 127.0.0.1
    python examples/train_dist.py --loader sync        # the plain loop: feat[input_nodes] inline
    python examples/train_dist.py --fetch-delay-ms 3   # +3 ms per pull, emulating a network
    python examples/train_dist.py --partition-only --part-dir parts   # for a real cluster

One file plays the three roles DGL's ``tools/launch.py`` gives a training
script, picked by the ``DGL_ROLE`` environment variable as launch.py sets it:

- no ``DGL_ROLE``: **the launcher** (this machine only). It partitions the
  synthetic graph (``pingpong.sources.make_synthetic_graph``, as
  ``train_sage.py`` uses it) with ``dgl.distributed.partition_graph`` into
  ``--num-parts`` partitions (a temporary directory unless ``--part-dir``),
  writes an ip_config with one ``127.0.0.1 PORT`` line per partition, and
  starts one server and one trainer per partition as processes with the
  environment launch.py would give them (``DGL_*`` plus torchrun's ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...). Every process runs in a
  process group of its own and is killed with it on exit, on error, on
  Ctrl-C or SIGTERM (and, on Linux, by the kernel if the launcher itself dies:
  ``PR_SET_PDEATHSIG``); see :class:`LocalCluster`.
- ``DGL_ROLE=server``: serves one partition until the trainers are done.
- ``DGL_ROLE=client``: **a trainer**. ``dgl.distributed.initialize``, a gloo
  process group (``env://``), the ``DistGraph``, its share of the training
  nodes (``dgl.distributed.node_split``), a ``DistNodeDataLoader`` and DDP.
  ``--loader pingpong`` wraps the DataLoader in ``pingpong.PingPongLoader``
  with the ``DistTensor`` s ``g.ndata["feat"]`` and ``g.ndata["label"]`` as row
  sources: the producer thread samples and pulls the next batch's rows while
  the training thread computes. ``--loader sync`` is the plain loop: sample,
  then ``feat[input_nodes]`` and ``label[output_nodes]`` on the training thread.

Rank 0 prints each epoch's time and accuracy; ``--json PATH`` writes them.

One machine, several partitions -- what DGL 1.1 does not do by itself:

- Every trainer is "machine 0": DGL takes the first ip_config line whose
  address is local, so both trainers read partition 0 from shared memory and
  pull partition 1 over a socket.
- DGL names a partition's shared-memory tables by the data name alone
  (``/dev/shm/node~_N~feat-kvdata-``): two servers on one machine write the
  *same* segment and the features come out wrong, silently. In the local
  launch (only there) every process gives its tables names of its own
  (:func:`isolate_shared_memory`) and the servers of partitions other than 0
  keep their graph out of shared memory (``disable_shared_mem=True``, as DGL's
  own multi-partition tests do); trainers then take their share of the
  training nodes from their own partition's book. On a cluster (one partition
  per machine, started by launch.py) none of this applies.

Call DGL's RPC (``DistTensor`` pulls, ``g.barrier()``, distributed sampling)
from the training thread while a pingpong epoch is running only inside
``with pingpong.rpc_turn():``: DGL's RPC client is not thread-safe, and the
producer thread is using it (two threads at once mixed up their replies here:
``KeyError`` in ``dgl.distributed.rpc.recv_responses``). Between epochs it is free.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.util
import inspect
import json
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import psutil
import torch
from torch.nn import functional as F

EXAMPLES = Path(__file__).resolve().parent
if importlib.util.find_spec("pingpong") is None:  # running from a source checkout
    sys.path.insert(0, str(EXAMPLES.parent))
if str(EXAMPLES) not in sys.path:  # sage_model, also when imported by tests/benchmarks
    sys.path.insert(0, str(EXAMPLES))

from _args import (  # noqa: E402
    FANOUTS_HOW,
    add_device_flags,
    buffer_count,
    check_device_flags,
    check_json_target,
    fanout_list,
    non_negative_float,
    positive_float,
    positive_int,
    probability,
    seed_value,
)
from _batch_check import params_digest  # noqa: E402
from _stacks import ANSWERED_DIR_ENV, answer_stack_requests, request_stacks  # noqa: E402
from sage_model import SAGE  # noqa: E402

import pingpong  # noqa: E402
from pingpong.sources import make_synthetic_graph  # noqa: E402

#: Set by :class:`LocalCluster` in the processes it starts: the job's token.
ONE_HOST_ENV = "PINGPONG_DIST_ONE_HOST"
#: The launcher's pid, so that a child can die with it.
LAUNCHER_PID_ENV = "PINGPONG_DIST_LAUNCHER_PID"
#: Where rank 0 writes its results for the launcher.
RESULT_ENV = "PINGPONG_DIST_RESULT"
#: DGL's RPC backend for every process of a one-host job: ``socket`` (DGL's default)
#: or ``tensorpipe`` (for an A/B run, ``benchmarks/dist_epoch.py --net-type``).
NET_TYPE_ENV = "PINGPONG_DIST_NET_TYPE"
GRAPH_META = "pingpong-graph.json"


# --------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="GraphSAGE on a partitioned graph with DistDGL, through pingpong.")
    p.add_argument("--loader", choices=["pingpong", "sync"], default="pingpong",
                   help="pingpong: PingPongLoader over DistNodeDataLoader with DistTensor "
                        "rows; sync: the plain loop pulling feat[input_nodes] inline")
    add_device_flags(p)
    p.add_argument("--epochs", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=500)
    p.add_argument("--fanouts", type=fanout_list, default=[10, 5], help=FANOUTS_HOW)
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--dropout", type=probability, default=0.5)
    p.add_argument("--lr", type=positive_float, default=5e-3)
    p.add_argument("--num-buffers", type=buffer_count, default=2)
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="pingpong: raise BatchTimeoutError after this many seconds "
                        "without a batch (a server that stopped answering)")
    p.add_argument("--fetch-delay-ms", type=non_negative_float, default=0.0,
                   help="sleep this long in every feature/label pull (both loaders), "
                        "emulating a network")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per trainer")
    # the graph (the launcher partitions it; trainers read its sizes)
    p.add_argument("--num-nodes", type=positive_int, default=40_000)
    p.add_argument("--feat-dim", type=positive_int, default=128)
    p.add_argument("--num-classes", type=positive_int, default=16)
    p.add_argument("--avg-degree", type=positive_float, default=15.0)
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--num-parts", type=positive_int, default=2,
                   help="partitions = servers = trainers (one each per partition)")
    p.add_argument("--part-dir", type=Path, default=None,
                   help="partition here (reused when it already holds this graph); "
                        "default: a temporary directory")
    p.add_argument("--partition-only", action="store_true",
                   help="partition into --part-dir and exit (for a real cluster)")
    # the local launch
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep the servers' logs here, made if missing (default: shown only "
                        "on failure)")
    p.add_argument("--job-timeout", type=non_negative_float, default=0.0,
                   help="stop everything after this many seconds (0: no limit); each "
                        "process still running first writes its Python stacks")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--pid-file", type=Path, default=None,
                   help=argparse.SUPPRESS)  # test hook: the pids of every process started
    # torch.distributed.launch (DGL 1.1's launch.py) passes --local-rank=N
    p.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    return p


# --------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class GraphSpec:
    """The synthetic graph's parameters: the same spec gives the same graph."""

    num_nodes: int = 40_000
    feat_dim: int = 128
    num_classes: int = 16
    avg_degree: float = 15.0
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GraphSpec:
        return cls(args.num_nodes, args.feat_dim, args.num_classes, args.avg_degree, args.seed)


def partition_synthetic(spec: GraphSpec, part_dir: Path, num_parts: int = 2,
                        log: Callable[[str], None] = print) -> Path:
    """Partition the synthetic graph into ``part_dir``; return the partition config.

    Reused when ``part_dir`` already holds a partition of the same spec;
    otherwise the previous partition's config is deleted, since the new one
    overwrites the ``part*/`` files it names. Besides DGL's files it writes
    ``pingpong-graph.json`` (the spec) and ``orig_nid.pt`` (``orig_nid[new_id]``
    = the node's id in the original graph: DGL renumbers the nodes so that each
    partition's are contiguous).
    """
    import dgl

    part_dir.mkdir(parents=True, exist_ok=True)
    meta_path = part_dir / GRAPH_META
    want = dict(asdict(spec), num_parts=num_parts)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        config = part_dir / f"{meta['graph_name']}.json"
        if meta.get("spec") == want and config.exists():
            log(f"reusing the partition in {part_dir}")
            return config
        # The new partition overwrites part*/ under the same names: the old config
        # would name another graph's files (and --partition-only printed its path).
        config.unlink(missing_ok=True)
        meta_path.unlink()
    t0 = time.perf_counter()
    sg = make_synthetic_graph(num_nodes=spec.num_nodes, num_classes=spec.num_classes,
                              feat_dim=spec.feat_dim, avg_degree=spec.avg_degree,
                              seed=spec.seed)
    g = sg.to_dgl()
    # A name of its own: DGL names the servers' shared memory after the graph.
    graph_name = f"pp_synthetic_{secrets.token_hex(4)}"
    with contextlib.redirect_stdout(sys.stderr):  # DGL reports every step on stdout
        orig_nid, _ = dgl.distributed.partition_graph(
            g, graph_name, num_parts, str(part_dir), return_mapping=True)
    torch.save(orig_nid, part_dir / "orig_nid.pt")
    meta_path.write_text(json.dumps({"graph_name": graph_name, "spec": want}, indent=1))
    log(f"partitioned {spec.num_nodes} nodes, {g.num_edges()} edges into {num_parts} parts "
        f"in {time.perf_counter() - t0:.1f} s ({part_dir})")
    return part_dir / f"{graph_name}.json"


# --------------------------------------------------------------------------- processes
def free_port(taken: set[int] | None = None) -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range.

    Below it, because the port is bound only seconds later (by a DGL server or
    torch's rendezvous), and in between DGL's clients pick their own ports with
    ``bind(0)``, which draws from the ephemeral range. ``taken``: ports already
    handed out (not bound yet), skipped and extended.
    """
    taken = set() if taken is None else taken
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(10000, max(10001, low))
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free TCP port found on 127.0.0.1")


def dgl_has_tensorpipe() -> bool:
    """Whether this DGL has the tensorpipe RPC backend (1.x: its ``DistGraphServer``
    takes ``net_type``; 2.x has sockets only)."""
    import dgl.distributed

    return "net_type" in inspect.signature(dgl.distributed.DistGraphServer.__init__).parameters


def dgl_net_type_kwargs() -> dict[str, str]:
    """Keyword arguments for ``dgl.distributed.initialize`` and ``DistGraphServer``:
    ``net_type`` from ``PINGPONG_DIST_NET_TYPE`` if it is set, else none (DGL's
    default, sockets).

    DGL 2.x has sockets only: its ``initialize`` ignores ``net_type`` (with a
    deprecation warning) and its ``DistGraphServer`` takes none, so ``socket``
    gives no argument there and ``tensorpipe`` raises ``ValueError``. The
    launchers call this before they start any process, so a wrong value fails
    there and not as servers that die while the trainers wait for them.
    """
    import dgl

    net_type = os.environ.get(NET_TYPE_ENV)
    if net_type is None:
        return {}
    if net_type not in ("socket", "tensorpipe"):
        raise ValueError(f"{NET_TYPE_ENV}={net_type!r}: DGL's RPC backends are 'socket' "
                         "and 'tensorpipe'")
    if dgl_has_tensorpipe():
        return {"net_type": net_type}
    if net_type == "tensorpipe":
        raise ValueError(f"{NET_TYPE_ENV}=tensorpipe, but DGL {dgl.__version__} has sockets "
                         "only (its DistGraphServer takes no net_type; DGL 2.0 deprecated the "
                         "argument). Unset it or use DGL 1.x")
    return {}


def die_with_launcher() -> None:
    """In a process the launcher started: be killed when it dies (Linux).

    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; if the launcher is already gone,
    exit now. Elsewhere a no-op (the launcher's own cleanup still runs).
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):
        os._exit(1)


@dataclass
class Proc:
    role: str  # "server" or "trainer"
    index: int
    popen: subprocess.Popen[bytes]
    log: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    def running(self) -> bool:
        """Whether the process has not exited yet (reaps it if it has)."""
        return self.popen.poll() is None


@dataclass
class LocalCluster:
    """DistDGL servers and trainers on this machine, as tools/launch.py would start them.

    ``command`` (say ``[python, train_dist.py, ...args]``) is run once per
    server with ``DGL_ROLE=server`` and once per trainer with ``DGL_ROLE=client``:
    one server per partition and ``num_trainers`` trainers (default: one per
    partition), each in a process group of its own (its own session).
    :meth:`stop` kills every group (SIGTERM, then SIGKILL after ``grace`` s);
    ``with LocalCluster(...)`` always stops it. The servers' output goes to
    ``log_dir`` (``workdir`` unless given); the trainers' to this process's
    stdout/stderr, or to ``trainer_log_dir`` when given.
    """

    command: Sequence[str]
    part_config: Path
    workdir: Path
    num_parts: int = 2
    num_trainers: int | None = None  # None: one per partition
    num_samplers: int = 0  # DGL sampler processes per trainer (DGL_NUM_SAMPLER)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    trainer_log_dir: Path | None = None
    server_threads: int = 1
    trainer_threads: int = 1
    #: The servers' graph formats (DGL_GRAPH_FORMAT; launch.py's --graph_format):
    #: edge workloads need "csc,coo" (a DistEdgeDataLoader's find_edges on a server).
    graph_format: str = "csc"
    procs: list[Proc] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(4))

    def __post_init__(self) -> None:
        self.ip_config = self.workdir / "ip_config.txt"
        self.answered_dir = self.workdir / "stacks-answered"  # see _stacks.request_stacks
        self.log_dir = self.log_dir or self.workdir
        if not 1 <= self.trainer_count <= self.num_parts:
            raise ValueError(f"num_trainers must be in [1, {self.num_parts}] (one host: at most "
                             f"one trainer per partition), got {self.num_trainers}")

    @property
    def trainer_count(self) -> int:
        """How many trainers: ``num_trainers``, or one per partition."""
        return self.num_parts if self.num_trainers is None else self.num_trainers

    # -- start --------------------------------------------------------------
    def start(self) -> None:
        dgl_net_type_kwargs()  # a backend this DGL lacks: ValueError before any process
        taken: set[int] = set()
        ports = [free_port(taken) for _ in range(self.num_parts)]
        self.ip_config.write_text("".join(f"127.0.0.1 {port}\n" for port in ports))
        self.answered_dir.mkdir(exist_ok=True)
        common = {
            **os.environ, **self.env,
            "DGL_NUM_SAMPLER": str(self.num_samplers),
            # trainers x (1 + samplers) x machines
            "DGL_NUM_CLIENT": str(self.trainer_count * (1 + self.num_samplers)),
            "DGL_CONF_PATH": str(self.part_config),
            "DGL_IP_CONFIG": str(self.ip_config),
            "DGL_NUM_SERVER": "1",  # servers per machine
            "DGL_GRAPH_FORMAT": self.graph_format,
            ONE_HOST_ENV: self.token,
            LAUNCHER_PID_ENV: str(os.getpid()),
            ANSWERED_DIR_ENV: str(self.answered_dir),
            "PYTHONUNBUFFERED": "1",
        }
        for key in ("DGL_DIST_MODE", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            common.pop(key, None)
        for i in range(self.num_parts):
            env = dict(common, DGL_ROLE="server", DGL_SERVER_ID=str(i), DGL_KEEP_ALIVE="0",
                       OMP_NUM_THREADS=str(self.server_threads))
            self._spawn("server", i, env, (self.log_dir or self.workdir) / f"server-{i}.log")
        master_port = free_port(taken)
        for rank in range(self.trainer_count):
            env = dict(common, DGL_ROLE="client", DGL_DIST_MODE="distributed", DGL_GROUP_ID="0",
                       OMP_NUM_THREADS=str(self.trainer_threads),
                       RANK=str(rank), WORLD_SIZE=str(self.trainer_count), GROUP_RANK=str(rank),
                       LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(master_port))
            log = (None if self.trainer_log_dir is None
                   else self.trainer_log_dir / f"trainer-{rank}.log")
            self._spawn("trainer", rank, env, log)

    def _spawn(self, role: str, index: int, env: dict[str, str], log: Path | None) -> None:
        out = open(log, "wb") if log is not None else None  # noqa: SIM115 - child owns it
        try:
            popen = subprocess.Popen(list(self.command), env=env, stdout=out,
                                     stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True)
        finally:
            if out is not None:
                out.close()
        self.procs.append(Proc(role, index, popen, log))

    # -- watch --------------------------------------------------------------
    @property
    def servers(self) -> list[Proc]:
        return [p for p in self.procs if p.role == "server"]

    @property
    def trainers(self) -> list[Proc]:
        return [p for p in self.procs if p.role == "trainer"]

    def pids(self) -> list[dict[str, Any]]:
        """Every process started: role, index, pid and process group (= pid)."""
        return [{"role": p.role, "index": p.index, "pid": p.popen.pid, "pgid": p.popen.pid,
                 "token": self.token} for p in self.procs]

    def wait(self, *, timeout: float | None = None, server_loss_grace: float = 60.0,
             on_poll: Callable[[LocalCluster], None] | None = None,
             log: Callable[[str], None] = print) -> int:
        """Wait for the trainers; 0 when all of them exited with 0, else 1 (124: timeout).

        A trainer that fails ends the job at once. A server that exits while
        trainers run is reported and the trainers get ``server_loss_grace``
        seconds to end by themselves (they fail or time out) before the job
        is stopped. After the trainers, the servers get 30 s to shut down
        (DGL's last client tells them to).
        """
        deadline = None if not timeout else time.monotonic() + timeout
        lost_at: float | None = None
        reported: set[str] = set()
        while True:
            if on_poll is not None:
                on_poll(self)
            codes = {p.name: p.popen.poll() for p in self.procs}
            failed = [p for p in self.trainers if codes[p.name] not in (None, 0)]
            if failed:
                for p in failed:
                    log(f"{p.name} (pid {p.popen.pid}) failed: {describe_exit(codes[p.name])}")
                return 1
            if all(codes[p.name] == 0 for p in self.trainers):
                break
            for p in self.servers:
                if codes[p.name] is not None and p.name not in reported:
                    reported.add(p.name)  # exit 0: the last trainer shut it down
                    if codes[p.name] != 0:
                        log(f"{p.name} (pid {p.popen.pid}) exited while trainers ran: "
                            f"{describe_exit(codes[p.name])}")
                    lost_at = lost_at or time.monotonic()
            if lost_at is not None and time.monotonic() - lost_at > server_loss_grace:
                log(f"trainers still running {server_loss_grace:.0f} s after a server "
                    "exited: stopping the job")
                self.dump_stacks(log)
                return 1
            if deadline is not None and time.monotonic() > deadline:
                log(f"job timeout ({timeout:.0f} s): stopping the job")
                self.dump_stacks(log)
                return 124
            time.sleep(0.1)
        self.wait_for_servers()
        return 0

    def wait_for_servers(self, timeout: float = 30.0) -> bool:
        """After the trainers: give the servers ``timeout`` s to shut down; True if all did.

        DGL's last trainer tells them to, and a server needs a moment after
        that trainer is gone (it finalizes its sockets, sleeping in 1 s steps
        while a queue drains). Stopping it earlier sends SIGTERM into that
        shutdown: DGL's handler then calls ``exit(1)``, which can hang.
        """
        end = time.monotonic() + timeout
        while any(p.running() for p in self.servers):
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)
        return True

    def dump_stacks(self, log: Callable[[str], None] = print, answer_s: float = 5.0) -> None:
        """Ask every process still running for its threads' Python stacks, one at a time.

        Each server and trainer writes them to its stderr (its log file with
        ``--log-dir``): a job that overran shows where each process was. See
        :mod:`_stacks`: SIGUSR1 (a Python handler, safe while threads run),
        then SIGUSR2 (faulthandler) for a process that did not answer within
        ``answer_s`` (its main thread in native code). A process still in its
        first imports (a second or two after it started) is killed by the
        signal instead -- the job is being stopped anyway.
        """
        for p in self.procs:
            if p.running():
                where = "" if p.log is None else f" (into {p.log.name})"
                log(f"Python stacks of {p.name} (pid {p.popen.pid}), still running{where}:")
                request_stacks(p.popen.pid, self.answered_dir, answer_s=answer_s,
                               alive=p.running, log=log)

    # -- stop ---------------------------------------------------------------
    def stop(self, grace: float = 5.0) -> None:
        """Stop every process group this cluster started; idempotent.

        Each group gets SIGTERM (after SIGCONT: a stopped process cannot exit) --
        also one whose leader has left, say a trainer whose DGL sampler process
        still waits on a server -- and ``grace`` s to leave; then SIGKILL.
        multiprocessing's resource trackers go last: they ignore SIGTERM and leave
        by themselves once every process that used them is gone, unlinking what
        those left (a sampler's named semaphores, ``/dev/shm/sem.mp-*``); killed
        together with the rest, they would leave it behind.
        """
        groups = {p.popen.pid for p in self.procs}
        for pgid in groups:
            _signal_group(pgid, signal.SIGCONT)
            _signal_group(pgid, signal.SIGTERM)
        for p in self.procs:
            p.running()  # reaps a leader that has exited
        _wait_until(lambda: not _workers_of(groups), grace)
        for proc in _workers_of(groups):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _wait_until(lambda: not _members_of(groups), TRACKER_EXIT_S)
        for pgid in groups:  # whatever is left, trackers included
            _signal_group(pgid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=10)
        self._remove_shared_memory()

    def _remove_shared_memory(self) -> None:
        """Delete what killed servers left in /dev/shm (DGL removes it on a clean exit)."""
        shm = Path("/dev/shm")
        if not shm.is_dir():
            return
        graph_name = json.loads(self.part_config.read_text()).get("graph_name", "")
        for path in shm.iterdir():
            if self.token in path.name or (graph_name and path.name.startswith(graph_name)):
                with contextlib.suppress(OSError):
                    path.unlink()

    def server_logs(self, lines: int = 15) -> str:
        out = []
        for p in self.servers:
            if p.log is not None and p.log.exists():
                tail = p.log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {p.name} ({p.log}), last lines:\n" + "\n".join(tail))
        return "\n".join(out)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


#: How long :meth:`LocalCluster.stop` gives multiprocessing's resource trackers to
#: clean up and leave once the processes they served are gone.
TRACKER_EXIT_S = 5.0


def _members_of(groups: set[int]) -> list[psutil.Process]:
    """The live processes (zombies aside) of the process groups ``groups``."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


def _workers_of(groups: set[int]) -> list[psutil.Process]:
    """:func:`_members_of` but multiprocessing's resource trackers."""
    def is_tracker(proc: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
        return False

    return [proc for proc in _members_of(groups) if not is_tracker(proc)]


def _wait_until(done: Callable[[], bool], timeout: float) -> None:
    """Poll ``done`` every 50 ms until it is true or ``timeout`` s have passed."""
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        time.sleep(0.05)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# --------------------------------------------------------------------------- servers
def isolate_shared_memory(token: str, machine: int) -> None:
    """Give this process's DGL key-value tables shared-memory names of their own.

    DGL 1.1 names the segment of a partition's table by the data name alone
    (``node~_N~feat-kvdata-``), so two partitions' servers on one machine
    would write the same segment (and a trainer maps it by that name). Here
    each name gets ``{token}-m{machine}``: ``machine`` is the partition the
    server holds, and 0 in a trainer (every trainer on one host is DGL's
    machine 0, which maps machine 0's tables).
    """
    from dgl.distributed import kvstore

    create = kvstore.empty_shared_mem

    def empty_shared_mem(name: str, is_create: bool, shape: Any, dtype: str = "float32") -> Any:
        if name.endswith("-kvdata-"):
            name = f"{name}{token}-m{machine}"
        return create(name, is_create, shape, dtype)

    kvstore.empty_shared_mem = empty_shared_mem


def isolate_shared_memory_in_dgl_samplers() -> None:
    """In a DGL sampler process of a one-host trainer: map tables as the trainer does.

    DGL spawns its sampler processes (``DGL_NUM_SAMPLER > 0``) with
    multiprocessing's ``spawn``, which imports the trainer's main script --
    and so this module -- in each of them, but runs none of the trainer's
    code; this runs at import there (a spawned child of a ``DGL_ROLE=client``
    process of a one-host launch) and nowhere else.
    """
    import multiprocessing

    token = os.environ.get(ONE_HOST_ENV)
    # parent_process() is not set yet while a spawned child imports the main script
    if (token is not None and os.environ.get("DGL_ROLE") == "client"
            and multiprocessing.current_process().name != "MainProcess"):
        isolate_shared_memory(token, machine=0)


def run_server() -> None:
    """The ``DGL_ROLE=server`` role: serve one partition until the trainers are done."""
    import dgl

    die_with_launcher()
    token = os.environ.get(ONE_HOST_ENV)
    ip_config = os.environ["DGL_IP_CONFIG"]
    if token is None:  # a cluster: DGL's own server, as launch.py starts it
        dgl.distributed.initialize(ip_config)
        return
    server_id = int(os.environ["DGL_SERVER_ID"])
    num_servers = int(os.environ["DGL_NUM_SERVER"])
    machine = server_id // num_servers
    isolate_shared_memory(token, machine)
    if machine == 0:
        dgl.distributed.initialize(ip_config, **dgl_net_type_kwargs())  # serves, then exits
        return
    # Machine 0's server shares its graph with the (co-located) trainers; the
    # others must not write the same segments (they are named after the graph).
    server = dgl.distributed.DistGraphServer(
        server_id, ip_config, num_servers, int(os.environ["DGL_NUM_CLIENT"]),
        os.environ["DGL_CONF_PATH"], disable_shared_mem=True,
        graph_format=os.environ.get("DGL_GRAPH_FORMAT", "csc").split(","),
        **dgl_net_type_kwargs())
    server.start()


# --------------------------------------------------------------------------- trainers
@dataclass
class Trainer:
    """What a trainer process holds after :func:`init_trainer`."""

    g: Any  # dgl.distributed.DistGraph
    rank: int
    world_size: int
    part_config: Path
    train_nids: torch.Tensor
    val_nids: torch.Tensor
    test_nids: torch.Tensor

    @property
    def leader(self) -> bool:
        return self.rank == 0


def init_trainer(threads: int = 1, gloo_timeout_s: float = 1800.0) -> Trainer:
    """``dgl.distributed.initialize``, a gloo process group, the DistGraph and this rank's nodes.

    Every rank gets the same number of training nodes (DDP needs the same
    number of steps everywhere): node_split's shares differ by at most one,
    so each is cut to the smallest.
    """
    import dgl
    import torch.distributed as dist

    g, rank, world_size, part_config, book = connect_trainer(threads, gloo_timeout_s)
    if dgl.distributed.role.get_num_trainers() % book.num_partitions() == 0:
        splits = [dgl.distributed.node_split(g.ndata[f"{s}_mask"], book, force_even=True)
                  for s in ("train", "val", "test")]
    else:  # fewer trainers than partitions (a benchmark's 1 trainer): node_split refuses it
        every = torch.arange(g.num_nodes())
        splits = [torch.nonzero(g.ndata[f"{s}_mask"][every]).squeeze(1).chunk(world_size)[rank]
                  for s in ("train", "val", "test")]
    count = torch.tensor([len(splits[0])])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    splits[0] = splits[0][: int(count)]
    return Trainer(g, rank, world_size, part_config, *splits)


def connect_trainer(threads: int = 1, gloo_timeout_s: float = 1800.0
                    ) -> tuple[Any, int, int, Path, Any]:
    """A trainer's connections: ``dgl.distributed.initialize``, a gloo process group,
    the DistGraph. Returns ``(g, rank, world_size, part_config, book)``; ``book`` is
    the partition book of this rank's share (on one host: partition ``rank``'s)."""
    import dgl
    import torch.distributed as dist

    die_with_launcher()
    logging.getLogger("dgl-distributed-socket").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    token = os.environ.get(ONE_HOST_ENV)
    if token is not None:
        isolate_shared_memory(token, machine=0)
    # before init_process_group
    dgl.distributed.initialize(os.environ["DGL_IP_CONFIG"], **dgl_net_type_kwargs())
    if token is not None and dgl.distributed.rpc.get_machine_id() != 0:
        raise RuntimeError("on one host every trainer should be DGL's machine 0, this one is "
                           f"{dgl.distributed.rpc.get_machine_id()}")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    part_config = Path(os.environ["DGL_CONF_PATH"])
    graph_name = json.loads(part_config.read_text())["graph_name"]
    g = dgl.distributed.DistGraph(graph_name, part_config=str(part_config))
    book = g.get_partition_book()
    if token is not None:  # DGL put us on machine 0; our share is partition `rank`'s
        book = dgl.distributed.load_partition_book(str(part_config), rank)[0]
    return g, rank, world_size, part_config, book


def make_source(g: Any, nids: torch.Tensor, fanouts: Sequence[int], batch_size: int,
                shuffle: bool) -> Any:
    """A ``DistNodeDataLoader``: PingPongLoader takes it as it is (every ``iter()`` is
    one pass; ``len()`` is its number of batches)."""
    import dgl

    return dgl.dataloading.DistNodeDataLoader(
        g, nids, dgl.dataloading.NeighborSampler(list(fanouts)), batch_size=batch_size,
        shuffle=shuffle, drop_last=False)


class DelayedRows:
    """A row source: another one's rows, after sleeping ``delay_s`` (a network's latency).

    ``delay_s`` may be changed between epochs. ``pulls`` counts the calls.
    With ``local=True`` it passes on the wrapped ``DistTensor``'s
    ``local_partition`` and ``part_policy``, so that pingpong reads the rows of
    this machine's partition in place and pulls (and waits) only for the others;
    with ``local=False`` every row goes through a pull.
    """

    def __init__(self, rows: Any, delay_s: float = 0.0, *, local: bool = True) -> None:
        self.rows = rows
        self.delay_s = delay_s
        self.shape = tuple(rows.shape)
        self.dtype = rows.dtype
        self.pulls = 0
        if local and hasattr(rows, "local_partition") and hasattr(rows, "part_policy"):
            self.local_partition = rows.local_partition
            self.part_policy = rows.part_policy

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        self.pulls += 1
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        return self.rows[ids]


class SyncBatch(NamedTuple):
    input_nodes: torch.Tensor
    output_nodes: torch.Tensor
    blocks: list[Any]
    x: torch.Tensor
    y: torch.Tensor


class SyncLoader:
    """The plain loop: sample, then pull ``feat[input_nodes]``, ``label[output_nodes]`` inline."""

    def __init__(self, source: Any, features: Any, labels: Any,
                 device: torch.device | str = "cpu") -> None:
        self.source = source
        self.features = features
        self.labels = labels
        self.device = torch.device(device)
        self.stats: dict[str, float] = {"batches": 0, "sample_s": 0.0, "fetch_s": 0.0}

    def __iter__(self) -> Iterator[SyncBatch]:
        it = iter(self.source)
        while True:
            t0 = time.perf_counter()
            try:
                input_nodes, output_nodes, blocks = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            x = self.features[input_nodes]
            y = self.labels[output_nodes]
            t2 = time.perf_counter()
            self.stats["batches"] += 1
            self.stats["sample_s"] += t1 - t0
            self.stats["fetch_s"] += t2 - t1
            blocks = list(blocks)
            if self.device.type != "cpu":  # PyPI's DGL cannot put blocks on a GPU
                x, y = x.to(self.device), y.to(self.device)
                blocks = [pingpong.as_edge_block(b).to(self.device) for b in blocks]
            yield SyncBatch(input_nodes, output_nodes, blocks, x, y)

    def close(self) -> None:
        pass

    def __enter__(self) -> SyncLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_loader(kind: str, source: Any, features: Any, labels: Any, *,
                num_buffers: int = 2, timeout: float | None = 120.0,
                device: str = "cpu", gather: str = "auto") -> Any:
    if kind == "sync":
        return SyncLoader(source, features, labels, device)
    return pingpong.PingPongLoader(source, features, labels, device=device, gather=gather,
                                   num_buffers=num_buffers, timeout=timeout)


@dataclass
class EpochResult:
    epoch_s: float = 0.0
    compute_s: float = 0.0
    steps: int = 0
    loss: float = 0.0
    correct: int = 0
    seen: int = 0


def train_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Iterable[Any]
                ) -> EpochResult:
    """One pass of ``loader``; ``compute_s`` is the time spent in the steps themselves."""
    result = EpochResult()
    model.train()
    t0 = time.perf_counter()
    for batch in loader:
        t = time.perf_counter()
        logits = model(batch.blocks, batch.x)
        loss = F.cross_entropy(logits, batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        result.compute_s += time.perf_counter() - t
        result.steps += 1
        result.loss += float(loss.detach())
        result.correct += int((logits.argmax(1) == batch.y).sum())
        result.seen += int(batch.y.shape[0])
    result.epoch_s = time.perf_counter() - t0
    return result


def evaluate(model: torch.nn.Module, loader: Iterable[Any]) -> tuple[int, int]:
    """(correct, total) over ``loader`` (this rank's share; all-reduce them)."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            logits = model(batch.blocks, batch.x)
            correct += int((logits.argmax(1) == batch.y).sum())
            total += int(batch.y.shape[0])
    return correct, total


def all_sum(*values: float) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def loader_stats(loader: Any) -> dict[str, float]:
    keys = ("batches", "sample_s", "fetch_s", "validate_s", "gather_s", "consumer_stall_s",
            "overlap_ratio")
    stats = loader.stats
    return {k: float(stats[k]) for k in keys if k in stats}


def trainer_main(args: argparse.Namespace) -> None:
    """The ``DGL_ROLE=client`` role."""

    t_start = time.perf_counter()
    tr = init_trainer(args.threads)
    log = print if tr.leader else (lambda *a, **k: None)
    spec = GraphSpec.from_args(args)
    features = DelayedRows(tr.g.ndata["feat"], args.fetch_delay_ms / 1000)
    labels = DelayedRows(tr.g.ndata["label"], args.fetch_delay_ms / 1000)
    torch.manual_seed(args.seed)
    model = SAGE(features.shape[1], args.hidden, spec.num_classes, len(args.fanouts),
                 args.dropout).to(args.device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # gloo: CUDA tensors too
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    def loader_for(nids: torch.Tensor, shuffle: bool) -> Any:
        source = make_source(tr.g, nids, args.fanouts, args.batch_size, shuffle)
        return make_loader(args.loader, source, features, labels,
                           num_buffers=args.num_buffers, timeout=args.timeout,
                           device=args.device, gather=args.gather)

    sizes = all_sum(len(tr.train_nids), len(tr.val_nids), len(tr.test_nids))
    log(f"DistDGL: {tr.world_size} trainers, {tr.g.num_nodes()} nodes, "
        f"{int(sizes[0])}/{int(sizes[1])}/{int(sizes[2])} train/val/test | loader "
        f"{args.loader} | device {args.device} | fanouts {','.join(map(str, args.fanouts))} "
        f"| batch {args.batch_size}"
        f" | fetch delay {args.fetch_delay_ms:g} ms | setup {time.perf_counter() - t_start:.1f} s",
        flush=True)
    epochs = []
    with contextlib.ExitStack() as stack:
        train_loader = stack.enter_context(loader_for(tr.train_nids, shuffle=True))
        val_loader = stack.enter_context(loader_for(tr.val_nids, shuffle=False))
        test_loader = stack.enter_context(loader_for(tr.test_nids, shuffle=False))
        for epoch in range(args.epochs):
            before = loader_stats(train_loader)
            r = train_epoch(ddp, opt, train_loader)
            after = loader_stats(train_loader)
            steps, loss, correct, seen = all_sum(r.steps, r.loss, r.correct, r.seen)
            epoch_max = all_max(r.epoch_s)
            val = all_sum(*evaluate(model, val_loader))
            row = {"epoch": epoch, "epoch_s": r.epoch_s, "epoch_s_max": epoch_max,
                   "compute_s": r.compute_s, "steps": r.steps,
                   "loss": loss / max(steps, 1), "train_acc": correct / max(seen, 1),
                   "val_acc": val[0] / max(val[1], 1),
                   **{f"{k}_epoch": after[k] - before.get(k, 0.0)
                      for k in ("sample_s", "fetch_s", "consumer_stall_s") if k in after}}
            epochs.append(row)
            log(f"Epoch {epoch:02d} | Time(s) {r.epoch_s:.3f} (slowest rank {epoch_max:.3f}) "
                f"| Loss {row['loss']:.4f} | Train Acc {row['train_acc']:.4f} "
                f"| Val Acc {row['val_acc']:.4f} | steps {r.steps} | compute {r.compute_s:.2f} s"
                f" | fetch {row.get('fetch_s_epoch', 0.0):.2f} s", flush=True)
        test = all_sum(*evaluate(model, test_loader))
        stats = loader_stats(train_loader)
    test_acc = test[0] / max(test[1], 1)
    log(f"Test Acc {test_acc:.4f}", flush=True)
    weights = [None] * tr.world_size  # every rank's: DDP keeps them equal
    torch.distributed.all_gather_object(weights, params_digest(model))
    if tr.leader and os.environ.get(RESULT_ENV):
        Path(os.environ[RESULT_ENV]).write_text(json.dumps({
            "loader": args.loader, "world_size": tr.world_size, "num_nodes": tr.g.num_nodes(),
            "train_nodes": int(sizes[0]), "epochs": epochs, "test_acc": test_acc,
            "train_loader_stats_rank0": stats, "pulls_rank0": features.pulls + labels.pulls,
            "params_sha256_by_rank": weights,
        }, indent=1))
    end_trainer(tr.rank)


def end_trainer(rank: int) -> NoReturn:
    """Wait for the other trainers, run the exit handlers, and end the process
    with status 0, without freeing the gloo process group; each step logged
    (stderr, every rank), so a job that hangs at its end shows in each
    trainer's log which step it last reached.

    The exit handlers are DGL's exit hook (a barrier with the other trainers,
    then the servers' shutdown) and multiprocessing's clean-up, which would run
    at interpreter exit anyway. The group is not freed, because freeing a gloo
    process group can deadlock (torch 2.2.1; 3 of 52 runs of this example on 2
    busy cores): ``~ProcessGroupGloo`` joins its worker threads while holding
    the GIL, and a worker still dropping the last collective's tensors waits
    for the GIL. The process therefore ends with ``os._exit`` after the
    handlers, before anything frees the group; ``destroy_process_group()``
    frees it too, once no model refers to it, and is not called.
    """
    import atexit

    import torch.distributed as dist

    def note(what: str) -> None:
        # one write per line: print() writes the text and the newline separately,
        # and another process writing to the same stream lands between them
        sys.stderr.write(f"trainer {rank}: {what}\n")
        sys.stderr.flush()

    note("training done; gloo barrier")
    dist.barrier()
    note("running the exit handlers (DGL's exit hook)")
    atexit._run_exitfuncs()
    note("leaving (os._exit(0), the gloo group kept)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_trainer(main: Callable[[], None]) -> None:
    """Run a trainer's ``main``; on any error print it and leave at once.

    ``os._exit``: DGL's exit hook waits for every other trainer in a barrier,
    which after a failure may never come.
    """
    try:
        main()
    except BaseException:  # noqa: BLE001 - report anything, then go
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def run_role(trainer_main: Callable[[], None]) -> bool:
    """Play the role ``DGL_ROLE`` gives this process, if any; True if it had one.

    ``DGL_ROLE=server``: :func:`run_server`; any other value (launch.py sets
    ``client``; DGL's ``initialize`` treats every value but ``server`` as a
    client): a trainer, ``trainer_main`` under :func:`run_trainer`. Either
    way the process first answers the launcher's requests for stacks. No
    ``DGL_ROLE``: nothing runs and the caller is the launcher (False).
    """
    role = os.environ.get("DGL_ROLE")
    if role is None:
        return False
    answer_stack_requests()  # the launcher's dump_stacks asks before a stop
    if role == "server":
        run_server()
    else:
        run_trainer(trainer_main)
    return True


# --------------------------------------------------------------------------- launcher
def launch(command: Sequence[str], part_config: Path, *, num_parts: int,
           num_trainers: int | None = None, num_samplers: int = 0,
           log_dir: Path | None = None, job_timeout: float = 0.0,
           env: dict[str, str] | None = None, threads: int = 1,
           on_poll: Callable[[LocalCluster], None] | None = None,
           pid_file: Path | None = None, log: Callable[[str], None] = print,
           ) -> tuple[int, dict[str, Any] | None]:
    """Start servers and trainers running ``command``, wait, stop them all.

    Returns (exit status, rank 0's results or None). SIGTERM is turned into
    SystemExit so that the cleanup runs; KeyboardInterrupt (Ctrl-C) too.
    """
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        with tempfile.TemporaryDirectory(prefix="pingpong-dist-") as tmp:
            workdir = Path(tmp)
            result_path = workdir / "result.json"
            cluster = LocalCluster(command, part_config, workdir, num_parts=num_parts,
                                   num_trainers=num_trainers, num_samplers=num_samplers,
                                   env={**(env or {}), RESULT_ENV: str(result_path)},
                                   log_dir=log_dir, trainer_threads=threads)
            status = 1
            try:
                cluster.start()
                if pid_file is not None:
                    pid_file.write_text(json.dumps(cluster.pids(), indent=1))
                log("started " + ", ".join(f"{p.name} (pid {p.popen.pid})" for p in cluster.procs))
                status = cluster.wait(timeout=job_timeout or None, on_poll=on_poll, log=log)
            finally:
                with signals_ignored():  # a second Ctrl-C must not cut the cleanup short
                    cluster.stop()
                if status != 0:
                    log(cluster.server_logs(lines=40))  # room for stacks dumped
            result = json.loads(result_path.read_text()) if result_path.exists() else None
            return status, result
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM inside the block (main thread only)."""
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def launcher_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    spec = GraphSpec.from_args(args)
    try:  # before partitioning: a backend this DGL lacks fails at once
        dgl_net_type_kwargs()
    except ValueError as exc:
        raise SystemExit(f"train_dist.py: {exc}") from None
    if args.partition_only and args.part_dir is None:
        raise SystemExit("--partition-only needs --part-dir")
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        part_dir = args.part_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="pingpong-parts-")))
        part_config = partition_synthetic(spec, part_dir, args.num_parts)
        if args.partition_only:
            print(part_config)
            return 0
        command = [sys.executable, str(Path(__file__).resolve()), *argv]
        try:
            status, result = launch(command, part_config, num_parts=args.num_parts,
                                    log_dir=args.log_dir, job_timeout=args.job_timeout,
                                    threads=args.threads, pid_file=args.pid_file)
        except KeyboardInterrupt:
            print("interrupted: every process of the job was stopped", flush=True)
            return 130
    wall = time.perf_counter() - t0
    print(f"job {'finished' if status == 0 else 'FAILED'} in {wall:.1f} s", flush=True)
    if args.json is not None and result is not None:
        args.json.write_text(json.dumps({**result, "status": status, "wall_s": wall,
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))
    return status


def refuse_splits_smaller_than_trainers(parser: argparse.ArgumentParser, spec: GraphSpec,
                                        trainers: int) -> None:
    """Exit (status 2) before partitioning when a split of the synthetic graph has
    fewer nodes than there are trainers: each trainer needs a node of every split
    (METIS itself fails with a backtrace below one node per partition). The
    split sizes are ``floor(fraction * num_nodes)``, with the fractions
    :func:`make_synthetic_graph` uses by default."""
    defaults = inspect.signature(make_synthetic_graph).parameters
    sizes = {name: int(defaults[f"{name}_frac"].default * spec.num_nodes)
             for name in ("train", "val", "test")}
    for name, size in sizes.items():
        if size < trainers:
            parser.error(f"the {name} split of {spec.num_nodes} nodes has {size} "
                         f"(train/val/test {'/'.join(map(str, sizes.values()))}), fewer "
                         f"than the {trainers} trainers of --num-parts {trainers}; raise "
                         "--num-nodes or lower --num-parts")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if run_role(lambda: trainer_main(args)):
        return 0
    check_json_target(parser, args.json)
    check_device_flags(parser, args)
    refuse_splits_smaller_than_trainers(parser, GraphSpec.from_args(args), args.num_parts)
    if args.log_dir is not None:  # like --part-dir: made if missing, before partitioning
        try:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--log-dir {args.log_dir}: {exc.strerror or exc}")
    return launcher_main(args, argv)


isolate_shared_memory_in_dgl_samplers()

if __name__ == "__main__":
    sys.exit(main())
