"""Resume and mixture edges: a state loaded (or an epoch set) while a pass of a loader
that counts epochs itself is still read, and the pass order told to sources under a
mixture of mixtures."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from torch.utils.data import DataLoader

import torchgrain as tg


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _prepared(n=20):
    from accelerate.data_loader import prepare_data_loader

    data = list(range(n))
    sampler = tg.GlobalShuffleSampler(data, seed=1)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    return tg.ResumableLoader(
        prepare_data_loader(loader, num_processes=1, process_index=0, put_on_device=False)
    )


@pytest.mark.parametrize("change", ["load_state_dict", "set_epoch"])
def test_accelerate_keeps_a_state_loaded_or_an_epoch_set_during_a_pass(change, no_launcher_env):
    """A state loaded while a pass is still read (a rollback to a checkpoint of the same
    epoch) is where the next pass continues, and an epoch set during a pass is the next
    pass's epoch, under an Accelerate-prepared loader as under a plain DataLoader."""
    pytest.importorskip("accelerate")
    if change == "load_state_dict":
        reference = [b.tolist() for b in _prepared()][2:]
    else:
        fresh = _prepared()
        fresh.set_epoch(5)
        reference = [b.tolist() for b in fresh]

    loader = _prepared()
    it = iter(loader)
    next(it), next(it)
    checkpoint = pickle.loads(pickle.dumps(loader.state_dict()))  # after 2 batches
    next(it)
    if change == "load_state_dict":
        loader.load_state_dict(checkpoint)
    else:
        loader.set_epoch(5)
    for _ in it:  # the pass that was running reads on to its end
        pass
    expected_epoch = 0 if change == "load_state_dict" else 5
    assert (loader.epoch, [b.tolist() for b in loader]) == (expected_epoch, reference)


class _Told(list):
    """Records that keep the pass order a sampler's read-ahead hands them."""

    def __init__(self, records):
        super().__init__(records)
        self.told: list[list[int]] = []

    def read_ahead(self, order, start, count, position):
        if order is not None and count:
            self.told.append(np.asarray(order(start, start + count)).tolist())


def test_read_ahead_under_a_mixture_of_a_mixture_is_told_the_records_read():
    """A source under a mixture that is itself mixed (and read in part each epoch) is told,
    by the sampler's read-ahead, the records the pass then reads, in the order it reads
    them: read-ahead otherwise fetches shards no read needs and leaves the needed ones to
    be fetched one read at a time."""
    a = _Told({"x": f"a{i}"} for i in range(10))
    b = [{"x": f"b{i}"} for i in range(10)]
    c = [{"x": f"c{i}"} for i in range(90)]
    inner = tg.mix([tg.Dataset(a), b], [0.5, 0.5], seed=1)
    outer = tg.mix([inner, c], [0.1, 0.9], seed=2, length=100)  # half of inner per epoch
    sampler = tg.GlobalShuffleSampler(outer, seed=3, num_replicas=1, rank=0)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        read = [int(r["x"][1:]) for r in outer.__getitems__(order) if r["x"][0] == "a"]
        assert a.told[-1] == read, f"epoch {epoch}"


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_mixture_read_at_no_indices_is_an_empty_batch(nested):
    """Reading a mixture at no indices gives no records (as every source and view does),
    also through a selection of none of its positions."""
    a = [{"x": i} for i in range(5)]
    b = [{"x": -i} for i in range(5)]
    ds = tg.mix([a, b], [0.5, 0.5], seed=1)
    if nested:
        ds = tg.mix([ds, [{"x": 100 + i} for i in range(10)]], [0.5, 0.5], seed=2)
    assert ds.source.__getitems__([]) == []
    assert ds.source.read_columns([]).num_rows == 0
    assert len(ds.select([]).source.read_columns([])) == 0
