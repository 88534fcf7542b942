"""Ints past int64 in Parquet output (in structs, beside strings) and in the default
collate (beside floats)."""

from __future__ import annotations

import pytest

import torchgrain as tg

BIG = 2**63 + 5


def _convert(tmp_path, records, **kw):
    import pyarrow.parquet as pq

    tg.write_array_record(records, tmp_path / "src", **kw)
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")
    files = sorted((tmp_path / "out").glob("*.parquet"))
    return [str(pq.read_schema(f).field("m").type) for f in files], pq.read_table(files)


def test_convert_to_parquet_makes_nested_struct_ints_uint64_across_shards(tmp_path):
    # list<struct<a: list<int64>, b: int64>> in one shard, a uint64 under it in the
    # other; b stays int64 (its negative kept).
    records = [{"m": [{"a": [i], "b": -i}]} for i in range(10)]
    records += [{"m": [{"a": [BIG], "b": -1}, None]} for _ in range(10)]
    kinds, table = _convert(tmp_path, records, num_shards=2)
    assert kinds == ["list<element: struct<a: list<element: uint64>, b: int64>>"] * 2
    assert table.column("m").to_pylist() == [r["m"] for r in records]


def test_convert_to_parquet_refuses_a_negative_struct_int_beside_uint64_across_shards(tmp_path):
    from torchgrain.errors import SchemaMismatchError

    records = [{"m": {"a": -1}} for _ in range(10)] + [{"m": {"a": BIG}} for _ in range(10)]
    with pytest.raises(SchemaMismatchError, match="'m'"):
        _convert(tmp_path, records, num_shards=2)


def test_convert_to_parquet_refuses_a_negative_struct_int_beside_uint64_across_batches(tmp_path):
    # -512 in records 0..511, typed struct<a: int64>; BIG in the next batch
    records = [{"m": {"a": -1 - i if i < 512 else i}} for i in range(600)] + [{"m": {"a": BIG}}]
    with pytest.raises(TypeError, match=r"key 'm'.* -512 .*records 0\.\.511"):
        _convert(tmp_path, records)


def test_convert_to_parquet_keeps_struct_ints_across_batches_with_nulls(tmp_path):
    records = [{"m": None if i % 7 else {"a": [i, None]}} for i in range(600)]
    records.append({"m": {"a": [BIG]}})
    kinds, table = _convert(tmp_path, records)
    assert kinds == ["struct<a: list<element: uint64>>"]
    assert table.column("m").to_pylist() == [r["m"] for r in records]


@pytest.mark.parametrize(
    "records",
    [[{"x": ["a", 2**63]}], [{"x": "a"}, {"x": 2**63}], [{"x": {"k": ["a", 2**63]}}]],
)
def test_parquet_output_names_an_int_past_int64_beside_a_string(records):
    from torchgrain.writers import records_to_table

    with pytest.raises(TypeError, match=r"key 'x'.*record \d holds 9223372036854775808"):
        records_to_table(records)


def test_a_record_past_msgpacks_unpack_depth_is_named_as_such():
    import msgpack

    from torchgrain.errors import RecordDecodeError
    from torchgrain.formats.codecs import MsgpackCodec

    value: object = []
    for _ in range(1023):
        value = [value]
    try:
        packed = msgpack.packb({"a": value})
    except ValueError:
        pytest.skip("this msgpack packs fewer levels than it unpacks")
    with pytest.raises(RecordDecodeError, match="undecodable msgpack record: StackError"):
        MsgpackCodec().decode(packed)
