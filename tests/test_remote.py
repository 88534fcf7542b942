"""Remote reading against real servers on 127.0.0.1: S3 (moto) and HTTP with Range.

Covers fsspec URLs with storage_options, forked DataLoader workers, the shard cache
(shared by processes, LRU within budget, atomic publication), parallel extraction,
and retries under injected faults.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import time

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchgrain as tg
from tests.conftest import make_records
from tests.servers import RangeHTTPServer, start_moto_s3
from torchgrain.io.retry import RetryPolicy, is_transient, retry_call
from torchgrain.io.shard_cache import ShardCache

FAST_RETRY = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)
# aiohttp itself retries a request once when a kept-alive connection drops, and
# fsspec's info() falls back from HEAD to GET: inject enough faults that some reach
# torchgrain's retry loop, and allow enough attempts to get through them.
PATIENT_RETRY = RetryPolicy(attempts=10, base_delay=0.001, max_delay=0.01)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _write(root, name="ds", n=60, shards=4, image_shape=(4, 4, 3)):
    recs = make_records(n, image_shape=image_shape)
    d = os.path.join(root, name)
    tg.write_array_record(recs, d, num_shards=shards)
    return d, recs


def _shard_files(d):
    return sorted(f for f in os.listdir(d) if ".array_record" in f)


# ----------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server, endpoint = start_moto_s3()
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    yield client, endpoint
    server.stop()


def _upload(client, bucket, local_dir, prefix, skip=()):
    client.create_bucket(Bucket=bucket)
    for name in sorted(os.listdir(local_dir)):
        if name in skip:
            continue
        client.upload_file(os.path.join(local_dir, name), bucket, f"{prefix}/{name}")


@pytest.fixture
def http(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    with RangeHTTPServer(root) as srv:
        yield srv, str(root)


# ----------------------------------------------------------------------- retry unit
def test_transient_classification():
    aiohttp = pytest.importorskip("aiohttp")
    ri = aiohttp.RequestInfo(url="http://x/a", method="GET", headers={}, real_url="http://x/a")
    e503 = aiohttp.ClientResponseError(ri, (), status=503)
    e404 = aiohttp.ClientResponseError(ri, (), status=404)
    assert is_transient(e503) and not is_transient(e404)
    assert is_transient(aiohttp.ServerDisconnectedError())
    # fsspec's HTTP info() turns any failure into FileNotFoundError *from* the cause.
    try:
        try:
            raise e503
        except Exception as inner:
            raise FileNotFoundError("http://x/a") from inner
    except FileNotFoundError as wrapped:
        assert is_transient(wrapped)
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(PermissionError("x"))
    assert not is_transient(tg.CorruptDataError("bad chunk"))
    assert is_transient(OSError(104, "reset"))  # ECONNRESET without the subclass


@given(
    attempts=st.integers(1, 8),
    base=st.floats(0, 1),
    cap=st.floats(0, 2),
    jitter=st.floats(0, 1),
    k=st.integers(0, 20),
)
def test_retry_delay_bounds(attempts, base, cap, jitter, k):
    p = RetryPolicy(attempts=attempts, base_delay=base, max_delay=cap, jitter=jitter)
    d = p.delay(k)
    full = min(cap, base * 2.0**k)
    assert (1 - jitter) * full - 1e-12 <= d <= full + 1e-12


def test_retry_gives_up_clearly():
    calls = []

    def always_reset():
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    with pytest.raises(tg.RemoteIOError, match=r"s3://b/k.*3 attempts"):
        retry_call(always_reset, url="s3://b/k", policy=RetryPolicy(3, base_delay=0.001))
    assert len(calls) == 3

    def forbidden():
        calls.append(1)
        raise PermissionError("403")

    calls.clear()
    with pytest.raises(PermissionError, match="s3://b/k"):
        retry_call(forbidden, url="s3://b/k", policy=FAST_RETRY)
    assert len(calls) == 1  # never retried


# ----------------------------------------------------------------------- S3
def test_s3_manifest_and_footers_with_workers(s3, tmp_path):
    client, endpoint = s3
    d, recs = _write(tmp_path, n=50, shards=3)
    _upload(client, "bkt-a", d, "train")
    _upload(client, "bkt-a", d, "nomanifest", skip=("torchgrain.json",))
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}

    for url in ("s3://bkt-a/train", "s3://bkt-a/nomanifest/*.array_record*"):
        src = tg.ArrayRecordSource(url, storage_options=opts)
        assert len(src) == 50 and src.num_shards == 3
        # Used in the parent first (users look at a record before training) ...
        assert _same(src[7], recs[7])
        # ... then in forked workers, which need their own s3fs instance and loop.
        loader = torch.utils.data.DataLoader(
            tg.Dataset(src),
            batch_size=8,
            num_workers=2,
            multiprocessing_context="fork",
            collate_fn=lambda b: b,
        )
        got = [r for batch in loader for r in batch]
        assert len(got) == 50
        assert all(_same(g, r) for g, r in zip(got, recs))
        # Pickled (spawn / forkserver workers) it rebuilds its filesystem too.
        clone = pickle.loads(pickle.dumps(src))
        assert _same(clone.__getitems__([49, 0])[0], recs[49])


def test_s3_cache_with_workers(s3, tmp_path):
    client, endpoint = s3
    d, recs = _write(tmp_path, n=40, shards=4)
    _upload(client, "bkt-b", d, "train")
    cache_dir = tmp_path / "cache"
    src = tg.ArrayRecordSource(
        "s3://bkt-b/train",
        storage_options={"endpoint_url": endpoint},
        cache_dir=cache_dir,
        cache_bytes=1 << 30,
    )
    assert _same(src[0], recs[0])  # parent fetches shard 0
    assert src.io_stats["cache_misses"] == 1
    order = np.random.default_rng(0).permutation(40).tolist()
    loader = torch.utils.data.DataLoader(
        tg.Dataset(src),
        batch_size=5,
        sampler=order,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=lambda b: b,
    )
    got = [r for batch in loader for r in batch]
    assert all(_same(g, recs[i]) for g, i in zip(got, order))
    # Every shard is in the cache exactly once, complete, under its final name.
    cached = sorted(os.listdir(cache_dir))
    data = [c for c in cached if not c.startswith(".")]
    assert len(data) == 4
    assert not [c for c in cached if c.startswith(".tmp-")]
    local_sizes = sorted(os.path.getsize(os.path.join(d, f)) for f in _shard_files(d))
    assert sorted(os.path.getsize(cache_dir / c) for c in data) == local_sizes


# ----------------------------------------------------------------------- HTTP
@pytest.mark.parametrize("cached", [False, True])
def test_http_reads_match_local(http, tmp_path, cached):
    srv, root = http
    d, recs = _write(root, n=45, shards=3)
    kw = {"cache_dir": tmp_path / "c", "cache_bytes": 1 << 30} if cached else {}
    src = tg.ArrayRecordSource(f"{srv.url}/ds", **kw)
    assert len(src) == 45
    idx = list(np.random.default_rng(0).permutation(45))
    got = src.__getitems__(idx)
    assert all(_same(g, recs[i]) for g, i in zip(got, idx))
    if cached:
        src2 = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c")
        srv.reset_counts()
        src2.__getitems__(idx)  # a second epoch, another process's view: no shard GETs
        assert sum(srv.gets(f"/ds/{f}") for f in _shard_files(d)) == 0
        assert src2.io_stats["cache_hits"] == 3 and src2.io_stats["cache_misses"] == 0


def test_local_files_are_never_cached(tmp_path):
    d, recs = _write(tmp_path, n=10, shards=2)
    src = tg.ArrayRecordSource(d, cache_dir=tmp_path / "c")
    assert src.cache is None
    assert _same(src[3], recs[3])
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("io_threads", [1, 8])
def test_parallel_extraction_overlaps_requests(http, io_threads):
    srv, root = http
    _d, recs = _write(root, n=80, shards=8)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", io_threads=io_threads)
    src[0]
    srv.latency_s = 0.05
    srv.reset_counts()
    idx = list(range(0, 80, 3))  # touches all 8 shards
    got = src.__getitems__(idx)
    assert all(_same(g, recs[i]) for g, i in zip(got, idx))
    if io_threads == 1:
        assert srv.max_inflight == 1
    else:
        assert srv.max_inflight >= 4


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_range_reads_survive_transient_faults(http, kind):
    srv, root = http
    _d, recs = _write(root, n=30, shards=3)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", retry=PATIENT_RETRY, io_threads=1)
    srv.fail_next(6, kind)
    got = src.__getitems__(list(range(30)))
    assert all(_same(g, r) for g, r in zip(got, recs))
    assert srv.pending_faults() == 0
    assert src.io_stats["retries"] >= 1


def test_range_reads_fail_clearly_after_last_try(http):
    srv, root = http
    _write(root, n=30, shards=3)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", retry=FAST_RETRY)
    srv.fail_next(100, "503")
    with pytest.raises(tg.RemoteIOError, match=r"ds/.*array_record.*4 attempts") as ei:
        src[5]
    assert "503" in str(ei.value)


@pytest.mark.parametrize("kind", ["503", "reset", "truncate"])
def test_cached_download_survives_faults(http, tmp_path, kind):
    srv, root = http
    _d, recs = _write(root, n=30, shards=3)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c", retry=PATIENT_RETRY)
    srv.fail_next(6, kind)
    got = src.__getitems__(list(range(30)))
    assert all(_same(g, r) for g, r in zip(got, recs))
    assert src.io_stats["cache_retries"] >= 1
    assert not [f for f in os.listdir(tmp_path / "c") if f.startswith(".tmp-")]


def test_cached_download_fails_clearly_and_leaves_nothing(http, tmp_path):
    srv, root = http
    _write(root, n=30, shards=3)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c", retry=FAST_RETRY)
    srv.fail_next(100, "truncate")
    with pytest.raises(tg.RemoteIOError, match=r"download of .*ds/.*4 attempts"):
        src[0]
    srv.fail_next(0)
    leftovers = [f for f in os.listdir(tmp_path / "c") if f not in (".locks", ".sums", ".tmp")]
    assert leftovers == [] and os.listdir(tmp_path / "c" / ".sums") == []
    assert os.listdir(tmp_path / "c" / ".tmp") == []


def test_not_found_and_forbidden_are_not_retried(http, tmp_path):
    srv, root = http
    d, _ = _write(root, n=30, shards=3)
    src = tg.ArrayRecordSource(f"{srv.url}/ds", retry=FAST_RETRY)
    victim = _shard_files(d)[1]
    os.unlink(os.path.join(d, victim))
    srv.reset_counts()
    with pytest.raises(tg.DatasetNotFoundError, match=victim):
        src[15]
    assert srv.gets(f"/ds/{victim}") == 1

    cached = tg.ArrayRecordSource(f"{srv.url}/ds", cache_dir=tmp_path / "c", retry=FAST_RETRY)
    with pytest.raises(tg.DatasetNotFoundError, match=victim):
        cached[15]

    os.makedirs(os.path.join(root, "forbidden"))
    cache = ShardCache(tmp_path / "c2", max_bytes=1 << 20, retry=FAST_RETRY)
    srv.reset_counts()
    with pytest.raises(PermissionError, match="forbidden/x"):
        cache.fetch(f"{srv.url}/forbidden/x", size=10)
    assert srv.gets("/forbidden/x") == 1


# ----------------------------------------------------------------------- cache
def _fetch_in_process(cache_dir, url, q):
    cache = ShardCache(cache_dir, max_bytes=1 << 30)
    path = cache.fetch(url)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    q.put((path, digest, cache.stats["misses"], cache.stats["waits"]))


def test_two_processes_download_a_shard_once(http, tmp_path):
    srv, root = http
    payload = os.urandom(300_000)
    with open(os.path.join(root, "big.bin"), "wb") as f:
        f.write(payload)
    srv.latency_s = 0.3  # both processes ask while the first download is in flight
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_fetch_in_process, args=(str(tmp_path / "c"), f"{srv.url}/big.bin", q))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert srv.gets("/big.bin") == 1
    assert {r[0] for r in results} == {results[0][0]}
    assert {r[1] for r in results} == {hashlib.sha256(payload).hexdigest()}
    assert sorted(r[2] for r in results) == [0, 1]  # one downloaded, the other waited
    assert sorted(r[3] for r in results) == [0, 1]


def test_lru_eviction_respects_budget_and_open_readers(tmp_path):
    mem = fsspec.filesystem("memory")
    for name in "abcd":
        mem.pipe(f"/lru/{name}", name.encode() * 1000)
    cache = ShardCache(tmp_path / "c", max_bytes=2500)
    pa = cache.fetch("memory://lru/a")
    pb = cache.fetch("memory://lru/b")
    reader = open(pa, "rb")  # noqa: SIM115 - a worker is reading a
    now = time.time()
    used = cache._sum_path  # a copy's last use is its record's modification time
    os.utime(used(pa), (now - 100, now - 100))
    os.utime(used(pb), (now - 50, now - 50))
    cache.fetch("memory://lru/a")  # a hit refreshes a's last use: b is now the LRU
    assert os.stat(used(pa)).st_mtime > now - 10
    cache.fetch("memory://lru/c")
    assert not os.path.exists(pb) and os.path.exists(pa)
    assert cache.total_bytes() <= 2500
    os.utime(used(pa), (now - 100, now - 100))
    cache.fetch("memory://lru/d")  # evicts a while it is open
    assert not os.path.exists(pa)
    assert reader.read() == b"a" * 1000  # the open reader is unaffected
    reader.close()
    assert cache.stats["evictions"] == 2 and cache.total_bytes() <= 2500
    with pytest.raises(ValueError, match="larger than the cache budget"):
        mem.pipe("/lru/huge", b"x" * 3000)
        cache.fetch("memory://lru/huge")


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 400)), min_size=1, max_size=25))
def test_cache_property_budget_and_content(tmp_path_factory, ops):
    mem = fsspec.filesystem("memory")
    cache = ShardCache(tmp_path_factory.mktemp("c"), max_bytes=1000)
    for key, size in ops:
        url = f"memory://prop/{key}-{size}"
        payload = bytes([key]) * size
        mem.pipe(url, payload)
        path = cache.fetch(url, size=size)
        with open(path, "rb") as f:
            assert f.read() == payload
        assert cache.total_bytes() <= 1000


def test_checksum_verified_before_publishing(tmp_path):
    mem = fsspec.filesystem("memory")
    mem.pipe("/ck/shard", b"hello" * 100)
    good = "sha256:" + hashlib.sha256(b"hello" * 100).hexdigest()
    cache = ShardCache(tmp_path / "c", max_bytes=1 << 20)
    with open(cache.fetch("memory://ck/shard", checksum=good), "rb") as f:
        assert f.read() == b"hello" * 100
    bad = "sha256:" + "0" * 64
    with pytest.raises(tg.CorruptDataError, match="checksum"):
        cache.fetch("memory://ck/shard", checksum=bad)
    assert not os.path.exists(cache.local_path("memory://ck/shard", checksum=bad))
    assert not [f for f in os.listdir(tmp_path / "c") if f.startswith(".tmp-")]


def _fetch_forever(cache_dir, url):
    ShardCache(cache_dir, max_bytes=1 << 30).fetch(url)


def test_killed_download_leaves_no_complete_looking_file(http, tmp_path):
    srv, root = http
    payload = os.urandom(1 << 20)
    with open(os.path.join(root, "slow.bin"), "wb") as f:
        f.write(payload)
    srv.rate_bytes_per_s = 1 << 20  # one second for the whole file
    url = f"{srv.url}/slow.bin"
    cache_dir = tmp_path / "c"
    p = mp.get_context("fork").Process(target=_fetch_forever, args=(str(cache_dir), url))
    p.start()
    deadline = time.time() + 30
    tmp = []
    while time.time() < deadline:
        temps = cache_dir / ".tmp"  # (the temp files' folder)
        tmp = [f for f in os.listdir(temps) if f.startswith(".tmp-")] if temps.exists() else []
        if tmp and os.path.getsize(temps / tmp[0]) > 0:
            break
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    cache = ShardCache(cache_dir, max_bytes=1 << 30)
    final = cache.local_path(url)
    assert tmp and not os.path.exists(final)  # only an obviously temporary file remains
    srv.rate_bytes_per_s = 0
    assert cache.total_bytes() == 0
    with open(cache.fetch(url), "rb") as f:
        assert f.read() == payload
    assert not [f for f in os.listdir(cache_dir) if f.startswith(".tmp-")]  # cleaned up


# ----------------------------------------------------------------------- Parquet
def test_s3_parquet_with_workers_and_faults(s3, http, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    client, endpoint = s3
    d = tmp_path / "pq"
    d.mkdir()
    for k in range(3):
        t = pa.table({"x": np.arange(k * 20, k * 20 + 20), "s": [f"r{i}" for i in range(20)]})
        pq.write_table(t, d / f"part-{k}.parquet", row_group_size=7)
    _upload(client, "bkt-pq", str(d), "train")
    src = tg.ParquetSource("s3://bkt-pq/train", storage_options={"endpoint_url": endpoint})
    assert len(src) == 60 and src[25]["x"] == 25  # used in the parent first
    loader = torch.utils.data.DataLoader(
        tg.Dataset(src),
        batch_size=7,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=lambda b: b,
    )
    assert [r["x"] for b in loader for r in b] == list(range(60))

    # Over HTTP, transient faults on row-group reads are retried.
    srv, root = http
    shutil.copytree(d, os.path.join(root, "pq"))
    hsrc = tg.ParquetSource([f"{srv.url}/pq/part-{k}.parquet" for k in range(3)])
    srv.fail_next(6, "503")
    assert [r["x"] for r in hsrc.__getitems__(list(range(60)))] == list(range(60))
