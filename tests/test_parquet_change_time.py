"""A local Parquet shard's version includes its change time: bytes rewritten in place
with the size and modification time put back (``cp -p`` onto it, ``rsync --inplace -t``)
are refused by a source opened before, at its reader's opening as at a read, and never
stored in the decoded cache under the key of what the file held."""

from __future__ import annotations

import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg


def _shard(path: str, base: int) -> None:
    """Eight int64s in two row groups, plain, uncompressed, no statistics: files of other
    values are of one size and one footer."""
    table = pa.table({"x": pa.array([base + i for i in range(8)], pa.int64())})
    pq.write_table(
        table,
        path,
        row_group_size=4,
        compression="none",
        write_statistics=False,
        use_dictionary=False,
    )


def _copy_keeping_times(src: str, dst: str) -> None:
    """What ``cp -p src dst`` does to an existing ``dst``: written in place, its
    modification time put back (its inode kept)."""
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


def _entries(cache: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache, "*", "*.arrow")))


@pytest.fixture
def shard(tmp_path) -> str:
    path = str(tmp_path / "ds" / "a.parquet")
    os.makedirs(os.path.dirname(path))
    _shard(path, 0)
    _shard(str(tmp_path / "other.parquet"), 100)
    return path


def test_a_shard_rewritten_before_its_reader_opens_is_refused(tmp_path, shard) -> None:
    cache = str(tmp_path / "dc")
    src = tg.ParquetSource(str(tmp_path / "ds"), decoded_cache=cache, cache_bytes=0)
    _copy_keeping_times(str(tmp_path / "other.parquet"), shard)  # no reader open yet
    with pytest.raises(tg.CorruptDataError, match=r"a\.parquet.*changed since the dataset"):
        src[5]
    assert _entries(cache) == []
    # Opened again, the source reads what the file holds now.
    assert tg.ParquetSource(str(tmp_path / "ds"), decoded_cache=cache, cache_bytes=0)[5] == {
        "x": 105
    }


def test_a_rewritten_shard_is_not_stored_in_the_decoded_cache_under_its_old_key(
    tmp_path, shard
) -> None:
    cache = str(tmp_path / "dc")
    src = tg.ParquetSource(str(tmp_path / "ds"), decoded_cache=cache, cache_bytes=0)
    assert src[0] == {"x": 0}
    stored = _entries(cache)
    assert len(stored) == 1  # row group 0, of the file as it was
    _copy_keeping_times(str(tmp_path / "other.parquet"), shard)
    for _ in range(2):
        with pytest.raises(tg.CorruptDataError, match="changed since the dataset"):
            src[5]
    assert _entries(cache) == stored
    with pytest.raises(tg.CorruptDataError, match="changed since the dataset"):
        src.__getitems__([0, 5])


def test_a_shard_whose_mode_changed_asks_to_open_the_dataset_again(tmp_path, shard) -> None:
    src = tg.ParquetSource(str(tmp_path / "ds"), cache_bytes=0)
    assert src[0] == {"x": 0}
    os.chmod(shard, 0o640)  # moves the change time: not told apart from a write
    with pytest.raises(tg.CorruptDataError, match=r"mode, owner or links changed.*open it again"):
        src[5]
    assert tg.ParquetSource(str(tmp_path / "ds"), cache_bytes=0)[5] == {"x": 5}
