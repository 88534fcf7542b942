"""Conversion into Parquet writes values and types it reads back, or fails naming them."""

from __future__ import annotations

import os

import numpy as np
import pytest

import torchgrain as tg


@pytest.mark.parametrize(
    "recs",
    [
        [{"x": 2**53 + 1}, {"x": 1.5}],
        [{"x": np.arange(2, dtype=np.int8)}, {"x": np.arange(2, dtype=np.int16)}],
        [{"x": {"a": 1}}, {"x": {"b": 1}}],
        [{"x": 1}, {"x": "a"}],
    ],
)
def test_parquet_shards_of_other_column_types_are_refused(tmp_path, recs):
    tg.write_array_record(recs, tmp_path / "src")
    with pytest.raises(tg.SchemaMismatchError, match=r"column 'x' .* data-00000-of-00002"):
        tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", num_shards=2)
    assert not os.path.exists(tmp_path / "out" / ".torchgrain-convert" / "result.json")


@pytest.mark.parametrize("value", [1e300, np.array([0.5, -1e39]), [1, 1e300], [1.5, 10**400]])
def test_tf_example_float_past_float32_is_an_error(value):
    from torchgrain.formats.tf_example import encode_tf_example

    with pytest.raises(ValueError, match=r"feature 'x'.*float32"):
        encode_tf_example({"x": value})


def test_tf_example_infinities_and_float32_extremes_are_kept():
    from torchgrain.formats.tf_example import decode_tf_example, encode_tf_example

    v = np.array([np.inf, -np.inf, np.nan, np.finfo(np.float32).max, 1e-45])
    out = decode_tf_example(encode_tf_example({"x": v}))["x"]
    assert np.array_equal(out, v.astype(np.float32), equal_nan=True)


@pytest.mark.parametrize("shape", [(0, 2), (2, 0, 3), (1, 0, 0, 1)])
def test_parquet_refuses_an_array_whose_shape_it_would_lose(tmp_path, shape):
    recs = [{"x": np.zeros((1, 1) + (1,) * (len(shape) - 2), np.float32)}]
    recs.append({"x": np.zeros(shape, np.float32)})
    with pytest.raises(TypeError, match=rf"key 'x'.*shape \({shape[0]}, "):
        tg.write_parquet(recs, tmp_path)
    tg.write_array_record(recs, tmp_path / "src")
    with pytest.raises(
        TypeError, match=r"output shard data-00000-of-00001.parquet .*key .x.*records 0..1 of"
    ):
        tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 0), (3, 2, 0)])
def test_parquet_keeps_empty_arrays_of_these_shapes(tmp_path, shape):
    tg.write_parquet([{"x": np.zeros(shape, np.int16)}], tmp_path)
    assert np.asarray(tg.open(tmp_path)[0]["x"]).shape == shape


@pytest.mark.parametrize("row_group_bytes", [1, 32 << 20])
def test_parquet_shard_ints_past_int64_after_its_first_batches(tmp_path, row_group_bytes):
    recs = [{"x": i, "y": None} for i in range(1500)] + [{"x": 2**64 - 1, "y": 3}]
    tg.write_array_record(recs, tmp_path / "src")
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", row_group_bytes=row_group_bytes)
    out = tg.open(tmp_path / "out")
    assert [out[i]["x"] for i in (0, 1499, 1500)] == [0, 1499, 2**64 - 1]
    assert out[1500]["y"] == 3 and out[3]["y"] is None
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp-" in n]


def test_parquet_shard_negative_ints_and_ints_past_int64_are_refused(tmp_path):
    recs = [{"x": -1}] * 512 + [{"x": 2**63}]
    tg.write_array_record(recs, tmp_path / "src")
    with pytest.raises(TypeError, match=r"output shard data-.*key 'x'.* -1 and ints past int64"):
        tg.convert(tmp_path / "src", tmp_path / "out", to="parquet")


def test_parquet_shard_column_null_or_missing_in_its_first_row_group(tmp_path):
    recs = [{"a": i, "n": None} for i in range(1100)]
    recs += [{"a": 1100, "n": [b"x"], "late": "z"}, {"a": 1101, "n": []}]
    tg.write_array_record(recs, tmp_path / "src")
    tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", row_group_bytes=1)
    out = tg.open(tmp_path / "out")
    assert [out[i]["a"] for i in range(len(recs))] == list(range(1102))
    assert out[0]["n"] is None and out[0].get("late") is None
    assert [bytes(v) for v in out[1100]["n"]] == [b"x"] and out[1100]["late"] == "z"
    assert len(out[1101]["n"]) == 0


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_parquet_shards_typed_apart_without_a_value_changed_are_rewritten(tmp_path, compression):
    import pyarrow.parquet as pq

    recs = [{"x": 1, "s": [], "n": None}, {"x": 2**63, "s": [b"a"], "n": {"a": 1}}]
    tg.write_array_record(recs, tmp_path / "src")
    m = tg.convert(
        tmp_path / "src", tmp_path / "out", to="parquet", num_shards=2, compression=compression
    )
    out = tg.open(tmp_path / "out")
    assert [out[0]["x"], out[1]["x"]] == [1, 2**63]
    assert [list(out[0]["s"]), [bytes(v) for v in out[1]["s"]]] == [[], [b"a"]]
    assert out[0]["n"] is None and out[1]["n"] == {"a": 1}
    for s in m.shards:
        path = tmp_path / "out" / s.path
        tg.writers.verify_shard(str(path), s.num_records, s.checksum)
        assert s.num_bytes == os.path.getsize(path)
        codec = pq.read_metadata(path).row_group(0).column(0).compression
        assert codec == {"none": "UNCOMPRESSED", "snappy": "SNAPPY"}[compression]
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp-" in n]


def test_parquet_shards_negative_int64_and_uint64_are_refused(tmp_path):
    tg.write_array_record([{"x": -1}, {"x": 2**63}], tmp_path / "src")
    with pytest.raises(tg.SchemaMismatchError, match="'x' is int64 in data-00000-of-00002"):
        tg.convert(tmp_path / "src", tmp_path / "out", to="parquet", num_shards=2)
