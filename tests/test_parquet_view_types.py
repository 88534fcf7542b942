"""Parquet files whose Arrow schema holds string and binary views (pyarrow 16+ writes and
reads them back as views): read as str and bytes, on every read path, where Arrow has no
``take`` of a view type."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg

pytestmark = pytest.mark.skipif(not hasattr(pa, "string_view"), reason="pyarrow < 16")


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_string_and_binary_views_read_as_str_and_bytes(tmp_path, cache_bytes):
    table = pa.table(
        {
            "s": pa.array(["a", None, "ccc"], pa.string_view()),
            "b": pa.array([b"x", b"yy", None], pa.binary_view()),
            "l": pa.array([["a"], [], ["b", "c"]], pa.list_(pa.string_view())),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    src = tg.ParquetSource(str(tmp_path), cache_bytes=cache_bytes)
    assert src.schema == {"s": "str", "b": "bytes", "l": "list[str]"}
    want = table.to_pylist()
    assert [src[i] for i in range(3)] == want
    assert src.__getitems__([2, 0, 1]) == [want[2], want[0], want[1]]
    assert list(src.iter_shard(0)) == want
    cols = src.read_columns([2, 0])
    assert cols.records() == [want[2], want[0]]
    assert [type(v) for v in cols["s"]] == [str, str]
