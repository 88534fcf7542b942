"""Arrow columns to batch columns (``batch_format="columns"``): one conversion per column.

:meth:`ParquetSource.read_columns` gathers a batch's rows with one Arrow ``take`` over
the row groups it touches and converts each column here, without a Python object per
row where the type allows:

* numbers and bools without nulls: a numpy array ``[B]`` of the Arrow type's dtype;
* binary and string without nulls: a :class:`~torchgrain.columns.Ragged` over a copy of
  Arrow's value buffer and offsets;
* fixed-size lists (nested too) and lists of numbers whose rows all have one length: a
  numpy array ``[B, k]`` (``[B, a, b]`` for lists of lists); lists of numbers of
  different lengths: a ``Ragged`` of kind ``"array"``;
* anything else (nulls, temporal types, structs, maps...): the values a per-record read
  gives, put in column form by :func:`~torchgrain.columns.column_of`.

Arrays come from :func:`torchgrain.columns.empty`, so in a DataLoader worker they are
allocated in shared memory and cross to the main process without a copy.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pyarrow as pa

from torchgrain.columns import Ragged, column_of, empty
from torchgrain.sources.parquet.values import (
    _is_list,
    _is_number,
    _list_offsets,
    _primitive_numpy,
    convert_column,
)

__all__ = ["arrow_column"]

_BINARY = (pa.types.is_binary, pa.types.is_large_binary)
_STRING = (pa.types.is_string, pa.types.is_large_string)


def arrow_column(col: pa.ChunkedArray | pa.Array) -> Any:
    """The batch-column form of an Arrow column (see the module docstring).

    Example:
        >>> import pyarrow as pa
        >>> arrow_column(pa.array([1, 2], pa.int32())).tolist()
        [1, 2]
        >>> arrow_column(pa.array([b"ab", b"c"]))[1]
        b'c'
        >>> arrow_column(pa.array([[1.0, 2.0], [3.0, 4.0]])).shape
        (2, 2)
    """
    if isinstance(col, pa.ChunkedArray):
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    out = _fast(arr) if arr.null_count == 0 else None
    if out is not None:
        return out
    # The per-record values, in column form: the same values a records batch holds.
    return column_of(convert_column(arr).take(list(range(len(arr)))))


def _fast(arr: pa.Array) -> Any:
    t = arr.type
    if _is_number(t):
        return _copy(_primitive_numpy(arr))
    if any(f(t) for f in _BINARY) or any(f(t) for f in _STRING):
        return _ragged_binary(arr, "str" if any(f(t) for f in _STRING) else "bytes")
    if pa.types.is_fixed_size_binary(t):
        return None
    if _is_list(t):
        return _lists(arr)
    return None


def _copy(values: np.ndarray) -> np.ndarray:
    out = empty(values.shape, values.dtype)
    out[...] = values
    return out


def _ragged_binary(arr: pa.Array, kind: str) -> Ragged:
    n = len(arr)
    dtype = (
        np.int64
        if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
        else np.int32
    )
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=dtype, count=arr.offset + n + 1)[arr.offset :]
    lo, hi = int(offsets[0]), int(offsets[-1])
    out_offsets = empty((n + 1,), np.int64)
    np.subtract(offsets, lo, out=out_offsets, casting="unsafe")
    values = empty((hi - lo,), np.uint8)
    if hi > lo:
        values[:] = np.frombuffer(data_buf, dtype=np.uint8, count=hi - lo, offset=lo)
    return Ragged(values, out_offsets, kind)


def _leaf(arr: pa.Array) -> np.ndarray | None:
    if arr.null_count or not _is_number(arr.type):
        return None
    return _primitive_numpy(arr)


def _lists(arr: pa.Array) -> Any:
    n = len(arr)
    outer, child = _list_offsets(arr)
    if not _is_list(child.type):
        leaf = _leaf(child)
        if leaf is None:
            return None
        lengths = np.diff(outer)
        values = leaf[int(outer[0]) : int(outer[-1])]
        if n and (lengths == lengths[0]).all():
            return _copy(values.reshape(n, int(lengths[0])))
        offsets = empty((n + 1,), np.int64)
        np.subtract(outer, outer[0], out=offsets)
        return Ragged(_copy(values), offsets, "array")
    if child.null_count:
        return None
    inner, grandchild = _list_offsets(child)
    if _is_list(grandchild.type):
        return None
    leaf = _leaf(grandchild)
    if leaf is None:
        return None
    rows = np.diff(outer)
    if not n or not (rows == rows[0]).all():
        return None
    inner = inner[int(outer[0]) : int(outer[-1]) + 1]
    cols = np.diff(inner)
    if len(cols) and not (cols == cols[0]).all():
        return None
    a = int(rows[0])
    b = int(cols[0]) if len(cols) else 0
    values = leaf[int(inner[0]) : int(inner[-1])]
    return _copy(values.reshape(n, a, b))


# ------------------------------------------------------------------ gathering a batch
# ------------------------------------------------------------------ gathering a batch
# A cached row group is prepared once for columnar reads (:class:`GroupViews`): its
# fixed-width columns, and the (start, length) of every row of its variable-length
# columns, packed row by row into one byte matrix. A batch then gathers every packed
# column with one fancy index per row group it touches, plus one to put the rows in
# request order; variable-length values take one more fancy index per group.
class GatherPlan:
    """Where a batch's rows come from. The *staged* order lists the batch's rows of its
    first row group, then of the second...: ``rows[k]`` are group ``k``'s rows,
    ``bounds[k]`` is where they start in the staged order, and ``where[i]`` is batch
    row ``i``'s place in it.

    Example:
        >>> p = GatherPlan(np.array([1, 0, 1]), np.array([5, 7, 6]))
        >>> [r.tolist() for r in p.rows], p.bounds, p.where.tolist()
        ([[7], [5, 6]], [0, 1, 3], [1, 0, 2])
    """

    __slots__ = ("bounds", "first", "groups", "n", "rows", "where")

    def __init__(self, groups: np.ndarray, rows: np.ndarray) -> None:
        n = len(groups)
        order = np.argsort(groups, kind="stable")
        ordered = groups[order]
        cuts = (np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()
        bounds = [0, *cuts, n]
        self.n = n
        self.groups = ordered[bounds[:-1]]  # the distinct row groups, ascending
        self.first = order[bounds[:-1]]  # a batch position of each (for error messages)
        staged_rows = rows[order]
        self.rows = [staged_rows[a:b] for a, b in itertools.pairwise(bounds)]
        self.bounds = bounds
        self.where = np.empty(n, np.int64)
        self.where[order] = np.arange(n)


class GroupViews:
    """A cached row group prepared for columnar reads.

    ``layout`` lists the packed columns as ``(column, kind, byte offset, dtype, row
    shape, ragged kind)``: ``"dense"`` columns (numbers, bools, fixed-size lists of
    numbers) hold their values, ``"ragged"`` ones (binary, string, lists of numbers)
    their rows' start and length (two int64) while ``values[column]`` holds the flat
    values. Columns missing from ``layout`` need Arrow (nulls, dictionaries, temporal
    or nested types). ``nbytes`` is the memory the packing adds.
    """

    __slots__ = ("layout", "nbytes", "packed", "record", "values")

    def __init__(self, table: pa.Table) -> None:
        rows = table.num_rows
        parts: list[np.ndarray] = []
        layout = []
        self.values: dict[int, memoryview] = {}  # a ragged column's values, as bytes
        at = 0
        for pos, col in enumerate(table.columns):
            view = _view(col)
            if view is None:
                continue
            kind, data, offsets, ragged_kind = view
            if kind == "dense":
                part = np.ascontiguousarray(data).reshape(rows, -1).view(np.uint8)
                shape = data.shape[1:]
            else:
                bounds = np.asarray(offsets, np.int64)
                part = np.empty((rows, 2), np.int64)
                part[:, 0] = bounds[:-1]
                part[:, 1] = bounds[1:] - bounds[:-1]
                part = part.view(np.uint8)
                shape = ()
                self.values[pos] = memoryview(np.ascontiguousarray(data).view(np.uint8))
            layout.append((pos, kind, at, data.dtype, shape, ragged_kind))
            parts.append(part)
            at += part.shape[1]
        self.layout = tuple(layout)
        self.packed = np.concatenate(parts, axis=1) if parts else np.empty((rows, 0), np.uint8)
        self.nbytes = self.packed.nbytes
        # One packed row as a record: field ``c<column>`` per column.
        self.record = np.dtype(
            {
                "names": [f"c{pos}" for pos, *_ in layout],
                "formats": [
                    (dtype, shape) if kind == "dense" else (np.int64, (2,))
                    for _, kind, _, dtype, shape, _ in layout
                ],
                "offsets": [at for _, _, at, *_ in layout],
                "itemsize": max(at, 1),
            }
        )


def _view(col: pa.ChunkedArray) -> tuple[str, np.ndarray, Any, str] | None:
    """``(kind, data, offsets, ragged kind)`` of a column that gathers without Arrow."""
    if col.num_chunks != 1:
        return None
    arr = col.chunk(0)
    if arr.null_count:
        return None
    t = arr.type
    if _is_number(t):
        return "dense", _primitive_numpy(arr), None, ""
    if pa.types.is_fixed_size_list(t) and _is_number(t.value_type) and arr.values.null_count == 0:
        k = t.list_size
        values = _primitive_numpy(arr.values)[arr.offset * k : (arr.offset + len(arr)) * k]
        return "dense", values.reshape(len(arr), k), None, ""
    string = any(f(t) for f in _STRING)
    if string or any(f(t) for f in _BINARY):
        large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(
            offsets_buf, np.int64 if large else np.int32, count=arr.offset + len(arr) + 1
        )[arr.offset :]
        data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        return "ragged", data, offsets, "str" if string else "bytes"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_number(t.value_type):
        if arr.values.null_count:
            return None
        offsets, child = _list_offsets(arr)
        return "ragged", _primitive_numpy(child), offsets, "array"
    return None


def gather(groups: list[GroupViews], plan: GatherPlan) -> dict[int, Any]:
    """The batch's packed columns by column position (numpy arrays and
    :class:`~torchgrain.columns.Ragged`); empty when the row groups' layouts differ
    (the caller then reads every column through Arrow)."""
    first = groups[0]
    if not first.layout or not all(g.layout == first.layout for g in groups):
        return {}
    n = plan.n
    if len(groups) == 1:
        staged = first.packed.take(plan.rows[0], axis=0)
        rows = staged
    else:
        staged = np.empty((n, first.packed.shape[1]), np.uint8)
        b = plan.bounds
        for k, g in enumerate(groups):
            g.packed.take(plan.rows[k], axis=0, out=staged[b[k] : b[k + 1]])
        rows = staged.take(plan.where, axis=0)
    # Each packed column as a typed (strided) view, copied once into its own array.
    record = first.record
    typed = rows.view(record).reshape(n)
    out: dict[int, Any] = {}
    for pos, kind, _, dtype, shape, ragged_kind in first.layout:
        field = f"c{pos}"
        if kind == "dense":
            col = empty((n, *shape), dtype)
            col[...] = typed[field]
            out[pos] = col
        else:
            pairs = typed[field] if len(groups) == 1 else staged.view(record).reshape(n)[field]
            data = [g.values[pos] for g in groups]
            out[pos] = _gather_values(data, pairs, plan, dtype, ragged_kind)
    return out


def _gather_values(
    data: list[memoryview], pairs: np.ndarray, plan: GatherPlan, dtype: np.dtype, kind: str
) -> Ragged:
    """The values of a variable-length column; ``pairs`` holds each row's (start,
    length, in items of ``dtype``) in its group's ``data`` (bytes), in staged order."""
    n = plan.n
    item = dtype.itemsize
    starts = (pairs[:, 0] * item).tolist()
    ends = ((pairs[:, 0] + pairs[:, 1]) * item).tolist()
    if len(data) == 1:
        view = data[0]
        parts = [view[a:e] for a, e in zip(starts, ends)]
        lengths = pairs[:, 1]
    else:
        b = plan.bounds
        staged = []
        for k, view in enumerate(data):
            lo, hi = b[k], b[k + 1]
            staged += [view[a:e] for a, e in zip(starts[lo:hi], ends[lo:hi])]
        parts = [staged[j] for j in plan.where.tolist()]
        lengths = pairs[:, 1][plan.where]
    offsets = empty((n + 1,), np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    values = empty((int(offsets[-1]),), dtype)
    if len(values):
        values.view(np.uint8)[:] = np.frombuffer(b"".join(parts), np.uint8)
    return Ragged(values, offsets, kind)
