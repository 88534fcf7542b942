"""The node-shared dataset index is never trusted for files it does not describe: a
TFRecord shard rewritten to the same size gets a fresh index, an index beside the
shards edited in place after it was verified is verified again, a full index
directory deletes its least recently used indexes first (never one under its lock), one
process at a time holds the lock to build an index, a killed builder's temp files are
swept, and an index directory of the earlier release is used as it is."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.sources.node_index import COUNTERS, INDEX_NAME, store
from torchgrain.sources.node_index.derived import derived_index

BASE = os.environ.get("TORCHGRAIN_BASE", "/tmp/base")  # the starting release's checkout


def _records(src, idx):
    return [r["bytes"] for r in src.__getitems__(idx)]


def test_a_tfrecord_shard_rewritten_to_the_same_size_gets_a_fresh_index(tmp_path):
    d = tmp_path / "tf"
    d.mkdir()
    path = d / "x-0.tfrecord"
    write_tfrecord([b"a" * 10, b"b" * 30], path)
    idx = tmp_path / "idx"
    src = tg.TFRecordSource(d, codec="raw", index_dir=idx)
    assert _records(src, [0, 1]) == [b"a" * 10, b"b" * 30]
    st = os.stat(path)
    # The same size, the records laid out otherwise: only the version stamp (its
    # modification time) tells the files apart.
    write_tfrecord([b"c" * 30, b"d" * 10], tmp_path / "new.tfrecord")
    os.replace(tmp_path / "new.tfrecord", path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert os.path.getsize(path) == st.st_size
    before = COUNTERS["tfrecord_builds"]
    src = tg.TFRecordSource(d, codec="raw", index_dir=idx)
    assert COUNTERS["tfrecord_builds"] == before + 1
    assert _records(src, [0, 1]) == [b"c" * 30, b"d" * 10]


def test_an_index_beside_the_shards_edited_in_place_after_it_was_verified_is_checked_again(
    tmp_path,
):
    tg.write_array_record([{"i": i} for i in range(30)], tmp_path / "ds", num_shards=3)
    idx = tmp_path / "idx"
    src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=idx)  # verified, and stamped
    assert src[29]["i"] == 29
    path = tmp_path / "ds" / INDEX_NAME
    st = os.stat(path)
    with open(path, "r+b") as f:  # the same inode and size
        f.seek(st.st_size - 100)
        byte = f.read(1)[0]
        f.seek(st.st_size - 100)
        f.write(bytes([byte ^ 0x40]))
    # Its modification time put back: only the change time says it was written to.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = COUNTERS["verified"]
    with pytest.warns(UserWarning, match="not using the dataset's index file"):
        src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=idx)
    assert COUNTERS["verified"] == before  # verified again, and failed
    assert [r["i"] for r in src.__getitems__(list(range(29, -1, -1)))] == list(range(29, -1, -1))


def _write_foreign(directory, n: int = 40) -> None:
    os.makedirs(directory)
    w = ArrayRecordWriter(str(directory / "part-00000.array_record"), "group_size:1")
    for i in range(n):
        w.write(b"%d" % i)
    w.close()


def test_a_full_index_directory_deletes_the_least_recently_used_index(tmp_path, monkeypatch):
    idx = tmp_path / "idx"
    paths = {}
    for name in ("a", "b"):
        _write_foreign(tmp_path / name)
        paths[name] = tg.ArrayRecordSource(tmp_path / name, codec="raw", index_dir=idx)._dindex.path
    size = os.path.getsize(paths["a"])
    assert os.path.getsize(paths["b"]) == size
    # "a" was used after "b" (an index's use is the time of its lock file).
    os.utime(paths["b"] + ".lock", (1_000_000_000, 1_000_000_000))
    os.utime(paths["a"] + ".lock", (1_000_000_100, 1_000_000_100))
    monkeypatch.setattr(store, "INDEX_DIR_BYTES", 2 * size + size // 2)  # room for two
    _write_foreign(tmp_path / "c")
    c = tg.ArrayRecordSource(tmp_path / "c", codec="raw", index_dir=idx)
    assert os.path.exists(c._dindex.path)
    assert os.path.exists(paths["a"]) and not os.path.exists(paths["b"])
    assert [r["bytes"] for r in c.__getitems__([39, 0])] == [b"39", b"0"]


def test_the_build_lock_excludes_every_other_holder(tmp_path):
    # One builder per machine: while one process builds, another that asks for the lock
    # (to build, or to wait for the build) does not get it, not even a shared one.
    path = str(tmp_path / "arrayrecord-x.tgindex")
    with store.IndexDir(str(tmp_path))._lock("arrayrecord-x.tgindex"):
        fd = os.open(path + ".lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    fd = os.open(path + ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the builder's
    finally:
        os.close(fd)


def test_an_index_being_built_or_opened_under_its_lock_is_not_evicted(tmp_path, monkeypatch):
    idx = tmp_path / "idx"
    srcs = {}
    for name in ("a", "b"):
        _write_foreign(tmp_path / name)
        srcs[name] = tg.ArrayRecordSource(tmp_path / name, codec="raw", index_dir=idx)
    paths = {k: s._dindex.path for k, s in srcs.items()}
    os.utime(paths["a"] + ".lock", (1_000_000_000, 1_000_000_000))  # "a" least recent
    os.utime(paths["b"] + ".lock", (1_000_000_100, 1_000_000_100))
    monkeypatch.setattr(store, "INDEX_DIR_BYTES", os.path.getsize(paths["a"]) * 5 // 2)
    fd = os.open(paths["a"] + ".lock", os.O_RDWR)  # another process rebuilds "a"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _write_foreign(tmp_path / "c")
        tg.ArrayRecordSource(tmp_path / "c", codec="raw", index_dir=idx)
    finally:
        os.close(fd)
    assert os.path.exists(paths["a"]) and not os.path.exists(paths["b"])
    # Evicted is unlinked, never truncated: a source that maps it reads on.
    assert _records(srcs["b"], [39, 0]) == [b"39", b"0"]


def test_a_killed_builders_temp_files_are_deleted_and_a_live_ones_kept(tmp_path):
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / ".tmp").mkdir()
    dead = [  # this release's (a reserved file, its writer's), and earlier releases'
        ".tmp/.derived-x.tgindex-0-1-0a1b2c3d",
        ".tmp/..derived-x.tgindex-0-1-0a1b2c3d.kept.tmp-1-0a1b2c3d",
        ".derived-w.tgindex-0-1-0a1b2c3d",
        "..derived-w.tgindex-0-1-0a1b2c3d.kept.tmp-1-0a1b2c3d",
        ".derived-y.tgindex.tmp-1-0a1b2c3d",
        ".derived-y.tgindex.kept.tmp-1-0a1b2c3d",
    ]
    live = [".tmp/.derived-z.tgindex-0-1-0a1b2c3d", ".derived-z.tgindex-0-1-0a1b2c3e"]
    for name in [*dead, *live]:
        (idx / name).write_bytes(b"x" * 100)
    fill = lambda sink: sink.append("kept", np.arange(3)) or {}  # noqa: E731
    fd = os.open(idx / "derived-z.tgindex.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # its builder is alive
        ix = derived_index("demo", "k", {"kept": ("<i8", ())}, fill, index_dir=str(idx))
    finally:
        os.close(fd)
    assert ix.arrays["kept"].tolist() == [0, 1, 2]
    left = [n for n in os.listdir(idx) if n.startswith(".")]
    left += [f".tmp/{n}" for n in os.listdir(idx / ".tmp")]
    assert sorted(left) == sorted([".tmp", *live])


@pytest.mark.skipif(not os.path.isdir(BASE), reason="no checkout of the starting release")
def test_an_index_directory_of_the_earlier_release_is_used_as_it_is(tmp_path):
    # Built by the starting release's code: found, not built or verified again.
    _write_foreign(tmp_path / "ds")
    idx = tmp_path / "idx"
    script = (
        "import sys, numpy as np, torchgrain as tg\n"
        "from torchgrain.sources.node_index.derived import derived_index\n"
        "tg.ArrayRecordSource(sys.argv[1], codec='raw', index_dir=sys.argv[2])\n"
        "fill = lambda sink: sink.append('kept', np.arange(3)) or {}\n"
        "derived_index('demo', 'k', {'kept': ('<i8', ())}, fill, index_dir=sys.argv[2])\n"
    )
    env = dict(os.environ, PYTHONPATH=BASE)
    subprocess.run([sys.executable, "-c", script, tmp_path / "ds", idx], env=env, check=True)
    before = dict(COUNTERS)
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    fill = lambda sink: pytest.fail("built again")  # noqa: E731
    ix = derived_index("demo", "k", {"kept": ("<i8", ())}, fill, index_dir=str(idx))
    assert dict(COUNTERS) == before  # nothing built, nothing verified: its stamp was found
    assert _records(src, [39, 0]) == [b"39", b"0"] and ix.arrays["kept"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("slow", [False, True])
def test_an_openings_stats_are_each_shards_in_order_on_a_quick_or_a_slow_file_system(
    tmp_path, monkeypatch, slow
):
    """stat_shards stats a local disk's files one after another and a slow file system's
    (over 50 µs a file) on threads: either way each shard's own stat, in order, None for
    a missing one."""
    import threading
    import time

    from torchgrain.sources.node_index import arrayrecord as ar_index

    paths = []
    for i in range(300):
        p = tmp_path / f"{i:03d}.bin"
        if i != 250:
            p.write_bytes(b"x" * i)
        paths.append(str(p))
    threads = set()
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        threads.add(threading.get_ident())
        if slow:
            time.sleep(0.0002)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(ar_index.os, "stat", stat)
    got = ar_index.stat_shards(paths)
    assert [None if st is None else st.st_size for st in got] == [
        None if i == 250 else i for i in range(300)
    ]
    if slow:  # (a quick disk's stats may still go to threads on a machine this busy)
        assert len(threads) > 1
