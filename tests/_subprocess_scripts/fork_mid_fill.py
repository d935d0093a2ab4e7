"""Parent process: ``os.fork()`` while the producer fills a slot, then one scenario in
the child.

Usage: ``python fork_mid_fill.py SCENARIO``.  The producer's second gather blocks
(on a device that waits for the parent's go) while it holds the epoch's write lock;
the process forks right then.  In the child, the producer thread does not exist
and that lock stays held.  Scenarios, run in the child:

- ``exit``: leave normally (``sys.exit(0)``: exit hooks and finalisers run);
- ``close``: ``loader.close()``, then leave;
- ``iter``: a new epoch of the same loader; every batch must equal ``features[ids]``.
  Run under Numba's ``workqueue`` layer, which Numba documents as fork-safe: under
  ``omp`` (GNU OpenMP) Numba terminates a forked child that runs parallel code
  once the parent has ("fork() called from a process already using GNU OpenMP").

The fork waits for the kernel warm-up to finish: a child forked while it
compiled, inside LLVM, aborted at its exit in one CI run.

The child prints ``CHILD_OK`` when its scenario finished (and, for ``iter``, every
batch was exact); the parent prints ``CHILD_EXIT <code>`` or ``CHILD_HUNG`` (killed
after 30 s), then finishes its own epoch and checks it too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

if __name__ == "__main__" and sys.argv[1:] == ["iter"]:  # before Numba is imported
    os.environ["NUMBA_THREADING_LAYER"] = "workqueue"

import numpy as np
import torch

from pingpong import PingPongLoader
from pingpong.devices.cpu import CPUDevice

N = 2_000


class PausingDevice(CPUDevice):
    """Blocks inside the gather it is told to, until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__(1)
        self.pause_at = 2  # the producer's second gather: batch 1, slot 1
        self.gathers = 0
        self.paused = threading.Event()
        self.go = threading.Event()

    def gather(self, table: Any, ids: np.ndarray, out: torch.Tensor) -> None:
        self.gathers += 1
        if self.gathers == self.pause_at:
            self.paused.set()
            self.go.wait()
        super().gather(table, ids, out)


def exact(loader: PingPongLoader, features: torch.Tensor, source: list) -> bool:
    count = 0
    for batch, (inputs, _, _) in zip(loader, source, strict=True):
        if not torch.equal(batch.x, features[inputs]):
            return False
        count += 1
    return count == len(source)


def main() -> None:
    scenario = sys.argv[1]
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(N, 8, generator=gen)
    source = [(torch.randint(0, N, (64,), generator=gen), torch.arange(4), None)
              for _ in range(6)]
    device = PausingDevice()
    loader = PingPongLoader(source, features, device=device, num_buffers=2)
    batches = iter(loader)
    first = next(batches)
    assert torch.equal(first.x, features[source[0][0]])
    if not device.paused.wait(30):
        raise SystemExit("the producer never reached its second gather")
    # Not while the kernel warm-up compiles: a child forked inside LLVM aborted at
    # its exit (LLVM's "asserting value handle" UNREACHABLE, SIGABRT, one CI run).
    # That is another hazard than the write lock this script is about.  The gathers
    # so far ran the warm-up's kernels or its fallback: under omp, the child's
    # parallel code after this wait is what Numba refuses (see the docstring).
    deadline = time.monotonic() + 120
    while any(t.name.startswith("pingpong-warmup") for t in threading.enumerate()):
        if time.monotonic() > deadline:
            raise SystemExit("the kernel warm-up did not finish")
        time.sleep(0.05)
    epoch = loader._core.epoch
    assert epoch is not None
    assert epoch.write_lock.locked()
    pid = os.fork()
    if pid == 0:  # the child: the producer thread is gone, its write lock held
        try:
            if scenario == "close":
                loader.close()
            elif scenario == "iter" and not exact(loader, features, source):
                print("CHILD_WRONG_BATCH", flush=True)
                os._exit(1)
            print("CHILD_OK", flush=True)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            print(f"CHILD_ERROR {type(exc).__name__}: {exc}", flush=True)
            os._exit(2)
        sys.exit(0)
    device.go.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print(f"CHILD_EXIT {os.waitstatus_to_exitcode(status)}", flush=True)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("CHILD_HUNG", flush=True)
    rest = [batch.x.clone() for batch in batches]
    assert len(rest) == len(source) - 1
    for x, (inputs, _, _) in zip(rest, source[1:], strict=True):
        assert torch.equal(x, features[inputs])
    assert exact(loader, features, source)
    loader.close()
    print("PARENT_OK", flush=True)


if __name__ == "__main__":
    main()
