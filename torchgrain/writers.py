"""Writers: turn an iterable of record dicts into a torchgrain ArrayRecord dataset."""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Iterable, Sequence, Sized
from typing import Any

import numpy as np

from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.formats.checksums import RecordHasher, file_checksum
from torchgrain.formats.codecs import get_codec, merge_schema
from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo, read_manifest
from torchgrain.io.atomic import atomic_path, atomic_write_text, publish, temp_name
from torchgrain.io.fs import get_filesystem, is_local
from torchgrain.sources.node_index import INDEX_NAME, write_dataset_index

__all__ = [
    "array_record_options",
    "records_to_table",
    "shard_name",
    "write_array_record",
    "write_parquet",
]


def shard_name(index: int, num_shards: int, prefix: str = "data") -> str:
    """File name of shard ``index`` of ``num_shards``.

    Example:
        >>> shard_name(3, 8)
        'data-00003-of-00008.array_record'
    """
    return f"{prefix}-{index:05d}-of-{num_shards:05d}.array_record"


def array_record_options(group_size: int, compression: str) -> str:
    """The ArrayRecord writer options string for a group size and a compression.

    Example:
        >>> array_record_options(1, "zstd:3")
        'group_size:1,zstd:3'
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    allowed = ("zstd", "snappy", "brotli", "uncompressed")
    base = compression.split(":", 1)[0]
    if base not in allowed:
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
        overwrite: replace an existing torchgrain dataset in ``directory``.

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
    try:
        old = read_manifest(fs, root)
    except CorruptDataError:
        old = None  # overwriting a damaged dataset: its manifest is replaced below
    enc = get_codec(codec)
    if not callable(getattr(enc, "encode", None)):
        raise ValueError(f"codec {codec!r} cannot encode records")
    options = array_record_options(group_size, compression)

    names = [shard_name(i, num_shards, prefix) for i in range(num_shards)]
    finals = [os.path.join(root, n) for n in names]
    temps = [temp_name(f) for f in finals]
    counts = [0] * num_shards
    hashers = [RecordHasher() for _ in range(num_shards)]
    schema: dict[str, str] = {}
    writers: list[Any] = []
    try:
        if isinstance(records, Sized):
            total = len(records)
            bounds = [total * i // num_shards for i in range(1, num_shards + 1)]

            def shard_of(k: int) -> int:  # contiguous slices keep the input order
                return bisect.bisect_right(bounds, k)
        else:
            total = -1

            def shard_of(k: int) -> int:  # round-robin for iterators of unknown length
                return k % num_shards

        writers = [ArrayRecordWriter(t, options) for t in temps]
        k = -1
        for k, rec in enumerate(records):
            if total >= 0 and k >= total:
                raise TorchgrainError(f"records yielded more than its length {total}")
            try:
                data = enc.encode(rec)
            except (TypeError, ValueError) as e:
                raise TypeError(f"cannot encode record {k}: {e}") from e
            s = shard_of(k)
            writers[s].write(data)
            hashers[s].update(data)
            counts[s] += 1
            if k < 10_000 or k % 1009 == 0:
                # The schema is sampled: every record early on, then a spread of them.
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
        if os.path.exists(manifest_path):
            os.unlink(manifest_path)
        if os.path.exists(os.path.join(root, INDEX_NAME)):
            os.unlink(os.path.join(root, INDEX_NAME))
        if old is not None:
            for info in old.shards:
                stale = os.path.join(root, info.path)
                if os.path.exists(stale):
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
        manifest = Manifest(codec=enc.name, shards=shards, schema=schema, group_size=group_size)
        manifest.extra["compression"] = compression
        # Every chunk's offset and size, mapped by every process that reads the dataset
        # (see torchgrain.sources.node_index); recorded with its checksum.
        manifest.extra["index"] = write_dataset_index(root, names)
        atomic_write_text(manifest_path, manifest.to_json())
    finally:
        for w in writers:
            with contextlib.suppress(Exception):
                w.close()
        for t in temps:
            if os.path.exists(t):
                os.unlink(t)
    return finals


def records_to_table(records: Sequence[dict[str, Any]]) -> Any:
    """Build a ``pyarrow.Table`` from record dicts (the Parquet writer of :func:`convert`).

    numpy arrays become (nested) lists of their dtype, so :class:`~torchgrain.ParquetSource`
    reads 1-D arrays back as arrays of the same dtype; numpy scalars keep their dtype;
    ``None`` is a null. Other values go through ``pyarrow.array``'s inference. A key
    missing from some records is null there.

    Raises:
        TypeError: a column mixes arrays of different dtypes or ranks with other values.

    Example:
        >>> import numpy as np
        >>> t = records_to_table([{"x": np.arange(3, dtype=np.int16), "s": "a"},
        ...                       {"x": np.arange(2, dtype=np.int16), "s": None}])
        >>> t.schema.field("x").type, t.column("s").to_pylist()
        (ListType(list<item: int16>), ['a', None])
    """
    import pyarrow as pa

    keys: dict[str, None] = {}
    for r in records:
        for k in r:
            keys.setdefault(k, None)
    arrays = []
    for k in keys:
        values = [r.get(k) for r in records]
        try:
            arrays.append(_column(values))
        except (TypeError, ValueError, OverflowError, pa.ArrowException) as e:
            raise TypeError(f"cannot store key {k!r} in Parquet: {e}") from e
    return pa.Table.from_arrays(arrays, names=list(keys))


def _column(values: list[Any]) -> Any:
    import pyarrow as pa

    present = [v for v in values if v is not None]
    if present and all(isinstance(v, (np.ndarray, np.generic)) for v in present):
        arrs = [np.asarray(v) for v in present]
        dtypes = {a.dtype for a in arrs}
        ndims = {a.ndim for a in arrs}
        if len(dtypes) != 1 or len(ndims) != 1:
            raise TypeError(
                f"arrays of different dtypes/ranks in one column: "
                f"{sorted(str(d) for d in dtypes)}, ndim {sorted(ndims)}"
            )
        dtype, ndim = dtypes.pop(), ndims.pop()
        mask = np.array([v is None for v in values])
        if ndim == 0:
            flat = np.zeros(len(values), dtype=dtype)
            flat[~mask] = [a[()] for a in arrs]
            return pa.array(flat, mask=mask if mask.any() else None)
        flat = np.concatenate([a.ravel() for a in arrs]) if arrs else np.zeros(0, dtype)
        out = pa.array(flat)
        shapes = [a.shape for a in arrs]
        # Innermost level first: level k has prod(shape[:k]) lists of shape[k] items each.
        for level in range(ndim - 1, -1, -1):
            if level == 0:
                lengths = np.zeros(len(values), dtype=np.int64)
                lengths[~mask] = [s[0] for s in shapes]
            else:
                lengths = np.concatenate(
                    [np.full(int(np.prod(s[:level])), s[level], np.int64) for s in shapes]
                )
            offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            if level == 0 and mask.any():
                out = pa.ListArray.from_arrays(pa.array(offsets), out, mask=pa.array(mask))
            else:
                out = pa.ListArray.from_arrays(pa.array(offsets), out)
        return out
    ints = present and all(isinstance(v, int) and not isinstance(v, bool) for v in present)
    if ints and max(present) > np.iinfo(np.int64).max:
        # Python ints: int64 unless a value needs uint64 (msgpack keeps both ranges).
        return pa.array(values, pa.uint64())
    return pa.array(values)


def write_parquet(
    records: Iterable[dict[str, Any]],
    directory: str | os.PathLike,
    *,
    num_shards: int = 1,
    row_group_size: int = 10_000,
    prefix: str = "data",
    compression: str = "zstd",
) -> list[str]:
    """Write records as ``num_shards`` Parquet files (contiguous slices, in order).

    Values map to Arrow as :func:`records_to_table` describes; each file is written under
    a hidden temporary name and renamed when complete.

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> paths = write_parquet([{"id": i, "v": np.ones(2, np.float32)} for i in range(5)],
        ...                       d, num_shards=2)
        >>> src = tg.ParquetSource(d)
        >>> len(src), src[4]["id"], src.schema["v"]
        (5, 4, 'float32[?]')
    """
    import pyarrow.parquet as pq

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    records = list(records)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    paths = []
    n = len(records)
    for i in range(num_shards):
        part = records[n * i // num_shards : n * (i + 1) // num_shards]
        final = os.path.join(
            directory, shard_name(i, num_shards, prefix).replace(".array_record", ".parquet")
        )
        with atomic_path(final) as tmp:
            pq.write_table(
                records_to_table(part), tmp, row_group_size=row_group_size, compression=compression
            )
        paths.append(final)
    return paths
