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

This module holds its set-up, per-process state, readers and I/O; three helpers it holds,
each given what it uses when made, do the rest: ``src.ranges``
(:mod:`~torchgrain.sources.fetch_ahead`: a remote batch's byte ranges fetched at once),
``src.cached_copies`` (:mod:`~torchgrain.sources.cached_copies`: reads through the shard
cache's local copies) and ``src.cache_fit`` (:mod:`~torchgrain.sources.cache_fit`: the
shards' sizes, whether a pass fits the caches).
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import fsspec
import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.errors import warn_empty
from torchgrain.formats.codecs import describe_value
from torchgrain.io import process, remote
from torchgrain.io.fs import ShardPaths, filesystem_for_this_process, is_local
from torchgrain.io.readahead import RangeReadAhead, ShardReadAhead
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources.block_cache import BlockCache, CacheBlocks, CacheFit, CacheInfo
from torchgrain.sources.cache_fit import CacheFitting
from torchgrain.sources.cached_copies import CachedCopies, OpenCopies
from torchgrain.sources.fetch_ahead import BatchRanges, Files, Groups, count_io, take_early
from torchgrain.sources.index import ShardIndex, in_request_order
from torchgrain.sources.options import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_DIR_BYTES, ReadOptions

__all__ = [
    "DEFAULT_CACHE_DIR_BYTES",
    "RecordBytesSource",
    "ShardedSource",
    "Source",
    "decode_in_order",
    "first_record_schema",
]

T = TypeVar("T")

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
        return np.unique(np.concatenate(([0], np.cumsum(self.shard_counts, dtype=np.int64))))

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
        start, stop = shard_rows(counts, shard, start, stop)
        base = int(counts[:shard].sum())
        yield from iter_in_blocks(self, base + start, base + stop)

    def record_settings(self) -> tuple:
        """What decides its records besides its files, keys and schema: the settings under
        which the same files give other values (:class:`~torchgrain.ParquetSource`'s
        ``partitioning``), part of what identifies its records to the indexes shared on
        disk (a filter's selection, token windows). Empty by default.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": 1}], d)
            >>> tg.ArrayRecordSource(d).record_settings()
            ()
        """
        return ()

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

    def __init__(self, cache_bytes: int, fs: fsspec.AbstractFileSystem) -> None:
        self.token = process.token()
        self.lock = threading.Lock()
        self.fs = fs  # the source's filesystem, made for this process
        # shard -> reader of the shard itself (local file or remote URL)
        self.readers: OrderedDict[int, Any] = OrderedDict()
        self.copies = OpenCopies(self.lock)  # the open local copies (with a shard cache)
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
        sizes: Mapping[int, int] | None = None,
    ) -> None:
        """Set up the shards: ``options`` says how they are read; ``cache_bytes`` and
        ``max_open_files`` are the values the format resolved from them (None and
        ``"auto"``: from ``options``, then the defaults); ``sizes``: the shards' sizes in
        bytes that the opening found (shard -> bytes; the rest are asked when needed)."""
        self.options = opts = ReadOptions.build(options)
        if cache_bytes is None:
            cache_bytes = opts.cache_bytes_or(DEFAULT_CACHE_BYTES)
        if max_open_files in ("auto", ...):
            max_open_files = opts.max_open_files
        if max_open_files in ("auto", ...):
            max_open_files = self.default_max_open_files
        self.max_inflight = opts.max_inflight
        self.multi_range = opts.multi_range
        self._fs = filesystem
        self._fs_token = process.token()  # the process ``_fs`` belongs to
        self._remote = not is_local(filesystem)
        self._paths = paths if isinstance(paths, ShardPaths) else list(paths)
        self.index = ShardIndex(counts)
        if not len(self.index):
            more = f" and {len(self._paths) - 1} more files" if len(self._paths) > 1 else ""
            first = repr(self._paths[0]) if len(self._paths) else "with no shard files"
            warn_empty(f"{type(self).__name__} {first}{more}")
        self.cache_bytes = cache_bytes
        self.io_threads = opts.io_threads
        self.max_open_files = max_open_files
        self._retry = opts.retry or RetryPolicy()
        self.cache: ShardCache | None = None
        if self._remote and opts.cache_dir is not None:
            self.cache = (
                opts.cache_dir
                if isinstance(opts.cache_dir, ShardCache)
                else ShardCache(opts.cache_dir, max_bytes=opts.cache_dir_bytes, retry=self._retry)
            )
        read_ahead_bytes = opts.read_ahead_bytes
        if read_ahead_bytes is None:
            read_ahead_bytes = self.cache.max_bytes // 2 if self.cache is not None else 0
        self.read_ahead_bytes = int(read_ahead_bytes)
        self._state: _ProcessState | None = None
        self._make_helpers(sizes)
        # The versions of the remote files this opening pinned: its pickle carries them,
        # not those a later opening in this process pins of a file replaced since.
        self._held = remote.held_pins(self._fs, self._paths)

    def _make_helpers(self, sizes: Mapping[int, int] | None) -> None:
        """Make the helpers (:attr:`cached_copies`, :attr:`cache_fit`, :attr:`ranges`)
        from this source's fields (``sizes``: the shards' sizes known so far): at set-up,
        and for a copy or an unpickled source, whose helpers are its own, never the
        original's (bound to its per-process state: lock, pool, counters, open copies)."""
        self.cached_copies = CachedCopies(
            self.cache,
            self._paths,
            self._proc,
            self.shard_integrity,
            self._open_reader,
            self._touch,
            self._verify_copy,
            self._pool,
            self.io_threads,
            self._held_version,
        )
        self.cache_fit = CacheFitting(type(self).__name__, self._paths, sizes)
        self.ranges = BatchRanges(
            self._batch_ranges, self._proc, self._reads_remote, self.options, self._retry
        )

    # ------------------------------------------------------------------ contract
    def __len__(self) -> int:
        return len(self.index)

    @property
    def keys(self) -> list[str]:
        """The record keys: those of :attr:`schema`."""
        return list(self.schema)

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem its files are read from (with its storage options)."""
        return self._fs

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
            readers = [*st.readers.values(), *st.copies.close_all()]
            st.readers.clear()
            pool, st.pool = st.pool, None
        for r in readers:
            r.close()
        if pool is not None:  # (a read in another thread may still submit to it)
            pool.stop_threads()
        st.blocks.clear()

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
        :mod:`torchgrain.io.readahead`); nothing with ``read_ahead_bytes=0``. Without
        one, the byte ranges of the records ahead are fetched into this process's range
        store (:class:`~torchgrain.io.readahead.RangeReadAhead`). A new call cancels the
        previous walk.

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
        if self._reads_remote():
            # Without a shard cache: the byte ranges of the records ahead of position()
            # are fetched into this process's range store while the loader decodes, where
            # this process reads the batches (no DataLoader workers: the walk starts at
            # this process's first batch read). A new pass cancels the old one's.
            st = self._proc()
            with st.lock:
                ra = st.range_ahead
                if ra is None and order is not None and self.max_inflight > 1:
                    ra = st.range_ahead = RangeReadAhead(self)
            if ra is not None and order is None:
                ra.cancel()
            elif ra is not None:
                ra.begin(order, start, count, position)  # (begin cancels the old walk)
            return fits
        if self.cache is None or not self._remote or self.read_ahead_bytes <= 0:
            return fits
        st = self._proc()
        with st.lock:
            if st.read_ahead is None:
                st.read_ahead = ShardReadAhead(self, self.read_ahead_bytes, threads=self.io_threads)
            ra = st.read_ahead
        ra.begin(order, start, count, position)
        return fits

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
        return self.cached_copies.fetch(shard, self.shard_nbytes)

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
        return self.cache_fit.check(self.cache_blocks(), order, start, count)

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
        ask = lambda: remote.file_size(self._fs, self._paths[shard])  # noqa: E731
        return self.cache_fit.nbytes(
            shard, self._fs, self.shard_integrity, lambda: self._io(ask, shard, "size")
        )

    # ------------------------------------------------------------- per process
    def _proc(self) -> _ProcessState:
        """This process's state, created on first use and again after a fork."""
        st = self._state
        if st is None or st.token != process.token():
            token = process.token()
            if getattr(self, "_fs_token", token) != token:
                # Async filesystems (s3fs, http) are bound to the event loop of the
                # process that made them: a forked child needs its own instance.
                self._fs = filesystem_for_this_process(self._fs)
            self._fs_token = token
            new = _ProcessState(self.cache_bytes, self._fs)
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

    def _held_version(self, shard: int) -> tuple | None:
        """``(size, ETag, Last-Modified)`` of remote ``shard`` as this source's opening
        (or its first read) pinned it; None where it pinned nothing."""
        held = self._held[shard] if self._held is not None else None
        return (held.size, held.etag, held.modified) if held is not None else None

    def shard_version(self, shard: int) -> tuple | None:
        """The version of remote ``shard`` this source's opening read, as a tuple that
        tells it from others (what keys a filter's selection): ``(size, ETag,
        Last-Modified)`` as pinned, fields it has none of None; None for a local file or
        one it pinned nothing of.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d)
            >>> tg.ArrayRecordSource(d).shard_version(0) is None  # (a local file)
            True
        """
        return self._held_version(shard)

    def check_unchanged(self, shard: int) -> None:
        """Raise :class:`~torchgrain.CorruptDataError`, naming the shard and its file,
        where local ``shard``'s file is no longer the version this source opened, as far
        as the source keeps what it opened (a remote shard's version is pinned and
        checked by its reads). What a selection computed from the source's reads (which
        may still be of that version: mapped, cached) is checked with before it is keyed
        by the file's version now.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d)
            >>> src = tg.ArrayRecordSource(d)
            >>> src.check_unchanged(0)
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, overwrite=True)
            >>> src.check_unchanged(0)
            Traceback (most recent call last):
            ...
            torchgrain.errors.CorruptDataError: shard 0 ... changed since the dataset was opened ...
        """

    def shard_integrity(self, shard: int) -> tuple[int | None, str | None]:
        """``(size in bytes, checksum)`` of a shard, where the dataset records them (a
        torchgrain manifest does); ``(None, None)`` otherwise."""
        return None, None

    def _batch_ranges(self, groups: Groups) -> Files | None:
        """``(path, url, ranges)`` per shard of a batch's ``(shard, rows, positions)``
        groups: the byte ranges its reads will fetch (see :attr:`ranges`), or None where
        the format cannot plan them (its reads then fetch their own, one shard at a time)."""
        return None

    def _touch(self, reader: Any) -> None:
        """Make ``reader`` (of a cached copy) hold its file open (read its footer, map
        it): a later eviction only unlinks the file."""

    def _verify_copy(self, path: str, checksum: str, *, name: str) -> str | None:
        """Check a downloaded copy against its checksum (the shard cache's
        :data:`~torchgrain.io.shard_cache.Verifier`)."""
        from torchgrain.io.file_hash import verify_file_hash

        return verify_file_hash(path, checksum, name=name)

    def _reader(self, shard: int) -> Any:
        """This process's reader of ``shard`` (opened on first use; LRU-bounded)."""
        st = self._proc()
        if self.cached_copies.in_use():
            reader = self.cached_copies.reader(shard)
            if reader is not None:
                return reader
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

    # --------------------------------------------------------------------- I/O
    def _reads_remote(self) -> bool:
        """Whether reads go over the network (remote shards and no local copies)."""
        return self._remote and not self.cached_copies.in_use()

    def _io(self, fn: Callable[[], T], shard: int, what: str) -> T:
        """Run one read of ``shard``; remote reads are counted and retried. Readers of
        cached copies that ``fn`` gets stay open until it returns."""
        if not self._reads_remote():
            return self.cached_copies.pinned(fn) if self.cache is not None else fn()
        count_io(self._proc(), "remote_reads")
        got = retry_call(
            fn,
            url=self._paths[shard],
            policy=self._retry,
            what=what,
            on_retry=lambda attempt, exc: count_io(self._proc(), "retries"),
        )
        if self._held is not None and self._held[shard] is None:
            # The version its first read found, if the opening pinned none.
            self._held[shard] = remote.held_pins(self._fs, [self._paths[shard]])[0]  # type: ignore[index]
        return got

    def _read_shard_groups(
        self, groups: list[tuple[int, np.ndarray, Any]], n: int, read: Callable[..., list[Any]]
    ) -> list[Any]:
        """``read(group, reader=None)`` once per ``(shard, rows, positions)`` group of a
        batch of ``n`` (:meth:`ShardIndex.split <torchgrain.sources.index.ShardIndex.split>`),
        in request order: remote shards concurrently, the shard cache's downloads
        overlapped (``reader``: the open copy); without a cache, the batch's ranges fetched
        across its shards at once and each group read as soon as its ranges are in."""
        early: dict[int, Any] = {}
        fetched = self.ranges.prefetch(
            groups, read=(lambda k: read(groups[k])) if len(groups) > 1 else None, early=early
        )
        try:
            if len(groups) == 1:
                return read(groups[0])
            opened = self.cached_copies.prefetch([g[0] for g in groups])
            with_copy = lambda g: read(g, opened.get(g[0]))  # noqa: E731
            # Fetched already: reading needs no threads.
            results = (
                [take_early(early, k, with_copy, g) for k, g in enumerate(groups)]
                if fetched
                else self._map(with_copy, groups)
            )
            out = in_request_order(results, groups, n)
            if opened:
                self.cached_copies.close_evicted()
            return out
        finally:
            self.ranges.release(fetched)

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> Iterable[T]:
        """``fn`` over ``items`` (one per shard or block of a batch), in order.

        Remote items run concurrently on this process's ``io_threads`` so their request
        latencies overlap (tf.data's parallel interleave); local ones run here, where
        they are fastest.
        """
        if not (self._reads_remote() and self.io_threads > 1 and len(items) > 1):
            return (fn(x) for x in items)
        return self._pool().map(fn, items)

    def _pool(self) -> process.ForkSafeThreadPool:
        st = self._proc()
        with st.lock:
            if st.pool is None:
                # Its threads are stopped whenever this process forks (io/process.py).
                st.pool = process.ForkSafeThreadPool(self.io_threads, "torchgrain-io")
            return st.pool

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        # Readers, threads, caches and counters are per process, and the helpers are
        # made again for the new source (copy.copy and deepcopy come here too): only the
        # shards' sizes they learnt travel, and the versions of the remote files this
        # source read (a spawned worker has none of its own to refuse a replaced file):
        # those it holds, else this process's now; the source itself is left as it was
        # (it holds the version of its own first read, see _io).
        state = self.__dict__.copy()
        state["_state"] = None
        del state["cached_copies"], state["ranges"], state["_held"]
        state["cache_fit"] = dict(self.cache_fit.sizes)
        held = list(self._held) if self._held is not None else None
        pins = state["_pins"] = remote.pins_of(self._fs, self._paths, held)
        # (those a later opening here replaced: held by the copy, never pinned in its process)
        state["_replaced"] = remote.replaced_pins(self._fs, self._paths, pins)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pins, replaced = state.pop("_pins", None), state.pop("_replaced", None)
        self.__dict__.update(state)
        self._make_helpers(state["cache_fit"])
        # The versions it was pickled with: a file replaced since is refused when read.
        self._held = remote.restore_pins(self._fs, self._paths, pins, replaced)


def shard_rows(counts: np.ndarray, shard: int, start: int, stop: int | None) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``shard`` (of a dataset with ``counts`` records per
    shard) clipped to it, as :meth:`Source.iter_shard` reads them: a negative ``start``
    is 0, ``stop`` at most the shard's count (``None``: all of it).

    Raises:
        IndexError: ``shard`` is not a shard of the dataset.

    Example:
        >>> import numpy as np
        >>> shard_rows(np.array([3, 5]), 1, -2, None), shard_rows(np.array([3, 5]), 0, 1, 9)
        ((0, 5), (1, 3))
        >>> shard_rows(np.array([3, 5]), -1, 0, None)
        Traceback (most recent call last):
        ...
        IndexError: shard -1 out of range [0, 2)
    """
    if not 0 <= shard < len(counts):
        raise IndexError(f"shard {shard} out of range [0, {len(counts)})")
    n = int(counts[shard])
    return max(start, 0), n if stop is None else min(stop, n)


def decode_in_order(
    src: Any, shard: int, start: int, stop: int | None, decode: Callable[..., dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """Records ``[start, stop)`` of one shard of ``src``, a :class:`ShardedSource` of
    encoded records (a :class:`RecordBytesSource`), in order: its
    :meth:`~RecordBytesSource.iter_shard_bytes`, each record decoded by
    ``decode(data, shard, row, index)``."""
    start, stop = shard_rows(src.index.counts, shard, start, stop)
    base = int(src.index.offsets[shard])
    for row, data in enumerate(src.iter_shard_bytes(shard, start, stop), start):
        yield decode(data, shard, row, base + row)


def first_record_schema(src: Source) -> dict[str, str]:
    """Key -> type description of ``src``'s first record (``{}`` without records): the
    schema of a format whose records are not read to find it.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": 1, "y": b"ab"}], d)
        >>> first_record_schema(tg.ArrayRecordSource(d))
        {'x': 'int', 'y': 'bytes'}
    """
    nonempty = np.flatnonzero(src.shard_counts)
    first = next(src.iter_shard(int(nonempty[0]), 0, 1), None) if len(nonempty) else None
    return {} if first is None else {k: describe_value(v) for k, v in first.items()}


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
