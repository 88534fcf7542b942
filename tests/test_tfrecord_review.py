"""TFRecord's read path through one map of every file and its streamed offsets index,
against hostile and changing inputs: each test here reproduces a defect found there."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.formats.tfrecord import _frame, _walk_buffered, iter_tfrecord_offsets
from torchgrain.io.region import supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_per_file_cache_not_starting_at_zero_is_walked_again(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    recs = [b"a" * 4, b"b" * 4, b"c" * 4]  # frames at 0, 20 and 40
    (d / "p.tfrecord").write_bytes(b"".join(_frame(r) for r in recs))
    ix = tmp_path / "index"
    tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))
    (cache,) = ix.glob("*.offsets.tgindex")
    # Increasing, 16 bytes apart, within the file: only the first offset is wrong.
    with open(cache, "wb") as f:
        np.save(f, np.array([20, 40], np.int64))
    for f in ix.glob("tfrecord-*"):
        if f.is_file():
            f.unlink()
    src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))
    assert [r["bytes"] for r in src.__getitems__([0, 1, 2])] == recs


_HELD = textwrap.dedent(
    """
    import os, sys, warnings
    sys.path.insert(0, sys.argv[1])
    warnings.simplefilter("ignore")
    import numpy as np
    import torchgrain as tg
    from torchgrain.errors import CorruptDataError
    from torchgrain.formats.tfrecord import _frame, _walk_buffered

    d = sys.argv[2]
    for f in range(3):
        frames = b"".join(_frame(bytes([f * 10 + r]) * 20000) for r in range(4))
        open(os.path.join(d, f"p{f}.tfrecord"), "wb").write(frames)
    src = tg.TFRecordSource(d, codec="raw", index_dir=None)
    src.__getitems__([0, 7, 9])  # every file mapped
    region = src.format._mapped(src.paths)
    if not region._watched[region.slot_of[1]]:
        sys.exit(print("unwatched"))  # no inotify: each read stats its files again
    region.acquire(np.array([0]))  # a read in progress in another thread
    os.truncate(os.path.join(d, "p1.tfrecord"), 100)
    src.__getitems__([0, 9])  # sees the change; p1 is still in use: left mapped
    region.release()
    try:
        src.__getitems__([7])  # p1's record 3, now past the file's end
    except CorruptDataError as e:
        print("refused:", e)
    """
)


@pytest.mark.skipif(not supported(), reason="one map of every file needs Linux x86-64/arm64")
def test_shard_changed_during_another_read_is_refused_not_read(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _HELD, ROOT, str(d)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"exit status {run.returncode}: {run.stderr[-2000:]}"
    if run.stdout.strip() == "unwatched":
        pytest.skip("no inotify watch here: changes are seen by a stat at each read")
    assert "refused:" in run.stdout and "p1.tfrecord" in run.stdout


def test_index_dir_inside_the_data_directory_opens_twice(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.tfrecord").write_bytes(_frame(b"x") + _frame(b"y"))
    for _ in range(2):
        src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(d / ".index"))
        assert (len(src), src.num_shards) == (2, 1)


def test_offsets_walk_stops_at_the_size_it_was_given():
    data = b"".join(_frame(b"ab") for _ in range(100))  # frames of 18 bytes
    size = 18 * 60  # the size read before a writer appended 40 more records
    parts = list(_walk_buffered(io.BytesIO(data), "x.tfrecord", size, True, 1 << 16))
    assert np.concatenate(parts).tolist() == list(range(0, size, 18))


def test_offsets_walk_of_a_file_stops_at_the_size_recorded(tmp_path):
    p = tmp_path / "x.tfrecord"
    p.write_bytes(b"".join(_frame(b"ab") for _ in range(100)))  # appended after indexing
    parts = iter_tfrecord_offsets(str(p), size=18 * 60)
    assert np.concatenate(list(parts)).tolist() == list(range(0, 18 * 60, 18))


def test_files_in_hidden_directories_are_not_shards(tmp_path):
    d = tmp_path / "data"
    (d / ".old").mkdir(parents=True)
    (d / "train.tfrecord").write_bytes(_frame(b"x"))
    (d / ".old" / "train.tfrecord").write_bytes(_frame(b"y") * 3)
    assert len(tg.TFRecordSource(str(d), codec="raw", index_dir=None)) == 1


def test_offset_caches_are_not_named_as_data_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.tfrecord").write_bytes(_frame(b"x"))
    tg.TFRecordSource(str(d), codec="raw", index_dir=str(tmp_path / "ix"))
    (cache,) = (tmp_path / "ix").glob("*.offsets.tgindex")
    assert ".tfrecord" not in cache.name


def test_per_file_offset_caches_are_held_within_the_index_directory_budget(tmp_path, monkeypatch):
    """Each file's offsets are entries of the index directory, as its dataset indexes:
    counted in INDEX_DIR_BYTES and evicted least recently used first (they were files
    beside the store, never counted nor evicted: one more per version of each file)."""
    from torchgrain.sources.node_index import store

    monkeypatch.setattr(store, "INDEX_DIR_BYTES", 4096)
    d, ix = tmp_path / "data", tmp_path / "ix"
    d.mkdir()
    for version in range(6):
        for k in range(4):
            path = d / f"p{k}.tfrecord"
            path.write_bytes(_frame(bytes([version]) * 8) * 20)
            os.utime(path, ns=(10**18 + version, 10**18 + version))  # a new version
        src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))
        assert src[79]["bytes"] == bytes([version]) * 8
    held = [f for f in ix.iterdir() if f.suffix in (".tgindex", ".npy")]
    assert sum(f.stat().st_size for f in held) <= 4096, sorted(f.name for f in held)
    assert any(f.name.endswith(".offsets.tgindex") for f in held)


def _reopen(d, ix):
    """The source opened again once its dataset index is gone (its files' own offsets
    kept: the index is built from them)."""
    for f in ix.glob("tfrecord-*"):
        if f.is_file():
            f.unlink()
    return tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))


def test_offsets_kept_in_an_earlier_format_are_walked_again_not_misread(tmp_path):
    """An entry an earlier release kept (a .npy file of offsets, or of a compressed
    file's count) under the name of a file's offsets is not taken for them: it holds
    plausible offsets here (from 0, 20 bytes apart, within the file) of 2 records of 3,
    and a count of 7 of a stream of 3."""
    d, ix = tmp_path / "data", tmp_path / "index"
    d.mkdir()
    recs = [b"a" * 4, b"b" * 4, b"c" * 4]  # frames at 0, 20 and 40
    (d / "p.tfrecord").write_bytes(b"".join(_frame(r) for r in recs))
    tg.formats.tfrecord.write_tfrecord(recs, str(d / "q.tfrecord.gz"))
    tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))
    kept = sorted(ix.glob("*.offsets.tgindex"))
    assert len(kept) == 2
    for entry in kept:
        with open(entry, "wb") as f:
            np.save(f, np.array([7] if "_gz" in entry.name else [0, 20], np.int64))
    src = _reopen(d, ix)
    assert len(src) == 6
    assert [r["bytes"] for r in src.__getitems__([0, 1, 2])] == recs
    assert [r["bytes"] for r in src.iter_shard(1)] == recs
    for entry in kept:  # kept again, in the format of this release
        assert not entry.read_bytes().startswith(b"\x93NUMPY")


@pytest.mark.parametrize("records", [3, (1 << 16) + 5])
def test_offsets_kept_per_file_rebuild_the_dataset_index_without_a_walk(
    tmp_path, monkeypatch, records
):
    """A file's offsets kept in the index directory build the dataset index again
    without walking the file: one chunk of offsets, and more than one (read twice:
    checked, then given)."""
    from torchgrain.sources import tfrecord as source

    d, ix = tmp_path / "data", tmp_path / "index"
    d.mkdir()
    (d / "p.tfrecord").write_bytes(_frame(b"") * records)  # 16-byte frames
    tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))

    def no_walk(*args, **kwargs):
        raise AssertionError("walked again")

    monkeypatch.setattr(source, "iter_tfrecord_offsets", no_walk)
    src = _reopen(d, ix)
    assert len(src) == records
    assert src.format.shards.index.offsets[[0, 1, records - 1, records]].tolist() == [
        0,
        16,
        16 * (records - 1),
        16 * records,
    ]
    (entry,) = ix.glob("*.offsets.tgindex")
    with open(entry, "r+b") as f:  # damaged: its last offset past the file's end
        f.seek(-8, os.SEEK_END)
        f.write(np.int64(16 * records).tobytes())
    with pytest.raises(AssertionError, match="walked again"):
        _reopen(d, ix)


def _stored_gzip(path, records) -> None:
    """A gzip TFRecord file of ``records``, stored (not deflated): its size is theirs."""
    import gzip

    data = b"".join(_frame(r) for r in records)
    path.write_bytes(gzip.compress(data, compresslevel=0, mtime=0))


@pytest.mark.parametrize("counted, now", [(100, 50), (50, 100)], ids=["fewer", "more"])
def test_a_compressed_stream_other_than_counted_is_an_error_not_fewer_records(
    tmp_path, monkeypatch, counted, now
):
    """A stream rewritten in place with its size and modification time kept is counted
    anew (its change time keys the index). Where its index is reused all the same (a
    filesystem whose change times and inodes say nothing, simulated here), reading it
    in order ends at the count indexed, or short of it, never silently; it is a named
    CorruptDataError."""
    d = tmp_path / "data"
    d.mkdir()
    path = d / "d-0.tfrecord.gz"
    records = {100: [b"a%029d" % i for i in range(100)], 50: [b"b%075d" % i for i in range(50)]}
    _stored_gzip(path, records[counted])
    st = os.stat(path)
    ix = tmp_path / "ix"
    assert len(tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))) == counted
    _stored_gzip(path, records[now])
    assert os.path.getsize(path) == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))
    assert len(src) == len(list(src.iter_shard(0))) == now  # (counted anew)
    from torchgrain.sources import tfrecord

    stamp = tfrecord._size_and_stamp

    def old_stamp(*args):
        size, _, ctime, etag = stamp(*args)
        return size, f"{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}", ctime, etag

    monkeypatch.setattr(tfrecord, "_size_and_stamp", old_stamp)
    src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(ix))
    assert len(src) == counted  # (the index of the file as it was)
    said = "more" if now > counted else "fewer"
    with pytest.raises(tg.CorruptDataError, match=f"shard 0 .*{said}"):
        list(src.iter_shard(0))
    assert len(list(src.iter_shard(0, 0, 10))) == 10  # (a part of it: no more read)


def test_offsets_kept_for_another_file_of_the_same_size_are_not_taken(tmp_path):
    """Each file's kept offsets hold its key: an entry of another file (of the same size)
    under its name is walked again, not read as its offsets."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "p.tfrecord").write_bytes(_frame(b"x" * 4) * 10)  # 20-byte frames
    (b / "p.tfrecord").write_bytes(_frame(b"y" * 24) * 5)  # 40-byte frames
    ix_a, ix_b = tmp_path / "ix_a", tmp_path / "ix_b"
    tg.TFRecordSource(str(a), codec="raw", index_dir=str(ix_a))
    tg.TFRecordSource(str(b), codec="raw", index_dir=str(ix_b))
    (entry_a,) = ix_a.glob("*.offsets.tgindex")
    (entry_b,) = ix_b.glob("*.offsets.tgindex")
    os.replace(entry_b, entry_a)
    src = _reopen(a, ix_a)
    assert [r["bytes"] for r in src.__getitems__(range(10))] == [b"x" * 4] * 10
