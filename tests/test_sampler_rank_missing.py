"""A sampler given num_replicas > 1 but no rank (no rank=, no RANK, no process group)
cannot know its part of the data: an error naming what is missing, never rank 0 in every
process (each replica reading the same part)."""

from __future__ import annotations

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.sampling import resolve_world


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _samplers(**kw):
    offsets = np.array([0, 5, 12, 20], dtype=np.int64)
    return [
        tg.GlobalShuffleSampler(20, seed=0, **kw),
        tg.BlockShuffleSampler(None, block_offsets=offsets, seed=0, **kw),
    ]


@pytest.mark.parametrize("world_size", [None, "4"])
def test_num_replicas_without_a_rank_is_an_error_naming_it(
    monkeypatch, no_launcher_env, world_size
):
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    for s in _samplers(num_replicas=4):
        with pytest.raises(RuntimeError, match=r"num_replicas=4 is given but RANK is not") as e:
            list(s)
        assert "init_process_group" in str(e.value) and "rank=" in str(e.value)
        with pytest.raises(RuntimeError, match="RANK"):
            len(s)


def test_num_replicas_takes_its_rank_from_rank_or_the_argument(monkeypatch, no_launcher_env):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_world(4, 2) == (4, 2)
    monkeypatch.setenv("RANK", "3")
    assert resolve_world(4, None) == (4, 3)
    parts = [set(tg.GlobalShuffleSampler(20, seed=0, num_replicas=4, rank=r)) for r in range(4)]
    assert set.union(*parts) == set(range(20))


def test_a_single_process_without_a_launcher_reads_everything(no_launcher_env):
    assert resolve_world(None, None) == (1, 0)
    assert resolve_world(1, None) == (1, 0)
    for s in _samplers():
        assert sorted(s) == list(range(20))
    for s in _samplers(num_replicas=1):
        assert sorted(s) == list(range(20))
