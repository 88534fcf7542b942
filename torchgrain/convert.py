"""Convert Parquet, TFRecord or ArrayRecord datasets to torchgrain ArrayRecord (or Parquet).

One call (or ``torchgrain convert SRC DST``) reads every record of the source, in order,
and writes sharded output plus a manifest with per-shard record counts and checksums.

How the work is split
    The input is a list of shards (files). With ``match_shards=True`` (the default when
    ``num_shards`` is not given) output shard ``i`` holds exactly input shard ``i``.
    With ``num_shards=N`` the global record order (input shards in sorted order, records
    in file order) is cut into ``N`` contiguous slices whose sizes differ by at most
    one; that needs every input's record count first. Parquet and ArrayRecord footers
    give counts cheaply; TFRecord has no footer, so its files are scanned first (an
    uncompressed file by walking the 12-byte record headers with
    :func:`~torchgrain.sources.tfrecord.index_tfrecord`, a gzip/zlib file by a full
    decompression pass, which costs as much as a second read; prefer
    ``match_shards`` for compressed TFRecord). The scan runs in the worker pool and its
    result is kept, so a resumed run does not repeat it.

Parallel and resumable
    Output shards are independent tasks run by a process pool (``forkserver`` or
    ``spawn``: never ``fork``, which is unsafe after a parent has read ArrayRecord files
    with the C++ reader). Each shard is written under a hidden temporary name, read back
    and verified (record count, and a checksum over the records), then renamed. The
    parent records every finished shard in ``DST/.torchgrain-convert/``; a rerun after a
    crash (or ``kill -9``) skips finished shards and produces the same result. The
    manifest is written last.

Checksums
    ``ShardInfo.checksum`` is ``"blake2b-records:" + hex`` for ArrayRecord output: BLAKE2b
    (16-byte digest) over, for every record in order, its length as a little-endian
    uint64 followed by its bytes. It does not depend on the ArrayRecord compression or
    group size. For Parquet output it is ``"blake2b-file:" + hex`` over the file's bytes.

Example:
    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq, torchgrain as tg
    >>> src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> for i in range(3):
    ...     pq.write_table(pa.table({"id": [i * 10 + j for j in range(10)]}),
    ...                    os.path.join(src, f"part-{i}.parquet"))
    >>> m = tg.convert(src, dst, num_shards=2)
    >>> [s.num_records for s in m.shards]
    [15, 15]
    >>> tg.ArrayRecordSource(dst)[17]["id"]
    17
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import multiprocessing
import os
import queue
import signal
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.io.fs import expand_paths, get_filesystem, is_local
from torchgrain.sources.codecs import Codec, _merge_one, get_codec, merge_schema
from torchgrain.sources.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    atomic_write_text,
    read_manifest,
)
from torchgrain.writers import _writer_options, shard_name

__all__ = ["FORMATS", "convert", "detect_format", "records_to_table", "verify_shard"]

#: Source formats :func:`convert` reads.
FORMATS = ("parquet", "tfrecord", "array_record")
_SUFFIXES = {
    "parquet": (".parquet", ".parq"),
    "tfrecord": (".tfrecord", ".tfrecords"),
    "array_record": (".array_record", ".arrayrecord"),
}
JOURNAL_DIR = ".torchgrain-convert"
_LEN = struct.Struct("<Q")
_READ_BATCH = 1024  # records read (and hashed) per call
_PARQUET_ROW_GROUP_BYTES = 32 << 20  # in-memory size of one output row group
_PARQUET_MAX_ROWS = 1 << 16
_PROGRESS_INTERVAL = 0.25  # seconds between a worker's progress messages


# --------------------------------------------------------------------------- checksums
class RecordHasher:
    """The record checksum :func:`convert` stores (see the module docstring).

    Example:
        >>> h = RecordHasher()
        >>> h.update(b"a"); h.update(b"bc")
        >>> h.hexdigest() == RecordHasher.of([b"a", b"bc"])
        True
    """

    prefix = "blake2b-records:"

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, record: bytes) -> None:
        self._h.update(_LEN.pack(len(record)))
        self._h.update(record)

    def hexdigest(self) -> str:
        return self.prefix + self._h.hexdigest()

    @classmethod
    def of(cls, records: Sequence[bytes]) -> str:
        h = cls()
        for r in records:
            h.update(r)
        return h.hexdigest()


def _file_checksum(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return "blake2b-file:" + h.hexdigest()


# --------------------------------------------------------------------------- inputs
def detect_format(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> str:
    """Guess the source format of a path, glob, directory or list of them by file suffix.

    A directory with a ``torchgrain.json`` manifest is ``array_record``; otherwise the
    suffixes of the files in it decide (``.parquet``/``.parq``, ``.tfrecord``/
    ``.tfrecords`` (also ``.tfrecord.gz``, TFDS's ``x.tfrecord-00000-of-00008``),
    ``.array_record``).

    Raises:
        ValueError: no file of a known format, or files of several formats.

    Example:
        >>> detect_format("data/train-00000-of-00004.tfrecord.gz")
        'tfrecord'
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    found: set[str] = set()
    for item in items:
        fs, p = get_filesystem(item)
        names: list[str]
        if not any(ch in p for ch in "*?[") and fs.isdir(p):
            if fs.isfile(f"{p.rstrip('/')}/{MANIFEST_NAME}"):
                found.add("array_record")
                continue
            names = [f.rsplit("/", 1)[-1] for f in fs.find(p)]
            names = [n for n in names if not n.startswith((".", "_"))]
        else:
            names = [os.fspath(item).rsplit("/", 1)[-1]]
        for n in names:
            for fmt, sufs in _SUFFIXES.items():
                if any(s in n for s in sufs):
                    found.add(fmt)
    if len(found) == 1:
        return found.pop()
    if not found:
        raise ValueError(
            f"cannot tell the format of {paths!r} from its file names; pass "
            f"src_format= one of {FORMATS}"
        )
    raise ValueError(
        f"{paths!r} holds files of several formats ({', '.join(sorted(found))}); "
        "convert them separately or pass src_format="
    )


@dataclass
class _Input:
    """A picklable description of the source: what each worker needs to read it."""

    format: str
    paths: list[str]
    counts: list[int] | None  # records per input shard (None: TFRecord not yet counted)
    codec: Any  # codec name or object that turns record bytes into dicts; None for Parquet
    passthrough: bool  # records are msgpack already: copy the bytes
    storage_options: dict[str, Any] | None = None
    parquet: Any = None  # a ParquetSource over all input files

    def sizes(self) -> list[int]:
        fs = self._fs()
        return [int(fs.size(self._strip(p))) for p in self.paths]

    def _fs(self) -> Any:
        return get_filesystem(self.paths[0], self.storage_options)[0]

    def _strip(self, p: str) -> str:
        return get_filesystem(p, self.storage_options)[1]

    # --- record iteration (in a worker) ---------------------------------------
    def iter_bytes(self, shard: int, start: int, stop: int | None) -> Iterator[bytes]:
        """Record bytes ``[start, stop)`` of input shard ``shard`` (TFRecord / ArrayRecord)."""
        if self.format == "tfrecord":
            yield from _iter_tfrecord_range(self.paths[shard], start, stop, self.storage_options)
            return
        from torchgrain.sources.arrayrecord_file import ArrayRecordFile

        path = self.paths[shard]
        fs, _ = get_filesystem(path, self.storage_options)
        f = ArrayRecordFile(path, filesystem=None if is_local(fs) else fs)
        try:
            end = f.num_records if stop is None else stop
            for a in range(start, end, _READ_BATCH):
                b = min(a + _READ_BATCH, end)
                yield from _read_range(f, a, b)
        finally:
            f.close()

    def iter_dicts(self, shard: int, start: int, stop: int | None) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of input shard ``shard`` as dicts (Parquet)."""
        src = self.parquet
        base = int(src.index.offsets[shard])
        end = base + (int(src.index.counts[shard]) if stop is None else stop)
        # Read whole row-group intersections so each row group is decoded once.
        bounds = src.block_offsets()
        a = base + start
        while a < end:
            g = int(np.searchsorted(bounds, a, side="right"))
            b = min(end, int(bounds[g]) if g < len(bounds) else end, a + _PARQUET_MAX_ROWS)
            yield from src.__getitems__(range(a, b))
            a = b


def _read_range(f: Any, a: int, b: int) -> list[bytes]:
    read_range = getattr(f, "read_range", None)
    if read_range is not None:
        return list(read_range(a, b))
    return list(f.read(np.arange(a, b)))


def _iter_tfrecord_range(
    path: str, start: int, stop: int | None, storage_options: dict[str, Any] | None
) -> Iterator[bytes]:
    from torchgrain.sources.tfrecord import index_tfrecord, iter_tfrecord, resolve_compression

    fs, _ = get_filesystem(path, storage_options)
    offset = 0
    skip = start
    if start > 0 and resolve_compression(path, None) == "":
        # Jump to the first wanted record with a header walk instead of reading the data.
        offsets = index_tfrecord(path, filesystem=fs)
        if start >= len(offsets):
            return
        offset, skip = int(offsets[start]), 0
    want = None if stop is None else stop - start
    if want == 0:
        return
    n = 0
    for k, rec in enumerate(iter_tfrecord(path, filesystem=fs, offset=offset)):
        if k < skip:
            continue
        yield rec
        n += 1
        if n == want:
            return


def _count_tfrecord(path: str, storage_options: dict[str, Any] | None) -> int:
    from torchgrain.sources.tfrecord import index_tfrecord, iter_tfrecord, resolve_compression

    fs, _ = get_filesystem(path, storage_options)
    if resolve_compression(path, None) == "":
        return len(index_tfrecord(path, filesystem=fs))
    return sum(1 for _ in iter_tfrecord(path, filesystem=fs))


def _open_input(
    src: Any, src_format: str, codec: Any, storage_options: dict[str, Any] | None
) -> _Input:
    fmt = detect_format(src) if src_format == "auto" else src_format
    if fmt not in FORMATS:
        raise ValueError(f"src_format must be 'auto' or one of {FORMATS}, got {src_format!r}")
    if fmt == "parquet":
        from torchgrain.sources.parquet import ParquetSource

        if codec not in ("auto", None):
            raise ValueError("codec= applies to TFRecord and ArrayRecord sources, not Parquet")
        psrc = ParquetSource(src, storage_options=storage_options, cache_bytes=0)
        return _Input(
            fmt,
            list(psrc.paths),
            [int(c) for c in psrc.index.counts],
            None,
            False,
            storage_options,
            psrc,
        )
    if fmt == "array_record":
        from torchgrain.sources.arrayrecord import ArrayRecordSource

        asrc = ArrayRecordSource(src, codec=codec, storage_options=storage_options)
        name = getattr(asrc.codec, "name", None)
        passthrough = name == "msgpack" and type(asrc.codec).__name__ == "MsgpackCodec"
        return _Input(
            fmt,
            list(asrc.paths),
            [int(c) for c in asrc.index.counts],
            asrc.codec,
            passthrough,
            storage_options,
        )
    fs, files = expand_paths(
        src, suffixes=_SUFFIXES["tfrecord"], storage_options=storage_options, kind="TFRecord"
    )
    if codec in ("auto", None):
        codec = _tfrecord_codec(files, storage_options)
    elif isinstance(codec, str) and codec == "tf_example":
        from torchgrain.sources.tfds import tfds_codec_for

        codec = tfds_codec_for(files, fs) or codec
    resolved = get_codec(codec)
    return _Input(fmt, files, None, resolved, False, storage_options)


def _tfrecord_codec(files: list[str], storage_options: dict[str, Any] | None) -> Codec:
    """TFRecord records are tf.train.Example unless the first one does not parse as one."""
    from torchgrain.errors import RecordDecodeError
    from torchgrain.sources.tf_example import decode_tf_example
    from torchgrain.sources.tfds import tfds_codec_for
    from torchgrain.sources.tfrecord import iter_tfrecord

    fs, _ = get_filesystem(files[0], storage_options)
    tfds = tfds_codec_for(files, fs)
    if tfds is not None:
        return tfds
    for path in files:
        for rec in iter_tfrecord(path, filesystem=fs):
            try:
                decode_tf_example(rec)
            except RecordDecodeError:
                return get_codec("raw")
            return get_codec("tf_example")
    return get_codec("tf_example")


# --------------------------------------------------------------------------- outputs
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


class _ArrayRecordOut:
    def __init__(self, path: str, options: str) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        self._w = ArrayRecordWriter(path, options)

    def write(self, data: bytes) -> None:
        self._w.write(data)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _ParquetOut:
    def __init__(self, path: str, compression: str, row_group_bytes: int) -> None:
        self._path = path
        self._compression = compression
        self._target = row_group_bytes
        self._writer: Any = None
        self._pending: list[dict[str, Any]] = []
        self._tables: list[Any] = []
        self._bytes = 0

    def add(self, rec: dict[str, Any]) -> None:
        self._pending.append(rec)
        if len(self._pending) >= 512:
            self._convert()

    def _convert(self) -> None:
        if self._pending:
            t = records_to_table(self._pending)
            self._pending = []
            self._tables.append(t)
            self._bytes += t.nbytes
            if self._bytes >= self._target or sum(x.num_rows for x in self._tables) >= (
                _PARQUET_MAX_ROWS
            ):
                self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._tables:
            return
        table = pa.concat_tables(self._tables, promote_options="permissive")
        self._tables, self._bytes = [], 0
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._path, table.schema, compression=self._compression)
        elif not table.schema.equals(self._writer.schema):
            table = table.cast(self._writer.schema)
        self._writer.write_table(table, row_group_size=table.num_rows)

    def close(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._convert()
        self._flush()
        if self._writer is None:  # no records: an empty file with an empty schema
            pq.write_table(pa.table({}), self._path, compression=self._compression)
        else:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None


def verify_shard(path: str, num_records: int, checksum: str | None = None) -> None:
    """Check a written shard's record count (and record checksum, for ArrayRecord).

    Raises:
        CorruptDataError: a mismatch, naming the file.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> m = tg.convert(tg.write_array_record([{"a": 1}], d + "/in"), d + "/out")
        >>> verify_shard(f"{d}/out/{m.shards[0].path}", 1, m.shards[0].checksum)
    """
    if ".parquet" in os.path.basename(path):
        import pyarrow.parquet as pq

        n = pq.read_metadata(path).num_rows
        if n != num_records:
            raise CorruptDataError(f"{path}: holds {n} records, expected {num_records}")
        if checksum is not None and _file_checksum(path) != checksum:
            raise CorruptDataError(f"{path}: file checksum mismatch")
        return
    from torchgrain.sources.arrayrecord_file import ArrayRecordFile

    f = ArrayRecordFile(path)
    try:
        n = f.num_records
        if n != num_records:
            raise CorruptDataError(f"{path}: holds {n} records, expected {num_records}")
        if checksum is not None:
            h = RecordHasher()
            for a in range(0, n, _READ_BATCH):
                for rec in _read_range(f, a, min(a + _READ_BATCH, n)):
                    h.update(rec)
            if h.hexdigest() != checksum:
                raise CorruptDataError(
                    f"{path}: record checksum {h.hexdigest()} read back differs from the "
                    f"{checksum} computed while writing"
                )
    finally:
        f.close()


# --------------------------------------------------------------------------- tasks
@dataclass
class _Task:
    index: int
    name: str  # output file name
    pieces: list[tuple[int, int, int | None]]  # (input shard, start, stop); None: to the end
    expected: int | None  # records this shard must hold, when known


@dataclass
class _Job:
    """Everything a worker needs (pickled once per task)."""

    input: _Input
    root: str
    to: str
    writer_options: str
    compression: str
    row_group_bytes: int
    verify: bool


_progress_queue: Any = None  # set in pool workers
_progress_callback: Callable[[int, int], None] | None = None  # set in-process


def _worker_init(q: Any) -> None:
    global _progress_queue
    _progress_queue = q
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    if sys.platform.startswith("linux"):
        # Die with the parent (kill -9 included): an orphan must not keep writing.
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Reporter:
    def __init__(self) -> None:
        self.records = 0
        self.bytes = 0
        self._last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.records += 1
        self.bytes += nbytes
        if self.records & 255 == 0 and time.monotonic() - self._last > _PROGRESS_INTERVAL:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if self.records:
            if _progress_queue is not None:
                _progress_queue.put((self.records, self.bytes))
            elif _progress_callback is not None:
                _progress_callback(self.records, self.bytes)
        self.records = self.bytes = 0


def _run_task(job: _Job, task: _Task) -> dict[str, Any]:
    """Write one output shard; returns its ShardInfo fields plus its schema."""
    final = os.path.join(job.root, task.name)
    tmp = os.path.join(job.root, f".{task.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    inp = job.input
    report = _Reporter()
    count = 0
    schema: dict[str, str] = {}
    where = ""
    try:
        if job.to == "array_record":
            out: Any = _ArrayRecordOut(tmp, job.writer_options)
            hasher = RecordHasher()
        else:
            out = _ParquetOut(tmp, job.compression, job.row_group_bytes)
            hasher = None
        from torchgrain.sources.codecs import MsgpackCodec

        msgpack = MsgpackCodec()
        try:
            for shard, start, stop in task.pieces:
                where = f"input shard {shard} ({inp.paths[shard]!r})"
                k = start
                for rec, size in _records(inp, shard, start, stop, job.to == "array_record"):
                    if job.to == "array_record":
                        if isinstance(rec, dict):
                            try:
                                data = msgpack.encode(rec)
                            except (TypeError, ValueError) as e:
                                raise TypeError(f"cannot encode record {k} of {where}: {e}") from e
                        else:
                            data = rec
                        out.write(data)
                        hasher.update(data)  # type: ignore[union-attr]
                        size = len(data)
                    else:
                        out.add(rec)
                    if count < 64 or count % 1009 == 0:
                        if not isinstance(rec, dict):
                            rec = msgpack.decode(rec)
                        schema = merge_schema(schema, rec)
                    count += 1
                    k += 1
                    report.add(size)
            out.close()
        except BaseException:
            out.abort()
            raise
        report.flush()
        if task.expected is not None and count != task.expected:
            raise CorruptDataError(
                f"output shard {task.name}: read {count} records from its input, expected "
                f"{task.expected} (did an input file change during the conversion?)"
            )
        checksum = hasher.hexdigest() if hasher is not None else _file_checksum(tmp)
        if job.verify:
            verify_shard(tmp, count, checksum)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, TorchgrainError) and where and where not in str(e):
            raise type(e)(f"{e} (converting {where} into output shard {task.name})") from e
        raise
    return {
        "index": task.index,
        "path": task.name,
        "num_records": count,
        "num_bytes": os.path.getsize(final),
        "checksum": checksum,
        "schema": schema,
    }


def _records(
    inp: _Input, shard: int, start: int, stop: int | None, bytes_ok: bool
) -> Iterator[tuple[Any, int]]:
    """(record, input bytes) pairs: msgpack bytes when they can pass through, else dicts."""
    if inp.format == "parquet":
        for rec in inp.iter_dicts(shard, start, stop):
            yield rec, 0
        return
    if inp.passthrough and bytes_ok:
        for data in inp.iter_bytes(shard, start, stop):
            yield data, len(data)
        return
    decode = inp.codec.decode
    path = inp.paths[shard]
    for k, data in enumerate(inp.iter_bytes(shard, start, stop), start):
        try:
            rec = decode(data)
        except Exception as e:
            from torchgrain.errors import RecordDecodeError

            raise RecordDecodeError(
                f"cannot decode record {k} of {path!r} with codec "
                f"{getattr(inp.codec, 'name', inp.codec)!r}: {e}"
            ) from e
        yield rec, len(data)


# --------------------------------------------------------------------------- planning
def _plan(
    counts: list[int] | None, num_inputs: int, num_shards: int | None, to: str
) -> list[_Task]:
    suffix = ".array_record" if to == "array_record" else ".parquet"

    def name(i: int, n: int) -> str:
        return shard_name(i, n).replace(".array_record", suffix)

    if num_shards is None:
        return [
            _Task(i, name(i, num_inputs), [(i, 0, None)], None if counts is None else counts[i])
            for i in range(num_inputs)
        ]
    assert counts is not None
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    total = int(offsets[-1])
    tasks = []
    for j in range(num_shards):
        a, b = total * j // num_shards, total * (j + 1) // num_shards
        pieces = []
        first = int(np.searchsorted(offsets, a, side="right")) - 1
        for s in range(max(first, 0), num_inputs):
            lo, hi = int(offsets[s]), int(offsets[s + 1])
            if lo >= b:
                break
            if hi <= a or hi == lo:
                continue
            pieces.append((s, max(a, lo) - lo, min(b, hi) - lo))
        tasks.append(_Task(j, name(j, num_shards), pieces, b - a))
    return tasks


def _merge_schemas(a: dict[str, str], b: dict[str, str]) -> dict[str, str]:
    out = dict(a)
    for k, t in b.items():
        out[k] = _merge_one(out[k], t) if k in out else (t if not a else _merge_one("null", t))
    if b:
        for k in a:
            if k not in b:
                out[k] = _merge_one(out[k], "null")
    return out


def _fingerprint(inp: _Input, options: dict[str, Any]) -> dict[str, Any]:
    fs = inp._fs()
    files = []
    for p in inp.paths:
        info = fs.info(inp._strip(p))
        files.append(
            {"path": p, "size": int(info.get("size") or 0), "mtime": str(info.get("mtime", ""))}
        )
    return {"format": inp.format, "files": files, "options": options}


@dataclass
class _Journal:
    """The ``.torchgrain-convert`` directory: the plan and every finished shard."""

    root: str
    dir: str = field(init=False)

    def __post_init__(self) -> None:
        self.dir = os.path.join(self.root, JOURNAL_DIR)

    def load_plan(self) -> dict[str, Any] | None:
        p = os.path.join(self.dir, "plan.json")
        if not os.path.isfile(p):
            return None
        with open(p) as f:
            return json.load(f)

    def save_plan(self, plan: dict[str, Any]) -> None:
        os.makedirs(self.dir, exist_ok=True)
        atomic_write_text(os.path.join(self.dir, "plan.json"), json.dumps(plan))

    def done(self) -> dict[int, dict[str, Any]]:
        out = {}
        if os.path.isdir(self.dir):
            for n in os.listdir(self.dir):
                if n.startswith("shard-") and n.endswith(".json"):
                    with open(os.path.join(self.dir, n)) as f:
                        r = json.load(f)
                    out[int(r["index"])] = r
        return out

    def record(self, result: dict[str, Any]) -> None:
        atomic_write_text(
            os.path.join(self.dir, f"shard-{result['index']:05d}.json"), json.dumps(result)
        )

    def clear(self) -> None:
        if os.path.isdir(self.dir):
            for n in os.listdir(self.dir):
                if n != "lock":
                    os.unlink(os.path.join(self.dir, n))


@contextlib.contextmanager
def _locked(journal: _Journal) -> Iterator[None]:
    import fcntl

    os.makedirs(journal.dir, exist_ok=True)
    fd = os.open(os.path.join(journal.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TorchgrainError(
                f"another conversion is writing to {journal.root} (lock held on {journal.dir}/lock)"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the lock (so does the process dying)


# --------------------------------------------------------------------------- the driver
class _Progress:
    """tqdm bar on a terminal (records and MB/s), silent otherwise."""

    def __init__(self, total: int | None, enabled: bool | None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit="rec", unit_scale=True, desc="convert")
        self._t0 = time.monotonic()
        self._bytes = 0
        self._lock = threading.Lock()

    def update(self, records: int, nbytes: int) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bytes += nbytes
            self._bar.update(records)
            mbps = self._bytes / max(time.monotonic() - self._t0, 1e-9) / 1e6
            self._bar.set_postfix_str(f"{mbps:.1f} MB/s", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _mp_context() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # The fork server imports torchgrain (and torch) once; each worker then starts by a
    # fork of it in milliseconds instead of re-importing everything.
    ctx.set_forkserver_preload(["torchgrain.convert"])
    return ctx


def convert(
    src: str | os.PathLike | Sequence[str | os.PathLike],
    dst: str | os.PathLike,
    *,
    to: str = "array_record",
    num_shards: int | None = None,
    match_shards: bool = False,
    group_size: int = 1,
    workers: int = 1,
    codec: str | Codec = "auto",
    compression: str | None = None,
    src_format: str = "auto",
    row_group_bytes: int = _PARQUET_ROW_GROUP_BYTES,
    verify: bool = True,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Convert a Parquet, TFRecord or ArrayRecord dataset; resumable, verified, parallel.

    Args:
        src: directory, glob, file, list of these, or fsspec URLs.
        dst: output directory (local).
        to: ``"array_record"`` (msgpack records plus a ``torchgrain.json`` manifest) or
            ``"parquet"`` (one ``.parquet`` file per output shard).
        num_shards: cut the global record order into this many contiguous output shards.
        match_shards: one output shard per input shard (the default when ``num_shards``
            is not given).
        group_size: records per ArrayRecord chunk (1: fastest random access).
        workers: processes converting shards in parallel (1: in this process).
        codec: how TFRecord/ArrayRecord records are decoded: ``"auto"`` (ArrayRecord:
            the manifest's codec or sniffed; TFRecord: ``tf_example`` when the records
            parse as ``tf.train.Example``, else ``raw``; TFDS directories: decoded per
            their ``features.json``), ``"tf_example"``, ``"raw"`` (keep the bytes, as
            ``{"bytes": ...}``), ``"msgpack"``, or a codec object.
        compression: ArrayRecord ``zstd[:LEVEL]`` (default ``zstd:3``), ``snappy``,
            ``brotli``, ``uncompressed``; Parquet ``zstd`` (default), ``snappy``,
            ``gzip``, ``lz4``, ``none``.
        src_format: ``"auto"`` (by file suffix) or one of :data:`FORMATS`.
        row_group_bytes: Parquet output row groups hold about this many bytes of
            Arrow data (at most 65,536 rows).
        verify: read every written shard back and check its count and checksum.
        overwrite: replace whatever ``dst`` holds (another dataset or a conversion
            with other inputs or options) instead of raising.
        progress: show a progress bar (default: when stderr is a terminal).
        storage_options: fsspec options for remote sources.

    Returns:
        The manifest (written to ``dst/torchgrain.json`` for ArrayRecord output; kept in
        ``dst/.torchgrain-convert/`` for Parquet output).

    Raises:
        CorruptDataError: a corrupt input record (the message names file and offset or
            record); shards finished before stay, the failing one leaves no file.
        FileExistsError: ``dst`` holds something else and ``overwrite`` is False.

    Example:
        >>> import os, tempfile, torchgrain as tg
        >>> from torchgrain.sources.tfrecord import write_tfrecord
        >>> from torchgrain.sources.tf_example import encode_tf_example
        >>> d = tempfile.mkdtemp()
        >>> _ = write_tfrecord([encode_tf_example({"label": i}) for i in range(4)],
        ...                    os.path.join(d, "train.tfrecord"))
        >>> m = tg.convert(os.path.join(d, "train.tfrecord"), os.path.join(d, "out"))
        >>> m.num_records, tg.ArrayRecordSource(os.path.join(d, "out"))[3]["label"].tolist()
        (4, [3])
    """
    if to not in ("array_record", "parquet"):
        raise ValueError(f"to must be 'array_record' or 'parquet', got {to!r}")
    if num_shards is not None and match_shards:
        raise ValueError("pass either num_shards or match_shards, not both")
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if to == "array_record":
        compression = compression or "zstd:3"
        writer_options = _writer_options(group_size, compression)
    else:
        compression = compression or "zstd"
        writer_options = ""
    fs, root = get_filesystem(dst)
    if not is_local(fs):
        raise NotImplementedError(
            f"convert writes local directories; convert locally and upload, or use "
            f"torchgrain.beam for {os.fspath(dst)!r}"
        )
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    inp = _open_input(src, src_format, codec, storage_options)
    options = {
        "to": to,
        "num_shards": num_shards,
        "group_size": group_size,
        "compression": compression,
        "codec": getattr(inp.codec, "name", None) if inp.codec is not None else None,
        "row_group_bytes": row_group_bytes if to == "parquet" else None,
    }
    if is_local(inp._fs()) and any(os.path.dirname(os.path.abspath(p)) == root for p in inp.paths):
        raise ValueError(f"{root} holds input files: write the conversion to another directory")
    journal = _Journal(root)
    with _locked(journal):
        fingerprint = _fingerprint(inp, options)
        plan = journal.load_plan()
        if plan is not None and plan["fingerprint"] != fingerprint:
            if not overwrite:
                raise FileExistsError(
                    f"{root} holds a conversion of other inputs or options; pass "
                    "overwrite=True to start over"
                )
            _remove_outputs(root, plan)
            journal.clear()
            plan = None
        if plan is None:
            old = read_manifest(fs, root)
            if old is not None and not overwrite:
                raise FileExistsError(
                    f"{root} already holds a torchgrain dataset ({MANIFEST_NAME}); pass "
                    "overwrite=True"
                )
            if old is not None:
                _remove_outputs(root, {"tasks": [{"name": s.path} for s in old.shards]})
        _remove_temps(root)
        ctx = _mp_context()
        pool: futures.ProcessPoolExecutor | None = None
        progress_q: Any = None
        try:
            if workers > 1:
                progress_q = ctx.Queue()
                pool = futures.ProcessPoolExecutor(
                    workers, mp_context=ctx, initializer=_worker_init, initargs=(progress_q,)
                )
            if plan is None:
                counts = inp.counts
                if counts is None and num_shards is not None:
                    counts = _count_all(inp, pool)
                tasks = _plan(counts, len(inp.paths), num_shards, to)
                plan = {
                    "fingerprint": fingerprint,
                    "counts": counts,
                    "tasks": [asdict(t) for t in tasks],
                }
                journal.save_plan(plan)
            tasks = [
                _Task(t["index"], t["name"], [tuple(p) for p in t["pieces"]], t["expected"])
                for t in plan["tasks"]
            ]
            done = {
                i: r
                for i, r in journal.done().items()
                if _still_there(os.path.join(root, r["path"]), r["num_bytes"])
            }
            todo = [t for t in tasks if t.index not in done]
            job = _Job(inp, root, to, writer_options, compression, row_group_bytes, verify)
            counts = plan["counts"]
            total = int(sum(counts)) if counts is not None else None
            bar = _Progress(total, progress)
            if bar._bar is not None and done:
                bar._bar.update(sum(r["num_records"] for r in done.values()))
            try:
                for result in _execute(job, todo, pool, progress_q, bar):
                    journal.record(result)
                    done[result["index"]] = result
            finally:
                bar.close()
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        results = [done[t.index] for t in tasks]
        manifest = _finish(root, inp, to, group_size, compression, plan, results)
    return manifest


def _still_there(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False


def _remove_outputs(root: str, plan: dict[str, Any]) -> None:
    for t in plan.get("tasks", []):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, t["name"]))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, MANIFEST_NAME))


def _remove_temps(root: str) -> None:
    # Temporary shards of an interrupted run (the lock guarantees no run is active).
    for n in os.listdir(root):
        if n.startswith(".") and ".tmp-" in n and (".array_record" in n or ".parquet" in n):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, n))


def _count_all(inp: _Input, pool: futures.ProcessPoolExecutor | None) -> list[int]:
    if pool is None:
        return [_count_tfrecord(p, inp.storage_options) for p in inp.paths]
    futs = [pool.submit(_count_tfrecord, p, inp.storage_options) for p in inp.paths]
    return [f.result() for f in futs]


def _execute(
    job: _Job,
    tasks: list[_Task],
    pool: futures.ProcessPoolExecutor | None,
    progress_q: Any,
    bar: _Progress,
) -> Iterator[dict[str, Any]]:
    global _progress_callback
    if pool is None:
        _progress_callback = bar.update
        try:
            for t in tasks:
                yield _run_task(job, t)
        finally:
            _progress_callback = None
        return
    pending = {pool.submit(_run_task, job, t) for t in tasks}
    try:
        while pending:
            finished, pending = futures.wait(
                pending, timeout=0.2, return_when=futures.FIRST_COMPLETED
            )
            _drain(progress_q, bar)
            for f in finished:
                yield f.result()  # re-raises a worker's error here
    finally:
        for f in pending:
            f.cancel()
        _drain(progress_q, bar)


def _drain(q: Any, bar: _Progress) -> None:
    while True:
        try:
            records, nbytes = q.get_nowait()
        except (queue.Empty, OSError, ValueError):
            return
        bar.update(records, nbytes)


def _finish(
    root: str,
    inp: _Input,
    to: str,
    group_size: int,
    compression: str,
    plan: dict[str, Any],
    results: list[dict[str, Any]],
) -> Manifest:
    counts = plan["counts"]
    total = sum(r["num_records"] for r in results)
    if counts is not None and total != sum(counts):
        raise CorruptDataError(
            f"wrote {total} records but the input holds {sum(counts)}; nothing was published"
        )
    schema: dict[str, str] = {}
    for r in results:
        if r["num_records"]:
            schema = _merge_schemas(schema, r["schema"])
    shards = [
        ShardInfo(
            path=r["path"],
            num_records=r["num_records"],
            num_bytes=r["num_bytes"],
            checksum=r["checksum"],
        )
        for r in results
    ]
    manifest = Manifest(
        codec="msgpack" if to == "array_record" else "parquet",
        shards=shards,
        schema=schema,
        group_size=group_size if to == "array_record" else 1,
    )
    manifest.extra["compression"] = compression
    manifest.extra["converted_from"] = {"format": inp.format, "num_files": len(inp.paths)}
    text = manifest.to_json()
    if to == "array_record":
        atomic_write_text(os.path.join(root, MANIFEST_NAME), text)
    else:
        atomic_write_text(os.path.join(root, JOURNAL_DIR, "result.json"), text)
    return manifest
