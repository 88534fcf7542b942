"""Values Parquet holds exactly stay written when the writer refuses the ones it would
change: the checks of nested leaves against their column's type take every value Arrow
writes as it is (a bytearray or memoryview in a binary leaf is written as its bytes)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchgrain.writers import records_to_table


def _round_trip(tmp_path, records, schema):
    table = records_to_table(records, schema)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize(
    ("kind", "value", "back"),
    [
        (pa.list_(pa.binary()), [bytearray(b"ab"), b"c", None], [b"ab", b"c", None]),
        (pa.list_(pa.binary()), [memoryview(b"ab")], [b"ab"]),
        (pa.struct({"f": pa.binary()}), {"f": bytearray(b"ab")}, {"f": b"ab"}),
        (pa.map_(pa.binary(), pa.int64()), [(bytearray(b"k"), 1)], [(b"k", 1)]),
    ],
    ids=["bytearray_in_list", "memoryview_in_list", "bytearray_in_struct", "bytearray_map_key"],
)
def test_nested_binary_leaf_takes_bytes_like_values(tmp_path, kind, value, back):
    """A bytearray or memoryview in a list<binary>, a struct's binary field or a map's
    binary key was written as its bytes (read back equal); it is now a TypeError ("it
    holds bytearray(b'ab') (bytearray)") though nothing of it would change."""
    schema = pa.schema({"v": kind})
    assert _round_trip(tmp_path, [{"v": value}, {"v": None}], schema) == [
        {"v": back},
        {"v": None},
    ]


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (pa.timestamp("us"), "2020-01-01 00:00:00.000000001"),
        (pa.timestamp("ms"), "2020-01-01 00:00:00.000000001"),
        (pa.duration("us"), 1),
    ],
    ids=["timestamp_us", "timestamp_ms", "duration_us"],
)
def test_pandas_nanoseconds_refused_by_coarser_temporal_column(kind, value):
    """A pandas Timestamp or Timedelta (a datetime or timedelta that holds nanoseconds)
    in a timestamp[us]/[ms] or duration[us] column was written without its nanoseconds
    (00:00:00.000000001 as 00:00:00, 1 ns as 0), as a Python datetime's microseconds in a
    timestamp[s] column were before they were refused; it is a TypeError naming the key."""
    pd = pytest.importorskip("pandas")
    v = pd.Timedelta(value) if pa.types.is_duration(kind) else pd.Timestamp(value)
    with pytest.raises(TypeError, match="'x'"):
        records_to_table([{"x": v}], pa.schema({"x": kind}))
