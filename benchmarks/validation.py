"""What checking a batch's ids costs, next to gathering its rows (CPU device).

For each batch size, the contenders are timed alternately (see
``_common.alternate``).  Each contender cycles through its own pre-drawn
random id arrays, so many that their rows together are four times the
last-level cache: the rows a call reads were not left in cache by an earlier
call (the table is larger than the caches either), while the ids themselves
may be, as they are in training, where the sampler has just written them.  The
caches are not scrubbed: that would also evict the interpreter and the Numba
dispatcher, which a real producer finds warm.

- ``gather``: what the CPU device would do with ids known to be valid: the
  ids as a NumPy array (``Tensor.numpy()``) and the unchecked gather kernel
  into a preallocated slot;
- ``convert``: ``Tensor.numpy()`` alone (the part of ``gather`` that turns
  the ids into an array);
- ``checks``: what the producer runs per batch instead of ``convert``:
  ``pingpong._ids.batch_ids`` for a one-table loader without labels (type and
  shape checks, the conversion, the ``[0, N)`` range check, and the per-table
  bookkeeping around them);
- ``validate+gather``: ``checks`` and the gather, as the producer runs them.

The validation cost is ``median(checks) - median(convert)``: both are a few
microseconds of CPU work with no table traffic, so their difference is
steady.  The figure reported against the reliability goal ("validation
overhead <= 3% of gather time") is that cost over ``median(gather)``.  The
difference ``validate+gather - gather`` is printed too; it is the difference
of two much larger, noisier medians.

    python benchmarks/validation.py [--rounds 200 | --quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    alternate,
    cache_bytes,
    command_line,
    describe_machine,
    machine_info,
    markdown_table,
    out_dir,
    plot_lines,
    positive_int,
    refuse_sizes_with_quick,
    write_results,
)

from pingpong._ids import batch_ids
from pingpong.devices.cpu import CPUDevice
from pingpong.kernels.cpu import gather_rows_cpu_unchecked
from pingpong.store import make_feature_store


def measure(num_rows: int, width: int, batch: int, rounds: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(num_rows, width, generator=gen).numpy()
    pool_size = max(8, -(-4 * cache_bytes() // (batch * table.itemsize * width)))

    def pool() -> itertools.cycle[torch.Tensor]:
        return itertools.cycle(
            [torch.randint(0, num_rows, (batch,), generator=gen) for _ in range(pool_size)]
        )

    out = np.empty((batch, width), dtype=table.dtype)
    store = make_feature_store(torch.from_numpy(table))  # one table, no labels
    draws = {name: pool() for name in ("gather", "convert", "checks", "both")}

    used: list[torch.Tensor] = []

    def gather() -> None:
        ids = next(draws["gather"])
        used.append(ids)
        gather_rows_cpu_unchecked(table, ids.numpy(), out)

    def convert() -> None:
        next(draws["convert"]).numpy()

    def validate() -> None:
        batch_ids(store, next(draws["checks"]), None)

    def both() -> None:
        ids = next(draws["both"])
        used.append(ids)
        x_ids, _ = batch_ids(store, ids, None)
        gather_rows_cpu_unchecked(table, x_ids[None], out)

    samples = alternate(
        {"gather": gather, "convert": convert, "checks": validate, "validate+gather": both},
        rounds=rounds,
        warmup=3,
        seed=seed,
    )
    assert np.array_equal(out, table[used[-1].numpy()])  # the timed calls really gathered
    med = {name: statistics.median(s) for name, s in samples.items()}
    validation_s = med["checks"] - med["convert"]
    return {
        "batch_ids": batch,
        "row_bytes": width * table.itemsize,
        "median_s": med,
        "min_s": {name: min(s) for name, s in samples.items()},
        "max_s": {name: max(s) for name, s in samples.items()},
        "validation_s": validation_s,
        "validate_pct_of_gather": 100.0 * validation_s / med["gather"],
        "difference_pct_of_gather": 100.0
        * (med["validate+gather"] - med["gather"])
        / med["gather"],
    }


def render_markdown(report: dict[str, Any]) -> str:
    rows = [
        [
            r["batch_ids"],
            r["median_s"]["gather"] * 1e6,
            r["median_s"]["convert"] * 1e6,
            r["median_s"]["checks"] * 1e6,
            r["validation_s"] * 1e6,
            r["median_s"]["validate+gather"] * 1e6,
            f"{r['validate_pct_of_gather']:.1f}%",
            f"{r['difference_pct_of_gather']:.1f}%",
        ]
        for r in report["results"]
    ]
    table = markdown_table(
        [
            "ids per batch",
            "gather µs",
            "convert µs",
            "checks µs",
            "validation µs",
            "validate+gather µs",
            "validation / gather",
            "(both - gather) / gather",
        ],
        rows,
    )
    return (
        "# What checking the ids costs (CPU)\n\n"
        f"```\n{report['command']}\n```\n\n"
        f"Table {report['table']}, {report['gather_threads']} gather thread(s), medians of "
        f"{report['rounds']} alternating rounds. `validation` = `checks` - `convert`: the "
        "time the type, shape and range checks add to turning the ids into an array "
        "(method in `benchmarks/validation.py`'s docstring).\n\n"
        f"{table}\n\n{describe_machine(report['machine'])}\n"
    )


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    results = report["results"]
    series = {
        "validation / gather": [(r["batch_ids"], r["validate_pct_of_gather"]) for r in results],
        "goal: 3%": [(r["batch_ids"], 3.0) for r in results],
    }
    return plot_lines(
        path, {"CPU device": series}, "ids per batch", "% of gather time", "What the id check costs"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=positive_int, default=500_000,
                        help="table rows (default 500k)")
    parser.add_argument("--width", type=positive_int, default=128,
                        help="float32 columns (default 128)")
    parser.add_argument(
        "--batches", type=positive_int, nargs="+", default=[256, 1_000, 4_000, 20_000, 100_000]
    )
    parser.add_argument("--rounds", type=positive_int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 200k rows, 2 batch sizes, 20 rounds"
    )
    parser.add_argument("--out", type=out_dir, default=None, help="write JSON/Markdown/PNG here")
    args = parser.parse_args(argv)
    refuse_sizes_with_quick(parser, args, ("rows", "batches", "rounds"))
    if args.quick:
        args.rows, args.batches, args.rounds = 200_000, [1_000, 20_000], 20
    device = CPUDevice()  # sets the producer's Numba thread count the way the loader does
    device.producer_started()
    report = {
        "table": f"{args.rows:,} x {args.width} float32",
        "gather_threads": device.gather_threads,
        "rounds": args.rounds,
        "results": [
            measure(args.rows, args.width, batch, args.rounds, args.seed) for batch in args.batches
        ],
        "machine": machine_info(),
        "command": command_line(),
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out, "validation-cpu", report, render_markdown(report), render_plot)


if __name__ == "__main__":
    main()
