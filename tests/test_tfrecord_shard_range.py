"""A TFRecord source's shard out of range is named as every source names it."""

from __future__ import annotations

import pytest

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord


@pytest.mark.parametrize("shard", [1, -1])
def test_iter_shard_bytes_names_a_shard_out_of_range(tmp_path, shard):
    write_tfrecord([b"a", b"bb"], tmp_path / "x.tfrecord")
    src = tg.TFRecordSource(str(tmp_path / "x.tfrecord"), index_dir=None)
    with pytest.raises(IndexError, match=rf"shard {shard} out of range \[0, 1\)"):
        list(src.iter_shard_bytes(shard))
    assert list(src.iter_shard_bytes(0)) == [b"a", b"bb"]
