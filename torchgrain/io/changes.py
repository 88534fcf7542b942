"""Noticing that a memory-mapped local file changed, before its map is read.

Reading a map past the end of a file truncated since it was mapped raises SIGBUS, which
Python cannot catch. So every reader of a mapped file calls :func:`changed` on the file's
:class:`Pin` before it touches the map: on Linux one inotify read per check (about 1 µs for
every mapped file), else a stat per file (1-2 µs). A truncation within the batch after a
check, or a write through another machine, is not seen.

Design notes: docs/design-notes.md#io-changes.

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "f")
    >>> _ = open(p, "wb").write(b"x" * 100)
    >>> fd = os.open(p, os.O_RDONLY)
    >>> pin = Pin(fd, p)
    >>> os.close(fd)
    >>> changed(pin) is None
    True
    >>> os.truncate(p, 10)
    >>> changed(pin)
    'its size, modification or change time, or contents changed'
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import struct
import sys
import threading
import weakref
from typing import Any

from torchgrain.errors import CorruptDataError
from torchgrain.io import process
from torchgrain.io.libc import libc

__all__ = [
    "ChangedWhileOpen",
    "Pin",
    "changed",
    "changed_since_opening",
    "check",
    "first_changed",
    "open_regular",
    "poll",
    "seen",
]

_IN_MODIFY = 0x2
_IN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, name length
_WHY = "its size, modification or change time, or contents changed"
_NOT_REGULAR = "it was replaced by something that is not a regular file"


class ChangedWhileOpen(CorruptDataError):
    """A mapped local file was written, truncated or replaced while a reader had it open."""


class _Watcher:
    """This process's inotify instance, and what it has seen per watch."""

    def __init__(self) -> None:
        self.generation = process.generation  # (this module's state is never pickled)
        # Reentrant: a pin freed by the garbage collector during a poll releases its
        # watch from within it.
        self.lock = threading.RLock()
        self.fd = -1
        self.lost = False  # the queue overflowed: events are missing, stat every file
        self.modified: dict[int, int] = {}  # watch -> modifications seen
        self.refs: dict[int, int] = {}  # watch -> pins using it
        self.events = 0  # modifications seen in all
        lib = libc()
        if lib is None or not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
            return
        try:  # (ctypes' default prototypes fit: ints and a char pointer, int results)
            fd = lib.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except AttributeError:
            return
        if fd < 0:
            return
        self.fd = fd
        self.lib = lib
        # An empty queue is told by poll(2) (under 1 us) faster than by a read that
        # fails (an exception, about 2.5 us).
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)

    def add(self, fd: int) -> int:
        """Watch the file open as ``fd``; its watch, or -1."""
        if self.fd < 0 or self.lost:
            return -1
        wd = self.lib.inotify_add_watch(self.fd, b"/proc/self/fd/%d" % fd, _IN_MODIFY)
        if wd < 0:
            return -1
        with self.lock:
            self.refs[wd] = self.refs.get(wd, 0) + 1
        return wd

    def release(self, wd: int) -> None:
        with self.lock:
            n = self.refs.get(wd, 0) - 1
            if n > 0:
                self.refs[wd] = n
                return
            self.refs.pop(wd, None)
            self.modified.pop(wd, None)
        if self.fd >= 0:
            self.lib.inotify_rm_watch(self.fd, wd)  # (fails harmlessly if already gone)

    def poll(self) -> int:
        """Read the events queued; return how many modifications were seen in all."""
        if self.fd < 0:
            return self.events
        with self.lock:  # (a poll object refuses concurrent calls)
            if not self.poller.poll(0):
                return self.events
            while True:
                try:
                    data = os.read(self.fd, 1 << 16)
                except BlockingIOError:
                    return self.events
                except OSError:
                    self.lost = True
                    return self.events
                at = 0
                while at + _EVENT.size <= len(data):
                    wd, mask, _, length = _EVENT.unpack_from(data, at)
                    at += _EVENT.size + length
                    if mask & _IN_Q_OVERFLOW:
                        self.lost = True
                    if mask & _IN_MODIFY and wd in self.refs:  # (not a released watch)
                        self.modified[wd] = self.modified.get(wd, 0) + 1
                    self.events += 1


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def _this_process() -> _Watcher:
    w = _watcher
    if w is not None and w.generation == process.generation:
        return w
    return _new_watcher()


def _new_watcher() -> _Watcher:
    global _watcher
    with _watcher_lock:
        w = _watcher
        if w is None or w.generation != process.generation:
            # A forked child must not read the parent's instance (it would take the
            # parent's events): it makes its own and watches again what it checks.
            if w is not None and w.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(w.fd)  # (the child's copy of the descriptor only)
            w = _watcher = _Watcher()
        return w


# The watched pins alive in this process: a forked child watches their files again as
# it starts (see _adopt_at_fork).
_live: weakref.WeakSet[Pin] = weakref.WeakSet()


def _before_fork() -> None:
    # The child judges what happened before the fork from the parent's events: read
    # them now (one non-blocking read), not at the parent's last check.
    w = _watcher
    if (
        w is not None
        and w.generation == process.generation
        and w.fd >= 0
        and w.lock.acquire(timeout=0.1)
    ):
        try:
            with contextlib.suppress(Exception):  # a hook must not fail the fork
                w.poll()
        finally:
            w.lock.release()


def _after_fork() -> None:
    global _watcher_lock
    _watcher_lock = threading.Lock()
    with contextlib.suppress(Exception):  # a hook must not fail the fork
        _adopt_at_fork()


def _adopt_at_fork() -> None:
    """In a forked child, at once: each pin the parent watched is watched again here (a
    file changed after the fork must raise an event this child reads). One whose path no
    longer names its inode (replaced by a rename, or deleted) is kept as unchanged: the
    child's maps hold that inode, which no one can open by its path any more. Anything but
    a regular file there now (a FIFO, a device) is taken as a change, and never waited on."""
    old = _watcher
    pins = [pin for pin in list(_live) if old is not None and pin.generation == old.generation]
    if old is None or not pins:
        return
    w = _new_watcher()
    for pin in pins:
        if (why := pin._adopt(w, old)) is not None:
            pin.verdict = why


os.register_at_fork(before=_before_fork, after_in_child=_after_fork)


def poll() -> int:
    """Read this process's queue of file events; the number of changes seen so far (a
    caller that saw the same number before and holds only watched pins knows that none
    of its files changed since).

    Example:
        >>> poll() >= 0
        True
    """
    return _this_process().poll()


def seen() -> int:
    """The number :func:`poll` returned last in this process (no system call): for a
    reader whose caller has just polled.

    Example:
        >>> seen() == poll()
        True
    """
    return _this_process().events


def _identity(st: os.stat_result, ctime: bool = True) -> tuple[int, int, int, int, int]:
    # The change time: a write in place with the size and modification time put back
    # (cp -p, rsync --inplace -t) moves it, and no one can set it back (nor can a
    # touch of the access time alone: not compared for a pin taken with ctime=False).
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns if ctime else 0)


def changed_since_opening(shard: int, path: str) -> CorruptDataError:
    """The error for local shard ``shard`` at ``path`` whose change time is not the one
    its dataset's opening saw (``st_ctime_ns``, compared when a process first opens or
    maps the shard: a change from then on is seen by its :class:`Pin`).

    Example:
        >>> print(changed_since_opening(3, "/d/a.tfrecord"))  # doctest: +ELLIPSIS
        shard 3 '/d/a.tfrecord' changed since the dataset was opened (its change time ...
    """
    return CorruptDataError(
        f"shard {shard} {path!r} changed since the dataset was opened (its change time "
        "differs: written, even with its size and modification time put back as cp -p "
        "and rsync --inplace -t do, or its mode, owner or links changed): not read; "
        "open it again"
    )


class Pin:
    """A local file as it was when a reader opened it to map it: its identity (device,
    inode, size, modification and change times) and, where inotify works, a watch on it.

    Take it from the open descriptor the file is mapped from, before reading anything
    through the map. The watch is released when the pin is garbage collected.

    Args:
        fd: the open file.
        path: its path (for messages, and for the stat when no watch is kept).
        ctime: compare the change time too. False for a file only ever replaced, never
            written in place, whose access time its owner sets (a decoded-cache entry's
            LRU touch moves the change time): its stat compares what a touch cannot move.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "e")
        >>> _ = open(p, "wb").write(b"abc")
        >>> fd = os.open(p, os.O_RDONLY); pin = Pin(fd, p, ctime=False); os.close(fd)
        >>> os.utime(p, ns=(0, os.stat(p).st_mtime_ns))  # its access time (and change time)
        >>> pin.release(); changed(pin) is None
        True
    """

    __slots__ = (
        "__weakref__",
        "ctime",
        "generation",
        "ident",
        "owner",
        "path",
        "seen",
        "verdict",
        "wd",
    )

    def __init__(self, fd: int, path: str, *, ctime: bool = True) -> None:
        self.path = path
        self.ctime = ctime
        self.verdict: str | None = None  # what a forked child found as it started
        w = _this_process()
        self.generation, self.owner = w.generation, process.token()
        self.wd = w.add(fd)
        # After the watch is added a change raises an event: count from what came before.
        self.seen = 0
        if self.wd >= 0:
            w.poll()
            self.seen = w.modified.get(self.wd, 0)
            _live.add(self)
        self.ident = _identity(os.fstat(fd), ctime)

    @property
    def size(self) -> int:
        """The file's size when pinned."""
        return self.ident[2]

    def _adopt(self, w: _Watcher, old: _Watcher | None = None) -> str | None:
        """In a forked child: watch the file again, through its path (checked to be
        the same inode, size and times, so the new watch covers what the map holds).

        At the fork (``old``: the parent's watcher), the parent's events say what
        happened to the file before it, unless its queue overflowed: a file no longer at
        its path (replaced by a rename, or deleted) is then unchanged (``""``), as the
        child's maps hold that inode, which no one can open by its path any more; after
        an overflow it is refused, as by a stat."""
        # (the parent's watch, dropped here, is the parent's to release)
        parents, self.generation, self.owner, self.wd = self.wd, w.generation, process.token(), -1
        if old is not None and parents < 0:
            return None
        if old is not None and old.modified.get(parents, 0) != self.seen:
            return _WHY  # changed before the fork
        trusted = old is not None and not old.lost
        try:
            fd = open_regular(self.path)
        except (IsADirectoryError, CorruptDataError):
            return _NOT_REGULAR
        except OSError:
            return "" if trusted else "it was deleted or replaced"
        try:
            wd = w.add(fd)  # (before the stat: a change after it raises an event)
            if wd >= 0:
                if old is None:
                    w.poll()
                self.seen = w.modified.get(wd, 0)
            now = _identity(os.fstat(fd), self.ctime)
            if now != self.ident and old is not None:
                if wd >= 0:
                    w.release(wd)
                if now[:2] == self.ident[:2]:
                    return _WHY
                return "" if trusted else "it was replaced by another file"
            self.wd = wd
            return None if now == self.ident else _WHY
        finally:
            os.close(fd)

    def release(self) -> None:
        """Stop watching (the map is gone); :func:`changed` then stats the path."""
        wd, self.wd = self.wd, -1
        # The pid too, not only the generation: a forked child may free its copy of a
        # parent's pin before the after-fork hooks have run, and the inotify instance is
        # shared with the parent until then.
        if wd >= 0 and self.generation == process.generation and self.owner == process.token():
            w = _watcher
            if w is not None and w.generation == self.generation:
                w.release(wd)

    def __del__(self) -> None:
        # (No module global here: at the interpreter's exit this module's globals may be
        # cleared, to None, before the last pins are collected.)
        try:  # noqa: SIM105 - contextlib may be None by then
            self.release()
        except Exception:
            pass

    def __getstate__(self) -> Any:
        raise TypeError("a Pin belongs to the process that mapped its file")

    def __repr__(self) -> str:
        return f"Pin({self.path!r}, size={self.ident[2]}, watched={self.wd >= 0})"


def changed(pin: Pin, *, polled: bool = False) -> str | None:
    """Why ``pin``'s file is not what it was when pinned (written, truncated, replaced,
    deleted), or None when it is unchanged as far as can be seen (see the module
    docstring). ``polled``: the caller has just called :func:`poll` (one system call
    for all the files an operation checks, not one per file)."""
    if pin.verdict is not None:
        return pin.verdict or None
    w = _this_process()
    if pin.generation != w.generation:
        why = pin._adopt(w)
        if why is not None:
            return why
    if pin.wd >= 0 and not w.lost:
        if not polled:
            w.poll()
        return None if w.modified.get(pin.wd, 0) == pin.seen else _WHY
    try:
        st = os.stat(pin.path)
    except OSError:
        return "it was deleted or replaced"
    now = _identity(st, pin.ctime)
    if now[:2] != pin.ident[:2]:
        return "it was replaced by another file"
    return None if now == pin.ident else _WHY


def first_changed(pins: list[Pin]) -> tuple[int, str] | None:
    """``(k, why)`` for the first of ``pins`` whose file changed (see :func:`changed`),
    or None. When no watched file of the process changed and every pin is watched here,
    this is one ``poll`` and a look at each pin.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "h")
        >>> _ = open(p, "wb").write(b"abc")
        >>> fd = os.open(p, os.O_RDONLY); pins = [Pin(fd, p)]; os.close(fd)
        >>> first_changed(pins) is None
        True
        >>> os.truncate(p, 1)
        >>> first_changed(pins)[0]
        0
    """
    w = _this_process()
    w.poll()
    if not w.modified and not w.lost:
        here = w.generation
        if all(pin.wd >= 0 and pin.generation == here for pin in pins):
            return None
    return next(((k, why) for k, pin in enumerate(pins) if (why := changed(pin)) is not None), None)


def check(pin: Pin, what: str, *, polled: bool = False) -> None:
    """Raise :class:`ChangedWhileOpen` naming ``what`` (the file, as the reader names
    it) if :func:`changed` says the file changed (``polled`` as there).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "g")
        >>> _ = open(p, "wb").write(b"abc")
        >>> fd = os.open(p, os.O_RDONLY); pin = Pin(fd, p); os.close(fd)
        >>> check(pin, "file 'g'")
        >>> _ = open(p, "wb").write(b"xyz")
        >>> try:
        ...     check(pin, "file 'g'")
        ... except ChangedWhileOpen as e:
        ...     print(str(e)[:27])
        file 'g' changed while open
    """
    why = changed(pin, polled=polled)
    if why is not None:
        raise ChangedWhileOpen(
            f"{what} changed while open ({why} after it was memory-mapped): not read, "
            "as its bytes are no longer the ones indexed (a shard rewritten in place under "
            "a running job, e.g. by cp or rsync --inplace); open the dataset again"
        )


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (what a shard's reader pins
    and maps). Anything else a listing or a manifest may name is refused, never opened
    for reading: a FIFO's open would wait for a writer forever, a socket or device holds
    no data.

    Raises:
        FileNotFoundError: nothing is there.
        IsADirectoryError: a directory is there (as ``open`` raises it).
        CorruptDataError: anything else that is not a regular file.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); os.mkfifo(os.path.join(d, "f"))
        >>> open_regular(os.path.join(d, "f"))
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: '...f' is not a regular file
    """
    # O_NONBLOCK: the open of a FIFO returns at once (reads of a regular file ignore it)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        raise CorruptDataError(f"{path!r} is not a regular file")
    return fd
