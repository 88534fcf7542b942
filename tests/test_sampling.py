"""Tests of torchgrain.sampling: permutation correctness, DistributedSampler
semantics, shuffle quality, determinism, exact and elastic resume."""

from __future__ import annotations

import collections
import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.utils.data import DataLoader, DistributedSampler

import torchgrain as tg
from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler, KeyedPermutation
from torchgrain.sampling.permutation import _U64, _permute, _rounds_for, _split_bits

SEEDS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
EPOCHS = st.integers(min_value=0, max_value=2**40)


def assert_bijection(p: KeyedPermutation, chunk: int = 1 << 20) -> None:
    """Full check that p maps [0, n) onto itself, in chunks (bounded memory)."""
    n = p.n
    seen = np.zeros(n, dtype=bool)
    for s in range(0, n, chunk):
        x = np.arange(s, min(s + chunk, n))
        y = p(x)
        assert y.min(initial=0) >= 0 and y.max(initial=-1) < n
        seen[y] = True
        assert np.array_equal(p.inverse(y), x)
    # n images all inside [0, n) and all of [0, n) hit: a bijection.
    assert seen.all(), f"n={n}: {int((~seen).sum())} values never produced"


def random_offsets(rng: np.random.Generator, n_blocks: int, max_rows: int) -> np.ndarray:
    sizes = rng.integers(0, max_rows + 1, size=n_blocks)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def make(kind: str, n_or_offsets, **kw):
    if kind == "global":
        return GlobalShuffleSampler(n_or_offsets, **kw)
    if kind == "dealt":  # batches dealt to 3 DataLoader workers
        kw = {"batch_size": 7, "num_workers": 3, **kw}
    return BlockShuffleSampler(None, block_offsets=n_or_offsets, **kw)


def all_ranks(kind: str, data, world: int, **kw) -> list[list[int]]:
    return [list(make(kind, data, num_replicas=world, rank=r, **kw)) for r in range(world)]


def dataset_len(kind: str, data) -> int:
    return int(data) if kind == "global" else int(data[-1])


# --------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5])
def test_tiny_sizes_are_permutations(n):
    for seed in range(50):
        assert_bijection(KeyedPermutation(n, seed=seed, epoch=seed % 3))


def test_boundary_sizes_full_check():
    sizes = sorted({m for k in range(1, 21) for m in (2**k - 1, 2**k, 2**k + 1)})
    for n in sizes:
        assert_bijection(KeyedPermutation(n, seed=n, epoch=1))


def test_reported_regression_size_through_sampler():
    n = 2**16 + 1
    out = GlobalShuffleSampler(n, num_replicas=1, rank=0, seed=0).indices()
    assert np.array_equal(np.bincount(out, minlength=n), np.ones(n, dtype=np.int64))


def test_full_check_at_2_pow_24_plus_1():
    assert_bijection(KeyedPermutation(2**24 + 1, seed=12345, epoch=7))


@pytest.mark.parametrize("k", range(21, 31))
def test_large_boundary_sizes_sampled(k):
    # A sample through the inverse: p.inverse(p(x)) == x proves p injective on it
    # and p(x) in range proves it maps into [0, n).
    rng = np.random.default_rng(k)
    for n in (2**k - 1, 2**k, 2**k + 1):
        p = KeyedPermutation(n, seed=k, epoch=n)
        x = np.unique(np.concatenate([rng.integers(0, n, 20000), [0, n - 1, n // 2]]))
        y = p(x)
        assert y.min() >= 0 and y.max() < n
        assert len(np.unique(y)) == len(x)
        assert np.array_equal(p.inverse(y), x)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 5000), seed=SEEDS, epoch=EPOCHS)
def test_property_any_size_seed_epoch(n, seed, epoch):
    assert_bijection(KeyedPermutation(n, seed=seed, epoch=epoch))


def test_out_of_range_values_rejected():
    p = KeyedPermutation(10)
    with pytest.raises(IndexError):
        p([10])
    with pytest.raises(IndexError):
        p([-1])
    with pytest.raises(ValueError):
        KeyedPermutation(10, seed=2**64)


# --------------------------------------------------------------------------- quality


def _pair_chi2(n: int, trials: int = 20000) -> tuple[float, float]:
    """p-values of chi-square tests on where 0 goes, and where (0, 1) go jointly,
    over `trials` independent keys (vectorised with per-element keys)."""
    rng = np.random.default_rng(n)
    a, c = _split_bits(n)
    keys = rng.integers(0, 2**64, size=(_rounds_for(int(a + c)), trials), dtype=_U64)
    y0 = _permute(np.zeros(trials, _U64), _U64(n), keys, a, c).astype(np.int64)
    y1 = _permute(np.ones(trials, _U64), _U64(n), keys, a, c).astype(np.int64)
    p_pos = stats.chisquare(np.bincount(y0, minlength=n)).pvalue
    joint = np.bincount(y0 * n + y1, minlength=n * n).reshape(n, n)
    p_pair = stats.chisquare(joint[~np.eye(n, dtype=bool)]).pvalue
    return p_pos, p_pair


@pytest.mark.parametrize("n", [3, 4, 5, 8, 9, 16, 17, 33, 64])
def test_small_domains_position_and_pair_uniform(n):
    p_pos, p_pair = _pair_chi2(n)
    # Fixed keys: deterministic. Thresholds far below typical p-values (~0.5) but
    # far above what a biased network gives (< 1e-20 with too few rounds).
    assert p_pos > 1e-4 and p_pair > 1e-4, (p_pos, p_pair)


def test_position_of_element_uniform_over_epochs():
    n, epochs = 97, 3000
    pos0 = np.empty(epochs, dtype=np.int64)
    for e in range(epochs):
        order = GlobalShuffleSampler(n, num_replicas=1, rank=0, seed=3)
        order.set_epoch(e)
        pos0[e] = int(np.flatnonzero(order.indices() == 0)[0])
    assert stats.chisquare(np.bincount(pos0, minlength=n)).pvalue > 1e-4


def test_lag1_and_rank_correlation_near_zero():
    n = 1_000_000
    y = GlobalShuffleSampler(n, num_replicas=1, rank=0, seed=11).indices().astype(np.float64)
    assert abs(np.corrcoef(y[:-1], y[1:])[0, 1]) < 0.01
    assert abs(np.corrcoef(np.arange(n), y)[0, 1]) < 0.01
    # Displacement looks like that of a uniform permutation: mean |y_i - i| ~ n / 3.
    assert abs(np.abs(y - np.arange(n)).mean() / n - 1 / 3) < 0.01


def test_epoch_mixing_is_hashed_not_added():
    a = GlobalShuffleSampler(1000, num_replicas=1, rank=0, seed=5)
    a.set_epoch(1)
    b = GlobalShuffleSampler(1000, num_replicas=1, rank=0, seed=6)
    b.set_epoch(0)
    c = GlobalShuffleSampler(1000, num_replicas=1, rank=0, seed=5)
    assert list(a) != list(b)
    assert list(a) != list(c)
    # Unrelated orders agree in about one position out of n.
    assert (a.indices() == b.indices()).sum() < 10


def test_large_seeds_and_negative_seeds_work_and_differ():
    orders = {
        tuple(GlobalShuffleSampler(500, num_replicas=1, rank=0, seed=s).indices().tolist())
        for s in (0, 1, -1, 2**63, 2**64 - 1, 2**32)
    }
    assert len(orders) == 5  # -1 and 2**64 - 1 are the same 64-bit seed
    with pytest.raises(ValueError):
        GlobalShuffleSampler(10, num_replicas=1, rank=0, seed=2**64)


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_distributed_sampler_counts(shuffle, drop_last):
    for n, w in itertools.product([0, 1, 2, 3, 5, 10, 17, 100, 101], [1, 2, 3, 4, 7]):
        ours = all_ranks("global", n, w, shuffle=shuffle, drop_last=drop_last, seed=1)
        theirs = [
            list(
                DistributedSampler(
                    range(n), num_replicas=w, rank=r, shuffle=shuffle, drop_last=drop_last
                )
            )
            for r in range(w)
        ]
        assert [len(x) for x in ours] == [len(x) for x in theirs]
        assert len(GlobalShuffleSampler(n, num_replicas=w, rank=0, drop_last=drop_last)) == len(
            theirs[0]
        )
        if not shuffle:
            assert ours == theirs
        else:
            # Same multiset of counts: as many distinct indices, as many repeats.
            ours_c = collections.Counter(itertools.chain(*ours))
            theirs_c = collections.Counter(itertools.chain(*theirs))
            assert sorted(ours_c.values()) == sorted(theirs_c.values())
            if not drop_last:
                assert ours_c.keys() == theirs_c.keys()


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["global", "block"]),
    n=st.integers(0, 400),
    world=st.integers(1, 8),
    seed=SEEDS,
    epoch=st.integers(0, 1000),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    window=st.integers(1, 5),
)
def test_property_split_covers_and_pads(kind, n, world, seed, epoch, drop_last, shuffle, window):
    if kind == "global":
        data, kw = n, {}
    else:
        data, kw = random_offsets(np.random.default_rng(n), n // 7 + 1, 13), {"window": window}
    total = dataset_len(kind, data)
    parts = []
    for r in range(world):
        s = make(
            kind,
            data,
            num_replicas=world,
            rank=r,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            **kw,
        )
        s.set_epoch(epoch)
        out = list(s)
        assert out == s.indices(0, len(s)).tolist()
        assert len(out) == len(s)
        parts.append(out)
    per = total // world if drop_last else -(-total // world)
    assert all(len(p) == per for p in parts)
    counts = collections.Counter(itertools.chain(*parts))
    assert all(0 <= i < total for i in counts)
    if drop_last:
        assert all(v == 1 for v in counts.values())
        assert len(counts) == per * world
    else:
        assert len(counts) == total
        extra = sum(counts.values()) - total
        assert extra == per * world - total and extra < world
        if total >= world:
            assert all(v <= 2 for v in counts.values())


def test_padding_is_minimal_and_rotates_between_epochs():
    n, w = 1001, 8  # 7 padded samples per epoch
    pads = []
    for epoch in range(4):
        parts = []
        for r in range(w):
            s = GlobalShuffleSampler(n, num_replicas=w, rank=r, seed=2)
            s.set_epoch(epoch)
            parts += list(s)
        c = collections.Counter(parts)
        pads.append(frozenset(i for i, v in c.items() if v == 2))
        assert len(pads[-1]) == 7
    assert len(set(pads)) == 4


def test_determinism_and_fresh_iterators_repeat():
    s = GlobalShuffleSampler(12345, num_replicas=3, rank=2, seed=9)
    s.set_epoch(4)
    t = GlobalShuffleSampler(12345, num_replicas=3, rank=2, seed=9)
    t.set_epoch(4)
    assert list(s) == list(t) == list(s)
    assert np.array_equal(s.indices(100, 200), np.asarray(list(s)[100:200]))


@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
def test_iterator_keeps_its_epoch_when_the_sampler_changes(kind):
    # An iterator is a snapshot, as DistributedSampler's materialised list is:
    # set_epoch or load_state_dict while it runs must not switch orders between
    # chunks (that would repeat and drop samples).
    n = 3 * 65536 + 17
    data = n if kind == "global" else [*range(0, n + 1, 1000), n]
    s = make(kind, data, num_replicas=1, rank=0, seed=5)
    expected = list(s)
    it = iter(s)
    head = [next(it) for _ in range(10)]
    s.set_epoch(1)
    other = make(kind, data, num_replicas=1, rank=0, seed=6)
    s.load_state_dict(other.state_dict())
    assert head + list(it) == expected
    # and the sampler itself now follows the loaded state
    assert list(s) == list(other)


def test_default_world_without_process_group():
    s = GlobalShuffleSampler(10)
    assert (s.num_replicas, s.rank) == (1, 0)
    assert sorted(s) == list(range(10))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_replicas": 2, "rank": 2},
        {"num_replicas": 2, "rank": -1},
        {"num_replicas": 0, "rank": 0},
    ],
)
def test_invalid_rank_rejected(kwargs):
    with pytest.raises(ValueError):
        GlobalShuffleSampler(10, **kwargs)
    with pytest.raises(ValueError):
        BlockShuffleSampler(None, block_offsets=[0, 10], **kwargs)


class EpochRecordingDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, block: int = 10) -> None:
        self.n, self.block, self.epochs = n, block, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def block_offsets(self) -> np.ndarray:
        return np.append(np.arange(0, self.n, self.block), self.n)


@pytest.mark.parametrize("cls", [GlobalShuffleSampler, BlockShuffleSampler])
def test_set_epoch_and_load_state_reach_the_dataset(cls):
    ds = EpochRecordingDataset(100)
    s = cls(ds, num_replicas=1, rank=0)
    s.set_epoch(3)
    state = s.state_dict()
    s.set_epoch(5)
    s.load_state_dict(state)
    assert ds.epochs == [3, 5, 3]
    assert s.epoch == 3


# --------------------------------------------------------------------------- block sampler


def test_block_sampler_is_block_local():
    offsets = np.arange(0, 100_001, 1000)  # 100 blocks of 1000 rows
    s = BlockShuffleSampler(None, block_offsets=offsets, window=4, num_replicas=1, rank=0, seed=1)
    out = s.indices()
    assert np.array_equal(np.sort(out), np.arange(100_000))
    blocks = out // 1000
    # Every stripe (1000 consecutive samples here) holds 250 rows of each of 4 blocks,
    # and the window slides by one block per stripe: 4 stripes hold 7 blocks.
    for k in range(100):
        ids, counts = np.unique(blocks[k * 1000 : (k + 1) * 1000], return_counts=True)
        assert len(ids) == 4 and (counts == 250).all()
    for k in range(25):
        assert len(np.unique(blocks[k * 4000 : (k + 1) * 4000])) == 7
    # A block's rows span at most 4 stripes, except the 3 that wrap around.
    pos = np.empty_like(out)
    pos[out] = np.arange(len(out))
    span = np.ptp(pos.reshape(100, 1000), axis=1)
    assert (span < 4000).sum() == 97
    # ... and is shuffled inside: consecutive samples mostly change block.
    assert (np.diff(blocks) != 0).mean() > 0.5
    # Different epochs order blocks differently.
    s.set_epoch(1)
    assert not np.array_equal(s.indices()[:4000] // 1000, blocks[:4000])


def test_block_sampler_ranks_take_contiguous_runs():
    offsets = np.arange(0, 10_001, 100)
    runs = [
        BlockShuffleSampler(None, block_offsets=offsets, window=2, num_replicas=4, rank=r).indices()
        for r in range(4)
    ]
    # Each rank touches about a quarter of the blocks (plus boundary windows).
    assert all(len(np.unique(r // 100)) <= 27 for r in runs)
    unshuffled = BlockShuffleSampler(
        None, block_offsets=offsets, num_replicas=4, rank=1, shuffle=False
    )
    assert unshuffled.indices().tolist() == list(range(2500, 5000))


def test_block_sampler_uses_dataset_block_offsets_and_validates():
    ds = EpochRecordingDataset(95, block=10)
    s = BlockShuffleSampler(ds, num_replicas=1, rank=0)
    assert s.num_blocks == 10 and sorted(s) == list(range(95))
    with pytest.raises(ValueError, match="end at 90"):
        BlockShuffleSampler(ds, block_offsets=[0, 90])
    with pytest.raises(ValueError, match="start at 0"):
        BlockShuffleSampler(None, block_offsets=[1, 5])
    with pytest.raises(ValueError, match="non-decreasing"):
        BlockShuffleSampler(None, block_offsets=[0, 5, 3])
    with pytest.raises(TypeError):
        BlockShuffleSampler(list(range(5)))
    with pytest.raises(ValueError):
        BlockShuffleSampler(None, block_offsets=[0, 5], window=0)


def test_block_sampler_window_position_uniform():
    # One block: a single stripe, shuffled uniformly (where row 0 lands).
    pos = []
    for e in range(3000):
        s = BlockShuffleSampler(None, block_offsets=[0, 31], window=3, num_replicas=1, rank=0)
        s.set_epoch(e)
        pos.append(int(np.flatnonzero(s.indices() == 0)[0]))
    assert stats.chisquare(np.bincount(pos, minlength=31)).pvalue > 1e-4
    # Three equal blocks, window 3: every stripe holds 4 rows of each block; with the
    # block order shuffled too, a row lands anywhere in the epoch uniformly.
    pos = []
    for e in range(3600):
        s = BlockShuffleSampler(None, block_offsets=[0, 12, 24, 36], window=3, seed=5)
        s.set_epoch(e)
        pos.append(int(np.flatnonzero(s.indices() == 13)[0]))
    assert stats.chisquare(np.bincount(pos, minlength=36)).pvalue > 1e-4


def test_block_sampler_refuses_fixed_window_states():
    s = BlockShuffleSampler(None, block_offsets=[0, 10, 20])
    state = s.state_dict()
    del state["window_layout"]
    with pytest.raises(ValueError, match="fixed windows"):
        BlockShuffleSampler(None, block_offsets=[0, 10, 20]).load_state_dict(state)


# --------------------------------------------------------------------------- resume


KINDS = {
    "global": 1003,
    "block": random_offsets(np.random.default_rng(0), 40, 50),
}
KINDS["dealt"] = KINDS["block"]


@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
def test_resume_direct_iteration_every_cut(kind):
    data = KINDS[kind]
    for world, rank in [(1, 0), (3, 2)]:
        ref = make(kind, data, num_replicas=world, rank=rank, seed=4)
        ref.set_epoch(2)
        full = list(ref)
        for k in sorted({0, 1, 17, len(full) // 2, len(full) - 1, len(full)}):
            s = make(kind, data, num_replicas=world, rank=rank, seed=4)
            s.set_epoch(2)
            head = list(itertools.islice(iter(s), k))
            state = s.state_dict()
            t = make(kind, data, num_replicas=world, rank=rank, seed=999)  # seed comes from state
            t.load_state_dict(state)
            t.set_epoch(2)  # same epoch: keeps the position
            assert head + list(t) == full
            assert list(t) == full  # the resume applies to one pass only
            t.set_epoch(3)
            assert t.state_dict()["position"] == 0


class RangeData(torch.utils.data.Dataset):
    def __init__(self, offsets: np.ndarray) -> None:
        self.offsets = offsets

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> int:
        return i

    def block_offsets(self) -> np.ndarray:
        return self.offsets


def _sampler(kind: str, ds: RangeData, seed: int = 1):
    if kind == "global":
        return GlobalShuffleSampler(ds, num_replicas=2, rank=1, seed=seed)
    return BlockShuffleSampler(ds, num_replicas=2, rank=1, seed=seed, window=3)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
def test_resume_plain_dataloader_with_consumed(kind, num_workers):
    ds = RangeData(random_offsets(np.random.default_rng(1), 30, 40))
    bs, k = 7, 5
    ref_sampler = _sampler(kind, ds)
    ref_sampler.set_epoch(1)
    full = [b.tolist() for b in DataLoader(ds, batch_size=bs, sampler=ref_sampler)]

    s = _sampler(kind, ds)
    s.set_epoch(1)
    loader = DataLoader(
        ds,
        batch_size=bs,
        sampler=s,
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
    )
    got = []
    for step, batch in enumerate(loader, start=1):
        got.append(batch.tolist())
        if step == k:
            # The loader has drawn more indices than the loop consumed.
            assert num_workers == 0 or s.state_dict()["position"] > k * bs
            state = s.state_dict(consumed=step * bs)
            break
    del loader

    s2 = _sampler(kind, ds, seed=77)
    s2.load_state_dict(state)
    s2.set_epoch(1)
    loader2 = DataLoader(
        ds,
        batch_size=bs,
        sampler=s2,
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
    )
    got += [b.tolist() for b in loader2]
    assert got == full


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
def test_resume_stateful_dataloader(kind, num_workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = RangeData(random_offsets(np.random.default_rng(2), 30, 40))
    bs, k = 5, 6
    kw = {"num_workers": num_workers, "prefetch_factor": 2 if num_workers else None}
    ref_sampler = _sampler(kind, ds)
    ref_sampler.set_epoch(3)
    full = [b.tolist() for b in StatefulDataLoader(ds, batch_size=bs, sampler=ref_sampler)]

    s = _sampler(kind, ds)
    s.set_epoch(3)
    loader = StatefulDataLoader(ds, batch_size=bs, sampler=s, **kw)
    got = []
    for step, batch in enumerate(loader, start=1):
        got.append(batch.tolist())
        if step == k:
            state = loader.state_dict()
            break
    del loader

    s2 = _sampler(kind, ds, seed=55)
    loader2 = StatefulDataLoader(ds, batch_size=bs, sampler=s2, **kw)
    loader2.load_state_dict(state)
    got += [b.tolist() for b in loader2]
    assert got == full
    assert s2.epoch == 3
    # The next epoch starts from its beginning.
    s2.set_epoch(4)
    assert sum(len(b) for b in loader2) == len(s2)


def test_consumed_validation():
    s = GlobalShuffleSampler(100, num_replicas=1, rank=0)
    it = iter(s)
    for _ in range(10):
        next(it)
    with pytest.raises(ValueError):
        s.state_dict(consumed=11)
    with pytest.raises(ValueError):
        s.state_dict(consumed=-1)
    assert s.state_dict(consumed=4)["position"] == 4
    list(it)
    # Past the end (a last partial batch counted in full) means "finished".
    assert s.state_dict(consumed=105)["position"] == 100


def test_load_state_validates():
    s = GlobalShuffleSampler(100, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="100 records"):
        GlobalShuffleSampler(99, num_replicas=1, rank=0).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="GlobalShuffleSampler"):
        BlockShuffleSampler(None, block_offsets=[0, 100]).load_state_dict(s.state_dict())
    b = BlockShuffleSampler(None, block_offsets=[0, 50, 100])
    with pytest.raises(ValueError, match="block boundaries"):
        BlockShuffleSampler(None, block_offsets=[0, 40, 100]).load_state_dict(b.state_dict())
    bad = s.state_dict()
    bad["position"] = 101
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict(bad)


# --------------------------------------------------------------------------- elastic resume


def _elastic(kind, data, old_w, new_w, pos, drop_old=False, drop_new=False, epoch=1):
    """Consume `pos` per rank at old_w, resume at new_w; return (consumed, resumed parts)."""
    consumed, states = [], []
    for r in range(old_w):
        s = make(kind, data, num_replicas=old_w, rank=r, seed=8, drop_last=drop_old)
        s.set_epoch(epoch)
        it = iter(s)
        consumed += list(itertools.islice(it, pos))
        states.append(s.state_dict())
    assert all(st == states[0] for st in states)  # any rank's state describes the job
    parts = []
    for r in range(new_w):
        t = make(kind, data, num_replicas=new_w, rank=r, seed=0, drop_last=drop_new)
        t.load_state_dict(states[r % old_w])
        parts.append(list(t))
    return consumed, parts


@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
@pytest.mark.parametrize(("old_w", "new_w"), [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_elastic_resume_covers_the_rest_exactly_once(kind, old_w, new_w):
    data = KINDS[kind]
    n = dataset_len(kind, data)
    per_old = -(-n // old_w)
    for pos in (0, 1, 37, per_old // 2, per_old - 1, per_old):
        consumed, parts = _elastic(kind, data, old_w, new_w, pos)
        assert len({len(p) for p in parts}) == 1  # split evenly
        rest = set(range(n)) - set(consumed)
        got = collections.Counter(itertools.chain(*parts))
        assert set(got) == rest
        extra = sum(got.values()) - len(rest)
        assert 0 <= extra < new_w  # only padding repeats


@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
def test_elastic_resume_drop_last_and_chained(kind):
    data = KINDS[kind]
    n = dataset_len(kind, data)
    consumed, parts = _elastic(kind, data, 4, 3, 50, drop_old=True, drop_new=True)
    got = collections.Counter(itertools.chain(*parts))
    rest = set(range(n)) - set(consumed)
    assert all(v == 1 for v in got.values()) and set(got) <= rest
    assert len(rest) - len(got) < 3

    # 4 -> 2 -> 3: the second resume continues from the first resume's layout.
    seen = []
    states = []
    for r in range(4):
        s = make(kind, data, num_replicas=4, rank=r, seed=8)
        it = iter(s)
        seen += list(itertools.islice(it, 30))
        states.append(s.state_dict())
    mid = []
    for r in range(2):
        t = make(kind, data, num_replicas=2, rank=r)
        t.load_state_dict(states[0])
        it = iter(t)
        seen += list(itertools.islice(it, 40))
        mid.append(t.state_dict())
    assert mid[0] == mid[1]
    final = []
    for r in range(3):
        u = make(kind, data, num_replicas=3, rank=r)
        u.load_state_dict(mid[0])
        final.append(list(u))
    assert len({len(p) for p in final}) == 1
    assert len(seen) == len(set(seen))
    got = collections.Counter(itertools.chain(*final))
    assert set(got) == set(range(n)) - set(seen)
    assert sum(got.values()) - len(got) < 3


def test_same_world_resume_after_elastic_is_exact():
    n = 1003
    s = GlobalShuffleSampler(n, num_replicas=4, rank=0, seed=8)
    list(itertools.islice(iter(s), 100))
    state = s.state_dict()
    t = GlobalShuffleSampler(n, num_replicas=3, rank=1)
    t.load_state_dict(state)
    full = list(t)
    t.load_state_dict(state)
    it = iter(t)
    head = list(itertools.islice(it, 25))
    u = GlobalShuffleSampler(n, num_replicas=3, rank=1)
    u.load_state_dict(t.state_dict())
    assert head + list(u) == full


def test_epoch_reaches_real_dataset_in_persistent_workers():
    import torchgrain as tg

    ds = tg.Dataset(list(range(40))).random_map(
        lambda r, rng: [r, int(rng.integers(1 << 30))], seed=1
    )
    sampler = tg.GlobalShuffleSampler(ds, num_replicas=2, rank=0, seed=3)
    loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=2, persistent_workers=True)
    per_epoch = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert ds.epoch == epoch
        rows = [r for b in loader for r in zip(b[0].tolist(), b[1].tolist())]
        assert [i for i, _ in rows] == sampler.indices().tolist()
        per_epoch.append(dict(rows))
    # The random transform saw each epoch: same records, different draws.
    common = per_epoch[0].keys() & per_epoch[1].keys()
    assert common and all(per_epoch[0][i] != per_epoch[1][i] for i in common)
    # Loading a state puts the dataset back to the saved epoch.
    state = sampler.state_dict()
    sampler.set_epoch(7)
    sampler.load_state_dict(state)
    assert ds.epoch == 1


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["global", "block", "dealt"]),
    n=st.integers(0, 300),
    old_w=st.integers(1, 6),
    new_w=st.integers(1, 6),
    frac=st.floats(0, 1),
    drop_old=st.booleans(),
    drop_new=st.booleans(),
)
def test_property_elastic_resume(kind, n, old_w, new_w, frac, drop_old, drop_new):
    data = n if kind == "global" else random_offsets(np.random.default_rng(n), n // 5 + 1, 9)
    total = dataset_len(kind, data)
    per_old = total // old_w if drop_old else -(-total // old_w)
    pos = int(frac * per_old)
    consumed, parts = _elastic(kind, data, old_w, new_w, pos, drop_old, drop_new)
    rest = set(range(total)) - set(consumed)
    got = collections.Counter(itertools.chain(*parts))
    assert len({len(p) for p in parts}) == 1
    if drop_new:
        assert set(got) <= rest
        assert all(v == 1 for v in got.values()) and len(rest) - len(got) < new_w
    else:
        # Everything not yet consumed, plus fewer than new_w padding repeats (which,
        # as in DistributedSampler, may repeat samples consumed before the resume).
        assert rest <= set(got) and 0 <= sum(got.values()) - len(rest) < new_w
    if old_w == new_w and drop_old == drop_new:
        # Same world: each rank continues exactly.
        for r in range(new_w):
            s = make(kind, data, num_replicas=new_w, rank=r, seed=8, drop_last=drop_new)
            s.set_epoch(1)
            assert parts[r] == list(s)[pos:]


@pytest.mark.parametrize("kind", ["block", "dealt"])
def test_elastic_resume_counts_padding_draws_as_consumed(kind):
    # 7 rows on 5 ranks: the contiguous split gives the last rank only padding, which
    # wraps onto the start of the epoch. Its draws were trained on, so a resume onto
    # one rank must not hand them out again (one world needs no padding at all).
    data = np.array([0, 7])
    consumed, parts = _elastic(kind, data, 5, 1, 1)
    rest = set(range(7)) - set(consumed)
    assert sorted(parts[0]) == sorted(rest)
    # Many-fold padding (2 rows on 6 ranks) wraps more than once.
    consumed, parts = _elastic(kind, np.array([0, 2]), 6, 2, 1)
    assert consumed and parts == [[], []]


# --------------------------------------------------------------------------- dealt batches


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 400),
    world=st.integers(1, 4),
    batch=st.integers(1, 40),
    workers=st.integers(2, 5),
    drop=st.booleans(),
)
def test_property_dealing_keeps_each_ranks_indices(n, world, batch, workers, drop):
    offsets = random_offsets(np.random.default_rng(n), n // 7 + 1, 13)
    for r in range(world):
        plain = make("block", offsets, num_replicas=world, rank=r, seed=5, drop_last=drop)
        dealt = BlockShuffleSampler(
            None,
            block_offsets=offsets,
            num_replicas=world,
            rank=r,
            seed=5,
            drop_last=drop,
            batch_size=batch,
            num_workers=workers,
        )
        a, b = list(plain), list(dealt)
        assert len(a) == len(b) == len(plain)
        assert collections.Counter(a) == collections.Counter(b)
        # Batch k goes to worker k % workers; each worker's batches, in order, are the
        # next contiguous piece of the undealt run (worker 0's first).
        nb = -(-len(b) // batch)
        start = 0
        for w in range(workers):
            mine = [x for k in range(w, nb, workers) for x in b[k * batch : (k + 1) * batch]]
            assert a[start : start + len(mine)] == mine
            start += len(mine)
        assert start == len(a)


def test_dealing_config_change_resumes_exactly():
    data = KINDS["block"]
    n = dataset_len("block", data)
    s = make("dealt", data, num_replicas=2, rank=0, seed=8)
    consumed = list(itertools.islice(iter(s), 50))
    s1 = make("dealt", data, num_replicas=2, rank=1, seed=8)
    consumed += list(itertools.islice(iter(s1), 50))
    state = s.state_dict()
    assert state["batch_size"] == 7 and state["num_workers"] == 3
    # Same world, other DataLoader settings (and back to no dealing): the rest of the
    # epoch once, nothing consumed again.
    for kw in ({"batch_size": 4, "num_workers": 2}, {}):
        parts = []
        for r in range(2):
            t = BlockShuffleSampler(None, block_offsets=data, num_replicas=2, rank=r, **kw)
            t.load_state_dict(state)
            parts.append(list(t))
        got = collections.Counter(itertools.chain(*parts))
        rest = set(range(n)) - set(consumed)
        assert set(got) == rest and sum(got.values()) - len(rest) < 2


def test_dealing_arguments_are_checked():
    # num_workers without batch_size: the batch size comes from the loader (none when
    # the sampler is iterated directly: the plain order).
    alone = BlockShuffleSampler(None, block_offsets=[0, 10, 20], num_workers=2)
    assert list(alone) == list(BlockShuffleSampler(None, block_offsets=[0, 10, 20]))
    with pytest.raises(ValueError, match="num_workers"):
        BlockShuffleSampler(None, block_offsets=[0, 10], batch_size=2, num_workers=-1)
    with pytest.raises(ValueError, match="batch_size"):
        BlockShuffleSampler(None, block_offsets=[0, 10], batch_size=0)
    # One worker (or none): nothing to deal, the plain order.
    one = BlockShuffleSampler(None, block_offsets=[0, 10, 20], batch_size=3, num_workers=1)
    assert list(one) == list(BlockShuffleSampler(None, block_offsets=[0, 10, 20]))


@pytest.mark.parametrize("num_workers", [2, 3])
def test_dealing_learned_from_the_bound_loader(num_workers):
    # deal_to_workers=True: the sampler takes the batch size and workers of the loader
    # bound to it (tg.bind) and lays the order out exactly as if they had been given.
    ds = RangeData(random_offsets(np.random.default_rng(4), 25, 30))
    learned = BlockShuffleSampler(ds, window=3, seed=2, deal_to_workers=True)
    given = BlockShuffleSampler(ds, window=3, seed=2, batch_size=6, num_workers=num_workers)
    loader = tg.bind(DataLoader(ds, batch_size=6, sampler=learned, num_workers=num_workers))
    got = [i for b in loader for i in b.tolist()]
    assert got == list(given) and sorted(got) == list(range(len(ds)))
    assert list(learned) == list(given)  # bound: the same order, however it is iterated
    state = learned.state_dict()
    assert (state["batch_size"], state["num_workers"]) == (6, num_workers)
    # Unbound and iterated directly, nobody to deal to: the plain order.
    plain = BlockShuffleSampler(ds, window=3, seed=2)
    assert list(BlockShuffleSampler(ds, window=3, seed=2, deal_to_workers=True)) == list(plain)
    # Without the flag the order does not depend on the loader.
    default = BlockShuffleSampler(ds, window=3, seed=2)
    loader = tg.bind(DataLoader(ds, batch_size=6, sampler=default, num_workers=num_workers))
    assert [i for b in loader for i in b.tolist()] == list(plain)


def test_unbound_dealing_still_finds_its_loader_with_a_deprecation_warning():
    ds = RangeData(random_offsets(np.random.default_rng(4), 25, 30))
    given = BlockShuffleSampler(ds, window=3, seed=2, batch_size=6, num_workers=2)
    unbound = BlockShuffleSampler(ds, window=3, seed=2, deal_to_workers=True)
    loader = DataLoader(ds, batch_size=6, sampler=unbound, num_workers=2)
    with pytest.warns(DeprecationWarning, match=r"tg\.bind"):
        got = [i for b in loader for i in b.tolist()]
    assert got == list(given)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        tg.bind(loader)
        assert [i for b in loader for i in b.tolist()] == got


def test_learned_dealing_resumes_exactly_through_stateful_dataloader():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = RangeData(random_offsets(np.random.default_rng(5), 30, 40))

    def make():
        s = BlockShuffleSampler(ds, window=3, seed=9, deal_to_workers=True)
        return tg.bind(sdl.StatefulDataLoader(ds, batch_size=5, sampler=s, num_workers=2))

    full = [b.tolist() for b in make()]
    loader = make()
    head = []
    for step, batch in enumerate(loader, start=1):
        head.append(batch.tolist())
        if step == 7:
            state = loader.state_dict()
            break
    del loader
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full
