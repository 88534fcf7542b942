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
import itertools
import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    check_ceiling,
    warn_once,
)
from torchgrain.formats.codecs import Codec, describe_value, get_codec
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
from torchgrain.io import process
from torchgrain.io import remote as io_remote
from torchgrain.io.atomic import disk_full_errno, disk_full_error
from torchgrain.io.changes import changed_since_opening, open_regular
from torchgrain.io.fs import default_cache_dir, is_local, map_files
from torchgrain.io.region import RegionUnavailable, ShardRegion, acquired
from torchgrain.io.retry import RetryPolicy, each_under
from torchgrain.sources.base import decode_in_order, first_record_schema, shard_rows
from torchgrain.sources.format import FormatSource, ShardFile, name_error, shard_where
from torchgrain.sources.node_index import TFRecordIndex, tfrecord_index
from torchgrain.sources.node_index.store import EntryWriter, index_store
from torchgrain.sources.options import ReadOptions, check_dir_option

__all__ = [
    "TFRECORD_SUFFIXES",
    "TFRecordFormat",
    "TFRecordReader",
    "TFRecordShards",
    "TFRecordSource",
    "tfrecord_codec",
]

TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords")
# Block-shuffle blocks: runs of consecutive records of about this many bytes.
_BLOCK_BYTES = 1 << 20


class TFRecordSource(FormatSource):
    """Random-access, key-value view of TFRecord files (``tf.train.Example`` or raw bytes):
    the :class:`~torchgrain.FormatSource` of :class:`TFRecordFormat`.

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

    format: TFRecordFormat

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
        fmt = TFRecordFormat(
            codec,
            index_dir=index_dir,
            max_record_bytes=max_record_bytes,
            verify=opts.verify_or(True),
        )
        super().__init__(paths, format=fmt, options=opts)
        fmt = self.format  # (the copy this source indexed)
        self.max_record_bytes, self._verify = fmt.max_record_bytes, fmt.verify
        self.codec: Codec = fmt.codec  # type: ignore[assignment]
        # Known from the opening where it read the first record (the version opened: a
        # source whose file a later opening saw replaced keeps its schema).
        self._schema = fmt.schema

    @property
    def schema(self) -> dict[str, str]:
        """Record key -> type description, from the first record."""
        if self._schema is None:
            self._schema = first_record_schema(self)
        return dict(self._schema)

    def shard_version(self, shard: int) -> tuple | None:
        """The version of remote ``shard`` this source indexed: its size and what its
        store said tells its versions apart (a version id, ETag or modification time);
        None for a local file.

        Example:
            >>> import os, tempfile, torchgrain as tg
            >>> from torchgrain.formats.tfrecord import write_tfrecord
            >>> d = tempfile.mkdtemp()
            >>> _ = write_tfrecord([b"x"], os.path.join(d, "a.tfrecord"))
            >>> tg.TFRecordSource(d, index_dir=None).shard_version(0) is None  # (local)
            True
        """
        infos = self.format.shards.infos  # type: ignore[union-attr]
        return None if infos is None else tuple(infos[shard])

    def check_unchanged(self, shard: int) -> None:
        """Raise if local ``shard`` is not the file the dataset's opening indexed (its
        change time differs)."""
        if not self._remote:
            self.format.check_opened(shard, self._paths[shard])

    def block_offsets(self) -> np.ndarray:
        """Runs of consecutive records of about 1 MiB within each file (no I/O)."""
        shards = self.format.shards
        assert shards is not None
        shards.index.check_unchanged()  # (before its map is read: a truncated map is a SIGBUS)
        parts = [np.zeros(1, dtype=np.int64)]
        for s in range(self.num_shards):
            b = shards.index.base[s]
            n = int(self.index.counts[s])
            cuts = np.zeros(0, np.int64)
            if not shards.compressed[s]:  # (read in order only: one block)
                starts = shards.index.offsets[b : b + n + 1]
                cuts = np.searchsorted(starts, np.arange(0, starts[-1], _BLOCK_BYTES))
            parts.append(np.append(cuts[(cuts > 0) & (cuts < n)], n) + self.index.offsets[s])
        return np.unique(np.concatenate(parts))

    def iter_shard(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of one shard, in order (compressed files too)."""
        return decode_in_order(self, shard, start, stop, self._decode)

    def iter_shard_bytes(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[bytes]:
        """The raw bytes of records ``[start, stop)`` of one shard, in order."""
        start, stop = shard_rows(self.index.counts, shard, start, stop)
        n = int(self.index.counts[shard])
        if start >= stop:
            return
        path, fmt = self._paths[shard], self.format
        fmt.check_opened(shard, path)  # (read through a file of its own: not pinned)
        ix, plain = fmt.shards.index, not fmt.shards.compressed[shard]  # type: ignore[union-attr]
        ix.check_unchanged()  # (before its map is read: a truncated map is a SIGBUS)
        # (a compressed stream is read from its start, its first records skipped)
        records = iter_tfrecord(
            path,
            filesystem=self._fs if self._remote else None,
            verify=fmt.verify,
            offset=int(ix.offsets[ix.base[shard] + start]) if plain else 0,
            max_record_bytes=self.max_record_bytes,
            # (the version the dataset's opening read: one a later opening pinned is refused)
            seen=self._held_version(shard),
        )
        it = each_under(self._retry, records)  # (each read under the source's policy)
        skip, want = 0 if plain else start, stop - start
        at = int(self.index.offsets[shard]) + start  # (the record read now, for errors)
        try:
            for data in itertools.islice(it, skip, skip + want):
                yield data
                at += 1
            # (a file rewritten while it was read: what it gave may mix two versions)
            fmt.check_opened(shard, path)
            # The count comes from an index file (untrusted): a stream that ends before
            # it, or goes on after it, is not the one counted.
            more = not plain and stop == n and next(it, None) is not None
        except CorruptDataError as e:
            raise self._named(e, shard, path, at) or e from e
        finally:
            it.close()
            records.close()  # (one never started is not closed by its wrapper)
        if at - int(self.index.offsets[shard]) < stop or more:
            raise CorruptDataError(
                f"TFRecord shard {shard} {path!r} holds "
                f"{'more' if more else 'fewer'} records than the {n} its index counts "
                f"(record index {at}); the file changed since it was indexed, or the "
                "index is damaged (delete it to have it rebuilt)"
            )

    def __repr__(self) -> str:
        return (
            f"TFRecordSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"codec={self.codec.name!r})"
        )


class TFRecordShards:
    """The files of a TFRecord dataset as
    :meth:`~torchgrain.sources.TFRecordFormat.index_shards` found them (a
    :class:`~torchgrain.sources.ShardCounts`): the node-shared offsets ``index``, each
    remote file's ``(size, version stamp)`` (``infos``, None for local files: a pickle
    carries nothing per file for them), each local file's change time (``ctimes``, None
    for remote files) and which are gzip/zlib streams (``compressed``)."""

    def __init__(self, index: TFRecordIndex, infos: list, ctimes: Any, compressed: Any) -> None:
        self.index, self.infos, self.ctimes, self.compressed = index, infos, ctimes, compressed

    counts = property(lambda self: self.index.counts, doc="Records per file (int64).")
    sizes = property(lambda self: self.index.file_size, doc="Bytes per file (int64).")


class TFRecordFormat:
    """The TFRecord format (a :class:`~torchgrain.sources.ShardFormat`): all its files
    counted and sized at once from the dataset's offsets index, built once per machine
    (:class:`~torchgrain.sources.IndexesShards`), each record one byte range of its file
    (its readers are :class:`~torchgrain.sources.ReadsByteRanges`: a remote batch is
    fetched across its files at once), a batch of local files read from one map of every
    file (:class:`~torchgrain.sources.ReadsBatches`), its records decoded by ``codec``
    (:class:`~torchgrain.sources.EncodedFormat`). ``codec``, ``index_dir`` and
    ``max_record_bytes`` are :class:`~torchgrain.sources.TFRecordSource`'s; ``verify``
    checks both CRCs of every record read (a source's ``verify_checksums``, when given,
    decides instead).

    Example:
        >>> import os, tempfile, torchgrain as tg
        >>> from torchgrain.formats.tfrecord import write_tfrecord
        >>> d = tempfile.mkdtemp()
        >>> _ = write_tfrecord([b"a", b"bc", b"d"], os.path.join(d, "x.tfrecord"))
        >>> src = tg.FormatSource(d, format=TFRecordFormat("raw", index_dir=None))
        >>> len(src), src.__getitems__([2, 0])
        (3, [{'bytes': b'd'}, {'bytes': b'a'}])
    """

    name = "TFRecord"
    suffixes = TFRECORD_SUFFIXES

    def __init__(
        self,
        codec: str | Codec = "auto",
        *,
        index_dir: str | os.PathLike | type[Ellipsis] | None = ...,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        verify: bool = True,
    ) -> None:
        index_dir = check_dir_option("index_dir", index_dir)
        self.max_record_bytes = check_ceiling("max_record_bytes", max_record_bytes, 0)
        if index_dir is ...:
            index_dir = os.path.join(default_cache_dir(), "tfrecord-index")
        self.index_dir, self.verify = index_dir, verify
        #: The codec (a name until :meth:`index_shards` resolves it).
        self.codec: str | Codec = codec
        #: The first record's keys and types, where :meth:`index_shards` read that record
        #: to choose the codec (``codec="auto"``), else None.
        self.schema: dict[str, str] | None = None
        self.shards: TFRecordShards | None = None
        # This process's map of every local file (False: none can be made), made by the
        # first batch; inherited through fork (the maps stay valid), never pickled.
        self._region: ShardRegion | bool | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_region": None}

    @property
    def record_codec(self) -> Codec:
        """What decodes the records' bytes (as an
        :class:`~torchgrain.sources.EncodedFormat`): :attr:`codec`, once resolved."""
        return self.codec  # type: ignore[return-value]

    def index_shards(
        self, files: Sequence[str], filesystem: fsspec.AbstractFileSystem, options: ReadOptions
    ) -> TFRecordShards:
        """The dataset's offsets index of ``files``, mapped from ``index_dir`` when this
        machine built it for these very files (sizes and versions), else built from each
        file's offsets (kept per file in ``index_dir`` when they are there and sound,
        else walked; a compressed file has no offsets, records of a stream are only
        counted: what is kept of it is its count); the codec resolved, and ``verify``
        set by ``options.verify_checksums`` when given."""
        fs, files, index_dir, retry = filesystem, list(files), self.index_dir, options.retry_policy
        self.verify = options.verify_or(self.verify)
        compressed = np.array([resolve_compression(f, None) != "" for f in files])
        compressed.setflags(write=False)
        remote = not is_local(fs)
        got = map_files(
            lambda i: _size_and_stamp(fs, files[i], i, remote),
            len(files),
            max_workers=16 if remote else 1,
        )
        infos = [(size, stamp) for size, stamp, _, _ in got]
        if remote:
            # An opening reads the files as they are now: what an earlier opening in this
            # process pinned of them (a dataset re-uploaded since, its index found on
            # this machine, so not walked again) is taken anew, at the size and ETag just
            # asked (what its index describes: a reader refuses another version).
            for path, (size, _, _, etag) in zip(files, got):
                io_remote.pin_opened(fs, fs._strip_protocol(path), size, etag)
        ctimes = None  # each local file's change time, taken with its size
        if not remote:
            ctimes = np.array([ctime for _, _, ctime, _ in got], np.int64)
            ctimes.setflags(write=False)

        def offsets_of(i: int) -> Iterable[np.ndarray]:
            """File ``i``'s offsets in chunks, or its count (``[n]``) when compressed."""
            path, (size, stamp), count = files[i], infos[i], bool(compressed[i])
            stamp += "\0count" if count else ""
            key, kept = _entry_key(path, size, stamp), _cache_file(index_dir, path, size, stamp)
            got = _read_kept(kept, size, key, count)
            if got is not None:
                return got
            walked: Iterable[np.ndarray]
            if count:
                records = iter_tfrecord(
                    path, filesystem=fs if remote else None, max_record_bytes=self.max_record_bytes
                )
                walked = [np.array([sum(1 for _ in records)], dtype=np.int64)]
            elif remote:
                walked = _remote_walk(path, fs, size, retry)
            else:
                # The size the index records: a file appended to meanwhile is indexed as
                # it was when its size was read.
                walked = iter_tfrecord_offsets(path, size=size)
            return walked if kept is None else _keeping(kept, key, walked)

        index = tfrecord_index(
            files,
            infos,
            offsets_of,
            compressed,
            index_dir=None if index_dir is None else os.fspath(index_dir),
            lock_wait=None if options.retry is None else options.retry.deadline,
        )
        self.shards = TFRecordShards(index, infos if remote else None, ctimes, compressed)
        codec, first = self.codec, None
        if isinstance(codec, str) and codec == "auto":
            codec, first = _codec_and_first(files, fs, self.max_record_bytes)
        elif isinstance(codec, str) and codec == "tf_example":
            # TFDS output: decode per its features.json (images, shapes, scalars).
            codec = tfds_codec_for(files, fs) or codec
        self.codec = get_codec(codec)
        if first is not None:  # (the first record, of the version opened: the schema's)
            self.schema = {k: describe_value(v) for k, v in self.codec.decode(first).items()}
        return self.shards

    def open(self, file: ShardFile) -> TFRecordReader:
        """A reader of ``file``; a local file whose change time is not the one
        :meth:`index_shards` took is refused
        (:func:`~torchgrain.io.changes.changed_since_opening`: the index is another
        file's): the file is pinned now, a change from then on is the pin's to see."""
        self.check_opened(file.shard, file.path)
        return TFRecordReader(self, file)

    def check_opened(self, shard: int, path: str) -> None:
        """Raise if local ``shard`` at ``path`` is not the file :meth:`index_shards` saw
        (its change time differs)."""
        ctimes = self.shards.ctimes if self.shards is not None else None
        if ctimes is not None and os.stat(path).st_ctime_ns != ctimes[shard]:
            raise changed_since_opening(shard, path)

    def check_readable(self, shard: int, path: str, index: int) -> None:
        """Refuse random access to a compressed file (record ``index`` asked of it)."""
        if self.shards is not None and self.shards.compressed[shard]:
            raise self._corrupt(
                f"{path!r} is compressed and can only be read in order, not by index; "
                "decompress it, or convert the dataset: torchgrain convert SRC DST",
                shard,
                path,
                index,
            )

    def frames(
        self, shard: np.ndarray, rows: np.ndarray, idx: np.ndarray, paths: Sequence[str] | dict
    ) -> tuple[Any, Any]:
        """Where the records at ``rows`` of ``shard`` (global indices ``idx``; files
        ``paths``) lie in their files (``first``, ``last``), checked against the files'
        sizes and ``max_record_bytes`` (offsets come from an index file: untrusted)."""
        ix = self.shards.index  # type: ignore[union-attr]
        entry = ix.base[shard] + rows
        first, last = ix.offsets[entry], ix.offsets[entry + 1]
        size = ix.file_size[shard]
        # A frame is >= 16 bytes: every byte read below lies inside its file.
        bad = (first < 0) | (last - first < 16) | (last > size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            s, where = int(shard[k]), ix.path
            raise self._corrupt(
                f"the dataset's index {'file ' + repr(where) if where else ''} puts row "
                f"{int(rows[k])} at bytes [{int(first[k])}, {int(last[k])}) of a "
                f"{int(size[k])}-byte file; the index is damaged (delete it to have it rebuilt)",
                s,
                paths[s],
                int(idx[k]),
            )
        lengths = last - first - 16
        if int(lengths.max()) > self.max_record_bytes:
            k = int(np.argmax(lengths))
            raise self._corrupt(
                f"{paths[int(shard[k])]!r}: row {int(rows[k])} is {int(lengths[k])} bytes long, more than "
                f"max_record_bytes={self.max_record_bytes} allows (a larger max_record_bytes "
                "reads it, if the file is trusted)",
                int(shard[k]),
                paths[int(shard[k])],
                int(idx[k]),
            )
        return first, last

    def read_batch(
        self, paths: Sequence[str], shards: np.ndarray, rows: np.ndarray, indices: np.ndarray
    ) -> list[bytes] | None:
        """The records of a batch of local files from one map of every file: one gather
        for the batch's headers and footers, one Python step per record (its bytes and
        data CRC), none per file; None for remote or compressed files, or shards that
        cannot be mapped now (read through their readers)."""
        region = self._ready(paths, bool(self.shards.compressed[shards].any()))  # type: ignore[union-attr]
        if region is None:
            return None  # file by file (a compressed one: the error says to convert it)
        files = paths
        first, last = self.frames(shards, rows, indices, files)
        base = acquired(region, shards)
        if base is None:
            return None  # file by file
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
            if self.verify:
                ok &= (words[at + 8] & 0xFFFFFFFF) == _length_crcs(lengths)
                crcs = np.fromiter(map(crc32c_bytes, data), np.uint64, len(data))
                ok &= words[at + lengths + 8] >> np.uint64(32) == _mask(crcs)
            if not ok.all():
                k = int(np.flatnonzero(~ok)[0])
                s, a, f = int(shards[k]), int(at[k]), int(first[k])
                try:  # (it raises: the frame failed the same checks)
                    parse_frame(view[a : a + int(lengths[k]) + 16], name=files[s], offset=f)
                    raise CorruptDataError(f"{files[s]!r}: bad record at byte offset {f}")
                except CorruptDataError as e:
                    where = shard_where(self.name, s, len(files), files[s])
                    raise name_error(e, where, int(indices[k])) or e from e
            return data
        finally:
            region.release()

    def read_one(self, paths: Sequence[str], shard: int, row: int, index: int) -> bytes | None:
        """The record at ``row`` of local ``shard`` (global ``index``) from the map of
        every file, without a batch's numpy steps (they would cost it 4x); None where
        :meth:`read_batch` would give None, or its frame looks damaged (the reader names
        the damage)."""
        region = self._ready(paths, bool(self.shards.compressed[shard]))  # type: ignore[union-attr]
        if region is None:
            return None
        ix = self.shards.index  # type: ignore[union-attr]
        e = int(ix.base[shard]) + row
        first, last = int(ix.offsets[e]), int(ix.offsets[e + 1])
        size = ix.file_size[shard]
        if not (first >= 0 and 16 <= last - first <= self.max_record_bytes + 16 and last <= size):
            return None
        at = acquired(region, shard)
        if at is None:
            return None
        try:
            view = region.view[at + first : at + last]
            return parse_frame(view, name=paths[shard], offset=first, verify=self.verify)
        except CorruptDataError as e:
            where = shard_where(self.name, shard, len(paths), paths[shard])
            raise name_error(e, where, index) or e from e
        finally:
            region.release()

    def _ready(self, paths: Sequence[str], compressed: bool) -> ShardRegion | None:
        """The map of every file for a read (the source has just read this process's file
        events: the region's checks use them); None for remote files or a read of
        ``compressed`` ones."""
        if self._region is False or compressed:
            return None
        # A node-shared index file written or truncated since it was mapped is refused
        # before its arrays are read: a truncated map is a SIGBUS.
        self.shards.index.check_unchanged(polled=True)  # type: ignore[union-attr]
        return self._mapped(paths)

    def _mapped(self, paths: Sequence[str]) -> ShardRegion | None:
        """This process's map of every local file (``paths``) in one address range, or
        None."""
        region = self._region
        if region is None:
            shards = self.shards
            if shards is None or shards.ctimes is None or bool(shards.compressed.all()):
                region = False  # (remote files, or none to map)
            else:
                try:
                    region = ShardRegion(paths, shards.index.file_size, ctimes=shards.ctimes)
                except RegionUnavailable:
                    region = False
            self._region = region
        return region or None

    def close(self) -> None:
        """Unmap this process's map of the files (a later batch maps them again)."""
        region, self._region = self._region, None
        if region:
            region.close()

    def _corrupt(self, message: str, shard: int, path: str, index: int) -> CorruptDataError:
        """A CorruptDataError of ``message`` naming the shard, file and record index as
        every read does (:func:`~torchgrain.sources.format.name_error`)."""
        num = len(self.shards.counts) if self.shards is not None else shard + 1
        where = shard_where(self.name, shard, num, path)
        return name_error(CorruptDataError(message), where, index)  # type: ignore[return-value]

    def parse(self, frames: Iterable[Any], starts: Iterable[int], path: str) -> list[bytes]:
        """The records of ``frames`` (read from byte ``starts`` of ``path``), CRCs checked."""
        return [
            parse_frame(f, name=path, offset=s, verify=self.verify) for f, s in zip(frames, starts)
        ]


class TFRecordReader:
    """One TFRecord file opened by :class:`~torchgrain.sources.TFRecordFormat`: a
    :class:`~torchgrain.sources.ShardReader` whose records are byte ranges
    (:class:`~torchgrain.sources.ReadsByteRanges`) found in the dataset's index, read as
    their bytes (the format's codec decodes them)."""

    def __init__(self, fmt: TFRecordFormat, file: ShardFile) -> None:
        self.format, self.file, self.shard = fmt, file, file.shard
        self.count = int(fmt.shards.counts[file.shard])  # type: ignore[union-attr]

    def __len__(self) -> int:
        return self.count

    def _frames(self, rows: np.ndarray) -> tuple[Any, Any]:
        k, ix = self.shard, self.format.shards.index  # type: ignore[union-attr]
        # A node-shared index file written or truncated since it was mapped is refused
        # (ChangedWhileOpen) before its arrays are read: a truncated map is a SIGBUS.
        ix.check_unchanged()
        index = int(ix.rec_base[k]) + rows
        self.format.check_readable(k, self.file.path, int(index[0]) if len(rows) else 0)
        return self.format.frames(np.full(len(rows), k), rows, index, {k: self.file.path})

    def byte_ranges(self, rows: np.ndarray) -> list[tuple[int, int]]:
        first, last = self._frames(rows)
        return list(zip(first.tolist(), last.tolist()))

    def decode(self, rows: np.ndarray, chunks: list[memoryview]) -> list[bytes]:
        # The frames of byte_ranges (checked there): their starts only name a bad record.
        ix = self.format.shards.index  # type: ignore[union-attr]
        # Before its map is read (a truncated map is a SIGBUS), with the file events the
        # source read for this batch (FormatSource polls once per batch).
        ix.check_unchanged(polled=True)
        starts = ix.offsets[ix.base[self.shard] + rows].tolist()
        return self.format.parse(chunks, starts, self.file.path)

    def read(self, rows: np.ndarray) -> list[bytes]:
        ranges = self.byte_ranges(rows)
        return self.decode(rows, self.file.read_ranges(ranges, max_bytes=1 << 62))

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
    return _codec_and_first(files, fs, max_record_bytes)[0]


def _codec_and_first(
    files: list[str], fs: fsspec.AbstractFileSystem, max_record_bytes: int
) -> tuple[Codec, bytes | None]:
    """:func:`tfrecord_codec`, and the first record it read to choose (None where it
    read none: TFDS output, or no record)."""
    from torchgrain.formats.tf_example import decode_tf_example

    tfds = tfds_codec_for(files, fs)
    if tfds is not None:
        return tfds, None
    filesystem = None if is_local(fs) else fs
    for path in files:
        for rec in iter_tfrecord(path, filesystem=filesystem, max_record_bytes=max_record_bytes):
            try:
                decode_tf_example(rec)
            except RecordDecodeError:
                return get_codec("raw"), rec
            return get_codec("tf_example"), rec
    return get_codec("tf_example"), None


# ------------------------------------------------------------------ offset index
def _size_and_stamp(
    fs: fsspec.AbstractFileSystem, path: str, shard: int, remote: bool
) -> tuple[int, str, int, str | None]:
    """A file's size, what tells its versions apart (its modification and change times
    and inode: a file rewritten in place with its size and modification time put back,
    as ``rsync --inplace -t`` does, has another change time; or the store's version or
    ETag, "" where a server gives none) and a local file's change time (0 for a remote
    one) and a remote one's ETag (None where the store gives none)."""
    try:
        if not remote:
            st = os.stat(path)
            stamp = f"{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
            return st.st_size, stamp, st.st_ctime_ns, None
        size, version, etag = io_remote.size_version_and_etag(
            fs, fs._strip_protocol(path), url=path
        )
    except FileNotFoundError:
        raise DatasetNotFoundError(f"TFRecord shard {shard} {path!r} does not exist") from None
    return size, version or "", 0, etag


def _remote_walk(
    path: str, fs: fsspec.AbstractFileSystem, size: int, retry: RetryPolicy | None
) -> Iterator[np.ndarray]:
    """A remote file's offsets a chunk at a time, as a local walk's (a file of any size in
    bounded memory: walked whole, its offsets took 8 bytes a record at once), each ranged
    read retried under the dataset's policy."""
    return each_under(retry, iter_tfrecord_offsets(path, filesystem=fs, size=size))


# A file's kept offsets: the digest of its key (:func:`_entry_key`: its URL, size and
# version), their number n and their CRC-32 (int64), then the n offsets (one count for a
# compressed file), read and written a chunk at a time. The key: an entry under another
# file's name (another file of the same size) is not that file's. The CRC: a compressed
# file's count cannot be checked against its file (a damaged one lost records). An entry
# of an earlier release (a .npy file, or no key or CRC) is walked again.
_HEAD = struct.Struct("<16sqq")


def _kept_chunks(path: str, key: bytes) -> Iterator[np.ndarray]:
    """The offsets kept at ``path`` for the file of ``key``, a chunk at a time
    (``ValueError``: not that file's)."""
    with open(open_regular(path), "rb") as f:  # (a FIFO's open would wait forever)
        head = f.read(_HEAD.size)
        kept_key, n, crc = _HEAD.unpack(head) if len(head) == _HEAD.size else (b"", -1, 0)
        if kept_key != key or os.fstat(f.fileno()).st_size != _HEAD.size + 8 * n:
            raise ValueError("not the offsets of this file")
        got = 0
        for a in range(0, n, OFFSETS_CHUNK):
            want = 8 * min(OFFSETS_CHUNK, n - a)
            data = f.read(want)
            if len(data) != want:
                raise ValueError("truncated")
            got = zlib.crc32(data, got)
            yield np.frombuffer(data, "<i8").astype(np.int64)
        if got != crc:
            raise ValueError("damaged")


def _read_kept(path: str | None, size: int, key: bytes, count: bool) -> Iterable[np.ndarray] | None:
    """The offsets kept at ``path`` for the file of ``key``, of ``size`` bytes (``count``:
    its count, ``[n]``), a chunk at a time, or None where none are kept or what is kept
    cannot be that file's: another key, a count, or offsets from 0 at least 16 bytes
    apart, the last a frame's
    length before the end (a damaged entry would leave every open failing on the dataset
    index built from it). Checked in one pass; one chunk is kept from it, more read
    again (bounded memory)."""
    if path is None:
        return None
    n, prev, parts = 0, -16, []
    try:
        for part in _kept_chunks(path, key):
            if not count and (
                (n == 0 and part[0] != 0) or (np.diff(part, prepend=prev) < 16).any()
            ):
                raise ValueError("not offsets")
            n, prev = n + len(part), int(part[-1])
            if n <= OFFSETS_CHUNK:
                parts.append(part)
    except (OSError, ValueError):
        return None
    if (n != 1 or prev < 0) if count else prev > size - 16:
        return None
    with contextlib.suppress(OSError):  # its last use, for the store's LRU
        os.utime(path + ".lock")
    return parts if n <= OFFSETS_CHUNK else _kept_chunks(path, key)


def _keeping(path: str, key: bytes, parts: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """``parts`` (the offsets of the file of ``key`` as walked), kept at ``path`` as they
    pass: an entry of the index directory (within its budget, evicted least recently used
    first) published once whole, so a reader sees all of it or none."""
    out, n, crc = None, 0, 0
    try:
        try:
            out = index_store(os.path.dirname(path)).writer(os.path.basename(path))
            if out is not None:
                out.write(_HEAD.pack(key, 0, 0))
        except OSError as e:
            out = _unsaved(out, path, e)
        for part in parts:
            if out is not None:
                try:
                    data = np.asarray(part, "<i8").tobytes()
                    out.write(data)
                    crc = zlib.crc32(data, crc)
                except OSError as e:
                    out = _unsaved(out, path, e)
            n += len(part)
            yield part
        if out is not None:
            try:
                out.write(_HEAD.pack(key, n, crc), at=0)
                out.publish()
            except OSError as e:
                out = _unsaved(out, path, e)
    finally:
        if out is not None:
            out.discard()


def _unsaved(out: EntryWriter | None, path: str, e: OSError) -> None:
    """Discard ``out`` and say, once per directory and process, that a file's offsets
    cannot be kept there: a directory that refuses them (read-only, full) costs a walk
    at each open, nothing else (as the dataset index says it)."""
    if out is not None:
        out.discard()
    directory = os.path.dirname(path)
    code = disk_full_errno(e)
    what = "the TFRecord offset cache"
    reason = (
        f"{what} in {directory!r} cannot write {path!r} ({e})."
        if code is None
        else disk_full_error(code, what, directory, path, index_store(directory)._remedy())
    )
    warn_once(
        (process.token(), "tfrecord offsets", os.path.abspath(directory)),
        f"torchgrain: {reason} Each file's offsets are read again at each open.",
        RuntimeWarning,
    )


def _cache_file(
    index_dir: str | os.PathLike | None, path: str, size: int, stamp: str
) -> str | None:
    if index_dir is None:
        return None
    key = _entry_key(path, size, stamp).hex()
    # The file's name, from the dataset, only makes the index's name readable: keep
    # characters that cannot make it a path elsewhere, and no dot, so that no data
    # suffix (.tfrecord) makes it a shard of an index_dir inside the data directory.
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", path.rstrip("/").rsplit("/", 1)[-1])[-60:]
    # (an entry of the directory's store: counted in its budget, evicted least recently
    # used first)
    return os.path.join(os.fspath(index_dir), f"{key}-{name}.offsets{INDEX_SUFFIX}")


def _entry_key(path: str, size: int, stamp: str) -> bytes:
    """What names the kept offsets of a file: a digest of its URL, size and version
    stamp (its entry's name, and the first field of the entry's head)."""
    return hashlib.blake2b(f"{path}\0{size}\0{stamp}".encode(), digest_size=16).digest()
