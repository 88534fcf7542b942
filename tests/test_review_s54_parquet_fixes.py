"""Parquet output of values typed by a source's schema (records_to_table with a schema):
arrays inside structs and dates in lists are written as the values they are, or refused,
never written as other values."""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.writers import records_to_table


@pytest.mark.parametrize(
    ("shape", "kind"),
    [((0, 2), pa.list_(pa.list_(pa.float32()))), ((0, 3), pa.list_(pa.list_(pa.float32(), 2)))],
)
def test_an_empty_matrix_inside_a_struct_keeps_its_shape_or_is_refused(tmp_path, shape, kind):
    """An array of shape (0, 2) in a column list<list<float>> is refused at the top level
    (nothing records the 2 below a zero-length dimension), and one of shape (0, 3) in
    list<fixed_size_list<float, 2>> too (its sizes are not the column's). The same array
    in a struct field of that type is refused as well, or reads back with its shape; it
    is not written as an array of another shape without a word."""
    schema = pa.schema({"s": pa.struct([("m", kind)])})
    value = np.zeros(shape, np.float32)
    with pytest.raises(TypeError):
        records_to_table([{"s": value}], pa.schema({"s": kind}))  # (the top level refuses)
    try:
        table = records_to_table([{"s": {"m": value}}], schema)
    except TypeError:
        return  # refused, as at the top level
    pq.write_table(table, tmp_path / "a.parquet")
    got = tg.ParquetSource(str(tmp_path))[0]["s"]["m"]
    assert np.shape(got) == shape


def test_a_float_matrix_in_an_int_struct_field_is_refused(tmp_path):
    """records_to_table promises that a value its column's type does not hold exactly
    is an error: a 2-D float64 array holding 1.5 in a struct field of type
    list<list<int32>> is refused (a TypeError naming the key), not written as 1."""
    schema = pa.schema({"s": pa.struct([("m", pa.list_(pa.list_(pa.int32())))])})
    record = {"s": {"m": np.array([[1.5, 2.0], [3.0, 4.0]])}}
    with pytest.raises(TypeError, match="'s'"):
        table = records_to_table([record], schema)
        pq.write_table(table, tmp_path / "a.parquet")
        written = pq.read_table(tmp_path / "a.parquet").column("s").to_pylist()
        assert written == [{"m": [[1.5, 2.0], [3.0, 4.0]]}]  # (what Parquet holds today: 1)


def test_a_time_of_day_in_a_list_of_date64_is_refused_or_keeps_its_day(tmp_path):
    """A list<date64> column holds whole days. A datetime64[ms] array holding
    1969-12-31T05:00 beside a row with a null date is refused (as a date32 column
    refuses it: the type does not hold the time), or written as the day it falls in;
    it is not written as 1970-01-01, which the Parquet file then reads back."""
    schema = pa.schema({"d": pa.list_(pa.date64())})
    records = [{"d": np.array(["1969-12-31T05:00"], "datetime64[ms]")}, {"d": [None]}]
    try:
        table = records_to_table(records, schema)
    except (TypeError, ValueError):
        return  # refused
    pq.write_table(table, tmp_path / "a.parquet")
    got = pq.read_table(tmp_path / "a.parquet").column("d").to_pylist()
    assert got == [[datetime.date(1969, 12, 31)], [None]]
