"""tf.train.Example wire format: checked both ways against the protobuf library."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from torchgrain.errors import RecordDecodeError
from torchgrain.formats.tf_example import TFExampleCodec, decode_tf_example, encode_tf_example

pb = pytest.importorskip("google.protobuf")
from _example_proto import Example, to_python  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402
from google.protobuf.unknown_fields import UnknownFieldSet  # noqa: E402

INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT32 = st.floats(width=32, allow_nan=False)
names = st.text(max_size=12)
values = st.one_of(
    st.lists(st.binary(max_size=20), max_size=4),
    st.lists(INT64, min_size=1, max_size=30).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(FLOAT32, max_size=30).map(lambda v: np.array(v, dtype=np.float32)),
    # Long lists exercise the vectorised varint decoder.
    st.lists(INT64, min_size=40, max_size=200).map(lambda v: np.array(v, dtype=np.int64)),
)
features = st.dictionaries(names, values, max_size=8)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype, (k, g, w)
            np.testing.assert_array_equal(g, w)
            assert g.flags.writeable
        else:
            assert g == w, k


def to_proto(feats: dict) -> Example:
    ex = Example()
    ex.features.SetInParent()
    for k, v in feats.items():
        f = ex.features.feature[k]
        if isinstance(v, np.ndarray) and v.dtype == np.int64:
            f.int64_list.value.extend(v.tolist())
            f.int64_list.SetInParent()
        elif isinstance(v, np.ndarray):
            f.float_list.value.extend(v.tolist())
            f.float_list.SetInParent()
        else:
            f.bytes_list.value.extend(v)
            f.bytes_list.SetInParent()
    return ex


@settings(max_examples=300, deadline=None)
@given(features)
def test_encoding_matches_protobuf(feats):
    ours = encode_tf_example(feats)
    # Byte for byte, one feature at a time (protobuf orders map entries its own way).
    for k, v in feats.items():
        assert encode_tf_example({k: v}) == to_proto({k: v}).SerializeToString()
    assert_same(to_python(Example.FromString(ours)), feats)


@settings(max_examples=300, deadline=None)
@given(features)
def test_decoding_matches_protobuf(feats):
    data = to_proto(feats).SerializeToString()
    assert_same(decode_tf_example(data), feats)
    assert_same(decode_tf_example(memoryview(bytearray(data))), feats)


def _protobuf_parse(data: bytes):
    try:
        return to_python(Example.FromString(data))
    except DecodeError:
        return None


def _upb_dropped_map_entry(data: bytes) -> bool:
    """True when the protobuf library set a map entry aside for holding unknown fields.

    upb (the protobuf Python runtime) keeps such an entry as an unknown field of
    ``Features`` instead of inserting it; the C++ runtime, like torchgrain, inserts it
    and ignores the unknown field. Only the accept/reject verdict is compared then.
    """
    ex = Example.FromString(data)
    return ex.HasField("features") and any(
        f.field_number == 1 for f in UnknownFieldSet(ex.features)
    )


def _sequence_lists(data: bytes) -> bool:
    """Whether ``data`` holds field 2 as a length-delimited field (a SequenceExample's
    ``feature_lists``), which an Example does not have."""
    return any(
        f.field_number == 2 and f.wire_type == 2 for f in UnknownFieldSet(Example.FromString(data))
    )


def _ours(data: bytes):
    try:
        return decode_tf_example(data)
    except RecordDecodeError:
        return None


def _differential(data: bytes) -> None:
    want = _protobuf_parse(data)
    got = _ours(data)
    if want is not None and _sequence_lists(data):
        # An Example holds no field 2; a SequenceExample's feature_lists are refused, not
        # skipped as protobuf's Example parse does (every list dropped, no error).
        assert got is None, f"{data.hex()}: its field 2 was dropped"
        return
    if want is None:
        assert got is None, f"protobuf rejects {data.hex()} but got {got}"
    else:
        assert got is not None, f"protobuf accepts {data.hex()} as {want}"
        if not _upb_dropped_map_entry(data):
            assert_same(got, want)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
@example(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\x3f")  # length 2**62
@example(b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01")  # 11-byte varint
@example(b"\x0b\x0c")  # empty group, skipped
@example(b"\x0c")  # end-group without a start
@example(bytes.fromhex("0b000000000c"))  # field 0 in a skipped group: upb skips it
@example(bytes.fromhex("0b03040c"))  # a field-0 group inside a skipped group
@example(bytes.fromhex("0b8000000c"))  # field 0 as a two-byte tag in a group
@example(bytes.fromhex("0b800000000c"))  # the same, unterminated: refused
@example(bytes.fromhex("0a020000"))  # field 0 in Features: refused
def test_arbitrary_bytes_match_protobuf(data):
    """Any input: only RecordDecodeError, and exactly the protobuf library's verdict."""
    _differential(data)


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    b = bytearray(data)
    for op, pos, val in edits:
        if not b:
            break
        pos %= len(b)
        if op == 0:
            b[pos] = val
        elif op == 1:
            b.insert(pos, val)
        else:
            del b[pos]
    return bytes(b)


small_features = st.dictionaries(
    st.text(max_size=4),
    st.one_of(
        st.lists(st.binary(max_size=6), max_size=3),
        st.lists(INT64, min_size=1, max_size=4).map(lambda v: np.array(v, dtype=np.int64)),
        st.lists(FLOAT32, max_size=3).map(lambda v: np.array(v, dtype=np.float32)),
    ),
    max_size=4,
)


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    small_features,
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
)
def test_mutated_examples_match_protobuf(feats, edits):
    """Near-valid inputs reach deep into the parser; verdicts and values must agree."""
    _differential(_mutate(to_proto(feats).SerializeToString(), edits))


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _entry(key: bytes, *feature_payloads: bytes, key_last: bool = False) -> bytes:
    vals = b"".join(_ld(2, p) for p in feature_payloads)
    return _ld(1, vals + _ld(1, key) if key_last else _ld(1, key) + vals)


def test_map_entry_with_unknown_field_is_kept():
    # key sent with the wrong wire type (an unknown field), then a bytes_list value.
    data = _ld(1, _ld(1, b"\x08\x00" + _ld(1, b"k") + _ld(2, _ld(1, _ld(1, b"v")))))
    assert decode_tf_example(data) == {"k": [b"v"]}
    assert _upb_dropped_map_entry(data)


def test_non_canonical_encodings():
    unpacked_ints = b"".join(b"\x08" + _varint(v) for v in (5, -1, 2**62))
    unpacked_floats = b"".join(b"\x0d" + np.float32(v).tobytes() for v in (1.5, -2.0))
    unknown = b"\x10\x07" + b"\x1d\x00\x00\x00\x00" + b"\x21" + b"\x00" * 8 + b"\x2b\x08\x01\x2c"
    feats = b"".join(
        [
            _entry(b"ints", _ld(3, unpacked_ints + unknown)),
            # A packed run followed by an unpacked value in the same list.
            _entry(b"mixed", _ld(3, _ld(1, _varint(1) + _varint(2)) + b"\x08\x03")),
            _entry(b"floats", _ld(2, unpacked_floats), key_last=True),
            # oneof set twice: the last kind wins; the same kind twice merges.
            _entry(b"switch", _ld(1, _ld(1, b"x")), _ld(3, b"\x08\x09")),
            _entry(b"merge", _ld(1, _ld(1, b"a")) + _ld(1, _ld(1, b"b"))),
            _entry(b"dup", _ld(3, b"\x08\x01")),
            _entry(b"dup", _ld(1, _ld(1, b"last"))),  # a repeated key: last entry wins
            _entry(b"", b""),  # empty key, no kind set
        ]
    )
    # The features field twice: merged.
    data = _ld(1, feats[: len(_entry(b"ints", _ld(3, unpacked_ints + unknown)))]) + _ld(
        1, feats[len(_entry(b"ints", _ld(3, unpacked_ints + unknown))) :]
    )
    got = decode_tf_example(data)
    assert_same(got, to_python(Example.FromString(data)))
    assert got["ints"].tolist() == [5, -1, 2**62]
    assert got["mixed"].tolist() == [1, 2, 3]
    assert got["floats"].tolist() == [1.5, -2.0]
    assert got["switch"].tolist() == [9]
    assert got["merge"] == [b"a", b"b"]
    assert got["dup"] == [b"last"]
    assert got[""] == []


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x05\x0a\x03",  # length runs past the end
        b"\x0a" + _varint(2**62) + b"\x00",  # absurd length
        b"\x0a" + _varint(2**64 - 1),
        b"\x0a\x06" + _ld(1, _ld(1, b"\xff\xfe")),  # key is not UTF-8
        _ld(1, _entry(b"f", _ld(2, _ld(1, b"\x00\x00\x00")))),  # packed floats, 3 bytes
        _ld(1, _entry(b"i", _ld(3, _ld(1, b"\x80")))),  # truncated packed varint
        _ld(1, _entry(b"i", _ld(3, _ld(1, b"\x80" * 60)))),  # same, vectorised path
        _ld(1, _entry(b"i", _ld(3, _ld(1, b"\xff" * 10 + b"\x01" + b"\x00" * 40)))),
        b"\x00\x00",  # field number 0
        b"\x0e",  # wire type 6
        b"\x0b\x14",  # group never closed
        b"\x0b\x0c\x0c",  # stray end-group
    ],
)
def test_malformed_rejected(data):
    assert _protobuf_parse(data) is None
    with pytest.raises(RecordDecodeError, match=r"malformed tf\.train\.Example"):
        decode_tf_example(data)


def test_deep_group_nesting_bounded():
    data = b"\x0b" * 5000 + b"\x0c" * 5000
    with pytest.raises(RecordDecodeError):
        decode_tf_example(data)


def test_squeeze_and_keys():
    data = encode_tf_example(
        {"a": 1, "b": [1, 2], "c": b"x", "d": [b"x", b"y"], "e": 0.5, "f": [], "g": np.zeros(0)}
    )
    got = decode_tf_example(data, squeeze=True)
    assert got["a"] == 1 and isinstance(got["a"], np.int64)
    assert got["b"].tolist() == [1, 2]
    assert got["c"] == b"x"
    assert got["d"] == [b"x", b"y"]
    assert got["e"] == 0.5 and isinstance(got["e"], np.float32)
    assert got["f"] == []
    assert got["g"].dtype == np.float32 and got["g"].size == 0
    assert decode_tf_example(data, keys={"c", "zz"}) == {"c": [b"x"]}


def test_encoder_types():
    data = encode_tf_example(
        {
            "str": "héllo",
            "strs": ["a", b"b"],
            "bool": True,
            "np_int": np.int32(-4),
            "np_float": np.float64(0.25),
            "matrix": np.arange(6, dtype=np.uint8).reshape(2, 3),
            "f64": np.array([1.0, 2.0]),
            "floats": [1, 2.5],
            "bytes_arr": np.array([b"ab", b"c"]),
            "unicode_arr": np.array(["x", "yz"]),
            "obj_arr": np.array([b"q"], dtype=object),
        }
    )
    got = decode_tf_example(data)
    assert got["str"] == ["héllo".encode()]
    assert got["strs"] == [b"a", b"b"]
    assert got["bool"].tolist() == [1]
    assert got["np_int"].tolist() == [-4]
    assert got["np_float"].tolist() == [0.25]
    assert got["matrix"].tolist() == [0, 1, 2, 3, 4, 5]
    assert got["f64"].dtype == np.float32
    assert got["floats"].tolist() == [1.0, 2.5]
    assert got["bytes_arr"] == [b"ab", b"c"]
    assert got["unicode_arr"] == [b"x", b"yz"]
    assert got["obj_arr"] == [b"q"]
    for bad in ({"x": None}, {"x": [b"a", 1]}, {"x": np.array([1j])}, {1: 1}, {"x": {"y": 1}}):
        with pytest.raises(TypeError):
            encode_tf_example(bad)
    for bad in ({"x": 2**63}, {"x": np.array([2**64 - 1], dtype=np.uint64)}):
        with pytest.raises(ValueError):
            encode_tf_example(bad)
    assert decode_tf_example(encode_tf_example({})) == {}
    assert decode_tf_example(b"") == {}


@pytest.mark.parametrize("value", [2**63, 2**63 + 5, 2**63 + 1000])
def test_a_uint64_just_past_int64_is_refused_not_wrapped(value):
    # (numpy 1 compares a uint64 scalar with a Python int as floats: 2**63 + 5 and
    # 2**63 - 1 are the same float there)
    with pytest.raises(ValueError, match="does not fit in int64"):
        encode_tf_example({"x": np.array([1, value], dtype=np.uint64)})


def test_codec_protocol():
    codec = TFExampleCodec()
    assert codec.name == "tf_example"
    record = {"image": b"\x00" * 100, "label": np.array([3]), "bbox": np.ones(4, np.float32)}
    clone = pickle.loads(pickle.dumps(TFExampleCodec(squeeze=True, keys=["label"])))
    data = codec.encode(record)
    assert_same(codec.decode(data), {**record, "image": [record["image"]]})
    assert clone.decode(data) == {"label": 3}
    with pytest.raises(RecordDecodeError):
        codec.decode(b"\x0a\x05")


@pytest.mark.parametrize("n", [1, 3])
def test_float_bits_preserved(n):
    bits = np.array([0x7FA00001, 0xFFC12345, 0x00000001][:n], dtype="<u4")  # NaN payloads
    data = _ld(1, _entry(b"f", _ld(2, _ld(1, bits.tobytes()))))
    got = decode_tf_example(data)["f"]
    assert got.dtype == np.float32
    assert got.view(np.uint32).tolist() == bits.tolist()
