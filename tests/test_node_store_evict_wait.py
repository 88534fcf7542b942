"""A node-local store's eviction lock held by another process: a write waits for it a
bounded time, then is refused, naming the lock; the same process then tries it once."""

from __future__ import annotations

import fcntl
import os
import time

import pytest

from torchgrain.io import node_store
from torchgrain.io.node_store import NodeStore


def test_a_held_eviction_lock_refuses_the_write_then_is_tried_once(tmp_path, monkeypatch):
    monkeypatch.setattr(node_store, "_EVICT_WAIT", 0.3)
    sleeps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(node_store.time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    store = NodeStore(str(tmp_path), max_bytes=100)
    (tmp_path / ".locks").mkdir()
    lock = str(tmp_path / ".locks" / "evict.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)  # (another open file: flock excludes it)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with store._lock("a"), pytest.raises(BlockingIOError, match=r"evict\.lock"):
            store._reserve("a", 3)
        assert time.monotonic() - start >= 0.3
        assert store._temps() == []  # its reservation is not left behind
        sleeps.clear()
        with store._lock("b"), pytest.raises(BlockingIOError):
            store._reserve("b", 3)
        assert sleeps == []  # one try, no wait
    finally:
        os.close(fd)
    with store._lock("c"):  # free again: taken at the first try
        tmp = store._reserve("c", 3)
        store._publish(tmp, str(tmp_path / "c"), 0)
    assert store.total_bytes() == 0 and os.path.exists(tmp_path / "c")


def test_a_held_eviction_lock_refuses_one_download_and_leaves_the_shard_cache_on(
    tmp_path, monkeypatch
):
    # Many processes queued on the lock are not a full disk: the download that waited in
    # vain is refused (its read goes by ranges), and the cache stays in use afterwards.
    import uuid

    import fsspec

    from torchgrain.errors import CacheDiskFullError
    from torchgrain.io.shard_cache import ShardCache

    monkeypatch.setattr(node_store, "_EVICT_WAIT", 0.2)
    url = f"memory://evict-{uuid.uuid4().hex}/shard-0"
    fsspec.filesystem("memory").pipe(url, b"r" * 100)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=1000)
    (tmp_path / "cache" / ".locks").mkdir(parents=True, exist_ok=True)
    fd = os.open(str(tmp_path / "cache" / ".locks" / "evict.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CacheDiskFullError, match="holds that lock"):
            cache.fetch(url, size=100)
        assert not cache.disk_full
    finally:
        os.close(fd)
    monkeypatch.setattr(NodeStore, "_evict_stuck", (None, 0.0))
    with open(cache.fetch(url, size=100), "rb") as f:
        assert f.read() == b"r" * 100
    assert not cache.disk_full


def test_a_copy_whose_download_grows_is_waited_for_past_the_lock_wait(tmp_path, monkeypatch):
    # Another process holds a copy's lock while its download grows: a reader waits for
    # it however long it takes (the wait bound is for a holder that makes no progress).
    import threading
    import uuid

    import fsspec

    from torchgrain.io import shard_cache
    from torchgrain.io.shard_cache import ShardCache

    monkeypatch.setattr(shard_cache, "_ENTRY_WAIT", 0.2)
    url = f"memory://grow-{uuid.uuid4().hex}/shard-0"
    fsspec.filesystem("memory").pipe(url, b"r" * 100)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=1000)
    cache.fetch(url, size=100)
    locks = tmp_path / "cache" / ".locks"
    (lock,) = [n for n in os.listdir(locks) if n != "evict.lock"]
    name = lock[: -len(".lock")]
    for f in os.listdir(tmp_path / "cache"):  # (the copy gone: fetched again)
        if f.startswith(name[:8]) and os.path.isfile(tmp_path / "cache" / f):
            os.unlink(tmp_path / "cache" / f)
    fd = os.open(str(locks / lock), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    tmp_dir = tmp_path / "cache" / cache._TMP_DIR
    temp = tmp_dir / f"{cache._TMP_PREFIX}{name}-100-1-abcdef12"

    def download() -> None:  # grows for 1 s, then gives up its lock
        with open(temp, "wb") as f:
            for _ in range(10):
                f.write(b"x")
                f.flush()
                time.sleep(0.1)
        os.unlink(temp)
        os.close(fd)

    t = threading.Thread(target=download)
    start = time.monotonic()
    t.start()
    try:
        with open(cache.fetch(url, size=100), "rb") as f:
            assert f.read() == b"r" * 100
        assert time.monotonic() - start >= 0.9  # waited past the 0.2 s bound
    finally:
        t.join()
