"""Named S3 shards whose folder an earlier listing cached are asked anew once per folder
(one listing of it), not with a HEAD request each, and read as they are now."""

from __future__ import annotations

import threading

import pytest

from tests.servers import make_bucket, parquet_bytes
from torchgrain.errors import DatasetNotFoundError
from torchgrain.io import fs as tgfs


def test_40_named_s3_shards_after_a_listing_ask_at_most_2_requests_and_are_fresh(moto_s3):
    from tests.servers import FaultProxy

    client, endpoint = moto_s3
    bucket = make_bucket(client, "nsr-many")
    names = [f"data/p{i:02d}.parquet" for i in range(40)]
    for key in names:
        client.put_object(Bucket=bucket, Key=key, Body=parquet_bytes(2))
    with FaultProxy(endpoint) as proxy:
        opts = {"endpoint_url": proxy.url}
        _, files = tgfs.expand_paths(
            f"s3://{bucket}/data/", suffixes=[".parquet"], storage_options=opts
        )
        assert len(files) == 40
        for key in names[:20]:  # rewritten since the listing
            client.put_object(Bucket=bucket, Key=key, Body=parquet_bytes(30))
        client.put_object(Bucket=bucket, Key="data/p40.parquet", Body=parquet_bytes(3))  # added
        client.delete_object(Bucket=bucket, Key=names[39])  # removed
        named = [f"s3://{bucket}/{key}" for key in [*names[:39], "data/p40.parquet"]]
        proxy.log.clear()
        fs2, got = tgfs.expand_paths(named, suffixes=[".parquet"], storage_options=opts)
        asked = list(proxy.log)
        gone = [*named[:5], f"s3://{bucket}/{names[39]}"]  # (named with others)
        with pytest.raises(DatasetNotFoundError, match=r"p39\.parquet.*does not exist"):
            tgfs.expand_paths(gone, suffixes=[".parquet"], storage_options=opts)
    assert got == named
    assert len(asked) <= 2, asked
    sizes = {f: fs2.info(f)["size"] for f in got}  # (the cache's answers)
    assert sizes[named[0]] == len(parquet_bytes(30)) and sizes[named[20]] == len(parquet_bytes(2))
    assert sizes[named[-1]] == len(parquet_bytes(3))


def test_threads_refreshing_one_s3_folder_keep_each_others_entries(moto_s3, monkeypatch):
    client, endpoint = moto_s3
    bucket = make_bucket(client, "nsr-threads")
    for name in ("a", "b"):
        client.put_object(Bucket=bucket, Key=f"data/{name}.parquet", Body=parquet_bytes(2))
    opts = {"endpoint_url": endpoint}
    fs, _ = tgfs.expand_paths(f"s3://{bucket}/data/", suffixes=[".parquet"], storage_options=opts)
    for name in ("c", "d"):  # added since: each thread's HEAD finds its own
        client.put_object(Bucket=bucket, Key=f"data/{name}.parquet", Body=parquet_bytes(2))
    both = threading.Barrier(2)
    real = tgfs.remote.call
    waited = threading.local()

    def call(fs, method, *args, **kwargs):
        out = real(fs, method, *args, **kwargs)
        if method == "info" and not getattr(waited, "done", False):
            waited.done = True
            both.wait(timeout=10)  # both asked, before either puts its answer in the cache
        return out

    monkeypatch.setattr(tgfs.remote, "call", call)
    errors: list[BaseException] = []

    def open_one(name: str) -> None:
        try:
            tgfs.expand_paths(
                f"s3://{bucket}/data/{name}.parquet", suffixes=[".parquet"], storage_options=opts
            )
        except BaseException as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=open_one, args=(n,)) for n in ("c", "d")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    listed = [e["name"] for e in fs.dircache[f"{bucket}/data"]]
    assert listed == [f"{bucket}/data/{n}.parquet" for n in "abcd"]
