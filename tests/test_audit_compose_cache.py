"""Indexes cached on disk by composed datasets, keyed by what they were derived from:
two different derivations must never share one cached file, and a cached file that
misstates the data is found before any record is lost."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import torchgrain as tg
from tests._forged import forge_window_offsets
from torchgrain.errors import CorruptDataError


def test_two_is_in_expressions_that_print_alike_do_not_share_a_selection(tmp_path):
    tg.write_parquet(({"x": i} for i in range(200)), str(tmp_path / "data"))
    ds = tg.Dataset(tg.ParquetSource(str(tmp_path / "data")))
    first = list(range(100))
    # The same first and last ten values, other ones between: Arrow prints both sets as
    # "0, 1, ..., 9, ..., 90, ..., 99".
    second = first[:10] + list(range(110, 190)) + first[90:]
    index_dir = str(tmp_path / "indexes")
    ds.filter(pc.field("x").isin(first), index_dir=index_dir, progress=False)
    kept = ds.filter(pc.field("x").isin(second), index_dir=index_dir, progress=False)
    assert sorted(r["x"] for r in kept) == sorted(second)


def test_a_float32_and_a_float64_bound_that_print_alike_do_not_share_a_selection(tmp_path):
    tg.write_parquet(({"x": v} for v in [0.05, 0.1, 0.2]), str(tmp_path / "data"))
    ds = tg.Dataset(tg.ParquetSource(str(tmp_path / "data")))
    index_dir = str(tmp_path / "indexes")
    # float32(0.1) is 0.10000000149...: the row 0.1 is below it, not below 0.1.
    ds.filter(pc.field("x") < pa.scalar(0.1, pa.float32()), index_dir=index_dir, progress=False)
    kept = ds.filter(pc.field("x") < 0.1, index_dir=index_dir, progress=False)
    assert [r["x"] for r in kept] == [0.05]


def test_an_index_file_that_shortens_the_last_document_loses_no_windows_silently(tmp_path):
    docs = [np.arange(1, 5), np.arange(10, 13), np.arange(20, 30)]  # 4 + 3 + 10 tokens
    ds = tg.Dataset([{"t": t} for t in docs])
    assert len(ds.windows("t", 4, index_dir=tmp_path)) == 4  # (17 - 1) // 4
    # A well-formed file (sound checksum, offsets rising from 0 to its token count) that
    # says document 2 has 1 token, not 10: documents 0 and 1 are as they are.
    forge_window_offsets(ds, tmp_path, [0, 4, 7, 8], 8)
    w = ds.windows("t", 4, index_dir=tmp_path)
    with pytest.raises(CorruptDataError, match="document 2 "):
        w.__getitems__(list(range(len(w))))


def test_windows_of_a_concatenation_of_lists_do_not_share_a_cached_index(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    for lengths in ((3, 5), (6, 2)):  # two lists of one length, other documents
        docs = tg.concat([[{"t": np.arange(1, n + 1)} for n in lengths]])
        windows = docs.windows("t", 2, progress=False)
        assert len(windows) == 3
        windows.__getitems__([0, 1, 2])  # a CorruptDataError: "the data changed"
