"""A local ArrayRecord or TFRecord shard rewritten in place with its size and modification
time put back (``cp -p`` onto it, ``rsync --inplace -t``) is refused by a source opened
before, whenever a process's reader or map first opens it (in the opening process, in a
forked DataLoader worker, after a read, with or without inotify): an error naming the
file, never the new records."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import changes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux files")

N = 40  # records per shard
REFUSED = r"changed since the dataset was opened"


def _records(base: int) -> list[dict[str, object]]:
    # Incompressible values of one size: datasets of other values have shards of one size.
    rng = np.random.default_rng(base)
    return [{"x": rng.integers(0, 255, 64, dtype=np.uint8), "y": base + i} for i in range(2 * N)]


def _ar_plain(d: str, base: int) -> list[str]:
    """Two ArrayRecord files, no manifest (indexed for the machine at opening)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(d)
    paths = []
    for k in range(2):
        p = os.path.join(d, f"{k}.array_record")
        w = ArrayRecordWriter(p, "group_size:1,uncompressed")
        for i in range(N):
            w.write(b"%08d" % (base + k * N + i) + bytes(56))
        w.close()
        paths.append(p)
    return paths


def _tfrecord(d: str, base: int) -> list[str]:
    os.makedirs(d)
    paths = []
    for k in range(2):
        p = os.path.join(d, f"{k}.tfrecord")
        write_tfrecord([b"%08d" % (base + k * N + i) for i in range(N)], p)
        paths.append(p)
    return paths


def _write(kind: str, d: str, base: int) -> list[str]:
    if kind == "arrayrecord":
        return tg.write_array_record(_records(base), d, num_shards=2, compression="uncompressed")
    return (_ar_plain if kind == "arrayrecord-plain" else _tfrecord)(d, base)


def _open(kind: str, root: str, index_dir: str | None) -> tg.ShardedSource:
    if kind == "tfrecord":
        return tg.TFRecordSource(root, codec="raw", index_dir=index_dir)
    codec = {"codec": "raw"} if kind == "arrayrecord-plain" else {}
    return tg.ArrayRecordSource(root, index_dir=index_dir, **codec)


def _copy_keeping_times(src: str, dst: str) -> None:
    """What ``cp -p src dst`` does to an existing ``dst``: written in place (its inode
    kept), its modification time put back."""
    before = os.stat(dst)
    with open(src, "rb") as f:
        data = f.read()
    assert len(data) == before.st_size
    with open(dst, "r+b") as f:
        f.write(data)
    os.utime(dst, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(dst)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


KINDS = ["arrayrecord", "arrayrecord-plain", "tfrecord"]


@pytest.fixture(params=[pytest.param(k, id=k) for k in KINDS])
def kind(request) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["no-index-dir", "index-dir"])
def data(request, kind, tmp_path):
    root, other = str(tmp_path / "ds"), str(tmp_path / "other")
    paths = _write(kind, root, 1000)  # (values of one encoded size)
    others = _write(kind, other, 2000)
    index_dir = str(tmp_path / "ix") if request.param else None
    return kind, root, index_dir, sorted(paths), sorted(others)


@pytest.fixture(params=["region", "readers"])
def reading(request) -> str:
    """Through the process's map of every shard, or through a reader per shard."""
    return request.param


def _source(data, reading: str) -> tg.ShardedSource:
    kind, root, index_dir, _, _ = data
    src = _open(kind, root, index_dir)
    if reading == "readers":
        # every read through a reader of its shard
        if isinstance(src, tg.TFRecordSource):
            src.format._region = False
        else:
            src._mapped = False
    return src


def _value(record: object) -> object:
    return record["y"] if isinstance(record, dict) and "y" in record else record


def _raises_naming(path: str, fn) -> None:
    with pytest.raises(tg.CorruptDataError, match=REFUSED) as e:
        fn()
    assert os.path.basename(path) in str(e.value)


def test_rewritten_before_the_first_read_is_refused(data, reading) -> None:
    kind, root, index_dir, paths, others = data
    src = _source(data, reading)
    _copy_keeping_times(others[1], paths[1])
    _raises_naming(paths[1], lambda: src[N + 3])
    _raises_naming(paths[1], lambda: src.__getitems__([0, N + 3]))
    assert src[3] is not None  # the other shard is read
    # Opened again, the dataset reads what the file holds now.
    again = _open(kind, root, index_dir)
    assert _value(again[N + 3]) == _value(_open(kind, os.path.dirname(others[1]), None)[N + 3])


@pytest.mark.parametrize("parent_read", ["other-shard", "same-shard"])
def test_rewritten_before_a_forked_worker_opens_it_is_refused(data, reading, parent_read) -> None:
    _, _, _, paths, others = data
    src = _source(data, reading)
    # The parent has read the other shard, or this one (its reader or map inherited).
    src[0 if parent_read == "other-shard" else N + 5]
    _copy_keeping_times(others[1], paths[1])
    loader = DataLoader(
        src,
        batch_size=None,
        sampler=[N + 3],
        num_workers=1,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    try:
        with pytest.raises(tg.CorruptDataError, match="changed") as e:
            next(it)
    finally:
        it._shutdown_workers()  # (now: left to the collector, it waits 5 s)
    assert os.path.basename(paths[1]) in str(e.value)


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "no-inotify"])
def test_rewritten_after_a_read_is_refused(data, reading, inotify, monkeypatch) -> None:
    _, _, _, paths, others = data
    if not inotify:  # a stat of the path at each check, as where inotify is missing
        monkeypatch.setattr(changes, "libc", lambda: None)
        monkeypatch.setattr(changes, "_watcher", None)
    src = _source(data, reading)
    before = src[N + 3]
    _copy_keeping_times(others[1], paths[1])
    for _ in range(2):
        with pytest.raises(tg.CorruptDataError, match="changed") as e:
            src[N + 3]
        assert os.path.basename(paths[1]) in str(e.value)
    assert before is not None


def test_a_shard_whose_mode_changed_asks_to_open_the_dataset_again(data) -> None:
    kind, root, index_dir, paths, _ = data
    src = _open(kind, root, index_dir)
    os.chmod(paths[1], 0o640)  # moves the change time: not told apart from a write
    with pytest.raises(tg.CorruptDataError, match=r"mode, owner or links.*open it again"):
        src[N + 3]
    assert _open(kind, root, index_dir)[N + 3] is not None
