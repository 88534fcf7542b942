"""Reconciling the schemas of a dataset's Parquet files, and naming Arrow types."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from torchgrain.errors import SchemaMismatchError, warn_once

__all__ = ["arrow_type_name", "common_type", "fixed_bytes", "merge_types", "value_type_name"]


def all_names(schemas: list[pa.Schema]) -> list[str]:
    """Every column name of ``schemas``, in order of first appearance."""
    return list(dict.fromkeys(n for s in schemas for n in s.names))


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _decoded(t: pa.DataType) -> pa.DataType:
    """``t`` with each dictionary type in it (at any depth: list items, struct fields,
    map keys and items) its value type, as :func:`arrow_type_name` names it, and each
    string or binary view type the large string or binary type.

    Example:
        >>> import pyarrow as pa
        >>> _decoded(pa.list_(pa.dictionary(pa.int32(), pa.string())))
        ListType(list<item: string>)
    """
    if pa.types.is_dictionary(t):
        return _decoded(t.value_type)
    if t.id in _VIEWS:  # (Arrow has no take of a view type: read as the large type)
        return _VIEWS[t.id]
    if is_list_type(t):
        field = t.value_field.with_type(_decoded(t.value_type))
        if pa.types.is_large_list(t):
            return pa.large_list(field)
        return pa.list_(field, t.list_size if pa.types.is_fixed_size_list(t) else -1)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_decoded(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(
            t.key_field.with_type(_decoded(t.key_type)),
            t.item_field.with_type(_decoded(t.item_type)),
            keys_sorted=t.keys_sorted,
        )
    return t


_VIEWS = {
    view().id: large()
    for view, large in (
        (getattr(pa, "string_view", None), pa.large_string),
        (getattr(pa, "binary_view", None), pa.large_binary),
    )
    if view is not None  # (pyarrow 16+)
}


def merge_types(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type both ``a`` and ``b`` widen to without loss, or None (see ParquetSource).

    Example:
        >>> import pyarrow as pa
        >>> merge_types(pa.int32(), pa.int64()), merge_types(pa.int64(), pa.string())
        (DataType(int64), None)
    """
    return common_type([a, b])


def common_type(types: Sequence[pa.DataType]) -> pa.DataType | None:
    """The narrowest of ``types`` that all of them widen to without loss, or None.

    Unlike folding :func:`merge_types` over a list, the answer does not depend on the
    order: ``uint8, int8, int16`` gives ``int16`` whichever comes first.

    Example:
        >>> import pyarrow as pa
        >>> common_type([pa.uint8(), pa.int8(), pa.int16()])
        DataType(int16)
        >>> common_type([pa.uint8(), pa.int8()]) is None   # no int16 among them
        True
    """
    values = [t for t in map(_decoded, types) if not pa.types.is_null(t)]
    if not values:
        return pa.null()
    if all(t.equals(values[0]) for t in values):
        return values[0]
    # (nested fields that differ only in nullability: Spark writes list items
    # non-nullable where another writer does not; the values are the same)
    relaxed = [_nullable(t) for t in values]
    if all(t.equals(relaxed[0]) for t in relaxed):
        return relaxed[0]
    if all(pa.types.is_integer(t) for t in values):
        signed = [t for t in values if pa.types.is_signed_integer(t)]
        unsigned = [t for t in values if not pa.types.is_signed_integer(t)]
        widest = max(signed or unsigned, key=lambda t: t.bit_width)
        if signed and unsigned and widest.bit_width <= max(t.bit_width for t in unsigned):
            return None  # no signed type holds every unsigned one
        return widest
    if all(pa.types.is_floating(t) for t in values):
        return max(values, key=lambda t: t.bit_width)
    names = {str(t) for t in values}
    for small, large in ((pa.string(), pa.large_string()), (pa.binary(), pa.large_binary())):
        if names == {str(small), str(large)}:
            return large
    return None


def _nullable(t: pa.DataType) -> pa.DataType:
    """``t`` with every nested field nullable (a map's keys stay required)."""

    def field(f: pa.Field) -> pa.Field:
        return pa.field(f.name, _nullable(f.type), True, f.metadata)

    if pa.types.is_list(t):
        return pa.list_(field(t.value_field))
    if pa.types.is_large_list(t):
        return pa.large_list(field(t.value_field))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(field(t.value_field), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(t.key_field, field(t.item_field), t.keys_sorted)
    if pa.types.is_struct(t):
        return pa.struct([field(t.field(i)) for i in range(t.num_fields)])
    return t


def merge_file_schemas(
    files: list[str], schemas: list[pa.Schema], columns: list[str] | None, part_keys: list[str]
) -> tuple[list[pa.Field], np.ndarray]:
    """Merge the selected columns of every file; return fields and a presence matrix."""
    wanted = None if columns is None else set(columns)
    # name -> [(file, type, nullable)], in file order; names in order of first appearance
    seen: dict[str, list[tuple[int, pa.DataType, bool]]] = {}
    for i, s in enumerate(schemas):
        names = s.names
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SchemaMismatchError(f"{files[i]!r} has more than one column named {dup!r}")
        for field in s:
            name = field.name
            if wanted is not None and name not in wanted:
                continue
            if name in part_keys:
                raise SchemaMismatchError(
                    f"column {name!r} of {files[i]!r} is also a hive partition key in its path"
                )
            twice = _field_named_twice(field.type)
            if twice is not None:  # a record's dict would hold one of them
                raise SchemaMismatchError(
                    f"column {name!r} of {files[i]!r} has a struct with more than one field "
                    f"named {twice!r}"
                )
            seen.setdefault(name, []).append((i, field.type, field.nullable))
    names = list(seen)
    have = [set(s.names) for s in schemas]
    present = np.array([[n in h for n in names] for h in have], bool).reshape(len(have), len(names))
    fields = []
    for j, name in enumerate(names):
        entries = seen[name]
        typ = common_type([t for _, t, _ in entries])
        if typ is None:
            a, b = _conflict(entries)
            raise SchemaMismatchError(
                f"column {name!r} has type {arrow_type_name(a[1])} in {files[a[0]]!r} but "
                f"{arrow_type_name(b[1])} in {files[b[0]]!r}"
            )
        if not present[:, j].all():
            missing_in = files[int(np.flatnonzero(~present[:, j])[0])]
            required = next((i for i, _, nullable in entries if not nullable), None)
            if required is not None:
                raise SchemaMismatchError(
                    f"column {name!r} is missing from {missing_in!r} but is required "
                    f"(not nullable) in {files[required]!r}"
                )
        fields.append(pa.field(name, typ, nullable=True))
    _warn_missing(files, names, present)
    present.setflags(write=False)
    return fields, present


def _field_named_twice(t: pa.DataType) -> str | None:
    """A name that a struct in type ``t`` (at any depth) gives two of its fields, or None."""
    names = [t.field(i).name for i in range(t.num_fields)]
    if pa.types.is_struct(t) and len(set(names)) != len(names):
        return next(n for n in names if names.count(n) > 1)
    found = (_field_named_twice(t.field(i).type) for i in range(t.num_fields))
    return next((n for n in found if n is not None), None)


def _warn_missing(files: list[str], names: list[str], present: np.ndarray) -> None:
    """Say once per dataset and process which files lack a column that others have: their
    records read None for it, which is schema drift more often than intent."""
    lacking = [j for j in range(len(names)) if not present[:, j].all()]
    if not lacking:
        return
    parts = []
    for j in lacking[:5]:
        missing = np.flatnonzero(~present[:, j])
        more = f" and {len(missing) - 1} more of {len(files)} files" if len(missing) > 1 else ""
        parts.append(f"column {names[j]!r} is missing from {files[int(missing[0])]!r}{more}")
    others = f"; {len(lacking) - 5} more columns too" if len(lacking) > 5 else ""
    warn_once(
        ("columns missing", files[0], len(files), tuple(names)),
        f"{'; '.join(parts)}{others}, which other files of the dataset have: the records of "
        "those files read None there. Select the columns every file has (columns=[...]) or "
        "rewrite the files with one schema",
    )


def _conflict(entries: list[tuple[int, pa.DataType, bool]]) -> tuple[Any, Any]:
    """Two entries (file, type, nullable) whose types have no common type: the first
    file whose type breaks the merge, and an earlier file it conflicts with."""
    for k in range(1, len(entries)):
        if common_type([t for _, t, _ in entries[: k + 1]]) is None:
            pair = (e for e in entries[:k] if common_type([e[1], entries[k][1]]) is None)
            return next(pair, entries[0]), entries[k]
    return entries[0], entries[-1]


_OFFSET_TYPES = (
    pa.types.is_binary,
    pa.types.is_string,
    pa.types.is_large_binary,
    pa.types.is_large_string,
    pa.types.is_list,
    pa.types.is_large_list,
    pa.types.is_map,
)


def fixed_bytes(t: pa.DataType) -> int:
    """The bytes every value of type ``t`` takes at least in Arrow's memory: a
    fixed-width value's width (a bool's bit rounds down to 0), a variable-length value's
    offset (4 bytes), a struct's fields. A lower bound, so a row group of ``n`` rows
    needs at least ``n`` times its columns' sum, whatever its footer says otherwise.

    Example:
        >>> import pyarrow as pa
        >>> [fixed_bytes(t) for t in (pa.int64(), pa.bool_(), pa.string(), pa.list_(pa.int8()))]
        [8, 0, 4, 4]
        >>> fixed_bytes(pa.struct([("a", pa.int32()), ("b", pa.list_(pa.float64(), 3))]))
        28
    """
    if isinstance(t, pa.ExtensionType):
        return fixed_bytes(t.storage_type)
    if pa.types.is_struct(t):
        return sum(fixed_bytes(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_fixed_size_list(t):
        return t.list_size * fixed_bytes(t.value_type)
    try:
        return t.bit_width // 8
    except ValueError:  # not fixed-width
        return 4 if any(is_offsets(t) for is_offsets in _OFFSET_TYPES) else 0


def arrow_type_name(t: pa.DataType) -> str:
    """Short pyarrow name of a type, as :attr:`ParquetSource.schema` shows it.

    Example:
        >>> import pyarrow as pa
        >>> arrow_type_name(pa.list_(pa.float32())), arrow_type_name(pa.list_(pa.int8(), 3))
        ('list<float>', 'fixed_size_list<int8>[3]')
    """
    if pa.types.is_dictionary(t):
        return arrow_type_name(t.value_type)
    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list<{arrow_type_name(t.value_type)}>[{t.list_size}]"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"{'large_' * pa.types.is_large_list(t)}list<{arrow_type_name(t.value_type)}>"
    if pa.types.is_map(t):
        return f"map<{arrow_type_name(t.key_type)}, {arrow_type_name(t.item_type)}>"
    if pa.types.is_struct(t):
        inner = ", ".join(f"{f.name}: {arrow_type_name(f.type)}" for f in t)
        return f"struct<{inner}>"
    return str(t)


# Arrow types whose values are one Python type each (tested in this order).
_VALUE_NAMES = (
    (pa.types.is_null, "null"),
    (pa.types.is_boolean, "bool"),
    (pa.types.is_integer, "int"),
    (pa.types.is_floating, "float"),
    (pa.types.is_string, "str"),
    (pa.types.is_large_string, "str"),
    (pa.types.is_binary, "bytes"),
    (pa.types.is_large_binary, "bytes"),
    (pa.types.is_fixed_size_binary, "bytes"),
    (pa.types.is_struct, "map"),
    (pa.types.is_map, "list[tuple]"),
    (pa.types.is_time, "time"),
    (pa.types.is_decimal, "Decimal"),
)


def value_type_name(t: pa.DataType) -> str:
    """The type of the values a ParquetSource hands out for an Arrow column of type ``t``.

    The vocabulary every source's ``schema`` speaks (see
    :func:`torchgrain.formats.codecs.describe_value`): ``int``, ``float``, ``str``,
    ``bytes``, numpy arrays as ``dtype[shape]`` with ``?`` for a length that varies,
    ``datetime64[unit]``, ``list[str]``, ``map`` for structs.

    Example:
        >>> import pyarrow as pa
        >>> value_type_name(pa.int32()), value_type_name(pa.list_(pa.float32()))
        ('int', 'float32[?]')
        >>> value_type_name(pa.list_(pa.list_(pa.uint8(), 3), 4)), value_type_name(pa.string())
        ('uint8[4,3]', 'str')
    """
    t = _value_type(t)
    name = next((name for is_type, name in _VALUE_NAMES if is_type(t)), None)
    if name is not None:
        return name
    leaf = _numpy_name(t)
    if leaf is not None:
        return leaf  # a temporal scalar: numpy datetime64 / timedelta64
    if is_list_type(t):
        dims, inner = [_list_length(t)], _value_type(t.value_type)
        if is_list_type(inner):
            dims.append(_list_length(inner))
            inner = _value_type(inner.value_type)
        leaf = "bool" if pa.types.is_boolean(inner) else _numpy_name(inner)
        if leaf is not None:
            return f"{leaf}[{','.join(dims)}]"
        return f"list[{value_type_name(inner)}]"
    return str(t)


def is_list_type(t: pa.DataType) -> bool:
    """Whether ``t`` is a list, large list or fixed-size list type."""
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _list_length(t: pa.DataType) -> str:
    return str(t.list_size) if pa.types.is_fixed_size_list(t) else "?"


def numpy_dtype(t: pa.DataType) -> tuple[np.dtype, np.dtype | None]:
    """(storage dtype, dtype to view/cast as) of a fixed-width number or temporal type.

    Example:
        >>> import pyarrow as pa
        >>> numpy_dtype(pa.int16()), numpy_dtype(pa.date32())
        ((dtype('int16'), None), (dtype('int32'), dtype('<M8[D]')))
    """
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
        return np.dtype(f"<{kind}{t.bit_width // 8}"), None
    if pa.types.is_timestamp(t) or pa.types.is_duration(t):
        kind = "datetime64" if pa.types.is_timestamp(t) else "timedelta64"
        return np.dtype("<i8"), np.dtype(f"{kind}[{t.unit}]")
    if pa.types.is_date(t):  # (date32: days, date64: milliseconds)
        unit = "D" if pa.types.is_date32(t) else "ms"
        return np.dtype(f"<i{t.bit_width // 8}"), np.dtype(f"datetime64[{unit}]")
    raise TypeError(f"no numpy dtype for {t}")


def _numpy_name(t: pa.DataType) -> str | None:
    """numpy dtype name of a fixed-width number or temporal type (None otherwise)."""
    try:
        storage, view = numpy_dtype(t)
    except TypeError:
        return None
    return (view or storage).name
