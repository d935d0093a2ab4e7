"""Which queue survives Ctrl-C: ``queue.Queue`` or ``queue.SimpleQueue``?

pingpong's ``next()`` waits for the producer in ``get(timeout=...)``.  This
runs a child that loops on ``get(timeout=0.5 ms)`` on an empty queue for 6 s
while the parent sends SIGINT every 0.3 ms, and counts how each ``get``
ended: ``KeyboardInterrupt`` (right) or anything else, e.g. ``RuntimeError:
release unlocked lock`` when the interrupt lands inside ``Queue.get``'s
Python-level ``Condition`` code; a child that never finishes is reported as
hung.  (Result in pingpong/_epoch.py, where the choice is made.)

    python benchmarks/sigint_queue.py
"""

from __future__ import annotations

import argparse
import queue
import signal
import subprocess
import sys
import time


def child(kind: str) -> None:
    q: queue.Queue[int] | queue.SimpleQueue[int] = (
        queue.Queue() if kind == "Queue" else queue.SimpleQueue()
    )
    counts = {"KeyboardInterrupt": 0}
    in_get = False

    def on_sigint(signum: int, frame: object) -> None:
        if in_get:  # only inside get(): elsewhere it would hit this loop's bookkeeping
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    print("READY", flush=True)
    end = time.monotonic() + 6
    while time.monotonic() < end:
        try:
            in_get = True
            q.get(timeout=0.0005)
        except queue.Empty:
            pass
        except KeyboardInterrupt:
            counts["KeyboardInterrupt"] += 1
        except BaseException as exc:  # noqa: BLE001 - counting what else comes out
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
        finally:
            in_get = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(kind, counts, flush=True)


def main() -> None:
    for kind in ("Queue", "SimpleQueue"):
        proc = subprocess.Popen([sys.executable, __file__, kind], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        proc.stdout.readline()
        start = time.monotonic()
        while time.monotonic() - start < 5:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.0003)
        try:
            print(proc.communicate(timeout=15)[0].strip())
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            print(kind, "hung (killed)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("child", nargs="?", choices=["Queue", "SimpleQueue"],
                        help=argparse.SUPPRESS)  # the child process's role
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
    else:
        main()
