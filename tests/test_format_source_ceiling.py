"""FormatSource reads a batch whatever its size: the per-read ceiling bounds the distinct
byte ranges of one shard by the larger of MAX_FILE_BYTES and the file's size, so valid
records are never refused as corrupt because a batch holds many (or repeats) of them."""

from __future__ import annotations

import pytest

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.sources import format as format_module
from torchgrain.sources.tfrecord import TFRecordFormat


@pytest.mark.parametrize("batch", [[0, 1, 2], [2, 2, 2, 2, 0], [1, 0, 1]])
def test_a_batch_past_the_ceiling_within_its_file_is_read(tmp_path, monkeypatch, batch):
    recs = [bytes([i]) * 600 for i in range(3)]
    write_tfrecord(recs, str(tmp_path / "a.tfrecord"))
    # A ceiling of 1,000 bytes (one record is 616): a 1 GiB one, scaled down.
    monkeypatch.setattr(format_module, "MAX_FILE_BYTES", 1000)
    monkeypatch.setitem(format_module.ShardFile.read_ranges.__kwdefaults__, "max_bytes", 1000)
    src = tg.FormatSource(tmp_path, format=TFRecordFormat("raw", index_dir=None))
    assert [r["bytes"] for r in src.__getitems__(batch)] == [recs[i] for i in batch]
