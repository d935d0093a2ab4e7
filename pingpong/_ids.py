"""Turning the ids a source yields into validated host arrays for the kernels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import IdShapeError, IdTypeError
from .kernels._checks import check_id_array, check_id_range, swapped_id_dtype
from .store import FeatureStore, Table, TableKey

_TORCH_ID_DTYPES = (torch.int32, torch.int64)


def host_ids(ids: Any, num_rows: int, name: str) -> np.ndarray:
    """Return ``ids`` as a validated 1-D int32/int64 NumPy array on the host: a
    private copy, C-contiguous and writeable.

    Accepts a torch tensor (any device) or a NumPy array.  Always a copy, never
    memory the caller can still write: the ids are checked here, when the batch
    is sampled, and gathered later -- the batch may wait for a free slot while
    the training loop runs -- so a write to them in between (a source that
    yields one id tensor again, and a loop that edits ``batch.input_nodes`` in
    place) must not reach the kernels, which do not check again.  Contiguous
    and writeable, every consumer -- ``torch.from_numpy`` in the CPU fallback,
    a row source's fetch, the CUDA id staging -- can take it as it is
    (``torch.from_numpy`` refuses negative strides and warns on read-only
    arrays).  Never reads a table.

    Raises:
        IdTypeError: not a tensor/array, or a dtype other than int32/int64
            (floats, bools and unsigned types are refused, not cast; int32/int64
            of either byte order are read), a tensor on
            the meta device or of a sparse layout, a NumPy masked array.  (A
            lazily negated view is read as the values it stands for.)
        IdShapeError: not 1-D.
        IdRangeError: a value outside ``[0, num_rows)``; the message names it.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise IdShapeError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype not in _TORCH_ID_DTYPES:
            raise IdTypeError(f"{name} must have dtype int32 or int64, got {ids.dtype}")
        if ids.is_meta:
            raise IdTypeError(f"{name} is on the meta device, which holds no values")
        if ids.layout != torch.strided:
            raise IdTypeError(f"{name} is a {ids.layout} tensor; pass dense ids "
                              f"({name}.to_dense(), or a sparse tensor's indices)")
        if ids.is_neg():  # its memory holds the negated values
            ids = ids.resolve_neg()
        # integer tensors never require grad; .numpy() is 2-3x cheaper than .cpu().numpy()
        if not ids.is_cpu:
            return _checked(np.ascontiguousarray(ids.cpu().numpy()), num_rows, name)  # a copy
        array = ids.numpy()
    elif isinstance(ids, np.ndarray):
        if isinstance(ids, np.ma.MaskedArray):
            raise IdTypeError(f"{name} is a NumPy masked array, whose masked entries are "
                              f"no ids; pass {name}.compressed() (the unmasked ids)")
        native = swapped_id_dtype(ids.dtype)
        if native is not None:
            # int32/int64 in the other byte order (read from a file written on a
            # big-endian machine, or as ">i8"): the same values, taken in this
            # machine's order -- the ids are copied anyway
            ids = ids.astype(native)
        check_id_array(ids, name)
        array = ids
    elif isinstance(ids, Mapping):
        raise IdTypeError(
            f"{name} is a dict (a heterogeneous graph, or seeds given as a dict?); "
            "build the loader with heterogeneous=True and features/labels as dicts "
            "keyed by node type"
        )
    else:
        raise IdTypeError(f"{name} must be a torch.Tensor or numpy array, got {type(ids).__name__}")
    # The copy comes before the range check, whose Numba kernel the warm-up
    # compiled for C-contiguous writeable arrays only (no compilation while a
    # batch waits).
    return _checked(np.array(array, order="C"), num_rows, name)


def _checked(own_copy: np.ndarray, num_rows: int, name: str) -> np.ndarray:
    """``own_copy`` (a C-contiguous writeable array no caller holds), once its
    values are checked against ``[0, num_rows)``."""
    check_id_range(own_copy, num_rows, name)
    return own_copy


#: Validated ids per table key: what each feature / label table is gathered with.
TableIds = dict[TableKey, np.ndarray]


def batch_ids(
    store: FeatureStore,
    feature_ids: Any,
    label_ids: Any,
    feature_name: str = "input_nodes",
    label_name: str = "output_nodes",
) -> tuple[TableIds, TableIds]:
    """Validate one batch's ids for every table; read no table.

    Homogeneous store: every feature table gets the same ``feature_ids``
    array (the same object, so a device stages it once) and the label table
    gets ``label_ids``, checked against its own row count (node labels have
    ``N`` rows, edge labels one per edge).  ``label_ids`` of ``None`` gathers
    no labels.  Heterogeneous store: table ``ntype`` gets
    ``feature_ids[ntype]`` (labels: ``label_ids[ntype]``), each checked
    against that table's own row count; a node type that has a table but no
    entry in the dict gets no ids (DGL leaves out of ``output_nodes`` the seed
    types a batch happens not to contain); node types without a table are not
    looked at (their ids are delivered as given); ids that are not a dict are
    the ids of the only table where the loader has one feature table and at
    most one node label table (a graph of one node type).
    Label tables keyed by edge type (either store) are the same: table ``k``
    gets ``label_ids[k]`` (plain ids where there is one such table); one label
    table keyed ``None`` gets ``label_ids``.
    The names are what error messages call the ids.

    Raises what :func:`host_ids` raises, and ``IdTypeError`` when a
    heterogeneous batch's ids are not a dict and the loader has more tables.
    """
    node_label_tables = store.label_tables if store.label_kind == "node" else {}
    one_type = len(store.tables) == 1 and len(node_label_tables) <= 1
    y_ids: TableIds = {}
    if not store.label_tables or label_ids is None:
        pass
    elif store.label_kind == "edge" and store.labels_by_type:
        y_ids = _typed_ids(label_ids, store.label_tables, label_name,
                           len(store.label_tables) == 1, "edge type")
    elif store.labels_by_type:
        y_ids = _typed_ids(label_ids, store.label_tables, label_name, one_type)
    elif store.label_kind == "edge" and isinstance(label_ids, Mapping):
        raise IdTypeError(
            f"{label_name} is a dict by edge type ({', '.join(map(repr, label_ids))}), but "
            "the loader has one edge_labels table: pass edge_labels as a dict "
            "{edge type: table}"
        )
    else:
        y_ids[None] = host_ids(label_ids, store.label_tables[None].num_rows, label_name)
    if not store.heterogeneous:
        x_ids = host_ids(feature_ids, store.num_rows, feature_name)
        return dict.fromkeys(store.tables, x_ids), y_ids
    return _typed_ids(feature_ids, store.tables, feature_name, one_type), y_ids


#: The ids of a table with none in a batch.  Writeable like every array of a
#: :data:`TableIds` (see :func:`host_ids`); being empty, it holds nothing to write.
_NO_IDS = np.empty(0, dtype=np.int64)


def _typed_ids(ids: Any, tables: dict[TableKey, Table], name: str,
               one_type: bool, kind: str = "node type") -> TableIds:
    """Each table's validated ids from a dict by ``kind`` (node or edge type; none
    where the type is absent).  With ``one_type`` (one feature table, at most
    one label table), plain ids are the table's: DGL gives a graph of one node
    type (and several edge types) ``input_nodes`` as a tensor, while
    ``output_nodes`` follow the seeds, a dict if they were one."""
    if not isinstance(ids, Mapping):
        if not one_type:
            raise IdTypeError(
                f"{name} must be a dict {{{kind}: ids}} (the loader's tables are keyed "
                f"by {kind}), got {type(ids).__name__} (plain ids are taken as a type's "
                "only where the loader has one feature table and at most one label table)"
            )
        ids = dict.fromkeys(tables, ids)
    return {
        ntype: host_ids(ids[ntype], table.num_rows, f"{name}[{ntype!r}]")
        if ntype in ids
        else _NO_IDS
        for ntype, table in tables.items()
    }
