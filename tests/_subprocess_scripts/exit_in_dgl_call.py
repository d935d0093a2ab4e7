"""Child process: the interpreter exits while a producer that takes turns in DGL's RPC
client (:mod:`pingpong._rpc`) is inside a slow call (a 1.5 s source step standing for
a pull or a sampling RPC).

An exit hook registered before the loader's first epoch -- like DGL's
``exit_client``, registered by ``dgl.distributed.initialize`` -- runs after
pingpong's and prints ``INSIDE_AT_DGL_EXIT <True|False>``: whether the producer was
still inside the call then (DGL's hook sends through the same client). Prints
``EXITING`` right before leaving.
"""

from __future__ import annotations

import atexit
import time

state = {"inside": False}


@atexit.register  # before pingpong's hook, so it runs after it (as DGL's does)
def _dgl_like_exit_client() -> None:
    print(f"INSIDE_AT_DGL_EXIT {state['inside']}", flush=True)


import torch  # noqa: E402

from pingpong import PingPongLoader, _rpc  # noqa: E402

# As in a process with a DGL RPC client: loaders made now take turns.
_rpc.lock_for_process = lambda: _rpc.RPC_LOCK


class SlowCalls:
    def __iter__(self):
        for _ in range(100):
            state["inside"] = True
            time.sleep(1.5)
            state["inside"] = False
            yield (torch.arange(10), torch.arange(4), None)


loader = PingPongLoader(SlowCalls(), torch.zeros(20, 3))
it = iter(loader)
next(it)
time.sleep(0.2)  # the producer is inside its next step
print("EXITING", flush=True)
