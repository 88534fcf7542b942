"""The C library's ``mmap`` and ``munmap``, typed for ctypes, loaded once per process;
its allocator's ``malloc_trim``.

Python's :mod:`mmap` cannot map at a chosen address (:mod:`torchgrain.io.region` needs
that) and keeps a file descriptor per map (:mod:`torchgrain.sources.parquet.arrow_map`
maps thousands of files); both call libc directly through this module.

Example:
    >>> lib = libc()
    >>> lib is None or callable(lib.mmap)
    True
    >>> trim_heap()
"""

from __future__ import annotations

import ctypes
from ctypes import c_int, c_long, c_size_t, c_void_p
from typing import Any

__all__ = ["libc", "trim_heap"]

_libc: Any = None  # None: not loaded yet; False: not available here


def libc() -> Any | None:
    """The process's C library with ``mmap``/``munmap`` prototypes set, or None where it
    has no ``mmap`` (not a POSIX system)."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            mmap_fn, munmap_fn = lib.mmap, lib.munmap
        except (OSError, AttributeError):
            _libc = False
            return None
        mmap_fn.restype = c_void_p
        mmap_fn.argtypes = [c_void_p, c_size_t, c_int, c_int, c_int, c_long]
        munmap_fn.restype = c_int
        munmap_fn.argtypes = [c_void_p, c_size_t]
        _libc = lib
    return _libc or None


def trim_heap() -> None:
    """Give the C allocator's free memory back to the system: glibc's ``malloc_trim(0)``,
    which releases the free pages of every arena, those of threads that have exited
    included (what an index build's threads freed). Nothing where the C library has no
    ``malloc_trim`` (musl, macOS)."""
    lib = libc()
    trim = getattr(lib, "malloc_trim", None) if lib is not None else None
    if trim is not None:
        trim(0)
