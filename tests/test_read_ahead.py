"""Read-ahead of remote shards in the sampler's order (torchgrain.io.readahead), against a
real HTTP server with Range support and latency on 127.0.0.1."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import torchgrain as tg
from tests.servers import RangeHTTPServer

SHARDS = 12


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    recs = [{"label": i, "x": np.full(256, i % 251, np.uint8)} for i in range(SHARDS * 40)]
    tg.write_array_record(recs, str(root / "ds"), num_shards=SHARDS)
    with RangeHTTPServer(root, latency_s=0.02) as srv:
        yield srv, str(root / "ds")


def _copies(cache_dir) -> int:
    return sum(1 for f in os.listdir(cache_dir) if not f.startswith("."))


def _wait_for(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _order(ds, sampler, workers, epochs=2):
    loader = torch.utils.data.DataLoader(ds, batch_size=20, sampler=sampler, num_workers=workers)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([int(v) for b in loader for v in b["label"]])
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_read_ahead_keeps_order_and_fills_the_cache_ahead(served, tmp_path, workers):
    srv, _ = served
    url = f"{srv.url}/ds"
    plain = tg.Dataset(tg.ArrayRecordSource(url, cache_dir=tmp_path / "a", read_ahead_bytes=0))
    ahead_src = tg.ArrayRecordSource(url, cache_dir=tmp_path / "b")
    assert ahead_src.read_ahead_bytes > 0  # on by default with a shard cache
    ahead = tg.Dataset(ahead_src)
    want = _order(
        plain,
        tg.BlockShuffleSampler(plain, seed=1, block_offsets=np.arange(0, SHARDS * 40 + 1, 10)),
        workers,
    )
    got = _order(
        ahead,
        tg.BlockShuffleSampler(ahead, seed=1, block_offsets=np.arange(0, SHARDS * 40 + 1, 10)),
        workers,
    )
    assert got == want
    assert all(sorted(e) == list(range(SHARDS * 40)) for e in got)
    # The first batch alone needs few shards; the read-ahead fetched the others.
    src = tg.ArrayRecordSource(url, cache_dir=tmp_path / "c")
    ds = tg.Dataset(src)
    sampler = tg.BlockShuffleSampler(
        ds, seed=2, block_offsets=np.arange(0, SHARDS * 40 + 1, 40), window=1
    )
    it = iter(torch.utils.data.DataLoader(ds, batch_size=10, sampler=sampler))
    next(it)
    assert _wait_for(lambda: _copies(tmp_path / "c") == SHARDS)


def test_read_ahead_stays_within_its_budget(served, tmp_path):
    srv, local = served
    size = max(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local) if "array" in f)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c", read_ahead_bytes=3 * size)
    sampler = tg.BlockShuffleSampler(
        src, seed=0, block_offsets=np.arange(0, SHARDS * 40 + 1, 40), window=1
    )
    it = iter(sampler)
    next(it)  # position 1: the first shard is in use, the walk may hold 3 more ahead
    time.sleep(1.0)
    assert _copies(tmp_path / "c") <= 1 + 3
    for _ in range(40 * 4):  # four shards further on: more may follow, still bounded
        next(it)
    assert _wait_for(lambda: _copies(tmp_path / "c") >= 5)
    time.sleep(0.5)
    assert _copies(tmp_path / "c") <= 5 + 3


def test_set_epoch_and_resume_cancel_the_walk(served, tmp_path):
    srv, _ = served
    src = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c")
    sampler = tg.GlobalShuffleSampler(src, seed=0)
    it = iter(sampler)
    next(it)
    ra = src._proc().read_ahead
    generation = ra._generation
    sampler.set_epoch(1)
    assert ra._generation > generation
    generation = ra._generation
    sampler.load_state_dict(sampler.state_dict())
    assert ra._generation > generation


def test_no_read_ahead_without_a_shard_cache(served, tmp_path):
    srv, local = served
    assert tg.ArrayRecordSource(f"{srv.url}/ds").read_ahead_bytes == 0
    # local files are never copied into the cache, so there is nothing to read ahead
    assert tg.ArrayRecordSource(local, cache_dir=tmp_path / "c").read_ahead_bytes == 0
    with pytest.raises(ValueError, match="read_ahead_bytes"):
        tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c", read_ahead_bytes=-1)
    src = tg.ArrayRecordSource(local, cache_dir=tmp_path / "c")
    list(iter(tg.GlobalShuffleSampler(src, seed=0)))
    assert src._proc().read_ahead is None  # local files: nothing to read ahead


def test_parquet_block_shuffle_reads_ahead_over_s3(tmp_path):
    """Parquet files on a real S3 server: the walk downloads the files a block shuffle
    will need; the records and their order are those of a run without it."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.servers import start_moto_s3

    server, endpoint = start_moto_s3()
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="ra-pq")
    for k in range(6):
        table = pa.table({"label": list(range(k * 50, (k + 1) * 50)), "x": [b"x" * 64] * 50})
        path = tmp_path / f"part-{k}.parquet"
        pq.write_table(table, path, row_group_size=10)
        client.upload_file(str(path), "ra-pq", f"train/part-{k}.parquet")
    options = {"endpoint_url": endpoint}
    orders = []
    for ahead in (0, None):
        src = tg.ParquetSource(
            "s3://ra-pq/train",
            storage_options=options,
            cache_dir=tmp_path / f"c{ahead}",
            read_ahead_bytes=ahead,
        )
        ds = tg.Dataset(src)
        sampler = tg.BlockShuffleSampler(ds, seed=3, window=2)
        orders.append(_order(ds, sampler, workers=2))
        walk = src._proc().read_ahead
        if ahead is None:  # the main process's walk downloaded the later files
            assert walk is not None and walk.fetched >= 1
        else:
            assert walk is None
    server.stop()
    assert orders[0] == orders[1]
    assert all(sorted(e) == list(range(300)) for e in orders[1])
