"""Answers that refuse a request (400, 401, 403) are that refusal, naming the URL and the
status, never "does not exist" (a user with expired credentials is not told the data is
gone) nor a corrupt file (reproduced against servers on 127.0.0.1: a static HTTP server
and moto's S3, behind a fault-injecting proxy)."""

from __future__ import annotations

import os

import pytest

import torchgrain as tg
from tests.conftest import make_records
from tests.servers import FaultProxy, RangeHTTPServer
from tests.test_remote_audit_review import QUICK, _parquet


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [401, 403])
def test_a_refused_read_of_a_manifest_listed_shard_is_access_denied(tmp_path, code):
    """A shard listed in a manifest is first read through a size lookup (fsspec's HTTP
    ``info``, which reports any failed answer as FileNotFoundError): a 403 there was
    'shard 0 ... of this dataset does not exist'."""
    tg.write_array_record(make_records(6), tmp_path / "ar", num_shards=1)
    with RangeHTTPServer(tmp_path) as srv, FaultProxy(srv.url) as proxy:
        src = tg.ArrayRecordSource(f"{proxy.url}/ar", retry=QUICK)
        proxy.inject("status", times=None, match=".array_record", code=code)
        with pytest.raises(PermissionError, match=rf"denied \(HTTP {code}.*array_record") as e:
            src[3]
        assert not isinstance(e.value, FileNotFoundError)


@pytest.mark.timeout(60)
def test_an_opening_answered_400_names_the_url_and_the_status(tmp_path):
    """A 400 to an opening's requests was aiohttp's ClientResponseError as raised (not a
    RemoteIOError); one to a manifest-listed shard's size lookup was 'does not exist'."""
    tg.write_array_record(make_records(6), tmp_path / "ar", num_shards=1)
    (shard,) = [n for n in os.listdir(tmp_path / "ar") if n.endswith(".array_record")]
    with RangeHTTPServer(tmp_path) as srv, FaultProxy(srv.url) as proxy:
        proxy.inject("status", times=None, code=400)
        url = f"{proxy.url}/ar/{shard}"
        with pytest.raises(tg.RemoteIOError, match=rf"{url}: the server answered HTTP 400"):
            tg.ArrayRecordSource(url, retry=QUICK)
        proxy.clear()
        src = tg.ArrayRecordSource(f"{proxy.url}/ar", retry=QUICK)
        proxy.inject("status", times=None, match=".array_record", code=400)
        with pytest.raises(tg.RemoteIOError, match=rf"{url}: the server answered HTTP 400"):
            src[3]


@pytest.mark.timeout(60)
def test_a_refused_s3_read_of_a_parquet_shard_is_access_denied(tmp_path, moto_s3):
    """s3fs reports a 403 as PermissionError: opening a Parquet shard's reader took it
    for a corrupt file ('cannot open Parquet shard ...: Forbidden')."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="refused")
    _parquet(tmp_path / "p0.parquet", 0)
    client.upload_file(str(tmp_path / "p0.parquet"), "refused", "pq/p0.parquet")
    with FaultProxy(endpoint) as proxy:
        opts = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        src = tg.ParquetSource("s3://refused/pq", storage_options=opts, retry=QUICK, cache_bytes=0)
        proxy.inject("status", times=None, match="p0.parquet", code=403)
        with pytest.raises(PermissionError, match=r"s3://refused/pq/p0\.parquet.*HTTP 403"):
            src[3]
