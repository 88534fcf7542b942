"""Values handed on as given, or refused naming where: ToTensor's ints past int64,
Parquet list items past int64, msgpack map keys deeper than Python's stack."""

from __future__ import annotations

import msgpack
import pytest

from torchgrain.formats.codecs import MsgpackCodec


def _nested(depth: int, bottom: object) -> object:
    for _ in range(depth):
        bottom = [bottom]
    return bottom


def test_encode_refuses_an_int_map_key_deeper_than_pythons_stack():
    # 1010 lists: past Python's default recursion limit (1000), within msgpack's 1024
    # levels, so packb takes the record; read back, the int key fails every decode.
    record = {"a": _nested(1010, {"ok": {1: "x"}})}
    with pytest.raises(TypeError, match=r"record key \['a'\]\[0\]\[0\].*\['ok'\]\[1\] is not str"):
        MsgpackCodec().encode(record)


def test_encode_keeps_str_keys_deeper_than_pythons_stack():
    c = MsgpackCodec()
    back = c.decode(c.encode({"a": _nested(1010, {"k": [1, {b"z": 2}]}), "b": 3}))
    inner = back["a"]
    for _ in range(1010):
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
    assert msgpack.packb(_nested(1010, 1))  # (1010 levels are within msgpack's)
