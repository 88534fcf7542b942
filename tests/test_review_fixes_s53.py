"""Ints past int64 through ToTensor, pad_collate and Parquet output, msgpack map keys
deeper than Python's stack, field 0 inside a skipped tf.train.Example group: values
handed on exactly as given (or refused naming the record), the common case no slower.
Each test asserts what should hold."""

from __future__ import annotations

import random
import sys
import timeit

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.errors import RecordDecodeError
from torchgrain.formats.codecs import MsgpackCodec, _check_map_keys
from torchgrain.formats.tf_example import decode_tf_example
from torchgrain.tokens.collate import exact_numpy
from torchgrain.transforms import ToTensor

BIG = 2**63 + 5


def _to_tensor(value):
    return ToTensor(keys=["k"])({"k": value})["k"]


# ------------------------------------------------------------- ToTensor: what held
@pytest.mark.parametrize(
    ("value", "dtype", "want"),
    [
        ([True, False], torch.bool, [True, False]),
        ([np.int8(-3), 1], torch.int64, [-3, 1]),
        ([np.uint64(BIG), 1], torch.uint64, [BIG, 1]),
        ([np.int32(2), BIG], torch.uint64, [2, BIG]),
        ((BIG, 1), torch.uint64, [BIG, 1]),
        ([(BIG,), (1,)], torch.uint64, [[BIG], [1]]),
        ([np.array([BIG], np.uint64), np.array([1])], torch.uint64, [[BIG], [1]]),
        ([torch.tensor([2**63 - 1]), [BIG]], torch.uint64, [[2**63 - 1], [BIG]]),
        ([[0, 1.5], [2, 3]], torch.float64, [[0.0, 1.5], [2.0, 3.0]]),
        ([np.float32(1.5), 2], torch.float64, [1.5, 2.0]),
        ([[], []], torch.float64, [[], []]),
        (np.uint64(BIG), torch.uint64, BIG),
        (2**64 - 1, torch.uint64, 2**64 - 1),
    ],
)
def test_to_tensor_keeps_values_as_given(value, dtype, want):
    out = _to_tensor(value)
    assert out.dtype == dtype and out.tolist() == want


@pytest.mark.parametrize(
    "value",
    [
        [None, BIG],
        [[1, 2], [BIG]],
        [[1, [BIG]]],
        np.array([BIG, 1], dtype=object),
        [np.int64(-1), np.uint64(2**63)],
        [np.uint64(2**64 - 1), -1],
    ],
)
def test_to_tensor_refuses_naming_the_key(value):
    with pytest.raises(TypeError, match=r"ToTensor: key 'k' "):
        _to_tensor(value)


def test_exact_numpy_matches_numpy_within_int64():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        row = [
            rng.choice([rng.randint(-(2**63), 2**63 - 1), rng.random(), 0, -1]) for _ in range(n)
        ]
        for items in (row, [row, row]):
            want, got = np.asarray(items), exact_numpy(items)
            assert got.dtype == want.dtype and np.array_equal(got, want)


def _ratio(fast, slow, rounds: int = 15, number: int = 100) -> float:
    """min time of ``slow`` over min time of ``fast``, interleaved rounds."""
    a = b = float("inf")
    for _ in range(rounds):
        a = min(a, timeit.timeit(fast, number=number))
        b = min(b, timeit.timeit(slow, number=number))
    return b / a


def test_exact_numpy_of_floats_beside_ints_costs_what_numpy_does():
    boxes = [[0, 10, 20, 30]] * 255 + [[0.5, 1, 2, 3]]
    assert exact_numpy(boxes).dtype == np.float64
    assert _ratio(lambda: np.asarray(boxes), lambda: exact_numpy(boxes)) < 2.0


def test_exact_numpy_of_ints_and_floats_costs_what_numpy_does():
    ints, floats = list(range(512)), [i + 0.5 for i in range(512)]
    assert _ratio(lambda: np.asarray(ints), lambda: exact_numpy(ints)) < 1.5
    assert _ratio(lambda: np.asarray(floats), lambda: exact_numpy(floats)) < 1.5


def test_pad_collate_keeps_rows_as_given():
    batch = [{"ids": [True, False]}, {"ids": [np.int8(-3)]}, {"ids": []}]
    assert tg.pad_collate(batch, keys=["ids"])["ids"].tolist() == [[1, 0], [-3, 0], [0, 0]]
    out = tg.pad_collate([{"ids": (BIG, 2**64 - 1)}], keys=["ids"])["ids"]
    assert out.dtype == torch.uint64 and out.tolist() == [[BIG, 2**64 - 1]]
    with pytest.raises(TypeError, match=r"field 'ids' of record 1 .*past int64"):
        tg.pad_collate([{"ids": [1]}, {"ids": [-1, BIG]}], keys=["ids"])


# ---------------------------------------------------------------- Parquet output
def _norm(v):
    if isinstance(v, np.ndarray):
        return _norm(v.tolist())
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {a: _norm(b) for a, b in v.items()}
    return v


@pytest.mark.parametrize(
    ("records", "kind"),
    [
        ([{"x": (1, 2**63)}], "list<element: uint64>"),
        ([{"x": [None, 2**63]}], "list<element: uint64>"),
        ([{"x": []}, {"x": [[2**63]]}], "list<element: list<element: uint64>>"),
        ([{"m": {"a": -1, "b": 2**63}}], "struct<a: int64, b: uint64>"),
        ([{"x": [np.uint64(BIG)]}], "list<element: uint64>"),
    ],
)
def test_write_parquet_reads_back_as_given(tmp_path, records, kind):
    import pyarrow.parquet as pq

    (path,) = tg.write_parquet(records, tmp_path)
    table = pq.read_table(path)
    assert str(table.schema.field(0).type) == kind
    assert table.column(0).to_pylist() == [_norm(r[table.column_names[0]]) for r in records]
    key = table.column_names[0]
    back = [r[key] for r in tg.Dataset(tg.ParquetSource(str(tmp_path)))]
    assert _norm(back) == [_norm(r.get(key)) for r in records]


@pytest.mark.parametrize(
    "records",
    [
        [{"m": [{"a": 2**63}, {"a": -1}]}],
        [{"m": {"a": -(2**63) - 5, "b": 2**63}}],
        [{"x": [np.float64(1.5), 2**63]}],
    ],
)
def test_write_parquet_refuses_naming_the_record(tmp_path, records):
    with pytest.raises(TypeError, match=r"cannot store key '.' in Parquet: record 0 holds"):
        tg.write_parquet(records, tmp_path)


@pytest.mark.parametrize(
    ("records", "why"),
    [
        ([{"x": [np.int64(-1), 2**63]}], r"record 0 holds -1 and 9223372036854775808"),
        ([{"x": [np.int32(-3)]}, {"x": [2**63]}], r"record 0 holds -3 and record 1 holds"),
        ([{"m": {"a": np.int64(-3)}}, {"m": {"a": 2**63}}], r"record 0 holds -3 and record 1"),
        ([{"x": [np.uint64(BIG)]}, {"x": [2**63]}], None),
    ],
    ids=["int64-in-list", "int32-across-records", "int64-in-struct", "uint64"],
)
def test_write_parquet_numpy_ints_beside_ints_past_int64(tmp_path, records, why):
    import pyarrow.parquet as pq

    if why is not None:
        with pytest.raises(TypeError, match=rf"cannot store key '.' in Parquet: {why}"):
            tg.write_parquet(records, tmp_path)
        return
    (path,) = tg.write_parquet(records, tmp_path)
    assert pq.read_table(path).column("x").to_pylist() == [_norm(r["x"]) for r in records]


@pytest.mark.parametrize("records", [[{"x": [True, 2**63]}], [{"x": True}, {"x": [2**63]}]])
def test_write_parquet_int_past_int64_beside_a_bool_names_it(tmp_path, records):
    with pytest.raises(TypeError, match=r"record \d holds 9223372036854775808"):
        tg.write_parquet(records, tmp_path)


# --------------------------------------------------- msgpack keys past Python's stack
def _reference_key_error(record):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        for k, v in record.items():
            _check_map_keys(v, (k,))
    except TypeError as e:
        return str(e)
    finally:
        sys.setrecursionlimit(old)
    return None


def test_encode_refuses_deep_records_as_the_recursive_check_does():
    import msgpack

    deep = 1
    for _ in range(1015):
        deep = [deep]
    try:
        msgpack.packb(deep)
    except ValueError:
        pytest.skip("this msgpack packs fewer than 1024 levels")
    rng = random.Random(1)
    codec = MsgpackCodec()
    for _ in range(60):
        v = rng.choice([1, "s", {b"k": 2}, {"a": {3: 1}}, [], (1, {2.5: 1})])
        for _ in range(rng.randint(990, 1012)):
            r = rng.random()
            if r < 0.4:
                v = [v]
            elif r < 0.6:
                v = (0, v)
            elif r < 0.97:
                v = {rng.choice(["a", b"b"]): v}
            else:
                v = {"x": v, rng.choice(["y", 7, None, True]): 1}
        record = {"r": v}
        want = _reference_key_error(record)
        try:
            codec.encode(record)
        except TypeError as e:
            assert want is not None, str(e)[-200:]
            assert "is not str or bytes" in str(e)  # (maybe another of its bad keys)
        else:
            assert want is None, want[-200:]


# ------------------------------------------- tf.train.Example: field 0 inside groups
pb = pytest.importorskip("google.protobuf")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _example_proto import Example, to_python  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402


def _protobuf(data: bytes):
    try:
        return to_python(Example.FromString(data))
    except DecodeError:
        return None


def _ours(data: bytes):
    try:
        return decode_tf_example(data)
    except RecordDecodeError:
        return None


# field 0 as a two-byte (80 00), three-byte or five-byte tag in a skipped group
LONG_FIELD_0 = ["0b8000000c", "0b80000000000c", "0b8000800000000c", "0b8080808000000c"]


@pytest.mark.parametrize("hexdata", LONG_FIELD_0)
def test_protobuf_skips_a_longer_field_0_tag_in_a_group(hexdata):
    assert _protobuf(bytes.fromhex(hexdata)) == {}


@pytest.mark.parametrize("hexdata", LONG_FIELD_0)
def test_decode_skips_a_longer_field_0_tag_in_a_group(hexdata):
    assert _ours(bytes.fromhex(hexdata)) == {}


def _group_cases():
    out = []
    for wt in range(8):
        for tail in [
            b"",
            b"\x00",
            b"\x01",
            b"\x00" * 4,
            b"\x00" * 8,
            b"\x04",
            b"\x0c",
            b"\x04\x0c",
        ]:
            g = b"\x0b" + bytes([wt]) + tail + b"\x0c"
            out += [g, b"\x0a\x00" + g, b"\x0a" + bytes([len(g)]) + g]
            feat = b"\x12\x00" + g
            ent = b"\x0a\x01k\x12" + bytes([len(feat)]) + feat
            m = b"\x0a" + bytes([len(ent)]) + ent
            out.append(b"\x0a" + bytes([len(m)]) + m)
    nested = ["0b1b000c0c", "0b13041c0c", "0b0304040c", "0b030b0c040c", "0b0b03040c0c", "0b04"]
    nested += ["0b030c", "0b0304", "13000c", "0b000c14", "0b00", "0b800000000c", "0b0500000000000c"]
    return out + [bytes.fromhex(h) for h in nested]


def test_decode_matches_protobuf_on_field_0_in_groups():
    for data in _group_cases():
        want, got = _protobuf(data), _ours(data)
        assert (want is None) == (got is None), data.hex()
        if want is not None and not data.startswith(b"\x0a"):
            assert got == want, data.hex()


@pytest.mark.parametrize(
    ("last", "why"),
    [
        ([{"ids": [-1]}, {"ids": [BIG]}], r"record 599 holds -1 and record 600 holds"),
        ([{"ids": -1}, {"ids": BIG}], r"record 599 holds -1 and record 600 holds"),
    ],
    ids=["list", "scalar"],
)
def test_convert_names_the_input_record_of_an_int_no_type_holds(tmp_path, last, why):
    records = [{"ids": [1] if isinstance(last[0]["ids"], list) else 1}] * 599 + last
    tg.write_array_record(records, tmp_path / "src")
    with pytest.raises(TypeError, match=rf"cannot store key 'ids' in Parquet: {why}"):
        tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")


@pytest.mark.parametrize(
    "value", [[BIG, 1.5], [1.5, BIG], [[BIG, 1], [2.5, 1]], [BIG, np.float32(1.0)]]
)
def test_ints_past_int64_beside_floats_are_refused_not_rounded(value):
    with pytest.raises(TypeError, match=r"ToTensor: key 'k' .*9223372036854775813"):
        _to_tensor(value)
    with pytest.raises(TypeError, match=r"field 'ids' of record 0 .*9223372036854775813"):
        row = np.array(value, dtype=object).ravel().tolist()  # (a row is 1-D)
        tg.pad_collate([{"ids": row}], keys=["ids"])


@pytest.mark.parametrize(
    ("first", "last"),
    [([1], [BIG]), ([[1]], [[BIG]]), (1, BIG), ({"a": [1]}, {"a": [BIG]})],
    ids=["list", "nested", "scalar", "struct"],
)
def test_write_parquet_shards_agree_on_ints_past_int64(tmp_path, first, last):
    records = [{"ids": first}] * 9 + [{"ids": last}]
    tg.write_parquet(records, tmp_path, num_shards=2)
    back = [r["ids"] for r in tg.Dataset(tg.ParquetSource(str(tmp_path)))]
    assert _norm(back) == [_norm(r["ids"]) for r in records]


def test_default_collate_of_to_tensor_ints_past_int64_keeps_them_or_names_the_key():
    ds = tg.Dataset([{"k": [1, BIG]}, {"k": [2, 3]}]).map(ToTensor(keys=["k"]))
    loader = torch.utils.data.DataLoader(ds, batch_size=2)
    try:
        batch = next(iter(loader))
    except (RuntimeError, TypeError, ValueError) as e:
        assert "'k'" in str(e)
    else:
        assert batch["k"].dtype == torch.uint64 and batch["k"].tolist() == [[1, BIG], [2, 3]]


@pytest.mark.parametrize("value", [[np.array(5), BIG], [BIG, np.array(5)]])
def test_to_tensor_keeps_ints_past_int64_beside_0d_int_arrays(value):
    out = _to_tensor(value)
    assert out.dtype == torch.uint64 and out.tolist() == [int(v) for v in value]
