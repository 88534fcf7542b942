"""Review of the node-local store (torchgrain/io/node_store.py) under the shard cache and
the decoded Parquet cache: faults found by reproduction, with real processes and files
in tmp_path. Each test showed one fault (fixed since): seven were regressions against
the caches' code before the store, the last two older."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import warnings

import pyarrow as pa

from torchgrain.errors import DatasetNotFoundError
from torchgrain.io import remote
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

MARK = 0x5A5A_1234_5678_9ABC  # a value whose bytes are found in an entry's file


def _table(first: int, rows: int = 50) -> pa.Table:
    return pa.table({"x": pa.array([first, MARK, *range(first + 2, first + rows)], pa.int64())})


def _build(cache: DecodedCache, key: str, table: pa.Table) -> tuple[pa.Table, str | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the cache's notice of where it writes)
        return cache.get_or_build(key, lambda: table, schema=table.schema, num_rows=len(table))


def _remote_files(tmp_path, names: str, size: int = 1000) -> dict[str, str]:
    """``name -> file:// URL`` of local files standing for remote shards."""
    root = tmp_path / "remote"
    root.mkdir()
    urls = {}
    for n in names:
        (root / n).write_bytes(n.encode() * size)
        urls[n] = f"file://{root / n}"
    return urls


def _fork(child) -> int:
    """Run ``child()`` in a forked process; its exit status (0: it returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                code = 0 if child() else 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_decoded_cache_never_evicts_files_that_are_not_its_entries(tmp_path):
    # A job keeps its shard cache in a subdirectory of its decoded cache's directory
    # (cache_dir=ROOT/shards, decoded_cache=ROOT), a user keeps notes there too. The
    # decoded cache's eviction (and clear) must leave both alone: the shard copy is not
    # its entry, and its lock and record belong to the shard cache.
    root = tmp_path / "cache"
    urls = _remote_files(tmp_path, "a")
    shards = ShardCache(root / "shards", max_bytes=10_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the cache's notice of where it writes)
        copy = shards.fetch(urls["a"])
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_bytes(b"n" * 3000)
    cache = DecodedCache(root, max_bytes=4000, min_free_bytes=0)
    for i in range(3):  # (the cache counts 4,000 bytes that are not its entries: it evicts)
        _build(cache, entry_key("part.parquet", i), _table(i * 100))
    assert os.path.exists(copy) and (root / "notes" / "todo.txt").exists()
    cache.clear()
    assert os.path.exists(copy) and (root / "notes" / "todo.txt").exists()
    assert cache.total_bytes() == 0


def test_a_decoded_cache_temp_file_of_the_previous_layout_is_swept(tmp_path):
    cache = DecodedCache(tmp_path / "cache", max_bytes=4000, min_free_bytes=0)
    key, other = entry_key("a.parquet", 0), entry_key("b.parquet", 0)
    tmp_dir = tmp_path / "cache" / ".tmp"
    # What a build killed under the previous release left (its writer is gone: its
    # stripe's lock is free), one of the key built next and one of another key.
    left = [tmp_dir / f"{key}-99999-deadbeef", tmp_dir / f"{other}-99999-deadbeef"]
    for p in left:
        p.write_bytes(b"z" * 100_000)
    _build(cache, key, _table(0))
    for i in range(1, 5):  # beyond the budget: an eviction runs
        _build(cache, entry_key("a.parquet", i), _table(i * 100))
    assert cache.stats["evictions"] > 0
    assert [p.name for p in left if p.exists()] == []


def test_a_shard_record_temp_file_of_the_previous_layout_is_removed_at_the_download(
    tmp_path,
):
    urls = _remote_files(tmp_path, "a")
    cache = ShardCache(tmp_path / "cache", max_bytes=10_000)
    name = os.path.basename(cache.local_path(urls["a"]))
    old = tmp_path / "cache" / ".sums" / f"{name}.tmp-99999-deadbeef"
    old.write_text("crc32:00000000 1000\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.fetch(urls["a"])
    assert not old.exists()


def _undeletable(monkeypatch, path) -> None:
    """``path`` cannot be deleted by this process (another user's file in a shared
    directory with the sticky bit, as a node-wide cache under /tmp or /scratch is):
    os.unlink of it raises EPERM, as the kernel would."""
    real = os.unlink

    def unlink(p, *args, **kwargs):
        if os.fspath(p) == os.fspath(path):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_a_temp_file_that_cannot_be_deleted_never_fails_a_read(tmp_path, monkeypatch):
    # A directory that refuses writes never fails a read (the decoded cache's rule).
    cache = DecodedCache(tmp_path / "cache", max_bytes=1 << 20, min_free_bytes=0)
    key = entry_key("a.parquet", 0)
    theirs = tmp_path / "cache" / ".tmp" / f"{key}-900-99999-deadbeef"  # a killed build
    theirs.write_bytes(b"z" * 900)
    _undeletable(monkeypatch, theirs)
    got, _ = _build(cache, key, _table(0))
    assert got.equals(_table(0))


def test_a_temp_file_that_cannot_be_deleted_does_not_turn_the_cache_off(tmp_path, monkeypatch):
    cache = DecodedCache(tmp_path / "cache", max_bytes=1 << 20, min_free_bytes=0)
    assert _build(cache, entry_key("a.parquet", 0), _table(0))[1] is not None
    # Then another user's build of another key is killed; its temp file stays.
    theirs = tmp_path / "cache" / ".tmp" / f"{entry_key('other.parquet', 0)}-900-99999-deadbeef"
    theirs.write_bytes(b"z" * 900)
    _undeletable(monkeypatch, theirs)
    stored = [_build(cache, entry_key("a.parquet", i), _table(i))[1] for i in range(1, 4)]
    assert None not in stored and cache.stats["not_stored"] == 0


def test_an_eviction_frees_down_to_90_percent_of_the_budget_after_the_publish(tmp_path):
    cache = DecodedCache(tmp_path / "cache", max_bytes=4000, min_free_bytes=0)
    sizes = []
    for i in range(5):  # entries of 914 bytes (tables of 400 bytes): the 5th does not fit
        _, path = _build(cache, entry_key("a.parquet", i), _table(i * 100))
        sizes.append(os.path.getsize(path))
    assert sizes[0] > _table(0).nbytes
    assert cache.stats["evictions"] > 0
    assert cache.total_bytes() <= 0.9 * cache.max_bytes


def test_a_forked_child_of_a_process_that_found_the_disk_short_tries_again(tmp_path):
    cache = DecodedCache(tmp_path / "cache", max_bytes=1 << 20, min_free_bytes=1 << 62)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the one warning of a refused write)
        assert _build(cache, entry_key("a.parquet", 0), _table(0))[1] is None
    cache.min_free_bytes = 0  # room again (a checkpoint was deleted)
    assert _fork(lambda: _build(cache, entry_key("a.parquet", 1), _table(1))[1]) == 0


def test_a_decoded_entry_rewritten_in_place_with_its_time_put_back_is_not_served(tmp_path):
    cache = DecodedCache(tmp_path / "cache", max_bytes=1 << 20, min_free_bytes=0)
    key, t = entry_key("a.parquet", 0), _table(1, rows=3)
    _build(cache, key, t)
    _, path = _build(cache, key, t)  # mapped, and verified by this process
    st = os.stat(path)
    with open(path, "r+b") as f:
        at = f.read().index(struct.pack("<q", MARK))
        f.seek(at)
        f.write(struct.pack("<q", 7))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r
    got, _ = _build(cache, key, t)
    assert got.column("x").to_pylist() == [1, MARK, 3]


def test_a_shard_cache_directory_deleted_during_a_download_does_not_blame_the_remote(
    tmp_path, monkeypatch
):
    urls = _remote_files(tmp_path, "a")
    cache = ShardCache(tmp_path / "cache", max_bytes=10_000)
    get_file = remote.get_file

    def deleted_meanwhile(fs, rpath, tmp, **kwargs):
        get_file(fs, rpath, tmp, **kwargs)
        shutil.rmtree(tmp_path / "cache")  # a user cleaning up, `torchgrain cache clear`

    monkeypatch.setattr(remote, "get_file", deleted_meanwhile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            path = cache.fetch(urls["a"])
        except OSError as e:  # (a failure may name the cache, never the remote as missing)
            assert not isinstance(e, DatasetNotFoundError), e
            assert str(tmp_path / "cache") in str(e)
        else:
            with open(path, "rb") as f:
                assert f.read() == b"a" * 1000


def test_refreshing_an_entrys_lru_time_keeps_its_modification_time(tmp_path):
    # (Found with the cases above.) A pin without an inotify watch (none left, or not
    # Linux) compares the modification time to the nanosecond: a refresh that rounded it
    # through a float read as a change, and the entry was let go and decoded again.
    cache = DecodedCache(tmp_path / "cache", max_bytes=1 << 20, min_free_bytes=0)
    _, path = _build(cache, entry_key("a.parquet", 0), _table(0))
    os.utime(path, ns=(1, 1_700_000_000_123_456_789))
    cache.touch(path)
    st = os.stat(path)
    assert (st.st_mtime_ns, st.st_atime_ns > 1) == (1_700_000_000_123_456_789, True)
