"""tg.sources.read_column: one column of any source or dataset, read the cheapest way."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.columns import ColumnBatch, Ragged
from torchgrain.sources import read_column

N = 23


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def parquet_dir(tmp_path):
    """Two files of 3 row groups or fewer; a number, text, token lists, a large blob."""
    d = tmp_path / "pq"
    d.mkdir()
    for f, rows in enumerate((range(0, 14), range(14, N))):
        table = pa.table(
            {
                "n": [i * 10 for i in rows],
                "text": ["ab" * i for i in rows],
                "tokens": [list(range(i % 5)) for i in rows],
                "blob": [bytes(4096) for _ in rows],
            }
        )
        pq.write_table(table, d / f"part-{f}.parquet", row_group_size=5)
    return d


@pytest.fixture
def column_reads(monkeypatch):
    """The ``columns`` of every Parquet row-group read."""
    seen: list[list[str] | None] = []
    read = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kwargs):
        seen.append(None if columns is None else list(columns))
        return read(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    return seen


def _lengths(col: Ragged) -> list[int]:
    return np.asarray(col.lengths()).tolist()


def test_parquet_reads_that_column_only(parquet_dir, column_reads):
    src = tg.ParquetSource(parquet_dir, decoded_cache=False)
    got = read_column(src, "n", chunk=4)
    assert got.tolist() == [i * 10 for i in range(N)]
    # 5 row groups, each read once (chunks in increasing order), the one column alone.
    assert column_reads == [["n"]] * 5
    tokens = read_column(src, "tokens", chunk=4)
    assert isinstance(tokens, Ragged) and _lengths(tokens) == [i % 5 for i in range(N)]
    assert tokens[7].tolist() == [0, 1]
    assert all(c == ["tokens"] for c in column_reads[5:])
    # A Dataset without transforms reads through its source: the same single column.
    del column_reads[:]
    text = read_column(tg.Dataset(src), "text", chunk=1000)
    assert list(text) == ["ab" * i for i in range(N)]
    assert column_reads == [["text"]] * 5


def test_indices_in_any_order_with_repeats(parquet_dir, column_reads):
    src = tg.ParquetSource(parquet_dir, decoded_cache=False)
    ask = [22, 3, 3, 17, 0, 9]
    assert read_column(src, "n", indices=ask, chunk=2).tolist() == [i * 10 for i in ask]
    text = read_column(src, "text", indices=np.array(ask, np.uint32), chunk=2)
    assert list(text) == ["ab" * i for i in ask]
    # In reading order: the row groups holding 0, 3, 9, 17, 22, each once per column.
    assert len(column_reads) == 2 * 4
    assert read_column(src, "n", indices=[]).shape == (0,)
    with pytest.raises(IndexError, match="23"):
        read_column(src, "n", indices=[1, N])
    with pytest.raises(TypeError):
        read_column(src, "n", indices=[1.5])


def test_a_hive_partition_key_reads_no_row_group(tmp_path, column_reads):
    for lang, rows in (("de", range(3)), ("en", range(3, 5))):
        (tmp_path / f"lang={lang}").mkdir()
        pq.write_table(pa.table({"x": list(rows)}), tmp_path / f"lang={lang}" / "a.parquet")
    src = tg.ParquetSource(tmp_path, decoded_cache=False)
    assert list(read_column(src, "lang", indices=[4, 0, 3])) == ["en", "de", "en"]
    assert column_reads == []


def test_array_record_in_chunks(tmp_path):
    records = [
        {
            "x": i,
            "s": b"z" * i,
            "v": np.arange(i % 3, dtype=np.int32),
            "maybe": i if i % 4 else None,
        }
        for i in range(N)
    ]
    tg.write_array_record(records, tmp_path / "ar", num_shards=2)
    src = tg.ArrayRecordSource(tmp_path / "ar")
    x = read_column(src, "x", chunk=5)
    assert x.dtype.kind == "i" and x.tolist() == list(range(N))
    s = read_column(src, "s", chunk=5)
    assert isinstance(s, Ragged) and s.kind == "bytes" and _lengths(s) == list(range(N))
    # The last chunk holds one record (a [1, k] array): joined with the others' Ragged.
    v = read_column(src, "v", chunk=11)
    assert isinstance(v, Ragged) and v.values.dtype == np.int32
    assert _lengths(v) == [i % 3 for i in range(N)]
    # Nulls: an object array of the values, as the records hold them.
    maybe = read_column(src, "maybe", chunk=5)
    assert maybe.dtype == object and maybe.tolist() == [r["maybe"] for r in records]
    assert read_column(src, "x", indices=[20, 2]).tolist() == [20, 2]


def test_a_dataset_through_its_transforms_and_a_plain_list():
    ds = tg.Dataset([{"text": "ab" * i} for i in range(N)])
    doubled = ds.map(lambda r: {"len": 2 * len(r["text"])})
    assert read_column(doubled, "len", chunk=4).tolist() == [4 * i for i in range(N)]
    assert read_column(doubled, "len", indices=[5, 1]).tolist() == [20, 4]
    plain = [{"y": float(i)} for i in range(5)]
    assert read_column(plain, "y", chunk=2).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_an_unknown_key_names_the_keys_there_are(parquet_dir, tmp_path):
    src = tg.ParquetSource(parquet_dir, decoded_cache=False)
    with pytest.raises(KeyError, match=r"'txt'.*ParquetSource.*\['n', 'text', 'tokens', 'blob'\]"):
        read_column(src, "txt")
    tg.write_array_record([{"a": 1}], tmp_path / "ar")
    with pytest.raises(KeyError, match=r"'b'.*\['a'\]"):
        read_column(tg.ArrayRecordSource(tmp_path / "ar"), "b")
    mapped = tg.Dataset(src).map(lambda r: {"len": len(r["text"])})
    with pytest.raises(KeyError, match=r"'text'.*\['len'\]"):
        read_column(mapped, "text")
    with pytest.raises(ValueError, match="chunk"):
        read_column(src, "n", chunk=0)


def test_a_source_giving_fewer_values_than_asked_is_an_error():
    class Short(tg.Source):
        keys = ["x"]
        schema = {"x": "int64"}

        def __len__(self):
            return 4

        def __getitems__(self, indices):
            return [{"x": i} for i in indices][1:]

    with pytest.raises(tg.TorchgrainError, match=r"gave 1 values of 'x' for 2 records"):
        read_column(Short(), "x", chunk=2)


def test_a_chunk_given_as_an_object_array_keeps_its_values():
    # A source's read_columns may hold a column of mixed values as an object array.
    class Mixed(tg.Source):
        keys = ["x"]
        schema = {"x": "object"}

        def __len__(self):
            return 4

        def __getitems__(self, indices):
            return [{"x": i} for i in indices]

        def read_columns(self, indices):
            values = [None if i == 3 else i for i in indices]
            col = np.array(values) if None not in values else np.array(values, dtype=object)
            return ColumnBatch({"x": col}, num_rows=len(values))

    got = read_column(Mixed(), "x", chunk=2)
    assert got.dtype == object and got.tolist() == [0, 1, 2, None]
