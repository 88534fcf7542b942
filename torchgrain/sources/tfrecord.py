"""TFRecordSource: random access by index over TFRecord files, through a cached offset index.

A TFRecord file has no index: records are framed one after the other. Opening a
``TFRecordSource`` the first time on a machine walks each file's 12-byte record headers
once (no data is decoded; each file's offsets are also kept in a per-file cache, keyed
by its URL, size and modification time) and writes the dataset's offsets (8 bytes per
record) into one index file, keyed by every file's URL, size and modification time, that
every process of the machine maps read-only (:mod:`torchgrain.sources.node_index`): no
per-record memory per process, and later opens only look at each file's size. A record
is then one byte range: a batch is read with coalesced range requests remotely, and
locally from one map of every file (:class:`~torchgrain.io.region.ShardRegion`), planned
with numpy over the index's offsets, with no Python work or file open per file: a
batch's cost does not grow with the number of files it touches. Both CRCs are checked.

gzip/zlib-compressed files have no random access: they are counted (one decompression
pass, cached too) and can be read in order (``iter_shard``, which ``torchgrain
convert`` and ``inspect`` use), but reading them by index raises an error that says to
convert them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import re
import struct
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
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
from torchgrain.formats.index_file import INDEX_SUFFIX
from torchgrain.formats.tfds import tfds_codec_for
from torchgrain.formats.tfrecord import (
    DEFAULT_MAX_RECORD_BYTES,
    OFFSETS_CHUNK,
    crc32c_bytes,
    iter_tfrecord,
    iter_tfrecord_offsets,
    masked_crc32c,
    parse_frame,
    resolve_compression,
)
from torchgrain.io import remote as io_remote
from torchgrain.io.atomic import disk_full_errno, disk_full_error
from torchgrain.io.changes import ChangedWhileOpen
from torchgrain.io.fs import default_cache_dir, expand_paths, is_local, map_files
from torchgrain.io.limits import default_max_open_files
from torchgrain.io.ranges import MappedFile, fetch_ranges
from torchgrain.io.region import RegionUnavailable, ShardRegion
from torchgrain.io.retry import RetryPolicy, using
from torchgrain.sources.encoded import EncodedSource
from torchgrain.sources.node_index import TFRecordIndex, tfrecord_index
from torchgrain.sources.node_index.store import EntryWriter, index_store
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
        self._mapped: Any = None  # this process's ShardRegion (not pickled)
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

    def _region(self) -> ShardRegion | None:
        """This process's map of every local file in one address range (inherited
        through fork: the maps stay valid); None where batches are read file by file."""
        region = self._mapped
        if region is None:
            if self._remote or not self.num_shards or bool(self._compressed.all()):
                return None
            try:
                region = ShardRegion(self._paths, self._tfindex.file_size)
            except RegionUnavailable:
                region = False
            self._mapped = region
        return region or None

    def _frames(self, shard: np.ndarray, rows: np.ndarray, idx: np.ndarray) -> tuple[Any, Any]:
        """Where the records at ``rows`` of ``shard`` lie in their files (``first``,
        ``last``), checked against the files' sizes and ``max_record_bytes`` (offsets
        come from an index file: untrusted)."""
        entry = self._base[shard] + rows
        first, last = self._bounds[entry], self._bounds[entry + 1]
        size = self._tfindex.file_size[shard]
        # A frame is >= 16 bytes: every byte read below lies inside its file.
        bad = (first < 0) | (last - first < 16) | (last > size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise self._damaged(int(shard[k]), int(rows[k]), first[k], last[k], int(idx[k]))
        lengths = last - first - 16
        if int(lengths.max()) > self.max_record_bytes:
            k = int(np.argmax(lengths))
            raise self._too_long(int(shard[k]), int(rows[k]), int(lengths[k]), int(idx[k]))
        return first, last

    def _read_batch(self, idx: np.ndarray) -> list[bytes] | None:
        # Local files: one gather over one map of every file for the batch's headers and
        # footers, one Python step per record (its bytes and data CRC), none per file.
        region = self._region()
        if region is None:
            return None
        shard, rows = self.index._locate(idx)
        if bool(self._compressed[shard].any()):
            return None  # file by file: the error says to convert it
        first, last = self._frames(shard, rows, idx)
        try:
            base = region.acquire(shard, polled=True)  # (_check_index polled)
        except ChangedWhileOpen:
            raise
        except (CorruptDataError, FileNotFoundError):
            return None  # a file that cannot be mapped: file by file, which names it
        if base is None:
            return None  # more files than may be mapped at once
        try:
            at = base + first
            lengths = last - first - 16
            words = region.words
            # The length field must say what the index does; its CRC and the data's are
            # the low half of the word after it and the high half of the frame's last.
            ok = words[at] == lengths.astype(np.uint64)
            view = region.view
            starts = (at + 12).tolist()
            data = [bytes(view[a : a + n]) for a, n in zip(starts, lengths.tolist())]
            if self._verify:
                ok &= (words[at + 8] & 0xFFFFFFFF) == _length_crcs(lengths)
                crcs = np.fromiter(map(crc32c_bytes, data), np.uint64, len(data))
                ok &= words[at + lengths + 8] >> np.uint64(32) == _mask(crcs)
            if not ok.all():
                k = int(np.flatnonzero(~ok)[0])
                s = int(shard[k])
                a, f = int(at[k]), int(first[k])
                try:
                    frame = view[a : a + int(lengths[k]) + 16]
                    parse_frame(frame, name=self._paths[s], offset=f, verify=self._verify)
                except CorruptDataError as e:
                    raise self._named(e, s, int(idx[k])) from e
                raise self._named(  # pragma: no cover - parse_frame raises above
                    CorruptDataError(f"{self._paths[s]!r}: bad record at byte offset {f}"),
                    s,
                    int(idx[k]),
                )
            return data
        finally:
            region.release()

    def _read_single(self, shard: int, row: int, index: int) -> bytes | None:
        region = self._region()
        if region is None:
            return None
        e = int(self._base[shard]) + row
        first, last = int(self._bounds[e]), int(self._bounds[e + 1])
        if not (first >= 0 and last - first >= 16 and last <= self._tfindex.file_size[shard]):
            return None  # the batch path names the damage
        if last - first - 16 > self.max_record_bytes:
            return None
        try:
            at = region.acquire_one(shard, polled=True)  # (_check_index polled)
        except ChangedWhileOpen:
            raise
        except (CorruptDataError, FileNotFoundError):
            return None
        if at is None:
            return None
        try:
            return parse_frame(
                region.view[at + first : at + last],
                name=self._paths[shard],
                offset=first,
                verify=self._verify,
            )
        except CorruptDataError as e:
            raise self._named(e, shard, index) from e
        finally:
            region.release()

    def _damaged(self, shard: int, row: int, first: int, last: int, index: int) -> CorruptDataError:
        where = self._tfindex.path
        size = int(self._tfindex.file_size[shard])
        return CorruptDataError(
            f"TFRecord shard {shard} {self._paths[shard]!r}: the dataset's index "
            f"{'file ' + repr(where) if where else ''} puts row {row} at bytes "
            f"[{int(first)}, {int(last)}) of a {size}-byte file (record index "
            f"{index}); the index is damaged (delete it to have it rebuilt)"
        )

    def _too_long(self, shard: int, row: int, length: int, index: int) -> CorruptDataError:
        return CorruptDataError(
            f"TFRecord shard {shard} {self._paths[shard]!r}: record {row} is "
            f"{length} bytes long, more than max_record_bytes="
            f"{self.max_record_bytes} allows (record index {index}; a larger "
            "max_record_bytes reads it, if the file is trusted)"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_mapped"] = None  # maps belong to one process
        return state

    def close(self) -> None:
        super().close()
        if self._mapped:
            self._mapped.close()

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
        name = self._paths[shard]
        first, last = self._frames(np.full(len(rows), shard), rows, np.full(len(rows), index))
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


def _mask(crcs: np.ndarray) -> np.ndarray:
    """TFRecord's masked CRC (see :func:`~torchgrain.formats.tfrecord.masked_crc32c`) of
    uint64 CRC-32C values, elementwise."""
    return (
        ((crcs >> np.uint64(15)) | (crcs << np.uint64(17))) + np.uint64(0xA282EAD8)
    ) & np.uint64(0xFFFFFFFF)


def _length_crcs(lengths: np.ndarray) -> np.ndarray:
    """The masked CRC of each record's 8-byte length field, elementwise (one CRC when
    the records share a length, else CRC-32C's table steps in numpy)."""
    if bool((lengths == lengths[0]).all()):
        return np.full(len(lengths), masked_crc32c(struct.pack("<Q", int(lengths[0]))), np.uint64)
    v = lengths.astype(np.uint64)
    crc = np.full(len(v), 0xFFFFFFFF, np.uint64)
    for shift in range(0, 64, 8):
        crc = _CRC_TABLE[(crc ^ (v >> np.uint64(shift))) & np.uint64(0xFF)] ^ (crc >> np.uint64(8))
    return _mask(crc ^ np.uint64(0xFFFFFFFF))


def _crc_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint64)
    for _ in range(8):  # CRC-32C (Castagnoli), reflected
        table = np.where(
            table & 1, (table >> np.uint64(1)) ^ np.uint64(0x82F63B78), table >> np.uint64(1)
        )
    return table


_CRC_TABLE = _crc_table()


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

    def cache_of(i: int) -> str | None:
        size, stamp = infos[i]
        return _cache_file(index_dir, files[i], size, stamp + ("\0count" if compressed[i] else ""))

    # Files whose per-file cache was found sound: its offsets (when small) or None.
    checked: dict[int, list[np.ndarray] | None] = {}

    def cost_of(i: int) -> int:
        """What file ``i``'s offsets take (the builder calls it first, then
        ``offsets_of(i)``, in the same thread)."""
        cached = cache_of(i)
        if cached is not None:
            try:
                n, checked[i] = _check_cached(cached, infos[i][0], bool(compressed[i]))
                with contextlib.suppress(OSError):  # its last use, for the store's LRU
                    os.utime(cached + ".lock")
                return 8 * n
            except (OSError, ValueError):
                pass  # missing, unreadable or not an index of this file: walked again
        return 8 if compressed[i] else infos[i][0] // 2  # (at most one per 16 bytes)

    def offsets_of(i: int) -> Iterator[np.ndarray]:
        """The file's offsets in chunks, or its count (``[n]``) when compressed."""
        path = files[i]
        cached = cache_of(i)
        if cached is not None and i in checked:
            parts = checked.pop(i)
            if parts is not None:  # read already
                yield from parts
                return
            try:
                got = _read_cached(cached)
                first = next(got)  # (opened: what follows is read from the same file)
            except (OSError, ValueError, StopIteration):
                pass  # gone meanwhile: walked below (nothing of it was given yet)
            else:
                yield first
                yield from got
                return
        if compressed[i]:
            records = iter_tfrecord(
                path, filesystem=fs if remote else None, max_record_bytes=max_record_bytes
            )
            walked: Iterable[np.ndarray] = [np.array([sum(1 for _ in records)], dtype=np.int64)]
        elif remote:
            walked = _remote_walk(path, fs, infos[i][0], retry)
        else:
            # The size the index records: a file appended to meanwhile is indexed as
            # it was when its size was read.
            walked = iter_tfrecord_offsets(path, size=infos[i][0])
        out = _CacheWriter(cached) if cached is not None else None
        try:
            for part in walked:
                if out is not None:
                    out.add(part)
                yield part
            if out is not None:
                out.publish()
        finally:
            if out is not None:
                out.discard()

    return tfrecord_index(
        files,
        infos,
        offsets_of,
        compressed,
        index_dir=None if index_dir is None else os.fspath(index_dir),
        cost_of=cost_of,
    )


def _remote_walk(
    path: str, fs: fsspec.AbstractFileSystem, size: int, retry: RetryPolicy | None
) -> Iterator[np.ndarray]:
    """A remote file's offsets a chunk at a time, as a local walk's (a file of any size in
    bounded memory: walked whole, its offsets took 8 bytes a record at once), each ranged
    read retried under the dataset's policy."""
    walk = iter_tfrecord_offsets(path, filesystem=fs, size=size)
    while True:
        with using(retry):  # (set around each step: the generator runs in its caller's context)
            part = next(walk, None)
        if part is None:
            return
        yield part


# A per-file cache is a .npy file of int64 offsets (or of one count), read and written
# a chunk at a time.
_NPY_DTYPE = np.dtype("<i8")


def _npy_header(n: int) -> bytes:
    out = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(_NPY_DTYPE)
    np.lib.format.write_array_header_1_0(
        out, {"descr": descr, "fortran_order": False, "shape": (n,)}
    )
    return out.getvalue()


def _read_cached(path: str, chunk: int = OFFSETS_CHUNK) -> Iterator[np.ndarray]:
    """The offsets in the per-file cache at ``path``, a chunk at a time (``ValueError``:
    not such a file)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version != (1, 0):
            raise ValueError("not an offsets index")
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        if len(shape) != 1 or fortran or dtype != _NPY_DTYPE:
            raise ValueError("not an offsets index")
        n = int(shape[0])
        if os.fstat(f.fileno()).st_size != f.tell() + 8 * n:
            raise ValueError("truncated or padded")
        for a in range(0, n, chunk):
            want = 8 * min(chunk, n - a)
            data = f.read(want)
            if len(data) != want:
                raise ValueError("truncated")
            yield np.frombuffer(data, _NPY_DTYPE).astype(np.int64)


def _check_cached(path: str, size: int, compressed: bool) -> tuple[int, list[np.ndarray] | None]:
    """The number of offsets in the per-file cache at ``path``, read a chunk at a time
    and checked to be those of a file of ``size`` bytes (``ValueError`` otherwise): a
    count, or increasing offsets from 0 that leave room for a frame each; and the
    offsets themselves when they are one chunk (else None: read again when used)."""
    parts = list(itertools.islice(_read_cached(path), 2)) if compressed else _read_cached(path)
    if compressed:
        if len(parts) != 1 or len(parts[0]) != 1 or parts[0][0] < 0:
            raise ValueError("not a count")
        return 1, parts
    n, prev, first = 0, -16, None
    for part in parts:
        # The first frame is at 0: a cache that starts later (damaged, or another
        # file's) would leave every open failing on the dataset index built from it.
        if first is None and part[0] != 0:
            raise ValueError("not offsets from 0")
        if part[0] - prev < 16 or bool((np.diff(part) < 16).any()):
            raise ValueError("not offsets")
        prev = int(part[-1])
        n += len(part)
        first = part if first is None else first
    if n and prev > size - 16:
        raise ValueError("offsets past the end")
    return n, ([] if first is None else [first]) if n <= OFFSETS_CHUNK else None


class _CacheWriter:
    """A per-file cache written as a file's offsets are walked, published when complete
    (a reader sees a whole index or none) as an entry of the index directory, under its
    budget; a directory that refuses it costs a walk at each open, said once per
    directory and process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = 0
        self._out: EntryWriter | None = None
        try:
            self._out = index_store(os.path.dirname(path)).writer(os.path.basename(path))
            if self._out is not None:
                self._out.write(_npy_header(0))
        except OSError as e:
            self._failed(e)

    def add(self, part: np.ndarray) -> None:
        if self._out is None:
            return
        try:
            self._out.write(np.ascontiguousarray(part, _NPY_DTYPE).tobytes())
            self.n += len(part)
        except OSError as e:
            self._failed(e)

    def publish(self) -> None:
        if self._out is None:
            return
        try:
            header = _npy_header(self.n)
            if len(header) != len(_npy_header(0)):  # (not below 10^15 offsets)
                raise OSError(f"no room for the header of {self.n} offsets")
            self._out.write(header, at=0)
            out, self._out = self._out, None
            out.publish()
        except OSError as e:
            self._failed(e)

    def discard(self) -> None:
        """Remove what was written (nothing once published)."""
        out, self._out = self._out, None
        if out is not None:
            out.discard()

    def _failed(self, e: OSError) -> None:
        self.discard()
        _warn_unsaved(self.path, e)


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
    # characters that cannot make it a path elsewhere, and no dot, so that no data
    # suffix (.tfrecord) makes it a shard of an index_dir inside the data directory.
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", path.rstrip("/").rsplit("/", 1)[-1])[-60:]
    # (an entry of the directory's store: counted in its budget, evicted least recently
    # used first; the .npy files of earlier releases are not read)
    return os.path.join(os.fspath(index_dir), f"{key}-{name}.offsets{INDEX_SUFFIX}")


# (process id, directory) already warned that a file's offsets cannot be kept there.
_SAVE_WARNED: set[tuple[int, str]] = set()
_SAVE_LOCK = threading.Lock()
_REMEDY = (
    "Free space on that disk, or pass index_dir= a directory on a disk with room (its "
    "default lies under $TORCHGRAIN_CACHE; index_dir=None keeps indexes in memory)."
)


def _warn_unsaved(path: str, e: OSError) -> None:
    """Say, once per directory and process, that a file's offsets cannot be kept there:
    a directory that refuses them (read-only, full) costs an index walk at each open,
    nothing else (as the dataset index says it)."""
    directory = os.path.dirname(path)
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
