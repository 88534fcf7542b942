"""A directory option's leading '~' is the home directory, as in dataset paths."""

from __future__ import annotations

import pytest

import torchgrain as tg
from torchgrain.sources.options import ReadOptions, check_dir_option


def test_cache_dir_under_the_home_directory_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ReadOptions(cache_dir="~/shards").cache_dir == str(tmp_path / "shards")
    assert check_dir_option("index_dir", "~") == str(tmp_path)


def test_a_directory_option_that_is_no_path_is_named():
    with pytest.raises(TypeError, match="cache_dir must be a directory path"):
        ReadOptions(cache_dir=5)
    with pytest.raises(TypeError, match="index_dir must be a directory path"):
        tg.ArrayRecordSource("/nonexistent", index_dir=5)
