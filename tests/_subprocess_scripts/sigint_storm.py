"""Child process: Ctrl-C over and over while ``next()`` waits for a batch.

Usage: ``python sigint_storm.py SECONDS``.  Prints ``READY``, then for
SECONDS starts epochs whose source is slow (20 ms per batch) and waits in
``next()`` while the parent sends SIGINT every millisecond or so.  The
handler raises ``KeyboardInterrupt`` only while the script is inside
``next()`` (elsewhere a signal would just hit this script's own bookkeeping).
Prints one JSON line: how many ``next()`` calls ended in KeyboardInterrupt,
in a batch, and in anything else (with the exception names), and whether the
loader still delivered a batch and closed afterwards.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import torch

from pingpong import PingPongLoader

N = 64


class Slow:
    """Batches after 20 ms each: next() spends its time waiting for the producer."""

    def __iter__(self):
        for _ in range(1000):
            time.sleep(0.02)
            yield (torch.arange(16), torch.arange(4), None)


def main() -> None:
    seconds = float(sys.argv[1])
    in_next = False

    def on_sigint(signum, frame):
        if in_next:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    counts = {"keyboard_interrupt": 0, "batch": 0, "other": 0}
    others: list[str] = []
    loader = PingPongLoader(Slow(), torch.randn(N, 4), torch.arange(N), timeout=30)
    print("READY", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        it = iter(loader)
        try:
            in_next = True
            next(it)
            in_next = False
            counts["batch"] += 1
        except KeyboardInterrupt:
            counts["keyboard_interrupt"] += 1
        except BaseException as exc:  # noqa: BLE001 - the point is to see anything else
            counts["other"] += 1
            others.append(type(exc).__name__)
        finally:
            in_next = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the storm is over
    batch = next(iter(loader))  # still works
    delivered = bool(torch.equal(batch.y, torch.arange(4)))
    started = time.monotonic()
    loader.close()
    print(json.dumps({**counts, "others": others[:10], "delivered_after": delivered,
                      "close_s": time.monotonic() - started}), flush=True)


if __name__ == "__main__":
    main()
