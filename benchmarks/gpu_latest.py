"""Write ``gpu-latest.json`` from the raw outputs of one ``gpu_check.sh`` run.

Reads, in the run's output folder:

- ``log.txt``: every step between ``=== NAME (...)`` and ``--- NAME rc=N``
  markers (``=== NAME skipped: why`` for a step that could not run); the
  pytest summary line of each pytest step (``N passed, M skipped ... in
  Xs``) and compute-sanitizer's ``ERROR SUMMARY: N errors``;
- ``machine.txt``: the ``nvidia-smi`` CSV line (GPU name), ``commit:`` and
  ``date:`` lines that ``gpu_check.sh`` writes first;
- ``gather-cuda.json`` (and ``gather-cuda-32g.json``) from
  ``benchmarks/gather.py --device cuda``;
- ``epochs.json`` from the ``epochs`` step: ``{"config": flags, "runs": {mode:
  train_sage.py --json output}}``;
- ``epochs-cache.json`` from the ``cache`` step (same shape; modes
  ``zerocopy``, ``zerocopy-cache``, ``device``), reported as ``cache_epoch``
  with the cached run's hit rate and how many times fewer rows crossed PCIe.

and writes ``gpu-latest.json`` there (the fields of ``/work/shared/GPU.md``,
plus more) -- and a copy to ``--copy-to``. A figure the run did not measure
is absent, never zero: a step that did not run, or ran without finishing,
contributes nothing. ``tests`` sums every pytest step that printed a summary
(``failed`` counts pytest's failures and errors); a pytest step that printed
none (killed at its limit) is listed under ``tests.incomplete_steps``.

    python benchmarks/gpu_latest.py OUT --command "bash benchmarks/gpu_check.sh OUT" \\
        --copy-to docs/benchmarks/gpu-latest.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

STEP_START = re.compile(r"^=== (?P<name>\S+) \((?P<clock>[0-9:]+), limit (?P<limit>\d+)s\): "
                        r"(?P<command>.*)$")
STEP_SKIPPED = re.compile(r"^=== (?P<name>\S+) skipped: (?P<reason>.*)$")
STEP_END = re.compile(r"^--- (?P<name>\S+) rc=(?P<rc>-?\d+)(?: \((?P<seconds>[0-9.]+)s\))?")
#: pytest's final line: "3 failed, 101 passed, 2 skipped, 1 warning in 12.34s" (with or
#: without the "=====" frame); or "no tests ran in 0.01s".
PYTEST_SUMMARY = re.compile(r"^[= ]*(?P<body>(?:\d+ [a-z]+(?:, )?)+|no tests ran) in "
                            r"(?P<seconds>[0-9.]+)s\b")
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
SANITIZER_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")

#: gather.py contender -> name part in gpu-latest.json.
GATHER_KINDS = {
    "pingpong zerocopy": "zerocopy",
    "pingpong zerocopy full grid": "zerocopy_full_grid",
    "staged": "staged",
    "device index_select": "device",
    "pinned memcpy": "pinned_memcpy",
}
#: Epoch modes in epochs.json and their names in gpu-latest.json.
EPOCH_MODES = ("plain", "zerocopy", "staged", "device", "zerocopy-nosort", "zerocopy-cache")
MIN_TIMED_EPOCHS = 3


# --------------------------------------------------------------------------- log.txt
def parse_log(text: str) -> list[dict[str, Any]]:
    """The steps of a ``gpu_check.sh`` log: name, command, rc, seconds, output lines."""
    steps: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        skipped = STEP_SKIPPED.match(line)
        if skipped:
            steps.append({"name": skipped["name"], "command": "", "limit_s": None, "rc": None,
                          "seconds": None, "lines": [], "skipped": skipped["reason"]})
            current = None
            continue
        start = STEP_START.match(line)
        if start:
            current = {"name": start["name"], "command": start["command"],
                       "limit_s": int(start["limit"]), "rc": None, "seconds": None, "lines": []}
            steps.append(current)
            continue
        end = STEP_END.match(line)
        if end and current is not None and end["name"] == current["name"]:
            current["rc"] = int(end["rc"])
            if end["seconds"] is not None:
                current["seconds"] = float(end["seconds"])
            current = None
            continue
        if current is not None:
            current["lines"].append(line)
    return steps


def pytest_counts(lines: list[str]) -> dict[str, int] | None:
    """Counts from the last pytest summary line among ``lines``, or None if none."""
    for line in reversed(lines):
        match = PYTEST_SUMMARY.match(line.strip())
        if not match:
            continue
        counts: dict[str, int] = {}
        for number, word in PYTEST_COUNT.findall(match["body"]):
            key = "errors" if word.startswith("error") else word
            counts[key] = counts.get(key, 0) + int(number)
        return counts
    return None


def summarize_tests(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Sum the pytest steps; None if no pytest step ran."""
    pytest_steps = [s for s in steps if "pytest" in s["command"]]
    if not pytest_steps:
        return None
    total = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    per_step: dict[str, Any] = {}
    incomplete = []
    for step in pytest_steps:
        counts = pytest_counts(step["lines"])
        if counts is None:
            incomplete.append(step["name"])
            continue
        per_step[step["name"]] = counts
        total["passed"] += counts.get("passed", 0)
        total["failed"] += counts.get("failed", 0) + counts.get("errors", 0)
        total["skipped"] += counts.get("skipped", 0)
        total["errors"] += counts.get("errors", 0)
        for extra in ("xfailed", "xpassed"):
            if extra in counts:
                total[extra] = total.get(extra, 0) + counts[extra]
    result: dict[str, Any] = {**total, "steps": per_step}
    if incomplete:
        result["incomplete_steps"] = incomplete
    return result


def memcheck_errors(steps: list[dict[str, Any]]) -> int | None:
    """compute-sanitizer's error count summed over the memcheck steps that reported one."""
    found = None
    for step in steps:
        if "compute-sanitizer" not in step["command"]:
            continue
        counts = [int(m) for line in step["lines"] for m in SANITIZER_SUMMARY.findall(line)]
        if counts:
            found = (found or 0) + sum(counts)
    return found


# --------------------------------------------------------------------------- machine.txt
def parse_machine(text: str) -> dict[str, str]:
    """``gpu`` (nvidia-smi's first CSV row), ``commit``, ``date`` where present, and
    ``dgl``: the version and wheel of the DGL the tests had, or ``none``."""
    info: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("dgl "):
            info["dgl"] = line[len("dgl "):].strip()
        elif line.startswith("dgl: none"):
            info["dgl"] = "none"
        if line.startswith("name,") and i + 1 < len(lines) and "," in lines[i + 1]:
            info["gpu"] = lines[i + 1].split(",")[0].strip()
        for key in ("commit", "commit_source", "dirty", "date", "source_sha256"):
            prefix = f"{key}:"
            if line.startswith(prefix) and line[len(prefix):].strip():
                info[key] = line[len(prefix):].strip()
    return info


# --------------------------------------------------------------------------- gather
def _gib_label(table_bytes: int) -> str:
    gib = table_bytes / 2**30
    return "" if round(gib) == 4 else f"_{gib:g}gib".replace(".", "p")


def gather_figures(report: dict[str, Any]) -> dict[str, Any]:
    """GB/s figures of a gather-cuda.json, named ``{ids}_{row}_{kind}[_{pages}][_{size}]_gbps``.

    Only float32 rows. ``ids`` is ``random``, ``sorted`` (address order) or
    ``gpu_sorted`` (random ids sorted on the GPU, sort included). Pages
    ``normal`` (or a report from before page kinds: ``torch``) carry no suffix;
    a 4 GiB table carries no size suffix. ``pinned_memcpy_gbps`` is the memcpy
    of the random 512-byte configuration.
    """
    figures: dict[str, Any] = {}
    for record in report.get("results", []):
        if record.get("dtype") != "float32":
            continue
        pages = record.get("pages", "torch")
        table_bytes = record.get("table_bytes", report.get("settings", {}).get("table_bytes", 0))
        if isinstance(table_bytes, list):
            table_bytes = table_bytes[0] if table_bytes else 0
        suffix = ("" if pages in ("normal", "torch") else f"_{pages}") + _gib_label(table_bytes)
        for contender, stats in record["summary"].items():
            if contender == "pingpong zerocopy gpu-sorted":
                key = f"gpu_sorted_{record['row_bytes']}_zerocopy{suffix}_gbps"
            elif contender in GATHER_KINDS:
                kind = GATHER_KINDS[contender]
                key = f"{record['order']}_{record['row_bytes']}_{kind}{suffix}_gbps"
            else:
                continue
            # a run with two pages kinds of the same name cannot happen; several thread
            # counts can: keep the first
            figures.setdefault(key, stats["median_gbps"])
        if record["order"] == "random" and record["row_bytes"] == 512 and "grid" in record:
            figures.setdefault(f"zerocopy_sm_share{suffix}", record["grid"]["sm_share"])
            figures.setdefault(f"zerocopy_sms_used{suffix}", record["grid"]["sms_used"])
    memcpy = figures.get("random_512_pinned_memcpy_gbps")
    if memcpy is not None:
        figures["pinned_memcpy_gbps"] = memcpy
    for key in [k for k in figures if "_pinned_memcpy" in k and k != "pinned_memcpy_gbps"]:
        del figures[key]  # the same copy in every configuration: one figure is enough
    for table in report.get("tables", []):
        page = table.get("page_report") or {}
        suffix = _gib_label(table["table_bytes"])
        if "huge_fraction" in page:
            figures[f"huge_page_fraction_{table['pages']}{suffix}"] = page["huge_fraction"]
        if table.get("register_s") is not None:
            figures[f"register_s_{table['pages']}{suffix}"] = table["register_s"]
    for sweep in report.get("sweep", []):
        suffix = ("" if sweep["pages"] in ("normal", "torch") else f"_{sweep['pages']}")
        suffix += _gib_label(sweep["table_bytes"])
        figures[f"gpu_sort_speedup_{sweep['row_bytes']}{suffix}"] = {
            str(point["ids"]): point["gpu_sort_speedup"] for point in sweep["points"]
        }
    rounds = report.get("settings", {}).get("rounds")
    if figures and rounds is not None:
        figures.setdefault("rounds", rounds)
    return figures


# --------------------------------------------------------------------------- epochs
def epoch_figures(payload: dict[str, Any]) -> dict[str, Any]:
    """Median of the timed epochs (all after the first) and the first, per mode.

    A mode with fewer than ``MIN_TIMED_EPOCHS`` timed epochs gives only its
    first epoch. ``runs`` may also be the whole payload (epochs.json of old runs).
    """
    runs = payload.get("runs", payload)
    figures: dict[str, Any] = {}
    if "config" in payload:
        figures["config"] = payload["config"]
    accuracy = {}
    for mode in EPOCH_MODES:
        run = runs.get(mode)
        if not isinstance(run, dict) or not run.get("epoch_times"):
            continue
        name = mode.replace("-", "_")
        times = [float(t) for t in run["epoch_times"]]
        figures[f"first_epoch_{name}_s"] = times[0]
        if len(times) - 1 >= MIN_TIMED_EPOCHS:
            figures[f"{name}_s"] = statistics.median(times[1:])
            figures[f"{name}_timed_epochs"] = len(times) - 1
        if run.get("test_acc") is not None:
            accuracy[name] = run["test_acc"]
    if accuracy:
        figures["test_acc"] = accuracy
    for mode in ("zerocopy", "staged", "plain", "zerocopy_cache"):
        if f"{mode}_s" in figures and "device_s" in figures:
            figures[f"{mode}_vs_device"] = figures[f"{mode}_s"] / figures["device_s"]
    return figures


def cache_figures(payload: dict[str, Any]) -> dict[str, Any]:
    """:func:`epoch_figures` plus the cached run's counters (``stats`` of its JSON):
    hit rate, and ``pcie_rows_cut`` = rows looked up / rows that still crossed PCIe."""
    figures = epoch_figures(payload)
    run = payload.get("runs", {}).get("zerocopy-cache")
    stats = run.get("stats") if isinstance(run, dict) else None
    if isinstance(stats, dict) and stats.get("cache_lookups"):
        lookups, hits = int(stats["cache_lookups"]), int(stats.get("cache_hits", 0))
        figures["cache_rows"] = stats.get("cache_rows")
        figures["cache_hit_rate"] = hits / lookups
        if lookups > hits:
            figures["pcie_rows_cut"] = lookups / (lookups - hits)
    return figures


# --------------------------------------------------------------------------- provenance
def git_commit(repo: Path = REPO) -> tuple[str | None, bool | None]:
    """(``git rev-parse HEAD``, tree dirty?) where this is a git checkout, else (None, None)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=repo, capture_output=True, text=True, timeout=30,
                                check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(status.strip())


def source_sha256(repo: Path = REPO) -> str:
    """SHA-256 over the paths and bytes of the Python and shell sources that ran.

    The same tree gives the same hash on any machine (``--source-hash`` prints
    it), so a run can be matched to a commit even where ``.git`` did not travel.
    """
    digest = hashlib.sha256()
    for folder in ("pingpong", "benchmarks", "examples", "tests"):
        for path in sorted((repo / folder).rglob("*")):
            if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(repo)).encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


# --------------------------------------------------------------------------- assemble
def _read_text(path: Path) -> str:
    """The file's text, or "" when it is missing."""
    return path.read_text() if path.exists() else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build(out: Path, command: str | None = None, commit: str | None = None,
          now: dt.datetime | None = None) -> dict[str, Any]:
    """Everything ``gpu-latest.json`` says, from the files in ``out``."""
    machine = parse_machine(_read_text(out / "machine.txt"))
    log = _read_text(out / "log.txt")
    steps = parse_log(log)
    result: dict[str, Any] = {}
    commit = commit or machine.get("commit")
    if commit:
        result["commit"] = commit
    date = machine.get("date") or (now or dt.datetime.now(dt.UTC)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    result["date"] = date
    if machine.get("gpu"):  # the machine this check ran on (a report may be left from before)
        result["gpu"] = machine["gpu"]
    if command:
        result["command"] = command
    if commit and machine.get("commit_source"):
        result["commit_source"] = machine["commit_source"]
    if machine.get("dirty") in ("true", "false"):
        result["dirty"] = machine["dirty"] == "true"
    if machine.get("source_sha256"):
        result["source_sha256"] = machine["source_sha256"]
    if machine.get("dgl"):
        result["dgl"] = machine["dgl"]
    tests = summarize_tests(steps)
    if tests is not None:
        result["tests"] = tests
    errors = memcheck_errors(steps)
    if errors is not None:
        result["memcheck_errors"] = errors
    figures: dict[str, Any] = {}
    for name in ("gather-cuda.json", "gather-cuda-32g.json"):
        report = _read_json(out / name)
        if report:
            for key, value in gather_figures(report).items():
                figures.setdefault(key, value)
    if figures:
        result["gather"] = figures
    epochs = _read_json(out / "epochs.json")
    if epochs:
        epoch = epoch_figures(epochs)
        if any(key.endswith("_s") for key in epoch):
            result["epoch"] = epoch
    cache = _read_json(out / "epochs-cache.json")
    if cache:
        cache_epoch = cache_figures(cache)
        if any(key.endswith("_s") for key in cache_epoch):
            result["cache_epoch"] = cache_epoch
    if steps:
        result["steps"] = {s["name"]: {k: s[k] for k in ("rc", "seconds", "limit_s", "skipped")
                                       if s.get(k) is not None} for s in steps}
    return result


def provenance_lines(repo: Path = REPO) -> list[str]:
    """``commit:``, ``commit_source:``, ``dirty:`` and ``source_sha256:`` lines for machine.txt.

    The commit is ``git rev-parse HEAD`` where the tree is a git checkout, else
    ``$PINGPONG_COMMIT`` (the caller's word for what it sent), else none.
    """
    head, dirty = git_commit(repo)
    lines = []
    if head:
        lines += [f"commit: {head}", "commit_source: git", f"dirty: {str(dirty).lower()}"]
    elif os.environ.get("PINGPONG_COMMIT"):
        lines += [f"commit: {os.environ['PINGPONG_COMMIT']}", "commit_source: PINGPONG_COMMIT"]
    lines.append(f"source_sha256: {source_sha256(repo)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="?", help="the gpu_check.sh output folder")
    p.add_argument("--command", default=None, help="the gpu_check.sh command line")
    p.add_argument("--commit", default=None,
                   help="default: the 'commit:' line of machine.txt")
    p.add_argument("--copy-to", type=Path, default=None,
                   help="also write it here (docs/benchmarks/gpu-latest.json); skipped when "
                   "machine.txt names no GPU (a dry run on a CPU must not replace the record)")
    p.add_argument("--source-hash", action="store_true",
                   help="print this tree's source_sha256 and exit")
    p.add_argument("--provenance", action="store_true",
                   help="print the commit/source lines gpu_check.sh puts in machine.txt; exit")
    args = p.parse_args(argv)
    if args.source_hash:
        print(source_sha256())
        return 0
    if args.provenance:
        print("\n".join(provenance_lines()))
        return 0
    if args.out is None:
        p.error("give the output folder of gpu_check.sh")
    result = build(args.out, args.command, args.commit)
    text = json.dumps(result, indent=1) + "\n"
    (args.out / "gpu-latest.json").write_text(text)
    written = [args.out / "gpu-latest.json"]
    if args.copy_to is not None and "gpu" not in result:
        print(f"# no GPU named in {args.out}/machine.txt: not copied to {args.copy_to}")
    elif args.copy_to is not None:
        args.copy_to.parent.mkdir(parents=True, exist_ok=True)
        args.copy_to.write_text(text)
        written.append(args.copy_to)
    print("# wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
