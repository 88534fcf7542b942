"""Ints beside floats in a Parquet output column: one rule within a batch, across a shard's
batches and across shards. The column is double when every int is a double exactly
(|x| <= 2**53); an int past that is refused naming the key, its records or shard and the
int, wherever the batch boundaries fall."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg

BIG = 2**53 + 1  # the first int a double rounds


def _convert(tmp_path, records, **kw):
    tg.write_array_record(records, str(tmp_path / "in"))
    tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", **kw)
    return tg.open(str(tmp_path / "out"))


def _types(tmp_path, key):
    names = sorted(n for n in os.listdir(tmp_path / "out") if n.endswith(".parquet"))
    return {str(pq.read_schema(str(tmp_path / "out" / n)).field(key).type) for n in names}


@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
def test_ints_then_floats_in_later_batches_of_one_shard_are_doubles(tmp_path, row_group_bytes):
    ints = [{"score": i - 300} for i in range(512)] + [{"score": 2**53}, {"score": -(2**53)}]
    out = _convert(tmp_path, [*ints, {"score": 0.5}], row_group_bytes=row_group_bytes)
    assert _types(tmp_path, "score") == {"double"}
    got = [out[i]["score"] for i in range(len(ints) + 1)]
    assert all(isinstance(v, float) for v in got)
    assert got == [r["score"] for r in ints] + [0.5]


def test_ints_and_floats_in_two_shards_are_doubles(tmp_path):
    out = _convert(tmp_path, [{"x": 3, "l": [1, -2]}, {"x": 0.5, "l": [0.25]}], num_shards=2)
    assert _types(tmp_path, "x") == {"double"} and _types(tmp_path, "l") == {
        "list<element: double>"
    }
    assert isinstance(out[0]["x"], float) and out[0]["x"] == 3 and out[1]["x"] == 0.5
    assert list(out[0]["l"]) == [1.0, -2.0] and list(out[1]["l"]) == [0.25]


@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
def test_lists_of_ints_then_lists_of_floats_in_one_shard_are_doubles(tmp_path, row_group_bytes):
    recs = [{"l": [i, 2**53]} for i in range(512)] + [{"l": [1.5]}]
    out = _convert(tmp_path, recs, row_group_bytes=row_group_bytes)
    assert _types(tmp_path, "l") == {"list<element: double>"}
    assert list(out[7]["l"]) == [7.0, float(2**53)] and list(out[512]["l"]) == [1.5]


@pytest.mark.parametrize("value", [BIG, -BIG, 2**63 - 1])
def test_an_int_past_2_53_among_floats_in_one_batch_is_refused(tmp_path, value):
    recs = [{"k": 0.5}, {"k": 1}, {"k": value}]
    with pytest.raises(TypeError, match=rf"key 'k'.*{value}.*records 0\.\.2"):
        _convert(tmp_path, recs)


@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
@pytest.mark.parametrize("floats_first", [False, True])
def test_an_int_past_2_53_and_floats_in_two_batches_are_refused(
    tmp_path, row_group_bytes, floats_first
):
    ints = [{"k": i} for i in range(1024)]
    ints[600] = {"k": -BIG}
    ints[650] = {"k": BIG}
    floats = [{"k": 0.5}] * 512
    recs = [*floats, *ints] if floats_first else [*ints, *floats]
    at = 600 + (512 if floats_first else 0)
    with pytest.raises(
        TypeError, match=rf"key 'k'.*{-BIG}.*records {at // 512 * 512}\.\..*data-00000-of-00001"
    ):
        _convert(tmp_path, recs, row_group_bytes=row_group_bytes)
    assert not os.path.exists(tmp_path / "out" / "data-00000-of-00001.parquet")


@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
def test_a_list_holding_an_int_past_2_53_beside_lists_of_floats_is_refused(
    tmp_path, row_group_bytes
):
    recs = [{"l": [1, BIG]}] * 512 + [{"l": [0.5]}]
    with pytest.raises(TypeError, match=rf"key 'l'.*{BIG}.*records 0\.\.511"):
        _convert(tmp_path, recs, row_group_bytes=row_group_bytes)


@pytest.mark.parametrize("key, ints", [("x", [5, BIG]), ("l", [[5], [6, BIG]])])
@pytest.mark.parametrize("statistics", [True, False])
def test_an_int_past_2_53_and_floats_in_two_shards_are_refused(tmp_path, key, ints, statistics):
    floats = [0.5] if key == "x" else [[0.5]]
    pq.write_table(pa.table({key: floats}), str(tmp_path / "a.parquet"))
    pq.write_table(pa.table({key: ints}), str(tmp_path / "b.parquet"), write_statistics=statistics)
    with pytest.raises(
        tg.SchemaMismatchError, match=rf"column '{key}' .*b\.parquet.*a\.parquet.*{BIG}"
    ):
        tg.writers._reconciled(str(tmp_path), ["a.parquet", "b.parquet"])


def test_an_int_past_2_53_and_floats_in_two_shards_of_a_conversion_are_refused(tmp_path):
    with pytest.raises(tg.SchemaMismatchError, match=rf"column 'x' .*{BIG}.*nothing was published"):
        _convert(tmp_path, [{"x": 0.5}, {"x": 1}, {"x": BIG}], num_shards=2)
    assert not os.path.exists(tmp_path / "out" / ".torchgrain-convert" / "result.json")


def test_int64_shards_within_2_53_beside_a_double_one_are_checked_by_statistics(
    tmp_path, monkeypatch
):
    pq.write_table(pa.table({"x": [0.5]}), str(tmp_path / "a.parquet"))
    pq.write_table(
        pa.table({"x": [2**53, -(2**53), None]}), str(tmp_path / "b.parquet"), row_group_size=1
    )
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", None)  # (statistics only)
    got = tg.writers._reconciled(str(tmp_path), ["a.parquet", "b.parquet"])
    assert list(got) == ["b.parquet"] and str(got["b.parquet"].field("x").type) == "double"


@pytest.mark.parametrize(
    "first, then", [(True, 1), (1, True), (1, "a"), (1.5, "a"), ([1], ["a"]), (1, [1.5])]
)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_bools_text_and_lists_beside_ints_or_floats_are_still_refused(
    tmp_path, first, then, num_shards
):
    recs = [{"a": first}] * (512 if num_shards == 1 else 1) + [{"a": then}]
    with pytest.raises((TypeError, tg.SchemaMismatchError), match="'a'"):
        _convert(tmp_path, recs, num_shards=num_shards)
