"""The decoded Parquet cache never serves an entry it has not checked: a file written to
in place after this process verified it is checked again, another entry's file under
a key's name is refused, and a cache directory deleted while in use keeps its running
total in the directory made again."""

from __future__ import annotations

import os
import shutil
import struct

import pyarrow as pa

from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

MARK = 0x5A5A_1234_5678_9ABC  # a value whose bytes are found in the entry's file


def _table(first: int) -> pa.Table:
    return pa.table({"x": pa.array([first, MARK, first + 2], pa.int64())})


def _cache(tmp_path) -> DecodedCache:
    return DecodedCache(tmp_path / "cache", max_bytes=1 << 20, min_free_bytes=0)


def _get(cache, key, table):
    built = []

    def build():
        built.append(1)
        return table

    got, path = cache.get_or_build(key, build, schema=table.schema, num_rows=table.num_rows)
    return got.column("x").to_pylist(), path, len(built)


def test_an_entry_written_to_in_place_after_it_was_verified_is_checked_again(tmp_path):
    cache = _cache(tmp_path)
    key = entry_key("a.parquet", 0)
    t = _table(1)
    assert _get(cache, key, t)[::2] == ([1, MARK, 3], 1)
    values, path, builds = _get(cache, key, t)  # mapped, and verified by this process
    assert (values, builds) == ([1, MARK, 3], 0)
    st = os.stat(path)
    with open(path, "r+b") as f:  # the same inode: damaged where the values lie
        data = f.read()
        at = data.index(struct.pack("<q", MARK))
        f.seek(at)
        f.write(struct.pack("<q", MARK ^ 0xFF))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    values, path, builds = _get(cache, key, t)
    assert (values, builds) == ([1, MARK, 3], 1)  # refused, decoded again


def test_another_entrys_file_under_a_keys_name_is_not_served(tmp_path):
    cache = _cache(tmp_path)
    a, b = entry_key("a.parquet", 0), entry_key("a.parquet", 1)
    _get(cache, a, _table(10))
    _get(cache, b, _table(20))
    # The same schema and row count: only the key in its trailer tells them apart.
    shutil.copyfile(cache.path_of(a), cache.path_of(b))
    fresh = _cache(tmp_path)  # a process that has verified nothing yet
    values, _, builds = _get(fresh, b, _table(20))
    assert (values, builds) == ([20, MARK, 22], 1)
    assert fresh.stats["corrupt"] == 1


def test_a_cache_directory_deleted_while_in_use_keeps_its_total_in_the_new_one(tmp_path):
    cache = _cache(tmp_path)
    _get(cache, entry_key("a.parquet", 0), _table(1))
    shutil.rmtree(cache.directory)
    _, path, builds = _get(cache, entry_key("a.parquet", 1), _table(2))
    assert builds == 1 and path is not None
    # The running total is in the directory made again, not in the deleted one's file.
    with open(os.path.join(cache.directory, ".usage"), "rb") as f:
        assert struct.unpack("<q", f.read(8))[0] == cache.total_bytes() == os.path.getsize(path)
