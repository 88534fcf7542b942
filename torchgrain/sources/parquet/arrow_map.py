"""Files mapped read-only as Arrow buffers, with no file descriptor kept per map.

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "m")
    >>> _ = open(p, "wb").write(b"arrow")
    >>> buf, st = map_file(p)
    >>> buf.to_pybytes(), st.st_size
    (b'arrow', 5)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any

import pyarrow as pa

__all__ = ["map_file"]

# Maps are made with libc's mmap and the file closed at once: a Python mmap object
# keeps a duplicate file descriptor per map, and a process may map thousands of row
# groups (the open-file limit is often 1024). The map is released when the last Arrow
# buffer over it is freed.
_libc: Any = None


class _Mapping:
    __slots__ = ("addr", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size

    def __del__(self) -> None:
        if _libc is not None and self.addr:
            _libc.munmap(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.size))


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def map_file(path: str) -> tuple[pa.Buffer, os.stat_result]:
    """A read-only map of the whole file as an Arrow buffer, and its stat."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            return pa.py_buffer(b""), st
        try:
            libc = _load_libc()
        except (OSError, AttributeError):  # no libc mmap here: Python's (keeps an fd)
            return pa.py_buffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ)), st
        addr = libc.mmap(None, st.st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {path}: {os.strerror(err)}")
        return pa.foreign_buffer(addr, st.st_size, base=_Mapping(addr, st.st_size)), st
    finally:
        os.close(fd)
