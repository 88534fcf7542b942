import copy
import pickle
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg


def noisy(rec, rng):
    return {**rec, "noise": rng.integers(0, 1 << 30), "image": rec["image"] + 0}


def to_tensors(rec):
    return {k: v for k, v in rec.items() if k != "id"}


def run_epochs(ds, order, *, num_workers, persistent=False, epochs=(0, 1), batch_size=8):
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        sampler=order,
        num_workers=num_workers,
        persistent_workers=persistent and num_workers > 0,
    )
    out = []
    for e in epochs:
        ds.set_epoch(e)
        out.append([{k: v.clone() for k, v in b.items()} for b in loader])
    return out


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


def test_map_and_random_map_identical_across_workers_and_persistence(small_dataset):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).random_map(noisy, seed=3).map(to_tensors)
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    ref = run_epochs(ds, order, num_workers=0)
    for workers, persistent in ((1, False), (2, False), (2, True), (4, True)):
        got = run_epochs(ds, order, num_workers=workers, persistent=persistent)
        for e in range(2):
            assert_batches_equal(ref[e], got[e])
    # different epochs draw different randomness, same images
    n0 = torch.cat([b["noise"] for b in ref[0]])
    n1 = torch.cat([b["noise"] for b in ref[1]])
    assert (n0 != n1).float().mean() > 0.9
    torch.testing.assert_close(
        torch.cat([b["image"] for b in ref[0]]), torch.cat([b["image"] for b in ref[1]])
    )


def test_batch_size_does_not_change_random_results(small_dataset):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).random_map(noisy, seed=1).map(to_tensors)
    order = list(range(len(ds)))[::-1]
    a = torch.cat([b["noise"] for b in run_epochs(ds, order, num_workers=0, batch_size=7)[0]])
    b = torch.cat([b["noise"] for b in run_epochs(ds, order, num_workers=2, batch_size=32)[0]])
    assert torch.equal(a, b)


def test_random_map_depends_on_seed_and_index_not_call_order():
    ds = tg.Dataset(list(range(10))).random_map(lambda r, rng: (r, rng.random()), seed=5)
    forward = [ds[i] for i in range(10)]
    backward = [ds[i] for i in reversed(range(10))][::-1]
    assert forward == backward
    assert len({v for _, v in forward}) == 10
    other = tg.Dataset(list(range(10))).random_map(lambda r, rng: (r, rng.random()), seed=6)
    assert other[3] != ds[3]
    # 64-bit and larger seeds
    big = tg.Dataset([0]).random_map(lambda r, rng: rng.random(), seed=2**64 + 1)
    assert big[0] != tg.Dataset([0]).random_map(lambda r, rng: rng.random(), seed=1)[0]


def test_two_random_maps_in_a_chain_get_independent_streams():
    ds = tg.Dataset([0]).random_map(lambda r, rng: [rng.random()], seed=0)
    ds = ds.random_map(lambda r, rng: [*r, rng.random()], seed=0)
    a, b = ds[0]
    assert a != b


def test_epoch_reaches_persistent_spawned_workers(small_dataset):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).random_map(noisy, seed=0).map(to_tensors)
    loader = DataLoader(
        ds,
        batch_size=10,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )
    ref = tg.Dataset(tg.ArrayRecordSource(d)).random_map(noisy, seed=0)
    for epoch in (0, 3):
        ds.set_epoch(epoch)
        got = torch.cat([b["noise"] for b in loader]).tolist()
        ref.set_epoch(epoch)
        assert got == [ref[i]["noise"] for i in range(len(ref))]


def test_dataset_pickles_and_deepcopies_as_private_copies(small_dataset):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).random_map(noisy, seed=0)
    ds.set_epoch(4)
    clone = copy.deepcopy(ds)
    assert clone.epoch == 4
    clone.set_epoch(5)
    assert ds.epoch == 4
    assert len(pickle.dumps(tg.Dataset(tg.ArrayRecordSource(d)))) < 8192


def test_plain_sequences_and_getitems_fallback():
    ds = tg.Dataset(["a", "b", "c"]).map(str.upper)
    assert len(ds) == 3 and ds.__getitems__([2, 0]) == ["C", "A"]
    with pytest.raises(TypeError):
        tg.Dataset(5)
    with pytest.raises(TypeError):
        ds.map(3)
    with pytest.raises(TypeError):
        ds.random_map(lambda r, g: r, seed=1.5)
    with pytest.raises(TypeError, match="block"):
        ds.block_offsets()


def test_record_rng_public_matches_dataset_stream():
    ds = tg.Dataset([0, 1]).random_map(lambda r, rng: rng.integers(1 << 40), seed=9)
    ds.set_epoch(2)
    assert ds[1] == tg.record_rng(9, 2, 1).integers(1 << 40)


def test_set_epoch_reaches_a_wrapped_dataset():
    # Dataset(Dataset(...).random_map(...)): the inner chain's random transforms
    # must follow the epoch too, not stay at epoch 0.
    inner = tg.Dataset(list(range(4))).random_map(lambda r, rng: rng.integers(1 << 40), seed=3)
    outer = tg.Dataset(inner).map(int)
    outer.set_epoch(5)
    assert inner.epoch == 5
    assert outer[2] == tg.record_rng(3, 5, 2).integers(1 << 40)


def test_worker_pipe_grows_for_the_loaders_result_queue():
    """Workers enlarge the pipe their batches travel through (Linux; the same pipe
    the main process reads, so its size is visible here)."""
    fcntl = pytest.importorskip("fcntl")
    if not sys.platform.startswith("linux"):
        pytest.skip("pipe sizes are a Linux feature")
    with open("/proc/sys/fs/pipe-max-size") as f:
        limit = int(f.read())

    def pipe_size(dataset, loader_cls=torch.utils.data.DataLoader):
        loader = loader_cls(dataset, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        it = iter(loader)
        next(it)
        next(it)  # both workers have fetched a batch
        size = fcntl.fcntl(it._worker_result_queue._reader.fileno(), 1032)  # F_GETPIPE_SZ
        del it
        return size

    data = [{"x": bytes(100)} for _ in range(64)]
    grown = pipe_size(tg.Dataset(data).map(lambda r: r))
    assert grown == min(1 << 20, limit)
    assert pipe_size(tg.Dataset(data, worker_pipe_bytes=0)) < grown  # left as it was
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    assert pipe_size(tg.Dataset(data), stateful.StatefulDataLoader) == grown
    with pytest.raises(ValueError, match="worker_pipe_bytes"):
        tg.Dataset(data, worker_pipe_bytes=-1)
