"""ArrayRecordSource: random access, key-value records over sharded ArrayRecord files."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.diagnostics import count_decode, count_read
from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    TorchgrainError,
    check_ceiling,
)
from torchgrain.formats.arrayrecord import (
    DEFAULT_MAX_CHUNK_BYTES,
    ArrayRecordFile,
    read_mapped,
    read_num_records,
)
from torchgrain.formats.arrayrecord.footer import fast_views
from torchgrain.formats.arrayrecord.riegeli import CHUNK_HEADER
from torchgrain.formats.checksums import verify_file
from torchgrain.formats.codecs import Codec, get_codec, sniff_codec
from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, read_manifest
from torchgrain.formats.tfds import tfds_codec_for
from torchgrain.io import changes, remote
from torchgrain.io.fs import ShardPaths, is_local, map_files
from torchgrain.io.limits import default_max_open_files
from torchgrain.io.region import RegionUnavailable, ShardRegion, acquired
from torchgrain.io.retry import retry_call, using
from torchgrain.sources.arrayrecord_paths import ARRAY_RECORD_SUFFIXES, resolve_dataset
from torchgrain.sources.base import ShardedSource, decode_in_order, first_record_schema, shard_rows
from torchgrain.sources.block_cache import CacheBlocks
from torchgrain.sources.format import (
    decode_columns,
    decode_record,
    decode_records,
    name_error,
    named_rows,
    shard_where,
)
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.node_index import ArrayRecordIndex, arrayrecord_index, default_index_dir
from torchgrain.sources.node_index.arrayrecord import stat_shards
from torchgrain.sources.options import ReadOptions, check_dir_option

__all__ = ["ARRAY_RECORD_SUFFIXES", "ArrayRecordSource"]

_SEQUENTIAL_BLOCK = 1024  # records per read when reading a shard in order
_FOOTERS = 256  # shards whose index views a process keeps for single-record reads
_SINGLES = 8  # batches of up to this many records are read record by record


class ArrayRecordSource(ShardedSource):
    """Random-access, key-value view of one or many ArrayRecord shards.

    Args:
        paths: a dataset directory (with or without a ``torchgrain.json`` manifest), a
            glob, a single file, a list of these, or fsspec URLs (``s3://``, ``gs://``,
            ``http(s)://``, ...).
        codec: ``"auto"`` (the manifest's codec, else sniffed from the first record),
            ``"msgpack"``, ``"raw"`` (records as ``{"bytes": b}``), ``"tf_example"``,
            or any registered codec name or codec object. For TFDS output (a directory
            with ``features.json``), ``"auto"`` and ``"tf_example"`` decode records per
            the feature spec (:class:`~torchgrain.formats.tfds.TFDSCodec`: images to
            arrays, scalars squeezed, tensors reshaped); the files must be of one split.
        options: how the shards are read (:class:`~torchgrain.ReadOptions`: storage,
            caches, threads, retries, limits, trust); each of its fields is also
            accepted as a keyword argument (``cache_dir=...``), which replaces that
            field. Here ``cache_bytes`` is the cache of decompressed chunks: only chunks
            holding several records (files written with ``group_size`` > 1) are kept,
            so that a block-local order decompresses each chunk once.
            ``verify_checksums`` (Riegeli's chunk hashes) is off by default: the hash
            is computed in pure Python (a few MB/s) and turns off the mapped batch
            reads. Without it a damaged chunk can decode to other values without an
            error (zstd and snappy frames carry no checksum of their content; a
            damaged frame header or length still fails); the manifest's file
            checksums check a downloaded copy whole (``cache_dir``); read data you
            did not write once with it on (it also places chunks by the shards' own
            footers, not by the index file the dataset ships).
            ``max_open_files`` defaults to every shard when the open-files limit
            allows (raising the soft limit toward the hard one where that makes room),
            else what a quarter of the limit holds; local batches are read through one
            map of all shards and open readers only for unusual chunks. Before
            ``cache_dir_bytes`` existed, the keyword ``cache_bytes`` given together
            with ``cache_dir`` meant that budget; that still works, with a
            ``DeprecationWarning``.
        max_chunk_bytes: the most bytes one compressed chunk (so one record) may
            decompress to (default 1 GiB,
            :data:`~torchgrain.formats.arrayrecord_file.DEFAULT_MAX_CHUNK_BYTES`); a
            chunk that declares more raises :class:`~torchgrain.CorruptDataError`
            before anything is allocated for it. Raise it for trusted files written
            with large groups of large records.
        index_dir: where the dataset index of local shards (every chunk's offset and
            size, see :mod:`torchgrain.sources.node_index`) is built once per machine
            and shared by every process through the page cache, for datasets without a
            valid ``torchgrain.tgindex`` of their own (default
            ``<torchgrain cache>/arrayrecord-index``); ``None`` builds it in each
            process's memory instead.
        max_mapped_shards: local shards mapped at once per process for batch reads
            (default: what ``vm.max_map_count`` leaves free; least recently used
            unmapped first); ``0`` reads every batch shard by shard instead.

    Opening reads the manifest (one small file) or, without one, every shard's footer
    (in parallel). No file handle is kept in the object: each process opens its own
    readers on first use, so the source is safe to use before forking DataLoader
    workers, pickles small, and works with ``spawn``/``forkserver``. A forked worker
    also gets its own fsspec filesystem instance (async filesystems such as s3fs are
    bound to the event loop of the process that created them).

    Remote reading: ``src.io_stats`` counts remote reads, retries and, with a cache,
    the cache's hits, misses and bytes fetched (per process).

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record(
        ...     [{"image": np.zeros((2, 2), np.uint8), "label": i} for i in range(10)], d,
        ...     num_shards=3)
        >>> src = tg.ArrayRecordSource(d)
        >>> len(src), src.keys, src.schema["image"]
        (10, ['image', 'label'], 'uint8[2,2]')
        >>> [r["label"] for r in src.__getitems__([9, 0, 5])]
        [9, 0, 5]
    """

    # The manifest, where kept (remote shards): a local source reads it again if asked
    # (a class default: one attribute more on every source would leave its dict unshared,
    # every attribute lookup of every read slower; so is the shards' change times').
    _manifest: Manifest | None = None
    codec: Codec
    _schema: dict[str, str] | None = None
    _mapped: Any = None  # this process's map of the shards (:meth:`_region`; not pickled)
    # Each local shard's change time (st_ctime_ns) at the dataset's opening (8 bytes a
    # shard, pickled with the source); None for remote shards.
    _ctimes: np.ndarray | None = None

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        codec: str | Codec = "auto",
        options: ReadOptions | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        index_dir: str | os.PathLike | type[Ellipsis] | None = ...,
        max_mapped_shards: int | None = None,
        **read_options: Any,
    ) -> None:
        opts = ReadOptions.build(options, _old_cache_budget(read_options))
        index_dir = check_dir_option("index_dir", index_dir)
        self._verify = opts.verify_or(False)
        self.max_chunk_bytes = check_ceiling("max_chunk_bytes", max_chunk_bytes, 1)
        if max_mapped_shards is not None and max_mapped_shards < 0:
            raise ValueError(f"max_mapped_shards must be >= 0, got {max_mapped_shards!r}")
        self.max_mapped_shards = max_mapped_shards
        retry = opts.retry_policy
        with using(retry):  # the transport and open-time requests keep to its deadlines
            manifest, fs, files, index_entry = resolve_dataset(
                paths, opts.storage_options, opts.filesystem, opts.allow_external_paths
            )
        local = is_local(fs)
        has_manifest = manifest is not None
        # (None: no manifest; no attribute says so: one more would leave the source's dict
        # unshared, every attribute lookup of every read slower)
        self._manifest_dir = fs._strip_protocol(os.fspath(paths)) if has_manifest else None
        shard_paths = ShardPaths(files)
        counts = manifest_codec = schema = None
        if manifest is not None:
            counts = np.array([s.num_records for s in manifest.shards], dtype=np.int64)
            manifest_codec = manifest.codec
            schema = dict(manifest.schema) if manifest.schema else None
        # Local shards: what reading needs of the manifest is in the dataset index. Its
        # shard list costs hundreds of bytes per shard, and parsing it leaves the
        # allocator's pages pinned if objects made meanwhile outlive it: it is dropped
        # before anything lasting is made (and read again only if asked for).
        if not local:
            self._manifest = manifest
        del manifest, files
        self._dindex: ArrayRecordIndex | None = None
        self._count_bad: np.ndarray | None = None  # shards whose files disagree with the manifest
        fresh = False  # (set where the shards are pinned anew below)
        if local and len(shard_paths):
            if index_dir is ...:
                index_dir = default_index_dir("arrayrecord")
            # Before the index is read or built: a shard written from now on (even with
            # its size and modification time put back) is refused when a process opens it.
            stats = stat_shards(shard_paths)
            ctimes = np.array([-1 if st is None else st.st_ctime_ns for st in stats], np.int64)
            ctimes.setflags(write=False)
            self._ctimes = ctimes
            self._dindex = arrayrecord_index(
                shard_paths,
                index_dir=None if index_dir is None else os.fspath(index_dir),
                counts=counts,
                # (verifying: the shards' own footers, not an index the dataset ships,
                # whose offsets only the manifest's checksum vouches for)
                beside=None if self._verify else index_entry,
                max_chunk_bytes=max_chunk_bytes,
                lock_wait=None if opts.retry is None else opts.retry.deadline,
                stats=stats,
            )
            del stats
            if counts is None:
                counts = self._dindex.counts
            elif not np.array_equal(self._dindex.counts, counts):
                self._count_bad = self._dindex.counts != counts
        elif counts is None:  # remote files without a manifest: count from footers
            # An opening reads the shards as they are now: what an earlier opening in this
            # process pinned of them (a dataset re-uploaded since) is taken anew, before
            # the footers are read (they pin the answers' size and validators).
            for path in shard_paths:
                remote.pin(fs, fs._strip_protocol(path), None, fresh=True)
            fresh = True
            counts = retry_call(
                read_num_records,
                list(shard_paths),
                filesystem=fs,
                max_chunk_bytes=max_chunk_bytes,
                url=os.fspath(paths) if isinstance(paths, (str, os.PathLike)) else shard_paths[0],
                policy=retry,
                what="reading shard footers",
            )
        elif not local:  # with a manifest: its sizes and the first answers' validators
            for shard, path in enumerate(shard_paths):
                remote.pin(fs, fs._strip_protocol(path), self.shard_integrity(shard)[0], fresh=True)
        max_open_files = opts.max_open_files
        if max_open_files == "auto":
            # Local readers hold two descriptors each (the file, its map); remote ones none.
            max_open_files = default_max_open_files(len(shard_paths)) if local else None
        self._init_shards(
            filesystem=fs,
            paths=shard_paths,
            counts=counts,
            options=opts,
            max_open_files=max_open_files,
        )
        if has_manifest:  # a shard the manifest gives no records is never read: its file
            # must hold none (a count too low elsewhere is refused when the shard is read):
            # local ones by the index's counts, remote ones by their footers, concurrently
            empty = np.flatnonzero(np.asarray(counts) == 0)
            if local:  # (its counts agree with the manifest's where _count_bad is None)
                bad = self._count_bad
                empty = empty[bad[empty]] if bad is not None else np.zeros(0, np.int64)
            map_files(
                lambda j: self._counted_file(
                    int(empty[j]), shard_paths[int(empty[j])], None if local else fs
                ).close(),
                len(empty),
                max_workers=1 if local else opts.io_threads,
            )
        if fresh and self._held is not None:
            # The footer reads found each file's size: a pass's cache-fit check asks for none.
            self.cache_fit.sizes = {k: p.size for k, p in enumerate(self._held) if p and p.size}
        with using(retry):  # the TFDS metadata's lookup, the codec's sniff
            if not has_manifest and isinstance(codec, str) and codec in ("auto", "tf_example"):
                # TFDS output: decode per its features.json (images, shapes, scalars).
                codec = tfds_codec_for(list(shard_paths), fs) or codec
            if codec == "auto" and has_manifest:
                try:
                    self.codec: Codec = get_codec(manifest_codec)
                except ValueError as e:  # the dataset's word, not the caller's
                    raise CorruptDataError(
                        f"the manifest ({MANIFEST_NAME}) of {os.fspath(paths)!r}: {e}"
                    ) from None
            else:
                self.codec = get_codec(self._sniff() if codec == "auto" else codec)
        self._schema: dict[str, str] | None = schema
        self._share_index()

    # ------------------------------------------------------------ the contract
    @property
    def schema(self) -> dict[str, str]:
        """Record key -> type description, from the manifest or else the first record."""
        if self._schema is None:
            self._schema = first_record_schema(self)
        return dict(self._schema)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self._check_index()
        shard, row = self.index.locate_one(index)
        t0, index = time.perf_counter(), int(index)
        data = self._read_single(shard, row, index)
        if data is None:
            data = self._read_named(shard, np.array([row]), np.array([index]), None)[0]
        t1 = time.perf_counter()
        count_read(t1 - t0, len(data))
        out = self._decode(data, shard, row, index)
        count_decode(time.perf_counter() - t1)
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Read a batch: each shard once, the remote ones concurrently; request order."""
        self._check_index()  # (before the index is read: a truncated map is a SIGBUS)
        return self._records(self.index.check(indices), decode=True)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        """The records at ``indices`` as columns, decoded for the whole batch at once when
        the codec has a column form (``decode_columns``: msgpack, raw), else built from
        the decoded records."""
        self._check_index()  # (before the index is read: a truncated map is a SIGBUS)
        idx = self.index.check(indices)
        if len(idx) == 0:
            return ColumnBatch.from_records([])
        blobs = self._records(idx)
        t0 = time.perf_counter()
        where = named_rows(self.index, idx, self._shard_where)
        batch = decode_columns(self.codec, blobs, lambda: decode_records(self.codec, blobs, where))
        count_decode(time.perf_counter() - t0)
        return batch

    def iter_shard(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of one shard, in order."""
        return decode_in_order(self, shard, start, stop, self._decode)

    def _share_index(self) -> None:
        """Record offsets per shard from the mapped index, not a private copy."""
        if self._dindex is not None and self._count_bad is None:
            self.index = ShardIndex.from_offsets(self._dindex.rec_base)

    # ---------------------------------------------------------------- decoding
    def _records(self, idx: np.ndarray, *, decode: bool = False) -> list[Any]:
        """The records at checked indices ``idx``, in request order, as their bytes unless
        ``decode``: the mapped path where it covers the batch, else the reader path (each
        shard once, remote ones concurrently, each decoded as soon as it is read). The
        caller has checked the index (:meth:`_check_index`)."""
        t0 = time.perf_counter()
        blobs = self._read_batch(idx) if len(idx) else None
        if blobs is not None:
            count_read(time.perf_counter() - t0, sum(map(len, blobs)))
            return self._decode_all(blobs, idx) if decode else blobs

        def group(g: tuple[int, np.ndarray, Any], reader: Any = None) -> list[Any]:
            t0, at = time.perf_counter(), idx if g[2] is None else idx[g[2]]
            got = self._read_named(g[0], g[1], at, reader)
            count_read(time.perf_counter() - t0, sum(map(len, got)))
            return self._decode_all(got, at) if decode else got

        return self._read_shard_groups(self.index.split(idx), len(idx), group)

    def _decode_all(self, blobs: list[bytes], idx: np.ndarray) -> list[dict[str, Any]]:
        """The records ``blobs`` at checked indices ``idx`` decoded (:func:`decode_records`:
        an error names the record)."""
        t0 = time.perf_counter()
        out = decode_records(self.codec, blobs, named_rows(self.index, idx, self._shard_where))
        count_decode(time.perf_counter() - t0)
        return out

    def _decode(self, data: bytes, shard: int, row: int, index: int) -> dict[str, Any]:
        return decode_record(self.codec, data, lambda: self._shard_where(shard), row, index)

    def _read_named(
        self, shard: int, rows: np.ndarray, indices: np.ndarray, reader: Any
    ) -> list[bytes]:
        """:meth:`_read_rows`, its errors naming the shard and the record: of bad data in
        several rows, the first row that fails alone (read again one by one)."""
        try:
            return self._read_rows(shard, rows, int(indices[0]), reader)
        except CorruptDataError as e:
            at = int(indices[0])
            for j in range(len(rows) if len(rows) > 1 else 0):
                try:
                    self._read_rows(shard, rows[j : j + 1], int(indices[j]), reader)
                except CorruptDataError:
                    at = int(indices[j])
                    break
            raise self._named(e, shard, at) from e

    def _in_order(self, shard: int, start: int, records: Iterable[bytes]) -> Iterator[bytes]:
        """``records`` of ``shard`` from row ``start`` on (a read in order), a read error
        naming the shard and the index of the record read from."""
        index = int(self.index.offsets[shard]) + max(start, 0)
        try:
            for data in records:
                yield data
                index += 1
        except CorruptDataError as e:
            raise self._named(e, shard, index) from e

    def _shard_where(self, shard: int) -> str:
        return shard_where("ArrayRecord", shard, self.num_shards, self._paths[shard])

    def _named(self, e: CorruptDataError, shard: int, index: int | None) -> CorruptDataError:
        """``e`` naming the shard, file and record index it was reading (when not yet
        said; ``index`` None: the shard alone, a later read adds its record), as every
        read of every format does (:func:`name_error`), the mapped path too."""
        return name_error(e, self._shard_where(shard), index) or e  # type: ignore[return-value]

    def _check_index(self) -> None:
        """Read this process's file events once for the operation
        (:func:`torchgrain.io.changes.poll`: the reads that follow check their maps
        against it), and raise if the node-shared index file the source maps changed
        since it was opened (reading its arrays could kill the process with SIGBUS)."""
        changes.poll()
        if self._dindex is not None:
            self._dindex.check_unchanged(polled=True)

    def check_unchanged(self, shard: int) -> None:
        """Raise if local ``shard`` is not the file the dataset's opening saw (its change
        time differs: :func:`~torchgrain.io.changes.changed_since_opening`). Called once
        a process's reader has pinned the file (a change from then on is the pin's to
        see), not per read."""
        ctimes = self._ctimes
        if ctimes is None:
            return
        path = self._paths[shard]
        if os.stat(path).st_ctime_ns != ctimes[shard]:
            raise changes.changed_since_opening(shard, path)

    # ----------------------------------------------------------------- readers
    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> ArrayRecordFile:
        ix = self._dindex
        if ix is None or filesystem is not None or path != self._paths[shard]:
            return self._counted_file(shard, path, filesystem)
        # A local shard of an indexed dataset: its footer comes from the index, and the
        # file is checked against it now (size, footer), not parsed.
        self._check_counts(np.array([shard]))
        f = ArrayRecordFile(
            path,
            verify_checksums=self._verify,
            footer=ix.footer(shard),
            max_chunk_bytes=self.max_chunk_bytes,
        )
        try:
            try:
                f._local_view()
            except CorruptDataError as e:
                raise self._shard_changed(shard, str(e)) from None
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
                raise _missing(shard, path, e) from e
            self.check_unchanged(shard)  # (pinned: a change from now on is the pin's)
        except BaseException:
            f.close()
            raise
        return f

    def _counted_file(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> ArrayRecordFile:
        """A reader of shard ``shard`` whose record count has been checked against the
        manifest's; a shard that is a directory or missing is an error naming it."""
        # Range answers must be of the file the manifest lists (its size, if given), and of
        # the version the dataset's opening read: one a later opening pinned is refused.
        f = ArrayRecordFile(
            path,
            filesystem=filesystem,
            verify_checksums=self._verify,
            max_chunk_bytes=self.max_chunk_bytes,
            size=None if filesystem is None else self.shard_integrity(shard)[0],
            seen=self._held_version(shard),
        )
        try:
            self._check_count(shard, f)
        except BaseException as e:
            f.close()
            not_file = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
            if isinstance(e, not_file) and not isinstance(e, DatasetNotFoundError):
                raise _missing(shard, path, e) from e
            raise
        return f

    def _shard_changed(self, shard: int, why: str) -> CorruptDataError:
        """The error for a shard that is not the file its index describes: the count
        error when it holds other records than the manifest lists, else the change."""
        if self._manifest_dir is not None:
            f = ArrayRecordFile(self._paths[shard], max_chunk_bytes=self.max_chunk_bytes)
            try:
                self._check_count(shard, f)
            except CorruptDataError as e:
                return e
            finally:
                f.close()
        return self._named(
            CorruptDataError(
                f"the file is not the one the dataset's index describes ({why}); "
                + (
                    "it was replaced after the dataset was written: rewrite the dataset"
                    if self._manifest_dir is not None
                    else "it changed after the dataset was opened: open it again"
                )
            ),
            shard,
            None,
        )

    def _check_counts(self, shards: np.ndarray) -> None:
        """Shards whose files hold other record counts than the manifest lists are
        refused, with the manifest's error."""
        bad = self._count_bad
        if bad is not None and bad[shards].any():
            shard = int(shards[np.flatnonzero(bad[shards])[0]])
            self._counted_file(shard, self._paths[shard], None).close()

    def _reader_for_child(self, reader: ArrayRecordFile) -> ArrayRecordFile | None:
        if not reader.has_index:
            return None
        child = reader.for_child()
        parent = reader._pin
        if self._ctimes is None or parent is None:
            return child
        # A local shard: mapped now, and kept only if it is the very file the parent's
        # reader pinned (checked then against the opening's); else opened afresh, which
        # names the change when the shard is read.
        with contextlib.suppress(OSError, CorruptDataError):
            child._local_view()
            if child._pin is not None and child._pin.ident == parent.ident:
                return child
        child.close()
        return None

    def _touch(self, reader: ArrayRecordFile) -> None:
        reader.num_records  # noqa: B018 - maps the file now: later eviction only unlinks

    def _check_count(self, shard: int, f: ArrayRecordFile) -> None:
        """A shard must hold exactly the records the manifest promised (none skipped)."""
        if self._manifest_dir is None:
            return
        expected = int(self.index.counts[shard])
        n = f.num_records
        if n != expected:  # (the callers close f)
            raise self._named(
                CorruptDataError(
                    f"the file holds {n} records but the dataset's manifest lists {expected}: "
                    "the shard was replaced after the manifest was written (rewrite the "
                    "dataset, or delete torchgrain.json to count records from the shards' "
                    "footers)"
                ),
                shard,
                None,
            )

    def shard_integrity(self, shard: int) -> tuple[int | None, str | None]:
        manifest = self.manifest
        info = manifest.shards[shard] if manifest is not None else None
        if info is None:
            return None, None
        # A downloaded copy is checked against the file's own hash where the manifest
        # has one (cheap), else against the records' (every record decoded).
        return (info.num_bytes if info.num_bytes >= 0 else None), (
            info.file_checksum or info.checksum
        )

    def _verify_copy(self, path: str, checksum: str, *, name: str) -> str | None:
        return verify_file(path, checksum, name=name)  # record checksums need the format

    def _sniff(self) -> str:
        if len(self.index) == 0:
            return "msgpack"
        shard, row = self.index.locate_one(0)
        return sniff_codec(self._reader(shard).read([row])[0])

    # ------------------------------------------------------------ the contract
    def block_offsets(self) -> np.ndarray:
        """Global record offsets of ArrayRecord chunks (for :class:`BlockShuffleSampler`).

        Starts at 0 and ends at ``len(self)``; from the dataset index (local shards) or
        every shard's footer.
        """
        ix = self._dindex
        if ix is not None:
            self._check_counts(np.arange(self.num_shards))
            owner = np.repeat(np.arange(self.num_shards), np.diff(ix.chunk_base) + 1)
            return np.unique(ix.record_offsets + self.index.offsets[owner])
        base = self.index.offsets
        parts = [self._reader(s).record_offsets[1:] + base[s] for s in range(self.num_shards)]
        return np.concatenate([np.zeros(1, dtype=np.int64), *parts])

    def cache_blocks(self) -> list[CacheBlocks]:
        """The caches a pass goes through (see :meth:`check_cache_fit`): the shard cache
        for remote shards, and for local ones the chunk cache, which holds chunks of
        several records (files written with ``group_size`` > 1) decompressed, from the
        dataset index (no shard opened). A chunk is counted at about its stored
        (compressed) size, less than what it costs decompressed: the check may miss a
        thrash of data that compresses well, and does not invent one."""
        out = super().cache_blocks()
        if not self.cache_bytes or self._remote:
            return out
        ix = self._dindex
        if ix is None or ix.single:
            # No shard, or every chunk holds one record (the dataset index says so
            # without opening a shard): nothing goes through the chunk cache.
            return out
        # From the mapped dataset index, in one numpy step: no reader per shard.
        shards = self.num_shards
        # Every entry but each shard's last (its footer) is a chunk.
        e = np.delete(np.arange(len(ix.offsets)), ix.chunk_base[1:] + np.arange(shards))
        owner = np.repeat(np.arange(shards), np.diff(ix.chunk_base))
        stored = np.maximum(ix.offsets[e + 1] - ix.offsets[e], 0)
        records = ix.record_offsets[e + 1] - ix.record_offsets[e]
        offsets = np.concatenate(
            [np.zeros(1, np.int64), ix.record_offsets[e + 1] + self.index.offsets[owner]]
        )
        nbytes = np.where(records > 1, stored, 0).astype(np.int64)  # 1-record chunks: not cached
        if not nbytes.any():
            return out  # no chunk of several records: nothing goes through the cache
        out.append(
            CacheBlocks(
                cache="chunk cache",
                unit="chunk",
                offsets=offsets,
                nbytes=lambda c: nbytes[c],
                capacity=self.cache_bytes,
                per_process=True,
                total=int(nbytes.sum()),
                remedies=(
                    "use BlockShuffleSampler (chunks in random order, records shuffled "
                    "within a window of a few: each chunk decompressed once a pass)",
                    "raise cache_bytes above the working set, memory allowing (every "
                    "DataLoader worker holds its own)",
                    "rewrite with group_size=1 (torchgrain convert SRC DST --group-size 1): "
                    "each record its own chunk, read without the chunk cache",
                ),
            )
        )
        return out

    def iter_shard_bytes(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[bytes]:
        """The raw records ``[start, stop)`` of one shard, in order, read in blocks."""
        start, stop = shard_rows(self.index.counts, shard, start, stop)

        def records() -> Iterator[bytes]:
            for a in range(start, stop, _SEQUENTIAL_BLOCK):
                b = min(a + _SEQUENTIAL_BLOCK, stop)
                yield from self._io(
                    lambda a=a, b=b: self._reader(shard).read_range(a, b),
                    shard,
                    f"read of records {a}-{b} of shard {shard}",
                )

        yield from self._in_order(shard, start, records())

    # ---------------------------------------------------------------- reading
    # Two paths, chosen once per read (a batch, or a record): the mapped path
    # (_read_batch, and _read_single for one record) for records of one-record chunks of
    # local shards the dataset index covers, read through this process's one map of the
    # shards (io.region) within the bounds the index gives; the reader path (_read_rows,
    # a reader per shard) for everything else: remote shards and their cached copies,
    # verify_checksums, chunks of several records (the chunk cache), datasets whose files
    # disagree with the manifest, shards that cannot be mapped (their reader names the
    # error), and batches of more shards than may be mapped at once (see
    # :func:`~torchgrain.io.region.acquired`).
    def _read_rows(
        self, shard: int, rows: np.ndarray, index: int, reader: ArrayRecordFile | None
    ) -> list[bytes]:
        cache = self._blocks if self.cache_bytes else None
        return self._io(
            lambda: (reader or self._reader(shard)).read(rows, chunk_cache=cache, cache_key=shard),
            shard,
            f"range read of shard {shard} (record index {index})",
        )

    def _read_single(self, shard: int, row: int, index: int) -> bytes | None:
        # One record without the batch's numpy steps (they would double its cost).
        ix = self._dindex
        mapped = None if ix is None or not ix.single else self._region()
        if mapped is None:
            return None
        region = mapped[0]
        at = acquired(region, shard)
        if at is None:
            return None
        try:  # one record per chunk: the row is the chunk
            return self._mapped_record(mapped, at, shard, row, index)
        finally:
            region.release()

    def _read_batch(self, idx: np.ndarray) -> list[bytes] | None:
        """The mapped path for a batch: one numpy plan (:func:`read_mapped`); up to
        :data:`_SINGLES` records of a one-record-chunk dataset each by
        :meth:`_read_single`, cheaper than the plan's fixed cost (~0.2 ms of numpy
        steps)."""
        ix = self._dindex
        mapped = None if ix is None else self._region()
        if mapped is None:
            return None
        if len(idx) <= _SINGLES and ix.single:
            shards, rows = self.index.locate(idx, checked=True)
            where = zip(shards.tolist(), rows.tolist(), idx.tolist())
            out = [self._read_single(s, r, i) for s, r, i in where]
            return None if None in out else out  # (a shard not mapped now: the reader path)
        shard, _, entry, chunk = ix.chunks(idx, self.index.offsets)
        recs = ix.record_offsets
        if not (ix.single or bool((recs[entry + 1] - recs[entry] == 1).all())):
            return None
        region, decoder, _ = mapped
        base = acquired(region, shard)
        if base is None:
            return None
        try:
            pos = ix.offsets[entry]
            end = ix.offsets[entry + 1]
            c = entry - ix.starts(shard)  # the chunk in its shard
            # Every offset is bounded by its shard's footer before any byte is read.
            outside = (pos < CHUNK_HEADER) | (end <= pos) | (end > ix.footer_offsets(shard))
            if outside.any():
                k = int(np.flatnonzero(outside)[0])
                raise self._outside(int(shard[k]), int(c[k]), int(pos[k]), int(end[k]), int(idx[k]))
            return read_mapped(
                region.u8,
                region.view,
                base + pos,
                base + end,
                base + ix.file_size[shard],
                ix.decoded[chunk],
                decoder=decoder,
                careful=lambda k: self._mapped_record(
                    mapped, int(base[k]), int(shard[k]), int(c[k]), int(idx[k])
                ),
                words=region.words,
            )
        finally:
            region.release()

    def _mapped_record(self, mapped: tuple, at: int, shard: int, chunk: int, index: int) -> bytes:
        """The record of one-record chunk ``chunk`` of ``shard``, mapped at ``at`` of the
        region of ``mapped`` (:meth:`_region`), by the careful path (no reader per shard:
        no descriptor, map or context); its bounds checked against the index, errors
        naming the shard and record."""
        region, decoder, footers = mapped
        got = footers.get(shard)
        if got is None:
            if len(footers) >= _FOOTERS:
                with contextlib.suppress(RuntimeError, StopIteration, KeyError):
                    footers.pop(next(iter(footers)))  # another thread may be here too
            footer = self._dindex.footer(shard)  # type: ignore[union-attr]
            got = footers[shard] = (footer, fast_views(footer))
        footer, fast = got
        pos, end = fast[0][chunk], fast[1][chunk]
        if not CHUNK_HEADER <= pos < end <= footer.footer_offset:
            raise self._outside(shard, chunk, pos, end, index)
        view = region.view[at : at + footer.file_size]
        f = ArrayRecordFile.over(view, self._paths[shard], footer, decoder, fast)
        try:  # (the checks of its map are the region's: the chunk read from it directly)
            values, bounds = f._local_chunk(chunk, view, fast)
        except CorruptDataError as e:
            raise self._named(e, shard, index) from e
        if bounds is None:
            return values if type(values) is bytes else bytes(values)
        return bytes(values[int(bounds[0]) : int(bounds[1])])  # its one record

    def _outside(self, shard: int, chunk: int, pos: int, end: int, index: int) -> CorruptDataError:
        return self._dindex.error(  # type: ignore[union-attr]
            shard,
            f"chunk {chunk} of {self._paths[shard]!r} at [{pos}, {end}) lies outside "
            f"the file's chunks (record index {index})",
        )

    def _region(self) -> tuple[ShardRegion, ArrayRecordFile, dict] | None:
        """This process's map of the dataset's local shards (inherited through fork:
        the maps stay valid), with a decoder and the index views of the shards records
        were read from one by one (a few): one per process, made once (threads that
        read at once share it; a read uses the one it took throughout); None where
        every read takes the reader path (its readers name a shard whose count
        disagrees with the manifest)."""
        mapped = self._mapped
        if mapped is None:
            off = self._remote or self._verify or self.max_mapped_shards == 0
            if off or self._dindex is None or self._count_bad is not None:
                return None
            with self._proc().lock:
                return self._new_region()
        return mapped or None

    def _new_region(self) -> tuple[ShardRegion, ArrayRecordFile, dict] | None:
        mapped = self._mapped
        if mapped is None:  # (not made by another thread meanwhile)
            try:
                region = ShardRegion(
                    self._paths,
                    self._dindex.file_size,
                    max_maps=self.max_mapped_shards,
                    check=self._check_mapped,
                    ctimes=self._ctimes,
                )
            except RegionUnavailable:
                self._mapped = False
                return None
            # Only its zstd context is used: one per thread and process.
            mapped = self._mapped = (
                region,
                ArrayRecordFile(self._paths[0], max_chunk_bytes=self.max_chunk_bytes),
                {},
            )
        return mapped or None

    def _check_mapped(self, shard: int, st: os.stat_result, view: memoryview) -> None:
        assert self._dindex is not None
        why = self._dindex.mismatch(shard, st, view if len(view) else None)
        if why is not None:
            raise self._shard_changed(shard, why)

    @property
    def manifest(self) -> Manifest | None:
        """The dataset's ``torchgrain.json`` (None for files without one). A worker that
        received the source pickled reads it again on first use: its shard list costs
        every process hundreds of bytes per shard."""
        if self._manifest is None and self._manifest_dir is not None:
            self._manifest = read_manifest(self._fs, self._manifest_dir)
        return self._manifest

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_mapped"] = None  # maps belong to one process
        if self._dindex is not None:  # local: the index holds what reading needs
            state.pop("_manifest", None)
            if self._count_bad is None:
                state["index"] = None  # the mapped index's, after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self.index is None:
            self._share_index()

    def close(self) -> None:
        super().close()
        mapped = self._mapped
        if mapped:
            mapped[0].close()

    def _batch_ranges(
        self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]]
    ) -> list[tuple[str, str, list[tuple[int, int]]]] | None:
        # The chunks the batch's reads will fetch: footers first (each shard's once per
        # process, the missing ones concurrently); chunks in the chunk cache are not.
        open_now = self._proc().readers
        missing = [g[0] for g in groups if getattr(open_now.get(g[0]), "_footer", None) is None]
        list(self._map(self._ensure_footer_of, missing))
        readers = [self._reader(g[0]) for g in groups]
        cache = self._blocks if self.cache_bytes else None
        out = []
        for (shard, rows, _), reader in zip(groups, readers):
            chunks, ranges = reader.chunk_ranges(rows)
            if cache is not None and len(cache):
                ranges = [r for c, r in zip(chunks.tolist(), ranges) if (shard, c) not in cache]
            out.append((reader._path, reader.path, ranges))
        return out

    def _ensure_footer_of(self, shard: int) -> None:
        what = f"footer read of shard {shard}"
        self._io(lambda: self._reader(shard)._ensure_footer(), shard, what)

    def __repr__(self) -> str:
        return (
            f"ArrayRecordSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"codec={self.codec.name!r}, keys={self.keys if self._schema else '?'})"
        )


def _missing(shard: int, path: str, e: OSError) -> TorchgrainError:
    """The error for a shard that is not a file: missing, or a directory."""
    if isinstance(e, FileNotFoundError):
        return DatasetNotFoundError(f"shard {shard} {path!r} of this dataset does not exist ({e})")
    what = "a directory" if isinstance(e, IsADirectoryError) else "not a file"
    return CorruptDataError(
        f"shard {shard} {path!r} of this dataset is {what}, not an ArrayRecord file"
    )


def _old_cache_budget(keywords: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments, the earlier meaning of ``cache_bytes`` honoured: given
    with ``cache_dir`` and without ``cache_dir_bytes``, it was the budget of
    ``cache_dir``."""
    if keywords.get("cache_dir_bytes", 0) is None:
        keywords = {k: v for k, v in keywords.items() if k != "cache_dir_bytes"}
    if (
        keywords.get("cache_dir") is not None
        and keywords.get("cache_bytes") is not None
        and "cache_dir_bytes" not in keywords
    ):
        warnings.warn(
            "ArrayRecordSource(cache_dir=..., cache_bytes=N): cache_bytes is now the "
            "in-memory chunk cache, as on every source; N is taken as the budget of "
            "cache_dir this time. Pass cache_dir_bytes=N instead.",
            DeprecationWarning,
            stacklevel=3,
        )
        keywords = {**keywords, "cache_bytes": None, "cache_dir_bytes": keywords["cache_bytes"]}
    return keywords
