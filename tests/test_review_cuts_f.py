"""Behaviour the line cuts and the int64 fixes left: each strict xfail asserts what
should hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.transforms import ToTensor

BIG = 2**63 + 5


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda v: {"a": v}, "struct<a: uint64>"),
        (lambda v: {"a": [v]}, "struct<a: list<element: uint64>>"),
        (lambda v: [{"a": v}], "list<element: struct<a: uint64>>"),
    ],
)
def test_convert_to_parquet_makes_dict_ints_uint64_across_batches(tmp_path, make, kind):
    import pyarrow.parquet as pq

    # Records are typed 512 at a time: struct<a: int64>, then struct<a: uint64>.
    records = [{"m": make(i)} for i in range(600)] + [{"m": make(BIG)}]
    tg.write_array_record(records, tmp_path / "src")
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")
    table = pq.read_table(next((tmp_path / "out").glob("*.parquet")))
    assert str(table.schema.field("m").type) == kind
    assert table.column("m").to_pylist() == [r["m"] for r in records]


def test_convert_to_parquet_makes_dict_ints_uint64_across_shards(tmp_path):
    import pyarrow.parquet as pq

    records = [{"m": {"a": i}} for i in range(10)] + [{"m": {"a": BIG}} for _ in range(10)]
    tg.write_array_record(records, tmp_path / "src", num_shards=2)
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")
    files = sorted((tmp_path / "out").glob("*.parquet"))
    assert [str(pq.read_schema(f).field("m").type) for f in files] == ["struct<a: uint64>"] * 2
    assert pq.read_table(files).column("m").to_pylist() == [r["m"] for r in records]


# ToTensor and pad_collate: numpy's unsigned ints narrower than 64 bits
@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ([np.uint8(1)] * 8, "uint8"),
        ([np.uint32(1), np.uint32(2)], "uint32"),
        ([[np.uint8(3)] * 8, [np.uint8(4)] * 8], "uint8"),
        (np.uint16(9), "uint16"),
        # a list of uint8 images 8 pixels wide: (3, 2, 8) uint8 read as (3, 2, 1) uint64
        ([np.arange(16, dtype=np.uint8).reshape(2, 8)] * 3, "uint8"),
    ],
)
def test_to_tensor_keeps_narrow_unsigned_numpy_ints_as_they_are(value, dtype):
    out = ToTensor(keys=["ids"])({"ids": value})["ids"]
    assert out.dtype == getattr(torch, dtype)
    assert out.tolist() == np.asarray(value).tolist()


def test_pad_collate_keeps_a_row_of_narrow_unsigned_numpy_ints():
    rows = [{"ids": [np.uint8(1)] * 8}, {"ids": [np.uint8(2)] * 3}]
    out = tg.pad_collate(rows, keys=["ids"])["ids"]
    assert out.tolist() == [[1] * 8, [2, 2, 2, 0, 0, 0, 0, 0]]


# MsgpackCodec: a record msgpack packs but cannot unpack
def _packs_deep() -> bool:
    import msgpack

    value: object = 1
    for _ in range(1012):
        value = [value]
    try:
        msgpack.packb(value)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(not _packs_deep(), reason="this msgpack packs fewer levels than it unpacks")
@pytest.mark.parametrize("bottom", [[], {}])
def test_encode_writes_no_record_that_every_read_refuses(bottom):
    from torchgrain.formats.codecs import MsgpackCodec

    value: object = bottom
    for _ in range(1023):
        value = [value]
    codec = MsgpackCodec()
    try:
        packed = codec.encode({"a": value})
    except ValueError:
        return  # refused when written, as a record deeper than msgpack takes is
    back = codec.decode(packed)["a"]
    for _ in range(1023):
        (back,) = back
    assert back == bottom


@pytest.mark.skipif(not _packs_deep(), reason="this msgpack packs fewer levels than it unpacks")
def test_encode_writes_no_unreadable_record_under_a_raised_recursion_limit():
    import sys

    from torchgrain.formats.codecs import MsgpackCodec

    value: object = []
    for _ in range(1023):
        value = [value]
    codec = MsgpackCodec()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        packed = codec.encode({"a": value})
    except ValueError:
        return  # refused when written
    finally:
        sys.setrecursionlimit(limit)
    back = codec.decode(packed)["a"]
    for _ in range(1023):
        (back,) = back
    assert back == []
