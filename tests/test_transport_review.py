"""Columns batches from source to training loop: every batch holds its own records.

Reproducers found by auditing the transport (worker slots, collate, prefetch) against a
plain read of the same indices.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain import shm
from torchgrain.columns import ColumnBatch


def _records(n=8):
    return [{"x": np.full(2, i, np.float32), "y": i} for i in range(n)]


def _drop_odd_x(batch):  # keeps the even rows of one column only
    return {"x": batch["x"][batch["y"] % 2 == 0], "y": batch["y"]}


def _short_column(batch):
    out = ColumnBatch(dict(batch), num_rows=len(batch))
    out["x"] = out["x"][:1]
    return out


@pytest.mark.parametrize("fn", [_drop_odd_x, _short_column])
def test_a_map_batch_column_of_another_length_is_an_error(fn):
    # A map_batch that loses rows of one column would pair each x with another record's
    # y without a word; one that returns a list of records of another length is refused.
    ds = tg.Dataset(_records(), batch_format="columns").map_batch(fn)
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    with pytest.raises(TypeError, match=r"column 'x' of \d rows for a batch of 4"):
        next(iter(loader))


def _send_a_slot_batch_and_exit(conn):
    pool = shm.SlotPool(2)
    slot = pool.take(64)
    base = slot.arrays()
    base[:8] = 7
    batch = shm.SlotBatch({"x": torch.from_numpy(base[:8])})
    batch.slot = slot
    conn.send_bytes(bytes(ForkingPickler.dumps(batch)))  # its slot's descriptor goes along
    os._exit(0)  # as a worker killed before the main process took the descriptor


@pytest.mark.skipif(not shm.ENABLED, reason="slots need Linux memfd")
def test_a_slot_batch_whose_worker_is_gone_names_the_worker():
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=_send_a_slot_batch_and_exit, args=(theirs,))
    worker.start()
    data = ours.recv_bytes()
    worker.join(60)
    with pytest.raises(RuntimeError, match=f"worker {worker.pid} exited"):
        pickle.loads(data)


def test_a_str_column_that_utf8_cannot_hold_stays_a_list():
    # A file name listed from disk that is not UTF-8 (os.fsdecode's surrogates): a
    # records batch carries it; a columns batch must too, not fail on encoding it.
    paths = [os.fsdecode(b"img_\xff.jpg"), "b.jpg"]
    ds = tg.Dataset([{"path": p, "y": i} for i, p in enumerate(paths)], batch_format="columns")
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
    assert list(batch["path"]) == paths and batch["y"].tolist() == [0, 1]


def test_a_prefetcher_pass_left_open_at_exit_ends_quietly(monkeypatch):
    # A script that keeps a pass in a global: it is collected at exit after the module's
    # globals were cleared (sys among them), and its finaliser printed an AttributeError.
    from torchgrain import prefetch

    it = iter(prefetch.CudaPrefetcher([1, 2], device="cpu"))
    assert next(it) == 1
    monkeypatch.setattr(prefetch, "sys", None)  # as at exit
    it.__del__()  # must not raise


@pytest.mark.skipif(not shm.ENABLED, reason="slots need Linux memfd")
def test_a_slot_that_cannot_be_made_leaves_the_others_in_use(monkeypatch):
    # Memory short for a moment (a bigger batch's new slot): the worker's slots already
    # made still carry batches, not torch's path, which needs fresh shared memory for
    # each batch (unreserved: SIGBUS when it runs out).
    pool = shm.SlotPool(max_slots=3)
    slot = pool.take(100)
    batch = slot.arrays()  # the worker is writing a batch into it

    def no_memory(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_memory)
    assert pool.take(1 << 20) is None  # a bigger batch: no slot can be made
    monkeypatch.undo()
    del batch  # the first batch's slot is free again
    assert pool.take(100) is slot


def test_closing_a_prefetcher_ends_the_pass_a_consumer_waits_on():
    # A training thread waits for a batch while another thread (shutdown, a watchdog)
    # closes the prefetcher: the wait must end, not last forever.
    from torchgrain.prefetch import CudaPrefetcher

    first = threading.Event()

    def slow_loader():
        yield 0
        first.wait(60)
        time.sleep(0.2)  # the next batch is slow to come
        yield 1

    prefetcher = CudaPrefetcher(RepeatableLoader(slow_loader), device="cpu", depth=1)
    got = []

    def consume():
        for batch in prefetcher:
            got.append(batch)
            first.set()
        got.append("end")

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert first.wait(60)
    time.sleep(0.05)  # the consumer now waits for batch 1
    prefetcher.close()
    consumer.join(30)
    assert not consumer.is_alive() and got[0] == 0 and got[-1] == "end"


class RepeatableLoader:
    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()
