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


@pytest.mark.xfail(
    strict=True,
    reason="nested binary leaves refuse bytearray/memoryview, which Arrow writes as their bytes",
)
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
