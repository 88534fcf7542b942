"""ShardCache: whole remote shards copied to a local directory, shared by every process.

On object storage each request pays a time-to-first-byte of tens of milliseconds.
Reading a shard's records one range at a time pays it again and again; fetching the
whole shard once and reading the local copy pays it once per shard and epoch, and not
at all in later epochs while the copy stays in the cache.

Layout and safety rules (all processes of a machine may share one directory):

* A shard's copy is ``DIR/<key>-<name>``, where the key hashes the URL (and the
  checksum, when one is known), so shards with equal names in different datasets
  never collide.
* A download goes to ``DIR/.tmp-<key>-<size>-<pid>-<random>`` and is renamed into
  place only after its size (and checksum, when known) checked out, so a file under
  its final name is always complete. A killed download leaves only a ``.tmp-`` file,
  which the next fetcher of that shard deletes.
* An exclusive ``fcntl.flock`` on ``DIR/.locks/<key>.lock`` is held while fetching:
  two workers (threads or processes) asking for the same missing shard fetch it
  once; the second waits and then finds it.
* Eviction (least recently used first, by the access time that every hit refreshes)
  runs under ``DIR/.locks/evict.lock``, skips files whose shard lock is held (being
  fetched or opened by :meth:`ShardCache.fetch_open`), and only ever unlinks: a reader that has the
  file open (or mapped) keeps reading it, POSIX frees the blocks when it closes.
  In-flight downloads reserve their size (it is in the temp name), so concurrent
  downloads do not overshot the budget together.

The cache assumes shards are immutable: the same URL always holds the same bytes
(write a changed dataset to a new path, or give checksums in the manifest).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec

from torchgrain.errors import CorruptDataError
from torchgrain.io import remote
from torchgrain.io.file_hash import verify_file_hash
from torchgrain.io.fs import get_filesystem
from torchgrain.io.retry import RetryPolicy, retry_call

__all__ = ["ShardCache"]

T = TypeVar("T")
#: ``verify(path, checksum, name=...)``: raise CorruptDataError when ``path`` does not match.
Verifier = Callable[..., None]

_TMP_PREFIX = ".tmp-"
_LOCK_DIR = ".locks"
# Refresh a file's access time at most this often (seconds): one utime() per shard
# per second is plenty for LRU order and keeps hits to a single stat() call.
_TOUCH_INTERVAL = 1.0
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class _ShortDownload(ConnectionError):
    """The transfer ended early (counted as transient: the connection dropped)."""


def _key(url: str, checksum: str | None) -> str:
    h = hashlib.sha256(url.encode())
    if checksum:
        h.update(b"\0" + checksum.encode())
    return h.hexdigest()[:24]


class ShardCache:
    """A byte-bounded, LRU, multi-process cache of whole remote files on local disk.

    Args:
        directory: local directory for the copies (created if missing). Put it on a
            local disk (NVMe), not on a network filesystem: the locks are ``flock``.
        max_bytes: budget for the files in the cache; the least recently used files
            are deleted to stay under it. A single file larger than the budget is an
            error.
        retry: retry policy for downloads (default :class:`RetryPolicy()`).

    Counters (this process only) are in :attr:`stats`: ``hits``, ``misses`` (files this
    process downloaded), ``waits`` (hits that waited for another worker's download),
    ``bytes_fetched``, ``evictions``, ``bytes_evicted``, ``retries``.

    The object holds no open file or lock between calls: it pickles small and is safe
    to share with forked, spawned or forkserver DataLoader workers.

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

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int,
        retry: RetryPolicy | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = int(max_bytes)
        self.retry = retry or RetryPolicy()
        os.makedirs(os.path.join(self.directory, _LOCK_DIR), exist_ok=True)
        self._stats_lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._paths: dict[tuple[str, str | None], str] = {}
        self.stats: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "waits", "bytes_fetched", "evictions", "bytes_evicted", "retries"),
            0,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_stats_lock"]
        state["_paths"] = {}
        state["stats"] = dict.fromkeys(self.stats, 0)  # counters are per process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stats_lock = threading.Lock()
        self._lock_pid = os.getpid()

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
            path = os.path.join(self.directory, f"{_key(url, checksum)}-{name}")
            self._paths[(url, checksum)] = path
        return path

    def lookup(
        self, url: str, *, size: int | None = None, checksum: str | None = None
    ) -> tuple[str, int] | None:
        """``(path, inode)`` of a complete cached copy of ``url`` (a hit), else None.

        A hit refreshes the copy's access time (its LRU position) and is counted; a
        miss downloads nothing and is not counted (see :meth:`fetch`).

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).lookup("s3://b/x") is None
            True
        """
        path = self.local_path(url, checksum=checksum)
        st = self._hit(path, size)
        if st is None:
            return None
        self._count(hits=1)
        return path, st.st_ino

    def fetch(
        self,
        url: str,
        *,
        filesystem: fsspec.AbstractFileSystem | None = None,
        size: int | None = None,
        checksum: str | None = None,
        verify: Verifier | None = None,
    ) -> str:
        """Return the path of a complete local copy of ``url``, downloading it if needed.

        Args:
            url: the remote file (fsspec URL).
            filesystem: the fsspec filesystem that reads ``url`` (default: inferred).
            size: expected size in bytes (e.g. from a manifest); asked from the
                filesystem on a miss when not given. A cached copy of another size is
                discarded and fetched again.
            checksum: the expected checksum, checked before the copy is published.
            verify: ``verify(path, checksum, name=...)`` raising
                :class:`~torchgrain.CorruptDataError` on a mismatch (default: a whole-file
                hash, ``blake2b-file:...`` or ``[hashlib algorithm:]hexdigest``; sources
                pass their format's, e.g. ``blake2b-records`` for ArrayRecord).

        The copy may be evicted by another process at any time after this returns;
        open it at once, or use :meth:`fetch_open`, which opens it before any eviction
        can touch it.

        Raises:
            DatasetNotFoundError / PermissionError: the object is missing / forbidden.
            RemoteIOError: transient failures outlasted the retry policy.
            CorruptDataError: the downloaded bytes have the wrong size or checksum.
            ValueError: the file is larger than the whole cache budget.
        """
        path = self.local_path(url, checksum=checksum)
        if self._hit(path, size) is not None:
            self._count(hits=1)
            return path
        return self._fetch_locked(url, path, filesystem, size, checksum, None, verify)[0]

    def fetch_open(
        self,
        url: str,
        opener: Callable[[str], T],
        *,
        filesystem: fsspec.AbstractFileSystem | None = None,
        size: int | None = None,
        checksum: str | None = None,
        verify: Verifier | None = None,
    ) -> tuple[str, int, T]:
        """Like :meth:`fetch`, then ``opener(path)`` while the copy cannot be evicted.

        Returns ``(path, inode, opener(path))``. Eviction skips files whose shard lock
        is held, and this holds it until ``opener`` returns: a reader that opens (or
        maps) the file in ``opener`` keeps it readable for as long as it likes.

        Example:
            >>> import tempfile, fsspec
            >>> fsspec.filesystem("memory").pipe("/bucket/s1", b"abc")
            >>> c = ShardCache(tempfile.mkdtemp(), max_bytes=10)
            >>> _, _, f = c.fetch_open("memory://bucket/s1", lambda p: open(p, "rb"))
            >>> f.read(), f.close()
            (b'abc', None)
        """
        path = self.local_path(url, checksum=checksum)
        return self._fetch_locked(url, path, filesystem, size, checksum, opener, verify)

    def _fetch_locked(
        self,
        url: str,
        path: str,
        filesystem: fsspec.AbstractFileSystem | None,
        size: int | None,
        checksum: str | None,
        opener: Callable[[str], T] | None,
        verify: Verifier | None = None,
    ) -> tuple[str, int, T | None]:
        waited = self._hit(path, size) is None
        with self._flock(self._lock_path(path)):
            # Another worker may have fetched it while we waited for the lock.
            st = self._hit(path, size)
            if st is not None:
                self._count(hits=1, waits=int(waited))
                return path, st.st_ino, opener(path) if opener else None
            self._remove_stale_tmp(path)
            fs = filesystem
            if fs is None:
                fs, rpath = get_filesystem(url, retry=self.retry)
            else:
                rpath = fs._strip_protocol(url)
            if size is None or size < 0:
                size = retry_call(
                    remote.file_size,
                    fs,
                    rpath,
                    url=url,
                    policy=self.retry,
                    what="size lookup",
                    on_retry=self._on_retry,
                )
            if size > self.max_bytes:
                raise ValueError(
                    f"shard {url} is {size} bytes, larger than the cache budget "
                    f"max_bytes={self.max_bytes} of {self.directory}"
                )
            tmp = os.path.join(
                self.directory,
                f"{_TMP_PREFIX}{os.path.basename(path)}-{size}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            )
            # Reserve the space (the size is in the temp name), then make room for it.
            open(tmp, "wb").close()
            try:
                self._make_room(keep=path)
                retry_call(
                    self._download,
                    fs,
                    rpath,
                    tmp,
                    size,
                    url,
                    url=url,
                    policy=self.retry,
                    what="download",
                    on_retry=self._on_retry,
                )
                if checksum:
                    (verify or verify_file_hash)(tmp, checksum, name=f"downloaded {url}")
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            self._count(misses=1, bytes_fetched=size)
            ino = os.stat(path).st_ino
            obj = opener(path) if opener else None
        # Downloads that ran concurrently may together have overshot the budget
        # (they could not evict each other while in flight): settle it now.
        self._make_room(keep=path)
        return path, ino, obj

    def total_bytes(self) -> int:
        """Bytes of complete files in the cache now (all processes).

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).total_bytes()
            0
        """
        return sum(size for _, size, _ in self._entries())

    def clear(self) -> None:
        """Delete every complete file of the cache (open readers keep theirs).

        Example:
            >>> import tempfile
            >>> ShardCache(tempfile.mkdtemp(), max_bytes=10).clear()
        """
        with self._flock(os.path.join(self.directory, _LOCK_DIR, "evict.lock")):
            for _, _, p in self._entries():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)

    # ----------------------------------------------------------------- helpers
    def _count(self, **kw: int) -> None:
        if self._lock_pid != os.getpid():
            # A forked child (a DataLoader worker): a background download in the
            # parent may have held the lock at the fork, so the copy may be locked.
            self._stats_lock = threading.Lock()
            self._lock_pid = os.getpid()
        with self._stats_lock:
            for k, v in kw.items():
                self.stats[k] += v

    def _on_retry(self, attempt: int, exc: BaseException) -> None:
        self._count(retries=1)

    def _hit(self, path: str, size: int | None) -> os.stat_result | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if size is not None and size >= 0 and st.st_size != size:
            # A copy of another size (the remote changed, or the manifest did):
            # never serve it; the caller refetches under the shard lock.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return None
        now = time.time()
        if now - st.st_atime > _TOUCH_INTERVAL:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path, (now, st.st_mtime))
        return st

    def _lock_path(self, path: str) -> str:
        return os.path.join(self.directory, _LOCK_DIR, os.path.basename(path) + ".lock")

    @contextlib.contextmanager
    def _flock(self, lock_path: str, *, blocking: bool = True) -> Iterator[bool]:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _download(
        self, fs: fsspec.AbstractFileSystem, rpath: str, tmp: str, size: int, url: str
    ) -> None:
        # With a deadline that grows with the size (torchgrain.io.remote).
        remote.get_file(fs, rpath, tmp, nbytes=size, url=url)
        got = os.path.getsize(tmp)
        if got < size:
            raise _ShortDownload(f"transfer of {url} ended after {got} of {size} bytes")
        if got > size:
            raise CorruptDataError(
                f"downloaded {url} has {got} bytes, expected {size} (did the file change?)"
            )
        # Publish only data that is on disk: a crash right after the rename must not
        # leave a file that looks complete but is not.
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())

    def _remove_stale_tmp(self, path: str) -> None:
        """Delete temp files of this shard left by killed downloads (we hold its lock)."""
        prefix = _TMP_PREFIX + os.path.basename(path) + "-"
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)

    def _entries(self) -> list[tuple[float, int, str]]:
        out = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.startswith("."):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((st.st_atime, st.st_size, e.path))
        return out

    def _reserved(self) -> int:
        """Bytes reserved by downloads in flight (their target size is in the temp name)."""
        total = 0
        with os.scandir(self.directory) as it:
            tmps = [e for e in it if e.name.startswith(_TMP_PREFIX)]
        for e in tmps:
            try:
                base, size, _pid, _rand = e.name[len(_TMP_PREFIX) :].rsplit("-", 3)
                nbytes = int(size)
            except ValueError:
                continue
            # Only the holder of a shard's lock writes its temp file: if nobody holds
            # it, the download was killed and the file is garbage.
            with self._flock(self._lock_path(base), blocking=False) as locked:
                if locked:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                    continue
            total += nbytes
        return total

    def _make_room(self, keep: str) -> None:
        with self._flock(os.path.join(self.directory, _LOCK_DIR, "evict.lock")):
            entries = sorted(self._entries())
            total = sum(s for _, s, _ in entries) + self._reserved()
            for _, size, p in entries:
                if total <= self.max_bytes:
                    break
                if p == keep:
                    continue
                # A held shard lock means a download or a fetch_open() is using it.
                with self._flock(self._lock_path(p), blocking=False) as free:
                    if not free:
                        continue
                    try:
                        os.unlink(p)  # readers holding it open keep reading (POSIX)
                    except FileNotFoundError:
                        continue
                total -= size
                self._count(evictions=1, bytes_evicted=size)
