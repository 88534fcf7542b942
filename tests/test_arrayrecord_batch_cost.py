"""The ArrayRecord source's batched reads: a few records skip the batch plan, and the
plan's varint step agrees with a plain decoder."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgrain as tg
import torchgrain.sources.arrayrecord as arrayrecord_source
from torchgrain.errors import CorruptDataError
from torchgrain.formats.arrayrecord.batch import _varints


def _records(n):
    return [{"x": np.full(3 + i % 5, i, np.int32), "label": i} for i in range(n)]


def test_small_batches_are_read_record_by_record(tmp_path, monkeypatch):
    d = str(tmp_path / "ds")
    tg.write_array_record(_records(40), d, num_shards=3)
    src = tg.ArrayRecordSource(d, index_dir=None)
    want = [src[i] for i in range(40)]

    def planned(*a, **k):
        raise AssertionError("a batch of a few records went through the batch plan")

    monkeypatch.setattr(arrayrecord_source, "read_mapped", planned)
    for batch in ([5], [39, 0, 17], [3, 3, 38, 1, 20, 2, 9, 30]):
        got = src.__getitems__(batch)
        assert [g["label"] for g in got] == batch
        for g, i in zip(got, batch):
            np.testing.assert_array_equal(g["x"], want[i]["x"])
    with pytest.raises(AssertionError, match="batch plan"):
        src.__getitems__(list(range(9)))  # more: the plan


def test_small_batch_of_a_damaged_chunk_names_the_record(tmp_path):
    d = tmp_path / "ds"
    tg.write_array_record(_records(20), str(d), num_shards=1, compression="zstd")
    (path,) = [p for p in d.iterdir() if p.name.endswith(".array_record")]
    src = tg.ArrayRecordSource(str(d), index_dir=None)
    raw = bytearray(path.read_bytes())
    src.__getitems__([0])  # mapped now
    f = src._dindex.footer(0)
    at = int(f.chunk_offsets[7]) + 48  # inside record 7's compressed data
    raw[at : at + 8] = b"\xff" * 8
    path.write_bytes(bytes(raw))  # same size: read through the map
    src = tg.ArrayRecordSource(str(d), index_dir=None)
    with pytest.raises(CorruptDataError, match="record index 7"):
        src.__getitems__([2, 7])


def _plain(row):
    value = 0
    for k, b in enumerate(row):
        value |= (b & 0x7F) << (7 * k)
        if b < 0x80:
            return value, k + 1
    return 0, 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 255), min_size=4, max_size=4), min_size=1, max_size=20))
def test_varints_agree_with_a_plain_decoder(rows):
    value, length = _varints(np.array(rows, np.uint8))
    assert list(zip(value.tolist(), length.tolist())) == [_plain(r) for r in rows]
