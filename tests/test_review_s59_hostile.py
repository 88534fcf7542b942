"""Hostile dataset files found by review: a dataset index whose header or offsets lie, a
manifest that gives a shard no records, TFDS image specs that lie about dtype or shape."""

from __future__ import annotations

import io
import json
import os
import struct

import numpy as np
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.formats.index_file import IndexFile, IndexFileWriter
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.file_hash import file_checksum
from torchgrain.sources.node_index.arrayrecord import _AR_COLUMNS

HEADERS = {
    "unhashable dtype": json.dumps(
        {"kind": "array_record", "meta": {}, "arrays": [["a", ["<i8"], [1], 1024]]}
    ).encode(),
    "shape past int64": json.dumps(
        {"kind": "array_record", "meta": {}, "arrays": [["a", "<i8", [2**40, 2**24], 1024]]}
    ).encode(),
    "deep nesting": b'{"kind": "array_record", "meta": {}, "arrays": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}",
}


def _manifest(d):
    with open(os.path.join(d, "torchgrain.json")) as f:
        return json.load(f)


def _save_manifest(d, doc):
    with open(os.path.join(d, "torchgrain.json"), "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("case", list(HEADERS))
@pytest.mark.parametrize("own_dir", [True, False])
def test_a_dataset_index_with_a_hostile_header_is_rebuilt_not_a_crash(tmp_path, case, own_dir):
    """The header was parsed before the manifest's checksum was checked: a dtype that is a
    list leaked TypeError, a shape past int64 ValueError, deep nesting RecursionError."""
    d = str(tmp_path / "ds")
    tg.write_array_record([{"i": i} for i in range(4)], d)
    path = os.path.join(d, "torchgrain.tgindex")
    header = HEADERS[case]
    data = b"TGINDEX1" + struct.pack("<Q", len(header)) + header
    data += b"\0" * max(0, os.path.getsize(path) - len(data))
    with open(path, "wb") as f:
        f.write(data)
    doc = _manifest(d)
    doc["index"]["num_bytes"] = len(data)  # (its checksum is left stale)
    _save_manifest(d, doc)
    with pytest.raises(tg.CorruptDataError, match=r"torchgrain\.tgindex"):
        IndexFile.open(path, "array_record")
    index_dir = str(tmp_path / "index") if own_dir else None
    with pytest.warns(UserWarning, match="index"):
        src = tg.ArrayRecordSource(d, index_dir=index_dir)
    assert [r["i"] for r in src.__getitems__([3, 0, 1, 2])] == [3, 0, 1, 2]


def test_a_shard_the_manifest_gives_no_records_must_hold_none(tmp_path):
    """Its records were never read (a shard of 0 records is never opened), so they were
    lost without an error; a count too low by 2 was refused."""
    d = str(tmp_path / "ds")
    tg.write_array_record([{"i": i} for i in range(10)], d, num_shards=2)
    doc = _manifest(d)
    doc["shards"][0]["num_records"], doc["num_records"] = 0, 5
    _save_manifest(d, doc)
    for index_dir in (str(tmp_path / "index"), None):
        with pytest.raises(
            tg.CorruptDataError,
            match=r"holds 5 records but the dataset's manifest lists 0: .*\(ArrayRecord shard 0 of 2 '",
        ):
            tg.ArrayRecordSource(d, index_dir=index_dir)


def test_empty_shards_of_a_manifest_still_open(tmp_path):
    d = tmp_path / "ds"
    tg.write_array_record([{"i": i} for i in range(2)], str(d), num_shards=4)
    assert [r["i"] for r in tg.ArrayRecordSource(str(d)).__getitems__([1, 0])] == [1, 0]
    with RangeHTTPServer(str(tmp_path)) as srv:
        src = tg.ArrayRecordSource(f"{srv.url}/ds")
        assert [r["i"] for r in src.__getitems__([1, 0])] == [1, 0]


def test_a_remote_shard_the_manifest_gives_no_records_must_hold_none(tmp_path):
    d = tmp_path / "ds"
    tg.write_array_record([{"i": i} for i in range(10)], str(d), num_shards=2)
    doc = _manifest(str(d))
    doc["shards"][1]["num_records"], doc["num_records"] = 0, 5
    _save_manifest(str(d), doc)
    with (
        RangeHTTPServer(str(tmp_path)) as srv,
        pytest.raises(
            tg.CorruptDataError, match=r"manifest lists 0: .*\(ArrayRecord shard 1 of 2 'http"
        ),
    ):
        tg.ArrayRecordSource(f"{srv.url}/ds")


def test_verify_checksums_reads_the_shards_footers_not_a_shipped_index(tmp_path):
    """An index rewritten with its checksum in the manifest, each chunk moved to where the
    next one is: every chunk passes its own hash, so record k read as record k + 1. With
    verify_checksums the shards' own footers place the records."""
    d = str(tmp_path / "ds")
    tg.write_array_record([{"i": i} for i in range(20)], d, num_shards=2, group_size=1)
    path = os.path.join(d, "torchgrain.tgindex")
    f = IndexFile.open(path, "array_record")
    arrays, meta = {k: np.array(v) for k, v in f.arrays.items()}, dict(f.meta)
    del f
    arrays["offsets"][0:10] = arrays["offsets"][1:11].copy()
    os.unlink(path)
    w = IndexFileWriter(path, "array_record", _AR_COLUMNS)
    for k in _AR_COLUMNS:
        w.append(k, arrays[k])
    w.publish(meta)
    doc = _manifest(d)
    doc["index"]["num_bytes"], doc["index"]["file_checksum"] = (
        os.path.getsize(path),
        file_checksum(path),
    )
    _save_manifest(d, doc)
    index_dir = str(tmp_path / "index")
    src = tg.ArrayRecordSource(d, index_dir=index_dir, verify_checksums=True)
    assert [r["i"] for r in src.__getitems__(list(range(9)))] == list(range(9))
    assert [src[i]["i"] for i in range(20)] == list(range(20))


def _png(shape):
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(np.full(shape, 7, np.uint8)).save(b, format="PNG")
    return b.getvalue()


def _tfds(tmp_path, image_spec, shape=(64, 64, 3)):
    d = tmp_path / "toy" / "1.0.0"
    d.mkdir(parents=True)
    write_tfrecord(
        [encode_tf_example({"im": _png(shape)})], str(d / "toy-train.tfrecord-00000-of-00001")
    )
    spec = {"featuresDict": {"features": {"im": {"image": image_spec}}}}
    (d / "features.json").write_text(json.dumps(spec))
    return str(d)


def test_a_tfds_image_of_a_huge_dtype_is_refused(tmp_path):
    """A 64x64 PNG of 121 bytes decoded to 2.4 GB as dtype S200000."""
    d = _tfds(tmp_path, {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "S200000"})
    with pytest.raises(tg.CorruptDataError, match="image's dtype must be a number"):
        tg.TFRecordSource(d, index_dir=None)


def test_a_tfds_image_of_another_shape_than_its_spec_is_refused(tmp_path):
    d = _tfds(tmp_path, {"shape": {"dimensions": ["8", "8", "1"]}, "dtype": "uint8"})
    with pytest.raises(tg.RecordDecodeError, match=r"shape \(64, 64, 3\) where the spec says"):
        tg.TFRecordSource(d, index_dir=None)[0]
    d2 = _tfds(tmp_path / "ok", {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8"})
    assert tg.TFRecordSource(d2, index_dir=None)[0]["im"].shape == (64, 64, 3)
    # (channels are left as decoded: a grayscale image under an RGB spec still reads)
    d3 = _tfds(tmp_path / "gray", {"shape": {"dimensions": ["64", "64", "3"]}}, shape=(64, 64))
    assert tg.TFRecordSource(d3, index_dir=None)[0]["im"].shape == (64, 64, 1)


def _forge(path, kind, edit, *, in_place):
    """Rewrite index file ``path`` with ``edit(arrays, meta)`` applied, its checksum
    recomputed: in place (same inode and size) or replaced."""
    f = IndexFile.open(path, kind)
    arrays, meta = {k: np.array(v) for k, v in f.arrays.items()}, dict(f.meta)
    del f
    edit(arrays, meta)
    tmp = path + ".forged"
    w = IndexFileWriter(tmp, kind, {k: (v.dtype.str, v.shape[1:]) for k, v in arrays.items()})
    for k, v in arrays.items():
        w.append(k, v)
    w.publish(meta)
    if not in_place:
        os.replace(tmp, path)
        return
    with open(tmp, "rb") as src:
        data = src.read()
    os.unlink(tmp)
    assert len(data) == os.path.getsize(path)
    with open(path, "r+b") as out:
        out.write(data)


def _tenth(r):
    return r["x"] % 10 == 0


def test_a_filter_selection_rewritten_in_place_is_refused_by_spawned_workers(tmp_path):
    """Same inode and size, checksum recomputed: a spawned worker maps it by name and
    checked only (device, inode, size), so it served [0] * 10 for [0, 10, ..., 90]."""
    import torch

    data, idx = str(tmp_path / "data"), str(tmp_path / "idx")
    tg.write_parquet(({"x": i} for i in range(100)), data)
    f = tg.Dataset(tg.ParquetSource(data)).filter(
        _tenth, index_dir=idx, progress=False, num_workers=0
    )
    assert len(f) == 10
    (path,) = [os.path.join(idx, p) for p in os.listdir(idx) if p.endswith(".tgindex")]

    def dup(arrays, meta):
        arrays["selection"][:] = 0

    _forge(path, "filter", dup, in_place=True)
    loader = torch.utils.data.DataLoader(
        f, batch_size=5, num_workers=1, multiprocessing_context="spawn", collate_fn=list
    )
    with pytest.raises(tg.CorruptDataError, match=r"index file .* was replaced"):
        [r["x"] for batch in loader for r in batch]


@pytest.mark.parametrize("truncated", [None, "lots", [1], 99])
def test_a_pack_index_whose_truncated_count_lies_is_rebuilt(tmp_path, truncated):
    """A KeyError, a ValueError later, a TypeError, or 99 truncated documents reported."""
    data, idx = str(tmp_path / "data"), str(tmp_path / "idx")
    tg.write_parquet(({"tokens": np.arange(n, dtype=np.int64)} for n in [3, 7, 2, 4, 12]), data)

    def windows():
        return tg.Dataset(tg.ParquetSource(data)).windows(
            "tokens", 8, mode="pack", index_dir=idx, progress=False, num_workers=0
        )

    with pytest.warns(UserWarning, match="truncated"):
        assert windows().truncated_documents == 1
    (path,) = [
        os.path.join(idx, p)
        for p in os.listdir(idx)
        if p.endswith(".tgindex") and "bins" in IndexFile.open(os.path.join(idx, p), "windows")
    ]

    def lie(arrays, meta):
        meta.pop("truncated")
        if truncated is not None:
            meta["truncated"] = truncated

    _forge(path, "windows", lie, in_place=False)
    with pytest.warns(UserWarning, match="rebuilding"):
        assert windows().truncated_documents == 1


def test_a_dataset_index_touched_or_rewritten_before_spawned_workers(tmp_path):
    """A touch or chmod of the index beside a dataset is not a rewrite: spawned workers
    still read it (they refused it once its full identity was pickled); a rewrite in
    place, checksum recomputed, is refused in the parent, where the DataLoader says so."""
    import torch

    d = str(tmp_path / "ds")
    tg.write_array_record([{"i": i} for i in range(20)], d, num_shards=2, group_size=1)
    path = os.path.join(d, "torchgrain.tgindex")
    src = tg.ArrayRecordSource(d, index_dir=None)
    os.utime(path)
    os.chmod(path, 0o444)

    def load():
        loader = torch.utils.data.DataLoader(
            src, batch_size=5, num_workers=1, multiprocessing_context="spawn", collate_fn=list
        )
        return [r["i"] for batch in loader for r in batch]

    assert load() == list(range(20))
    os.chmod(path, 0o644)

    def shift(arrays, meta):
        arrays["offsets"][0:10] = arrays["offsets"][1:11].copy()

    _forge(path, "array_record", shift, in_place=True)
    with pytest.raises(tg.CorruptDataError, match=r"torchgrain\.tgindex"):
        load()
