"""Host feature and label tables: validation and byte-row views for the kernels.

A :class:`HostTable` wraps one host tensor of shape ``(N, ...)`` without
copying it.  The kernels see it as ``(N, row_bytes)`` uint8 rows, so every
dtype (bfloat16 included) is gathered bit-exactly by the same code.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .errors import ConfigError, TableError
from .rowsource import RemoteTable, is_row_source, make_remote_table


def byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``(N, ...)`` tensor as ``(N, row_bytes)`` uint8, sharing memory.

    A tensor torch calls contiguous may carry any stride on a dimension of size
    1 (an ``(N, 1)`` column made by a transpose has strides ``(1, N)``); the
    view takes the standard strides, which address the same bytes.
    """
    width = math.prod(tensor.shape[1:])
    if tensor.is_contiguous():
        rows = tensor.as_strided((tensor.shape[0], width), (width, 1))
    else:
        rows = tensor.reshape(tensor.shape[0], width)
    return rows.view(torch.uint8)


class TensorLayout(NamedTuple):
    """What an in-place change of a tensor's metadata (``resize_``, ``unsqueeze_``,
    ``set_`` over the same memory) alters."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


class NumpyLayout(NamedTuple):
    """What an in-place change of a NumPy array's attributes (``shape``, ``dtype``,
    ``strides``, ``data``) alters; strides in bytes."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    address: int


@dataclass(frozen=True)
class NumpyOrigin:
    """The caller's NumPy array behind a table, and its layout when the table was made.

    A table given as an array is read through pingpong's own tensor over the
    array's memory, which nothing the caller does to the array changes: only the
    array itself shows an in-place ``arr.shape = ...``, ``arr.dtype = ...`` or
    ``arr.data = ...``.
    """

    array: np.ndarray = field(repr=False)
    layout: NumpyLayout = field(repr=False)

    def change(self) -> str | None:
        """What changed since the table was made (for :class:`TableError`), or None."""
        now = _numpy_layout_of(self.array)
        if now == self.layout:
            return None
        if now._replace(address=0) == self.layout._replace(address=0):
            return "new memory"
        return (f"a new shape, strides or dtype ({_describe(self.layout)} when the loader "
                f"was built, {_describe(now)} now)")


@dataclass(frozen=True, eq=False)
class HostTable:
    """One validated host table; ``tensor`` is the caller's own, never copied.

    Attributes:
        name: what the table is called in error messages.
        tensor: the caller's tensor, shape ``(N, *row_shape)``, C-contiguous, on CPU.
        byte_rows: NumPy uint8 view ``(N, row_bytes)`` of the same memory: what
            every gather reads (it keeps that memory alive).
        address: ``tensor.data_ptr()`` when the table was made.
        layout: the tensor's shape, strides and dtype when the table was made.
        numpy_origin: for a table given as a NumPy array, that array (``tensor``
            is then pingpong's own view of its memory, which no caller can change).
    """

    name: str
    tensor: torch.Tensor
    byte_rows: np.ndarray = field(repr=False)
    address: int = field(repr=False)
    layout: TensorLayout = field(repr=False)
    numpy_origin: NumpyOrigin | None = field(default=None, repr=False)

    def check_memory_unchanged(self) -> None:
        """``TableError`` if the caller's tensor was given other memory, or another
        shape, strides or dtype over its memory, since the table was made
        (``tensor.data = ...``, ``tensor.set_(...)``, ``resize_``, ``unsqueeze_``;
        for a NumPy array, ``arr.shape = ...``, ``arr.dtype = ...``): gathers
        would keep reading the old memory in the old layout, silently stale or
        of the wrong shape."""
        if self.numpy_origin is not None:
            change = self.numpy_origin.change()
            how = "arr.shape = ..., arr.dtype = ..., arr.data = ..., arr.resize(...)"
            write = f"{self.name}[...] = new"
        else:
            change = self._tensor_change()
            how = "tensor.data = ..., tensor.set_(...), an in-place resize_ or view"
            write = f"{self.name}.copy_(new)"
        if change is None:
            return
        raise TableError(
            f"{self.name} was given {change} after the loader was built ({how}); "
            "pingpong reads the memory a table had when the loader was built, in "
            "its layout then, so its batches would not be what the table holds. "
            f"Write the new values in place ({write}) or build a new loader"
        )

    def _tensor_change(self) -> str | None:
        if self.tensor.data_ptr() != self.address:
            return "new memory"
        now = _layout_of(self.tensor)
        if now != self.layout:
            return (f"a new shape, strides or dtype ({_describe(self.layout)} when the "
                    f"loader was built, {_describe(now)} now)")
        return None

    # The table's rows as the gathers read them: ``byte_rows``' memory in the layout
    # recorded when the table was made -- not the caller's tensor now, which may have
    # been given other memory or another shape since (a slot buffer sized from that
    # would be too small for the rows the kernel copies).

    @property
    def num_rows(self) -> int:
        return int(self.byte_rows.shape[0])

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.layout.shape[1:]

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def row_bytes(self) -> int:
        return int(self.byte_rows.shape[1])

    @property
    def nbytes_local(self) -> int:
        """Bytes of host memory the table occupies (what ``gather="auto"`` weighs)."""
        return int(self.byte_rows.nbytes)


def _layout_of(tensor: torch.Tensor) -> TensorLayout:
    return TensorLayout(tuple(tensor.shape), tensor.stride(), tensor.dtype)


def _numpy_layout_of(array: np.ndarray) -> NumpyLayout:
    return NumpyLayout(array.shape, array.strides, array.dtype,
                       array.__array_interface__["data"][0])


def _describe(layout: TensorLayout | NumpyLayout) -> str:
    return f"shape {layout.shape}, strides {layout.strides}, {layout.dtype}"


#: A feature or label table: a host tensor read in place, or a row source
#: (:mod:`pingpong.rowsource`) whose rows are fetched per batch.
Table = HostTable | RemoteTable


def make_table(value: Any, name: str) -> Table:
    """A :class:`HostTable` for a tensor or array, a ``RemoteTable`` for a row source."""
    if is_row_source(value):
        return make_remote_table(value, name)
    return make_host_table(value, name)


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if isinstance(value, np.ma.MaskedArray):
            raise TableError(
                f"{name} is a NumPy masked array: pingpong would gather the values under "
                f"its mask as if they were data; pass {name}.filled(fill_value) (a copy "
                "with the masked entries set) or its .data if those values are meant"
            )
        if not value.flags.c_contiguous:  # torch.from_numpy refuses negative strides
            raise TableError(
                f"{name} is not contiguous (strides {value.strides}); pass "
                f"np.ascontiguousarray({name}) -- pingpong does not copy tables implicitly"
            )
        value = _from_numpy(value, name)
    if not isinstance(value, torch.Tensor):
        if callable(getattr(value, "__getitem__", None)) and \
                not isinstance(value, list | tuple | str | bytes):  # meant as a row source?
            missing = " or ".join(a for a in ("shape", "dtype") if not hasattr(value, a))
            raise TableError(
                f"{name} must be a torch.Tensor, a NumPy array or a row source; "
                f"{type(value).__name__} has __getitem__ but no {missing}: a row source "
                "also has shape (rows first) and a torch dtype (see pingpong.rowsource)"
            )
        raise TableError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    """``torch.from_numpy`` (no copy); ``TableError`` for a dtype or byte order torch lacks."""
    try:
        if array.flags.writeable:
            return torch.from_numpy(array)
        # A read-only array (np.load(..., mmap_mode="r")) is a valid table:
        # pingpong only ever reads a table, which is what torch warns about.
        # (catch_warnings swaps the process's warning filters: not thread-safe
        # before Python 3.14, hence only here, once per read-only table.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable",
                                    UserWarning)
            return torch.from_numpy(array)
    except (TypeError, ValueError) as exc:
        raise TableError(
            f"{name}: torch cannot read a NumPy array of dtype {array.dtype.str!r} in "
            f"place ({exc}); convert it (e.g. astype with a native-order numeric dtype)"
        ) from exc


def make_host_table(value: Any, name: str) -> HostTable:
    """Validate ``value`` as a host table and wrap it (no copy).

    Raises:
        TableError: not a tensor, 0-D, empty, sparse, nested, not on the CPU, not
            C-contiguous, quantized, a lazily conjugated/negated view, a NumPy
            masked array, a NumPy array torch cannot read in place (pingpong never silently copies a
            feature table), or a tensor that requires grad (its gathered rows
            would carry no gradient).
    """
    array = value if isinstance(value, np.ndarray) else None
    tensor = _as_tensor(value, name)
    if tensor.is_nested:  # its layout may read torch.strided, and .shape raises
        raise TableError(
            f"{name} is a nested tensor (rows of different lengths): pingpong gathers "
            f"rows of one shape; pass a dense table ({name}.to_padded_tensor(0.0), say, "
            "and the lengths as another table)")
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
    if tensor.is_quantized:
        raise TableError(
            f"{name} is a quantized tensor ({tensor.dtype}), whose values are its integers "
            f"with a scale and zero point pingpong would not carry over; pass "
            f"{name}.int_repr() (and dequantize in the model) or {name}.dequantize()"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise TableError(
            f"{name} is a lazily conjugated or negated view, whose memory holds other "
            f"values; pass {name}.resolve_conj().resolve_neg() -- pingpong does not copy "
            "tables implicitly"
        )
    if tensor.requires_grad:
        raise TableError(
            f"{name} requires grad (a learnable nn.Parameter, say): pingpong copies rows "
            "into its own buffers, outside autograd, so the table would never train. "
            f"A frozen table: pass {name}.detach(). A learnable one (node embeddings): "
            "look its rows up in the model (an nn.Embedding indexed with "
            "batch.input_nodes) and give pingpong only the fixed tables"
        )
    return HostTable(name, tensor, byte_rows(tensor).numpy(), tensor.data_ptr(),
                     _layout_of(tensor),
                     None if array is None else NumpyOrigin(array, _numpy_layout_of(array)))


#: What a table is keyed by: ``None`` (the one table of its kind), a feature
#: name or node type (``str``), or -- edge label tables -- an edge type, as its
#: name or canonical ``(source type, edge type, destination type)``.
TableKey = str | tuple[str, str, str] | None


@dataclass(frozen=True, eq=False)
class FeatureStore:
    """The validated feature tables and optional label tables.

    Homogeneous (the default): ``tables`` maps a key to each feature table,
    all with the same ``N`` rows; the key is ``None`` when the user passed a
    single tensor (``batch.x`` is then a tensor, else a dict).  Every table is
    gathered with the batch's one ``input_nodes`` array; ``label_tables`` is
    ``{}`` or ``{None: labels}``, gathered with ``output_nodes``.

    Heterogeneous (``heterogeneous=True``): the keys of ``tables`` and
    ``label_tables`` are node types; each table has its own ``N``, row shape
    and dtype and is gathered with ``input_nodes[ntype]`` (labels:
    ``output_nodes[ntype]``).  ``batch.x`` and ``batch.y`` are dicts.

    Edge labels (``label_kind == "edge"``, either kind of store): one table
    keyed ``None``, gathered at a pair graph's edge ids, or one per edge type
    (keys: edge type names or canonical triples), gathered at that type's
    edge ids; ``batch.y`` is then a dict with the same keys.
    """

    tables: dict[TableKey, Table]
    label_tables: dict[TableKey, Table]
    heterogeneous: bool = False
    #: What the label table is indexed by: ``"node"`` ids, ``"edge"`` ids
    #: (``edge_labels=``: one row per edge of the graph), or ``"none"``.
    label_kind: str = "none"
    #: ``N`` of a homogeneous store (read per batch); 0 if heterogeneous, whose
    #: tables each have their own.
    num_rows: int = field(init=False, default=0)
    #: The tables of ``all_tables`` that are host tables (not row sources).
    host_tables: tuple[HostTable, ...] = field(init=False, default=(), repr=False)
    #: The local parts of the row sources (:class:`~pingpong.rowsource.LocalPart`):
    #: host tables too, read in place where the device reads local rows.
    local_part_tables: tuple[HostTable, ...] = field(init=False, default=(), repr=False)
    #: ``id()`` of each row-source object behind more than one of the tables.
    shared_sources: frozenset[int] = field(init=False, default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if not self.heterogeneous:
            object.__setattr__(self, "num_rows", next(iter(self.tables.values())).num_rows)
        object.__setattr__(self, "host_tables",
                           tuple(t for t in self.all_tables if isinstance(t, HostTable)))
        object.__setattr__(self, "local_part_tables",
                           tuple(t.local.table for t in self.all_tables
                                 if isinstance(t, RemoteTable) and t.local is not None))
        sources = Counter(id(t.source) for t in self.all_tables if isinstance(t, RemoteTable))
        object.__setattr__(self, "shared_sources",
                           frozenset(key for key, count in sources.items() if count > 1))

    def check_memory_unchanged(self, read_local: bool = True) -> None:
        """:meth:`HostTable.check_memory_unchanged` for every host table (per batch,
        before any row is read) and, with ``read_local`` (the device reads the row
        sources' local rows in place), for every local part."""
        for table in (*self.host_tables, *(self.local_part_tables if read_local else ())):
            table.check_memory_unchanged()

    @property
    def is_dict(self) -> bool:
        return None not in self.tables

    @property
    def labels_by_type(self) -> bool:
        """Label tables keyed by node or edge type, one or more (``batch.y`` is a
        dict); False for one label table keyed ``None`` and for none."""
        return bool(self.label_tables) and None not in self.label_tables

    @property
    def all_tables(self) -> list[Table]:
        """Every feature and label table (for pinning or copying once)."""
        return [*self.tables.values(), *self.label_tables.values()]


def _table_dict(values: Mapping[Any, Any], what: str) -> dict[TableKey, Table]:
    if not values:
        raise TableError(f"{what} is an empty dict; give at least one table")
    tables: dict[TableKey, Table] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise TableError(f"{what} dict keys must be str, got {key!r}")
        tables[key] = make_table(value, f"{what}[{key!r}]")
    return tables


def _edge_label_tables(edge_labels: Any) -> dict[TableKey, Table]:
    """``{None: table}`` for one table, else one table per edge type: keys are edge
    type names or canonical ``(source type, edge type, destination type)`` triples."""
    if not isinstance(edge_labels, Mapping):
        return {None: make_table(edge_labels, "edge_labels")}
    if not edge_labels:
        raise TableError("edge_labels is an empty dict; give at least one table")
    tables: dict[TableKey, Table] = {}
    for key, value in edge_labels.items():
        if not (isinstance(key, str) or _is_canonical_etype(key)):
            raise TableError(
                "edge_labels dict keys must be edge types: a name such as 'rates' or a "
                f"canonical ('user', 'rates', 'item') tuple of three str, got {key!r}"
            )
        tables[key] = make_table(value, f"edge_labels[{key!r}]")
    return tables


def _is_canonical_etype(key: Any) -> bool:
    return isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, str) for k in key)


def make_feature_store(features: Any, labels: Any = None,
                       heterogeneous: bool = False, edge_labels: Any = None) -> FeatureStore:
    """Validate ``features`` (tensor or non-empty mapping of tensors) and the labels.

    ``labels`` are node labels (``N`` rows, like the features); ``edge_labels``
    are edge labels (one row per edge id of the graph, any number of rows),
    for edge-prediction items: one table, or a mapping ``{edge type: table}``
    (one row per edge id of that type; keys are edge type names or canonical
    triples), with or without ``heterogeneous=True``.  At most one of the
    two.  With ``heterogeneous=True`` ``features`` and ``labels`` must be
    mappings keyed by node type (``labels`` may be ``None``), and a node type
    in both must have as many label rows as feature rows.

    Raises:
        TableError: see :func:`make_host_table`; also mismatched row counts
            between tables, labels whose length differs from the features',
            or ``edge_labels`` keys that are not edge types.
        ConfigError: both ``labels`` and ``edge_labels``.
    """
    if edge_labels is not None:
        if labels is not None:
            raise ConfigError(
                "pass labels= (node labels) or edge_labels= (edge labels), not both: "
                "a batch's y is one of them"
            )
        if heterogeneous:
            tables = _make_heterogeneous_store(features, None).tables
        elif isinstance(features, Mapping):
            tables = _table_dict(features, "features")
        else:
            tables = {None: make_table(features, "features")}
        if not heterogeneous:
            _check_same_rows(tables)
        return FeatureStore(tables, _edge_label_tables(edge_labels), heterogeneous,
                            label_kind="edge")
    if heterogeneous:
        return _make_heterogeneous_store(features, labels)
    if isinstance(features, Mapping):
        tables = _table_dict(features, "features")
    else:
        tables = {None: make_table(features, "features")}
    num_rows = _check_same_rows(tables)
    label_tables: dict[TableKey, Table] = {}
    if labels is not None:
        if isinstance(labels, Mapping):
            raise TableError(
                "labels is a dict: per-node-type labels need heterogeneous=True; "
                "a homogeneous loader takes one label tensor"
            )
        label_table = make_table(labels, "labels")
        if label_table.num_rows != num_rows:
            raise TableError(
                f"labels has {label_table.num_rows} rows but features has {num_rows}; "
                "labels[i] must belong to node i"
            )
        label_tables[None] = label_table
    return FeatureStore(tables, label_tables, label_kind="node" if label_tables else "none")


def _check_same_rows(tables: dict[TableKey, Table]) -> int:
    """The common row count of homogeneous feature tables (``TableError`` if they differ)."""
    row_counts = {t.name: t.num_rows for t in tables.values()}
    if len(set(row_counts.values())) != 1:
        raise TableError(
            f"feature tables have different numbers of rows: {row_counts}; a dict of "
            "features is several features of the same nodes -- if its keys are node "
            "types, pass heterogeneous=True"
        )
    return next(iter(row_counts.values()))


def _make_heterogeneous_store(features: Any, labels: Any) -> FeatureStore:
    if not isinstance(features, Mapping):
        raise TableError(
            "heterogeneous=True: features must be a dict {node type: table}, got "
            f"{type(features).__name__}"
        )
    tables = _table_dict(features, "features")
    label_tables: dict[TableKey, Table] = {}
    if labels is not None:
        if not isinstance(labels, Mapping):
            raise TableError(
                "heterogeneous=True: labels must be None or a dict {node type: table}, got "
                f"{type(labels).__name__}"
            )
        label_tables = _table_dict(labels, "labels")
    for ntype, label_table in label_tables.items():
        table = tables.get(ntype)
        if table is not None and table.num_rows != label_table.num_rows:
            raise TableError(
                f"labels[{ntype!r}] has {label_table.num_rows} rows but "
                f"features[{ntype!r}] has {table.num_rows}; both index the same nodes"
            )
    return FeatureStore(
        tables, label_tables, heterogeneous=True, label_kind="node" if label_tables else "none"
    )
