"""Hit rate of a static cache of hot feature rows, against its size (CPU, no GPU).

The built-in neighbour sampler runs two epochs over a synthetic graph
(power-law by default, and the uniform control). Every id the loader would
gather (each batch's ``input_nodes``) is counted per epoch with
:class:`pingpong.hotrows.RowCounter`. Epoch 1 is the epoch a cache serves;
for cache sizes of 1/5/10/25% of the rows, the hit rate in epoch 1 of:

- ``learned``: the hottest rows of epoch 0 -- what a loader that counts during
  its first epoch can hold from its second;
- ``degree``: the highest in-degree nodes (PaGraph's static choice, known
  before any sampling);
- ``best static``: the hottest rows of epoch 1 itself -- the best any static
  cache of that size could do for that epoch, known only afterwards.

``PCIe cut`` is how many times fewer rows cross PCIe with the cache than
without it, ``1 / (1 - hit rate)``. Counting's cost is timed too (the
``RowCounter.add`` calls of one epoch). Hit rates are deterministic for given
flags; only the counting time depends on the machine.

    python benchmarks/cache_hit_rate.py --out docs/benchmarks --name cache-hit-rate-cpu
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import _common
import torch

from pingpong.hotrows import RowCounter, hit_rate
from pingpong.sources import (
    GRAPH_KINDS,
    BuiltinLoader,
    NeighborSampler,
    make_synthetic_graph,
)

CHOICES = ("learned", "degree", "best static")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _fractions(text: str) -> list[float]:
    """``--fractions``: comma-separated shares of the rows to cache, each in (0, 1]."""
    values = [float(x) for x in text.split(",")]
    if not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"each fraction must be in (0, 1], got {text}")
    return values


def _graph_kinds(text: str) -> list[str]:
    kinds = text.split(",")
    unknown = [k for k in kinds if k not in GRAPH_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown graph kind(s) {unknown}; choose from {list(GRAPH_KINDS)}")
    return kinds


def count_epoch(loader: BuiltinLoader, num_rows: int) -> tuple[RowCounter, float, int]:
    """One epoch's gathered ids counted; returns (counter, seconds counting, batches)."""
    counter = RowCounter(num_rows)
    counting = 0.0
    batches = 0
    for input_nodes, _output_nodes, _blocks in loader:
        started = time.perf_counter()
        counter.add(input_nodes)
        counting += time.perf_counter() - started
        batches += 1
    return counter, counting, batches


def measure(args: argparse.Namespace, graph_kind: str) -> dict[str, Any]:
    graph = make_synthetic_graph(num_nodes=args.num_nodes, feat_dim=1,
                                 avg_degree=args.avg_degree, seed=args.seed,
                                 graph_kind=graph_kind, train_frac=args.train_frac,
                                 power_law_exponent=args.power_law_exponent,
                                 val_frac=0.0, test_frac=0.0)
    n = graph.num_nodes
    loader = BuiltinLoader(graph.to_csr(), graph.train_idx, NeighborSampler(args.fanouts),
                           args.batch_size, shuffle=True, seed=args.seed)
    first, _, _ = count_epoch(loader, n)
    served, counting_s, batches = count_epoch(loader, n)
    degree = torch.bincount(graph.dst, minlength=n)
    by_degree = torch.sort(degree, descending=True, stable=True).indices
    rows = []
    for fraction in args.fractions:
        k = round(fraction * n)
        rates = {
            "learned": hit_rate(first.hottest(k), served.counts),
            "degree": hit_rate(by_degree[:k], served.counts),
            "best static": hit_rate(served.hottest(k), served.counts),
        }
        rows.append({
            "fraction": fraction,
            "cached_rows": k,
            "hit_rate": rates,
            "learned_vs_best": rates["learned"] / rates["best static"],
            "pcie_cut": {name: 1.0 / (1.0 - rate) if rate < 1.0 else float("inf")
                         for name, rate in rates.items()},
        })
    return {
        "graph_kind": graph_kind,
        "num_nodes": n,
        "num_edges": graph.num_edges,
        "max_degree": int(degree.max()),
        "median_degree": float(degree.double().median()),
        "batches_per_epoch": batches,
        "rows_gathered_per_epoch": served.total,
        "rows_per_batch": served.total / batches,
        "distinct_rows_gathered": int((served.counts > 0).sum()),
        "counting_s_per_batch": counting_s / batches,
        "cache": rows,
    }


def to_markdown(report: dict[str, Any]) -> str:
    parts = [
        "# Cache hit rate (CPU)",
        "",
        _common.describe_machine(report["machine"]),
        "",
        f"Command: `{report['command']}`",
        "",
        f"Built-in sampler, fanouts {report['config']['fanouts']}, batch size "
        f"{report['config']['batch_size']}, {report['config']['train_frac']:.0%} of the nodes "
        f"as seeds, seed {report['config']['seed']}; hit rates in "
        "epoch 1 (epoch 0 is what `learned` counted).",
        "",
    ]
    for result in report["results"]:
        parts += [
            f"## {result['graph_kind']} graph"
            + (f" (exponent {report['config']['power_law_exponent']:g})"
               if result["graph_kind"] == "powerlaw" else ""),
            "",
            f"{result['num_nodes']:,} nodes, {result['num_edges']:,} directed edges, max "
            f"in-degree {result['max_degree']}, median {result['median_degree']:g}; "
            f"{result['batches_per_epoch']} batches of {result['rows_per_batch']:,.0f} rows "
            f"on average ({result['distinct_rows_gathered']:,} distinct rows per epoch); "
            f"counting costs {result['counting_s_per_batch'] * 1e3:.2f} ms per batch.",
            "",
        ]
        table = []
        for row in result["cache"]:
            rates = row["hit_rate"]
            table.append([
                f"{row['fraction']:.0%}",
                f"{row['cached_rows']:,}",
                *(f"{rates[name]:.3f}" for name in CHOICES),
                f"{row['learned_vs_best']:.3f}",
                f"{row['pcie_cut']['learned']:.2f}x",
            ])
        parts += [
            _common.markdown_table(
                ["cache", "rows", *(f"hit rate: {name}" for name in CHOICES),
                 "learned / best", "PCIe cut (learned)"],
                table,
            ),
            "",
        ]
    return "\n".join(parts)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    panels = {
        f"{result['graph_kind']} graph": {
            name: [(100 * row["fraction"], row["hit_rate"][name]) for row in result["cache"]]
            for name in CHOICES
        }
        for result in report["results"]
    }
    return _common.plot_lines(path, panels, "rows cached (%)", "hit rate in epoch 1",
                              "Static cache of hot rows: hit rate against size", logx=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-nodes", type=int, default=1_000_000)
    p.add_argument("--avg-degree", type=float, default=15.0)
    p.add_argument("--power-law-exponent", type=float, default=2.5)
    p.add_argument("--train-frac", type=float, default=0.08,
                   help="share of the nodes that are seeds (ogbn-products: 8%%)")
    p.add_argument("--fanouts", type=_ints, default=[15, 10, 5])
    p.add_argument("--batch-size", type=_common.positive_int, default=1024)
    p.add_argument("--fractions", type=_fractions, default=[0.01, 0.05, 0.10, 0.25])
    p.add_argument("--graph-kinds", type=_graph_kinds, default=list(GRAPH_KINDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=_common.out_dir, default=None)
    p.add_argument("--name", default="cache-hit-rate")
    args = p.parse_args(argv)
    report = {
        "machine": _common.machine_info(),
        "command": _common.command_line(),
        "config": {"num_nodes": args.num_nodes, "avg_degree": args.avg_degree,
                   "power_law_exponent": args.power_law_exponent,
                   "train_frac": args.train_frac,
                   "fanouts": args.fanouts, "batch_size": args.batch_size,
                   "fractions": args.fractions, "seed": args.seed},
        "results": [measure(args, kind) for kind in args.graph_kinds],
    }
    _common.write_results(args.out, args.name, report, to_markdown(report), render_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
