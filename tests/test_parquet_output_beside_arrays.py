"""numpy arrays beside lists (or numpy scalars beside Python ones) in one Parquet output
column: the others are written with the arrays' dtype, each value held exactly and nulls
kept, or the column is refused naming the key and the record; never widened."""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pytest

import torchgrain as tg
from torchgrain.writers import records_to_table


def _table(*values):
    return records_to_table([{"x": v} for v in values])


def test_lists_beside_arrays_take_the_arrays_dtype_with_their_nulls():
    t = _table(np.array([7, 8], np.int16), [3, None], None, [], np.array([], np.int16))
    assert t.schema.field("x").type == pa.list_(pa.int16())
    assert t.column("x").to_pylist() == [[7, 8], [3, None], None, [], []]


def test_nested_lists_beside_2d_arrays_take_their_dtype():
    t = _table(np.ones((2, 1), np.uint8), [[1], [2, None], None], [np.array([5], np.uint8)])
    assert t.schema.field("x").type == pa.list_(pa.list_(pa.uint8()))
    assert t.column("x").to_pylist() == [[[1], [1]], [[1], [2, None], None], [[5]]]


def test_floats_and_ints_beside_float32_arrays_when_held_exactly():
    t = _table(np.array([0.25], np.float32), [0.5, 3, None, float("inf")])
    assert t.schema.field("x").type == pa.list_(pa.float32())
    assert t.column("x").to_pylist() == [[0.25], [0.5, 3.0, None, float("inf")]]


def test_python_scalars_beside_numpy_scalars_take_their_dtype():
    t = _table(np.int16(-4), 5, None)
    assert t.schema.field("x").type == pa.int16()
    assert t.column("x").to_pylist() == [-4, 5, None]


@pytest.mark.parametrize(
    "array,other,shown",
    [
        (np.array([True, False]), [1, None], "1 (int)"),
        (np.array([1, 2], np.int16), [3, True], "True (bool)"),
        (np.array([1], np.int16), [1.5], "1.5 (float)"),
        (np.array([1], np.int16), [3.0], "3.0 (float)"),
        (np.array([1.0], np.float64), [False], "False (bool)"),
        (np.array([1], np.uint8), b"ab", "b'ab' (bytes)"),
        (np.array([1], np.int16), "ab", "'ab' (str)"),
        (np.array([1], np.int16), [[1]], "[1] (list)"),
        (np.ones((1, 1), np.int16), [1], "1 (int)"),
        (np.ones((1, 1), np.int16), [np.array([1], np.int32)], "array([1], dtype=int32)"),
        (np.array([b"a"]), ["a"], "'a' (str)"),
        (np.int16(1), [1], "[1] (list)"),
        (np.int16(1), True, "True (bool)"),
    ],
)
def test_a_value_of_another_type_beside_arrays_is_refused_naming_key_and_record(
    array, other, shown
):
    with pytest.raises(TypeError, match="cannot store key 'x'") as e:
        _table(array, None, other)
    assert "record 2 holds " + shown in str(e.value)
    assert str(np.asarray(array).dtype) in str(e.value)


@pytest.mark.parametrize(
    "array,other,shown",
    [
        (np.array([1], np.int8), [300], "[300]"),
        (np.array([1], np.uint16), [-1], "[-1]"),
        (np.array([0.5], np.float32), [0.1], "[0.1]"),
        (np.array([1.0], np.float64), [2**53 + 1], str([2**53 + 1])),
        (np.int8(1), 128, "128"),
    ],
)
def test_a_value_the_arrays_dtype_does_not_hold_exactly_is_refused(array, other, shown):
    with pytest.raises(TypeError, match="cannot store key 'x'") as e:
        _table(array, other)
    assert f"record 1 holds {shown}, not {np.asarray(array).dtype} values" in str(e.value)


def test_datetimes_beside_datetime_arrays_only_in_exact_units():
    s = np.array(["2020-01-01T00:00:01"], "datetime64[s]")
    t = _table(s, [np.datetime64("2020-01-01T00:00:02.000", "ms"), None])
    assert t.schema.field("x").type == pa.list_(pa.timestamp("s"))
    assert t.column("x").to_pylist()[1] == [datetime.datetime(2020, 1, 1, 0, 0, 2), None]
    with pytest.raises(TypeError, match="record 1 holds"):
        _table(s, [np.datetime64("2020-01-01T00:00:02.001", "ms")])


def test_arrays_of_two_dtypes_beside_lists_are_refused_as_without_lists():
    with pytest.raises(TypeError, match="arrays of different dtypes"):
        _table(np.array([1], np.int16), np.array([1], np.int32), [1])


@pytest.mark.parametrize(
    "array,other",
    [(np.array([7, 8], np.int16), [3, None]), (np.array([0.5, -0.0], np.float32), [1.5, None])],
)
def test_parquet_to_array_record_to_parquet_keeps_the_arrays_dtype(tmp_path, array, other):
    # A list<int16> Parquet column with null items reads as an array where a row has no
    # null and as a list where it has: back to Parquet, the column is list<int16> again.
    tg.write_array_record([{"x": array}, {"x": other}, {"x": None}], tmp_path / "ar")
    tg.convert(tmp_path / "ar", tmp_path / "pq", to="parquet")
    src = tg.ParquetSource(tmp_path / "pq")
    got = src[0]["x"]
    assert got.dtype == array.dtype and got.tobytes() == array.tobytes()
    assert list(src[1]["x"]) == other and src[2]["x"] is None


def test_convert_names_the_key_and_records_of_a_refused_value(tmp_path):
    tg.write_array_record([{"x": np.array([True])}, {"x": [1, None]}], tmp_path / "ar")
    with pytest.raises(TypeError, match=r"'x'.*record 1 holds 1 \(int\) beside arrays of bool"):
        tg.convert(tmp_path / "ar", tmp_path / "pq", to="parquet")
