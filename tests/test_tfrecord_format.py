"""TFRecordFormat on the public format contract: a FormatSource counts its files from the
offsets index (IndexesShards) without opening one, reads local and remote batches through
its byte ranges, keeps a shared format's index per source, and refuses random access to
a compressed file."""

from __future__ import annotations

import gzip
import pickle

import fsspec
import numpy as np
import pytest

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.sources.format import IndexesShards, ReadsByteRanges, ShardCounts
from torchgrain.sources.tfrecord import TFRecordFormat, TFRecordSource

FILES, PER_FILE = 6, 7


def write(root, first: int = 0) -> list[bytes]:
    root.mkdir(parents=True, exist_ok=True)
    recs = [f"r{first + i}".encode() * (1 + i % 4) for i in range(FILES * PER_FILE)]
    for f in range(FILES):
        write_tfrecord(recs[f * PER_FILE : (f + 1) * PER_FILE], str(root / f"p{f}.tfrecord"))
    return recs


def test_counted_from_the_index_without_opening_a_file(tmp_path):
    recs = write(tmp_path / "d")
    fmt = TFRecordFormat("raw", index_dir=str(tmp_path / "ix"))
    assert isinstance(fmt, IndexesShards) and isinstance(fmt, tg.sources.ShardFormat)
    src = tg.FormatSource(tmp_path / "d", format=fmt)
    assert isinstance(src.format.shards, ShardCounts)
    assert src._proc().readers == {}  # nothing opened to count
    assert len(src) == len(recs) and src.shard_counts.tolist() == [PER_FILE] * FILES
    idx = np.random.default_rng(0).permutation(len(recs)).tolist()
    assert [r["bytes"] for r in src.__getitems__(idx)] == [recs[i] for i in idx]
    reader = src._reader(0).reader  # (local batches read from one map of the files)
    assert isinstance(reader, ReadsByteRanges) and len(reader) == PER_FILE
    again = pickle.loads(pickle.dumps(src))
    assert [r["bytes"] for r in again.__getitems__([5, 0, 41])] == [recs[i] for i in (5, 0, 41)]
    # The same records as TFRecordSource's.
    tf = TFRecordSource(tmp_path / "d", codec="raw", index_dir=str(tmp_path / "ix"))
    assert tf.__getitems__(idx) == src.__getitems__(idx)


def test_a_shared_format_keeps_each_sources_index(tmp_path):
    a, b = write(tmp_path / "a"), write(tmp_path / "b", first=100)
    fmt = TFRecordFormat("raw", index_dir=None)
    sa, sb = (
        tg.FormatSource(tmp_path / "a", format=fmt),
        tg.FormatSource(tmp_path / "b", format=fmt),
    )
    assert fmt.shards is None  # each source indexed its own copy
    assert [r["bytes"] for r in sa.__getitems__([3, 40])] == [a[3], a[40]]
    assert [r["bytes"] for r in sb.__getitems__([3, 40])] == [b[3], b[40]]


def test_a_remote_batch_is_read_through_byte_ranges(tmp_path):
    recs = write(tmp_path / "d")
    mem = fsspec.filesystem("memory")
    for f in range(FILES):
        mem.pipe(f"/tff/p{f}.tfrecord", (tmp_path / "d" / f"p{f}.tfrecord").read_bytes())
    try:
        src = tg.FormatSource(
            "memory://tff", format=TFRecordFormat("raw", index_dir=None), io_threads=2
        )
        idx = [41, 0, 7, 7, 20]
        assert [r["bytes"] for r in src.__getitems__(idx)] == [recs[i] for i in idx]
    finally:
        mem.rm("/tff", recursive=True)


def test_a_compressed_file_is_counted_but_not_read_by_index(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    plain = tmp_path / "x.tfrecord"
    write_tfrecord([b"a", b"b", b"c"], str(plain))
    (d / "x.tfrecord.gz").write_bytes(gzip.compress(plain.read_bytes()))
    src = tg.FormatSource(d, format=TFRecordFormat("raw", index_dir=None))
    assert len(src) == 3
    with pytest.raises(tg.CorruptDataError, match=r"compressed .*record index 1"):
        src.__getitems__([1])
