"""Large records from a slow store: range read-ahead sized by bytes, and multi-range
answers handed over without a copy, over a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import torchgrain as tg
import torchgrain.io.readahead as readahead
from tests.servers import RangeHTTPServer
from torchgrain.io.fs import get_filesystem
from torchgrain.io.inflight import cat_many
from torchgrain.io.ranges import range_store

RECORD = 40 << 10  # bytes of each record's blob


@pytest.fixture
def served(tmp_path):
    """96 records of 40 KiB in 4 shards, on disk and behind an HTTP server."""
    rng = np.random.default_rng(3)
    recs = [{"i": i, "blob": rng.bytes(RECORD)} for i in range(96)]
    d = tmp_path / "www" / "ds"
    tg.write_array_record(recs, d, num_shards=4)
    with RangeHTTPServer(tmp_path / "www", latency_s=0.005) as srv:
        yield srv, str(d), recs


def test_range_read_ahead_steps_are_sized_by_bytes(served, monkeypatch):
    srv, _d, recs = served
    # A step of at most 256 KiB: six records of 40 KiB, where it was 256 records.
    monkeypatch.setattr(readahead, "STEP_BYTES", 256 << 10, raising=False)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=16)
    steps: list[int] = []
    fetch = src.ranges.prefetch

    def counted(groups, **kw):
        if kw.get("owner") is not None:  # a read-ahead step (a batch's own read has none)
            steps.append(sum(len(rows) for _, rows, _ in groups))
        return fetch(groups, **kw)

    src.ranges.prefetch = counted
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=0)

    def slow_step(batch):  # slower than the reads: read-ahead runs ahead of the reader
        threading.Event().wait(0.02)
        return [(r["i"], r["blob"]) for r in batch]

    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=slow_step)
    try:
        got = [pair for batch in loader for pair in batch]
    finally:
        src.close()
    assert sorted(i for i, _ in got) == list(range(len(recs)))
    assert all(blob == recs[i]["blob"] for i, blob in got)
    assert steps, "read-ahead fetched nothing ahead"
    # Each step holds about 256 KiB (the first batch told the bytes per record).
    assert max(steps) <= (256 << 10) // RECORD, steps
    assert range_store().nbytes == 0


def test_a_multirange_answer_is_handed_over_without_a_copy(served):
    srv, d, _recs = served
    srv.multirange = "parts"  # one part per range, as nginx answers
    name = sorted(os.listdir(d))[0]
    fs, path = get_filesystem(f"{srv.url}/ds/{name}")
    with open(os.path.join(d, name), "rb") as f:
        data = f.read()
    starts = [0, 100_000, 50_000]
    ends = [s + RECORD for s in starts]
    got = cat_many(fs, [path] * 3, starts, ends, max_inflight=4)
    assert srv.gets() == 1  # one request for the three ranges
    assert [bytes(b) for b in got] == [data[s:e] for s, e in zip(starts, ends)]
    # Views of one response body, not a copy of each range.
    assert all(isinstance(b, memoryview) for b in got)
    assert got[0].obj is got[1].obj is got[2].obj


def test_a_batch_decodes_each_shard_as_its_ranges_arrive(tmp_path):
    """One shard served only once the batch's other shards are decoded: the batch decodes
    them while that shard's request is still in flight (it waited for every request)."""
    recs = [{"i": i, "blob": bytes([i]) * 512} for i in range(64)]
    d = tmp_path / "www" / "ds"
    tg.write_array_record(recs, d, num_shards=4)
    slow = sorted(os.listdir(d))[0]
    events: list[tuple[str, int | str]] = []
    release = threading.Event()
    with RangeHTTPServer(tmp_path / "www") as srv:
        count = srv._count

        def held(method, path):  # the slow shard's answer waits for the others' decoding
            if hold.is_set() and method == "GET" and path.endswith(slow):
                release.wait(5)
                events.append(("served", slow))
            count(method, path)

        hold = threading.Event()
        srv._count = held
        src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=16)
        decode = src._decode_all

        def told(blobs, idx):  # (each shard's records decoded as a group)
            out = decode(blobs, idx)
            events.append(("decoded", int(idx[0]) // 16))
            if {e for e in events if e[0] == "decoded"} >= {("decoded", s) for s in (1, 2, 3)}:
                release.set()
            return out

        try:
            _ = [src[i] for i in (0, 16, 32, 48)]  # footers read, before the hold
            src._decode_all = told
            events.clear()
            hold.set()
            indices = [5, 21, 37, 53, 6, 22, 38, 54]
            got = src.__getitems__(indices)
        finally:
            src.close()
    assert [r["i"] for r in got] == indices
    assert all(r["blob"] == recs[i]["blob"] for r, i in zip(got, indices))
    served = events.index(("served", slow))
    assert {e for e in events[:served]} == {("decoded", s) for s in (1, 2, 3)}, events
    assert events[served + 1 :] == [("decoded", 0)], events


def test_a_file_is_handed_over_once_when_its_last_request_is_in(served):
    """cat_many(arrived=) wakes the calling thread once per file, with all of that file's
    ranges (one request each here), not once per request; every byte as on disk."""
    srv, d, _recs = served
    names = sorted(os.listdir(d))[:3]
    fs, _ = get_filesystem(f"{srv.url}/ds/{names[0]}")
    paths, starts = [], []
    for n, name in enumerate(names):
        for k in range(4):  # four ranges of each file (interleaved below)
            paths.append(get_filesystem(f"{srv.url}/ds/{name}")[1])
            starts.append(k * 50_000 + n)
    order = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    paths = [paths[i] for i in order]
    starts = [starts[i] for i in order]
    ends = [s + 1000 for s in starts]
    calls: list[list[int]] = []
    got = cat_many(
        fs,
        paths,
        starts,
        ends,
        max_inflight=4,
        multi_range=False,
        arrived=lambda idx, blobs: calls.append(sorted(idx)),
    )
    assert sorted(calls) == sorted([i for i in range(12) if paths[i] == p] for p in set(paths))
    for p, s, e, blob in zip(paths, starts, ends, got):
        with open(os.path.join(d, os.path.basename(p)), "rb") as f:
            f.seek(s)
            assert bytes(blob) == f.read(e - s)
