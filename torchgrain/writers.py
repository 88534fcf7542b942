"""Writers: records into ArrayRecord and Parquet datasets, and each format's output side.

``write_array_record`` and ``write_parquet`` turn an iterable of record dicts into a
dataset. An :class:`OutputFormat` is what ``torchgrain convert`` (and its Beam pipeline)
needs to write a format, one :class:`ShardWriter` per output shard: a registry
:class:`~torchgrain.sources.registry.Format` names it as its ``output``, so a new output
format is one class here (or in the format's own module) and its registry entry.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> out = PARQUET_OUTPUT
    >>> compression, options = out.options(1, None)
    >>> w = out.open(os.path.join(d, "x" + out.suffix), compression=compression,
    ...              writer_options=options, row_group_bytes=1 << 20)
    >>> for i in range(3):
    ...     _ = w.add({"i": i})
    >>> w.close()
    >>> import pyarrow.parquet as pq
    >>> pq.read_table(w.path).column("i").to_pylist()
    [0, 1, 2]
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import datetime as dt
import decimal
import functools
import itertools
import math
import os
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    SchemaMismatchError,
    TorchgrainError,
)
from torchgrain.formats.checksums import RecordHasher, file_checksum, verify_file, verify_shard
from torchgrain.formats.codecs import MsgpackCodec, get_codec, merge_schema, schema_sampled
from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo, read_manifest
from torchgrain.io.atomic import atomic_path, atomic_write_text, publish, temp_name
from torchgrain.io.fs import expand_paths, get_filesystem, is_local
from torchgrain.io.paths import local_file_in
from torchgrain.sources.node_index import INDEX_NAME, write_dataset_index
from torchgrain.sources.parquet.paths import PARQUET_SUFFIXES
from torchgrain.sources.parquet.schema import arrow_type_name, common_type

__all__ = [
    "ARRAY_RECORD_OUTPUT",
    "PARQUET_COMPRESSIONS",
    "PARQUET_OUTPUT",
    "ArrayRecordOutput",
    "OutputFormat",
    "ParquetOutput",
    "ShardWriter",
    "array_record_options",
    "check_shard_schemas",
    "records_to_table",
    "shard_name",
    "write_array_record",
    "write_parquet",
]


def shard_name(
    index: int, num_shards: int, prefix: str = "data", suffix: str = ".array_record"
) -> str:
    """File name of shard ``index`` of ``num_shards``.

    Example:
        >>> shard_name(3, 8), shard_name(0, 2, suffix=".parquet")
        ('data-00003-of-00008.array_record', 'data-00000-of-00002.parquet')
    """
    return f"{prefix}-{index:05d}-of-{num_shards:05d}{suffix}"


def array_record_options(group_size: int, compression: str) -> str:
    """The ArrayRecord writer options string for a group size and a compression.

    Example:
        >>> array_record_options(1, "zstd:3")
        'group_size:1,zstd:3'
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    allowed = ("zstd", "snappy", "brotli", "uncompressed")
    if compression.split(":", 1)[0] not in allowed:
        raise ValueError(f"compression must be one of {allowed} (optionally 'zstd:LEVEL')")
    return f"group_size:{group_size},{compression}"


def write_array_record(
    records: Iterable[dict[str, Any]],
    directory: str | os.PathLike,
    *,
    num_shards: int = 1,
    group_size: int = 1,
    codec: str = "msgpack",
    compression: str = "zstd:3",
    prefix: str = "data",
    overwrite: bool = False,
) -> list[str]:
    """Write records as ``num_shards`` ArrayRecord files plus a JSON manifest.

    Values may be numpy arrays of any numeric/bool/bytes dtype and shape, int, float,
    str, bytes, bool, None, and lists of these. Shard sizes differ by at most one:
    when ``records`` has a length (a list, a Dataset) shard ``i`` gets a contiguous
    slice, so the dataset's global order is the input order; a plain iterator is dealt
    round-robin (record ``k`` goes to shard ``k % num_shards``).

    Every shard is written under a hidden temporary name and renamed when complete, and
    the manifest is written last, so a crash never leaves a partial shard that looks
    complete. Beside the shards goes ``torchgrain.tgindex``, the dataset's index (every
    chunk's offset and size), which every process reading the dataset maps instead of
    parsing the shards' footers (:mod:`torchgrain.sources.node_index`).

    Args:
        records: iterable of dicts with str keys.
        directory: output directory (created if needed). Local paths only.
        num_shards: number of shard files.
        group_size: records per ArrayRecord chunk. 1 gives the fastest random access;
            larger groups compress better and suit sequential or block-shuffled reads.
        codec: record codec name (``"msgpack"`` by default).
        compression: ``zstd[:LEVEL]``, ``snappy``, ``brotli`` or ``uncompressed``.
        prefix: shard file name prefix.
        overwrite: replace an existing torchgrain dataset in ``directory``, or files of
            the names this write gives its shards (without it, either is a
            ``FileExistsError``).

    Returns:
        The shard paths, in dataset order.

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> recs = [{"x": np.full(2, i, np.uint8), "label": i} for i in range(5)]
        >>> paths = tg.write_array_record(recs, d, num_shards=2)
        >>> [p.rsplit("/", 1)[-1] for p in paths]
        ['data-00000-of-00002.array_record', 'data-00001-of-00002.array_record']
        >>> tg.ArrayRecordSource(d)[4]["label"]
        4
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    fs, root = get_filesystem(directory)
    if not is_local(fs):
        raise NotImplementedError(
            f"write_array_record writes local directories; write locally and upload {directory!r}"
        )
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    manifest_path = os.path.join(root, MANIFEST_NAME)
    if os.path.exists(manifest_path) and not overwrite:
        raise FileExistsError(
            f"{root} already holds a torchgrain dataset ({MANIFEST_NAME}); pass overwrite=True"
        )
    names = [shard_name(i, num_shards, prefix) for i in range(num_shards)]
    taken = [n for n in names if os.path.lexists(os.path.join(root, n))]
    if taken and not overwrite:  # (files of another writer: no manifest lists them)
        raise FileExistsError(
            f"{root} already holds {taken[0]!r}, a shard this write would replace; pass "
            "overwrite=True"
        )
    try:
        old = read_manifest(fs, root)
    except CorruptDataError:
        old = None  # overwriting a damaged dataset: its manifest is replaced below
    enc = get_codec(codec)
    if not callable(getattr(enc, "encode", None)):
        raise ValueError(f"codec {codec!r} cannot encode records")
    options = array_record_options(group_size, compression)

    finals = [os.path.join(root, n) for n in names]
    temps = [temp_name(f) for f in finals]
    counts = [0] * num_shards
    hashers = [RecordHasher() for _ in range(num_shards)]
    schema: dict[str, str] = {}
    writers: list[Any] = []
    try:
        total = len(records) if isinstance(records, Sized) else -1
        bounds = [total * i // num_shards for i in range(1, num_shards + 1)]
        writers = [ArrayRecordWriter(t, options) for t in temps]
        k = -1
        for k, rec in enumerate(records):
            if total >= 0 and k >= total:
                raise TorchgrainError(f"records yielded more than its length {total}")
            try:
                data = enc.encode(rec)
            except (TypeError, ValueError) as e:
                raise TypeError(f"cannot encode record {k}: {e}") from e
            # Contiguous slices keep the input order; round-robin for iterators of
            # unknown length.
            s = bisect.bisect_right(bounds, k) if total >= 0 else k % num_shards
            writers[s].write(data)
            hashers[s].update(data)
            counts[s] += 1
            if schema_sampled(k):
                schema = merge_schema(schema, rec)
        if total >= 0 and k + 1 != total:
            raise TorchgrainError(f"records yielded {k + 1} items but its length is {total}")
        for w in writers:
            w.close()
        writers = []
        # Replacing a dataset: first retire the old manifest, then every old shard, and
        # only then publish the new shards. A crash in between leaves either complete new
        # shards without a manifest (still readable, counted from their footers) or an
        # incomplete -of-N shard set, which sources refuse: never old and new mixed.
        # The old manifest is data: a file it names outside the dataset ("../x", an
        # absolute path, a link to another directory) is not the dataset's to remove.
        old_shards = old.shards if old is not None else []
        for name in (MANIFEST_NAME, INDEX_NAME, *(info.path for info in old_shards)):
            stale = local_file_in(root, name)
            if stale is not None and os.path.exists(stale):
                os.unlink(stale)
        shards = []
        for t, f, n, c, h in zip(temps, finals, names, counts, hashers):
            publish(t, f)
            shards.append(
                ShardInfo(
                    path=n,
                    num_records=c,
                    num_bytes=os.path.getsize(f),
                    checksum=h.hexdigest(),
                    file_checksum=file_checksum(f),
                )
            )
        manifest = Manifest(codec=enc.name, shards=shards, schema=schema)
        manifest.extra["compression"] = compression
        # The group size, and every chunk's offset and size (the dataset's index, mapped by
        # every process that reads it: torchgrain.sources.node_index) with its checksum.
        ARRAY_RECORD_OUTPUT.finish(root, manifest, group_size)
        atomic_write_text(manifest_path, manifest.to_json())
    finally:
        for w in writers:
            with contextlib.suppress(Exception):
                w.close()
        for t in temps:
            if os.path.exists(t):
                os.unlink(t)
    return finals


def records_to_table(
    records: Sequence[dict[str, Any]], schema: pa.Schema | None = None, *, first: int = 0
) -> Any:
    """Build a ``pyarrow.Table`` from record dicts (the Parquet writer of :func:`convert`).

    numpy arrays become (nested) lists of their dtype, so :class:`~torchgrain.ParquetSource`
    reads 1-D arrays back as arrays of the same dtype; numpy scalars keep their dtype (but
    ``datetime64[s]``: Parquet stores it in milliseconds, exactly, read back as
    ``datetime64[ms]``); ``None`` is a null. Lists beside arrays in a column (Python scalars beside numpy
    scalars) are written with the arrays' dtype, nulls kept, each item held exactly (not
    1.5 or ``True`` for int16, nor 300 for int8). Other values go through
    ``pyarrow.array``'s inference, except Python ints past int64 (at any depth: in lists,
    dicts), which make their place uint64. A key missing from some records is null there.

    With ``schema`` (a ``pyarrow.Schema``: a Parquet source's columns), its columns come
    first, each of its type (a column no record has: nulls), then the records' other keys
    as above; a value that its column's type does not hold exactly (an int past the
    type's range, a float it would round, a string in a binary column, a number in a
    date, time or duration column) is an error.

    Errors number the records from ``first`` (the index of ``records[0]`` in a longer
    input written a batch at a time).

    Raises:
        TypeError: a column holds arrays of different dtypes or ranks, a value beside
            arrays that their dtype does not hold exactly or of another shape (the message
            names the record), an int past int64 beside a negative one, past 2**64 or
            beside floats (the message names the record), a str beside bytes, a bool
            (or numpy float16) beside numbers, a datetime beside dates or a number
            beside dates, datetimes, durations or times that inference would write as
            the others' type, numpy datetime64 scalars beside numpy numbers (which
            pyarrow's inference cannot take: it crashes), a pandas Timestamp or Timedelta with
            nanoseconds (inferred as microseconds), a time with a UTC offset or a set
            (the message names the records), or a value its ``schema`` type does not
            (the message names the column).

    Example:
        >>> import numpy as np, pyarrow as pa
        >>> t = records_to_table([{"x": np.arange(3, dtype=np.int16), "s": "a"},
        ...                       {"x": np.arange(2, dtype=np.int16), "s": None}])
        >>> t.schema.field("x").type, t.column("s").to_pylist()
        (ListType(list<item: int16>), ['a', None])
        >>> records_to_table([{"u": 200}], pa.schema({"u": pa.uint8()})).schema.field("u").type
        DataType(uint8)
        >>> records_to_table([{"u": 300}], pa.schema({"u": pa.uint8()}))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: cannot store key 'u' in Parquet as its source's uint8: ...
    """
    fields: list[Any] = [] if schema is None else list(schema)
    typed = {f.name for f in fields}
    fields += dict.fromkeys(k for r in records for k in r if k not in typed)
    arrays = []
    for i, f in enumerate(fields):
        k = f.name if isinstance(f, pa.Field) else f
        if not isinstance(k, str):
            at = next(j for j, r in enumerate(records, first) if k in r)
            raise TypeError(f"record keys must be str, got {k!r} (record {at})")
        values = [r.get(k) for r in records]
        try:
            arrays.append(
                _column(values, first) if isinstance(f, str) else _typed_column(values, f.type)
            )
        except (TypeError, ValueError, OverflowError, pa.ArrowException) as e:
            what = "" if isinstance(f, str) else f" as its source's {f.type}"
            raise TypeError(f"cannot store key {k!r} in Parquet{what}: {e}") from e
        fields[i] = pa.field(f, arrays[-1].type) if isinstance(f, str) else f
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _typed_column(values: list[Any], kind: Any) -> Any:
    """``values`` as an Arrow array of type ``kind``, each value held exactly (else a
    ValueError or TypeError)."""
    _check_leaf(values, kind)
    if pa.types.is_float16(kind) or pa.types.is_float32(kind):
        # Arrow rounds a Python float to the narrower type without a word.
        mask = np.fromiter((v is None for v in values), bool, len(values))
        wide = np.array([0.0 if v is None else v for v in values], dtype=np.float64)
        with np.errstate(over="ignore"):  # (past the type's range: refused below)
            narrow = wide.astype(f"<f{kind.bit_width // 8}")
        bad = (narrow != wide) & ~(np.isnan(wide) & np.isnan(narrow))
        if bad.any():
            raise ValueError(f"{values[int(np.argmax(bad))]!r} is not a {_float_in(kind)} value")
        if any(issubclass(t, (int, np.integer)) for t in set(map(type, values))):
            # An int past 2**53 is rounded by float64 already (2**53 + 1 to 2**53).
            for i, v in enumerate(values):
                if isinstance(v, (int, np.integer)) and int(narrow[i]) != v:
                    raise ValueError(f"{v!r} is not a {_float_in(kind)} value")
        return pa.array(narrow, type=kind, mask=mask if mask.any() else None)
    temporal = _temporal_unit(kind)
    if temporal is not None:
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, (np.datetime64, np.timedelta64)) for v in present):
            # What a ParquetSource returns; Arrow takes such scalars only of a type
            # without a time zone, and of its own unit.
            if len({v.dtype for v in present}) == 1:
                within = _in_units(np.array(present), kind)
            else:  # (one array of them would be in the finest unit: a year 2500 wraps in ns)
                within = np.array([_in_units(v, kind) for v in present], dtype=temporal)
            mask = np.fromiter((v is None for v in values), bool, len(values))
            full = np.zeros(len(values), dtype=temporal)
            full[~mask] = within
            return _from_numpy(full, mask).cast(kind)
    arrays = [v for v in values if v is not None] if _is_list(kind) else []
    if arrays and all(isinstance(v, np.ndarray) and v.ndim for v in arrays):
        # Arrow builds lists from 1-D arrays only, and casts their values to the type
        # without a word: nested lists from numpy's shapes, of the arrays' own dtype,
        # then cast to the column's list type (fixed size, large) if another.
        built = _column(values, fixed=_fixed_sizes(kind))
        if not _same_leaves(built.type, kind):
            raise TypeError(f"it holds arrays of {built.type}")
        return built.cast(kind)
    if _is_nested(kind):
        # Square rows (2-D arrays) beside ragged ones (lists of arrays), or in structs and
        # maps: Arrow takes 1-D arrays only; and it casts a nested array's values, or a
        # float in an integer leaf, without a word (1.5 to 1).
        values = [_exact(v, kind) for v in values]
    wide_kind = _widened(kind)
    if _first(kind, _temporal_unit) is not None:
        # Timestamps and dates inside structs or maps: Arrow builds them from numpy
        # scalars of the type's own unit only, zoneless (cast after) and dates as ints.
        values = [_in_units(v, kind) for v in values]
    if wide_kind.equals(kind):
        return pa.array(values, type=kind)
    # float16/float32 values inside lists, structs or maps: Arrow rounds a Python float
    # to them without a word, so they are built as float64 and checked to round trip.
    wide = pa.array(values, type=wide_kind)
    narrow = wide.cast(kind)
    for a, b in zip(_float_leaves(wide), _float_leaves(narrow.cast(wide_kind))):
        x, y = a.to_numpy(zero_copy_only=False), b.to_numpy(zero_copy_only=False)
        bad = (x != y) & ~(np.isnan(x) & np.isnan(y))
        if bad.any():
            raise ValueError(f"{float(x[int(np.argmax(bad))])!r} is not a {_float_in(kind)} value")
    return narrow


@functools.lru_cache(maxsize=1024)  # (called per value of nested columns)
def _takes(kind: Any) -> tuple[type, ...] | None:
    """The Python (and numpy) types whose values Arrow type ``kind`` takes as they are;
    None for a type whose values are left to pyarrow."""
    t = pa.types
    table = (
        (t.is_integer(kind), (int, np.integer)),
        (t.is_floating(kind), (float, int, np.floating, np.integer)),
        (t.is_string(kind) or t.is_large_string(kind), (str,)),
        (
            t.is_binary(kind) or t.is_large_binary(kind) or t.is_fixed_size_binary(kind),
            (bytes, bytearray, memoryview),
        ),
        (t.is_boolean(kind), (bool, np.bool_)),
        # (a number would be a count of the unit: 5 as 1970-01-06)
        (t.is_date(kind), (dt.date, np.datetime64)),
        (t.is_timestamp(kind), (dt.datetime, np.datetime64)),
        (t.is_duration(kind), (dt.timedelta, np.timedelta64)),
        (t.is_time(kind), (dt.time,)),
    )
    return next((types for match, types in table if match), None)


def _foreign(typ: type, allowed: tuple[type, ...]) -> bool:
    """Whether values of Python type ``typ`` are none of ``allowed`` (see :func:`_takes`;
    a bool is an int or a float nowhere)."""
    return not issubclass(typ, allowed) or (
        issubclass(typ, (bool, np.bool_)) and bool not in allowed
    )


def _widened(kind: Any) -> Any:
    """``kind`` with every float16 and float32 in it float64 and every timestamp zoneless."""
    t = pa.types
    if t.is_float16(kind) or t.is_float32(kind):
        return pa.float64()
    if t.is_timestamp(kind):
        return pa.timestamp(kind.unit)
    if t.is_map(kind):
        return pa.map_(
            kind.key_field.with_type(_widened(kind.key_type)),
            kind.item_field.with_type(_widened(kind.item_type)),
        )
    if _is_list(kind):
        field = kind.value_field.with_type(_widened(kind.value_type))
        if t.is_large_list(kind):
            return pa.large_list(field)
        return pa.list_(field, getattr(kind, "list_size", -1))
    if t.is_struct(kind):
        return pa.struct([f.with_type(_widened(f.type)) for f in kind])
    return kind


def _exact(value: Any, kind: Any) -> Any:
    """``value`` as Arrow holds it exactly in nested type ``kind``: each array of two or
    more dimensions a list of 1-D arrays where ``kind`` has a list of lists, each array
    checked against its place (:func:`_check_array`) and each value in a leaf of a type
    :func:`_takes` knows of a type it takes (an int in an integer leaf, bytes in a binary
    one), at any depth; else a TypeError (a set too, see :func:`_unordered`; a ValueError
    for a Python datetime, time or timedelta its temporal leaf would truncate, see
    :func:`_python_step`).

    Example:
        >>> import pyarrow as pa
        >>> _exact({"m": np.eye(2)}, pa.struct({"m": pa.list_(pa.list_(pa.float64()))}))
        {'m': [array([1., 0.]), array([0., 1.])]}
        >>> _exact({"a": [1, 1.5]}, pa.struct({"a": pa.list_(pa.int32())}))
        Traceback (most recent call last):
        ...
        TypeError: it holds 1.5 (float)
    """
    if isinstance(value, np.ndarray) and _is_list(kind):
        _check_array(value, kind)
        if value.ndim > 1 and _is_matrix(kind):
            inner = kind.value_type
            return [_exact(v, inner) for v in value] if _is_matrix(inner) else list(value)
    elif isinstance(value, (set, frozenset)):
        _unordered((type(value),))
    elif isinstance(value, (list, tuple)) and _is_list(kind):
        inner = kind.value_type
        if _is_nested(inner):
            return [_exact(v, inner) for v in value]
        _check_leaf(value, inner)
    elif _is_nested(kind):  # (its types hash slowly: none looked up per value here)
        return _in_fields(value, kind, _exact)
    else:
        _check_leaf((value,), kind)
    return value


def _check_leaf(values: Sequence[Any], kind: Any) -> None:
    """A TypeError or ValueError where leaf type ``kind`` does not hold ``values`` as
    they are: one of a type it does not take (see :func:`_takes`), or a time finer than
    its unit (see :func:`_python_step`)."""
    if (allowed := _takes(kind)) is not None:
        _check_types(values, allowed)
    if (step := _python_step(kind)) is not None:
        _check_steps(values, kind, step)


@functools.lru_cache(maxsize=1024)
def _python_step(kind: Any) -> int | None:
    """The nanoseconds of which a Python datetime's or time's time of day, or a
    timedelta, must be a multiple for temporal type ``kind`` to hold it (Arrow truncates
    it to the type's unit without a word: 12:00:00.5 to 12:00:00, noon to a date, a
    pandas Timestamp's nanoseconds to microseconds); None where every one is held (1 for
    time64[ns]: a time with a UTC offset is not, see :func:`_check_steps`)."""
    t = pa.types
    if t.is_date(kind):
        return 86_400_000_000_000
    if t.is_timestamp(kind) or t.is_duration(kind) or t.is_time(kind):
        step = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000}.get(kind.unit)
        return 1 if step is None and t.is_time(kind) else step
    return None


def _check_steps(values: Iterable[Any], kind: Any, step: int) -> None:
    """A ValueError naming the first Python datetime, time or timedelta of ``values``
    that is no multiple of ``step`` nanoseconds (see :func:`_python_step`; pandas'
    Timestamp and Timedelta, their subclasses, count their nanoseconds too), or time
    with a UTC offset (Arrow writes it as the naive time, the offset dropped).

    Example:
        >>> _check_steps([dt.timedelta(seconds=1.5)], pa.duration("s"), 1_000_000_000)
        Traceback (most recent call last):
        ...
        ValueError: datetime.timedelta(seconds=1, microseconds=500000) is not a duration[s] value
    """
    for v in values:
        if isinstance(v, dt.timedelta):
            ns = v // dt.timedelta(microseconds=1) * 1_000 + getattr(v, "nanoseconds", 0)
        elif isinstance(v, (dt.datetime, dt.time)):
            if isinstance(v, dt.time) and v.utcoffset() is not None:
                raise ValueError(f"{v!r} has a UTC offset, which a {kind} value does not hold")
            us = ((v.hour * 60 + v.minute) * 60 + v.second) * 1_000_000 + v.microsecond
            ns = us * 1_000 + getattr(v, "nanosecond", 0)
        else:
            continue
        if ns % step:
            raise ValueError(f"{v!r} is not a {kind} value")


def _is_nested(kind: Any) -> bool:
    """Whether type ``kind`` is a list, struct or map."""
    return _is_list(kind) or pa.types.is_struct(kind) or pa.types.is_map(kind)


def _check_types(values: Sequence[Any], allowed: tuple[type, ...]) -> None:
    """A TypeError naming the first of ``values`` (None aside) of a type that is none of
    ``allowed`` (see :func:`_foreign`; a 0-d numpy datetime64 or timedelta64 array, as
    msgpack gives such scalars back, is its scalar).

    Example:
        >>> _check_types([np.array(np.datetime64(1, "D")), None], (dt.date, np.datetime64))
        >>> _check_types([dt.date(2020, 1, 2), 5], (dt.date, np.datetime64))
        Traceback (most recent call last):
        ...
        TypeError: it holds 5 (int)
    """
    bad = {t for t in set(map(type, values)) if t is not type(None) and _foreign(t, allowed)}
    if bad:  # (the first such value, whatever order a set of types iterates in)
        for v in values:
            if type(v) in bad and not (isinstance(v, np.ndarray) and _temporal_0d(v, allowed)):
                raise TypeError(f"it holds {v!r} ({type(v).__name__})")


def _temporal_0d(value: np.ndarray, allowed: tuple[type, ...]) -> bool:
    """Whether ``value`` is a 0-d datetime64 or timedelta64 array of a type ``allowed``."""
    kind = value.dtype.type
    return not value.ndim and kind in (np.datetime64, np.timedelta64) and kind in allowed


def _in_fields(value: Any, kind: Any, fn: Any) -> Any:
    """``value`` with ``fn(item, its type)`` applied to each of its fields (a dict where
    ``kind`` is a struct) or keys and items (pairs or a dict, as pairs, where ``kind`` is a
    map); else as it is. A TypeError where a dict has keys its struct type lacks (Arrow drops them without a word).
    """
    if pa.types.is_struct(kind) and isinstance(value, dict):
        fields = _field_types(kind)
        if not value.keys() <= fields.keys():
            other = [k for k in value if k not in fields]
            raise TypeError(f"it holds a dict with keys {other} that {kind} lacks")
        return {k: fn(v, fields[k]) for k, v in value.items()}
    if pa.types.is_map(kind) and isinstance(value, (list, tuple, dict)):
        if isinstance(value, dict):
            value = list(value.items())
        return [
            (fn(p[0], kind.key_type), fn(p[1], kind.item_type))
            if isinstance(p, tuple) and len(p) == 2
            else p
            for p in value
        ]
    return value


@functools.lru_cache(maxsize=1024)
def _field_types(kind: Any) -> dict[str, Any]:
    """Field name -> type of struct type ``kind``."""
    return {f.name: f.type for f in kind}


def _check_array(value: np.ndarray, kind: Any) -> None:
    """A TypeError where list type ``kind`` would not hold array ``value`` as it is:
    another shape (see :func:`_check_shape`), or items its leaves hold otherwise (Arrow
    casts an array's values without a word: 1.5 to int 1)."""
    _check_shape(value, _fixed_sizes(kind))
    while _is_list(kind):
        kind = kind.value_type
    allowed = _takes(kind)
    if allowed is not None and value.dtype != object and _foreign(value.dtype.type, allowed):
        raise TypeError(f"it holds an array of {value.dtype}, not {kind} values")


def _is_matrix(kind: Any) -> bool:
    """Whether type ``kind`` is a list of lists (where a 2-D array goes)."""
    return _is_list(kind) and _is_list(kind.value_type)


_DAY_MS = 86_400_000  # a day in a date64's ms


def _in_units(value: Any, kind: Any) -> Any:
    """``value`` with each numpy datetime64/timedelta64 in it in the unit of its place
    in ``kind`` (a date's as an int, which Arrow takes); ValueError where one would lose
    precision."""
    unit = _temporal_unit(kind)
    if unit is not None and isinstance(value, (np.ndarray, np.datetime64, np.timedelta64)):
        got = np.asarray(value)
        if got.dtype.kind in "mM" and got.dtype != np.dtype(unit):
            if got.dtype.kind != np.dtype(unit).kind:
                raise TypeError(f"it holds {got.dtype} values")
            within = got.astype(unit)
            # Back in its own unit: a value past the other unit's range wraps without a
            # word (a year 2500 in ns), and compares equal in the finer unit too.
            same = (within.astype(got.dtype) == got) | np.isnat(got)
            if not same.all():
                raise ValueError(f"{got.flat[int(np.argmin(same))]!r} is not a {kind} value")
            got = within
        if pa.types.is_date64(kind) and got.dtype.kind == "M":
            # A date64 holds whole days: Arrow takes any ms, which Parquet writes as the
            # day it truncates to (1969-12-31T05:00 as 1970-01-01).
            whole = (got.astype(np.int64) % _DAY_MS == 0) | np.isnat(got)
            if not whole.all():
                raise ValueError(f"{got.flat[int(np.argmin(whole))]!r} is not a {kind} value")
        if isinstance(value, np.ndarray) and value.ndim:
            return got
        if np.isnat(got):  # (a scalar, or a 0-d array as msgpack decodes one in a list)
            return None  # a null (Arrow refuses a NaT date scalar)
        return int(got.astype(np.int64)) if pa.types.is_date(kind) else got[()]
    if _is_list(kind) and isinstance(value, (list, tuple, np.ndarray)):
        if isinstance(value, np.ndarray) and value.dtype.kind in "mM":
            got = _in_units(value, kind.value_type)
            if not np.isnat(got).any():
                # Arrow takes a list of dates as ints (as datetime64[D], only alone: not
                # beside a Python list of them).
                return got.astype(np.int64) if pa.types.is_date(kind.value_type) else got
            value = list(got)  # each NaT None, below
        return [_in_units(v, kind.value_type) for v in value]
    return _in_fields(value, kind, _in_units)


def _float_leaves(array: Any) -> Iterator[Any]:
    """The float64 arrays at the bottom of a (nested) array, in order."""
    t = array.type
    if pa.types.is_float64(t):
        yield array
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            yield from _float_leaves(array.field(i))
    elif pa.types.is_map(t):
        yield from _float_leaves(array.keys)
        yield from _float_leaves(array.items)
    elif _is_list(t):
        yield from _float_leaves(array.flatten())


def _first(kind: Any, test: Any) -> Any:
    """The first type in ``kind`` (itself, then its fields' depth first) that ``test``
    holds for, or None."""
    if test(kind):
        return kind
    found = (_first(kind.field(i).type, test) for i in range(kind.num_fields))
    return next((t for t in found if t is not None), None)


def _float_in(kind: Any) -> str:
    """The name of the first float16 or float32 type in ``kind``."""
    narrow = _first(kind, lambda t: pa.types.is_float16(t) or pa.types.is_float32(t))
    return np.dtype(f"<f{narrow.bit_width // 8}").name


def _temporal_unit(kind: Any) -> str | None:
    """The numpy dtype (``datetime64[us]``...) of an Arrow date, timestamp or duration
    type; None for another."""
    if pa.types.is_timestamp(kind):
        return f"datetime64[{kind.unit}]"
    if pa.types.is_duration(kind):
        return f"timedelta64[{kind.unit}]"
    return _DATES.get(kind.id)


_DATES = {pa.date32().id: "datetime64[D]", pa.date64().id: "datetime64[ms]"}  # by Arrow type id


def _is_list(kind: Any) -> bool:
    return isinstance(kind, (pa.ListType, pa.LargeListType, pa.FixedSizeListType))


def _fixed_sizes(kind: Any) -> tuple[int, ...]:
    """The sizes of the fixed-size lists innermost in list type ``kind`` (those of an
    array's last dimensions there).

    Example:
        >>> import pyarrow as pa
        >>> _fixed_sizes(pa.list_(pa.list_(pa.list_(pa.float32(), 3), 4)))
        (4, 3)
        >>> _fixed_sizes(pa.list_(pa.list_(pa.float32()), 4))
        ()
    """
    sizes: tuple[int, ...] = ()
    while _is_list(kind):
        sizes = (*sizes, kind.list_size) if pa.types.is_fixed_size_list(kind) else ()
        kind = kind.value_type
    return sizes


def _same_leaves(a: Any, b: Any) -> bool:
    """Whether list types ``a`` and ``b`` nest alike down to the same value type."""
    if _is_list(a) and _is_list(b):
        return _same_leaves(a.value_type, b.value_type)
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        return a.unit == b.unit
    return a.equals(b)


_LIST_ITEMS = 2**31 - 1  # the most items a batch's lists hold at one level (int32 offsets)


def _column(values: list[Any], first: int = 0, fixed: tuple[int, ...] = ()) -> Any:
    """``values`` as an Arrow array, errors numbering them from ``first``; ``fixed``: the
    sizes of the innermost dimensions of its arrays that their column's type records
    (its fixed-size lists, see :func:`_fixed_sizes`)."""
    numpy = [isinstance(v, (np.ndarray, np.generic)) for v in values]
    if any(numpy) and any(isinstance(v, np.ndarray) and v.dtype == object for v in values):
        # Arrays of objects: their items, as lists (pyarrow infers them as it infers lists).
        values = [
            _as_inferred(v) if isinstance(v, np.ndarray) and v.dtype == object else v
            for v in values
        ]
        numpy = [isinstance(v, (np.ndarray, np.generic)) for v in values]
    present = [v for v in values if v is not None]
    if any(numpy) and len(present) != sum(numpy):
        return _beside_arrays(values, numpy, first)
    if any(numpy):  # (every value a numpy array or scalar, or None)
        arrs = [np.asarray(v) for v in present]
        dtypes = {a.dtype for a in arrs}
        ndims = {a.ndim for a in arrs}
        if len(dtypes) != 1 or len(ndims) != 1:
            raise TypeError(
                f"arrays of different dtypes/ranks in one column: "
                f"{sorted(str(d) for d in dtypes)}, ndim {sorted(ndims)}"
            )
        dtype, ndim = dtypes.pop(), ndims.pop()
        for a in arrs:
            _check_shape(a, fixed)
        mask = np.array([v is None for v in values])
        if ndim == 0:
            flat = np.zeros(len(values), dtype=dtype)
            flat[~mask] = [a[()] for a in arrs]
            return _from_numpy(flat, mask)
        out = _from_numpy(np.concatenate([a.ravel() for a in arrs]))
        shapes = [(0,) * ndim if v is None else np.shape(v) for v in values]
        # Innermost level first: level k has prod(shape[:k]) lists of shape[k] items each.
        for level in range(ndim - 1, -1, -1):
            counts = [math.prod(s[:level]) for s in shapes] if level else 1
            lengths = np.repeat(np.array([s[level] for s in shapes], np.int64), counts)
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            if offsets[-1] > _LIST_ITEMS:
                raise ValueError(
                    f"too many elements for one batch: {offsets[-1]} at one list level of its "
                    f"arrays, past {_LIST_ITEMS} (a Parquet list's int32 offsets)"
                )
            offsets = offsets.astype(np.int32)
            nulls = pa.array(mask) if level == 0 and mask.any() else None
            out = pa.ListArray.from_arrays(pa.array(offsets), out, mask=nulls)
        return out
    try:
        places = _Place(values)
    except TypeError as whole:  # (the shortest prefix that fails names the record)
        lo, hi = 1, len(values)
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                _Place(values[:mid])
                lo = mid + 1
            except TypeError:
                hi = mid
        try:  # (the message of what the values up to that record hold)
            _Place(values[:lo])
        except TypeError as e:
            raise TypeError(f"{e} (record {first + lo - 1})") from None
        raise TypeError(f"{whole} (record {first + lo - 1})") from None
    try:
        built = pa.array(values)
    except (OverflowError, TypeError, pa.ArrowInvalid) as e:  # ('a' first: a TypeError)
        # Python ints past int64, at any depth: uint64 (msgpack keeps both ranges).
        kind = _uint64_type(values, first)
        if kind is not None:
            built = pa.array(values, kind)
        elif (kind := _temporal_inferred(values)) is not None:
            built = _typed_column(values, kind)
        else:
            raise TypeError(f"{e} ({_clash(values, first)})") from e
    try:
        _check_inferred(values, built.type, places)
    except TypeError as e:
        raise TypeError(f"{e} ({_clash(values, first)})") from e
    return built


class _Place:
    """The Python types of the values at one place of a column (its values, a list's
    items, a dict key's values, at any depth: ``types``) and of the places inside them
    (``items``, ``fields``): one walk over a column's values, before pyarrow sees them
    (a TypeError where numpy datetime64 scalars share a place with any other numpy
    scalar: pyarrow's inference of those kills the process with SIGSEGV, pyarrow 26) and for
    :func:`_check_inferred` after.

    Example:
        >>> _Place([[1, 2], None, [3]]).items.types == {int}
        True
        >>> _Place([[np.datetime64(1, "s")], [np.int16(3)]])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: it holds numpy datetime64 beside numpy int16 values ...
    """

    __slots__ = ("fields", "items", "types")

    def __init__(self, values: list[Any], types: set[type] | None = None) -> None:
        if types is None:
            types = set(map(type, values))
            if any(issubclass(t, np.ndarray) for t in types):
                values = [_as_inferred(v) if isinstance(v, np.ndarray) else v for v in values]
                types = set(map(type, values))
        self.types = types
        self.items: _Place | None = None
        self.fields: dict[Any, _Place] = {}
        if np.datetime64 in types:
            others = [t for t in types if issubclass(t, np.generic) and t is not np.datetime64]
            other = min(others, key=lambda t: t.__name__, default=None)
            if other is not None:
                raise TypeError(
                    f"it holds numpy datetime64 beside numpy {other.__name__} values (as items "
                    "of lists or arrays, or values of a dict key), which pyarrow cannot take "
                    "together"
                )
        if any(issubclass(t, _LISTS) for t in types):
            lists = [v for v in values if isinstance(v, _LISTS)]
            inner = set(map(type, itertools.chain.from_iterable(lists)))  # (no list built)
            deeper = any(issubclass(t, _NESTED) for t in inner)
            items = list(itertools.chain.from_iterable(lists)) if deeper else []
            self.items = _Place(items) if deeper else _Place([], inner)
        if any(issubclass(t, dict) for t in types):
            dicts = [v for v in values if isinstance(v, dict)]
            for key in dict.fromkeys(k for d in dicts for k in d):
                self.fields[key] = _Place([d.get(key) for d in dicts])


def _as_inferred(a: np.ndarray) -> Any:
    """What pyarrow's inference sees of array ``a`` inside a column's values: a 0-d array
    its one item, an array of objects a list of its items, any other a list of one item
    of its dtype (as deep as the array: its types, not its values, which may be many)."""
    if a.dtype == object:
        return a.tolist() if a.ndim else a[()]
    return _nest(np.zeros((1,) * a.ndim, a.dtype)) if a.ndim else a[()]


def _nest(a: np.ndarray) -> Any:
    """Array ``a`` (of one item) as nested lists of its numpy scalar."""
    return [_nest(a[0])] if a.ndim > 1 else [a[0]]


_LISTS = (list, tuple, set, frozenset)  # (pyarrow infers a list of a set's items)
_NESTED = (*_LISTS, dict, np.ndarray)


def _temporal_inferred(values: list[Any]) -> Any:
    """The type Arrow infers for ``values`` where it holds a date, timestamp or duration
    (Arrow infers ``list<date32>`` for lists of numpy dates beside a null, then fails to
    build it: :func:`_typed_column` builds it), else None.

    Example:
        >>> _temporal_inferred([[np.datetime64("2020-01-01"), None]])
        ListType(list<item: date32[day]>)
    """
    try:
        kind = pa.infer_type(values)
    except (OverflowError, TypeError, pa.ArrowInvalid):
        return None
    return kind if _first(kind, lambda t: _temporal_unit(t) is not None) is not None else None


def _merged(kind: Any) -> tuple[type, ...] | None:
    """The Python (and numpy) types that Arrow's inference writes as a leaf of type
    ``kind`` beside its own values, changing them: a str as binary beside bytes (and
    bytes as a string), a bool as a number, a numpy float16 as an int, a datetime (a
    subclass of date) as a date, its time of day dropped, a number as a count of a
    temporal type's unit (5 beside dates as 1970-01-06); None for none."""
    t = pa.types
    temporal = t.is_timestamp(kind) or t.is_duration(kind) or t.is_time(kind)
    table = (
        (t.is_date(kind), (dt.datetime, *_NUMBERS)),
        (temporal, _NUMBERS),
        (t.is_string(kind), (bytes,)),
        (t.is_binary(kind), (str,)),
        (t.is_integer(kind), (bool, np.bool_, np.floating)),
        (t.is_floating(kind), (bool, np.bool_)),
    )
    return next((types for match, types in table if match), None)


def _check_inferred(values: Iterable[Any], kind: Any, place: _Place | None = None) -> None:
    """A TypeError where Arrow inferred type ``kind`` for Python ``values`` by changing
    some of their leaves to another type (see :func:`_merged`), or a set to a list (in
    its iteration order, see :func:`_unordered`), at any depth; ``place``: their types,
    when known.

    Example:
        >>> _check_inferred([["a"], [b"b"]], pa.list_(pa.string()))
        Traceback (most recent call last):
        ...
        TypeError: it holds bytes beside string values
    """
    if place is None:
        values = values if isinstance(values, list) else list(values)
        place = _Place(values)
    if _is_list(kind):
        _unordered(place.types)
        lists = (v for v in values if isinstance(v, (list, tuple)))
        inner = place.items or _Place([])
        _check_inferred(itertools.chain.from_iterable(lists), kind.value_type, inner)
    elif pa.types.is_struct(kind):
        dicts = [v for v in values if isinstance(v, dict)]
        for f in kind:
            inner = place.fields.get(f.name) or _Place([])
            _check_inferred([d.get(f.name) for d in dicts], f.type, inner)
    else:
        _check_leaves(values, kind, place.types)


def _check_leaves(values: Iterable[Any], kind: Any, types: set[type]) -> None:
    """:func:`_check_inferred` of the leaves ``values`` (of Python ``types``) of type
    ``kind`` (not nested)."""
    if (banned := _merged(kind)) is not None:
        for typ in types:
            if issubclass(typ, banned) and not issubclass(typ, np.timedelta64):
                raise TypeError(f"it holds {typ.__name__} beside {kind} values")
    # Arrow infers microseconds for pandas' Timestamp and Timedelta, dropping their
    # nanoseconds; and a time's UTC offset (Parquet's time holds no zone).
    step = _python_step(kind)
    if step is not None and (pa.types.is_time(kind) or not types <= _EXACT_TEMPORAL):
        try:
            _check_steps(values, kind, step)
        except ValueError as e:
            why = str(e)
            if not pa.types.is_time(kind):
                why += " (write numpy datetime64 or timedelta64 values of the unit needed)"
            raise TypeError(why) from None


# Numbers, which Arrow's inference writes beside temporal values as counts of their unit
# (np.timedelta64, a numpy integer, is not one of them).
_NUMBERS = (int, float, decimal.Decimal, np.number, np.bool_)

# The types of values Arrow's inference holds exactly in the temporal type it infers.
_EXACT_TEMPORAL = {type(None), dt.date, dt.datetime, dt.timedelta, np.datetime64, np.timedelta64}


def _unordered(types: Iterable[type]) -> None:
    """A TypeError where one of ``types`` (of values) is a set (or frozenset): Arrow writes
    it as a list in its iteration order (for str, one that changes with ``PYTHONHASHSEED``),
    so the same records would give different files; :func:`write_array_record` refuses it
    too."""
    for typ in types:
        if issubclass(typ, (set, frozenset)):
            raise TypeError(f"it holds a {typ.__name__}, which has no order: write a sorted list")


def _check_shape(a: np.ndarray, fixed: tuple[int, ...] = ()) -> None:
    """A TypeError where Parquet would not keep array ``a``'s shape as nested lists whose
    innermost ``fixed`` sizes are fixed-size lists (see :func:`_fixed_sizes`).

    Example:
        >>> _check_shape(np.zeros((0, 4)), (4,))
        >>> _check_shape(np.zeros((0, 4)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: an array of shape (0, 4) loses its shape in Parquet ...
    """
    end = a.ndim - len(fixed)
    if fixed and a.size == 0 and a.shape[end:] != fixed:  # (else: refused by the cast)
        raise TypeError(f"an array of shape {a.shape} in fixed-size lists of {fixed}")
    # Nested lists keep no length below an empty one: (0, 2) would read back (0, 0), but
    # for the sizes a fixed-size list records.
    if any(n == 0 and any(a.shape[d + 1 : end]) for d, n in enumerate(a.shape[:-1])):
        raise TypeError(
            f"an array of shape {a.shape} loses its shape in Parquet (nothing records "
            "the sizes below a zero-length dimension); reshape it or write array_record"
        )


def _clash(values: list[Any], first: int = 0) -> str:
    """The records of ``values`` (numbered from ``first``) that Arrow's inference refuses
    together: the first that does beside those before it, and the last of those it clashes with.

    Example:
        >>> _clash([0.5, 1, 2**53 + 1, 2.5], first=10)
        'records 10 and 12'
        >>> _clash([1, [2, "a"]])
        'record 1'
    """

    def fails(part: list[Any]) -> bool:
        try:
            _check_inferred(part, pa.array(part).type)
        except (OverflowError, TypeError, pa.ArrowInvalid):  # (an ArrowTypeError a TypeError)
            return True
        return False

    lo, hi = 1, len(values)  # the shortest failing prefix, by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fails(values[:mid]) else (mid + 1, hi)
    end = lo - 1
    lo, hi = 0, end  # the latest start of a failing run ending there
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fails(values[mid : end + 1]) else (lo, mid - 1)
    if lo == end:
        return f"record {first + end}"
    return f"records {first + lo} and {first + end}"


_LIST = object()  # a path step into a list's items (others: a struct's field name)
_INT64 = (-(2**63), 2**63 - 1)


def _uint64_type(values: list[Any], first: int = 0) -> Any:
    """The Arrow type of Python ``values`` holding ints past int64 (which Arrow's
    inference refuses): what Arrow infers with uint64 where such ints are, or None when
    none is; a ValueError naming the record where one is negative, past 2**64, or beside
    another type than int (numbered from ``first``).

    Example:
        >>> _uint64_type([{"ids": [1, 2**63]}, None])
        StructType(struct<ids: list<item: uint64>>)
        >>> _uint64_type([[1, 2**63], [-1]])
        Traceback (most recent call last):
        ...
        ValueError: record 1 holds -1 and record 0 holds 9223372036854775808 (past int64) in [*]: no integer type holds both
    """
    # path -> [least int, its record, greatest int, its record], for paths of an int past int64
    seen: dict[tuple[Any, ...], list[Any]] = {}
    wide: set[tuple[Any, ...]] = set()

    def walk(v: Any, path: tuple[Any, ...], i: int) -> Any:  # ``v`` with such ints 0
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            n = int(v)  # (a numpy int beside them too)
            at = seen.setdefault(path, [n, i, n, i])
            if n < at[0]:
                at[:2] = n, i
            elif n > at[2]:
                at[2:] = n, i
            if _INT64[0] <= n <= _INT64[1]:
                return v
            wide.add(path)
            return 0
        if isinstance(v, (list, tuple)):
            return [walk(x, (*path, _LIST), i) for x in v]
        if isinstance(v, dict):
            return {k: walk(x, (*path, k), i) for k, x in v.items()}
        return v

    zeroed = [walk(v, (), i) for i, v in enumerate(values, first)]
    if not wide:
        return None
    paths = []
    for path in sorted(wide, key=len):
        lo, lo_at, hi, hi_at = seen[path]
        where = f" in {''.join('[*]' if p is _LIST else f'[{p!r}]' for p in path)}" if path else ""
        if lo < _INT64[0] or hi >= 2**64:
            v, at = (lo, lo_at) if lo < _INT64[0] else (hi, hi_at)
            raise ValueError(f"record {at} holds {v}{where}, past int64's and uint64's range")
        if lo < 0:
            also = "" if lo_at == hi_at else f"record {hi_at} holds "
            raise ValueError(
                f"record {lo_at} holds {lo} and {also}{hi} (past int64){where}: no integer "
                "type holds both"
            )
        paths.append((path, f"record {hi_at} holds {hi} (past int64){where}"))
    try:
        kind = pa.array(zeroed).type
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # (it names a 0 no record holds)
        raise ValueError(
            f"{paths[0][1]} beside values of another type: no Arrow type holds both"
        ) from e
    for path, what in paths:
        kind = _with_uint64(kind, path, what)
    return kind


def _with_uint64(kind: Any, path: tuple[Any, ...], what: str) -> Any:
    """``kind`` with uint64 for the int64 at ``path`` (a ValueError beginning ``what``
    when another type is there)."""
    if not path:
        if kind != pa.int64():
            raise ValueError(f"{what} beside values of another type: {kind} would not hold it")
        return pa.uint64()
    if path[0] is _LIST:
        return pa.list_(kind.value_field.with_type(_with_uint64(kind.value_type, path[1:], what)))
    return pa.struct(
        [
            f.with_type(_with_uint64(f.type, path[1:], what)) if f.name == path[0] else f
            for f in kind
        ]
    )


def _from_numpy(values: np.ndarray, mask: np.ndarray | None = None) -> Any:
    """A 1-D numpy array as an Arrow array, null where ``mask`` is set and where a value
    is NaT (which Arrow, given a mask, writes as a date or time: 1970-01-01, or int64's
    least).

    Example:
        >>> d = np.array(["NaT", "2020-01-02", "2020-01-03"], "datetime64[D]")
        >>> _from_numpy(d, np.array([False, False, True])).to_pylist()
        [None, datetime.date(2020, 1, 2), None]
    """
    if values.dtype.kind in "mM":
        mask = np.isnat(values) if mask is None else mask | np.isnat(values)
    return pa.array(values, mask=mask if mask is not None and mask.any() else None)


def _beside_arrays(values: list[Any], numpy: list[bool], first: int = 0) -> Any:
    """A column of numpy arrays (or scalars: ``numpy``) beside other values (lists, Python
    scalars), all of the arrays' type: each other value of their shape, its items of a
    Python type the dtype takes and held by it exactly, else a TypeError naming the record
    (numbered from ``first``).

    Example:
        >>> _beside_arrays([np.array([7, 8], np.int16), [3, None]], [True, False]).to_pylist()
        [[7, 8], [3, None]]
        >>> _beside_arrays([np.array([True]), [1]], [True, False])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: record 1 holds 1 (int) beside arrays of bool (in [1])
    """
    built = _column([v if n else None for v, n in zip(values, numpy)])
    sample = np.asarray(next(v for v, n in zip(values, numpy) if n))
    dtype, ndim = sample.dtype, sample.ndim
    others = [None if n else v for v, n in zip(values, numpy)]
    for i, v in enumerate(others, first):
        stray = _stray(v, ndim, dtype)
        if stray is not None:
            raise TypeError(
                f"record {i} holds {stray[0]!r} ({type(stray[0]).__name__}) beside arrays of "
                f"{dtype}" + ("" if stray[0] is v else f" (in {v!r})")
            )
    try:
        typed = _typed_column(others, built.type)
    except (TypeError, ValueError, OverflowError, pa.ArrowException):
        for i, v in enumerate(others, first):  # the first record its type refuses, named
            if v is not None:
                try:
                    _typed_column([v], built.type)
                except (TypeError, ValueError, OverflowError, pa.ArrowException) as e:
                    raise TypeError(f"record {i} holds {v!r}, not {dtype} values: {e}") from e
        raise
    # Each record from the arrays' column or the others'.
    order = np.arange(len(values)) + np.where(numpy, 0, len(values))
    return pa.concat_arrays([built, typed]).take(pa.array(order))


# The Python (and numpy) types a list item beside arrays of a dtype's kind may be, to be
# written as that dtype (a bool is never an int or a float here).
_ITEMS: dict[str, tuple[type, ...]] = {
    "b": (bool, np.bool_),
    "i": (int, np.integer),
    "u": (int, np.integer),
    "f": (float, int, np.floating, np.integer),
    "U": (str,),
    "S": (bytes,),
    "M": (np.datetime64,),
    "m": (np.timedelta64,),
}


def _stray(value: Any, depth: int, dtype: np.dtype) -> tuple[Any] | None:
    """The first part of ``value`` (beside arrays of ``dtype`` and ``depth`` dimensions)
    that is neither a list (or an array of ``dtype``) at a level above ``depth`` nor an
    item of a type ``dtype`` takes at it, in a tuple; None where there is none (a None is
    a null at every level).

    Example:
        >>> _stray([[1, None], None], 2, np.dtype(np.int8)) is None
        True
        >>> _stray([1, 2.5], 1, np.dtype(np.int8)), _stray([True], 1, np.dtype(np.int8))
        ((2.5,), (True,))
    """
    if value is None or (
        isinstance(value, np.ndarray) and value.dtype == dtype and value.ndim == depth
    ):
        return None
    if depth == 0:
        return (value,) if _foreign(type(value), _ITEMS.get(dtype.kind, ())) else None
    if not isinstance(value, (list, tuple)):
        return (value,)
    return next((s for v in value if (s := _stray(v, depth - 1, dtype)) is not None), None)


def write_parquet(
    records: Iterable[dict[str, Any]],
    directory: str | os.PathLike,
    *,
    num_shards: int = 1,
    row_group_size: int = 10_000,
    prefix: str = "data",
    compression: str = "zstd",
    overwrite: bool = False,
) -> list[str]:
    """Write records as ``num_shards`` Parquet files (contiguous slices, in order).

    Values map to Arrow as :func:`records_to_table` describes, typed from all the records
    at once (every shard of one schema); each file is written under a hidden temporary
    name and renamed when complete.

    A directory that already holds Parquet files (any that ``tg.ParquetSource(directory)``
    would read) is a ``FileExistsError``: they would be read with the new ones, or be
    replaced. ``overwrite=True`` removes them first, then writes.

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> paths = write_parquet([{"id": i, "v": np.ones(2, np.float32)} for i in range(5)],
        ...                       d, num_shards=2)
        >>> src = tg.ParquetSource(d)
        >>> len(src), src[4]["id"], src.schema["v"]
        (5, 4, 'float32[?]')
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    records = list(records)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    table = records_to_table(records)  # (one type for every shard: they are in memory)
    existing = parquet_files(directory)
    if existing and not overwrite:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise FileExistsError(
            f"{directory!r} already holds Parquet files ({existing[0]!r}{more}): they would "
            "be read with the new ones; write to an empty directory, or pass overwrite=True "
            "to replace them"
        )
    for old in existing:  # (first: a crash leaves an incomplete -of-N set, refused)
        os.unlink(old)
    paths = []
    n = len(records)
    for i in range(num_shards):
        part = table.slice(n * i // num_shards, n * (i + 1) // num_shards - n * i // num_shards)
        final = os.path.join(directory, shard_name(i, num_shards, prefix, ".parquet"))
        try:
            with atomic_path(final) as tmp:
                pq.write_table(part, tmp, row_group_size=row_group_size, compression=compression)
        except OSError as e:  # (a full disk: Arrow's message names no file)
            raise OSError(e.errno, f"cannot write Parquet file: {e.strerror or e}", final) from e
        paths.append(final)
    return paths


def parquet_files(directory: str) -> list[str]:
    """The Parquet files ``tg.ParquetSource(directory)`` would read (none: ``[]``).

    Example:
        >>> import tempfile
        >>> parquet_files(tempfile.mkdtemp())
        []
    """
    try:
        return expand_paths(directory, suffixes=PARQUET_SUFFIXES, kind="Parquet")[1]
    except DatasetNotFoundError:
        return []


# ---------------------------------------------------------------- output formats
class ShardWriter(abc.ABC):
    """Writes one output shard of a conversion, at ``path`` (a temporary name the
    converter renames once the shard is complete and verified)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @abc.abstractmethod
    def add(self, record: dict[str, Any] | bytes) -> int | None:
        """Write one record: a dict, or msgpack bytes for an output whose
        :attr:`OutputFormat.msgpack_records` is set. Returns the bytes it wrote, or None
        where that is not known record by record. Raises ``TypeError`` or
        ``ValueError`` for a value the format cannot store."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish the file (after the last record)."""

    def abort(self) -> None:
        """Give up on the file after an error (the converter removes it)."""
        with contextlib.suppress(Exception):
            self.close()

    def checksum(self) -> str:
        """The shard's checksum for the manifest, once closed: the file's hash unless a
        format checks its records instead."""
        return file_checksum(self.path)

    def file_checksum(self) -> str | None:
        """The whole file's hash, kept beside a record checksum (None: not kept)."""
        return None


class OutputFormat(abc.ABC):
    """What ``torchgrain convert`` needs to write a format (a registry ``Format``'s
    ``output``). Instances travel to the converting processes: keep them picklable (a
    module-level class)."""

    #: The output shards' file-name suffix (``data-00000-of-00004`` + suffix).
    suffix: ClassVar[str]
    #: The codec the conversion's manifest records.
    codec: ClassVar[str]
    #: :meth:`ShardWriter.add` takes msgpack bytes, which then pass through unchanged.
    msgpack_records: ClassVar[bool] = False
    #: The manifest goes into the dataset directory (``torchgrain.json``), where the
    #: format's sources read it; otherwise it is kept in the conversion's journal.
    manifest_in_dataset: ClassVar[bool] = False
    #: The conversion settings the format uses (``group_size``, ``compression``,
    #: ``row_group_bytes``): a change of another does not change the output.
    settings: ClassVar[tuple[str, ...]] = ("compression",)

    @abc.abstractmethod
    def options(self, group_size: int, compression: str | None) -> tuple[str, str]:
        """``(compression, writer options)``, defaults filled in; ``ValueError`` for a
        compression or group size the format does not take (checked before any work)."""

    @abc.abstractmethod
    def open(
        self, path: str, *, compression: str, writer_options: str, row_group_bytes: int
    ) -> ShardWriter:
        """A writer of one output shard at ``path``."""

    def writer(
        self,
        path: str,
        *,
        compression: str,
        writer_options: str,
        row_group_bytes: int,
        arrow_schema: pa.Schema | None = None,
    ) -> ShardWriter:
        """The writer of one output shard the conversion opens: :meth:`open`'s, told the
        input's Arrow schema where the input has one (a Parquet source: its selected
        columns, in order), which a format keeping Arrow types writes those columns
        with. The default leaves it aside.

        Example:
            >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
            >>> path = os.path.join(tempfile.mkdtemp(), "x.parquet")
            >>> w = PARQUET_OUTPUT.writer(path, compression="zstd", writer_options="",
            ...                           row_group_bytes=1 << 20,
            ...                           arrow_schema=pa.schema({"i": pa.int8()}))
            >>> _ = w.add({"i": 3})
            >>> w.close()
            >>> pq.read_schema(path).field("i").type
            DataType(int8)
        """
        return self.open(
            path,
            compression=compression,
            writer_options=writer_options,
            row_group_bytes=row_group_bytes,
        )

    def verify(self, path: str, num_records: int, checksum: str) -> None:
        """Read a written shard back: ``CorruptDataError`` unless it matches ``checksum``
        (and, where the format can count them, holds ``num_records`` records)."""
        verify_file(path, checksum)

    def finish(self, root: str, manifest: Manifest, group_size: int) -> None:
        """Complete the conversion's manifest (before it is written) with what this
        format records (the default: nothing)."""
        return None

    def read_with(self, root: str, names: set[str]) -> list[str]:
        """The files in ``root``, besides the conversion's shards ``names``, that the
        format's source would read with them (the default: none, a source that reads the
        shards its manifest names)."""
        return []


class ArrayRecordOut(ShardWriter):
    """Writes one output ArrayRecord shard of msgpack records, hashing each record."""

    def __init__(self, path: str, options: str) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        super().__init__(path)
        self._w: Any = ArrayRecordWriter(path, options)
        self._hasher = RecordHasher()
        self._msgpack = MsgpackCodec()

    def add(self, record: dict[str, Any] | bytes) -> int:
        data = self._msgpack.encode(record) if isinstance(record, dict) else record
        self._w.write(data)
        self._hasher.update(data)
        return len(data)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

    def checksum(self) -> str:
        return self._hasher.hexdigest()

    def file_checksum(self) -> str:
        # What a downloaded copy is checked against (cheaper than decoding every record).
        return file_checksum(self.path)


class ArrayRecordOutput(OutputFormat):
    """torchgrain's ArrayRecord datasets: msgpack records, a ``torchgrain.json``
    manifest and the dataset's index (every chunk's offset and size)."""

    suffix = ".array_record"
    codec = "msgpack"
    msgpack_records = True
    manifest_in_dataset = True
    settings = ("group_size", "compression")

    def options(self, group_size: int, compression: str | None) -> tuple[str, str]:
        """``zstd:3`` unless told; the writer options of :func:`array_record_options`.

        Example:
            >>> ARRAY_RECORD_OUTPUT.options(1, None)
            ('zstd:3', 'group_size:1,zstd:3')
        """
        compression = compression or "zstd:3"
        return compression, array_record_options(group_size, compression)

    def open(
        self, path: str, *, compression: str, writer_options: str, row_group_bytes: int
    ) -> ShardWriter:
        return ArrayRecordOut(path, writer_options)

    def verify(self, path: str, num_records: int, checksum: str) -> None:
        verify_shard(path, num_records, checksum)

    def finish(self, root: str, manifest: Manifest, group_size: int) -> None:
        manifest.group_size = group_size
        manifest.extra["index"] = write_dataset_index(root, [s.path for s in manifest.shards])


#: The codecs Arrow writes Parquet with (any case).
PARQUET_COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "lz4_raw", "none")

PARQUET_MAX_ROWS = 1 << 16  # rows per output row group at most


class ParquetOut(ShardWriter):
    """Writes one output Parquet file, a row group of about ``row_group_bytes`` at a time."""

    def __init__(
        self, path: str, compression: str, row_group_bytes: int, schema: pa.Schema | None = None
    ) -> None:
        super().__init__(path)
        self._schema = schema  # the types of the input's columns (a Parquet input)
        self._compression = compression
        self._target = row_group_bytes
        self._writer: Any = None
        # Files of the row groups written before the schema last changed, in order: each
        # is rewritten once, at close (a rewrite at each change grew as the square).
        self._parts: list[str] = []
        self._pending: list[dict[str, Any]] = []
        self._tables: list[tuple[int, Any]] = []  # (its first record, a batch's table)
        self._bytes = 0
        self._added = 0  # records added

    def add(self, record: dict[str, Any] | bytes) -> None:
        if not isinstance(record, dict):
            raise TypeError("Parquet output takes records as dicts")
        self._pending.append(record)
        self._added += 1
        if len(self._pending) >= 512:
            self._convert()

    def _convert(self) -> None:
        if self._pending:
            first = self._added - len(self._pending)
            try:
                t = records_to_table(self._pending, self._schema, first=first)
            except TypeError as e:
                raise TypeError(
                    f"{e} (in records {first}..{self._added - 1} of {self.path})"
                ) from e
            self._pending = []
            self._tables.append((first, t))
            self._bytes += t.nbytes
            rows = sum(x.num_rows for _, x in self._tables)
            if self._bytes >= self._target or rows >= PARQUET_MAX_ROWS:
                self._flush()

    def _flush(self) -> None:
        if not self._tables:
            return
        tables, self._tables, self._bytes = self._tables, [], 0
        # Each batch is typed from its own records: give them, and the row groups written
        # before, one schema as shards get one (a column null or missing so far gets its
        # type; int64 beside uint64 is uint64 where no value is negative; else an error).
        where = [f"records {first}..{first + t.num_rows - 1}" for first, t in tables]
        batches = [(t.schema, w) for (_, t), w in zip(tables, where)]
        if self._writer is not None:  # (the row groups written before)
            batches.insert(0, (self._writer.schema, f"records 0..{tables[0][0] - 1}"))
        tables = [t for _, t in tables]
        schema = _one_schema(batches, self.path)
        tables = [_conformed(t, schema, self.path, w) for t, w in zip(tables, where)]
        if self._writer is not None and not self._writer.schema.equals(schema):
            self._writer.close()
            self._writer = None
            self._parts.append(temp_name(self.path))
            os.replace(self.path, self._parts[-1])
        table = pa.concat_tables(tables)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema, compression=self._compression)
        self._writer.write_table(table, row_group_size=table.num_rows)

    def close(self) -> None:
        self._convert()
        self._flush()
        if self._writer is None:  # no records: an empty file, of the input's columns if known
            empty = pa.table({}) if self._schema is None else self._schema.empty_table()
            pq.write_table(empty, self.path, compression=self._compression)
        else:
            schema = self._writer.schema
            self._writer.close()
            self._writer = None
            if self._parts:
                _rewrite(self.path, schema, self._compression, self._parts)
                self._drop_parts()

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        self._drop_parts()

    def _drop_parts(self) -> None:
        for part in self._parts:
            with contextlib.suppress(OSError):
                os.unlink(part)
        self._parts = []


def _one_schema(batches: Sequence[tuple[Any, str]], path: str) -> Any:
    """The schema a shard's batches (``(schema, where in the file path: its records)``
    pairs) are written with: each column's :func:`_common` type, else a TypeError naming
    the column and two of its batches."""
    seen: dict[str, dict[Any, tuple[Any, str]]] = {}  # column -> {type: (field, where)}
    for schema, w in batches:
        for f in schema:
            seen.setdefault(f.name, {}).setdefault(f.type, (f, w))
    fields = []
    for name, kinds in seen.items():
        target = _common(list(kinds))
        if target is None:
            pairs = [(x, y) for x in kinds for y in kinds if _common([x, y]) is None]
            a, b = pairs[0] if pairs else [next(iter(kinds))] * 2
            raise TypeError(
                f"cannot store key {name!r} in Parquet: it is {a} in {kinds[a][1]} but {b} in "
                f"{kinds[b][1]} of one output shard ({path}); give the key one type in every "
                "record, or convert to array_record"
            )
        fields.append(next(iter(kinds.values()))[0].with_type(target))
    return pa.schema(fields)


def _conformed(table: Any, schema: Any, path: str, where: str) -> Any:
    """``table`` (``where`` in the file ``path``: its records or row group) cast to
    ``schema`` (a column it lacks: nulls); a TypeError naming the column, ``where`` and
    ``path`` where a value does not cast (a negative int to uint64)."""
    if table.schema.equals(schema):
        return table
    columns = []
    for f in schema:
        if f.name not in table.schema.names:
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(f.name)
        if _int64_as(column.type, f.type, pa.float64()):
            value = _first_outside(column, f.type, -_DOUBLE_INTS, _DOUBLE_INTS)
            if value is not None:
                raise TypeError(
                    f"cannot store key {f.name!r} in Parquet: it holds {value} and floats in one "
                    f"output shard ({where} of {path}); a double rounds an int past 2**53"
                )
        if _int64_as(column.type, f.type, pa.uint64()):
            low = _first_outside(column, f.type, 0)
            if low is not None:
                raise TypeError(
                    f"cannot store key {f.name!r} in Parquet: it holds {low} and ints past "
                    f"int64 in one output shard ({where} of {path}); no Parquet integer type "
                    "holds both"
                )
        try:
            columns.append(column.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TypeError(
                f"cannot store key {f.name!r} in Parquet as {f.type}: {e} ({where} of {path})"
            ) from e
    return pa.Table.from_arrays(columns, schema=schema)


class ParquetOutput(OutputFormat):
    """One Parquet file per output shard; the manifest stays in the conversion's journal."""

    suffix = ".parquet"
    codec = "parquet"
    settings = ("compression", "row_group_bytes")

    def options(self, group_size: int, compression: str | None) -> tuple[str, str]:
        """``zstd`` unless told, one of :data:`PARQUET_COMPRESSIONS`; no writer options.

        Example:
            >>> PARQUET_OUTPUT.options(1, None)
            ('zstd', '')
            >>> PARQUET_OUTPUT.options(1, "zip")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: Parquet compression must be one of zstd, snappy, ..., not 'zip'
        """
        compression = compression or "zstd"
        if compression.lower() not in PARQUET_COMPRESSIONS:
            # Checked here: Arrow would refuse it only when a worker opens a shard.
            raise ValueError(
                f"Parquet compression must be one of {', '.join(PARQUET_COMPRESSIONS)}, "
                f"not {compression!r}"
            )
        return compression, ""

    def open(
        self, path: str, *, compression: str, writer_options: str, row_group_bytes: int
    ) -> ShardWriter:
        return ParquetOut(path, compression, row_group_bytes)

    def writer(
        self,
        path: str,
        *,
        compression: str,
        writer_options: str,
        row_group_bytes: int,
        arrow_schema: pa.Schema | None = None,
    ) -> ShardWriter:
        """The input's columns keep their Arrow types (``arrow_schema``), each value
        checked to fit; other keys are typed from their values."""
        return ParquetOut(path, compression, row_group_bytes, arrow_schema)

    def verify(self, path: str, num_records: int, checksum: str) -> None:
        verify_shard(path, num_records, checksum)

    def read_with(self, root: str, names: set[str]) -> list[str]:
        """Every other Parquet file there: ``tg.ParquetSource(root)`` reads them all."""
        return [p for p in parquet_files(root) if os.path.relpath(p, root) not in names]

    def finish(self, root: str, manifest: Manifest, group_size: int) -> None:
        """Check that the shards, each typed from its own records, open as one dataset.

        A shard whose column is of a type the others hold with no value changed (a
        column of nulls or empty lists typed; an int64 column of no negative value
        uint64) is rewritten with their type; other differences are a
        ``SchemaMismatchError`` naming two shards and the column.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": 1}, {"x": "a"}], d + "/in")
            >>> tg.convert(d + "/in", d + "/out", to="parquet", num_shards=2)
            Traceback (most recent call last):
            ...
            torchgrain.errors.SchemaMismatchError: the Parquet output shards ... nothing was published
        """
        shards = {s.path: s for s in manifest.shards if s.num_records}
        for shard, schema in _reconciled(root, list(shards)).items():
            info, path = shards[shard], os.path.join(root, shard)
            _rewrite(path, schema, str(manifest.extra.get("compression", "zstd")))
            info.num_bytes = os.path.getsize(path)
            info.checksum = file_checksum(path)
        check_shard_schemas(root, list(shards))


def _common(types: Sequence[Any]) -> Any:
    """The one of ``types`` each of them becomes with no value changed (a null type typed,
    int64 of no negative value uint64, int64 of no value past 2**53 double, at any depth:
    in lists and struct fields; see :func:`_becomes`), or None.

    Example:
        >>> import pyarrow as pa
        >>> _common([pa.list_(pa.null()), pa.list_(pa.int8())])
        ListType(list<item: int8>)
        >>> _common([pa.int64(), pa.uint64()])
        DataType(uint64)
        >>> _common([pa.list_(pa.int64()), pa.list_(pa.float64()), pa.list_(pa.null())])
        ListType(list<item: double>)
        >>> _common([pa.struct({"a": pa.int64()}), pa.struct({"a": pa.uint64()})])
        StructType(struct<a: uint64>)
        >>> _common([pa.list_(pa.int8()), pa.list_(pa.int16())]) is None
        True
    """
    for t in types:
        if all(_becomes(u, t) for u in types):
            return t
    return None


def _becomes(a: Any, b: Any) -> bool:
    """Whether type ``a`` is ``b`` but for null types (its values are then nulls or
    empty lists, which ``b`` holds unchanged), a struct's fields in another order
    (matched by name, written in ``b``'s order), and int64 where ``b`` has uint64 or
    double (its values then need checking: :func:`_int64_leaves`), at any depth.

    Example:
        >>> import pyarrow as pa
        >>> _becomes(pa.list_(pa.struct({"a": pa.int64(), "b": pa.null()})),
        ...          pa.list_(pa.struct({"b": pa.string(), "a": pa.uint64()})))
        True
        >>> _becomes(pa.struct({"a": pa.int32()}), pa.struct({"a": pa.uint64()}))
        False
        >>> _becomes(pa.struct({"a": pa.int8()}), pa.struct({"a": pa.int8(), "b": pa.int8()}))
        False
    """
    if a.equals(b) or pa.types.is_null(a):
        return True
    if a == pa.int64():
        return b == pa.uint64() or b == pa.float64()
    if _is_list(a) and _is_list(b) and type(a) is type(b):
        return _becomes(a.value_type, b.value_type)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        of_b = {f.name: f.type for f in b}
        names = {f.name for f in a}
        return (
            len(names) == a.num_fields == b.num_fields == len(of_b)
            and names == of_b.keys()
            and all(_becomes(f.type, of_b[f.name]) for f in a)
        )
    return False


def _int64_as(a: Any, b: Any, leaf: Any) -> bool:
    """Whether type ``a`` has int64 where ``b`` has ``leaf`` (uint64 or double), at any
    depth (its values then need checking: :func:`_first_outside`).

    Example:
        >>> import pyarrow as pa
        >>> _int64_as(pa.list_(pa.int64()), pa.list_(pa.float64()), pa.float64())
        True
        >>> _int64_as(pa.int32(), pa.float64(), pa.float64())
        False
        >>> _int64_as(pa.struct({"a": pa.list_(pa.int64())}),
        ...           pa.struct({"a": pa.list_(pa.uint64())}), pa.uint64())
        True
    """
    if a == pa.int64():
        return b == leaf
    if _is_list(a) and _is_list(b) and type(a) is type(b):
        return _int64_as(a.value_type, b.value_type, leaf)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        of_b = {f.name: f.type for f in b}
        return any(f.name in of_b and _int64_as(f.type, of_b[f.name], leaf) for f in a)
    return False


def _int64_leaves(column: Any, kind: Any, leaf: Any) -> Iterator[Any]:
    """The int64 arrays of ``column`` (an array, or a chunked one) where type ``kind`` has
    ``leaf`` (None: every one): its values, its lists' items, its structs' fields (nulls
    above them kept).

    Example:
        >>> import pyarrow as pa
        >>> column = pa.array([[{"a": 1, "b": 2}], None, [{"a": -3, "b": 4}]])
        >>> kind = pa.list_(pa.struct({"a": pa.uint64(), "b": pa.int64()}))
        >>> [a.to_pylist() for a in _int64_leaves(column, kind, pa.uint64())]
        [[1, -3]]
    """
    t = column.type
    if t == pa.int64():
        if kind is None or kind == leaf:
            yield column
    elif _is_list(t) and (kind is None or _is_list(kind)):
        inner = None if kind is None else kind.value_type
        yield from _int64_leaves(pc.list_flatten(column), inner, leaf)
    elif pa.types.is_struct(t) and (kind is None or pa.types.is_struct(kind)):
        names = t if kind is None else kind
        of_kind = {f.name: None if kind is None else f.type for f in names}
        for f, child in zip(t, column.flatten()):
            if f.name in of_kind:
                yield from _int64_leaves(child, of_kind[f.name], leaf)


def _first_outside(column: Any, kind: Any, low: int, high: int | None = None) -> int | None:
    """An int of the int64 arrays of ``column`` (see :func:`_int64_leaves`) where ``kind``
    has uint64 (``high`` None) or double (``kind`` None: every one) outside ``low..high``,
    or None: the least where no ``high`` is given, else the first (a double's bound: the
    first int a double rounds, past 2**53 either side).

    Example:
        >>> import pyarrow as pa
        >>> _first_outside(pa.array([[1, None], [2**53 + 1, -(2**53) - 1]]), None, -(2**53), 2**53)
        9007199254740993
        >>> _first_outside(pa.array([2**53, -(2**53), None]), None, -(2**53), 2**53) is None
        True
        >>> _first_outside(pa.array([3, -1, -5, None]), None, 0)
        -5
    """
    leaf = pa.uint64() if high is None else pa.float64()
    for ints in _int64_leaves(column, kind, leaf):
        limits = pc.min_max(ints)
        least, most = limits["min"].as_py(), limits["max"].as_py()
        if least is None or (least >= low and (high is None or most <= high)):
            continue
        if high is None:
            return least
        past = pc.or_(pc.less(ints, low), pc.greater(ints, high))
        return ints[pc.index(past, pa.scalar(True)).as_py()].as_py()
    return None


_DOUBLE_INTS = 2**53  # a double holds every int up to this (either side), not all past it


def _reconciled(root: str, names: Sequence[str]) -> dict[str, Any]:
    """The Parquet files among ``names`` whose columns become those of the others
    without a changed value (see :func:`_common`), and the schema each is rewritten with."""
    schemas = {n: pq.read_schema(os.path.join(root, n)) for n in names}
    types: dict[str, dict[Any, str]] = {}  # column -> {type: the first file of it}
    for n, schema in schemas.items():
        for f in schema:
            types.setdefault(f.name, {}).setdefault(f.type, n)
    target = {c: t for c, ts in types.items() if (t := _common(list(ts))) is not None}
    out = {}
    for n, schema in schemas.items():
        changed = [
            (i, f) for i, f in enumerate(schema) if f.name in target and f.type != target[f.name]
        ]
        if not changed:
            continue
        path = os.path.join(root, n)
        becomes = {f.name: (f.type, target[f.name]) for _, f in changed}
        ints = {c: t for c, (a, t) in becomes.items() if _int64_as(a, t, pa.uint64())}
        if ints and _outside(path, ints, 0, None) is not None:
            continue  # left as it is: check_shard_schemas names it
        doubles = {c: t for c, (a, t) in becomes.items() if _int64_as(a, t, pa.float64())}
        past = _outside(path, doubles, -_DOUBLE_INTS, _DOUBLE_INTS) if doubles else None
        if past is not None:
            column, value = past
            raise SchemaMismatchError(
                f"the Parquet output shards in {root!r} do not agree: column {column!r} is "
                f"{schema.field(column).type} in {n} but {target[column]} in "
                f"{types[column][target[column]]}, and {n} holds {value}, which a double "
                "rounds (past 2**53); give the column one type in every record, or convert to "
                "array_record; nothing was published"
            )
        for i, f in changed:
            schema = schema.set(i, f.with_type(target[f.name]))
        out[n] = schema
    return out


def _outside(
    path: str, columns: dict[str, Any] | Sequence[str], low: int, high: int | None
) -> tuple[str, int] | None:
    """A column of ``columns`` (name -> the type it becomes: its int64s uint64 where
    ``high`` is None, else double; names alone: every int64 of them) of the Parquet file
    ``path`` and an int of it outside ``low..high`` (None: no bound), or None. Its row groups'
    statistics decide where written, else a row group's column at a time (bounded
    memory); a double's bound (``high`` given) names the row group's first such int."""
    if not isinstance(columns, dict):
        columns = dict.fromkeys(columns)
    with pq.ParquetFile(path) as pf:
        meta = pf.metadata
        # A leaf's (path, lists above it) -> its index; None: two of them (a top-level
        # column named as a struct field's path, 'a.b'), read instead.
        leaf: dict[tuple[str, int], int | None] = {}
        for j in range(meta.num_columns):
            c = meta.schema.column(j)
            key = (c.path, c.max_repetition_level)
            leaf[key] = None if key in leaf else j
        arrow = pf.schema_arrow
        for i in range(meta.num_row_groups):
            for name in columns:
                kind, depth = arrow.field(name).type, 0
                while _is_list(kind):
                    kind, depth = kind.value_type, depth + 1
                paths = (name + ".list.element" * depth, name + ".list.item" * depth)
                j = next((leaf[(p, depth)] for p in paths if (p, depth) in leaf), None)
                if kind != pa.int64():  # (int64s in structs: read)
                    j = None
                stats = None if j is None else meta.row_group(i).column(j).statistics
                bound = None
                if stats is not None and stats.has_min_max:
                    if stats.min >= low and (high is None or stats.max <= high):
                        continue
                    bound = stats.min if stats.min < low else stats.max
                    if high is None:
                        return name, bound
                elif stats is not None and stats.num_values == 0:  # nulls only
                    continue
                # No statistics, or a double's bound passed: the row group read (to name
                # the first int past it).
                column = pf.read_row_group(i, columns=[name]).column(0)
                value = _first_outside(column, columns[name], low, high)
                if value is not None or bound is not None:
                    return name, bound if value is None else value
    return None


def _rewrite(path: str, schema: Any, compression: str, parts: Sequence[str] = ()) -> None:
    """Rewrite the Parquet file ``path`` with ``schema``, a row group at a time (see
    :func:`_conformed`: an error names the row group's records), after the row groups of
    the files ``parts`` (left as they are)."""
    tmp, writer, k = temp_name(path), None, 0
    try:
        writer = pq.ParquetWriter(tmp, schema, compression=compression)
        for part in [*parts, path]:
            with pq.ParquetFile(part) as pf:
                for i in range(pf.num_row_groups):
                    t = pf.read_row_group(i)
                    t = _conformed(t, schema, path, f"records {k}..{k + t.num_rows - 1}")
                    writer.write_table(t, row_group_size=t.num_rows)
                    k += t.num_rows
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_shard_schemas(root: str, names: Sequence[str]) -> None:
    """Raise ``SchemaMismatchError`` unless the Parquet files ``names`` in ``root`` have
    column types a :class:`~torchgrain.ParquetSource` reconciles (their footers only).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> d = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": pa.array([1], pa.int64())}), d + "/a.parquet")
        >>> pq.write_table(pa.table({"x": pa.array([2**63], pa.uint64())}), d + "/b.parquet")
        >>> check_shard_schemas(d, ["a.parquet", "a.parquet"])
        >>> check_shard_schemas(d, ["a.parquet", "b.parquet"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchgrain.errors.SchemaMismatchError: ... column 'x' is int64 in a.parquet but uint64 in b.parquet...
    """
    # column -> {type: the first shard of it}: a type already seen is not checked again
    # (a check per shard over all shards before took 1.6 s for 2,000 shards, growing as
    # the square of their number).
    seen: dict[str, dict[Any, str]] = {}
    for name in names:
        for field in pq.read_schema(os.path.join(root, name)):
            entries = seen.setdefault(field.name, {})
            if field.type in entries:
                continue
            entries[field.type] = name
            if common_type(list(entries)) is not None:
                continue
            typ, other = next(
                ((t, n) for t, n in entries.items() if common_type([t, field.type]) is None),
                next(iter(entries.items())),
            )
            raise SchemaMismatchError(
                f"the Parquet output shards in {root!r} do not agree: column {field.name!r} is "
                f"{arrow_type_name(typ)} in {other} but {arrow_type_name(field.type)} in {name} "
                "(each shard is typed from its own records; give the column one type in every "
                "record, or convert to array_record); nothing was published"
            )


ARRAY_RECORD_OUTPUT = ArrayRecordOutput()
PARQUET_OUTPUT = ParquetOutput()
