"""The Source contract, and what every sharded, file-backed source shares.

:class:`Source` is what a torchgrain source is: a sized, random-access, key-value view
of a dataset. ``tg.Dataset``, the samplers, ``torchgrain inspect``/``convert``/``bench``
and the test suite's conformance checks rely on nothing else.

:class:`ShardedSource` is the machinery of sources over shard files, written once:
per-process readers that survive ``fork`` (and pickles that carry no handles), an LRU of
open readers, a retry policy for remote reads, ``io_threads`` that overlap the latency of
remote shards within a batch, an optional on-disk shard cache (``cache_dir``), an
in-memory cache of decoded blocks (``cache_bytes``) and the ``tg.stats`` counters. A
format adds a reader and the way one batch is read with it.
"""

from __future__ import annotations

import abc
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import fsspec
import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.io import process
from torchgrain.io.fs import filesystem_for_this_process, is_local
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources.block_cache import DEFAULT_CACHE_BYTES, BlockCache, CacheInfo
from torchgrain.sources.index import ShardIndex

__all__ = ["DEFAULT_CACHE_DIR_BYTES", "RecordBytesSource", "ShardedSource", "Source"]

T = TypeVar("T")

#: Default budget of a ``cache_dir`` (local copies of remote shards).
DEFAULT_CACHE_DIR_BYTES = 16 * 2**30
# Readers of cached local copies kept open per process. Eviction only unlinks files, so
# an open reader pins an evicted copy's disk blocks: keep few of them open.
_MAX_OPEN_CACHED = 32
# How long an open reader of a cached copy is trusted without a stat() of the copy
# (the cache's LRU clock has the same 1 s resolution).
_RECHECK_SECONDS = 1.0
# Per-process state inherited through fork is kept referenced (never freed) in the
# child: releasing it would write to every inherited page (refcounts, allocator
# metadata) and turn shared copy-on-write pages into private copies.
_INHERITED: list[Any] = []


class Source(abc.ABC):
    """A sized, random-access, key-value view of a dataset: what every source is.

    Required of a source:

    * ``len(src)`` and ``src.__getitems__(indices) -> list[dict]`` (records in request
      order; a batch should be read with as few I/O and decode calls as the format
      allows: the DataLoader calls it with a whole batch of indices);
    * :attr:`keys` (the record keys) and :attr:`schema` (key -> value type, in the
      vocabulary :func:`torchgrain.formats.codecs.describe_value` speaks: ``int``,
      ``float``, ``bool``, ``str``, ``bytes``, ``null``, ``uint8[64,64,3]`` for numpy
      arrays (``?`` for a dimension that varies), ``datetime64[us]``, ``list[str]``,
      ``map``; ``a|b`` when records differ).

    Provided, and overridden where a format knows better: ``src[i]`` (a one-record
    batch), :attr:`paths` and :attr:`shard_counts` (one shard when there are no
    files), :meth:`block_offsets` (the storage blocks a block-local order should
    follow; one block per shard by default), :attr:`io_stats`, :meth:`cache_info`
    and :meth:`close`. Negative or out-of-range indices raise ``IndexError`` and
    non-integers ``TypeError``; bad data raises :class:`~torchgrain.CorruptDataError`
    naming the file and index. A source is safe to use before forking workers and
    pickles small (no open handles).

    Example:
        >>> import numpy as np, torchgrain as tg
        >>> class Squares(tg.Source):
        ...     def __len__(self):
        ...         return 5
        ...     def __getitems__(self, indices):
        ...         return [{"x": i * i} for i in tg.ShardIndex([5]).check(indices).tolist()]
        ...     keys = property(lambda self: ["x"])
        ...     schema = property(lambda self: {"x": "int"})
        >>> src = Squares()
        >>> src[3], isinstance(src, tg.Source), src.block_offsets().tolist()
        ({'x': 9}, True, [0, 5])
    """

    #: True when the source times its own reads for ``tg.stats`` (else the Dataset does).
    reports_stats: ClassVar[bool] = False

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of records."""

    @abc.abstractmethod
    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The records at ``indices``, in request order."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    @property
    @abc.abstractmethod
    def keys(self) -> list[str]:
        """The record keys."""

    @property
    @abc.abstractmethod
    def schema(self) -> dict[str, str]:
        """Record key -> value type (see the class docstring for the vocabulary)."""

    @property
    def paths(self) -> list[str]:
        """The shard files, in dataset order (empty for a source without files)."""
        return []

    @property
    def shard_counts(self) -> np.ndarray:
        """Records per shard (int64), in dataset order."""
        return np.array([len(self)], dtype=np.int64)

    @property
    def num_shards(self) -> int:
        return len(self.shard_counts)

    def block_offsets(self) -> np.ndarray:
        """Global record offsets of storage blocks (starts at 0, ends at ``len(self)``).

        :class:`~torchgrain.BlockShuffleSampler` keeps reads inside a few blocks at a
        time. One block per shard unless the format has finer ones.
        """
        offsets = np.zeros(self.num_shards + 1, dtype=np.int64)
        np.cumsum(self.shard_counts, out=offsets[1:])
        return np.unique(offsets)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        """The records at ``indices`` as columns (see :mod:`torchgrain.columns`).

        By default built from :meth:`__getitems__`; formats that can build columns
        straight from what they decode (without a Python object per record) override it.
        """
        return ColumnBatch.from_records(self.__getitems__(indices))

    def iter_shard(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of one shard, in order: sequential reading (what
        ``torchgrain convert`` and ``inspect`` use), without a random access per record."""
        counts = self.shard_counts
        if not 0 <= shard < len(counts):
            raise IndexError(f"shard {shard} out of range [0, {len(counts)})")
        base = int(counts[:shard].sum())
        n = int(counts[shard])
        stop = n if stop is None else min(stop, n)
        yield from iter_in_blocks(self, base + max(start, 0), base + stop)

    @property
    def io_stats(self) -> dict[str, int]:
        """This process's I/O counters (remote reads, retries, shard-cache traffic)."""
        return {}

    def cache_info(self) -> CacheInfo | None:
        """This process's decoded-block cache counters, when the source has one."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most sources hold nothing to close
        """Close this process's open readers (they reopen on next use)."""


@runtime_checkable
class RecordBytesSource(Protocol):
    """A source whose records are encoded bytes (ArrayRecord, TFRecord): it also gives the
    bytes, and the codec that decodes them. ``torchgrain convert`` copies them unchanged
    when the output would encode them the same way."""

    codec: Any

    def iter_shard_bytes(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[bytes]:
        """The raw records ``[start, stop)`` of one shard, in order."""
        ...


class _ProcessState:
    """Readers, threads, caches and counters owned by one process."""

    def __init__(self, cache_bytes: int) -> None:
        self.token = process.token()
        self.lock = threading.Lock()
        # shard -> reader of the shard itself (local file or remote URL)
        self.readers: OrderedDict[int, Any] = OrderedDict()
        # shard -> [local copy path, inode, reader, time of the last existence check]
        self.cached: OrderedDict[int, list[Any]] = OrderedDict()
        self.pool: process.ForkSafeThreadPool | None = None
        self.read_ahead: Any = None
        self.blocks = BlockCache(cache_bytes)
        self.io = {"remote_reads": 0, "retries": 0}


class ShardedSource(Source):
    """Base of the sources over shard files (ArrayRecord, Parquet, TFRecord).

    Subclasses call :meth:`_init_shards` from their constructor, implement
    :meth:`_open_reader` (a reader of one shard file: an object with ``close()``, safe
    to use from several threads or serialising itself) and read batches with
    :meth:`_reader`, :meth:`_io` and :meth:`_map`. Everything per process lives in
    one state object that is rebuilt, not reused, in a forked child.

    Common arguments (the same meaning for every format):

    * ``storage_options`` / ``filesystem``: fsspec options or a ready filesystem for
      remote paths (``s3://``, ``gs://``, ``http(s)://``, ...);
    * ``cache_bytes``: this process's in-memory cache of decoded blocks (Parquet row
      groups, ArrayRecord chunks), in bytes; ``0`` disables it;
    * ``cache_dir`` / ``cache_dir_bytes``: a local directory (or a
      :class:`~torchgrain.io.shard_cache.ShardCache`) for whole copies of *remote*
      shards, and its byte budget; local shards are never copied;
    * ``io_threads``: threads per process that read the remote shards of one batch
      concurrently (1 = sequential; local shards are read in the calling thread);
    * ``retry``: a :class:`~torchgrain.io.retry.RetryPolicy` for remote reads and
      downloads;
    * ``max_open_files``: readers kept open per process (least recently used closed
      first; ``None``: no limit).
    """

    reports_stats: ClassVar[bool] = True
    #: Readers kept open per process unless the user says otherwise.
    default_max_open_files: ClassVar[int | None] = 64

    # ---------------------------------------------------------------- set-up
    def _init_shards(
        self,
        *,
        filesystem: fsspec.AbstractFileSystem,
        paths: Sequence[str],
        counts: Sequence[int] | np.ndarray,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_dir: str | os.PathLike | ShardCache | None = None,
        cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES,
        io_threads: int = 8,
        read_ahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        max_open_files: int | type[Ellipsis] | None = ...,
    ) -> None:
        if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an integer >= 0, got {cache_bytes!r}")
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an integer >= 1, got {io_threads!r}")
        if max_open_files is ...:
            max_open_files = self.default_max_open_files
        if max_open_files is not None and max_open_files < 1:
            raise ValueError(f"max_open_files must be >= 1 or None, got {max_open_files!r}")
        self._fs = filesystem
        self._fs_token = process.token()  # the process ``_fs`` belongs to
        self._remote = not is_local(filesystem)
        self._paths = list(paths)
        self.index = ShardIndex(counts)
        self.cache_bytes = cache_bytes
        self.io_threads = io_threads
        self.max_open_files = max_open_files
        self._retry = retry or RetryPolicy()
        self.cache: ShardCache | None = None
        if self._remote and cache_dir is not None:
            self.cache = (
                cache_dir
                if isinstance(cache_dir, ShardCache)
                else ShardCache(cache_dir, max_bytes=cache_dir_bytes, retry=self._retry)
            )
        if read_ahead_bytes is not None and read_ahead_bytes < 0:
            raise ValueError(f"read_ahead_bytes must be >= 0, got {read_ahead_bytes!r}")
        if read_ahead_bytes is None:
            read_ahead_bytes = self.cache.max_bytes // 2 if self.cache is not None else 0
        self.read_ahead_bytes = int(read_ahead_bytes)
        self._sizes: dict[int, int] = {}
        self._state: _ProcessState | None = None

    # ------------------------------------------------------------- read-ahead
    def read_ahead(
        self,
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> None:
        """Download, in the background, the shards that ``order`` (a sampler's pass:
        ``order(a, b)`` are the indices at positions ``[a, b)``) will read from
        ``start`` on, ahead of ``position()``, into the shard cache (see
        :mod:`torchgrain.io.readahead`). Does nothing without a shard cache on remote
        storage or with ``read_ahead_bytes=0``; a new call cancels the previous walk.
        Samplers call this at the start of each pass.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> src = tg.ArrayRecordSource(d)  # local files: nothing to read ahead
            >>> src.read_ahead(lambda a, b: list(range(a, b)), 0, len(src), lambda: 0)
            >>> src.read_ahead_bytes
            0
        """
        if self.cache is None or not self._remote or self.read_ahead_bytes <= 0:
            return
        from torchgrain.io.readahead import ShardReadAhead

        st = self._proc()
        with st.lock:
            if st.read_ahead is None:
                st.read_ahead = ShardReadAhead(self, self.read_ahead_bytes, threads=self.io_threads)
            ra = st.read_ahead
        ra.begin(order, start, count, position)

    def shard_nbytes(self, shard: int) -> int:
        """Size of a shard file in bytes (from the dataset's records, else from one
        listing of the shards' directories, else asked for this shard).

        Example:
            >>> import os, tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> src = tg.ArrayRecordSource(d)
            >>> src.shard_nbytes(0) == os.path.getsize(src.paths[0])
            True
        """
        size = self._sizes.get(shard)
        if size is None:
            size = self.shard_integrity(shard)[0]
            if size is None and not self._sizes:
                self._sizes.update(self._listed_sizes())
                size = self._sizes.get(shard)
            if size is None:
                size = int(self._io(lambda: self._fs.size(self._paths[shard]), shard, "size"))
            self._sizes[shard] = size
        return size

    def _listed_sizes(self) -> dict[int, int]:
        """Sizes of the shards from listings of their directories (one request each)."""
        fs = self._fs
        where: dict[str, list[int]] = {}
        for k, path in enumerate(self._paths):
            where.setdefault(fs._parent(path), []).append(k)
        if len(where) > 16:
            return {}
        out = {}
        for parent, shards in where.items():
            try:
                listing = {
                    fs._strip_protocol(e["name"]): e.get("size") for e in fs.ls(parent, detail=True)
                }
            except Exception:  # a store that cannot list: sizes are asked one by one
                continue
            for k in shards:
                size = listing.get(fs._strip_protocol(self._paths[k]))
                if isinstance(size, int) and size >= 0:
                    out[k] = size
        return out

    def prefetch_shard(self, shard: int) -> bool:
        """Put a local copy of remote ``shard`` in the shard cache; whether it was
        downloaded now (False: already there, or no shard cache).

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> tg.ArrayRecordSource(d).prefetch_shard(0)  # no shard cache: nothing to do
            False
        """
        if self.cache is None or self._is_cached(shard):
            return False
        _, checksum = self.shard_integrity(shard)
        self.cache.fetch(
            self._paths[shard],
            filesystem=self._fs,
            size=self.shard_nbytes(shard),
            checksum=checksum,
            verify=self._verify_copy,
        )
        return True

    # ------------------------------------------------------------------ contract
    def __len__(self) -> int:
        return len(self.index)

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    @property
    def shard_counts(self) -> np.ndarray:
        return self.index.counts

    @property
    def num_shards(self) -> int:
        return self.index.num_shards

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of remote reads and downloads."""
        return self._retry

    @property
    def io_stats(self) -> dict[str, int]:
        out = dict(self._proc().io)
        if self.cache is not None:
            out.update({f"cache_{k}": v for k, v in self.cache.stats.items()})
        return out

    def cache_info(self) -> CacheInfo:
        """This process's decoded-block cache counters (a miss is one block decode)."""
        return self._proc().blocks.cache_info()

    def close(self) -> None:
        st = self._state
        if st is None or st.token != process.token():
            return
        with st.lock:
            readers = [*st.readers.values(), *(e[2] for e in st.cached.values())]
            st.readers.clear()
            st.cached.clear()
            pool, st.pool = st.pool, None
        for r in readers:
            r.close()
        if pool is not None:
            pool.shutdown(wait=False)
        st.blocks.clear()

    # ------------------------------------------------------------- per process
    def _proc(self) -> _ProcessState:
        """This process's state, created on first use and again after a fork."""
        st = self._state
        if st is None or st.token != process.token():
            new = _ProcessState(self.cache_bytes)
            if st is not None:
                _INHERITED.append(st)
                if not self._remote:
                    # What the parent's local readers learnt (a parsed index) carries
                    # over: the child reopens the file but parses nothing again, and
                    # the index's pages stay shared with the parent.
                    for shard, reader in list(st.readers.items()):
                        child = self._reader_for_child(reader)
                        if child is not None:
                            new.readers[shard] = child
            token = process.token()
            if getattr(self, "_fs_token", token) != token:
                # Async filesystems (s3fs, http) are bound to the event loop of the
                # process that made them: a forked child needs its own instance.
                self._fs = filesystem_for_this_process(self._fs)
            self._fs_token = token
            st = self._state = new
        return st

    def _reader_for_child(self, reader: Any) -> Any | None:
        """A reader for a forked child made from the parent's ``reader`` of a local
        shard (sharing what it parsed but no handle, lock or thread), or None to open
        the shard afresh."""
        return None

    @property
    def _blocks(self) -> BlockCache:
        return self._proc().blocks

    # ------------------------------------------------------------------ readers
    @abc.abstractmethod
    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> Any:
        """Open a reader of ``shard`` at ``path`` (``filesystem`` is None for a local path).

        Raise :class:`~torchgrain.DatasetNotFoundError` for a missing file and
        :class:`~torchgrain.CorruptDataError` for one that is not of this format; both
        naming the shard and the file.
        """

    def shard_integrity(self, shard: int) -> tuple[int | None, str | None]:
        """``(size in bytes, checksum)`` of a shard, where the dataset records them (a
        torchgrain manifest does); ``(None, None)`` otherwise."""
        return None, None

    def _verify_copy(self, path: str, checksum: str, *, name: str) -> None:
        """Check a downloaded copy against its checksum (the shard cache's hook)."""
        from torchgrain.io.file_hash import verify_file_hash

        verify_file_hash(path, checksum, name=name)

    def _reader(self, shard: int) -> Any:
        """This process's reader of ``shard`` (opened on first use; LRU-bounded)."""
        st = self._proc()
        if self.cache is not None:
            return self._cached_reader(st, shard)
        with st.lock:
            reader = st.readers.get(shard)
            if reader is not None:
                st.readers.move_to_end(shard)
                return reader
        reader = self._open_reader(shard, self._paths[shard], self._fs if self._remote else None)
        evicted = []
        with st.lock:
            other = st.readers.get(shard)
            if other is not None:  # another thread opened it meanwhile: use that one
                evicted.append(reader)
                reader = other
            else:
                st.readers[shard] = reader
                limit = self.max_open_files
                while limit is not None and len(st.readers) > limit:
                    evicted.append(st.readers.popitem(last=False)[1])
        for old in evicted:  # outside the lock: a reader may wait for a read in progress
            old.close()
        return reader

    def _open_local_copy(self, shard: int, path: str) -> Any:
        reader = self._open_reader(shard, path, None)
        try:
            self._touch(reader)  # opened (mapped) now: a later eviction only unlinks
        except BaseException:
            reader.close()
            raise
        return reader

    def _touch(self, reader: Any) -> None:
        """Make ``reader`` hold its file open (read its footer, map it)."""

    def _is_cached(self, shard: int) -> bool:
        assert self.cache is not None
        entry = self._proc().cached.get(shard)
        if entry is not None and time.monotonic() - entry[3] < _RECHECK_SECONDS:
            return True
        _, checksum = self.shard_integrity(shard)
        return os.path.exists(self.cache.local_path(self._paths[shard], checksum=checksum))

    def _cached_reader(self, st: _ProcessState, shard: int) -> Any:
        """A reader of the local copy of remote ``shard`` (fetched on first access)."""
        assert self.cache is not None
        now = time.monotonic()
        with st.lock:
            entry = st.cached.get(shard)
            if entry is not None and now - entry[3] < _RECHECK_SECONDS:
                # Checked a moment ago: skip the stat() (the hot path of warm epochs).
                # Were the copy evicted since, the open reader still reads it.
                return entry[2]
        url = self._paths[shard]
        size, checksum = self.shard_integrity(shard)
        # A hit refreshes the copy's access time (its LRU position).
        hit = self.cache.lookup(url, size=size, checksum=checksum)
        reader = None
        if hit is not None:
            with st.lock:
                entry = st.cached.get(shard)
                if entry is not None and (entry[0], entry[1]) == hit:
                    entry[3] = now
                    st.cached.move_to_end(shard)
                    return entry[2]
            try:
                reader = self._open_local_copy(shard, hit[0])
            except FileNotFoundError:
                reader = None  # evicted just now: fetch it again below
        if reader is None:
            path, ino, reader = self.cache.fetch_open(
                url,
                lambda p: self._open_local_copy(shard, p),
                filesystem=self._fs,
                size=size,
                checksum=checksum,
                verify=self._verify_copy,
            )
            hit = (path, ino)
        assert hit is not None
        with st.lock:
            old = st.cached.pop(shard, None)
            st.cached[shard] = [hit[0], hit[1], reader, now]
            evicted = [old[2]] if old is not None else []
            while len(st.cached) > _MAX_OPEN_CACHED:
                evicted.append(st.cached.popitem(last=False)[1][2])
        for r in evicted:
            r.close()
        return reader

    def _close_evicted_copies(self) -> None:
        """Close readers whose cached copy was evicted: they pin its disk blocks."""
        st = self._proc()
        stale = []
        with st.lock:
            for shard, (path, ino, reader, _) in list(st.cached.items()):
                try:
                    if os.stat(path).st_ino == ino:
                        continue
                except FileNotFoundError:
                    pass
                del st.cached[shard]
                stale.append(reader)
        for r in stale:
            r.close()

    # --------------------------------------------------------------------- I/O
    @property
    def _reads_remote(self) -> bool:
        """Whether reads go over the network (remote shards and no local copies)."""
        return self._remote and self.cache is None

    def _io(self, fn: Callable[[], T], shard: int, what: str) -> T:
        """Run one read of ``shard``; remote reads are counted and retried."""
        if not self._reads_remote:
            return fn()
        st = self._proc()
        with st.lock:
            st.io["remote_reads"] += 1
        return retry_call(
            fn,
            url=self._paths[shard],
            policy=self._retry,
            what=what,
            on_retry=self._count_retry,
        )

    def _count_retry(self, attempt: int, exc: BaseException) -> None:
        st = self._proc()
        with st.lock:
            st.io["retries"] += 1

    def _parallel(self, n: int) -> bool:
        """Whether ``n`` shard reads of one batch should overlap on ``io_threads``."""
        return self._reads_remote and self.io_threads > 1 and n > 1

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> Iterable[T]:
        """``fn`` over ``items`` (one per shard or block of a batch), in order.

        Remote items run concurrently on this process's ``io_threads`` so their request
        latencies overlap (tf.data's parallel interleave); local ones run here, where
        they are fastest.
        """
        if not self._parallel(len(items)):
            return (fn(x) for x in items)
        return self._pool().map(fn, items)

    def _pool(self) -> process.ForkSafeThreadPool:
        st = self._proc()
        with st.lock:
            if st.pool is None:
                # Its threads are stopped whenever this process forks (io/process.py).
                st.pool = process.ForkSafeThreadPool(self.io_threads, "torchgrain-io")
            return st.pool

    def _prefetch_copies(self, shards: Sequence[int]) -> dict[int, Any]:
        """With a shard cache: open the batch's shards, downloading the missing ones
        concurrently. Readers opened here serve the batch even if a concurrent download
        evicts their copy meanwhile (eviction only unlinks): no shard is fetched twice
        per batch."""
        if self.cache is None or self.io_threads <= 1 or len(shards) <= 1:
            return {}
        missing = [s for s in shards if not self._is_cached(s)]
        if not missing:
            return {}
        # Open the cached ones first, before the downloads can evict them.
        opened = {s: self._reader(s) for s in shards if s not in missing}
        opened.update(zip(missing, self._pool().map(self._reader, missing)))
        return opened

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = None  # readers, threads, caches and counters are per process
        return state


def iter_in_blocks(
    src: Source, start: int, stop: int, block: int = 1024
) -> Iterator[dict[str, Any]]:
    """Records ``[start, stop)`` of ``src`` in order, read ``block`` at a time.

    Example:
        >>> import torchgrain as tg
        >>> class Ten(tg.Source):
        ...     __len__ = lambda self: 10
        ...     __getitems__ = lambda self, idx: [{"i": int(i)} for i in idx]
        ...     keys = property(lambda self: ["i"])
        ...     schema = property(lambda self: {"i": "int"})
        >>> [r["i"] for r in iter_in_blocks(Ten(), 3, 7, block=2)]
        [3, 4, 5, 6]
    """
    for a in range(start, stop, block):
        yield from src.__getitems__(range(a, min(a + block, stop)))
