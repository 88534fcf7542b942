"""ArrayRecordSource: random access, key-value records over sharded ArrayRecord files."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    check_ceiling,
)
from torchgrain.formats.arrayrecord_file import (
    DEFAULT_MAX_CHUNK_BYTES,
    ArrayRecordFile,
    read_many,
    read_num_records,
)
from torchgrain.formats.checksums import verify_file
from torchgrain.formats.codecs import Codec, get_codec, sniff_codec
from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, read_manifest
from torchgrain.formats.tfds import tfds_codec_for
from torchgrain.io import remote
from torchgrain.io.fs import expand_paths, get_filesystem, is_local
from torchgrain.io.paths import resolve_all
from torchgrain.io.retry import RetryPolicy, retry_call, using
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources.base import DEFAULT_CACHE_DIR_BYTES
from torchgrain.sources.block_cache import DEFAULT_CACHE_BYTES, CacheBlocks
from torchgrain.sources.encoded import EncodedSource

__all__ = ["ARRAY_RECORD_SUFFIXES", "ArrayRecordSource"]

ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
_SEQUENTIAL_BLOCK = 1024  # records per read when reading a shard in order


class ArrayRecordSource(EncodedSource):
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
        storage_options: fsspec options for remote paths (e.g. ``endpoint_url``).
        filesystem: an fsspec filesystem to use instead of inferring one.
        verify_checksums: verify Riegeli chunk hashes on every read.
        max_chunk_bytes: the most bytes one compressed chunk (so one record) may
            decompress to (default 1 GiB,
            :data:`~torchgrain.formats.arrayrecord_file.DEFAULT_MAX_CHUNK_BYTES`); a
            chunk that declares more raises :class:`~torchgrain.CorruptDataError`
            before anything is allocated for it. Raise it for trusted files written
            with large groups of large records.
        cache_bytes: this process's in-memory cache of decompressed chunks, in bytes
            (default 256 MiB; ``0`` disables it). Only chunks holding several records
            (files written with ``group_size`` > 1) are kept: a block-local order then
            decompresses each chunk once.
        cache_dir: a local directory (or a :class:`~torchgrain.io.shard_cache.ShardCache`)
            for whole copies of *remote* shards: each shard is downloaded once (by one
            worker of the machine) and read locally after. Local shards are never cached.
        cache_dir_bytes: byte budget of ``cache_dir`` (default 16 GiB; least recently
            used shards go first). Before this argument existed, ``cache_bytes`` given
            together with ``cache_dir`` meant this budget; that still works, with a
            ``DeprecationWarning``.
        read_ahead_bytes: with ``cache_dir`` on remote storage, how many bytes of
            shards a sampler's future order may have downloaded ahead of use (default:
            half of ``cache_dir_bytes``; ``0`` turns read-ahead off). See
            :mod:`torchgrain.io.readahead`.
        io_threads: threads per process that read the shards of one remote batch
            concurrently, overlapping request latency (1 = sequential), and the shard
            read-ahead's concurrent downloads. Local shards are always read in the
            calling thread.
        retry: retry policy and deadlines of remote reads and downloads (default
            :class:`~torchgrain.io.retry.RetryPolicy()`: 6 attempts, exponential backoff;
            a read that makes no progress fails within 90 s).
        max_open_files: readers kept open per process (default: all; a local reader is
            a memory map and holds no file descriptor).
        allow_external_paths: a manifest (or a server's directory listing) may name
            shards outside the dataset's directory (absolute paths, ``..``, other URLs),
            and an HTTP(S) server may redirect. Off by default: a dataset from an
            untrusted place must not pull other files into your batches, nor make this
            process request other URLs (see :mod:`torchgrain.io.paths`).

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

    default_max_open_files = None

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        codec: str | Codec = "auto",
        storage_options: dict[str, Any] | None = None,
        filesystem: fsspec.AbstractFileSystem | None = None,
        verify_checksums: bool = False,
        cache_bytes: int | None = None,
        cache_dir: str | os.PathLike | ShardCache | None = None,
        cache_dir_bytes: int | None = None,
        io_threads: int = 8,
        read_ahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        max_open_files: int | type[Ellipsis] | None = ...,
        allow_external_paths: bool = False,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    ) -> None:
        cache_bytes, cache_dir_bytes = _cache_budgets(cache_bytes, cache_dir, cache_dir_bytes)
        self._verify = verify_checksums
        self.max_chunk_bytes = check_ceiling("max_chunk_bytes", max_chunk_bytes, 1)
        retry = retry or RetryPolicy()
        with using(retry):  # the transport and open-time requests keep to its deadlines
            manifest, fs, files = _resolve(paths, storage_options, filesystem, allow_external_paths)
        if manifest is not None:
            counts = np.array([s.num_records for s in manifest.shards], dtype=np.int64)
        elif not is_local(fs):
            counts = retry_call(
                read_num_records,
                files,
                filesystem=fs,
                max_chunk_bytes=max_chunk_bytes,
                url=os.fspath(paths) if isinstance(paths, (str, os.PathLike)) else files[0],
                policy=retry,
                what="reading shard footers",
            )
        else:
            counts = read_num_records(files, filesystem=fs, max_chunk_bytes=max_chunk_bytes)
        self.manifest = manifest
        self._init_shards(
            filesystem=fs,
            paths=files,
            counts=counts,
            cache_bytes=cache_bytes,
            cache_dir=cache_dir,
            cache_dir_bytes=cache_dir_bytes,
            io_threads=io_threads,
            read_ahead_bytes=read_ahead_bytes,
            retry=retry,
            max_open_files=max_open_files,
        )
        if manifest is None and isinstance(codec, str) and codec in ("auto", "tf_example"):
            # TFDS output: decode per its features.json (images, shapes, scalars).
            codec = tfds_codec_for(files, fs) or codec
        if codec == "auto" and manifest is not None:
            try:
                self.codec: Codec = get_codec(manifest.codec)
            except ValueError as e:  # the dataset's word, not the caller's
                raise CorruptDataError(
                    f"the manifest ({MANIFEST_NAME}) of {os.fspath(paths)!r}: {e}"
                ) from None
        else:
            self.codec = get_codec(self._sniff() if codec == "auto" else codec)
        self._schema: dict[str, str] | None = (
            dict(manifest.schema) if manifest is not None and manifest.schema else None
        )

    # ----------------------------------------------------------------- readers
    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> ArrayRecordFile:
        f = ArrayRecordFile(
            path,
            filesystem=filesystem,
            verify_checksums=self._verify,
            max_chunk_bytes=self.max_chunk_bytes,
        )
        try:
            self._check_count(shard, f)
        except (IsADirectoryError, NotADirectoryError) as e:
            f.close()
            raise CorruptDataError(
                f"shard {shard} {path!r} of this dataset is a directory, not an ArrayRecord file"
            ) from e
        except FileNotFoundError as e:
            f.close()
            if isinstance(e, DatasetNotFoundError):
                raise
            raise DatasetNotFoundError(
                f"shard {shard} {path!r} of this dataset does not exist ({e})"
            ) from e
        return f

    def _reader_for_child(self, reader: ArrayRecordFile) -> ArrayRecordFile | None:
        return reader.for_child() if reader.has_index else None

    def _touch(self, reader: ArrayRecordFile) -> None:
        reader.num_records  # noqa: B018 - maps the file now: later eviction only unlinks

    def _check_count(self, shard: int, f: ArrayRecordFile) -> None:
        """A shard must hold exactly the records the manifest promised (none skipped)."""
        if self.manifest is None:
            return
        expected = int(self.index.counts[shard])
        n = f.num_records
        if n != expected:
            f.close()
            raise CorruptDataError(
                f"shard {shard} {self._paths[shard]!r} holds {n} records but the dataset's "
                f"manifest lists {expected}: the shard was replaced after the manifest was "
                "written (rewrite the dataset, or delete torchgrain.json to count records "
                "from the shards' footers)"
            )

    def shard_integrity(self, shard: int) -> tuple[int | None, str | None]:
        info = self.manifest.shards[shard] if self.manifest is not None else None
        if info is None:
            return None, None
        # A downloaded copy is checked against the file's own hash where the manifest
        # has one (cheap), else against the records' (every record decoded).
        return (info.num_bytes if info.num_bytes >= 0 else None), (
            info.file_checksum or info.checksum
        )

    def _verify_copy(self, path: str, checksum: str, *, name: str) -> None:
        verify_file(path, checksum, name=name)  # record checksums need the format

    def _sniff(self) -> str:
        if len(self.index) == 0:
            return "msgpack"
        shard, row = self.index.locate_one(0)
        return sniff_codec(self._reader(shard).read([row])[0])

    # ------------------------------------------------------------ the contract
    def block_offsets(self) -> np.ndarray:
        """Global record offsets of ArrayRecord chunks (for :class:`BlockShuffleSampler`).

        Starts at 0 and ends at ``len(self)``; reads every shard's footer.
        """
        parts = [np.zeros(1, dtype=np.int64)]
        for shard in range(self.num_shards):
            offs = self._reader(shard).record_offsets
            parts.append(offs[1:] + self.index.offsets[shard])
        return np.concatenate(parts)

    def cache_blocks(self) -> list[CacheBlocks]:
        """The caches a pass goes through (see :meth:`check_cache_fit`): the shard cache
        for remote shards, and for local ones the chunk cache, which holds chunks of
        several records (files written with ``group_size`` > 1) decompressed. Reads
        every shard's footer. A chunk is counted at about its stored (compressed) size,
        less than what it costs decompressed: the check may miss a thrash of data that
        compresses well, and does not invent one."""
        out = super().cache_blocks()
        if not self.cache_bytes or self._remote:
            return out
        offsets, sizes = [np.zeros(1, dtype=np.int64)], []
        for shard in range(self.num_shards):
            reader = self._reader(shard)
            records = reader.record_offsets
            starts = reader.chunk_offsets
            ends = np.append(starts[1:], self.shard_nbytes(shard))
            stored = np.maximum(ends - starts, 0)
            offsets.append(records[1:] + self.index.offsets[shard])
            sizes.append(np.where(np.diff(records) > 1, stored, 0))  # 1-record: not cached
        nbytes = np.concatenate([np.zeros(0, dtype=np.int64), *sizes]).astype(np.int64)
        if not nbytes.any():
            return out  # no chunk of several records: nothing goes through the cache
        out.append(
            CacheBlocks(
                cache="chunk cache",
                unit="chunk",
                offsets=np.concatenate(offsets),
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
        n = int(self.index.counts[shard])
        stop = n if stop is None else min(stop, n)

        def records() -> Iterator[bytes]:
            for a in range(max(start, 0), stop, _SEQUENTIAL_BLOCK):
                b = min(a + _SEQUENTIAL_BLOCK, stop)
                yield from self._io(
                    lambda a=a, b=b: self._reader(shard).read_range(a, b),
                    shard,
                    f"read of records {a}-{b} of shard {shard}",
                )

        yield from self._in_order(shard, start, records())

    # ---------------------------------------------------------------- reading
    def _read_rows(
        self, shard: int, rows: np.ndarray, index: int, reader: ArrayRecordFile | None
    ) -> list[bytes]:
        cache = self._blocks if self.cache_bytes else None
        return self._io(
            lambda: (reader or self._reader(shard)).read(rows, chunk_cache=cache, cache_key=shard),
            shard,
            f"range read of shard {shard} (record index {index})",
        )

    def _read_many(
        self, groups: list[tuple[int, np.ndarray, np.ndarray]]
    ) -> list[list[bytes]] | None:
        # Local files only: remote shards are fetched concurrently, one by one, and
        # downloaded copies may be evicted while the batch opens others. All of the
        # batch's files are open at once, so only as many as may stay open. An error is
        # left to the shard-by-shard path, which names the shard.
        limit = self.max_open_files
        if self._remote or (limit is not None and len(groups) > limit):
            return None
        try:
            readers = [self._reader(shard) for shard, _, _ in groups]
            return read_many(
                readers,
                [rows for _, rows, _ in groups],
                chunk_cache=self._blocks if self.cache_bytes else None,
                cache_keys=[shard for shard, _, _ in groups],
            )
        except CorruptDataError:
            return None

    def __repr__(self) -> str:
        return (
            f"ArrayRecordSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"codec={self.codec.name!r}, keys={self.keys if self._schema else '?'})"
        )


def _cache_budgets(
    cache_bytes: int | None, cache_dir: Any, cache_dir_bytes: int | None
) -> tuple[int, int]:
    """``(cache_bytes, cache_dir_bytes)``, honouring the old meaning of ``cache_bytes``."""
    if cache_dir is not None and cache_bytes is not None and cache_dir_bytes is None:
        warnings.warn(
            "ArrayRecordSource(cache_dir=..., cache_bytes=N): cache_bytes is now the "
            "in-memory chunk cache, as on every source; N is taken as the budget of "
            "cache_dir this time. Pass cache_dir_bytes=N instead.",
            DeprecationWarning,
            stacklevel=3,
        )
        return DEFAULT_CACHE_BYTES, cache_bytes
    return (
        DEFAULT_CACHE_BYTES if cache_bytes is None else cache_bytes,
        DEFAULT_CACHE_DIR_BYTES if cache_dir_bytes is None else cache_dir_bytes,
    )


def _resolve(
    paths: Any,
    storage_options: dict[str, Any] | None,
    filesystem: fsspec.AbstractFileSystem | None,
    allow_external_paths: bool,
) -> tuple[Manifest | None, fsspec.AbstractFileSystem, list[str]]:
    """The manifest (for a dataset directory that has one), the filesystem and the files."""
    if isinstance(paths, (str, os.PathLike)):
        if filesystem is not None:
            fs, root = filesystem, filesystem._strip_protocol(os.fspath(paths))
        else:
            fs, root = get_filesystem(paths, storage_options, allow_redirects=allow_external_paths)
        where = os.fspath(paths)
        if not any(ch in root for ch in "*?[") and remote.isdir(fs, root, url=where):
            manifest = read_manifest(fs, root)
            if manifest is not None:
                files = _shard_paths(
                    fs, root, [s.path for s in manifest.shards], where, allow_external_paths
                )
                ends = sorted({0, len(files) - 1}) if files else []
                missing = [k for k in ends if not remote.exists(fs, files[k])]
                if missing:
                    raise DatasetNotFoundError(
                        f"shard {missing[0]} {files[missing[0]]!r} listed in the manifest of "
                        f"{where!r} does not exist"
                    )
                return manifest, fs, files
    fs, files = expand_paths(
        paths,
        suffixes=ARRAY_RECORD_SUFFIXES,
        storage_options=storage_options,
        filesystem=filesystem,
        kind="ArrayRecord",
        allow_external=allow_external_paths,
    )
    return None, fs, files


def _shard_paths(
    fs: fsspec.AbstractFileSystem,
    root: str,
    names: list[str],
    where: str,
    allow_external: bool,
) -> list[str]:
    """Where a manifest's shards are: inside ``root`` unless the user allows more.

    A shard name is a relative path below the dataset directory, checked in every reading
    (percent-decoded, normalised) by :func:`torchgrain.io.paths.resolve_all`: ``..``
    segments, an absolute path or a URL would let an untrusted dataset read any file the
    process can. A symlink inside the directory is the user's own doing and is followed.
    """
    return resolve_all(
        fs,
        root,
        names,
        where=f"the manifest of {where!r}",
        what=lambda k: f"shard {k}",
        allow_external=allow_external,
    )
