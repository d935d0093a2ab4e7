"""Child process: a SIGTERM handler calls ``loader.close()`` while the main thread is
inside that loader's ``iter()`` or ``close()``, each waiting up to 2 s for the last
epoch's producer, which is inside a 3 s source step.

Usage: ``python close_in_signal_handler.py {iter|close} {returns|raises}``: the
handler returns after ``close()``, or raises ``Stop``.  Prints ``HANDLED`` once the
handler's ``close()`` returned, then what the interrupted call did (``ITER RAISED
<error>`` or ``CLOSED``), then ``CLOSED=<loader.closed>``, ``FULLY_CLOSED=`` (the
close finished: epoch retired, device closed) and ``PRODUCERS_LEFT=`` (producer
threads alive once the stuck step had time to return).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from pingpong import PingPongLoader


class SlowSecondStep:
    """One batch, then a 3 s step before each of the rest (a slow sampler)."""

    def __iter__(self):
        for i in range(4):
            if i:
                time.sleep(3.0)
            yield (torch.arange(10) + i, torch.arange(4), None)


class Stop(Exception):
    """What a handler that raises raises."""


def main() -> None:
    where, handler = sys.argv[1], sys.argv[2]
    loader = PingPongLoader(SlowSecondStep(), torch.randn(100, 4))
    it = iter(loader)
    next(it)  # the producer is now inside the 3 s step

    def on_sigterm(signum: int, frame: object) -> None:
        loader.close()
        print("HANDLED", flush=True)
        if handler == "raises":
            raise Stop

    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    if where == "iter":
        try:
            iter(loader)  # retires the last epoch: waits for its producer
            print("ITER RETURNED", flush=True)
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            print(f"ITER RAISED {type(exc).__name__}", flush=True)
    else:
        loader.close()  # joins the producer
        print("CLOSED", flush=True)
    print(f"CLOSED={loader.closed}", flush=True)
    print(f"FULLY_CLOSED={loader._core.fully_closed}", flush=True)
    time.sleep(3.5)  # the stuck step returns: its producer leaves
    producers = [t for t in threading.enumerate() if t.name.startswith("pingpong-producer")]
    print(f"PRODUCERS_LEFT={len(producers)}", flush=True)
    del it


if __name__ == "__main__":
    main()
