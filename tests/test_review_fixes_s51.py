"""Parquet -> Parquet conversion of nested temporal and nested list columns, re-tokenizing
a typed tokens column, local globs meeting a linked folder and S3 listings (HEAD requests,
glob prefixes, a chained S3 listing): each was a bug, reproduced here first."""

from __future__ import annotations

import contextlib
import datetime
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import s3_listing_page, s3_listing_server
from torchgrain.errors import DatasetWarning
from torchgrain.io import fs as tgfs
from torchgrain.io.retry import RetryPolicy, using


def _round_trip(tmp_path, table: pa.Table) -> pa.Table:
    """``table`` written as a Parquet dataset, converted to Parquet, and read back."""
    (tmp_path / "src").mkdir()
    pq.write_table(table, tmp_path / "src" / "a.parquet")
    tg.convert(str(tmp_path / "src"), str(tmp_path / "dst"), to="parquet", progress=False)
    (out,) = sorted((tmp_path / "dst").glob("*.parquet"))
    return pq.read_table(out)


def _assert_kept(tmp_path, table: pa.Table) -> None:
    got = _round_trip(tmp_path, table)
    assert got.schema.field("t").type == table.schema.field("t").type
    assert got.column("t").to_pylist() == table.column("t").to_pylist()


_T = datetime.datetime(2020, 2, 29, 12, 0, 0, 1000, tzinfo=datetime.timezone.utc)


# Converted (without the zone) before the source's schema was written: now a TypeError.
@pytest.mark.parametrize(
    "typ, value",
    [
        (pa.list_(pa.timestamp("ms", "UTC")), [_T, None]),
        (pa.list_(pa.timestamp("ns", "Europe/Paris")), [_T]),
        (pa.struct([("a", pa.timestamp("ms", "UTC"))]), {"a": _T}),
    ],
    ids=["list-ts-utc", "list-ts-paris", "struct-ts-utc"],
)
def test_a_nested_zoned_timestamp_column_converts_to_parquet_with_its_type(tmp_path, typ, value):
    _assert_kept(tmp_path, pa.table({"t": pa.array([value, None], typ)}))


@pytest.mark.parametrize(
    "typ, value",
    [
        (pa.struct([("a", pa.date32())]), {"a": datetime.date(2020, 2, 29)}),
        (pa.map_(pa.string(), pa.date32()), [("k", datetime.date(2020, 2, 29))]),
    ],
    ids=["struct-date32", "map-date32"],
)
def test_a_date_inside_a_struct_or_map_converts_to_parquet(tmp_path, typ, value):
    _assert_kept(tmp_path, pa.table({"t": pa.array([value, None], typ)}))


@pytest.mark.parametrize(
    "rows",
    [[[[1], [2, 3]], []], [[[1, 2], [3, 4]], [[1], [2, 3]]]],
    ids=["ragged-and-empty", "square-and-ragged"],
)
def test_a_list_of_lists_column_converts_to_parquet(tmp_path, rows):
    _assert_kept(tmp_path, pa.table({"t": pa.array(rows, pa.list_(pa.list_(pa.int8())))}))


def _linked_dataset(tmp_path) -> str:
    ds = tmp_path / "ds"
    (ds / "sub").mkdir(parents=True)
    (tmp_path / "more").mkdir()
    for path in (ds / "a.parquet", ds / "sub" / "b.parquet", tmp_path / "more" / "c.parquet"):
        pq.write_table(pa.table({"x": [1]}), path)
    os.symlink(tmp_path / "more", ds / "more")
    return str(ds)


def test_a_listed_directory_names_its_linked_folder(tmp_path):
    ds = _linked_dataset(tmp_path)
    with pytest.warns(DatasetWarning, match=r"1 linked folder: 'more'"):
        _, files = tgfs.expand_paths(ds, suffixes=[".parquet"])
    assert [os.path.relpath(f, ds) for f in files] == [
        "a.parquet",
        os.path.join("sub", "b.parquet"),
    ]


@pytest.mark.parametrize("pattern", ["**/*.parquet", "*/*.parquet"])
def test_a_glob_names_the_linked_folder_it_does_not_walk(tmp_path, pattern):
    ds = _linked_dataset(tmp_path)
    with pytest.warns(DatasetWarning, match=r"linked folder.*'more'"):
        tgfs.expand_paths(f"{ds}/{pattern}", suffixes=[".parquet"])


# ------------------------------------------------------------- a chained S3 listing
def test_a_chained_s3_listing_that_repeats_its_token_is_refused():
    pytest.importorskip("s3fs")
    # Tokens A, B, A, B... until page 40, which ends the listing (so a loop that does not
    # refuse a repeated token ends too, instead of holding the test).
    server, url, served = s3_listing_server(
        lambda n: (
            s3_listing_page(n, "AB"[n % 2]) if n < 40 else s3_listing_page(n, "", truncated=False)
        )
    )
    opts = {"s3": {"endpoint_url": url, "key": "k", "secret": "s"}}
    try:
        with (
            using(RetryPolicy(attempts=1, deadline=20.0)),
            pytest.raises(tg.CorruptDataError, match=r"does not end"),
        ):
            tgfs.expand_paths(
                "simplecache::s3://bkt/ds", suffixes=[".array_record"], storage_options=opts
            )
        assert served[0] < 10
    finally:
        server.shutdown()


# ---------------------------------------------------- tokenizing a Parquet corpus again
@pytest.mark.parametrize("old", [pa.int64(), pa.uint16()])
def test_a_parquet_corpus_with_a_tokens_column_tokenizes_again(tmp_path, old):
    from torchgrain.tokens.tokenize import tokenize

    (tmp_path / "src").mkdir()
    table = pa.table({"text": ["a bb", "ccc"], "tokens": pa.array([[7], [8]], pa.list_(old))})
    pq.write_table(table, tmp_path / "src" / "a.parquet")
    lengths = tokenize("text", lambda ts: [[len(w) for w in t.split()] for t in ts], "tokens")
    tg.convert(
        str(tmp_path / "src"), str(tmp_path / "dst"), to="parquet", progress=False, tokenize=lengths
    )
    (out,) = sorted((tmp_path / "dst").glob("*.parquet"))
    assert pq.read_table(out).column("tokens").to_pylist() == [[1, 2], [3]]


# ------------------------------------------------------- requests of an S3 dataset's open
@pytest.mark.parametrize("given", ["s3://rf51/ds", "s3://rf51/ds/**/*.parquet"])
def test_opening_an_s3_dataset_asks_no_head_request_per_shard(moto_s3, given):
    import io

    from tests.servers import FaultProxy

    client, endpoint = moto_s3
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": [1, 2]}), buf)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket="rf51")
    for i in range(6):
        client.put_object(Bucket="rf51", Key=f"ds/sub{i % 2}/p{i}.parquet", Body=buf.getvalue())
    with FaultProxy(endpoint) as proxy:
        src = tg.ParquetSource(given, storage_options={"endpoint_url": proxy.url})
        assert len(src) == 12
        heads = [p for m, p in proxy.log if m == "HEAD"]
    assert len(heads) <= 1, heads  # (the root's own probe)


def test_an_s3_glob_lists_only_its_literal_prefix(moto_s3, monkeypatch):
    client, endpoint = moto_s3
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket="rf51g")
    for name in [f"junk-{i}" for i in range(8)] + ["train-0", "train-1"]:
        client.put_object(Bucket="rf51g", Key=f"data/{name}.parquet", Body=b"")
    monkeypatch.setattr(tgfs, "MAX_LISTED_OBJECTS", 5, raising=False)
    _, files = tgfs.expand_paths(
        "s3://rf51g/data/train-*.parquet",
        suffixes=[".parquet"],
        storage_options={"endpoint_url": endpoint},
    )
    assert files == [f"s3://rf51g/data/train-{i}.parquet" for i in range(2)]
