"""Does ``dgl.seed()`` make DGL's neighbour sampling reproducible, and in which thread?

pingpong runs the sampler in its producer thread, not in the thread that
called ``dgl.seed()``.  This draws one 500-seed, fanout-3 sample repeatedly:

- twice in the main thread, after ``dgl.seed(0)`` each time;
- once in each of two new threads, each calling ``dgl.seed(0)`` first.

and prints whether the draws agree.  Run it with ``OMP_NUM_THREADS=1`` and
``=2`` (results in docs/troubleshooting.rst).  Needs DGL.

    OMP_NUM_THREADS=1 python benchmarks/dgl_seeding.py
"""

from __future__ import annotations

import argparse
import os
import threading
import warnings

import dgl
import torch

warnings.filterwarnings("ignore")


def main() -> None:
    torch.manual_seed(0)
    src, dst = torch.randint(0, 1000, (20000,)), torch.randint(0, 1000, (20000,))
    graph = dgl.graph((src, dst), num_nodes=1000)
    sampler = dgl.dataloading.NeighborSampler([3])

    def draw() -> tuple[int, ...]:
        _, _, blocks = sampler.sample(graph, torch.arange(500))
        return tuple(blocks[0].edges()[0].tolist())

    dgl.seed(0)
    first = draw()
    dgl.seed(0)
    second = draw()
    in_threads: list[tuple[int, ...]] = []

    def seeded_in_thread() -> None:
        dgl.seed(0)
        in_threads.append(draw())

    for _ in range(2):
        thread = threading.Thread(target=seeded_in_thread)
        thread.start()
        thread.join()
    print(f"dgl {dgl.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}: "
          f"main thread twice alike: {first == second}; two new threads alike: "
          f"{in_threads[0] == in_threads[1]}; new thread like main: {in_threads[0] == first}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split())).parse_args()
    main()
