"""Contracts between Dataset, samplers and sources: stated as protocols, adapted at the edge."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.adapters import SequenceSource
from torchgrain.columns import ColumnBatch
from torchgrain.protocols import HasBlockOffsets, ReadsAhead, ReadsBatches, SetsEpoch


class Batched:
    """A sequence with its own batched read, counting its calls."""

    def __init__(self, n, short=False):
        self.n, self.short, self.calls = n, short, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": i}

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        got = [{"x": i} for i in indices]
        return got[:-1] if self.short else got


class Told:
    """A dataset that is told its epoch and each pass's order."""

    def __init__(self, n):
        self.n, self.epochs, self.passes = n, [], []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def read_ahead(self, order, start, count, position):
        self.passes.append(None if order is None else (order(start, start + 3).tolist(), count))


def test_a_plain_sequence_is_adapted_once_and_the_dataset_still_hands_it_back():
    items = ["a", "b", "c"]
    ds = tg.Dataset(items)
    assert ds.source is items and repr(ds) == "Dataset(['a', 'b', 'c'])"
    assert isinstance(ds._source, SequenceSource) and isinstance(ds._source, tg.Source)
    assert ds.keys == [] and ds.schema == {}
    with pytest.raises(TypeError, match="list is not a torchgrain Source"):
        ds.block_offsets()


def test_a_source_is_used_as_it_is(tmp_path):
    tg.write_array_record([{"x": i} for i in range(6)], tmp_path, num_shards=2)
    src = tg.ArrayRecordSource(tmp_path)
    ds = tg.Dataset(src)
    assert ds.source is src and ds._source is src
    assert ds.keys == ["x"] and ds.block_offsets().tolist() == src.block_offsets().tolist()


def test_a_sequence_with_batched_reads_is_read_a_batch_at_a_time():
    items = Batched(10)
    ds = tg.Dataset(items).map(lambda r: r["x"])
    assert ds.__getitems__([4, 1, 7]) == [4, 1, 7] and items.calls == [[4, 1, 7]]
    loader = torch.utils.data.DataLoader(ds, batch_size=5)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert isinstance(items, ReadsBatches) and not isinstance([1], ReadsBatches)


def test_a_batched_read_that_loses_records_is_an_error_naming_the_sequence():
    ds = tg.Dataset(Batched(10, short=True))
    with pytest.raises(RuntimeError, match=r"Batched.__getitems__ returned 2 records for 3"):
        ds.__getitems__([0, 1, 2])
    with pytest.raises(RuntimeError, match="Batched"):
        tg.Dataset(Batched(10, short=True), batch_format="columns").__getitems__([0, 1, 2])


def test_a_bool_index_is_refused_as_the_built_in_sources_refuse_it():
    # A list reads True as record 1 and False as record 0: a mask passed by mistake.
    ds = tg.Dataset([{"a": i} for i in range(3)])
    for index in (True, False, np.True_):
        with pytest.raises(TypeError, match="record index must be an integer, got bool"):
            ds[index]
    assert ds[1] == {"a": 1} and ds[np.int64(2)] == {"a": 2}


def test_a_sequence_with_its_own_columns_reader_gives_the_columns_batch():
    class Columnar(Batched):
        def read_columns(self, indices):
            return ColumnBatch(
                {"x": np.asarray(indices, dtype=np.int64) * 10}, num_rows=len(indices)
            )

    (batch,) = tg.Dataset(Columnar(5), batch_format="columns").__getitems__([1, 3])
    assert batch["x"].tolist() == [10, 30]
    (batch,) = tg.Dataset(Batched(5), batch_format="columns").__getitems__([1, 3])
    assert batch["x"].tolist() == [1, 3]


def test_a_sampler_tells_a_dataset_with_the_capabilities_its_epoch_and_its_pass():
    data = Told(20)
    assert isinstance(data, SetsEpoch) and isinstance(data, ReadsAhead)
    s = tg.GlobalShuffleSampler(data, num_replicas=1, rank=0, seed=4)
    s.set_epoch(2)
    first = next(iter(s))
    assert data.epochs == [2]
    (_, (head, count)) = data.passes  # the epoch change cancelled, then the pass began
    assert head[0] == first and count == 20
    # Through a tg.Dataset the same reaches the sequence it adapted.
    data = Told(20)
    s = tg.GlobalShuffleSampler(tg.Dataset(data), num_replicas=1, rank=0, seed=4)
    s.set_epoch(5)
    next(iter(s))
    assert data.epochs == [5] and data.passes[-1][1] == 20


def test_a_dataset_without_the_capabilities_is_left_alone():
    s = tg.GlobalShuffleSampler(list(range(8)), num_replicas=1, rank=0)
    s.set_epoch(1)
    assert sorted(s) == list(range(8))
    with pytest.raises(TypeError, match="block_offsets"):
        tg.BlockShuffleSampler(list(range(8)))
    assert not isinstance(list(range(8)), HasBlockOffsets)


def test_block_shuffle_takes_the_blocks_a_dataset_states():
    class Blocked(Told):
        def block_offsets(self):
            return np.array([0, 5, 20])

    s = tg.BlockShuffleSampler(Blocked(20), window=1, num_replicas=1, rank=0, seed=1)
    order = s.indices().tolist()
    assert sorted(order) == list(range(20))
    first_block = [i < 5 for i in order]
    assert first_block in ([True] * 5 + [False] * 15, [False] * 15 + [True] * 5)
