"""A filter pushed down to Parquet that names a list or struct column keeps what
pyarrow's own filter keeps: a row group whose one leaf is all null (only empty lists,
structs of null fields) is not a row group of null values, and is not pruned."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import torchgrain as tg


def _write(tmp_path) -> pa.Table:
    table = pa.table(
        {
            "id": list(range(6)),
            "labels": pa.array([[], [], [7], [8], None, [None]], pa.list_(pa.int64())),
            "meta": pa.array(
                [{"a": None}, {"a": None}, {"a": 1}, None, {"a": 2}, {"a": None}],
                pa.struct([("a", pa.int64())]),
            ),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    return table


EXPRESSIONS = {
    "empty lists": pc.list_value_length(pc.field("labels")) == 0,
    "list present": pc.field("labels").is_valid(),
    "list absent": pc.field("labels").is_null(),
    "struct present": pc.field("meta").is_valid(),
    "struct field null": pc.field("meta", "a").is_null(),
}


@pytest.mark.parametrize("what", sorted(EXPRESSIONS))
def test_a_pushed_down_filter_on_a_nested_column_keeps_what_pyarrow_keeps(tmp_path, what):
    table = _write(tmp_path)
    expr = EXPRESSIONS[what]
    want = table.filter(expr)["id"].to_pylist()
    src = tg.ParquetSource(tmp_path / "a.parquet", filter=expr)
    assert [src[i]["id"] for i in range(len(src))] == want
    ds = tg.Dataset(tg.ParquetSource(tmp_path / "a.parquet"))
    kept = ds.filter(expr, index_dir=tmp_path / "index", progress=False)
    assert [kept[i]["id"] for i in range(len(kept))] == want
