"""Strict-xfail reproducers of holes in the decoded cache's and index build's lock
handling, the Parquet shard version and the Parquet output schema."""

from __future__ import annotations

import os
import pickle
import time
import warnings
import zlib

import pyarrow as pa

import torchgrain as tg
from tests._locks import array_record_without_index, hold_flock
from torchgrain.sources.node_index import store as node_index


def test_an_index_build_given_up_on_leaves_no_lock_file_of_its_own(tmp_path, monkeypatch):
    data = array_record_without_index(tmp_path)
    probe, idx = tmp_path / "probe", tmp_path / "idx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg.ArrayRecordSource(data, codec="msgpack", index_dir=str(probe))
    (name,) = [n for n in os.listdir(probe) if n.endswith(".tgindex.lock")]
    monkeypatch.setenv(node_index.INDEX_LOCK_WAIT_ENV, "0")  # (documented: never wait)
    fd = hold_flock(str(idx / name))  # a builder stopped holding the index's lock
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(5):  # five opens, each giving up at once and building too
                src = tg.ArrayRecordSource(data, codec="msgpack", index_dir=str(idx))
                assert len(src) == 10
                del src
                os.unlink(idx / name[: -len(".lock")])  # (as if evicted: built again)
    finally:
        os.close(fd)
    locks = sorted(n for n in os.listdir(idx) if n.endswith(".lock") and n != "evict.lock")
    assert locks == [name], locks


# ------------------------------------------------------------- decoded cache
def _same_stripe(n: int) -> list[str]:
    from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

    keys = [entry_key(f"part-{i}.parquet", 0) for i in range(4000)]
    stripe = zlib.crc32(keys[0].encode()) % DecodedCache._STRIPES
    return [k for k in keys if zlib.crc32(k.encode()) % DecodedCache._STRIPES == stripe][:n]


def test_a_spawned_worker_keeps_a_decoded_cache_stripe_its_parent_found_stuck(tmp_path):
    from torchgrain.sources.parquet.decoded_cache import DecodedCache

    cache = DecodedCache(str(tmp_path / "c"), max_bytes=1 << 20, min_free_bytes=0, lock_timeout=1)
    table = pa.table({"x": [1, 2, 3]})
    first, second = _same_stripe(2)
    fd = hold_flock(cache._lock_path(first))  # a builder stopped holding the stripe
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache.get_or_build(first, lambda: table, schema=table.schema, num_rows=3)
            assert cache._stuck  # (the parent waited once)
            worker = pickle.loads(pickle.dumps(cache))  # what spawn hands a worker
            start = time.monotonic()
            got, path = worker.get_or_build(second, lambda: table, schema=table.schema, num_rows=3)
            took = time.monotonic() - start
    finally:
        os.close(fd)
    assert got.equals(table) and path is None
    assert took < 0.5, took  # (a forked child's: no wait of its own)
