"""How many OpenMP threads DGL's C++ code (its samplers) uses on the producer thread.

A DGL ``DataLoader`` with ``num_workers=0`` samples in the thread that iterates
it -- pingpong's producer.  DGL parallelises sampling with OpenMP over every
core by default, while the training step's torch threads use those same cores:
on a machine the step already fills, the two teams preempt each other and both
slow down (``examples/train_rgcn.py`` on a 2-core VM: pingpong's epochs went
from slower than the plain loop to level with it when the producer's DGL used
one thread; numbers in the README).

OpenMP keeps the thread count per calling thread (``omp_set_num_threads`` sets
the calling thread's ICV), so setting it on the producer thread changes no
other thread's DGL calls -- the training thread's, an evaluation loop's.  DGL
and torch share one OpenMP runtime in a process (libgomp), so torch's CPU ops
on the producer thread use that count too; torch's first parallel op on a
thread sets the thread's count to torch's own, which is why
:func:`limit_dgl_threads` lets that happen first.

The producer sets it before ``iter(source)``, not just before each sampling
step: DGL's ``iter()`` shuffles with torch, and once that had run with two
threads on the producer thread, limiting the steps alone left the epochs as
slow as not limiting at all (``train_rgcn.py`` on the 2-core VM, three runs
each; why, in libgomp, was not pinned down).  Numba's OpenMP layer also sets
the calling thread's count when it starts (the device's ``producer_started``
may start it), so the producer sets it after that.

pingpong never imports DGL for this: a process that has not imported it has
no DGL sampler to limit.
"""

from __future__ import annotations

import sys

import torch


def limit_dgl_threads(count: int) -> bool:
    """Make OpenMP code called from *this thread* -- DGL's, torch's CPU ops -- use
    ``count`` threads, through DGL's ``dgl.utils.set_num_threads``.

    Returns whether DGL was there to be told (it has been imported and has
    that function); without it, does nothing.
    """
    dgl = sys.modules.get("dgl")
    set_num_threads = getattr(getattr(dgl, "utils", None), "set_num_threads", None)
    if set_num_threads is None:
        return False
    torch.get_num_threads()  # torch's one-time per-thread set-up, which sets the count
    set_num_threads(count)
    return True
