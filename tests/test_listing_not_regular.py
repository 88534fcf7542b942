"""A local listing or glob that meets something other than a regular file: a link named
like a shard whose target is missing is an error naming it, a FIFO is named in a warning
(never opened), and neither is left out without a word."""

from __future__ import annotations

import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.errors import DatasetWarning


def _dataset(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"x": list(range(10))}), d / "a.parquet")
    return d


@pytest.mark.parametrize("given", ["{d}", "{d}/*.parquet"], ids=["directory", "glob"])
def test_a_dangling_link_named_like_a_shard_is_an_error_naming_it(tmp_path, given):
    d = _dataset(tmp_path)
    os.symlink(tmp_path / "unmounted" / "b.parquet", d / "b.parquet")
    with pytest.raises(tg.DatasetNotFoundError, match=r"b\.parquet.*does not exist"):
        tg.ParquetSource(given.format(d=d))
    with pytest.raises(tg.DatasetNotFoundError, match=r"b\.parquet.*does not exist"):
        tg.open(given.format(d=d))  # (the format's detection lists it too)


def test_a_dangling_link_in_a_hidden_directory_is_not_the_datasets(tmp_path):
    d = _dataset(tmp_path)
    (d / ".index").mkdir()
    os.symlink(tmp_path / "gone.parquet", d / ".index" / "b.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(tg.ParquetSource(str(d))) == 10


@pytest.mark.parametrize("given", ["{d}", "{d}/*.parquet"], ids=["directory", "glob"])
def test_a_fifo_named_like_a_shard_is_named_in_a_warning_and_never_opened(tmp_path, given):
    d = _dataset(tmp_path)
    os.mkfifo(d / "zz.parquet")
    with pytest.warns(DatasetWarning, match=r"zz\.parquet.*not regular files"):
        src = tg.ParquetSource(given.format(d=d))
    assert len(src) == 10
