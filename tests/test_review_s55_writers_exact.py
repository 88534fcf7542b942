"""Values written to Parquet read back exactly, or are refused with an error naming the key."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.writers import records_to_table, write_parquet


def _round_trip(tmp_path, records, schema):
    """The records as written with ``schema`` and read back, or the TypeError raised."""
    table = records_to_table(records, schema)
    path = tmp_path / "out.parquet"
    pq.write_table(table, path)
    return pq.read_table(path).to_pylist()


def test_map_given_as_dict_refuses_float_in_int_items(tmp_path):
    """A map<string, int32> value given as a dict ``{"a": 1.5}`` was written as ``{"a": 1}``:
    only maps given as lists of pairs had their items checked. It is a TypeError naming the key."""
    schema = pa.schema({"m": pa.map_(pa.string(), pa.int32())})
    with pytest.raises(TypeError, match="'m'"):
        _round_trip(tmp_path, [{"m": {"a": 1.5}}], schema)


def test_float32_column_refuses_int_past_2_53(tmp_path):
    """An int ``2**53 + 1`` in a float32 column was written as ``2**53``: it was made a
    float64 (rounding it) before being checked against float32. float64 columns refuse it."""
    schema = pa.schema({"x": pa.float32()})
    with pytest.raises(TypeError, match="'x'"):
        _round_trip(tmp_path, [{"x": 2**53 + 1}], schema)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (pa.timestamp("s"), dt.datetime(2020, 1, 1, 0, 0, 0, 500_000)),
        (pa.list_(pa.timestamp("s")), [dt.datetime(2020, 1, 1, 0, 0, 0, 500_000)]),
        (pa.duration("s"), dt.timedelta(seconds=1, microseconds=500_000)),
        (pa.time32("s"), dt.time(1, 2, 3, 500)),
        (pa.date32(), dt.datetime(2020, 1, 1, 12)),
    ],
    ids=["timestamp_s", "list_timestamp_s", "duration_s", "time32_s", "date32_of_datetime"],
)
def test_temporal_column_refuses_python_value_it_would_truncate(tmp_path, kind, value):
    """A Python datetime with microseconds in a ``timestamp[s]`` column (alone or in a list),
    a timedelta in a ``duration[s]`` one, a time in a ``time32[s]`` one and a datetime at noon
    in a ``date32`` one were written truncated (12:00:00.5 as 12:00:00, noon as midnight);
    numpy values of a finer unit are refused. Each is a TypeError naming the key."""
    schema = pa.schema({"t": kind})
    with pytest.raises(TypeError, match="'t'"):
        _round_trip(tmp_path, [{"t": value}], schema)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (pa.list_(pa.string()), [b"a"]),
        (pa.struct({"s": pa.string()}), {"s": b"a"}),
        (pa.list_(pa.binary()), ["a"]),
    ],
    ids=["bytes_in_list_of_string", "bytes_in_struct_string", "str_in_list_of_binary"],
)
def test_nested_string_and_binary_leaves_refuse_the_other_type(tmp_path, kind, value):
    """``b"a"`` in a list<string> or struct string field read back as ``"a"``, and ``"a"``
    in a list<binary> as ``b"a"``; at the top level both are refused. Nested, they are a
    TypeError naming the key too."""
    schema = pa.schema({"v": kind})
    with pytest.raises(TypeError, match="'v'"):
        _round_trip(tmp_path, [{"v": value}], schema)


@pytest.mark.parametrize(
    "records",
    [
        [{"k": "a"}, {"k": b"b"}],
        [{"k": ["a", b"b"]}],
    ],
    ids=["across_records", "in_one_list"],
)
def test_write_parquet_str_beside_bytes_is_refused_or_kept(tmp_path, records):
    """A column of ``"a"`` in one record and ``b"b"`` in another was written as binary
    (``"a"`` read back ``b"a"``), and a list ``["a", b"b"]`` as strings (``b"b"`` read
    back ``"b"``). Either each value reads back as given or it is a TypeError naming the key."""
    try:
        write_parquet(records, tmp_path / "out")
    except TypeError as e:
        assert "'k'" in str(e)
        return
    back = pq.read_table(tmp_path / "out").to_pylist()
    assert back == records


@pytest.mark.parametrize(
    "records",
    [
        [{"k": 1.5}, {"k": True}],
        [{"k": [1.5, True]}],
        [{"k": [np.True_, 1]}],
    ],
    ids=["float_then_bool_records", "float_and_bool_in_list", "numpy_bool_and_int_in_list"],
)
def test_write_parquet_bool_beside_numbers_is_refused_or_kept(tmp_path, records):
    """``True`` beside a float was written as the double ``1.0``, and ``np.True_`` beside an
    int as the int ``1`` (a bool beside Python ints is refused). Either each value reads
    back as given (a bool a bool) or it is a TypeError naming the key."""
    try:
        write_parquet(records, tmp_path / "out")
    except TypeError as e:
        assert "'k'" in str(e)
        return
    back = pq.read_table(tmp_path / "out").to_pylist()
    flat = [v for r in back for v in (r["k"] if isinstance(r["k"], list) else [r["k"]])]
    given = [v for r in records for v in (r["k"] if isinstance(r["k"], list) else [r["k"]])]
    assert [type(v) is bool for v in flat] == [isinstance(v, (bool, np.bool_)) for v in given]


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (pa.struct({"a": pa.int32()}), {"a": 1, "b": 2}),
        (pa.list_(pa.struct({"a": pa.int32()})), [{"a": 1, "b": "kept?"}]),
    ],
    ids=["struct", "list_of_struct"],
)
def test_struct_column_refuses_dict_with_other_keys(tmp_path, kind, value):
    """A dict ``{"a": 1, "b": 2}`` in a ``struct<a: int32>`` column read back ``{"a": 1}``:
    key ``b`` and its value were dropped. It is a TypeError naming the column."""
    schema = pa.schema({"s": kind})
    with pytest.raises(TypeError, match="'s'"):
        _round_trip(tmp_path, [{"s": value}], schema)


@pytest.mark.parametrize("value", ["\ud800", ["ok", "\ud800"]], ids=["str", "list_of_str"])
def test_tf_example_text_not_utf8_error_names_feature(value):
    """A str holding a lone surrogate (which UTF-8 cannot encode) raised a bare
    UnicodeEncodeError; every other value an Example cannot hold names its feature."""
    with pytest.raises(ValueError, match="'caption'"):
        encode_tf_example({"id": 1, "caption": value})


@pytest.mark.parametrize(
    "records",
    [
        [{"k": [np.float16(1.5), 2]}],
        [{"k": [2049, np.float16(1.5)]}],
        [{"k": {"a": np.float16(1.5)}}, {"k": {"a": 3}}],
    ],
    ids=["float16_first", "float16_after_int", "struct_field_across_records"],
)
def test_write_parquet_float16_beside_ints_keeps_its_value(tmp_path, records):
    """``[np.float16(1.5), 2]`` was written as ``list<int64>`` and read back ``[1, 2]`` (a
    struct field likewise): Arrow's inference takes the float16 for an int. It reads back
    1.5, or is a TypeError naming the key."""
    try:
        write_parquet(records, tmp_path / "out")
    except TypeError as e:
        assert "'k'" in str(e)
        return
    back = pq.read_table(tmp_path / "out").to_pylist()
    assert back == [
        {"k": [float(v) for v in r["k"]] if isinstance(r["k"], list) else r["k"]} for r in records
    ]
    assert 1.5 in [
        v for r in back for v in (r["k"] if isinstance(r["k"], list) else r["k"].values())
    ]


def test_convert_array_record_str_beside_bytes_to_parquet(tmp_path):
    """Records ``{"label": "cat"}`` and ``{"label": b"\\x89"}`` converted from ArrayRecord to
    Parquet read back ``b"cat"`` for the first: the column was written as binary. Each label
    reads back as given, or the conversion is a TypeError naming the key."""
    records = [{"label": "cat"}, {"label": b"\x89"}]
    tg.write_array_record(records, tmp_path / "in")
    try:
        tg.convert(tmp_path / "in", tmp_path / "out", to="parquet", progress=False)
    except TypeError as e:
        assert "'label'" in str(e)
        return
    back = tg.ParquetSource(str(tmp_path / "out"))
    assert [back[i]["label"] for i in range(len(back))] == ["cat", b"\x89"]
