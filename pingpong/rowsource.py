"""Row sources: feature or label tables that are not a host tensor pingpong reads in place.

A **row source** is any object with

- ``shape`` -- a tuple whose first entry is the number of rows ``N``;
- ``dtype`` -- a ``torch.dtype``;
- ``__getitem__(ids)`` -- given a 1-D int64 CPU tensor of ids in ``[0, N)``,
  return a tensor of shape ``(len(ids), *shape[1:])`` and that dtype with
  the rows in that order.

DGL's ``dgl.distributed.DistTensor`` is one: ``dist_tensor[ids]`` pulls the
rows from the servers that own them (rows of the local partition come out of
shared memory, without a copy over the network), and so is anything of the
user's own (a memory-mapped file, a key-value store, a compressed table...).
A plain ``torch.Tensor`` is not treated as a row source: it is a host table,
gathered in place by the kernels.

The producer thread fetches each batch's rows from a row source *before* it
takes a slot -- so a slow fetch overlaps training like sampling does, and a
stuck one never holds a slot or blocks ``close()`` -- then copies them into
the slot (on CUDA through a pinned staging buffer on the copy stream).  Ids
are checked against ``N`` before any fetch; a fetch that raises reaches the
training loop with its original exception; a fetch that returns the wrong
shape or dtype raises :class:`~pingpong.errors.TableError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .errors import TableError

__all__ = ["RemoteTable", "RowSource", "is_row_source", "make_remote_table"]


@runtime_checkable
class RowSource(Protocol):
    """The row-source protocol (see the module docstring), for type checkers."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor: ...


def is_row_source(value: Any) -> bool:
    """True for an object with ``shape``, ``dtype`` and ``__getitem__`` that is no tensor."""
    return (
        not isinstance(value, torch.Tensor | np.ndarray)
        and hasattr(value, "shape")
        and hasattr(value, "dtype")
        and callable(getattr(value, "__getitem__", None))
    )


@dataclass(frozen=True)
class RemoteTable:
    """A validated row source (see the module docstring).

    Attributes:
        name: what the table is called in error messages.
        source: the user's object.
        num_rows, row_shape, dtype: from its ``shape`` and ``dtype``.
    """

    name: str
    source: Any
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes_local(self) -> int:
        """Bytes of it held in this process's memory by pingpong: none."""
        return 0

    def fetch(self, ids: np.ndarray) -> torch.Tensor:
        """The rows at ``ids`` (validated), as a contiguous CPU tensor; checks what came back.

        Raises what the source raises, and :class:`~pingpong.errors.TableError`
        for a result of the wrong type, shape, dtype or device.
        """
        rows = self.source[torch.from_numpy(np.asarray(ids, dtype=np.int64))]
        want = (len(ids), *self.row_shape)
        if not isinstance(rows, torch.Tensor):
            raise TableError(
                f"{self.name}[ids] returned {type(rows).__name__}, not a torch.Tensor"
            )
        if tuple(rows.shape) != want or rows.dtype != self.dtype:
            raise TableError(
                f"{self.name}[ids] returned shape {tuple(rows.shape)} {rows.dtype} for "
                f"{len(ids)} ids; expected {want} {self.dtype}"
            )
        if rows.device.type != "cpu":
            rows = rows.cpu()
        return rows.contiguous()


def make_remote_table(value: Any, name: str) -> RemoteTable:
    """Validate a row source (``TableError`` naming what is wrong)."""
    shape = tuple(int(d) for d in value.shape)
    dtype = value.dtype
    if not isinstance(dtype, torch.dtype):
        raise TableError(f"{name}.dtype must be a torch.dtype, got {dtype!r}")
    if len(shape) < 1:
        raise TableError(f"{name} must have at least 1 dimension (rows), got shape {shape}")
    if shape[0] == 0 or math.prod(shape) == 0:
        raise TableError(f"{name} is empty (shape {shape})")
    return RemoteTable(name, value, shape[0], shape[1:], dtype)
