"""Parquet files as an attacker (or a careless job) leaves them: a file rewritten
between the source's opening and its reads, and pages whose headers understate what
Arrow allocates. Each must give the right values or a CorruptDataError naming the
file, never other values, a bare Arrow/KeyError, or more memory than
``max_row_group_bytes`` allows."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.errors import CorruptDataError

MiB = 1 << 20


def _rewrite_in_place(path, table: pa.Table) -> None:
    """Write ``table`` over ``path`` through the same inode (``cp``, ``rsync --inplace``)."""
    tmp = f"{path}.new"
    pq.write_table(table, tmp, row_group_size=4)
    with open(tmp, "rb") as f:
        data = f.read()
    os.unlink(tmp)
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def test_a_shard_rewritten_in_place_after_a_read_is_refused_not_read_by_the_old_footer(
    tmp_path,
):
    # The reader opened by the first read keeps the old footer; the rewritten file has
    # the same layout with its two columns swapped, so the old footer's offsets find the
    # other column's pages: x read 0..7 from the new y, y read "b" from the new x.
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": list(range(8)), "y": ["a"] * 8}), path, row_group_size=4)
    src = tg.ParquetSource(str(tmp_path), decoded_cache=False, cache_bytes=0)
    assert src[0] == {"x": 0, "y": "a"}
    _rewrite_in_place(path, pa.table({"y": list(range(8)), "x": ["b"] * 8}))
    for read in (lambda: src.__getitems__([1, 5]), lambda: src.read_columns([1, 5])):
        with pytest.raises(CorruptDataError, match=r"a\.parquet.*changed since the dataset"):
            read()


def test_a_shard_replaced_before_its_first_read_is_refused_naming_it(tmp_path):
    # Opened with columns x and y; replaced (a rename over it) by a file without x
    # before any read: a bare KeyError ('Field "x" does not exist in schema'), or, with
    # x a string column now, its strings cast silently to the old type.
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": list(range(8)), "y": ["a"] * 8}), path, row_group_size=4)
    for new in (
        pa.table({"y": ["b"] * 8}),
        pa.table({"x": [str(10 * i) for i in range(8)], "y": ["b"] * 8}),
    ):
        src = tg.ParquetSource(str(tmp_path), decoded_cache=False, cache_bytes=0)
        pq.write_table(new, f"{path}.tmp", row_group_size=4)
        os.replace(f"{path}.tmp", path)
        with pytest.raises(CorruptDataError, match=r"a\.parquet.*changed since the dataset"):
            src.__getitems__([0, 5])
        pq.write_table(pa.table({"x": list(range(8)), "y": ["a"] * 8}), path, row_group_size=4)


def test_a_dictionary_entry_repeated_past_the_ceiling_is_refused(tmp_path):
    n = 4096  # rows, each the dictionary's one 16 KiB entry: 64 MiB decoded
    indices = pa.array(np.zeros(n, np.int32))
    column = pa.DictionaryArray.from_arrays(indices, pa.array(["x" * (16 << 10)]))
    # Without the stored Arrow schema the column reads as plain strings (as any
    # non-Arrow writer's would).
    pq.write_table(
        pa.table({"s": column}), tmp_path / "a.parquet", store_schema=False, compression="zstd"
    )
    assert os.path.getsize(tmp_path / "a.parquet") < 4096
    src = tg.ParquetSource(
        str(tmp_path), max_row_group_bytes=MiB, decoded_cache=False, cache_bytes=0
    )
    with pytest.raises(CorruptDataError, match=r"a\.parquet.*max_row_group_bytes"):
        src[0]


def test_short_strings_beside_one_long_dictionary_entry_still_read(tmp_path):
    # Their longest entry times their count (6.4 GB) is past the ceiling, what they
    # decode to (164 KiB, and 400 KiB of offsets) is not: counted, not bounded.
    n = 100_000
    rows = ["ab"[i % 2] for i in range(n)]
    rows[7] = "x" * (64 << 10)
    pq.write_table(pa.table({"s": rows}), tmp_path / "a.parquet", store_schema=False)
    assert (
        pq.ParquetFile(tmp_path / "a.parquet").metadata.row_group(0).column(0).has_dictionary_page
    )
    src = tg.ParquetSource(
        str(tmp_path), max_row_group_bytes=MiB, decoded_cache=False, cache_bytes=0
    )
    got = src.__getitems__([0, 7, n - 1])
    assert [r["s"] for r in got] == ["a", rows[7], "b"]


def test_rle_booleans_past_the_ceiling_are_refused(tmp_path):
    # 2**22 booleans run-length encoded take a few KiB in the file and 512 KiB decoded
    # (1 MiB with their validity, 8 MiB of definition levels while Arrow decodes them): a
    # boolean counted as 0 bytes never reached the ceiling.
    n = 1 << 22
    pq.write_table(
        pa.table({"b": pa.array(np.ones(n, bool))}),
        tmp_path / "a.parquet",
        use_dictionary=False,
        column_encoding={"b": "RLE"},
        data_page_version="2.0",
        compression="zstd",
        row_group_size=n,
    )
    assert os.path.getsize(tmp_path / "a.parquet") < 64 << 10
    src = tg.ParquetSource(
        str(tmp_path), max_row_group_bytes=64 << 10, decoded_cache=False, cache_bytes=0
    )
    with pytest.raises(CorruptDataError, match=r"a\.parquet.*max_row_group_bytes"):
        src[0]
    # An honest ceiling reads them (a row counts a byte at least).
    src = tg.ParquetSource(str(tmp_path), max_row_group_bytes=n, decoded_cache=False)
    assert src[n - 1] == {"b": True}


def test_int96_timestamps_outside_the_nanosecond_range_are_not_other_dates(tmp_path):
    # Spark writes timestamps as INT96 by default; 9999-12-31 is a common "no end" date.
    days = [datetime.datetime(3000, 1, 1), datetime.datetime(2000, 1, 1)]
    table = pa.table({"ts": pa.array(days, pa.timestamp("us"))})
    pq.write_table(
        table, tmp_path / "a.parquet", use_deprecated_int96_timestamps=True, store_schema=False
    )
    src = tg.ParquetSource(str(tmp_path), decoded_cache=False)
    try:
        got = [r["ts"] for r in src.__getitems__([0, 1])]
    except CorruptDataError as e:  # refusing them, naming the file, is right too
        assert "a.parquet" in str(e)
        return
    # (compared as text: numpy compares a year-3000 datetime64[us] to nanoseconds by
    # wrapping it too; the year 3000 reads as 1830-11-23)
    assert [str(t.astype("datetime64[s]")) for t in got] == [d.isoformat() for d in days]


def _int96_file(directory, days) -> None:
    table = pa.table({"ts": pa.array(days, pa.timestamp("us"))})
    pq.write_table(table, directory / "a.parquet", use_deprecated_int96_timestamps=True)


def _ts_text(batch) -> list[str]:
    """A batch's timestamps as text: records, columns, or a list of those (numpy compares
    a datetime64[us] beyond 2262 to nanoseconds by wrapping it)."""
    parts = batch if isinstance(batch, list) else [batch]
    return [str(np.datetime64(v, "s")) for p in parts for v in np.atleast_1d(p["ts"])]


def test_int96_timestamps_beyond_2262_read_exactly_at_another_unit(tmp_path):
    import pickle

    import torch

    _int96_file(tmp_path, [datetime.datetime(9999, 12, 31), datetime.datetime(1970, 1, 1)])
    want = ["9999-12-31T00:00:00", "1970-01-01T00:00:00"]
    with pytest.raises(CorruptDataError, match=r'a\.parquet.*int96_timestamp_unit="us" reads'):
        tg.ParquetSource(str(tmp_path), decoded_cache=False)[0]
    with pytest.raises(ValueError, match="int96_timestamp_unit"):
        tg.ParquetSource(str(tmp_path), int96_timestamp_unit="ps")
    src = tg.ParquetSource(str(tmp_path), decoded_cache=False, int96_timestamp_unit="us")
    assert src.arrow_schema.field("ts").type == pa.timestamp("us")
    assert src.schema == {"ts": "datetime64[us]"}
    assert _ts_text(src.__getitems__([0, 1])) == want
    assert _ts_text(src.read_columns([0, 1])) == want
    # What a spawned worker gets; tg.open passes the option on.
    assert _ts_text(pickle.loads(pickle.dumps(src)).read_columns([0, 1])) == want
    assert _ts_text(tg.open(str(tmp_path), int96_timestamp_unit="us").__getitems__([0, 1])) == want
    for batch_format in ("records", "columns"):
        ds = tg.Dataset(src, batch_format=batch_format)
        for workers in (0, 2):
            loader = torch.utils.data.DataLoader(
                ds, batch_size=1, num_workers=workers, collate_fn=_ts_text
            )
            assert [t for b in loader for t in b] == want, (batch_format, workers)


def test_int96_timestamps_past_the_microsecond_range_are_refused_at_us(tmp_path):
    # Hostile bytes: the year 300,000 wraps an int64 of microseconds too.
    ms = int(np.datetime64("300000-01-01", "ms").astype(np.int64))
    table = pa.table({"ts": pa.array([ms, 0], pa.int64()).cast(pa.timestamp("ms"))})
    pq.write_table(table, tmp_path / "a.parquet", use_deprecated_int96_timestamps=True)
    src = tg.ParquetSource(str(tmp_path), decoded_cache=False, int96_timestamp_unit="us")
    with pytest.raises(CorruptDataError, match=r'a\.parquet.*int96_timestamp_unit="ms" reads'):
        src[0]
    src = tg.ParquetSource(str(tmp_path), decoded_cache=False, int96_timestamp_unit="ms")
    assert src[0]["ts"] == np.datetime64("300000-01-01", "ms")


def test_a_decoded_cache_never_serves_a_table_of_another_int96_unit(tmp_path):
    _int96_file(tmp_path, [datetime.datetime(2000, 1, 1), datetime.datetime(1970, 1, 1)])
    from torchgrain.sources.parquet.decoded_cache import DecodedCache

    # Each read goes to the disk cache (no memory cache): built once per unit, then hit.
    cache = DecodedCache(tmp_path / "cache", min_free_bytes=0)
    path = str(tmp_path / "a.parquet")
    ns = tg.ParquetSource(path, decoded_cache=cache, cache_bytes=0)
    us = tg.ParquetSource(path, decoded_cache=cache, cache_bytes=0, int96_timestamp_unit="us")
    for src, unit in [(ns, "ns"), (us, "us"), (ns, "ns"), (us, "us")]:
        got = src.read_columns([0, 1])["ts"]
        assert got.dtype == np.dtype(f"datetime64[{unit}]")
        assert got.astype("datetime64[s]").tolist() == [
            datetime.datetime(2000, 1, 1),
            datetime.datetime(1970, 1, 1),
        ]
    assert (cache.stats["builds"], cache.stats["hits"]) == (2, 2)


_CLAIM_CHILD = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
warnings.simplefilter("ignore")
import torchgrain as tg
for path in sys.argv[1:]:
    try:
        tg.ParquetSource(path, decoded_cache=False)[0]
        print("read")
    except Exception as e:
        print(type(e).__name__, str(e).replace("\\n", " "))
"""


def test_a_footer_claiming_billions_of_boolean_or_null_rows_is_refused(tmp_path):
    import fuzz

    paths = []
    for name, column in (("bools", [True, None, False, True, True]), ("nulls", [None] * 5)):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"b": column}), sink)
        paths.append(tmp_path / f"{name}.parquet")
        paths[-1].write_bytes(fuzz.claim_rows(sink.getvalue().to_pybytes(), 5, 1 << 40))
        assert pq.ParquetFile(paths[-1]).metadata.num_rows == 1 << 40
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    out = subprocess.run(
        [sys.executable, "-c", _CLAIM_CHILD, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for path, line in zip(paths, lines):
        assert line.startswith("CorruptDataError") and path.name in line, line
        assert "max_row_group_bytes" in line, line


def test_a_struct_with_a_field_name_twice_is_refused_not_read_as_one(tmp_path):
    fields = [pa.field("a", pa.int64()), pa.field("a", pa.string())]
    twice = pa.StructArray.from_arrays([pa.array([1, 2]), pa.array(["x", "y"])], fields=fields)
    inner = pa.struct([pa.field("b", pa.int8()), pa.field("b", pa.int8())])
    listed = pa.array([[{"b": 1}], []], pa.list_(inner))
    columns = {"s": twice, "l": listed, "i": [1, 2]}
    pq.write_table(pa.table(columns), tmp_path / "a.parquet")
    for name in ("s", "l"):
        with pytest.raises(tg.SchemaMismatchError, match=rf"a\.parquet.*{name}"):
            tg.ParquetSource(str(tmp_path), columns=[name])
    assert tg.ParquetSource(str(tmp_path), columns=["i"])[1] == {"i": 2}  # others open


def test_an_empty_list_of_fixed_size_lists_keeps_their_size(tmp_path):
    rows = [[[1.0, 2.0, 3.0]], [], [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]]
    column = pa.array(rows, pa.list_(pa.list_(pa.float32(), 3)))
    pq.write_table(pa.table({"v": column}), tmp_path / "a.parquet")
    src = tg.ParquetSource(str(tmp_path), decoded_cache=False)
    assert src.schema == {"v": "float32[?,3]"}
    got = [r["v"] for r in src.__getitems__([0, 1, 2])]
    assert [v.shape for v in got] == [(1, 3), (0, 3), (2, 3)]
    assert [np.asarray(v).shape for v in src.read_columns([1, 1])["v"]] == [(0, 3), (0, 3)]
