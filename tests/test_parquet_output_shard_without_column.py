"""A Parquet output shard without a column (none of its records has the key) beside shards
whose types of it differ: the mismatch is still a SchemaMismatchError naming the shards."""

from __future__ import annotations

import os

import pytest

import torchgrain as tg

BIG = 2**53 + 1  # the first int a double rounds


def test_an_int_past_2_53_and_floats_with_a_shard_between_without_the_column(tmp_path):
    records = [{"x": BIG}, {"y": 1}, {"x": 0.5}]
    tg.write_array_record(records, str(tmp_path / "in"))
    with pytest.raises(
        tg.SchemaMismatchError,
        match=rf"column 'x' is int64 in data-00000-of-00003.parquet but double in "
        rf"data-00002-of-00003.parquet, and .* holds {BIG}",
    ):
        tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=3)
    assert not os.path.exists(tmp_path / "out" / ".torchgrain-convert" / "result.json")
