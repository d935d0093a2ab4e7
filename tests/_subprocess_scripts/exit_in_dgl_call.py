"""Child process: the interpreter exits while a producer that takes turns in DGL's RPC
client (:mod:`pingpong._rpc`) is inside a slow call (a source step standing for a pull
or a sampling RPC).

Usage: ``python exit_in_dgl_call.py SCENARIO``:

- ``plain``: exit while the producer is inside a 3 s call;
- ``local-loader-first``: the same, after a loader that takes no turns ran
  before DGL's exit hook was registered (as a loader used before
  ``dgl.distributed.initialize`` would);
- ``closed-while-inside``: 5 s calls; ``loader.close()`` gives up on the
  producer after 2 s (it is still inside the call), the loader and its epoch
  are dropped, then the interpreter exits;
- ``slow-free``: as ``closed-while-inside``, and the source's iterator holds an
  object whose ``__del__`` runs torch ops for 0.3 s (a batch's tensors being
  freed: torch gives the GIL up while it frees one). The producer drops it as it
  leaves, right after the call; prints ``FREED`` when that is done. Exit's join
  budget is raised to 5 s here, so that a loaded machine cannot make it run out.

An exit hook standing for DGL's ``exit_client`` -- registered where
``dgl.distributed.initialize`` would register it, before the loader that takes
turns -- prints ``INSIDE_AT_DGL_EXIT <True|False>``: whether the producer was
still inside the call then (DGL's hook sends through the same client). Prints
``INSIDE_AT_EXIT <True|False>`` (whether the producer is inside its call as the
interpreter starts to exit) and ``EXITING`` right before leaving.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time

import torch

from pingpong import PingPongLoader, _exit_hook, _rpc

scenario = sys.argv[1]
state = {"inside": False}


def _dgl_like_exit_client() -> None:
    print(f"INSIDE_AT_DGL_EXIT {state['inside']}", flush=True)


class FreedSlowly:
    """Runs torch ops (each gives the GIL up) for 0.3 s when freed."""

    def __del__(self) -> None:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            torch.ones(10_000).sum()
        print("FREED", flush=True)


class SlowCalls:
    def __init__(self, call_s: float) -> None:
        self.call_s = call_s

    def __iter__(self):
        _freed_when_the_producer_leaves = FreedSlowly() if scenario == "slow-free" else None
        for _ in range(100):
            state["inside"] = True
            time.sleep(self.call_s)
            state["inside"] = False
            yield (torch.arange(10), torch.arange(4), None)


if scenario == "local-loader-first":  # pingpong's exit hook is registered now
    for _batch in PingPongLoader([(torch.arange(3), torch.arange(2), None)],
                                 torch.zeros(20, 3)):
        pass
atexit.register(_dgl_like_exit_client)  # what dgl.distributed.initialize does
# As in a process with a DGL RPC client: loaders made now take turns.
_rpc.lock_for_process = lambda: _rpc.RPC_LOCK

closes = scenario in ("closed-while-inside", "slow-free")
if scenario == "slow-free":
    _exit_hook.EXIT_JOIN_BUDGET_S = 5.0
loader = PingPongLoader(SlowCalls(5.0 if closes else 3.0), torch.zeros(20, 3))
it = iter(loader)
next(it)
deadline = time.monotonic() + 10
while not state["inside"] and time.monotonic() < deadline:  # its next call has begun
    time.sleep(0.01)
if closes:
    loader.close()  # waits 2 s for the producer, which stays inside its call
    del it, loader  # the epoch is gone; its producer is not
    gc.collect()
print(f"INSIDE_AT_EXIT {state['inside']}", flush=True)  # else the test tests nothing
print("EXITING", flush=True)
