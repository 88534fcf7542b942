"""Times of day stored as time64[ns] are read as ``datetime.time``, which holds
microseconds: a value with nanoseconds beyond them is refused (RecordDecodeError naming
the file, column and record index), on every read path and at any depth, instead of
being read as another time; whole-microsecond values read exactly."""

from __future__ import annotations

import datetime
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.errors import CorruptDataError, RecordDecodeError

NS = pa.time64("ns")
_US = 1_000
# 12 rows in row groups of 4; one value at record 9 has nanoseconds (1 ns past 10:00).
_BAD_ROW = 9
_TEN = 10 * 3600 * 1_000_000_000


def _times(n: int = 12, bad: int | None = _BAD_ROW) -> list[int]:
    values = [_TEN + i * 1_500 * _US for i in range(n)]  # whole microseconds
    if bad is not None:
        values[bad] += 1
    return values


def _write(tmp_path, table: pa.Table, **kw) -> str:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    kw.setdefault("row_group_size", 4)
    pq.write_table(table, str(d / "part-0.parquet"), **kw)
    return str(d)


def _table(bad: int | None = _BAD_ROW) -> pa.Table:
    return pa.table({"i": list(range(12)), "t": pa.array(_times(bad=bad), NS)})


def _check(err: pytest.ExceptionInfo, column: str = "t", record: int = _BAD_ROW) -> None:
    msg = str(err.value)
    assert isinstance(err.value, RecordDecodeError)
    assert isinstance(err.value, CorruptDataError) and isinstance(err.value, ValueError)
    assert "part-0.parquet" in msg
    assert f"column {column!r}" in msg
    assert f"record index {record}" in msg
    assert "time64[us]" in msg and "int64" in msg and "columns=" in msg


@pytest.mark.parametrize("cache_bytes", [0, 64 << 20])
def test_item_and_batch_reads_refuse_nanoseconds(tmp_path, cache_bytes):
    """src[i] and __getitems__ of the row group holding a sub-microsecond time64[ns]
    value raise, naming the record that holds it (it used to read as a time 1 ns off);
    the other row groups read as before."""
    src = tg.ParquetSource(_write(tmp_path, _table()), cache_bytes=cache_bytes)
    assert src[0]["t"] == datetime.time(10, 0)
    assert src[5]["t"] == datetime.time(10, 0, 0, 7_500)
    for read in (
        lambda: src[_BAD_ROW],
        lambda: src[8],  # same row group: named by the offending record
        lambda: src.__getitems__([1, 10]),
    ):
        with pytest.raises(RecordDecodeError) as err:
            read()
        _check(err)


@pytest.mark.parametrize("cache_bytes", [0, 64 << 20])
def test_read_columns_refuses_nanoseconds(tmp_path, cache_bytes):
    src = tg.ParquetSource(_write(tmp_path, _table()), cache_bytes=cache_bytes)
    assert src.read_columns([2, 3])["t"][1] == datetime.time(10, 0, 0, 4_500)
    with pytest.raises(RecordDecodeError) as err:
        src.read_columns([11, 0])
    _check(err)


def test_iter_shard_refuses_nanoseconds(tmp_path):
    src = tg.ParquetSource(_write(tmp_path, _table()))
    it = src.iter_shard(0)
    assert [next(it)["i"] for _ in range(8)] == list(range(8))
    with pytest.raises(RecordDecodeError) as err:
        next(it)
    _check(err)


def test_decoded_disk_cache_refuses_nanoseconds(tmp_path):
    """The row group is refused before it is stored in the decoded disk cache, and
    again on every read."""
    cache = tmp_path / "decoded"
    src = tg.ParquetSource(_write(tmp_path, _table()), decoded_cache=str(cache))
    for _ in range(2):
        with pytest.raises(RecordDecodeError) as err:
            src[_BAD_ROW]
        _check(err)
    assert src[3]["t"] == datetime.time(10, 0, 0, 4_500)


def test_decoded_disk_cache_entry_stored_unchecked_is_refused(tmp_path, monkeypatch):
    """A row group the decoded disk cache already holds unchecked (stored by a version
    of torchgrain without the check) is refused when mapped, not read truncated."""
    from torchgrain.sources.parquet.loading import RowGroupLoader

    d, cache = _write(tmp_path, _table()), str(tmp_path / "decoded")
    with monkeypatch.context() as m:
        m.setattr(RowGroupLoader, "_check_times", lambda self, table, group: None)
        src = tg.ParquetSource(d, decoded_cache=cache, cache_bytes=0)
        # (another record of the bad one's row group: stored whole, read without its
        # value, which older pyarrow refuses to convert while newer truncates it)
        assert src[8]["t"] == datetime.time(10, 0, 0, 12_000)
        assert src.io_stats["decoded_builds"] >= 1
    again = tg.ParquetSource(d, decoded_cache=cache, cache_bytes=0)
    with pytest.raises(RecordDecodeError) as err:
        again[8]
    _check(err)
    assert again.io_stats["decoded_hits"] >= 1


def test_value_in_a_later_page_of_a_large_row_group(tmp_path):
    """Many small pages in one row group: the record named is the one that holds the
    value, wherever its page lies."""
    n, bad = 5_000, 4_321
    table = pa.table({"t": pa.array(_times(n, bad), NS)})
    d = _write(tmp_path, table, row_group_size=n, data_page_size=512, use_dictionary=False)
    assert pq.ParquetFile(os.path.join(d, "part-0.parquet")).metadata.num_row_groups == 1
    src = tg.ParquetSource(d)
    with pytest.raises(RecordDecodeError) as err:
        src[0]
    _check(err, record=bad)


def _nested(kind: str, values: list[int]) -> pa.Array:
    n = len(values)
    if kind == "list":
        return pa.array([[values[i], values[i]] for i in range(n)], pa.list_(NS))
    if kind == "large_list":
        return pa.array([[values[i]] for i in range(n)], pa.large_list(NS))
    if kind == "fixed_size_list":
        return pa.array([[values[i], _TEN] for i in range(n)], pa.list_(NS, 2))
    if kind == "struct":
        return pa.array(
            [{"a": i, "t": values[i]} for i in range(n)], pa.struct({"a": pa.int64(), "t": NS})
        )
    if kind == "map":
        return pa.array([[("k", values[i])] for i in range(n)], pa.map_(pa.string(), NS))
    if kind == "map_key":
        return pa.array([[(values[i], 1)] for i in range(n)], pa.map_(NS, pa.int64()))
    if kind == "list_of_structs":
        t = pa.list_(pa.struct({"t": NS}))
        return pa.array([[{"t": _TEN}] * (i % 3) + [{"t": values[i]}] for i in range(n)], t)
    raise AssertionError(kind)


_KINDS = ["list", "large_list", "fixed_size_list", "struct", "map", "map_key", "list_of_structs"]


@pytest.mark.parametrize("kind", _KINDS)
def test_nested_values_refused(tmp_path, kind):
    """A sub-microsecond time64[ns] value inside a list, a struct, a map (its value or
    its key) or a list of structs is refused too, naming the top-level column and the
    record."""
    values = _times()
    values[3] += 1  # (and record 9 in another row group)
    nested = _nested(kind, _times(bad=None))
    table = pa.table({"i": list(range(12)), "n": _nested(kind, values)})
    src = tg.ParquetSource(_write(tmp_path, table))
    with pytest.raises(RecordDecodeError) as err:
        src[2]
    _check(err, column="n", record=3)
    with pytest.raises(RecordDecodeError):
        src.read_columns([0])
    assert src[4]["i"] == 4
    # Whole microseconds read as datetime.time, as before.
    pq.write_table(pa.table({"i": list(range(12)), "n": nested}), str(tmp_path / "ok.parquet"))
    ok = tg.ParquetSource(str(tmp_path / "ok.parquet"))
    assert ok[1]["n"] == nested.to_pylist()[1]
    assert ok.read_columns([1])["n"][0] == ok[1]["n"]


def test_nulls_and_whole_microseconds_read_exactly(tmp_path):
    """Whole-microsecond time64[ns] values (and nulls) read as datetime.time exactly."""
    values = [_TEN, None, 86_399_999_999_000, 0, 1_000]
    table = pa.table({"t": pa.array(values, NS)})
    pq.write_table(table, str(tmp_path / "a.parquet"))
    src = tg.ParquetSource(str(tmp_path / "a.parquet"))
    got = [src[i]["t"] for i in range(len(values))]
    assert got == [
        datetime.time(10),
        None,
        datetime.time(23, 59, 59, 999_999),
        datetime.time(0),
        datetime.time(0, 0, 0, 1),
    ]
    assert list(src.read_columns(range(5))["t"]) == got
    assert list(src.iter_shard(0)) == [{"t": v} for v in got]


def test_columns_leaving_the_time_column_out_read(tmp_path):
    """The fix the message suggests: a projection without the column reads the rest."""
    src = tg.ParquetSource(_write(tmp_path, _table()), columns=["i"])
    assert src[_BAD_ROW] == {"i": _BAD_ROW}


def test_convert_refuses_nanoseconds(tmp_path):
    """Converting Parquet to Parquet refuses such a value with the same error (it used
    to write the time truncated) and leaves no output shard."""
    d = _write(tmp_path, _table())
    with pytest.raises(RecordDecodeError) as err:
        tg.convert(d, tmp_path / "out", to="parquet")
    _check(err)
    out = tmp_path / "out"
    assert not out.exists() or not any(p.suffix == ".parquet" for p in out.iterdir())


def test_convert_whole_microseconds(tmp_path):
    """Whole-microsecond time64[ns] values convert exactly, into a column of the input's
    type (time64[ns])."""
    d = _write(tmp_path, _table(bad=None))
    tg.convert(d, tmp_path / "out", to="parquet")
    out = tg.ParquetSource(str(tmp_path / "out"))
    assert out.arrow_schema.field("t").type == NS
    src = tg.ParquetSource(d)
    assert [out[i]["t"] for i in range(12)] == [src[i]["t"] for i in range(12)]
    assert [out[i]["t"] for i in range(12)] == pa.array(_times(bad=None), NS).to_pylist()
    assert pq.read_table(str(tmp_path / "out")).column("t").combine_chunks() == pa.array(
        _times(bad=None), NS
    )
