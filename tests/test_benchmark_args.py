"""The benchmark scripts refuse bad arguments before they run, and judge what they ran.

From a review of ``benchmarks/`` (a probe of every script's command line): a
count of zero ended in ``ZeroDivisionError`` or ``statistics.StatisticsError``
after the run, ``gather.py --threads 3`` on two cores compared two Numba
threads with three of torch's under a "3 threads" title, a ``--formats png``
without matplotlib wrote nothing and exited 0, and ``soak.py`` said FAILED for
a run in which no fault happened to be injected.  A bad argument goes to the
script's ``main(argv)`` in the test's process; a run that does work runs the
script as a user does, in a fresh process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HAVE_DGL = importlib.util.find_spec("dgl") is not None
needs_dgl = pytest.mark.skipif(not HAVE_DGL, reason="the script imports DGL")


def run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DGLBACKEND": "pytorch"}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO, check=False)


@pytest.mark.parametrize(("script", "args", "needle"), [
    ("validation.py", ["--rows", "0"], "--rows: must be at least 1"),
    ("validation.py", ["--batches", "1000", "0"], "--batches: must be at least 1"),
    ("validation.py", ["--rounds", "0"], "--rounds: must be at least 1"),
    ("cache_hit_rate.py", ["--fractions", "0,0.1"], "each fraction must be in (0, 1]"),
    ("cache_hit_rate.py", ["--graph-kinds", "bogus"], "unknown graph kind(s) ['bogus']"),
    ("soak.py", ["--batches", "0"], "--batches: must be at least 1"),
    ("soak.py", ["--cycles", "-1"], "--cycles: must be at least 1"),
    ("soak.py", ["--json", "/"], "--json /: is a folder"),
    ("gather.py", ["--quick", "--threads", "0"], "--threads must be between 1 and"),
    ("gather.py", ["--quick", "--threads", str((os.cpu_count() or 1) + 1)],
     "--threads must be between 1 and"),
    pytest.param("sampler.py", ["--rounds", "0"], "--rounds: must be at least 1",
                 marks=needs_dgl),
    pytest.param("epoch.py", ["--epochs", "1"], "--epochs must be at least 2",
                 marks=needs_dgl),
    pytest.param("epoch.py", ["--rounds", "0"], "--rounds must be at least 1",
                 marks=needs_dgl),
    ("core_interference.py", ["--cores", "abc"], "expected two core numbers as A,B"),
    ("core_interference.py", ["--cores", f"0,{max(os.sched_getaffinity(0)) + 1}"],
     "is not one this process may run on"),
    # a file where a folder or a JSON file belongs: a traceback when it was used
    ("gather.py", ["--quick", "--out", str(REPO / "README.md")], "exists and is not a folder"),
    ("validation.py", ["--quick", "--out", str(REPO / "README.md")],
     "exists and is not a folder"),
    ("gather.py", ["--from-json", str(REPO / "no-such.json")], "No such file or directory"),
    ("gather.py", ["--from-json", str(REPO / "README.md")], "not JSON"),
    # --quick sets the sizes itself: a size given with it was silently replaced
    ("validation.py", ["--quick", "--rounds", "5"], "--quick sets --rounds itself"),
    pytest.param("epoch.py", ["--quick", "--num-nodes", "5000"],
                 "--quick sets --num-nodes itself", marks=needs_dgl),
], ids=lambda v: v if isinstance(v, str) and v.endswith(".py") else None)
def test_a_bad_argument_is_an_argparse_error_before_the_run(script, args, needle, capsys,
                                                            monkeypatch):
    """In this process (a fresh one per case imported torch again: about 4 s each,
    three CI envs): the script's ``main(argv)``, which must exit with status 2
    and argparse's message; any other exception fails the test."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # their `import _common`
    spec = importlib.util.spec_from_file_location(
        f"benchmark_{Path(script).stem}", REPO / "benchmarks" / script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    try:
        status = module.main(list(args))
    except SystemExit as exc:
        status = exc.code
    stderr = capsys.readouterr().err
    assert status == 2, stderr[-2000:]
    assert "error:" in stderr, stderr[-2000:]
    assert needle in stderr, stderr[-2000:]


def test_a_soak_in_which_no_fault_was_injected_is_not_a_failure(tmp_path):
    """Seed 0 over 20 batches injects no fault (the run says so): nothing about
    fault surfacing to judge -- it was FAILED, with NaN (not JSON) in the report."""
    out = tmp_path / "soak.json"
    done = run("soak.py", "--batches", "20", "--epochs", "5", "--cycles", "2", "--seed", "0",
               "--json", str(out))
    report = json.loads(out.read_text())  # valid JSON: no NaN where a fault rate would be
    assert report["results"]["faults_injected"] == 0, "the seed now injects a fault"
    assert report["results"]["faults_surfaced_ok_pct"] is None
    assert done.returncode == 0, done.stdout[-2000:]
    assert "fault surfacing not tested" in done.stdout
    assert "PASSED" in done.stdout


def test_gather_writes_nothing_it_was_asked_for_is_an_error(tmp_path):
    """``--from-json`` re-rendering only a PNG, without matplotlib: said "wrote" and
    exited 0 with nothing written."""
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed: the PNG is written")
    made = run("gather.py", "--quick", "--row-bytes", "64", "--dtypes", "float32",
               "--rounds", "1", "--threads", "1", "--table-gib", "0.01", "--formats", "json",
               "--out", str(tmp_path))  # a small real report to re-render
    assert made.returncode == 0, made.stderr[-2000:]
    done = run("gather.py", "--from-json", str(tmp_path / "gather.json"), "--formats", "png",
               "--out", str(tmp_path / "out"))
    assert "matplotlib is not installed" in done.stderr
    assert done.returncode == 1, (done.stdout, done.stderr)


def test_a_re_render_writes_under_the_name_given(tmp_path):
    """``--from-json`` with ``--name``: the outputs were named after the input
    whatever ``--name`` said; without ``--name`` they still are."""
    made = run("gather.py", "--quick", "--row-bytes", "64", "--dtypes", "float32",
               "--rounds", "1", "--threads", "1", "--table-gib", "0.01", "--formats", "json",
               "--out", str(tmp_path))
    assert made.returncode == 0, made.stderr[-2000:]
    source = tmp_path / "gather.json"
    done = run("gather.py", "--from-json", str(source), "--formats", "md", "--name", "again")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "again.md").is_file()
    assert not (tmp_path / "gather.md").exists()
    done = run("gather.py", "--from-json", str(source), "--formats", "md")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "gather.md").is_file()
