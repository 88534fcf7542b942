"""Columns batches through worker slots, attacked with real DataLoader workers: batches the
loop keeps, sends elsewhere or views must keep their bytes; failures must end in errors."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain import shm as _shm

pytestmark = pytest.mark.skipif(not _shm.ENABLED, reason="slots need Linux memfd")

N = 240


@pytest.fixture(scope="module")
def records():
    rng = np.random.default_rng(11)
    return [
        {"image": rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), "label": i} for i in range(N)
    ]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, records):
    d = str(tmp_path_factory.mktemp("review_slots"))
    tg.write_array_record(records, d, num_shards=3)
    return d


def _loader(data_dir, *, batch_size=16, worker_slots=_shm.MAX_SLOTS, **kw):
    src = tg.ArrayRecordSource(data_dir)
    src[0]
    ds = tg.Dataset(src, batch_format="columns", worker_slots=worker_slots)
    kw.setdefault("num_workers", 1)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, **kw)


def _bad_rows(images, labels, records):
    return [
        j
        for j, label in enumerate(labels)
        if not np.array_equal(images[j], records[label]["image"])
    ]


@pytest.mark.parametrize(
    "worker_slots",
    [
        0,
        _shm.MAX_SLOTS,
    ],
)
def test_a_numpy_view_survives_sending_the_batch_to_another_process(
    data_dir, records, worker_slots
):
    loader = _loader(data_dir, worker_slots=worker_slots)
    it = iter(loader)
    first = next(it)
    images = first["image"].numpy()  # e.g. for logging
    labels = first["label"].tolist()
    ForkingPickler.dumps(first)  # what multiprocessing.Queue.put(batch) does
    del first
    gc.collect()
    for _ in range(8):  # the worker's slots are used again (its slots stay mapped)
        next(it)
    bad = _bad_rows(images, labels, records)
    # (read before the epoch ends: the slot is unmapped then, and reading the view
    # would crash the process)
    del images
    assert len(list(it)) == N // 16 - 9
    assert bad == []


def _check_in_child(batch, labels, records, go, results):
    go.wait(10)
    results.put(_bad_rows(batch["image"].numpy(), labels, records))


@pytest.mark.parametrize(
    "worker_slots",
    [
        0,
        _shm.MAX_SLOTS,
    ],
)
def test_a_batch_handed_to_a_forked_process_keeps_its_bytes(data_dir, records, worker_slots):
    # e.g. a batch saved or logged by a process of its own while training goes on
    ctx = mp.get_context("fork")
    loader = _loader(data_dir, worker_slots=worker_slots)
    it = iter(loader)
    first = next(it)
    labels = first["label"].tolist()
    go, results = ctx.Event(), ctx.SimpleQueue()
    child = ctx.Process(target=_check_in_child, args=(first, labels, records, go, results))
    child.start()
    del first
    gc.collect()
    for _ in range(8):  # the worker's slots are used again
        next(it)
    go.set()
    bad = results.get()
    child.join(10)
    assert len(list(it)) == N // 16 - 9
    assert bad == []


def _slot_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor)
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in out if link.startswith("/memfd:torchgrain-")]


def test_a_deleted_loader_leaves_no_slot_mapped_once_its_batches_are_dropped(data_dir, records):
    gc.collect()
    _shm._sweep()  # slots of loaders before this one
    assert _slot_fds() == []
    loader = _loader(data_dir, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    held = [next(it) for _ in range(3)]
    del it, loader  # mid-epoch: the workers exit, their slots retired
    gc.collect()
    assert _bad_rows(held[0]["image"].numpy(), held[0]["label"].tolist(), records) == []
    del held
    gc.collect()
    assert (_slot_fds(), sorted(_shm._mapped)) == ([], [])
