"""A Parquet output shard's batches get one schema: a value is written with its type or
refused naming its key, records and shard, never widened or cast."""

from __future__ import annotations

import pytest

import torchgrain as tg


def test_an_int_a_float_does_not_hold_beside_a_float_names_key_records_and_shard(tmp_path):
    records = [{"k": 2**53 + 1}] * 512 + [{"k": 1.5}]
    tg.write_array_record(records, str(tmp_path / "in"))
    with pytest.raises(TypeError, match=r"key 'k'.*records 0\.\.511.*data-00000-of-00001"):
        tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=1)
