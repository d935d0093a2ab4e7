"""A small zero-copy gather workload for compute-sanitizer (memcheck).

Runs the loader in every CUDA gather mode over a few batches, an out-of-range
batch (which must be refused before any kernel runs), and a pin/unpin cycle.
Exit status 0 and "sanitize workload ok" mean every batch matched the host.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import pingpong


def main() -> None:
    torch.manual_seed(0)
    n = 20_000
    features = torch.randn(n, 67)  # odd row width: unaligned rows
    labels = torch.randint(0, 10, (n,))
    source: list[tuple[torch.Tensor, torch.Tensor, list[Any]]] = [
        (torch.randint(0, n, (3000,)), torch.randint(0, n, (64,)), []) for _ in range(6)]
    for mode in ("zerocopy", "staged", "device"):
        with pingpong.PingPongLoader(source, features, labels, device="cuda", gather=mode) as ld:
            for batch, (inputs, outputs, _b) in zip(ld, source, strict=True):
                assert torch.equal(batch.x.cpu(), features[inputs]), mode
                assert torch.equal(batch.y.cpu(), labels[outputs]), mode
    bad: list[tuple[torch.Tensor, torch.Tensor, list[Any]]] = [
        (torch.tensor([0, n]), torch.tensor([0]), [])]
    with pingpong.PingPongLoader(bad, features, labels, device="cuda") as ld:
        try:
            list(ld)
        except pingpong.IdRangeError:
            pass
        else:
            raise SystemExit("out-of-range ids were not refused")
    torch.cuda.synchronize()
    print("sanitize workload ok")


if __name__ == "__main__":
    argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split())).parse_args()
    main()
