"""Node-local stores and links: a store's own folders and lock files, and an index
directory's stamps folder, are never followed when they are links (the store's directory
itself may be one); a copy's lock another process holds is waited for a bounded time."""

from __future__ import annotations

import fcntl
import os
import time
import uuid

import fsspec
import pytest

from torchgrain.errors import CacheDiskFullError
from torchgrain.io import shard_cache
from torchgrain.io.retry import RetryPolicy
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources.node_index import store as node_index


def _remote(data: bytes) -> str:
    url = f"memory://links-{uuid.uuid4().hex}/shard-0"
    fsspec.filesystem("memory").pipe(url, data)
    return url


def test_a_cache_dir_that_is_a_link_to_a_directory_is_used(tmp_path):
    (tmp_path / "disk").mkdir()
    os.symlink(tmp_path / "disk", tmp_path / "cache")
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=1000)
    with open(cache.fetch(_remote(b"a" * 10), size=10), "rb") as f:
        assert f.read() == b"a" * 10
    assert not cache.disk_full
    assert sorted(os.listdir(tmp_path / "disk" / ".locks"))


def test_a_lock_folder_that_is_a_link_turns_the_cache_off(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "cache" / ".locks")
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=1000)
    assert cache.disk_full and "link" in str(cache._full_error)
    with pytest.raises(CacheDiskFullError, match=r"\.locks"):
        cache.fetch(_remote(b"a"), size=1)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_held_copy_lock_refuses_the_copy_within_the_deadline_then_is_tried_once(tmp_path):
    url = _remote(b"r" * 100)
    cache = ShardCache(str(tmp_path), max_bytes=1000, retry=RetryPolicy(deadline=0.3))
    lock = os.path.join(tmp_path, ".locks", os.path.basename(cache.local_path(url)) + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with pytest.raises(CacheDiskFullError, match="holds that lock") as e:
            cache.fetch(url, size=100)
        assert 0.3 <= time.monotonic() - start < 2 and url in str(e.value)
        start = time.monotonic()
        with pytest.raises(CacheDiskFullError):
            cache.fetch(url, size=100)
        assert time.monotonic() - start < 0.2  # one try, no wait
        assert not cache.disk_full
    finally:
        os.close(fd)
    with open(cache.fetch(url, size=100), "rb") as f:  # free again: taken at once
        assert f.read() == b"r" * 100


def test_the_copy_lock_wait_is_at_most_the_module_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_cache, "_ENTRY_WAIT", 0.2)
    url = _remote(b"r")
    cache = ShardCache(str(tmp_path), max_bytes=1000)  # (a 90 s deadline)
    lock = os.path.join(tmp_path, ".locks", os.path.basename(cache.local_path(url)) + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with pytest.raises(CacheDiskFullError):
            cache.fetch(url, size=1)
        assert time.monotonic() - start < 2
    finally:
        os.close(fd)


def test_stamps_are_written_found_and_pruned_in_their_own_folder(tmp_path):
    stamp = str(tmp_path / node_index._STAMPS / "abc")
    assert not node_index._stamped(stamp)
    node_index._write_stamp(stamp)
    assert node_index._stamped(stamp)
    old = time.time() - 8 * 86400
    os.utime(stamp, (old, old))
    node_index._prune_stamps(str(tmp_path))
    assert not os.path.exists(stamp)


def test_a_stamps_folder_that_is_a_link_is_never_written_read_or_pruned(tmp_path):
    (tmp_path / "ix").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "ix" / node_index._STAMPS)
    (tmp_path / "elsewhere" / "abc").write_text("")
    stamp = str(tmp_path / "ix" / node_index._STAMPS / "abc")
    assert not node_index._stamped(stamp)  # (verified again: not trusted through a link)
    node_index._write_stamp(str(tmp_path / "ix" / node_index._STAMPS / "new"))
    old = time.time() - 8 * 86400
    os.utime(tmp_path / "elsewhere" / "abc", (old, old))
    node_index._prune_stamps(str(tmp_path / "ix"))
    assert os.listdir(tmp_path / "elsewhere") == ["abc"]


def test_a_folder_made_a_link_after_the_cache_was_made_is_refused_in_its_workers(tmp_path):
    import pickle
    import shutil

    cache = ShardCache(str(tmp_path / "cache"), max_bytes=1000)
    (tmp_path / "elsewhere").mkdir()
    shutil.rmtree(tmp_path / "cache" / ".sums")
    os.symlink(tmp_path / "elsewhere", tmp_path / "cache" / ".sums")
    worker = pickle.loads(pickle.dumps(cache))  # (a DataLoader worker's)
    assert worker.disk_full and r".sums" in str(worker._full_error)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_batch_whose_copies_locks_are_held_reads_by_ranges_without_a_word(tmp_path):
    import io
    import pickle
    import warnings

    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    base = f"memory://links-{uuid.uuid4().hex}"
    for i in range(2):
        buf = io.BytesIO()
        pq.write_table(pa.table({"x": list(range(i * 10, i * 10 + 10))}), buf)
        fsspec.filesystem("memory").pipe(f"{base}/s{i}.parquet", buf.getvalue())
    paths = [f"{base}/s0.parquet", f"{base}/s1.parquet"]
    retry = RetryPolicy(deadline=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the cache's notice)
        src = tg.ParquetSource(paths, cache_dir=str(tmp_path), retry=retry, io_threads=2)
        src.__getitems__([1, 15])  # (the copies and their locks made)
    fds = []
    for n in os.listdir(tmp_path / ".locks"):
        if n != "evict.lock":
            fds.append(os.open(tmp_path / ".locks" / n, os.O_RDWR))
            fcntl.flock(fds[-1], fcntl.LOCK_EX)
    try:
        worker = pickle.loads(pickle.dumps(src))  # (a process that has no copy open)
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert worker.cached_copies.prefetch([0, 1]) == {}  # (a batch's opens)
            assert worker.__getitems__([1, 15]) == [{"x": 1}, {"x": 15}]
            assert worker[3] == {"x": 3}
        assert time.monotonic() - start < 3
        assert not worker.cached_copies.cache.disk_full
    finally:
        for fd in fds:
            os.close(fd)
