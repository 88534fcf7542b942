"""Hive keys alike through every way a ParquetSource builds records, maps and fixed-size
lists read whole and sliced, and an int64 shard's negative int found with or without
row-group statistics."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.sources.parquet.values import arrow_column, convert_column


@pytest.fixture
def hive(tmp_path):
    """Three files under ``k=...`` (a string with a space, the default partition, an
    empty file between them) of two row groups each but the empty one."""
    for i, key in enumerate(["a%20b", "__HIVE_DEFAULT_PARTITION__", "c"]):
        rows = 0 if i == 1 else 3
        table = pa.table({"x": pa.array(range(10 * i, 10 * i + rows), pa.int64())})
        (tmp_path / f"k={key}").mkdir()
        pq.write_table(table, str(tmp_path / f"k={key}" / "f.parquet"), row_group_size=2)
    return tmp_path


@pytest.mark.parametrize("cache_bytes", [0, 1 << 24])  # records built from views / templates
def test_hive_keys_are_the_same_through_every_read_path(hive, cache_bytes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = tg.ParquetSource(str(hive), cache_bytes=cache_bytes)
    want = [{"x": x, "k": k} for x, k in [(0, "a b"), (1, "a b"), (2, "a b")]]
    want += [{"x": x, "k": "c"} for x in (20, 21, 22)]
    assert src.__getitems__([5, 0, 3, 2]) == [want[5], want[0], want[3], want[2]]
    assert [src[i] for i in range(6)] == want
    assert [r for s in range(3) for r in src.iter_shard(s)] == want
    batch = src.read_columns([4, 1])
    assert batch["x"].tolist() == [21, 1] and list(batch["k"]) == ["c", "a b"]


def test_maps_and_fixed_size_lists_read_the_same_whole_and_sliced():
    m = pa.array([[("a", 1), ("b", None)], None, [], [("c", 3)]], pa.map_(pa.string(), pa.int32()))
    f = pa.array([[1, 2], None, [5, 6], [7, 8]], pa.list_(pa.int64(), 2))
    for arr in (m, m.slice(1), pa.chunked_array([m.slice(0, 1), m.slice(1)])):
        assert convert_column(arr).take(list(range(len(arr)))) == arr.to_pylist()
    for arr in (f, f.slice(1), f.slice(2)):
        rows = convert_column(arr).take(list(range(len(arr))))
        assert [None if r is None else r.tolist() for r in rows] == arr.to_pylist()
    got = arrow_column(f.slice(2))
    assert got.dtype == np.int64 and got.tolist() == [[5, 6], [7, 8]]


@pytest.mark.parametrize("statistics", [True, False])
def test_an_int64_shards_negative_int_is_found_with_or_without_statistics(tmp_path, statistics):
    # (what keeps an int64 shard from being rewritten as uint64 beside a uint64 one)
    t = pa.table({"x": pa.array([3, 4, None, -5, -1], pa.int64()), "y": [1, 2, 3, 4, None]})
    path = str(tmp_path / "b.parquet")
    pq.write_table(t, path, row_group_size=2, write_statistics=statistics)
    assert tg.writers._outside(path, ["y", "x"], 0, None) == ("x", -5)
    assert tg.writers._outside(path, ["y"], 0, None) is None


def test_a_lossy_datetime_in_a_typed_column_is_named_as_the_record_holds_it():
    values = [np.datetime64("2020-01-01T00:00:00.500", "ms"), np.datetime64(1, "ns")]
    with pytest.raises(TypeError) as e:
        tg.writers.records_to_table([{"u": v} for v in values], pa.schema({"u": pa.timestamp("s")}))
    # (numpy 1 writes numpy.datetime64(...), numpy 2 np.datetime64(...))
    assert "datetime64('2020-01-01T00:00:00.500') is not a timestamp[s] value" in str(e.value)
