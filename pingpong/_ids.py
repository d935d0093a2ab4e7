"""Turning the ids a source yields into validated host arrays for the kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import IdShapeError, IdTypeError
from .kernels._checks import check_id_array, check_id_range

_TORCH_ID_DTYPES = (torch.int32, torch.int64)


def host_ids(ids: Any, num_rows: int, name: str) -> np.ndarray:
    """Return ``ids`` as a validated 1-D int32/int64 NumPy array on the host.

    Accepts a torch tensor (any device; a device tensor is copied to the host)
    or a NumPy array.  Shares memory with a CPU tensor; never reads a table.

    Raises:
        IdTypeError: not a tensor/array, or a dtype other than int32/int64
            (floats, bools and unsigned types are refused, not cast).
        IdShapeError: not 1-D.
        IdRangeError: a value outside ``[0, num_rows)``; the message names it.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise IdShapeError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype not in _TORCH_ID_DTYPES:
            raise IdTypeError(f"{name} must have dtype int32 or int64, got {ids.dtype}")
        # integer tensors never require grad; .numpy() is 2-3x cheaper than .cpu().numpy()
        array = ids.numpy() if ids.is_cpu else ids.cpu().numpy()
    elif isinstance(ids, np.ndarray):
        check_id_array(ids, name)
        array = ids
    elif isinstance(ids, dict):
        raise IdTypeError(
            f"{name} is a dict (a heterogeneous graph?); pingpong gathers one node "
            "type: pass a homogeneous source, or one loader per node type"
        )
    else:
        raise IdTypeError(f"{name} must be a torch.Tensor or numpy array, got {type(ids).__name__}")
    check_id_range(array, num_rows, name)
    return array
