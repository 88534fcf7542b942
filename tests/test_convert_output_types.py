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

