"""A numpy NaT in a Parquet output column is written as a null, at the top level and in
lists and structs, of every date, time and duration unit; never as 1970-01-01 or as
int64's least value."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.writers import records_to_table

DTYPES = [f"datetime64[{u}]" for u in ("D", "s", "ms", "us", "ns")] + [
    f"timedelta64[{u}]" for u in ("s", "ms", "us", "ns")
]


def _leaves(column):
    """The values at the bottom of a (list or struct) column."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    while pa.types.is_list(column.type) or pa.types.is_struct(column.type):
        column = column.flatten() if pa.types.is_list(column.type) else column.field(0)
    return column


def _kind(dtype):
    return pa.array(np.zeros(1, dtype)).type


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("typed", [False, True], ids=["untyped", "typed"])
def test_a_top_level_nat_is_a_null(dtype, typed):
    nat, one = np.array(["NaT", 1], dtype)
    schema = pa.schema({"t": _kind(dtype)}) if typed else None
    for values in ([nat, None, one], [nat, one], [None, nat]):
        t = records_to_table([{"t": v} for v in values], schema)
        got = t.column("t")
        assert got.type == _kind(dtype)
        assert got.is_null().to_pylist() == [v is None or np.isnat(v) for v in values]
        assert pc.drop_null(got.combine_chunks()).equals(
            pa.array(np.array([v for v in values if v == one], dtype))
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("typed", [False, True], ids=["untyped", "typed"])
def test_a_nat_in_an_array_or_beside_one_is_a_null_item(dtype, typed):
    nat, one = np.array(["NaT", 1], dtype)
    values = [np.array([nat, one]), None, [nat, None], np.array([[nat]])[0]]
    schema = pa.schema({"t": pa.list_(_kind(dtype))}) if typed else None
    got = records_to_table([{"t": v} for v in values], schema).column("t")
    assert got.is_null().to_pylist() == [False, True, False, False]
    assert _leaves(got).is_null().to_pylist() == [True, False, True, True, True]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nat_in_a_2d_array_is_a_null_item(dtype):
    nat, one = np.array(["NaT", 1], dtype)
    got = records_to_table([{"t": np.array([[nat, one]])}]).column("t")
    assert _leaves(got).is_null().to_pylist() == [True, False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nat_in_a_typed_struct_is_a_null(dtype):
    nat, one = np.array(["NaT", 1], dtype)
    kind = pa.struct({"f": _kind(dtype)})
    got = records_to_table([{"s": {"f": nat}}, {"s": {"f": one}}], pa.schema({"s": kind}))
    assert _leaves(got.column("s")).is_null().to_pylist() == [True, False]


@pytest.mark.parametrize("dtype", ["datetime64[D]", "datetime64[us]", "timedelta64[ns]"])
def test_convert_writes_a_nat_as_a_null(tmp_path, dtype):
    nat, one = np.array(["NaT", 1], dtype)
    tg.write_array_record([{"t": nat}, {"t": None}, {"t": one}], tmp_path / "ar")
    tg.convert(tmp_path / "ar", tmp_path / "pq", to="parquet")
    got = pq.read_table(tmp_path / "pq").column("t")
    assert got.is_null().to_pylist() == [True, True, False]
