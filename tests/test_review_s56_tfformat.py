"""FormatSource over TFRecordFormat against TFRecordSource on the same data: a file
replaced after the dataset was opened (same size, same record lengths) is refused by
both, not read as the new file's records."""

from __future__ import annotations

import os
import time

import pytest

import torchgrain as tg
from torchgrain.errors import CorruptDataError, RemoteIOError
from torchgrain.formats.tfrecord import write_tfrecord


def _write(root, tag: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(3):
        recs = [f"{tag}{f}_{i}".encode() * (1 + i) for i in range(4)]
        write_tfrecord(recs, str(root / f"p{f}.tfrecord"))


def _replace_same_size(root) -> None:
    """p0 rewritten with other records of the same lengths: same size, same offsets,
    sound CRCs, a new change time."""
    before = os.stat(root / "p0.tfrecord")
    time.sleep(0.01)
    write_tfrecord([f"X0_{i}".encode() * (1 + i) for i in range(4)], str(root / "p0.tfrecord"))
    after = os.stat(root / "p0.tfrecord")
    assert after.st_size == before.st_size and after.st_ctime_ns != before.st_ctime_ns


@pytest.mark.parametrize("index_dir", ["ix", None])
def test_tfrecord_source_refuses_a_local_file_replaced_after_opening(tmp_path, index_dir):
    """TFRecordSource: a local file replaced after opening, with the same size and record
    lengths, is refused naming the shard and file (its change time differs)."""
    _write(tmp_path / "d", "r")
    ix = None if index_dir is None else str(tmp_path / index_dir)
    src = tg.TFRecordSource(tmp_path / "d", codec="raw", index_dir=ix)
    _replace_same_size(tmp_path / "d")
    with pytest.raises(CorruptDataError, match=r"shard 0 .*p0\.tfrecord.*changed since"):
        src.__getitems__([1])


@pytest.mark.parametrize("index_dir", ["ix", None])
def test_format_source_refuses_a_local_file_replaced_after_opening(tmp_path, index_dir):
    """FormatSource(format=TFRecordFormat()): the shards are counted from the index, not
    opened, so the first read is the first open; a file replaced between the two (same
    size, same record lengths, sound CRCs) must be refused as TFRecordSource refuses it,
    not read as the other file's records against an index built from the first."""
    from torchgrain.sources.tfrecord import TFRecordFormat

    _write(tmp_path / "d", "r")
    ix = None if index_dir is None else str(tmp_path / index_dir)
    src = tg.FormatSource(tmp_path / "d", format=TFRecordFormat("raw", index_dir=ix))
    _replace_same_size(tmp_path / "d")
    with pytest.raises(CorruptDataError, match=r"shard 0 .*p0\.tfrecord.*changed"):
        src.__getitems__([1])


_TRUNCATED_INDEX = r"""
import glob, os, sys
import torchgrain as tg
from torchgrain.sources.tfrecord import TFRecordSource

d, ix, kind, warm = sys.argv[1:5]
if kind == "format":
    from torchgrain.sources.tfrecord import TFRecordFormat

    src = tg.FormatSource(d, format=TFRecordFormat("raw", index_dir=ix))
else:
    src = TFRecordSource(d, codec="raw", index_dir=ix)
if warm == "1":
    src.__getitems__([0, 5, 11])
(main,) = glob.glob(os.path.join(ix, "tfrecord-*.tgindex"))
os.truncate(main, 0)
try:
    src.__getitems__([1, 6, 10])
except Exception as e:
    print("REFUSED", type(e).__name__, e)
else:
    print("READ")
"""


def _read_after_truncating_the_index(tmp_path, kind: str, warm: bool):
    import subprocess
    import sys

    _write(tmp_path / "d", "r")
    args = [str(tmp_path / "d"), str(tmp_path / "ix"), kind, "1" if warm else "0"]
    return subprocess.run(
        [sys.executable, "-c", _TRUNCATED_INDEX, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("warm", [False, True])
def test_tfrecord_source_refuses_reads_once_its_index_file_is_truncated(tmp_path, warm):
    """TFRecordSource: the node-shared index file truncated under a running job (its map
    no longer backed) is refused as changed while open; the process lives on."""
    got = _read_after_truncating_the_index(tmp_path, "source", warm)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "REFUSED ChangedWhileOpen" in got.stdout and "changed while open" in got.stdout


@pytest.mark.parametrize("warm", [False, True])
def test_format_source_refuses_reads_once_its_index_file_is_truncated(tmp_path, warm):
    """FormatSource(format=TFRecordFormat()) maps the same node-shared index: truncated
    under a running job, a read must be refused as TFRecordSource refuses it (changed
    while open), not kill the process with SIGBUS reading the map."""
    got = _read_after_truncating_the_index(tmp_path, "format", warm)
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])
    assert "REFUSED ChangedWhileOpen" in got.stdout and "changed while open" in got.stdout


def _bad_crc(root) -> None:
    """A byte of record 4's payload (p1's first record) flipped: its data CRC fails."""
    _write(root, "r")
    data = bytearray((root / "p1.tfrecord").read_bytes())
    data[14] ^= 1
    (root / "p1.tfrecord").write_bytes(bytes(data))


@pytest.mark.parametrize("verify", [False, True])
def test_tfrecord_source_verifies_as_verify_checksums_says(tmp_path, verify):
    """TFRecordSource: verify_checksums=False reads a record whose CRC fails as stored,
    verify_checksums=True refuses it naming the file."""
    _bad_crc(tmp_path / "d")
    src = tg.TFRecordSource(tmp_path / "d", codec="raw", index_dir=None, verify_checksums=verify)
    if verify:
        with pytest.raises(CorruptDataError, match=r"p1\.tfrecord: data checksum mismatch"):
            src.__getitems__([4])
    else:
        assert src.__getitems__([4]) == [{"bytes": b"r1^0"}]


@pytest.mark.parametrize("verify", [False, True])
def test_format_source_verifies_as_verify_checksums_says(tmp_path, verify):
    """FormatSource(format=TFRecordFormat(), verify_checksums=...): the read option that
    says whether the format's stored checksums are checked is honoured as TFRecordSource
    honours it (whatever the format object's own default): True must refuse a record
    whose data CRC fails, False read it as stored."""
    from torchgrain.sources.tfrecord import TFRecordFormat

    _bad_crc(tmp_path / "d")
    fmt = TFRecordFormat("raw", index_dir=None, verify=not verify)
    src = tg.FormatSource(tmp_path / "d", format=fmt, verify_checksums=verify)
    if verify:
        with pytest.raises(CorruptDataError, match=r"p1\.tfrecord: data checksum mismatch"):
            src.__getitems__([4])
    else:
        assert src.__getitems__([4]) == [{"bytes": b"r1^0"}]


def test_remote_in_order_read_refuses_a_file_a_later_opening_saw_replaced(tmp_path):
    """A remote TFRecord file replaced on the server after a source opened it (same size
    and record lengths), then opened again by a second source in the same process: the
    first source refuses to read it, in order (iter_shard) as by index (__getitems__),
    rather than return the new file's records against the index of the first."""
    from tests.servers import RangeHTTPServer

    _write(tmp_path / "d", "r")
    with RangeHTTPServer(tmp_path) as srv:
        urls = [f"{srv.url}/d/p{f}.tfrecord" for f in range(3)]
        src = tg.TFRecordSource(urls, codec="raw", index_dir=None)
        time.sleep(1.1)  # a new Last-Modified (whole seconds), so a new ETag
        write_tfrecord(
            [f"X1_{i}".encode() * (1 + i) for i in range(4)], str(tmp_path / "d/p1.tfrecord")
        )
        tg.TFRecordSource(urls, codec="raw", index_dir=None)  # the later opening
        with pytest.raises((RemoteIOError, CorruptDataError), match=r"p1\.tfrecord.*(changed|412)"):
            src.__getitems__([5])
        with pytest.raises((RemoteIOError, CorruptDataError), match=r"p1\.tfrecord.*(changed|412)"):
            list(src.iter_shard(1))


def test_format_source_refuses_a_compressed_file_which_tfrecord_source_reads_in_order(tmp_path):
    """A gzip TFRecord file is counted and can be read in order (iter_shard) by
    TFRecordSource, though not by index; FormatSource(format=TFRecordFormat()) counts it
    and refuses both (it reads by index only), naming the file and what to do."""
    from torchgrain.sources.tfrecord import TFRecordFormat

    d = tmp_path / "d"
    d.mkdir()
    recs = [[f"r{f}_{i}".encode() * (1 + i) for i in range(4)] for f in range(2)]
    for f in range(2):
        write_tfrecord(recs[f], str(d / f"p{f}.tfrecord.gz"))
    tf = tg.TFRecordSource(d, codec="raw", index_dir=None)
    assert [r["bytes"] for r in tf.iter_shard(1)] == recs[1]
    src = tg.FormatSource(d, format=TFRecordFormat("raw", index_dir=None))
    assert len(src) == 8
    with pytest.raises(CorruptDataError, match=r"compressed and can only be read in order"):
        src.__getitems__([5])
    with pytest.raises(CorruptDataError, match=r"p1\.tfrecord\.gz.*compressed and can only"):
        list(src.iter_shard(1))


def test_a_stale_sources_schema_is_the_opened_versions_or_refused(tmp_path):
    """The schema of a source whose remote file a later opening saw replaced: known from
    its opening when that read the first record (``codec="auto"``), so a concat of it
    builds (its reads refuse); else read in order from the version opened, which is
    refused (naming the file), never taken from the new file."""
    from tests.servers import RangeHTTPServer

    _write(tmp_path / "d", "r")
    with RangeHTTPServer(tmp_path) as srv:
        urls = [f"{srv.url}/d/p{f}.tfrecord" for f in range(3)]
        auto = tg.TFRecordSource(urls, index_dir=None)
        raw = tg.TFRecordSource(urls, codec="raw", index_dir=None)
        time.sleep(1.1)  # a new Last-Modified (whole seconds), so a new ETag
        for f in range(3):
            write_tfrecord([b"\x00" * 7] * 4, str(tmp_path / f"d/p{f}.tfrecord"))
        new = tg.TFRecordSource(urls, codec="raw", index_dir=None)  # the later opening
        assert auto.schema == {"bytes": "bytes"} and auto.codec.name == "raw"
        both = tg.concat([new, auto])
        assert both[0] == {"bytes": b"\x00" * 7}
        with pytest.raises(RemoteIOError, match=r"p0\.tfrecord"):
            both[len(new)]
        with pytest.raises(RemoteIOError, match=r"p0\.tfrecord"):
            _ = raw.schema
