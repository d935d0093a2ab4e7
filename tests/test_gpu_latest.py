"""gpu-latest.json is written from a GPU run's raw outputs: counts summed, absent stays absent.

Every input here is fabricated, small and shaped like what ``benchmarks/gpu_check.sh``,
``benchmarks/gather.py --device cuda`` and ``examples/train_sage.py --json`` write.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_latest  # noqa: E402

MACHINE = """date: 2026-12-01T10:00:00Z
commit: 0123456789abcdef0123456789abcdef01234567
commit_source: git
dirty: false
source_sha256: feedface
name, driver_version, memory.total [MiB], pcie.link.gen.max, pcie.link.width.max
NVIDIA H200, 580.159.04, 143771 MiB, 5, 16
cores: 16
dgl 1.1.3 (.whl/dgl-1.1.3-cp311-cp311-manylinux1_x86_64.whl)
"""

PYTEST = "python3 -m pytest -q -p no:cacheprovider -W default"
SANITIZER = "compute-sanitizer --tool memcheck"
LOG = "\n".join([
    f"=== tests (10:00:01, limit 120s): {PYTEST} tests/test_cuda.py",
    "........s.F",
    "FAILED tests/test_cuda.py::test_x - AssertionError",
    "1 failed, 120 passed, 3 skipped, 2 warnings in 61.20s (0:01:01)",
    "--- tests rc=1 (62s)",
    f"=== reliability (10:01:03, limit 180s): {PYTEST} -m cuda tests/test_reliability.py",
    "....E",
    "========= 40 passed, 1 skipped, 7 deselected, 1 error in 90.01s =========",
    "--- reliability rc=1 (91s)",
    f"=== ddp (10:02:35, limit 90s): {PYTEST} -m cuda tests/test_distributed.py",
    ".....",
    "--- ddp rc=124 (90s)",
    f"=== memcheck (10:04:05, limit 75s): {SANITIZER} python3 benchmarks/gpu_sanitize.py",
    "sanitize workload ok",
    "========= ERROR SUMMARY: 0 errors",
    "--- memcheck rc=0 (33s)",
    f"=== memcheck-reliability (10:04:40, limit 180s): {SANITIZER} {PYTEST} -m cuda "
    '-k "bad_ids or leak" tests/test_reliability_system.py',
    "========= Invalid __global__ read of size 8 bytes",
    "4 passed in 50.00s",
    "========= ERROR SUMMARY: 2 errors",
    "--- memcheck-reliability rc=3 (51s)",
    "=== gather (10:05:32, limit 100s): python3 benchmarks/gather.py --device cuda --out OUT",
    "--- gather rc=0 (70s)",
    "",
])


def _record(order, row_bytes, pages, medians, table_gib=4, grid=True):
    record = {
        "table_bytes": table_gib * 2**30, "pages": pages, "threads": 8, "dtype": "float32",
        "order": order, "row_bytes": row_bytes, "rows_per_call": 1, "bytes_per_call": 1,
        "other_processes_cores": 0.0, "mismatches": [], "seconds": {},
        "summary": {name: {"median_gbps": value, "median_s": 1.0 / value}
                    for name, value in medians.items()},
    }
    if grid:
        record["grid"] = {"blocks": 104, "threads_per_block": 256, "threads_per_row": 32,
                          "word_bytes": 8, "sms_used": 13, "sm_share": 13 / 132}
    return record


def gather_report(pages=("normal", "thp")) -> dict:
    results = []
    for p, scale in zip(pages, (1.0, 2.0), strict=False):
        results += [
            _record("random", 512, p, {"pingpong zerocopy": 16.0 * scale,
                                       "pingpong zerocopy gpu-sorted": 30.0 * scale,
                                       "pingpong zerocopy full grid": 17.0, "staged": 16.1,
                                       "pinned memcpy": 49.7, "device index_select": 244.0}),
            _record("sorted", 512, p, {"pingpong zerocopy": 35.0 * scale, "staged": 17.0,
                                       "pinned memcpy": 49.8}),
            _record("random", 128, p, {"pingpong zerocopy": 5.5, "pinned memcpy": 49.6}),
        ]
    sweep_point = {"ids": 1000, "calls_per_sample": 131, "seconds_per_call": {},
                   "summary": {name: {"median_s": 1e-4, "median_gbps": 5.0}
                               for name in ("zerocopy", "zerocopy gpu-sorted", "torch.sort alone",
                                            "zerocopy presorted")},
                   "gpu_sort_speedup": 0.8}
    return {
        "benchmark": "gather", "device": "cuda", "gpu": "NVIDIA H200", "command": "python x",
        "machine": {"cpu": "x", "logical_cores": 16, "physical_cores": 16, "l3_cache": None,
                    "ram_gib": 125.9, "os": "Linux", "python": "3.12", "torch": "2.11",
                    "numpy": "2.5", "numba": "0.68", "pingpong": "0.1.0", "git_commit": None,
                    "date_utc": "2026-12-01 10:05 UTC"},
        "sm": {"sms": 132, "threads_per_sm": 2048, "default_max_blocks": 104,
               "default_sm_share": 0.1, "full_grid_blocks": 1056},
        "settings": {"table_bytes": [4 * 2**30], "pages": list(pages), "batch_bytes": 2**26,
                     "rounds": 5, "threads": [8], "row_bytes": [128, 512],
                     "dtypes": ["float32"], "seed": 0, "sweep_row_bytes": 512,
                     "batch_ids": [1000]},
        "tables": [{"table_bytes": 4 * 2**30, "pages": p, "thp_mode": "madvise", "fill_s": 1.0,
                    "register_s": 0.5 if p == "thp" else 2.0, "device_copy": True,
                    "page_report": {"huge_fraction": 1.0 if p == "thp" else 0.0}}
                   for p in pages],
        "skipped": [],
        "results": results,
        "sweep": [{"table_bytes": 4 * 2**30, "pages": p, "row_bytes": 512,
                   "points": [sweep_point]} for p in pages],
        "load_1min": None, "other_processes_cores": None, "elapsed_s": 70.0,
    }


def train_result(times, acc=0.96):
    return {"epoch_times": times, "test_acc": acc, "loader": "x"}


EPOCHS = {
    "config": "--num-nodes 500000 --feat-dim 256 --fanouts 10,10 --epochs 4",
    "runs": {
        "plain": train_result([5.2, 3.6, 3.7, 3.5]),
        "zerocopy": train_result([2.6, 1.2, 1.3, 1.25]),
        "device": train_result([2.4, 1.2, 1.22, 1.21]),
        "staged": train_result([2.7, 1.4]),  # killed early: too few timed epochs
    },
}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "machine.txt").write_text(MACHINE)
    (tmp_path / "log.txt").write_text(LOG)
    (tmp_path / "gather-cuda.json").write_text(json.dumps(gather_report()))
    (tmp_path / "epochs.json").write_text(json.dumps(EPOCHS))
    return tmp_path


def test_test_counts_are_summed_over_every_pytest_step(run_dir):
    result = gpu_latest.build(run_dir, "bash benchmarks/gpu_check.sh OUT")
    tests = result["tests"]
    assert tests["passed"] == 120 + 40 + 4
    assert tests["failed"] == 1 + 1  # pytest's failures and errors
    assert tests["errors"] == 1
    assert tests["skipped"] == 3 + 1
    assert tests["incomplete_steps"] == ["ddp"]  # killed at its limit: no summary
    assert set(tests["steps"]) == {"tests", "reliability", "memcheck-reliability"}
    assert result["memcheck_errors"] == 0 + 2
    assert result["steps"]["ddp"] == {"rc": 124, "seconds": 90.0, "limit_s": 90}


def test_the_fields_gpu_md_names(run_dir):
    result = gpu_latest.build(run_dir, "bash benchmarks/gpu_check.sh OUT")
    assert list(result)[:6] == ["commit", "date", "gpu", "command", "commit_source", "dirty"]
    assert result["commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert result["date"] == "2026-12-01T10:00:00Z"
    assert result["gpu"] == "NVIDIA H200"
    assert result["dirty"] is False
    assert result["dgl"] == "1.1.3 (.whl/dgl-1.1.3-cp311-cp311-manylinux1_x86_64.whl)"
    gather = result["gather"]
    assert gather["pinned_memcpy_gbps"] == 49.7
    assert gather["random_512_zerocopy_gbps"] == 16.0
    assert gather["sorted_512_zerocopy_gbps"] == 35.0
    assert gather["gpu_sorted_512_zerocopy_gbps"] == 30.0
    assert gather["random_512_zerocopy_thp_gbps"] == 32.0
    assert gather["gpu_sorted_512_zerocopy_thp_gbps"] == 60.0
    assert gather["random_512_device_gbps"] == 244.0
    assert gather["huge_page_fraction_thp"] == 1.0
    assert gather["register_s_thp"] == 0.5
    assert gather["zerocopy_sm_share"] == pytest.approx(13 / 132)
    assert gather["gpu_sort_speedup_512"] == {"1000": 0.8}
    assert not [key for key in gather if "pinned_memcpy" in key and key != "pinned_memcpy_gbps"]
    epoch = result["epoch"]
    assert epoch["config"].startswith("--num-nodes 500000")
    assert epoch["plain_s"] == 3.6  # median of the 3 epochs after the first
    assert epoch["zerocopy_s"] == 1.25
    assert epoch["device_s"] == 1.21
    assert epoch["first_epoch_plain_s"] == 5.2
    assert epoch["first_epoch_zerocopy_s"] == 2.6
    assert epoch["plain_vs_device"] == pytest.approx(3.6 / 1.21)


def test_absent_figures_stay_absent(run_dir):
    result = gpu_latest.build(run_dir)
    assert "staged_s" not in result["epoch"]  # 1 timed epoch is not a median of 3
    assert result["epoch"]["first_epoch_staged_s"] == 2.7
    assert "zerocopy_nosort_s" not in result["epoch"]
    assert "command" not in result
    (run_dir / "gather-cuda.json").write_text(json.dumps(gather_report(pages=("thp",))))
    gather = gpu_latest.build(run_dir)["gather"]
    assert "random_512_zerocopy_gbps" not in gather  # no 4 KiB-page table this run
    assert "pinned_memcpy_gbps" not in gather
    assert gather["random_512_zerocopy_thp_gbps"] == 16.0
    for name in ("gather-cuda.json", "epochs.json", "machine.txt"):
        (run_dir / name).unlink()
    (run_dir / "log.txt").write_text(
        "=== memcheck skipped: compute-sanitizer not found\n"
        "=== memcheck-reliability (10:00:00, limit 180s): compute-sanitizer --tool memcheck "
        "python3 -m pytest -q\n--- memcheck-reliability rc=124 (180s)\n"
    )
    result = gpu_latest.build(run_dir)
    for key in ("commit", "gpu", "gather", "epoch", "memcheck_errors"):
        assert key not in result, key
    assert result["tests"]["incomplete_steps"] == ["memcheck-reliability"]
    assert result["tests"]["passed"] == 0
    assert result["steps"]["memcheck"] == {"skipped": "compute-sanitizer not found"}


def test_no_pytest_step_means_no_tests_field(tmp_path):
    (tmp_path / "log.txt").write_text(LOG.split("=== memcheck ")[0].split("=== tests")[0])
    assert "tests" not in gpu_latest.build(tmp_path)


@pytest.mark.parametrize(
    ("line", "counts"),
    [
        ("3 passed in 1.20s", {"passed": 3}),
        ("===== 2 failed, 7 passed, 1 skipped in 3.00s =====", {"failed": 2, "passed": 7,
                                                                 "skipped": 1}),
        ("1 failed, 2 passed, 2 errors, 1 xfailed in 9.10s (0:00:09)",
         {"failed": 1, "passed": 2, "errors": 2, "xfailed": 1}),
        ("no tests ran in 0.01s", {}),
    ],
)
def test_pytest_summary_lines(line, counts):
    assert gpu_latest.pytest_counts(["noise", line, ""]) == counts


def test_main_writes_out_and_the_copy_but_not_for_a_run_without_a_gpu(run_dir, tmp_path):
    docs = tmp_path / "docs" / "gpu-latest.json"
    assert gpu_latest.main([str(run_dir), "--command", "bash x OUT", "--copy-to", str(docs)]) == 0
    written = json.loads((run_dir / "gpu-latest.json").read_text())
    assert json.loads(docs.read_text()) == written
    assert written["command"] == "bash x OUT"
    docs.unlink()
    (run_dir / "machine.txt").write_text("nvidia-smi: command not found\n")
    # A dry run on a CPU must not replace the record, even when the folder still
    # holds a GPU run's gather report (which names its GPU).
    assert json.loads((run_dir / "gather-cuda.json").read_text())["gpu"] == "NVIDIA H200"
    assert gpu_latest.main([str(run_dir), "--copy-to", str(docs), "--commit", "abc"]) == 0
    assert not docs.exists()
    assert "gpu" not in json.loads((run_dir / "gpu-latest.json").read_text())
    assert json.loads((run_dir / "gpu-latest.json").read_text())["commit"] == "abc"


def test_source_hash_follows_the_sources(tmp_path):
    for folder in ("pingpong", "benchmarks", "examples", "tests"):
        (tmp_path / folder).mkdir()
    (tmp_path / "pingpong" / "a.py").write_text("x = 1\n")
    first = gpu_latest.source_sha256(tmp_path)
    (tmp_path / "pingpong" / "notes.txt").write_text("not a source")
    assert gpu_latest.source_sha256(tmp_path) == first
    (tmp_path / "pingpong" / "a.py").write_text("x = 2\n")
    assert gpu_latest.source_sha256(tmp_path) != first


def test_the_cuda_gather_report_renders(tmp_path):
    """gather.py re-renders a CUDA report of the new shape (tables, pages, sweep, SMs)."""
    import gather

    report = gather_report()
    text = gather.render_markdown(report)
    assert "## 4 GiB table, thp pages" in text
    assert "## Sort sweep: 4 GiB table, normal pages, 512 B rows" in text
    assert "13 (10%)" in text  # the SMs the default grid occupied
    headline = gather.render_headline(report)
    assert headline is not None
    assert "gpu-sorted" in headline
    path = tmp_path / "gather-cuda.json"
    path.write_text(json.dumps(report))
    assert gather.main(["--from-json", str(path), "--formats", "md"]) == 0
    assert (tmp_path / "gather-cuda.md").exists()
    assert not (tmp_path / "gather-cuda.png").exists()


def test_gpu_check_is_valid_bash_and_writes_gpu_latest_without_a_gpu(tmp_path):
    """The script's glue on a CPU: no steps can run, the writer still runs, docs untouched."""
    script = REPO / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", "-S", "warning", str(script)],
                              capture_output=True, text=True, check=False)
        assert lint.returncode == 0, lint.stdout
    docs = REPO / "docs" / "benchmarks" / "gpu-latest.json"
    before = docs.read_bytes() if docs.exists() else None
    out = tmp_path / "out"
    try:
        run = subprocess.run(["bash", str(script), str(out), "no-such-step"],
                             capture_output=True, text=True, timeout=300, check=False,
                             env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                  "HOME": str(tmp_path)})
        after = docs.read_bytes() if docs.exists() else None
    finally:  # never leave a dry run's file in docs/, whatever happened
        if before is None:
            docs.unlink(missing_ok=True)
        else:
            docs.write_bytes(before)
    assert after == before
    assert run.returncode == 1, run.stdout + run.stderr  # the unknown step
    result = json.loads((out / "gpu-latest.json").read_text())
    assert result["command"] == "bash benchmarks/gpu_check.sh OUT no-such-step"
    assert result["steps"] == {"no-such-step": {"skipped": "unknown step"}}
    assert "source_sha256" in result


def test_the_cache_step_reports_epochs_hit_rate_and_the_pcie_cut(run_dir):
    cached = train_result([3.0, 1.1, 1.12, 1.15])
    cached["stats"] = {"cache_rows": 50_000, "cache_lookups": 1000, "cache_hits": 750}
    payload = {"config": "x", "runs": {"zerocopy": train_result([2.6, 1.3, 1.3, 1.3]),
                                       "zerocopy-cache": cached,
                                       "device": train_result([2.4, 1.0, 1.0, 1.0])}}
    (run_dir / "epochs-cache.json").write_text(json.dumps(payload))
    figures = gpu_latest.build(run_dir)["cache_epoch"]
    assert figures["zerocopy_cache_s"] == 1.12
    assert figures["zerocopy_cache_vs_device"] == pytest.approx(1.12)
    assert figures["zerocopy_vs_device"] == pytest.approx(1.3)
    assert figures["cache_hit_rate"] == 0.75
    assert figures["pcie_rows_cut"] == pytest.approx(4.0)
    assert figures["cache_rows"] == 50_000
    cached.pop("stats")
    (run_dir / "epochs-cache.json").write_text(json.dumps(payload))
    figures = gpu_latest.build(run_dir)["cache_epoch"]
    assert "cache_hit_rate" not in figures  # not measured: absent, never zero
    (run_dir / "epochs-cache.json").unlink()
    assert "cache_epoch" not in gpu_latest.build(run_dir)


def test_a_run_without_dgl_says_so(run_dir):
    machine = (run_dir / "machine.txt").read_text()
    (run_dir / "machine.txt").write_text(
        machine.replace("dgl 1.1.3 (.whl/dgl-1.1.3-cp311-cp311-manylinux1_x86_64.whl)",
                        "dgl: none (the DGL tests skip)"))
    assert gpu_latest.build(run_dir, "bash benchmarks/gpu_check.sh OUT")["dgl"] == "none"
