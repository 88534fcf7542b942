"""Several byte ranges of a file in one HTTP request (``multipart/byteranges``): the strict
reading of the answer (exact bytes or an error, whatever the server sends), and the
batch-wide fetch over real servers on 127.0.0.1 that answer it every way a server does
(one part per range as nginx, merged into one range, the whole file) or breaks it."""

from __future__ import annotations

import itertools
import random
import time

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgrain as tg
from tests.servers import MULTIRANGE_MODES, RangeHTTPServer
from tests.test_remote_global import global_epoch
from torchgrain.io import inflight
from torchgrain.io.byteranges import (
    MAX_RANGES,
    MultipartError,
    merge_ranges,
    parse_byteranges,
    range_header,
    response_limit,
    slice_parts,
)
from torchgrain.io.remote import storage_options_with_deadlines
from torchgrain.io.retry import RetryPolicy

FILE = bytes(random.Random(1).randbytes(5000))


def _body(parts: list[tuple[int, int]], *, boundary: str = "B", size: int = len(FILE)) -> bytes:
    out = b"".join(
        f"\r\n--{boundary}\r\nContent-Type: x\r\nContent-Range: bytes {s}-{e - 1}/{size}\r\n\r\n".encode()
        + FILE[s:e]
        for s, e in parts
    )
    return out + f"\r\n--{boundary}--\r\n".encode()


_range = st.tuples(st.integers(0, len(FILE) - 1), st.integers(1, 300)).map(
    lambda t: (t[0], min(len(FILE), t[0] + t[1]))
)


@settings(max_examples=300)
@given(st.lists(_range, min_size=1, max_size=40), st.booleans())
def test_a_faithful_answer_gives_every_range_its_bytes(ranges, merge_all):
    merged = merge_ranges(ranges)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(merged))  # sorted, apart
    sent = [(merged[0][0], merged[-1][1])] if merge_all else merged
    parts, size = parse_byteranges(_body(sent), "B", max_parts=len(merged))
    assert size == len(FILE)
    assert slice_parts(parts, ranges) == [FILE[s:e] for s, e in ranges]
    header = range_header(merged)
    assert header.count(",") == len(merged) - 1
    assert len(_body(merged)) <= response_limit(merged)


@settings(max_examples=500)
@given(
    st.lists(_range, min_size=1, max_size=8),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    st.sampled_from(["flip", "cut", "insert"]),
)
def test_a_corrupted_answer_is_an_error_or_bytes_of_the_right_length(ranges, edits, how):
    # Bytes changed inside a part cannot be told from the file's (as with one range per
    # request); everything else is a MultipartError, in time and memory bounded by the body.
    merged = merge_ranges(ranges)
    body = bytearray(_body(merged))
    for pos, value in edits:
        pos %= max(1, len(body))
        if how == "flip":
            body[pos] = value
        elif how == "cut":
            del body[pos : pos + value]
        else:
            body[pos:pos] = bytes([value]) * (value % 17)
    try:
        got = slice_parts(parse_byteranges(bytes(body), "B", max_parts=len(merged))[0], ranges)
    except MultipartError:
        return
    assert [len(g) for g in got] == [e - s for s, e in ranges]


@pytest.mark.parametrize(
    "body, why",
    [
        (b"", "does not start"),
        (
            b"--B\r\nContent-Range: bytes 0-9/5000\r\n\r\n" + FILE[:10] + b"\r\n--B",
            "no end of its headers",
        ),
        (b"--B\r\nContent-Range: bytes 5-2/5000\r\n\r\n\r\n--B--", "bytes 5-2"),
        (
            b"--B\r\nContent-Range: bytes 0-4999/4999\r\n\r\n" + FILE + b"\r\n--B--",
            "file size 4999",
        ),
        (b"--B\r\nContent-Range: bytes 0-1/5000\r\n\r\nab", "not followed"),
        (b"--B\r\nX: y\r\n\r\nab\r\n--B--", "no Content-Range"),
        (b"--B\r\n" + b"X: y\r\n" * 400 + b"\r\nab", "within bounds"),
        (b"--B\r\nContent-Range: bytes 99999999999999999999-1/5\r\n\r\n", "bad Content-Range"),
    ],
)
def test_each_kind_of_broken_answer_is_named(body, why):
    with pytest.raises(MultipartError, match=why):
        parse_byteranges(body, "B", size=5000)


def test_a_range_no_part_holds_is_an_error():
    parts, _ = parse_byteranges(_body([(0, 10), (20, 30)]), "B")
    with pytest.raises(MultipartError, match="no part holds bytes 5-25"):
        slice_parts(parts, [(5, 25)])
    with pytest.raises(MultipartError, match="more than the 1 parts"):
        parse_byteranges(_body([(0, 10), (20, 30)]), "B", max_parts=1)


def test_a_huge_declared_part_costs_nothing():
    # A part that declares terabytes is checked against the body, never allocated.
    body = b"--B\r\nContent-Range: bytes 0-999999999999/1000000000000\r\n\r\nab\r\n--B--"
    t0 = time.perf_counter()
    with pytest.raises(MultipartError, match="not followed"):
        parse_byteranges(body, "B")
    assert time.perf_counter() - t0 < 1.0


# ------------------------------------------------------------------- over real servers
def _files(root, n: int = 2) -> list[bytes]:
    rng = np.random.default_rng(5)
    blobs = [rng.bytes(200_000) for _ in range(n)]
    for k, blob in enumerate(blobs):
        (root / f"f{k}.bin").write_bytes(blob)
    return blobs


def _http() -> fsspec.AbstractFileSystem:
    opts = storage_options_with_deadlines("http", {})
    opts["skip_instance_cache"] = True  # each test asks its own server afresh
    return fsspec.filesystem("http", **opts)


def _batch(srv, blobs, n: int = 150, seed: int = 0):
    rng = random.Random(seed)
    paths, starts, ends = [], [], []
    for _ in range(n):
        k = rng.randrange(len(blobs))
        s = rng.randrange(0, len(blobs[k]) - 2000)
        paths.append(f"{srv.url}/f{k}.bin")
        starts.append(s)
        ends.append(s + rng.randrange(1, 2000))
    expected = [blobs[int(p[-5])][s:e] for p, s, e in zip(paths, starts, ends)]
    return paths, starts, ends, expected


@pytest.mark.parametrize("mode", MULTIRANGE_MODES)
def test_every_answer_a_server_may_give_ends_in_the_files_bytes(tmp_path, mode):
    blobs = _files(tmp_path)
    with RangeHTTPServer(tmp_path, multirange=mode) as srv:
        fs = _http()
        for seed in range(2):
            paths, starts, ends, expected = _batch(srv, blobs, seed=seed)
            srv.reset_counts()
            got = inflight.cat_many(fs, paths, starts, ends, max_inflight=8)
            assert got == expected, mode
            # A server that merges far-apart ranges sends more bytes than asked for: such
            # an answer is refused (the bytes bound), and the ranges asked one by one.
            together = mode == "parts"
            if together:  # 150 ranges of 2 files: at most 64 ranges a request
                assert srv.gets() <= 2 * -(-75 // MAX_RANGES) + 2
            elif seed == 0:  # asked together once per file, then one range per request
                assert srv.gets() <= len(starts) + 2
            else:  # the server is known by now: one range per request, no multi-range
                assert srv.gets() == len(starts)
                assert all("," not in r for r in srv.range_log)
        assert inflight.multirange_servers(fs)[srv.url.lower()] is together


def test_a_transient_error_of_a_multi_range_request_is_retried_as_one(tmp_path):
    # A 503 is not a server without multi-range support: the batch's ranges are retried
    # together, not sent again one per request (which would multiply a throttled load).
    blobs = _files(tmp_path, 1)
    (tmp_path / "ds").mkdir()
    tg.write_array_record(
        [{"i": i, "b": blobs[0][i * 100 : i * 100 + 700]} for i in range(400)],
        tmp_path / "ds",
        num_shards=2,
    )
    with RangeHTTPServer(tmp_path) as srv:
        retry = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)
        src = tg.ArrayRecordSource(f"{srv.url}/ds", retry=retry)
        src.__getitems__([0, 399])  # footers read
        srv.reset_counts()
        idx = list(range(1, 399, 25))  # records far apart: ranges apart
        srv.fail_next(2, "503")
        got = src.__getitems__(idx)
        assert [r["b"] for r in got] == [blobs[0][i * 100 : i * 100 + 700] for i in idx]
        assert srv.gets() == 4  # two failed, then the two shards' requests again
        assert all(r.count(",") >= 3 for r in srv.range_log), srv.range_log


def test_ranges_a_server_merges_into_one_part_are_sliced_from_it(tmp_path):
    blobs = _files(tmp_path, 1)
    with RangeHTTPServer(tmp_path, multirange="merge") as srv:
        fs = _http()
        url = f"{srv.url}/f0.bin"
        starts, ends = [100, 900, 1500, 400], [600, 1200, 1600, 450]  # gaps < 1 KiB
        got = inflight.cat_many(fs, [url] * 4, starts, ends)
        assert got == [blobs[0][s:e] for s, e in zip(starts, ends)]
        assert srv.gets() == 1 and inflight.multirange_servers(fs)[srv.url.lower()] is True


@pytest.mark.parametrize("workers", [0, 2])
def test_a_global_shuffle_over_a_multi_range_server_asks_about_one_request_per_shard(
    tmp_path, workers
):
    rng = np.random.default_rng(2)
    recs = [{"i": i, "blob": rng.bytes(int(rng.integers(100, 1200)))} for i in range(2048)]
    tg.write_array_record(recs, tmp_path / "www" / "ds", num_shards=8)
    with RangeHTTPServer(tmp_path / "www") as srv:
        src = tg.ArrayRecordSource(f"{srv.url}/ds", max_inflight=16)
        got, order = global_epoch(src, workers=workers, batch_size=256, seed=1)
        assert [i for i, _ in got] == order
        assert all(blob == recs[i]["blob"] for i, blob in got)
        # 8 batches x 8 shards: about 64 multi-range requests, not 2,048 (+ footers,
        # listings; read-ahead of the next batches may split a shard's ranges in two)
        together = [r for r in srv.range_log if r and "," in r]
        assert 56 <= len(together) <= 96
        assert srv.gets() - len(together) <= 8 * (workers + 1) * 3 + 10


def test_multi_range_false_asks_one_range_per_request(tmp_path):
    rng = np.random.default_rng(3)
    recs = [{"i": i, "blob": rng.bytes(900)} for i in range(600)]
    tg.write_array_record(recs, tmp_path / "www" / "ds", num_shards=2)
    idx = list(range(0, 600, 13))
    with RangeHTTPServer(tmp_path / "www") as srv:
        for multi_range in (True, False):
            src = tg.ArrayRecordSource(f"{srv.url}/ds", multi_range=multi_range)
            src.__getitems__([0, 599])  # footers read
            srv.reset_counts()
            assert [r["blob"] for r in src.__getitems__(idx)] == [recs[i]["blob"] for i in idx]
            together = [r for r in srv.range_log if "," in (r or "")]
            assert (len(together), srv.gets()) == ((2, 2) if multi_range else (0, srv.gets()))
            assert multi_range or srv.gets() > 2
            src.close()
