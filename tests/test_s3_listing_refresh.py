"""An S3 shard removed since a listing of its folder is gone for a later, narrower
opening too (its name, a glob of a longer prefix): s3fs's listing cache does not answer
for it."""

from __future__ import annotations

import contextlib
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchgrain.errors import DatasetNotFoundError
from torchgrain.io import fs as tgfs


def _parquet(rows: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(rows))}), buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("second", "error"),
    [("data/c.parquet", "does not exist"), ("data/c*.parquet", "matched no")],
)
def test_an_s3_shard_removed_since_a_listing_is_gone_for_a_narrower_opening(
    moto_s3, second, error
) -> None:
    client, endpoint = moto_s3
    bucket = f"lr-{'glob' if '*' in second else 'name'}"
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    for name in ("a", "c"):
        client.put_object(Bucket=bucket, Key=f"data/{name}.parquet", Body=_parquet(2))
    opts = {"endpoint_url": endpoint}
    fs, files = tgfs.expand_paths(
        f"s3://{bucket}/data/", suffixes=[".parquet"], storage_options=opts
    )
    assert len(files) == 2
    client.delete_object(Bucket=bucket, Key="data/c.parquet")
    with pytest.raises(DatasetNotFoundError, match=error):
        tgfs.expand_paths(f"s3://{bucket}/{second}", suffixes=[".parquet"], storage_options=opts)
    assert fs.ls(f"{bucket}/data") == [f"{bucket}/data/a.parquet"]  # (the cache's answer)
