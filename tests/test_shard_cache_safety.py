"""The shard cache under hostile conditions: copies that no longer match what was
downloaded (or the manifest), threads and processes sharing one cache smaller than the
data, a download killed mid-transfer. Through the public source API, against a real HTTP
server on 127.0.0.1, with real threads, processes and DataLoader workers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.formats.codecs import get_codec
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.retry import RetryPolicy
from torchgrain.io.shard_cache import ShardCache

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 240  # records; record i's payload is 64 bytes of value i (unique: N < 256)
SHARDS = 6
PAYLOAD = 64
FORMATS = ("array_record", "parquet", "tfrecord")
PATHS = ("record", "batch", "columns")
# Sources without their in-memory cache of decoded blocks (TFRecord has none).
NO_BLOCK_CACHE = {
    "array_record": {"cache_bytes": 0, "cache_dir_bytes": 1 << 30},
    "parquet": {"cache_bytes": 0},
    "tfrecord": {},
}


def _records(n: int = N) -> list[dict]:
    return [{"i": i, "x": np.full(PAYLOAD, i, np.uint8)} for i in range(n)]


def _write(root: str, fmt: str, n: int = N, shards: int = SHARDS) -> str:
    """Write ``n`` records in ``shards`` uncompressed files under ``root/fmt`` (so that a
    flipped byte changes a value instead of breaking a decompressor)."""
    recs = _records(n)
    d = os.path.join(root, fmt)
    if fmt == "array_record":
        tg.write_array_record(recs, d, num_shards=shards, compression="uncompressed")
        return d
    os.makedirs(d)
    per = -(-n // shards)
    for s in range(shards):
        part = recs[s * per : (s + 1) * per]
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({"i": [r["i"] for r in part], "x": [r["x"].tobytes() for r in part]})
            pq.write_table(
                table,
                os.path.join(d, f"part-{s:02d}.parquet"),
                compression="none",
                use_dictionary=False,
                row_group_size=10,
            )
        else:
            codec = get_codec("msgpack")
            write_tfrecord(
                [codec.encode(r) for r in part], os.path.join(d, f"part-{s:02d}.tfrecord")
            )
    return d


def _source(fmt: str, base_url: str, root: str, cache_dir, **kw) -> tg.Source:
    url = f"{base_url}/{fmt}"
    if fmt == "array_record":
        return tg.ArrayRecordSource(url, cache_dir=cache_dir, **kw)
    files = sorted(os.listdir(os.path.join(root, fmt)))
    urls = [f"{url}/{f}" for f in files]
    if fmt == "parquet":
        return tg.ParquetSource(urls, cache_dir=cache_dir, **kw)
    return tg.TFRecordSource(
        urls, codec="msgpack", cache_dir=cache_dir, index_dir=os.path.join(root, "idx"), **kw
    )


def _as_pair(rec: dict) -> tuple[int, bytes]:
    x = rec["x"]
    return int(rec["i"]), bytes(x) if isinstance(x, bytes) else np.asarray(x).tobytes()


def _expected(indices) -> list[tuple[int, bytes]]:
    return [(int(i), bytes([int(i)]) * PAYLOAD) for i in indices]


def _read(src: tg.Source, path: str, indices) -> list[tuple[int, bytes]]:
    indices = [int(i) for i in indices]
    if path == "record":
        return [_as_pair(src[i]) for i in indices]
    if path == "batch":
        return [_as_pair(r) for r in src.__getitems__(indices)]
    return [_as_pair(r) for r in src.read_columns(indices).records()]


def _read_all(src: tg.Source, path: str, batch: int = 48) -> list[tuple[int, bytes]]:
    out = []
    order = np.random.default_rng(0).permutation(len(src))  # batches span shards
    for a in range(0, len(order), batch):
        out += _read(src, path, order[a : a + batch])
    return sorted(out)


def _copies(cache_dir) -> list[str]:
    return sorted(
        os.path.join(cache_dir, f) for f in os.listdir(cache_dir) if not f.startswith(".")
    )


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _flip_payload(path: str, value: int, *, keep_mtime: bool) -> None:
    """Flip one byte of record ``value``'s payload in place (same size, same inode);
    ``keep_mtime`` puts the modification time back, as if nothing had happened."""
    data = _bytes(path)
    at = data.find(bytes([value]) * PAYLOAD)
    assert at >= 0, f"record {value}'s payload is not in {path}"
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at + PAYLOAD // 2)
        f.write(bytes([value ^ 0xFF]))
    # An in-place write moves the modification time, but within one clock tick of the
    # download it may not: say which case this is, explicitly.
    mtime = st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(st.st_atime_ns, mtime))


def _copy_holding(cache_dir, value: int) -> str:
    for p in _copies(cache_dir):
        if bytes([value]) * PAYLOAD in _bytes(p):
            return p
    raise AssertionError(f"no cached copy holds record {value}")


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    with RangeHTTPServer(root) as srv:
        yield srv, str(root)


# ------------------------------------------------------------------- integrity
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cached_copy_with_a_flipped_byte_is_never_served(served, tmp_path, fmt, path):
    """A copy downloaded by one process (here: another source) and then changed on disk,
    even with its modification time put back, is checked by the next process that uses
    it, discarded and downloaded again: the records are right."""
    srv, root = served
    _write(root, fmt)
    cache = tmp_path / "cache"
    first = _source(fmt, srv.url, root, cache)
    assert _read_all(first, path) == _expected(range(N))
    victim = _copy_holding(cache, 100)
    _flip_payload(victim, 100, keep_mtime=True)

    src = _source(fmt, srv.url, root, cache)  # a new process's view: nothing checked yet
    with pytest.warns(RuntimeWarning, match="no longer matches what was downloaded"):
        got = _read_all(src, path)
    assert got == _expected(range(N))
    assert src.io_stats["cache_rejected"] == 1
    assert src.io_stats["cache_misses"] == 1  # only the bad copy was downloaded again
    assert bytes([100]) * PAYLOAD in _bytes(victim)


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime_moved", "mtime_put_back"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_copy_rewritten_in_place_under_an_open_reader_is_checked_again(
    served, tmp_path, fmt, keep_mtime
):
    """The same source keeps a reader of each copy open; a copy written to afterwards
    is checked again before its next use, even with its modification time put back
    (``touch -r``, ``cp -p``): the write moved its change time. (No cache of decoded
    blocks: those hold what was read before the change.)"""
    srv, root = served
    _write(root, fmt)
    cache = tmp_path / "cache"
    src = _source(fmt, srv.url, root, cache, **NO_BLOCK_CACHE[fmt])
    assert _read_all(src, "batch") == _expected(range(N))
    _flip_payload(_copy_holding(cache, 7), 7, keep_mtime=keep_mtime)
    with pytest.warns(RuntimeWarning, match="no longer matches"):
        assert _read(src, "record", [7]) == _expected([7])
    assert _read_all(src, "batch") == _expected(range(N))
    assert src.io_stats["cache_rejected"] == 1


def test_a_copy_replaced_under_the_same_name_is_checked_before_use(served, tmp_path):
    """A new file renamed over a copy (another inode) is not the file that was checked:
    a good one is checked and used, a bad one discarded."""
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    src = _source("array_record", srv.url, root, cache)
    assert _read_all(src, "batch") == _expected(range(N))
    victim = _copy_holding(cache, 50)
    good = _bytes(victim)

    with open(victim + ".new", "wb") as f:
        f.write(good)
    os.replace(victim + ".new", victim)  # the same bytes under a new inode
    assert _read(src, "batch", [50, 200]) == _expected([50, 200])
    stats = src.io_stats
    assert stats["cache_verified"] == 1 and stats["cache_rejected"] == 0

    bad = bytearray(good)
    bad[good.find(bytes([50]) * PAYLOAD) + 3] ^= 1
    with open(victim + ".new", "wb") as f:
        f.write(bad)
    os.replace(victim + ".new", victim)
    with pytest.warns(RuntimeWarning, match="no longer matches"):
        assert _read(src, "record", [50]) == _expected([50])
    assert src.io_stats["cache_rejected"] == 1


def test_a_new_file_reusing_a_checked_copys_inode_size_and_times_is_checked(served, tmp_path):
    """A copy this process checked is deleted and written anew (not by the cache) with
    other bytes; the file system gives the new file the same inode number, and its size
    and modification time are the old ones: it is not the file that was checked."""
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    src = _source("array_record", srv.url, root, cache)
    assert _read_all(src, "batch") == _expected(range(N))
    src.close()  # no reader holds the old file: its inode number is free again
    victim = _copy_holding(cache, 100)
    good, st = _bytes(victim), os.stat(victim)
    bad = bytearray(good)
    bad[good.find(bytes([100]) * PAYLOAD) + 5] ^= 0xFF
    for _ in range(20):
        os.unlink(victim)
        with open(victim, "wb") as f:
            f.write(bad)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(victim).st_ino == st.st_ino:
            break
    else:
        pytest.skip("this file system does not reuse a deleted file's inode number")
    with pytest.warns(RuntimeWarning, match="no longer matches"):
        assert _read(src, "record", [100]) == _expected([100])
    assert src.io_stats["cache_rejected"] == 1


def test_a_truncated_or_unrecorded_copy_is_fetched_again(served, tmp_path):
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    assert _read_all(_source("array_record", srv.url, root, cache), "batch") == _expected(range(N))
    victim = _copy_holding(cache, 10)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 1)
    other = _copy_holding(cache, 200)
    os.unlink(os.path.join(cache, ".sums", os.path.basename(other)))  # an older version's
    src = _source("array_record", srv.url, root, cache)
    assert _read_all(src, "record") == _expected(range(N))
    assert src.io_stats["cache_misses"] == 2 and src.io_stats["cache_rejected"] == 2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["file_checksum", "records_checksum"])
def test_a_remote_shard_that_does_not_match_its_manifest_is_never_served(
    served, tmp_path, kind, path
):
    """A shard changed on the server after its manifest was written is refused at
    download (CorruptDataError naming the URL), on every read path; no copy is kept."""
    srv, root = served
    d = _write(root, "array_record")
    manifest = os.path.join(d, "torchgrain.json")
    doc = json.loads(_bytes(manifest))
    if kind == "records_checksum":  # older manifests: only the records' checksum
        for shard in doc["shards"]:
            del shard["file_checksum"]
        with open(manifest, "w") as f:
            json.dump(doc, f)
    victim = os.path.join(d, doc["shards"][2]["path"])
    _flip_payload(victim, 100, keep_mtime=True)
    cache = tmp_path / "cache"
    src = _source("array_record", srv.url, root, cache, io_threads=1)
    # other shards read fine
    assert _read(src, path, [0, 239]) == _expected([0, 239])
    with pytest.raises(tg.CorruptDataError, match=r"downloaded .*/array_record/data-00002"):
        _read(src, path, [100] if path == "record" else [0, 100, 239])
    assert not any("data-00002" in p for p in _copies(cache))
    assert not [f for f in os.listdir(cache) if f.startswith(".tmp-")]


def test_a_download_shorter_than_the_manifest_says_is_never_published(served, tmp_path):
    """A server that serves fewer bytes than the manifest lists (no checksums to catch
    it): the transfer counts as cut short, is retried, then fails; no copy is kept."""
    srv, root = served
    d = _write(root, "array_record")
    manifest = os.path.join(d, "torchgrain.json")
    doc = json.loads(_bytes(manifest))
    for shard in doc["shards"]:
        del shard["file_checksum"], shard["checksum"]
    with open(manifest, "w") as f:
        json.dump(doc, f)
    victim = os.path.join(d, doc["shards"][1]["path"])
    os.truncate(victim, os.path.getsize(victim) - 100)
    cache = tmp_path / "cache"
    src = _source("array_record", srv.url, root, cache, retry=FAST_RETRY)
    with pytest.raises(tg.RemoteIOError, match="ended after"):
        src[50]
    assert _copies(cache) == [] and src[0]["i"] == 0


def test_each_process_checks_a_copy_once(served, tmp_path):
    """The cost of the checks: one read of each copy per process, not per use."""
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    _read_all(_source("array_record", srv.url, root, cache), "batch")
    src = _source("array_record", srv.url, root, cache)
    for _ in range(3):
        assert _read_all(src, "batch") == _expected(range(N))
    stats = src.io_stats
    assert stats["cache_verified"] == SHARDS and stats["cache_misses"] == 0
    assert stats["cache_bytes_verified"] == sum(os.path.getsize(p) for p in _copies(cache))


def test_verify_hits_false_trusts_a_copy_of_the_right_size(served, tmp_path):
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    _read_all(_source("array_record", srv.url, root, cache), "batch")
    _flip_payload(_copy_holding(cache, 100), 100, keep_mtime=True)
    trusting = ShardCache(cache, max_bytes=1 << 30, verify_hits=False)
    src = _source("array_record", srv.url, root, trusting)
    assert _read(src, "record", [100]) != _expected([100])  # what the check prevents
    assert src.io_stats["cache_verified"] == 0
    # A copy of another size than the manifest's is never served, even so.
    victim = _copy_holding(cache, 10)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 1)
    assert _read(src, "record", [10]) == _expected([10])
    assert src.io_stats["cache_rejected"] == 1


# ------------------------------------------------------------ threads, processes
@pytest.mark.parametrize("fmt", FORMATS)
def test_eight_threads_sharing_a_source_and_a_small_cache_read_every_batch_exactly(
    served, tmp_path, fmt
):
    """A cache holding a third of the data, shared by eight threads that read random
    batches (records and columns): copies are evicted and fetched again all the time,
    readers are replaced under the threads, and every batch is exact."""
    srv, root = served
    _write(root, fmt, shards=12)
    total = sum(os.path.getsize(os.path.join(root, fmt, f)) for f in os.listdir(f"{root}/{fmt}"))
    src = _source(fmt, srv.url, root, tmp_path / "cache", cache_dir_bytes=total // 3)
    errors: list[str] = []

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for k in range(25):
            idx = rng.choice(N, 24, replace=False)
            try:
                got = _read(src, "columns" if k % 3 == 0 else "batch", idx)
                if got != _expected(idx):
                    errors.append(f"thread {seed} batch {k}: wrong records")
            except Exception as e:  # every failure is reported, not just the first
                errors.append(f"thread {seed} batch {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert src.io_stats["cache_evictions"] > 0  # the cache really was too small


def test_a_reader_in_use_is_not_closed_when_its_copy_leaves_the_open_set(served, tmp_path):
    """A read holds its reader of a cached copy: closing the source (or retiring the
    copy) meanwhile closes that reader only when the read ends."""
    srv, root = served
    _write(root, "tfrecord")
    src = _source("tfrecord", srv.url, root, tmp_path / "cache")
    src[0]  # the copy of shard 0 is open
    reader = None

    def read_while_closed() -> bytes:
        nonlocal reader
        reader = src._reader(0)
        src.close()  # another thread's close(), or its batch retiring the copy
        return bytes(reader.file.read_ranges([(0, 16)])[0])

    assert len(src._io(read_while_closed, 0, "test read")) == 16
    assert reader.file._fd is None  # closed once the read ended
    assert _read_all(src, "batch") == _expected(range(N))


def _read_everything_in_a_process(fmt, url_root, root, cache_dir, budget, seed, q):
    try:
        src = _source(fmt, url_root, root, cache_dir, cache_dir_bytes=budget)
        rng = np.random.default_rng(seed)
        bad = 0
        for _ in range(2):  # two epochs, each record once, in batches across shards
            order = rng.permutation(N)
            for a in range(0, N, 20):
                idx = order[a : a + 20]
                bad += _read(src, "batch", idx) != _expected(idx)
        q.put((seed, bad, src.io_stats["cache_misses"], None))
    except BaseException as e:
        q.put((seed, -1, 0, f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("fmt", ["array_record", "parquet"])
def test_processes_sharing_a_small_cache_dir_each_read_every_record_exactly(served, tmp_path, fmt):
    srv, root = served
    _write(root, fmt, shards=12)
    total = sum(os.path.getsize(os.path.join(root, fmt, f)) for f in os.listdir(f"{root}/{fmt}"))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    args = (fmt, srv.url, root, str(tmp_path / "cache"), total // 3)
    procs = [
        ctx.Process(target=_read_everything_in_a_process, args=(*args, s, q)) for s in range(3)
    ]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [(seed, bad, err) for seed, bad, _, err in results] == [(s, 0, None) for s in range(3)]
    assert sum(r[2] for r in results) > 12  # copies were evicted and fetched again


_KILLED_READER = textwrap.dedent(
    """
    import sys
    import torchgrain as tg
    src = tg.ArrayRecordSource(sys.argv[1], cache_dir=sys.argv[2])
    print("reading", flush=True)
    src[0]
    """
)


def test_a_download_killed_mid_transfer_is_cleaned_up_and_never_served(served, tmp_path):
    srv, root = served
    d = _write(root, "array_record", shards=2)
    cache = tmp_path / "cache"
    srv.rate_bytes_per_s = 64 << 10  # a few seconds per shard
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_READER, f"{srv.url}/array_record", str(cache)],
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline() == b"reading\n"
        deadline = time.monotonic() + 120
        tmp: list[str] = []
        while time.monotonic() < deadline and child.poll() is None:
            temps = cache / ".tmp"  # (the temp files' folder)
            tmp = [f for f in os.listdir(temps) if f.startswith(".tmp-")] if temps.exists() else []
            if tmp and os.path.getsize(temps / tmp[0]) > 0:
                break
            time.sleep(0.01)  # polling the file system, not synchronising on time
        assert tmp, "the download never started"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert _copies(cache) == []  # only an obviously temporary file: nothing to serve
    srv.rate_bytes_per_s = 0
    src = tg.ArrayRecordSource(f"{srv.url}/array_record", cache_dir=cache)
    assert _read_all(src, "batch") == _expected(range(N))
    assert not [f for f in os.listdir(cache) if f.startswith(".tmp-")]
    assert len(_copies(cache)) == 2 and os.path.isdir(d)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_copy_corrupted_between_epochs_is_never_served(served, tmp_path, persistent):
    """DataLoader workers share the cache; between two epochs a copy is changed on disk.
    New workers check it at first use; persistent ones see that it changed."""
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    src = _source("array_record", srv.url, root, cache)
    loader = torch.utils.data.DataLoader(
        tg.Dataset(src),
        batch_size=16,
        sampler=tg.GlobalShuffleSampler(src, seed=0),
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context="fork",
        collate_fn=lambda b: [_as_pair(r) for r in b],
    )

    def epoch(e: int) -> list[tuple[int, bytes]]:
        loader.sampler.set_epoch(e)
        return sorted(p for batch in loader for p in batch)

    assert epoch(0) == _expected(range(N))
    # The main process uses (and checks) the copy too: forked workers check it anew.
    assert _read(src, "record", [33]) == _expected([33])
    victim = _copy_holding(cache, 33)
    _flip_payload(victim, 33, keep_mtime=not persistent)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the workers' warnings go to their stderr
        assert epoch(1) == _expected(range(N))
    assert bytes([33]) * PAYLOAD in _bytes(victim)  # downloaded again


def test_a_dataloader_with_workers_and_read_ahead_sharing_a_small_cache_reads_every_record(
    served, tmp_path
):
    srv, root = served
    _write(root, "array_record", shards=12)
    d = os.path.join(root, "array_record")
    total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    src = _source("array_record", srv.url, root, tmp_path / "cache", cache_dir_bytes=total // 2)
    assert src.read_ahead_bytes > 0
    sampler = tg.BlockShuffleSampler(src, seed=0, window=2)
    loader = torch.utils.data.DataLoader(
        tg.Dataset(src),
        batch_size=12,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=lambda b: [_as_pair(r) for r in b],
    )
    for e in range(2):
        sampler.set_epoch(e)
        assert sorted(p for batch in loader for p in batch) == _expected(range(N))


def test_eviction_never_unlinks_a_copy_between_its_check_and_its_open(tmp_path):
    """Eviction skips a copy whose shard lock is held: a copy being checked and opened
    by one worker cannot vanish under it, even when another needs the room."""
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/evict-race/a", b"a" * 1000)
    mem.pipe("/evict-race/b", b"b" * 1000)
    cache = ShardCache(tmp_path / "c", max_bytes=1500)
    cache.fetch("memory://evict-race/a")
    other = ShardCache(tmp_path / "c", max_bytes=1500)  # another worker

    def opener(path: str):
        # between check and open, another worker needs room for b
        other.fetch("memory://evict-race/b")
        return open(path, "rb")

    reader = ShardCache(tmp_path / "c", max_bytes=1500)
    path, _, f = reader.fetch_open("memory://evict-race/a", opener)
    with f:
        assert f.read() == b"a" * 1000
    assert os.path.exists(path) and other.stats["evictions"] == 0  # b went over budget
    mem.pipe("/evict-race/c", b"c" * 400)
    cache.fetch("memory://evict-race/c")  # the next download settles the budget
    assert cache.total_bytes() <= 1500


@pytest.mark.parametrize("returned", [None, True, "abc", "crc32:zz", b"crc32:00000000"])
def test_a_verifiers_return_value_is_recorded_only_when_it_is_a_crc(tmp_path, returned):
    """A verifier that read the whole file may hand the cache its CRC (one read fewer);
    anything else it returns (None, or a value of its own) must not become the record
    every later use is checked against."""
    import hashlib

    import fsspec

    from torchgrain.io.cache_records import file_crc, read_record

    data = os.urandom(50_000)
    fsspec.filesystem("memory").pipe("/verifier-returns/shard", data)
    checksum = "sha256:" + hashlib.sha256(data).hexdigest()
    cache = ShardCache(tmp_path / "c", max_bytes=1 << 30)
    path = cache.fetch(
        "memory://verifier-returns/shard", checksum=checksum, verify=lambda p, c, name: returned
    )
    assert read_record(cache._sum_path(path)) == (file_crc(path)[0], len(data))
    # Another process's cache (a fresh instance) checks the copy against it: a hit.
    again = ShardCache(tmp_path / "c", max_bytes=1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.fetch("memory://verifier-returns/shard", checksum=checksum)
    assert again.stats["hits"] == 1 and again.stats["misses"] == 0


@pytest.mark.parametrize("deletions", [1, 99])
def test_a_cache_directory_deleted_during_a_download_never_fails_a_read(
    served, tmp_path, monkeypatch, deletions
):
    """Deleted once (a user cleaning up), the directory is made again and the download
    done once more; deleted again, the source reads by ranges, as on a full disk."""
    import shutil

    from torchgrain.io import remote

    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    get_file = remote.get_file
    left = [deletions]

    def deleted_meanwhile(fs, rpath, lpath, **kwargs):
        get_file(fs, rpath, lpath, **kwargs)
        if left[0]:
            left[0] -= 1
            shutil.rmtree(cache)

    monkeypatch.setattr(remote, "get_file", deleted_meanwhile)
    # One download at a time (a batch per shard, no read-ahead): each deletion is whole.
    src = _source("array_record", srv.url, root, cache, read_ahead_bytes=0)
    per = N // SHARDS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for a in range(0, N, per):
            assert _read(src, "batch", range(a, a + per)) == _expected(range(a, a + per))
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    if deletions == 1:
        assert said == [] and len(_copies(cache)) == SHARDS  # the cache in use again
    else:
        assert len(said) == 1 and repr(str(cache)) in said[0], said
