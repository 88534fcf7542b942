"""What a listing is given and what it may cost: a chained URL's remote layer gets
torchgrain's transport, a linked folder a listing does not walk is named, and an S3
listing is bounded in pages, objects and time."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer, s3_listing_page, s3_listing_server, start_moto_s3
from torchgrain.errors import DatasetWarning
from torchgrain.io import fs as tgfs
from torchgrain.io import remote
from torchgrain.io.retry import RetryPolicy, using


# ------------------------------------------------------------------------ chained URLs
def test_a_chained_urls_remote_layers_get_torchgrains_transport():
    fs, _ = tgfs.get_filesystem(
        "simplecache::http://127.0.0.1:9/d/a.parquet",
        {"http": {"client_kwargs": {"headers": {"X-Token": "t"}}}},
    )
    http = fs.fs
    assert http.get_client is remote._client  # redirects refused, bodies capped
    assert http.client_kwargs["headers"] == {"X-Token": "t"}  # the user's own, kept
    assert http.client_kwargs["timeout"].sock_read == RetryPolicy().read_timeout
    trusted, _ = tgfs.get_filesystem("blockcache::http://127.0.0.1:9/d/b", allow_redirects=True)
    assert trusted.fs.get_client is remote._client_following_redirects


def test_a_chained_s3_layer_gets_timeouts():
    pytest.importorskip("s3fs")
    fs, _ = tgfs.get_filesystem("simplecache::s3://bkt/ds/a.parquet", {"s3": {"anon": True}})
    config = fs.fs.config_kwargs
    assert fs.fs.anon and config["read_timeout"] == RetryPolicy().read_timeout


def test_a_chained_url_dataset_reads(tmp_path):
    (tmp_path / "flat").mkdir()
    pq.write_table(pa.table({"x": np.arange(5)}), tmp_path / "flat" / "a.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        src = tg.ParquetSource([f"simplecache::{srv.url}/flat/a.parquet"], cache_bytes=0)
        assert [src[i]["x"] for i in range(len(src))] == list(range(5))


# ----------------------------------------------------------------------- linked folders
def test_a_linked_folder_is_named_in_the_not_regular_files_warning(tmp_path):
    tg.write_parquet([{"x": i} for i in range(3)], tmp_path / "ds")
    tg.write_parquet([{"x": 100 + i} for i in range(2)], tmp_path / "more")
    os.symlink(tmp_path / "more", tmp_path / "ds" / "more")
    with pytest.warns(DatasetWarning, match=r"1 linked folder: 'more'.*not regular files"):
        assert len(tg.ParquetSource(str(tmp_path / "ds"))) == 3
    assert len(tg.ParquetSource(str(tmp_path / "ds" / "more"))) == 2  # named: read


def test_a_hidden_linked_folder_is_not_the_datasets(tmp_path):
    tg.write_parquet([{"x": i} for i in range(3)], tmp_path / "ds")
    (tmp_path / "snap").mkdir()
    os.symlink(tmp_path / "snap", tmp_path / "ds" / ".snapshot")
    os.symlink(tmp_path / "snap", tmp_path / "ds" / "_tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(tg.ParquetSource(str(tmp_path / "ds"))) == 3


# -------------------------------------------------------------------------- S3 listings
@pytest.mark.parametrize(
    "token, refused_at",
    [(lambda n: "AB"[n % 2], 4), (lambda n: "", 2)],  # (page 1: the directory probe's)
    ids=["cycling-tokens", "no-token"],
)
def test_an_s3_listing_that_does_not_end_is_refused_at_once(token, refused_at):
    pytest.importorskip("s3fs")
    server, url, served = s3_listing_server(lambda n: s3_listing_page(n, token(n)))
    opts = {"endpoint_url": url, "key": "k", "secret": "s"}
    try:
        with (
            using(RetryPolicy(attempts=1, deadline=20.0)),
            pytest.raises(tg.CorruptDataError, match=r"s3://bkt/ds.*does not end"),
        ):
            tgfs.expand_paths("s3://bkt/ds", suffixes=[".array_record"], storage_options=opts)
        assert served[0] == refused_at
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server, endpoint = start_moto_s3()
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="lst")
    for key in ("ds/a.array_record", "ds/b.array_record", "ds/sub/c.array_record", "ds/sub/"):
        client.put_object(Bucket="lst", Key=key, Body=b"")
    yield {"endpoint_url": endpoint}
    server.stop()


def test_an_s3_listing_past_max_listed_objects_is_refused_naming_the_cap(s3, monkeypatch):
    monkeypatch.setattr(tgfs, "MAX_LISTED_OBJECTS", 2)
    with pytest.raises(tg.CorruptDataError, match=r"s3://lst/ds.*more than 2 objects"):
        tgfs.expand_paths("s3://lst/ds", suffixes=[".array_record"], storage_options=s3)


@pytest.mark.parametrize(
    "given, names",
    [
        ("s3://lst/ds", ["a", "b", "sub/c"]),
        ("s3://lst/ds/*.array_record", ["a", "b"]),
        ("s3://lst/ds/**/*.array_record", ["a", "b", "sub/c"]),
        ("s3://lst/ds/s*/*.array_record", ["sub/c"]),
    ],
)
def test_an_s3_listing_or_glob_finds_its_objects(s3, given, names):
    _, files = tgfs.expand_paths(given, suffixes=[".array_record"], storage_options=s3)
    assert files == [f"s3://lst/ds/{n}.array_record" for n in names]
