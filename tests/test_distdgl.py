"""DistDGL through pingpong: 2 partitions, servers and trainers as real processes on 127.0.0.1.

Each job is ``tests/_subprocess_scripts/distdgl_job.py`` (or the example,
``examples/train_dist.py``) run in its own session: it partitions a small
synthetic graph, starts two DGL servers and two trainers with the
environment DGL's launch script gives them, and writes what each process
saw; these tests read it. After every job, each process it started must be
gone (pid and process group) and nothing new left in /dev/shm.

Skipped without DGL, or where DistDGL cannot run at all (not Linux, no
writable /dev/shm, no 127.0.0.1); any other failure fails.
``PINGPONG_DISTDGL_BREAK=wrong-pull|no-ddp|no-exclude|in-range|no-rpc-lock|no-turn|
no-drain|no-end|no-close|no-timeout|no-watch|no-signal|leak`` breaks the job on
purpose (the script says how), to see these tests fail.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import default_sigint, run_in_own_session, still_running

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "_subprocess_scripts" / "distdgl_job.py"
EXAMPLE = ROOT / "examples" / "train_dist.py"
TIMEOUT_S = 15.0  # the loader's timeout in the server-loss jobs (distdgl_job.TIMEOUT_S)
JOB_LIMIT_S = 150  # hard limit per job; the job's own deadline is 110 s

pytestmark = [pytest.mark.dgl, pytest.mark.slow]
# A variant whose DGL-facing part another test here covers: more sampler processes,
# or the example launcher's own paths. CI runs these with DGL 1.1.3 only
# (tox.ini: torch221-dgl21 deselects them; a job takes 15-35 s).
variant = pytest.mark.dgl_variant


def variant_of(mode: str) -> Any:
    """``mode`` as a parameter marked :data:`variant`."""
    return pytest.param(mode, marks=variant)


def distdgl_unavailable() -> str | None:
    """Why DistDGL cannot start on this machine at all, or None."""
    if not sys.platform.startswith("linux"):
        return "DistDGL on one host is tested on Linux only (process groups, /dev/shm)"
    if importlib.util.find_spec("dgl") is None:
        return "needs DGL"
    try:
        import dgl.distributed  # noqa: F401
        from dgl.dataloading import DistNodeDataLoader  # noqa: F401
    except ImportError as exc:
        return f"dgl.distributed does not import here: {exc!r}"
    if not os.access("/dev/shm", os.W_OK):
        return "no writable /dev/shm (DGL's servers share their tables through it)"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
    except OSError as exc:
        return f"cannot listen on 127.0.0.1: {exc}"
    return None


@pytest.fixture(scope="module")
def part_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One partition of the job's graph for the whole module (the first job writes it)."""
    reason = distdgl_unavailable()
    if reason is not None:
        pytest.skip(reason)
    return tmp_path_factory.mktemp("parts")


def run_job(mode: str, out: Path, part_dir: Path, env: dict[str, str] | None = None,
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run one job (``env``: more environment for all its processes); return its
    job.json and the ranks' JSON (missing ones as {}).

    Whatever happens, every process it started must be gone afterwards. Their
    temporary files go under ``out``: a trainer that leaves with ``os._exit`` after
    a server is lost leaves its ``multiprocessing`` temporary directory behind.
    """
    (out / "tmp").mkdir(exist_ok=True)
    shm_before = shm_entries()
    try:
        returncode, stdout, stderr = run_in_own_session(
            [sys.executable, str(JOB), mode, str(out), str(part_dir)], timeout=JOB_LIMIT_S,
            env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(out / "tmp"), **(env or {})))
        assert returncode == 0, stdout[-3000:] + stderr[-3000:] + job_logs(out)
    finally:
        if (out / "pids.json").exists():
            assert_all_gone(out / "pids.json", shm_before)
    job = json.loads((out / "job.json").read_text())
    ranks = [json.loads(p.read_text()) if p.exists() else {}
             for p in (out / f"rank{r}.json" for r in range(2))]
    return job, ranks


def run_clean_job(mode: str, out: Path, part_dir: Path, env: dict[str, str] | None = None,
                  ) -> list[dict[str, Any]]:
    """:func:`run_job`, which must end with both trainers and both servers exiting 0;
    the ranks' JSON."""
    job, ranks = run_job(mode, out, part_dir, env)
    assert [t["exit"] for t in job["trainers"].values()] == ["exit code 0"] * 2
    assert job["servers"] == {"0": "exit code 0", "1": "exit code 0"}, job_logs(out)
    return ranks


def job_logs(out: Path) -> str:
    """The tails of a job's server and trainer logs, for a failure message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(out.glob("*.log")))


# --------------------------------------------------------------------------- processes
def live_members(pgid: int) -> list[psutil.Process]:
    """Processes of group ``pgid`` that are not zombies."""
    members = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


def shm_entries() -> set[str]:
    """The names now in /dev/shm. A job may leave none of its own there: not its
    tables (named by its token or by the graph's name), nor multiprocessing's named
    semaphores (``sem.mp-*``, unlinked by a process's resource tracker unless the
    tracker is killed with it), nor anything else."""
    return {p.name for p in Path("/dev/shm").iterdir()}


def shm_held() -> set[str]:
    """The names in /dev/shm that a live process has mapped or open: another
    program's (a test run beside this one), not a dead job's leftovers."""
    held = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if (at := line.find("/dev/shm/")) >= 0:
                    held.add(line[at + len("/dev/shm/"):].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        held.add(target[len("/dev/shm/"):])
    return held


def assert_all_gone(pid_file: Path, shm_before: set[str], grace: float = 5.0) -> None:
    """Every process in ``pid_file`` has exited, its process group is empty, and the
    job left nothing in /dev/shm: no entry that was not there before it
    (``shm_before``, from :func:`shm_entries`) and that no live process holds
    (:func:`shm_held`; the job's are all gone by then). Kills what is left (so a
    failing test leaves no orphan) and then fails."""
    entries = json.loads(pid_file.read_text())
    deadline = time.monotonic() + grace
    while True:
        alive = [e for e in entries
                 if still_running(e["pid"])
                 or live_members(e["pgid"])]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for entry in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(entry["pgid"], signal.SIGKILL)
    assert not alive, f"processes left running after the job: {alive}"
    leftovers = sorted(shm_entries() - shm_before - shm_held())
    assert not leftovers, f"shared memory left in /dev/shm: {leftovers}"


def assert_two_equal_epochs(epochs: list[dict[str, Any]]) -> None:
    """Two reshuffled epochs, each covering the trainer's share once, every batch
    equal to the synchronous pulls and to the original tables."""
    assert len(epochs) == 2
    for e in epochs:
        assert e["batches"] == e["len_loader"] > 1
        assert e["mismatch_vs_sync_pull"] == 0
        assert e["mismatch_vs_original"] == 0
        assert e["seeds_are_train_share"]  # every seed of the share, once
    assert epochs[0]["order_sha256"] != epochs[1]["order_sha256"], "not reshuffled"


# --------------------------------------------------------------------------- tests
def assert_negatives_seed_edges_and_one_warning(report: dict[str, Any]) -> None:
    """An edge-prediction trainer's report (``exclude="self"``): negatives sampled,
    seed edges left in the blocks by DGL (if a DGL version honours ``exclude``,
    this and the warning go), pingpong's one warning about it, and rows both read
    in place and pulled."""
    assert report["negatives"] > 0
    assert report["seed_edges_in_blocks"] > 0
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "exclude='self'" in report["warnings"][0]
    assert "ignores exclude_edges" in report["warnings"][0]
    assert report["stats"]["rows_read_in_place"] > 0
    assert report["stats"]["rows_fetched"] > 0


def expected_samplers(mode: str) -> int:
    """DGL sampler processes per trainer the mode asks for (``distdgl_job.py``)."""
    digits = mode.rpartition("-samplers")[2]
    return int(digits) if digits.isdigit() else int(mode.endswith("-samplers"))


@pytest.mark.parametrize("mode", ["equal", "equal-samplers", variant_of("equal-samplers2"),
                                  "byvalue-samplers3"])
def test_pingpong_over_distnodedataloader_equals_synchronous_pulls(
        part_dir: Path, tmp_path: Path, mode: str) -> None:
    """Two shuffled epochs on both trainers: every batch pingpong delivered equals
    ``feat[input_nodes]`` / ``label[output_nodes]`` pulled synchronously from the
    DistTensors, bit for bit, and the original tables through DGL's renumbering.
    ``equal-samplers``: the same with a DGL sampler process per trainer,
    ``equal-samplers2`` with two (whose batches arrive in the order they finish);
    ``byvalue-samplers3`` with three told to send small tensors by value: then no
    batch's ids come as shared memory (with sampler processes otherwise, every one)."""
    ranks = run_clean_job(mode, tmp_path, part_dir)  # servers shut down by DGL's last trainer
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    by_value = mode.startswith("byvalue")
    for report in ranks:
        batches = sum(e["batches"] for e in report["epochs"])
        assert report["by_value_told"] == (expected_samplers(mode) if by_value else None)
        assert report["shared_batches"] == (
            0 if by_value or not expected_samplers(mode) else batches)
    for report in ranks:
        assert report["loader"] == "PingPongLoader"
        epochs = report["epochs"]
        assert_two_equal_epochs(epochs)
        assert report["stats"]["batches"] == sum(e["batches"] for e in epochs)
        assert report["stats"]["fetch_s"] > 0  # the rows came through the row sources
        # A DistDGL client's producers keep their priority by default (measured mixed).
        assert report["producer_nice"] == 0
        assert report["stats"]["niced_epochs"] == 0
        assert report["stats"]["epochs"] == 2
        # ... those of this machine's partition straight from its shared memory (no pull),
        # the others through DGL's pull.
        # Found without a call into DGL per batch: the partition is one id range
        # (on one host every trainer is DGL's machine 0: partition 0).
        first, stop, count = report["local_ids_by_policy"]
        assert stop - first == count < report["num_nodes"]
        assert report["local_id_ranges"] == [[first, stop]] * 2  # feat, label
        local = sum(e["local_rows"] for e in epochs)
        assert report["stats"]["rows_read_in_place"] == local > 0
        assert report["stats"]["rows_fetched"] == sum(
            e["rows"] + e["label_rows"] for e in epochs) - local > 0
        # Both servers were watched through two epochs, and never reported gone.
        assert [w.split(" 127.0.0.1:")[0] for w in report["watched"]] == [
            "DGL server 0", "DGL server 1"]
    # Each trainer has its own share (node_split), of the same size (DDP steps in step).
    shares = [set(r["train_share"]) for r in ranks]
    assert len(shares[0]) == len(shares[1]) > 0
    assert not shares[0] & shares[1]
    assert ranks[0]["epochs"][0]["batches"] == ranks[1]["epochs"][0]["batches"]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # DDP averaged them


def test_pingpong_over_a_heterogeneous_distgraph_equals_synchronous_pulls(
        part_dir: Path, tmp_path: Path) -> None:
    """Paper and author nodes, a DistTensor per node type (float32 and float64 of
    another width) and paper labels, ``heterogeneous=True``: two shuffled epochs on
    both trainers, every table of every batch bit-identical to the synchronous pulls
    and to the original tables; each node type's local partition read in place. An
    R-GCN-style DDP model trains on the batches: both trainers end with the same
    weights (``no-ddp``: they do not)."""
    ranks = run_clean_job("hetero-equal", tmp_path, part_dir)
    for report in ranks:
        epochs = report["epochs"]
        assert_two_equal_epochs(epochs)
        assert [e["node_types_seen"] for e in epochs] == [["author", "paper"]] * 2
        assert report["dtypes"] == {"paper": "torch.float32", "author": "torch.float64"}
        # Partition 0 of each node type is one id range from 0, read in place.
        ranges = report["local_id_ranges"]
        assert set(ranges) == {"features['paper']", "features['author']", "labels['paper']"}
        assert all(r is not None and r[0] == 0 < r[1] for r in ranges.values()), ranges
        local = sum(e["local_rows"] for e in epochs)
        assert report["stats"]["rows_read_in_place"] == local > 0
        assert report["stats"]["rows_fetched"] == sum(e["rows"] for e in epochs) - local > 0
        assert len(report["losses"]) == sum(e["batches"] for e in epochs)
        assert all(math.isfinite(loss) for loss in report["losses"])
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]


def test_pingpong_over_distedgedataloader_equals_synchronous_pulls(
        part_dir: Path, tmp_path: Path) -> None:
    """Edge prediction on DistDGL: ``DistEdgeDataLoader`` with negative sampling and
    ``exclude="self"``, passed as it is; every batch's features equal
    ``feat[input_nodes]``, bit for bit, and the positive edges cover the trainer's edge
    ids once. DGL ignores ``exclude`` on a ``DistGraph`` (its ``sample_neighbors``
    drops ``exclude_edges``; 1.1.3 and 2.1.0): the blocks hold seed edges, and
    pingpong warns about it, once (``no-exclude``: no exclude asked for, no warning)."""
    ranks = run_clean_job("edge-equal", tmp_path, part_dir)
    for report in ranks:
        assert report["batch_types"] == ["NegativeEdgeBatch"]
        assert report["batches"] == report["len_loader"] > 1
        assert report["mismatch_vs_sync_pull"] == 0
        assert report["edges_are_share"]
        assert_negatives_seed_edges_and_one_warning(report)


def test_edge_prediction_on_a_heterogeneous_distgraph_equals_synchronous_pulls(
        part_dir: Path, tmp_path: Path) -> None:
    """``DistEdgeDataLoader`` on the heterogeneous DistGraph, seed edges of two edge
    types, uniform negatives, ``exclude="self"``, a DistTensor per node type,
    ``heterogeneous=True``, edge labels by edge type (a DistTensor per type, keyed by
    a name and a canonical triple): every table of every batch equals the
    synchronous pulls and the original tables, bit for bit; the positive edges of
    each type cover the trainer's share once; DGL leaves seed edges in the blocks of
    a heterogeneous DistGraph too, and pingpong warns once (``no-exclude``: no
    warning)."""
    ranks = run_clean_job("edge-hetero", tmp_path, part_dir)
    for report in ranks:
        assert report["batch_types"] == ["NegativeEdgeBatch"]
        assert report["batches"] == report["len_loader"] > 1
        assert report["node_types_seen"] == ["author", "paper"]
        assert report["mismatch_vs_sync_pull"] == 0
        assert report["mismatch_vs_original"] == 0
        assert report["label_keys"] == ["('author', 'writes', 'paper')", "cites"]
        assert report["label_rows"] > 0
        assert report["label_mismatch_vs_sync_pull"] == 0
        assert report["label_mismatch_vs_original"] == 0
        assert report["edges_are_share"] == {"cites": True, "writes": True}
        assert_negatives_seed_edges_and_one_warning(report)


def test_edge_labels_over_distedgedataloader_equal_synchronous_pulls(
        part_dir: Path, tmp_path: Path) -> None:
    """Edge classification: ``DistEdgeDataLoader`` (seed edges from both partitions)
    with ``edge_labels=g.edata["label"]``: every batch's x and y equal the pulls at
    ``input_nodes`` and ``pair_graph.edata[dgl.EID]`` and the original tables; the
    local edge partition is one id range, its labels read in place (counted)."""
    ranks = run_clean_job("edge-labels", tmp_path, part_dir)
    for report in ranks:
        assert report["batch_types"] == ["EdgeBatch"]
        assert report["batches"] == report["len_loader"] > 1
        assert report["mismatch_vs_sync_pull"] == 0
        assert report["mismatch_vs_original"] == 0
        assert report["edges_are_share"]
        ranges = report["local_id_ranges"]
        assert set(ranges) == {"features", "edge_labels"}
        assert all(r is not None and r[0] == 0 < r[1] for r in ranges.values()), ranges
        assert report["stats"]["rows_read_in_place"] == report["local_rows"] > 0
        assert report["stats"]["rows_fetched"] == report["rows"] - report["local_rows"] > 0


def test_an_epoch_left_early_then_another_loader_and_a_zip_of_two(
        part_dir: Path, tmp_path: Path) -> None:
    """Eight times: two batches of a training loader, ``break``, then a whole epoch of a
    validation loader at once; then both loaders in one ``zip``; then an epoch whose
    training thread pulls rows itself, in ``pingpong.rpc_turn()``. The producers and
    the training thread take turns in DGL's RPC client (one per process, not
    thread-safe): no error, every batch and pull right. Without the lock
    (``no-rpc-lock``), or with the training thread's pulls outside the turn
    (``no-turn``), DGL mixes up the replies (``KeyError``).

    Then two loaders over the validation ``DistNodeDataLoader``, whose ``iter()``
    restarts the one iterator both read (from a code review: each loader's
    wrapper hid it, and a ``zip`` of the two silently split its batches): the
    newer ``iter()`` ends the other's epoch, as over a persistent-worker
    DataLoader, and a whole epoch of each is exact.

    Then an epoch left while its producer is inside a DGL step that takes 4 s (a
    stalling sampler): a new epoch of the same loader, and of another loader over
    the same DGL loader, waits for that producer to leave DGL's loader before it
    restarts it (it was refused after 2 s for a while); it is whole and exact."""
    ranks = run_clean_job("early-exit", tmp_path, part_dir)
    for report in ranks:
        assert report["errors"] == [], job_logs(tmp_path)
        val = report["val_batches"]
        assert report["train_batches"] > val > 1  # the zip ends with the validation loader
        assert report["own_pulls"] == report["train_batches"]
        assert report["checked"] == 8 * (2 + val) + 2 * val + report["train_batches"]
        assert report["shared"] == ["zip: superseded", "nested: superseded"]
        assert report["shared_checked"] == 1 + val + 2 * val
        assert report["under_a_stuck_step"] == ["same loader: whole", "another loader: whole"]
        assert report["wrong"] == 0


@pytest.mark.parametrize("mode", ["temporary", "temporary-samplers"])
def test_temporary_loaders_over_one_distnodedataloader(mode: str, part_dir: Path,
                                                       tmp_path: Path) -> None:
    """``for batch in PingPongLoader(dist_loader, ...)``, never named or closed: three
    left after two batches, two whole epochs with a whole validation epoch nested
    twice in each (inner temporary loaders), then a ``zip`` of two temporary
    loaders; each new loader over the same DGL loader as the one abandoned before
    it. No error, every batch right, each whole epoch exactly the trainer's seeds,
    the zip as long as the shorter loader, no pingpong thread left; also with a DGL
    sampler process per trainer (whose batches for the abandoned passes are still
    on their way)."""
    ranks = run_clean_job(mode, tmp_path, part_dir)
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    for report in ranks:
        assert report["errors"] == [], job_logs(tmp_path)
        assert report["wrong"] == 0
        assert report["whole_epochs_are_share"] == [True, True]
        assert report["zipped"] == report["expected_zipped"] > 0
        assert report["whole_epoch_batches"] == [report["train_batches"]] * 2
        assert report["nested_val_batches"] == 2 * 2 * report["val_batches"] > 0
        assert report["checked"] == (3 * 2 + 2 * report["train_batches"]
                                     + report["nested_val_batches"] + 2 * report["zipped"])
        assert report["pingpong_threads_left"] == []


@pytest.mark.parametrize("mode", ["close-thread", "close-thread-samplers"])
def test_close_from_another_thread_mid_epoch_then_a_new_loader(mode: str, part_dir: Path,
                                                               tmp_path: Path) -> None:
    """A timer thread closes the loader while the training loop runs, three times at
    different moments: each time the loop gets ``LoaderClosedError`` part-way through
    the epoch and ``close()`` returns (within its 2 s wait for a producer inside DGL,
    plus slack); a new loader over the same ``DistNodeDataLoader`` then runs a whole
    epoch of the trainer's seeds, every batch right; also with a DGL sampler process
    per trainer (``no-close``: the loops run to the end)."""
    ranks = run_clean_job(mode, tmp_path, part_dir)
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    for report in ranks:
        assert report["wrong"] == 0
        n = report["train_batches"]
        for r in report["rounds"]:
            assert r["ended_by"] == "LoaderClosedError", r
            assert 0 < r["delivered"] < n, r
            assert r["close_s"] is not None, r
            assert r["close_s"] < 5.0, r
            assert r["next_epoch_error"] is None, r
            assert r["next_epoch_batches"] == n, r
            assert r["next_epoch_is_share"], r
        assert report["checked"] == sum(r["delivered"] for r in report["rounds"]) + 3 * n


@pytest.mark.parametrize("mode", ["break-samplers", variant_of("break-samplers2"),
                                  variant_of("break-samplers3")])
def test_epochs_left_early_with_dgl_sampler_processes_leave_no_batches_behind(
        mode: str, part_dir: Path, tmp_path: Path) -> None:
    """DGL's sampler processes keep preparing the batches of a pass left early; pingpong
    receives and drops them before the next pass, so each whole epoch after three left
    early has exactly the trainer's seeds (without that, ``no-drain``, it starts with
    the old pass's batches and misses its own last ones); with one, two and three
    sampler processes per trainer."""
    ranks = run_clean_job(mode, tmp_path, part_dir)
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    for report in ranks:
        assert report["wrong"] == 0
        whole = report["whole_epochs"]
        assert [e["batches"] for e in whole] == [whole[0]["len_loader"]] * 2
        assert report["checked"] == 3 * 2 + 2 * whole[0]["len_loader"]
        assert [e["seeds_are_train_share"] for e in whole] == [True, True]
        assert report["dropped"] > 0  # DGL had batches in flight at each break


@pytest.mark.parametrize("mode", ["bad-id", "bad-id-samplers", variant_of("bad-id-samplers2")])
def test_out_of_range_id_is_refused_before_any_pull(mode: str, part_dir: Path,
                                                    tmp_path: Path) -> None:
    """Batch 2 carries id N: IdRangeError in the training loop, and the DistTensors
    were pulled for batches 0 and 1 only -- never with the bad id (also with a DGL
    sampler process per trainer)."""
    ranks = run_clean_job(mode, tmp_path, part_dir)
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    for report in ranks:
        assert report["exception"] == "IdRangeError"
        assert report["is_id_range_error"]
        assert f"= {report['num_rows']} is out of range" in report["message"]
        assert report["delivered"] == report["bad_batch"] == 2
        assert report["feature_pulls"] == report["label_pulls"] == 2


def test_out_of_range_seeds_of_dgls_distributed_loaders_are_refused_when_built(
        part_dir: Path, tmp_path: Path) -> None:
    """A ``DistNodeDataLoader`` seeded with node id N and a ``DistEdgeDataLoader``
    seeded with edge id E: ``IdRangeError`` naming the loader and the seed when the
    ``PingPongLoader`` is built, before anything is sampled.  (Unchecked, the node
    seed surfaced only at its batch, as an input node out of range; DGL sampled
    the edge seed without a word and the epoch ended normally.)"""
    ranks = run_clean_job("edge-bad-seed", tmp_path, part_dir)
    for report in ranks:
        for kind, loader, count in (("node", "DistNodeDataLoader", report["num_nodes"]),
                                    ("edge", "DistEdgeDataLoader", report["num_edges"])):
            assert report[kind] is not None, kind
            assert report[kind]["exception"] == "IdRangeError"
            assert (f"the DGL {loader}'s seed {kind} ids include {count}, outside the "
                    f"graph's {count} {kind}s") in report[kind]["message"]


def test_out_of_range_id_of_one_node_type_is_refused_before_any_pull(
        part_dir: Path, tmp_path: Path) -> None:
    """Heterogeneous: batch 2 carries author id N among valid paper ids: IdRangeError
    naming the author table, and no table -- not even the papers' -- was pulled
    for that batch."""
    ranks = run_clean_job("hetero-bad-id", tmp_path, part_dir)
    for report in ranks:
        assert report["exception"] == "IdRangeError"
        assert report["is_id_range_error"]
        assert f"= {report['num_rows']} is out of range" in report["message"]
        assert "input_nodes['author']" in report["message"]
        assert report["delivered"] == report["bad_batch"] == 2
        assert report["pulls"] == {"paper": 2, "author": 2, "label": 2}


@pytest.mark.parametrize("mode", ["server-stop", "server-stop-samplers",
                                  variant_of("server-stop-samplers2"), "server-stop-hetero"])
def test_server_stopped_mid_epoch_raises_batch_timeout(mode: str, part_dir: Path,
                                                       tmp_path: Path) -> None:
    """SIGSTOP to server 1 in the second epoch: it stays connected but never answers, so
    DGL's pull waits for ever; the loader's timeout= turns that into BatchTimeoutError
    in the training loop of the trainers waiting on it, and no process hangs (also
    with a DGL sampler process per trainer, which waits on the server too, and on the
    heterogeneous graph, a table per node type: ``server-stop-hetero``)."""
    job, ranks = run_job(mode, tmp_path, part_dir)
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    assert [e["signal"] for e in job["events"]] == ["SIGSTOP"]
    ends = job["trainers"]
    print("trainers:", json.dumps(ends), "reports:", json.dumps(ranks))
    for rank, end in ends.items():
        assert not end["hung"], f"trainer {rank} hung"
        assert end["returncode"] == 3, f"trainer {rank}: {end['exit']}"  # its loop raised
        assert ranks[int(rank)]["exception"] is not None
        assert end["after_disturbance_s"] < TIMEOUT_S + 30
    timed_out = [r for r in ranks if r.get("is_batch_timeout")]
    assert timed_out, "no trainer got BatchTimeoutError"
    for report in timed_out:
        assert f"timeout={TIMEOUT_S}" in report["message"]


@pytest.mark.parametrize("mode", ["server-kill", "server-kill-samplers",
                                  variant_of("server-kill-samplers2"), "server-kill-hetero"])
def test_server_killed_mid_epoch_raises_server_gone_in_every_training_loop(
        mode: str, part_dir: Path, tmp_path: Path) -> None:
    """SIGKILL to server 1 in the second epoch: the training loops get ServerGoneError
    naming it, within seconds (well before the loader's timeout), instead of DGL's
    sender thread aborting the process at its next send; no process hangs -- also with
    a DGL sampler process per trainer (``server-kill-samplers``), which must be gone
    afterwards like every other process; with two (``server-kill-samplers2``); and on
    the heterogeneous graph, a table per node type (``server-kill-hetero``).

    DDP's race, seen in CI: a trainer that still had a batch ready is inside a
    collective when the other leaves on its ServerGoneError, and gets the process
    group's error instead. Allowed only after another trainer's ServerGoneError, and
    then the loader's ``server_watch.check()`` (what the docs advise) must name the
    server."""
    job, ranks = run_job(mode, tmp_path, part_dir)
    assert_server_1_gone_in_training_loops(mode, job, ranks, tmp_path)


def assert_killed_once_and_trainers_raised(job: dict[str, Any], ranks: list[dict[str, Any]],
                                           out: Path) -> dict[str, Any]:
    """One SIGKILL, and every trainer left with the exit status of an exception in its
    training loop (3), none hung; the trainers' ends."""
    assert [e["signal"] for e in job["events"]] == ["SIGKILL"]
    ends = job["trainers"]
    print("trainers:", json.dumps(ends), "reports:", json.dumps(ranks))
    for rank, end in ends.items():  # first how each ended: an aborted one wrote no report
        assert not end["hung"], f"trainer {rank} hung"
        log = (out / f"trainer-{rank}.log").read_text(errors="replace")
        assert end["returncode"] == 3, f"trainer {rank}: {end['exit']}\n{log[-2000:]}"
    return ends


def assert_server_1_gone_in_training_loops(mode: str, job: dict[str, Any],
                                           ranks: list[dict[str, Any]], out: Path,
                                           tensorpipe: bool = False) -> None:
    """A ``server-kill`` job's ends: what the test above asserts."""
    ends = assert_killed_once_and_trainers_raised(job, ranks, out)
    assert [r["sampler_processes"] for r in ranks] == [expected_samplers(mode)] * 2
    gone_at = [r["at"] for r in ranks if r["exception"] == "ServerGoneError"]
    assert gone_at, "no training loop got ServerGoneError"
    for rank, end in ends.items():
        report = ranks[int(rank)]
        if report["exception"] == "ServerGoneError":
            message = report["message"]
        else:  # the process group's error (gloo: "Connection closed by peer")
            assert report["exception"] in ("RuntimeError", "DistBackendError"), report
            assert report["at"] > min(gone_at), report
            message = report["watch_after"]
        assert message is not None, report
        assert message.startswith("DGL server 1 at 127.0.0.1:"), report
        # With sampler processes DGL aborts the sampler process at its send to the
        # lost server, and the trainer's read from it often fails before the watch
        # sees the server gone: that failure is kept as the cause.
        causes = ((None,) if expected_samplers(mode) == 0
                  else (None, "ConnectionResetError", "EOFError"))
        assert report["cause"] in causes, report
        assert end["after_disturbance_s"] < 5.0  # the watch, not timeout= (15 s)
        assert report["steps"] > 0
    assert_watched_both_servers(ranks, tensorpipe)


def assert_watched_both_servers(ranks: list[dict[str, Any]], tensorpipe: bool = False) -> None:
    """Each trainer's loader watched its connections to both servers: one to each
    with DGL's socket backend, several with ``tensorpipe``."""
    for report in ranks:
        names = [w.split(" 127.0.0.1:")[0] for w in report["watched"]]
        if tensorpipe:
            assert sorted(set(names)) == ["DGL server 0", "DGL server 1"], names
        else:
            assert names == ["DGL server 0", "DGL server 1"]


def test_server_killed_while_a_trainer_is_in_ddp_all_reduce(
        part_dir: Path, tmp_path: Path) -> None:
    """DDP's race made to happen: trainer 1 has one batch more in hand than trainer 0
    when server 1 is killed. Trainer 0's loop gets ServerGoneError and it leaves;
    trainer 1, inside the all-reduce of that batch, gets the process group's error
    (gloo), and the loader's ``server_watch.check()`` then raises ServerGoneError
    naming the server -- the handling ``docs/distributed.rst`` shows."""
    job, ranks = run_job("server-kill-ddp-race", tmp_path, part_dir)
    assert_killed_once_and_trainers_raised(job, ranks, tmp_path)
    first, second = ranks
    assert first["exception"] == "ServerGoneError", first
    assert first["message"].startswith("DGL server 1 at 127.0.0.1:")
    assert second["exception"] in ("RuntimeError", "DistBackendError"), second
    assert "by peer" in second["message"], second  # "closed by peer", "reset by peer"
    assert second["at"] > first["at"]
    assert second["watch_after"] is not None, second
    assert second["watch_after"].startswith("DGL server 1 at 127.0.0.1:")
    assert second["steps"] == first["steps"]  # its last step is the one that failed


def test_a_pull_of_the_trainers_own_after_a_server_died_raises_server_gone(
        part_dir: Path, tmp_path: Path) -> None:
    """A ``DistTensor`` pull the training loop makes itself (in ``rpc_turn()``) once
    the loader's watch has seen server 1 die: ServerGoneError naming it, not a trainer
    aborted by DGL's sender thread (SIGABRT) -- the pull goes through DGL's
    ``rpc.fast_pull``, which the watch guards as it guards ``send_rpc_message``."""
    job, ranks = run_job("server-kill-own-pull", tmp_path, part_dir)
    ends = assert_killed_once_and_trainers_raised(job, ranks, tmp_path)
    for rank, end in ends.items():
        report = ranks[int(rank)]
        assert report["watch_saw_loss"], report
        assert report["exception"] == "ServerGoneError", report
        assert report["message"].startswith("DGL server 1 at 127.0.0.1:"), report
        assert report["cause"] is None, report
        assert report["steps"] > 0
        assert end["after_disturbance_s"] < 10.0
    assert_watched_both_servers(ranks)


def test_a_loader_built_after_a_server_died_raises_server_gone(
        part_dir: Path, tmp_path: Path) -> None:
    """From a DistDGL review: server 1 killed while no loader was open. The next
    loader found no ESTABLISHED connection to it (CLOSE_WAIT), built no server
    watch, and DGL aborted both trainers (SIGABRT) at the sampler's first send.
    A connection that is no longer ESTABLISHED is now watched like any other: the
    first check, before the first step, raises ServerGoneError naming it."""
    job, ranks = run_job("server-kill-between-loaders", tmp_path, part_dir)
    ends = assert_killed_once_and_trainers_raised(job, ranks, tmp_path)
    for rank, end in ends.items():
        report = ranks[int(rank)]
        assert report["exception"] == "ServerGoneError", report
        assert report["message"].startswith("DGL server 1 at 127.0.0.1:"), report
        assert "CLOSE_WAIT" in report["message"], report
        assert end["after_disturbance_s"] < 10.0
    assert_watched_both_servers(ranks)


def dgl_has_tensorpipe() -> bool:
    """The example's answer (``train_dist.dgl_has_tensorpipe``): whether this DGL has
    the tensorpipe RPC backend. Loads the example as a module (harmless in this
    process: what it runs at import acts only in a DGL sampler process)."""
    return bool(train_dist_module().dgl_has_tensorpipe())


def train_dist_module() -> Any:
    """examples/train_dist.py as a module, loaded once."""
    example = sys.modules.get("train_dist")
    if example is None:
        spec = importlib.util.spec_from_file_location("train_dist", EXAMPLE)
        assert spec is not None
        assert spec.loader is not None
        example = sys.modules["train_dist"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
    return example


# DGL's partition_graph reads /proc/self/status without closing it.
@pytest.mark.filterwarnings("ignore::ResourceWarning",
                            "ignore::pytest.PytestUnraisableExceptionWarning")
def test_partitioning_again_with_other_flags_leaves_no_stale_config(tmp_path: Path) -> None:
    """``--part-dir`` reused with other graph flags: the new partition overwrites
    ``part0/``, ``part1/``, so the old config (whose path ``--partition-only``
    printed) must go rather than name another graph's files."""
    reason = distdgl_unavailable()
    if reason is not None:
        pytest.skip(reason)
    td = train_dist_module()
    first = td.partition_synthetic(td.GraphSpec(num_nodes=400), tmp_path, 2, log=lambda s: None)
    assert td.partition_synthetic(td.GraphSpec(num_nodes=400), tmp_path, 2,
                                  log=lambda s: None) == first  # the same flags: reused
    second = td.partition_synthetic(td.GraphSpec(num_nodes=500, num_classes=8), tmp_path, 2,
                                    log=lambda s: None)
    assert second != first
    assert sorted(tmp_path.glob("*.json")) == sorted([second, tmp_path / td.GRAPH_META])
    assert json.loads(second.read_text())["num_nodes"] == 500


@pytest.mark.parametrize("mode", ["equal", "server-kill"])
def test_dgl_tensorpipe_rpc_backend(mode: str, part_dir: Path, tmp_path: Path) -> None:
    """DGL's other RPC backend (``initialize(net_type="tensorpipe")``, set through
    ``PINGPONG_DIST_NET_TYPE``): ``equal``'s two epochs, every batch bit-identical to
    the synchronous pulls and the original tables; and a killed server still reported
    as ServerGoneError naming it -- the watch finds tensorpipe's TCP connections to
    the servers too."""
    if not dgl_has_tensorpipe():
        pytest.skip("this DGL has sockets only (DGL 2.x)")
    env = {"PINGPONG_DIST_NET_TYPE": "tensorpipe"}
    if mode == "equal":
        ranks = run_clean_job(mode, tmp_path, part_dir, env)
        for report in ranks:
            assert_two_equal_epochs(report["epochs"])
        assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
        assert_watched_both_servers(ranks, tensorpipe=True)
    else:
        job, ranks = run_job(mode, tmp_path, part_dir, env)
        assert_server_1_gone_in_training_loops(mode, job, ranks, tmp_path, tensorpipe=True)
    for rank in range(2):  # the backend DGL was asked for is the one it ran
        log = (tmp_path / f"trainer-{rank}.log").read_text(errors="replace")
        assert "NetType~tensorpipe" in log, log[-2000:]
        assert "NetType~socket" not in log


@pytest.mark.parametrize("net_type", ["tensorpipe", "infiniband"])
def test_example_refuses_an_rpc_backend_dgl_lacks_before_starting_anything(
        net_type: str, tmp_path: Path) -> None:
    """``PINGPONG_DIST_NET_TYPE`` naming a backend this DGL does not have (tensorpipe
    on DGL 2.x; a made-up name on any): the example's launcher exits at once with a
    message naming the variable -- before partitioning, with no process started
    (DGL 2.1's servers used to die of ``net_type`` while the trainers waited)."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    if net_type == "tensorpipe" and dgl_has_tensorpipe():
        pytest.skip("this DGL has tensorpipe (test_dgl_tensorpipe_rpc_backend runs it)")
    pid_file, parts = tmp_path / "pids.json", tmp_path / "parts"
    returncode, stdout, stderr = run_in_own_session(
        [sys.executable, str(EXAMPLE), "--pid-file", str(pid_file), "--part-dir", str(parts)],
        timeout=60, cwd=tmp_path, env=dict(os.environ, PINGPONG_DIST_NET_TYPE=net_type))
    assert returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert f"PINGPONG_DIST_NET_TYPE={net_type!r}" in stderr or (
        "PINGPONG_DIST_NET_TYPE=tensorpipe" in stderr), stderr[-2000:]
    assert ("has sockets only" if net_type == "tensorpipe"
            else "DGL's RPC backends are 'socket' and 'tensorpipe'") in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not pid_file.exists()  # no process was started
    assert not parts.exists()  # nor partitioning


def test_example_partition_only_needs_part_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--partition-only`` without ``--part-dir`` would partition into a temporary
    folder, print its config and delete it: refused before partitioning."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    td = train_dist_module()
    for name in ("DGL_ROLE", "PINGPONG_DIST_NET_TYPE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        td.main(["--partition-only", "--num-nodes", "400"])
    assert exc.value.code == "--partition-only needs --part-dir"


# DGL's partition_graph reads /proc/self/status without closing it.
@pytest.mark.filterwarnings("ignore::ResourceWarning",
                            "ignore::pytest.PytestUnraisableExceptionWarning")
def test_stop_after_server_0_was_killed_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """Server 0 shares its partition's graph with the trainers in /dev/shm, under the
    graph's name. Killed (the OOM killer, ``kill -9``), it cannot unlink those
    segments; the launcher's ``stop()`` must, and stop everything else."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    td = train_dist_module()
    part_config = td.partition_synthetic(td.GraphSpec(num_nodes=2000, feat_dim=8),
                                         tmp_path / "parts", 2, log=lambda s: None)
    graph_name = json.loads(part_config.read_text())["graph_name"]
    (tmp_path / "work").mkdir()
    shm_before = shm_entries()
    cluster = td.LocalCluster([sys.executable, str(EXAMPLE)], part_config, tmp_path / "work",
                              num_parts=2, num_trainers=1, trainer_log_dir=tmp_path)
    pid_file = tmp_path / "pids.json"
    try:
        cluster.start()
        pid_file.write_text(json.dumps(cluster.pids()))
        server_0 = cluster.servers[0].popen
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(graph_name) for p in Path("/dev/shm").iterdir()):
            assert server_0.poll() is None, cluster.server_logs()
            assert time.monotonic() < deadline, "server 0 shared no graph within 120 s"
            time.sleep(0.1)
        os.killpg(server_0.pid, signal.SIGKILL)
        server_0.wait(timeout=30)
        assert any(p.name.startswith(graph_name) for p in Path("/dev/shm").iterdir())
    finally:
        cluster.stop()
        if pid_file.exists():
            assert_all_gone(pid_file, shm_before)


@pytest.mark.parametrize("argv", [
    ["--gather", "zerocopy"],
    pytest.param(["--device", "cuda"], marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is available here")),
], ids=["cuda-gather-on-cpu", "cuda-without-gpu"])
def test_example_refuses_device_flags_it_cannot_run_before_starting_anything(
        argv: list[str], tmp_path: Path) -> None:
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    pid_file, parts = tmp_path / "pids.json", tmp_path / "parts"
    returncode, _stdout, stderr = run_in_own_session(
        [sys.executable, str(EXAMPLE), *argv, "--pid-file", str(pid_file),
         "--part-dir", str(parts)], timeout=60, cwd=tmp_path)
    assert returncode == 2, stderr[-2000:]
    assert "error: --" in stderr
    assert not pid_file.exists()  # no process was started
    assert not parts.exists()  # nor partitioning


def test_example_refuses_a_graph_too_small_for_its_trainers_before_partitioning(
        tmp_path: Path) -> None:
    """``--num-parts 3`` of 20 nodes: the val split has one node for three trainers
    (METIS failed with a backtrace below a node per partition): a parser error
    naming the split, before anything is partitioned or started."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    pid_file, parts = tmp_path / "pids.json", tmp_path / "parts"
    returncode, _stdout, stderr = run_in_own_session(
        [sys.executable, str(EXAMPLE), "--num-nodes", "20", "--num-parts", "3",
         "--pid-file", str(pid_file), "--part-dir", str(parts)], timeout=60, cwd=tmp_path)
    assert returncode == 2, stderr[-2000:]
    assert ("error: the val split of 20 nodes has 1 (train/val/test 6/1/2), fewer than "
            "the 3 trainers of --num-parts 3") in stderr
    assert "Traceback" not in stderr
    assert not pid_file.exists()
    assert not parts.exists()


@pytest.mark.parametrize("loader", ["pingpong", "sync"])
def test_example_trains_and_leaves_nothing_behind(loader: str, tmp_path: Path) -> None:
    """``examples/train_dist.py`` end to end: partition, 2 servers, 2 DDP trainers."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    pid_file, result = tmp_path / "pids.json", tmp_path / "result.json"
    shm_before = shm_entries()
    log_dir = tmp_path / "logs" / loader  # not there yet: the launcher makes it
    tmp = tmp_path / "tmp"  # the job's temporary folders (partition, ip_config): removed
    tmp.mkdir()
    try:
        returncode, stdout, stderr = run_in_own_session(
            [sys.executable, str(EXAMPLE), "--loader", loader, *SMALL, "--json", str(result),
             "--pid-file", str(pid_file), "--job-timeout", "120",  # a hang shows its stacks
             "--log-dir", str(log_dir)],
            timeout=JOB_LIMIT_S, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp)))
        assert returncode == 0, stdout[-4000:] + stderr[-4000:]
    finally:
        if pid_file.exists():
            assert_all_gone(pid_file, shm_before)
    report = json.loads(result.read_text())
    assert report["loader"] == loader
    assert report["world_size"] == 2
    assert len(report["epochs"]) == 2
    assert all(e["steps"] > 1 for e in report["epochs"])
    assert report["test_acc"] > 0.4  # 4 classes: chance is 0.25
    # node_split's shares of the odd number of training nodes differ by one: each
    # trainer's is cut to the smaller, so that the two step in step.
    from pingpong.sources import make_synthetic_graph

    graph = make_synthetic_graph(num_nodes=int(SMALL[SMALL.index("--num-nodes") + 1]),
                                 num_classes=4, feat_dim=32, avg_degree=10)
    assert len(graph.train_idx) % 2 == 1  # the precondition
    assert report["train_nodes"] == len(graph.train_idx) - 1
    # DDP averaged the gradients: both trainers end with the same weights.
    weights = report["params_sha256_by_rank"]
    assert len(weights) == 2
    assert weights[0] == weights[1]
    # The loader asked for: only pingpong's has a producer that gathers (and may stall).
    stats = report["train_loader_stats_rank0"]
    assert stats["batches"] == sum(e["steps"] for e in report["epochs"])
    assert ("gather_s" in stats, "consumer_stall_s" in stats) == (
        (True, True) if loader == "pingpong" else (False, False))
    # (torch's compile cache, torchinductor_USER, is torch's, kept on purpose)
    assert sorted(p for p in tmp.iterdir() if not p.name.startswith("torchinductor_")) == []
    assert "Epoch 01 | Time(s)" in stdout
    assert "Test Acc" in stdout
    assert all((log_dir / f"server-{i}.log").stat().st_size > 0 for i in range(2))


@variant
def test_example_job_timeout_shows_where_each_process_was(tmp_path: Path) -> None:
    """A job that overruns ``--job-timeout``: the launcher asks each process for its
    Python stacks (examples/_stacks.py), then stops them all (exit 124).

    Seen in CI before _stacks: faulthandler, asked while trainer 0 was training, killed
    it with SIGSEGV; trainer 1 left at once, never asked (tests/test_stacks.py)."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    pid_file = tmp_path / "pids.json"
    shm_before = shm_entries()
    try:
        returncode, stdout, stderr = run_in_own_session(
            # 40 s: the trainers are training by then (about 15 s in), past their imports
            # (a process asked for its stacks while still importing dies of the signal)
            [sys.executable, str(EXAMPLE), *SMALL, "--epochs", "1000", "--job-timeout", "40",
             "--pid-file", str(pid_file)], timeout=JOB_LIMIT_S, cwd=tmp_path)
    finally:
        if pid_file.exists():
            assert_all_gone(pid_file, shm_before)
    assert returncode == 124, stdout[-4000:] + stderr[-4000:]
    assert "job timeout (40 s): stopping the job" in stdout
    for name in ("server 0", "server 1", "trainer 0", "trainer 1"):
        assert f"Python stacks of {name} (pid " in stdout, stdout[-4000:] + stderr[-4000:]
    # The trainers write to the launcher's stderr: each main thread, inside trainer_main.
    assert stderr.count(" in trainer_main") == 2, stderr[-6000:]
    assert "(most recent call first)" in stderr


# 8010 nodes: 2403 training nodes, an odd number, so that node_split's two shares differ
SMALL = ["--num-nodes", "8010", "--feat-dim", "32", "--num-classes", "4", "--avg-degree", "10",
         "--epochs", "2", "--batch-size", "200", "--hidden", "32", "--lr", "0.01"]


@variant
def test_example_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the launcher) mid-training: it stops all four processes."""
    if (reason := distdgl_unavailable()) is not None:
        pytest.skip(reason)
    pid_file, log = tmp_path / "pids.json", tmp_path / "out.log"
    shm_before = shm_entries()
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *SMALL, "--epochs", "50", "--pid-file", str(pid_file)],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            preexec_fn=default_sigint)  # Ctrl-C works even if this run ignores SIGINT
    try:
        deadline = time.monotonic() + 120
        while "Epoch 00" not in log.read_text(errors="replace"):
            assert launcher.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "training did not start within 120 s"
            time.sleep(0.2)
        # Each process the launcher started leads a process group of its own: what
        # stop() signals (a Ctrl-C in a terminal reaches the launcher's group alone).
        entries = json.loads(pid_file.read_text())
        assert [os.getpgid(e["pid"]) for e in entries] == [e["pgid"] for e in entries]
        assert len({e["pgid"] for e in entries} | {os.getpgid(launcher.pid)}) == 5
        os.kill(launcher.pid, signal.SIGINT)
        returncode = launcher.wait(timeout=30)
        assert returncode == 130, log.read_text(errors="replace")[-4000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        if pid_file.exists():
            assert_all_gone(pid_file, shm_before)
    assert "interrupted" in log.read_text(errors="replace")
