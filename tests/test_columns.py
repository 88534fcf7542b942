"""Batches as columns: the structures, the vectorised msgpack decoder, and tg.Dataset's
``batch_format="columns"`` through real DataLoaders."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgrain.columns import ColumnBatch, Ragged, gather_ranges
from torchgrain.formats.codecs import MsgpackCodec
from torchgrain.formats.msgpack_columns import decode_columns

CODEC = MsgpackCodec()


def pack(records):
    blobs = [CODEC.encode(r) for r in records]
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    ends = np.cumsum(lengths)
    # Some slack between records, as a shared buffer of a batch may have.
    buf = np.frombuffer(b"".join(blobs), np.uint8)
    return buf, ends - lengths, ends


def same(a, b) -> bool:
    """Two columns hold the same values (arrays compare by dtype, shape and bytes)."""
    if isinstance(a, Ragged) or isinstance(b, Ragged):
        return isinstance(a, Ragged) and isinstance(b, Ragged) and a == b
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


int64s = st.integers(-(2**63), 2**63 - 1)
scalars = st.one_of(
    int64s.map(lambda v: ("int", v)),
    st.floats(allow_nan=False).map(lambda v: ("float", v)),
    st.booleans().map(lambda v: ("bool", v)),
    st.binary(max_size=300).map(lambda v: ("bytes", v)),
    st.text(max_size=40).map(lambda v: ("str", v)),
)
DTYPES = ["uint8", "int16", "int64", "float32", "float64", "bool", "<U3", "S2"]


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    keys = draw(
        st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=5, unique=True)
    )
    records = [{} for _ in range(n)]
    for key in keys:
        kind = draw(
            st.sampled_from(["int", "float", "bool", "bytes", "str", "dense", "ragged", "mixed"])
        )
        for r in records:
            value: object
            if kind in ("dense", "ragged"):
                dt = np.dtype(DTYPES[len(key) % len(DTYPES)])
                shape = (2, 3) if kind == "dense" else (draw(st.integers(0, 5)),)
                value = np.zeros(shape, dt)
            elif kind == "mixed":
                value = draw(scalars)[1]
            else:
                value = draw(scalars.filter(lambda x, k=kind: x[0] == k))[1]
            r[key] = value
    return records


@settings(max_examples=300, deadline=None)
@given(records=batches())
def test_vectorised_decode_agrees_with_record_by_record(records):
    buf, starts, ends = pack(records)
    got = decode_columns(buf, starts, ends)
    decoded = [CODEC.decode(buf[s:e].tobytes()) for s, e in zip(starts, ends)]
    want = ColumnBatch.from_records(decoded)
    if got is None:
        return  # declined: the caller decodes record by record
    assert len(got) == len(want) and list(got) == list(want)
    for key in want:
        assert same(got[key], want[key]), key


def test_vectorised_decode_takes_the_common_records():
    rng = np.random.default_rng(0)
    records = [
        {
            "image": rng.integers(0, 256, (4, 4, 3), dtype=np.uint8),
            "label": int(rng.integers(-300, 70000)),
            "score": float(rng.random()),
            "ok": bool(i % 2),
            "payload": rng.bytes(int(rng.integers(0, 2000))) + b"\x00" * (i % 3),
            "name": f"img-{i}",
            "tokens": np.arange(i % 5, dtype=np.int32),
        }
        for i in range(40)
    ]
    buf, starts, ends = pack(records)
    cols = decode_columns(buf, starts, ends)
    assert cols is not None and len(cols) == 40
    assert cols["image"].shape == (40, 4, 4, 3) and cols["image"].dtype == np.uint8
    np.testing.assert_array_equal(cols["image"][7], records[7]["image"])
    assert cols["label"].tolist() == [r["label"] for r in records]
    assert cols["ok"].dtype == bool and cols["score"].dtype == np.float64
    assert cols["payload"].tolist() == [r["payload"] for r in records]  # trailing zeros kept
    assert cols["name"][3] == "img-3" and cols["tokens"][4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "records",
    [
        [{"a": 1}, {"a": None}],  # a null
        [{"a": 1, "b": 2}, {"b": 2, "a": 1}],  # keys in another order
        [{"a": [1, 2]}, {"a": [3]}],  # nested lists
        [{"a": {"x": 1}}, {"a": {"x": 2}}],  # nested maps
        [{"a": 2**64 - 1}, {"a": 1}],  # beyond int64
        [{"a": 1}, {"a": "1"}],  # mixed families
    ],
)
def test_vectorised_decode_declines_what_it_cannot_represent(records):
    buf, starts, ends = pack(records)
    assert decode_columns(buf, starts, ends) is None


def test_vectorised_decode_never_reads_past_a_record():
    buf, starts, ends = pack([{"p": b"x" * 100}, {"p": b"y" * 100}])
    assert decode_columns(buf, starts, ends - 1) is None  # cut short: declined, no overrun
    assert decode_columns(buf, starts + 1, ends) is None


def test_ragged_and_batch_helpers():
    r = Ragged.from_values(["ä", "", "xyz"])
    assert r.tolist() == ["ä", "", "xyz"] and r.lengths().tolist() == [2, 0, 3]
    b = ColumnBatch.from_records([{"a": 1, "s": b"x"}, {"a": 2, "s": b"yz"}, {"a": 3}])
    assert b["a"].tolist() == [1, 2, 3] and b["s"] == [b"x", b"yz", None]
    assert [r["a"] for r in b.take([2, 0]).records()] == [3, 1]
    out = np.empty(6, np.uint8)
    buf = (np.arange(1000) % 256).astype(np.uint8)
    gather_ranges(buf, np.array([500, 0]), np.array([3, 3]), out)
    assert out.tolist() == [244, 245, 246, 0, 1, 2]
