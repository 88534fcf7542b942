"""Conversion into Parquet writes values and types it reads back, or fails naming them."""

from __future__ import annotations

import os

import numpy as np
import pytest

import torchgrain as tg


@pytest.mark.parametrize(
    "recs",
    [
        [{"x": 1}, {"x": 2**63}],
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
