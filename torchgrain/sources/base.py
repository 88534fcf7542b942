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
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import fsspec
import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.errors import CacheThrashWarning, DatasetNotFoundError, RemoteIOError
from torchgrain.io import process, remote
from torchgrain.io.fs import ShardPaths, filesystem_for_this_process, is_local
from torchgrain.io.ranges import fetch_batch, range_store
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.io.shard_cache import ShardCache, file_identity
from torchgrain.sources.block_cache import (
    BlockCache,
    CacheBlocks,
    CacheFit,
    CacheInfo,
    check_fit,
)
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.options import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_DIR_BYTES, ReadOptions

__all__ = ["DEFAULT_CACHE_DIR_BYTES", "RecordBytesSource", "ShardedSource", "Source"]

T = TypeVar("T")

#: Ranges of a remote batch closer than this are fetched as one request. Small: with
#: many requests in flight, latency is paid once per batch either way, and a larger gap
#: fetches bytes nobody asked for (a 64 KiB gap between 1 KiB records of a global
#: shuffle would fetch ~30x what is delivered).
BATCH_GAP = 4 << 10
# Readers of cached local copies kept open per process. Eviction only unlinks files, so
# an open reader pins an evicted copy's disk blocks: keep few of them open.
_MAX_OPEN_CACHED = 32
# How long a process keeps reading an evicted copy it has open (it holds the file's
# disk blocks beyond the cache's budget meanwhile) before fetching it again.
_EVICTED_GRACE_SECONDS = 1.0
# How often an open copy in use counts as a hit, which refreshes its LRU position (the
# cache's access-time clock has the same resolution).
_TOUCH_SECONDS = 1.0
# Per-process state inherited through fork is kept referenced (never freed) in the
# child: releasing it would write to every inherited page (refcounts, allocator
# metadata) and turn shared copy-on-write pages into private copies.
_INHERITED: list[Any] = []
# Per thread: ``pins``, the cached copies the running read (ShardedSource._pinned) uses.
_READS = threading.local()


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


class _CachedCopy:
    """An open reader of a shard's local copy, and how many reads are using it.

    A copy leaves the open set when it is evicted or replaced on disk, or to bound the
    open readers; its reader is closed only once no read uses it (``pins == 0``), so a
    thread never has a reader closed under it.
    """

    __slots__ = ("evicted_at", "ident", "lock", "path", "pins", "reader", "retired", "touched")

    def __init__(self, path: str, ident: tuple[int, ...], reader: Any, lock: Any) -> None:
        self.lock = lock  # the lock of the process state it belongs to
        self.path = path
        self.ident = ident  # of the file the reader opened (see ShardCache.lookup)
        self.reader = reader
        self.pins = 0
        self.retired = False
        self.evicted_at: float | None = None  # when it was first seen evicted
        self.touched = time.monotonic()  # its last hit in the cache (its LRU position)


class _ProcessState:
    """Readers, threads, caches and counters owned by one process."""

    def __init__(self, cache_bytes: int) -> None:
        self.token = process.token()
        self.lock = threading.Lock()
        # shard -> reader of the shard itself (local file or remote URL)
        self.readers: OrderedDict[int, Any] = OrderedDict()
        # shard -> the open reader of its local copy (with a shard cache)
        self.cached: OrderedDict[int, _CachedCopy] = OrderedDict()
        # per thread: ``batch``, the copies a batch opened ahead (see _prefetch_copies)
        self.local = threading.local()
        self.pool: process.ForkSafeThreadPool | None = None
        self.read_ahead: Any = None
        self.range_ahead: Any = None  # a RangeReadAhead (remote reads, no shard cache)
        self.blocks = BlockCache(cache_bytes)
        self.io = {"remote_reads": 0, "retries": 0}


class ShardedSource(Source):
    """Base of the sources over shard files (ArrayRecord, Parquet, TFRecord).

    Subclasses call :meth:`_init_shards` from their constructor, implement
    :meth:`_open_reader` (a reader of one shard file: an object with ``close()``, safe
    to use from several threads or serialising itself) and read batches with
    :meth:`_reader`, :meth:`_io` and :meth:`_map`. Everything per process lives in
    one state object that is rebuilt, not reused, in a forked child.

    The options every format shares (storage, caches, threads, retries, limits,
    trust) are one :class:`~torchgrain.ReadOptions` value, kept as :attr:`options`; a
    subclass passes the caller's to :meth:`_init_shards` with the values it resolved
    for its format (its default ``cache_bytes``, its ``max_open_files``).
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
        options: ReadOptions | None = None,
        cache_bytes: int | None = None,
        max_open_files: int | str | type[Ellipsis] | None = "auto",
        **keywords: Any,
    ) -> None:
        """Set up the shards: ``options`` (with any :class:`ReadOptions` field given by
        name in ``keywords`` replacing it) says how they are read; ``cache_bytes`` and
        ``max_open_files`` are the values the format resolved from them (None and
        ``"auto"``: from ``options``, then the defaults)."""
        self.options = ReadOptions.build(options, keywords)
        opts = self.options
        if cache_bytes is None:
            cache_bytes = opts.cache_bytes_or(DEFAULT_CACHE_BYTES)
        if max_open_files in ("auto", ...):
            max_open_files = opts.max_open_files
        if max_open_files in ("auto", ...):
            max_open_files = self.default_max_open_files
        cache_dir, cache_dir_bytes = opts.cache_dir, opts.cache_dir_bytes
        read_ahead_bytes, retry = opts.read_ahead_bytes, opts.retry
        io_threads = opts.io_threads
        self.max_inflight = opts.max_inflight
        self._fs = filesystem
        self._fs_token = process.token()  # the process ``_fs`` belongs to
        self._remote = not is_local(filesystem)
        self._paths = paths if isinstance(paths, ShardPaths) else list(paths)
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
        if read_ahead_bytes is None:
            read_ahead_bytes = self.cache.max_bytes // 2 if self.cache is not None else 0
        self.read_ahead_bytes = int(read_ahead_bytes)
        self._sizes: dict[int, int] = {}
        self._state: _ProcessState | None = None
        # (process, cache) pairs already warned of a pass that cannot fit
        self._thrash_warned: set[tuple[Any, str]] = set()

    # ------------------------------------------------------------- read-ahead
    def read_ahead(
        self,
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> list[CacheFit]:
        """Prepare for a sampler's pass: ``order(a, b)`` are the indices at positions
        ``[a, b)``, the pass reads from ``start`` on (``count`` more), ``position()``
        is how far it got. Samplers call this at the start of each pass.

        First, whether the pass fits this source's caches (:meth:`check_cache_fit`):
        one that does not is reported once per source and process with a
        :class:`~torchgrain.CacheThrashWarning`, and every check is returned (the
        :class:`~torchgrain.Dataset` keeps them for :func:`tg.stats <torchgrain.stats>`).

        Then, on remote storage with a shard cache, the shards the pass will read are
        downloaded in the background ahead of ``position()`` (see
        :mod:`torchgrain.io.readahead`); nothing with ``read_ahead_bytes=0``. A new
        call cancels the previous walk.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> src = tg.ArrayRecordSource(d)  # local files: nothing to read ahead
            >>> src.read_ahead(lambda a, b: list(range(a, b)), 0, len(src), lambda: 0)
            []
            >>> src.read_ahead_bytes
            0
        """
        fits = self.check_cache_fit(order, start, count) if order is not None else []
        if self._reads_remote:
            self._range_read_ahead(order, start, count, position)
            return fits
        if self.cache is None or not self._remote or self.read_ahead_bytes <= 0:
            return fits
        from torchgrain.io.readahead import ShardReadAhead

        st = self._proc()
        with st.lock:
            if st.read_ahead is None:
                st.read_ahead = ShardReadAhead(self, self.read_ahead_bytes, threads=self.io_threads)
            ra = st.read_ahead
        ra.begin(order, start, count, position)
        return fits

    def _range_read_ahead(
        self,
        order: Callable[[int, int], np.ndarray] | None,
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> None:
        """Without a shard cache: fetch the byte ranges of the records ahead of
        ``position()`` into this process's range store while the loader decodes (see
        :class:`~torchgrain.io.readahead.RangeReadAhead`), where this process reads the
        batches (no DataLoader workers: the walk starts at this process's first batch
        read). A new pass cancels the old one's."""
        from torchgrain.io.readahead import RangeReadAhead

        st = self._proc()
        with st.lock:
            ra = st.range_ahead
            if ra is None and order is not None and self.max_inflight > 1:
                ra = st.range_ahead = RangeReadAhead(self)
        if ra is None:
            return
        if order is None or count <= start:
            ra.cancel()
            return
        ra.begin(order, start, count, position)  # walked once this process reads a batch

    def _batch_ranges(
        self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]]
    ) -> list[tuple[str, str, list[tuple[int, int]]]] | None:
        """``(path, url, ranges)`` per shard of a batch's ``(shard, rows, positions)``
        groups: the byte ranges its reads will fetch, or None where the format cannot
        plan them (its reads then fetch their own, one shard at a time)."""
        return None

    def _prefetch_ranges(
        self,
        groups: Sequence[tuple[int, np.ndarray, np.ndarray]],
        *,
        owner: object | None = None,
        lenient: bool = False,
    ) -> object | None:
        """Fetch a remote batch's byte ranges (:meth:`_batch_ranges`) across all its
        shards at once, with up to ``max_inflight`` requests in flight, into this
        process's range store, where the batch's reads find them. Returns the owner
        token of what it put (release it with :meth:`_release_ranges`), or None when
        the batch is read shard by shard.

        Transient failures are retried per the source's policy (only the ranges still
        missing are asked again); a batch that outlasts it raises
        :class:`~torchgrain.RemoteIOError` naming the URL. Other failures (a missing or
        truncated shard) are left to the shard's own read, which names the shard and
        the record index. With ``lenient`` (read-ahead), every failure is."""
        if not self._reads_remote or not groups:
            return None
        files = self._batch_ranges(groups)
        if not files:
            return None
        if owner is None:  # a batch read here: the pass's range read-ahead may start
            owner = object()
            ahead = self._proc().range_ahead
            if ahead is not None:
                ahead.kick()
        store = range_store()
        label = files[0][1] if len(files) == 1 else f"{files[0][1]} and {len(files) - 1} more"

        def fetch() -> None:
            with self._proc().lock:
                self._proc().io["remote_reads"] += 1
            fetch_batch(
                self._fs,
                files,
                store=store,
                owner=owner,
                gap=BATCH_GAP,
                # io_threads=1 keeps its meaning: remote reads one at a time.
                max_inflight=self.max_inflight if self.io_threads > 1 else 1,
            )

        try:
            retry_call(
                fetch,
                url=label,
                policy=self._retry,
                what="range read of a batch",
                on_retry=self._count_retry,
            )
        except (RemoteIOError, DatasetNotFoundError, PermissionError):
            # Out of retries, or missing or denied (never asked again): named the URL.
            store.drop(owner)
            if lenient:
                return None
            raise
        except Exception:
            if lenient:
                store.drop(owner)
                return None
            # Corrupt or truncated: the shard's own read meets it again and names the
            # shard and the record index.
        return owner

    @staticmethod
    def _release_ranges(owner: object | None) -> None:
        """Forget what :meth:`_prefetch_ranges` put and the batch did not use."""
        if owner is not None:
            range_store().drop(owner)

    # ------------------------------------------------------------ cache fitting
    def _describe(self) -> str:
        """A short name of the dataset for messages: the class and its first shard."""
        more = f" and {self.num_shards - 1:,} more" if self.num_shards > 1 else ""
        first = repr(self._paths[0]) if self._paths else "no files"
        return f"{type(self).__name__}({first}{more})"

    def cache_blocks(self) -> list[CacheBlocks]:
        """The caches a pass over this source goes through, for :meth:`check_cache_fit`:
        the shard cache (``cache_dir``) for remote shards; formats add their decoded-
        block cache."""
        if self.cache is None or not self._remote:
            return []
        return [
            CacheBlocks(
                cache="shard cache (cache_dir)",
                unit="shard",
                offsets=self.index.offsets,
                nbytes=lambda shards: np.array([self.shard_nbytes(int(s)) for s in shards]),
                capacity=self.cache.max_bytes,
                per_process=False,
                remedies=(
                    "raise cache_dir_bytes above the working set",
                    "use BlockShuffleSampler (a few shards at a time, each read once a pass)",
                    "rewrite the data in fewer, larger passes' worth of shards "
                    "(torchgrain convert)",
                ),
            )
        ]

    def check_cache_fit(
        self, order: Callable[[int, int], np.ndarray], start: int, count: int
    ) -> list[CacheFit]:
        """Whether a pass (``order``, ``start``, ``count`` as in :meth:`read_ahead`) fits
        each of :meth:`cache_blocks`, replaying its start through a simulated cache (see
        :func:`~torchgrain.sources.block_cache.check_fit`). A cache it does not fit gets
        a :class:`~torchgrain.CacheThrashWarning`, once per source, cache and process.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> tg.ArrayRecordSource(d).check_cache_fit(lambda a, b: range(a, b), 0, 4)
            []
        """
        fits = []
        for blocks in self.cache_blocks():
            fit = check_fit(self._describe(), blocks, order, start, count)
            if fit is None:
                continue
            fits.append(fit)
            warned = self._thrash_warned
            if not fit.fits and (process.token(), blocks.cache) not in warned:
                warned.add((process.token(), blocks.cache))
                warnings.warn(CacheThrashWarning(fit.message(), fit), stacklevel=4)
        return fits

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
                size = self._io(
                    lambda: remote.file_size(self._fs, self._paths[shard]), shard, "size"
                )
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
                    fs._strip_protocol(e["name"]): e.get("size")
                    for e in remote.call(fs, "ls", parent, detail=True, what="listing")
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
        ahead = st.range_ahead
        if ahead is not None:  # its fetches would outlive the readers
            ahead.cancel()
            ahead.join(timeout=60)
        with st.lock:
            # Readers of cached copies still in use by a read close when it ends.
            copies = [c.reader for c in st.cached.values() if _retire(c)]
            readers = [*st.readers.values(), *copies]
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
        _, checksum = self.shard_integrity(shard)
        return os.path.exists(self.cache.local_path(self._paths[shard], checksum=checksum))

    def _cached_reader(self, st: _ProcessState, shard: int) -> Any:
        """A reader of the local copy of remote ``shard`` (fetched on first access),
        open until the read that asked for it (:meth:`_io`) ends, at least."""
        return self._cached_copy(st, shard, getattr(_READS, "pins", None)).reader

    def _cached_copy(self, st: _ProcessState, shard: int, pins: list | None) -> _CachedCopy:
        """The open copy of remote ``shard``, pinned into ``pins`` (when given) so that
        it stays open until they are released."""
        assert self.cache is not None
        copy = st.cached.get(shard)
        if copy is not None and self._still_readable(copy, shard):
            with st.lock:
                if st.cached.get(shard) is copy:
                    st.cached.move_to_end(shard)
                    _pin(copy, pins)
                    return copy
        size, checksum = self.shard_integrity(shard)
        path, ident, reader = self.cache.fetch_open(
            self._paths[shard],
            lambda p: self._open_local_copy(shard, p),
            filesystem=self._fs,
            size=size,
            checksum=checksum,
            verify=self._verify_copy,
        )
        copy = _CachedCopy(path, ident, reader, st.lock)
        with st.lock:
            _pin(copy, pins)
            old = st.cached.pop(shard, None)
            st.cached[shard] = copy
            retired = [old] if old is not None else []
            while len(st.cached) > _MAX_OPEN_CACHED:
                retired.append(st.cached.popitem(last=False)[1])
            unused = [c.reader for c in retired if _retire(c)]
        for r in unused:
            r.close()
        return copy

    def _still_readable(self, copy: _CachedCopy, shard: int) -> bool:
        """Whether the open reader of ``copy`` still reads the file it checked (one
        stat() per use): the copy on disk is that file, or it was evicted less than a
        grace period ago (only unlinked: the reader keeps the file). A copy replaced or
        rewritten in place is not: it is fetched, and checked, again."""
        assert self.cache is not None
        try:
            ident = file_identity(os.stat(copy.path))
        except FileNotFoundError:
            return _in_grace(copy)
        if ident != copy.ident:
            return False
        now = time.monotonic()
        if now - copy.touched >= _TOUCH_SECONDS:
            # A hit: refreshes the copy's LRU position, at most once a second.
            size, checksum = self.shard_integrity(shard)
            hit = self.cache.lookup(self._paths[shard], size=size, checksum=checksum)
            if hit != (copy.path, copy.ident):
                return False
            copy.touched = now
        return True

    def _pinned(self, fn: Callable[[], T]) -> T:
        """``fn()``, the readers of cached copies it gets staying open until it returns."""
        if getattr(_READS, "pins", None) is not None:  # within a read: that one holds them
            return fn()
        pins: list[_CachedCopy] = []
        _READS.pins = pins
        try:
            return fn()
        finally:
            _READS.pins = None
            if pins:
                _unpin(pins)

    def _close_evicted_copies(self) -> None:
        """End a batch that :meth:`_prefetch_copies` opened: release its readers, and
        retire those whose cached copy was evicted or replaced (they pin its disk
        blocks; they close once no other read uses them)."""
        assert self.cache is not None
        st = self._proc()
        _release_batch(st)
        with st.lock:
            copies = list(st.cached.items())
        gone = []
        for shard, copy in copies:
            ident = self.cache.identity(copy.path)
            if ident != copy.ident and (ident is not None or not _in_grace(copy)):
                gone.append((shard, copy))
        with st.lock:
            unused = []
            for shard, copy in gone:
                if st.cached.get(shard) is copy:
                    del st.cached[shard]
                    if _retire(copy):
                        unused.append(copy.reader)
        for r in unused:
            r.close()

    # --------------------------------------------------------------------- I/O
    @property
    def _reads_remote(self) -> bool:
        """Whether reads go over the network (remote shards and no local copies)."""
        return self._remote and self.cache is None

    def _io(self, fn: Callable[[], T], shard: int, what: str) -> T:
        """Run one read of ``shard``; remote reads are counted and retried. Readers of
        cached copies that ``fn`` gets stay open until it returns."""
        if not self._reads_remote:
            if self.cache is not None:
                return self._pinned(fn)
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
        per batch. They stay open until :meth:`_close_evicted_copies` ends the batch
        (or this thread's next batch begins)."""
        if self.cache is None:
            return {}
        st = self._proc()
        _release_batch(st)  # a batch that raised before its end
        if self.io_threads <= 1 or len(shards) <= 1:
            return {}
        with st.lock:
            open_now = set(st.cached)
        missing = [s for s in shards if s not in open_now and not self._is_cached(s)]
        if not missing:
            return {}
        batch: list[_CachedCopy] = []
        st.local.batch = batch

        def get(shard: int) -> Any:
            return self._cached_copy(st, shard, batch).reader

        # Open the cached ones first, before the downloads can evict them.
        opened = {s: get(s) for s in shards if s not in missing}
        opened.update(zip(missing, self._pool().map(get, missing)))
        return opened

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = None  # readers, threads, caches and counters are per process
        return state


def _pin(copy: _CachedCopy, pins: list[_CachedCopy] | None) -> None:
    """Count a use of ``copy`` into ``pins`` (call with the state's lock held)."""
    if pins is not None:
        copy.pins += 1
        pins.append(copy)


def _in_grace(copy: _CachedCopy) -> bool:
    """Whether an evicted ``copy`` may still be read (see _EVICTED_GRACE_SECONDS)."""
    now = time.monotonic()
    if copy.evicted_at is None:
        copy.evicted_at = now
    return now - copy.evicted_at < _EVICTED_GRACE_SECONDS


def _retire(copy: _CachedCopy) -> bool:
    """Mark ``copy`` as out of the open set (lock held); whether to close it now."""
    copy.retired = True
    return copy.pins == 0


def _unpin(pins: list[_CachedCopy]) -> None:
    """Release uses counted by :func:`_pin`, closing retired readers no read uses."""
    unused = []
    for copy in pins:
        with copy.lock:
            copy.pins -= 1
            if copy.pins == 0 and copy.retired:
                unused.append(copy.reader)
    for r in unused:
        r.close()


def _release_batch(st: _ProcessState) -> None:
    """Release the readers this thread's batch opened ahead (see _prefetch_copies)."""
    batch = getattr(st.local, "batch", None)
    if batch is not None:
        st.local.batch = None
        _unpin(batch)


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
