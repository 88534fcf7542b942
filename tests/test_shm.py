"""Columns batches from DataLoader workers through reusable shared-memory slots.

Real worker processes throughout: a slot is written again only once the main process has
dropped every tensor of the batch it held, whatever the training loop keeps.
"""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain import shm as _shm
from torchgrain.dataset import collate_columns

pytestmark = pytest.mark.skipif(not _shm.ENABLED, reason="slots need Linux memfd")

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


def _check_epoch(loader, records):
    """Iterate one epoch, checking every batch; every record must come exactly once."""
    seen = []
    for batch in loader:
        seen += _check(batch, records)
    assert sorted(seen) == list(range(N))
    return seen


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
    _check_epoch(loader, records)


def test_custom_collate_that_rebuilds_the_dict(data_dir, records):
    # Tensors of a slot in a dict of the user's: torch's pickler copies them; still exact.
    def collate(batch):
        out = collate_columns(batch)
        return {"image": out["image"] * 1, "label": out["label"], "blob": out["blob"]}

    _, loader = _loader(data_dir, collate_fn=collate)
    _check_epoch(loader, records)


def test_slot_pool_hands_out_a_slot_only_when_both_sides_are_done():
    pool = _shm.SlotPool(max_slots=3)
    a = pool.take(100)
    ta = a.arrays()
    b = pool.take(100)
    tb = b.arrays()
    c = pool.take(50)
    tc = c.arrays()
    assert len({id(a), id(b), id(c)}) == 3
    assert pool.take(10) is None  # all in use: the caller falls back to torch's path
    view = tb[10:20]
    del tb
    gc.collect()
    assert pool.take(100) is None  # the worker still holds a view of b's batch
    b.header[0] = 1  # b's batch was pickled for the main process
    del view
    gc.collect()
    assert pool.take(100) is None  # ... which still holds it
    b.header[0] = 0  # the main process dropped it
    assert pool.take(100) is b
    del tc
    gc.collect()
    big = pool.take(1000)  # too big for the free slot c: c is replaced
    assert big is not c and big.capacity >= 1000 and c.header[1] == 1
    assert c not in pool.slots and len(pool.slots) == 3
    del ta


def test_a_map_batch_that_keeps_arrays_keeps_them_intact(data_dir, records):
    kept = []

    def keep(batch):
        kept.append((batch["label"].copy(), batch["image"]))  # the worker keeps a column
        for labels, image in kept:
            for j, label in enumerate(labels.tolist()):
                assert np.array_equal(image[j], records[label]["image"]), "overwritten"
        return batch

    src = tg.ArrayRecordSource(data_dir)
    ds = tg.Dataset(src, batch_format="columns").map_batch(keep)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2)
    _check_epoch(loader, records)


# Module level: a spawn-free DataLoader (fork) runs them in its workers.
_kept: dict = {}


def _keep_first(batch):
    if "first" not in _kept:
        _kept["first"], _kept["copy"] = batch["image"], batch["image"].copy()
    batch["first_ok"] = np.array([np.array_equal(_kept["first"], _kept["copy"])])
    return batch


def _plain_dict(batch):  # torch's pickler then moves the slot's tensors to its own segment
    return dict(collate_columns(batch))


_log: list = []


def _deepcopy_too(batch):  # e.g. a copy kept for logging
    out = collate_columns(batch)
    _log.append(copy.deepcopy(out))
    del _log[:-2]
    return out


def test_kept_arrays_survive_a_collate_that_returns_a_plain_dict(data_dir, records):
    src = tg.ArrayRecordSource(data_dir)
    ds = tg.Dataset(src, batch_format="columns").map_batch(_keep_first)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=1, collate_fn=_plain_dict)
    oks = [bool(b["first_ok"][0]) for b in loader]
    assert len(oks) == N // 16 and all(oks)


def test_a_batch_copied_in_the_worker_still_reaches_the_main_process(data_dir, records):
    _, loader = _loader(data_dir, num_workers=1, collate_fn=_deepcopy_too)
    _check_epoch(loader, records)


def test_a_strided_view_of_a_column_is_sent_as_such(data_dir, records):
    def transpose(batch):
        batch["image"] = batch["image"].transpose(0, 2, 1, 3)
        return batch

    src = tg.ArrayRecordSource(data_dir)
    ds = tg.Dataset(src, batch_format="columns").map_batch(transpose)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2)
    for batch in loader:
        for j, label in enumerate(batch["label"].tolist()):
            want = torch.from_numpy(records[label]["image"]).transpose(0, 1)
            assert torch.equal(batch["image"][j], want)


def test_early_breaks_do_not_pile_up_mappings(data_dir, records):
    _, loader = _loader(data_dir, prefetch_factor=4)
    counts = []
    for _epoch in range(4):
        for k, batch in enumerate(loader):
            _check(batch, records)
            if k == 6:
                break
        del batch
        gc.collect()
        counts.append(len(_shm._mapped))
    # Slots of workers that are gone are unmapped when the next workers' slots arrive.
    assert max(counts) <= 2 * 2 * (_shm.MAX_SLOTS + 1), counts
    assert counts[-1] <= counts[0] + 4, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs a CUDA device")
def test_pin_memory_copies_out_of_the_slot(data_dir, records):
    _, loader = _loader(data_dir, pin_memory=True, batch_size=25)
    seen = []
    for batch in loader:
        assert batch["image"].is_pinned() and batch["blob"].values.is_pinned()
        seen += _check(batch, records)
    assert sorted(seen) == list(range(N))
