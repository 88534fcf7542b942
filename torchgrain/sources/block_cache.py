"""BlockCache: a per-process LRU cache bounded by the bytes of what it holds.

Sources keep decoded blocks (Parquet row groups) here so that block-local access
patterns, such as :class:`~torchgrain.BlockShuffleSampler` order or a batch that hits
the same row group many times, pay for one decode per block instead of one per record.

The cache lives in one process. A source holding one drops it in a forked child (the
child starts with a fresh, empty cache), so DataLoader workers never share or copy
their parent's entries.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

__all__ = ["DEFAULT_CACHE_BYTES", "BlockCache", "CacheInfo", "held_bytes"]

DEFAULT_CACHE_BYTES = 256 << 20

_CACHES: weakref.WeakSet[BlockCache] = weakref.WeakSet()


def held_bytes() -> int:
    """The bytes charged to every :class:`BlockCache` alive in this process."""
    return sum(c._bytes for c in list(_CACHES))


class CacheInfo(NamedTuple):
    """Counters of a :class:`BlockCache` (like :func:`functools.lru_cache`'s)."""

    hits: int
    misses: int
    evictions: int
    max_bytes: int
    current_bytes: int
    entries: int


class BlockCache:
    """Least-recently-used cache whose budget is a number of bytes.

    Args:
        max_bytes: the most bytes the entries may add up to (their sizes are given by
            the caller, see :meth:`put`). ``0`` disables caching: nothing is stored and
            every :meth:`get_or_load` loads.

    An entry larger than ``max_bytes`` is never stored (it would evict everything and
    still not fit). Thread-safe: one lock guards the bookkeeping; loads run outside it.

    Example:
        >>> cache = BlockCache(max_bytes=100)
        >>> cache.get_or_load("a", lambda: ("A", 60))
        'A'
        >>> cache.get_or_load("a", lambda: ("never called", 60))
        'A'
        >>> cache.get_or_load("b", lambda: ("B", 60))   # evicts "a": 120 > 100
        'B'
        >>> cache.cache_info()
        CacheInfo(hits=1, misses=2, evictions=1, max_bytes=100, current_bytes=60, entries=1)
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()
        _CACHES.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable, default: Any = None) -> Any:
        """Return the value for ``key`` (and mark it recently used), counting a hit or miss."""
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                self._misses += 1
                return default
            self._entries.move_to_end(key)
            self._hits += 1
            return item[0]

    def get_many(self, keys: list[Hashable]) -> list[Any]:
        """:meth:`get` for several keys under one lock (``None`` for the absent ones)."""
        out: list[Any] = []
        with self._lock:
            entries = self._entries
            for key in keys:
                item = entries.get(key)
                if item is None:
                    self._misses += 1
                    out.append(None)
                else:
                    entries.move_to_end(key)
                    self._hits += 1
                    out.append(item[0])
        return out

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Store ``value`` costing ``nbytes``; evict least recently used entries to fit.

        Returns whether the value was stored (``False`` when it is larger than the
        whole budget or the cache is disabled).
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if nbytes > self.max_bytes or self.max_bytes == 0:
                return False
            while self._entries and self._bytes + nbytes > self.max_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self._bytes -= size
                self._evictions += 1
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            return True

    def get_or_load(self, key: Hashable, load: Callable[[], tuple[Any, int]]) -> Any:
        """Return the cached value, or call ``load() -> (value, nbytes)`` and cache it."""
        sentinel = _MISSING
        value = self.get(key, sentinel)
        if value is not sentinel:
            return value
        value, nbytes = load()
        self.put(key, value, nbytes)
        return value

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def cache_info(self) -> CacheInfo:
        """Hits, misses, evictions, the byte budget, bytes held and number of entries."""
        with self._lock:
            return CacheInfo(
                self._hits,
                self._misses,
                self._evictions,
                self.max_bytes,
                self._bytes,
                len(self._entries),
            )

    def __getstate__(self) -> dict[str, Any]:
        # A cache never travels: a pickled copy (e.g. to a spawned worker) starts empty.
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_bytes"])

    def __repr__(self) -> str:
        i = self.cache_info()
        return (
            f"BlockCache(max_bytes={i.max_bytes}, current_bytes={i.current_bytes}, "
            f"entries={i.entries}, hits={i.hits}, misses={i.misses})"
        )


_MISSING = object()
