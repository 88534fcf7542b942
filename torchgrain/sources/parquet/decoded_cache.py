"""DecodedCache: decoded Parquet row groups on local disk, memory-mapped, shared by a node.

A global shuffle over Parquet would decode a whole row group for every few records it
serves. This cache decodes each row group once per machine: the table is written as an
Arrow IPC file that every process memory-maps (page cache, no private memory). The
directory is a :class:`~torchgrain.io.node_store.NodeStore`; entries are keyed by what they
were decoded from (a changed file has new keys), checked in full when first mapped (a bad
one is decoded again, never served), and a directory that refuses writes never fails a
read (the row group is served unstored, with one warning).

Design notes: docs/design-notes.md#parquet-decoded-cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from torchgrain.caches import announce, size_text
from torchgrain.errors import CacheDiskFullError, CorruptDataError
from torchgrain.io import process
from torchgrain.io.cache_records import Identity, file_identity
from torchgrain.io.changes import Pin
from torchgrain.io.mounts import NETWORK_FILESYSTEMS, filesystem_type
from torchgrain.io.node_store import NodeStore, unlink_quietly
from torchgrain.sources.parquet.arrow_map import map_file_pinned

__all__ = [
    "DEFAULT_DECODED_CACHE_BYTES",
    "DecodedCache",
    "entry_key",
    "filesystem_type",
    "on_network_filesystem",
]

#: Default byte budget of a decoded cache directory (at most: see DecodedCache).
DEFAULT_DECODED_CACHE_BYTES = 64 << 30

_MAGIC = b"TGROWGRP"
_VERSION = 1
_TRAILER = struct.Struct("<8sIIQ32s")  # magic, version, crc32, IPC length, key
_TOUCH_SECONDS = 60.0
# The default min_free_bytes: this share of the filesystem, at most _MIN_FREE_CAP (a
# tenth of a 250 GB disk that is 90% full left a cache that never stored anything).
_MIN_FREE_SHARE = 0.05
_MIN_FREE_CAP = 8 << 30
_STATS = "hits builds waits corrupt changed evictions bytes_evicted bytes_written not_stored"


def default_min_free_bytes(disk_total: int) -> int:
    """The free space a :class:`DecodedCache` leaves on a filesystem of ``disk_total``
    bytes unless told otherwise: 5% of it, at most 8 GiB (room for the checkpoints and
    logs written beside it, without turning the cache off on a disk that is fairly full).

    Example:
        >>> default_min_free_bytes(100 * 10**9), default_min_free_bytes(10**12) == 8 << 30
        (5000000000, True)
    """
    return min(int(disk_total * _MIN_FREE_SHARE), _MIN_FREE_CAP)


def entry_key(*parts: Any) -> str:
    """The 32-hex-digit key of an entry decoded from ``parts`` (anything with a stable
    ``repr``, or bytes).

    Example:
        >>> len(entry_key("a.parquet", 123, 4)), entry_key(1) == entry_key(1)
        (32, True)
    """
    h = hashlib.sha256(f"torchgrain-decoded-v{_VERSION}".encode())
    for p in parts:
        h.update(b"\0")
        h.update(p if isinstance(p, (bytes, bytearray, memoryview)) else repr(p).encode())
    return h.hexdigest()[:32]


class DecodedCache(NodeStore):
    """A byte-bounded, LRU, multi-process cache of decoded Arrow tables on local disk.

    Args:
        directory: local directory for the entries (created if missing), on a local disk
            (the locks are ``flock``).
        max_bytes: budget for the entries' files, least recently used deleted first; an
            entry larger than the budget is not stored. Default: 64 GiB, or half of what the
            disk has free plus what the cache already holds there, whichever is less.
        min_free_bytes: free space the cache leaves on its filesystem (default
            :func:`default_min_free_bytes`: 5% of the filesystem, at most 8 GiB).
        lock_timeout: the longest a process waits for another one's build of the same
            entry (its lock stripe's) before decoding it itself, unstored; the process then
            tries that lock once each time (decoding unstored while it is held), said once.

    Counters of this process are in :attr:`stats`. The object holds no lock, file or map
    between calls: it pickles small. Design notes:
    docs/design-notes.md#parquet-decoded-cache.

    Example:
        >>> import tempfile, pyarrow as pa
        >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20, min_free_bytes=0)
        >>> t = pa.table({"x": [1, 2, 3]})
        >>> key = entry_key("example.parquet", 0)
        >>> got, path = cache.get_or_build(key, lambda: t, schema=t.schema, num_rows=3)
        >>> got.to_pydict(), cache.stats["builds"], path == cache.path_of(key)
        ({'x': [1, 2, 3]}, 1, True)
        >>> again, _ = cache.get_or_build(key, lambda: 1 / 0, schema=t.schema, num_rows=3)
        >>> again.equals(t), cache.stats["hits"]
        (True, 1)
    """

    _WHAT = "the decoded Parquet cache"
    _TMP_DIR, _TMP_PREFIX = ".tmp", ""
    _STRIPES = 256
    _ENTRIES = "[0-9a-f][0-9a-f]/*.arrow"  # (path_of)
    _USAGE = ".usage"
    _EVICT_TO = 0.9

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        min_free_bytes: int | None = None,
        lock_timeout: float = 600.0,
    ) -> None:
        for what, v, low in (("max_bytes", max_bytes, 1), ("min_free_bytes", min_free_bytes, 0)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise ValueError(f"{what} must be an integer {'> 0' if low else '>= 0'}, got {v!r}")
        super().__init__(os.path.abspath(os.fspath(directory)), max_bytes=max_bytes or 0)
        self.lock_timeout = float(lock_timeout)
        self._init_process()
        # (a file under one of its folders' names: its writes are refused, said once)
        with self._writing(self.directory), contextlib.suppress(FileExistsError):
            self._make_dirs()
        disk = shutil.disk_usage(self.directory)
        if max_bytes is None:
            # What the cache holds (its running total) it may keep: a later run reuses it.
            held = self._read_usage() or 0
            max_bytes = max(1, min(DEFAULT_DECODED_CACHE_BYTES, (disk.free + held) // 2))
        self.max_bytes = max_bytes
        self.min_free_bytes = (
            default_min_free_bytes(disk.total) if min_free_bytes is None else min_free_bytes
        )

    def _init_process(self) -> None:
        self._token = process.token()
        self._stats_lock = threading.Lock()
        # (device, inode) -> identity of the files this process has verified (the change
        # time too: a file written in place with its times put back is checked again)
        self._verified: dict[tuple[int, int], Identity] = {}
        self._warned = False  # of a refused write (once per process)
        # lock files waited for in vain (lock_timeout): their entries are decoded, not
        # stored, while another process holds them (said once per process)
        self._stuck: set[str] = set()
        self._said_stuck = False
        self.stats: dict[str, int] = dict.fromkeys(_STATS.split(), 0)

    def __getstate__(self) -> dict[str, Any]:
        keep = ("directory", "max_bytes", "min_free_bytes", "lock_timeout")
        # The stripes found held for good travel too: a spawned worker does not wait
        # lock_timeout for them again (a forked one keeps them as it is).
        return {**{k: self.__dict__[k] for k in keep}, "stuck": sorted(self._stuck)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        stuck = state.pop("stuck", ())
        self.__dict__.update(state)
        self._init_process()
        self._stuck.update(stuck)

    def __repr__(self) -> str:
        return f"DecodedCache({self.directory!r}, max_bytes={self.max_bytes})"

    # ------------------------------------------------------------------ public
    def path_of(self, key: str) -> str:
        """Where the entry ``key`` lives (whether or not it is cached now)."""
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            raise ValueError(f"a decoded cache key is 32 lowercase hex digits, got {key!r}")
        return os.path.join(self.directory, key[:2], key + ".arrow")

    def get_or_build(
        self,
        key: str,
        build: Callable[[], pa.Table],
        *,
        schema: pa.Schema,
        num_rows: int,
        name: str = "",
    ) -> tuple[pa.Table, str | None]:
        """``(table, path)``: the entry ``key`` memory-mapped from ``path``, built with
        ``build()`` (by one process of the machine) when missing.

        ``schema`` and ``num_rows`` are what the entry must hold: a file that differs,
        fails its checksum or does not validate is deleted and built again. ``name``
        says what the entry is in error messages. When the entry cannot be stored
        (larger than the budget, no room on the disk, a directory that refuses writes),
        the table ``build()`` made is returned as it is, with ``path`` None.
        """
        return self.get_or_build_pinned(key, build, schema=schema, num_rows=num_rows, name=name)[:2]

    def get_or_build_pinned(
        self,
        key: str,
        build: Callable[[], pa.Table],
        *,
        schema: pa.Schema,
        num_rows: int,
        name: str = "",
    ) -> tuple[pa.Table, str | None, Pin | None]:
        """:meth:`get_or_build`, and the :class:`~torchgrain.io.changes.Pin` of the file
        the table is mapped from (None when not stored). A caller that keeps the table
        checks the pin (:func:`~torchgrain.io.changes.changed`) before it reads the table
        again: a file truncated under its map kills the reader with SIGBUS. A changed
        entry is let go (:meth:`forget`) and asked for again, which rebuilds it.

        Example:
            >>> import tempfile, pyarrow as pa
            >>> from torchgrain.io.changes import changed
            >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20, min_free_bytes=0)
            >>> t = pa.table({"x": [1, 2]})
            >>> got, path, pin = cache.get_or_build_pinned(
            ...     entry_key("p", 0), lambda: t, schema=t.schema, num_rows=2)
            >>> changed(pin) is None
            True
        """
        self._check_process()
        path = self.path_of(key)
        table, pin = self._open(path, key, schema, num_rows)
        if table is not None:
            self._count(hits=1)
            return table, path, pin

        def made() -> pa.Table:
            built = build()
            if built.num_rows != num_rows or not built.schema.equals(schema):
                raise ValueError(f"{name or key}: built table does not match its schema/rows")
            return built

        # A lock waited for lock_timeout in vain is stuck: then tried once each time.
        lock = self._lock_path(key)
        wait = 0 if lock in self._stuck else self.lock_timeout
        with contextlib.ExitStack() as stack:
            held: bool | None = None  # (None: no lock file; the write is refused, said once)
            with contextlib.suppress(OSError):
                held = stack.enter_context(self._lock(key, wait=wait))
            # Another process may have built it while we waited for the lock.
            table, pin = self._open(path, key, schema, num_rows)
            if table is not None:
                self._count(hits=1, waits=1)
                return table, path, pin
            if held is False:  # its holder is stopped or stuck: decoded, not stored
                self._stuck_on(lock)
                self._count(not_stored=1)
                return made(), None, None
            self._stuck.discard(lock)
            self._remove_temps(key)
            built = made()
            if not self._store_table(path, key, built, name or key):
                return built, None, None
            table, pin = self._open(path, key, schema, num_rows, trusted=True)
        if table is None:  # evicted at once by another process
            return built, None, None
        return table, path, pin

    def forget(self, path: str, pin: Pin) -> None:
        """Let go an entry whose file changed while this process mapped it (see
        :meth:`get_or_build_pinned`): its file is deleted if it is still the one mapped,
        and it will be checked in full when mapped again.

        Example:
            >>> import tempfile, pyarrow as pa
            >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20, min_free_bytes=0)
            >>> t = pa.table({"x": [1]})
            >>> _, path, pin = cache.get_or_build_pinned(
            ...     entry_key("q", 0), lambda: t, schema=t.schema, num_rows=1)
            >>> cache.forget(path, pin); os.path.exists(path)
            False
        """
        self._check_process()
        with self._stats_lock:
            self._verified.pop(pin.ident[:2], None)
        self._discard(path, pin.ident[:2])
        self._count(changed=1)

    def touch(self, path: str, st: os.stat_result | None = None) -> None:
        """Refresh an entry's LRU time (its access time; ``st``: its stat, if just taken).

        It moves the file's change time, which the entry's pins do not compare: a
        touch, this process's or another's, never reads as a change.

        Example:
            >>> import tempfile, pyarrow as pa
            >>> from torchgrain.io.changes import changed
            >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20, min_free_bytes=0)
            >>> t = pa.table({"x": [1]})
            >>> _, path, pin = cache.get_or_build_pinned(
            ...     entry_key("t", 0), lambda: t, schema=t.schema, num_rows=1)
            >>> cache.touch(path); changed(pin) is None
            True
        """
        # Its modification time kept to the nanosecond (not through a float): a Pin
        # without an inotify watch compares it, and would take the entry as changed.
        with contextlib.suppress(OSError):
            mtime = (st or os.stat(path)).st_mtime_ns
            os.utime(path, ns=(time.time_ns(), mtime))

    # ----------------------------------------------------------------- opening
    def _open(
        self, path: str, key: str, schema: pa.Schema, num_rows: int, trusted: bool = False
    ) -> tuple[pa.Table | None, Pin | None]:
        """The mapped, checked table of ``path`` and its file's pin; None when there is
        none (a corrupt file is deleted, counted and reported as none; so is one through a
        link in place of its folder: its build's publish refuses the link)."""
        try:
            if stat.S_ISLNK(os.lstat(os.path.dirname(path)).st_mode):
                return None, None
            # Touched before it is pinned and checked: the identity this process verifies
            # holds the change time the touch moved.
            before = os.stat(path)
            if stat.S_ISREG(before.st_mode) and time.time() - before.st_atime > _TOUCH_SECONDS:
                self.touch(path, before)
            # (its pin compares no change time: any process's touch moves it)
            buf, st, pin = map_file_pinned(path, ctime=False)
        except OSError:  # missing, or unreadable (decoded again, and replaced if it can)
            return None, None
        except CorruptDataError:  # not a regular file (a FIFO, a device): decoded again,
            self._count(corrupt=1)  # and replaced by the new entry's rename
            return None, None
        size = buf.size
        try:  # (any fault: the file is deleted, and the entry decoded again)
            if size < _TRAILER.size:
                raise CorruptDataError(f"decoded cache file of {size} bytes")
            magic, version, crc, length, stored_key = _TRAILER.unpack(
                buf.slice(size - _TRAILER.size).to_pybytes()
            )
            if magic != _MAGIC or version != _VERSION or length != size - _TRAILER.size:
                raise CorruptDataError("not a decoded cache file of this version")
            if stored_key != key.encode():
                raise CorruptDataError("decoded cache file holds another entry")
            body = buf.slice(0, length)
            ident = file_identity(st)
            first = self._verified.get(ident[:2]) != ident
            if first and not trusted and zlib.crc32(memoryview(body)) != crc:
                raise CorruptDataError("decoded cache file fails its checksum")
            table = ipc.open_file(pa.BufferReader(body)).read_all()
            if first and not trusted:
                table.validate(full=True)
            if table.num_rows != num_rows or not table.schema.equals(schema):
                raise CorruptDataError("decoded cache file holds another schema or row count")
        except (pa.ArrowException, OSError, ValueError):  # (CorruptDataError too)
            self._count(corrupt=1)
            self._discard(path, (st.st_dev, st.st_ino))
            return None, None
        if first:
            with self._stats_lock:
                self._verified[ident[:2]] = ident
        return table, pin

    def _discard(self, path: str, ident: tuple[int, int]) -> None:
        """Delete the file ``ident`` (device, inode) at ``path``, unless it was replaced
        (never through a link in place of its folder)."""
        folder, name = os.path.split(path)
        with contextlib.suppress(OSError), self._folder(folder) as fd:
            now = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == ident:
                os.unlink(name, dir_fd=fd)

    # --------------------------------------------------------------- building
    def _store_table(self, path: str, key: str, table: pa.Table, name: str) -> bool:
        """Write ``table`` (the entry ``name``) under a temp name and rename it to ``path``
        (we hold the key's lock). False when it was not stored."""
        what, tmp = f" ({name})", ""
        try:
            if not self._room_on_disk(table.nbytes):
                self._refused(
                    f"the disk would keep less than min_free_bytes={self.min_free_bytes:,} "
                    f"bytes free after writing {path!r}{what}. {self._remedy()}"
                )
                return False
            if table.nbytes > self.max_bytes:  # (its file is larger still)
                self._count(not_stored=1)
                return False
            # (its file is larger: eviction makes room for that at the publish)
            tmp = self._reserve(key, table.nbytes, what, evict=False)
            with self._writing(tmp, what):
                nbytes = self._write(tmp, table, key)
            if nbytes > self.max_bytes:
                self._count(not_stored=1)
                return False
            self._publish(tmp, path, nbytes, what)
        except CacheDiskFullError as e:  # full disk, quota or size limit: say so, and what to do
            self._refused(str(e), full=True)
            return False
        except OSError as e:  # the directory refused it (read-only, deleted...)
            self._refused(
                f"{type(e).__name__}: {e} (writing {tmp or path!r}{what}). {self._remedy()}"
            )
            return False
        finally:
            if tmp:
                unlink_quietly(tmp)
        self._count(builds=1, bytes_written=nbytes)
        announce(
            "the decoded Parquet cache",
            self.directory,
            f"{size_text(self.max_bytes or 0)}, leaving {size_text(self.min_free_bytes)} free "
            "on its disk; decoded_cache_bytes= sets it, decoded_cache=False turns it off",
        )
        return True

    def _remedy(self) -> str:
        now = f", now {self.max_bytes:,} bytes" if self.max_bytes else ""
        return (
            f"Free space on that disk, lower the cache's budget (decoded_cache_bytes{now}), or "
            "pass decoded_cache= a directory on another local disk (its default lies under "
            "$TORCHGRAIN_CACHE; decoded_cache=False turns it off)."
        )

    def _refused(self, reason: str, *, full: bool = False) -> None:
        """Count an entry not stored, and say once per process why (``reason`` names the
        directory, the file and the remedy; ``full``: it is a full disk's error)."""
        self._count(not_stored=1)
        if self._warned:
            return
        self._warned = True
        if not full:
            reason = (
                f"the decoded Parquet cache in {self.directory!r} cannot store row groups: {reason}"
            )
        warnings.warn(
            f"torchgrain: {reason} Row groups are decoded again whenever needed, not stored.",
            stacklevel=2,
        )

    def _stuck_on(self, lock: str) -> None:
        """Remember the lock file ``lock`` as held for good by another process (waited for
        ``lock_timeout`` in vain): the entries under it are tried once, then decoded
        without the cache; said once per process."""
        with self._stats_lock:
            self._stuck.add(lock)
            said, self._said_stuck = self._said_stuck, True
        if said:
            return
        warnings.warn(
            f"torchgrain: the decoded Parquet cache's lock {lock!r} was held by another "
            f"process for more than lock_timeout={self.lock_timeout:g} s (stopped, or stuck "
            "on its disk): the row groups under it are decoded without the cache in this "
            "process while it is held. End that process (see `fuser` on the lock) to "
            "cache them again.",
            stacklevel=4,
        )

    def _write(self, tmp: str, table: pa.Table, key: str) -> int:
        """Write the IPC file and its trailer to ``tmp``; return the file's size."""
        if any(c.num_chunks > 1 for c in table.columns):
            table = table.combine_chunks()  # one record batch: one chunk per column
        with open(tmp, "wb") as f:
            out = _ChecksummedFile(f)
            with pa.PythonFile(out, mode="w") as sink, ipc.new_file(sink, table.schema) as w:
                w.write_table(table, max_chunksize=max(1, table.num_rows))
            f.write(_TRAILER.pack(_MAGIC, _VERSION, out.crc, out.size, key.encode()))
        return out.size + _TRAILER.size

    def _check_process(self) -> None:
        if self._token != process.token():  # a forked child: counters and locks are its own
            # (files checked by the parent stay checked, and locks found stuck stay so,
            # until found free)
            verified, stuck = dict(self._verified), set(self._stuck)
            self._init_process()
            self._verified, self._stuck = verified, stuck

    def _count(self, **kw: int) -> None:
        self._check_process()
        with self._stats_lock:
            for k, v in kw.items():
                self.stats[k] += v


_KEY = re.compile(r"[0-9a-f]{32}")


def on_network_filesystem(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a network or cluster filesystem (NFS, SMB, Lustre...).

    Example:
        >>> on_network_filesystem("/proc")
        False
    """
    return filesystem_type(path) in NETWORK_FILESYSTEMS


class _ChecksummedFile:
    """A write-only file that keeps the CRC-32 and size of what went through it (the
    bytes are checksummed while they are in memory, not read back)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.crc = 0
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:  # the caller closes the file itself, after the trailer
        self.closed = True
