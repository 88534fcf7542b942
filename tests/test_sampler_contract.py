"""The public sampler contract: a new sampler is an order plus a split strategy.

The sampler below is written as a user would write one, with public names only, and is
held to what torchgrain's own samplers promise: an exact cover of every epoch over
ranks and DataLoader workers, and an exact (also elastic) mid-epoch resume.
"""

from __future__ import annotations

import ast
import math
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.sampling import (
    ContiguousSplit,
    InterleavedSplit,
    KeyedPermutation,
    KeyedPermutations,
    OrderFn,
    ResumableSampler,
    Shares,
    Split,
)


class StridedSampler(ResumableSampler):
    """Every ``k``-th record from a start ``a``: position ``q`` is record ``(a + k q) mod
    N``, with ``k`` coprime to ``N``; ``k`` and ``a`` come from ``(seed, epoch)``."""

    def __init__(self, dataset_or_length, *, split: Split | None = None, **kwargs):
        super().__init__(dataset_or_length, **kwargs)
        self._split = split or InterleavedSplit()

    def epoch_order(self, seed: int, epoch: int) -> OrderFn:
        n = self.dataset_len
        rng = np.random.default_rng([seed % (1 << 64), epoch])
        k = int(rng.integers(1, n))
        while math.gcd(k, n) != 1:
            k = k % (n - 1) + 1
        a = int(rng.integers(n))
        return lambda q: (a + k * q) % n

    def split(self) -> Split:
        return self._split


SPLITS = {
    "interleaved": InterleavedSplit(),
    "contiguous": ContiguousSplit(),
    "dealt": ContiguousSplit(batch_size=4, num_workers=2),
}


def _loader(sampler, n, workers=2):
    return torch.utils.data.DataLoader(
        tg.Dataset(list(range(n))), batch_size=4, sampler=sampler, num_workers=workers
    )


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_sampler_written_with_public_names_covers_each_epoch_over_two_ranks_and_two_workers(
    split,
):
    n = 103
    seen_by_epoch = []
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            s = StridedSampler(n, num_replicas=2, rank=rank, seed=5, split=SPLITS[split])
            s.set_epoch(epoch)
            batches = [b.tolist() for b in _loader(s, n)]
            assert [i for b in batches for i in b] == list(s)  # workers keep the order
            seen.extend(i for b in batches for i in b)
        # Padded like DistributedSampler: every record, plus one repeat to even the ranks.
        assert len(seen) == 104 and sorted(set(seen)) == list(range(n))
        seen_by_epoch.append(seen)
    assert seen_by_epoch[0] != seen_by_epoch[1]  # a new order each epoch


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_sampler_written_with_public_names_resumes_exactly_through_a_loader_with_workers(
    split,
):
    n, taken = 90, 5
    for rank in (0, 1):

        def make(rank=rank):
            s = StridedSampler(n, num_replicas=2, rank=rank, seed=11, split=SPLITS[split])
            return tg.ResumableLoader(_loader(s, n))

        loader = make()
        loader.set_epoch(3)
        full = [b.tolist() for b in loader]
        loader = make()
        loader.set_epoch(3)
        it = iter(loader)
        head = [next(it).tolist() for _ in range(taken)]
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        resumed.set_epoch(3)
        assert head + [b.tolist() for b in resumed] == full


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_sampler_written_with_public_names_resumes_onto_three_ranks_without_loss(split):
    n = 100
    olds = [
        StridedSampler(n, num_replicas=2, rank=r, seed=2, pad=False, split=SPLITS[split])
        for r in (0, 1)
    ]
    drawn = []
    for s in olds:
        it = iter(s)
        drawn.extend(next(it) for _ in range(17))
    state = olds[0].state_dict()
    rest = []
    for r in range(3):
        s = StridedSampler(n, num_replicas=3, rank=r, seed=0, pad=False, split=SPLITS[split])
        s.load_state_dict(state)
        rest.extend(s)
    assert sorted(drawn + rest) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    world=st.integers(1, 4),
    mode=st.sampled_from(["pad", "no_pad", "drop_last"]),
    split=st.sampled_from(sorted(SPLITS)),
    seed=st.integers(-(1 << 63), (1 << 64) - 1),
)
def test_any_split_of_a_public_order_is_an_exact_cover(n, world, mode, split, seed):
    kw = {"pad": mode != "no_pad", "drop_last": mode == "drop_last"}
    draws = []
    for r in range(world):
        s = StridedSampler(n, num_replicas=world, rank=r, seed=seed, split=SPLITS[split], **kw)
        got = list(s)
        assert got == s.indices().tolist() and len(got) == len(s)
        draws.extend(got)
    if mode == "no_pad":
        assert sorted(draws) == list(range(n))
    elif mode == "drop_last":
        assert len(draws) == n // world * world and len(set(draws)) == len(draws)
    else:
        assert sorted(set(draws)) == list(range(n)) and len(draws) == -(-n // world) * world


def test_shares_follow_distributed_sampler_counts():
    for length in range(0, 30):
        for w in range(1, 5):
            for drop, pad in ((False, True), (True, True), (False, False)):
                s = Shares(length, w, drop_last=drop, pad=pad)
                counts = [s.count(r) for r in range(w)]
                starts = [s.start(r) for r in range(w)]
                assert starts == [sum(counts[:r]) for r in range(w)]
                if drop:
                    assert counts == [length // w] * w
                elif pad:
                    assert counts == [math.ceil(length / w)] * w
                else:
                    assert sum(counts) == length and max(counts) - min(counts) <= 1


def test_a_sampler_without_an_order_says_what_it_lacks():
    class NoOrder(ResumableSampler):
        pass

    with pytest.raises(NotImplementedError, match="epoch_order"):
        list(NoOrder(5, num_replicas=1, rank=0))
    assert list(NoOrder(5, num_replicas=1, rank=0, shuffle=False)) == [0, 1, 2, 3, 4]


def test_a_state_from_another_sampler_kind_is_refused():
    s = StridedSampler(10, num_replicas=1, rank=0)
    state = s.state_dict()
    assert state["sampler"] == "StridedSampler"
    with pytest.raises(ValueError, match="StridedSampler"):
        tg.GlobalShuffleSampler(10, num_replicas=1, rank=0).load_state_dict(state)


def test_the_shipped_samplers_are_written_with_public_names_only():
    root = pathlib.Path(tg.__file__).parent / "sampling"
    for name in ("block_shuffle.py", "global_shuffle.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchgrain"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports {private} from {node.module}"


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=12),
    seed=st.integers(0, (1 << 64) - 1),
    epoch=st.integers(0, 5),
)
def test_a_family_of_keyed_permutations_permutes_each_member(sizes, seed, epoch):
    perms = KeyedPermutations(np.array(sizes), seed, epoch)
    member = np.repeat(np.arange(len(sizes)), sizes)
    x = np.concatenate([np.arange(s) for s in sizes]).astype(np.int64)
    y = perms(member, x)
    for m, s in enumerate(sizes):
        assert sorted(y[member == m].tolist()) == list(range(s))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5000), seed=st.integers(0, (1 << 64) - 1))
def test_an_unchecked_keyed_permutation_gives_the_checked_result(n, seed):
    p = KeyedPermutation(n, seed, 1)
    q = np.arange(n, dtype=np.int64)
    assert p(q, check=False).tolist() == p(q).tolist()
    with pytest.raises(IndexError):
        p(np.array([n]))
