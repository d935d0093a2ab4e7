"""Neighbour-sampling speed: pingpong's built-in sampler against DGL's.

Both iterate the same synthetic graph's training seeds with the same fanouts
and batch size and yield DGL-shaped ``(input_nodes, output_nodes, blocks)``
triples; one timed call is one full epoch of sampling (no features, no
training).  Contenders alternate in a shuffled order each round; medians.

    python benchmarks/sampler.py --out docs/benchmarks --name sampler-cpu
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import _common

from pingpong.sources import BuiltinLoader, NeighborSampler, make_synthetic_graph


def epoch_of(source: Any) -> Any:
    def run() -> int:
        rows = 0
        for input_nodes, _output_nodes, _blocks in source:
            rows += len(input_nodes)
        return rows

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-nodes", type=_common.positive_int, default=100_000)
    p.add_argument("--batch-size", type=_common.positive_int, default=1024)
    p.add_argument("--rounds", type=_common.positive_int, default=5)
    p.add_argument("--out", type=_common.out_dir, default=Path("results"))
    p.add_argument("--name", default="sampler")
    args = p.parse_args(argv)
    try:
        import dgl
    except ImportError:
        p.exit(2, "sampler.py compares against DGL's sampler: install dgl\n")
    graph = make_synthetic_graph(num_nodes=args.num_nodes)
    csr, g = graph.to_csr(), graph.to_dgl()
    rows = []
    results = []
    for fanouts in ([15, 10, 5], [10, 10]):
        contenders = {
            "builtin": epoch_of(
                BuiltinLoader(csr, graph.train_idx, NeighborSampler(fanouts), args.batch_size)
            ),
            "dgl": epoch_of(
                dgl.dataloading.DataLoader(
                    g,
                    graph.train_idx,
                    dgl.dataloading.NeighborSampler(fanouts),
                    batch_size=args.batch_size,
                )
            ),
        }
        samples = _common.alternate(contenders, args.rounds, warmup=1)
        med = {name: statistics.median(times) for name, times in samples.items()}
        results.append({"fanouts": fanouts, "seconds": samples, "median_s": med})
        rows.append(
            [
                ",".join(map(str, fanouts)),
                f"{med['builtin']:.3f}",
                f"{med['dgl']:.3f}",
                f"{med['dgl'] / med['builtin']:.2f}",
            ]
        )
        print(fanouts, {k: round(v, 3) for k, v in med.items()}, flush=True)
    machine = _common.machine_info()
    command = _common.command_line()
    _common.write_json(
        args.out / f"{args.name}.json",
        {"benchmark": "sampler", "command": command, "machine": machine, "results": results},
    )
    table = _common.markdown_table(
        ["fanouts", "built-in s/epoch", "DGL s/epoch", "DGL / built-in"], rows
    )
    _common.write_markdown(
        args.out / f"{args.name}.md",
        f"# Neighbour sampling: built-in vs DGL\n\n```\n{command}\n```\n\n"
        f"{_common.describe_machine(machine)}\n\n"
        f"Synthetic graph, {args.num_nodes} nodes; {len(graph.train_idx)} seeds, batch "
        f"{args.batch_size}; one timed call = one epoch of sampling (no features, no "
        f"training); medians of {args.rounds} rounds, contenders alternated.\n\n{table}\n",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
