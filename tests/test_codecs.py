import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torchgrain.errors import RecordDecodeError
from torchgrain.formats.codecs import (
    MsgpackCodec,
    RawCodec,
    get_codec,
    merge_schema,
    register_codec,
    sniff_codec,
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=40),
)
arrays = hnp.arrays(
    dtype=st.one_of(
        hnp.integer_dtypes(endianness="="),
        hnp.unsigned_integer_dtypes(endianness="="),
        hnp.floating_dtypes(endianness="="),
        st.just(np.dtype(bool)),
        st.just(np.dtype("S3")),
    ),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
)
values = st.one_of(scalars, arrays, st.lists(st.one_of(scalars, arrays), max_size=4))
records = st.dictionaries(st.text(max_size=10), values, max_size=6)


def assert_same(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


@given(records)
def test_msgpack_round_trip_every_value_type(rec):
    codec = MsgpackCodec()
    out = codec.decode(codec.encode(rec))
    assert list(out) == list(rec)
    for k in rec:
        assert_same(rec[k], out[k])


@given(arrays)
def test_arrays_writable_by_default_zero_copy_optional(arr):
    data = MsgpackCodec().encode({"a": arr})
    writable = MsgpackCodec().decode(data)["a"]
    view = MsgpackCodec(zero_copy=True).decode(data)["a"]
    assert writable.flags.writeable
    assert not view.flags.writeable or view.size == 0
    np.testing.assert_array_equal(writable, view)


def test_numpy_scalars_keep_dtype():
    out = MsgpackCodec().decode(MsgpackCodec().encode({"x": np.float16(1.5)}))
    assert out["x"].dtype == np.float16 and out["x"].shape == ()


def test_rejects_object_arrays_and_non_str_keys():
    with pytest.raises(TypeError):
        MsgpackCodec().encode({"x": np.array([object()], dtype=object)})
    with pytest.raises(TypeError):
        MsgpackCodec().encode({1: 2})


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian: stored in native order
        np.array(7, dtype=">f8"),  # 0-d
        np.zeros((0, 3), np.float32),  # empty
        np.zeros((2, 0), "S4"),
        np.array(["ab", "ünï"]),  # unicode: UCS-4 bytes
        np.array([b"ab", b"c"]),
        np.frombuffer(b"\x00\x01\x02\x03\x04\x05", dtype="V3"),
        np.array([True, False]),
        np.array([1 + 2j], np.complex64),
        np.array(["2024-01-01"], "datetime64[ns]"),
        np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.arange(10)[::3],
    ],
    ids=lambda a: f"{a.dtype.str}{list(a.shape)}",
)
@pytest.mark.parametrize("zero_copy", [False, True])
def test_array_dtype_and_layout_edge_cases_round_trip(arr, zero_copy):
    codec = MsgpackCodec(zero_copy=zero_copy)
    out = codec.decode(codec.encode({"a": arr}))["a"]
    # values, kind, item size and shape survive; byte order becomes native (torch needs it)
    assert out.dtype == arr.dtype.newbyteorder("=") and out.dtype.isnative
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_structured_arrays_rejected_not_flattened():
    # dtype.str of a structured dtype is a bare '|V8': the field names and types
    # would be lost without a word.
    rec = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")])
    with pytest.raises(TypeError, match="structured"):
        MsgpackCodec().encode({"x": rec})
    with pytest.raises(TypeError, match="structured"):
        MsgpackCodec().encode({"x": rec[0]})  # a numpy.void scalar


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data):
    try:
        out = MsgpackCodec().decode(data)
    except RecordDecodeError:
        return
    assert isinstance(out, dict)


def test_huge_ndarray_shape_rejected_before_allocation():
    import struct

    import msgpack

    header = struct.pack("<B3sB2Q", 3, b"<f8", 2, 2**30, 2**30)
    data = msgpack.packb({"x": msgpack.ExtType(1, header + b"\0" * 8)})
    with pytest.raises(RecordDecodeError, match="does not match shape"):
        MsgpackCodec().decode(data)


def test_pickle_payload_is_not_executed(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Evil())
    for codec in ("msgpack", "raw"):
        with contextlib.suppress(RecordDecodeError):
            get_codec(codec).decode(payload)
    assert not marker.exists()


def test_registry_and_sniff():
    assert sniff_codec(MsgpackCodec().encode({"a": 1})) == "msgpack"
    assert sniff_codec(b"\x0a\x05hello") == "raw"
    assert RawCodec().decode(memoryview(b"ab")) == {"bytes": b"ab"}
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("nope")

    class Rev:
        name = "rev"

        def decode(self, data):
            return {"r": bytes(data)[::-1]}

    register_codec("rev", Rev())
    assert get_codec("rev").decode(b"ab") == {"r": b"ba"}


def test_merge_schema_marks_varying_shapes_and_missing_keys():
    s = merge_schema({}, {"img": np.zeros((2, 3), np.uint8), "y": 1})
    s = merge_schema(s, {"img": np.zeros((4, 3), np.uint8), "z": "a"})
    assert s == {"img": "uint8[?,3]", "y": "int|null", "z": "null|str"}
