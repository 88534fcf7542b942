"""Arrow columns to the Python and numpy values a ParquetSource hands out.

Decoded row groups are converted column-wise (no per-cell pyarrow scalars) into
:class:`Column` objects that gather rows cheaply; numpy is read straight from Arrow's
buffers, because ``Array.to_numpy`` imports pandas (about 0.3 s per DataLoader worker).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

# Rough cost of one Python object held in a cached row group (object header + pointer),
# added to the Arrow buffer size when charging the cache.
_PY_OBJECT_BYTES = 48


class Column:
    """One decoded column of a row group, converted once, ready to gather rows from.

    ``plain`` columns hold a Python list of final, immutable values (numbers, str,
    bytes, None, numpy datetime64 scalars...), gathered by plain list indexing, which
    keeps a global shuffle (about one row per row group per batch) cheap. Other
    columns build a fresh value per record: ``"copy"`` (numpy arrays, copied so that
    callers may write to them), ``"lists"`` (Python lists, shallow-copied), ``"struct"`` (dicts from converted children) and
    ``"arrow"`` (anything else, through ``to_pylist``).
    """

    __slots__ = ("kind", "nbytes", "plain", "values")

    def __init__(self, kind: str, values: Any, nbytes: int) -> None:
        self.kind = kind
        self.plain = kind == "plain"
        self.values = values
        self.nbytes = int(nbytes)

    def get(self, r: int) -> Any:
        return self.take([r])[0]

    def take(self, rows: list[int]) -> list[Any]:
        values = self.values
        kind = self.kind
        if kind == "plain":
            return [values[r] for r in rows]
        if kind == "copy":
            return [_copy_value(values[r]) for r in rows]
        if kind == "lists":  # lists of immutable values: a shallow copy is private
            return [None if values[r] is None else list(values[r]) for r in rows]
        if kind == "struct":
            names, children, valid = values
            if not names:
                out: list[Any] = [{} for _ in rows]
            else:
                cols = [c.take(rows) for c in children]
                out = [dict(zip(names, vals)) for vals in zip(*cols)]
            if valid is not None:
                out = [rec if valid[r] else None for rec, r in zip(out, rows)]
            return out
        return values.take(int64_array(rows)).to_pylist()


class RowGroup:
    """A cached row group in Arrow's compact form, for both batch formats.

    ``table`` is the decoded row group, in this process's memory or memory-mapped from
    the node's decoded disk cache (``mapped``: its buffers cost no private memory). It is
    prepared lazily for each batch format: ``rows`` (a
    :class:`~torchgrain.sources.parquet.rows.RowViews`, for records; or ``templates``, a
    :class:`~torchgrain.sources.parquet.rows.RowTemplates`, when the source's converted
    records fit its cache) and ``views`` (a
    :class:`~torchgrain.sources.parquet.columns.GroupViews`, for columns). ``nbytes`` is
    what the cache is charged: the table's size (a mapped table: ``mapped_bytes``) plus
    what its preparations added.
    """

    __slots__ = (
        "mapped",
        "nbytes",
        "path",
        "pin",
        "rows",
        "table",
        "templates",
        "touched",
        "views",
    )

    def __init__(
        self, table: pa.Table, *, mapped_bytes: int | None = None, path: str | None = None
    ) -> None:
        self.table: pa.Table | None = table
        self.views: Any = None
        self.rows: Any = None
        self.templates: Any = None  # converted records (rows.RowTemplates), when they fit
        self.mapped = mapped_bytes is not None
        self.nbytes = int(table.nbytes if mapped_bytes is None else mapped_bytes)
        self.path = path  # the decoded-cache file a mapped table lives in
        self.pin: Any = None  # and that file's torchgrain.io.changes.Pin
        self.touched = 0.0  # when this process last refreshed that file's LRU time

    def drop_table(self) -> None:
        """Let the decoded table go (its records were converted) and stop charging it."""
        self.table = None
        self.rows = None
        self.pin = None  # (nothing of the map is read any more)
        self.nbytes = 0

    def charge(self) -> int:
        """What the cache is charged for this entry and its preparations."""
        extra = 0
        if self.views is not None:
            extra += self.views.nbytes
        if self.rows is not None:
            extra += self.rows.nbytes
        if self.templates is not None:
            extra += self.templates.nbytes
        return self.nbytes + extra


def int64_array(values: Any) -> pa.Array:
    """An Arrow int64 array of ``values`` over a numpy buffer.

    ``pa.array`` would import pandas (about 0.3 s, again in every DataLoader worker
    whose parent never imported it) just to ask whether its input is a pandas object.
    """
    buf = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(buf), [None, pa.py_buffer(buf)])


# Arrow buffers are read straight into numpy here: ``Array.to_numpy`` imports pandas on
# first use (~0.3 s), which every DataLoader worker would pay again at each epoch.
def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """Arrow's little-endian bitmap as a bool array of ``n`` values from bit ``offset``."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little", count=offset + n)[offset:].view(np.bool_)


def _null_mask(arr: pa.Array) -> np.ndarray | None:
    if arr.null_count == 0:
        return None
    if pa.types.is_null(arr.type):
        return np.ones(len(arr), dtype=bool)
    return ~_bits(arr.buffers()[0], arr.offset, len(arr))


def _numpy_dtype(t: pa.DataType) -> tuple[np.dtype, np.dtype | None]:
    """(storage dtype, dtype to view/cast as) of a fixed-width number or temporal type."""
    if pa.types.is_integer(t):
        kind = "i" if pa.types.is_signed_integer(t) else "u"
        return np.dtype(f"<{kind}{t.bit_width // 8}"), None
    if pa.types.is_floating(t):
        return np.dtype(f"<f{t.bit_width // 8}"), None
    if pa.types.is_timestamp(t):
        return np.dtype("<i8"), np.dtype(f"datetime64[{t.unit}]")
    if pa.types.is_duration(t):
        return np.dtype("<i8"), np.dtype(f"timedelta64[{t.unit}]")
    if pa.types.is_date32(t):
        return np.dtype("<i4"), np.dtype("datetime64[D]")
    if pa.types.is_date64(t):
        return np.dtype("<i8"), np.dtype("datetime64[ms]")
    raise TypeError(f"no numpy dtype for {t}")


def _primitive_numpy(arr: pa.Array) -> np.ndarray:
    """Values of a bool/number/temporal array (whatever sits in null slots)."""
    n = len(arr)
    buf = arr.buffers()[1]
    boolean = pa.types.is_boolean(arr.type)
    if buf is None:  # no data buffer (e.g. all null): the values are never looked at
        storage = np.dtype(bool) if boolean else _numpy_dtype(arr.type)[0]
        buf = np.zeros((arr.offset + n) * storage.itemsize, dtype=np.uint8)
    if boolean:
        return _bits(buf, arr.offset, n)
    storage, view = _numpy_dtype(arr.type)
    values = np.frombuffer(buf, dtype=storage, count=arr.offset + n)[arr.offset :]
    if view is None:
        return values
    if view.itemsize == storage.itemsize:
        return values.view(view)
    return values.astype(view)


def _with_nulls(values: list[Any], mask: np.ndarray | None) -> list[Any]:
    if mask is not None:
        for i in np.flatnonzero(mask).tolist():
            values[i] = None
    return values


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


# Values that ``to_pylist`` turns into immutable Python objects in a fast C loop.
_PYLIST_TYPES = (
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_binary,
    pa.types.is_large_binary,
    pa.types.is_fixed_size_binary,
    pa.types.is_decimal,
    pa.types.is_time,
)


def convert_column(col: pa.ChunkedArray | pa.Array) -> Column:
    """Convert a column column-wise (no per-cell pyarrow scalars) for gathering."""
    if isinstance(col, pa.ChunkedArray):  # combine_chunks copies even a single chunk
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    n = len(arr)
    # Python lists cost a pointer per value plus the value object (small for numbers).
    overhead = n * _PY_OBJECT_BYTES
    if pa.types.is_null(t):
        return Column("plain", [None] * n, n * 8)
    if _is_number(t):
        mask = _null_mask(arr)
        values = _primitive_numpy(arr).tolist()
        return Column("plain", _with_nulls(values, mask), arr.nbytes + overhead)
    if _is_temporal(t):
        # numpy scalars keep the unit (nanoseconds included); Python datetime cannot.
        mask = _null_mask(arr)
        values = list(_primitive_numpy(arr))
        return Column("plain", _with_nulls(values, mask), arr.nbytes + overhead)
    if any(is_type(t) for is_type in _PYLIST_TYPES):
        return Column("plain", arr.to_pylist(), arr.nbytes + overhead)
    if _is_list(t):
        converted = _lists_to_numpy(arr)
        if converted is not None:
            return converted
    elif pa.types.is_map(t):
        converted = _maps_to_python(arr)
        if converted is not None:
            return converted
    elif pa.types.is_struct(t):
        children = [convert_column(c) for c in arr.flatten()]
        names = [f.name for f in t]
        mask = _null_mask(arr)
        valid = None if mask is None else (~mask).tolist()
        nbytes = sum(c.nbytes for c in children) + overhead
        return Column("struct", (names, children, valid), nbytes)
    return Column("arrow", arr, arr.nbytes + overhead)


def _list_offsets(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """``(offsets, child)``: row i's items are ``child[offsets[i]:offsets[i + 1]]``."""
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
        return offsets, arr.values
    dtype = np.int64 if pa.types.is_large_list(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=dtype, count=arr.offset + len(arr) + 1)
    return offsets[arr.offset :].astype(np.int64), arr.values


def _leaf_numpy(arr: pa.Array) -> np.ndarray | None:
    """A numeric/bool/temporal child as numpy (null slots undefined), else None."""
    t = arr.type
    if not (_is_number(t) or _is_temporal(t)):
        return None
    values = _primitive_numpy(arr)
    values.setflags(write=False)
    return values


def _rows_with_null_items(child: pa.Array, outer: np.ndarray, n: int) -> np.ndarray | None:
    """Which of the ``n`` rows (items ``child[outer[i]:outer[i + 1]]``) hold a null item;
    None when none does."""
    child_mask = _null_mask(child)
    if child_mask is None:
        return None
    pos = np.flatnonzero(child_mask)
    pos = pos[(pos >= outer[0]) & (pos < outer[-1])]
    if len(pos) == 0:  # the null items lie outside this (sliced) array's rows
        return None
    owner = np.searchsorted(outer, pos, side="right") - 1
    flags = np.zeros(n, dtype=bool)
    flags[owner] = True
    return flags


def _lists_to_numpy(arr: pa.Array) -> Column | None:
    """List columns of numbers as per-row numpy arrays (2-D where rectangular).

    Rows are read-only views of one buffer here; ``take`` copies them, so callers get
    writable arrays that do not alias the cache. Lists whose items are not numbers are
    Python lists (None when the caller should use ``to_pylist``). Which form a row gets
    depends on that row alone: a row holding a null item (or a null inner list) is a
    Python list, whatever the rows read with it hold.
    """
    n = len(arr)
    mask = _null_mask(arr)
    outer, child = _list_offsets(arr)
    bounds = outer.tolist()
    leaf = None
    if not _is_list(child.type):
        leaf = _leaf_numpy(child)
        if leaf is None:
            return _lists_to_python(arr, mask, bounds, child)
        if pa.types.is_fixed_size_list(arr.type):
            k = arr.type.list_size
            rows: list[Any] = list(leaf[bounds[0] : bounds[0] + n * k].reshape(n, k))
        else:
            rows = [leaf[bounds[i] : bounds[i + 1]] for i in range(n)]
        holed = _rows_with_null_items(child, outer, n)
        if holed is not None:
            if mask is not None:
                holed &= ~mask
            items = convert_column(child).values  # plain: numbers / temporal, with None
            for i in np.flatnonzero(holed).tolist():
                rows[i] = items[bounds[i] : bounds[i + 1]]
    else:
        inner, grandchild = _list_offsets(child)
        leaf = _leaf_numpy(grandchild)
        if leaf is None:
            return None
        holed = _rows_with_null_items(child, outer, n)
        deep = _rows_with_null_items(grandchild, inner[outer], n) if grandchild.null_count else None
        if holed is None:
            holed = deep
        elif deep is not None:
            holed |= deep
        if holed is not None and mask is not None:
            holed &= ~mask
        if (
            holed is None
            and pa.types.is_fixed_size_list(arr.type)
            and pa.types.is_fixed_size_list(child.type)
        ):
            a, b = arr.type.list_size, child.type.list_size
            start = int(inner[bounds[0]])
            rows = list(leaf[start : start + n * a * b].reshape(n, a, b))
        else:
            lengths = np.diff(inner)
            rows = []
            for i in range(n):
                lo, hi = bounds[i], bounds[i + 1]
                lens = lengths[lo:hi]
                if holed is not None and holed[i]:
                    rows.append(arr.slice(i, 1).to_pylist()[0])  # as to_pylist
                elif hi == lo:
                    rows.append(leaf[0:0].reshape(0, 0))
                elif (lens == lens[0]).all():
                    part = leaf[int(inner[lo]) : int(inner[hi])]
                    rows.append(part.reshape(hi - lo, int(lens[0])))
                else:
                    rows.append([leaf[int(inner[j]) : int(inner[j + 1])] for j in range(lo, hi)])
    return Column("copy", _with_nulls(rows, mask), leaf.nbytes + n * 2 * _PY_OBJECT_BYTES)


def _lists_to_python(
    arr: pa.Array, mask: np.ndarray | None, bounds: list[int], child: pa.Array
) -> Column | None:
    """Lists of strings or bytes as Python lists."""
    values = convert_column(child)
    if not values.plain:
        return None
    items = values.values
    n = len(arr)
    rows: list[Any] = [items[bounds[i] : bounds[i + 1]] for i in range(n)]
    return Column("lists", _with_nulls(rows, mask), values.nbytes + n * _PY_OBJECT_BYTES)


def _maps_to_python(arr: pa.MapArray) -> Column | None:
    """Map columns as lists of ``(key, value)`` tuples, like ``to_pylist``."""
    n = len(arr)
    mask = _null_mask(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=arr.offset + n + 1)
    bounds = offsets[arr.offset :].tolist()
    key_arr, item_arr = arr.values.flatten()
    keys, items = convert_column(key_arr), convert_column(item_arr)
    if not (keys.plain and items.plain):
        return None
    pairs = list(zip(keys.values, items.values))
    rows: list[Any] = [pairs[bounds[i] : bounds[i + 1]] for i in range(n)]
    nbytes = keys.nbytes + items.nbytes + (len(pairs) + n) * _PY_OBJECT_BYTES
    return Column("lists", _with_nulls(rows, mask), nbytes)


def _copy_value(v: Any) -> Any:
    """A private copy of a list column's value: arrays copied; a list of arrays (a ragged
    list of lists) copied item by item; a Python list (a row with null items) shallow-
    copied, or deep-copied when nested (``to_pylist`` rows of a list of lists)."""
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        return v.copy()
    if any(isinstance(a, np.ndarray) for a in v):
        return [a.copy() for a in v]
    return [list(a) if isinstance(a, list) else a for a in v]
