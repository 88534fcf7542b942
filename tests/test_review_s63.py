"""Review of remote reads, caches and conversion: bytes fetched ahead of a dataset
re-uploaded and opened again are not served to it; the node-local stores scale with the
number of entries (a write lists the writes in flight, not every entry); a conversion
never carries a damaged input into an output that vouches for it, nor mixes two versions
of a file rewritten while it is read, nor writes beside Parquet files it would be read
with; a tf.train.SequenceExample is never decoded as an Example (its lists dropped); a
redirect loop is not a missing file; a sampler state is not resumed over other files."""

from __future__ import annotations

import os
import warnings

import fsspec
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.ranges import fetch_batch, fetch_ranges, range_store
from torchgrain.io.retry import RetryPolicy
from torchgrain.io.shard_cache import ShardCache


def _write(path, fill: int) -> list[bytes]:
    records = [bytes([fill]) * 40 + i.to_bytes(4, "little") for i in range(30)]
    write_tfrecord(records, path)
    return records


def test_bytes_fetched_ahead_of_a_reupload_are_not_served_to_the_dataset_opened_again(tmp_path):
    # Read-ahead leaves ranges of the first opening in this process's range store; the
    # file is then re-uploaded (same size, new validators) and the dataset opened again:
    # its reads get the new file's bytes, not the old ones left in the store.
    www = tmp_path / "www"
    www.mkdir()
    path = str(www / "part-0.tfrecord")
    old = _write(path, 1)
    with RangeHTTPServer(www) as srv, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        url = f"{srv.url}/part-0.tfrecord"
        first = tg.TFRecordSource(url, codec="raw", index_dir=None)
        assert first[0]["bytes"] == old[0]
        fs = first.filesystem
        rpath = fs._strip_protocol(url)
        size = os.path.getsize(path)
        # What read-ahead does: the file's bytes fetched into the store, kept for a read.
        fetch_batch(fs, [(rpath, url, [(0, size)])], store=range_store(), owner=object())
        assert range_store().nbytes >= size
        new = _write(path, 2)
        assert os.path.getsize(path) == size
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # a new ETag
        again = tg.TFRecordSource(url, codec="raw", index_dir=None)  # pins the new file
        with open(path, "rb") as f:
            assert bytes(fetch_ranges(fs, rpath, [(0, size)], name=url)[0]) == f.read()
        assert [r["bytes"] for r in again.__getitems__(list(range(30)))] == new


def test_a_shard_cache_fills_in_time_linear_in_its_copies(tmp_path):
    # Each download used to list every copy (and stat its record) three times: 4,000
    # copies took 189 s to fill, 47 ms a copy at the end. Counted, not timed: the
    # directory listings per download stay constant as the cache grows.
    mem = fsspec.filesystem("memory")
    for i in range(300):
        mem.pipe(f"/linear/s{i}", b"x" * 10)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(200):
            cache.fetch(f"memory://linear/s{i}")
        listed = _listings(lambda: [cache.fetch(f"memory://linear/s{i}") for i in range(200, 300)])
    # The last 100 downloads, into a cache of 200-300 copies: no listing of the copies.
    assert max(listed, default=0) < 10, max(listed)
    assert cache.total_bytes() == 3000


def _listings(fn) -> list[int]:
    """The number of names in each directory ``fn`` lists."""
    listed, real = [], os.scandir

    def counting(path=".", *a, **kw):
        listed.append(len(os.listdir(path)) if os.path.isdir(path) else 0)
        return real(path, *a, **kw)

    os.scandir = counting
    try:
        fn()
    finally:
        os.scandir = real
    return listed


def test_the_first_opening_of_many_tfrecord_files_lists_no_index_entries(tmp_path):
    # Each file's offsets are an entry of the index directory: their writes used to list
    # the whole directory (10,000 files: 226 s for the first opening, 12 s now).
    data = tmp_path / "tf"
    data.mkdir()
    for i in range(120):
        write_tfrecord([b"r"] * 3, str(data / f"part-{i:04d}.tfrecord"))
    index_dir = str(tmp_path / "index")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        listed = _listings(lambda: tg.TFRecordSource(str(data), codec="raw", index_dir=index_dir))
    assert len(os.listdir(index_dir)) > 240  # each file's offsets and their locks
    assert max(listed) < 130, sorted(listed)[-5:]  # the data directory's listing only


def test_a_damaged_arrayrecord_input_is_not_converted(tmp_path):
    # Its manifest's checksum of the records is checked as they are read: copied as they
    # are, they would go into an output whose new checksum vouches for the damage.
    src = tmp_path / "src"
    tg.write_array_record(
        [{"text": f"record-{i:05d}"} for i in range(200)], str(src), compression="uncompressed"
    )
    shard = src / "data-00000-of-00001.array_record"
    raw = bytearray(shard.read_bytes())
    raw[raw.find(b"record-00123") + 7] ^= 1  # record-10123: a valid record, other bytes
    shard.write_bytes(bytes(raw))
    for to in ("array_record", "parquet"):
        with pytest.raises(tg.CorruptDataError, match=r"input shard 0 .* does not match"):
            tg.convert(str(src), str(tmp_path / to), to=to, progress=False)
        assert not (tmp_path / to).exists() or not any(
            n.endswith((".parquet", ".array_record")) for n in os.listdir(tmp_path / to)
        )


def test_a_tfrecord_file_rewritten_while_it_is_read_in_order_is_refused(tmp_path):
    # Same size, same count, its modification time put back: the records read before
    # and after the rewrite are of two files (a conversion wrote them as one).
    path = tmp_path / "in.tfrecord"
    write_tfrecord([b"A%05d" % i for i in range(2000)], str(path))
    src = tg.TFRecordSource(str(path), codec="raw", index_dir=None)
    it = src.iter_shard_bytes(0)
    assert next(it) == b"A00000"
    st = os.stat(path)
    write_tfrecord([b"B%05d" % i for i in range(2000)], str(tmp_path / "new.tfrecord"))
    with open(path, "r+b") as f:
        f.write((tmp_path / "new.tfrecord").read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(tg.CorruptDataError, match="changed since the dataset was opened"):
        list(it)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_sequence_examples_are_read_raw_not_as_examples_without_their_lists(tmp_path):
    # A SequenceExample's context is an Example's field 1; its feature_lists (field 2)
    # an Example decode skipped: every list dropped, with no error.
    from torchgrain.formats.tf_example import decode_tf_example, encode_tf_example

    tokens = _field(1, _field(3, _field(1, b"".join(_varint(v) for v in (5, 6, 7)))))
    lists = _field(1, _field(1, b"tokens") + _field(2, tokens))
    records = [encode_tf_example({"id": i}) + _field(2, lists) for i in range(10)]
    path = tmp_path / "seq.tfrecord"
    write_tfrecord(records, str(path))
    src = tg.TFRecordSource(str(path), index_dir=None)  # codec="auto"
    assert src.codec.name == "raw" and src[3]["bytes"] == records[3]
    with pytest.raises(tg.RecordDecodeError, match="SequenceExample"):
        decode_tf_example(records[0])
    assert decode_tf_example(encode_tf_example({"id": 1}))["id"].tolist() == [1]


def test_a_parquet_conversion_is_not_written_beside_parquet_files_it_would_be_read_with(
    tmp_path,
):
    tg.write_array_record([{"i": i} for i in range(10)], str(tmp_path / "src"))
    dst = tmp_path / "dst"
    tg.write_parquet([{"i": i} for i in range(10)], str(dst), num_shards=2)
    for overwrite in (False, True):  # (overwrite removes only what a conversion wrote)
        with pytest.raises(FileExistsError, match="would be read with the conversion"):
            tg.convert(
                str(tmp_path / "src"), str(dst), to="parquet", num_shards=3, overwrite=overwrite
            )
    assert len(tg.ParquetSource(str(dst))) == 10
    tg.convert(str(tmp_path / "src"), str(tmp_path / "ok"), to="parquet", num_shards=3)
    tg.convert(str(tmp_path / "src"), str(tmp_path / "ok"), to="parquet", num_shards=3)
    assert len(tg.ParquetSource(str(tmp_path / "ok"))) == 10  # (a rerun: its own shards)


def test_a_redirect_loop_is_not_reported_as_a_missing_file(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Loop(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(302)
            self.send_header("Location", self.path)  # itself, for ever
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Loop)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/d/part-0.tfrecord"
        fast = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, deadline=10)
        with pytest.raises(tg.RemoteIOError, match="redirects go round"):
            tg.TFRecordSource(url, index_dir=None, allow_external_paths=True, retry=fast)
    finally:
        server.shutdown()
        server.server_close()


def _state_after(ds, batches: int) -> dict:
    sampler = tg.GlobalShuffleSampler(ds, seed=3)
    it = iter(sampler)
    for _ in range(batches * 10):
        next(it)
    return sampler.state_dict(consumed=batches * 10)


def test_a_dataset_rewritten_with_its_length_kept_is_not_resumed_at_other_records(tmp_path):
    # Re-converted (records dealt to shards another way) or a shard swapped for another
    # of as many records: the same length, so the length check passed, and the resumed
    # epoch read records already trained on and never others.
    import shutil

    ar = tmp_path / "ar"
    tg.write_array_record([{"i": i} for i in range(400)], str(ar), num_shards=4)
    state = _state_after(tg.ArrayRecordSource(str(ar)), 5)
    copy = tmp_path / "copy"
    shutil.copytree(ar, copy)  # the same files elsewhere (another node's copy): resumed
    tg.GlobalShuffleSampler(tg.ArrayRecordSource(str(copy)), seed=3).load_state_dict(state)
    dealt = [{"i": i} for k in range(4) for i in range(k, 400, 4)]  # other shard contents
    tg.write_array_record(dealt, str(ar), num_shards=4, overwrite=True)
    with pytest.raises(ValueError, match="state was saved for other data"):
        tg.GlobalShuffleSampler(tg.ArrayRecordSource(str(ar)), seed=3).load_state_dict(state)

    pq = tmp_path / "pq"
    for name in "abcd":
        tg.write_parquet([{"n": name}] * 50, str(pq / name), num_shards=1)
        shutil.move(str(pq / name / "data-00000-of-00001.parquet"), str(pq / f"{name}.parquet"))
        (pq / name).rmdir()
    for sampler in (tg.GlobalShuffleSampler, tg.BlockShuffleSampler):
        state = sampler(tg.ParquetSource(str(pq)), seed=3).state_dict()
        (pq / "a.parquet").rename(pq / "e.parquet")  # another shard of as many records
        with pytest.raises(ValueError, match="state was saved for other data"):
            sampler(tg.ParquetSource(str(pq)), seed=3).load_state_dict(state)
        (pq / "e.parquet").rename(pq / "a.parquet")
        sampler(tg.ParquetSource(str(pq)), seed=3).load_state_dict(state)


def test_the_same_files_opened_without_their_manifest_resume(tmp_path):
    # Opened by a list of files, the manifest is not read: no checksums to compare, the
    # files' names and counts still are.
    d = tmp_path / "ar"
    tg.write_array_record([{"i": i} for i in range(100)], str(d), num_shards=3)
    state = _state_after(tg.ArrayRecordSource(str(d)), 2)
    files = sorted(str(p) for p in d.glob("*.array_record"))
    tg.GlobalShuffleSampler(tg.ArrayRecordSource(files), seed=3).load_state_dict(state)


def test_copies_added_behind_the_running_total_are_counted_by_the_next_process(tmp_path):
    # A process of an earlier release adds copies without adding them to the total: a
    # store counts its entries once per process (here: per store object) before trusting it.
    mem = fsspec.filesystem("memory")
    for i in range(15):
        mem.pipe(f"/behind/s{i}", b"x" * 1000)
    directory = str(tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = ShardCache(directory, max_bytes=10_000)
        for i in range(5):
            first.fetch(f"memory://behind/s{i}")
        for i in range(5, 10):  # as an earlier release leaves them: the total not told
            with open(os.path.join(directory, f"old-{i}"), "wb") as f:
                f.write(b"y" * 1000)
        later = ShardCache(directory, max_bytes=10_000)
        for i in range(10, 15):
            later.fetch(f"memory://behind/s{i}")
    assert later.total_bytes() <= 10_000
