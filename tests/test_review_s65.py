"""Token windows take a ``name`` that their index's key adds: the state a transform's code
calls (a helper, a global) is not in the documents' fingerprint, so an index built under
another helper is found stale when read; naming the state builds the index anew.

A shard rewritten in place between runs with its size and modification time put back
(``rsync --inplace -t``) is indexed anew on this machine (the node-shared TFRecord and
ArrayRecord indexes are keyed by change time and inode too), not refused for good."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord

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


def _rewrite_in_place(path, data: bytes) -> None:
    """``path`` rewritten in place with ``data`` (of its size), its modification time put
    back: what ``rsync --inplace -t`` or ``cp -p`` onto the file does."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_tfrecord_rewritten_in_place_between_runs_is_indexed_anew(tmp_path):
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "a.tfrecord"
    write_tfrecord([bytes([65 + i]) * 10 for i in range(4)], str(path))
    write_tfrecord([b"X" * 36, b"Y" * 36], str(tmp_path / "new"))  # as many bytes, 2 records
    ix = tmp_path / "ix"
    old = tg.TFRecordSource(tmp_path / "data", codec="raw", index_dir=ix)
    assert [old[i]["bytes"] for i in range(len(old))] == [bytes([65 + i]) * 10 for i in range(4)]
    _rewrite_in_place(path, (tmp_path / "new").read_bytes())
    new = tg.TFRecordSource(tmp_path / "data", codec="raw", index_dir=ix)
    assert [new[i]["bytes"] for i in range(len(new))] == [b"X" * 36, b"Y" * 36]
    assert [r["bytes"] for r in new.iter_shard(0)] == [b"X" * 36, b"Y" * 36]


def test_arrayrecord_rewritten_in_place_between_runs_is_indexed_anew(tmp_path):
    for name, value, n, group in (("w1", "a" * 10, 4, 1), ("w2", "b" * 3, 11, 2)):
        tg.write_array_record(
            [{"x": value}] * n, tmp_path / name, compression="uncompressed", group_size=group
        )
    (tmp_path / "ar").mkdir()  # files without their manifest: indexed on this machine
    path = tmp_path / "ar" / "a.array_record"
    shutil.copy(next((tmp_path / "w1").glob("*.array_record")), path)
    ix = tmp_path / "ix"
    old = tg.ArrayRecordSource(tmp_path / "ar", index_dir=ix)
    assert [old[i]["x"] for i in range(len(old))] == ["a" * 10] * 4
    _rewrite_in_place(path, next((tmp_path / "w2").glob("*.array_record")).read_bytes())
    new = tg.ArrayRecordSource(tmp_path / "ar", index_dir=ix)
    assert [new[i]["x"] for i in range(len(new))] == ["b" * 3] * 11
    assert [r["x"] for r in new.__getitems__(list(range(11)))] == ["b" * 3] * 11
