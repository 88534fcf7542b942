"""How many files and memory maps a process may hold: sized from the system's limits.

A dataset of 10,000 shards cannot keep one file descriptor per shard open on a default
``ulimit -n`` of 1024, nor one memory map per shard per process where there are
100,000 shards (``vm.max_map_count`` is 65,530 by default). Sources size what they keep
open from these limits instead of assuming them away.

Example:
    >>> open_files_limit() >= 1 and map_count_limit() >= 1
    True
"""

from __future__ import annotations

import contextlib
import threading

try:
    import resource
except ImportError:  # pragma: no cover - not on Linux or macOS
    resource = None  # type: ignore[assignment]

__all__ = [
    "default_max_open_files",
    "free_maps",
    "map_count_limit",
    "maps_in_use",
    "open_files_limit",
    "raise_open_files_limit",
]

# Descriptors and maps left for everything else a process holds (sockets, pipes, torch's
# shared-memory tensors, the interpreter's own libraries).
_RESERVED_FDS = 256
_RESERVED_MAPS = 4096
_DEFAULT_MAP_COUNT = 65530  # Linux's default vm.max_map_count
_lock = threading.Lock()


def open_files_limit() -> int:
    """This process's soft limit on open file descriptors (``ulimit -n``)."""
    if resource is None:  # pragma: no cover
        return 1024
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_files_limit(wanted: int) -> int:
    """Raise the soft limit on open files toward ``wanted`` (never above the hard limit,
    never lowering it); returns the soft limit now in force. Children (DataLoader
    workers) inherit it.

    Example:
        >>> raise_open_files_limit(1) == open_files_limit()
        True
    """
    if resource is None:  # pragma: no cover
        return open_files_limit()
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return open_files_limit()


def default_max_open_files(num_files: int, fds_per_file: int = 2) -> int:
    """How many readers of ``num_files`` shard files (``fds_per_file`` descriptors each)
    a process keeps open: all of them when the limit allows (raising the soft limit
    toward the hard one where that makes room), else what a quarter of the limit holds.

    Example:
        >>> default_max_open_files(4)
        4
    """
    wanted = num_files * fds_per_file * 4 + _RESERVED_FDS
    limit = raise_open_files_limit(wanted) if wanted > open_files_limit() else open_files_limit()
    return max(1, min(num_files, (limit - _RESERVED_FDS) // 4 // fds_per_file))


def map_count_limit() -> int:
    """``vm.max_map_count``: how many memory maps a process may hold (Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return _DEFAULT_MAP_COUNT


def maps_in_use() -> int:
    """How many memory maps this process holds now (Linux; 0 where unknown)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def free_maps() -> int:
    """Memory maps this process may still add, keeping a reserve for everything else.

    Example:
        >>> free_maps() >= 0
        True
    """
    return max(0, map_count_limit() - maps_in_use() - _RESERVED_MAPS)
