"""A global shuffle straight from remote storage: a batch's records fetched across all its
shards at once (``max_inflight`` requests in flight), the next batches fetched while one
is decoded, in bounded memory, byte-identical to local reads, over real servers on
127.0.0.1 (HTTP with Range, and moto's S3)."""

from __future__ import annotations

import functools
import os
import threading

import numpy as np
import pytest
import torch

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.io.ranges import range_store
from torchgrain.io.readahead import RangeReadAhead
from torchgrain.io.retry import RetryPolicy

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01)


def _records(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"i": i, "blob": rng.bytes(int(rng.integers(200, 1500)))} for i in range(n)]


@pytest.fixture
def served(tmp_path):
    """An ArrayRecord dataset of 16 shards on disk and behind an HTTP server."""
    recs = _records(640)
    d = tmp_path / "www" / "ds"
    tg.write_array_record(recs, d, num_shards=16)
    with RangeHTTPServer(tmp_path / "www") as srv:
        yield srv, str(d), recs


def _pairs(key: str, batch: list) -> list:
    return [(r["i"], r[key]) for r in batch]


def global_epoch(
    src,
    *,
    workers: int,
    epoch: int = 0,
    batch_size: int = 64,
    seed: int = 3,
    key: str = "blob",
    context: str = "fork",
) -> tuple[list, list[int]]:
    """One global-shuffle epoch of ``src`` through a DataLoader: its ``(i, record[key])``
    pairs in the order delivered, and the sampler's order. Closes ``src``."""
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=seed)
    sampler.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=functools.partial(_pairs, key),
        multiprocessing_context=context if workers else None,
    )
    try:
        return [rec for batch in loader for rec in batch], list(sampler)
    finally:
        src.close()  # ends its read-ahead: the process's range store is shared


def _epoch(src, *, workers: int, epoch: int = 0, batch_size: int = 64) -> list:
    return global_epoch(src, workers=workers, epoch=epoch, batch_size=batch_size)[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_remote_global_shuffle_delivers_the_local_bytes_with_0_and_2_workers(served, workers):
    srv, d, recs = served
    local = _epoch(tg.ArrayRecordSource(d), workers=workers)
    remote = _epoch(tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=16), workers=workers)
    assert remote == local
    assert sorted(i for i, _ in remote) == list(range(len(recs)))
    assert all(blob == recs[i]["blob"] for i, blob in remote)


def test_a_remote_batch_has_requests_for_all_its_shards_in_flight_at_once(served):
    srv, _d, recs = served
    src = tg.ArrayRecordSource(f"{srv.url}/ds", io_threads=2, max_inflight=32)
    src.__getitems__(list(range(0, 640, 40)))  # footers read: one record of each shard
    srv.latency_s = 0.05
    srv.reset_counts()
    idx = list(range(3, 640, 5))  # 128 records of all 16 shards
    got = src.__getitems__(idx)
    assert [r["blob"] for r in got] == [recs[i]["blob"] for i in idx]
    # Two threads read two shards at a time: only a batch-wide fetch has more in flight.
    assert srv.max_inflight > 8


def test_requests_in_flight_never_exceed_max_inflight(served):
    srv, _d, recs = served
    src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=3)
    src.__getitems__(list(range(0, 640, 40)))  # footers read (io_threads at a time)
    srv.latency_s = 0.01
    srv.reset_counts()
    got = _epoch(src, workers=0)
    assert sorted(i for i, _ in got) == list(range(len(recs)))
    # The server counts a request until its handler returns, just after the client has
    # its bytes and may send the next: one more than the client's limit can show here.
    assert 1 <= srv.max_inflight <= 3 + 1


def test_a_tfrecord_global_shuffle_over_http_delivers_the_local_bytes(tmp_path):
    from torchgrain.formats.tfrecord import write_tfrecord

    rng = np.random.default_rng(1)
    blobs = [rng.bytes(int(rng.integers(10, 900))) for _ in range(200)]
    root = tmp_path / "www"
    (root / "tf").mkdir(parents=True)
    for k in range(4):
        write_tfrecord(blobs[k::4], str(root / "tf" / f"part-{k}.tfrecord"))
    with RangeHTTPServer(root) as srv:
        kw = {"codec": "raw", "index_dir": None}
        local = tg.TFRecordSource(str(root / "tf"), **kw)
        remote = tg.TFRecordSource(f"{srv.url}/tf", max_inflight=8, **kw)
        idx = np.random.default_rng(2).permutation(200)[:120].tolist()
        srv.reset_counts()
        got = remote.__getitems__(idx)
        assert got == local.__getitems__(idx)
        # One batch-wide fetch: never more requests than the records asked for.
        assert srv.gets() <= len(idx)


def test_a_remote_global_shuffle_over_s3_delivers_the_local_bytes(moto_s3, tmp_path):
    client, endpoint = moto_s3
    recs = _records(160)
    d = tmp_path / "ds"
    tg.write_array_record(recs, d, num_shards=4)
    client.create_bucket(Bucket="global")
    for name in sorted(os.listdir(d)):
        client.upload_file(str(d / name), "global", f"ds/{name}")
    opts = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
    remote = tg.ArrayRecordSource("s3://global/ds", storage_options=opts, max_inflight=8)
    assert _epoch(remote, workers=0, batch_size=32) == _epoch(
        tg.ArrayRecordSource(str(d)), workers=0, batch_size=32
    )


def test_read_ahead_holds_no_more_than_its_budget_ahead_of_a_slow_step(served):
    srv, _d, recs = served
    store = range_store()
    old = store.max_bytes
    store.max_bytes = 8 << 10  # a few records
    try:
        src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=8)
        # Read-ahead 16 records at a time (the default is 256): a tight bound to check.
        src._proc().range_ahead = RangeReadAhead(src, step=16)
        srv.latency_s = 0.002  # slow enough to need read-ahead, faster than the step
        ds = tg.Dataset(src)
        sampler = tg.GlobalShuffleSampler(ds, seed=0)

        def slow_step(batch):  # a training step much slower than the reads
            threading.Event().wait(0.2)
            return [r["i"] for r in batch]

        loader = torch.utils.data.DataLoader(
            ds, batch_size=32, sampler=sampler, collate_fn=slow_step
        )
        peak = 0
        seen = []
        for batch in loader:
            peak = max(peak, store.nbytes)
            seen.extend(batch)
        assert sorted(seen) == list(range(len(recs)))
        ra = src._proc().range_ahead
        assert ra is not None and ra.steps >= 1  # it did read ahead
        # The budget, plus the two steps (16 records of < 1600 bytes) that may start under it.
        assert peak <= store.max_bytes + 2 * 16 * 1600
    finally:
        src.close()
        store.max_bytes = old


@pytest.mark.parametrize("new_pass", ["set_epoch", "resume"])
def test_a_new_pass_cancels_read_ahead_and_drops_what_it_fetched(served, new_pass):
    srv, _d, recs = served
    src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=4)
    srv.latency_s = 0.02
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=0)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=16, sampler=sampler, collate_fn=lambda b: [r["i"] for r in b]
    )
    it = iter(loader)
    first = next(it)
    ra = src._proc().range_ahead
    assert ra is not None
    fetched_ahead = threading.Event()
    for _ in range(2000):  # until read-ahead has put the next batches' bytes in the store
        if range_store().nbytes:
            fetched_ahead.set()
            break
        threading.Event().wait(0.005)
    assert fetched_ahead.is_set()
    if new_pass == "set_epoch":
        sampler.set_epoch(1)  # a new order: what was fetched for the old one is of no use
    else:
        sampler.load_state_dict(sampler.state_dict(consumed=16))  # a resume: a new pass
    assert ra.join(timeout=60)
    assert range_store().nbytes == 0
    del it
    again = [i for batch in loader for i in batch]
    src.close()
    done = len(recs) if new_pass == "set_epoch" else len(recs) - 16
    assert len(first) == 16 and len(again) == done and len(set(again)) == done


def test_a_batch_that_outlasts_its_retries_names_the_url_and_keeps_nothing(served):
    srv, _d, _recs = served
    idx = list(range(3, 640, 7))
    probe = tg.ArrayRecordSource(f"{srv.url}/ds")
    probe.__getitems__(list(range(0, 640, 40)))  # footers read
    srv.reset_counts()
    probe.__getitems__(idx)
    per_try = srv.gets()  # requests one try of the batch makes
    src = tg.ArrayRecordSource(f"{srv.url}/ds", retry=FAST_RETRY, max_inflight=8)
    src.__getitems__(list(range(0, 640, 40)))
    held = range_store().nbytes
    # Every request of the first two tries fails, and half of the last one's.
    srv.fail_next(2 * per_try + per_try // 2, "503")
    with pytest.raises(tg.RemoteIOError, match=r"/ds/.*array_record"):
        src.__getitems__(idx)
    assert range_store().nbytes == held  # what arrived before the failure is not kept


def test_read_ahead_downloads_the_first_windows_shards_in_parallel(served, tmp_path):
    srv, _d, _recs = served
    src = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c", cache_dir_bytes=1 << 30)
    srv.latency_s = 0.1
    srv.reset_counts()
    # A block order: the first window is shards 0-3, each read whole before the next.
    order = np.concatenate([np.random.default_rng(k).permutation(160) + 160 * k for k in range(4)])
    src.read_ahead(lambda a, b: order[a:b], 0, len(order), lambda: 0)
    assert src._proc().read_ahead.join(timeout=60)
    assert src._proc().read_ahead.fetched == 16
    assert srv.max_inflight >= 4  # not one download after the other
