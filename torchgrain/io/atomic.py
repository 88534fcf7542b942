"""Atomic local writes: a file appears under its name complete, or not at all.

Every file torchgrain writes (shards, manifests, the conversion journal, index and shard
caches) goes through this module. A writer fills a temporary file in the same
directory (a rename across filesystems is not atomic) and then :func:`publish` gives it
its mode, flushes it to disk where a crash must not lose it, and renames it into place.
On an error the temporary file is removed.

A write that finds no room (a full disk, a spent quota, a file-size limit: see
:data:`DISK_FULL_ERRNOS`) leaves nothing under the final name either; the caches turn it
into a :class:`~torchgrain.CacheDiskFullError` that names their directory, the file and
the remedy (:func:`naming_full_disk`).

The mode is what a plain ``open(path, "w")`` would give: ``0o666`` less the process
umask. ``tempfile.mkstemp`` would make it ``0o600``, and libraries that write files
themselves (ArrayRecord's C++ writer, Arrow) choose their own, so the mode is set
explicitly before the rename: on shared storage another user or a job under another
account can read what was written whenever the umask allows it.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> atomic_write_bytes(os.path.join(d, "a.json"), b"{}")
    >>> with atomic_path(os.path.join(d, "b.bin")) as tmp:
    ...     with open(tmp, "wb") as f:
    ...         _ = f.write(b"xyz")
    >>> sorted(os.listdir(d)), oct(os.stat(os.path.join(d, "a.json")).st_mode & 0o777) == oct(
    ...     file_mode())
    (['a.json', 'b.bin'], True)
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import uuid
from collections.abc import Iterator
from typing import IO, Any

from torchgrain.errors import CacheDiskFullError

__all__ = [
    "DISK_FULL_ERRNOS",
    "atomic_open",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "current_umask",
    "disk_full_errno",
    "disk_full_error",
    "file_mode",
    "naming_full_disk",
    "publish",
    "temp_name",
]

#: The ``errno`` values of a write that found no room: the filesystem is full (ENOSPC), the
#: user's quota is spent (EDQUOT), or the file outgrew a size limit (EFBIG: the
#: filesystem's largest file, or the process's RLIMIT_FSIZE with SIGXFSZ ignored).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the system tells it.

    Linux (4.7 and later) reports it in ``/proc/self/status``; elsewhere it is read by
    setting it and putting it back at once, under a lock (another thread creating a
    file in between would see the momentary value).

    Example:
        >>> old = os.umask(0o027)
        >>> oct(current_umask())
        '0o27'
        >>> _ = os.umask(old)
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from ``open(path, "w")``: ``0o666`` less the umask.

    Example:
        >>> old = os.umask(0o022)
        >>> oct(file_mode())
        '0o644'
        >>> _ = os.umask(old)
    """
    return 0o666 & ~current_umask()


def temp_name(path: str | os.PathLike[str]) -> str:
    """A hidden name beside ``path`` for its temporary file: ``DIR/.NAME.tmp-PID-RANDOM``.

    Unique per process and call; readers that list a directory skip hidden names.

    Example:
        >>> temp_name("/data/x.parquet").startswith("/data/.x.parquet.tmp-")
        True
    """
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    tmp: str, path: str | os.PathLike[str], *, durable: bool = True, mode: int | None = None
) -> None:
    """Rename a complete temporary file ``tmp`` to ``path``, with the umask's mode.

    ``durable=True`` first flushes the file's data to disk and afterwards the directory
    entry, so that after a crash ``path`` holds either the old or the whole new content
    (what shards and manifests need); caches that can be rebuilt skip it. ``mode``
    (default :func:`file_mode`) is for a worker process writing on behalf of another
    whose umask it may not share (a fork server started before the umask changed).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> tmp = temp_name(os.path.join(d, "x"))
        >>> with open(tmp, "wb") as f:
        ...     _ = f.write(b"1")
        >>> publish(tmp, os.path.join(d, "x"))
        >>> os.listdir(d)
        ['x']
    """
    path = os.fspath(path)
    if durable:
        _fsync(tmp)
    os.chmod(tmp, file_mode() if mode is None else mode)
    os.replace(tmp, path)
    if durable:
        with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
            _fsync(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[str]:
    """A temporary path beside ``path`` for any writer; published when the block ends.

    The body writes the file (with any library: Arrow, ArrayRecord, numpy). If the body
    raises, the temporary file is removed and ``path`` is left as it was.

    Example:
        >>> import tempfile, numpy as np
        >>> p = os.path.join(tempfile.mkdtemp(), "a.npy")
        >>> with atomic_path(p, durable=False) as tmp:
        ...     with open(tmp, "wb") as f:
        ...         np.save(f, np.arange(3))
        >>> np.load(p).tolist()
        [0, 1, 2]
    """
    tmp = temp_name(path)
    try:
        yield tmp
        publish(tmp, path, durable=durable)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], mode: str = "wb", *, durable: bool = True, **kwargs: Any
) -> Iterator[IO[Any]]:
    """``open(path, mode)`` for writing, published atomically when the block ends.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.txt")
        >>> with atomic_open(p, "w") as f:
        ...     _ = f.write("hello")
        >>> open(p).read()
        'hello'
    """
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes a whole file: mode must be 'w' or 'wb', not {mode!r}")
    with atomic_path(path, durable=durable) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`).

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "b.bin")
        >>> atomic_write_bytes(p, b"abc", durable=False)
        >>> open(p, "rb").read()
        b'abc'
    """
    with atomic_open(path, "wb", durable=durable) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, durable: bool = True) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_path`).

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "m.json")
        >>> atomic_write_text(p, '{"a": 1}')
        >>> open(p).read()
        '{"a": 1}'
    """
    atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def disk_full_errno(exc: BaseException) -> int | None:
    """The errno of the first write that found no room (:data:`DISK_FULL_ERRNOS`) in
    ``exc`` or the exceptions it wraps (``__cause__``, ``__context__``: libraries wrap
    the ``OSError`` of the write, e.g. Arrow's), else None.

    Example:
        >>> disk_full_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
        True
        >>> disk_full_errno(OSError(errno.EACCES, "Permission denied")) is None
        True
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e.errno
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def naming_full_disk(
    cache: str, directory: str, path: str, remedy: str, *, what: str = ""
) -> Iterator[None]:
    """Raise a write in the body that found no room as a
    :class:`~torchgrain.CacheDiskFullError` (an ``OSError`` with the same ``errno``) naming
    ``cache`` (what it is), its ``directory``, the file ``path`` being written (``what``
    says more of it) and the ``remedy``; other errors pass unchanged. The body removes
    what it wrote (the atomic helpers above do).

    Example:
        >>> try:
        ...     with naming_full_disk("the shard cache", "/c", "/c/x", "Free space in /c."):
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        ... except OSError as e:
        ...     print(e)
        [Errno 28] No space left on device: the shard cache in '/c' cannot write '/c/x'. Free space in /c.
    """
    try:
        yield
    except CacheDiskFullError:
        raise
    except Exception as e:
        code = disk_full_errno(e)
        if code is None:
            raise
        raise disk_full_error(code, cache, directory, path, remedy, what=what) from e


def disk_full_error(
    code: int, cache: str, directory: str, path: str, remedy: str, *, what: str = ""
) -> CacheDiskFullError:
    """The :class:`~torchgrain.CacheDiskFullError` of :func:`naming_full_disk`, for
    callers that report it instead of raising it.

    Example:
        >>> str(disk_full_error(errno.EFBIG, "the index", "/i", "/i/a", "Use index_dir=."))
        "[Errno 27] File too large: the index in '/i' cannot write '/i/a'. Use index_dir=."
    """
    return CacheDiskFullError(
        code,
        f"{os.strerror(code)}: {cache} in {directory!r} cannot write {path!r}{what}. {remedy}",
        directory=directory,
        path=path,
    )
