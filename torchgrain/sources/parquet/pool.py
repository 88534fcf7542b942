"""Hand Arrow's freed decode buffers back to the system when the process grows.

A row group is decoded into Arrow's default memory pool (mimalloc or jemalloc in
pyarrow's wheels). When the source converts it to Python values, or the row-group cache
evicts it, its buffers go back to that pool, which keeps them for later Arrow
allocations. The Python values that replace them come from another allocator, so the
pool's freed pages never serve them: over a global-shuffle epoch the process held the
cache's contents *plus* the pool's high-water mark of freed buffers (256 MiB of cache
cost 490 MiB of private memory). Nor is what the pool keeps bounded by its live bytes:
mimalloc kept 45 MiB of freed pages while no more than one 10 MiB row group was live.

:class:`PoolTrimmer` calls the pool's ``release_unused()`` when the process's resident
memory *beyond what the block caches hold* (:func:`~torchgrain.sources.block_cache.held_bytes`)
has grown ``threshold`` bytes above its lowest point since the last release, and only
after reads that allocated or freed Arrow memory (a read served from the cache costs one
comparison). A cache filling up does not trigger releases (its growth is accounted
for); freed buffers the pool keeps do, once they reach about ``threshold`` bytes. A
release takes well under a millisecond with mimalloc, but the pages it returns are
faulted in again by the next decodes: releasing on the process's growth alone (the
cache filling up included) cost 18% of a short block-shuffle run's CPU time, and a
16 MiB threshold still made 9 releases in it where 32 MiB made none.
"""

from __future__ import annotations

import os
import threading

import pyarrow as pa

from torchgrain.io import process
from torchgrain.sources.block_cache import held_bytes

__all__ = ["RELEASE_BYTES", "PoolTrimmer", "resident_bytes", "trimmer"]

#: Growth of the resident set (above its lowest point since the last release) that
#: triggers a release.
RELEASE_BYTES = 32 << 20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _allocations(pool: pa.MemoryPool) -> tuple[int, int] | None:
    """What changes whenever ``pool`` allocates or frees: its live bytes and the running
    total of its allocations; None where pyarrow keeps no total (before 20). A read that
    allocates and frees as much leaves the live bytes as they were, so without the total
    every :meth:`PoolTrimmer.settle` looks at the process's size (one read of
    /proc/self/statm)."""
    total = getattr(pool, "total_bytes_allocated", None)
    return None if total is None else (pool.bytes_allocated(), total())


class PoolTrimmer:
    """Release a memory pool's unused memory when the process grows by ``threshold``
    beyond what the block caches hold.

    Call :meth:`settle` after a read, and wherever a read has just freed a decoded
    table. Thread-safe; one per process and pool.

    Example:
        >>> import pyarrow as pa
        >>> t = PoolTrimmer(pa.default_memory_pool(), threshold=1 << 20)
        >>> t.settle()   # no Arrow memory allocated or freed since it was made
        False
        >>> table = pa.table({"x": list(range(1_000_000))})
        >>> del table    # its 8 MB stay in the pool, resident
        >>> t.settle()   # the process grew past the threshold: released
        True
    """

    def __init__(self, pool: pa.MemoryPool, threshold: int = RELEASE_BYTES) -> None:
        self.pool = pool
        self.threshold = int(threshold)
        self.releases = 0
        self._seen = _allocations(pool)
        self._floor = resident_bytes() - held_bytes()
        self._lock = threading.Lock()

    def settle(self) -> bool:
        """Release the pool's unused memory if Arrow memory was allocated or freed since
        the last call and the process's resident size beyond the caches' contents grew
        ``threshold`` bytes above its lowest point since the last release; returns
        whether it did."""
        pool = self.pool
        seen = _allocations(pool)
        if seen is not None and seen == self._seen:
            return False
        self._seen = seen
        rss = resident_bytes() - held_bytes()  # what the caches do not account for
        with self._lock:
            if rss < self._floor:
                self._floor = rss
            if rss - self._floor < self.threshold:
                return False
            self.releases += 1
            pool.release_unused()
            self._floor = resident_bytes() - held_bytes()
        return True


_TRIMMER: PoolTrimmer | None = None
_TRIMMER_GENERATION = -1


def trimmer() -> PoolTrimmer:
    """This process's trimmer of Arrow's default memory pool (a fresh one after fork)."""
    global _TRIMMER, _TRIMMER_GENERATION
    if _TRIMMER is None or process.generation != _TRIMMER_GENERATION:
        _TRIMMER = PoolTrimmer(pa.default_memory_pool())
        _TRIMMER_GENERATION = process.generation
    return _TRIMMER
