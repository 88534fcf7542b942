"""Resume through a StatefulDataLoader whose iterator was made before the state was loaded:
torchdata's StatefulDataLoader makes (and starts) its first iterator when asked for its
state before any pass, as Accelerate's prepare does with use_stateful_dataloader=True."""

from __future__ import annotations

import pickle

import pytest
from torch.utils.data import DataLoader

import torchgrain as tg

N = 22


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _loader(kind):
    data = list(range(N))
    sampler = tg.GlobalShuffleSampler(data, seed=1, num_replicas=1, rank=0)
    if kind == "accelerate":
        from accelerate.data_loader import prepare_data_loader

        loader = prepare_data_loader(
            DataLoader(data, batch_size=4, sampler=sampler, num_workers=2),
            num_processes=1,
            process_index=0,
            put_on_device=False,
            use_stateful_dataloader=True,
        )
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
        loader.state_dict()  # a checkpoint taken before the first pass
    return tg.ResumableLoader(loader)


@pytest.mark.parametrize("kind", ["accelerate", "stateful"])
def test_resume_mid_pass_through_an_iterator_made_before_the_load(kind, no_launcher_env):
    """A state saved after 2 batches and loaded into a new loader (2 workers) continues at
    batch 3 of the pass, also when the StatefulDataLoader under it already made its first
    iterator (and drew the pass's first indices) before the load: Accelerate's prepare
    with use_stateful_dataloader=True asks it for its state, and so does a checkpoint
    taken before training. That pass read again from its start, repeating 8 records."""
    pytest.importorskip("torchdata")
    if kind == "accelerate":
        pytest.importorskip("accelerate")
    reference = [b.tolist() for b in _loader(kind)]
    first = _loader(kind)
    it = iter(first)
    taken = [next(it).tolist() for _ in range(2)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    resumed = _loader(kind)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert taken + rest == reference
    assert sorted(x for batch in taken + rest for x in batch) == list(range(N))


@pytest.mark.parametrize("kind", ["accelerate", "stateful"])
def test_epoch_set_before_the_first_pass_through_an_iterator_made_before(kind, no_launcher_env):
    """An epoch set before the first pass is that pass's order with 2 workers, also when
    the StatefulDataLoader under it made its first iterator before (it drew epoch 0's
    first indices): the pass read epoch 0's order."""
    pytest.importorskip("torchdata")
    if kind == "accelerate":
        pytest.importorskip("accelerate")
    loader = _loader(kind)
    passes = [[b.tolist() for b in loader] for _ in range(4)]
    late = _loader(kind)
    late.set_epoch(3)
    assert [b.tolist() for b in late] == passes[3]
