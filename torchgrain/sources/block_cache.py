"""BlockCache: a per-process LRU cache bounded by the bytes of what it holds, and the
check that a sampler's pass fits such caches.

Sources keep decoded blocks (Parquet row groups) here so that block-local access
patterns, such as :class:`~torchgrain.BlockShuffleSampler` order or a batch that hits
the same row group many times, pay for one decode per block instead of one per record.

The cache lives in one process. A source holding one drops it in a forked child (the
child starts with a fresh, empty cache), so DataLoader workers never share or copy
their parent's entries.

A cache too small for an access pattern thrashes: a global shuffle over data ten times
a row-group cache decodes a whole row group for nearly every record. :func:`check_fit`
tells, before a pass reads anything, from the pass's order (samplers hand it to the
source at the start of each pass, see :meth:`~torchgrain.Source.read_ahead`): it
replays the start of the pass through a simulated LRU cache of the same budget and
reports a :class:`CacheFit` with the numbers (working set, hit rate, loads per record)
and what to do instead.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from torchgrain.sources.options import DEFAULT_CACHE_BYTES

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "BlockCache",
    "CacheBlocks",
    "CacheFit",
    "CacheInfo",
    "check_fit",
    "held_bytes",
]


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
        self._bytes = self._hits = self._misses = self._evictions = 0
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
        with self._lock:
            items = [self._entries.get(key) for key in keys]
            for key, item in zip(keys, items):
                if item is not None:
                    self._entries.move_to_end(key)
            misses = items.count(None)
            self._hits += len(keys) - misses
            self._misses += misses
        return [None if item is None else item[0] for item in items]

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
        value = self.get(key, _MISSING)
        if value is not _MISSING:
            return value
        value, nbytes = load()
        self.put(key, value, nbytes)
        return value

    @property
    def evictions(self) -> int:
        """Entries evicted so far (to make room for others)."""
        return self._evictions

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


# ------------------------------------------------------------------ fitting a pass
#: Indices of a pass's order generated and replayed at a time.
_CHUNK = 1 << 14
#: Block changes replayed once the simulated cache is full: its hit rate within ~1%.
_STEADY = 1 << 13
#: The most indices replayed (a cache that has not filled by then is taken to fit).
_MAX_SAMPLE = 1 << 20
#: An order whose first indices fill less than half the cache is local (a block
#: shuffle, a sequential read): its blocks come and go, each loaded once.
_LOCAL_AFTER = 1 << 17
#: A pass thrashes when its blocks would be loaded more than this many times each, on
#: average, over the pass (1 is ideal: each block loaded once).
_THRASH_LOADS = 2.0


@dataclass(frozen=True)
class CacheBlocks:
    """What a source's cache holds, in the terms :func:`check_fit` needs.

    ``offsets`` (int64, ``num_blocks + 1``): block ``b`` holds records
    ``[offsets[b], offsets[b + 1])``. ``nbytes(blocks)``: each block's cost in the cache
    (an int64 array for an array of block numbers). ``capacity``: the cache's budget in
    bytes (``per_process``: every process has one of its own, else one for the machine).
    ``cache`` names the cache and ``unit`` its blocks in messages; ``remedies`` are what
    the user can do when a pass does not fit.
    """

    cache: str
    unit: str
    offsets: np.ndarray
    nbytes: Callable[[np.ndarray], np.ndarray]
    capacity: int
    per_process: bool
    remedies: tuple[str, ...]
    #: What all blocks cost together, when known cheaply: a pass over data that fits
    #: whole needs no replay.
    total: int | None = None


@dataclass(frozen=True)
class CacheFit:
    """Whether a sampler's pass fits a cache, from a replay of its start (see
    :func:`check_fit`).

    ``sampled`` indices of the pass were replayed; they touch ``blocks`` distinct blocks
    (``working_set_bytes`` together) of a cache of ``capacity_bytes``. ``hit_rate`` is
    the simulated LRU's share of hits once the cache was full (1.0 when it never
    filled). ``loads_per_record`` and ``loads_per_block`` are the block loads of the
    whole pass, per index and per block it touches (1.0: each loaded once, the least
    possible): counted when the replay is the whole pass, else the replay's loads plus
    the rest of the pass at the rate of its steady state (once the cache was full).
    """

    source: str
    cache: str
    unit: str
    capacity_bytes: int
    per_process: bool
    sampled: int
    blocks: int
    working_set_bytes: int
    hit_rate: float
    loads_per_record: float
    loads_per_block: float
    remedies: tuple[str, ...]

    @property
    def fits(self) -> bool:
        """False when the pass thrashes the cache (its blocks load over twice each)."""
        return self.loads_per_block <= _THRASH_LOADS

    def message(self, batch_size: int = 256) -> str:
        """The diagnosis in words, with the numbers and the remedies."""
        where = "per process" if self.per_process else "for the machine"
        cache = f"the {self.cache} ({_size(self.capacity_bytes)} {where})"
        if self.sampled == 0:
            return (
                f"{self.source}: the whole dataset ({self.blocks:,} {self.unit}s, "
                f"~{_size(self.working_set_bytes)}) fits {cache}."
            )
        verdict = "fits" if self.fits else "does not fit"
        remedies = (
            "" if self.fits or not self.remedies else "Remedies: " + "; ".join(self.remedies) + "."
        )
        return (
            f"{self.source}: this pass's working set {verdict} {cache}. "
            f"Its first {self.sampled:,} indices "
            f"touch {self.blocks:,} {self.unit}s (~{_size(self.working_set_bytes)}); "
            f"replayed through an LRU cache of that size they hit "
            f"{100 * self.hit_rate:.0f}% of the time once it is full: over the pass, "
            f"{self.loads_per_record:.2f} {self.unit} loads per record (~"
            f"{self.loads_per_record * batch_size:,.0f} per batch of {batch_size}), each "
            f"{self.unit} loaded {self.loads_per_block:,.1f} times instead of once. " + remedies
        ).strip()


def check_fit(
    source: str,
    blocks: CacheBlocks,
    order: Callable[[int, int], Any],
    start: int,
    count: int,
) -> CacheFit | None:
    """Replay the start of a pass through a simulated LRU cache like ``blocks``'.

    ``order(a, b)`` gives the indices at positions ``[a, b)`` of the pass (what samplers
    hand to :meth:`~torchgrain.Source.read_ahead`); ``start`` and ``count`` the
    positions to come. Replays 16,384 indices at a time until the simulated cache has
    been full for 8,192 block changes (its steady state: the rest of the pass is
    estimated at that rate), the pass ends, or about a million indices were replayed;
    a cache that has not filled by then (or not half by the 131,072th index: a local
    order) is taken to fit. The replay is of one stream:
    each DataLoader worker sees a share of the batches, which for a global shuffle has
    the same hit rate in a cache of its own, and for a block shuffle the same blocks
    (unless the sampler deals each worker its own part).

    Example:
        >>> import numpy as np
        >>> b = CacheBlocks("cache", "block", np.arange(0, 1001, 10),
        ...                 lambda ids: np.full(len(ids), 100), 1000, True, ())
        >>> shuffled = np.random.default_rng(0).permutation(1000)
        >>> fit = check_fit("src", b, lambda a, z: shuffled[a:z], 0, 1000)
        >>> fit.fits, fit.blocks, round(fit.hit_rate, 1)      # 10 of 100 blocks fit
        (False, 100, 0.1)
        >>> check_fit("src", b, lambda a, z: np.arange(a, z), 0, 1000).fits  # in order
        True
    """
    if count <= 0 or blocks.capacity <= 0:
        return None
    offsets = np.asarray(blocks.offsets, dtype=np.int64)
    num_blocks = max(1, len(offsets) - 1)
    fit = functools.partial(
        CacheFit,
        source=source,
        cache=blocks.cache,
        unit=blocks.unit,
        capacity_bytes=int(blocks.capacity),
        per_process=blocks.per_process,
        remedies=blocks.remedies,
    )
    if blocks.total is not None and blocks.total <= blocks.capacity:
        return fit(  # the whole dataset fits: each block loads once at most
            sampled=0,
            blocks=num_blocks,
            working_set_bytes=int(blocks.total),
            hit_rate=1.0,
            loads_per_record=min(1.0, num_blocks / count),
            loads_per_block=1.0,
        )
    lru = _LRU(blocks.capacity)
    touched: list[np.ndarray] = []
    sampled = changes = 0
    last = -1
    while sampled < count and sampled < _MAX_SAMPLE:
        a = start + sampled
        idx = np.asarray(order(a, a + min(_CHUNK, count - sampled)), dtype=np.int64)
        if len(idx) == 0:
            break
        sampled += len(idx)
        ids = offsets.searchsorted(idx, side="right") - 1
        # Consecutive indices in one block hit whatever the cache: replay the changes.
        stream = ids[np.diff(ids, prepend=last) != 0]
        last = int(ids[-1])
        distinct = np.unique(stream)
        touched.append(distinct)
        costs = np.asarray(blocks.nbytes(distinct), dtype=np.int64)
        lru.replay(stream.tolist(), dict(zip(distinct.tolist(), costs.tolist())))
        changes += len(stream)
        if lru.steady >= _STEADY:
            break
        if sampled >= _LOCAL_AFTER and not lru.full and 2 * lru.used < blocks.capacity:
            break
    if sampled == 0:
        return None
    seen = np.unique(np.concatenate(touched))
    working = int(np.asarray(blocks.nbytes(seen), dtype=np.int64).sum())
    loads = float(lru.misses)
    spanned = len(seen)
    if sampled < count:  # the rest of the pass at the steady state's rate
        if lru.steady:
            loads += (count - sampled) * (changes / sampled) * lru.misses_after / lru.steady
        spanned = min(num_blocks, max(len(seen), round(len(seen) * count / sampled)))
    return fit(
        sampled=sampled,
        blocks=len(seen),
        working_set_bytes=working,
        hit_rate=1.0 if lru.steady == 0 else lru.hits_after / lru.steady,
        loads_per_record=loads / count,
        loads_per_block=max(1.0, loads / spanned) if lru.steady else lru.misses / len(seen),
    )


class _LRU:
    """A simulated LRU cache of ``capacity`` bytes, fed block numbers: counts its misses,
    and its hits and misses once it first had to evict (``steady`` of them)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.used = self.misses = self.hits_after = self.misses_after = 0
        self.full = False

    @property
    def steady(self) -> int:
        return self.hits_after + self.misses_after

    def replay(self, stream: list[int], costs: dict[int, int]) -> None:
        """Feed ``stream`` (block numbers; ``costs[b]`` bytes each)."""
        lru, capacity, used, full = self.blocks, self.capacity, self.used, self.full
        misses, hits_after, misses_after = self.misses, self.hits_after, self.misses_after
        for b in stream:
            if b in lru:
                lru.move_to_end(b)
                if full:
                    hits_after += 1
                continue
            misses += 1
            if full:
                misses_after += 1
            c = costs[b]
            if c > capacity:
                full = True  # never stored: as good as evicted at once
                continue
            while used + c > capacity:
                used -= lru.popitem(last=False)[1]
                full = True
            lru[b] = c
            used += c
        self.used, self.full = used, full
        self.misses, self.hits_after, self.misses_after = misses, hits_after, misses_after


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"
