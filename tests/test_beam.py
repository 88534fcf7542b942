"""The Beam conversion pipeline on the DirectRunner (runs where apache-beam is installed).

CI runs it in its own virtualenv (scripts/test_beam.sh): apache-beam pins pyarrow
below the version the main environment uses.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord

pytest.importorskip("apache_beam")

from torchgrain.beam import main, run_conversion


@pytest.fixture
def parquet_dir(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    for s, n in enumerate([30, 0, 45, 11]):
        t = pa.table(
            {
                "i": list(range(s * 100, s * 100 + n)),
                "v": [np.arange(k % 5, dtype=np.float32) for k in range(n)],
                "s": [f"r{k}" for k in range(n)],
            }
        )
        pq.write_table(t, d / f"part-{s}.parquet", row_group_size=8)
    return str(d)


def test_beam_matches_convert(parquet_dir, tmp_path):
    ref = tg.convert(parquet_dir, tmp_path / "ref", num_shards=4)
    m = run_conversion(parquet_dir, tmp_path / "beam", num_shards=4)
    assert [(s.path, s.num_records, s.checksum) for s in m.shards] == [
        (s.path, s.num_records, s.checksum) for s in ref.shards
    ]
    src = tg.ArrayRecordSource(tmp_path / "beam", index_dir=tmp_path / "idx")
    assert [r["i"] for r in src.__getitems__([0, 30, 85])] == [0, 200, 310]
    # The dataset's index is written beside the shards, recorded, and mapped.
    assert m.extra["index"]["path"] == "torchgrain.tgindex"
    assert src._dindex.path == str(tmp_path / "beam" / "torchgrain.tgindex")
    # A rerun finds every shard done and gives the same manifest.
    again = run_conversion(parquet_dir, tmp_path / "beam", num_shards=4)
    assert [s.checksum for s in again.shards] == [s.checksum for s in m.shards]


def test_beam_match_shards_tfrecord_and_parquet_output(tmp_path):
    d = tmp_path / "tf"
    d.mkdir()
    for s in range(3):
        write_tfrecord(
            [encode_tf_example({"id": s * 10 + k}) for k in range(4 + s)],
            d / f"x-{s:05d}-of-00003.tfrecord",
        )
    m = run_conversion(d, tmp_path / "ar")
    assert [s.num_records for s in m.shards] == [4, 5, 6]
    m2 = run_conversion(tmp_path / "ar", tmp_path / "pqout", to="parquet", num_shards=2)
    assert m2.num_records == 15
    back = tg.ParquetSource(tmp_path / "pqout")
    assert back[14]["id"].tolist() == [25]
    assert main([str(tmp_path / "ar"), str(tmp_path / "cli"), "--num-shards", "5"]) == 0
    assert len([n for n in os.listdir(tmp_path / "cli") if n.endswith(".array_record")]) == 5
