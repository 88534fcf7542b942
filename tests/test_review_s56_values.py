"""Values that reach the user changed without an error: each test asserts the exact value
(or an error naming the key), and is a strict xfail while the change remains."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg


def _parquet_round_trip(tmp_path, values):
    """Write ``{"v": value}`` records with write_parquet and read them back (or raise)."""
    out = tmp_path / "out"
    tg.write_parquet([{"v": v} for v in values], out)
    src = tg.ParquetSource(str(out))
    return [src[i]["v"] for i in range(len(src))]


def test_pandas_timestamp_nanoseconds_in_an_inferred_column_are_kept_or_refused(tmp_path):
    """A pandas Timestamp holding nanoseconds, alone in its column (typed by inference),
    was written as ``timestamp[us]`` and read back one nanosecond earlier, with no error.
    It must read back exactly (as ``datetime64[ns]``) or be refused naming the key."""
    pd = pytest.importorskip("pandas")
    ts = pd.Timestamp("2020-01-01T00:00:00.000000001")
    try:
        got = _parquet_round_trip(tmp_path, [ts, pd.Timestamp("2020-01-02")])
    except TypeError as e:
        assert "'v'" in str(e)
        return
    assert got[0] == np.datetime64("2020-01-01T00:00:00.000000001", "ns")
    assert got[0].dtype == np.dtype("datetime64[ns]")


def test_pandas_timedelta_nanoseconds_in_an_inferred_column_are_kept_or_refused(tmp_path):
    """``pd.Timedelta(1, "ns")`` in a struct field typed by inference was written as
    ``duration[us]`` and read back as 0 with no error. It must read back as one
    nanosecond or be refused naming the key."""
    pd = pytest.importorskip("pandas")
    try:
        got = _parquet_round_trip(tmp_path, [{"d": pd.Timedelta(1, "ns")}])
    except TypeError as e:
        assert "'v'" in str(e)
        return
    assert got[0]["d"] == np.timedelta64(1, "ns")


def test_datetime64_seconds_written_to_parquet_read_back_exactly_in_milliseconds(tmp_path):
    """Parquet has no seconds unit for timestamps (pyarrow writes ``timestamp[s]`` as
    milliseconds): a ``datetime64[s]`` array written with write_parquet reads back as
    ``datetime64[ms]`` holding the same instants, as docs/conversion.md says."""
    arr = np.array(["2020-01-01T00:00:01", "1999-12-31T23:59:59"], "datetime64[s]")
    got = _parquet_round_trip(tmp_path, [arr, arr[:1]])
    assert got[0].dtype == np.dtype("datetime64[ms]")
    assert (got[0] == arr).all() and (got[1] == arr[:1]).all()


def test_a_set_is_refused_by_write_parquet(tmp_path):
    """A set has no order: write_parquet wrote it as a list in whatever order the set
    iterates (for str, one that changes with PYTHONHASHSEED), so the same data gave
    different files; write_array_record refuses it. It must be a TypeError naming the key."""
    with pytest.raises(TypeError, match="'v'"):
        tg.write_parquet([{"v": {"b", "a", "c"}}], tmp_path / "out")


def _ns_timestamps(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    stamps = pa.array([1, 2], pa.int64()).cast(pa.timestamp("ns"))
    pq.write_table(pa.table({"t": stamps, "x": [1, 2]}), str(d / "a.parquet"))
    return str(d)


def test_columns_map_after_map_batch_sees_timestamps_as_records_hold_them(tmp_path):
    """``ColumnBatch.records()`` turns a datetime64[ns] column's rows into Python ints
    (``.item()``), so a ``map`` after a ``map_batch`` got ``1`` where the record holds
    ``datetime64('...00.000000001')``, and the batch came back as an int64 column. The map
    must see what ``src[i]`` gives, and the batch keep ``datetime64[ns]``."""
    src = tg.ParquetSource(_ns_timestamps(tmp_path))
    seen = []

    def keep(record):
        seen.append(record["t"])
        return record

    ds = tg.Dataset(src, batch_format="columns").map_batch(lambda b: b).map(keep)
    batch = ds.__getitems__([0, 1])[0]
    assert [type(v) for v in seen] == [type(src[0]["t"])] * 2
    assert seen == [src[0]["t"], src[1]["t"]]
    assert batch["t"].dtype == np.dtype("datetime64[ns]")


def test_array_record_column_records_match_per_record_values(tmp_path):
    """A numpy scalar written to ArrayRecord reads back per record as a 0-d array of its
    dtype, but the column path's ``records()`` (what per-record transforms see with
    ``batch_format="columns"`` after a ``map_batch``) gave ``1`` for ``timedelta64(1, 'ns')``.
    Both paths must give the same value, and a timedelta its dtype (numbers come as Python
    numbers of the same value, as a Parquet record holds them)."""
    out = tmp_path / "ar"
    recs = [{"d": np.timedelta64(i + 1, "ns"), "h": np.float16(0.5 * i)} for i in range(2)]
    tg.write_array_record(recs, out)
    src = tg.ArrayRecordSource(str(out))
    rows = src.read_columns([0, 1]).records()
    for i, row in enumerate(rows):
        for key in ("d", "h"):
            want = src[i][key]
            assert row[key] == want, key
        assert np.asarray(row["d"]).dtype == np.dtype("timedelta64[ns]")


def test_hive_minus_zero_stays_a_string(tmp_path):
    """Hive keys are ints only when every value is a canonical decimal integer ('007' and
    '+3' stay strings), but ``x=-0`` matched ``-?(0|[1-9][0-9]*)`` and read back as ``0``:
    written back, it names another directory (``x=0``). It must stay the string '-0'."""
    for v in ("-0", "1"):
        part = tmp_path / f"x={v}"
        part.mkdir()
        pq.write_table(pa.table({"a": [1]}), str(part / "p.parquet"))
    src = tg.ParquetSource(str(tmp_path))
    assert sorted(src[i]["x"] for i in range(len(src))) == ["-0", "1"]


@pytest.mark.parametrize("nested", [False, True], ids=["top", "in-list"])
def test_a_datetime_beside_dates_is_kept_or_refused(tmp_path, nested):
    """``datetime`` is a subclass of ``date``: a column inferred from a ``date`` first
    (``date32``) took a later ``datetime(2020, 1, 1, 23, 59)`` as the date 2020-01-01,
    with no error (a column typed ``date32`` from a Parquet source refuses it, and the
    other order is refused). It must be refused naming the key, or read back exactly."""
    values = [dt.date(2020, 1, 1), dt.datetime(2020, 1, 1, 23, 59)]
    values = [values] if nested else values
    try:
        got = _parquet_round_trip(tmp_path, values)
    except TypeError as e:
        assert "'v'" in str(e)
        return
    last = got[0][1] if nested else got[1]
    assert last == np.datetime64("2020-01-01T23:59")


def test_a_time_with_a_utc_offset_is_refused_or_kept(tmp_path):
    """``time(1, 2, 3, tzinfo=+05:00)`` was written as ``time64[us]`` and read back as the
    naive ``time(1, 2, 3)``, the offset lost without an error (Parquet's time holds no
    zone; an aware datetime, by contrast, is stored as its UTC instant). It must be
    refused naming the key, or read back with its offset."""
    tz = dt.timezone(dt.timedelta(hours=5))
    try:
        got = _parquet_round_trip(tmp_path, [dt.time(1, 2, 3, tzinfo=tz)])
    except TypeError as e:
        assert "'v'" in str(e)
        return
    assert got[0].utcoffset() == dt.timedelta(hours=5)


def test_column_batch_of_datetimes_in_two_units_keeps_every_value(tmp_path):
    """``column_of`` stacked numpy scalars of one Python type with ``np.array(values)``:
    ``datetime64[ns]`` beside ``datetime64[s]`` became one ``datetime64[ns]`` array, and a
    date past 2262 wrapped around (year 3000 read 1830-11-23), no error. With
    ``batch_format="columns"``, a ``map`` returning such values reaches the batch this way.
    Every value must come out as it went in (a list, or each in its own unit)."""
    src = tg.ParquetSource(_ns_timestamps(tmp_path))
    far = np.datetime64("3000-01-01", "s")

    def later(record):
        if record["x"] == 2:
            record["t"] = far
        return record

    batch = tg.Dataset(src, batch_format="columns").map(later).__getitems__([0, 1])[0]
    # (compared in seconds: numpy compares in the finer unit, where ``far`` wraps alike)
    assert np.datetime64(batch["t"][1], "s") == far
    column = tg.columns.ColumnBatch.from_records([{"t": src[0]["t"]}, {"t": far}])["t"]
    assert np.datetime64(column[1], "s") == far
