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
