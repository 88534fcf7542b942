"""Resume exactness at the edges: states loaded while a pass is still being read, and
states carried between configurations."""

from __future__ import annotations

import pickle

import pytest
from torch.utils.data import DataLoader

import torchgrain as tg


def _loader(data, workers=0, batch=4, seed=1):
    sampler = tg.GlobalShuffleSampler(data, seed=seed, num_replicas=1, rank=0)
    return tg.ResumableLoader(
        DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)
    )


@pytest.mark.xfail(
    strict=True,
    reason="ResumableLoader: a pass of the loaded state's epoch that runs to its end after "
    "load_state_dict moves the sampler to the next epoch, dropping the loaded position",
)
@pytest.mark.parametrize("workers", [0, 2])
def test_state_loaded_during_a_pass_is_where_the_next_pass_starts(workers):
    """A state loaded while a pass is still read (a rollback to a checkpoint of the same
    epoch, the old pass left to finish) is where the next pass continues, as
    load_state_dict promises, whatever the old pass does after the load."""
    data = list(range(20))
    reference = [b.tolist() for b in _loader(data, workers)]

    loader = _loader(data, workers)
    it = iter(loader)
    next(it), next(it)
    checkpoint = pickle.loads(pickle.dumps(loader.state_dict()))  # after 2 batches
    next(it)
    loader.load_state_dict(checkpoint)
    for _ in it:  # the pass that was running reads on to its end
        pass
    assert [b.tolist() for b in loader] == reference[2:]
