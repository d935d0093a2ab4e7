"""Gather throughput: pingpong's kernels against the usual ways to gather rows.

Throughput is GB/s of rows *delivered*: ``len(ids) * row_bytes / seconds``.

CPU (``--device cpu``), every contender with the same thread count N (torch
and Numba threads both set to N), for N in ``--threads``:

- ``pingpong``      ``pingpong.kernels.gather_rows_cpu`` on the table's byte
                    view (ids validated on every call, as in the loader);
- ``index_select``  ``torch.index_select(table, 0, ids, out=buf)``;
- ``table[ids]``    advanced indexing (allocates its output every call);
- ``np.take``       ``np.take(table, ids, axis=0, out=buf)`` (bfloat16 tables
                    are taken through an int16 view: NumPy has no bfloat16);
- ``memcpy``        ``np.copyto`` of a contiguous block of the same size,
                    split into N chunks copied by N threads: the bandwidth
                    ceiling a gather can hope for.

CUDA (``--device cuda``; needs a GPU, exits with one line otherwise; the code
is in ``_gather_cuda.py``, whose docstring has the details): per host table
(``--table-gib 4 32``: each size in turn, skipped when RAM is short) and page
kind (``--pages normal thp``: 4 KiB or 2 MiB pages, ``pingpong.hugepages``),
with the page-lock (``cudaHostRegister``) time and the huge pages obtained:

- ``pingpong zerocopy``        ``gather_rows_cuda`` reading the pinned host table over
                               PCIe straight into device memory (default grid: the SM
                               share is recorded per configuration);
- ``... gpu-sorted``           ``torch.sort`` of the ids on the stream, then the kernel's
                               ``positions=`` path (random ids; the sort is timed);
- ``... full grid``            the same kernel on every SM;
- ``staged``                   ``index_select`` into a pinned buffer + ``copy_`` to the
                               device (the classic CPU-gather path);
- ``pinned memcpy``            host-to-device copy of a pinned block of the same size
                               (the PCIe ceiling);
- ``device index_select``      the table resident in GPU memory (upper bound);

for random ids and for ids in address order (``sorted``), and a sort sweep
(``--batch-ids`` 1k..1M ids per call at ``--sweep-row-bytes``): gather as
given, GPU-sorted, the sort alone, presorted.

Contenders are alternated in a shuffled order each round, with the CPU
caches scrubbed before every timed call (see ``_common.alternate``), for
``--rounds`` rounds; medians are reported, with ratios against
``index_select`` and ``memcpy``.

Run from the repository root::

    python benchmarks/gather.py --quick                  # < 30 s smoke run
    python benchmarks/gather.py --out docs/benchmarks    # full CPU run
    python benchmarks/gather.py --device cuda --out results/gpu   # see gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common
import numpy as np
import torch

ROW_BYTES_FULL = (64, 128, 256, 512, 1024, 2048, 4096)
#: Ids per call in the CUDA sort sweep: does sorting on the GPU pay, and from what size?
SWEEP_BATCH_IDS = (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000)
#: How a host table can be allocated (``--pages``): ``torch`` is ``torch.empty``; the
#: others come from ``pingpong.hugepages.empty_table``.
PAGE_CHOICES = ("torch", "normal", "thp", "hugetlb")
ROW_BYTES_QUICK = (64, 256, 4096)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: NumPy view used by ``np.take`` (NumPy has no bfloat16).
NUMPY_VIEW = {
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.bfloat16: torch.int16,
}
#: Goals from the project brief, checked for rows of at least GOAL_MIN_ROW_BYTES.
GOAL_VS_INDEX_SELECT = 1.0
GOAL_VS_MEMCPY = 0.85
GOAL_MIN_ROW_BYTES = 256

CPU_CONTENDERS = ("pingpong", "index_select", "table[ids]", "np.take", "memcpy")
CUDA_CONTENDERS = (
    "pingpong zerocopy",
    "pingpong zerocopy gpu-sorted",
    "pingpong zerocopy full grid",
    "staged",
    "pinned memcpy",
    "device index_select",
)


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small table, few sizes and dtypes, 3 rounds (< 30 s)",
    )
    p.add_argument(
        "--out",
        type=_common.out_dir,
        default=None,
        help="write gather.json, gather.md (and gather.png) into this folder",
    )
    p.add_argument(
        "--name",
        default=None,
        help="base name of the output files (default: gather, or gather-cuda)",
    )
    p.add_argument(
        "--table-gib",
        type=float,
        nargs="+",
        default=None,
        help="feature table size in GiB (default 1.5 on the CPU, 4 on CUDA; --quick: 0.0625); "
        "CUDA takes several (each in turn; one that does not fit in free RAM is skipped)",
    )
    p.add_argument(
        "--pages",
        nargs="+",
        choices=PAGE_CHOICES,
        default=None,
        help="how the host table is allocated: torch (torch.empty), normal (4 KiB pages: "
        "pingpong.hugepages with MADV_NOHUGEPAGE), thp (2 MiB transparent huge pages), "
        "hugetlb (the reserved pool). Default: torch on the CPU; normal and thp on CUDA, "
        "which takes several",
    )
    p.add_argument(
        "--batch-ids",
        type=int,
        nargs="+",
        default=None,
        help="CUDA: ids per call in the sort sweep (default 1k 4k 16k 64k 256k 1M)",
    )
    p.add_argument(
        "--sweep-row-bytes",
        type=int,
        default=512,
        help="CUDA: row size of the sort sweep (default 512; 0 skips the sweep)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        choices=("json", "md", "png"),
        default=["json", "md", "png"],
        help="what --out receives (default all three)",
    )
    p.add_argument(
        "--batch-mib",
        type=float,
        default=None,
        help="bytes delivered per timed call, MiB (default 64; --quick: 8)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per configuration (default 7; --quick: 3)",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="thread counts N to run (default: 1 and 2 on the CPU; half the cores on CUDA)",
    )
    p.add_argument(
        "--row-bytes",
        type=int,
        nargs="+",
        default=None,
        help="row sizes in bytes (default 64 .. 4096, powers of two)",
    )
    p.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each configuration, wait up to SECONDS for other processes to use "
        "< 0.25 cores (shared machines); the load while timing is recorded either way",
    )
    p.add_argument(
        "--from-json",
        type=_common.json_file,
        default=None,
        help="measure nothing: re-render the Markdown and PNG of an earlier gather.json",
    )
    args = p.parse_args(argv)
    _common.rerender_target(p, args)
    quick = args.quick
    cuda = args.device == "cuda"
    if args.table_gib is None:
        args.table_gib = [0.0625 if quick else (4.0 if cuda else 1.5)]
    if args.pages is None:
        args.pages = ["normal", "thp"] if cuda else ["torch"]
    if args.batch_ids is None:
        args.batch_ids = [1_000, 4_000, 16_000] if quick else list(SWEEP_BATCH_IDS)
    if args.batch_mib is None:
        args.batch_mib = 8.0 if quick else 64.0
    if args.rounds is None:
        args.rounds = 3 if quick else 7
    if args.row_bytes is None:
        args.row_bytes = list(ROW_BYTES_QUICK if quick else ROW_BYTES_FULL)
    if args.dtypes is None:
        # The kernels move bytes: on CUDA float16 stands for both 2-byte types.
        if cuda:
            args.dtypes = ["float32"] if quick else ["float32", "float16"]
        else:
            args.dtypes = ["float32", "bfloat16"] if quick else list(DTYPES)
    if args.threads is None:
        cores = _cores()
        # CPU: every contender at N = 1 and 2.  CUDA: only the staged contender
        # uses CPU threads; give it the loader's default (half the cores).
        args.threads = [max(1, cores // 2)] if cuda else sorted({1, min(2, cores)})
    if args.name is None:
        args.name = "gather" if args.device == "cpu" else "gather-cuda"
    for rb in args.row_bytes:
        if rb < 2 or rb % 2:
            p.error(f"--row-bytes must be even and >= 2 (bfloat16 rows), got {rb}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not cuda and (len(args.table_gib) != 1 or len(args.pages) != 1):
        p.error("the CPU run takes one --table-gib and one --pages")
    if any(size <= 0 for size in args.table_gib):
        p.error("--table-gib must be positive")
    if any(n < 1 for n in args.batch_ids):
        p.error("--batch-ids must be positive")
    # Every contender gets n threads; Numba's pool has at most NUMBA_NUM_THREADS
    # (the cores, by default): more would compare fewer threads with more.
    numba_max = _numba_max_threads()
    if any(not 1 <= n <= numba_max for n in args.threads):
        p.error(f"--threads must be between 1 and {numba_max} (Numba's pool here, "
                f"NUMBA_NUM_THREADS), got {args.threads}")
    if args.sweep_row_bytes < 0 or args.sweep_row_bytes % 2:
        p.error("--sweep-row-bytes must be even and >= 0")
    return args


def _numba_max_threads() -> int:
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def _cores() -> int:
    import os

    return os.cpu_count() or 1


# --------------------------------------------------------------------------- shared


def make_table(nbytes: int, seed: int, pages: str = "torch") -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` random bytes, every page touched.

    ``pages``: ``torch`` (``torch.empty``) or a ``pingpong.hugepages`` page kind.
    """
    size = nbytes // 8 * 8
    if pages == "torch":
        storage = torch.empty(size, dtype=torch.uint8)
    else:
        from pingpong.hugepages import empty_table

        storage = empty_table(size, torch.uint8, pages=pages)
    gen = torch.Generator().manual_seed(seed)
    storage.view(torch.int64).random_(generator=gen)
    return storage


def make_ids(num_rows: int, n: int, order: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (n,), dtype=torch.int64, generator=gen)
    if order == "sorted":
        ids = ids.sort().values
    return ids


def _config_seed(seed: int, *parts: object) -> int:
    """A seed per configuration, the same in every process (no ``hash()``)."""
    key = "/".join(str(p) for p in parts).encode()
    return (seed * 1_000_003 + zlib.crc32(key)) % 2**31


class ParallelCopy:
    """``np.copyto`` of a contiguous block split into N chunks, N threads."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None:
        if self.pool is None:
            np.copyto(dst, src)
            return
        step = -(-src.shape[0] // self.threads)
        futures = [
            self.pool.submit(
                np.copyto, dst[i * step : (i + 1) * step], src[i * step : (i + 1) * step]
            )
            for i in range(1, self.threads)
        ]
        np.copyto(dst[:step], src[:step])
        for future in futures:
            future.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def set_threads(n: int) -> None:
    """Give every contender ``n`` threads.

    Numba first: its first ``set_num_threads`` starts its OpenMP threading
    layer, which resets the calling thread's OpenMP thread count -- the one
    torch's intra-op pool reads -- to all cores (seen with torch 2.13 and
    numba 0.68: torch.set_num_threads(1) then numba.set_num_threads(1) leaves
    torch.get_num_threads() == 2).  Then torch, and check it took.
    """
    import numba

    numba.set_num_threads(n)  # parse_args kept n within Numba's pool
    torch.set_num_threads(n)
    if torch.get_num_threads() != n:
        raise SystemExit(f"torch kept {torch.get_num_threads()} threads, asked for {n}")


# --------------------------------------------------------------------------- CPU


def cpu_contenders(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    memcpy_src: np.ndarray,
    copier: ParallelCopy,
) -> dict[str, Callable[[], object]]:
    from pingpong.kernels import gather_rows_cpu

    table_bytes = table.view(torch.uint8).numpy()
    out_bytes = out.view(torch.uint8).numpy()
    np_view = NUMPY_VIEW[table.dtype]
    table_np = table.view(np_view).numpy()
    out_np = out.view(np_view).numpy()
    ids_np = ids.numpy()
    memcpy_dst = out_bytes.reshape(-1)

    return {
        "pingpong": lambda: gather_rows_cpu(table_bytes, ids_np, out_bytes),
        "index_select": lambda: torch.index_select(table, 0, ids, out=out),
        "table[ids]": lambda: table[ids],
        "np.take": lambda: np.take(table_np, ids_np, axis=0, out=out_np),
        "memcpy": lambda: copier(memcpy_dst, memcpy_src),
    }


def check_cpu_outputs(
    contenders: dict[str, Callable[[], object]],
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
) -> list[str]:
    """Run each gather once and compare bytes with ``table[ids]``; return mismatches."""
    expected = table[ids].view(torch.uint8)
    bad = []
    for name in ("pingpong", "index_select", "np.take"):
        out.view(torch.uint8).fill_(0)
        contenders[name]()
        if not torch.equal(out.view(torch.uint8), expected):
            bad.append(name)
    return bad


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import numba

    table_bytes = int(args.table_gib[0] * 2**30)
    batch_bytes = int(args.batch_mib * 2**20)
    print(
        f"# table {table_bytes / 2**30:.2f} GiB, {batch_bytes / 2**20:.0f} MiB per call, "
        f"{args.rounds} rounds",
        flush=True,
    )
    storage = make_table(table_bytes, args.seed, args.pages[0])
    out_storage = torch.empty(batch_bytes, dtype=torch.uint8)
    out_storage.fill_(0)
    scrub = _common.CacheScrubber()
    load_samples: list[float] = []
    other_samples: list[float] = []
    results = []
    for n_threads in args.threads:
        set_threads(n_threads)
        copier = ParallelCopy(n_threads)
        try:
            for dtype_name in args.dtypes:
                dtype = DTYPES[dtype_name]
                itemsize = torch.empty((), dtype=dtype).element_size()
                for order in ("random", "sorted"):
                    for row_bytes in args.row_bytes:
                        width = row_bytes // itemsize
                        num_rows = table_bytes // row_bytes
                        n = batch_bytes // row_bytes
                        table = storage[: num_rows * row_bytes].view(dtype).view(num_rows, width)
                        out = out_storage[: n * row_bytes].view(dtype).view(n, width)
                        seed = _config_seed(args.seed, n_threads, dtype_name, order, row_bytes)
                        ids = make_ids(num_rows, n, order, seed)
                        start = int(np.random.default_rng(seed).integers(0, num_rows - n + 1))
                        memcpy_src = storage.numpy()[start * row_bytes : (start + n) * row_bytes]
                        fns = cpu_contenders(table, ids, out, memcpy_src, copier)
                        mismatches = check_cpu_outputs(fns, table, ids, out)
                        if "pingpong" in mismatches:
                            raise SystemExit(
                                f"pingpong gathered wrong bytes ({dtype_name}, {row_bytes} B rows)"
                            )
                        waited = 0.0
                        if args.wait_quiet > 0:
                            waited, _ = _common.wait_for_quiet(args.wait_quiet)
                        load = _common.load_average()
                        if load is not None:
                            load_samples.append(load[0])
                        other = _common.OtherLoad()
                        other.start()
                        samples = _common.alternate(
                            fns, args.rounds, warmup=1, before_each=scrub, seed=seed
                        )
                        other_cores = other.stop()
                        if other_cores is not None:
                            other_samples.append(other_cores)
                        delivered = n * row_bytes
                        summary = {k: _common.summarize(v, delivered) for k, v in samples.items()}
                        record = {
                            "threads": n_threads,
                            "dtype": dtype_name,
                            "order": order,
                            "row_bytes": row_bytes,
                            "rows_per_call": n,
                            "bytes_per_call": delivered,
                            "load_1min_before": None if load is None else load[0],
                            "other_processes_cores": other_cores,
                            "waited_for_quiet_s": waited,
                            "mismatches": mismatches,
                            "seconds": samples,
                            "summary": summary,
                        }
                        results.append(record)
                        print(_progress_line(record, CPU_CONTENDERS), flush=True)
        finally:
            copier.close()
    return {
        "benchmark": "gather",
        "device": "cpu",
        "command": _common.command_line(),
        "machine": _common.machine_info(),
        "numba_threading_layer": str(numba.threading_layer()),
        "settings": {
            "table_bytes": table_bytes,
            "batch_bytes": batch_bytes,
            "rounds": args.rounds,
            "threads": args.threads,
            "row_bytes": args.row_bytes,
            "dtypes": args.dtypes,
            "seed": args.seed,
            "wait_quiet_s": args.wait_quiet,
            "pages": args.pages[0],
        },
        "load_1min": _load_stats(load_samples),
        "other_processes_cores": _spread(other_samples),
        "results": results,
    }


def _load_stats(samples: list[float]) -> dict[str, float] | None:
    if not samples:
        return None
    final = _common.load_average()
    if final is not None:
        samples = [*samples, final[0]]
    return {"min": min(samples), "median": float(np.median(samples)), "max": max(samples)}


def _spread(samples: list[float]) -> dict[str, float] | None:
    if not samples:
        return None
    return {"min": min(samples), "median": float(np.median(samples)), "max": max(samples)}


def _progress_line(record: dict[str, Any], names: tuple[str, ...]) -> str:
    gbps = "  ".join(
        f"{name}={record['summary'][name]['median_gbps']:.2f}"
        for name in names
        if name in record["summary"]
    )
    return (
        f"N={record['threads']} {record['dtype']:>8} {record['order']:>6} "
        f"{record['row_bytes']:>4} B: {gbps} GB/s"
    )


# --------------------------------------------------------------------------- CUDA
# The CUDA run lives in _gather_cuda.py, imported only for --device cuda.


def cuda_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU, or a CPU-only torch build)"
    try:
        from numba import cuda
    except ImportError:
        return "numba.cuda cannot be imported (install numba-cuda)"
    if not cuda.is_available():
        return "numba.cuda.is_available() is False"
    return None


def run_cuda(args: argparse.Namespace) -> dict[str, Any]:
    import _gather_cuda

    return _gather_cuda.run(args, sys.modules[__name__])


# --------------------------------------------------------------------------- report


def _ratio(record: dict[str, Any], name: str, base: str) -> float | None:
    s = record["summary"]
    if name not in s or base not in s:
        return None
    return s[name]["median_gbps"] / s[base]["median_gbps"]


def goal_check(report: dict[str, Any]) -> dict[str, Any] | None:
    """The brief's CPU goals for rows >= GOAL_MIN_ROW_BYTES; None for CUDA runs."""
    if report["device"] != "cpu":
        return None
    rows = [r for r in report["results"] if r["row_bytes"] >= GOAL_MIN_ROW_BYTES]
    if not rows:
        return None
    vs_is = [_ratio(r, "pingpong", "index_select") for r in rows]
    vs_mc = [_ratio(r, "pingpong", "memcpy") for r in rows]
    return {
        "configs": len(rows),
        "vs_index_select_goal": GOAL_VS_INDEX_SELECT,
        "vs_index_select_met": sum(v is not None and v >= GOAL_VS_INDEX_SELECT for v in vs_is),
        "vs_index_select_min": min(v for v in vs_is if v is not None),
        "vs_index_select_median": float(np.median([v for v in vs_is if v is not None])),
        "vs_memcpy_goal": GOAL_VS_MEMCPY,
        "vs_memcpy_met": sum(v is not None and v >= GOAL_VS_MEMCPY for v in vs_mc),
        "vs_memcpy_min": min(v for v in vs_mc if v is not None),
        "vs_memcpy_median": float(np.median([v for v in vs_mc if v is not None])),
    }


def render_markdown(report: dict[str, Any]) -> str:
    cpu = report["device"] == "cpu"
    names = CPU_CONTENDERS if cpu else CUDA_CONTENDERS
    ours, base, ceiling = (
        ("pingpong", "index_select", "memcpy")
        if cpu
        else ("pingpong zerocopy", "staged", "pinned memcpy")
    )
    s = report["settings"]
    load = report.get("load_1min")
    lines = [
        f"# Gather throughput ({report['device'].upper()})",
        "",
        "Command (from the repository root):",
        "",
        "```",
        report["command"],
        "```",
        "",
        "Machine: " + _common.describe_machine(report["machine"]),
    ]
    if not cpu:
        lines.append(f"GPU: {report['gpu']}.")
    if cpu:
        lines.append(f"Numba threading layer: {report['numba_threading_layer']}.")
    if load:
        lines.append(
            f"Machine load while measuring (1-minute load average, sampled before each "
            f"configuration): min {load['min']:.2f}, median {load['median']:.2f}, "
            f"max {load['max']:.2f} on {report['machine']['logical_cores']} cores "
            "(the benchmark itself contributes up to N)."
        )
    other = report.get("other_processes_cores")
    if other:
        lines.append(
            "CPU used by other processes while timing (cores' worth, per configuration): "
            f"min {other['min']:.2f}, median {other['median']:.2f}, max {other['max']:.2f}"
            " (the `other` column below)."
        )
    if s.get("wait_quiet_s"):
        lines.append(
            f"Before each configuration the script waited up to {s['wait_quiet_s']:.0f} s "
            "for other processes to use less than 0.25 cores."
        )
    sizes = s["table_bytes"] if isinstance(s["table_bytes"], list) else [s["table_bytes"]]
    table_text = " and ".join(f"{size / 2**30:.2f}" for size in sizes)
    lines += [
        "",
        f"Table {table_text} GiB; {s['batch_bytes'] / 2**20:.0f} MiB of rows "
        f"delivered per timed call; {s['rounds']} rounds, contenders in a shuffled order each "
        "round, CPU caches scrubbed before every timed call; "
        "numbers are medians in GB/s of rows delivered (rows x row bytes / time). "
        f"Ratios are `{ours}` / `{base}` and `{ours}` / `{ceiling}`.",
    ]
    goals = goal_check(report)
    if goals:
        lines += [
            "",
            f"## Goals (rows >= {GOAL_MIN_ROW_BYTES} B, {goals['configs']} configurations)",
            "",
            _common.markdown_table(
                ["goal", "met in", "median ratio", "worst ratio"],
                [
                    [
                        f"pingpong >= {GOAL_VS_INDEX_SELECT:.2f} x index_select",
                        f"{goals['vs_index_select_met']} / {goals['configs']}",
                        goals["vs_index_select_median"],
                        goals["vs_index_select_min"],
                    ],
                    [
                        f"pingpong >= {GOAL_VS_MEMCPY:.2f} x memcpy",
                        f"{goals['vs_memcpy_met']} / {goals['configs']}",
                        goals["vs_memcpy_median"],
                        goals["vs_memcpy_min"],
                    ],
                ],
            ),
        ]
    headline = render_headline(report)
    if headline:
        lines += ["", "## Headline", "", HEADLINE_BEGIN, headline, HEADLINE_END]
    mism = [r for r in report["results"] if r["mismatches"]]
    if mism:
        lines += [
            "",
            "Contenders whose output differed from `table[ids]`: "
            + "; ".join(
                f"{', '.join(r['mismatches'])} ({r['dtype']}, {r['row_bytes']} B)" for r in mism
            ),
        ]
    if not cpu:
        import _gather_cuda

        lines += _gather_cuda.render_markdown(report, sys.modules[__name__])
        return "\n".join(lines)
    for n_threads in s["threads"]:
        headers = ["dtype", "ids", "row B", *names, f"/{base}", f"/{ceiling}", "other"]
        rows = []
        for r in report["results"]:
            if r["threads"] != n_threads:
                continue
            rows.append(
                [
                    r["dtype"],
                    r["order"],
                    r["row_bytes"],
                    *(r["summary"][name]["median_gbps"] for name in names),
                    _ratio(r, ours, base),
                    _ratio(r, ours, ceiling),
                    _fmt_other(r.get("other_processes_cores")),
                ]
            )
        lines += [
            "",
            f"## N = {n_threads} thread{'s' if n_threads > 1 else ''}",
            "",
            _common.markdown_table(headers, rows),
        ]
    return "\n".join(lines)


def _fmt_other(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


#: Markers around the headline table, so docs can include just that table.
HEADLINE_BEGIN = "<!-- headline-begin -->"
HEADLINE_END = "<!-- headline-end -->"
HEADLINE_ROW_BYTES = (256, 512, 4096)


def render_headline(report: dict[str, Any]) -> str | None:
    """float32 rows of 256 B, 512 B and 4 KB: ours vs the baseline and the ceiling."""
    cpu = report["device"] == "cpu"
    ours, base, ceiling = (
        ("pingpong", "index_select", "memcpy")
        if cpu
        else ("pingpong zerocopy", "staged", "pinned memcpy")
    )
    dtype = "float32"
    if not cpu and any("pages" in r for r in report["results"]):
        rows = [
            [
                f"{r['table_bytes'] / 2**30:g} GiB",
                r["pages"],
                r["order"],
                r["row_bytes"],
                *(r["summary"].get(name, {}).get("median_gbps", "-") for name in (
                    ours, "pingpong zerocopy gpu-sorted", base, ceiling)),
                _ratio(r, ours, ceiling) or "-",
                _fmt_other(r.get("other_processes_cores")),
            ]
            for r in report["results"]
            if r["dtype"] == dtype and r["row_bytes"] in HEADLINE_ROW_BYTES
        ]
        if not rows:
            return None
        headers = ["table", "pages", "ids", "row B", ours, "gpu-sorted", base, ceiling,
                   f"/{ceiling}", "other"]
        return _common.markdown_table(headers, rows)
    rows = [
        [
            r["threads"],
            r["order"],
            r["row_bytes"],
            r["summary"][ours]["median_gbps"],
            r["summary"][base]["median_gbps"],
            r["summary"][ceiling]["median_gbps"],
            _ratio(r, ours, base),
            _ratio(r, ours, ceiling),
            _fmt_other(r.get("other_processes_cores")),
        ]
        for r in report["results"]
        if r["dtype"] == dtype and r["row_bytes"] in HEADLINE_ROW_BYTES
    ]
    if not rows:
        return None
    headers = ["N", "ids", "row B", ours, base, ceiling, f"/{base}", f"/{ceiling}", "other"]
    return _common.markdown_table(headers, rows)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    cpu = report["device"] == "cpu"
    names = CPU_CONTENDERS if cpu else CUDA_CONTENDERS
    dtype = (
        "float32" if "float32" in report["settings"]["dtypes"] else report["settings"]["dtypes"][0]
    )
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in report["results"]:
        if r["dtype"] != dtype:
            continue
        if cpu:
            panel = f"N={r['threads']}, {r['order']} ids, {dtype}"
        else:
            panel = (f"{r.get('table_bytes', 0) / 2**30:g} GiB {r.get('pages', 'torch')} pages, "
                     f"{r['order']} ids")
        series = panels.setdefault(panel, {name: [] for name in names})
        for name in names:
            if name in r["summary"]:
                series[name].append((r["row_bytes"], r["summary"][name]["median_gbps"]))
    panels = {
        panel: {name: points for name, points in series.items() if points}
        for panel, series in panels.items()
    }
    if not panels:
        return None
    title = f"Gather throughput ({report['device']}): median GB/s of rows delivered"
    return _common.plot_lines(path, panels, "row bytes", "GB/s", title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and args.from_json is None:
        reason = cuda_unavailable_reason()
        if reason is not None:
            print(f"gather.py: --device cuda needs a CUDA GPU: {reason}", file=sys.stderr)
            return 2
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        return write_outputs(report, args)
    t0 = time.perf_counter()
    report = run_cpu(args) if args.device == "cpu" else run_cuda(args)
    report["elapsed_s"] = time.perf_counter() - t0
    return write_outputs(report, args)


def write_outputs(report: dict[str, Any], args: argparse.Namespace) -> int:
    goals = goal_check(report)
    if goals is not None:
        report["goals"] = goals
    markdown = render_markdown(report)
    if args.out is not None:
        formats = getattr(args, "formats", ["json", "md", "png"])
        written = []
        if "json" in formats:
            written.append(_common.write_json(args.out / f"{args.name}.json", report))
        if "md" in formats:
            written.append(_common.write_markdown(args.out / f"{args.name}.md", markdown))
        png = render_plot(report, args.out / f"{args.name}.png") if "png" in formats else None
        if png is not None:
            written.append(png)
        elif "png" in formats:
            print("# no PNG: matplotlib is not installed (pip install matplotlib)",
                  file=sys.stderr)
        print("# wrote " + (", ".join(str(p) for p in written) or "nothing"))
        if not written:
            return 1  # every format asked for was left out
    else:
        print(markdown)
    print(f"# {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
