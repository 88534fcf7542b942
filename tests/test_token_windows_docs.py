"""Token windows: a null token list is an empty document; a random_map changing token
counts under windows fails saying so."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg


def _ids(w):
    return [x["input_ids"].tolist() for x in w]


def test_a_null_parquet_token_list_is_an_empty_document(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"t": pa.array([[1, 2, 3], None, [4, 5]], pa.list_(pa.int64()))}), path)
    w = tg.Dataset(tg.ParquetSource(str(path))).windows("t", 2, eos=9, index_dir=None)
    assert _ids(w) == [[1, 2], [3, 9], [9, 4]]  # the null's eos between the two


def test_a_random_map_changing_token_counts_under_windows_is_named_in_the_error():
    def grow(rec, rng):  # a token count that depends on the epoch
        return {"t": np.arange(3 + rng.integers(0, 3))}

    docs = tg.Dataset([{"t": []} for _ in range(8)]).random_map(grow, seed=1)
    w = docs.windows("t", 2, index_dir=None, progress=False)
    for epoch in range(1, 5):
        w.set_epoch(epoch)
        try:
            _ids(w)
        except tg.CorruptDataError as e:
            assert "random_map" in str(e) and "cannot be under windows" in str(e)
            return
    pytest.fail("a changed token count was read without an error")
