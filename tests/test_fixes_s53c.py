"""Parquet output errors name their records and files: an int past 2**53 beside a float in
write_parquet (at the top level, in lists, in dicts, the float a batch later), and a write
that fails for want of disk space."""

from __future__ import annotations

import errno
import os

import pyarrow.parquet as pq
import pytest

import torchgrain as tg

BIG = 2**53 + 1  # the first int a double rounds


def _wrap(shape, v):
    return {"top": v, "list": [v], "dict": {"a": v}, "list_of_dicts": [{"a": v}]}[shape]


@pytest.mark.parametrize("shape", ["top", "list", "dict", "list_of_dicts"])
@pytest.mark.parametrize("floats_first", [False, True])
def test_write_parquet_int_past_2_53_beside_a_float_names_key_int_and_records(
    tmp_path, shape, floats_first
):
    ints = [{"k": _wrap(shape, i)} for i in range(512)]
    ints[300] = {"k": _wrap(shape, -BIG)}
    floats = [{"k": _wrap(shape, 0.5)}] * 512
    recs = [*floats, *ints] if floats_first else [*ints, *floats]
    at, other = (812, 511) if floats_first else (300, 512)
    lo, hi = sorted((at, other))
    with pytest.raises(TypeError, match=rf"key 'k'.*{-BIG}.*records {lo} and {hi}\b"):
        tg.write_parquet(recs, tmp_path / "out")
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".parquet")]


def test_write_parquet_a_record_refused_alone_is_named(tmp_path):
    recs = [{"k": [1]}, {"k": [2]}, {"k": [3, "a"]}, {"k": [4]}]
    with pytest.raises(TypeError, match=r"key 'k'.*\(record 2\)"):
        tg.write_parquet(recs, tmp_path / "out")


def test_write_parquet_on_a_full_disk_names_the_file_and_keeps_errno(tmp_path, monkeypatch):
    def full(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1")  # a partial file, which must not stay
        raise OSError(errno.ENOSPC, "Error writing bytes to file. No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    out = tmp_path / "out"
    with pytest.raises(OSError) as info:
        tg.write_parquet([{"x": 1}, {"x": 2}], out, num_shards=2)
    final = str(out / "data-00000-of-00002.parquet")
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == final and final in str(info.value)
    assert os.listdir(out) == []
