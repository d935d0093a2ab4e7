"""The CUDA half of ``benchmarks/gather.py`` (imported only with ``--device cuda``).

For each host table (``--table-gib``, each size in turn) and each way of
allocating it (``--pages``: 4 KiB pages or 2 MiB huge pages), the table is
filled with random bytes, page-locked in place (``cudaHostRegister``, timed:
huge pages register faster) and, when it fits in half the free GPU memory,
copied to the GPU for the device-resident contender. Then:

1. per row size (``--row-bytes``), dtype and id order, ``--batch-mib`` of rows
   per call, every contender once per round in a shuffled order, CPU caches
   scrubbed before each call:

   - ``pingpong zerocopy``             the loader's kernel and default grid (about
                                       10% of the SMs), ids as given;
   - ``pingpong zerocopy gpu-sorted``  ``torch.sort`` of the ids on the stream, then
                                       the kernel's ``positions=`` path scatters rows
                                       back (what ``sort_ids="auto"`` does in the
                                       loader); random ids only; the sort is timed;
   - ``pingpong zerocopy full grid``   the same kernel on every SM;
   - ``staged``                        ``index_select`` into pinned memory + copy;
   - ``pinned memcpy``                 a contiguous pinned block of the same size (the
                                       PCIe ceiling);
   - ``device index_select``           the table in GPU memory (upper bound);

   id orders: ``random`` (uniform) and ``sorted`` (the same kind of ids in
   address order, sorted before timing: what sorting can at best reach);

2. the sort sweep (``--batch-ids``, at ``--sweep-row-bytes``): for batches of
   1k to 1M random ids, the zero-copy gather as given, with the GPU sort (sort
   included), the sort alone, and already sorted ids -- when does sorting pay?

Every gather's output is compared with ``table[ids]`` before timing. The
grid each launch uses is recorded with the SM count (the "SM share").
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import _common
import numpy as np
import torch

SWEEP_CONTENDERS = (
    "zerocopy",
    "zerocopy gpu-sorted",
    "torch.sort alone",
    "zerocopy presorted",
)
#: Free host memory to keep beside a table (the process, staging, the OS).
RAM_RESERVE_BYTES = 8 * 2**30


def _scrubber() -> _common.CacheScrubber:
    """Cache scrubbing for the GPU runs: twice the last-level cache, 64-512 MiB.

    (The CPU benchmark reads 4x the LLC; on a GPU host with a 300 MB LLC that is
    ~0.2 s per timed call, which would not fit the GPU check's time limit.)
    """
    return _common.CacheScrubber(max(64 * 2**20, min(2 * _common.cache_bytes(), 512 * 2**20)))


def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _grid_info(plan: Any) -> dict[str, Any]:
    """Blocks, SMs a launch can occupy, and their share of the GPU."""
    from pingpong.kernels import cuda as kc

    sms, threads_per_sm = kc._device_limits()
    blocks_per_sm = max(1, threads_per_sm // plan.threads_per_block)
    used = min(sms, math.ceil(plan.blocks / blocks_per_sm))
    return {
        "blocks": plan.blocks,
        "threads_per_block": plan.threads_per_block,
        "threads_per_row": plan.threads_per_row,
        "word_bytes": plan.word_bytes,
        "sms_used": used,
        "sm_share": used / sms,
    }


def run(args: argparse.Namespace, g: ModuleType) -> dict[str, Any]:
    """Measure everything; ``g`` is ``gather.py`` (its shared helpers)."""
    from pingpong.kernels import cuda as kc

    device = torch.device("cuda")
    batch_bytes = int(args.batch_mib * 2**20)
    sweep_rows = args.sweep_row_bytes
    sweep_bytes = max(args.batch_ids) * sweep_rows if sweep_rows else 0
    out_storage = torch.empty(max(batch_bytes, sweep_bytes), dtype=torch.uint8, device=device)
    staging = torch.empty(batch_bytes, dtype=torch.uint8).pin_memory()
    sms, threads_per_sm = kc._device_limits()
    report: dict[str, Any] = {
        "benchmark": "gather",
        "device": "cuda",
        "gpu": torch.cuda.get_device_name(device),
        "command": _common.command_line(),
        "machine": _common.machine_info(),
        "sm": {
            "sms": sms,
            "threads_per_sm": threads_per_sm,
            "default_max_blocks": kc.default_max_blocks(),
            "default_sm_share": kc.DEFAULT_SM_SHARE,
            "full_grid_blocks": kc.full_grid_blocks(),
        },
        "settings": {
            "table_bytes": [int(gib * 2**30) for gib in args.table_gib],
            "pages": args.pages,
            "batch_bytes": batch_bytes,
            "rounds": args.rounds,
            "threads": args.threads,
            "row_bytes": args.row_bytes,
            "dtypes": args.dtypes,
            "seed": args.seed,
            "sweep_row_bytes": sweep_rows,
            "batch_ids": args.batch_ids,
        },
        "tables": [],
        "skipped": [],
        "results": [],
        "sweep": [],
    }
    load_samples: list[float] = []
    other_samples: list[float] = []
    for gib in args.table_gib:
        table_bytes = int(gib * 2**30)
        available = _available_ram()
        if available is not None and table_bytes + RAM_RESERVE_BYTES > available:
            note = (f"{gib:g} GiB table skipped: {available / 2**30:.1f} GiB of RAM available, "
                    f"{(table_bytes + RAM_RESERVE_BYTES) / 2**30:.1f} GiB needed")
            print(f"# {note}", flush=True)
            report["skipped"].append(note)
            continue
        for pages in args.pages:
            _one_table(args, g, report, table_bytes, pages, out_storage, staging,
                       load_samples, other_samples)
    report["load_1min"] = g._load_stats(load_samples)
    report["other_processes_cores"] = g._spread(other_samples)
    return report


def _one_table(
    args: argparse.Namespace,
    g: ModuleType,
    report: dict[str, Any],
    table_bytes: int,
    pages: str,
    out_storage: torch.Tensor,
    staging: torch.Tensor,
    load_samples: list[float],
    other_samples: list[float],
) -> None:
    import warnings

    from pingpong import hugepages
    from pingpong.kernels import _interop

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", hugepages.HugePageWarning)
        host = g.make_table(table_bytes, args.seed, pages)
    fill_s = time.perf_counter() - t0
    info: dict[str, Any] = {
        "table_bytes": table_bytes,
        "pages": pages,
        "thp_mode": hugepages.thp_mode(),
        "fill_s": fill_s,
        "warnings": [str(w.message) for w in caught],
    }
    try:
        page = hugepages.page_report(host)
        info["page_report"] = {**vars(page), "huge_fraction": page.huge_fraction,
                               "page_bytes": page.page_bytes}
    except (OSError, ValueError) as exc:
        info["page_report"] = None
        info["page_report_error"] = str(exc)
    t0 = time.perf_counter()
    pinned = _interop.pin_in_place(host.numpy(), host)
    info["register_s"] = time.perf_counter() - t0
    free, _total = torch.cuda.mem_get_info()
    resident = None
    if table_bytes <= free // 2:
        resident = host.to("cuda")
    info["device_copy"] = resident is not None
    report["tables"].append(info)
    print(f"# table {table_bytes / 2**30:.1f} GiB, pages {pages}: filled in {fill_s:.1f} s, "
          f"registered in {info['register_s']:.2f} s, huge pages "
          f"{(info['page_report'] or {}).get('huge_fraction', float('nan')):.0%}", flush=True)
    try:
        for record in _configs(args, g, host, pinned.array, resident, out_storage, staging,
                               table_bytes, pages, load_samples, other_samples):
            report["results"].append(record)
        if args.sweep_row_bytes:
            report["sweep"].append(_sweep(args, host, pinned.array, out_storage, table_bytes,
                                          pages))
    finally:
        torch.cuda.synchronize()
        pinned.release()
        del resident, host
        gc.collect()
        torch.cuda.empty_cache()


def _configs(
    args: argparse.Namespace,
    g: ModuleType,
    host: torch.Tensor,
    host_view: Any,
    resident: torch.Tensor | None,
    out_storage: torch.Tensor,
    staging: torch.Tensor,
    table_bytes: int,
    pages: str,
    load_samples: list[float],
    other_samples: list[float],
) -> list[dict[str, Any]]:
    from numba import cuda

    from pingpong.kernels import gather_rows_cuda
    from pingpong.kernels.cuda import full_grid_blocks, gather_rows_cuda_unchecked, plan_gather

    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    scrub = _scrubber()
    batch_bytes = int(args.batch_mib * 2**20)
    records = []
    for n_threads in args.threads:
        g.set_threads(n_threads)
        for dtype_name in args.dtypes:
            dtype = g.DTYPES[dtype_name]
            itemsize = torch.empty((), dtype=dtype).element_size()
            for order in ("random", "sorted"):
                for row_bytes in args.row_bytes:
                    width = row_bytes // itemsize
                    num_rows = table_bytes // row_bytes
                    n = batch_bytes // row_bytes
                    used = num_rows * row_bytes
                    table_host = host[:used].view(dtype).view(num_rows, width)
                    table_zc = host_view[:used].reshape(num_rows, row_bytes)
                    out_flat = out_storage[: n * row_bytes]
                    out = out_flat.view(dtype).view(n, width)
                    out_nb = cuda.as_cuda_array(out_flat.view(n, row_bytes))
                    stage = staging[: n * row_bytes].view(dtype).view(n, width)
                    seed = g._config_seed(args.seed, "cuda", n_threads, dtype_name, order,
                                          row_bytes, table_bytes)
                    ids = g.make_ids(num_rows, n, order, seed)
                    ids_dev = ids.to("cuda")
                    ids_nb = cuda.as_cuda_array(ids_dev)
                    start = int(np.random.default_rng(seed).integers(0, num_rows - n + 1))
                    block = host[start * row_bytes : (start + n) * row_bytes]
                    plan = plan_gather(table_zc, out_nb, n)

                    # validated once here; timed calls skip the check, as the loader does
                    gather_rows_cuda(table_zc, ids_nb, out_nb, stream)

                    def zerocopy(table_zc=table_zc, ids_nb=ids_nb, out_nb=out_nb) -> None:
                        gather_rows_cuda_unchecked(table_zc, ids_nb, out_nb, stream)
                        torch.cuda.synchronize()

                    def gpu_sorted(table_zc=table_zc, ids_dev=ids_dev, out_nb=out_nb) -> None:
                        sorted_ids, positions = torch.sort(ids_dev)
                        gather_rows_cuda_unchecked(
                            table_zc, cuda.as_cuda_array(sorted_ids), out_nb, stream,
                            positions=cuda.as_cuda_array(positions),
                        )
                        torch.cuda.synchronize()

                    def zerocopy_full(table_zc=table_zc, ids_nb=ids_nb, out_nb=out_nb) -> None:
                        gather_rows_cuda_unchecked(
                            table_zc, ids_nb, out_nb, stream, max_blocks=full_grid_blocks()
                        )
                        torch.cuda.synchronize()

                    def staged(table_host=table_host, ids=ids, stage=stage, out=out) -> None:
                        torch.index_select(table_host, 0, ids, out=stage)
                        out.copy_(stage, non_blocking=True)
                        torch.cuda.synchronize()

                    def pinned_memcpy(block=block, out_flat=out_flat) -> None:
                        out_flat.copy_(block, non_blocking=True)
                        torch.cuda.synchronize()

                    fns: dict[str, Callable[[], object]] = {"pingpong zerocopy": zerocopy}
                    if order == "random":
                        fns["pingpong zerocopy gpu-sorted"] = gpu_sorted
                    fns["pingpong zerocopy full grid"] = zerocopy_full
                    fns["staged"] = staged
                    fns["pinned memcpy"] = pinned_memcpy
                    if resident is not None:
                        table_dev = resident[:used].view(dtype).view(num_rows, width)

                        def device_index_select(table_dev=table_dev, ids_dev=ids_dev,
                                                out=out) -> None:
                            torch.index_select(table_dev, 0, ids_dev, out=out)
                            torch.cuda.synchronize()

                        fns["device index_select"] = device_index_select
                    expected = table_host[ids].view(torch.uint8)
                    mismatches = []
                    for name, fn in fns.items():
                        if name == "pinned memcpy":
                            continue
                        out_storage.zero_()
                        fn()
                        if not torch.equal(out.view(torch.uint8).cpu(), expected):
                            mismatches.append(name)
                    if any(name.startswith("pingpong") for name in mismatches):
                        raise SystemExit(
                            f"pingpong gathered wrong bytes ({mismatches}; {dtype_name}, "
                            f"{row_bytes} B, {pages} pages)"
                        )
                    load = _common.load_average()
                    if load is not None:
                        load_samples.append(load[0])
                    other = _common.OtherLoad()
                    other.start()
                    samples = _common.alternate(
                        fns, args.rounds, warmup=2, before_each=scrub, seed=seed
                    )
                    other_cores = other.stop()
                    if other_cores is not None:
                        other_samples.append(other_cores)
                    delivered = n * row_bytes
                    record = {
                        "table_bytes": table_bytes,
                        "pages": pages,
                        "threads": n_threads,
                        "dtype": dtype_name,
                        "order": order,
                        "row_bytes": row_bytes,
                        "rows_per_call": n,
                        "bytes_per_call": delivered,
                        "grid": _grid_info(plan),
                        "load_1min_before": None if load is None else load[0],
                        "other_processes_cores": other_cores,
                        "mismatches": mismatches,
                        "seconds": samples,
                        "summary": {k: _common.summarize(v, delivered) for k, v in samples.items()},
                    }
                    records.append(record)
                    print(f"{table_bytes / 2**30:g} GiB {pages:>6} "
                          + g._progress_line(record, g.CUDA_CONTENDERS), flush=True)
    return records


def _sweep(
    args: argparse.Namespace,
    host: torch.Tensor,
    host_view: Any,
    out_storage: torch.Tensor,
    table_bytes: int,
    pages: str,
) -> dict[str, Any]:
    """Random ids, 1k to 1M per call: the gather as given, GPU-sorted, the sort alone,
    and presorted. Each timed sample runs ``k`` calls back to back (about
    ``--batch-mib`` of rows in all; fresh ids each, so no call finds the previous
    one's rows in the CPU cache) and divides by ``k``."""
    from numba import cuda

    from pingpong.kernels.cuda import gather_rows_cuda_unchecked

    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    row_bytes = args.sweep_row_bytes
    num_rows = table_bytes // row_bytes
    table_zc = host_view[: num_rows * row_bytes].reshape(num_rows, row_bytes)
    table_host = host[: num_rows * row_bytes].view(num_rows, row_bytes)
    target = int(args.batch_mib * 2**20)
    points = []
    for n in args.batch_ids:
        k = max(1, min(256, math.ceil(target / (n * row_bytes))))
        gen = torch.Generator(device="cuda").manual_seed(args.seed + n)
        ids = torch.randint(0, num_rows, (k, n), device="cuda", generator=gen)
        presorted = torch.sort(ids, dim=1).values
        ids_nb = [cuda.as_cuda_array(ids[i]) for i in range(k)]
        presorted_nb = [cuda.as_cuda_array(presorted[i]) for i in range(k)]
        out_flat = out_storage[: n * row_bytes]
        out_nb = cuda.as_cuda_array(out_flat.view(n, row_bytes))

        def as_given(ids_nb=ids_nb, out_nb=out_nb) -> None:
            for one in ids_nb:
                gather_rows_cuda_unchecked(table_zc, one, out_nb, stream)
            torch.cuda.synchronize()

        def gpu_sorted(ids=ids, out_nb=out_nb) -> None:
            for i in range(ids.shape[0]):
                sorted_ids, positions = torch.sort(ids[i])
                gather_rows_cuda_unchecked(
                    table_zc, cuda.as_cuda_array(sorted_ids), out_nb, stream,
                    positions=cuda.as_cuda_array(positions),
                )
            torch.cuda.synchronize()

        def sort_alone(ids=ids) -> None:
            for i in range(ids.shape[0]):
                torch.sort(ids[i])
            torch.cuda.synchronize()

        def presorted_gather(presorted_nb=presorted_nb, out_nb=out_nb) -> None:
            for one in presorted_nb:
                gather_rows_cuda_unchecked(table_zc, one, out_nb, stream)
            torch.cuda.synchronize()

        fns: dict[str, Callable[[], object]] = dict(zip(
            SWEEP_CONTENDERS, (as_given, gpu_sorted, sort_alone, presorted_gather), strict=True))
        # the last call of each gather must hold table[ids[-1]]
        for name in ("zerocopy", "zerocopy gpu-sorted"):
            out_flat.zero_()
            fns[name]()
            if not torch.equal(out_flat.view(n, row_bytes).cpu(), table_host[ids[-1].cpu()]):
                raise SystemExit(f"sweep: {name} gathered wrong bytes at {n} ids")
        # No scrub: every call reads fresh random rows of a table far larger than the cache.
        samples = _common.alternate(fns, args.rounds, warmup=1, seed=n)
        per_call = {name: [t / k for t in times] for name, times in samples.items()}
        summary = {name: _common.summarize(times, n * row_bytes)
                   for name, times in per_call.items()}
        given = summary["zerocopy"]["median_s"]
        sorted_total = summary["zerocopy gpu-sorted"]["median_s"]
        points.append({
            "ids": n,
            "calls_per_sample": k,
            "seconds_per_call": per_call,
            "summary": summary,
            "gpu_sort_speedup": given / sorted_total,
        })
        print(f"sweep {table_bytes / 2**30:g} GiB {pages:>6} {n:>8} ids x {row_bytes} B: "
              + "  ".join(f"{name}={summary[name]['median_s'] * 1e6:.0f}us"
                          for name in SWEEP_CONTENDERS)
              + f"  sort speed-up {given / sorted_total:.2f}x", flush=True)
    return {"table_bytes": table_bytes, "pages": pages, "row_bytes": row_bytes,
            "points": points}


# --------------------------------------------------------------------------- report


def _group_key(record: dict[str, Any]) -> tuple[int, str]:
    return (int(record.get("table_bytes", 0)), str(record.get("pages", "torch")))


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB"


def _cell(record: dict[str, Any], name: str) -> Any:
    summary = record["summary"].get(name)
    return "-" if summary is None else summary["median_gbps"]


def render_markdown(report: dict[str, Any], g: ModuleType) -> list[str]:
    """The CUDA-specific sections (after gather.py's common header)."""
    lines: list[str] = []
    sm = report.get("sm")
    if sm:
        lines += [
            "",
            f"GPU: {sm['sms']} SMs. The loader's default grid is {sm['default_max_blocks']} "
            f"blocks (DEFAULT_SM_SHARE {sm['default_sm_share']:.0%} of the SMs); `full grid` "
            f"is {sm['full_grid_blocks']} blocks. Each row's `SMs` column is what the "
            "default-grid launch of that configuration occupied.",
        ]
    tables = report.get("tables") or []
    if tables:
        rows = []
        for t in tables:
            page = t.get("page_report") or {}
            rows.append([
                _gib(t["table_bytes"]), t["pages"], t.get("thp_mode") or "?",
                "?" if not page else f"{page.get('huge_fraction', 0.0):.0%}",
                t["fill_s"], t["register_s"], "yes" if t.get("device_copy") else "no",
            ])
        lines += [
            "", "## Host tables", "",
            "`huge pages`: share of the table's resident bytes on 2 MiB pages "
            "(`pingpong.hugepages.page_report`, after filling); `register`: "
            "`cudaHostRegister` of the whole table, seconds.", "",
            _common.markdown_table(
                ["table", "pages", "THP", "huge pages", "fill s", "register s", "GPU copy"],
                rows),
        ]
    for note in report.get("skipped") or []:
        lines += ["", f"Skipped: {note}."]
    names = g.CUDA_CONTENDERS
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for record in report["results"]:
        groups.setdefault(_group_key(record), []).append(record)
    for (table_bytes, pages), records in groups.items():
        title = f"{_gib(table_bytes)} table, {pages} pages" if table_bytes else "table"
        header = ["N", "dtype", "ids", "row B", *names, "/staged", "/pinned memcpy", "SMs",
                  "other"]
        rows = [
            [r["threads"], r["dtype"], r["order"], r["row_bytes"],
             *(_cell(r, name) for name in names),
             g._ratio(r, "pingpong zerocopy", "staged") or "-",
             g._ratio(r, "pingpong zerocopy", "pinned memcpy") or "-",
             "-" if "grid" not in r else f"{r['grid']['sms_used']} ({r['grid']['sm_share']:.0%})",
             g._fmt_other(r.get("other_processes_cores"))]
            for r in records
        ]
        lines += ["", f"## {title}", "", _common.markdown_table(header, rows)]
    for sweep in report.get("sweep") or []:
        header = ["ids", *(f"{name} us" for name in SWEEP_CONTENDERS),
                  "zerocopy GB/s", "gpu-sorted GB/s", "sort speed-up"]
        rows = [
            [p["ids"], *(p["summary"][name]["median_s"] * 1e6 for name in SWEEP_CONTENDERS),
             p["summary"]["zerocopy"]["median_gbps"],
             p["summary"]["zerocopy gpu-sorted"]["median_gbps"], p["gpu_sort_speedup"]]
            for p in sweep["points"]
        ]
        lines += [
            "", f"## Sort sweep: {_gib(sweep['table_bytes'])} table, {sweep['pages']} pages, "
            f"{sweep['row_bytes']} B rows", "",
            "Random ids, microseconds per call (median; back-to-back calls with fresh ids). "
            "`gpu-sorted` includes the sort; "
            "`presorted` is the same ids sorted beforehand (the gain's ceiling); "
            "`sort speed-up` = zerocopy / gpu-sorted (> 1: sorting pays).", "",
            _common.markdown_table(header, rows),
        ]
    return lines
