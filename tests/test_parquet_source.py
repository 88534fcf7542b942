"""ParquetSource and BlockCache: values, layouts, schema checks, errors, caching, workers."""

from __future__ import annotations

import datetime
import decimal
import multiprocessing
import os
import pickle

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.formats.codecs import describe_value
from torchgrain.sources.block_cache import BlockCache
from torchgrain.sources.parquet import arrow_type_name, common_type, merge_types

# ------------------------------------------------------------------- helpers


def arrow_names(src):
    """The Arrow type of each key, by pyarrow's name (``src.schema`` names value types)."""
    return {f.name: arrow_type_name(f.type) for f in src.arrow_schema}


def write(path, table, row_group_size=None, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size, **kw)
    return str(path)


def simple_table(start, n):
    ids = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"row{i}" for i in ids], pa.string()),
            "vec": pa.array([[float(i), float(i) + 0.5] for i in ids], pa.list_(pa.float32())),
        }
    )


def make_sharded(tmp_path, sizes, rg=3, name="ds"):
    """Files of the given row counts (row groups of ``rg`` rows); returns (dir, table)."""
    d = tmp_path / name
    tables = []
    start = 0
    for i, n in enumerate(sizes):
        t = simple_table(start, n)
        write(str(d / f"part-{i:03d}.parquet"), t, row_group_size=rg)
        tables.append(t)
        start += n
    return str(d), pa.concat_tables(tables)


def normalize(v):
    """Our values in to_pylist form (numpy arrays to lists), for comparisons."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [normalize(x) for x in v]
    if isinstance(v, dict):
        return {k: normalize(x) for k, x in v.items()}
    return v


def corrupt_column_pages(path, column):
    """Overwrite every page of ``column`` (all row groups) with junk bytes."""
    md = pq.read_metadata(path)
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    ci = names.index(column)
    with open(path, "r+b") as f:
        for r in range(md.num_row_groups):
            c = md.row_group(r).column(ci)
            start = c.data_page_offset
            if c.has_dictionary_page and c.dictionary_page_offset:
                start = min(start, c.dictionary_page_offset)
            f.seek(start)
            f.write(b"\xff" * c.total_compressed_size)


# -------------------------------------------------------------- value types
def all_types_table():
    ts = datetime.datetime(2021, 3, 4, 5, 6, 7, 891011)
    n = 6
    rows_vec = [[1.0, 2.0], None, [], [3.5], [4.0, 5.0, 6.0], [7.0]]
    cols = {
        "i8": pa.array([1, -2, None, 4, 5, 127], pa.int8()),
        "i16": pa.array([1, 2, 3, 4, 5, -300], pa.int16()),
        "i32": pa.array([1, None, 3, 4, 5, 2**31 - 1], pa.int32()),
        "i64": pa.array([2**62, 2, 3, None, 5, -(2**63)], pa.int64()),
        "u8": pa.array([0, 255, 1, 2, 3, 4], pa.uint8()),
        "u64": pa.array([2**64 - 1, 0, None, 1, 2, 3], pa.uint64()),
        "f16": pa.array(np.array([1.5, 2, 3, 4, 5, 6], np.float16), pa.float16()),
        "f32": pa.array([1.5, None, 3.25, 4, 5, 6], pa.float32()),
        "f64": pa.array([1.5, 2.5, float("inf"), None, 5, -0.0], pa.float64()),
        "flag": pa.array([True, False, None, True, False, True]),
        "s": pa.array(["a", "", None, "ünïcödé", "x" * 100, "z"]),
        "ls": pa.array(["a", "b", "c", None, "e", "f"], pa.large_string()),
        "b": pa.array([b"\x00\x01", b"", None, b"\xff" * 10, b"q", b"r"]),
        "lb": pa.array([b"a", b"b", b"c", b"d", None, b"f"], pa.large_binary()),
        "fsb": pa.array([b"ab", b"cd", None, b"ef", b"gh", b"ij"], pa.binary(2)),
        "dec": pa.array(
            [decimal.Decimal("1.25"), None, decimal.Decimal("-3.50"), 0, 1, 2],
            pa.decimal128(6, 2),
        ),
        "d32": pa.array([datetime.date(2020, 1, i + 1) for i in range(5)] + [None], pa.date32()),
        "ts_us": pa.array([ts] * 5 + [None], pa.timestamp("us")),
        "ts_ns": pa.array([10**18 + 1, 2, 3, 4, 5, 6], pa.timestamp("ns")),
        "ts_tz": pa.array([ts] * 6, pa.timestamp("ms", tz="Europe/Paris")),
        "dur": pa.array([1, 2, None, 4, 5, 6], pa.duration("ms")),
        "t64": pa.array([datetime.time(1, 2, 3)] * 5 + [None], pa.time64("us")),
        "vec": pa.array(rows_vec, pa.list_(pa.float64())),
        "lvec": pa.array([[1, 2]] * 5 + [None], pa.large_list(pa.int16())),
        "fvec": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.float32(), 3)),
        "fvec_null": pa.array(
            [[1, 2], None, [3, 4], [5, 6], [7, 8], [9, 0]], pa.list_(pa.int32(), 2)
        ),
        "mat": pa.array(
            [[[1.0, 2.0], [3.0, 4.0]], [[1.0]], [[1.0, 2.0], [3.0]], [], None, [[5.0, 6.0, 7.0]]],
            pa.list_(pa.list_(pa.float64())),
        ),
        "fmat": pa.array(
            [[[i, i], [i, i], [i, i]] for i in range(n)],
            pa.list_(pa.list_(pa.int64(), 2), 3),
        ),
        "lnull": pa.array([[1, None], [2], None, [], [3], [4]], pa.list_(pa.int64())),
        "lstr": pa.array([["a", "b"], [], None, ["c"], ["d"], ["e"]], pa.list_(pa.string())),
        "st": pa.array(
            [{"a": 1, "b": "x"}, None, {"a": None, "b": "y"}, {"a": 3, "b": None}]
            + [{"a": 5, "b": "z"}] * 2
        ),
        "m": pa.array(
            [[("k", 1)], [], None, [("a", 2), ("b", 3)], [("c", 4)], [("d", 5)]],
            pa.map_(pa.string(), pa.int64()),
        ),
        "cat": pa.array(["red", "blue", "red", None, "green", "blue"]).dictionary_encode(),
        "nothing": pa.nulls(n),
    }
    return pa.table(cols)


def test_every_value_type_round_trips(tmp_path):
    table = all_types_table()
    path = write(str(tmp_path / "t.parquet"), table, row_group_size=4)
    src = tg.ParquetSource(path)
    assert src.keys == table.column_names
    got = src.__getitems__(list(range(len(table))))
    temporal = {"d32", "ts_us", "ts_ns", "ts_tz", "dur"}
    arrow_back = pq.read_table(path)  # what the file holds (e.g. categorical decoded)
    for name in table.column_names:
        col = arrow_back.column(name)
        ours = [r[name] for r in got]
        if name in temporal:
            for v in ours:
                assert v is None or isinstance(v, (np.datetime64, np.timedelta64)), (name, v)
            nulls = col.is_null().to_pylist()  # (to_pylist of ns timestamps needs pandas)
            as_numpy = col.to_numpy(zero_copy_only=False)
            expected = [None if null else e for null, e in zip(nulls, as_numpy)]
            assert [v is None for v in ours] == nulls, name
            for v, e in zip(ours, expected):
                assert v is None or (v == e and v.dtype == e.dtype), (name, v, e)
            continue
        expected = col.to_pylist()
        if name == "cat":
            expected = col.cast(pa.string()).to_pylist()
        if name == "f64":
            assert np.signbit(ours[5]) and ours[5] == 0.0
        assert normalize(ours) == expected, name

    by = {k: [r[k] for r in got] for k in table.column_names}
    # Scalars are plain Python values, lists of numbers are numpy arrays.
    assert all(type(v) is int for v in by["i16"])
    assert all(type(v) is float for v in by["f16"])
    assert by["flag"][2] is None and by["flag"][0] is True
    assert isinstance(by["vec"][0], np.ndarray) and by["vec"][0].dtype == np.float64
    assert by["vec"][1] is None and by["vec"][2].shape == (0,)
    assert by["fvec"][4].tolist() == [4.0, 5.0, 6.0] and by["fvec"][4].dtype == np.float32
    assert by["fvec_null"][1] is None
    assert by["mat"][0].shape == (2, 2)  # rectangular -> 2-D
    assert isinstance(by["mat"][2], list) and [a.tolist() for a in by["mat"][2]] == [[1, 2], [3]]
    assert by["mat"][4] is None
    assert by["fmat"][2].shape == (3, 2) and by["fmat"][2].dtype == np.int64
    assert by["lnull"][0] == [1, None]  # null items: a Python list
    assert by["st"][1] is None and by["st"][2] == {"a": None, "b": "y"}
    assert by["ts_ns"][0] == np.datetime64(10**18 + 1, "ns")
    assert by["ts_tz"][0] == np.datetime64("2021-03-04T05:06:07.891", "ms")  # UTC
    assert by["dec"][0] == decimal.Decimal("1.25") and by["t64"][0] == datetime.time(1, 2, 3)
    assert by["nothing"] == [None] * 6

    schema = arrow_names(src)
    assert schema["i64"] == "int64" and schema["f32"] == "float" and schema["s"] == "string"
    assert schema["b"] == "binary" and schema["vec"] == "list<double>"
    assert schema["fvec"] == "fixed_size_list<float>[3]" and schema["cat"] == "string"
    assert schema["mat"] == "list<list<double>>" and schema["st"] == "struct<a: int64, b: string>"
    assert schema["ts_tz"] == "timestamp[ms, tz=Europe/Paris]"
    # src.schema names the values handed out, in the vocabulary of every source.
    values = src.schema
    assert values["i64"] == "int" and values["f32"] == "float" and values["s"] == "str"
    assert values["b"] == "bytes" and values["vec"] == "float64[?]"
    assert values["fvec"] == "float32[3]" and values["cat"] == "str"
    assert values["mat"] == "float64[?,?]" and values["st"] == "map"
    assert values["ts_tz"] == "datetime64[ms]" and values["ts_ns"] == "datetime64[ns]"
    assert values["nothing"] == "null"
    for key, value in by.items():  # each value read agrees with its schema entry
        if value[0] is not None and not isinstance(value[0], list):
            assert describe_value(value[0]).split("[")[0] == values[key].split("[")[0], key


def test_per_item_matches_batch_and_arrays_are_private(tmp_path):
    path = write(str(tmp_path / "t.parquet"), all_types_table(), row_group_size=4)
    src = tg.ParquetSource(path)
    batch = src.__getitems__(list(range(6)))
    for i in range(6):
        assert normalize(src[i]) == normalize(batch[i])
    a = src[0]["vec"]
    a[:] = -1  # writable, and writing must not reach the cached row group
    m = src[3]["fvec"]
    m[:] = -1
    assert src[0]["vec"].tolist() == [1.0, 2.0]
    assert src[3]["fvec"].tolist() == [3.0, 4.0, 5.0]


@given(
    sizes=st.lists(st.integers(0, 25), min_size=1, max_size=4),
    rg=st.integers(1, 9),
    requests=st.lists(st.integers(0, 10_000), max_size=40),
    cache=st.sampled_from([0, 300, 1 << 20]),
)
def test_batches_match_arrow_property(tmp_path_factory, sizes, rg, requests, cache):
    base = tmp_path_factory.mktemp("prop")
    rng = np.random.default_rng(sum(sizes) * 31 + rg)
    tables = []
    for i, n in enumerate(sizes):
        vals = rng.integers(-5, 5, n)
        t = pa.table(
            {
                "k": pa.array([None if v == 0 else int(v) for v in vals], pa.int32()),
                "s": pa.array(
                    [None if v == 1 else f"s{v}" * int(abs(v)) for v in vals], pa.string()
                ),
                "v": pa.array(
                    [
                        None if v == 2 else [3.0, None] if v == 3 else [float(v)] * int(abs(v))
                        for v in vals
                    ],
                    pa.list_(pa.float64()),
                ),
            }
        )
        write(str(base / f"f{i}.parquet"), t, row_group_size=rg)
        tables.append(t)
    full = pa.concat_tables(tables)
    src = tg.ParquetSource(str(base), cache_bytes=cache)
    assert len(src) == len(full) == sum(sizes)
    if len(full) == 0:
        assert src.__getitems__([]) == []
        return
    idx = [r % len(full) for r in requests]
    expected = [full.slice(i, 1).to_pylist()[0] for i in idx]
    assert normalize(src.__getitems__(idx)) == expected
    # Again: cached row groups are now read through their converted columns.
    assert normalize(src.__getitems__(idx)) == expected
    assert [normalize(src[i]) for i in idx[:5]] == expected[:5]
    # Block-local requests (many rows of two row groups) take the per-group path.
    near = [r % min(len(full), 2 * rg) for r in requests]
    got = src.__getitems__(near)
    assert normalize(got) == [full.slice(i, 1).to_pylist()[0] for i in near]
    for rec in got:  # records are the caller's: changing them changes no later read
        rec["k"] = "changed"
        if isinstance(rec["v"], np.ndarray):
            rec["v"][:] = -7
        elif rec["v"] is not None:
            rec["v"].append(-7)
    assert normalize(src.__getitems__(near)) == [full.slice(i, 1).to_pylist()[0] for i in near]
    info = src.cache_info()
    assert info.current_bytes <= cache


# ------------------------------------------------------------------- layouts
def test_request_order_duplicates_and_shards(tmp_path):
    d, _ = make_sharded(tmp_path, [7, 0, 12, 1, 5], rg=3)
    src = tg.ParquetSource(d)
    assert len(src) == 25 and src.num_shards == 5
    assert src.index.counts.tolist() == [7, 0, 12, 1, 5]
    idx = [24, 0, 7, 7, 3, 19, 0, 24, 8]
    got = src.__getitems__(idx)
    assert [r["id"] for r in got] == idx
    assert got[2] is not got[3] and got[2]["vec"] is not got[3]["vec"]
    assert got[2]["name"] == "row7"
    assert src.__getitems__(np.array(idx, dtype=np.int32))[0]["id"] == 24
    assert src[np.int64(5)]["id"] == 5
    assert src.__getitems__([]) == []
    offs = src.block_offsets()
    assert offs.dtype == np.int64
    assert offs.tolist() == [0, 3, 6, 7, 10, 13, 16, 19, 20, 23, 25]
    assert tg.Dataset(src).block_offsets().tolist() == offs.tolist()


def test_empty_row_group_and_empty_file(tmp_path):
    d = tmp_path / "e"
    d.mkdir()
    t = simple_table(0, 5)
    with pq.ParquetWriter(str(d / "a.parquet"), t.schema) as w:
        w.write_table(t.slice(0, 2))
        w.write_table(t.slice(0, 0))
        w.write_table(t.slice(2))
    with pq.ParquetWriter(str(d / "b.parquet"), t.schema):
        pass  # no row group at all
    write(str(d / "c.parquet"), simple_table(5, 2))
    src = tg.ParquetSource(str(d))
    assert len(src) == 7 and src.num_row_groups == 4
    assert [r["id"] for r in src.__getitems__(range(7))] == list(range(7))
    assert src.block_offsets().tolist() == [0, 2, 5, 7]
    empty = tg.ParquetSource(str(d / "b.parquet"))
    assert len(empty) == 0 and empty.block_offsets().tolist() == [0]
    with pytest.raises(IndexError):
        empty[0]


def test_bad_indices(tmp_path):
    d, _ = make_sharded(tmp_path, [4, 4])
    src = tg.ParquetSource(d)
    for bad in (8, -1, 100):
        with pytest.raises(IndexError, match=str(bad)):
            src[bad]
        with pytest.raises(IndexError):
            src.__getitems__([0, bad])
    for bad in ("1", 1.0, None, True):
        with pytest.raises(TypeError):
            src[bad]
    with pytest.raises(TypeError):
        src.__getitems__([0, 1.5])
    with pytest.raises(TypeError):
        src.__getitems__([True])


def test_dir_glob_file_list_and_url(tmp_path):
    d, full = make_sharded(tmp_path, [5, 6, 4])
    files = sorted(str(p) for p in (tmp_path / "ds").iterdir())
    expected = full.to_pylist()
    for spec in (d, f"{d}/*.parquet", files, [files[0], f"{d}/part-00[12].parquet"], f"file://{d}"):
        src = tg.ParquetSource(spec)
        assert normalize(src.__getitems__(range(len(src)))) == expected, spec
    one = tg.ParquetSource(files[1])
    assert len(one) == 6 and one[0]["id"] == 5
    with pytest.raises(tg.DatasetNotFoundError):
        tg.ParquetSource(str(tmp_path / "missing"))
    with pytest.raises(tg.DatasetNotFoundError):
        tg.ParquetSource(f"{d}/*.nothing")
    with pytest.raises(tg.DatasetNotFoundError):
        tg.ParquetSource([])


def test_fsspec_memory_filesystem_with_partitions():
    fs = fsspec.filesystem("memory")
    root = "/tg-parquet-mem"
    if fs.exists(root):
        fs.rm(root, recursive=True)
    for part in (0, 1):
        t = simple_table(part * 4, 4)
        with fs.open(f"{root}/part={part}/x.parquet", "wb") as f:
            pq.write_table(t, f, row_group_size=3)
    src = tg.ParquetSource(f"memory://{root}")
    assert len(src) == 8 and src.keys == ["id", "name", "vec", "part"]
    got = src.__getitems__([7, 0, 4])
    assert [(r["id"], r["part"]) for r in got] == [(7, 1), (0, 0), (4, 1)]
    src2 = pickle.loads(pickle.dumps(src))
    assert src2[5]["name"] == "row5"
    fs.rm(root, recursive=True)


def test_hive_partitions(tmp_path):
    root = tmp_path / "hive"
    layout = [("2020", "01", "Paris"), ("2020", "02", "New%20York"), ("2021", "01", None)]
    n = 0
    for year, month, city in layout:
        c = "__HIVE_DEFAULT_PARTITION__" if city is None else city
        write(str(root / f"year={year}/month={month}/city={c}/data.parquet"), simple_table(n, 3))
        n += 3
    src = tg.ParquetSource(str(root))
    assert src.keys == ["id", "name", "vec", "year", "month", "city"]
    assert arrow_names(src)["year"] == "int64"
    assert arrow_names(src)["month"] == "string"  # "01": keeps its leading zero
    assert arrow_names(src)["city"] == "string"
    assert [src.schema[k] for k in ("year", "month", "city")] == ["int", "str", "str"]
    recs = src.__getitems__([0, 3, 8])
    assert [(r["year"], r["month"], r["city"]) for r in recs] == [
        (2020, "01", "Paris"),
        (2020, "02", "New York"),
        (2021, "01", None),
    ]
    proj = tg.ParquetSource(str(root), columns=["city", "id"])
    assert proj.keys == ["city", "id"] and proj[4] == {"city": "New York", "id": 4}
    only_part = tg.ParquetSource(str(root), columns=["year"])
    assert [r["year"] for r in only_part.__getitems__([0, 8])] == [2020, 2021]
    # A glob below the partition directories, and partitioning switched off.
    sub = tg.ParquetSource(f"{root}/year=2020/*/*/*.parquet")
    assert sub.keys == ["id", "name", "vec", "month", "city"] and len(sub) == 6
    plain = tg.ParquetSource(str(root), partitioning=None)
    assert plain.keys == ["id", "name", "vec"]
    # Inconsistent partition keys are an error, not silent None.
    write(str(root / "year=2022/data.parquet"), simple_table(0, 1))
    with pytest.raises(tg.SchemaMismatchError, match="partition keys"):
        tg.ParquetSource(str(root))


# ---------------------------------------------------------------- projection
def test_projection_reads_only_requested_columns(tmp_path):
    t = pa.table(
        {
            "small": pa.array(np.arange(40), pa.int64()),
            "big": pa.array([os.urandom(200) for _ in range(40)]),
            "other": pa.array([f"o{i}" for i in range(40)]),
        }
    )
    path = write(str(tmp_path / "p.parquet"), t, row_group_size=10, compression="NONE")
    corrupt_column_pages(path, "big")
    src = tg.ParquetSource(path, columns=["other", "small"])
    assert src.keys == ["other", "small"] and list(src.schema) == ["other", "small"]
    assert src.__getitems__([35, 0]) == [{"other": "o35", "small": 35}, {"other": "o0", "small": 0}]
    with pytest.raises(tg.CorruptDataError, match=r"p\.parquet.*record index 12"):
        tg.ParquetSource(path, columns=["big"])[12]
    with pytest.raises(ValueError, match="nope"):
        tg.ParquetSource(path, columns=["small", "nope"])
    with pytest.raises(ValueError, match="more than once"):
        tg.ParquetSource(path, columns=["small", "small"])
    with pytest.raises(TypeError):
        tg.ParquetSource(path, columns="small")


def test_open_reads_no_data_pages(tmp_path):
    t = simple_table(0, 30)
    path = write(str(tmp_path / "q.parquet"), t, row_group_size=7, compression="NONE")
    for c in ("id", "name", "vec.list.element"):
        corrupt_column_pages(path, c)
    src = tg.ParquetSource(path)  # footer only
    assert len(src) == 30 and src.num_row_groups == 5
    assert src.block_offsets().tolist() == [0, 7, 14, 21, 28, 30]
    assert arrow_names(src) == {"id": "int64", "name": "string", "vec": "list<float>"}
    assert src.schema == {"id": "int", "name": "str", "vec": "float32[?]"}
    with pytest.raises(tg.CorruptDataError, match="row group 2"):
        src[15]


# -------------------------------------------------------------------- schema
def test_schema_mismatch_names_both_files_and_column(tmp_path):
    d = tmp_path / "mm"
    write(str(d / "a.parquet"), pa.table({"x": [1, 2], "y": ["a", "b"]}))
    write(str(d / "b.parquet"), pa.table({"x": ["1", "2"], "y": ["c", "d"]}))
    with pytest.raises(tg.SchemaMismatchError) as e:
        tg.ParquetSource(str(d))
    msg = str(e.value)
    assert "'x'" in msg and "a.parquet" in msg and "b.parquet" in msg
    assert "int64" in msg and "string" in msg
    # The mismatching column is not read: no error.
    assert tg.ParquetSource(str(d), columns=["y"])[3] == {"y": "d"}


def test_type_widening(tmp_path):
    d = tmp_path / "w"
    write(
        str(d / "a.parquet"),
        pa.table({"x": pa.array([1, 2], pa.int32()), "f": pa.array([0.5, 1], pa.float32())}),
    )
    write(
        str(d / "b.parquet"),
        pa.table({"x": pa.array([2**40], pa.int64()), "f": pa.array([0.25], pa.float64())}),
    )
    src = tg.ParquetSource(str(d))
    assert arrow_names(src) == {"x": "int64", "f": "double"}
    assert src.schema == {"x": "int", "f": "float"}
    assert src.__getitems__([0, 2]) == [{"x": 1, "f": 0.5}, {"x": 2**40, "f": 0.25}]
    assert merge_types(pa.uint32(), pa.int64()) == pa.int64()
    assert merge_types(pa.uint64(), pa.int64()) is None
    assert merge_types(pa.int64(), pa.float64()) is None
    assert merge_types(pa.string(), pa.large_string()) == pa.large_string()
    assert merge_types(pa.timestamp("ms"), pa.timestamp("us")) is None
    assert merge_types(pa.null(), pa.list_(pa.int8())) == pa.list_(pa.int8())
    assert arrow_type_name(pa.map_(pa.string(), pa.int8())) == "map<string, int8>"


@pytest.mark.parametrize(
    "order", [("int16", "uint8", "int8"), ("uint8", "int8", "int16"), ("int8", "uint8", "int16")]
)
def test_widening_does_not_depend_on_file_order(tmp_path, order):
    # uint8 and int8 alone have no common type among them, but with int16 present all
    # three widen to it, whichever file comes first.
    d = tmp_path / "".join(order)
    values = {"int16": -300, "uint8": 255, "int8": -1}
    for i, t in enumerate(order):
        write(str(d / f"f{i}.parquet"), pa.table({"x": pa.array([values[t]], getattr(pa, t)())}))
    src = tg.ParquetSource(str(d))
    assert arrow_names(src) == {"x": "int16"}
    assert [r["x"] for r in src.__getitems__([0, 1, 2])] == [values[t] for t in order]
    assert common_type([pa.uint8(), pa.int8()]) is None
    assert common_type([pa.uint16(), pa.int8(), pa.int32()]) == pa.int32()
    assert common_type([pa.null(), pa.float32(), pa.float64()]) == pa.float64()
    assert common_type([pa.int8(), pa.float64()]) is None


def test_mismatch_error_gives_each_files_own_type(tmp_path):
    d = tmp_path / "m"
    for i, t in enumerate([pa.int8(), pa.int32(), pa.string()]):
        write(
            str(d / f"f{i}.parquet"),
            pa.table({"x": pa.array(["1"] if t == pa.string() else [1], t)}),
        )
    with pytest.raises(tg.SchemaMismatchError) as e:
        tg.ParquetSource(str(d))
    msg = str(e.value)
    # The string file conflicts with the first: each named with the type it holds.
    assert "int8 in" in msg and "f0.parquet" in msg and "string in" in msg and "f2.parquet" in msg


def test_missing_nullable_column_reads_none(tmp_path):
    d = tmp_path / "ev"
    write(str(d / "a.parquet"), pa.table({"x": [1, 2], "extra": ["p", None]}))
    write(str(d / "b.parquet"), pa.table({"x": [3]}))  # written before "extra" existed
    src = tg.ParquetSource(str(d))
    assert src.keys == ["x", "extra"]
    assert src.__getitems__([2, 0, 1]) == [
        {"x": 3, "extra": None},
        {"x": 1, "extra": "p"},
        {"x": 2, "extra": None},
    ]


def test_missing_required_column_is_rejected(tmp_path):
    d = tmp_path / "req"
    schema = pa.schema([pa.field("x", pa.int64()), pa.field("must", pa.int64(), nullable=False)])
    write(str(d / "a.parquet"), pa.table({"x": [1], "must": [5]}, schema=schema))
    write(str(d / "b.parquet"), pa.table({"x": [2]}))
    with pytest.raises(tg.SchemaMismatchError, match=r"'must'.*b\.parquet.*required.*a\.parquet"):
        tg.ParquetSource(str(d))
    assert len(tg.ParquetSource(str(d), columns=["x"])) == 2


# -------------------------------------------------------------------- errors
def test_corrupt_or_foreign_files_name_the_file(tmp_path):
    d, _ = make_sharded(tmp_path, [4, 4])
    bad = tmp_path / "ds" / "part-999.parquet"
    bad.write_bytes(b"this is not parquet at all, not even close")
    with pytest.raises(tg.CorruptDataError, match=r"part-999\.parquet"):
        tg.ParquetSource(d)
    empty = tmp_path / "ds" / "part-999.parquet"
    empty.write_bytes(b"")
    with pytest.raises(tg.CorruptDataError, match=r"part-999\.parquet"):
        tg.ParquetSource(d)
    good = tmp_path / "ds" / "part-000.parquet"
    data = good.read_bytes()
    bad.write_bytes(data[:-20])  # truncated footer
    with pytest.raises(tg.CorruptDataError, match=r"part-999\.parquet"):
        tg.ParquetSource(d)
    bad.write_bytes(data[: len(data) // 2] + b"\x00" * 8 + data[len(data) // 2 + 8 :])
    # Either the footer or a page fails to decode, and the error names the file.
    with pytest.raises(tg.CorruptDataError, match=r"part-999\.parquet"):
        src = tg.ParquetSource(d)
        src.__getitems__(range(len(src)))


# --------------------------------------------------------------------- cache
def test_row_group_cache_lru_and_counters():
    c = BlockCache(100)
    assert c.get_or_load("a", lambda: ("A", 40)) == "A"
    assert c.get_or_load("b", lambda: ("B", 40)) == "B"
    assert c.get("a") == "A"  # refreshes "a": "b" is now least recently used
    c.put("c", "C", 40)
    assert "b" not in c and "a" in c and "c" in c
    assert not c.put("huge", "H", 101) and "huge" not in c
    c.put("a", "A2", 10)  # replacing an entry re-charges it
    info = c.cache_info()
    assert (info.hits, info.misses, info.evictions) == (1, 2, 1)
    assert (info.current_bytes, info.entries, info.max_bytes) == (50, 2, 100)
    c2 = pickle.loads(pickle.dumps(c))
    assert len(c2) == 0 and c2.max_bytes == 100
    c.clear()
    assert c.cache_info().current_bytes == 0 and len(c) == 0
    off = BlockCache(0)
    assert off.get_or_load("a", lambda: (1, 1)) == 1 and len(off) == 0
    with pytest.raises(ValueError):
        BlockCache(-1)


def test_source_cache_bound_and_hits(tmp_path):
    t = pa.table({"x": pa.array(np.arange(100), pa.int64())})
    path = write(str(tmp_path / "c.parquet"), t, row_group_size=10)
    probe = tg.ParquetSource(path)
    probe.__getitems__(range(10))  # a whole row group read at once: cached converted
    entry = probe.cache_info().current_bytes  # what one converted row group is charged
    assert entry >= 80
    budget = 2 * entry + entry // 2
    src = tg.ParquetSource(path, cache_bytes=budget)  # room for two row groups
    src.__getitems__(range(100))
    info = src.cache_info()
    assert info.misses == 10 and info.hits == 0 and info.evictions == 8
    assert info.entries == 2 and info.current_bytes <= budget
    src.__getitems__([95, 85, 99])  # row groups 9 and 8: both cached
    info = src.cache_info()
    assert info.hits == 2 and info.misses == 10
    src.__getitems__([5, 5, 6])  # one decode for three rows of one row group
    assert src.cache_info().misses == 11
    src.close()
    assert src.cache_info().entries == 0
    # A row group is cached once, whole, whatever a read asks of it: later reads of
    # other rows are served from it and charge nothing more.
    big = write(str(tmp_path / "big.parquet"), t, row_group_size=50)
    two = tg.ParquetSource(big)
    assert two[42]["x"] == 42
    first = two.cache_info().current_bytes
    assert two.__getitems__([41, 43]) == [{"x": 41}, {"x": 43}]
    assert [r["x"] for r in two.__getitems__(range(50))] == list(range(50))
    info = two.cache_info()
    assert (info.hits, info.misses) == (2, 1) and info.current_bytes == first
    off = tg.ParquetSource(path, cache_bytes=0)
    off.__getitems__([0, 1, 2, 3])
    off.__getitems__([0])
    assert off.cache_info().misses == 2 and off.cache_info().entries == 0


# ------------------------------------------------------- workers & pickling
@pytest.mark.parametrize("files", [1, 70])
def test_concurrent_reads_from_threads(tmp_path, files):
    # Threads share the process's readers (70 files: more than are kept open, so
    # readers are evicted and closed while other threads use them).
    from concurrent.futures import ThreadPoolExecutor

    d = tmp_path / f"t{files}"
    per = 600 // files
    for f in range(files):
        ids = np.arange(f * per, (f + 1) * per)
        write(
            str(d / f"f{f:03d}.parquet"),
            pa.table({"x": ids, "s": [str(i) * 8 for i in ids]}),
            row_group_size=20,
        )
    src = tg.ParquetSource(str(d), cache_bytes=0)
    n = len(src)

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(60):
            idx = rng.integers(0, n, 8).tolist()
            recs = src.__getitems__(idx)
            assert [r["x"] for r in recs] == idx
            assert [r["s"] for r in recs] == [str(i) * 8 for i in idx]
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))
    src.close()
    assert src[5]["x"] == 5  # readers reopen after close()


def test_pickle_is_small_and_carries_no_readers(tmp_path):
    d, _ = make_sharded(tmp_path, [50] * 8, rg=5)
    src = tg.ParquetSource(d)
    before = len(pickle.dumps(src))
    src.__getitems__(range(0, 400, 3))
    after = pickle.dumps(src)
    assert len(after) == before < 8192
    clone = pickle.loads(after)
    assert clone.cache_info().entries == 0
    assert normalize(clone.__getitems__([399, 1])) == normalize(src.__getitems__([399, 1]))


def _collect(loader):
    out = []
    for b in loader:
        out.append((b["id"].tolist(), b["name"], b["vec"].tolist()))
    return out


def test_dataloader_workers_match_single_process(tmp_path):
    d, _ = make_sharded(tmp_path, [30, 17, 25], rg=4)
    src = tg.ParquetSource(d)
    ds = tg.Dataset(src)
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    base = dict(batch_size=8, sampler=order)
    ref = _collect(torch.utils.data.DataLoader(ds, num_workers=0, **base))
    src[0]  # read in the parent first: forked workers must reopen cleanly
    got = _collect(
        torch.utils.data.DataLoader(ds, num_workers=2, multiprocessing_context="fork", **base)
    )
    assert got == ref
    assert [i for ids, _, _ in ref for i in ids] == order


def test_dataloader_spawn_workers(tmp_path):
    d, _ = make_sharded(tmp_path, [9, 9], rg=4)
    ds = tg.Dataset(tg.ParquetSource(d))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=6, num_workers=1, multiprocessing_context="spawn"
    )
    assert [b["id"].tolist() for b in loader] == [list(range(i, i + 6)) for i in (0, 6, 12)]


def _child_reads(src, queue):
    info = src.cache_info()
    recs = src.__getitems__([3, 40, 3])
    queue.put((info.entries, [r["id"] for r in recs], src.cache_info().misses))


def test_fork_after_parent_reads_gets_fresh_cache(tmp_path):
    d, _ = make_sharded(tmp_path, [30, 30], rg=10)
    src = tg.ParquetSource(d)
    src.__getitems__(range(60))
    assert src.cache_info().entries == 6
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(src, q))
    p.start()
    entries, ids, misses = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert entries == 0 and ids == [3, 40, 3] and misses == 2
    assert src.cache_info().entries == 6  # the parent's cache is untouched


def test_reading_does_not_import_pandas(tmp_path):
    """Workers must not pay pandas' import (``Array.to_numpy`` would pull it in)."""
    import subprocess
    import sys

    path = write(str(tmp_path / "t.parquet"), all_types_table(), row_group_size=4)
    # One large row group: single-row reads take the partial (Arrow take) path.
    big = write(str(tmp_path / "big.parquet"), simple_table(0, 200), row_group_size=200)
    code = (
        "import sys, torchgrain as tg\n"
        f"src = tg.ParquetSource({path!r})\n"
        "src.__getitems__(range(len(src))); src.__getitems__(range(len(src)))\n"
        f"one = tg.ParquetSource({big!r}, cache_bytes=0)\n"
        "one[5]; one.__getitems__([3, 150])\n"
        "assert 'pandas' not in sys.modules, 'pandas was imported'\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ samplers
def _decodes_seen(tmp_path, sampler_kind, cache_bytes, num_workers, sampler_kw=None):
    """Max row-group decodes per DataLoader worker over one epoch, and the ids read."""
    sampling = pytest.importorskip("torchgrain.sampling")
    d, _ = make_sharded(tmp_path, [40, 25, 55], rg=10, name=f"s-{sampler_kind}-{cache_bytes}")
    src = tg.ParquetSource(d, cache_bytes=cache_bytes)

    def tag(rec):
        info = torch.utils.data.get_worker_info()
        rec["worker"] = info.id if info is not None else -1
        rec["decodes"] = src.cache_info().misses  # this process's source (forked copy)
        return rec

    ds = tg.Dataset(src).map(tag)
    if sampler_kind == "block":
        sampler = sampling.BlockShuffleSampler(
            ds, window=2, num_replicas=1, rank=0, seed=3, **(sampler_kw or {})
        )
    else:
        sampler = sampling.GlobalShuffleSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=8,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=lambda b: b,
        multiprocessing_context="fork" if num_workers else None,
    )
    recs = [r for batch in loader for r in batch]
    per_worker = {}
    for r in recs:
        per_worker[r["worker"]] = max(per_worker.get(r["worker"], 0), r["decodes"])
    return per_worker, [r["id"] for r in recs], src.num_row_groups


@pytest.mark.parametrize("num_workers", [0, 2])
def test_block_shuffle_decodes_each_row_group_once_per_worker(tmp_path, num_workers):
    per_worker, ids, num_rgs = _decodes_seen(tmp_path, "block", 1 << 20, num_workers)
    assert sorted(ids) == list(range(120)) and ids != sorted(ids)
    assert len(per_worker) == max(1, num_workers)
    assert all(n <= num_rgs for n in per_worker.values()), per_worker
    # A cache holding the window (2 row groups) plus the row groups that enter it
    # during one batch is enough for block-local order: stripes hold 5-10 rows here,
    # so a batch of 8 spans up to 3 of them, i.e. 2 + 2 row groups.
    probe = tg.ParquetSource(make_sharded(tmp_path, [40, 25, 55], rg=10, name="probe")[0])
    probe.__getitems__(range(10))  # one row group, converted
    one_group = probe.cache_info().current_bytes
    per_worker, ids, num_rgs = _decodes_seen(tmp_path, "block", 4 * one_group, 0)
    assert sorted(ids) == list(range(120))
    # Each row group once, and the one that wraps around (window - 1) once more.
    assert per_worker[-1] <= num_rgs + 1
    # A cache too small for that decodes more (the bound above is not vacuous).
    per_worker, ids, num_rgs = _decodes_seen(tmp_path, "block", one_group, 0)
    assert sorted(ids) == list(range(120)) and per_worker[-1] > num_rgs + 1


def test_block_shuffle_dealt_to_workers_splits_the_decodes(tmp_path):
    # Told the loader's batch_size and num_workers, the sampler gives each worker its
    # own part of the epoch: together the workers decode each row group about once.
    plain, _, num_rgs = _decodes_seen(tmp_path, "block", 1 << 20, 2)
    dealt, dealt_ids, _ = _decodes_seen(
        tmp_path, "block", 1 << 20, 2, {"batch_size": 8, "num_workers": 2}
    )
    assert sorted(dealt_ids) == list(range(120))
    # With window 2: the 2 row groups of the stripe where the parts meet are read by
    # both workers, and the 1 that wraps around is read at the start and at the end.
    assert sum(dealt.values()) <= num_rgs + 3, dealt
    assert sum(plain.values()) > sum(dealt.values()) + num_rgs // 2, (plain, dealt)


def test_global_shuffle_needs_the_cache(tmp_path):
    per_worker, ids, num_rgs = _decodes_seen(tmp_path, "global", 1 << 20, 0)
    assert sorted(ids) == list(range(120)) and per_worker[-1] == num_rgs
    # Without a cache, every batch decodes each row group it touches.
    per_worker, ids, num_rgs = _decodes_seen(tmp_path, "global", 0, 0)
    assert sorted(ids) == list(range(120)) and per_worker[-1] > 4 * num_rgs
