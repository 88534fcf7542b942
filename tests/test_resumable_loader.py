"""tg.ResumableLoader: the loop's position, saved exactly and loaded in O(1)."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.loader import find_sampler


def noisy(rec, rng):
    return {"id": rec, "noise": float(rng.random())}


def make(n=103, batch=8, workers=0, kind="global", world=(1, 0), persistent=False, **kw):
    ds = tg.Dataset(list(range(n))).random_map(noisy, seed=5)
    w, r = world
    if kind == "global":
        sampler = tg.GlobalShuffleSampler(ds, seed=9, num_replicas=w, rank=r, **kw)
    else:
        offsets = np.arange(0, n + 10, 10).clip(max=n)
        sampler = tg.BlockShuffleSampler(
            ds, seed=9, window=2, num_replicas=w, rank=r, block_offsets=offsets, **kw
        )
    extra = {"persistent_workers": persistent} if workers else {}
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers, **extra)
    return tg.ResumableLoader(loader)


def rows(batch):
    return list(zip(batch["id"].tolist(), batch["noise"].tolist()))


def run_epochs(loader, epochs, stop_after=None):
    """Batches of `epochs` passes; with stop_after, the state after that many batches."""
    out, taken = [], 0
    for _ in range(loader.epoch, epochs):
        for batch in loader:
            out.append((loader.epoch, rows(batch)))
            taken += 1
            if taken == stop_after:
                return out, json.loads(json.dumps(loader.state_dict()))
    return out, None


@pytest.mark.parametrize("kind", ["global", "block"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_anywhere_continues_exactly(kind, workers):
    reference, _ = run_epochs(make(workers=workers, kind=kind, persistent=True), 2)
    per_epoch = len(reference) // 2
    for stop in (1, 5, per_epoch - 1, per_epoch, per_epoch + 3):
        head, state = run_epochs(make(workers=workers, kind=kind), 2, stop_after=stop)
        resumed = make(workers=workers, kind=kind)
        resumed.load_state_dict(state)
        tail, _ = run_epochs(resumed, 2)
        assert head + tail == reference, f"stopped after {stop} batches"


def test_epochs_advance_by_themselves():
    loader = make()
    first = [r for b in loader for r in rows(b)]
    assert loader.epoch == 1
    second = [r for b in loader for r in rows(b)]
    assert sorted(i for i, _ in first) == sorted(i for i, _ in second) == list(range(103))
    assert [i for i, _ in first] != [i for i, _ in second]
    # Breaking out of a pass does not end the epoch.
    for _ in loader:
        break
    assert loader.epoch == 2
    # set_epoch with the same numbers as the automatic ones changes nothing.
    a, b = make(), make()
    for epoch in range(3):
        b.set_epoch(epoch)
        assert [rows(x) for x in a] == [rows(x) for x in b]


def test_state_at_the_end_of_a_pass_points_at_the_next_epoch():
    loader = make()
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    state = loader.state_dict()  # every batch taken, the pass not yet closed
    assert state["epoch"] == 1
    assert list(it) == []
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["sampler"]["position"] == 0
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.epoch == 1
    assert len([b for b in fresh]) == len(loader)


def test_elastic_resume_onto_more_ranks():
    # Two ranks in lockstep, 4 batches each, then three ranks take the rest.
    loaders = [make(world=(2, r)) for r in range(2)]
    seen, state = [], None
    for loader in loaders:
        head, st = run_epochs(loader, 1, stop_after=4)
        seen += [i for _, batch in head for i, _ in batch]
        state = state or st
    rest = []
    for r in range(3):
        loader = make(world=(3, r))
        loader.load_state_dict(state)
        rest += [i for b in loader for i in b["id"].tolist()]
    counts = collections.Counter(rest)
    assert set(counts) == set(range(103)) - set(seen)
    assert sum(counts.values()) - len(counts) < 3  # padding only


def test_resume_far_into_a_huge_epoch_draws_nothing_skipped():
    n, pos, batch = 10**9, 10**8, 16
    sampler = tg.GlobalShuffleSampler(n, seed=1, num_replicas=1, rank=0)

    class Ids(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitems__(self, idx):
            return list(idx)

    loader = tg.ResumableLoader(DataLoader(Ids(), batch_size=batch, sampler=sampler))
    state = {
        "version": 1,
        "epoch": 0,
        "sampler": {**sampler.state_dict(), "position": pos},
    }
    resumed = tg.ResumableLoader(
        DataLoader(Ids(), batch_size=batch, sampler=tg.GlobalShuffleSampler(n, seed=0))
    )
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    assert first.tolist() == sampler.indices(pos, pos + batch).tolist()
    assert resumed.state_dict()["sampler"]["position"] == pos + batch
    assert loader.epoch == 0


def test_wrapping_checks_and_passthrough():
    with pytest.raises(TypeError, match="torchgrain sampler"):
        tg.ResumableLoader(DataLoader(list(range(5)), batch_size=2, shuffle=True))
    with pytest.raises(TypeError, match="torchgrain sampler"):
        tg.ResumableLoader(DataLoader(list(range(5))), sampler=object())
    loader = make(batch=10)
    assert len(loader) == 11 and loader.batch_size == 10
    assert find_sampler(loader.loader) is loader.sampler
    with pytest.raises(ValueError, match="ResumableLoader state"):
        loader.load_state_dict({"position": 3})
    assert "ResumableLoader" in repr(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_after_breaking_out_of_a_pass_is_where_the_loop_stopped(workers):
    # The loop takes 5 batches and leaves; the loader has drawn further ahead (workers
    # prefetch), but the state saved afterwards is after those 5 batches.
    reference, _ = run_epochs(make(workers=workers), 2)
    loader = make(workers=workers)
    head = []
    for batch in loader:
        head.append((loader.epoch, rows(batch)))
        if len(head) == 5:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make(workers=workers)
    resumed.load_state_dict(state)
    tail, _ = run_epochs(resumed, 2)
    assert head + tail == reference
