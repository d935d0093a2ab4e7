"""examples/train_sage.py under torchrun: one DDP job over several "machines".

Each job is started the way a user starts one: a ``torchrun`` process per
node (``--nnodes N --node-rank i --nproc-per-node M``, static rendezvous at
``127.0.0.1`` on a free port), here all on localhost, gloo on the CPU. The
script runs with its test hook ``--dump-batches``: every rank writes the
digest of every batch it trained on (ids, gathered features and labels,
blocks) and a ``.meta.json`` with the output nodes of each batch, digests of
its weights, what its own check of every batch found and, after training,
what it saw of the shared tables.
The checks:

- every batch on every rank equals the synchronous reference bit for bit:
  ``BuiltinLoader(num_replicas=W, rank=r)`` over the same data, gathered with
  ``index_select`` (the plain loop's :class:`SyncLoader`), computed here;
- with DGL's sampler, whose batches do not repeat from run to run (no
  reference can be computed here), and with the built-in one too: each rank
  compared every batch it trained on with what the plain loop reads for the
  same ids in that rank's process -- ``x`` with ``features[input_nodes]`` and
  ``y`` with ``labels[output_nodes]`` of the (shared) table, bit for bit, and
  the blocks with the ids (DGL blocks' ``dgl.NID``) -- and found no
  difference in any of the ``EPOCHS * ceil(ceil(n / W) / batch size)``
  batches;
- the ranks' shares cover each epoch as ``DistributedSampler``-style
  sharding says (one padded seed: 1,203 training nodes over two ranks);
- after training all ranks hold bit-identical weights;
- ranks on one machine read one copy of the tables: each wrote a probe row
  into its table after training and saw the other's write, and the mapping
  is the same (deleted) ``/dev/shm`` file in both; the file is gone afterwards,
  also when a rank dies while it exists.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_in_own_session

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_sage.py"
SHM = Path("/dev/shm")
HAVE_DGL = importlib.util.find_spec("dgl") is not None
EPOCHS = 2
WORLD_SIZE = 2
BATCH_SIZE = 64
# 4,010 nodes: 1,203 training nodes (odd, so one seed is padded in), 602 per rank,
# 10 batches of 64 per rank and epoch.
ARGS = ["--sampler", "builtin", "--num-nodes", "4010", "--num-classes", "4",
        "--avg-degree", "10", "--fanouts", "5,5", "--batch-size", str(BATCH_SIZE),
        "--hidden", "32", "--epochs", str(EPOCHS), "--lr", "0.01", "--log-every", "10",
        "--eval-batch-size", "512"]
CHANCE = 1 / 4
# Rank 0 alone evaluates: 200 validation nodes after each epoch, then 401 test
# nodes, batches of 512 -- one batch each time.
EVAL_BATCHES = EPOCHS + 1

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux") or not SHM.is_dir(),
                       reason="needs Linux with /dev/shm"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"),
]


@pytest.fixture(autouse=True)
def _remove_what_a_failed_job_left() -> Iterator[None]:
    """After each test (its assertions ran), remove the shared-table files it left:
    a failing job may leave them, and they would stay in /dev/shm."""
    before = set(SHM.glob("pingpong-train_sage-*"))
    yield
    for path in set(SHM.glob("pingpong-train_sage-*")) - before:
        path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shm_files(port: int) -> list[Path]:
    """This job's shared-table files (its master port is in their names)."""
    return sorted(SHM.glob(f"pingpong-train_sage-*-127.0.0.1-{port}-*"))


def torchrun_command(tmp_path: Path, nnodes: int, rank: int, nproc: int, port: int,
                     *extra: str) -> list[str]:
    """The torchrun command line of node ``rank`` of a job on 127.0.0.1:``port``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--node-rank", str(rank), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(SCRIPT), *ARGS,
            "--dump-batches", str(tmp_path / "batches.json"),
            "--json", str(tmp_path / f"node{rank}.json"), *extra]


def run_job(tmp_path: Path, nnodes: int, nproc: int, *extra: str,
            timeout: float = 150) -> tuple[int, list[tuple[int, str, str]]]:
    """Start one torchrun process per node, all at once; return the port and their results.

    Each runs in its own session (``run_in_own_session``), so a hang kills it
    and its workers, and fails the test.
    """
    port = free_port()

    def node(rank: int) -> tuple[int, str, str]:
        command = torchrun_command(tmp_path, nnodes, rank, nproc, port, *extra)
        return run_in_own_session(command, timeout=timeout, cwd=tmp_path,
                                  env=dict(os.environ, PYTHONHASHSEED="0"))

    with ThreadPoolExecutor(nnodes) as pool:
        results = list(pool.map(node, range(nnodes)))
    return port, results


# --------------------------------------------------------------------------- the reference
@pytest.fixture(scope="module")
def train_sage() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPT.parent))
        import train_sage

    return train_sage


@pytest.fixture(scope="module")
def reference(train_sage: Any) -> dict[str, Any]:
    """Per rank and epoch, what the plain synchronous loop reads: digests and output nodes."""
    from pingpong.sources import BuiltinLoader, NeighborSampler

    args = train_sage.build_parser().parse_args(ARGS)
    data = train_sage.load_dataset(args)
    data.features = data.features.to(train_sage.FEAT_DTYPES[args.feat_dtype]).contiguous()
    csr = data.sampling_graph("builtin")
    ranks = []
    for rank in range(WORLD_SIZE):
        source = BuiltinLoader(csr, data.train_idx, NeighborSampler(args.fanouts),
                               args.batch_size, shuffle=True, seed=args.seed,
                               num_replicas=WORLD_SIZE, rank=rank)
        loader = train_sage.SyncLoader(source, data.features, data.labels,
                                       torch.device("cpu"))
        digests, outputs = [], []
        for _ in range(EPOCHS):
            batches = list(loader)
            digests += [train_sage.batch_digest(b) for b in batches]
            outputs.append([b.output_nodes.tolist() for b in batches])
        ranks.append({"digests": digests, "outputs": outputs})
    return {"ranks": ranks, "train_idx": data.train_idx.tolist()}


def read_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's digests and meta report, in rank order."""
    reports = []
    for rank in range(WORLD_SIZE):
        meta = json.loads((tmp_path / f"batches.rank{rank}.meta.json").read_text())
        meta["digests"] = json.loads((tmp_path / f"batches.rank{rank}.json").read_text())
        reports.append(meta)
    return reports


def check_job(reports: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """What every torchrun job of WORLD_SIZE ranks with the built-in sampler must satisfy."""
    for report, expected in zip(reports, reference["ranks"], strict=True):
        # Every batch equals the synchronous reference of its rank, bit for bit.
        assert len(report["digests"]) == len(expected["digests"]) == EPOCHS * 10
        assert report["digests"] == expected["digests"]
        assert report["output_nodes"] == expected["outputs"]
        # BuiltinLoader pads across ranks: no rank sees a seed twice in an epoch
        # (DGL 1.1.3 pads the last rank's share with one of its own seeds).
        for epoch in report["output_nodes"]:
            share = [node for batch in epoch for node in batch]
            assert len(share) == len(set(share))
    check_shares_and_weights(reports, reference["train_idx"])
    check_every_batch_against_the_table(reports, len(reference["train_idx"]))


def check_every_batch_against_the_table(reports: list[dict[str, Any]], n_train: int) -> None:
    """Each rank checked every batch it trained on against its own tables; none differed.

    ``--dump-batches``' check (``BatchCheck``): ``x`` bit for bit
    ``features[input_nodes]``, ``y`` ``labels[output_nodes]`` of the rank's
    (shared) tables, blocks that fit the ids. Every rank takes
    ``ceil(ceil(n / W) / batch size)`` steps an epoch.
    """
    batches = EPOCHS * math.ceil(math.ceil(n_train / WORLD_SIZE) / BATCH_SIZE)
    for report in reports:
        assert sum(len(epoch) for epoch in report["output_nodes"]) == batches
        assert report["batch_check"] == {"batches_checked": batches, "batches_differing": 0,
                                         "first_differing": []}, f"rank {report['rank']}"


def check_shares_and_weights(reports: list[dict[str, Any]], train_idx: list[int]) -> None:
    """The ranks split every epoch DistributedSampler-style and end with the same weights."""
    assert [r["rank"] for r in reports] == list(range(WORLD_SIZE))
    assert {r["world_size"] for r in reports} == {WORLD_SIZE}
    # Rank 0 alone evaluated (the others waited in a barrier).
    assert [r["eval_batches"] for r in reports] == [EVAL_BATCHES] + [0] * (WORLD_SIZE - 1)
    n = len(train_idx)
    per_rank = math.ceil(n / WORLD_SIZE)
    assert n % WORLD_SIZE, "the job must exercise padding"
    for epoch in range(EPOCHS):
        shares = [r["output_nodes"][epoch] for r in reports]
        assert len({len(s) for s in shares}) == 1  # same number of steps on every rank
        nodes = [[node for batch in s for node in batch] for s in shares]
        assert all(len(share) == per_rank for share in nodes)
        counts = collections.Counter(node for share in nodes for node in share)
        assert set(counts) == set(train_idx)
        assert sum(c - 1 for c in counts.values()) == WORLD_SIZE * per_rank - n
    assert reports[0]["output_nodes"][0] != reports[0]["output_nodes"][1], "not reshuffled"
    # DDP averaged the gradients: the same trained weights everywhere. Should they
    # differ, name the first step whose averaged gradients or new weights differ.
    steps = [r["step_sha256"] for r in reports]
    assert all(len(s) == EPOCHS * 10 for s in steps)
    first = next(({"step": i, "gradients_equal": len({s[i][0] for s in steps}) == 1,
                   "weights_equal": len({s[i][1] for s in steps}) == 1}
                  for i in range(EPOCHS * 10) if len({tuple(s[i]) for s in steps}) > 1), None)
    assert first is None, f"ranks diverged: {first}"
    assert len({r["params_sha256"] for r in reports}) == 1


def check_leader_output(stdout: str, result: dict[str, Any]) -> None:
    assert f"| {WORLD_SIZE} ranks (DDP, torchrun)" in stdout
    assert len(re.findall(r"^Epoch Time\(s\): ", stdout, re.M)) == EPOCHS  # rank 0 only
    assert len(re.findall(r"^Eval Acc ", stdout, re.M)) == EPOCHS
    assert (result["world_size"], result["loader"], result["sampler"]) == (
        WORLD_SIZE, "pingpong", "builtin")
    assert len(result["losses"]) == EPOCHS * 10
    assert result["test_acc"] > CHANCE + 0.3


# --------------------------------------------------------------------------- jobs
@pytest.mark.slow  # two torchrun processes, one worker each (~30 s)
def test_two_nodes_one_rank_each(tmp_path: Path, reference: dict[str, Any]) -> None:
    """``--nnodes 2 --nproc-per-node 1``: each node's rank has its tables to itself."""
    port, nodes = run_job(tmp_path, nnodes=2, nproc=1)
    for returncode, stdout, stderr in nodes:
        assert returncode == 0, stdout + stderr
    check_leader_output(nodes[0][1], json.loads((tmp_path / "node0.json").read_text()))
    assert "Epoch Time" not in nodes[1][1]  # rank 1 prints nothing of its own
    assert not (tmp_path / "node1.json").exists()  # only rank 0 writes the summary
    reports = read_ranks(tmp_path)
    assert [r["node"] for r in reports] == [0, 1]
    check_job(reports, reference)
    assert [r["table"] for r in reports] == [{"shared": False}] * 2
    assert shm_files(port) == []


@pytest.mark.slow  # one torchrun process, two workers (~25 s)
def test_two_ranks_on_one_node_share_one_table(tmp_path: Path,
                                               reference: dict[str, Any]) -> None:
    """``--nproc-per-node 2``: both ranks read one copy, mapped from /dev/shm, then removed."""
    port, [(returncode, stdout, stderr)] = run_job(tmp_path, nnodes=1, nproc=2)
    assert returncode == 0, stdout + stderr
    check_leader_output(stdout, json.loads((tmp_path / "node0.json").read_text()))
    assert "tables shared by ranks [0, 1] of this machine" in stdout
    reports = read_ranks(tmp_path)
    assert [(r["node"], r["local_rank"]) for r in reports] == [(0, 0), (0, 1)]
    check_job(reports, reference)
    check_one_shared_table(reports, port)


def check_one_shared_table(reports: list[dict[str, Any]], port: int) -> None:
    tables = [r["table"] for r in reports]
    assert all(t["shared"] and t["ranks"] == [0, 1] for t in tables)
    # After training each rank wrote probe row i := i + 1 into its table; each
    # saw both writes, so they wrote to the same pages.
    assert [t["probe"] for t in tables] == [[[1.0], [2.0]]] * 2
    # ... which are one /dev/shm file's, removed while mapped.
    paths = tables[0]["paths"]
    assert tables[1]["paths"] == paths
    assert all(Path(p).parent == SHM and f"-127.0.0.1-{port}-" in p for p in paths.values())
    assert {t["mapping"]["inode"] for t in tables} == {tables[0]["mapping"]["inode"]}
    assert all(t["mapping"]["file"] == f"{paths['features']} (deleted)" for t in tables)
    assert all(t["paths_exist"] == [False, False] for t in tables)
    assert shm_files(port) == []


@pytest.mark.slow  # one torchrun process, two workers (~25 s)
@pytest.mark.dgl
@pytest.mark.skipif(not HAVE_DGL, reason="needs DGL")
def test_dgl_sampler_on_a_graph_file_with_two_ranks_sharing_one_table(
        tmp_path: Path, train_sage: Any, reference: dict[str, Any]) -> None:
    """DGL's ``DataLoader(use_ddp=True)`` (the default sampler with DGL) on a graph file.

    DGL's sampling does not repeat from run to run, so there is no reference
    to compute here: each rank checked every batch against its shared table
    (features, labels, the blocks' ``dgl.NID``); the shares, weights and the
    shared table are checked as for the built-in sampler.
    """
    import dgl

    graph = train_sage.load_dataset(train_sage.build_parser().parse_args(ARGS)).synthetic
    path = tmp_path / "graph.bin"
    dgl.save_graphs(str(path), [graph.to_dgl()])
    port, [(returncode, stdout, stderr)] = run_job(tmp_path, 1, 2, "--graph", str(path),
                                                   "--sampler", "dgl")
    assert returncode == 0, stdout + stderr
    assert "sampler dgl" in stdout
    assert json.loads((tmp_path / "node0.json").read_text())["test_acc"] > CHANCE + 0.3
    reports = read_ranks(tmp_path)
    check_shares_and_weights(reports, reference["train_idx"])
    check_every_batch_against_the_table(reports, len(reference["train_idx"]))
    check_one_shared_table(reports, port)


@pytest.mark.slow  # one torchrun process, two workers (~10 s)
def test_a_rank_that_dies_holding_the_shared_file_leaves_no_file(tmp_path: Path) -> None:
    """Rank 1 exits (``os._exit``) after mapping the tables: rank 0 removes the files."""
    port, [(returncode, stdout, stderr)] = run_job(tmp_path, 1, 2, "--test-crash-rank", "1",
                                                   timeout=120)
    assert returncode != 0
    found = re.search(r"test-crash-rank: rank 1 dies with (\[.*?\]) on disk: \[true, true\]",
                      stderr)
    assert found, stdout + stderr  # the files existed when it died
    paths = json.loads(found.group(1))
    assert len(paths) == 2
    assert all(f"-{port}-" in p for p in paths)
    assert not any(Path(p).exists() for p in paths)
    assert shm_files(port) == []
    assert "Epoch Time" not in stdout


@pytest.mark.slow  # one torchrun process, two workers (~10 s)
def test_torchruns_sigterm_reaches_the_writer_waiting_for_a_rank_and_leaves_no_file(
        tmp_path: Path) -> None:
    """Rank 1 hangs after mapping the tables; torchrun, stopped with SIGTERM, passes it
    on to its workers. Rank 0, the writer, is waiting for rank 1 then: its handler
    unwinds to the clean-up, which removes the files (Python's default would end it
    on the spot and leave them)."""
    port = free_port()
    command = torchrun_command(tmp_path, 1, 0, 2, port, "--test-hang-rank", "1")
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=tmp_path,
                                env=dict(os.environ, PYTHONHASHSEED="0"),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        pattern = r"test-hang-rank: rank 1 hangs with (\[.*?\]) on disk: \[true, true\]"
        while (found := re.search(pattern, err.read_text())) is None:
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        paths = [Path(p) for p in json.loads(found.group(1))]
        assert len(paths) == 2
        assert all(f"-{port}-" in str(p) for p in paths)
        assert all(p.exists() for p in paths)
        proc.send_signal(signal.SIGTERM)  # to torchrun, as a scheduler stops a job
        returncode = proc.wait(timeout=90)
        assert returncode != 0
        assert not any(p.exists() for p in paths), err.read_text()
        assert shm_files(port) == []
        assert "Epoch Time" not in out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --------------------------------------------------------------------------- the environment
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_the_launch_is_read_from_torchruns_environment(train_sage: Any) -> None:
    assert train_sage.launch_from_env({"MASTER_ADDR": "h", "PATH": "/bin"}) is None
    launch = train_sage.launch_from_env(
        dict(TORCHRUN_ENV, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", GROUP_RANK="1",
             TORCHELASTIC_RUN_ID="job7"))
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size,
            launch.node, launch.run_id) == (3, 4, 1, 2, 1, "job7")
    # Without GROUP_RANK a node is named by its first rank.
    assert train_sage.launch_from_env(dict(TORCHRUN_ENV, RANK="3", WORLD_SIZE="4",
                                           LOCAL_RANK="1")).node == 2


@pytest.mark.parametrize(("env", "match"), [
    ({"RANK": "1"}, "not WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    (dict(TORCHRUN_ENV, MASTER_PORT=""), "not MASTER_PORT"),
    (dict(TORCHRUN_ENV, RANK="2"), "inconsistent"),
    (dict(TORCHRUN_ENV, LOCAL_RANK="2"), "inconsistent"),  # LOCAL_RANK = LOCAL_WORLD_SIZE
    (dict(TORCHRUN_ENV, LOCAL_WORLD_SIZE="3"), "inconsistent"),  # more than WORLD_SIZE
    (dict(TORCHRUN_ENV, LOCAL_RANK="x"), "integers"),
])
def test_a_partial_or_inconsistent_environment_is_refused(train_sage: Any, env: dict[str, str],
                                                          match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train_sage.launch_from_env(env)


@pytest.mark.parametrize(("env", "argv", "match"), [
    (TORCHRUN_ENV, ["--nprocs", "2"], "--nproc-per-node"),
    ({"LOCAL_RANK": "0"}, [], "start the script with torchrun"),
    ({}, ["--shm-dir", "/tmp"], "under torchrun only"),
])
def test_flags_that_do_not_fit_the_launch_are_argparse_errors(
        train_sage: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        env: dict[str, str], argv: list[str], match: str) -> None:
    for name in (*TORCHRUN_ENV, "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def must_not_start(*args: Any, **kwargs: Any) -> None:
        # A flag let through would start ranks or wait in init_process_group for
        # ranks that never come: fail at once rather than at pytest-timeout's limit.
        raise AssertionError("the launch went ahead: the flags were not refused")

    monkeypatch.setattr(torch.distributed, "init_process_group", must_not_start)
    monkeypatch.setattr(torch.multiprocessing, "spawn", must_not_start)
    with pytest.raises(SystemExit) as exc:
        train_sage.main([*ARGS, *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


# --------------------------------------------------------------------------- the shared files
def test_a_shared_table_file_replaces_a_stale_one_and_is_checked_when_mapped(
        train_sage: Any, tmp_path: Path) -> None:
    """The writer replaces a file a crashed run of the same job left; a rank maps the
    file (the same pages, not a copy) only if it holds exactly the table it loaded."""
    table = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    path = tmp_path / "job.features"
    path.write_bytes(b"left by a crashed run")
    written = train_sage.write_shared_table(path, table)
    assert path.stat().st_size == 48
    assert torch.equal(written, table)
    mapped = train_sage.map_shared_table(path, table)
    assert torch.equal(mapped, table)
    mapped[1, 2] = -7.0  # one set of pages: the writer's view sees it
    assert float(written[1, 2]) == -7.0
    mapped[1, 2] = 5.0
    other = table.clone()
    other[3, 2] = 0.5  # one element differs: another job's or another dataset's table
    with pytest.raises(ValueError, match="differs from the table this rank loaded"):
        train_sage.map_shared_table(path, other)
    for rows in (3, 5):  # a file of another size is refused, whichever way it differs
        with pytest.raises(ValueError, match=rf"holds 48 bytes, but a torch.float32 table "
                                             rf"of shape \({rows}, 3\) takes {rows * 12}"):
            train_sage.map_shared_table(path, torch.zeros(rows, 3))


def test_shared_table_files_go_under_shm_dir(train_sage: Any, tmp_path: Path) -> None:
    """``--shm-dir`` names the folder; the default is /dev/shm. The names carry the
    job (master address and port) and the machine's first rank."""
    launch = train_sage.launch_from_env(dict(TORCHRUN_ENV, RANK="3", WORLD_SIZE="4",
                                             LOCAL_RANK="1"))
    parser = train_sage.build_parser()
    for argv, folder in (([], SHM), (["--shm-dir", str(tmp_path)], tmp_path)):
        paths = train_sage.shared_table_paths(parser.parse_args([*ARGS, *argv]), launch, 2)
        assert sorted(paths) == ["features", "labels"]
        for name, path in paths.items():
            assert path.parent == folder
            assert path.name.startswith(f"pingpong-train_sage-u{os.getuid()}-none-127.0.0.1-"
                                        "29500-rank2-")
            assert path.suffix == f".{name}"
