"""A bad index_dir is refused when the source is built, naming the option."""

from __future__ import annotations

import pathlib

import pytest

import torchgrain as tg


def _write(fmt: str, d: pathlib.Path) -> None:
    records = [{"i": i} for i in range(4)]
    if fmt == "tfrecord":
        tg.sources.get_format("tfrecord").write(records, str(d))
    else:
        tg.write_array_record(records, d)


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
@pytest.mark.parametrize("bad", [5, b"/tmp/ix", ["/tmp/ix"]])
def test_a_bad_index_dir_names_the_option(tmp_path, fmt, bad):
    _write(fmt, tmp_path / "d")
    with pytest.raises(TypeError, match="index_dir must be a directory path"):
        tg.open(tmp_path / "d", format=fmt, index_dir=bad)


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
def test_an_index_dir_path_or_none_opens(tmp_path, fmt):
    _write(fmt, tmp_path / "d")
    for index_dir in (tmp_path / "ix", str(tmp_path / "ix2"), None):
        assert len(tg.open(tmp_path / "d", format=fmt, index_dir=index_dir)) == 4


@pytest.mark.parametrize("view", ["filter", "windows"])
def test_a_derived_indexs_bad_index_dir_names_the_option(tmp_path, view):
    _write("array_record", tmp_path / "d")
    ds = tg.Dataset(tg.open(tmp_path / "d"))
    with pytest.raises(TypeError, match="index_dir must be a directory path"):
        if view == "filter":
            ds.filter(lambda r: r["i"] > 1, index_dir=5)
        else:
            ds.map(lambda r: {"tokens": [r["i"]] * 3}).windows("tokens", 2, index_dir=5)
