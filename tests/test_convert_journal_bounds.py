"""A conversion's journal files are read no further than a ceiling: a plan or shard
record planted in the output directory (a sparse file claiming hundreds of MiB) costs
no memory. An oversize plan is an error naming it; an oversize record is not taken,
and its shard is converted again."""

from __future__ import annotations

import os
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.convert.journal import Journal
from torchgrain.errors import CorruptDataError


def _converted(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"id": list(range(i * 10, i * 10 + 10))}), src / f"p{i}.parquet")
    tg.convert(src, dst, num_shards=2, progress=False)
    return src, dst, dst / ".torchgrain-convert"


def _plant(path, size: int, head: bytes) -> None:
    """Replace ``path`` by a sparse file of ``size`` bytes starting with ``head``."""
    with open(f"{path}.new", "wb") as f:
        f.write(head)
        f.truncate(size)
    os.replace(f"{path}.new", path)


def _peak(fn):
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    except BaseException as e:
        e.peak = tracemalloc.get_traced_memory()[1]
        raise
    finally:
        tracemalloc.stop()


def test_an_oversize_plan_is_refused_naming_it_without_reading_it(tmp_path):
    # Read whole, then refused as "not JSON": 512 MiB of NULs, a GiB of memory at least.
    src, dst, jdir = _converted(tmp_path)
    _plant(jdir / "plan.json", 512 << 20, b'{"tasks": [')
    with pytest.raises(CorruptDataError, match=r"plan\.json") as info:
        _peak(Journal(str(dst)).load_plan)
    assert info.value.peak < 16 << 20
    assert "MAX_PLAN_BYTES" in str(info.value)
    with pytest.raises(CorruptDataError, match=r"plan\.json.*MAX_PLAN_BYTES"):
        tg.convert(src, dst, num_shards=2, progress=False)
    assert [int(r["id"]) for r in tg.ArrayRecordSource(dst)] == list(range(20))  # kept


def test_an_oversize_shard_record_is_not_taken_and_its_shard_is_converted_again(tmp_path):
    # Read whole: 256 MiB of NULs, twice that in memory.
    src, dst, jdir = _converted(tmp_path)
    shard = dst / "data-00000-of-00002.array_record"
    before = os.stat(shard)
    _plant(jdir / "shard-00000.json", 256 << 20, b'{"index": 0, ')
    records, peak = _peak(Journal(str(dst)).done)
    assert sorted(records) == [1] and peak < 16 << 20
    tg.convert(src, dst, num_shards=2, progress=False)
    after = os.stat(shard)
    assert (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns)
    assert os.path.getsize(jdir / "shard-00000.json") < 4096  # its record written again
    assert [int(r["id"]) for r in tg.ArrayRecordSource(dst)] == list(range(20))
