"""DecodedCache: decoded Parquet row groups on local disk, memory-mapped, shared by a node.

A global shuffle over Parquet bigger than a process's memory cache would decode a whole
row group for every few records it serves. This cache decodes each row group once per
machine, not once per worker or epoch: the decoded table is written as an Arrow IPC
file, and every process (DataLoader workers, ranks, later runs) memory-maps it. The
mapped pages live in the page cache, shared by all processes, and cost no private memory.

Layout and safety rules (every process of a machine may share one directory):

* An entry is ``DIR/<k[:2]>/<k>.arrow``, where ``k`` hashes what the entry was decoded
  from (file path, size, modification time, inode and change time, or a remote
  store's version, and footer; row group, columns and their types): a changed Parquet
  file has new keys, so a stale entry is never served (it ages out of the LRU order).
  A remote file whose store reports no version (no ETag, generation or modification
  time) has keys of its own for each opening of the dataset.
* An entry is an Arrow IPC file followed by a trailer (magic, format version, CRC-32 of
  the IPC bytes, their length, the key). Cache files are untrusted input: a process
  checks the trailer, the CRC, the key, the schema and row count and validates the
  arrays in full the first time it maps a file; any mismatch is a corrupt entry,
  deleted and decoded again (never served). A file written or truncated while a
  process maps it (:mod:`torchgrain.io.changes` watches it) is let go by that process
  before it reads the map again, and decoded again (:meth:`DecodedCache.forget`).
* A build writes ``DIR/.tmp/<k>-<pid>-<random>`` and renames it into place: a file
  under its final name is always complete. A killed build leaves only a temp file,
  deleted by the next builder of its key or by eviction.
* An exclusive ``fcntl.flock`` on one of ``DIR/.locks/<n>`` (``n`` from the key) is
  held while building: processes that miss the same row group at once decode it once;
  the others wait, then map the published file. Locks are released by the kernel when
  a process dies; a wait gives up after ``lock_timeout`` seconds and decodes anyway
  (the rename is atomic either way).
* The directory holds at most ``max_bytes`` of entries: a publish that would exceed it
  first deletes the least recently used entries (by access time, refreshed when a
  process maps an entry and at most once a minute while it uses it), down to 90% of the
  budget, under ``DIR/.locks/evict``. Eviction only unlinks: processes that mapped a
  file keep reading it. The running total lives in ``DIR/.usage`` (recounted whenever
  an eviction runs).
* The cache never fills its disk: an entry is written only while the filesystem keeps
  ``min_free_bytes`` free after it (5% of the filesystem, at most 8 GiB, by default), least
  recently used entries deleted first to make room.
* A directory that refuses writes (full, read-only, deleted while in use, a file size
  limit) never fails a read: the row group is served as decoded, not stored, and the
  process warns once, naming the directory, the file it could not write, the row group
  and the remedy (a full disk, quota or size limit as a
  :class:`~torchgrain.CacheDiskFullError`'s message). Nothing partial is left: the temp
  file is removed. A deleted directory is made again at the next build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import struct
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from torchgrain.caches import announce, size_text
from torchgrain.errors import CorruptDataError
from torchgrain.io import process
from torchgrain.io.atomic import disk_full_errno, disk_full_error, naming_full_disk
from torchgrain.io.changes import Pin
from torchgrain.io.mounts import NETWORK_FILESYSTEMS, filesystem_type
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
_LOCK_STRIPES = 256
_TMP = ".tmp"
_LOCKS = ".locks"
_USAGE = ".usage"
_EVICT_TO = 0.9  # an eviction frees space down to this share of the budget
_TOUCH_SECONDS = 60.0
_LOCK_POLL = 0.005
_LOCK_POLL_MAX = 0.1
# The default min_free_bytes: this share of the filesystem, at most _MIN_FREE_CAP (a
# tenth of a 250 GB disk that is 90% full left a cache that never stored anything).
_MIN_FREE_SHARE = 0.05
_MIN_FREE_CAP = 8 << 30
# After the disk had no room for an entry, builds store nothing for this long (instead
# of listing the entries to make room at every row group decoded meanwhile).
_FULL_SECONDS = 30.0


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


class DecodedCache:
    """A byte-bounded, LRU, multi-process cache of decoded Arrow tables on local disk.

    Args:
        directory: local directory for the entries (created if missing). Put it on a
            local disk, not a network filesystem: the locks are ``flock``.
        max_bytes: budget for the entries' files; least recently used entries are
            deleted to stay under it. An entry larger than the budget is not stored.
            Default: 64 GiB, or half of what the disk has free plus what the cache
            already holds there, whichever is less.
        min_free_bytes: free space the cache leaves on its filesystem: an entry is
            stored only while at least this much stays free (least recently used
            entries are deleted first to make room). Default:
            :func:`default_min_free_bytes` (5% of the filesystem, at most 8 GiB).
        lock_timeout: the longest a process waits for another one's build of the same
            entry before decoding it itself.

    Counters (this process only) are in :attr:`stats`: ``hits`` (entries mapped),
    ``builds`` (entries this process decoded and published), ``waits`` (hits that
    waited for another process's build), ``corrupt`` (invalid files found and
    deleted), ``changed`` (entries let go as their file changed while mapped:
    :meth:`forget`), ``evictions``, ``bytes_written``, ``not_stored`` (builds served without
    being stored: too large, no room on the disk, or the directory refused them).

    The object holds no lock or map between calls (only descriptors of two small
    bookkeeping files, never pickled): it pickles small and is safe to share with
    forked or spawned DataLoader workers.

    Example:
        >>> import tempfile, pyarrow as pa
        >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20)
        >>> t = pa.table({"x": [1, 2, 3]})
        >>> key = entry_key("example.parquet", 0)
        >>> got, path = cache.get_or_build(key, lambda: t, schema=t.schema, num_rows=3)
        >>> got.to_pydict(), cache.stats["builds"], path == cache.path_of(key)
        ({'x': [1, 2, 3]}, 1, True)
        >>> again, _ = cache.get_or_build(key, lambda: 1 / 0, schema=t.schema, num_rows=3)
        >>> again.equals(t), cache.stats["hits"]
        (True, 1)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        min_free_bytes: int | None = None,
        lock_timeout: float = 600.0,
    ) -> None:
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0
        ):
            raise ValueError(f"max_bytes must be an integer > 0, got {max_bytes!r}")
        if min_free_bytes is not None and (
            not isinstance(min_free_bytes, int)
            or isinstance(min_free_bytes, bool)
            or min_free_bytes < 0
        ):
            raise ValueError(f"min_free_bytes must be an integer >= 0, got {min_free_bytes!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.lock_timeout = float(lock_timeout)
        self.max_bytes = max_bytes  # (None: set below, once the directory is there)
        with naming_full_disk(
            "the decoded Parquet cache", self.directory, self.directory, self._remedy()
        ):
            self._make_dirs()
        disk = shutil.disk_usage(self.directory)
        if max_bytes is None:
            # What the cache holds (its running total) it may keep: a later run reuses it.
            try:
                with open(os.path.join(self.directory, _USAGE), "rb") as f:
                    data = f.read(8)
                held = max(0, struct.unpack("<q", data)[0]) if len(data) == 8 else 0
            except OSError:
                held = 0
            max_bytes = max(1, min(DEFAULT_DECODED_CACHE_BYTES, (disk.free + held) // 2))
        self.max_bytes = max_bytes
        if min_free_bytes is None:
            min_free_bytes = default_min_free_bytes(disk.total)
        self.min_free_bytes = min_free_bytes
        self._init_process()

    def _make_dirs(self) -> None:
        for sub in (_TMP, _LOCKS):
            os.makedirs(os.path.join(self.directory, sub), exist_ok=True)

    def _init_process(self) -> None:
        self._token = process.token()
        self._lock = threading.Lock()
        # (device, inode) -> (size, mtime_ns) of files this process has verified
        self._verified: dict[tuple[int, int], tuple[int, int]] = {}
        self._fds: dict[str, int] = {}
        self._warned = False  # of a refused write (once per process)
        self._full_until = 0.0  # no room on the disk: store nothing until then
        # flock excludes processes, not the threads of one sharing a descriptor.
        self._evict_thread_lock = threading.Lock()
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "hits",
                "builds",
                "waits",
                "corrupt",
                "changed",
                "evictions",
                "bytes_written",
                "not_stored",
            ),
            0,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "max_bytes": self.max_bytes,
            "min_free_bytes": self.min_free_bytes,
            "lock_timeout": self.lock_timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process()

    def __repr__(self) -> str:
        return f"DecodedCache({self.directory!r}, max_bytes={self.max_bytes})"

    # ------------------------------------------------------------------ public
    def path_of(self, key: str) -> str:
        """Where the entry ``key`` lives (whether or not it is cached now)."""
        _check_key(key)
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
        table, path, _ = self.get_or_build_pinned(
            key, build, schema=schema, num_rows=num_rows, name=name
        )
        return table, path

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
            >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20)
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
        with self._stripe(key):
            # Another process may have built it while we waited for the lock.
            table, pin = self._open(path, key, schema, num_rows)
            if table is not None:
                self._count(hits=1, waits=1)
                return table, path, pin
            self._remove_temps(key)
            built = build()
            if built.num_rows != num_rows or not built.schema.equals(schema):
                raise ValueError(f"{name or key}: built table does not match its schema/rows")
            if not self._publish(path, key, built, name or key):
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
            >>> cache = DecodedCache(tempfile.mkdtemp(), max_bytes=1 << 20)
            >>> t = pa.table({"x": [1]})
            >>> _, path, pin = cache.get_or_build_pinned(
            ...     entry_key("q", 0), lambda: t, schema=t.schema, num_rows=1)
            >>> cache.forget(path, pin); os.path.exists(path)
            False
        """
        self._check_process()
        dev, ino = pin.ident[:2]
        with self._lock:
            self._verified.pop((dev, ino), None)
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (dev, ino):
                os.unlink(path)
        self._count(changed=1)

    def touch(self, path: str) -> None:
        """Refresh an entry's LRU time (its access time)."""
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(path, (now, os.stat(path).st_mtime))

    def total_bytes(self) -> int:
        """Bytes of the entries now on disk (all processes).

        Example:
            >>> import tempfile
            >>> DecodedCache(tempfile.mkdtemp(), max_bytes=10).total_bytes()
            0
        """
        return sum(size for _, size, _ in self._entries())

    def clear(self) -> None:
        """Delete every entry (processes that mapped one keep reading it).

        Example:
            >>> import tempfile
            >>> DecodedCache(tempfile.mkdtemp(), max_bytes=10).clear()
        """
        self._check_process()
        with self._evict_lock():
            for _, _, p in self._entries():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            self._write_usage(0)

    # ----------------------------------------------------------------- opening
    def _open(
        self, path: str, key: str, schema: pa.Schema, num_rows: int, trusted: bool = False
    ) -> tuple[pa.Table | None, Pin | None]:
        """The mapped, checked table of ``path`` and its file's pin; None when there is
        none (a corrupt file is deleted, counted and reported as none)."""
        try:
            buf, st, pin = map_file_pinned(path)
        except OSError:  # missing, or unreadable (decoded again, and replaced if it can)
            return None, None
        try:
            table = self._check(buf, st, key, schema, num_rows, trusted)
        except CorruptDataError:
            self._count(corrupt=1)
            self._discard(path, st)
            return None, None
        now = time.time()
        if now - st.st_atime > _TOUCH_SECONDS:
            with contextlib.suppress(OSError):
                os.utime(path, (now, st.st_mtime))
        return table, pin

    def _check(
        self,
        buf: pa.Buffer,
        st: os.stat_result,
        key: str,
        schema: pa.Schema,
        num_rows: int,
        trusted: bool,
    ) -> pa.Table:
        size = buf.size
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
        ident = (st.st_dev, st.st_ino)
        first = self._verified.get(ident) != (st.st_size, st.st_mtime_ns)
        if first and not trusted and zlib.crc32(memoryview(body)) != crc:
            raise CorruptDataError("decoded cache file fails its checksum")
        try:
            reader = ipc.open_file(pa.BufferReader(body))
            table = reader.read_all()
            if first and not trusted:
                table.validate(full=True)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptDataError(f"decoded cache file does not read: {e}") from e
        if table.num_rows != num_rows or not table.schema.equals(schema):
            raise CorruptDataError("decoded cache file holds another schema or row count")
        if first:
            with self._lock:
                self._verified[ident] = (st.st_size, st.st_mtime_ns)
        return table

    def _discard(self, path: str, st: os.stat_result) -> None:
        """Delete a corrupt file, unless it was replaced meanwhile."""
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)

    # --------------------------------------------------------------- building
    def _publish(self, path: str, key: str, table: pa.Table, name: str) -> bool:
        """Write ``table`` (the entry ``name``) under a temp name and rename it to ``path``
        (we hold the key's lock). False when it was not stored."""
        tmp = os.path.join(self.directory, _TMP, f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        what = f" ({name})"
        try:
            if not self._room_on_disk(table.nbytes):
                self._refused(
                    f"the disk would keep less than min_free_bytes={self.min_free_bytes:,} "
                    f"bytes free after writing {path!r}{what}. {self._remedy()}"
                )
                return False
            nbytes = self._write(tmp, table, key)
            if nbytes > self.max_bytes:
                self._count(not_stored=1)
                return False
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with self._evict_lock():
                total = self._read_usage()
                if total is None or total + nbytes > self.max_bytes:
                    total = self._make_room(nbytes)
                os.replace(tmp, path)
                self._write_usage(total + nbytes)
        except OSError as e:  # the directory refused it (full, read-only, deleted...)
            code = disk_full_errno(e)
            if code is not None:  # full disk, quota or size limit: say so, and what to do
                full = disk_full_error(
                    code,
                    "the decoded Parquet cache",
                    self.directory,
                    tmp,
                    self._remedy(),
                    what=what,
                )
                self._refused(f"{full}", full=True)
            else:
                self._refused(f"{type(e).__name__}: {e} (writing {tmp!r}{what}). {self._remedy()}")
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._count(builds=1, bytes_written=nbytes)
        announce(
            "the decoded Parquet cache",
            self.directory,
            f"{size_text(self.max_bytes or 0)}, leaving {size_text(self.min_free_bytes)} free "
            "on its disk; decoded_cache_bytes= sets it, decoded_cache=False turns it off",
        )
        return True

    def _room_on_disk(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more leave ``min_free_bytes`` free on the disk, once least
        recently used entries are deleted to make room if need be."""
        if time.monotonic() < self._full_until:
            return False
        short = self.min_free_bytes + nbytes - shutil.disk_usage(self.directory).free
        if short <= 0:
            return True
        with self._evict_lock():
            self._write_usage(self._make_room(0, short))
        # (files that processes still map free their blocks only when unmapped)
        if self.min_free_bytes + nbytes <= shutil.disk_usage(self.directory).free:
            return True
        self._full_until = time.monotonic() + _FULL_SECONDS
        return False

    def _remedy(self) -> str:
        now = "" if self.max_bytes is None else f", now {self.max_bytes:,} bytes"
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

    def _remove_temps(self, key: str) -> None:
        """Delete temp files of ``key`` left by killed builds (we hold its lock)."""
        tmp_dir = os.path.join(self.directory, _TMP)
        with contextlib.suppress(OSError), os.scandir(tmp_dir) as it:
            for e in it:
                if e.name.startswith(key + "-"):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)

    # ---------------------------------------------------------------- eviction
    def _entries(self) -> list[tuple[float, int, str]]:
        """``(access time, size, path)`` of every entry."""
        out = []
        with os.scandir(self.directory) as top:
            subdirs = [e.path for e in top if len(e.name) == 2 and e.is_dir()]
        for d in subdirs:
            with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
                for e in it:
                    if not e.name.endswith(".arrow"):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append((st.st_atime, st.st_size, e.path))
        return out

    def _make_room(self, nbytes: int, short: int = 0) -> int:
        """Delete least recently used entries until ``nbytes`` more fit under 90% of the
        budget, and ``short`` bytes more are free; return the bytes left (we hold the
        eviction lock)."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        target = max(0, min(int(self.max_bytes * _EVICT_TO) - nbytes, total - short))
        for _, size, p in entries:
            if total <= target:
                break
            try:
                os.unlink(p)  # processes that mapped it keep reading it (POSIX)
            except FileNotFoundError:
                continue
            total -= size
            self._count(evictions=1)
        self._sweep_temps()
        return total

    def _sweep_temps(self) -> None:
        """Delete temp files whose builder is gone (its key's lock is free)."""
        tmp_dir = os.path.join(self.directory, _TMP)
        try:
            with os.scandir(tmp_dir) as it:
                names = [e.name for e in it]
        except OSError:
            return
        for name in names:
            key = name.split("-", 1)[0]
            if len(key) != 32:
                continue
            with self._flock(self._stripe_path(key), blocking=False) as free:
                if free:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(tmp_dir, name))

    # The running total is 8 bytes written in place (under the eviction lock): a rename
    # over an existing file makes some filesystems (ext4) flush it, about 1 ms each time.
    def _read_usage(self) -> int | None:
        data = os.pread(self._fd(_USAGE), 8, 0)
        return struct.unpack("<q", data)[0] if len(data) == 8 else None

    def _write_usage(self, total: int) -> None:
        os.pwrite(self._fd(_USAGE), struct.pack("<q", max(0, total)), 0)

    def _fd(self, name: str) -> int:
        """This process's descriptor of a small shared file (kept open: each publish
        uses it; a forked child opens its own, as a lock on an inherited descriptor
        would be shared with the parent). Opened again when the file under its name is
        another one (the directory was deleted and made again): a lock on the old one
        would exclude nobody."""
        path = os.path.join(self.directory, _LOCKS if name == "evict" else "", name)
        fd = self._fds.get(name)
        if fd is not None:
            try:
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    return fd
            except FileNotFoundError:
                pass
            del self._fds[name]
            os.close(fd)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:
            self._make_dirs()
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        self._fds[name] = fd
        return fd

    @contextlib.contextmanager
    def _evict_lock(self) -> Iterator[None]:
        with self._evict_thread_lock:
            fd = self._fd("evict")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def __del__(self) -> None:
        if getattr(self, "_token", None) == process.token():
            for fd in getattr(self, "_fds", {}).values():
                with contextlib.suppress(OSError):
                    os.close(fd)

    # ------------------------------------------------------------------- locks
    def _stripe_path(self, key: str) -> str:
        return os.path.join(self.directory, _LOCKS, str(int(key[:8], 16) % _LOCK_STRIPES))

    @contextlib.contextmanager
    def _stripe(self, key: str) -> Iterator[None]:
        """Hold the build lock of ``key``'s stripe (waiting at most ``lock_timeout``;
        without it when the lock file cannot be made: the rename keeps entries whole)."""
        path = self._stripe_path(key)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except FileNotFoundError:  # the directory was deleted: make it again
                self._make_dirs()
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            yield
            return
        try:
            locked = False
            deadline = time.monotonic() + self.lock_timeout
            pause = _LOCK_POLL
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break  # build without it: the rename keeps the entry whole
                    time.sleep(pause)
                    pause = min(pause * 2, _LOCK_POLL_MAX)
            try:
                yield
            finally:
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _flock(self, lock_path: str, *, blocking: bool = True) -> Iterator[bool]:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
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

    def _check_process(self) -> None:
        if self._token != process.token():  # a forked child: counters and locks are its own
            verified = self._verified  # (files checked by the parent stay checked)
            self._init_process()
            self._verified = dict(verified)

    def _count(self, **kw: int) -> None:
        self._check_process()
        with self._lock:
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

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:  # the caller closes the file itself, after the trailer
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _check_key(key: str) -> None:
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(f"a decoded cache key is 32 lowercase hex digits, got {key!r}")
