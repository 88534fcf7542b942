"""Reading remote shards through their local copies in the shard cache (``cache_dir``).

:class:`CachedCopies` is a helper a :class:`~torchgrain.sources.base.ShardedSource` holds
(``src.cached_copies``). With a :class:`~torchgrain.io.shard_cache.ShardCache`, a read of
a remote shard opens the shard's local copy (downloaded, and checked, on first access)
and keeps a few such readers open per process. A reader is closed only once no read uses
it: each read pins the copies it opens (:meth:`CachedCopies.pinned`), and a copy that
leaves the open set (evicted, replaced on disk, or to bound the open readers) is retired,
then closed by its last user. A batch opens its shards' copies ahead, downloading the
missing ones concurrently (:meth:`CachedCopies.prefetch`).

Each open copy is pinned (:class:`~torchgrain.io.changes.Pin`: an inotify watch on its
inode) when it is opened, under its shard lock. A copy written in place (a user, another
job sharing the directory) is let go at its next use and fetched again, which checks it
(its CRC) and downloads it again: also when another process has already deleted it for
that reason (the file is missing, as after an eviction, but its bytes changed: the grace
an evicted copy gets would read them, and its reader would raise
:class:`~torchgrain.io.changes.ChangedWhileOpen`).

A cache whose disk has no room for a download (full, over quota, a file-size limit:
:class:`~torchgrain.CacheDiskFullError`) is not used again by the process
(:attr:`~torchgrain.io.shard_cache.ShardCache.disk_full`): its reads of remote shards go
on by ranges, as without a cache, and it warns once per cache directory.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from typing import Any, Protocol, TypeVar

import fsspec

from torchgrain.errors import CacheDiskFullError, warn_once
from torchgrain.io import changes, process
from torchgrain.io.shard_cache import ShardCache, Verifier, file_identity

__all__ = ["CachedCopies", "CopyState", "OpenCopies"]

T = TypeVar("T")

# Readers of cached local copies kept open per process. Eviction only unlinks files, so
# an open reader pins an evicted copy's disk blocks: keep few of them open.
_MAX_OPEN_CACHED = 32
# How long a process keeps reading an evicted copy it has open (it holds the file's
# disk blocks beyond the cache's budget meanwhile) before fetching it again.
_EVICTED_GRACE_SECONDS = 1.0
# How often an open copy in use counts as a hit, which refreshes its LRU position (the
# cache's access-time clock has the same resolution).
_TOUCH_SECONDS = 1.0
# Per thread: ``pins``, the cached copies the running read (CachedCopies.pinned) uses.
_READS = threading.local()


@dataclasses.dataclass(eq=False, slots=True)
class _CachedCopy:
    """An open reader of a shard's local copy, and how many reads are using it.

    A copy leaves the open set when it is evicted or replaced on disk, or to bound the
    open readers; its reader is closed only once no read uses it (``pins == 0``), so a
    thread never has a reader closed under it.
    """

    path: str
    ident: tuple[int, ...]  # of the file the reader opened (see ShardCache.lookup)
    reader: Any
    # The file's inode, watched from before the reader opened it: says whether its
    # bytes changed once the path no longer leads to it (evicted, or deleted by
    # another process because it changed).
    pin: changes.Pin
    lock: Any  # the lock of the process state it belongs to
    pins: int = 0
    retired: bool = False
    evicted_at: float | None = None  # when it was first seen evicted
    touched: float = dataclasses.field(default_factory=time.monotonic)  # its last hit (LRU)


class OpenCopies:
    """One process's open copies: shard -> its open copy (least recently used first),
    and per thread the copies a batch opened ahead (:meth:`CachedCopies.prefetch`),
    guarded by ``lock`` (the lock of the process state that holds them).

    Example:
        >>> import threading
        >>> copies = OpenCopies(threading.Lock())
        >>> with copies.lock:
        ...     copies.close_all()
        []
    """

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.by_shard: OrderedDict[int, _CachedCopy] = OrderedDict()
        self.local = threading.local()  # ``batch``: the copies this thread's batch pinned

    def close_all(self) -> list[Any]:
        """Take every copy out of the open set (call with ``lock`` held); the readers no
        read uses, for the caller to close (the others close when their read ends)."""
        unused = [c.reader for c in self.by_shard.values() if _retire(c)]
        self.by_shard.clear()
        return unused


class CopyState(Protocol):
    """What :class:`CachedCopies` uses of a source's per-process state."""

    copies: OpenCopies  # this process's open copies
    fs: fsspec.AbstractFileSystem  # the source's filesystem, made for this process


@dataclasses.dataclass(eq=False)
class CachedCopies:
    """Reads of a source's remote shards through their local copies in ``cache``: the
    open readers of the copies, and their downloads. ``paths`` are the shards' URLs,
    ``state()`` this process's :class:`CopyState`, ``integrity(shard)`` a shard's
    ``(size, checksum)`` where the dataset records them, ``open_reader(shard, path,
    None)`` a reader of a local copy, ``touch(reader)`` makes it hold its file open (map it),
    ``verify`` checks a download (the cache's
    :data:`~torchgrain.io.shard_cache.Verifier`), and the missing copies of a batch
    download concurrently on ``pool()``, when ``io_threads`` > 1. ``seen(shard)``: the
    ``(size, ETag, Last-Modified)`` the source's opening read of the shard (None: the
    process's pin), the only version its copies and downloads may be of.

    Example:
        >>> copies = CachedCopies(None, [], None, None, None, None, None, None, 1, None)
        >>> copies.in_use(), copies.prefetch([0, 1])
        (False, {})
    """

    cache: ShardCache | None
    paths: Sequence[str]
    state: Callable[[], CopyState]
    integrity: Callable[[int], tuple[int | None, str | None]]
    open_reader: Callable[[int, str, None], Any]
    touch: Callable[[Any], None]
    verify: Verifier
    pool: Callable[[], Executor]
    io_threads: int
    seen: Callable[[int], tuple | None]

    def in_use(self) -> bool:
        """Whether this process reads remote shards through the cache's copies (there is
        a cache, and its disk has had room)."""
        cache = self.cache
        if cache is None:
            return False
        if not cache.disk_full:
            return True
        if cache._full_error is not None:  # (found where no read met it: its directories)
            self._cache_full(cache._full_error)
        return False

    def _cache_full(self, err: CacheDiskFullError) -> None:
        """Go on without the shard cache in this process (its disk has no room: it set
        ``disk_full``); say so once per cache directory and process."""
        assert self.cache is not None
        if err.errno == errno.EAGAIN:  # (a lock held elsewhere: that read only, no word)
            return
        warn_once(
            (process.token(), "cache disk full", self.cache.directory),
            f"torchgrain: {err} Until this process ends, it reads the remote shards "
            "without the shard cache (byte ranges from the store).",
            RuntimeWarning,
        )

    def _open_local_copy(self, shard: int, path: str) -> tuple[Any, changes.Pin]:
        """Open the copy at ``path`` (under its shard lock: the file just checked) and
        pin it first, so that any change after the open is seen."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pin = changes.Pin(fd, path)
        finally:
            os.close(fd)
        reader = self.open_reader(shard, path, None)
        try:
            self.touch(reader)  # opened (mapped) now: a later eviction only unlinks
        except BaseException:
            reader.close()
            raise
        return reader, pin

    def reader(self, shard: int) -> Any | None:
        """A reader of the local copy of remote ``shard`` (fetched on first access),
        open until the read that asked for it (:meth:`pinned`) ends, at least; None once
        the cache's disk has no room (the shard is then read without it)."""
        try:
            return self._cached_copy(shard, getattr(_READS, "pins", None)).reader
        except CacheDiskFullError as e:
            if e.errno == errno.EAGAIN:  # a lock held elsewhere: this read goes by ranges
                return None
            if self.in_use():  # (the cache did not give up: nothing to fall back to)
                raise
            self._cache_full(e)
            return None

    def _cached_copy(self, shard: int, pins: list | None, download: bool = True) -> Any:
        """The open copy of remote ``shard``, pinned into ``pins`` (when given) so that
        it stays open until they are released (``download=False``: None where the cache
        has no copy of it, see :meth:`ShardCache.fetch_open`)."""
        assert self.cache is not None
        state = self.state()
        st = state.copies
        copy = st.by_shard.get(shard)
        if copy is not None and self._still_readable(copy, shard):
            with st.lock:
                if st.by_shard.get(shard) is copy:
                    st.by_shard.move_to_end(shard)
                    _pin(copy, pins)
                    return copy
        size, checksum = self.integrity(shard)
        got = self.cache.fetch_open(
            self.paths[shard],
            lambda p: self._open_local_copy(shard, p),
            filesystem=state.fs,
            size=size,
            checksum=checksum,
            verify=self.verify,
            seen=self.seen(shard),
            download=download,
        )
        if got is None:
            return None
        path, ident, (reader, pin) = got
        copy = _CachedCopy(path, ident, reader, pin, st.lock)
        with st.lock:
            _pin(copy, pins)
            old = st.by_shard.pop(shard, None)
            st.by_shard[shard] = copy
            retired = [old] if old is not None else []
            while len(st.by_shard) > _MAX_OPEN_CACHED:
                retired.append(st.by_shard.popitem(last=False)[1])
            unused = [c.reader for c in retired if _retire(c)]
        for r in unused:
            r.close()
        return copy

    def _still_readable(self, copy: _CachedCopy, shard: int) -> bool:
        """Whether the open reader of ``copy`` still reads the file it checked (one
        stat() per use): the copy on disk is that file, or it was evicted less than a
        grace period ago (only unlinked: the reader keeps the file) and its bytes did not
        change. A copy replaced or rewritten in place is not: it is fetched, and checked,
        again."""
        assert self.cache is not None
        try:
            ident = file_identity(os.stat(copy.path))
        except FileNotFoundError:
            # Unlinked, by an eviction or by another process that found it changed (its
            # check failed): only the pin tells them apart (without a watch, its stat of
            # the missing path says "changed": fetched again, the safe side).
            return _in_grace(copy) and changes.changed(copy.pin) is None
        if ident != copy.ident or changes.changed(copy.pin, polled=True) is not None:
            return False
        now = time.monotonic()
        if now - copy.touched >= _TOUCH_SECONDS:
            # A hit: refreshes the copy's LRU position, at most once a second.
            size, checksum = self.integrity(shard)
            hit = self.cache.lookup(self.paths[shard], size=size, checksum=checksum)
            if hit != (copy.path, copy.ident):
                return False
            copy.touched = now
        return True

    def pinned(self, fn: Callable[[], T]) -> T:
        """``fn()``, the readers of cached copies it gets staying open until it returns."""
        if getattr(_READS, "pins", None) is not None:  # within a read: that one holds them
            return fn()
        pins: list[_CachedCopy] = []
        _READS.pins = pins
        try:
            try:
                return fn()
            except changes.ChangedWhileOpen:
                # A copy written after its check at this read's start (a change racing
                # the read): let it go and read once more, through the copy fetched (and
                # checked, or downloaded) again.
                if not self._let_go_changed(pins):
                    raise
            return fn()
        finally:
            _READS.pins = None
            if pins:
                _unpin(pins)

    def _let_go_changed(self, pins: list[_CachedCopy]) -> bool:
        """Take the copies of ``pins`` whose file changed out of the open set (their
        readers close once no read uses them); whether there were any."""
        changed = {id(c) for c in pins if changes.changed(c.pin) is not None}
        if not changed:
            return False
        st = self.state().copies
        with st.lock:
            for shard, copy in list(st.by_shard.items()):
                if id(copy) in changed:
                    del st.by_shard[shard]
                    _retire(copy)  # (pinned by this read: closed when it ends)
        return True

    def close_evicted(self) -> None:
        """End a batch that :meth:`prefetch` opened: release its readers, and
        retire those whose cached copy was evicted or replaced (they pin its disk
        blocks; they close once no other read uses them)."""
        assert self.cache is not None
        st = self.state().copies
        _release_batch(st)
        with st.lock:
            copies = list(st.by_shard.items())
        gone = []
        for shard, copy in copies:
            ident = self.cache.identity(copy.path)
            if ident != copy.ident and (
                ident is not None or not _in_grace(copy) or changes.changed(copy.pin)
            ):
                gone.append((shard, copy))
        with st.lock:
            unused = []
            for shard, copy in gone:
                if st.by_shard.get(shard) is copy:
                    del st.by_shard[shard]
                    if _retire(copy):
                        unused.append(copy.reader)
        for r in unused:
            r.close()

    def prefetch(self, shards: Sequence[int]) -> dict[int, Any]:
        """With a shard cache: open the batch's shards concurrently, the cached copies
        first, then the missing ones downloaded ({} where none was missing: the batch's
        reads find the copies open). Readers opened here serve the batch even if a
        concurrent download evicts their copy meanwhile (eviction only unlinks): no shard
        is fetched twice per batch. They stay open until :meth:`close_evicted` ends the
        batch (or this thread's next batch begins)."""
        if self.cache is None:
            return {}
        st = self.state().copies
        _release_batch(st)  # a batch that raised before its end
        if self.io_threads <= 1 or len(shards) <= 1 or not self.in_use():
            return {}
        with st.lock:
            closed = [s for s in shards if s not in st.by_shard]
        batch: list[_CachedCopy] = []
        st.local.batch = batch

        def get(shard: int, download: bool = True) -> Any:
            copy = self._cached_copy(shard, batch, download)
            return copy.reader if copy is not None else None

        # Open the cached ones first, before the downloads can evict them (each checked
        # once: the reads then find them open).
        found = self._each(lambda s: get(s, False), closed)
        missing = [s for s in closed if found is not None and found[s] is None]
        if missing:
            assert found is not None
            opened = {s: get(s) for s in shards if s not in closed}
            opened |= {s: r for s, r in found.items() if r is not None}
            downloaded = self._each(get, missing)
            if downloaded is not None:
                return opened | downloaded
        # Every copy open already, or no room for one: the batch's reads open them.
        _release_batch(st)
        return {}

    def _each(self, get: Callable[[int], Any], shards: Sequence[int]) -> dict[int, Any] | None:
        """``get(shard)`` of each of ``shards``, concurrently on ``pool()``, all of them
        waited for (none pins a copy after this returns, nor after it raises the first
        error); None once the cache's disk has no room (it said so: the shards are then
        read by ranges)."""
        got = {s: self.pool().submit(get, s) for s in shards}
        wait(got.values())
        full = [e for f in got.values() if isinstance(e := f.exception(), CacheDiskFullError)]
        for e in full:
            self._cache_full(e)
        # (any other error raised, the first shard's first)
        out = {s: f.result() for s, f in got.items() if f.exception() not in full}
        return None if full else out

    def fetch(self, shard: int, nbytes: Callable[[int], int]) -> bool:
        """Put a local copy of remote ``shard`` (of ``nbytes(shard)`` bytes) in the cache;
        whether it was downloaded now (False: already there, or no cache in use)."""
        if not self.in_use():
            return False
        assert self.cache is not None
        size, checksum = self.integrity(shard)
        url, fs, seen = self.paths[shard], self.state().fs, self.seen(shard)
        if self.cache.holds(url, filesystem=fs, size=size, checksum=checksum, seen=seen):
            return False
        try:
            self.cache.fetch(
                url,
                filesystem=fs,
                size=nbytes(shard),
                checksum=checksum,
                verify=self.verify,
                seen=seen,
            )
        except CacheDiskFullError as e:
            self._cache_full(e)
            return False
        return True


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


def _release_batch(st: OpenCopies) -> None:
    """Release the readers this thread's batch opened ahead (see CachedCopies.prefetch)."""
    batch = getattr(st.local, "batch", None)
    if batch is not None:
        st.local.batch = None
        _unpin(batch)
