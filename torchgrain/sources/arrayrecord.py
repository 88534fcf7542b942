"""ArrayRecordSource: random access, key-value records over sharded ArrayRecord files."""

from __future__ import annotations

import os
import posixpath
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np

from torchgrain.diagnostics import COUNTER, local_counters
from torchgrain.errors import CorruptDataError, DatasetNotFoundError, RecordDecodeError
from torchgrain.io.fs import (
    expand_paths,
    filesystem_for_this_process,
    get_filesystem,
    is_local,
)
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources._index import ShardIndex, group_by_shard
from torchgrain.sources.arrayrecord_file import ArrayRecordFile, read_num_records
from torchgrain.sources.codecs import Codec, describe_value, get_codec, sniff_codec
from torchgrain.sources.manifest import Manifest, read_manifest
from torchgrain.sources.tfds import tfds_codec_for

__all__ = ["ArrayRecordSource"]

ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
DEFAULT_CACHE_BYTES = 16 * 2**30
# Readers of cached local copies kept open per process. Eviction only unlinks files, so
# an open reader would pin an evicted copy's disk blocks: keep few of them open.
_MAX_OPEN_CACHED = 32
# How long an open reader of a cached copy is trusted without a stat() of the copy
# (the cache's LRU clock has the same 1 s resolution).
_RECHECK_SECONDS = 1.0


class ArrayRecordSource:
    """Random-access, key-value view of one or many ArrayRecord shards.

    Args:
        paths: a dataset directory (with or without a ``torchgrain.json`` manifest), a
            glob, a single file, a list of these, or fsspec URLs (``s3://``, ``gs://``,
            ``http(s)://``, ...).
        codec: ``"auto"`` (the manifest's codec, else sniffed from the first record),
            ``"msgpack"``, ``"raw"`` (records as ``{"bytes": b}``), ``"tf_example"``,
            or any registered codec name or codec object. For TFDS output (a directory
            with ``features.json``), ``"auto"`` and ``"tf_example"`` decode records per
            the feature spec (:class:`~torchgrain.sources.tfds.TFDSCodec`: images to
            arrays, scalars squeezed, tensors reshaped); the files must be of one split.
        storage_options: fsspec options for remote paths (e.g. ``endpoint_url``).
        filesystem: an fsspec filesystem to use instead of inferring one.
        verify_checksums: verify Riegeli chunk hashes on every read.
        cache_dir: a local directory (or a :class:`~torchgrain.io.shard_cache.ShardCache`)
            for whole copies of *remote* shards: each shard is downloaded once (by one
            worker of the machine) and read locally after. Local shards are never cached.
        cache_bytes: byte budget of ``cache_dir`` (least recently used shards go first).
        io_threads: threads per process that read the shards of one remote batch
            concurrently, overlapping request latency (1 = sequential). Local shards
            are always read in the calling thread.
        retry: retry policy for remote reads and downloads (default
            :class:`~torchgrain.io.retry.RetryPolicy()`: 6 attempts, exponential backoff).

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

    #: Tells :class:`~torchgrain.Dataset` that this source times its own reads.
    reports_stats = True

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        codec: str | Codec = "auto",
        storage_options: dict[str, Any] | None = None,
        filesystem: fsspec.AbstractFileSystem | None = None,
        verify_checksums: bool = False,
        cache_dir: str | os.PathLike | ShardCache | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        io_threads: int = 8,
        retry: RetryPolicy | None = None,
    ) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self._verify = verify_checksums
        self._retry = retry or RetryPolicy()
        self.io_threads = int(io_threads)
        manifest, fs, files = self._resolve(paths, storage_options, filesystem)
        self._fs = fs
        self._remote = not is_local(fs)
        self.paths: list[str] = files
        self.cache: ShardCache | None = None
        if self._remote and cache_dir is not None:
            self.cache = (
                cache_dir
                if isinstance(cache_dir, ShardCache)
                else ShardCache(cache_dir, max_bytes=cache_bytes, retry=self._retry)
            )
        self._init_process_state()
        if manifest is not None:
            counts = np.array([s.num_records for s in manifest.shards], dtype=np.int64)
        elif self._remote:
            counts = retry_call(
                read_num_records,
                files,
                filesystem=fs,
                url=os.fspath(paths) if isinstance(paths, (str, os.PathLike)) else files[0],
                policy=self._retry,
                what="reading shard footers",
            )
        else:
            counts = read_num_records(files, filesystem=fs)
        self.index = ShardIndex(counts)
        self.manifest = manifest
        if manifest is None and isinstance(codec, str) and codec in ("auto", "tf_example"):
            # TFDS output: decode per its features.json (images, shapes, scalars).
            codec = tfds_codec_for(files, fs) or codec
        if codec == "auto":
            codec = manifest.codec if manifest is not None else self._sniff()
        self.codec: Codec = get_codec(codec)
        self._schema: dict[str, str] | None = (
            dict(manifest.schema) if manifest is not None and manifest.schema else None
        )

    # ----------------------------------------------------------------- opening
    @staticmethod
    def _resolve(
        paths: Any,
        storage_options: dict[str, Any] | None,
        filesystem: fsspec.AbstractFileSystem | None,
    ) -> tuple[Manifest | None, fsspec.AbstractFileSystem, list[str]]:
        if isinstance(paths, (str, os.PathLike)):
            if filesystem is not None:
                fs, root = filesystem, filesystem._strip_protocol(os.fspath(paths))
            else:
                fs, root = get_filesystem(paths, storage_options)
            if not any(ch in root for ch in "*?[") and fs.isdir(root):
                manifest = read_manifest(fs, root)
                if manifest is not None:
                    files = [posixpath.join(root, s.path) for s in manifest.shards]
                    if not is_local(fs):
                        files = [fs.unstrip_protocol(f) for f in files]
                    missing = [f for f in files[:1] + files[-1:] if not fs.exists(f)]
                    if missing:
                        raise DatasetNotFoundError(
                            f"shard {missing[0]!r} listed in the manifest of {os.fspath(paths)!r} "
                            "does not exist"
                        )
                    return manifest, fs, files
        fs, files = expand_paths(
            paths,
            suffixes=ARRAY_RECORD_SUFFIXES,
            storage_options=storage_options,
            filesystem=filesystem,
            kind="ArrayRecord",
        )
        return None, fs, files

    def _sniff(self) -> str:
        if len(self.index) == 0:
            return "msgpack"
        shard, row = self.index.locate_one(0)
        return sniff_codec(self._file(shard).read([row])[0])

    def _init_process_state(self) -> None:
        """Readers, thread pool and counters belong to one process: (re)create them."""
        self._pid = os.getpid()
        self._files: list[ArrayRecordFile | None] = [None] * len(self.paths)
        # shard -> [local path, inode, reader, time of the last existence check]
        self._cached_open: OrderedDict[int, list[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._io = {"remote_reads": 0, "retries": 0}

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            # Inherited through fork: the parent's readers, threads and (for async
            # filesystems) event loop do not exist here. Unpickling a filesystem
            # builds a new instance (fsspec's instance cache is per process).
            self._fs = filesystem_for_this_process(self._fs)
            self._init_process_state()

    def _file(self, shard: int) -> ArrayRecordFile:
        self._check_fork()
        if self.cache is not None:
            return self._cached_file(shard)
        f = self._files[shard]
        if f is None:
            f = ArrayRecordFile(
                self.paths[shard],
                filesystem=self._fs if self._remote else None,
                verify_checksums=self._verify,
            )
            self._check_count(shard, f)
            self._files[shard] = f
        return f

    def _check_count(self, shard: int, f: ArrayRecordFile) -> None:
        """A shard must hold exactly the records the manifest promised (none skipped)."""
        if self.manifest is None:
            return
        expected = int(self.index.offsets[shard + 1] - self.index.offsets[shard])
        n = f.num_records
        if n != expected:
            f.close()
            raise CorruptDataError(
                f"shard {shard} {self.paths[shard]!r} holds {n} records but the dataset's "
                f"manifest lists {expected}: the shard was replaced after the manifest was "
                "written (rewrite the dataset, or delete torchgrain.json to count records "
                "from the shards' footers)"
            )

    def _cache_key(self, shard: int) -> tuple[str, int | None, str | None]:
        info = self.manifest.shards[shard] if self.manifest is not None else None
        if info is None:
            return self.paths[shard], None, None
        return self.paths[shard], (info.num_bytes if info.num_bytes >= 0 else None), info.checksum

    def _is_cached(self, shard: int) -> bool:
        assert self.cache is not None
        entry = self._cached_open.get(shard)
        if entry is not None and time.monotonic() - entry[3] < _RECHECK_SECONDS:
            return True
        url, _, checksum = self._cache_key(shard)
        return os.path.exists(self.cache.local_path(url, checksum=checksum))

    def _open_local(self, path: str) -> ArrayRecordFile:
        f = ArrayRecordFile(path, verify_checksums=self._verify)
        try:
            f.num_records  # noqa: B018 - opens (maps) it now: later eviction only unlinks
        except BaseException:
            f.close()
            raise
        return f

    def _cached_file(self, shard: int) -> ArrayRecordFile:
        """A reader of the local copy of remote ``shard`` (fetched on first access)."""
        assert self.cache is not None
        now = time.monotonic()
        with self._lock:
            entry = self._cached_open.get(shard)
            if entry is not None and now - entry[3] < _RECHECK_SECONDS:
                # Checked a moment ago: skip the stat() (the hot path of warm epochs).
                # Were the copy evicted since, the open reader still reads it.
                return entry[2]
        url, size, checksum = self._cache_key(shard)
        # A hit refreshes the copy's access time (its LRU position).
        hit = self.cache.lookup(url, size=size, checksum=checksum)
        f = None
        if hit is not None:
            with self._lock:
                entry = self._cached_open.get(shard)
                if entry is not None and (entry[0], entry[1]) == hit:
                    entry[3] = now
                    self._cached_open.move_to_end(shard)
                    return entry[2]
            try:
                f = self._open_local(hit[0])
            except FileNotFoundError:
                f = None  # evicted just now: fetch it again below
        if f is None:
            path, ino, f = self.cache.fetch_open(
                url, self._open_local, filesystem=self._fs, size=size, checksum=checksum
            )
            hit = (path, ino)
        assert hit is not None
        self._check_count(shard, f)
        with self._lock:
            old = self._cached_open.pop(shard, None)
            self._cached_open[shard] = [hit[0], hit[1], f, now]
            while len(self._cached_open) > _MAX_OPEN_CACHED:
                self._cached_open.popitem(last=False)[1][2].close()
        if old is not None:
            old[2].close()
        return f

    def _close_evicted(self) -> None:
        """Close readers whose cached copy was evicted: they pin its disk blocks."""
        stale = []
        with self._lock:
            for shard, (path, ino, f, _) in list(self._cached_open.items()):
                try:
                    if os.stat(path).st_ino == ino:
                        continue
                except FileNotFoundError:
                    pass
                del self._cached_open[shard]
                stale.append(f)
        for f in stale:
            f.close()

    @property
    def io_stats(self) -> dict[str, int]:
        """Remote I/O counters of this process (cache counters included when caching)."""
        out = dict(self._io)
        if self.cache is not None:
            out.update({f"cache_{k}": v for k, v in self.cache.stats.items()})
        return out

    # ------------------------------------------------------------ the contract
    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_shards(self) -> int:
        return self.index.num_shards

    @property
    def schema(self) -> dict[str, str]:
        """Record key -> type description (e.g. ``uint8[64,64,3]``, ``int``, ``str``)."""
        if self._schema is None:
            if len(self) == 0:
                self._schema = {}
            else:
                self._schema = {k: describe_value(v) for k, v in self[0].items()}
        return dict(self._schema)

    @property
    def keys(self) -> list[str]:
        """The record keys (column names)."""
        return list(self.schema)

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, row = self.index.locate_one(index)
        return self._read_decode(shard, [row], [index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Read a batch: each shard is read once, records come back in request order."""
        idx = self.index.check(indices)
        if len(idx) == 0:
            return []
        shards, rows = self.index.locate(idx)
        out: list[Any] = [None] * len(idx)
        groups = group_by_shard(shards, rows)
        parallel = self._remote and self.io_threads > 1 and len(groups) > 1
        opened: dict[int, ArrayRecordFile] = {}
        if parallel and self.cache is not None:
            # Download the shards missing from the cache concurrently; then every read
            # is local, and local reads are fastest in this thread. The readers opened
            # here serve this batch even if a concurrent download evicts their file
            # meanwhile (eviction only unlinks), so no shard is fetched twice per batch.
            missing = [g[0] for g in groups if not self._is_cached(g[0])]
            if missing:
                # Open the cached ones first, before the downloads can evict them.
                opened = {g[0]: self._file(g[0]) for g in groups if g[0] not in missing}
                opened.update(zip(missing, self._thread_pool().map(self._file, missing)))
            parallel = False
        if parallel:
            # Remote shards: one request per shard, all in flight at once so that
            # their latencies overlap (tf.data's parallel interleave).
            results = self._thread_pool().map(
                lambda g: self._read_decode(g[0], g[1], idx[g[2]].tolist()), groups
            )
        else:
            results = (
                self._read_decode(g[0], g[1], idx[g[2]].tolist(), opened.get(g[0])) for g in groups
            )
        for (_shard, _rows, positions), records in zip(groups, results):
            for p, rec in zip(positions.tolist(), records):
                out[p] = rec
        if opened:
            self._close_evicted()
        return out

    def block_offsets(self) -> np.ndarray:
        """Global record offsets of ArrayRecord chunks (for :class:`BlockShuffleSampler`).

        Starts at 0 and ends at ``len(self)``; reads every shard's footer.
        """
        parts = [np.zeros(1, dtype=np.int64)]
        for shard in range(self.num_shards):
            offs = self._file(shard).record_offsets
            parts.append(offs[1:] + self.index.offsets[shard])
        return np.concatenate(parts)

    def close(self) -> None:
        """Close any open readers of this process (they reopen on next use)."""
        self._check_fork()
        for f in self._files:
            if f is not None:
                f.close()
        with self._lock:
            cached = [e[2] for e in self._cached_open.values()]
            self._cached_open.clear()
        for f in cached:
            f.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ---------------------------------------------------------------- helpers
    def _thread_pool(self) -> ThreadPoolExecutor:
        self._check_fork()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="torchgrain-io")
            return self._pool

    def _read(
        self,
        shard: int,
        rows: Sequence[int] | np.ndarray,
        index: int,
        reader: ArrayRecordFile | None = None,
    ) -> list[bytes]:
        """Raw records of one shard (one call); remote range reads are retried."""
        if not self._remote or self.cache is not None:
            # Local files, or local copies (downloads retry inside the cache).
            return (reader or self._file(shard)).read(rows)
        with self._lock:
            self._io["remote_reads"] += 1
        return retry_call(
            lambda: self._file(shard).read(rows),
            url=self.paths[shard],
            policy=self._retry,
            what=f"range read of shard {shard} (record index {index})",
            on_retry=self._count_retry,
        )

    def _read_decode(
        self,
        shard: int,
        rows: Sequence[int] | np.ndarray,
        indices: list[int],
        reader: ArrayRecordFile | None = None,
    ) -> list[dict[str, Any]]:
        """Read rows of one shard (one call) and decode them; errors name file and index."""
        counters = local_counters()
        t0 = time.perf_counter()
        try:
            blobs = self._read(shard, rows, indices[0], reader)
        except CorruptDataError as e:
            raise type(e)(
                f"{e} (shard {shard} of {self.num_shards}, reading record index {indices[0]})"
            ) from e
        t1 = time.perf_counter()
        counters[COUNTER["bytes_read"]] += sum(len(b) for b in blobs)
        counters[COUNTER["read_seconds"]] += t1 - t0
        decode = self.codec.decode
        try:
            out = [decode(b) for b in blobs]
        except Exception:
            # Find the culprit (the fast path above does not track positions).
            for b, row, index in zip(blobs, np.asarray(rows).tolist(), indices):
                self._decode_one(b, shard, row, index)
            raise
        counters[COUNTER["decode_seconds"]] += time.perf_counter() - t1
        return out

    def _decode_one(self, data: bytes, shard: int, row: int, index: int) -> dict[str, Any]:
        try:
            return self.codec.decode(data)
        except Exception as e:
            detail = str(e) if isinstance(e, RecordDecodeError) else f"{type(e).__name__}: {e}"
            raise RecordDecodeError(
                f"cannot decode record {index} (shard {shard} {self.paths[shard]!r}, row {row}) "
                f"with codec {getattr(self.codec, 'name', self.codec)!r}: {detail}"
            ) from (None if isinstance(e, RecordDecodeError) else e)

    def _count_retry(self, attempt: int, exc: BaseException) -> None:
        with self._lock:
            self._io["retries"] += 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_files", "_cached_open", "_lock", "_pool", "_io", "_pid"):
            del state[k]  # readers, threads and counters are per process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def __repr__(self) -> str:
        return (
            f"ArrayRecordSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"codec={self.codec.name!r}, keys={self.keys if self._schema else '?'})"
        )
