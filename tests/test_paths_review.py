"""Reproducers found by comparing the ArrayRecord and TFRecord read paths with the
code before their refactor (the same inputs read by both)."""

from __future__ import annotations

import glob
import os
import threading

import torchgrain as tg
from torchgrain.errors import CorruptDataError
from torchgrain.formats.tfrecord import write_tfrecord


def test_a_fifo_in_place_of_a_files_kept_offsets_does_not_hang_the_open(tmp_path):
    # A FIFO where the index directory keeps a TFRecord file's offsets (a damaged or
    # hostile index_dir): the open waited for a writer forever. It is not the file's
    # offsets: walked again, the same records.
    d, idx = tmp_path / "d", tmp_path / "i"
    d.mkdir()
    write_tfrecord([b"a" * 10, b"b" * 30, b""], str(d / "x.tfrecord"))
    assert len(tg.TFRecordSource(d, index_dir=idx, codec="raw")) == 3
    for f in glob.glob(str(idx / "*.tgindex")):
        os.unlink(f)  # the dataset index and the file's offsets: a FIFO in the latter's place
        if ".offsets." in f:
            os.mkfifo(f)
            fifo = f
    got: list = []

    def open_and_read() -> None:
        try:
            src = tg.TFRecordSource(d, index_dir=idx, codec="raw")
            got.append([r["bytes"] for r in src.__getitems__([0, 1, 2])])
        except Exception as e:  # (reported below)
            got.append(e)

    t = threading.Thread(target=open_and_read, daemon=True)
    t.start()
    t.join(10)
    hung = t.is_alive()
    if hung:  # let the blocked open return (a writer opens and closes the FIFO)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(60)
    assert not hung
    assert got == [[b"a" * 10, b"b" * 30, b""]]


def test_a_damaged_kept_count_of_a_compressed_file_loses_no_record(tmp_path):
    # The index directory keeps a compressed file's record count (its stream is only
    # counted). A count damaged there (one bit: 5 -> 4) was taken as the file's: the
    # dataset had 4 records and a pass over the shard silently left the fifth out.
    d, idx = tmp_path / "d", tmp_path / "i"
    d.mkdir()
    write_tfrecord([b"g%d" % i for i in range(5)], str(d / "y.tfrecord.gz"), compression="gzip")
    assert len(tg.TFRecordSource(d, index_dir=idx, codec="raw")) == 5
    for f in glob.glob(str(idx / "*.tgindex")):
        if ".offsets." in f:
            with open(f, "r+b") as fh:  # its last 8 bytes: the count
                fh.seek(-8, os.SEEK_END)
                fh.write((4).to_bytes(8, "little"))
        else:
            os.unlink(f)  # the dataset index: built again from the kept count
    try:
        src = tg.TFRecordSource(d, index_dir=idx, codec="raw")
        got = (len(src), list(src.iter_shard_bytes(0)))
    except CorruptDataError:
        return  # refused, naming the damage: as good as walking the file again
    assert got == (5, [b"g%d" % i for i in range(5)])
