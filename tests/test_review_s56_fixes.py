"""Values that the checks on Parquet times and on column rows must leave as they were."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import torchgrain as tg


def _numbers(tmp_path):
    path = tmp_path / "n.parquet"
    table = pa.table(
        {
            "i8": pa.array([3, 4], pa.int8()),
            "i32": pa.array([5, 6], pa.int32()),
            "u8": pa.array([0, 1], pa.uint8()),
            "f32": pa.array([0.5, 1.5], pa.float32()),
        }
    )
    pq.write_table(table, path)
    return str(path)


def test_map_after_map_batch_sees_the_parquet_records_numbers(tmp_path):
    """A Parquet record holds an int8, int32, uint8 or float32 column's value as a Python
    int or float, with or without batch_format="columns", and a map placed after a
    map_batch on a column batch sees the same values: arithmetic on them does not wrap at
    the column's width and the record is JSON-able."""
    path = _numbers(tmp_path)

    def seen_by_map(batch_format):
        seen = []
        ds = tg.Dataset(tg.ParquetSource(path, decoded_cache=False), batch_format=batch_format)
        ds = ds.map_batch(lambda batch: batch).map(lambda r: seen.append(dict(r)) or r)
        ds.__getitems__([0, 1])
        return seen

    records = seen_by_map("records")
    columns = seen_by_map("columns")
    assert [{k: type(v) for k, v in r.items()} for r in records] == [
        {"i8": int, "i32": int, "u8": int, "f32": float}
    ] * 2
    assert [{k: type(v) for k, v in r.items()} for r in columns] == [
        {k: type(v) for k, v in r.items()} for r in records
    ]
    assert [r["i8"] * 100 for r in columns] == [300, 400]
    assert [r["u8"] - 1 for r in columns] == [-1, 0]
    assert json.dumps(columns) == json.dumps(records)


def _times(tmp_path):
    """A file whose column ``t`` holds time64[ns] values with nanoseconds beyond whole
    microseconds (which datetime.time cannot hold) beside exact columns."""
    path = tmp_path / "t.parquet"
    table = pa.table(
        {
            "a": pa.array(range(6)),
            "t": pa.array([1, 2, 3, 1000, 2000, 3001], pa.time64("ns")),
            "tok": pa.array([1000, 2000, 3000, 4000, 5000, 6000], pa.time64("ns")),
        }
    )
    pq.write_table(table, path, row_group_size=3)
    return str(path)


def test_pushdown_filter_on_a_time64ns_column_left_out_of_the_records(tmp_path):
    """A filter expression on a time64[ns] column is evaluated by Arrow on its nanoseconds,
    exactly; with columns= leaving that column out no datetime.time is made of it, so its
    sub-microsecond values select rows and read nothing wrong."""
    path = _times(tmp_path)
    src = tg.ParquetSource(
        path,
        columns=["a"],
        filter=pc.field("t") > pa.scalar(2, pa.time64("ns")),
        decoded_cache=False,
    )
    assert [src[i]["a"] for i in range(len(src))] == [2, 3, 4, 5]


def test_dataset_filter_unaffected_by_an_unread_time64ns_column(tmp_path):
    """Dataset.filter with an expression on column ``tok`` (whole microseconds) over a
    source reading column ``a`` only keeps the matching rows; column ``t``, whose
    sub-microsecond values no record holds, does not make the pass fail."""
    path = _times(tmp_path)
    ds = tg.Dataset(tg.ParquetSource(path, columns=["a"], decoded_cache=False))
    kept = ds.filter(
        pc.field("tok") > pa.scalar(2000, pa.time64("ns")),
        index_dir=str(tmp_path / "index"),
        progress=False,
    )
    assert [kept[i]["a"] for i in range(len(kept))] == [2, 3, 4, 5]
