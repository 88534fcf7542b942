"""Parquet -> Parquet conversion keeps every column's Arrow type and value, or is an
error naming the column: the output is written with the source's schema, not typed
again from the Python values a ParquetSource returns."""

from __future__ import annotations

import datetime
import decimal
import glob
import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.sources.parquet.schema import numpy_dtype
from torchgrain.writers import records_to_table

_N = 7  # rows; every column has a null in row 1 (but the non-nullable ones)
_T0 = datetime.datetime(2020, 2, 29, 23, 59, 59, 123456, tzinfo=datetime.timezone.utc)


def _column(typ: pa.DataType, values: list) -> pa.Array:
    assert len(values) == _N
    return pa.array(values, typ)


def _ints(typ: pa.DataType) -> pa.Array:
    info = np.iinfo(numpy_dtype(typ)[0])
    return _column(typ, [int(info.min), None, int(info.max), 0, 1, -1 if info.min else 2, 7])


def _floats(typ: pa.DataType) -> pa.Array:
    dt = numpy_dtype(typ)[0]
    values = [1.5, None, float(np.finfo(dt).max), float(np.finfo(dt).tiny), -0.0, math.inf]
    values.append(float(dt.type(0.1)))  # 0.1 as that type rounds it
    return pa.array(np.array([0 if v is None else v for v in values], dt), mask=_NULL_ROW)


_NULL_ROW = np.array([i == 1 for i in range(_N)])

_TIMES = [_T0 + datetime.timedelta(days=400 * i, microseconds=i) for i in range(_N)]
_TIMES[1] = None


def _timestamps(unit: str, tz: str | None) -> pa.Array:
    whole = {"s": 1_000_000, "ms": 1000, "us": 1, "ns": 1}[unit]
    values = [
        None if t is None else t.replace(microsecond=t.microsecond // whole * whole) for t in _TIMES
    ]
    return pa.array(values, pa.timestamp(unit, tz=tz))


COLUMNS: dict[str, pa.Array] = {
    **{str(t): _ints(t) for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64())},
    **{str(t): _ints(t) for t in (pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64())},
    **{str(t): _floats(t) for t in (pa.float16(), pa.float32(), pa.float64())},
    "nan": pa.array(np.array([np.nan, 0, np.nan, 1, 2, 3, 4], np.float32)),
    "bool": _column(pa.bool_(), [True, None, False, True, True, False, False]),
    "string": _column(pa.string(), ["a", None, "", "é\x00", "日本", "x" * 50, "b"]),
    "large_string": _column(pa.large_string(), ["a", None, "", "b", "c", "d", "e"]),
    "binary": _column(pa.binary(), [b"a", None, b"", b"\x00\xff", b"b", b"c", b"d"]),
    "large_binary": _column(pa.large_binary(), [b"a", None, b"", b"\xff", b"b", b"c", b"d"]),
    "fixed_size_binary": _column(pa.binary(2), [b"ab", None, b"\x00\x00", b"cd"] + [b"zz"] * 3),
    "date32": _column(
        pa.date32(),
        [datetime.date(2020, 2, 29), None, datetime.date(1, 1, 1), datetime.date(9999, 12, 31)]
        + [datetime.date(1970, 1, 1 + i) for i in range(3)],
    ),
    **{f"ts_{u}": _timestamps(u, None) for u in ("ms", "us", "ns")},
    **{f"ts_{u}_utc": _timestamps(u, "UTC") for u in ("s", "ms", "us", "ns")},
    "ts_us_paris": _timestamps("us", "Europe/Paris"),
    "ts_ns_offset": _timestamps("ns", "+05:30"),
    "decimal": _column(
        pa.decimal128(9, 3),
        [decimal.Decimal(s) for s in ("1.234", "0", "-999999.999", "999999.999", "0.001")]
        + [None, decimal.Decimal("7")],
    ),
    "duration": _column(pa.duration("ms"), [0, None, -1, 2**40, 5, 6, 7]),
    "time64": _column(pa.time64("us"), [0, None, 86_399_999_999, 5, 6, 7, 8]),
    "list_int8": _column(pa.list_(pa.int8()), [[1, -128], None, [], [127], [0], [1, 2], [3]]),
    "list_float32": _column(
        pa.list_(pa.float32()), [[1.5, None], None, [], [0.25], [np.inf], [-0.0], [3.0]]
    ),
    "list_list_int16": _column(
        pa.list_(pa.list_(pa.int16())), [[[1, 2], [3, 4]], None, [], [[5]], [[]], [[6]], [[7]]]
    ),
    "fixed_size_list": _column(pa.list_(pa.uint16(), 2), [[1, 2], None] + [[3, 4]] * 5),
    "large_list_string": _column(
        pa.large_list(pa.string()), [["a"], None, [], ["b", None], ["c"], [], ["d"]]
    ),
    "struct": _column(
        pa.struct({"a": pa.int8(), "b": pa.string()}),
        [{"a": 1, "b": "x"}, None, {"a": None, "b": "y"}] + [{"a": 2, "b": "z"}] * 4,
    ),
    "map": _column(pa.map_(pa.string(), pa.uint8()), [[("a", 1)], None, []] + [[("b", 255)]] * 4),
    "struct_float": _column(
        pa.struct({"f": pa.float32(), "h": pa.list_(pa.float16())}),
        # (numpy float16 values: older pyarrow builds float16 from nothing else)
        [{"f": 0.5, "h": [np.float16(0.25), None]}, None, {"f": None, "h": []}]
        + [{"f": 1e30, "h": [np.float16(6e-8)]}] * 4,
    ),
    "map_float": _column(
        pa.map_(pa.string(), pa.float32()), [[("a", 0.5)], None, []] + [[("b", 1e-30)]] * 4
    ),
    "null": pa.nulls(_N),
}


def _source(tmp_path, table: pa.Table, files: int = 2) -> str:
    src = tmp_path / "src"
    src.mkdir()
    cut = table.num_rows // files
    for i in range(files):
        part = table.slice(i * cut, None if i == files - 1 else cut)
        pq.write_table(part, src / f"part-{i}.parquet", row_group_size=3)
    return str(src)


def _same(a, b) -> bool:
    """Equal values of the same Python type, nan equal to nan, -0.0 apart from 0.0."""
    # (older pyarrow hands float16 values over as numpy scalars)
    a, b = (float(x) if isinstance(x, np.floating) else x for x in (a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _plain(schema: pa.Schema) -> pa.Schema:
    """A ParquetSource reads a dictionary column as its values' type."""
    schema = schema.remove_metadata()
    for i, f in enumerate(schema):
        if pa.types.is_dictionary(f.type):
            schema = schema.set(i, f.with_type(f.type.value_type))
    return schema


def _check(src: str, out: str, num_shards: int) -> None:
    want_schema = _plain(pq.read_schema(sorted(glob.glob(os.path.join(src, "*.parquet")))[0]))
    shards = sorted(glob.glob(os.path.join(out, "*.parquet")))
    assert len(shards) == num_shards
    for shard in shards:
        got = pq.read_schema(shard).remove_metadata()
        for f, g in zip(want_schema, got):
            assert f.type == g.type, (shard, f, g)
        assert got.names == want_schema.names
    want = pq.read_table(src).to_pylist()
    got_rows = [r for shard in shards for r in pq.read_table(shard).to_pylist()]
    assert len(got_rows) == len(want)
    for k, (w, g) in enumerate(zip(want, got_rows)):
        for c in w:
            assert _same(w[c], g[c]), (k, c, w[c], g[c])


@pytest.mark.skipif(
    int(pa.__version__.split(".")[0]) < 16,
    reason="older pyarrow cannot write this test's table (lists with null slots of non-zero "
    "length)",
)
@pytest.mark.parametrize("num_shards", [1, 3])
def test_parquet_to_parquet_keeps_every_column_type_and_value(tmp_path, num_shards):
    table = pa.table(COLUMNS)
    src = _source(tmp_path, table)
    tg.convert(src, tmp_path / "out", to="parquet", num_shards=num_shards)
    _check(src, str(tmp_path / "out"), num_shards)
    # And a torchgrain reader reads the same records from both.
    a, b = tg.ParquetSource(src), tg.ParquetSource(tmp_path / "out")
    assert a.arrow_schema == b.arrow_schema
    for i in range(len(a)):
        ra, rb = a[i], b[i]
        for c in ra:
            assert type(ra[c]) is type(rb[c]) and repr(ra[c]) == repr(rb[c]), (i, c)


def test_a_dictionary_column_is_written_as_its_values_type(tmp_path):
    table = pa.table({"d": pa.array(["a", None, "b", "a"]).dictionary_encode()})
    src = _source(tmp_path, table, files=1)
    tg.convert(src, tmp_path / "out", to="parquet")
    (out,) = glob.glob(str(tmp_path / "out" / "*.parquet"))
    assert pq.read_schema(out).field("d").type == pa.string()
    assert pq.read_table(out).column("d").to_pylist() == ["a", None, "b", "a"]


def test_selected_columns_keep_their_types_in_the_selected_order(tmp_path):
    b = pa.array(np.array([1.5, 0], np.float16), mask=np.array([False, True]))
    table = pa.table({"a": pa.array([1, 2], pa.int8()), "b": b})
    src = _source(tmp_path, table, files=1)
    tg.convert(src, tmp_path / "out", to="parquet", columns=["b", "a"])
    (out,) = glob.glob(str(tmp_path / "out" / "*.parquet"))
    assert pq.read_schema(out).remove_metadata() == pa.schema({"b": pa.float16(), "a": pa.int8()})


def test_hive_partition_keys_are_columns_of_the_partition_values_type(tmp_path):
    for year in (2020, 2021):
        d = tmp_path / "src" / f"year={year}"
        d.mkdir(parents=True)
        pq.write_table(pa.table({"u": pa.array([year % 256], pa.uint8())}), d / "a.parquet")
    src = tg.ParquetSource(tmp_path / "src")
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", num_shards=2)
    shards = sorted(glob.glob(str(tmp_path / "out" / "*.parquet")))
    for shard in shards:
        assert pq.read_schema(shard).remove_metadata() == src.arrow_schema
    rows = [r for s in shards for r in pq.read_table(s).to_pylist()]
    assert rows == [{"u": 228, "year": 2020}, {"u": 229, "year": 2021}]


def test_an_empty_output_shard_has_the_source_columns(tmp_path):
    src = _source(tmp_path, pa.table({"a": pa.array([1], pa.int16())}), files=1)
    tg.convert(src, tmp_path / "out", to="parquet", num_shards=2)
    for shard in glob.glob(str(tmp_path / "out" / "*.parquet")):
        assert pq.read_schema(shard).field("a").type == pa.int16()
    assert [r["a"] for r in tg.ParquetSource(tmp_path / "out")] == [1]


def _retype(records: list[dict]) -> list[dict]:
    """A conversion transform that puts a value out of its column's range."""
    return [{**r, "u": 256} if r["u"] == 5 else r for r in records]


def test_a_value_the_source_type_cannot_hold_is_an_error_naming_column_and_records(tmp_path):
    src = _source(tmp_path, pa.table({"u": pa.array(range(10), pa.uint8())}), files=1)
    with pytest.raises(TypeError, match=r"key 'u' .*uint8.*\(in records 0\.\.9 "):
        tg.convert(src, tmp_path / "out", to="parquet", tokenize=_retype)
    assert not glob.glob(str(tmp_path / "out" / "*.parquet"))


@pytest.mark.parametrize(
    ("value", "typ"),
    [
        (256, pa.uint8()),
        (-1, pa.uint32()),
        (2**63, pa.int64()),
        (1.5, pa.int64()),  # pyarrow alone truncates it
        (2.0, pa.int16()),
        (True, pa.int8()),
        (0.1, pa.float32()),  # pyarrow alone rounds it
        (1e300, pa.float32()),
        (70000.0, pa.float16()),
        (0.1, pa.float16()),
        (np.float64(0.1), pa.float32()),
        ("a", pa.binary()),
        (b"a", pa.string()),
        (1, pa.string()),
        (b"abc", pa.binary(2)),
        (decimal.Decimal("1.2345"), pa.decimal128(9, 3)),
        (np.datetime64("2020-01-01T00:00:00.000000001"), pa.timestamp("us", tz="UTC")),
        (np.datetime64("2020-01-01T00:00:00.5"), pa.timestamp("s")),
        (np.datetime64("2020-01-01T12"), pa.date32()),
        (np.timedelta64(1, "ns"), pa.duration("us")),
        (np.array([1000], np.int16), pa.list_(pa.int8())),
        (np.array([0.1]), pa.list_(pa.float32())),
        (np.array([[1.5]]), pa.list_(pa.list_(pa.float32()))),
        ([0.5, 0.1], pa.list_(pa.float32())),  # pyarrow alone rounds these too
        ([[1e300]], pa.large_list(pa.list_(pa.float16()))),
        ({"a": 0.1}, pa.struct({"a": pa.float32()})),
        ([("k", 0.1)], pa.map_(pa.string(), pa.float32())),
    ],
)
def test_records_to_table_refuses_a_value_its_schema_type_does_not_hold(value, typ):
    with pytest.raises(TypeError, match="key 'x'"):
        records_to_table([{"x": None}, {"x": value}], pa.schema({"x": typ}))


def test_records_to_table_keeps_other_keys_inferred_and_fills_missing_columns():
    schema = pa.schema({"a": pa.uint8(), "b": pa.timestamp("ms", tz="UTC")})
    t = records_to_table([{"a": 1, "z": "s"}, {"z": None}], schema)
    assert t.schema == pa.schema({"a": pa.uint8(), "b": schema.field("b").type, "z": pa.string()})
    assert t.to_pylist() == [{"a": 1, "b": None, "z": "s"}, {"a": None, "b": None, "z": None}]


_INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16(), pa.uint64()]


@st.composite
def _typed_columns(draw):
    typ = draw(st.sampled_from([*_INT_TYPES, pa.float16(), pa.float32()]))
    n = draw(st.integers(1, 12))
    dt = numpy_dtype(typ)[0]
    if dt.kind == "f":
        bits = draw(st.lists(st.integers(0, 2 ** (8 * dt.itemsize) - 1), min_size=n, max_size=n))
        values = np.array(bits, f"u{dt.itemsize}").view(dt)  # every bit pattern: nan, inf...
    else:
        info = np.iinfo(dt)
        values = np.array(
            draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n)), dt
        )
    mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return pa.array(values, typ, mask=mask)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(column=_typed_columns(), num_shards=st.sampled_from([1, 3]))
def test_any_int_or_narrow_float_column_converts_unchanged(tmp_path_factory, column, num_shards):
    tmp = tmp_path_factory.mktemp("c")
    src = _source(tmp, pa.table({"x": column}), files=1)
    tg.convert(src, tmp / "out", to="parquet", num_shards=num_shards)
    got = pa.concat_tables(
        pq.read_table(s) for s in sorted(glob.glob(str(tmp / "out" / "*.parquet")))
    ).column("x")
    assert got.type == column.type
    # Bit for bit (nan payloads aside: Arrow's float16 reads them as Python floats).
    want, have = column.to_pylist(), got.to_pylist()
    assert all(_same(w, h) for w, h in zip(want, have)) and len(want) == len(have)


def _file_ids(out) -> dict[str, tuple[int, int]]:
    return {
        os.path.basename(p): (os.stat(p).st_ino, os.stat(p).st_mtime_ns)
        for p in glob.glob(str(out / "*.parquet"))
    }


def test_a_shard_the_last_step_rewrote_is_not_converted_again_by_a_rerun(tmp_path):
    # Shard 0 holds only None (typed null): the last step rewrites it as int64, and the
    # journal records the rewritten file, so a rerun finds every shard done.
    tg.write_array_record([{"x": None}, {"x": 1}], tmp_path / "src")
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", num_shards=2)
    before = _file_ids(tmp_path / "out")
    assert pq.read_schema(tmp_path / "out" / "data-00000-of-00002.parquet").field("x").type == (
        pa.int64()
    )
    m = tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", num_shards=2)
    assert _file_ids(tmp_path / "out") == before
    assert [r["x"] for r in tg.ParquetSource(tmp_path / "out")] == [None, 1]
    journal = tmp_path / "out" / ".torchgrain-convert"
    for info in m.shards:
        index = int(info.path.split("-")[1])
        record = json.loads((journal / f"shard-{index:05d}.json").read_text())
        assert (record["num_bytes"], record["checksum"]) == (info.num_bytes, info.checksum)
