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
from tests.servers import RangeHTTPServer
from torchgrain.errors import DatasetWarning
from torchgrain.io import fs as tgfs
from torchgrain.io import remote
from torchgrain.io.retry import RetryPolicy


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
