"""Review of remote versions: pins carried by a source's pickle, a shard cache copy of one
version, the capped S3 session, and '?' on HTTP(S) (reproduced against servers on
127.0.0.1: moto's S3, a static HTTP server)."""

from __future__ import annotations

import pytest

import torchgrain as tg  # noqa: F401
from torchgrain.io.shard_cache import ShardCache
from torchgrain.io import remote
from torchgrain.io.fs import get_filesystem
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
