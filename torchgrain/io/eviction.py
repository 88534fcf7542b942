"""Which cached shard to evict: least recently used, or the one used furthest in the future.

A sampler knows its whole order, so the next use of every shard is known ahead of time.
Belady's rule (MIN) evicts the cached shard whose next use lies furthest in the future
(never used again: first); for shards of equal size it is optimal: no policy has more
hits on the same sequence of accesses. :class:`~torchgrain.io.shard_cache.ShardCache`
applies it with ``eviction="belady"`` from next-use hints that read-ahead gives it
(:meth:`~torchgrain.io.shard_cache.ShardCache.advise`), which reach only as far as
read-ahead has scanned the order: a shard with no use known within that horizon counts
as never used again, least recently used first among those.

This module holds the rule and a simulator that replays a sequence of shard accesses
through a cache of a given byte budget under each policy (``benchmarks/eviction.py``
compares them; the tests check the rule against a brute-force optimum).

Example:
    >>> trace = [0, 1, 2, 0, 1, 3, 0, 1, 2, 3]
    >>> simulate(trace, capacity=2, policy="lru").hits
    0
    >>> simulate(trace, capacity=2, policy="belady").hits
    3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["EVICTION_POLICIES", "Simulation", "next_uses", "simulate", "victims"]

#: The policies :class:`~torchgrain.io.shard_cache.ShardCache` knows.
EVICTION_POLICIES = ("lru", "belady")

#: A next use that is not known (beyond the horizon, or never): evicted first.
NEVER = np.iinfo(np.int64).max


def next_uses(trace: Sequence[int] | np.ndarray) -> np.ndarray:
    """For each access ``i``, the position of the next access to the same item
    (``len(trace)`` when there is none).

    Example:
        >>> next_uses([5, 7, 5, 5]).tolist()
        [2, 4, 3, 4]
    """
    arr = np.asarray(trace, dtype=np.int64)
    order = np.argsort(arr, kind="stable")  # by item, then by position
    out = np.full(len(arr), len(arr), dtype=np.int64)
    same = arr[order[1:]] == arr[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


def victims(
    entries: Sequence[tuple[int, int, str]], next_use: dict[str, int], excess: int, keep: str
) -> list[tuple[int, int, str]]:
    """The entries to evict, in order, to free ``excess`` bytes under Belady's rule.

    ``entries`` are ``(last use, size, key)``; ``next_use`` maps a key to its next use
    (a key without one counts as never used again). Furthest next use first; among
    equal ones, least recently used first; ``keep`` (the shard being fetched) never.

    Example:
        >>> entries = [(1, 10, "a"), (2, 10, "b"), (3, 10, "c")]
        >>> [k for _, _, k in victims(entries, {"a": 5, "b": 9, "c": 7}, 15, keep="c")]
        ['b', 'a']
        >>> [k for _, _, k in victims(entries, {"a": 5}, 5, keep="")]  # b, c: never
        ['b']
    """
    ranked = sorted(
        (e for e in entries if e[2] != keep),
        key=lambda e: (-next_use.get(e[2], NEVER), e[0]),
    )
    out, freed = [], 0
    for e in ranked:
        if freed >= excess:
            break
        out.append(e)
        freed += e[1]
    return out


@dataclass
class Simulation:
    """What a replay of accesses through a cache gave."""

    policy: str
    accesses: int
    hits: int
    bytes_downloaded: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def simulate(
    trace: Sequence[int] | np.ndarray,
    *,
    capacity: int,
    policy: str = "lru",
    sizes: Sequence[int] | np.ndarray | None = None,
    horizon: int | None = None,
) -> Simulation:
    """Replay ``trace`` (item ids, one per access) through a cache of ``capacity``
    bytes (items of ``sizes[item]`` bytes, 1 each by default). A miss downloads the item
    and keeps it (a reader reads the local copy), evicting others until it fits.

    ``policy="belady"`` evicts by next use; with ``horizon``, only uses at most that
    many accesses ahead are known (what read-ahead has scanned): the others count as
    never, least recently used first, as :func:`victims` does.

    Example:
        >>> simulate([0, 1, 0, 2, 0, 1], capacity=2, policy="belady").hits
        2
    """
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"policy must be one of {EVICTION_POLICIES}, got {policy!r}")
    arr = np.asarray(trace, dtype=np.int64)
    size = (lambda item: 1) if sizes is None else (lambda item: int(sizes[item]))
    nxt = next_uses(arr)
    hits = downloaded = 0
    # Evict the cached item whose next use is furthest (as known at the time of the
    # eviction: within ``reach``, else never; under "lru", never for all), least
    # recently used among equals.
    reach = -1 if policy == "lru" else len(arr) if horizon is None else horizon
    cached: dict[int, tuple[int, int]] = {}  # item -> (true next use, last use)
    held = 0
    for i, item in enumerate(arr.tolist()):
        if item in cached:
            hits += 1
        else:
            downloaded += size(item)
            held += size(item)
        cached[item] = (int(nxt[i]), i)
        while held > capacity and len(cached) > 1:

            def rank(entry: tuple[int, tuple[int, int]], now: int = i) -> tuple[int, int]:
                use, last = entry[1]
                if use >= len(arr) or use - now > reach:
                    use = NEVER
                return (use, -last)

            victim = max((e for e in cached.items() if e[0] != item), key=rank)[0]
            held -= size(victim)
            del cached[victim]
    return Simulation(policy, len(arr), hits, downloaded)
