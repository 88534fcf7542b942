"""NodeStore: keyed files in one local directory, shared by every process of a machine.

The rules of the node-local caches, kept once (:class:`~torchgrain.io.shard_cache.ShardCache`
and :class:`~torchgrain.sources.parquet.decoded_cache.DecodedCache` subclass it and keep
what an entry is, its key and how it is verified). An entry is a file named by its key,
complete once renamed into place; an ``flock`` per entry guards writes, checks and
eviction; entries and writes in flight stay within ``max_bytes`` (least recently used
unlinked first); a full disk raises :class:`~torchgrain.CacheDiskFullError` and leaves
nothing partial. A store holds no file or lock between calls: it pickles and forks as it is.

Design notes: docs/design-notes.md#io-node-store.

Example:
    >>> import tempfile
    >>> store = NodeStore(tempfile.mkdtemp(), max_bytes=10)
    >>> a = os.path.join(store.directory, "a")
    >>> with store._lock("a"):
    ...     tmp = store._reserve("a", 3)
    ...     _ = open(tmp, "wb").write(b"abc")
    ...     store._publish(tmp, a, 3)
    >>> with store._lock("b"):
    ...     tmp = store._reserve("b", 9)  # no room for both: "a" goes
    ...     store._reserved(), store.total_bytes(), os.path.exists(a)
    (9, 0, False)
    >>> store._reserved(), os.path.exists(tmp)  # its writer is gone: so is its temp file
    (0, False)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import os
import shutil
import stat
import struct
import time
import uuid
import zlib
from collections.abc import Iterator

from torchgrain.errors import CacheDiskFullError
from torchgrain.io import process
from torchgrain.io.atomic import file_mode, naming_full_disk, publish

__all__ = ["Entry", "NodeStore", "unlink_quietly"]

#: ``(last use, size, path)`` of an entry.
Entry = tuple[int, int, str]

_TOTAL = struct.Struct("<q")
_POLL, _POLL_MAX = 0.005, 0.1  # seconds between tries of a lock waited for with a deadline
# After the disk had no room for an entry, store nothing for this long (instead of listing
# the entries to make room at every write meanwhile).
_FULL_SECONDS = 30.0
# The longest a process waits for the eviction lock (held for a listing and unlinks, each
# holder in turn: seconds only when many processes queue on a slow disk, or its holder is
# stopped); the write is then refused, and for _FULL_SECONDS its writes take one try of it.
_EVICT_WAIT = 30.0


class NodeStore:
    """A byte-bounded directory of entries shared by the processes of a machine.

    ``directory`` (a local disk: the locks are ``flock``) holds at most ``max_bytes``
    of entries and writes in flight, and :meth:`_room_on_disk` keeps ``min_free_bytes``
    free on its filesystem. Subclasses set the class attributes below and may override
    :meth:`_remedy`, :meth:`_count`, :meth:`_last_use`, :meth:`_forget`, :meth:`_rank`,
    :meth:`_temp_of` and :meth:`_own_lock`.
    """

    _WHAT = "the node store"  # what it is, in messages
    # Where temp files go (a folder of their own: a write lists the writes in flight, not
    # every entry), and how their names start.
    _TMP_DIR, _TMP_PREFIX = ".tmp", ".tmp-"
    # Where an earlier release put them (None: nowhere else), swept once per process.
    _OLD_TMP_DIR: str | None = None
    _LOCK_DIR = ".locks"  # where the lock files go
    _DIRS: tuple[str, ...] = ()  # more subdirectories to make with the store's own
    _ENTRIES = "[!.]*"  # the entries' paths in the directory (a glob per level: a/b)
    _STRIPES: int | None = None  # hash entry names to this many lock files, not one each
    # The file of a running total of the entries' bytes (a publish under the budget lists
    # no entry): 8 bytes of the eviction lock's file (a file of its own would be listed).
    _USAGE: str | None = os.path.join(".locks", "evict.lock")
    _EVICT_TO = 1.0  # an eviction frees room down to this share of max_bytes
    # (per process: a pickled store starts with these)
    _full_in: tuple[int, int] | None = None  # the process whose write found no room
    _full_error: CacheDiskFullError | None = None  # (and what it found)
    # _room_on_disk: the process (its token) that found no room stores nothing until then
    _full_until: tuple[tuple[int, int] | None, float] = (None, 0.0)
    # _evict_lock: the process that waited for it in vain tries it once until then
    _evict_stuck: tuple[tuple[int, int] | None, float] = (None, 0.0)
    _old_swept: tuple[int, int] | None = None  # the process that ran _sweep_old
    _counted: tuple[int, int] | None = None  # the process that counted the entries

    def __init__(self, directory: str, *, max_bytes: int, min_free_bytes: int = 0) -> None:
        self.directory, self.max_bytes, self.min_free_bytes = directory, max_bytes, min_free_bytes

    # ------------------------------------------------------------------ public
    @property
    def disk_full(self) -> bool:
        """Whether a write of this process into the store found no room (a full disk, a
        spent quota, a file-size limit: it raised :class:`~torchgrain.CacheDiskFullError`).
        Sources then read without the cache in this process; a new process (the next
        epoch's DataLoader workers, unless persistent) tries again.

        Example:
            >>> import tempfile
            >>> NodeStore(tempfile.mkdtemp(), max_bytes=10).disk_full
            False
        """
        # (no system call unless a write found no room)
        if self._full_in is not None and self._full_in != process.token():
            self._full_in = None  # a forked child of that process: it tries again
        return self._full_in is not None

    def total_bytes(self) -> int:
        """Bytes of complete entries now (all processes).

        Example:
            >>> import tempfile
            >>> NodeStore(tempfile.mkdtemp(), max_bytes=10).total_bytes()
            0
        """
        return sum(size for _, size, _ in self._entries())

    def clear(self) -> None:
        """Delete every entry (processes that have one open or mapped keep reading it).

        Example:
            >>> import tempfile
            >>> NodeStore(tempfile.mkdtemp(), max_bytes=10).clear()
        """
        with self._evict_lock():
            for _, _, path in self._entries():
                self._unlink(path)
            self._write_usage(0)

    # ---------------------------------------------------------- for subclasses
    def _remedy(self) -> str:
        return f"Free space on that disk or lower the budget (now {self.max_bytes:,} bytes)."

    def _count(self, **kw: int) -> None:
        """Count events (``evictions=1, bytes_evicted=n``) in the subclass's stats."""

    def _last_use(self, path: str, st: os.stat_result) -> int:
        """An entry's LRU clock: its access time."""
        return st.st_atime_ns

    def _forget(self, path: str) -> None:
        """Called with an entry's path once it is unlinked."""

    def _rank(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` (least recently used first) in the order they are evicted."""
        return entries

    def _temp_of(self, stem: str) -> tuple[str, int] | None:
        """``(entry name, reserved bytes)`` of the temp file ``<_TMP_PREFIX><stem>``: its
        name is ``<name>-<size>-<pid>-<random>``, or ``<name>-<pid>-<random>`` (a decoded
        cache's build of an earlier release: it reserved nothing); None: not a temp file."""
        name, *rest = stem.rsplit("-", 3)
        with contextlib.suppress(ValueError):
            if len(rest) >= 2:
                return name, int(rest[0]) if len(rest) == 3 else 0
        return None

    def _own_lock(self, name: str) -> bool:
        """Whether ``name`` is a writer's lock of its own, taken by no other process (not
        an entry's shared lock): a sweep that finds it free deletes it with its temp file."""
        return False

    # ----------------------------------------------------------------- writing
    @contextlib.contextmanager
    def _writing(self, path: str, what: str = "", *, mark: bool = True) -> Iterator[None]:
        """Writes to ``path`` (``what`` says what it is): one that finds no room raises
        :class:`~torchgrain.CacheDiskFullError` and (``mark``) sets :attr:`disk_full`."""
        try:
            with naming_full_disk(self._WHAT, self.directory, path, self._remedy(), what=what):
                yield
        except CacheDiskFullError as e:
            if mark and e.directory == self.directory:
                self._full_in = process.token()
                self._full_error = e
            raise

    def _make_dirs(self, *, mark: bool = True) -> None:
        """Make the store's directories (again, if they were deleted).

        Raises:
            OSError: ``ELOOP``, one of its own folders is a link (anyone who can write to
                the directory can put one there: the store would write where it points);
                the directory itself may be one.
        """
        for sub in (self._LOCK_DIR, self._TMP_DIR, *self._DIRS):
            path = os.path.join(self.directory, sub)
            with self._writing(path, mark=mark):
                os.makedirs(path, exist_ok=True)
                if sub and os.path.islink(path):
                    raise OSError(errno.ELOOP, f"{self._WHAT}'s own folder is a link", path)

    # ------------------------------------------------------------------- locks
    def _lock(
        self, name: str, *, shared: bool = False, wait: float | None = None, **kw: bool
    ) -> contextlib.AbstractContextManager[bool]:
        """Hold the lock of entry ``name`` (shared or exclusive); yields whether it is held:
        ``wait`` None waits for it, else gives up after that many seconds (0: one try).
        See :meth:`_flock` for ``mark`` and ``drop``."""
        return self._flock(self._lock_path(name), shared, wait, **kw)

    def _lock_path(self, name: str) -> str:
        """The lock file of entry ``name`` (its stripe's, with ``_STRIPES``)."""
        if self._STRIPES:
            name = str(zlib.crc32(name.encode()) % self._STRIPES)
        return os.path.join(self.directory, self._LOCK_DIR, name + ".lock")

    @contextlib.contextmanager
    def _evict_lock(self) -> Iterator[None]:
        """The lock under which entries are counted, evicted and published, waited for at
        most :data:`_EVICT_WAIT` seconds.

        Raises:
            BlockingIOError: another process holds it (named; the write is refused).
        """
        path = os.path.join(self.directory, self._LOCK_DIR, "evict.lock")
        who, until = self._evict_stuck
        stuck = who == process.token() and time.monotonic() < until
        with self._flock(path, wait=0 if stuck else _EVICT_WAIT) as held:
            if not held:
                self._evict_stuck = (process.token(), time.monotonic() + _FULL_SECONDS)
                with self._writing(path, " (the eviction lock)"):
                    raise BlockingIOError(
                        errno.EAGAIN,
                        f"the eviction lock is held by another process (for more than "
                        f"{_EVICT_WAIT:g} s: stopped, or stuck on its disk)",
                        path,
                    )
            yield

    @contextlib.contextmanager
    def _flock(
        self,
        path: str,
        shared: bool = False,
        wait: float | None = None,
        mark: bool = True,
        drop: bool = False,
    ) -> Iterator[bool]:
        """``mark``: see :meth:`_writing`; ``drop``: a lock file no other process takes,
        deleted while still held (if its path still names it) once let go."""
        # A new descriptor each time: flock excludes open files, not threads sharing one.
        with self._writing(path, " (a lock file)", mark=mark):
            try:
                fd = self._open_lock(path)
            except FileNotFoundError:  # not made for want of room, or deleted: again
                self._make_dirs(mark=mark)
                fd = self._open_lock(path)
        try:
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            deadline = None if wait is None else time.monotonic() + wait
            pause = _POLL
            while True:
                try:
                    fcntl.flock(fd, mode | (0 if deadline is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:  # type: ignore[operator]
                        yield False
                        return
                    time.sleep(pause)
                    pause = min(pause * 2, _POLL_MAX)
            try:
                yield True
            finally:
                if drop:
                    _unlink_if(path, fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _open_lock(self, path: str) -> int:
        """The lock file ``path`` opened (made if need be). A link put in its place, or in
        place of its folder (anyone who can write to the directory can) is never
        followed: an OSError (ELOOP), the write refused. The store's directory itself
        may be a link."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with self._folder(os.path.dirname(path)) as dir_fd:
            try:
                name = path if dir_fd is None else os.path.basename(path)
                return os.open(name, flags, 0o666, dir_fd=dir_fd)
            except OSError as e:  # (named by its whole path: see ShardCache._writing)
                raise OSError(e.errno, e.strerror, path) from None

    # ------------------------------------------------------------------- temps
    def _temps(self) -> list[tuple[str, str, int]]:
        """``(path, entry name, reserved bytes)`` of the temp files (what killed writers
        of an earlier release left where it put them is swept first: once a process)."""
        if self._old_swept != process.token():
            self._old_swept = process.token()
            self._sweep_old()
        return self._listed_temps(self._TMP_DIR)

    def _sweep_old(self) -> None:
        """Delete the temp files of killed writers of an earlier release (whose entry's
        lock is free) where it put them (:attr:`_OLD_TMP_DIR`)."""
        if self._OLD_TMP_DIR is not None:
            self._sweep(self._listed_temps(self._OLD_TMP_DIR))

    def _listed_temps(self, folder: str) -> list[tuple[str, str, int]]:
        out = []
        with contextlib.suppress(OSError), os.scandir(os.path.join(self.directory, folder)) as it:
            for e in it:
                if e.name.startswith(self._TMP_PREFIX):
                    of = self._temp_of(e.name[len(self._TMP_PREFIX) :])
                    if of is not None:
                        out.append((e.path, *of))
        return out

    def _remove_temps(self, name: str) -> None:
        """Delete temp files of entry ``name`` left by killed writers (its lock held)."""
        for path, of, _ in self._temps():
            if of == name:
                unlink_quietly(path)

    def _reserved(self, exclude: str = "") -> int:
        """Bytes reserved by writes in flight (but ``exclude``); deletes the temp files
        of writers that are gone (their entry's lock is free)."""
        return sum(
            size for _, _, size in self._sweep([t for t in self._temps() if t[0] != exclude])
        )

    def _sweep(self, temps: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
        """Delete the ``temps`` of writers that are gone (their entry's lock is free);
        the others."""
        out = []
        for path, name, size in temps:
            # (a writer's own lock goes too: its name is never used again)
            with self._lock(name, wait=0, drop=self._own_lock(name)) as free:
                if free:
                    unlink_quietly(path)
                    continue
            out.append((path, name, size))
        return out

    def _reserve(self, name: str, size: int, what: str = "", *, evict: bool = True) -> str:
        """A new temp file for entry ``name`` (its lock held) reserving ``size`` bytes; its
        path. ``evict``: least wanted entries are evicted now to make room for it (else at
        the publish only: ``size`` is an estimate, and the publish knows the size)."""
        tmp = os.path.join(
            self.directory,
            self._TMP_DIR,
            f"{self._TMP_PREFIX}{name}-{size}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        )
        self._make_dirs()  # (its folder made again if deleted; one that is a link refused)
        with self._writing(tmp, what):
            open(tmp, "wb").close()
        if evict:
            try:
                with self._evict_lock():
                    self._settle(0)
            except BaseException:
                unlink_quietly(tmp)
                raise
        return tmp

    def _publish(self, tmp: str, path: str, size: int, what: str = "") -> None:
        """Rename the complete temp file ``tmp`` to the entry ``path`` (``size`` bytes; its
        lock held), making room for it first: writes in flight may together have
        overshot the budget (they cannot evict each other).

        Raises:
            OSError: ``ELOOP``, the entry's folder is a link (see :meth:`_folder`).
        """
        with (
            self._writing(path, what),
            self._folder(os.path.dirname(path), make=True) as dir_fd,
            self._evict_lock(),
        ):
            held = self._settle(size, exclude=tmp)
            if dir_fd is None:
                publish(tmp, path, durable=False)  # mode from the umask
            else:  # (the same, into the folder opened)
                os.chmod(tmp, file_mode())
                os.replace(tmp, os.path.basename(path), dst_dir_fd=dir_fd)
            self._write_usage(held + size)

    @contextlib.contextmanager
    def _folder(self, folder: str, *, make: bool = False) -> Iterator[int | None]:
        """The entries' folder ``folder`` opened (made first, ``make``) without following
        a link put in its place (anyone who can write to the directory can: the store
        would write, read or delete where it points): an OSError (ELOOP). None for the
        store's directory, which may itself be a link."""
        if os.path.normpath(folder) == os.path.normpath(self.directory):
            yield None
            return
        if make:
            os.makedirs(folder, exist_ok=True)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(folder, flags)
        except OSError as e:
            if e.errno == errno.ENOTDIR and os.path.islink(folder):  # (O_DIRECTORY said so)
                e = OSError(errno.ELOOP, os.strerror(errno.ELOOP), folder)
            if e.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, f"{self._WHAT}'s folder is a link", folder) from None
            raise
        try:
            yield fd
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- eviction
    def _settle(self, size: int, exclude: str = "") -> int:
        """The entries' bytes, once ``size`` more fit with the reservations (evicting if
        need be; the eviction lock held)."""
        # (counted once per process: a process of an earlier release adds entries without
        # adding them to the total, and so does a copy put there by hand)
        held = self._read_usage() if self._counted == process.token() else None
        if held is None or held + size + self._reserved(exclude) > self.max_bytes:
            held = self._make_room(size, exclude=exclude)
        return held

    def _entries(self) -> list[Entry]:
        """``(last use, size, path)`` of the complete entries (all processes): the
        regular files whose path in the directory matches ``_ENTRIES``, no link followed
        (never anything else: the directory may hold a user's files, or another cache)."""
        out: list[Entry] = []

        def scan(directory: str, levels: list[str]) -> None:
            with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
                for e in it:
                    if not fnmatch.fnmatchcase(e.name, levels[0]):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if len(levels) > 1 and stat.S_ISDIR(st.st_mode):
                        scan(e.path, levels[1:])
                    elif len(levels) == 1 and stat.S_ISREG(st.st_mode):
                        out.append((self._last_use(e.path, st), st.st_size, e.path))

        scan(self.directory, self._ENTRIES.split("/"))
        return out

    def _make_room(self, need: int = 0, *, short: int = 0, exclude: str = "") -> int:
        """Evict until ``need`` more bytes fit in ``_EVICT_TO`` of the budget with the
        reservations (but ``exclude``) and ``short`` bytes more are free; return the
        entries' bytes left (the eviction lock held)."""
        entries = sorted(self._entries())
        held = sum(size for _, size, _ in entries)
        reserved = self._reserved(exclude)
        target = max(0, min(int(self.max_bytes * self._EVICT_TO) - need, held + reserved - short))
        for _, size, path in self._rank(entries) if held + reserved > target else ():
            if held + reserved <= target:
                break
            # A held lock of its own: the entry is being written, checked or opened (a
            # stripe says nothing of which entry: those stores map entries unlocked).
            with contextlib.ExitStack() as stack:
                if not self._STRIPES and not stack.enter_context(
                    self._lock(os.path.basename(path), wait=0)
                ):
                    continue
                if not self._unlink(path):
                    continue
            held -= size
            self._count(evictions=1, bytes_evicted=size)
        self._write_usage(held)
        self._counted = process.token()
        return held

    def _unlink(self, path: str) -> bool:
        """Delete an entry (readers that have it open keep reading it); whether it was
        there."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        finally:
            self._forget(path)
        return True

    def _room_on_disk(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more leave ``min_free_bytes`` free on the filesystem, once
        least recently used entries are deleted to make room if need be."""
        who, until = self._full_until
        if who == process.token() and time.monotonic() < until:
            return False
        short = self.min_free_bytes + nbytes - shutil.disk_usage(self.directory).free
        if short <= 0:
            return True
        with self._evict_lock():
            self._make_room(short=short)
        # (files that processes still map free their blocks only when unmapped)
        if self.min_free_bytes + nbytes <= shutil.disk_usage(self.directory).free:
            return True
        self._full_until = (process.token(), time.monotonic() + _FULL_SECONDS)
        return False

    # ------------------------------------------------------------------- usage
    # The running total is 8 bytes written in place (under the eviction lock): a rename
    # over an existing file makes some filesystems (ext4) flush it, about 1 ms each time.
    def _usage_fd(self, flags: int) -> int:
        """The running total's file opened with ``flags``, if it is a regular file: a link
        or a FIFO put in its place (anyone who can write to the directory can) is never
        followed (written through, outside the store) or waited on (forever)."""
        path = os.path.join(self.directory, self._USAGE or "")
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path!r} is not a regular file")
        return fd

    def _read_usage(self) -> int | None:
        """The running total of the entries' bytes; None without one."""
        if self._USAGE is None:
            return None
        try:
            fd = self._usage_fd(os.O_RDONLY)
        except OSError:
            return None
        try:
            data = os.pread(fd, _TOTAL.size, 0)
        finally:
            os.close(fd)
        return max(0, _TOTAL.unpack(data)[0]) if len(data) == _TOTAL.size else None

    def _write_usage(self, held: int) -> None:
        if self._USAGE is not None:
            path = os.path.join(self.directory, self._USAGE)
            with self._writing(path, " (the running total of its entries)"):
                try:
                    fd = self._usage_fd(os.O_WRONLY | os.O_CREAT)
                except OSError:  # not a regular file: replaced by one
                    unlink_quietly(path)
                    fd = self._usage_fd(os.O_WRONLY | os.O_CREAT)
                try:
                    os.pwrite(fd, _TOTAL.pack(max(0, held)), 0)
                finally:
                    os.close(fd)


def _unlink_if(path: str, fd: int) -> None:
    """Delete the file at ``path`` if it is still the one open as ``fd`` (another process
    may have made a new one there since)."""
    with contextlib.suppress(OSError):
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(path)


def unlink_quietly(path: str) -> None:
    """Delete ``path`` if it can be (one that cannot, another user's in a directory with
    the sticky bit, is left: temp files are never read).

    Example:
        >>> unlink_quietly("/nonexistent/x")
    """
    with contextlib.suppress(OSError):
        os.unlink(path)
