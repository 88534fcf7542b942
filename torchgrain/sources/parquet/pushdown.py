"""A pyarrow expression pushed down to a Parquet dataset: the rows that match it.

:func:`matching_rows` is the pass behind ``ParquetSource(..., filter=expression)`` and
``Dataset.filter(expression)``. A row group whose footer statistics (min, max, null count,
read by torchgrain's own parser) show that no row can match is never read; the others are
decoded with only the columns the expression names, and Arrow evaluates it. Pruning
trusts the statistics, as every engine that prunes by them does; an expression that casts
a column prunes nothing (see :func:`_prune`).

Design notes: docs/design-notes.md#parquet-pushdown.

Example:
    >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq, pyarrow.compute as pc
    >>> import torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"x": list(range(10))}), f"{d}/a.parquet", row_group_size=5)
    >>> stats = {}
    >>> rows = matching_rows(tg.ParquetSource(d), pc.field("x") >= 7, stats=stats)
    >>> np.concatenate(list(rows)).tolist(), stats
    ([7, 8, 9], {'row_groups': 2, 'row_groups_read': 1})
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from torchgrain.errors import CorruptDataError

__all__ = ["column_source", "matching_rows"]

_MAX_CASES = 64  # combinations of column states tried per row group; more: it is read
_ROW = "__torchgrain_row"
# Parquet physical type -> (numpy dtype of a plain-encoded statistic, Arrow types it holds)
_PLAIN = {
    0: ("|b1", (pa.bool_(),)),
    1: ("<i4", (pa.int8(), pa.int16(), pa.int32(), pa.date32())),
    2: ("<i8", (pa.int64(),)),
    4: ("<f4", (pa.float32(),)),
    5: ("<f8", (pa.float64(),)),
}
_UNSIGNED = {1: ("<u4", (pa.uint8(), pa.uint16(), pa.uint32())), 2: ("<u8", (pa.uint64(),))}


def matching_rows(
    src: Any, expression: pc.Expression, progress: bool = False, stats: dict | None = None
) -> Iterator[np.ndarray]:
    """The indices of ``src``'s rows (a :class:`~torchgrain.ParquetSource`) where
    ``expression`` is true, increasing, a row group at a time (see the module
    docstring). ``stats``, when given, gets ``row_groups`` and ``row_groups_read``.

    The expression may name any column of the files or hive partition key, whether
    ``src`` reads it or not (its ``columns``): the pass reads what the expression names.

    Raises:
        ValueError: the expression names no column of the files, or one they lack.
    """
    names, sub = _named_columns(src, expression)
    schema = pa.schema(_fields(src, sub, names))
    offsets = src._rg_offsets
    groups = src.num_row_groups
    keep = _prune(src, sub, schema, expression)
    out = {"row_groups": groups, "row_groups_read": 0}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=groups, unit="row group", desc="filter (pushdown)", file=sys.stderr, leave=False
        )
    try:
        for g in range(groups):
            first, stop = int(offsets[g]), int(offsets[g + 1])
            if keep[g] and stop > first:
                out["row_groups_read"] += 1
                # (times compared by Arrow, never made datetime.time: none refused)
                table = sub._decode(g, first, check_times=False)
                shard = int(src._rg_shard[g])
                for k in names:
                    if k in src._part_values:
                        value = src._part_values[k][shard : shard + 1].tolist()[0]
                        column = pa.array([value] * table.num_rows, schema.field(k).type)
                        table = table.append_column(schema.field(k), column)
                table = table.append_column(_ROW, pa.array(np.arange(first, stop)))
                rows = table.filter(expression).column(_ROW).to_numpy()
                if len(rows):
                    yield rows
            if bar is not None:
                bar.update(1)
    finally:
        sub.close()  # (its readers' descriptors: it is not used again)
        if bar is not None:
            bar.close()
        if stats is not None:
            stats.update(out)


def column_source(src: Any, columns: list[str], **options: Any) -> Any:
    """The files of ``src`` (a :class:`~torchgrain.ParquetSource`) opened again for
    ``columns`` only (no hive partition keys), for a one-off pass: no decoded disk cache,
    the same read options and limits otherwise (``options`` replace some). Its rows are
    ``src``'s, row group for row group (else ``CorruptDataError``: a file changed).

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_parquet(({"x": i, "s": str(i)} for i in range(4)), d)
        >>> column_source(tg.ParquetSource(d), ["x"]).read_columns([3])["x"].tolist()
        [3]
    """
    from torchgrain.sources.parquet.source import ParquetSource

    sub = ParquetSource(
        src.paths,
        columns=columns,
        options=src.options,
        partitioning=None,
        decoded_cache=False,
        max_row_group_bytes=src.max_row_group_bytes,
        int96_timestamp_unit=src.int96_timestamp_unit,
        **options,
    )
    # (the versions too: rows of the same row groups, rewritten, are other rows; a remote
    # file its store gives no version of is told by its row groups alone)
    same = [_same_version(a[1], b[1]) for a, b in zip(sub._identities, src._identities)]
    if not np.array_equal(sub._rg_offsets, src._rg_offsets) or not all(same):
        changed = src.paths[same.index(False)] if not all(same) else "their row groups"
        sub.close()
        raise CorruptDataError(
            f"the Parquet files of {src!r} changed since it was opened ({changed}): open it again"
        )
    return sub


def _same_version(a: tuple, b: tuple) -> bool:
    unversioned = any(isinstance(v, tuple) and v[:1] == ("unversioned",) for v in (*a, *b))
    return a == b or unversioned


def _named_columns(src: Any, expression: pc.Expression) -> tuple[list[str], Any]:
    """The columns of the files and hive partition keys ``expression`` names, whether
    ``src`` reads them or not: those whose name its text holds (a superset at worst),
    checked by binding it to them (else every column); with the files opened again for
    those columns (:func:`column_source`)."""
    every = list(dict.fromkeys([*src._file_columns, *src._part_values]))
    text = str(expression)
    named = [k for k in every if k in text]
    for names in [named] if named == every else [named, every]:
        sub = column_source(src, [k for k in names if k not in src._part_values], cache_bytes=0)
        empty = pa.table({f.name: pa.array([], f.type) for f in _fields(src, sub, names)})
        try:
            empty.filter(expression)
            return names, sub
        except (pa.ArrowException, TypeError) as e:
            error = e
            sub.close()
    raise ValueError(
        f"cannot filter {src!r} with {expression}: {error} (the columns of its files "
        f"and partition keys are {every})"
    ) from error


def _fields(src: Any, sub: Any, names: list[str]) -> list[pa.Field]:
    """The Arrow fields of ``names``: hive partition keys of ``src``, columns of ``sub``."""
    return [
        pa.field(k, src._part_types[k]) if k in src._part_values else sub.arrow_schema.field(k)
        for k in names
    ]


def _prune(src: Any, sub: Any, schema: pa.Schema, expression: pc.Expression) -> np.ndarray:
    """Whether each row group may hold a matching row (see the module docstring): all of
    them for an expression with a cast. Arrow simplifies ``cast(x) == c`` under a
    guarantee on ``x`` as ``x == c`` cast back to ``x``'s type, which a narrowing or
    unsafe cast makes wrong (``x.cast(float32) == float32(0.3)`` on a float64 ``x``
    holding 0.3 is true, yet pruned: 0.3f is 0.30000001 in float64, above the maximum)."""
    groups = src.num_row_groups
    keep = np.ones(groups, dtype=bool)
    if "cast(" in str(expression):
        return keep
    cases: list[tuple[int, pc.Expression]] = []
    for g in range(groups):
        states = [_states(src, sub, g, field) for field in schema]
        if math.prod(map(len, states)) > _MAX_CASES:
            continue
        for combo in itertools.product(*states):
            terms = [t for t in combo if t is not None]
            cases.append((g, functools.reduce(operator.and_, terms) if terms else pc.scalar(True)))
        keep[g] = False
    if not cases:
        return keep
    import pyarrow.dataset as pds  # (imported when needed: about 0.1 s)
    import pyarrow.fs as pfs

    # One fragment per case, with its guarantee as the "partition expression" Arrow
    # simplifies the filter under; nothing is read (the paths are names only).
    dataset = pds.FileSystemDataset.from_paths(
        [f"case{k}" for k in range(len(cases))],
        schema=schema,
        format=pds.IpcFileFormat(),
        filesystem=pfs.LocalFileSystem(),
        partitions=[c for _, c in cases],
    )
    for fragment in dataset.get_fragments(filter=expression):
        keep[cases[int(fragment.path[4:])][0]] = True
    return keep


def _states(src: Any, sub: Any, g: int, field: pa.Field) -> list[pc.Expression | None]:
    """What a row of row group ``g`` may be in column ``field``, each as a guarantee
    (None: anything)."""
    name, typ = field.name, field.type
    ref = pc.field(name)
    shard = int(src._rg_shard[g])
    if name in src._part_values:
        value = src._part_values[name][shard : shard + 1].tolist()[0]
        return [ref.is_null() if value is None else ref == pa.scalar(value, typ)]
    if pa.types.is_nested(typ):
        # A list's or struct's one leaf is not the column: a row group whose leaf is all
        # null holds empty lists and structs of null fields, which are not null.
        return [None]
    pos = [f.name for f in sub._file_fields].index(name)
    if not sub._present[shard, pos]:
        return [ref.is_null()]  # a column the file lacks reads as nulls
    reader = sub._reader(shard)
    try:
        if not reader.pf.schema_arrow.field(name).type.equals(typ):
            return [None]  # widened across files: its statistics are of another type
        leaves = reader.leaves((name,))
        if len(leaves) != 1:
            return [None]  # (a nested column)
        chunk = reader.footer()[int(src._rg_local[g])][leaves[0][0]]
    except (CorruptDataError, IndexError, KeyError):
        return [None]  # its decode says what is wrong with the file
    value_range = _range(chunk, typ)
    states: list[pc.Expression | None] = []
    if chunk.null_count is None or chunk.null_count > 0:
        states.append(ref.is_null())
    if chunk.null_count is not None and chunk.null_count >= chunk.num_values:
        return states  # nulls only
    if value_range is None:
        return [None]
    low, high = value_range
    states.append((ref >= low) & (ref <= high))
    if pa.types.is_floating(typ):
        states.append(ref == pa.scalar(float("nan"), typ))  # NaN lies outside min/max
    return states


def _range(chunk: Any, typ: pa.DataType) -> tuple[pa.Scalar, pa.Scalar] | None:
    """``(min, max)`` of a column chunk's statistics as scalars of ``typ``, or None when
    they are missing or do not fit it."""
    low, high, kind = chunk.min_value, chunk.max_value, chunk.physical_type
    if low is None or high is None:
        return None
    if kind == 6 and (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        try:
            values = [low.decode("utf-8"), high.decode("utf-8")]
        except UnicodeDecodeError:
            return None
    elif kind == 6 and (pa.types.is_binary(typ) or pa.types.is_large_binary(typ)):
        values = [low, high]
    else:
        unsigned = _UNSIGNED if pa.types.is_unsigned_integer(typ) else {}
        dtype, types = {**_PLAIN, **unsigned}.get(kind, ("", ()))
        if not any(typ.equals(t) for t in types):
            return None
        width = np.dtype(dtype).itemsize
        if len(low) != width or len(high) != width:
            return None
        raw = np.frombuffer(low + high, dtype=dtype)
        if pa.types.is_floating(typ) and np.isnan(raw).any():
            return None
        try:
            array = pa.array(raw).cast(typ)  # checked: out of the type's range fails
        except (pa.ArrowException, ValueError):
            return None
        values = [array[0], array[1]]
    scalars = [v if isinstance(v, pa.Scalar) else pa.scalar(v, typ) for v in values]
    if not pc.less_equal(scalars[0], scalars[1]).as_py():
        return None  # statistics that contradict themselves constrain nothing
    return scalars[0], scalars[1]
