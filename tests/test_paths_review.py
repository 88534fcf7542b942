"""Reproducers found by comparing the ArrayRecord and TFRecord read paths with the
code before their refactor (the same inputs read by both)."""

from __future__ import annotations

import glob
import os
import threading

import torchgrain as tg
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
