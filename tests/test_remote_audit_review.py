"""Audit of remote reads under hostile servers: faults found by reproduction against real
servers on 127.0.0.1 (a static HTTP server, moto's S3 behind a fault-injecting proxy)."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from tests.conftest import make_records
from tests.servers import FaultProxy, RangeHTTPServer
from torchgrain.formats.codecs import get_codec
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import responses
from torchgrain.io.retry import RetryPolicy

QUICK = RetryPolicy(
    attempts=2,
    base_delay=0.01,
    max_delay=0.05,
    connect_timeout=2.0,
    read_timeout=5.0,
    request_timeout=10.0,
    deadline=20.0,
)


@pytest.mark.timeout(120)
def test_an_s3_listing_far_larger_than_a_page_is_given_up_without_being_buffered(
    tmp_path, moto_s3, monkeypatch
):
    """An S3-compatible store that answers a listing with an endless body: an HTTP(S)
    listing page is given up past remote.MAX_PAGE_BYTES, so must an S3 one be (the
    client held ~1.7 GiB for a 512 MiB answer)."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="audit-listing")
    tg.write_array_record(make_records(8), tmp_path / "ar", num_shards=2)
    for name in os.listdir(tmp_path / "ar"):
        client.upload_file(str(tmp_path / "ar" / name), "audit-listing", f"ar/{name}")
    total = 48 << 20
    with FaultProxy(endpoint) as proxy:
        opts = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        proxy.inject(
            "flood", match="list-type", method="GET", total=total, content_type="application/xml"
        )
        monkeypatch.setattr("torchgrain.io.remote.MAX_PAGE_BYTES", 1 << 20)
        with contextlib.suppress(tg.TorchgrainError):  # (retried past the flood, or not)
            tg.ArrayRecordSource("s3://audit-listing/ar", storage_options=opts, retry=QUICK)
        assert proxy.hits() == 1
        # What a capped read lets out: the page, plus the loopback's socket buffers.
        assert proxy.flooded < 16 << 20, proxy.flooded
        proxy.inject(
            "flood",
            times=None,
            match="list-type",
            method="GET",
            total=total,
            content_type="text/xml",
        )
        with pytest.raises(tg.RemoteIOError, match=r"audit-listing\?list-type=2.*MAX_PAGE_BYTES"):
            tg.ArrayRecordSource("s3://audit-listing/ar", storage_options=opts, retry=QUICK)


def _parquet(path, first: int) -> None:
    # Uncompressed plain int64: another version of the file has the same size and layout.
    t = pa.table({"x": np.arange(first, first + 100, dtype=np.int64)})
    pq.write_table(t, path, compression="none", use_dictionary=False, row_group_size=50)


def _replace_parquet(path, first: int) -> None:
    """Another version of ``path`` (see :func:`_parquet`): same size, other values, and a
    later modification time (another ETag and Last-Modified: nginx's is mtime-size)."""
    size = path.stat().st_size
    _parquet(path, first)
    later = time.time() + 100
    os.utime(path, (later, later))
    assert path.stat().st_size == size


@pytest.mark.timeout(60)
def test_a_file_replaced_after_opening_is_refused_by_a_spawned_worker(tmp_path, monkeypatch):
    """The dataset's files are pinned when it is opened: a file replaced on the server
    since (same size, new ETag and Last-Modified) is refused, in a forked DataLoader
    worker as in the process that opened it. A spawned worker (a DataLoader with
    multiprocessing_context="spawn" and 2 workers gave [5050, 5051], in 28 s here) gets
    the source pickled and nothing pinned: it read the new file."""
    (tmp_path / "pq").mkdir()
    _parquet(tmp_path / "pq" / "p0.parquet", 0)
    _parquet(tmp_path / "pq" / "p1.parquet", 1000)
    with RangeHTTPServer(tmp_path) as srv:
        src = tg.ParquetSource(f"{srv.url}/pq", retry=QUICK, cache_bytes=0)
        assert src[150] == {"x": 1050}
        _replace_parquet(tmp_path / "pq" / "p1.parquet", 5000)
        # What a spawned worker starts with: the source as pickled, no pins of its own.
        state = pickle.dumps(src)
        monkeypatch.setattr(responses, "_PINS", {})
        worker = pickle.loads(state)
        with pytest.raises(tg.RemoteIOError, match=r"p1\.parquet"):
            pytest.fail(f"read the replaced file: {worker[150]}")


class _Lines:
    """The smallest format: one int per line (a reader is its list)."""

    name, suffixes = "lines", (".lines",)

    def open(self, file):
        return _LinesReader(bytes(file.read()).split())


class _LinesReader(list):
    def read(self, rows):
        return [{"i": int(self[r])} for r in rows.tolist()]

    def close(self):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ar", "tf", "lines"])
def test_every_pickled_source_refuses_a_file_replaced_after_opening(tmp_path, monkeypatch, kind):
    """As the Parquet test above, for each kind of source over remote files: a spawned
    worker (the source unpickled where nothing is pinned) refuses a shard whose ETag and
    Last-Modified changed since the opening read it (same bytes, a later mtime)."""
    recs = [{"i": i} for i in range(8)]
    (tmp_path / kind).mkdir()
    if kind == "ar":
        tg.write_array_record(recs, tmp_path / kind, num_shards=2)
    for s in range(2):
        part = recs[4 * s : 4 * s + 4]
        if kind == "tf":
            write_tfrecord(
                [get_codec("msgpack").encode(r) for r in part], tmp_path / kind / f"{s}.tfrecord"
            )
        elif kind == "lines":
            (tmp_path / kind / f"{s}.lines").write_text("".join(f"{r['i']}\n" for r in part))
    with RangeHTTPServer(tmp_path) as srv:
        url = f"{srv.url}/{kind}"
        make = {
            "ar": lambda: tg.ArrayRecordSource(url, retry=QUICK),
            "tf": lambda: tg.TFRecordSource(url, codec="msgpack", index_dir=None, retry=QUICK),
            "lines": lambda: tg.FormatSource(url, format=_Lines(), retry=QUICK),
        }[kind]
        src = make()
        assert src[6] == {"i": 6}
        name = src.paths[1].rsplit("/", 1)[1]
        later = time.time() + 100
        os.utime(tmp_path / kind / name, (later, later))
        state = pickle.dumps(src)
        monkeypatch.setattr(responses, "_PINS", {})
        worker = pickle.loads(state)
        assert worker[0] == {"i": 0}
        with pytest.raises(tg.RemoteIOError, match=re.escape(name)):
            pytest.fail(f"read the replaced file: {worker[6]}")
        # A process that has read the new version (a later opening) refuses the old one.
        monkeypatch.setattr(responses, "_PINS", {})
        assert make()[6] == {"i": 6}
        with pytest.raises(tg.RemoteIOError, match=re.escape(name)):
            pickle.loads(state)


@pytest.mark.timeout(60)
def test_the_url_of_one_file_with_a_query_string_is_that_file(tmp_path):
    """``https://host/a.array_record?token=...`` (a signed URL, a CDN's download link)
    names one file, as fsspec's HTTP filesystem reads it: a '?' on HTTP(S) starts the
    query, never a wildcard (it was listed as a glob: 'matched no ArrayRecord file')."""
    tg.write_array_record(make_records(6), tmp_path / "ar", num_shards=1)
    (shard,) = [n for n in os.listdir(tmp_path / "ar") if n.endswith(".array_record")]
    (tmp_path / "tf").mkdir()
    write_tfrecord(
        [encode_tf_example({"x": [i]}) for i in range(5)], tmp_path / "tf" / "a.tfrecord"
    )
    with RangeHTTPServer(tmp_path) as srv:
        ar = tg.ArrayRecordSource(f"{srv.url}/ar/{shard}?sig=a1&v=2", retry=QUICK)
        assert [r["id"] for r in ar.__getitems__([0, 5])] == ["r0", "r5"]
        tf = tg.TFRecordSource(f"{srv.url}/tf/a.tfrecord?sig=a1", retry=QUICK, index_dir=None)
        assert [int(tf[i]["x"][0]) for i in (0, 4)] == [0, 4]
        ranged = [
            p for m, p in srv.log if m == "GET" and p.startswith((f"/ar/{shard}", "/tf/a.tfrecord"))
        ]
        assert ranged and all("?sig=a1" in p for p in ranged), srv.log


@pytest.mark.timeout(60)
def test_the_url_of_one_parquet_file_with_a_query_string_is_that_file(tmp_path):
    """ParquetSource and tg.open read a presigned URL (its query holds '/' and '=') as
    that one file, as ArrayRecordSource does: Parquet's own glob check took the '?' for
    a wildcard and the query's path-like part for hive partition directories (a column
    'a.parquet?X-Amz-Credential' was added to every row)."""
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "a.parquet")
    query = "X-Amz-Credential=AK%2Fx/20260101/us-east-1/s3/aws4_request&X-Amz-Signature=ab"
    with RangeHTTPServer(tmp_path) as srv:
        url = f"{srv.url}/a.parquet?{query}"
        for src in (tg.ParquetSource(url, retry=QUICK), tg.open(url, retry=QUICK)):
            assert src.paths == [url]
            assert src.__getitems__([0, 2]) == [{"x": 1}, {"x": 3}]


@pytest.mark.timeout(60)
def test_a_listing_whose_links_start_with_dot_slash_is_read(tmp_path):
    """Caddy's directory listings link each entry as ``./name`` (so that a name holding
    ':' is not read as a scheme): a browser, and aiohttp, resolve it to ``DIR/name``.
    fsspec joins it as written (``DIR/./name``); the dataset was refused as naming a file
    outside itself (and a ``./sub/`` directory would have been skipped)."""
    (tmp_path / "pq" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"x": [3]}), tmp_path / "pq" / "sub" / "b.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/pq"] = '<a href="./a.parquet">a.parquet</a> <a href="./sub/">sub/</a>'
        srv.listings["/pq/sub"] = '<a href="./b.parquet">b.parquet</a>'
        src = tg.ParquetSource(f"{srv.url}/pq", retry=QUICK)
        assert src.paths == [f"{srv.url}/pq/a.parquet", f"{srv.url}/pq/sub/b.parquet"]
        assert [r["x"] for r in src.__getitems__([0, 1, 2])] == [1, 2, 3]
        loader = torch.utils.data.DataLoader(src, batch_size=None, num_workers=2)
        assert sorted(int(r["x"]) for r in loader) == [1, 2, 3]
