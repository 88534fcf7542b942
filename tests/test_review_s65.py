"""Token windows take a ``name`` that their index's key adds: the state a transform's code
calls (a helper, a global) is not in the documents' fingerprint, so an index built under
another helper is found stale when read; naming the state builds the index anew."""

from __future__ import annotations

import numpy as np
import pytest

import torchgrain as tg

_REPEAT = [1]


def _tokens(r: dict) -> dict:
    return {"t": np.tile(r["t"], _REPEAT[0])}


def test_windows_name_keys_the_index(tmp_path):
    tg.write_array_record([{"t": np.arange(i % 5 + 1)} for i in range(40)], tmp_path / "d")
    ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "d")).map(lambda r: _tokens(r))
    index_dir = tmp_path / "ix"
    first = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-1")
    before = [first[i]["input_ids"].tolist() for i in range(len(first))]
    try:
        _REPEAT[0] = 2  # what the transform calls changed; its own code did not
        stale = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-1")
        with pytest.raises(tg.CorruptDataError, match="name="):
            [stale[i] for i in range(len(stale))]
        fresh = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-2")
        tokens = np.concatenate(
            [np.append(np.tile(np.arange(i % 5 + 1), 2), 99) for i in range(40)]
        )
        assert len(fresh) == (len(tokens) - 1) // 8 > len(first)
        got = np.concatenate([fresh[i]["input_ids"] for i in range(len(fresh))])
        assert got.tolist() == tokens[: len(got)].tolist()
    finally:
        _REPEAT[0] = 1
    # The first name's index is still the one it built.
    again = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-1")
    assert [again[i]["input_ids"].tolist() for i in range(len(again))] == before
    with pytest.raises(TypeError, match="name must be a string"):
        ds.windows("t", 8, index_dir=None, name=1)
