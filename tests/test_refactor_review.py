"""Faults found by reproduction while reviewing this round's refactors of the Parquet
values/pages, the token-window pass plan and the peripheral modules (each compared with
the code before them: the faults here are older than the refactors)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.errors import CorruptDataError
from torchgrain.formats.manifest import MANIFEST_NAME


@pytest.mark.parametrize(
    "outside", ["../victim.txt", "ABSOLUTE", "../dsx/victim.txt", "link/victim.txt"]
)
def test_overwrite_deletes_nothing_outside_the_dataset(tmp_path, outside):
    """write_array_record(overwrite=True) removes the old shards its manifest lists: a
    manifest naming '../victim.txt', an absolute path or a file under a link to another
    directory had that file deleted."""
    ds = tmp_path / "ds"
    tg.write_array_record([{"x": 1}], str(ds), num_shards=1)
    name = str(tmp_path / "victim.txt") if outside == "ABSOLUTE" else outside
    (tmp_path / "elsewhere").mkdir()
    (ds / "link").symlink_to(tmp_path / "elsewhere")  # a directory link in the dataset
    victim = (ds / name).resolve()  # (a sibling directory whose name starts as ds's too)
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("keep me")
    manifest = json.loads((ds / MANIFEST_NAME).read_text())
    manifest["shards"].append(dict(manifest["shards"][0], path=name))
    manifest["num_records"] = 2  # a consistent manifest: its shards' records add up
    (ds / MANIFEST_NAME).write_text(json.dumps(manifest))
    tg.write_array_record([{"x": 2}], str(ds), num_shards=1, overwrite=True)
    assert victim.read_text() == "keep me"
    assert [r["x"] for r in tg.Dataset(tg.ArrayRecordSource(str(ds)))] == [2]


@pytest.mark.parametrize("cache_bytes", [None, 1])  # converted records; records built per batch
def test_invalid_utf8_in_a_string_column_is_a_corrupt_data_error(tmp_path, cache_bytes):
    """A Parquet string column holding bytes that are not UTF-8 (Arrow does not check
    them on read) failed a records read with a bare UnicodeDecodeError naming neither the
    file nor the row group."""
    path = tmp_path / "bad.parquet"
    strings = pa.array([b"ok", b"\xff\xfe", b"x"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"s": strings, "i": [1, 2, 3]}), path)
    kw = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    src = tg.ParquetSource(str(path), decoded_cache=False, **kw)
    with pytest.raises(CorruptDataError, match="row group 0") as err:
        src.__getitems__([1])
    assert os.fspath(path) in str(err.value)


def test_convert_overwrite_deletes_nothing_outside_the_dataset(tmp_path):
    """tg.convert(..., overwrite=True) over a dataset removes the old shards its manifest
    lists (convert/journal.remove_outputs): '../victim.txt' there had that file deleted."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    tg.write_array_record([{"x": 1}], str(src), num_shards=1)
    tg.write_array_record([{"x": 1}], str(dst), num_shards=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    manifest["shards"].append(dict(manifest["shards"][0], path="../victim.txt"))
    manifest["num_records"] = 2
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    tg.convert(str(src), str(dst), overwrite=True)
    assert victim.read_text() == "keep me"
