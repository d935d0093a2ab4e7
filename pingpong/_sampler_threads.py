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
the calling thread's count when it starts (to ``NUMBA_NUM_THREADS``; the
device's ``producer_started`` may start it), so the producer sets it after
that -- and, with no count asked for (CUDA's default), puts back the count
the thread had before.

This holds where DGL and torch load one OpenMP runtime (PyPI's wheels: both
bind ``libgomp.so.1``); a build on another runtime (llvm-openmp, Intel's) was
not tried.  Threads DGL or GraphBolt start themselves (DGL's prefetch thread
for a CUDA ``DataLoader``, GraphBolt's prefetcher before ``copy_to``) start
with the process default and are not limited.

pingpong never imports DGL for this: a process that has not imported it has
no DGL sampler to limit.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _dgl_utils(name: str) -> Any:
    return getattr(getattr(sys.modules.get("dgl"), "utils", None), name, None)


def limit_dgl_threads(count: int, *, torch_first: bool = True) -> bool:
    """Make OpenMP code called from *this thread* -- DGL's, torch's CPU ops -- use
    ``count`` threads, through DGL's ``dgl.utils.set_num_threads``.

    ``torch_first``: run torch's one-time per-thread set-up first (it would
    set the count to torch's own at the thread's first parallel op); without
    it, the count is put back as it was and torch's set-up still comes later.

    Returns whether DGL was there to be told (it has been imported and has
    that function); without it, does nothing.
    """
    set_num_threads = _dgl_utils("set_num_threads")
    if set_num_threads is None:
        return False
    if torch_first:
        torch.get_num_threads()
    set_num_threads(count)
    return True


def dgl_threads_of_this_thread() -> int | None:
    """The OpenMP count DGL's code would use on this thread now (None without DGL);
    reading it changes nothing."""
    get_num_threads = _dgl_utils("get_num_threads")
    return None if get_num_threads is None else int(get_num_threads())
