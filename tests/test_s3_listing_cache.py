"""An S3 listing fills s3fs's listing cache as s3fs's own find did: a shard's size asks
no HEAD request, a shard rewritten since is seen anew, and a prefix's partial listing of
a folder is never taken for the whole folder."""

from __future__ import annotations

import contextlib
import io

import pyarrow as pa
import pyarrow.parquet as pq

import torchgrain as tg
from torchgrain.io import fs as tgfs


def _parquet(rows: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(rows))}), buf)
    return buf.getvalue()


def test_a_reopened_s3_dataset_sees_its_rewritten_shard(moto_s3):
    client, endpoint = moto_s3
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket="lc1")
    client.put_object(Bucket="lc1", Key="ds/a.parquet", Body=_parquet(2))
    opts = {"endpoint_url": endpoint}
    assert len(tg.ParquetSource("s3://lc1/ds", storage_options=opts)) == 2
    client.put_object(Bucket="lc1", Key="ds/a.parquet", Body=_parquet(300))
    assert len(tg.ParquetSource("s3://lc1/ds", storage_options=opts)) == 300


def test_an_s3_glob_leaves_its_folder_listing_whole(moto_s3):
    client, endpoint = moto_s3
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket="lc2")
    for name in ("junk", "train-0", "sub/train-1"):
        client.put_object(Bucket="lc2", Key=f"data/{name}.parquet", Body=b"")
    fs, files = tgfs.expand_paths(
        "s3://lc2/data/train-*.parquet",
        suffixes=[".parquet"],
        storage_options={"endpoint_url": endpoint},
    )
    assert files == ["s3://lc2/data/train-0.parquet"]
    assert sorted(fs.ls("lc2/data")) == [
        "lc2/data/junk.parquet",
        "lc2/data/sub",
        "lc2/data/train-0.parquet",
    ]
    assert fs.size("lc2/data/junk.parquet") == 0
