"""Named S3 shards refreshed per folder, list element joins, ToTensor lists of tensors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.servers import make_bucket, parquet_bytes
from torchgrain.io import fs as tgfs
from torchgrain.tokens.collate import pad_collate


def _fresh(client, endpoint, bucket, folder, before, after, named):
    for key in before:
        client.put_object(Bucket=bucket, Key=key, Body=parquet_bytes(2))
    opts = {"endpoint_url": endpoint}
    tgfs.expand_paths(f"s3://{bucket}/{folder}", suffixes=[".parquet"], storage_options=opts)
    for key in after:
        client.put_object(Bucket=bucket, Key=key, Body=parquet_bytes(5))
    urls = [f"s3://{bucket}/{k}" for k in named]
    fs, got = tgfs.expand_paths(urls, suffixes=[".parquet"], storage_options=opts)
    return fs, urls, got


def test_named_shards_at_a_bucket_root_are_fresh_after_its_listing(moto_s3):
    client, endpoint = moto_s3
    b = make_bucket(client, "rl-root")
    fs, urls, got = _fresh(
        client,
        endpoint,
        b,
        "",
        ["a.parquet", "b.parquet"],
        ["c.parquet", "a.parquet"],
        ["a.parquet", "b.parquet", "c.parquet"],
    )
    assert got == urls
    assert fs.info(urls[0])["size"] == len(parquet_bytes(5))


def test_named_shards_with_spaces_percent_and_unicode_are_found_after_a_listing(moto_s3):
    client, endpoint = moto_s3
    b = make_bucket(client, "rl-odd")
    names = ["d/é 1%2F.parquet", "d/é 2+&.parquet"]
    _fs, urls, got = _fresh(
        client, endpoint, b, "d/", ["d/z.parquet"], names, [*names, "d/z.parquet"]
    )
    assert got == urls


def test_named_shards_of_two_folders_are_each_found_after_a_listing(moto_s3):
    client, endpoint = moto_s3
    b = make_bucket(client, "rl-two")
    client.put_object(Bucket=b, Key="e/z.parquet", Body=parquet_bytes(2))
    tgfs.expand_paths(
        f"s3://{b}/e/", suffixes=[".parquet"], storage_options={"endpoint_url": endpoint}
    )
    names = ["d/p1.parquet", "d/p2.parquet", "e/p1.parquet", "e/p2.parquet"]
    _fs, urls, got = _fresh(client, endpoint, b, "d/", ["d/z.parquet"], names, names)
    assert got == urls


def test_a_folder_created_since_a_listing_named_beside_shards_is_walked(moto_s3):
    client, endpoint = moto_s3
    b = make_bucket(client, "rl-fold")
    _fs, urls, got = _fresh(
        client,
        endpoint,
        b,
        "d/",
        ["d/z.parquet"],
        ["d/sub/x.parquet", "d/p.parquet"],
        ["d/sub", "d/p.parquet", "d/z.parquet"],
    )
    assert got == [f"s3://{b}/d/sub/x.parquet", *urls[1:]]


def test_a_named_shard_past_the_first_page_of_its_prefix_is_found(moto_s3):
    client, endpoint = moto_s3
    b = make_bucket(client, "rl-page")
    before = [f"d/k{i:04d}.parquet" for i in range(1001)]
    body = parquet_bytes(2)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: client.put_object(Bucket=b, Key=k, Body=body), before))
    named = ["d/k0000.parquet", "d/k0500.parquet", "d/k9999.parquet"]
    _fs, urls, got = _fresh(client, endpoint, b, "d/", [], ["d/k9999.parquet"], named)
    assert got == urls


def test_pad_collate_finds_a_list_of_tensors_field_by_default():
    batch = [{"ids": [torch.tensor(1), torch.tensor(2)]}, {"ids": [torch.tensor(3)]}]
    told = pad_collate(batch, keys=["ids"])
    assert told["ids"].tolist() == [[1, 2], [3, 0]]
    found = pad_collate(batch)
    assert found["ids"].tolist() == [[1, 2], [3, 0]]
    assert found["attention_mask"].tolist() == [[1, 1], [1, 0]]


def test_a_datetime_past_a_ns_columns_range_is_refused_not_wrapped():
    import torchgrain as tg

    record = {"u": np.datetime64("2500-01-01T00:00:00", "s")}
    with pytest.raises(TypeError, match=r"2500-01-01T00:00:00'\) is not a timestamp\[ns\]"):
        tg.writers.records_to_table([record], pa.schema({"u": pa.timestamp("ns")}))


def test_datetimes_of_mixed_units_each_exact_in_the_column_unit_are_written():
    import torchgrain as tg

    values = [np.datetime64("2500-01-01T00:00:00", "s"), np.datetime64("2020-01-01", "ns")]
    table = tg.writers.records_to_table(
        [{"u": v} for v in values], pa.schema({"u": pa.timestamp("us")})
    )
    got = table.column("u").to_pylist()
    assert [d.year for d in got] == [2500, 2020]


def test_msgpack_names_a_nested_date_key_as_a_key():
    import datetime

    from torchgrain.formats.codecs import MsgpackCodec

    with pytest.raises(TypeError, match=r"record key \['a'\]\[datetime\.date\(2020, 1, 1\)\]"):
        MsgpackCodec().encode({"a": {datetime.date(2020, 1, 1): 1}})


def test_a_list_of_a_tensor_and_a_python_float_keeps_float64():
    from torchgrain.transforms import ToTensor

    assert ToTensor(keys=["a"])({"a": [1, 0.1]})["a"].dtype == torch.float64
    assert ToTensor(keys=["a"])({"a": [torch.tensor(1), 0.1]})["a"].dtype == torch.float64
    padded = pad_collate([{"a": [torch.tensor(1), 0.1]}], keys=["a"])
    assert padded["a"].dtype == torch.float64
