"""Every file torchgrain writes has the mode a plain ``open(path, "w")`` would give it.

That is ``0o666`` less the process umask: shards, manifests, the conversion journal and
the caches alike, so that on shared storage others can read a dataset whenever the
umask allows it. Each writer runs under two umasks.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import fsspec
import numpy as np
import pytest

import torchgrain as tg
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.atomic import atomic_path, atomic_write_text, current_umask, file_mode
from torchgrain.io.shard_cache import ShardCache

UMASKS = [0o002, 0o077]


@pytest.fixture(params=UMASKS, ids=lambda u: f"umask{u:03o}")
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _records(n=20):
    return [{"x": np.full(4, i, np.float32), "label": i % 3, "name": f"r{i}"} for i in range(n)]


def _write_parquet_input(d):
    tg.write_parquet(_records(), d, num_shards=2)
    return d


def _write_array_record(tmp):
    tg.write_array_record(_records(), tmp / "out", num_shards=2)
    return [tmp / "out"]


def _overwrite_array_record(tmp):
    tg.write_array_record(_records(), tmp / "out", num_shards=3)
    tg.write_array_record(_records(7), tmp / "out", num_shards=2, overwrite=True)
    return [tmp / "out"]


def _write_parquet(tmp):
    tg.write_parquet(_records(), tmp / "out", num_shards=2)
    return [tmp / "out"]


def _write_tfrecord(tmp):
    os.makedirs(tmp / "out")
    write_tfrecord([encode_tf_example({"label": i}) for i in range(5)], tmp / "out" / "a.tfrecord")
    return [tmp / "out"]


def _convert_to_array_record(tmp):
    src = _write_parquet_input(tmp / "src")
    tg.convert(src, tmp / "out", progress=False)
    return [tmp / "out"]


def _convert_to_parquet_in_workers(tmp):
    # Worker processes come from a fork server that may have started under another umask.
    src = _write_parquet_input(tmp / "src")
    tg.convert(src, tmp / "out", to="parquet", workers=2, progress=False)
    return [tmp / "out"]


def _tfrecord_index_cache(tmp):
    os.makedirs(tmp / "data")
    write_tfrecord([b"ab", b"cd"], tmp / "data" / "a.tfrecord")
    src = tg.TFRecordSource(tmp / "data", codec="raw", index_dir=tmp / "index")
    assert len(src) == 2
    return [tmp / "index"]


def _arrayrecord_index_cache(tmp):
    # Files from another writer (no index beside them): the index is built into index_dir.
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(tmp / "data")
    for k in range(2):
        w = ArrayRecordWriter(str(tmp / "data" / f"{k}.array_record"), "group_size:1")
        for i in range(3):
            w.write(b"r%d" % i)
        w.close()
    os.chmod(tmp / "data", 0o777 & ~current_umask())
    src = tg.ArrayRecordSource(tmp / "data", codec="raw", index_dir=tmp / "index")
    assert [r["bytes"] for r in src.__getitems__([0, 5])] == [b"r0", b"r2"]
    return [tmp / "index"]


def _parquet_decoded_cache(tmp):
    src = tg.ParquetSource(_write_parquet_input(tmp / "src"), decoded_cache=tmp / "decoded")
    assert [r["label"] for r in src.__getitems__([0, 19])] == [0, 1]
    return [tmp / "decoded"]


def _shard_cache(tmp):
    name = f"/bucket-{os.getpid()}-{current_umask():o}/s1"
    fsspec.filesystem("memory").pipe(name, b"abc" * 100)
    cache = ShardCache(str(tmp / "cache"), max_bytes=1 << 20)
    path = cache.fetch(f"memory://{name}")
    assert Path(path).read_bytes() == b"abc" * 100
    return [tmp / "cache"]


WRITERS = {
    "write_array_record": _write_array_record,
    "write_array_record_overwrite": _overwrite_array_record,
    "write_parquet": _write_parquet,
    "write_tfrecord": _write_tfrecord,
    "convert_to_array_record": _convert_to_array_record,
    "convert_to_parquet_in_workers": _convert_to_parquet_in_workers,
    "tfrecord_index_cache": _tfrecord_index_cache,
    "arrayrecord_index_cache": _arrayrecord_index_cache,
    "parquet_decoded_cache": _parquet_decoded_cache,
    "shard_cache": _shard_cache,
}


def _modes(root):
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_file_written_follows_the_umask_like_a_plain_open(writer, umask, tmp_path):
    roots = WRITERS[writer](tmp_path)
    with open(tmp_path / "plain", "w"):
        pass
    plain = stat.S_IMODE(os.stat(tmp_path / "plain").st_mode)
    assert plain == file_mode() == 0o666 & ~umask
    files = 0
    for root in roots:
        for rel, mode in _modes(root).items():
            if os.path.isdir(os.path.join(root, rel)):
                assert mode == 0o777 & ~umask, (rel, oct(mode))
            else:
                files += 1
                assert mode == plain, f"{writer}: {rel} is {mode:o}, a plain open gives {plain:o}"
    assert files, f"{writer} wrote no file"


def test_the_umask_is_read_without_being_changed():
    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027
        assert file_mode() == 0o640
    finally:
        os.umask(old)


def test_a_failed_atomic_write_leaves_neither_the_file_nor_its_temporary(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError, match="boom"), atomic_path(target) as tmp:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["x.json"]
    assert target.read_text() == "old"
