"""Columns batches from DataLoader workers through reusable shared-memory slots.

Real worker processes throughout: a slot is written again only once the main process has
dropped every tensor of the batch it held, whatever the training loop keeps.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain import _shm
from torchgrain.dataset import collate_columns

pytestmark = pytest.mark.skipif(not _shm._ENABLED, reason="slots need Linux memfd")

N = 400


@pytest.fixture(scope="module")
def records():
    rng = np.random.default_rng(7)
    return [
        {
            "image": rng.integers(0, 255, (16, 16, 3), dtype=np.uint8),
            "label": i,
            "blob": bytes(rng.integers(0, 255, i % 11, dtype=np.uint8)) + b"\0" * (i % 2),
        }
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, records):
    d = str(tmp_path_factory.mktemp("shm"))
    tg.write_array_record(records, d, num_shards=4)
    return d


def _loader(data_dir, *, seed=0, batch_size=16, **kw):
    src = tg.ArrayRecordSource(data_dir)
    src[0]  # the parent reads before the workers start, as users do
    ds = tg.Dataset(src, batch_format="columns")
    sampler = tg.GlobalShuffleSampler(ds, seed=seed)
    kw.setdefault("num_workers", 2)
    return sampler, torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler, **kw)


def _check(batch, records):
    labels = batch["label"].tolist()
    for j, label in enumerate(labels):
        rec = records[label]
        assert torch.equal(batch["image"][j], torch.from_numpy(rec["image"])), label
        assert batch["blob"][j] == rec["blob"], label
    return labels


def _slot_storages(batches):
    return {b["image"].untyped_storage().data_ptr() for b in batches}


def test_batches_dropped_at_once_reuse_a_few_slots(data_dir, records):
    _, loader = _loader(data_dir)
    seen, storages, mapped = [], set(), set()
    for batch in loader:
        seen += _check(batch, records)
        storages.add(batch["image"].untyped_storage().data_ptr())
        mapped |= set(_shm._mapped)
        del batch
    assert sorted(seen) == list(range(N))
    # 25 batches from 2 workers, through at most MAX_SLOTS slots each (a first small
    # one per worker while the batch size is learnt).
    assert 1 <= len(mapped) <= 2 * _shm.MAX_SLOTS
    assert len(storages) <= 2 * (_shm.MAX_SLOTS + 1)


def test_batches_the_loop_keeps_are_never_overwritten(data_dir, records):
    # More batches kept than a worker has slots: later batches take torch's own path.
    _, loader = _loader(data_dir, batch_size=8)
    kept = list(loader)
    assert len(kept) == N // 8
    seen = []
    for batch in kept:
        seen += _check(batch, records)
    assert sorted(seen) == list(range(N))


def test_a_view_that_outlives_its_batch_keeps_the_slot(data_dir, records):
    _, loader = _loader(data_dir, persistent_workers=True)
    it = iter(loader)
    first = next(it)
    labels = first["label"][2:5].clone()
    part = first["image"][2:5]  # a view: keeps the batch's slot busy
    blob = first["blob"]
    del first
    gc.collect()
    rest = list(it)
    assert len(rest) == N // 16 - 1
    for j, label in enumerate(labels.tolist()):
        assert torch.equal(part[j], torch.from_numpy(records[label]["image"]))
    assert blob[3] == records[int(labels[1])]["blob"]


def test_persistent_workers_break_and_resume_epochs(data_dir, records):
    sampler, loader = _loader(data_dir, persistent_workers=True, prefetch_factor=4)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for k, batch in enumerate(loader):
            _check(batch, records)
            if k == 5:
                break
    sampler.set_epoch(3)
    seen = []
    for batch in loader:
        seen += _check(batch, records)
    assert seen == [int(i) for i in sampler]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_slots_with_each_start_method(data_dir, records, context):
    _, loader = _loader(data_dir, multiprocessing_context=context, batch_size=50)
    seen = []
    for batch in loader:
        seen += _check(batch, records)
    assert sorted(seen) == list(range(N))


def test_custom_collate_that_rebuilds_the_dict(data_dir, records):
    # Tensors of a slot in a dict of the user's: torch's pickler copies them; still exact.
    def collate(batch):
        out = collate_columns(batch)
        return {"image": out["image"] * 1, "label": out["label"], "blob": out["blob"]}

    _, loader = _loader(data_dir, collate_fn=collate)
    seen = []
    for batch in loader:
        seen += _check(batch, records)
    assert sorted(seen) == list(range(N))


def test_slot_pool_hands_out_each_slot_once_until_released():
    pool = _shm.SlotPool(max_slots=3)
    a, b, c = pool.take(100), pool.take(100), pool.take(50)
    assert len({id(a), id(b), id(c)}) == 3 and all(s.header[0] == 1 for s in (a, b, c))
    assert pool.take(10) is None  # all busy: the caller falls back to torch's path
    b.header[0] = 0  # the main process dropped b's batch
    assert pool.take(100) is b
    c.header[0] = 0
    big = pool.take(1000)  # too big for the free slot: it is replaced
    assert big is not c and big.capacity >= 1000 and c.header[1] == 1
    assert c not in pool.slots and len(pool.slots) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs a CUDA device")
def test_pin_memory_copies_out_of_the_slot(data_dir, records):
    _, loader = _loader(data_dir, pin_memory=True, batch_size=25)
    seen = []
    for batch in loader:
        assert batch["image"].is_pinned() and batch["blob"].values.is_pinned()
        seen += _check(batch, records)
    assert sorted(seen) == list(range(N))
