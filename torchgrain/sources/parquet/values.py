"""Arrow columns to the Python and numpy values a ParquetSource hands out, for records
and for columns.

A cached :class:`RowGroup` keeps its decoded table in Arrow's compact form and is
prepared once per batch format, from one view of each column (``_column``: its kind and
numpy views of its buffers): :class:`RowViews` (records built per batch by
:func:`build_records`: a value costs one index into a memoryview or numpy view, whichever
row group it sits in), :class:`RowTemplates` (records converted whole while they fit the
cache, copied by :func:`copy_records`) or :class:`GroupViews` (columns, by :func:`gather`
and :func:`arrow_column`). Other types (decimals, times, structs, maps, nested lists,
lists holding nulls...) go through :func:`convert_column`. Numpy is read straight from
Arrow's buffers: ``Array.to_numpy`` imports pandas (about 0.3 s per DataLoader worker).
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from torchgrain.columns import Ragged, column_of, empty
from torchgrain.sources.parquet.schema import is_list_type, numpy_dtype

__all__ = [
    "Column",
    "GatherPlan",
    "GroupViews",
    "RowGroup",
    "RowTemplates",
    "RowViews",
    "arrow_column",
    "build_records",
    "convert_column",
    "converted_bytes",
    "copy_records",
    "gather",
    "holds_time_ns",
    "inexact_time",
    "int64_array",
    "take_rows",
    "views_bytes",
]

# Rough cost of one Python object held in a cached row group (object header + pointer),
# added to the Arrow buffer size when charging the cache.
_PY_OBJECT_BYTES = 48


class RowGroup:
    """A cached row group in Arrow's compact form, for both batch formats.

    ``table`` is the decoded row group, in this process's memory or memory-mapped from
    the node's decoded disk cache (``mapped``: its charge, the file it lives in (``path``)
    and that file's ``pin``; its buffers cost no private memory). It is
    prepared lazily for each batch format: ``rows`` (:class:`RowViews`), ``templates``
    (:class:`RowTemplates`, when the source's converted records fit its cache) and
    ``views`` (:class:`GroupViews`). ``nbytes`` is what the cache is charged: the table's
    size (a mapped table: its charge) plus what its preparations added.
    """

    __slots__ = ("nbytes", "path", "pin", "rows", "table", "templates", "touched", "views")

    def __init__(self, table: pa.Table, mapped: tuple[int, str, Any] | None = None) -> None:
        self.table: pa.Table | None = table
        self.views: Any = None
        self.rows = self.templates = None
        # A mapped table's charge, the decoded-cache file it lives in and that file's
        # torchgrain.io.changes.Pin; when this process last refreshed the file's LRU time.
        self.nbytes, self.path, self.pin = mapped or (int(table.nbytes), None, None)
        self.touched = time.monotonic()

    def drop_table(self) -> None:
        """Let the decoded table go (its records were converted) and stop charging it."""
        self.table = None
        self.rows = None
        self.pin = None  # (nothing of the map is read any more)
        self.nbytes = 0

    def charge(self) -> int:
        """What the cache is charged for this entry and its preparations."""
        prepared = (self.views, self.rows, self.templates)
        return self.nbytes + sum(p.nbytes for p in prepared if p is not None)


def int64_array(values: Any) -> pa.Array:
    """An Arrow int64 array of ``values`` over a numpy buffer.

    ``pa.array`` would import pandas (about 0.3 s, again in every DataLoader worker
    whose parent never imported it) just to ask whether its input is a pandas object.
    """
    buf = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(buf), [None, pa.py_buffer(buf)])


# ------------------------------------------------------------- Arrow buffers as numpy
def _array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A column as one array, dictionaries decoded (``combine_chunks`` copies even a
    single chunk)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col.dictionary_decode() if pa.types.is_dictionary(col.type) else col


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


def _primitive_numpy(arr: pa.Array) -> np.ndarray:
    """Values of a bool/number/temporal array (whatever sits in null slots)."""
    n = len(arr)
    buf = arr.buffers()[1]
    boolean = pa.types.is_boolean(arr.type)
    if buf is None:  # no data buffer (e.g. all null): the values are never looked at
        buf = bytes((arr.offset + n) * (1 if boolean else numpy_dtype(arr.type)[0].itemsize))
    if boolean:
        return _bits(buf, arr.offset, n)
    storage, view = numpy_dtype(arr.type)
    values = np.frombuffer(buf, dtype=storage, count=arr.offset + n)[arr.offset :]
    if view is None:
        return values
    return values.view(view) if view.itemsize == storage.itemsize else values.astype(view)


def _offsets(arr: pa.Array) -> np.ndarray:
    """The ``len(arr) + 1`` offsets of a list, map, binary or string array, as stored."""
    t = arr.type
    large = pa.types.is_large_list(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    dtype = np.int64 if large else np.int32
    buf = arr.buffers()[1]
    if buf is None:
        return np.zeros(len(arr) + 1, dtype)
    return np.frombuffer(buf, dtype=dtype, count=arr.offset + len(arr) + 1)[arr.offset :]


def _list_offsets(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """``(offsets, child)``: row i's items are ``child[offsets[i]:offsets[i + 1]]``."""
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
        return offsets, arr.values
    return _offsets(arr).astype(np.int64), arr.values


def _with_nulls(values: list[Any], mask: np.ndarray | None) -> list[Any]:
    if mask is not None:
        for i in np.flatnonzero(mask).tolist():
            values[i] = None
    return values


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t)


def _leaf_numpy(arr: pa.Array) -> np.ndarray | None:
    """A numeric/bool/temporal child as read-only numpy (null slots undefined), else None."""
    if not (_is_number(arr.type) or _is_temporal(arr.type)):
        return None
    values = _primitive_numpy(arr)
    values.setflags(write=False)
    return values


def _rows_with_null_items(
    child: pa.Array, outer: np.ndarray, n: int, mask: np.ndarray | None
) -> np.ndarray | None:
    """Which of the ``n`` rows (items ``child[outer[i]:outer[i + 1]]``) hold a null item
    and are not null themselves (``mask``); None when none does."""
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
    if mask is not None:
        flags &= ~mask
    return flags if flags.any() else None


# ------------------------------------------------------------- times of day
# ``datetime.time`` holds microseconds: a time64[ns] value with nanoseconds beyond them
# would read as another time (pyarrow's ``to_pylist`` drops them silently). The decode
# refuses such a value (:func:`inexact_time`, per column of a type that holds time64[ns]
# anywhere: :func:`holds_time_ns`); other columns cost nothing.
def holds_time_ns(t: pa.DataType) -> bool:
    """Whether values of type ``t`` hold a time64[ns] at any depth (list items, struct
    fields, map keys and values, dictionary values).

    Example:
        >>> holds_time_ns(pa.list_(pa.struct({"t": pa.time64("ns")}))), holds_time_ns(pa.time64("us"))
        (True, False)
    """
    if t.num_fields == 0 and t.id != _DICTIONARY_ID:  # (no hash: it formats the name)
        return t.id == _TIME64_ID and t.unit == "ns"
    return _nested_holds_time_ns(t)


_TIME64_ID, _DICTIONARY_ID = pa.time64("ns").id, pa.dictionary(pa.int32(), pa.string()).id


@functools.lru_cache(maxsize=256)
def _nested_holds_time_ns(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return holds_time_ns(t.value_type)
    if pa.types.is_map(t):
        return holds_time_ns(t.key_type) or holds_time_ns(t.item_type)
    if is_list_type(t):
        return holds_time_ns(t.value_type)
    if pa.types.is_struct(t):
        return any(holds_time_ns(f.type) for f in t)
    return False


def inexact_time(col: pa.ChunkedArray | pa.Array) -> tuple[int, int] | None:
    """``(row, nanoseconds)`` of the first row of ``col`` holding a time64[ns] value
    (at any depth) that is not a whole number of microseconds, which ``datetime.time``
    cannot hold; None if every one is (one vectorised pass over each time64[ns] leaf).

    Example:
        >>> inexact_time(pa.array([[0], None, [1_000, 2_000_000_001]], pa.list_(pa.time64("ns"))))
        (2, 2000000001)
        >>> inexact_time(pa.array([1_000, None], pa.time64("ns"))) is None
        True
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    start = 0
    for chunk in chunks:
        found = _inexact(chunk)
        if found is not None:
            rows, values = found
            return start + int(rows[0]), int(values[0])
        start += len(chunk)
    return None


def _inexact(arr: pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows of ``arr`` (ascending) holding a time64[ns] value with sub-microsecond
    nanoseconds, and such a value of each; None if none does."""
    t = arr.type
    n = len(arr)
    if n == 0 or not holds_time_ns(t):
        return None
    if pa.types.is_time64(t):
        buf = arr.buffers()[1]
        if buf is None:
            return None
        ns = np.frombuffer(buf, dtype=np.int64, count=arr.offset + n)[arr.offset :]
        bad = ns % 1_000 != 0
        if not bad.any():  # (the common case: one pass, nothing more)
            return None
        mask = _null_mask(arr)
        if mask is not None:
            bad &= ~mask
        rows = np.flatnonzero(bad)
        return (rows, ns[rows]) if len(rows) else None
    if pa.types.is_dictionary(t):
        found = _inexact(arr.dictionary)
        if found is None:
            return None
        indices = _primitive_numpy(arr.indices.cast(pa.int64()))
        mask = _null_mask(arr)
        hit = np.flatnonzero(np.isin(indices, found[0]) & (True if mask is None else ~mask))
        if not len(hit):
            return None
        entry = dict(zip(found[0].tolist(), found[1].tolist()))
        return hit, np.array([entry[i] for i in indices[hit].tolist()], np.int64)
    if pa.types.is_struct(t):
        parts = [p for p in map(_inexact, arr.flatten()) if p is not None]
        if not parts:
            return None
        rows = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
        mask = _null_mask(arr)
        keep = np.ones(len(rows), bool) if mask is None else ~mask[rows]
        rows, values = rows[keep], values[keep]
        order = np.argsort(rows, kind="stable")
        return (rows[order], values[order]) if len(rows) else None
    if is_list_type(t) or pa.types.is_map(t):
        outer, child = _list_offsets(arr)
        found = _inexact(child)
        if found is None:
            return None
        items, values = found
        inside = (items >= outer[0]) & (items < outer[-1])
        items, values = items[inside], values[inside]
        rows = np.searchsorted(outer, items, side="right") - 1
        mask = _null_mask(arr)
        if mask is not None:
            keep = ~mask[rows]
            rows, values = rows[keep], values[keep]
        return (rows, values) if len(rows) else None
    return None


# ------------------------------------------------------------- whole-column conversion
class Column:
    """One decoded column of a row group, converted once, ready to gather rows from.

    ``plain`` columns hold a Python list of final, immutable values (numbers, str,
    bytes, None, numpy datetime64 scalars...), gathered by list indexing, which keeps a
    global shuffle (about one row per row group per batch) cheap. Other kinds build a
    fresh value per record: ``"copy"`` (numpy arrays, copied so that callers may write
    to them), ``"lists"`` (Python lists, shallow-copied), ``"struct"`` (dicts from
    converted children) and ``"arrow"`` (anything else, through ``to_pylist``).

    Example:
        >>> convert_column(pa.array([[1, 2], None])).take([1, 0])
        [None, array([1, 2])]
    """

    __slots__ = ("kind", "nbytes", "values")

    def __init__(self, kind: str, values: Any, nbytes: int) -> None:
        self.kind = kind
        self.values = values
        self.nbytes = int(nbytes)

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
            cols = [c.take(rows) for c in children]
            out = _records(names, cols, len(rows))
            if valid is not None:
                out = [rec if valid[r] else None for rec, r in zip(out, rows)]
            return out
        return values.take(int64_array(rows)).to_pylist()


def convert_column(col: pa.ChunkedArray | pa.Array) -> Column:
    """Convert a column column-wise (no per-cell pyarrow scalars) for gathering."""
    arr = _array(col)
    t = arr.type
    n = len(arr)
    # Python lists cost a pointer per value plus the value object (small for numbers).
    overhead = n * _PY_OBJECT_BYTES
    if pa.types.is_null(t):
        return Column("plain", [None] * n, n * 8)
    if _is_number(t) or _is_temporal(t):
        # Temporal values as numpy scalars, which keep the unit (nanoseconds included);
        # Python datetime cannot.
        raw = _primitive_numpy(arr)
        values = raw.tolist() if _is_number(t) else list(raw)
        return Column("plain", _with_nulls(values, _null_mask(arr)), arr.nbytes + overhead)
    # Values that ``to_pylist`` turns into immutable Python objects in a fast C loop.
    if t.id in _BYTES or any(is_type(t) for is_type in _PYLIST_TYPES):
        return Column("plain", arr.to_pylist(), arr.nbytes + overhead)
    if pa.types.is_struct(t):
        children = [convert_column(c) for c in arr.flatten()]
        names = [f.name for f in t]
        mask = _null_mask(arr)
        valid = None if mask is None else (~mask).tolist()
        nbytes = sum(c.nbytes for c in children) + overhead
        return Column("struct", (names, children, valid), nbytes)
    converted = _lists_to_numpy(arr) if is_list_type(t) or pa.types.is_map(t) else None
    return converted or Column("arrow", arr, arr.nbytes + overhead)  # (None: to_pylist)


def _lists_to_numpy(arr: pa.Array) -> Column | None:
    """List columns of numbers as per-row numpy arrays (2-D where rectangular), and
    maps as lists of ``(key, value)`` tuples.

    Rows are read-only views of one buffer here (lists of lists without nulls whose rows
    have one shape: one ``[n, a, b]`` array); ``take`` copies them. Lists whose items
    are not numbers are Python lists (None when the caller should use ``to_pylist``). A
    row holding a null item (or a null inner list) is a Python list, whatever the rows
    read with it hold. Lists of strings or bytes are Python lists, and maps lists of
    ``(key, value)`` tuples like ``to_pylist``'s (None if an item is not a plain value).
    """
    n = len(arr)
    mask = _null_mask(arr)
    outer, child = _list_offsets(arr)
    bounds = outer.tolist()
    if not is_list_type(child.type):
        leaf = _leaf_numpy(child)
        if leaf is None:  # strings or bytes as Python lists; a map's (key, value) tuples
            children = child.flatten() if pa.types.is_map(arr.type) else [child]
            parts = [convert_column(c) for c in children]
            if any(p.kind != "plain" for p in parts):
                return None
            items = parts[0].values if len(parts) == 1 else list(zip(*(p.values for p in parts)))
            lists = [items[bounds[i] : bounds[i + 1]] for i in range(n)]
            pairs = len(items) if len(parts) > 1 else 0  # a map's tuples
            nbytes = sum(p.nbytes for p in parts) + (pairs + n) * _PY_OBJECT_BYTES
            return Column("lists", _with_nulls(lists, mask), nbytes)
        rows: Any = [leaf[bounds[i] : bounds[i + 1]] for i in range(n)]
        holed = _rows_with_null_items(child, outer, n, mask)
        if holed is not None:
            items = convert_column(child).values  # plain: numbers / temporal, with None
            for i in np.flatnonzero(holed).tolist():
                rows[i] = items[bounds[i] : bounds[i + 1]]
    else:
        inner, grandchild = _list_offsets(child)
        leaf = _leaf_numpy(grandchild)
        if leaf is None:
            return None
        levels = ((child, outer), (grandchild, inner[outer]))  # null lists, null items
        found = [h for c, o in levels if (h := _rows_with_null_items(c, o, n, mask)) is not None]
        holed = np.logical_or.reduce(found) if found else None
        rows = _cube(outer, inner, leaf, child.type) if holed is None else None
        if rows is None:
            rows = []
            for i in range(n):
                if holed is not None and holed[i]:
                    rows.append(arr.slice(i, 1).to_pylist()[0])  # as to_pylist
                elif (one := _cube(outer[i : i + 2], inner, leaf, child.type)) is not None:
                    rows.append(one[0])  # its lists of one length: a matrix
                else:
                    lists = range(bounds[i], bounds[i + 1])
                    rows.append([leaf[int(inner[j]) : int(inner[j + 1])] for j in lists])
    if mask is not None:
        rows = _with_nulls(list(rows), mask)
    return Column("copy", rows, leaf.nbytes + n * 2 * _PY_OBJECT_BYTES)


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


# ------------------------------------------------------------- where a batch's rows are
class GatherPlan:
    """Where a batch's rows come from. The *staged* order lists the batch's rows of its
    first row group, then of the second...: ``rows[k]`` are group ``k``'s rows,
    ``bounds[k]`` is where they start in the staged order, ``order`` lists the batch
    positions in staged order and ``where[i]`` is batch row ``i``'s place in it.

    Example:
        >>> p = GatherPlan(np.array([1, 0, 1]), np.array([5, 7, 6]))
        >>> [r.tolist() for r in p.rows], p.bounds, p.where.tolist()
        ([[7], [5, 6]], [0, 1, 3], [1, 0, 2])
    """

    __slots__ = ("bounds", "first", "groups", "n", "order", "rows", "where")

    def __init__(self, groups: np.ndarray, rows: np.ndarray) -> None:
        n = len(groups)
        order = np.argsort(groups, kind="stable")
        ordered = groups[order]
        cuts = (np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()
        bounds = [0, *cuts, n]
        self.n = n
        self.order = order
        self.groups = ordered[bounds[:-1]]  # the distinct row groups, ascending
        self.first = order[bounds[:-1]]  # a batch position of each (for error messages)
        staged_rows = rows[order]
        self.rows = [staged_rows[a:b] for a, b in itertools.pairwise(bounds)]
        self.bounds = bounds
        self.where = np.empty(n, np.int64)
        self.where[order] = np.arange(n)


# ------------------------------------------------------------- one column, read without Arrow
# Column kinds (ints: compared once per column and batch).
_GENERIC, _NONE, _NUM, _SCALAR, _STR, _BIN, _FIXED_BIN, _ARRAY, _MATRIX = range(9)
# A string or binary type's kind, by type id (hashing a type formats its name).
_BYTES = {pa.string().id: _STR, pa.large_string().id: _STR}
_BYTES |= {pa.binary().id: _BIN, pa.large_binary().id: _BIN}
# Other types whose values to_pylist makes immutable (convert_column).
_PYLIST_TYPES = (pa.types.is_fixed_size_binary, pa.types.is_decimal, pa.types.is_time)
# A variable-length kind's Ragged kind, in a batch of columns.
_RAGGED = {_STR: "str", _BIN: "bytes", _ARRAY: "array"}
# Each distinct layout (kind and nulls of every column) gets a number: a batch compares
# its row groups' numbers, not their layouts.
_SIGNATURES: dict[tuple[tuple[int, bool], ...], int] = {}
# Bookkeeping of one prepared row group (views, tuples, lists), charged to the cache.
_VIEWS_OVERHEAD = 2048
_COLUMN_OVERHEAD = 512


class _Column:
    """One column of one row group as numpy views of its Arrow buffers: ``kind`` says
    how to read them. Both batch formats read it (:class:`RowViews`, :class:`GroupViews`).

    ``values``: the numbers, bools or temporal values (``_NUM``, ``_SCALAR``); the rows
    ``[n, k]`` of a fixed-size list (``_MATRIX``); the bytes of fixed-size binary, ``width``
    a row (``_FIXED_BIN``); or the flat values that row ``r`` of a string, binary or list
    column slices at ``offsets[r]:offsets[r + 1]``. ``nulls`` is a ``bytes`` with 1 for
    each null row, or None; ``private`` the bytes this view allocated (bools, null masks,
    casts). ``_GENERIC`` columns (nested types, lists holding nulls...) need ``arrow``.
    """

    __slots__ = ("arrow", "kind", "nulls", "offsets", "private", "values", "width")

    def __init__(self, arr: pa.Array) -> None:
        self.arrow = arr
        self.kind = _GENERIC
        self.values: Any = None
        self.offsets: Any = None
        self.nulls: bytes | None = None
        self.width = self.private = 0


def _column(arr: pa.Array) -> _Column:
    """The view of one column (no copy but bools, null masks and casts)."""
    t = arr.type
    n = len(arr)
    off = arr.offset
    col = _Column(arr)
    if pa.types.is_null(t):
        col.kind = _NONE
        return col
    if _is_number(t) or _is_temporal(t):
        col.kind = _NUM if _is_number(t) else _SCALAR
        col.values = fresh = _primitive_numpy(arr)
    elif (kind := _BYTES.get(t.id)) is not None:
        data = np.frombuffer(arr.buffers()[2] or b"", np.uint8)  # (offsets index into it)
        col.kind, col.values, col.offsets, fresh = kind, data, _offsets(arr), None
    elif pa.types.is_fixed_size_binary(t):
        col.kind, fresh = _FIXED_BIN, None
        w = col.width = t.byte_width
        buf = arr.buffers()[1] or bytes((off + n) * w)
        col.values = np.frombuffer(buf, np.uint8)[off * w : (off + n) * w]
    elif is_list_type(t) and (fresh := _leaf_numpy(arr.values)) is not None:
        child = arr.values
        if (
            child.null_count  # (its offsets are not read without nulls)
            and _rows_with_null_items(child, _list_offsets(arr)[0], n, _null_mask(arr)) is not None
        ):
            return col  # rows with null items: Python lists
        if pa.types.is_fixed_size_list(t):
            k = t.list_size
            col.kind, col.values = _MATRIX, fresh[off * k : (off + n) * k].reshape(n, k)
        else:
            col.kind, col.values, col.offsets = _ARRAY, fresh, _offsets(arr)
    else:
        return col
    mask = _null_mask(arr)
    if mask is not None:
        col.nulls = mask.tobytes()
        col.private = n
    if fresh is not None and (fresh.base is None or pa.types.is_boolean(t)):
        col.private += fresh.nbytes  # a cast, or bits unpacked
    return col


def _gathers(col: _Column) -> bool:
    """Whether a batch of columns gathers ``col`` from its numpy views (no nulls;
    numbers, strings, binary, fixed-size lists and lists of numbers)."""
    if col.nulls is not None or col.kind in (_GENERIC, _NONE, _SCALAR, _FIXED_BIN):
        return False
    return col.kind in (_STR, _BIN) or col.values.dtype.kind in "biuf"


class RowViews:
    """A cached row group prepared for building records: one :class:`_Column` per column.

    Made once per cached row group and process; holds views of the table's buffers (no
    copy, except bools, null masks and columns of several chunks), so a memory-mapped
    table stays mapped, not copied. ``nbytes`` is what it adds to the table's memory.

    Example:
        >>> v = RowViews(pa.table({"x": [1, 2], "s": ["a", None]}))
        >>> build_records(("x", "s"), [0, 1], [v], np.array([0, 0]), np.array([1, 0]), {})
        [{'x': 2, 's': None}, {'x': 1, 's': 'a'}]
    """

    __slots__ = ("columns", "layout", "nbytes", "num_rows", "signature")

    def __init__(self, table: pa.Table) -> None:
        self.num_rows = table.num_rows
        columns = []
        nbytes = _VIEWS_OVERHEAD
        for col in table.columns:
            arr = _array(col)
            if col.num_chunks > 1 or pa.types.is_dictionary(col.type):
                nbytes += arr.nbytes  # a copy
            view = _column(arr)
            # Records index memoryviews (Python numbers and bytes at C speed), which read
            # native numbers only, and no half floats.
            if view.kind == _NUM and (view.values.dtype == np.float16 or sys.byteorder != "little"):
                view = _Column(arr)
            if view.kind in (_NUM, _STR, _BIN, _FIXED_BIN):
                view.values = memoryview(view.values)
            if view.offsets is not None:
                view.offsets = memoryview(view.offsets)
            columns.append(view)
            nbytes += view.private + _COLUMN_OVERHEAD
        self.columns = columns
        self.nbytes = nbytes
        # Row groups of one signature read every column the same way (the common case:
        # checked once per batch, not once per column and row group).
        self.layout = tuple((c.kind, c.nulls is not None) for c in columns)
        self.signature = _SIGNATURES.setdefault(self.layout, len(_SIGNATURES))


def build_records(
    keys: tuple[str, ...] | list[str],
    positions: list[int],
    groups: list[RowViews],
    which: np.ndarray,
    rows: np.ndarray,
    constants: dict[int, list[Any]],
) -> list[dict[str, Any]]:
    """The records of a batch, in request order.

    ``which[i]`` is the index in ``groups`` of request ``i``'s row group and ``rows[i]``
    its row there. ``positions[j]`` is key ``j``'s column in the tables, or ``-1`` for a
    key whose values come from ``constants[j]`` (one per request: hive partitions).
    """
    n = len(which)
    k_list = which.tolist()
    r_list = rows.tolist()
    plan = None
    columns: list[list[Any]] = []
    alike = len({g.signature for g in groups}) == 1
    per_group = [g.columns for g in groups]
    for j, pos in enumerate(positions):
        if pos < 0:
            columns.append(constants[j])
            continue
        views = [c[pos] for c in per_group]
        kind, nullable = groups[0].layout[pos]
        if not alike:
            if any(v.kind != kind for v in views):
                kind = _GENERIC
            nullable = any(v.nulls is not None for v in views)
        if kind == _GENERIC:  # through Arrow, converted, in request order
            plan = plan or GatherPlan(which, rows)
            arrays = [views[g].arrow for g in plan.groups.tolist()]
            columns.append(convert_column(take_rows(arrays, plan)).take(plan.where.tolist()))
            continue
        values = _values(kind, views, k_list, r_list, n)
        if nullable:
            masks = [v.nulls for v in views]
            for i, (k, r) in enumerate(zip(k_list, r_list)):
                m = masks[k]
                if m is not None and m[r]:
                    values[i] = None
        columns.append(values)
    return _records(keys, columns, n)


def _records(keys: Sequence[str], columns: list[list[Any]], rows: int) -> list[dict[str, Any]]:
    """One dict per row of ``columns`` (``columns[j]`` holds key ``j``'s ``rows`` values).

    Dict displays (``{k0: a, k1: b}``) build a record about 3x faster than
    ``dict(zip(keys, row))``: the first four keys are set so, the others four at a time
    in one pass over the records.

    Example:
        >>> _records(["a", "b"], [[1, 2], ["x", "y"]], 2)
        [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]
    """
    n = len(keys)
    if n == 0:
        return [{} for _ in range(rows)]
    if n == 1:
        (k0,) = keys
        return [{k0: a} for a in columns[0]]
    if n == 2:
        k0, k1 = keys
        return [{k0: a, k1: b} for a, b in zip(*columns)]
    if n == 3:
        k0, k1, k2 = keys
        return [{k0: a, k1: b, k2: c} for a, b, c in zip(*columns)]
    k0, k1, k2, k3 = keys[:4]
    out = [{k0: a, k1: b, k2: c, k3: d} for a, b, c, d in zip(*columns[:4])]
    j = 4
    while n - j >= 4:
        k0, k1, k2, k3 = keys[j : j + 4]
        for rec, a, b, c, d in zip(out, *columns[j : j + 4]):
            rec[k0] = a
            rec[k1] = b
            rec[k2] = c
            rec[k3] = d
        j += 4
    for key, column in zip(keys[j:], columns[j:]):
        for rec, a in zip(out, column):
            rec[key] = a
    return out


def _values(kind: int, views: list[_Column], ks: list[int], rs: list[int], n: int) -> list[Any]:
    """One column's values at ``(ks[i], rs[i])`` (null rows hold whatever their slot does)."""
    if kind == _NONE:
        return [None] * n
    data = [v.values for v in views]
    if kind in (_NUM, _SCALAR):
        if len(views) == 1:
            a = data[0]
            if kind == _NUM and n > 64:  # many rows of one row group: numpy's C loop
                return np.asarray(a)[rs].tolist()
            return [a[r] for r in rs]
        return [data[k][r] for k, r in zip(ks, rs)]
    if kind == _FIXED_BIN:
        w = views[0].width
        return [bytes(data[k][r * w : r * w + w]) for k, r in zip(ks, rs)]
    if kind == _MATRIX:
        return [data[k][r].copy() for k, r in zip(ks, rs)]
    # _STR, _BIN, _ARRAY: each row's slice of the values, decoded or copied
    offs = [v.offsets for v in views]
    out = [data[k][offs[k][r] : offs[k][r + 1]] for k, r in zip(ks, rs)]
    if kind == _STR:
        return [str(v, "utf-8") for v in out]
    if kind == _BIN:
        return [bytes(v) for v in out]
    return [v.copy() for v in out]


def take_rows(columns: list[Any], plan: GatherPlan) -> pa.Array:
    """One column of a batch's row groups (``columns[k]``: an Arrow array or chunked
    array) through Arrow: each group's rows (``plan.rows[k]``), joined in staged order.

    Example:
        >>> plan = GatherPlan(np.array([1, 0]), np.array([0, 1]))
        >>> take_rows([pa.array([1, 2]), pa.chunked_array([[3]])], plan).to_pylist()
        [2, 3]
    """
    pieces = []
    # (one row: a slice, but of fixed-size lists: pyarrow 26's take of a sliced
    # fixed-size list of fixed-size lists ignores the slice's offset, and the batch is
    # taken again; the row groups' pieces of a column have one type)
    sliced = bool(columns) and not _has_fixed_size_list(columns[0].type)
    for col, r in zip(columns, plan.rows):
        if len(r) == 1 and sliced:
            part = col.slice(int(r[0]), 1)
        else:
            part = col.take(int64_array(r))
        pieces += part.chunks if isinstance(part, pa.ChunkedArray) else [part]
    return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)


def _has_fixed_size_list(t: pa.DataType) -> bool:
    """Whether type ``t`` is or holds a fixed-size list.

    Example:
        >>> _has_fixed_size_list(pa.struct([("a", pa.list_(pa.int8(), 2))]))
        True
    """
    return pa.types.is_fixed_size_list(t) or any(
        _has_fixed_size_list(t.field(i).type) for i in range(t.num_fields)
    )


class RowTemplates:
    """A row group converted whole into finished records, for data whose converted rows
    fit the cache: a read then copies one dict per record (C speed) instead of building
    its values.

    ``records`` holds one dict per row with every key, its immutable values (numbers,
    str, bytes, None, numpy scalars...) filled in; ``mutable`` the ``(key, column)``
    pairs whose values are made fresh for every read (arrays, lists, dicts), whose
    keys hold None in the templates. ``nbytes`` estimates what the Python objects cost.
    ``keys``, ``positions`` and ``constants`` (one value per row) are as in
    :func:`build_records`.

    Example:
        >>> t = RowTemplates(pa.table({"x": [1, 2], "v": [[1.0], [2.0]]}), ("x", "v"), [0, 1], {})
        >>> copy_records([t], np.array([0, 0]), np.array([1, 0]))
        [{'x': 2, 'v': array([2.])}, {'x': 1, 'v': array([1.])}]
    """

    __slots__ = ("mutable", "nbytes", "records")

    def __init__(
        self,
        table: pa.Table,
        keys: tuple[str, ...] | list[str],
        positions: list[int],
        constants: dict[int, list[Any]],
    ) -> None:
        n = table.num_rows
        cols = [
            Column("plain", constants[j], 0) if pos < 0 else convert_column(table.column(pos))
            for j, pos in enumerate(positions)
        ]
        # A placeholder keeps a mutable value's key in order; each read fills it afresh.
        self.mutable = [(key, c) for key, c in zip(keys, cols) if c.kind != "plain"]
        values = [c.values if c.kind == "plain" else [None] * n for c in cols]
        self.records = _records(keys, values, n)
        self.nbytes = sum(c.nbytes for c in cols) + n * sum(map(sys.getsizeof, self.records[:1]))


def views_bytes(columns: int) -> int:
    """What a row group's :class:`RowViews` are charged, beyond copies (bools, nulls)."""
    return _VIEWS_OVERHEAD + _COLUMN_OVERHEAD * columns


def converted_bytes(num_rows: int, keys: int) -> int:
    """Estimated Python objects of ``num_rows`` converted records of ``keys`` keys beyond
    their Arrow data (a dict each, an object per value)."""
    return num_rows * (sys.getsizeof(dict.fromkeys(range(keys))) + _PY_OBJECT_BYTES * keys)


def copy_records(
    groups: list[RowTemplates], which: np.ndarray, rows: np.ndarray
) -> list[dict[str, Any]]:
    """The records of a batch, in request order, copied from converted row groups
    (``which[i]``, ``rows[i]`` as in :func:`build_records`)."""
    templates = [g.records for g in groups]
    out = [templates[k][r].copy() for k, r in zip(which.tolist(), rows.tolist())]
    if groups[0].mutable:
        # Values that must be fresh per record replace the placeholders, group by group.
        plan = GatherPlan(which, rows)
        order = plan.order.tolist()
        for k, (g, local) in enumerate(zip(plan.groups.tolist(), plan.rows)):
            recs = [out[i] for i in order[plan.bounds[k] : plan.bounds[k + 1]]]
            for key, col in groups[g].mutable:
                for rec, value in zip(recs, col.take(local.tolist())):
                    rec[key] = value
    return out


# ------------------------------------------------------------- columns
def arrow_column(col: pa.ChunkedArray | pa.Array) -> Any:
    """The batch-column form of an Arrow column: numbers and bools without nulls a numpy
    array ``[B]``; binary and strings without nulls a :class:`~torchgrain.columns.Ragged`;
    fixed-size lists (nested too) and lists of numbers whose rows have one length a numpy
    array ``[B, k]`` (``[B, a, b]``), other lists of numbers a ``Ragged`` of kind
    ``"array"``; anything else (nulls, temporal, structs, maps...) the values a records
    batch holds, in :func:`~torchgrain.columns.column_of` form. Arrays come from
    :func:`torchgrain.columns.empty` (shared memory in a DataLoader worker).

    Example:
        >>> arrow_column(pa.array([1, 2], pa.int32())).tolist()
        [1, 2]
        >>> arrow_column(pa.array([b"ab", b"c"]))[1]
        b'c'
        >>> arrow_column(pa.array([[1.0, 2.0], [3.0, 4.0]])).shape
        (2, 2)
    """
    arr = _array(col)
    view = _column(arr)
    if not _gathers(view):
        converted = convert_column(arr)
        if isinstance(converted.values, np.ndarray):  # lists of lists of one shape
            return _copy(converted.values)
        return column_of(converted.take(list(range(len(arr)))))
    data, offsets = view.values, view.offsets
    if offsets is None:
        return _copy(data)
    n = len(arr)
    lo, hi = int(offsets[0]), int(offsets[-1])
    values = data[lo:hi]
    if view.kind == _ARRAY:  # lists of numbers whose rows have one length: a matrix
        lengths = np.diff(offsets)
        if n and (lengths == lengths[0]).all():
            return _copy(values.reshape(n, int(lengths[0])))
    out_offsets = empty((n + 1,), np.int64)
    np.subtract(offsets, lo, out=out_offsets, casting="unsafe")
    return Ragged(_copy(values), out_offsets, _RAGGED[view.kind])


def _copy(values: np.ndarray) -> np.ndarray:
    out = empty(values.shape, values.dtype)
    out[...] = values
    return out


def _cube(outer: np.ndarray, inner: np.ndarray, leaf: np.ndarray, inner_type: pa.DataType) -> Any:
    """The ``[n, a, b]`` view of ``leaf`` where each of the ``n`` rows (``outer``) holds
    ``a`` lists (``inner``) of ``b`` items; else None."""
    rows = np.diff(outer)
    if not len(rows) or not (rows == rows[0]).all():
        return None
    inner = inner[int(outer[0]) : int(outer[-1]) + 1]
    cols = np.diff(inner)
    if len(cols) and not (cols == cols[0]).all():
        return None
    b = int(cols[0]) if len(cols) else getattr(inner_type, "list_size", 0)  # where fixed
    return leaf[int(inner[0]) : int(inner[-1])].reshape(len(rows), int(rows[0]), b)


# A cached row group is prepared once for columnar reads (:class:`GroupViews`): its
# fixed-width columns, and the (start, length) of every row of its variable-length
# columns, packed row by row into one byte matrix. A batch then gathers every packed
# column with one fancy index per row group it touches, plus one to put the rows in
# request order; variable-length values take one more fancy index per group.
class GroupViews:
    """A cached row group prepared for columnar reads.

    ``layout`` lists the packed columns (those :func:`_gathers`) as ``(column, byte
    offset, dtype, row shape, ragged kind)``: dense columns (ragged kind ``""``: numbers,
    bools, fixed-size lists of numbers) hold their values, ragged ones (binary, string,
    lists of numbers) their rows' start and length (two int64) while ``values[column]``
    holds the flat values. Other columns need Arrow (nulls, dictionaries, temporal or
    nested types). ``nbytes`` is the memory the packing adds.

    Example:
        >>> v = GroupViews(pa.table({"x": [1, 2, 3], "s": ["a", "bc", None]}))
        >>> [pos for pos, *_ in v.layout]
        [0]
        >>> gather([v], GatherPlan(np.array([0, 0]), np.array([2, 0])))[0].tolist()
        [3, 1]
    """

    __slots__ = ("layout", "nbytes", "packed", "record", "values")

    def __init__(self, table: pa.Table) -> None:
        rows = table.num_rows
        parts: list[np.ndarray] = []
        layout, fields = [], []  # fields: of one packed row as a record (c<column>)
        self.values: dict[int, memoryview] = {}  # a ragged column's values, as bytes
        at = 0
        for pos, col in enumerate(table.columns):
            view = _column(col.chunk(0)) if col.num_chunks == 1 else None
            if view is None or not _gathers(view):
                continue
            data = view.values
            ragged_kind = _RAGGED.get(view.kind, "")
            if not ragged_kind:
                part = np.ascontiguousarray(data).reshape(rows, -1).view(np.uint8)
                shape = data.shape[1:]
            else:
                bounds = np.asarray(view.offsets, np.int64)
                part = np.stack([bounds[:-1], np.diff(bounds)], axis=1).view(np.uint8)
                shape = ()
                self.values[pos] = memoryview(np.ascontiguousarray(data).view(np.uint8))
            layout.append((pos, at, data.dtype, shape, ragged_kind))
            fields.append((f"c{pos}", (np.int64, (2,)) if ragged_kind else (data.dtype, shape), at))
            parts.append(part)
            at += part.shape[1]
        self.layout = tuple(layout)
        self.packed = np.concatenate(parts, axis=1) if parts else np.empty((rows, 0), np.uint8)
        self.nbytes = self.packed.nbytes
        names, formats, offsets = (list(f) for f in zip(*fields)) if fields else ([], [], [])
        self.record = np.dtype(
            {"names": names, "formats": formats, "offsets": offsets, "itemsize": max(at, 1)}
        )


def gather(groups: list[GroupViews], plan: GatherPlan) -> dict[int, Any]:
    """The batch's packed columns by column position (numpy arrays and
    :class:`~torchgrain.columns.Ragged`); empty when the row groups' layouts differ
    (the caller then reads every column through Arrow)."""
    first = groups[0]
    if not first.layout or not all(g.layout == first.layout for g in groups):
        return {}
    n, b = plan.n, plan.bounds
    staged = np.empty((n, first.packed.shape[1]), np.uint8)
    for k, g in enumerate(groups):
        g.packed.take(plan.rows[k], axis=0, out=staged[b[k] : b[k + 1]])
    rows = staged if len(groups) == 1 else staged.take(plan.where, axis=0)
    # Each packed column as a typed (strided) view, copied once into its own array.
    typed = rows.view(first.record).reshape(n)
    pairs = staged.view(first.record).reshape(n)  # (the ragged columns' starts and lengths)
    out: dict[int, Any] = {}
    for pos, _, dtype, _, ragged_kind in first.layout:
        field = f"c{pos}"
        if not ragged_kind:
            out[pos] = _copy(typed[field])
        else:
            data = [g.values[pos] for g in groups]
            out[pos] = _gather_values(data, pairs[field], plan, dtype, ragged_kind)
    return out


def _gather_values(
    data: list[memoryview], pairs: np.ndarray, plan: GatherPlan, dtype: np.dtype, kind: str
) -> Ragged | np.ndarray:
    """The values of a variable-length column; ``pairs`` holds each row's (start,
    length, in items of ``dtype``) in its group's ``data`` (bytes), in staged order.
    Lists of numbers whose rows have one length are a matrix, as :func:`arrow_column`
    gives them."""
    n = plan.n
    item = dtype.itemsize
    starts = (pairs[:, 0] * item).tolist()
    ends = ((pairs[:, 0] + pairs[:, 1]) * item).tolist()
    b, parts = plan.bounds, []
    for k, view in enumerate(data):
        lo, hi = b[k], b[k + 1]
        parts += [view[a:e] for a, e in zip(starts[lo:hi], ends[lo:hi])]
    lengths = pairs[:, 1]
    if len(data) > 1:  # in request order
        parts = [parts[j] for j in plan.where.tolist()]
        lengths = lengths[plan.where]
    offsets = empty((n + 1,), np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    values = empty((int(offsets[-1]),), dtype)
    if len(values):
        values.view(np.uint8)[:] = np.frombuffer(b"".join(parts), np.uint8)
    if kind == _RAGGED[_ARRAY] and n and (lengths == lengths[0]).all():
        return values.reshape(n, int(lengths[0]))
    return Ragged(values, offsets, kind)
