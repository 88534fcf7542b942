"""Record keys that are not str: refused by the Parquet writer, naming the key and record,
as the ArrayRecord writer refuses them."""

import re

import pytest

import torchgrain as tg


@pytest.mark.parametrize("key", [1, (1, 2), b"a"])
def test_a_key_that_is_not_str_is_refused_naming_it_and_its_record(tmp_path, key):
    with pytest.raises(
        TypeError, match=re.escape(f"record keys must be str, got {key!r} (record 1)")
    ):
        tg.write_parquet([{"a": 1}, {"a": 2, key: 3}], tmp_path / "pq")
    with pytest.raises(TypeError, match="record keys must be str"):
        tg.write_array_record([{"a": 1}, {"a": 2, key: 3}], tmp_path / "ar")
