"""A Parquet output shard's batches get one schema: a value is written with its type or
refused naming its key, records and shard, never widened or cast."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

import torchgrain as tg


def test_an_int_a_float_does_not_hold_beside_a_float_names_key_records_and_shard(tmp_path):
    records = [{"k": 2**53 + 1}] * 512 + [{"k": 1.5}]
    tg.write_array_record(records, str(tmp_path / "in"))
    with pytest.raises(TypeError, match=r"key 'k'.*records 0\.\.511.*data-00000-of-00001"):
        tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=1)


@pytest.mark.parametrize(
    "first, then, kinds",
    [
        (np.arange(3, dtype=np.int8), np.arange(3, dtype=np.int16), "list<item: int8>.*int16"),
        (np.uint8(1), np.int8(-1), "uint8 in records 0..511 but int8 in records 512..512"),
        ("a", b"b", "string in records 0..511 but binary in records 512..512"),
        (True, 1, "bool in records 0..511 but int64 in records 512..512"),
        ({"a": 1}, {"a": 1, "b": 2}, "struct<a: int64> in records 0..511 but struct<a: int64, b"),
    ],
)
@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
def test_a_key_typed_apart_in_two_batches_of_one_shard_is_refused(
    tmp_path, first, then, kinds, row_group_bytes
):
    tg.write_array_record([{"a": first}] * 512 + [{"a": then}], str(tmp_path / "in"))
    with pytest.raises(TypeError, match=rf"key 'a'.*{kinds}.*data-00000-of-00001"):
        tg.convert(
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            to="parquet",
            row_group_bytes=row_group_bytes,
        )
    assert not os.path.exists(tmp_path / "out" / "data-00000-of-00001.parquet")


@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
def test_what_two_shards_reconcile_two_batches_of_one_shard_reconcile(tmp_path, row_group_bytes):
    recs = [{"n": None, "e": [], "x": i} for i in range(512)]
    recs += [{"n": {"a": 1.5}, "e": [b"x"], "x": 2**64 - 1}]
    tg.write_array_record(recs, str(tmp_path / "in"))
    tg.convert(
        str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", row_group_bytes=row_group_bytes
    )
    schema = pq.read_schema(str(tmp_path / "out" / "data-00000-of-00001.parquet"))
    assert [str(f.type) for f in schema] == [
        "struct<a: double>",
        "list<element: binary>",
        "uint64",
    ]
    out = tg.open(str(tmp_path / "out"))
    assert out[0]["n"] is None and len(out[0]["e"]) == 0 and out[511]["x"] == 511
    assert out[512]["n"] == {"a": 1.5} and out[512]["x"] == 2**64 - 1


@pytest.mark.parametrize("num_shards, row_group_bytes", [(2, 32 << 20), (1, 1), (1, 32 << 20)])
def test_dicts_of_the_same_keys_in_another_order_convert_by_name(
    tmp_path, num_shards, row_group_bytes
):
    first = {"m": {"a": 1, "b": "x"}, "l": [{"p": 1.5, "q": b"z"}]}
    then = {"m": {"b": "y", "a": 2}, "l": [{"q": b"w", "p": 2.5}]}
    recs = [first] * 512 + [then] if num_shards == 1 else [first, then]
    tg.write_array_record(recs, str(tmp_path / "in"))
    tg.convert(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        to="parquet",
        num_shards=num_shards,
        row_group_bytes=row_group_bytes,
    )
    out = tg.open(str(tmp_path / "out"))
    last = out[len(recs) - 1]
    assert last["m"] == {"a": 2, "b": "y"} and list(last["m"]) == ["a", "b"]
    assert [(e["p"], bytes(e["q"])) for e in last["l"]] == [(2.5, b"w")]
    assert out[0]["m"] == {"a": 1, "b": "x"}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".parquet"):
            m = pq.read_schema(str(tmp_path / "out" / name)).field("m").type
            assert [f.name for f in m] == ["a", "b"]


def test_dicts_of_other_keys_in_two_batches_or_shards_are_still_refused(tmp_path):
    tg.write_array_record([{"m": {"a": 1, "b": 2}}, {"m": {"b": 3, "c": 4}}], str(tmp_path / "in"))
    with pytest.raises(tg.SchemaMismatchError, match="column 'm'"):
        tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=2)


def _late_keys_shard(path: str, n: int) -> tg.writers.ShardWriter:
    """A Parquet output shard of ``n`` row groups, key ``k{i}`` typed from the i-th on."""
    w = tg.writers.PARQUET_OUTPUT.open(
        path, compression="zstd", writer_options="", row_group_bytes=1
    )
    for b in range(n):
        for r in range(512):
            w.add({f"k{i}": (b * 512 + r if i <= b else None) for i in range(n)})
    return w


def test_a_key_typed_in_each_row_group_rewrites_each_row_group_once(tmp_path, monkeypatch):
    reads = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile,
        "read_row_group",
        lambda self, i, *a, **k: reads.append(i) or read_row_group(self, i, *a, **k),
    )
    path = str(tmp_path / "x.parquet")
    w = _late_keys_shard(path, 12)
    w.close()
    assert len(reads) == 12  # (a rewrite at each new type read 66)
    monkeypatch.undo()
    t = pq.read_table(path)
    assert pq.ParquetFile(path).num_row_groups == 12 and t.num_rows == 12 * 512
    assert t.column("k0").to_pylist() == list(range(12 * 512))
    assert t.column("k11").to_pylist() == [None] * (11 * 512) + list(range(11 * 512, 12 * 512))
    assert os.listdir(tmp_path) == ["x.parquet"]


def test_an_aborted_shard_leaves_no_file_of_its_earlier_row_groups(tmp_path):
    w = _late_keys_shard(str(tmp_path / "x.parquet"), 3)
    w.abort()
    assert [n for n in os.listdir(tmp_path) if n != "x.parquet"] == []


@pytest.mark.parametrize("statistics", [True, False])
@pytest.mark.parametrize("low", [-1, 0])
def test_an_int64_shard_beside_a_uint64_one_is_checked_for_negative_values(
    tmp_path, monkeypatch, statistics, low
):
    import pyarrow as pa

    a = pa.table({"x": pa.array([5, None, low, 7], pa.int64()), "y": [[1]] * 4})
    pq.write_table(a, str(tmp_path / "a.parquet"), row_group_size=2, write_statistics=statistics)
    pq.write_table(pa.table({"x": pa.array([2**63], pa.uint64())}), str(tmp_path / "b.parquet"))
    reads = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile,
        "read_row_group",
        lambda self, i, *a, **k: reads.append(i) or read_row_group(self, i, *a, **k),
    )
    monkeypatch.setattr(pq, "read_table", None)  # (never the whole file)
    got = tg.writers._reconciled(str(tmp_path), ["a.parquet", "b.parquet"])
    assert list(got) == ([] if low < 0 else ["a.parquet"])
    assert len(reads) == (0 if statistics else 2)


def test_a_column_named_as_a_struct_field_path_is_checked_by_its_values(tmp_path):
    import pyarrow as pa

    a = pa.table({"a.b": pa.array([-1], pa.int64()), "a": pa.array([{"b": 5}])})
    pq.write_table(a, str(tmp_path / "a.parquet"))
    pq.write_table(
        pa.table({"a.b": pa.array([2**63], pa.uint64()), "a": pa.array([{"b": 6}])}),
        str(tmp_path / "b.parquet"),
    )
    assert tg.writers._reconciled(str(tmp_path), ["a.parquet", "b.parquet"]) == {}
