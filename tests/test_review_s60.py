"""Cases found by the reviews of this stop: each failed before its fix.

- A Parquet column of fixed-size lists of fixed-size lists read as a batch of one row
  of a row group: pyarrow's ``take`` of a slice of such a column ignores the slice's
  offset, and ``read_columns`` handed the next row's values (or zeros) without an error.
- A list column's batch form depended on rows outside the batch: a row group with a null
  anywhere in the column gave a ``[B, k]`` matrix, one without a ``Ragged``, for the same
  values (records give the matrix).
- A filter or token windows over a source of one's own that lists no files went to the
  shared cache under a key of its type and length: a second such source with other
  records got the first one's selection (or window index).
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from torchgrain.columns import ColumnBatch, Ragged
from torchgrain.compose.filter import identified
from torchgrain.io.retry import RetryPolicy


def test_one_row_of_nested_fixed_size_lists_reads_as_its_records(tmp_path):
    inner = pa.list_(pa.int16(), 2)
    nested = pa.list_(inner, 2)
    values = [[[i, 1], [2, 3]] for i in range(6)]
    t = pa.table(
        {
            "m": pa.array(values, nested),
            "s": pa.array([{"a": v} for v in values], pa.struct([("a", nested)])),
        }
    )
    pq.write_table(t, tmp_path / "a.parquet", row_group_size=3)
    src = tg.ParquetSource(tmp_path, decoded_cache=False)
    for rows in ([0], [2], [4], [5], [5, 0], [2, 3]):
        got = src.read_columns(rows)
        assert got["m"].tolist() == [values[r] for r in rows], rows
        assert [np.asarray(s["a"]).tolist() for s in got["s"]] == [values[r] for r in rows]
    loader = torch.utils.data.DataLoader(tg.Dataset(src, batch_format="columns"), batch_size=1)
    assert [b["m"].tolist() for b in loader] == [[v] for v in values]


def test_a_list_columns_batch_form_does_not_depend_on_rows_outside_the_batch(tmp_path):
    rows = [[i, i] for i in range(4)]
    t = pa.table(
        {
            "clean": pa.array(rows, pa.list_(pa.int32())),
            "null_elsewhere": pa.array([*rows[:3], [3, None]], pa.list_(pa.int32())),
            "ragged": pa.array([[0], [1, 1], [2], [3]], pa.list_(pa.int32())),
        }
    )
    pq.write_table(t, tmp_path / "a.parquet", row_group_size=2)
    src = tg.ParquetSource(tmp_path, decoded_cache=False)
    for idx in ([0, 1, 2], [2, 0], [1]):
        cols = src.read_columns(idx)
        recs = ColumnBatch.from_records(src.__getitems__(idx))
        for key in ("clean", "null_elsewhere"):
            assert isinstance(cols[key], np.ndarray), (key, idx)
            assert cols[key].dtype == np.int32 and cols[key].tolist() == recs[key].tolist()
    assert isinstance(src.read_columns([0, 1])["ragged"], Ragged)
    assert src.read_columns([0, 2])["ragged"].shape == (2, 1)  # (one length: a matrix)


class _Numbers(tg.Source):
    """Records ``{"x": start + i}``, made in memory (no files)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __len__(self) -> int:
        return 10

    def __getitems__(self, indices):
        return [{"x": self.start + i} for i in tg.ShardIndex([10]).check(indices).tolist()]

    keys = property(lambda self: ["x"])
    schema = property(lambda self: {"x": "int"})


def test_a_source_without_files_keeps_its_filter_selection_to_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    assert not identified(_Numbers(0))
    even = lambda r: r["x"] % 2 == 0  # noqa: E731
    a = tg.Dataset(_Numbers(0)).filter(even, progress=False)
    b = tg.Dataset(_Numbers(1)).filter(even, progress=False)
    assert [r["x"] for r in a] == [0, 2, 4, 6, 8]
    assert [r["x"] for r in b] == [2, 4, 6, 8, 10]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.tgindex"))


class _Corpus(tg.Source):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return 4

    def __getitems__(self, indices):
        idx = tg.ShardIndex([4]).check(indices).tolist()
        return [{"tokens": np.arange(self.n) + 10 * i} for i in idx]

    keys = property(lambda self: ["tokens"])
    schema = property(lambda self: {"tokens": "int64[?]"})


def test_token_windows_of_a_source_without_files_keep_their_index_to_themselves(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    short = tg.Dataset(_Corpus(3)).windows("tokens", 2, progress=False)
    long = tg.Dataset(_Corpus(9)).windows("tokens", 2, progress=False)
    assert (len(short), len(long)) == (5, 17)
    assert long[16]["input_ids"].tolist() == [35, 36]  # (tokens 32 and 33 of 0..8, 10..18, ...)


def test_a_source_stating_its_fingerprint_is_identified():
    class Stated(_Numbers):
        def fingerprint(self) -> str:
            return f"numbers from {self.start}"

    assert identified(Stated(0)) and identified(tg.Dataset(Stated(0)))


@pytest.mark.parametrize("files", [True, False])
def test_a_file_source_is_identified_by_its_files(tmp_path, files):
    if files:
        tg.write_parquet(({"x": i} for i in range(3)), tmp_path)
        assert identified(tg.ParquetSource(tmp_path))
    else:
        assert not identified(tg.Dataset([{"x": 0}]))


# ------------------------------------------------- a download of another version
def _two_versions_server(root):
    """Serves ``root/v1`` to HEAD and range requests and ``root/v2`` (the same sizes,
    other values) to a whole-file GET, each with its own ETag: a CDN edge holding
    another version than the origin, or a file replaced between two requests."""
    import email.utils
    import re
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._serve(False)

        def do_GET(self):
            self._serve(True)

        def _serve(self, body):
            rel, rng = self.path.lstrip("/"), self.headers.get("Range")
            if rel in ("ds/", "ds"):
                names = sorted(os.listdir(root / "v1"))
                data = "".join(f'<a href="{n}">{n}</a>' for n in names).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return
            version = "v2" if self.command == "GET" and rng is None else "v1"
            path = root / version / rel.removeprefix("ds/")
            if not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = path.read_bytes()
            start, end, status = 0, len(data), 200
            m = re.match(r"bytes=(\d+)-(\d+)$", rng or "")
            if m:
                start, end, status = int(m[1]), min(len(data), int(m[2]) + 1), 206
            self.send_response(status)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{version}-{len(data):x}"')
            modified = email.utils.formatdate(path.stat().st_mtime, usegmt=True)
            self.send_header("Last-Modified", modified)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[start:end])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tfrecord", "array_record", "parquet"])
def test_a_shard_cache_download_of_another_version_is_never_served(tmp_path, fmt):
    from torchgrain.formats.tfrecord import write_tfrecord

    for version, base in (("v1", 0), ("v2", 5000)):
        d = tmp_path / version
        values = [np.full(8, base + i, np.int64) for i in range(40)]
        if fmt == "parquet":
            d.mkdir()
            x = pa.array([int(v[0]) for v in values], pa.int64())
            pq.write_table(pa.table({"x": x}), d / "a.parquet", use_dictionary=False)
        elif fmt == "tfrecord":
            d.mkdir()
            write_tfrecord([v.tobytes() for v in values], d / "a.tfrecord")
        else:
            tg.write_array_record([{"x": v} for v in values], d, num_shards=1)
            for name in os.listdir(d):  # (no manifest: the opening reads the footer)
                if name.startswith("torchgrain"):
                    os.unlink(d / name)
    server = _two_versions_server(tmp_path)
    url = f"http://127.0.0.1:{server.server_address[1]}/ds/"
    retry = RetryPolicy(attempts=2, base_delay=0.01, deadline=20)
    kw = {"cache_dir": str(tmp_path / "cache"), "retry": retry}
    try:
        # (ArrayRecord's opening reads its first record: the download comes then)
        with pytest.raises(tg.RemoteIOError, match="changed on the server"):
            if fmt == "parquet":
                src = tg.ParquetSource(url, decoded_cache=False, **kw)
            elif fmt == "tfrecord":
                src = tg.TFRecordSource(url, codec="raw", index_dir=None, **kw)
            else:
                src = tg.ArrayRecordSource(url, index_dir=None, **kw)
            src.__getitems__([0, 1, 39])
    finally:
        server.shutdown()
        server.server_close()


def test_a_tfrecord_shard_replaced_by_a_directory_is_named(tmp_path):
    from torchgrain.formats.tfrecord import write_tfrecord

    for s in range(2):
        write_tfrecord([bytes([s]) * 10] * 5, tmp_path / f"s{s}.tfrecord")
    src = tg.TFRecordSource(tmp_path, codec="raw", index_dir=None)
    assert src[0] == {"bytes": b"\0" * 10}
    (tmp_path / "s1.tfrecord").unlink()
    (tmp_path / "s1.tfrecord").mkdir()
    for read in (lambda: src[7], lambda: src.__getitems__([0, 7])):
        with pytest.raises(tg.CorruptDataError, match=r"not a regular file.*shard 1 .*index 7"):
            read()


def test_pad_collate_pads_a_columns_batch_of_one_length_as_its_records():
    """A ``[B, k]`` column (1-D values that share a length in this batch) is padded,
    with its mask, as the same records are: a batch's shape does not depend on its
    content."""
    records = [{"ids": np.array([1, 2, 3]), "y": 1}, {"ids": np.array([4, 5, 6]), "y": 2}]
    columns = ColumnBatch.from_records(records)
    assert columns["ids"].shape == (2, 3)
    want = tg.pad_collate(records, multiple_of=8)
    got = tg.pad_collate(columns, multiple_of=8)
    assert sorted(got) == sorted(want) == ["attention_mask", "ids", "y"]
    for key in want:
        assert got[key].shape == want[key].shape and torch.equal(got[key], want[key]), key


def test_a_map_style_dataset_stating_its_fingerprint_is_identified():
    class Stated:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict:
            return {"x": i}

        def fingerprint(self) -> str:
            return "three"

    assert identified(tg.Dataset(Stated()))


# ------------------------------------------------- one source shared by threads
def _arrayrecord_shards(directory, shards: int, per: int, options: str) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    directory.mkdir(exist_ok=True)
    for s in range(shards):
        w = ArrayRecordWriter(str(directory / f"part-{s:05d}.array_record"), options)
        for i in range(per):
            w.write(b"rec%08d" % (s * per + i))
        w.close()


def _threads(target, n: int, seconds: float) -> list:
    import threading
    import time

    errors: list = []
    stop = time.monotonic() + seconds

    def run(t: int) -> None:
        import random

        rng = random.Random(t)
        while time.monotonic() < stop and not errors:
            try:
                target(rng)
            except Exception as e:  # every error on a valid dataset is one too many
                errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.timeout(120)
def test_an_arrayrecord_reader_evicted_while_another_thread_reads_it_reads_its_own_file(
    tmp_path,
):
    """The reader limit closed a reader's file while another thread read it by ``pread``:
    the descriptor's number, reused by the next shard opened, read that shard's bytes
    (a valid-looking wrong record), or the read failed on a released map."""
    shards, per = 40, 4
    _arrayrecord_shards(tmp_path / "d", shards, per, "group_size:2,uncompressed")
    src = tg.ArrayRecordSource(tmp_path / "d", index_dir=None, max_open_files=1, cache_bytes=1024)

    def read(rng) -> None:
        s = rng.randrange(shards)
        idx = list(range(s * per, s * per + per))
        got = [r["bytes"] for r in src.__getitems__(idx)]
        assert got == [b"rec%08d" % i for i in idx], (idx, got)
        if rng.random() < 0.1:
            assert [r["bytes"] for r in src.iter_shard(s)] == got
        if rng.random() < 0.02:
            src.close()

    errors = _threads(read, 6, 4)
    assert not errors, errors[:3]


@pytest.mark.timeout(120)
def test_threads_that_read_a_fresh_arrayrecord_source_at_once_share_one_map(tmp_path):
    """The first reads raced to map the shards: a read placed in one map read another,
    at its offset (a segfault, or another shard's bytes): run in a child process."""
    import subprocess
    import sys
    import textwrap

    _arrayrecord_shards(tmp_path / "d", 16, 8, "group_size:1")
    child = textwrap.dedent(
        f"""
        import threading, torchgrain as tg
        bad = []
        for rep in range(30):
            src = tg.ArrayRecordSource({str(tmp_path / "d")!r}, index_dir=None,
                                       max_mapped_shards=4)
            gate = threading.Barrier(8)
            def read(t):
                gate.wait()
                for i in range(t, 128, 8):
                    if src[i]["bytes"] != b"rec%08d" % i:
                        bad.append(i)
            ts = [threading.Thread(target=read, args=(t,)) for t in range(8)]
            [t.start() for t in ts]; [t.join() for t in ts]
            src.close()
        print("wrong", bad[:5])
        """
    )
    got = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=100)
    assert got.returncode == 0 and "wrong []" in got.stdout, (got.returncode, got.stderr[-2000:])


@pytest.mark.timeout(120)
def test_a_close_in_one_thread_never_fails_a_remote_read_in_another(tmp_path):
    from tests.servers import RangeHTTPServer

    tg.write_parquet(({"i": i} for i in range(240)), tmp_path / "ds", num_shards=12)
    server = RangeHTTPServer(str(tmp_path))
    try:
        src = tg.ParquetSource(f"{server.url}/ds/", io_threads=4)

        def read(rng) -> None:
            idx = [rng.randrange(240) for _ in range(16)]
            assert [r["i"] for r in src.__getitems__(idx)] == idx
            if rng.random() < 0.3:
                src.close()

        errors = _threads(read, 4, 4)
        assert not errors, errors[:3]
    finally:
        server.close()


def test_an_index_directory_under_its_budget_does_not_count_its_entries_at_each_publish(
    tmp_path, monkeypatch
):
    """Each file's kept offsets were published with a count of every entry's size:
    opening thousands of TFRecord files grew with the entries there. The running total
    is kept instead (its killed writers' temp files are still swept at each publish)."""
    from torchgrain.formats.tfrecord import write_tfrecord
    from torchgrain.sources.node_index.store import IndexDir

    for k in range(2):
        d = tmp_path / f"d{k}"
        d.mkdir()
        for s in range(20):
            write_tfrecord([b"x%d" % s] * 3, d / f"s{s:03d}.tfrecord")
    tg.TFRecordSource(tmp_path / "d0", codec="raw", index_dir=tmp_path / "ix")
    counts = []
    entries = IndexDir._entries
    monkeypatch.setattr(IndexDir, "_entries", lambda self: counts.append(1) or entries(self))
    src = tg.TFRecordSource(tmp_path / "d1", codec="raw", index_dir=tmp_path / "ix")
    assert len(src) == 60 and src[59] == {"bytes": b"x19"}
    assert counts == []


# ------------------------------------------------- the review of the second round
def test_arrayrecord_readers_closed_or_evicted_leave_no_unclosed_file(tmp_path):
    import gc
    import warnings

    _arrayrecord_shards(tmp_path / "d", 6, 4, "group_size:2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        src = tg.ArrayRecordSource(tmp_path / "d", index_dir=None, max_open_files=1)
        for s in range(6):
            assert next(iter(src.iter_shard(s)))["bytes"] == b"rec%08d" % (4 * s)
        src.close()
        del src
        gc.collect()
    assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []


def test_an_index_directory_keeps_its_budget_whoever_publishes(tmp_path, monkeypatch):
    """Each process (here: each store object, as each process has its own) publishes
    against the running total all of them keep, not a count of its own."""
    from torchgrain.sources.node_index import store as node_store

    monkeypatch.setattr(node_store, "INDEX_DIR_BYTES", 1000)
    d = tmp_path / "ix"
    d.mkdir()
    stores = [node_store.IndexDir(str(d)) for _ in range(4)]
    most = 0
    for k in range(8):
        for j, s in enumerate(stores):
            w = s.writer(f"e{j}-{k}.tgindex")
            w.write(b"x" * 100)
            w.publish()
            most = max(most, sum(p.stat().st_size for p in d.glob("*.tgindex")))
    assert most <= 1000, most


def test_pad_collate_leaves_a_columns_batch_of_other_values_as_its_records():
    records = [
        {"phase": np.array([1 + 2j, 3j], np.complex64), "ids": np.arange(n + 2)} for n in range(3)
    ]
    want = tg.pad_collate(records, multiple_of=8)
    got = tg.pad_collate(ColumnBatch.from_records(records), multiple_of=8)
    assert got["phase"].shape == want["phase"].shape == (3, 2)
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert got["attention_mask"].sum(1).tolist() == [2, 3, 4]
