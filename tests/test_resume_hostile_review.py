"""Hostile and mismatched resume states: a sampler or loader state that is not one the
sampler saved (edited, truncated, converted, from another job) ends in a ValueError
naming the field, or in an exact resume; never in repeated or lost records, a
builtin crash, or unbounded work. And a resume saved at the end of an epoch whose
last partial batch the DataLoader drops moves on to the next epoch."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from torch.utils.data import DataLoader

import torchgrain as tg

N = 27


def _loader(drop_last: bool) -> tg.ResumableLoader:
    sampler = tg.GlobalShuffleSampler(N, seed=9, num_replicas=1, rank=0)
    return tg.ResumableLoader(
        DataLoader(list(range(N)), batch_size=4, sampler=sampler, drop_last=drop_last)
    )


def _run(loader: tg.ResumableLoader, epochs: int, stop: int | None = None):
    """The recipe of docs/samplers.md: (epoch, batch) pairs of the passes up to
    ``epochs``; with ``stop``, the loader's state after that many batches."""
    out: list[tuple[int, list[int]]] = []
    for _ in range(loader.epoch, epochs):
        for batch in loader:
            out.append((loader.epoch, batch.tolist()))
            if len(out) == stop:
                return out, json.loads(json.dumps(loader.state_dict()))
    return out, None


@pytest.mark.parametrize("stop", [6, 12])  # the last batch of epoch 0, of epoch 1
def test_resume_at_the_last_batch_of_a_drop_last_epoch_goes_on_with_the_next_epoch(stop):
    reference, _ = _run(_loader(drop_last=True), 3)
    assert len(reference) == 18  # 6 full batches an epoch, 3 records dropped
    head, state = _run(_loader(drop_last=True), 3, stop=stop)
    resumed = _loader(drop_last=True)
    resumed.load_state_dict(state)
    tail, _ = _run(resumed, 3)
    assert head + tail == reference


def _global_state(**changes):
    s = tg.GlobalShuffleSampler(100, num_replicas=2, rank=0, seed=3)
    it = iter(s)
    for _ in range(10):
        next(it)
    return {**s.state_dict(), **changes}


@pytest.mark.parametrize(
    "layout",
    [
        [[0, 100], [0, 100]],  # every record twice
        [[50, 100], [0, 50]],  # an order no sampler saved
        [],  # nothing at all: the epoch silently empty
        [[0, 99.7]],  # a float: truncated to 99, one record lost
        [[[0, 100]]],  # nested one level too deep
    ],
)
def test_a_state_with_a_layout_no_sampler_saves_is_refused(layout):
    s = tg.GlobalShuffleSampler(100, num_replicas=1, rank=0, seed=3)
    with pytest.raises(ValueError, match="layout"):
        s.load_state_dict({**_global_state(), "num_replicas": 1, "layout": layout})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_replicas", 0),
        ("seed", "3"),
        ("epoch", "0"),
        ("epoch", 0.5),
        ("position", None),  # truncated: the field is missing
        ("num_replicas", None),
        ("drop_last", None),
        ("shuffle", "False"),  # was taken as True: another order
    ],
)
def test_a_state_with_a_bad_or_missing_field_is_refused_naming_it(field, value):
    s = tg.GlobalShuffleSampler(100, num_replicas=2, rank=0, seed=3)
    state = _global_state(**{field: value})
    if value is None:
        del state[field]
    with pytest.raises(ValueError, match=field):
        s.load_state_dict(state)
        list(s)
    assert (s.seed, s.epoch) == (3, 0)  # nothing of the refused state was taken


def test_a_state_that_is_not_a_dict_is_refused():
    s = tg.GlobalShuffleSampler(100, num_replicas=2, rank=0, seed=3)
    with pytest.raises(ValueError, match="sampler state"):
        s.load_state_dict([["position", 3]])  # type: ignore[arg-type]


def _block(**kwargs):
    return tg.BlockShuffleSampler(
        None, block_offsets=np.arange(0, 101, 10), window=2, seed=3, **kwargs
    )


@pytest.mark.parametrize(
    ("field", "value"), [("num_workers", 2**62), ("num_replicas", 2**62), ("window", 0)]
)
def test_a_block_state_of_an_absurd_world_or_window_is_refused_when_loaded(field, value):
    saved = _block(num_replicas=1, rank=0, batch_size=4, num_workers=2)
    it = iter(saved)
    for _ in range(10):
        next(it)
    state = {**saved.state_dict(), field: value}
    with pytest.raises(ValueError, match=field):
        # Refused when loading: a re-split would loop over 2**62 ranks.
        _block(num_replicas=1, rank=0).load_state_dict(state)


@pytest.mark.parametrize("epoch", [2, 5])
def test_a_loader_state_whose_epoch_contradicts_its_sampler_state_is_refused(epoch):
    loader = _loader(drop_last=False)
    _, state = _run(loader, 1, stop=2)
    assert (state["epoch"], state["sampler"]["epoch"], state["sampler"]["position"]) == (0, 0, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="epoch"):
            _loader(drop_last=False).load_state_dict({**state, "epoch": epoch})
