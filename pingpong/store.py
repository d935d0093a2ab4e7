"""Host feature and label tables: validation and byte-row views for the kernels.

A :class:`HostTable` wraps one host tensor of shape ``(N, ...)`` without
copying it.  The kernels see it as ``(N, row_bytes)`` uint8 rows, so every
dtype (bfloat16 included) is gathered bit-exactly by the same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import TableError


def byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``(N, ...)`` tensor as ``(N, row_bytes)`` uint8, sharing memory."""
    rows = tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))
    return rows.view(torch.uint8)


@dataclass(frozen=True)
class HostTable:
    """One validated host table; ``tensor`` is the caller's own, never copied.

    Attributes:
        name: what the table is called in error messages.
        tensor: the caller's tensor, shape ``(N, *row_shape)``, C-contiguous, on CPU.
        byte_rows: NumPy uint8 view ``(N, row_bytes)`` of the same memory.
    """

    name: str
    tensor: torch.Tensor
    byte_rows: np.ndarray = field(repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def row_bytes(self) -> int:
        return int(self.byte_rows.shape[1])


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TableError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def make_host_table(value: Any, name: str) -> HostTable:
    """Validate ``value`` as a host table and wrap it (no copy).

    Raises:
        TableError: not a tensor, 0-D, empty, sparse, not on the CPU, or not
            C-contiguous (pingpong never silently copies a feature table).
    """
    tensor = _as_tensor(value, name)
    if tensor.layout != torch.strided:
        raise TableError(f"{name} must be a dense tensor, got layout {tensor.layout}")
    if tensor.dim() < 1:
        raise TableError(f"{name} must have at least 1 dimension (rows), got a 0-D tensor")
    if tensor.device.type != "cpu":
        raise TableError(
            f"{name} must live in host memory, got a tensor on {tensor.device}; "
            "pass the CPU table (pingpong gathers it onto the device)"
        )
    if tensor.shape[0] == 0 or tensor.numel() == 0:
        raise TableError(f"{name} is empty (shape {tuple(tensor.shape)})")
    if not tensor.is_contiguous():
        raise TableError(
            f"{name} is not contiguous (strides {tensor.stride()}); pass "
            f"{name}.contiguous() -- pingpong does not copy tables implicitly"
        )
    if tensor.requires_grad:
        tensor = tensor.detach()
    return HostTable(name, tensor, byte_rows(tensor).numpy())


@dataclass(frozen=True)
class FeatureStore:
    """The validated features (one table or a dict of tables) and optional labels.

    ``tables`` maps a key to each feature table; the key is ``None`` when the
    user passed a single tensor (``batch.x`` is then a tensor, else a dict).
    """

    tables: dict[str | None, HostTable]
    labels: HostTable | None
    num_rows: int

    @property
    def is_dict(self) -> bool:
        return None not in self.tables

    @property
    def bytes_per_input_row(self) -> int:
        return sum(t.row_bytes for t in self.tables.values())


def make_feature_store(features: Any, labels: Any = None) -> FeatureStore:
    """Validate ``features`` (tensor or non-empty mapping of tensors) and ``labels``.

    Raises:
        TableError: see :func:`make_host_table`; also mismatched row counts
            between tables, or labels whose length differs from the features'.
    """
    if isinstance(features, Mapping):
        if not features:
            raise TableError("features is an empty dict; give at least one table")
        tables: dict[str | None, HostTable] = {}
        for key, value in features.items():
            if not isinstance(key, str):
                raise TableError(f"feature dict keys must be str, got {key!r}")
            tables[key] = make_host_table(value, f"features[{key!r}]")
    else:
        tables = {None: make_host_table(features, "features")}
    row_counts = {t.name: t.num_rows for t in tables.values()}
    num_rows = next(iter(row_counts.values()))
    if len(set(row_counts.values())) != 1:
        raise TableError(f"feature tables have different numbers of rows: {row_counts}")
    label_table = None
    if labels is not None:
        label_table = make_host_table(labels, "labels")
        if label_table.num_rows != num_rows:
            raise TableError(
                f"labels has {label_table.num_rows} rows but features has {num_rows}; "
                "labels[i] must belong to node i"
            )
    return FeatureStore(tables, label_table, num_rows)
