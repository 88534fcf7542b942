"""Schema-typed Parquet output holds every nested value exactly: a float in an integer
leaf of a list, struct or map (a Python float or a numpy array's), which Arrow truncates
without a word (1.5 to 1), is a TypeError naming the key."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from torchgrain.writers import records_to_table

INT_LIST = pa.list_(pa.int32())


@pytest.mark.parametrize(
    "record,kind",
    [
        ({"a": [1, 1.5]}, INT_LIST),
        ({"a": np.array([1.5, 2.0])}, INT_LIST),  # beside a row of Python ints (below)
        ({"a": {"b": [1.5]}}, pa.struct([("b", INT_LIST)])),
        ({"a": {"b": np.array([1.5])}}, pa.struct([("b", INT_LIST)])),
        ({"a": {"b": 1.5}}, pa.struct([("b", pa.int64())])),
        ({"a": [{"b": np.array([1.5])}]}, pa.list_(pa.struct([("b", INT_LIST)]))),
        ({"a": [[1], [2.5]]}, pa.list_(pa.list_(pa.int64()))),
        ({"a": [("k", 2.5)]}, pa.map_(pa.string(), pa.int64())),
        ({"a": [("k", np.array([1.5]))]}, pa.map_(pa.string(), INT_LIST)),
    ],
)
def test_a_float_in_an_integer_leaf_is_refused(record, kind):
    with pytest.raises(TypeError, match=r"'a'.*(1\.5|2\.5|float64|double)"):
        records_to_table([record, {"a": None}, record], pa.schema([("a", kind)]))
    if kind == INT_LIST:  # beside a row of ints: not the all-arrays path
        with pytest.raises(TypeError, match="'a'"):
            records_to_table([{"a": [1, 2]}, record], pa.schema([("a", kind)]))


def test_integers_in_nested_integer_leaves_are_written_as_they_are():
    schema = pa.schema(
        [
            ("a", INT_LIST),
            ("s", pa.struct([("b", INT_LIST), ("n", pa.int64())])),
            ("m", pa.map_(pa.string(), pa.int64())),
        ]
    )
    records = [
        {"a": [1, None, np.int64(3)], "s": {"b": np.array([4, 5]), "n": 6}, "m": [("k", 7)]},
        {"a": (8, 9), "s": {"b": [10], "n": None}, "m": []},
    ]
    assert records_to_table(records, schema).to_pylist() == [
        {"a": [1, None, 3], "s": {"b": [4, 5], "n": 6}, "m": [("k", 7)]},
        {"a": [8, 9], "s": {"b": [10], "n": None}, "m": []},
    ]
