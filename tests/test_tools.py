"""The tools that measure and tell: convert --columns, the bytes a read counts, the
caches listed, cleared and announced, bench's rounds and collation."""

from __future__ import annotations


import pytest

import torchgrain as tg
from torchgrain.cli import main


def _data(tmp_path, n=20):
    rows = [{"a": i, "b": str(i), "c": float(i)} for i in range(n)]
    tg.write_parquet(rows, str(tmp_path / "pq"))
    tg.write_array_record(rows, str(tmp_path / "ar"))
    return str(tmp_path / "pq"), str(tmp_path / "ar")


def test_convert_columns(tmp_path, capsys):
    pq, ar = _data(tmp_path)
    assert main(["convert", pq, str(tmp_path / "o1"), "--columns", "a,c", "-q"]) == 0
    assert tg.open(str(tmp_path / "o1"))[3] == {"a": 3, "c": 3.0}
    tg.convert(ar, str(tmp_path / "o2"), to="parquet", columns=["b"])
    assert tg.open(str(tmp_path / "o2"))[4] == {"b": "4"}
    for src in (pq, ar):
        with pytest.raises(ValueError, match=r"'zz'.*\['a', 'b', 'c'\]"):
            tg.convert(src, str(tmp_path / "o3"), columns=["a", "zz"])
    assert main(["convert", ar, str(tmp_path / "o4"), "--columns", "zz", "-q"]) != 0
    assert "'zz'" in capsys.readouterr().err
