"""Review of remote versions: pins carried by a source's pickle, a shard cache copy of one
version, the capped S3 session, and '?' on HTTP(S) (reproduced against servers on
127.0.0.1: moto's S3, a static HTTP server)."""

from __future__ import annotations

import copy
import os
import pickle
import re
import time

import pytest
import torch

import torchgrain as tg
from tests.conftest import make_records
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK, _parquet, _replace_parquet
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import remote, responses
from torchgrain.io.fs import get_filesystem
from torchgrain.io.shard_cache import ShardCache


@pytest.mark.timeout(60)
def test_the_size_of_an_s3_object_larger_than_a_page_is_answered(tmp_path, moto_s3, monkeypatch):
    """A HEAD answer (s3fs's info) declares the object's length with no body: the capped
    S3 session took it for a listing of that many bytes, so the size lookup (and the shard
    cache's version lookup, and a download) of any object over remote.MAX_PAGE_BYTES (32
    MiB) failed after its retries with a RemoteIOError."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="pins-head")
    client.put_object(Bucket="pins-head", Key="big", Body=b"x" * (3 << 20))
    monkeypatch.setattr(remote, "MAX_PAGE_BYTES", 1 << 20)
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    fs, path = get_filesystem("s3://pins-head/big", opts, retry=QUICK)
    assert remote.file_size(fs, path, url="s3://pins-head/big") == 3 << 20
    cache = ShardCache(tmp_path / "cache", max_bytes=8 << 20, retry=QUICK)
    with open(cache.fetch("s3://pins-head/big", filesystem=fs), "rb") as f:
        assert f.read() == b"x" * (3 << 20)


@pytest.mark.timeout(60)
def test_a_copy_of_a_source_opened_before_a_reupload_refuses_the_new_version(tmp_path, monkeypatch):
    """A source opened on one version of a file, then the file replaced (same size) and the
    dataset opened again in the same process: the second opening pins the new version, and
    pins_of gives the process's pins, not the first source's, so its copy (copy.copy, a
    spawned DataLoader worker's unpickled source) reads the new bytes under the old
    opening's index without an error, where the source itself still reads the old rows."""
    (tmp_path / "pq").mkdir()
    _parquet(tmp_path / "pq" / "p0.parquet", 0)
    _parquet(tmp_path / "pq" / "p1.parquet", 1000)
    with RangeHTTPServer(tmp_path) as srv:
        first = tg.ParquetSource(f"{srv.url}/pq", retry=QUICK, cache_bytes=0)
        assert first[150] == {"x": 1050}
        _replace_parquet(tmp_path / "pq" / "p1.parquet", 5000)
        again = tg.ParquetSource(f"{srv.url}/pq", retry=QUICK, cache_bytes=0)
        assert again[150] == {"x": 5050}
        state = pickle.dumps(first)
        with pytest.raises(tg.RemoteIOError, match=r"p1\.parquet"):
            pytest.fail(f"a copy read the new file: {copy.copy(first)[150]}")
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        with pytest.raises(tg.RemoteIOError, match=r"p1\.parquet"):
            pytest.fail(f"a spawned worker read the new file: {pickle.loads(state)[150]}")


QUERY = "X-Amz-Credential=AK%2Fx/20260101/us-east-1/s3/aws4_request&X-Amz-Signature=ab"


@pytest.mark.timeout(60)
def test_an_arrayrecord_or_tfrecord_url_whose_query_holds_a_slash_is_that_file(tmp_path):
    """A signed URL whose query holds '/' (as the Parquet test of the same query in
    test_remote_audit_review): ArrayRecordSource, TFRecordSource, tg.open and the CLI's
    inspect look for the TFDS metadata in the file's "directory", cut at the query's last
    '/' (.../a.tfrecord?X-Amz-Credential=AK%2Fx/.../s3/dataset_info.json), which the server
    answers with the shard itself: a CorruptDataError 'TFDS metadata ... is not JSON'."""
    tg.write_array_record(make_records(6), tmp_path / "ar", num_shards=1)
    (shard,) = [n for n in os.listdir(tmp_path / "ar") if n.endswith(".array_record")]
    (tmp_path / "tf").mkdir()
    write_tfrecord(
        [encode_tf_example({"x": [i]}) for i in range(5)], tmp_path / "tf" / "a.tfrecord"
    )
    with RangeHTTPServer(tmp_path) as srv:
        ar_url, tf_url = f"{srv.url}/ar/{shard}?{QUERY}", f"{srv.url}/tf/a.tfrecord?{QUERY}"
        for ar in (tg.ArrayRecordSource(ar_url, retry=QUICK), tg.open(ar_url, retry=QUICK)):
            assert [r["id"] for r in ar.__getitems__([0, 5])] == ["r0", "r5"]
        for tf in (
            tg.TFRecordSource(tf_url, retry=QUICK, index_dir=None),
            tg.open(tf_url, retry=QUICK, index_dir=None),
        ):
            assert [int(tf[i]["x"][0]) for i in (0, 4)] == [0, 4]


@pytest.mark.timeout(90)
def test_an_s3_tfrecord_file_larger_than_a_page_is_read_by_dataloader_workers(
    tmp_path, moto_s3, monkeypatch
):
    """TFRecordSource asks an S3 file's size and version with one info (a HEAD): of a
    file over remote.MAX_PAGE_BYTES the capped S3 session refused the answer (its
    Content-Length is the object's), so such a dataset could not be opened."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="pins-tf")
    records = [encode_tf_example({"x": [i], "pad": [b"p" * 1000]}) for i in range(2000)]
    write_tfrecord(records, tmp_path / "a.tfrecord")
    assert (tmp_path / "a.tfrecord").stat().st_size > 1 << 20
    client.upload_file(str(tmp_path / "a.tfrecord"), "pins-tf", "tf/a.tfrecord")
    monkeypatch.setattr(remote, "MAX_PAGE_BYTES", 1 << 20)
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    src = tg.TFRecordSource(
        "s3://pins-tf/tf/a.tfrecord", storage_options=opts, retry=QUICK, index_dir=None
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(src, [0, 999, 1999]),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
    )
    assert sorted(int(r["x"][0]) for r in loader) == [0, 999, 1999]


@pytest.mark.timeout(60)
def test_a_file_replaced_on_the_server_can_be_opened_again_in_the_same_process(tmp_path):
    """An opening reads a dataset as it is now (a later opening pins anew: io/responses.pin),
    but an ArrayRecord file named by its URL, replaced on the server after a first opening
    in this process, cannot be opened again: its footers' reads send the first opening's
    ETag as If-Match, the server answers 412, and the opening is a RemoteIOError ('the file
    changed on the server since'), with or without a shard cache. A long-lived process (a
    notebook) has to restart to read the new upload."""
    (tmp_path / "www").mkdir()
    for name, ch in (("www/ar", "a"), ("v2", "b")):
        tg.write_array_record([{"v": ch * 50} for _ in range(8)], tmp_path / name, num_shards=1)
    (shard,) = [n for n in os.listdir(tmp_path / "v2") if n.endswith(".array_record")]
    served = tmp_path / "www" / "ar" / shard
    assert served.stat().st_size == (tmp_path / "v2" / shard).stat().st_size
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/ar/{shard}"
        assert tg.ArrayRecordSource(url, retry=QUICK)[0] == {"v": "a" * 50}
        served.write_bytes((tmp_path / "v2" / shard).read_bytes())
        later = time.time() + 100  # another ETag and Last-Modified
        os.utime(served, (later, later))
        assert tg.ArrayRecordSource(url, retry=QUICK)[0] == {"v": "b" * 50}


def _two_tfrecords(tmp_path):
    """``tf/a.tfrecord`` under ``tmp_path`` (records ``a0``-``a4``, the served file),
    and ``b``, of the same size (``b0``-``b4``), to replace it with."""
    (tmp_path / "tf").mkdir()
    served = tmp_path / "tf" / "a.tfrecord"
    write_tfrecord([encode_tf_example({"v": [b"a%d" % i]}) for i in range(5)], served)
    write_tfrecord([encode_tf_example({"v": [b"b%d" % i]}) for i in range(5)], tmp_path / "b")
    return served


def _replace(path, data: bytes) -> None:
    """``path`` rewritten with ``data`` (its size), with a later modification time
    (another ETag and Last-Modified)."""
    assert len(data) == path.stat().st_size
    path.write_bytes(data)
    later = time.time() + 100
    os.utime(path, (later, later))


def _copies_refuse(first, again, monkeypatch, name: str) -> None:
    """``first``'s copy, and its pickle restored in a process that pinned nothing
    (a spawned worker's), refuse the file ``name`` replaced since ``first`` was opened;
    those of ``again``, opened since, read the new version."""
    state, new = pickle.dumps(first), pickle.dumps(again)
    assert copy.copy(again)[3] == again[3]
    with pytest.raises(tg.RemoteIOError, match=name):
        pytest.fail(f"a copy read the new file: {copy.copy(first)[3]}")
    monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
    with pytest.raises(tg.RemoteIOError, match=name):
        pytest.fail(f"a spawned worker read the new file: {pickle.loads(state)[3]}")
    monkeypatch.setattr(responses, "_PINS", {})
    assert pickle.loads(new)[3] == again[3]


@pytest.mark.timeout(60)
def test_a_copy_of_a_tfrecord_source_opened_before_a_reupload_refuses_the_new_version(
    tmp_path, monkeypatch
):
    """As the Parquet test above, of a TFRecord file: the copy of a source opened before
    the file was replaced (same size) and opened again reads the new records at the old
    index's offsets."""
    served = _two_tfrecords(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        url = f"{srv.url}/tf/a.tfrecord"
        first = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
        assert first[3]["v"] == [b"a3"]
        _replace(served, (tmp_path / "b").read_bytes())
        again = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
        assert again[3]["v"] == [b"b3"]
        _copies_refuse(first, again, monkeypatch, r"a\.tfrecord")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("by", ["url", "manifest"])
def test_a_copy_of_an_arrayrecord_source_opened_before_a_reupload_refuses_the_new_version(
    tmp_path, monkeypatch, by
):
    """As the Parquet test above, of an ArrayRecord file named by its URL (its footers
    pin it) or listed in a manifest (its sizes pin it)."""
    (tmp_path / "www").mkdir()
    for name, ch in (("www/ar", "a"), ("v2", "b")):
        tg.write_array_record([{"v": ch * 50} for _ in range(8)], tmp_path / name, num_shards=1)
    (shard,) = [n for n in os.listdir(tmp_path / "v2") if n.endswith(".array_record")]
    served = tmp_path / "www" / "ar" / shard
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/ar/{shard}" if by == "url" else f"{srv.url}/ar"
        first = tg.ArrayRecordSource(url, retry=QUICK)
        assert first[3] == {"v": "a" * 50}
        _replace(served, (tmp_path / "v2" / shard).read_bytes())
        again = tg.ArrayRecordSource(url, retry=QUICK)
        assert again[3] == {"v": "b" * 50}
        _copies_refuse(first, again, monkeypatch, re.escape(shard))


@pytest.mark.timeout(60)
def test_read_ahead_fetches_a_shard_whose_cached_copy_is_of_another_version(tmp_path):
    """Read-ahead (prefetch_shard) took a shard cache's copy of a file replaced since
    (same size, another ETag) for the shard: it fetched nothing, and the read that needed
    the shard downloaded it on its own path."""
    (tmp_path / "pq").mkdir()
    _parquet(tmp_path / "pq" / "p0.parquet", 0)
    _parquet(tmp_path / "pq" / "p1.parquet", 1000)
    with RangeHTTPServer(tmp_path) as srv:
        url, cache = f"{srv.url}/pq", tmp_path / "cache"
        assert tg.ParquetSource(url, retry=QUICK, cache_dir=cache)[150] == {"x": 1050}
        _replace_parquet(tmp_path / "pq" / "p1.parquet", 5000)
        again = tg.ParquetSource(url, retry=QUICK, cache_dir=cache)
        assert again.prefetch_shard(1)
        assert not again.prefetch_shard(1)
        srv.reset_counts()
        assert again[150] == {"x": 5050}
        assert srv.gets() == 0
