"""Gather kernels: ``out[i] = table[ids[i]]``, validated before any read.

- :func:`gather_rows_cpu` -- Numba ``parallel=True, nogil=True`` on NumPy arrays.
- :func:`gather_rows_cuda` -- Numba-CUDA zero-copy gather (see
  :mod:`pingpong.kernels.cuda`); imported lazily so that the CPU path never
  loads the CUDA target.
- :func:`warm_up_cpu` / :func:`warm_up_cuda` -- compile (or load from Numba's
  disk cache) the specialisations a loader's tables need, before the first
  batch; :func:`start_warm_up` runs either on a ``pingpong-warmup-N`` thread.
"""

from __future__ import annotations

from typing import Any

from ._warmup import WarmUpThread, start_warm_up
from .cpu import gather_rows_cpu, warm_up_cpu

__all__ = [
    "WarmUpThread",
    "gather_rows_cpu",
    "gather_rows_cuda",
    "start_warm_up",
    "warm_up_cpu",
    "warm_up_cuda",
]

_CUDA_NAMES = ("gather_rows_cuda", "warm_up_cuda")


def __getattr__(name: str) -> Any:
    if name in _CUDA_NAMES:
        from . import cuda

        return getattr(cuda, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
