"""Child process: block in ``next()`` (or ``iter()``) on a stalled source, wait for SIGINT.

Usage: ``python sigint_in_next.py {catch|uncaught} {cpu|fake} [next|iter]``.
Prints ``READY`` just before blocking -- in ``next()`` after one batch, or
with ``iter``, in ``iter(loader)`` waiting for a source whose ``iter()`` never
returns; with ``catch`` it prints ``INTERRUPTED`` after the KeyboardInterrupt
and exits normally, leaving the producer stuck inside the source
(interpreter exit must still be clean).
"""

from __future__ import annotations

import sys
import threading

import torch

from pingpong import PingPongLoader
from pingpong.devices.fake import FakeAsyncDevice

N = 100


class Stalled:
    """One batch, then blocks forever (a hung sampler)."""

    def __iter__(self):
        yield (torch.arange(10), torch.arange(4), None)
        threading.Event().wait()


class StalledStart:
    """Its iter() blocks forever (a sampler whose workers never start)."""

    def __iter__(self):
        threading.Event().wait()


def main() -> None:
    mode, device_kind = sys.argv[1], sys.argv[2]
    where = sys.argv[3] if len(sys.argv) > 3 else "next"
    device = FakeAsyncDevice(seed=0) if device_kind == "fake" else "cpu"
    source = StalledStart() if where == "iter" else Stalled()
    loader = PingPongLoader(source, torch.randn(N, 4), torch.arange(N), device=device)
    if where == "iter":
        block = lambda: iter(loader)  # noqa: E731 - the call that blocks
    else:
        it = iter(loader)
        next(it)
        block = lambda: next(it)  # noqa: E731
    print("READY", flush=True)
    if mode == "catch":
        try:
            block()
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        return
    block()

if __name__ == "__main__":
    main()
