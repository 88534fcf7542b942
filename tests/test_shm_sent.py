"""A slot batch sent to another process: the receiver gets a copy, the slot stays put."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain import shm as _shm

pytestmark = pytest.mark.skipif(not _shm.ENABLED, reason="slots need Linux memfd")


@pytest.fixture(scope="module")
def records():
    rng = np.random.default_rng(5)  # (images of a batch of 8: 24 KiB, kept in its slot)
    return [
        {"image": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8), "label": i} for i in range(64)
    ]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, records):
    d = str(tmp_path_factory.mktemp("shm_sent"))
    tg.write_array_record(records, d, num_shards=2)
    return d


def _receive(queue, results):
    batch = queue.get()
    results.put((batch["image"].numpy().copy(), batch["label"].tolist()))


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_sent_slot_batch_arrives_whole_and_stays_in_its_slot(data_dir, records, strategy):
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        src = tg.ArrayRecordSource(data_dir)
        ds = tg.Dataset(src, batch_format="columns")
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=1)
        it = iter(loader)
        batch = next(it)
        ptrs = {k: v.data_ptr() for k, v in batch.items()}
        starts = [(e.header.ctypes.data, len(e.mm)) for e in _shm._mapped.values()]
        assert any(0 <= ptrs["image"] - a < n for a, n in starts)
        ctx = mp.get_context("fork")
        queue, results = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_receive, args=(queue, results))
        child.start()
        queue.put(batch)
        images, labels = results.get(timeout=60)
        child.join(30)
        assert {k: v.data_ptr() for k, v in batch.items()} == ptrs  # not moved out
        assert labels == batch["label"].tolist()
        for j, label in enumerate(labels):
            assert np.array_equal(images[j], records[label]["image"])
        del it, loader
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
