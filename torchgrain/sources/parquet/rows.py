"""Records from cached Arrow row groups, built per batch.

The row-group cache keeps decoded row groups in Arrow's compact form (in this process's
memory, or memory-mapped from the node's decoded disk cache) for both batch formats. A
records batch builds its Python values from it, per batch:

* numbers, bools, strings, binary, temporal values and lists of numbers are read row by
  row through views made once per cached row group (:class:`RowViews`): a memoryview or
  numpy view per column, so a value costs one index into a buffer and the object it
  becomes, whichever row group it sits in (a global shuffle touches a different row
  group for nearly every record);
* other columns (decimals, times, structs, maps, nested lists, lists holding nulls...)
  gather the batch's rows with Arrow and convert them with
  :func:`~torchgrain.sources.parquet.values.convert_column`, as whole row groups were
  converted before.

Either way a value is what :class:`~torchgrain.ParquetSource`'s docstring promises
(arrays fresh and writable, nulls ``None``); nothing per row is kept between batches.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import numpy as np
import pyarrow as pa

from torchgrain.sources.parquet.values import (
    _PY_OBJECT_BYTES,
    _bits,
    _is_list,
    _is_number,
    _is_temporal,
    _leaf_numpy,
    _list_offsets,
    _null_mask,
    _primitive_numpy,
    _rows_with_null_items,
    convert_column,
    int64_array,
)

__all__ = [
    "RowTemplates",
    "RowViews",
    "build_records",
    "converted_bytes",
    "copy_records",
    "views_bytes",
]

# Column kinds (ints: compared once per column and batch).
_GENERIC, _NONE, _NUM, _BOOL, _SCALAR, _STR, _BIN, _FIXED_BIN, _ARRAY, _MATRIX = range(10)
_BOOLS = (False, True)
# memoryview formats of Arrow's fixed-width number types (little-endian platforms).
_FORMATS = {
    "int8": "b",
    "int16": "h",
    "int32": "i",
    "int64": "q",
    "uint8": "B",
    "uint16": "H",
    "uint32": "I",
    "uint64": "Q",
    "float": "f",
    "double": "d",
}
# Each distinct layout (kind and nulls of every column) gets a number: a batch compares
# its row groups' numbers, not their layouts.
_SIGNATURES: dict[tuple[tuple[int, bool], ...], int] = {}
# Bookkeeping of one prepared row group (views, tuples, lists), charged to the cache.
_VIEWS_OVERHEAD = 2048
_COLUMN_OVERHEAD = 512


class _Column:
    """How to read one column of one row group: ``kind`` and its buffers.

    ``a``/``b`` depend on the kind: values (memoryview or numpy), offsets (memoryview),
    the byte width of fixed-size binary. ``nulls`` is a ``bytes`` with 1 for each null
    row, or None when the column has none. ``arrow`` is the column itself (generic kind).
    """

    __slots__ = ("a", "arrow", "b", "kind", "nulls")

    def __init__(self, kind: int, a: Any = None, b: Any = None, nulls: bytes | None = None):
        self.kind = kind
        self.a = a
        self.b = b
        self.nulls = nulls
        self.arrow: pa.Array | None = None


def _raw(buf: pa.Buffer | None, start: int, stop: int) -> memoryview:
    """Bytes ``[start, stop)`` of an Arrow buffer (zeros for a missing buffer)."""
    if buf is None:
        return memoryview(bytes(stop - start))
    return memoryview(buf)[start:stop]


def _column(arr: pa.Array) -> tuple[_Column, int]:
    """The view of one column, and the private bytes it allocated."""
    t = arr.type
    n = len(arr)
    mask = _null_mask(arr)
    nulls = None if mask is None else mask.tobytes()
    private = 0 if nulls is None else n
    off = arr.offset
    if pa.types.is_null(t):
        return _Column(_NONE), 0
    if pa.types.is_boolean(t):
        buf = arr.buffers()[1]
        bits = _bits(buf, off, n) if buf is not None else np.zeros(n, bool)
        return _Column(_BOOL, bits.view(np.uint8).tobytes(), None, nulls), private + n
    fmt = _FORMATS.get(str(t)) if _is_number(t) else None
    if fmt is not None and sys.byteorder == "little":
        size = t.bit_width // 8
        values = _raw(arr.buffers()[1], off * size, (off + n) * size).cast(fmt)
        return _Column(_NUM, values, None, nulls), private
    if _is_temporal(t):
        values = _primitive_numpy(arr)
        private += 0 if values.base is not None else values.nbytes
        return _Column(_SCALAR, values, None, nulls), private
    string = pa.types.is_string(t) or pa.types.is_large_string(t)
    if string or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        _, offsets_buf, data_buf = arr.buffers()
        width = 8 if large else 4
        offsets = _raw(offsets_buf, off * width, (off + n + 1) * width).cast("q" if large else "i")
        data = memoryview(data_buf) if data_buf is not None else memoryview(b"")
        return _Column(_STR if string else _BIN, data, offsets, nulls), private
    if pa.types.is_fixed_size_binary(t):
        width = t.byte_width
        data = _raw(arr.buffers()[1], off * width, (off + n) * width)
        return _Column(_FIXED_BIN, data, width, nulls), private
    if _is_list(t) and not _is_list(t.value_type):
        child = arr.values
        leaf = _leaf_numpy(child)
        if leaf is None:
            return _Column(_GENERIC), 0
        if child.null_count:
            holed = _rows_with_null_items(child, _list_offsets(arr)[0], n)
            if holed is not None and mask is not None:
                holed &= ~mask
            if holed is not None and holed.any():
                return _Column(_GENERIC), 0  # rows with null items: Python lists
        if leaf.base is None:
            private += leaf.nbytes
        if pa.types.is_fixed_size_list(t):
            k = t.list_size
            rows = leaf[off * k : (off + n) * k].reshape(n, k)
            return _Column(_MATRIX, rows, None, nulls), private
        width = 8 if pa.types.is_large_list(t) else 4
        offsets = _raw(arr.buffers()[1], off * width, (off + n + 1) * width)
        return _Column(_ARRAY, leaf, offsets.cast("q" if width == 8 else "i"), nulls), private
    return _Column(_GENERIC), 0


class RowViews:
    """A cached row group prepared for building records: one :class:`_Column` per column.

    Made once per cached row group and process; holds views of the table's buffers (no
    copy, except bools, null masks and columns of several chunks), so a memory-mapped
    table stays mapped, not copied. ``nbytes`` is what it adds to the table's memory.

    Example:
        >>> import pyarrow as pa
        >>> v = RowViews(pa.table({"x": [1, 2], "s": ["a", None]}))
        >>> build_records(("x", "s"), [0, 1], [v], np.array([0, 0]), np.array([1, 0]))
        [{'x': 2, 's': None}, {'x': 1, 's': 'a'}]
    """

    __slots__ = ("columns", "layout", "nbytes", "num_rows", "signature")

    def __init__(self, table: pa.Table) -> None:
        self.num_rows = table.num_rows
        columns = []
        nbytes = _VIEWS_OVERHEAD
        for col in table.columns:
            arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
            if col.num_chunks > 1:
                nbytes += arr.nbytes
            if pa.types.is_dictionary(arr.type):
                arr = arr.dictionary_decode()
                nbytes += arr.nbytes
            view, private = _column(arr)
            view.arrow = arr
            columns.append(view)
            nbytes += private + _COLUMN_OVERHEAD
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
    constants: dict[int, list[Any]] | None = None,
) -> list[dict[str, Any]]:
    """The records of a batch, in request order.

    ``which[i]`` is the index in ``groups`` of request ``i``'s row group and ``rows[i]``
    its row there. ``positions[j]`` is key ``j``'s column in the tables, or ``-1`` for a
    key whose values come from ``constants[j]`` (one per request: hive partitions).
    """
    n = len(which)
    k_list = which.tolist()
    r_list = rows.tolist()
    staged: tuple[np.ndarray, list[int]] | None = None
    columns: list[list[Any]] = []
    alike = len({g.signature for g in groups}) == 1
    per_group = [g.columns for g in groups]
    for j, pos in enumerate(positions):
        if pos < 0:
            assert constants is not None
            columns.append(constants[j])
            continue
        views = [c[pos] for c in per_group]
        kind, nullable = groups[0].layout[pos]
        if not alike:
            if any(v.kind != kind for v in views):
                kind = _GENERIC
            nullable = any(v.nulls is not None for v in views)
        if kind == _GENERIC:
            if staged is None:
                order = np.argsort(which, kind="stable")
                staged = (order, np.flatnonzero(np.diff(which[order])).tolist())
            columns.append(_generic(views, which, rows, staged))
            continue
        values = _values(kind, views, k_list, r_list, n)
        if nullable:
            masks = [v.nulls for v in views]
            for i, (k, r) in enumerate(zip(k_list, r_list)):
                m = masks[k]
                if m is not None and m[r]:
                    values[i] = None
        columns.append(values)
    if not keys:
        return [{} for _ in range(n)]
    return _records(keys, columns)


def _records(keys: tuple[str, ...] | list[str], columns: list[list[Any]]) -> list[dict[str, Any]]:
    """One dict per row of ``columns`` (``columns[j]`` holds key ``j``'s values).

    Dict displays (``{k0: a, k1: b}``) build a record about 3x faster than
    ``dict(zip(keys, row))``: the first four keys are set so, the others four at a time
    in one pass over the records.

    Example:
        >>> _records(["a", "b"], [[1, 2], ["x", "y"]])
        [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]
    """
    n = len(keys)
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
    one = len(views) == 1
    if kind == _NONE:
        return [None] * n
    if kind in (_NUM, _SCALAR):
        if one:
            a = views[0].a
            if kind == _NUM and n > 64:  # many rows of one row group: numpy's C loop
                return np.asarray(a)[rs].tolist()
            return [a[r] for r in rs]
        arrs = [v.a for v in views]
        return [arrs[k][r] for k, r in zip(ks, rs)]
    if kind == _BOOL:
        bits = [v.a for v in views]
        return [_BOOLS[bits[k][r]] for k, r in zip(ks, rs)]
    if kind in (_STR, _BIN):
        data = [v.a for v in views]
        offs = [v.b for v in views]
        out = []
        for k, r in zip(ks, rs):
            o = offs[k]
            out.append(data[k][o[r] : o[r + 1]])
        if kind == _STR:
            return [str(v, "utf-8") for v in out]
        return [bytes(v) for v in out]
    if kind == _FIXED_BIN:
        data = [v.a for v in views]
        w = views[0].b
        return [bytes(data[k][r * w : r * w + w]) for k, r in zip(ks, rs)]
    if kind == _MATRIX:
        mats = [v.a for v in views]
        return [mats[k][r].copy() for k, r in zip(ks, rs)]
    # _ARRAY: a fresh copy of each row's slice of the leaf values
    leaves = [v.a for v in views]
    offs = [v.b for v in views]
    out = []
    for k, r in zip(ks, rs):
        o = offs[k]
        out.append(leaves[k][o[r] : o[r + 1]].copy())
    return out


def _generic(
    views: list[_Column],
    which: np.ndarray,
    rows: np.ndarray,
    staged: tuple[np.ndarray, list[int]],
) -> list[Any]:
    """A column through Arrow: each row group's rows, joined, converted, request order."""
    order, cuts = staged
    n = len(which)
    staged_rows = rows[order]
    bounds = [0, *(c + 1 for c in cuts), n]
    pieces = []
    for a, b in itertools.pairwise(bounds):
        arr = views[int(which[order[a]])].arrow
        assert arr is not None
        if b - a == 1:
            pieces.append(arr.slice(int(staged_rows[a]), 1))
        else:
            pieces.append(arr.take(int64_array(staged_rows[a:b])))
    joined = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
    values = convert_column(joined).take(list(range(n)))
    out: list[Any] = [None] * n
    for p, i in enumerate(order.tolist()):
        out[i] = values[p]
    return out


class RowTemplates:
    """A row group converted whole into finished records, for data whose converted rows
    fit the cache: a read then copies one dict per record (C speed) instead of building
    its values.

    ``records`` holds one dict per row with every key, its immutable values (numbers,
    str, bytes, None, numpy scalars...) filled in; ``mutable`` the ``(key, column)``
    pairs whose values are made fresh for every read (arrays, lists, dicts), whose
    keys hold None in the templates. ``nbytes`` estimates what the Python objects cost.

    Example:
        >>> import pyarrow as pa
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
        constants: dict[int, Any],
    ) -> None:
        n = table.num_rows
        records: list[dict[str, Any]] = [{} for _ in range(n)]
        mutable = []
        nbytes = 0
        # Filled column by column: about 2x faster than a dict per row from a zip.
        for j, (key, pos) in enumerate(zip(keys, positions)):
            if pos < 0:  # one value for the whole row group (a hive partition key)
                value = constants[j]
                for rec in records:
                    rec[key] = value
                continue
            col = convert_column(table.column(pos))
            nbytes += col.nbytes
            if col.plain:
                for rec, value in zip(records, col.values):
                    rec[key] = value
            else:  # a placeholder keeps the key order; each read fills a fresh value
                mutable.append((key, col))
                for rec in records:
                    rec[key] = None
        if records:
            nbytes += n * sys.getsizeof(records[0])
        self.records = records
        self.mutable = mutable
        self.nbytes = nbytes


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
    k_list = which.tolist()
    r_list = rows.tolist()
    out = [templates[k][r].copy() for k, r in zip(k_list, r_list)]
    if groups[0].mutable:
        # Values that must be fresh per record replace the placeholders, group by group.
        order = np.argsort(which, kind="stable").tolist()
        cuts = [0]
        staged_k = [k_list[i] for i in order]
        cuts += [i for i in range(1, len(order)) if staged_k[i] != staged_k[i - 1]]
        cuts.append(len(order))
        for a, b in itertools.pairwise(cuts):
            group = groups[staged_k[a]]
            positions = order[a:b]
            local = [r_list[i] for i in positions]
            recs = [out[i] for i in positions]
            for key, col in group.mutable:
                for rec, value in zip(recs, col.take(local)):
                    rec[key] = value
    return out
