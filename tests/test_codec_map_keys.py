"""MsgpackCodec.encode refuses a record whose maps the reader could not decode."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from torchgrain.formats.codecs import MsgpackCodec


@pytest.mark.parametrize(
    ("record", "where"),
    [
        ({"meta": {1: "one", "two": 2}}, "['meta'][1]"),
        ({"a": [{"x": 1}, ({None: 2},)]}, "['a'][1][0][None]"),
        ({"a": {b"k": {"z": [1, {(1, 2): 3}]}}}, "['a'][b'k']['z'][1][(1, 2)]"),
        ({"a": collections.OrderedDict([(2.5, "x")])}, "['a'][2.5]"),
    ],
)
def test_encode_refuses_a_map_key_the_reader_cannot_decode(record, where):
    with pytest.raises(TypeError, match=r"record key .* is not str or bytes") as e:
        MsgpackCodec().encode(record)
    assert where in str(e.value)


def test_encode_keeps_str_and_bytes_keys_at_any_depth():
    c = MsgpackCodec()
    record = {"m": {"a": {b"k": [1, {"z": np.arange(2)}]}}, "t": ["x", 2.5, None]}
    back = c.decode(c.encode(record))
    assert back["m"]["a"][b"k"][1]["z"].tolist() == [0, 1] and back["t"] == ["x", 2.5, None]
