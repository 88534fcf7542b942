"""Belady eviction for the shard cache: the rule against a brute-force optimum on small
traces, against LRU, and inside a real on-disk ShardCache fed by read-ahead's hints."""

from __future__ import annotations

import functools
import os
import threading

import fsspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.io.eviction import next_uses, simulate, victims
from torchgrain.io.shard_cache import ShardCache


def _best_hits(trace: tuple[int, ...], capacity: int) -> int:
    """The most hits any eviction choices give (unit sizes, the item read is kept)."""

    @functools.cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(trace):
            return 0
        item = trace[i]
        if item in cached:
            return 1 + best(i + 1, cached)
        full = cached | {item}
        if len(full) <= capacity:
            return best(i + 1, full)
        return max(best(i + 1, full - {v}) for v in cached)

    return best(0, frozenset())


traces = st.lists(st.integers(0, 5), min_size=1, max_size=14).map(tuple)


@settings(max_examples=300, deadline=None)
@given(trace=traces, capacity=st.integers(1, 4))
def test_belady_gets_as_many_hits_as_any_eviction_could(trace, capacity):
    assert simulate(trace, capacity=capacity, policy="belady").hits == _best_hits(trace, capacity)


@settings(max_examples=300, deadline=None)
@given(trace=traces, capacity=st.integers(1, 4))
def test_lru_never_beats_belady_and_a_horizon_past_the_end_changes_nothing(trace, capacity):
    belady = simulate(trace, capacity=capacity, policy="belady")
    assert simulate(trace, capacity=capacity, policy="lru").hits <= belady.hits
    assert simulate(trace, capacity=capacity, policy="belady", horizon=len(trace)) == belady
    # Downloads are the misses: every byte fetched once per miss.
    assert belady.bytes_downloaded == len(trace) - belady.hits


@given(trace=st.lists(st.integers(0, 9), max_size=30))
def test_next_uses_points_at_the_next_access_of_the_same_item(trace):
    nxt = next_uses(trace)
    for i, item in enumerate(trace):
        later = [j for j in range(i + 1, len(trace)) if trace[j] == item]
        assert nxt[i] == (later[0] if later else len(trace))


def test_victims_go_furthest_next_use_first_and_never_the_one_kept():
    entries = [(1, 10, "a"), (2, 10, "b"), (3, 10, "c"), (4, 10, "d")]
    uses = {"a": 50, "b": 10, "c": 90}
    assert [k for _, _, k in victims(entries, uses, 25, keep="d")] == ["c", "a", "b"]
    assert [k for _, _, k in victims(entries, uses, 5, keep="")] == ["d"]  # never used


def test_a_belady_cache_evicts_the_copy_used_furthest_ahead_not_the_oldest(tmp_path):
    mem = fsspec.filesystem("memory")
    for k in range(3):
        mem.pipe(f"/belady/s{k}", bytes([k]) * 100)
    urls = [f"memory://belady/s{k}" for k in range(3)]
    for policy, evicted in (("lru", 0), ("belady", 1)):
        cache = ShardCache(tmp_path / policy, max_bytes=250, eviction=policy)
        cache.fetch(urls[0])
        os.utime(cache._sum_path(cache.local_path(urls[0])), (1, 1))  # s0: the oldest use
        cache.fetch(urls[1])
        cache.advise({urls[0]: 10, urls[1]: 500, urls[2]: 20})  # s1 is needed last
        cache.fetch(urls[2])  # no room for three
        gone = [k for k in range(3) if not os.path.exists(cache.local_path(urls[k]))]
        assert gone == [evicted], policy


def test_read_ahead_tells_a_belady_cache_each_shards_next_use(tmp_path):
    d = tmp_path / "ds"
    tg.write_array_record([{"x": i} for i in range(400)], d, num_shards=8)
    mem = fsspec.filesystem("memory")
    for name in os.listdir(d):
        mem.pipe(f"/ra-belady/{name}", (d / name).read_bytes())
    cache = ShardCache(tmp_path / "c", max_bytes=1 << 30, eviction="belady")
    src = tg.ArrayRecordSource("memory://ra-belady", cache_dir=cache)
    order = np.random.default_rng(0).permutation(400)
    reached = [0]
    src.read_ahead(lambda a, b: order[a:b], 0, 400, position=lambda: reached[0])
    shards = src.index.locate(order)[0]
    names = [os.path.basename(cache.local_path(p)) for p in src.paths]
    for _ in range(3000):  # until all 8 shards have a hint
        if len(cache.next_uses()) == 8:
            break
        threading.Event().wait(0.01)
    hints = cache.next_uses()
    assert [hints[n] for n in names] == [int(np.flatnonzero(shards == k)[0]) for k in range(8)]
    reached[0] = 400  # the pass is over: the walk ends
    assert src._proc().read_ahead.join(timeout=60)
