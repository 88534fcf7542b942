"""The decoded Parquet cache against a link in place of a key folder and against a lock
stripe another process holds for good: it never reads, writes or deletes through such a
link, and a stripe waited for in vain costs one wait, then its entries are decoded
without the cache until it is free."""

from __future__ import annotations

import os
import time
import warnings
import zlib

import pyarrow as pa
import pytest

from tests._locks import hold_flock
from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key


def _cache(directory, **kw) -> DecodedCache:
    return DecodedCache(str(directory), max_bytes=1 << 20, min_free_bytes=0, **kw)


def _get(cache: DecodedCache, key: str, table: pa.Table, calls: list | None = None):
    def build() -> pa.Table:
        if calls is not None:
            calls.append(key)
        return table

    return cache.get_or_build(key, build, schema=table.schema, num_rows=len(table))


# ------------------------------------------------------- a linked key folder
def test_an_entry_behind_a_linked_key_folder_is_not_served_and_none_is_stored(tmp_path):
    table, key = pa.table({"x": [1, 2]}), entry_key("p", 0)
    other = _cache(tmp_path / "other")  # a sound entry of that key, elsewhere
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, elsewhere = _get(other, key, table)
    cache = _cache(tmp_path / "cache")
    os.symlink(os.path.dirname(elsewhere), tmp_path / "cache" / key[:2])
    before = os.stat(elsewhere)
    calls: list[str] = []
    with pytest.warns(UserWarning, match="folder is a link"):
        got, path = _get(cache, key, table, calls)
    assert got.equals(table) and path is None and calls == [key]  # decoded, not mapped
    assert cache.stats["hits"] == 0 and cache.stats["not_stored"] == 1
    after = os.stat(elsewhere)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(os.listdir(os.path.dirname(elsewhere))) == [os.path.basename(elsewhere)]


def test_a_corrupt_file_behind_a_linked_key_folder_is_not_deleted(tmp_path):
    table, key = pa.table({"x": [1, 2]}), entry_key("q", 0)
    cache = _cache(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{key}.arrow").write_bytes(b"a user's file" * 10)
    os.symlink(elsewhere, tmp_path / "cache" / key[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, path = _get(cache, key, table)
    assert got.equals(table) and path is None
    assert (elsewhere / f"{key}.arrow").read_bytes() == b"a user's file" * 10


def test_the_key_folders_of_a_cache_whose_directory_is_a_link_are_used(tmp_path):
    (tmp_path / "disk").mkdir()
    os.symlink(tmp_path / "disk", tmp_path / "cache")
    cache, table, key = _cache(tmp_path / "cache"), pa.table({"x": [3]}), entry_key("r", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, path = _get(cache, key, table)
        again, path2 = _get(cache, key, pa.table({"x": [9]}))  # (a hit: not built)
    assert path == path2 and again.to_pydict() == {"x": [3]}
    assert os.listdir(tmp_path / "disk" / key[:2]) == [f"{key}.arrow"]


# ------------------------------------------------------------- a stuck stripe
def _same_stripe(n: int) -> list[str]:
    keys = [entry_key(f"part-{i}.parquet", 0) for i in range(4000)]
    stripe = zlib.crc32(keys[0].encode()) % DecodedCache._STRIPES
    return [k for k in keys if zlib.crc32(k.encode()) % DecodedCache._STRIPES == stripe][:n]


def test_a_stripe_held_for_good_costs_one_wait_then_decodes_uncached_until_free(tmp_path):
    cache, table = _cache(tmp_path / "cache", lock_timeout=0.5), pa.table({"x": [1, 2, 3]})
    keys = _same_stripe(4)
    lock = cache._lock_path(keys[0])
    fd = hold_flock(lock)
    try:
        start = time.monotonic()
        with pytest.warns(UserWarning, match="held by another process") as said:
            for key in keys[:3]:
                got, path = _get(cache, key, table)
                assert got.equals(table) and path is None
        took = time.monotonic() - start
    finally:
        os.close(fd)
    assert 0.5 <= took < 1.2, took  # one lock_timeout, not three
    assert len([w for w in said if "held by another process" in str(w.message)]) == 1
    assert lock in str(said[0].message) and cache.stats["not_stored"] == 3
    assert not any(os.path.exists(cache.path_of(k)) for k in keys[:3])
    # Its holder gone: the next entry of the stripe is cached again, the lock no longer stuck.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, path = _get(cache, keys[3], table)
    assert path == cache.path_of(keys[3]) and os.path.exists(path)
    assert cache._stuck == set()


def test_a_stuck_stripe_leaves_the_other_stripes_cached(tmp_path):
    cache, table = _cache(tmp_path / "cache", lock_timeout=0.2), pa.table({"x": [1]})
    (stuck,) = _same_stripe(1)
    other = next(
        entry_key("other", i)
        for i in range(100)
        if cache._lock_path(entry_key("other", i)) != cache._lock_path(stuck)
    )
    fd = hold_flock(cache._lock_path(stuck))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _get(cache, stuck, table)[1] is None
            assert _get(cache, other, table)[1] == cache.path_of(other)
    finally:
        os.close(fd)


def test_a_forked_child_keeps_knowing_a_stuck_stripe(tmp_path):
    cache, table = _cache(tmp_path / "cache", lock_timeout=2.0), pa.table({"x": [1]})
    first, second = _same_stripe(2)
    fd = hold_flock(cache._lock_path(first))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _get(cache, first, table)[1] is None  # (one wait: now known stuck)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                start = time.monotonic()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _, path = _get(cache, second, table)
                code = 0 if path is None and time.monotonic() - start < 1.5 else 3
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        os.close(fd)
