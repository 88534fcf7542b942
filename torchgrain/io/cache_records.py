"""The small files a :class:`~torchgrain.io.shard_cache.ShardCache` keeps beside its copies.

* The CRC record of each copy, ``DIR/.sums/<copy name>``: ``"crc32:<hex> <size>
  [<version>]"``, the CRC-32 and size of the bytes that passed the download's checks, and
  the remote file's version they are of (where the store names one). A hit is served only
  while the copy matches it (its :func:`file_crc`, computed again whenever its
  :func:`file_identity` changes) and is of the version read; the record's modification
  time is the copy's last use (its LRU position).
* The next-use hints of ``eviction="belady"``, ``DIR/.next-use``: one ``"<copy name>
  <position>"`` line per copy, the position in the sampler's order of its next use.

Both are replaced atomically: a record through a temp file of one name per copy
(``.<copy name>.tmp``, written under the copy's lock), so a killed writer's goes at the
copy's next download without a listing of the records; the hints through
:func:`~torchgrain.io.atomic.atomic_write_text`. They are the cache's own files, but anyone who can write to the directory can change them:
a malformed record reads as none (the copy is downloaded again), a malformed hint as
no hint (hints only order evictions).

What the records guarantee: a copy holds what was downloaded unless it changed within
one clock tick of its last check (milliseconds, on kernels without fine-grained
timestamps), or while a reader had it mapped (that reader sees the change), or unless
whoever changed it also rewrote its record: anyone who can write to the directory can
do that, so keep it writable only by the jobs that share it.

Example:
    >>> import os, tempfile
    >>> record = os.path.join(tempfile.mkdtemp(), "copy")
    >>> write_record(record, "crc32:352441c2", 3)
    >>> read_record(record)
    ('crc32:352441c2', 3)
"""

from __future__ import annotations

import contextlib
import os
import zlib

from torchgrain.io.atomic import atomic_write_text, publish
from torchgrain.io.changes import open_regular

__all__ = [
    "Identity",
    "file_crc",
    "file_identity",
    "read_hints",
    "read_record",
    "write_hints",
    "write_record",
]

SUM_DIR = ".sums"  # the CRC of each copy, as downloaded
NEXT_FILE = ".next-use"  # eviction="belady": copy name -> its next use (read-ahead's hints)
_READ_BLOCK = 1 << 20  # bytes file_crc reads at a time


#: A file's identity for the checks: (device, inode, size, modification time, change time).
Identity = tuple[int, int, int, int, int]


def file_identity(st: os.stat_result) -> Identity:
    """What changes when a file is replaced or written to: its identity for the checks
    (device, inode, size, modification time, change time). The change time is set by
    the kernel on every write, truncation, rename, link or ``utime()``, and never back,
    so restoring the modification time (``touch -r``) still changes the identity.

    (Within one tick of the kernel's clock, a few milliseconds on kernels without
    fine-grained timestamps, a second change may leave both times as they were.)

    Example:
        >>> dev, ino, size, mtime, ctime = file_identity(os.stat("."))
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_crc(path: str) -> tuple[str, Identity]:
    """``("crc32:<hex>", identity)`` of a local file, read once.

    Read into a buffer, not through a map: a copy truncated while it is hashed (by
    another job sharing the directory, or a user) ends the read early, and the CRC then
    fails the record, where reading a map past the new end would kill the process with
    SIGBUS. Hashing a copy (after its download, and when its identity changed) reads
    about 0.8x as fast as through a map (the copy into the buffer; 1 MiB at a time,
    which stays in the CPU's cache, costs least).

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(p, "wb").write(b"abc")
        >>> file_crc(p)[0]
        'crc32:352441c2'
    """
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        crc = 0
        if st.st_size:
            buf = memoryview(bytearray(min(_READ_BLOCK, st.st_size)))
            while n := f.readinto(buf):
                crc = zlib.crc32(buf[:n], crc)
    return f"crc32:{crc:08x}", file_identity(st)


def write_record(record: str, crc: str, size: int, version: str | None = None) -> None:
    """Record at ``record`` the CRC and size of a copy that passed its download's checks,
    and the version of the remote file it is (one word; None: none known). The caller
    holds the copy's lock: the temp file has one name per record, and a killed writer's
    is replaced (a link put there is not followed: an ``OSError``)."""
    tmp = os.path.join(os.path.dirname(record), f".{os.path.basename(record)}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, 0o666), "w") as f:
            f.write(f"{crc} {size}{f' {version}' if version else ''}\n")
        publish(tmp, record, durable=False)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(record: str, version: str | None = None) -> tuple[str, int] | None:
    """``(crc, size)`` recorded at ``record``; None when there is none, it is malformed, or
    it is of another ``version`` than the one given (a copy of another version of the
    remote file, or without one: downloaded again).

    Example:
        >>> import os, tempfile
        >>> record = os.path.join(tempfile.mkdtemp(), "copy")
        >>> write_record(record, "crc32:352441c2", 3, "v1")
        >>> read_record(record, "v1"), read_record(record, "v2")
        (('crc32:352441c2', 3), None)
    """
    try:
        # (open_regular: a FIFO put in its place would wait for a writer forever)
        with open(open_regular(record)) as f:
            text = f.read(200)
        crc, size, *recorded = text.split()
        if len(recorded) > 1 or (version is not None and recorded != [version]):
            return None
        return crc, int(size)
    except (OSError, ValueError):  # (a CorruptDataError is a ValueError)
        return None


def write_hints(path: str, hints: dict[str, int]) -> None:
    """Replace the next-use hints at ``path``: copy name -> position of its next use.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), ".next-use")
        >>> write_hints(p, {"a": 3, "b": 9})
        >>> read_hints(p)
        {'a': 3, 'b': 9}
    """
    atomic_write_text(path, "".join(f"{n} {u}\n" for n, u in hints.items()), durable=False)


def read_hints(path: str) -> dict[str, int]:
    """The next-use hints at ``path`` (see :func:`write_hints`), malformed lines ignored."""
    out: dict[str, int] = {}
    try:
        with open(open_regular(path)) as f:  # (see read_record)
            text = f.read(64 << 20)
    except (OSError, ValueError):
        return out
    for line in text.splitlines():
        name, _, use = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[name] = int(use)
    return out
