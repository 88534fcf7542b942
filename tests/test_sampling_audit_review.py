"""Audit of the samplers' resume states: a BlockShuffleSampler state whose batch dealing
fields (batch_size, num_workers) are not ones a sampler saves is refused when loaded,
with a ValueError naming the field, never a builtin error at the next pass or a re-split
that runs for hours. And a ResumableLoader's state says where the training loop is, also
when a CudaPrefetcher reads batches from it ahead of the loop."""

from __future__ import annotations

import time

import numpy as np
import pytest
from torch.utils.data import DataLoader

import torchgrain as tg


def _block(**kwargs):
    return tg.BlockShuffleSampler(
        None, block_offsets=np.arange(0, 101, 10), window=2, seed=3, **kwargs
    )


def _saved_state(**fields):
    saved = _block(num_replicas=1, rank=0, batch_size=4, num_workers=2)
    it = iter(saved)
    for _ in range(10):
        next(it)
    return {**saved.state_dict(), **fields}


def test_a_block_state_of_more_rank_workers_than_any_job_is_refused_when_loaded():
    # 2**20 ranks and 2**16 workers each pass the bounds on each alone; the re-split of
    # the rest of the epoch onto this world walked every worker of every rank in Python:
    # about 70 ms a rank (4,096 ranks: 274 s; 2**20: about 20 hours).
    state = _saved_state(num_replicas=2**20, num_workers=2**16, batch_size=1, position=0)
    with pytest.raises(ValueError, match="num_workers"):
        _block(num_replicas=1, rank=0).load_state_dict(state)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batch_size", 2**64),  # loaded, then an OverflowError at the next pass
        ("batch_size", 1.5),  # TypeError
        ("batch_size", "4"),
        ("num_workers", "2"),
        ("num_workers", 2.0),
    ],
)
def test_a_block_state_with_a_dealing_field_of_another_type_is_refused_naming_it(field, value):
    s = _block(num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=field):
        s.load_state_dict(_saved_state(**{field: value}))
        list(iter(s))
    assert (s.seed, s.epoch) == (3, 0)


def test_a_resumable_loader_around_a_prefetcher_resumes_after_the_batches_the_loop_took():
    # CudaPrefetcher pulls up to depth batches (and one more in hand) ahead of the loop.
    # A ResumableLoader under it counted each pull as taken: a state saved after 3
    # batches pointed after 5, and the resumed run never saw 2 of them. That order is
    # refused now; around the prefetcher it counts the batches the loop took.
    fetched: list[int] = []

    class Records(list):
        def __getitem__(self, i):
            fetched.append(i)
            return super().__getitem__(i)

    def loader():
        sampler = tg.GlobalShuffleSampler(40, seed=1, num_replicas=1, rank=0)
        return DataLoader(Records(range(40)), batch_size=4, sampler=sampler)

    with pytest.raises(TypeError, match=r"ResumableLoader\(tg.CudaPrefetcher"):
        tg.CudaPrefetcher(tg.ResumableLoader(loader()), device="cpu")
    full = [b.tolist() for b in tg.ResumableLoader(loader())]
    fetched.clear()
    resumable = tg.ResumableLoader(tg.CudaPrefetcher(loader(), device="cpu", depth=2))
    it = iter(resumable)
    head = [next(it).tolist() for _ in range(3)]
    deadline = time.monotonic() + 60
    while len(fetched) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread has read the 2 batches it reads ahead
    state = resumable.state_dict()
    resumable.loader.close()
    resumed = tg.ResumableLoader(tg.CudaPrefetcher(loader(), device="cpu"))
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full
    assert resumed.epoch == 1


def test_a_sampler_given_num_replicas_alone_takes_its_rank_from_torchrun(monkeypatch):
    # Under torchrun (WORLD_SIZE, RANK) before a process group exists, a sampler given
    # num_replicas but no rank was rank 0 in every process: each read rank 0's part.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = tg.GlobalShuffleSampler(10, num_replicas=4, seed=2)
    assert (s.num_replicas, s.rank) == (4, 3)
    assert list(s) == list(tg.GlobalShuffleSampler(10, num_replicas=4, rank=3, seed=2))


@pytest.mark.timeout(60)
def test_a_resume_of_a_layout_of_many_intervals_onto_another_world_is_linear():
    # A chained elastic resume of a contiguous split: a layout of one interval per rank of
    # the last world, re-split over the ranks of the next. Composing the rest with the
    # layout walked every pair: 4,096 ranks 7.5 s, 2**14 about 2 minutes.
    k = 1 << 14
    offsets = np.arange(0, 3 * k + 1, 3)
    fresh = tg.BlockShuffleSampler(None, block_offsets=offsets, num_replicas=1, rank=0, seed=3)
    layout = [[3 * i, 3 * i + 2] for i in range(k)]
    state = {**fresh.state_dict(), "num_replicas": k, "position": 1, "layout": layout}
    s = tg.BlockShuffleSampler(None, block_offsets=offsets, num_replicas=1, rank=0, seed=3)
    s.load_state_dict(state)
    # Each rank drew the first of its 2 positions: the rest is the second of each.
    assert s.indices().tolist() == fresh.indices()[1::3].tolist()
