"""The producer thread's scheduling priority: its nice value, raised on the CPU.

On a machine where the training step's torch threads fill every core (the CPU
device: torch's intra-op pool has one thread per core), the producer -- DGL's
sampler, the gather -- runs beside them and takes a core from them for as long
as it works.  A training step's OpenMP team goes at the pace of its slowest
thread, so a core taken from one member slows the whole step, and the data
side's overlap turned into a loss: ``examples/train_sage.py`` at its default
size on a 2-core VM had pingpong's epochs 5-12% *longer* than the plain loop's.
With the producer at a lower priority the scheduler runs it in the gaps the
step leaves (between ops, while it waits for the GIL, or for the next batch),
and gives the step's threads the cores when they want them: the same job's
epochs became level with or shorter than the plain loop's (numbers in the
README).  Where the data side is the longer one, the training loop waits for
batches and its threads sleep, so the producer gets the cores anyway: a
features-only model (``--mlp --feat-dim 512``) took as long either way.  Not
on a DistDGL job whose servers share the cores (mixed: docs/distributed.rst),
so a loader in a DistDGL client process defaults to 0.

Linux keeps a nice value per thread (``setpriority(PRIO_PROCESS, tid)``) and a
thread inherits its creator's at creation, so raising it on the producer
thread changes no other thread -- the training thread keeps its own -- and the
threads the producer starts (its OpenMP pools) start at its value.  An
unprivileged process may raise a nice value but never lower it again, which is
why pingpong only raises it, and only on threads it started (each epoch has a
new producer thread).  Elsewhere nice is per process, not per thread, and this
does nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

#: The highest nice value (the lowest priority) Linux gives a thread.
MAX_NICE = 19

#: Whether this platform keeps a nice value per thread (Linux); elsewhere nothing is done.
PER_THREAD_NICE = sys.platform.startswith("linux")

_refusal_logged = False  # the OS refused once: later refusals are logged at debug


def lower_this_thread_priority(increment: int) -> int | None:
    """Raise the calling thread's nice value by ``increment`` (0-19), at most to 19.

    Returns the thread's nice value afterwards, or None where nothing was done:
    ``increment`` is 0, the platform has no per-thread nice (not Linux), or the
    OS refused (logged as a warning the first time in a process, at debug level
    after; the caller goes on at the old priority -- raising a nice value needs
    no privilege, so only a sandbox refuses).
    """
    if increment == 0 or not PER_THREAD_NICE:
        return None
    thread = threading.get_native_id()
    try:
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, thread) + increment)
        os.setpriority(os.PRIO_PROCESS, thread, target)
    except OSError as exc:
        global _refusal_logged
        # A warning once per process (each epoch has a new producer), then debug.
        level = logging.DEBUG if _refusal_logged else logging.WARNING
        _refusal_logged = True
        logger.log(level, "pingpong: could not lower the producer thread's priority "
                   "(producer_nice=%d): %s; it runs at its creator's priority",
                   increment, exc)
        return None
    return target
