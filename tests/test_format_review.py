"""Review of the public format contract (torchgrain/sources/format.py) through the example
format of docs/sources.md (docs/snippets/fixed_format.py): faults found by reproduction,
locally and against a real 127.0.0.1 server. Each test showed one fault (a strict xfail
until it was fixed)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import torchgrain as tg
from docs.snippets import fixed_format
from docs.snippets.fixed_format import FixedReader, FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from torchgrain.diagnostics import COUNTER, local_counters
from torchgrain.io import responses


def ids(records: list[dict]) -> list[int]:
    return [r["i"] for r in records]


@pytest.fixture
def data(tmp_path):
    """12 records {"i": i} in 3 local shards of 4."""
    root = tmp_path / "www" / "d"
    write_fixed([{"i": i} for i in range(12)], str(root), num_shards=3)
    return root


def use_reader(monkeypatch, reader: type) -> None:
    """Readers opened from now on are ``reader`` (FixedFormat.open looks the name up)."""
    monkeypatch.setattr(fixed_format, "FixedReader", reader)


def test_a_cached_copy_of_an_older_version_is_not_served(tmp_path):
    # A job reads a remote dataset through cache_dir; the files are then replaced (same
    # names, same record counts, longer records). The next job counts and sizes the new
    # files (FormatSource._sizes) but reads the old copies from the cache: old records,
    # no error (ShardCache._hit rejects a copy of another size only when told the size).
    root = tmp_path / "www" / "d"
    write_fixed([{"i": i} for i in range(4)], str(root))
    with RangeHTTPServer(tmp_path / "www") as srv:
        first = FixedSource(f"{srv.url}/d", cache_dir=str(tmp_path / "cache"))
        assert ids(first.__getitems__([0, 1])) == [0, 1]
        first.close()
        for f in root.iterdir():
            f.unlink()
        write_fixed([{"i": 100 + i, "pad": "x" * 50} for i in range(4)], str(root))
        responses._PINS.clear()  # the next job is a new process: nothing pinned
        second = FixedSource(f"{srv.url}/d", cache_dir=str(tmp_path / "cache"))
        assert ids(second.__getitems__([0, 1])) == [100, 101]


class _NegativeLen(FixedReader):
    def __len__(self):
        return -1


class _HugeLen(FixedReader):
    def __len__(self):
        return 2**64


@pytest.mark.parametrize("reader", [_NegativeLen, _HugeLen])
def test_a_shard_whose_reader_has_no_valid_length_is_corrupt_data_naming_it(
    data, monkeypatch, reader
):
    # A header that decodes to a length Python's len() refuses (negative, over 2**63).
    use_reader(monkeypatch, reader)
    with pytest.raises(tg.CorruptDataError, match=r"fixed shard 0 .*data-00000-of-00003"):
        FixedSource(str(data))


class _HostileOffsets(FixedReader):
    def byte_ranges(self, rows):
        raise ValueError("offsets table points backwards")


class _CorruptOffsets(FixedReader):
    def byte_ranges(self, rows):
        raise tg.CorruptDataError("offsets table points backwards")


@pytest.mark.parametrize("reader", [_HostileOffsets, _CorruptOffsets])
def test_a_remote_reader_failing_to_give_byte_ranges_is_named(data, monkeypatch, reader):
    with RangeHTTPServer(data.parent) as srv:
        use_reader(monkeypatch, reader)
        src = FixedSource(f"{srv.url}/d")
        with pytest.raises(
            tg.CorruptDataError, match=r"fixed shard 1 .*data-00001-of-00003.*record index 5"
        ):
            src.__getitems__([5])


class _Buggy(FixedReader):
    def decode(self, rows, chunks):
        return [None + 1]  # a programming error of the format, not bad data


def test_a_bug_in_the_format_code_surfaces_as_itself(data, monkeypatch):
    use_reader(monkeypatch, _Buggy)
    src = FixedSource(str(data))
    with pytest.raises(TypeError):
        src.__getitems__([5])


def test_a_local_shard_rewritten_in_place_while_open_is_detected(data, tmp_path):
    src = FixedSource(str(data))
    assert src[1]["i"] == 1  # shard 0 open, its header read
    other = tmp_path / "other"
    (path,) = write_fixed([{"i": 20 + i} for i in range(4)], str(other))
    new = Path(path).read_bytes()
    with open(src.paths[0], "r+b") as f:  # same size, new bytes (cp, rsync --inplace)
        assert len(new) == f.seek(0, 2)
        f.seek(0)
        f.write(new)
    with pytest.raises(tg.CorruptDataError):
        src[2]  # returns {"i": 22}: the new file's record, at the offsets of the old one


def test_a_reader_evicted_while_another_thread_reads_it_still_reads(data, monkeypatch):
    entered, release = threading.Event(), threading.Event()

    class Gated(FixedReader):
        def byte_ranges(self, rows):
            if self.file.shard == 0 and not release.is_set():
                entered.set()  # thread A has shard 0's reader and is reading it
                release.wait(30)
            return super().byte_ranges(rows)

    use_reader(monkeypatch, Gated)
    src = FixedSource(str(data), max_open_files=1)
    got: list = []
    reading = threading.Thread(target=lambda: got.append(_result(src, [0, 1])))
    reading.start()
    try:
        assert entered.wait(30)
        assert ids(src.__getitems__([5])) == [5]  # opens shard 1: shard 0 evicted, closed
        assert ids(src.__getitems__([9])) == [9]  # shard 2 may get shard 0's old fd
    finally:
        release.set()
        reading.join(30)
    assert not isinstance(got[0], BaseException), repr(got[0])
    assert ids(got[0]) == [0, 1]


def _result(src: tg.Source, indices: list[int]):
    try:
        return src.__getitems__(indices)
    except Exception as e:
        return e


def test_schema_and_keys_are_not_those_of_the_first_record_alone(tmp_path):
    recs = [{"i": 0}, {"i": 1, "label": "cat"}, {"i": 2, "label": None}]
    write_fixed(recs, str(tmp_path / "d"))
    src = FixedSource(str(tmp_path / "d"))
    assert "label" in src.keys
    assert (
        src.schema["label"]
        == tg.sources.merge_schema(
            tg.sources.merge_schema(tg.sources.merge_schema({}, recs[0]), recs[1]), recs[2]
        )["label"]
    )


def test_a_corrupt_record_error_names_that_record(data):
    # Record 6 (shard 1, row 2): its slot's length field claims more than the slot holds.
    path = data / "data-00001-of-00003.fixed"  # (before the source opens it: not a rewrite)
    width = int(np.frombuffer(path.read_bytes()[8:12], "<u4")[0])
    with open(path, "r+b") as f:
        f.seek(16 + 2 * width)
        f.write((width * 2).to_bytes(4, "little"))
    src = FixedSource(str(data))
    with pytest.raises(tg.CorruptDataError, match=r"record index 6\b"):
        src.__getitems__([4, 5, 6, 7])


class _ReadOnly:
    """A reader without byte ranges (a format whose reads are not one range a record)."""

    def __init__(self, file, width, count):
        self.ranged = FixedReader(file, width, count)

    def __len__(self):
        return len(self.ranged)

    def read(self, rows):
        return self.ranged.read(rows)  # bytes through ShardFile.read_ranges

    def close(self):
        pass


def test_bytes_a_reader_without_byte_ranges_reads_are_counted(data, monkeypatch):
    use_reader(monkeypatch, _ReadOnly)
    src = FixedSource(str(data))
    before = local_counters()[COUNTER["bytes_read"]]
    assert ids(src.__getitems__(list(range(12)))) == list(range(12))
    assert local_counters()[COUNTER["bytes_read"]] > before
