"""Values handed on as given, or refused naming where: ToTensor's ints past int64,
Parquet list items past int64, msgpack map keys deeper than Python's stack."""

from __future__ import annotations

import msgpack
import pytest
import torch

import torchgrain as tg
from torchgrain.formats.codecs import MsgpackCodec
from torchgrain.transforms import ToTensor


def _nested(depth: int, bottom: object) -> object:
    for _ in range(depth):
        bottom = [bottom]
    return bottom


# msgpack packs 1024 levels (1.2; 511 in 1.0): past Python's default recursion limit
# (1000), or not.
DEEP = 1010
PACKS_DEEP = True
try:
    msgpack.packb(_nested(DEEP + 2, 1))
except ValueError:
    PACKS_DEEP = False


def test_encode_refuses_an_int_map_key_deeper_than_pythons_stack():
    # Packed, the int key deeper than Python's stack fails every read.
    record = {"a": _nested(DEEP, {"ok": {1: "x"}})}
    if PACKS_DEEP:
        with pytest.raises(TypeError, match=r"record key \['a'\]\[0\]\[0\].*\['ok'\]\[1\] is not"):
            MsgpackCodec().encode(record)
    else:
        with pytest.raises(ValueError, match="recursion limit"):
            MsgpackCodec().encode(record)


@pytest.mark.skipif(not PACKS_DEEP, reason="this msgpack packs fewer levels than Python recurses")
def test_encode_keeps_str_keys_deeper_than_pythons_stack():
    c = MsgpackCodec()
    back = c.decode(c.encode({"a": _nested(DEEP, {"k": [1, {b"z": 2}]}), "b": 3}))
    inner = back["a"]
    for _ in range(DEEP):
        (inner,) = inner
    assert inner == {"k": [1, {b"z": 2}]} and back["b"] == 3


def test_encode_refuses_a_record_deeper_than_msgpack_takes():
    with pytest.raises(ValueError, match="recursion limit"):
        MsgpackCodec().encode({"a": _nested(2000, {1: "x"})})
    cyclic: list = []
    cyclic.append(cyclic)
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="recursion limit"):
        MsgpackCodec().encode({"a": cyclic})


# ------------------------------------------------------- ToTensor: ints past int64
@pytest.mark.parametrize(
    "value",
    [
        [1, 2**63 + 5],
        [[1, 2**63 + 5], [2, 3]],
        [2**63 + 5],
        2**63 + 5,
        [torch.tensor(1), 2**63 + 5],
    ],
)
def test_to_tensor_keeps_ints_past_int64_as_uint64(value):
    out = ToTensor(keys=["ids"])({"ids": value})["ids"]
    want = (
        [v.item() if isinstance(v, torch.Tensor) else v for v in value]
        if isinstance(value, list)
        else value
    )
    assert out.dtype == torch.uint64 and out.tolist() == want


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([-1, 2**63], r"9223372036854775808 \(past int64\) beside -1"),
        ([[1], [-(2**63) - 1]], r"-9223372036854775809 is past int64's and uint64's range"),
        ([2**64, 1], r"18446744073709551616 is past int64's and uint64's range"),
    ],
)
def test_to_tensor_names_the_key_of_ints_no_dtype_holds(value, why):
    with pytest.raises(TypeError, match=rf"ToTensor: key 'ids' .*{why}"):
        ToTensor(keys=["ids"])({"ids": value})


def test_pad_collate_keeps_a_row_of_ints_past_int64_alone():
    # numpy makes [2**63 + 5] its ulonglong, which torch refused
    out = tg.pad_collate([{"ids": [2**63 + 5]}], keys=["ids"])["ids"]
    assert out.dtype == torch.uint64 and out.tolist() == [[2**63 + 5]]


# ------------------------------------------- Parquet output: ints past int64 in lists
@pytest.mark.parametrize(
    ("records", "kind"),
    [
        ([{"ids": [1, 2**63]}, {"ids": None}, {"ids": []}], "list<element: uint64>"),
        ([{"ids": [[2**64 - 1], [0]]}], "list<element: list<element: uint64>>"),
        ([{"m": {"a": 2**63 + 5, "s": "x"}}, {"m": {"a": 1, "s": "y"}}], "struct<a: uint64"),
        ([{"m": [{"a": [2**63]}]}], "list<element: struct<a: list<element: uint64>>>"),
        ([{"x": 2**63}, {"x": None}], "uint64"),
    ],
)
def test_write_parquet_keeps_ints_past_int64_at_any_depth(tmp_path, records, kind):
    import pyarrow.parquet as pq

    (path,) = tg.write_parquet(records, tmp_path)
    table = pq.read_table(path)
    (key,) = table.column_names
    assert str(table.schema.field(key).type).startswith(kind)
    assert table.column(key).to_pylist() == [r[key] for r in records]


@pytest.mark.parametrize(
    ("records", "why"),
    [
        (
            [{"ids": [1]}, {"ids": [-1, 2**63]}],
            r"record 1 holds -1 and 9223372036854775808 \(past int64\) in \[\*\]: no integer",
        ),
        (
            [{"x": -1}, {"x": 2**63}],
            r"record 0 holds -1 and record 1 holds 9223372036854775808 \(past int64\): no",
        ),
        ([{"ids": [1]}, {"ids": [2**64]}], r"record 1 holds 18446744073709551616 in \[\*\], past"),
        ([{"m": {"a": [-(2**63) - 1]}}], r"record 0 holds -9223372036854775809 in \['a'\]\[\*\]"),
        ([{"ids": [0.5]}, {"ids": [2**63]}], r"record 1 holds 9223372036854775808 \(past int64\)"),
    ],
)
def test_write_parquet_names_key_and_record_of_an_int_no_type_holds(tmp_path, records, why):
    key = next(iter(records[0]))
    with pytest.raises(TypeError, match=rf"cannot store key '{key}' in Parquet: {why}"):
        tg.write_parquet(records, tmp_path)


def test_convert_to_parquet_makes_lists_of_ints_uint64_across_batches(tmp_path):
    import pyarrow.parquet as pq

    # Records are typed 512 at a time: list<int64>, then list<uint64>.
    records = [{"ids": [i]} for i in range(600)] + [{"ids": [2**63 + 5]}]
    tg.write_array_record(records, tmp_path / "src")
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")
    table = pq.read_table(next((tmp_path / "out").glob("*.parquet")))
    assert str(table.schema.field("ids").type) == "list<element: uint64>"
    assert table.column("ids").to_pylist() == [r["ids"] for r in records]
    records[0] = {"ids": [-1]}
    tg.write_array_record(records, tmp_path / "neg")
    with pytest.raises(TypeError, match=r"'ids' in Parquet: it holds -1 and ints past int64"):
        tg.convert(tmp_path / "neg", tmp_path / "out2", to="parquet")
