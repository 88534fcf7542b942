"""Files mapped read-only as Arrow buffers, with no file descriptor kept per map.

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "m")
    >>> _ = open(p, "wb").write(b"arrow")
    >>> buf, st = map_file(p)
    >>> buf.to_pybytes(), st.st_size
    (b'arrow', 5)
    >>> buf, st, pin = map_file_pinned(p)
    >>> pin.size
    5
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pyarrow as pa

from torchgrain.io.changes import Pin, open_regular
from torchgrain.io.libc import libc

__all__ = ["map_file", "map_file_pinned"]

# Maps are made with libc's mmap and the file closed at once: a Python mmap object
# keeps a duplicate file descriptor per map, and a process may map thousands of row
# groups (the open-file limit is often 1024). The map is released when the last Arrow
# buffer over it is freed.


class _Mapping:
    __slots__ = ("addr", "pin", "size")

    def __init__(self, addr: int, size: int, pin: Pin | None = None) -> None:
        self.addr = addr
        self.size = size
        self.pin = pin  # watched while mapped

    def __del__(self) -> None:
        lib = libc()
        if lib is not None and self.addr:
            lib.munmap(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.size))


def map_file(path: str) -> tuple[pa.Buffer, os.stat_result]:
    """A read-only map of the whole file as an Arrow buffer, and its stat."""
    return map_file_pinned(path)[:2]


def map_file_pinned(path: str, *, ctime: bool = True) -> tuple[pa.Buffer, os.stat_result, Pin]:
    """:func:`map_file`, and the file's :class:`~torchgrain.io.changes.Pin` (taken before
    it is mapped, watched while the map lives; ``ctime`` as there): check it before
    reading the buffer again later, as a file truncated meanwhile would kill the process
    with SIGBUS."""
    fd = open_regular(path)
    try:
        pin = Pin(fd, path, ctime=ctime)
        st = os.fstat(fd)
        if st.st_size == 0:
            return pa.py_buffer(b""), st, pin
        lib = libc()
        if lib is None:  # no libc mmap here: Python's (keeps an fd)
            return pa.py_buffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ)), st, pin
        addr = lib.mmap(None, st.st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {path}: {os.strerror(err)}")
        base = _Mapping(addr, st.st_size, pin)
        return pa.foreign_buffer(addr, st.st_size, base=base), st, pin
    finally:
        os.close(fd)
