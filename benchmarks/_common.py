"""Shared helpers for the benchmarks: machine description, timing, writers.

The machines these benchmarks run on are shared and noisy, so timing is done
the same way everywhere:

- every contender of one configuration is run once per *round*, in a fresh
  random order each round, so a burst of load from elsewhere hits all
  contenders alike and none always follows the same other one;
- the CPU caches are scrubbed (untimed) before every timed call, so no
  contender finds rows that the previous one left in cache;
- each contender gets untimed warm-up calls first (JIT compilation, page
  faults on fresh buffers);
- results are reported as the *median* over rounds, with the min and max kept
  in the JSON so the spread is visible.

Writers produce ``NAME.json`` (everything, raw samples included),
``NAME.md`` (tables for the docs) and, when matplotlib is importable,
``NAME.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- machine


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (a count of rows, batches, rounds)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def out_dir(text: str) -> Path:
    """An ``argparse`` type for ``--out``: a folder to write into, made if missing;
    refused if it names something that is not a folder (a file), which would
    otherwise fail only when the results are written, after the run."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder")
    return path


def json_file(text: str) -> Path:
    """An ``argparse`` type for ``--from-json``: a readable file holding JSON."""
    path = Path(text)
    try:
        json.loads(path.read_text())
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text}: not JSON ({exc})") from None
    return path


def rerender_target(parser: Any, args: Any) -> None:
    """With ``--from-json`` (else nothing): write next to the input (``--out``
    wins) under the input's name, unless ``--name`` was given a value other
    than its default."""
    if args.from_json is None:
        return
    if args.out is None:
        args.out = args.from_json.parent
    if args.name == parser.get_default("name"):
        args.name = args.from_json.stem


def refuse_sizes_with_quick(parser: Any, args: Any, sizes: Sequence[str]) -> None:
    """``--quick`` sets ``sizes`` (argparse destinations) itself: a parser error if
    any of them was given a value other than its default, which ``--quick``
    would silently replace."""
    if not getattr(args, "quick", False):
        return
    given = [name for name in sizes if getattr(args, name) != parser.get_default(name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        parser.error(f"--quick sets {flags} itself; drop {flags} or drop --quick")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _l3_cache() -> str | None:
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                return (index / "size").read_text().strip()
        except OSError:
            continue
    return None


def _physical_cores() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.cpu_count(logical=False)


def _ram_gib() -> float | None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None
    return round(total / 2**30, 1)


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return str(getattr(mod, "__version__", "?"))


def _git_commit() -> str | None:
    """``HEAD``'s short hash; ``+uncommitted`` when tracked files differ from it, or
    when a file git does not ignore is untracked under the code a benchmark runs
    (``pingpong/``, ``benchmarks/``, ``examples/``): the code measured is then not
    that commit's."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
        untracked = git("ls-files", "--others", "--exclude-standard", "--",
                        ":/pingpong", ":/benchmarks", ":/examples")
    except (OSError, subprocess.SubprocessError):
        return None
    if not commit:
        return None
    return f"{commit}+uncommitted" if changed or untracked else commit


def load_average() -> tuple[float, float, float] | None:
    """``os.getloadavg()`` (1, 5, 15 minutes), or None where unsupported."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def _system_busy_seconds() -> float | None:
    """CPU seconds all processes spent busy since boot (Linux /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def thread_runqueue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core (Linux
    ``/proc/thread-self/schedstat``, its second field), or None where unavailable."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class OtherLoad:
    """Cores' worth of CPU that *other* processes used between start() and stop().

    ``(system busy CPU seconds - this process's CPU seconds) / wall seconds``:
    0.0 on an idle machine, 1.0 when something else kept one core busy.  None
    where /proc/stat is unavailable.
    """

    def start(self) -> None:
        self._wall = time.perf_counter()
        self._system = _system_busy_seconds()
        t = os.times()
        self._own = t.user + t.system

    def stop(self) -> float | None:
        system = _system_busy_seconds()
        if system is None or self._system is None:
            return None
        wall = time.perf_counter() - self._wall
        t = os.times()
        own = t.user + t.system - self._own
        return max(0.0, (system - self._system - own) / wall) if wall > 0 else None


def wait_for_quiet(
    max_wait_s: float, threshold_cores: float = 0.25, window_s: float = 2.0
) -> tuple[float, float | None]:
    """Wait until other processes use less than ``threshold_cores`` for one window.

    Gives up after ``max_wait_s`` seconds.  Returns (seconds waited, the last
    window's other-process load in cores, or None where it cannot be measured).
    Nothing is hidden by this: the load *during* each measurement is recorded
    separately (:class:`OtherLoad`).
    """
    start = time.perf_counter()
    other: float | None = None
    while True:
        probe = OtherLoad()
        probe.start()
        time.sleep(window_s)
        other = probe.stop()
        waited = time.perf_counter() - start
        if other is None or other < threshold_cores or waited >= max_wait_s:
            return waited, other


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, software versions."""
    info = _cpuinfo()
    cpu = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info and "model" in info:
        cpu = f"{cpu} (family {info['cpu family']}, model {info['model']})"
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "physical_cores": _physical_cores(),
        "l3_cache": _l3_cache(),
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "pingpong": _version("pingpong"),
        "git_commit": _git_commit(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "thread_env": thread_env(),
    }


#: Environment variables that change how thread pools wait or how many threads
#: they start -- and so what a timing measures.
THREAD_ENV_VARS = (
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "NUMBA_THREADING_LAYER",
)


def thread_env() -> dict[str, str]:
    """The :data:`THREAD_ENV_VARS` set in this process's environment."""
    return {name: os.environ[name] for name in THREAD_ENV_VARS if name in os.environ}


def command_line() -> str:
    """The command that is running, as one could retype it.

    Prefixed with the :func:`thread_env` settings it ran under, so a rerun
    gets the same thread pools.
    """
    env = "".join(f"{k}={shlex.quote(v)} " for k, v in thread_env().items())
    return env + "python " + " ".join(shlex.quote(arg) for arg in sys.argv)


def describe_machine(info: Mapping[str, Any]) -> str:
    """One Markdown paragraph describing :func:`machine_info`'s result."""
    cores = f"{info['logical_cores']} logical cores"
    if info.get("physical_cores"):
        cores += f" ({info['physical_cores']} physical)"
    parts = [f"CPU: {info['cpu']}, {cores}"]
    if info.get("l3_cache"):
        parts.append(f"L3 {info['l3_cache']}")
    parts.append(f"{info['ram_gib']} GiB RAM")
    parts.append(f"{info['os']}")
    versions = ", ".join(
        f"{name} {info[name]}"
        for name in ("python", "torch", "numpy", "numba", "pingpong")
        if info.get(name)
    )
    parts.append(versions)
    if info.get("git_commit"):
        parts.append(f"commit {info['git_commit']}")
    parts.append(info["date_utc"])
    text = "; ".join(parts) + "."
    if info.get("thread_env"):
        settings = ", ".join(f"{k}={v}" for k, v in info["thread_env"].items())
        text += f" Thread settings from the environment: {settings}."
    return text


# --------------------------------------------------------------------------- timing


def alternate(
    contenders: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    before_each: Callable[[], object] | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each contender once per round, in a fresh random order each round.

    Returns seconds per call.  A shuffled order (not a rotation, which keeps
    the cyclic order) means no contender always runs right after the same
    other one -- e.g. right after a gather that left the same rows in cache.
    ``before_each`` runs untimed before every call (see :class:`CacheScrubber`).
    ``warmup`` untimed calls of each contender come first.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(contenders)
    rng = random.Random(seed)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            if before_each is not None:
                before_each()
            fn = contenders[name]
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return samples


def cache_bytes() -> int:
    """The last-level cache size from sysfs (32 MiB if unknown)."""
    text = _l3_cache()
    if text:
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            if text[-1] in units:
                return int(text[:-1]) * units[text[-1]]
            return int(text)
        except ValueError:
            pass
    return 32 * 2**20


class CacheScrubber:
    """Evict the CPU caches by reading a buffer several times their size.

    Called before every timed call, so each contender starts with the table's
    rows out of cache (as in training, where a batch's rows were not just
    read by someone else), and the previous call's dirty output lines are
    written back *before* the clock starts.
    """

    def __init__(self, nbytes: int | None = None) -> None:
        import numpy as np

        size = nbytes if nbytes is not None else max(64 * 2**20, 4 * cache_bytes())
        self.buffer = np.ones(size // 8, dtype=np.int64)

    def __call__(self) -> int:
        return int(self.buffer.sum())


def summarize(seconds: Sequence[float], nbytes: int) -> dict[str, float]:
    """Median/min/max seconds of ``seconds`` and the GB/s for ``nbytes`` each."""
    med = statistics.median(seconds)
    return {
        "median_s": med,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "median_gbps": nbytes / med / 1e9,
        "best_gbps": nbytes / min(seconds) / 1e9,
    }


# --------------------------------------------------------------------------- writers


def write_json(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; floats are printed with 2 decimals."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)

    numeric = [
        all(isinstance(row[i], int | float) for row in rows) if rows else False
        for i in range(len(headers))
    ]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if num else "---" for num in numeric) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip() + "\n")
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_lines(
    path: Path,
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = True,
) -> Path | None:
    """One subplot per panel, one line per series of ``(x, y)`` points.

    Returns the PNG's path, or None when matplotlib is not installed.
    """
    if not have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(panels)
    cols = min(2, count)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels.items(), strict=False):
        for label, points in series.items():
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if logx:
            ax.set_xscale("log", base=2)
            ticks = sorted({p[0] for points in series.values() for p in points})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_results(
    out: Path | None,
    name: str,
    report: Any,
    markdown: str,
    render_plot: Callable[[Any, Path], Path | None],
) -> None:
    """Write ``NAME.json``, ``NAME.md`` and (with matplotlib) ``NAME.png`` under ``out``.

    Without ``out`` the Markdown goes to stdout instead.
    """
    if out is None:
        print(markdown)
        return
    written = [
        write_json(out / f"{name}.json", report),
        write_markdown(out / f"{name}.md", markdown),
    ]
    png = render_plot(report, out / f"{name}.png")
    if png is not None:
        written.append(png)
    print("# wrote " + ", ".join(str(p) for p in written))

