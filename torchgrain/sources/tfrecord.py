"""TFRecordSource: random access by index over TFRecord files, through a cached offset index.

A TFRecord file has no index: records are framed one after the other. Opening a
``TFRecordSource`` the first time on a machine walks each file's 12-byte record headers
once (no data is decoded; each file's offsets are also kept in a per-file cache, keyed
by its URL, size and modification time) and writes the dataset's offsets (8 bytes per
record) into one index file, keyed by every file's URL, size and modification time, that
every process of the machine maps read-only (:mod:`torchgrain.sources.node_index`): no
per-record memory per process, and later opens only look at each file's size. A record
is then one byte range: a batch is read with a memory map locally or with coalesced
range requests remotely, and both CRCs are checked.

gzip/zlib-compressed files have no random access: they are counted (one decompression
pass, cached too) and can be read in order (``iter_shard``, which ``torchgrain
convert`` and ``inspect`` use), but reading them by index raises an error that says to
convert them.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    check_ceiling,
)
from torchgrain.formats.codecs import Codec, get_codec
from torchgrain.formats.tfds import tfds_codec_for
from torchgrain.formats.tfrecord import (
    DEFAULT_MAX_RECORD_BYTES,
    index_tfrecord,
    iter_tfrecord,
    parse_frame,
    resolve_compression,
)
from torchgrain.io import remote as io_remote
from torchgrain.io.atomic import atomic_open, disk_full_errno, disk_full_error
from torchgrain.io.fs import default_cache_dir, expand_paths, is_local, map_files
from torchgrain.io.limits import default_max_open_files
from torchgrain.io.ranges import MappedFile, fetch_ranges
from torchgrain.io.retry import RetryPolicy, retry_call, using
from torchgrain.sources.encoded import EncodedSource
from torchgrain.sources.node_index import TFRecordIndex, tfrecord_index
from torchgrain.sources.options import ReadOptions

__all__ = ["TFRECORD_SUFFIXES", "TFRecordSource", "tfrecord_codec"]

TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords")
# Block-shuffle blocks: runs of consecutive records of about this many bytes.
_BLOCK_BYTES = 1 << 20


class TFRecordSource(EncodedSource):
    """Random-access, key-value view of TFRecord files (``tf.train.Example`` or raw bytes).

    Args:
        paths: a directory, glob, file, list of these, or fsspec URLs of ``.tfrecord``
            files (TFDS's ``name.tfrecord-00000-of-00008`` included).
        codec: ``"auto"`` (TFDS feature specs when ``features.json`` is beside the files,
            else ``tf_example`` when the first record parses as one, else ``raw``),
            ``"tf_example"``, ``"raw"`` (``{"bytes": b}``) or any registered codec.
        options: how the files are read (:class:`~torchgrain.ReadOptions`: storage,
            caches, threads, retries, limits, trust); each of its fields is also
            accepted as a keyword argument (``cache_dir=...``), which replaces that
            field. ``verify_checksums`` defaults to on here: both CRC-32C checksums of
            every record read are checked (a few GB/s with ``google-crc32c``), and
            nothing else protects a TFRecord payload. ``cache_bytes`` is accepted, and
            unused: a record is a byte range, with no decoded block to keep.
        max_record_bytes: the longest record read (default 1 GiB,
            :data:`~torchgrain.formats.tfrecord.DEFAULT_MAX_RECORD_BYTES`); a longer
            one raises :class:`~torchgrain.CorruptDataError` before it is read, which
            also bounds the memory a gzip/zlib stream can make a reader use.
        index_dir: where offset indexes are cached and the dataset's index is built once
            per machine (default ``<torchgrain cache>/tfrecord-index``, see
            :func:`~torchgrain.io.fs.default_cache_dir`); ``None`` keeps them in each
            process's memory.

    Example:
        >>> import os, tempfile, torchgrain as tg
        >>> from torchgrain.formats.tf_example import encode_tf_example
        >>> from torchgrain.formats.tfrecord import write_tfrecord
        >>> d = tempfile.mkdtemp()
        >>> _ = write_tfrecord([encode_tf_example({"label": [i]}) for i in range(5)],
        ...                    os.path.join(d, "train.tfrecord"))
        >>> src = tg.TFRecordSource(d, index_dir=os.path.join(d, ".index"))
        >>> len(src), src.schema, [int(r["label"][0]) for r in src.__getitems__([4, 0, 2])]
        (5, {'label': 'int64[1]'}, [4, 0, 2])
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        codec: str | Codec = "auto",
        options: ReadOptions | None = None,
        index_dir: str | os.PathLike | type[Ellipsis] | None = ...,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        **read_options: Any,
    ) -> None:
        opts = ReadOptions.build(options, read_options)
        self.max_record_bytes = check_ceiling("max_record_bytes", max_record_bytes, 0)
        retry = opts.retry_policy
        with using(retry):  # the transport and open-time requests keep to its deadlines
            fs, files = expand_paths(
                paths,
                suffixes=TFRECORD_SUFFIXES,
                storage_options=opts.storage_options,
                filesystem=opts.filesystem,
                kind="TFRecord",
                allow_external=opts.allow_external_paths,
            )
        if index_dir is ...:
            index_dir = os.path.join(default_cache_dir(), "tfrecord-index")
        self._verify = opts.verify_or(True)
        self._compressed = np.array([resolve_compression(f, None) != "" for f in files])
        self._compressed.setflags(write=False)
        with using(retry):
            self._tfindex = _dataset_index(
                fs, files, index_dir, retry, self._compressed, max_record_bytes
            )
        counts = self._tfindex.counts
        max_open_files = opts.max_open_files
        if max_open_files == "auto":
            # A local reader is a memory map, which holds a file descriptor; remote
            # readers hold nothing.
            max_open_files = default_max_open_files(len(files), 1) if is_local(fs) else None
        self._init_shards(
            filesystem=fs,
            paths=files,
            counts=counts,
            options=opts,
            cache_bytes=0,  # nothing to decompress: a record is a byte range
            max_open_files=max_open_files,
        )
        with using(retry):
            if isinstance(codec, str) and codec in ("auto", "tf_example"):
                # TFDS output: decode per its features.json (images, shapes, scalars).
                codec = tfds_codec_for(files, fs) or codec
            self.codec: Codec = (
                tfrecord_codec(files, fs, max_record_bytes) if codec == "auto" else get_codec(codec)
            )

    # Record i of shard s spans _bounds[_base[s] + i] .. _bounds[_base[s] + i + 1]: each
    # shard's offsets followed by its size, in one array of the mapped dataset index.
    @property
    def _bounds(self) -> np.ndarray:
        return self._tfindex.offsets

    @property
    def _base(self) -> np.ndarray:
        return self._tfindex.base

    # ------------------------------------------------------------ the contract
    def _node_index(self) -> Any:
        return self._tfindex

    def _check_readable(self, shard: int, index: int) -> None:
        if self._compressed[shard]:
            raise CorruptDataError(
                f"TFRecord shard {shard} {self._paths[shard]!r} is compressed and can only be "
                f"read in order, not by index (record index {index}); decompress it, or "
                "convert the dataset: torchgrain convert SRC DST"
            )

    def block_offsets(self) -> np.ndarray:
        """Runs of consecutive records of about 1 MiB within each file (no I/O)."""
        parts = [np.zeros(1, dtype=np.int64)]
        for s in range(self.num_shards):
            b = self._base[s]
            n = int(self.index.counts[s])
            if self._compressed[s]:  # read in order only: one block
                parts.append(np.array([n]) + self.index.offsets[s])
                continue
            starts = self._bounds[b : b + n + 1]
            cuts = np.unique(np.searchsorted(starts, np.arange(0, starts[-1], _BLOCK_BYTES)))
            cuts = cuts[(cuts > 0) & (cuts < n)]
            parts.append(np.append(cuts, n) + self.index.offsets[s])
        return np.unique(np.concatenate(parts))

    def iter_shard_bytes(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[bytes]:
        """The raw bytes of records ``[start, stop)`` of one shard, in order."""
        n = int(self.index.counts[shard])
        stop = n if stop is None else min(stop, n)
        if start >= stop:
            return
        path = self._paths[shard]
        offset = 0 if self._compressed[shard] else int(self._bounds[self._base[shard] + start])
        skip = start if self._compressed[shard] else 0
        fs = self._fs if self._remote else None
        it = iter_tfrecord(
            path,
            filesystem=fs,
            verify=self._verify,
            offset=offset,
            max_record_bytes=self.max_record_bytes,
        )
        try:
            wanted = itertools.islice(it, skip, skip + stop - start)
            yield from self._in_order(shard, start, wanted)
        finally:
            it.close()

    # ---------------------------------------------------------------- reading
    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> Any:
        if filesystem is not None:
            return _RemoteFile(filesystem, path, int(self._tfindex.file_size[shard]))
        if not os.path.exists(path):
            raise DatasetNotFoundError(f"TFRecord shard {shard} {path!r} does not exist")
        return MappedFile(path)

    def _touch(self, reader: Any) -> None:
        reader.view()

    def _batch_ranges(
        self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]]
    ) -> list[tuple[str, str, list[tuple[int, int]]]] | None:
        # The frames _read_rows asks for (it checks them against the file's size).
        out = []
        for shard, rows, _ in groups:
            b = self._base[shard] + rows
            url = self._paths[shard]
            ranges = list(zip(self._bounds[b].tolist(), self._bounds[b + 1].tolist()))
            size = int(self._tfindex.file_size[shard])
            ranges = [(s, e) for s, e in ranges if 0 <= s < e <= size]
            path = self._fs._strip_protocol(url)
            io_remote.pin(self._fs, path, size)  # answers must be of the file indexed
            out.append((path, url, ranges))
        return out

    def _read_rows(self, shard: int, rows: np.ndarray, index: int, reader: Any) -> list[bytes]:
        b = self._base[shard] + rows
        first, last = self._bounds[b], self._bounds[b + 1]
        name = self._paths[shard]
        size = int(self._tfindex.file_size[shard])
        # Offsets come from an index file: bounded before use (a frame is >= 16 bytes).
        bad = (first < 0) | (last - first < 16) | (last > size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            where = self._tfindex.path
            raise CorruptDataError(
                f"TFRecord shard {shard} {name!r}: the dataset's index "
                f"{'file ' + repr(where) if where else ''} puts row {int(rows[k])} at bytes "
                f"[{int(first[k])}, {int(last[k])}) of a {size}-byte file (record index "
                f"{index}); the index is damaged (delete it to have it rebuilt)"
            )
        lengths = last - first - 16
        if int(lengths.max()) > self.max_record_bytes:
            k = int(np.argmax(lengths))
            raise CorruptDataError(
                f"TFRecord shard {shard} {name!r}: record {int(rows[k])} is "
                f"{int(lengths[k])} bytes long, more than max_record_bytes="
                f"{self.max_record_bytes} allows (record index {index}; a larger "
                "max_record_bytes reads it, if the file is trusted)"
            )
        starts, ends = first.tolist(), last.tolist()

        def read() -> list[Any]:
            r = reader or self._reader(shard)
            if not isinstance(r, MappedFile):
                return r.read(list(zip(starts, ends)))
            view = r.view(polled=True)  # (_check_index polled for this read)
            if ends and max(ends) > len(view):
                expected = int(self._bounds[self._base[shard] + self.index.counts[shard]])
                raise CorruptDataError(
                    f"TFRecord shard {shard} {name!r} is truncated: {len(view)} bytes where "
                    f"its index expects {expected} (record index {index})"
                )
            return [view[s:e] for s, e in zip(starts, ends)]

        frames = self._io(read, shard, f"range read of shard {shard} (record index {index})")
        return [
            parse_frame(f, name=name, offset=s, verify=self._verify) for f, s in zip(frames, starts)
        ]

    def __repr__(self) -> str:
        return (
            f"TFRecordSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"codec={self.codec.name!r})"
        )


class _RemoteFile:
    """A remote TFRecord file: coalesced range reads, nothing held open."""

    def __init__(self, fs: fsspec.AbstractFileSystem, url: str, size: int) -> None:
        self.fs, self.url = fs, url
        self.path = fs._strip_protocol(url)
        # Range answers must be of the file the index was built from (its size).
        io_remote.pin(fs, self.path, size)
        self._seen = io_remote.unchanged_since(fs, self.path, None)

    def read(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        got = fetch_ranges(self.fs, self.path, ranges, name=self.url)
        self._seen = io_remote.unchanged_since(self.fs, self.path, self._seen)
        return got

    def close(self) -> None:
        pass


def tfrecord_codec(
    files: list[str],
    fs: fsspec.AbstractFileSystem,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Codec:
    """The codec of TFRecord files: TFDS's feature specs when present, else ``tf_example``
    when the first record parses as a ``tf.train.Example``, else ``raw``."""
    from torchgrain.formats.tf_example import decode_tf_example
    from torchgrain.formats.tfds import tfds_codec_for

    tfds = tfds_codec_for(files, fs)
    if tfds is not None:
        return tfds
    remote = not is_local(fs)
    for path in files:
        records = iter_tfrecord(
            path, filesystem=fs if remote else None, max_record_bytes=max_record_bytes
        )
        for rec in records:
            try:
                decode_tf_example(rec)
            except RecordDecodeError:
                return get_codec("raw")
            return get_codec("tf_example")
    return get_codec("tf_example")


# ------------------------------------------------------------------ offset index
def _dataset_index(
    fs: fsspec.AbstractFileSystem,
    files: list[str],
    index_dir: str | os.PathLike | None,
    retry: RetryPolicy,
    compressed: np.ndarray,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> TFRecordIndex:
    """The dataset's index: mapped from ``index_dir`` when this machine has built it
    for these very files (sizes and versions), else built from each file's offsets
    (from the per-file cache when it has them, else walked). A compressed file has no
    offsets (records of a stream are only counted): its per-file entry is its count."""
    remote = not is_local(fs)

    def info(i: int) -> tuple[int, str]:
        path = files[i]
        try:
            st = (
                io_remote.call(fs, "info", fs._strip_protocol(path), url=path, what="size lookup")
                if remote
                else os.stat(path)
            )
        except FileNotFoundError:
            raise DatasetNotFoundError(f"TFRecord shard {i} {path!r} does not exist") from None
        if not remote:
            return int(st.st_size), f"{st.st_mtime_ns}"
        size = st.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CorruptDataError(
                f"TFRecord shard {i} {path!r}: the server reports no size ({size!r}); "
                "random access needs one"
            )
        return size, _stamp(st)

    infos = map_files(info, len(files), max_workers=16 if remote else 1)

    def offsets_of(i: int) -> np.ndarray:
        """The file's offsets, or its count (``[n]``) when compressed."""
        path = files[i]
        size, stamp = infos[i]
        cached = _cache_file(index_dir, path, size, stamp + ("\0count" if compressed[i] else ""))
        if cached is not None and os.path.exists(cached):
            try:
                index = np.load(cached)
                if _fits(index, size, compressed[i]):
                    return index
            except (OSError, ValueError):
                pass  # unreadable or not an index of this file: build it again
        if compressed[i]:
            records = iter_tfrecord(
                path, filesystem=fs if remote else None, max_record_bytes=max_record_bytes
            )
            index = np.array([sum(1 for _ in records)], dtype=np.int64)
        elif remote:
            index = retry_call(
                index_tfrecord, path, filesystem=fs, url=path, policy=retry, what="indexing"
            )
        else:
            index = index_tfrecord(path)
        if cached is not None:
            _save(cached, index)
        return index

    return tfrecord_index(
        files,
        infos,
        offsets_of,
        compressed,
        index_dir=None if index_dir is None else os.fspath(index_dir),
    )


def _fits(index: np.ndarray, size: int, compressed: bool) -> bool:
    """Whether a cached ``index`` can be one of a file of ``size`` bytes: a count, or
    increasing offsets from 0 that leave room for a frame each."""
    if index.ndim != 1 or index.dtype != np.int64:
        return False
    if compressed:
        return len(index) == 1 and index[0] >= 0
    return len(index) == 0 or (
        index[0] == 0 and bool((np.diff(index) >= 16).all()) and int(index[-1]) <= size - 16
    )


def _stamp(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "updated"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


def _cache_file(
    index_dir: str | os.PathLike | None, path: str, size: int, stamp: str
) -> str | None:
    if index_dir is None:
        return None
    key = hashlib.blake2b(f"{path}\0{size}\0{stamp}".encode(), digest_size=16).hexdigest()
    # The file's name, from the dataset, only makes the index's name readable: keep
    # characters that cannot make it a path elsewhere.
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", path.rstrip("/").rsplit("/", 1)[-1])[-60:]
    return os.path.join(os.fspath(index_dir), f"{key}-{name}.npy")


# (process id, directory) already warned that a file's offsets cannot be kept there.
_SAVE_WARNED: set[tuple[int, str]] = set()
_SAVE_LOCK = threading.Lock()
_REMEDY = (
    "Free space on that disk, or pass index_dir= a directory on a disk with room (its "
    "default lies under $TORCHGRAIN_CACHE; index_dir=None keeps indexes in memory)."
)


def _save(path: str, offsets: np.ndarray) -> None:
    """Write atomically: a reader sees a whole index or none (never a partial one). A
    directory that refuses it (read-only, full) costs an index walk at each open, nothing
    else: it is said once per directory and process, as the dataset index says it."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        # A cache: rebuilt if lost, so not flushed to disk before use.
        with atomic_open(path, "wb", durable=False) as f:
            np.save(f, offsets.astype(np.int64))
    except OSError as e:
        key = (os.getpid(), os.path.abspath(directory))
        with _SAVE_LOCK:
            if key in _SAVE_WARNED:
                return
            _SAVE_WARNED.add(key)
        code = disk_full_errno(e)
        reason = (
            f"the TFRecord offset cache in {directory!r} cannot write {path!r} ({e})."
            if code is None
            else disk_full_error(code, "the TFRecord offset cache", directory, path, _REMEDY)
        )
        warnings.warn(
            f"torchgrain: {reason} Each file's offsets are read again at each open.",
            RuntimeWarning,
            stacklevel=2,
        )
