"""Parquet values exactly as pyarrow has them: what a ParquetSource reads, and what a
Parquet to Parquet conversion writes from it, equal the input file's values and types."""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import torchgrain as tg


def _convert_parquet(tmp_path, column: pa.Array) -> tuple[tg.ParquetSource, tg.ParquetSource]:
    """A one-column Parquet file converted to Parquet: (its source, the output's)."""
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    pq.write_table(pa.table({"v": column}), src_dir / "part.parquet")
    tg.convert(str(src_dir), str(tmp_path / "out"), to="parquet")
    return tg.ParquetSource(str(src_dir)), tg.ParquetSource(str(tmp_path / "out"))


def test_convert_keeps_empty_rows_of_a_list_of_fixed_size_lists(tmp_path):
    """Bounding boxes as list<fixed_size_list<float, 4>>: an image without boxes reads as
    an array of shape (0, 4), which the column's fixed size records; converting the file
    to Parquet keeps every row and the type, not a TypeError about a lost shape."""
    boxes = pa.array(
        [[[1, 2, 3, 4]], [], None, [[5, 6, 7, 8], [9, 10, 11, 12]]],
        pa.list_(pa.list_(pa.float32(), 4)),
    )
    src, out = _convert_parquet(tmp_path, boxes)
    assert src[1]["v"].shape == (0, 4)
    assert out.arrow_schema.equals(src.arrow_schema)
    expected = pq.read_table(src.paths[0]).column("v").to_pylist()
    got = [None if r["v"] is None else r["v"].tolist() for r in out.__getitems__(range(4))]
    assert got == expected


def test_convert_keeps_a_matrix_inside_a_struct(tmp_path):
    """A struct field list<list<float>> whose lists have one length reads as a 2-D array
    in the record's dict; converting the file to Parquet writes it back as the nested
    lists it was, not 'Can only convert 1-dimensional array values'."""
    kind = pa.struct([("m", pa.list_(pa.list_(pa.float32())))])
    column = pa.array([{"m": [[1.0, 2.0], [3.0, 4.0]]}, {"m": [[5.0, 6.0]]}, {"m": None}], kind)
    src, out = _convert_parquet(tmp_path, column)
    assert isinstance(src[0]["v"]["m"], np.ndarray) and src[0]["v"]["m"].ndim == 2
    assert out.arrow_schema.equals(src.arrow_schema)
    assert pq.read_table(out.paths[0]).column("v").to_pylist() == column.to_pylist()


def test_convert_keeps_dates_in_lists_with_null_items(tmp_path):
    """list<date32>: a row with a null item reads as a Python list, the others as
    datetime64[D] arrays; converting the file to Parquet keeps both rows' dates and the
    null, not 'int() argument must be ... not datetime.date'."""
    day = datetime.date(2020, 1, 2)
    column = pa.array(
        [[day, None], [day, day + datetime.timedelta(1)], None], pa.list_(pa.date32())
    )
    src, out = _convert_parquet(tmp_path, column)
    assert out.arrow_schema.equals(src.arrow_schema)
    assert pq.read_table(out.paths[0]).column("v").to_pylist() == column.to_pylist()


def test_files_with_dictionary_encoded_strings_inside_lists_are_read(tmp_path):
    """Dictionary-encoded values widen to their value type when files are merged, inside
    a list as at the top level: one file's list<dictionary<string>> beside another's
    list<string> reads every file's rows (as pyarrow.dataset does), not a
    SchemaMismatchError saying 'list<string> in a.parquet but list<string> in b.parquet'."""
    encoded = pa.array(["a", "b"]).dictionary_encode()
    tags = pa.ListArray.from_arrays(pa.array([0, 1, 2], pa.int32()), encoded)
    pq.write_table(pa.table({"tags": tags}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"tags": pa.array([["c"], ["d", "e"]])}), tmp_path / "b.parquet")
    src = tg.ParquetSource(str(tmp_path))
    got = [r["tags"] for r in src.__getitems__(range(len(src)))]
    assert got == [["a"], ["b"], ["c"], ["d", "e"]]
