"""Gather kernels: ``out[i] = table[ids[i]]``, validated before any read.

- :func:`gather_rows_cpu` -- Numba ``parallel=True, nogil=True`` on NumPy arrays.
- :func:`gather_rows_cuda` -- Numba-CUDA zero-copy gather (see
  :mod:`pingpong.kernels.cuda`); imported lazily so that the CPU path never
  loads the CUDA target.
"""

from __future__ import annotations

from typing import Any

from .cpu import gather_rows_cpu

__all__ = ["gather_rows_cpu", "gather_rows_cuda"]


def __getattr__(name: str) -> Any:
    if name == "gather_rows_cuda":
        from .cuda import gather_rows_cuda

        return gather_rows_cuda
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
