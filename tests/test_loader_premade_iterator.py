"""A StatefulDataLoader iterator made for a state_dict() before the first pass, dropped by
ResumableLoader when a state is loaded: its worker processes are shut down (or, when they
persist, reset by the next pass), and the resumed pass continues at the loaded position."""

from __future__ import annotations

import multiprocessing

import pytest

import torchgrain as tg

N = 22


def _loader(persistent: bool) -> tg.ResumableLoader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(N))
    sampler = tg.GlobalShuffleSampler(data, seed=1, num_replicas=1, rank=0)
    loader = StatefulDataLoader(
        data, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=persistent
    )
    loader.state_dict()  # makes (and starts) the first iterator
    return tg.ResumableLoader(loader)


@pytest.mark.parametrize("persistent", [False, True])
def test_load_drops_the_premade_iterator_without_leaking_workers(persistent):
    """Loading a state after 2 batches into a loader whose pre-made iterator holds 2 worker
    processes: without persistent workers, that iterator is shut down at the load and its
    workers are gone; with them, they are kept and the next pass resets them. Both resume
    at batch 3 of the pass."""
    pytest.importorskip("torchdata")
    reference = [b.tolist() for b in _loader(persistent)]
    first = _loader(persistent)
    it = iter(first)
    taken = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    del it, first
    resumed = _loader(persistent)
    premade = resumed.loader._iterator
    workers = set(premade._workers)
    assert workers <= set(multiprocessing.active_children())
    resumed.load_state_dict(state)
    alive = workers & set(multiprocessing.active_children())
    if persistent:
        assert resumed.loader._iterator is premade and alive == workers
    else:
        assert premade._shutdown and not alive
    assert taken + [b.tolist() for b in resumed] == reference
