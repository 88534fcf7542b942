"""Nearby byte ranges of a batch merged into one request on stores that answer one range
per request (S3, GCS, an HTTP server without multi-range support), within a gap and a
size cap; servers that answer several ranges in one request still get them so. Requests
counted by real servers on 127.0.0.1, every byte checked."""

from __future__ import annotations

import random
import re

import fsspec
import numpy as np
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_remote_global import global_epoch
from torchgrain.io import inflight
from torchgrain.io.ranges import (
    SINGLE_RANGE_GAP,
    SINGLE_RANGE_MAX,
    RangeStore,
    coalescing,
    fetch_batch,
    version_of,
)
from torchgrain.io.remote import storage_options_with_deadlines

SIZE = 3 << 20
BLOB = np.random.default_rng(7).bytes(SIZE)


def _http() -> fsspec.AbstractFileSystem:
    opts = storage_options_with_deadlines("http", {})
    opts["skip_instance_cache"] = True  # each test asks its own server afresh
    return fsspec.filesystem("http", **opts)


def _spans(srv) -> list[list[tuple[int, int]]]:
    """Each GET's ranges (half-open), in order."""
    return [
        [(int(a), int(b) + 1) for a, b in re.findall(r"(\d+)-(\d+)", r or "")]
        for r in srv.range_log
    ]


def _fetch(fs, url: str, ranges: list[tuple[int, int]], *, one_range: bool = True) -> None:
    """One batch's ranges of ``url`` fetched, and every one checked against the file."""
    store = RangeStore()
    fetch_batch(fs, [(url, url, ranges)], store=store, owner=None, gap=4 << 10)
    got = store.take(url, ranges, version_of(fs, url))  # (of the version fetched)
    assert [bytes(v) for v in got] == [BLOB[s:e] for s, e in ranges]
    if one_range:  # a kept range owns its bytes, not a view of a request with holes
        assert all(len(v.obj) == len(v) for v in got)


def _batch(seed: int) -> list[tuple[int, int]]:
    """48 ranges of ~1 KiB: 6 clusters of 8 nearby ranges (holes of 1-12 KiB), the
    clusters ~400 KiB apart; shuffled, as a global shuffle asks for them."""
    rng = random.Random(seed)
    out = []
    for c in range(6):
        at = 100 + c * 400_000 + rng.randrange(1000)
        for _ in range(8):
            n = rng.randrange(500, 1500)
            out.append((at, at + n))
            at += n + rng.randrange(1000, 12_000)
    rng.shuffle(out)
    return out


def test_nearby_ranges_share_a_request_on_a_one_range_server(tmp_path):
    (tmp_path / "f.bin").write_bytes(BLOB)
    with RangeHTTPServer(tmp_path, multirange="ignore") as srv:
        fs = _http()
        url = f"{srv.url}/f.bin"
        _fetch(fs, url, _batch(0))  # asked together once: the whole file, refused
        assert inflight.multirange_servers(fs)[srv.url.lower()] is False
        assert coalescing(fs, url, 4096) == (SINGLE_RANGE_GAP, SINGLE_RANGE_MAX)
        for seed in (1, 2):
            srv.reset_counts()
            ranges = _batch(seed)
            _fetch(fs, url, ranges)
            spans = _spans(srv)
            assert all(len(s) == 1 for s in spans), srv.range_log  # one range a request
            # Each cluster of 8 in one request: 6 requests for 48 ranges, not 48.
            assert srv.gets() == 6, srv.range_log
            assert all(e - s <= 110_000 for ((s, e),) in spans)


def test_the_size_cap_and_the_gap_hold(tmp_path):
    (tmp_path / "f.bin").write_bytes(BLOB)
    with RangeHTTPServer(tmp_path, multirange="ignore") as srv:
        fs = _http()
        url = f"{srv.url}/f.bin"
        _fetch(fs, url, [(0, 10), (5000, 5010)])  # learns: one range per request
        srv.reset_counts()
        # 1 KiB ranges with 1 KiB holes over the whole file: merged, never past the cap.
        dense = [(s, s + 1024) for s in range(0, SIZE - 1024, 2048)]
        # and ranges further apart than the gap: never merged, however many.
        sparse = [(s, s + 1024) for s in range(50, SIZE - 1024, SINGLE_RANGE_GAP + 4096)]
        for ranges, lo, hi in (
            (dense, SIZE // SINGLE_RANGE_MAX, SIZE // SINGLE_RANGE_MAX + 2),
            (sparse, len(sparse), len(sparse)),
        ):
            srv.reset_counts()
            _fetch(fs, url, ranges)
            spans = [s for (s,) in _spans(srv)]
            assert lo <= len(spans) <= hi, (len(spans), lo, hi)
            assert max(e - s for s, e in spans) <= SINGLE_RANGE_MAX


def test_a_multi_range_server_still_gets_the_ranges_together(tmp_path):
    (tmp_path / "f.bin").write_bytes(BLOB)
    with RangeHTTPServer(tmp_path) as srv:  # answers multipart/byteranges, as nginx
        fs = _http()
        url = f"{srv.url}/f.bin"
        assert coalescing(fs, url, 4096) == (4096, 4 << 20)  # not asked yet: together
        ranges = _batch(3)
        _fetch(fs, url, ranges, one_range=False)
        assert inflight.multirange_servers(fs)[srv.url.lower()] is True
        (spans,) = _spans(srv)  # one request, holes over 4 KiB left out of it
        holes = sum(b[0] - a[1] > 4096 for a, b in zip(sorted(ranges), sorted(ranges)[1:]))
        assert len(spans) == holes + 1
        # multi_range=False: the same server asked one range per request, coalesced.
        srv.reset_counts()
        store = RangeStore()
        fetch_batch(fs, [(url, url, ranges)], store=store, owner=None, gap=4096, multi_range=False)
        got = store.take(url, ranges, version_of(fs, url))
        assert [bytes(v) for v in got] == [BLOB[s:e] for s, e in ranges]
        assert srv.gets() == 6 and all(r and "," not in r for r in srv.range_log)


def test_object_stores_are_asked_with_the_single_range_gap():
    pytest.importorskip("s3fs")
    s3 = fsspec.filesystem("s3", anon=True, skip_instance_cache=True)
    assert coalescing(s3, "bucket/key", 4096) == (SINGLE_RANGE_GAP, SINGLE_RANGE_MAX)
    assert coalescing(_http(), "http://h:1/f", 4096, multi_range=False)[0] == SINGLE_RANGE_GAP


def test_a_global_shuffle_from_a_one_range_server_asks_fewer_requests_than_records(tmp_path):
    rng = np.random.default_rng(4)
    recs = [{"i": i, "blob": rng.bytes(int(rng.integers(200, 1200)))} for i in range(2048)]
    tg.write_array_record(recs, tmp_path / "www" / "ds", num_shards=4)
    with RangeHTTPServer(tmp_path / "www", multirange="ignore") as srv:
        src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=16)
        # Footers read; several records of a shard asked together: the server learnt.
        src.__getitems__(list(range(0, 2048, 97)))
        assert inflight.multirange_servers(src._fs)[srv.url.lower()] is False
        srv.reset_counts()
        got, order = global_epoch(src, workers=0, batch_size=64, seed=1)
        assert [i for i, _ in got] == order
        assert all(blob == recs[i]["blob"] for i, blob in got)
        assert all(r is None or "," not in r for r in srv.range_log)
        # 32 batches of 64 records over 4 shards (~22 KiB apart): far fewer requests than
        # the 2,048 records (about 1,000 with the 4 KiB gap of a multi-range server).
        assert srv.gets() < 2048 // 4, srv.gets()
