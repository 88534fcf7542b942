"""ShardCache: whole remote shards copied to a local directory, shared by every process.

A copy is of one version of its remote file: without a checksum in the manifest, its record
names the version (the ``ETag``, else ``Last-Modified``) that this process pins for the file
(:func:`torchgrain.io.remote.pin`: from the dataset's opening and its answers, else asked once
with one ``info`` request), a copy of another version is a miss (downloaded again where
the store still serves the pinned one; else kept, the newer one's, and the reader refused), and a
download is checked against the pinned version after it arrives (a file changed on the server
is a :class:`~torchgrain.RemoteIOError`, as without the cache). A reader passes the version
its dataset's opening read (``seen``): where a later opening in the process pinned another
one (the file replaced since), its copies and downloads are a RemoteIOError. A store that
names no version is taken to keep the same bytes at a URL (write a changed dataset to a new path).

Each request to object storage pays tens of milliseconds before its first byte; a whole
shard fetched once and read locally pays it once per shard, and not in later epochs. The
directory is a :class:`~torchgrain.io.node_store.NodeStore`; this cache adds keys that hash
the URL (and checksum), a CRC-32 record per copy checked by each process on first use, one
fetch per shard across workers, optional ``eviction="belady"``, and reading by ranges after
a :class:`~torchgrain.CacheDiskFullError`.

Design notes: docs/design-notes.md#io-shard-cache.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec

from torchgrain.caches import announce, size_text
from torchgrain.errors import CacheDiskFullError, CorruptDataError, RemoteIOError
from torchgrain.io import process, remote, responses
from torchgrain.io.atomic import disk_full_error
from torchgrain.io.cache_records import (
    NEXT_FILE,
    SUM_DIR,
    Identity,
    file_crc,
    file_identity,
    read_hints,
    read_record,
    write_hints,
    write_record,
)
from torchgrain.io.eviction import EVICTION_POLICIES, victims
from torchgrain.io.file_hash import verify_file_hash
from torchgrain.io.fs import get_filesystem
from torchgrain.io.node_store import Entry, NodeStore, unlink_quietly
from torchgrain.io.retry import RetryPolicy, retry_call

__all__ = ["Identity", "ShardCache", "ShardTooLargeError", "file_crc", "file_identity"]

T = TypeVar("T")
#: ``verify(path, checksum, name=...)``: raise CorruptDataError when ``path`` does not
#: match; return its ``"crc32:<8 hex digits>"`` when the check read the whole file (the
#: cache then reads it no second time for its record), else None (anything else returned
#: is ignored).
Verifier = Callable[..., "str | None"]
_CRC_TEXT = re.compile(r"crc32:[0-9a-f]{8}")

# Refresh a copy's last use (its record's modification time) at most this often per
# process (seconds): one utime() per shard per second is plenty for LRU order and keeps
# most hits to a single stat() call.
_TOUCH_INTERVAL = 1.0
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_STATS = ("hits", "misses", "waits", "bytes_fetched", "evictions", "bytes_evicted", "retries")
_STATS += ("verified", "bytes_verified", "rejected")
# What a directory that refuses writes answers (read-only, or not this user's; one of its
# own files or folders of the wrong kind, or a link; a lock held elsewhere), and the remedy.
_ELSEWHERE = "pass cache_dir= a directory this process can write to."
_REFUSED = dict.fromkeys((errno.EACCES, errno.EPERM, errno.EROFS), _ELSEWHERE.capitalize())
_REFUSED.update(
    dict.fromkeys(
        (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP),
        "Something of another kind than the cache makes lies on that path (a file for a "
        f"folder, or the reverse, or a link): remove it, or {_ELSEWHERE}",
    )
)
# The longest a read waits for the lock of a shard's copy while no download of it grows
# (another process checks it, or holds it stopped): the retry policy's deadline, at most
# this; the copy is then refused to this read (which goes by ranges), and for _ENTRY_WAIT
# each lock waited for in vain takes one try. A download that grows is waited for.
_ENTRY_WAIT = 30.0
_REFUSED[errno.EAGAIN] = (
    f"Another process holds that lock (stopped, or stuck): end it, or {_ELSEWHERE}"
)


class _ShortDownload(ConnectionError):
    """The transfer ended early (counted as transient: the connection dropped)."""


class ShardTooLargeError(ValueError):
    """A shard larger than the whole budget of the shard cache asked to keep a copy of it
    (a setting to change, not damaged data: readers pass it on as it is).

    Example:
        >>> issubclass(ShardTooLargeError, ValueError)
        True
    """


class ShardCache(NodeStore):
    """A byte-bounded, LRU, multi-process cache of whole remote files on local disk.

    Args:
        directory: local directory for the copies (created if missing), on a local disk
            (the locks are ``flock``).
        max_bytes: budget for the files in the cache, least recently used deleted first; a
            single file larger than the budget is an error.
        retry: retry policy for downloads (default :class:`RetryPolicy()`).
        verify_hits: check a cached copy against the CRC recorded at its download the first
            time each process uses it, and when the file changes (1-4 GB/s of one core);
            ``False`` trusts a copy of the right size (and version).
        eviction: ``"lru"`` (default) or ``"belady"``: the copies whose next use lies
            furthest ahead in the sampler's order, as told by :meth:`advise`.

    Counters of this process are in :attr:`stats`. A full disk raises
    :class:`~torchgrain.CacheDiskFullError` and sets :attr:`disk_full`, as does a
    directory deleted twice during one download (once, it is made again). The object holds no
    open file or lock between calls: it pickles small. Design notes:
    docs/design-notes.md#io-shard-cache.

    Example:
        >>> import tempfile, fsspec
        >>> mem = fsspec.filesystem("memory")
        >>> mem.pipe("/bucket/shard-0", b"x" * 100)
        >>> cache = ShardCache(tempfile.mkdtemp(), max_bytes=150)
        >>> local = cache.fetch("memory://bucket/shard-0")
        >>> open(local, "rb").read() == b"x" * 100
        True
        >>> _ = cache.fetch("memory://bucket/shard-0")
        >>> cache.stats["hits"], cache.stats["misses"], cache.stats["bytes_fetched"]
        (1, 1, 100)
    """

    _WHAT = "the shard cache"
    _DIRS = (SUM_DIR,)
    _OLD_TMP_DIR = ""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int,
        retry: RetryPolicy | None = None,
        verify_hits: bool = True,
        eviction: str = "lru",
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        super().__init__(os.path.abspath(os.fspath(directory)), max_bytes=int(max_bytes))
        self.eviction = eviction
        self.retry = retry or RetryPolicy()
        self.verify_hits = bool(verify_hits)
        self._init_process()

    def _init_process(self) -> None:
        """This process's own state (checks, counters, locks), and the store's folders
        made (or checked: links) where the disk allows (disk_full: sources read without it)."""
        self._stats_lock = threading.Lock()
        self._token = process.token()
        self._paths: dict[tuple[str, str | None], str] = {}
        # copy path -> identity of the file this process checked (or downloaded) there,
        # and the remote version it was checked as (None: any)
        self._verified: dict[str, tuple[Identity, str | None]] = {}
        self._unversioned: set[str] = set()  # remote files whose store names no version
        # copy path -> when this process last refreshed its LRU position (monotonic)
        self._touched: dict[str, float] = {}
        # copy name -> until when its lock, waited for in vain, takes one try (monotonic)
        self._stuck: dict[str, float] = {}
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        with contextlib.suppress(CacheDiskFullError):
            self._make_dirs()

    def __getstate__(self) -> dict[str, Any]:  # (checks, counters and locks are per process)
        keep = ("eviction", "directory", "max_bytes", "min_free_bytes", "retry", "verify_hits")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process()

    def __repr__(self) -> str:
        return f"ShardCache({self.directory!r}, max_bytes={self.max_bytes}, stats={self.stats})"

    # ------------------------------------------------------------------ public
    def local_path(self, url: str, *, checksum: str | None = None) -> str:
        """Where the copy of ``url`` lives (whether or not it is cached now).

        Example:
            >>> c = ShardCache("/tmp/tg-doc-cache", max_bytes=1)
            >>> os.path.basename(c.local_path("s3://b/train/x.array_record")).endswith(
            ...     "-x.array_record")
            True
        """
        path = self._paths.get((url, checksum))
        if path is None:
            name = _SAFE_NAME.sub("_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
            key = hashlib.sha256(url.encode() + (b"\0" + checksum.encode() if checksum else b""))
            path = os.path.join(self.directory, f"{key.hexdigest()[:24]}-{name}")
            self._paths[(url, checksum)] = path
        return path

    def lookup(
        self, url: str, *, size: int | None = None, checksum: str | None = None
    ) -> tuple[str, Identity] | None:
        """``(path, identity)`` of a complete cached copy of ``url`` that this process
        has already checked (a hit), else None; the identity (:func:`file_identity`)
        changes when the file is replaced or written to.

        A hit refreshes the copy's access time (its LRU position) and is counted; a
        miss downloads and checks nothing and is not counted (see :meth:`fetch_open`).

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).lookup("s3://b/x") is None
            True
        """
        path = self.local_path(url, checksum=checksum)
        st = self._hit(path, size)
        if st is None or not self._checked(path, st):
            return None
        self._count(hits=1)
        return path, file_identity(st)

    def holds(
        self,
        url: str,
        *,
        filesystem: fsspec.AbstractFileSystem | None = None,
        size: int | None = None,
        checksum: str | None = None,
        seen: tuple | None = None,
    ) -> bool:
        """Whether :meth:`fetch` would find a copy of ``url`` here, of the version this
        process reads (pinned; asked of the store once where none is), not another one
        downloaded before the file was replaced. Downloads, checks and counts nothing.

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).holds("memory://b/x")
            False
        """
        path = self.local_path(url, checksum=checksum)
        st = _copy_stat(path, size)
        if st is None:
            return False
        fs, rpath = self._remote(url, filesystem)
        version = None if checksum else self._version(fs, rpath, url, seen)
        if self._checked(path, st, version):
            return True
        recorded = read_record(self._sum_path(path), version)
        return recorded is not None and recorded[1] == st.st_size

    def identity(self, path: str) -> Identity | None:
        """The identity of the file at ``path`` now (see :meth:`lookup`), None if missing.

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).identity("/nonexistent") is None
            True
        """
        try:
            return file_identity(os.stat(path))
        except FileNotFoundError:
            return None

    def fetch(
        self,
        url: str,
        *,
        filesystem: fsspec.AbstractFileSystem | None = None,
        size: int | None = None,
        checksum: str | None = None,
        verify: Verifier | None = None,
        seen: tuple | None = None,
    ) -> str:
        """Return the path of a complete local copy of ``url``, downloading it if needed.

        Args:
            url: the remote file (fsspec URL).
            filesystem: the fsspec filesystem that reads ``url`` (default: inferred).
            size: expected size in bytes (e.g. from a manifest); asked from the
                filesystem on a miss when not given. A cached copy of another size is
                discarded and fetched again, as is one that fails its check (see
                ``verify_hits``).
            checksum: the expected checksum, checked before the copy is published.
                Without one, a remote copy is of the version this process reads (see
                the module docstring): a copy of another version is fetched again, unless
                the store serves another version than pinned (a RemoteIOError; the copy kept).
            verify: ``verify(path, checksum, name=...)`` raising
                :class:`~torchgrain.CorruptDataError` on a mismatch (default: a whole-file
                hash, ``blake2b-file:...`` or ``[hashlib algorithm:]hexdigest``; sources
                pass their format's, e.g. ``blake2b-records`` for ArrayRecord). It may
                return the file's ``"crc32:<8 hex digits>"`` (zlib's CRC-32) when it read
                the whole file: the cache then records it instead of reading the file
                again; any other return value is ignored.
            seen: the ``(size, ETag, Last-Modified)`` the reader's dataset opening read
                of ``url`` (default: this process's pin): a copy or download of another
                version (a later opening re-pinned the URL) is a RemoteIOError.

        The copy may be evicted by another process at any time after this returns;
        open it at once, or use :meth:`fetch_open`, which opens it before any eviction
        can touch it.

        Raises:
            DatasetNotFoundError / PermissionError: the object is missing / forbidden.
            RemoteIOError: transient failures outlasted the retry policy, or the file
                changed on the server since this process pinned its version.
            CorruptDataError: the downloaded bytes have the wrong size or checksum.
            ValueError: the file is larger than the whole cache budget.
        """
        got = self.fetch_open(  # (no opener: the path only)
            url, None, filesystem=filesystem, size=size, checksum=checksum, verify=verify, seen=seen
        )  # type: ignore[arg-type]
        return got[0]  # type: ignore[index]

    def fetch_open(
        self,
        url: str,
        opener: Callable[[str], T],
        *,
        filesystem: fsspec.AbstractFileSystem | None = None,
        size: int | None = None,
        checksum: str | None = None,
        verify: Verifier | None = None,
        seen: tuple | None = None,
        download: bool = True,
    ) -> tuple[str, int, T] | None:
        """Like :meth:`fetch`, then ``opener(path)`` while the copy cannot be evicted.

        Returns ``(path, identity, opener(path))``. The copy is checked (see
        ``verify_hits``) and opened under its shard lock, which eviction and downloads
        respect: ``opener`` opens the very file that was checked, and a reader that
        opens (or maps) it keeps it readable for as long as it likes. ``download=False``:
        None where no copy of the right size is here (nothing fetched, no lock taken);
        a copy that fails its check is fetched again, as always.

        Example:
            >>> import tempfile, fsspec
            >>> fsspec.filesystem("memory").pipe("/bucket/s1", b"abc")
            >>> c = ShardCache(tempfile.mkdtemp(), max_bytes=10)
            >>> _, _, f = c.fetch_open("memory://bucket/s1", lambda p: open(p, "rb"))
            >>> f.read(), f.close()
            (b'abc', None)
        """
        path = self.local_path(url, checksum=checksum)
        name = os.path.basename(path)
        fs, rpath = self._remote(url, filesystem)
        # (a checksum checks the bytes themselves: no version needed)
        version = None if checksum else self._version(fs, rpath, url, seen)
        waited = self._hit(path, size) is None  # a hit now waited for another's download
        if waited and not download:
            return None
        # A complete copy is checked and opened under a shared lock (several workers may
        # check one copy at once): downloads and evictions, which need the lock
        # exclusively, cannot replace or unlink it in between.
        failed = None  # the identity of a copy that failed its check
        with self._entry_lock(name, url, shared=True):
            st = self._hit(path, size)
            if st is not None:
                if self._check(path, st, url, version):
                    self._count(hits=1, waits=int(waited))
                    return path, file_identity(st), opener(path) if opener else None
                failed = file_identity(st)
        with self._entry_lock(name, url):
            # Another worker may have fetched (or replaced) it while we waited for the lock.
            st = self._hit(path, size)
            if (
                st is not None
                and file_identity(st) != failed
                and self._check(path, st, url, version)
            ):
                self._count(hits=1, waits=int(waited))
                return path, file_identity(st), opener(path) if opener else None
            if version and self._of_another_version(path, version):
                self._refuse_replaced(fs, rpath, url, seen)  # (else an older copy: fetched again)
            if os.path.lexists(path):  # of the wrong size, failed its check, not a file
                try:
                    self._unlink(path)
                except IsADirectoryError:
                    raise CorruptDataError(
                        f"{path!r}, where {self._WHAT} keeps its copy of {url}, is a "
                        "directory (not made by the cache: remove it)"
                    ) from None
                self._checks().pop(path, None)
                self._count(rejected=1)
            self._remove_temps(name)
            retrying = self._retrying(url)
            if (size is None or size < 0) and version:  # (its lookup pinned the size)
                size = remote.unchanged_since(fs, rpath, None)[0]  # type: ignore[index]
            if size is None or size < 0:
                size = retry_call(remote.file_size, fs, rpath, what="size lookup", **retrying)
            if size > self.max_bytes:
                raise ShardTooLargeError(
                    f"shard {url} is {size} bytes, larger than the cache budget "
                    f"max_bytes={self.max_bytes} of {self.directory}"
                )
            what = f" (the copy of {url}, {size:,} bytes)"
            for again in (True, False):
                tmp = self._reserve(name, size, what)
                try:
                    retry_call(
                        self._download, fs, rpath, tmp, size, url, what="download", **retrying
                    )
                    if version:  # of the version pinned: the file did not change meanwhile
                        retry_call(self._observe, fs, rpath, url, what="version check", **retrying)
                        self._pinned(fs, rpath, url, seen)  # (not re-pinned meanwhile)
                    crc = None
                    if checksum:
                        crc = (verify or verify_file_hash)(tmp, checksum, name=f"downloaded {url}")
                    # What later hits are checked against: the bytes that passed the checks
                    # (a whole-file hash gave their CRC from the same read).
                    if not (isinstance(crc, str) and _CRC_TEXT.fullmatch(crc)):
                        crc, _ = file_crc(tmp)
                    with self._writing(self._sum_path(path), f" (the record of {url})"):
                        write_record(self._sum_path(path), crc, size, version)
                    self._publish(tmp, path, size, what)
                    # After the rename, which moves the change time: the identity it keeps.
                    ident = file_identity(os.stat(path))
                    break
                except BaseException as e:
                    # A temp file gone with its directory: a FileNotFoundError (made a
                    # DatasetNotFoundError by the retries), though the remote is not at fault.
                    lost = isinstance(e, FileNotFoundError) and not os.path.exists(tmp)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                    if not os.path.lexists(path):  # (not published: no record of it either)
                        self._forget(path)
                    if not lost:
                        raise
                # The temp file went missing: the directory was deleted meanwhile (a user
                # cleaning up). Made again, as the decoded cache does, for one more
                # download; deleted again (or not made), the cache gives up as on a full
                # disk, and sources read by ranges.
                if again:
                    with contextlib.suppress(OSError):
                        self._make_dirs()
                        continue
                with self._writing(tmp, what):
                    raise CacheDiskFullError(
                        errno.ENOENT,
                        f"{os.strerror(errno.ENOENT)}: {self._WHAT} in {self.directory!r} "
                        f"lost {tmp!r}{what} while writing it: its directory was deleted, "
                        "and made again it was deleted again (or could not be made).",
                        directory=self.directory,
                        path=tmp,
                    ) from None
            self._checks()[path] = (ident, version)
            self._count(misses=1, bytes_fetched=size)
            announce(
                "the shard cache (local copies of remote shards)",
                self.directory,
                f"{size_text(self.max_bytes)}; cache_dir_bytes= sets it",
            )
            return path, ident, opener(path) if opener else None

    def advise(self, next_use: dict[str, int | None]) -> None:
        """Tell the cache when each URL will be read next (a position in the sampler's
        order; None: not again as far as known), for ``eviction="belady"``. The hints
        are shared by every process of the cache (one small file, replaced atomically);
        hints for other URLs are kept. Nothing is done under ``"lru"``.

        Example:
            >>> import tempfile
            >>> c = ShardCache(tempfile.mkdtemp(), max_bytes=10, eviction="belady")
            >>> c.advise({"s3://b/x": 7, "s3://b/y": None})
            >>> c.next_uses() == {os.path.basename(c.local_path("s3://b/x")): 7}
            True
        """
        if self.eviction != "belady":
            return
        with self._lock("next-use", mark=False):
            hints = self.next_uses()
            for url, use in next_use.items():
                name = os.path.basename(self.local_path(url))
                if use is None:
                    hints.pop(name, None)
                else:
                    hints[name] = int(use)
            hints_path = os.path.join(self.directory, NEXT_FILE)
            # (named, but only a download's failure sets disk_full: the reads that meet it
            # say so, where read-ahead, which calls this, would swallow it)
            with self._writing(hints_path, " (the next-use hints)", mark=False):
                write_hints(hints_path, hints)

    def next_uses(self) -> dict[str, int]:
        """The next-use hints in force: copy name -> position (see :meth:`advise`).
        Malformed lines (the file is the cache's own, but anyone who can write to the
        directory can change it) are ignored: a hint only orders evictions.

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).next_uses()
            {}
        """
        return read_hints(os.path.join(self.directory, NEXT_FILE))

    # ----------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _entry_lock(self, name: str, url: str, shared: bool = False) -> Iterator[None]:
        """Hold the lock of the copy ``name`` of ``url``, waited for at most the retry
        policy's deadline (and :data:`_ENTRY_WAIT`).

        Raises:
            CacheDiskFullError: ``EAGAIN``, another process holds it (named; the cache
                stays in use).
        """
        stuck = self._stuck.get(name, 0.0) > time.monotonic()
        wait = 0.0 if stuck else min(_ENTRY_WAIT, self.retry.deadline)
        seen = None if stuck else self._download_state(name)
        while True:
            with self._lock(name, shared=shared, wait=wait) as held:
                if held:
                    self._stuck.pop(name, None)
                    yield
                    return
            now = None if stuck else self._download_state(name)
            if now == seen:  # (no download under way grew meanwhile)
                break
            seen = now
        self._stuck[name] = time.monotonic() + _ENTRY_WAIT
        lock = self._lock_path(name)
        with self._writing(lock, f" (the lock of the copy of {url})", mark=False):
            raise BlockingIOError(
                errno.EAGAIN,
                f"the lock of the copy of {url} is held by another process (for more than "
                f"{wait:g} s with no download of it growing: stopped, or stuck on its disk)",
                lock,
            )

    def _download_state(self, name: str) -> list[tuple[str, int]]:
        """The temp files of the copy ``name`` and their sizes: one that grows is a
        download under way, which a reader waits for however long it takes."""
        out = []
        for path, of, _ in self._temps():
            if of == name:
                with contextlib.suppress(OSError):
                    out.append((path, os.stat(path).st_size))
        return sorted(out)

    @contextlib.contextmanager
    def _writing(self, path: str, what: str = "", *, mark: bool = True) -> Iterator[None]:
        """:meth:`NodeStore._writing`; a write the directory refuses (a read-only mount,
        another user's directory) makes the cache as unusable as a full disk does: the
        same :class:`~torchgrain.CacheDiskFullError` (with its ``errno``), and sources
        read without the cache."""
        try:
            with super()._writing(path, what, mark=mark):
                yield
        except CacheDiskFullError:
            raise
        except OSError as e:
            if e.errno not in _REFUSED or not str(e.filename).startswith(self.directory):
                raise  # (a remote's refusal, during a download, is not the directory's)
            # (sets disk_full; an eviction lock held elsewhere refuses this write only)
            with super()._writing(path, what, mark=mark and e.errno != errno.EAGAIN):
                raise disk_full_error(
                    e.errno, self._WHAT, self.directory, path, _REFUSED[e.errno], what=what
                ) from e

    def _remedy(self) -> str:
        return (
            "Free space on that disk, lower its budget (cache_dir_bytes, now "
            f"{self.max_bytes:,} bytes), or pass cache_dir= a directory on a disk with room."
        )

    def _count(self, **kw: int) -> None:
        self._checks()  # (a forked child's own lock)
        with self._stats_lock:
            for k, v in kw.items():
                self.stats[k] += v

    def _hit(self, path: str, size: int | None) -> os.stat_result | None:
        st = _copy_stat(path, size)
        if st is None:
            return None
        now = time.monotonic()
        if now - self._touched.get(path, -_TOUCH_INTERVAL) >= _TOUCH_INTERVAL:
            # The record's time, not the copy's: a utime() on the copy would move its
            # change time, which is part of its identity.
            self._touched[path] = now
            with contextlib.suppress(OSError):  # (missing, or .sums not a folder)
                os.utime(self._sum_path(path))
        return st

    def _checked(self, path: str, st: os.stat_result, version: str | None = None) -> bool:
        """Whether this process has checked the file ``st`` describes, as of ``version``
        when given (no I/O)."""
        got = self._checks().get(path)
        if got is not None and got[0] == file_identity(st) and version in (None, got[1]):
            return True
        return not self.verify_hits and version is None

    def _checks(self) -> dict[str, tuple[Identity, str | None]]:
        """The copies this process has checked (path -> identity, version). A forked child
        (a DataLoader worker) starts with none: each process checks what it uses. It
        makes its own stats lock too: a download in the parent may have held it at the
        fork."""
        if self._token != process.token():
            self._verified = {}
            self._stats_lock = threading.Lock()
            self._token = process.token()
        return self._verified

    def _check(self, path: str, st: os.stat_result, url: str, version: str | None) -> bool:
        """Whether the copy at ``path`` (``st``) holds the bytes its download recorded, of
        ``version`` when given: size, version and CRC (unless not ``verify_hits``), read once
        per process per identity. Call with the shard lock held."""
        if self._checked(path, st, version):
            return True
        recorded = read_record(self._sum_path(path), version)
        if recorded is None or recorded[1] != st.st_size:
            return False  # no record of a checked download (or not this one's): refetch
        ident = file_identity(st)
        if self.verify_hits:
            crc, read = file_crc(path)
            self._count(verified=1, bytes_verified=st.st_size)
            if crc != recorded[0] or read != ident:
                warnings.warn(
                    f"cached copy {path} of {url} no longer matches what was downloaded "
                    f"({crc}, recorded {recorded[0]}): it changed on disk; downloading it again",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return False
        self._checks()[path] = (ident, version)
        return True

    def _remote(
        self, url: str, fs: fsspec.AbstractFileSystem | None
    ) -> tuple[fsspec.AbstractFileSystem, str]:
        """The filesystem that reads ``url`` (``fs``, else inferred) and its path there."""
        return (
            get_filesystem(url, retry=self.retry) if fs is None else (fs, fs._strip_protocol(url))
        )

    def _retrying(self, url: str) -> dict[str, Any]:
        return {"url": url, "policy": self.retry, "on_retry": lambda *_: self._count(retries=1)}

    def _pinned(
        self, fs: fsspec.AbstractFileSystem, rpath: str, url: str, seen: tuple | None
    ) -> tuple | None:
        """What this process pinned of ``rpath`` (size, ETag, Last-Modified), which must
        be ``seen`` where given: another version is a RemoteIOError naming ``url``."""
        try:
            return remote.unchanged_since(fs, rpath, seen)
        except responses.RangeAnswerError as e:
            raise RemoteIOError(
                f"{url}: {e}; its copy in {self.directory} is neither read nor downloaded"
            ) from None

    def _version(
        self, fs: fsspec.AbstractFileSystem, rpath: str, url: str, seen: tuple | None = None
    ) -> str | None:
        """The version of remote ``rpath`` the reader reads (a word for the copy's
        record): its ``ETag``, else ``Last-Modified``, as pinned (:func:`remote.pin`: by
        the dataset's opening and its answers; no request), else asked of the store once and
        pinned; ``seen``, the reader's opening's, must be it. None for local and in-memory
        files and where the store names none."""
        pinned = self._pinned(fs, rpath, url, seen)  # (size, ETag, Last-Modified)
        if pinned is None or rpath in self._unversioned:
            return None
        if not (pinned[1] or pinned[2]):
            retry_call(self._observe, fs, rpath, url, what="version lookup", **self._retrying(url))
            pinned = self._pinned(fs, rpath, url, seen) or pinned
        tag = pinned[1] or pinned[2]
        if not tag:
            self._unversioned.add(rpath)
            return None
        # (a compressing proxy weakens an ETag, W/"x": the same object)
        return hashlib.sha256(tag.removeprefix("W/").encode()).hexdigest()[:24]

    def _observe(self, fs: fsspec.AbstractFileSystem, rpath: str, url: str) -> None:
        """Ask the store for ``rpath``'s size and validators and check them against what
        this process pinned (pinning them where none are): another version raises
        :class:`~torchgrain.io.responses.RangeAnswerError`, retried once, then a
        :class:`~torchgrain.RemoteIOError` saying the file changed on the server."""
        info = remote.call(fs, "info", rpath, url=url, what="version lookup")
        size = info.get("size")
        if remote.unchanged_since(fs, rpath, None)[0] is not None:  # type: ignore[index]
            size = None  # (a pinned size is the download's to check: it names the bytes)
        etag = info.get("ETag") or info.get("etag")
        modified = info.get("Last-Modified") or info.get("LastModified")
        responses.check_file_answer(
            rpath,
            size if isinstance(size, int) and not isinstance(size, bool) else None,
            str(etag) if etag else None,
            str(modified) if modified else None,
            complete=False,  # (a listing may leave a validator out)
        )

    def _of_another_version(self, path: str, version: str) -> bool:
        """Whether the copy at ``path`` is a complete one its record names another
        version of than ``version`` (no version: one the store named none for)."""
        st = _copy_stat(path, None)
        recorded = read_record(self._sum_path(path))
        if st is None or recorded is None or recorded[1] != st.st_size:
            return False
        return read_record(self._sum_path(path), version) is None

    def _refuse_replaced(
        self, fs: fsspec.AbstractFileSystem, rpath: str, url: str, seen: tuple | None
    ) -> None:
        """Ask the store for ``rpath``'s version (one ``info`` request): one other than
        this process pinned, or than ``seen`` (the reader's opening's, where no pin holds:
        two unpickled sources disagreed), is the file replaced since the reader's dataset
        was opened (a copy of another version is the newer one's): a RemoteIOError naming
        ``url``, and that copy is neither deleted nor downloaded again."""
        try:
            retry_call(self._observe, fs, rpath, url, what="version lookup", **self._retrying(url))
            remote.unchanged_since(fs, rpath, seen)
        except (RemoteIOError, responses.RangeAnswerError) as e:
            cause = e if isinstance(e, responses.RangeAnswerError) else e.__cause__
            if not isinstance(cause, responses.RangeAnswerError):
                raise
            raise RemoteIOError(
                f"{url} changed on the server: it was replaced since the source reading it "
                "was opened (the store serves another version than the one pinned then); its "
                f"copy in {self.directory}, of another version, is kept for the sources opened "
                "since. Open the source again to read the new file."
            ) from None

    def _sweep_old(self) -> None:
        super()._sweep_old()
        # A record's temp file of an earlier release: .<name>.tmp-<pid>-<random> (or
        # <name>.tmp-...), deleted where the copy's lock is free (its writer is gone).
        old: list[tuple[str, str, int]] = []
        with contextlib.suppress(OSError), os.scandir(os.path.join(self.directory, SUM_DIR)) as it:
            old = [
                (e.path, e.name.removeprefix(".").split(".tmp-")[0], 0)
                for e in it
                if ".tmp-" in e.name
            ]
        self._sweep(old)

    def _sum_path(self, path: str) -> str:
        return os.path.join(self.directory, SUM_DIR, os.path.basename(path))

    def _last_use(self, path: str, st: os.stat_result) -> int:
        """A copy's last use: its record's modification time (0 without a record: it
        would be fetched again)."""
        try:
            return os.stat(self._sum_path(path)).st_mtime_ns
        except OSError:  # (missing, or .sums not a folder)
            return 0

    def _forget(self, path: str) -> None:
        # (a record that cannot be deleted, .sums not a folder or the record one, reads
        # as none: the copy is fetched again, and the record's write says why it fails)
        unlink_quietly(self._sum_path(path))

    def _rank(self, entries: list[Entry]) -> list[Entry]:
        """Belady: furthest next use first (the hints are by copy name)."""
        if self.eviction != "belady":
            return entries
        hints = self.next_uses()
        uses = {
            p: hints[os.path.basename(p)] for _, _, p in entries if os.path.basename(p) in hints
        }
        return victims(entries, uses, sum(s for _, s, _ in entries), keep="")

    def _download(
        self, fs: fsspec.AbstractFileSystem, rpath: str, tmp: str, size: int, url: str
    ) -> None:
        what = f" (the copy of {url}, {size:,} bytes)"
        # With a deadline that grows with the size (torchgrain.io.remote).
        with self._writing(tmp, what):
            remote.get_file(fs, rpath, tmp, nbytes=size, url=url)
        got = os.path.getsize(tmp)
        if got < size:
            raise _ShortDownload(f"transfer of {url} ended after {got} of {size} bytes")
        if got > size:
            raise CorruptDataError(
                f"downloaded {url} has {got} bytes, expected {size} (did the file change?)"
            )
        # Publish only data that is on disk: a crash right after the rename must not
        # leave a file that looks complete but is not. (A filesystem that allocates late
        # may report a full disk here.)
        with self._writing(tmp, what), open(tmp, "rb+") as f:
            os.fsync(f.fileno())


def _copy_stat(path: str, size: int | None) -> os.stat_result | None:
    """The stat of the copy at ``path`` if it can be served: a regular file (a link, a
    FIFO or a directory put in its place is never opened, even unchecked with
    ``verify_hits=False``; the fetch that follows replaces it) of ``size`` bytes where
    given (a copy of another size, the remote or the manifest changed, is never
    served); else None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or (size is not None and size >= 0 and st.st_size != size):
        return None
    return st
