"""Where the samplers get their world from, and evaluation without padding.

World size and rank are decided when a sampler is used, not when it is built; a
DataLoader wrapper that splits batches between processes itself (Accelerate's) gets the
one global order; ``pad=False`` gives every sample exactly once over the ranks.
"""

from __future__ import annotations

import collections
import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import torchgrain as tg
from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler

OFFSETS = np.array([0, 7, 7, 20, 31, 45, 46, 60, 73], dtype=np.int64)


def make(kind, data, **kw):
    if kind == "global":
        return GlobalShuffleSampler(data, **kw)
    if kind == "dealt":
        kw = {"batch_size": 4, "num_workers": 3, **kw}
    return BlockShuffleSampler(None, block_offsets=data, window=3, **kw)


def data_for(kind, n):
    if kind == "global":
        return n
    rng = np.random.default_rng(n)
    sizes = rng.integers(0, 12, size=n // 6 + 1)
    sizes[-1] += n - sizes.sum() if sizes.sum() < n else 0
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return offsets[offsets <= n] if offsets[-1] > n else offsets


def length(kind, data):
    return data if kind == "global" else int(data[-1])


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- world


@pytest.mark.parametrize("kind", ["global", "block"])
def test_is_a_distributed_sampler(kind):
    # Lightning keeps a DistributedSampler in place instead of wrapping it in its own
    # DistributedSamplerWrapper (which would split an already split order again).
    s = make(kind, 100 if kind == "global" else OFFSETS, num_replicas=2, rank=1)
    assert isinstance(s, DistributedSampler)
    assert (s.num_replicas, s.rank) == (2, 1)
    assert s.num_samples == len(s)
    assert s.total_size == len(s) * 2


@pytest.mark.parametrize("kind", ["global", "block"])
def test_world_is_decided_at_first_use(kind, monkeypatch, no_launcher_env):
    data = 100 if kind == "global" else OFFSETS
    n = length(kind, data)
    s = make(kind, data, seed=3)  # built before any launcher variables exist
    assert (s.num_replicas, s.rank) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (s.num_replicas, s.rank) == (2, 1)
    assert len(s) == -(-n // 2)
    mine = list(s)
    other = list(make(kind, data, seed=3, num_replicas=2, rank=0))
    assert mine == list(make(kind, data, seed=3, num_replicas=2, rank=1))
    assert sorted(set(mine) | set(other)) == list(range(n))
    assert s.state_dict()["num_replicas"] == 2


def test_launcher_without_rank_raises(monkeypatch, no_launcher_env):
    s = GlobalShuffleSampler(10)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="init_process_group"):
        list(s)
    with pytest.raises(RuntimeError, match="RANK"):
        len(s)
    # WORLD_SIZE=1 is a single process: fine.
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sorted(s) == list(range(10))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        len(s)


def test_explicit_world_wins_over_environment(monkeypatch, no_launcher_env):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = GlobalShuffleSampler(10, num_replicas=1, rank=0)
    assert sorted(s) == list(range(10))
    t = GlobalShuffleSampler(10, rank=0)  # rank given, world from the environment
    assert (t.num_replicas, t.rank) == (4, 0)


def test_pickled_sampler_decides_in_the_process_that_uses_it(monkeypatch, no_launcher_env):
    s = GlobalShuffleSampler(50, seed=1)
    assert len(s) == 50  # used once in the parent, world 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    t = pickle.loads(pickle.dumps(s))
    assert len(t) == 25
    assert list(t) == list(GlobalShuffleSampler(50, seed=1, num_replicas=2, rank=0))


# ------------------------------------------------------------- batch-sharding wrappers


def _accelerate_shards(loader_sampler, batch_size, world, **kw):
    from accelerate.data_loader import BatchSamplerShard

    out = []
    for r in range(world):
        bs = BatchSamplerShard(
            BatchSampler(loader_sampler(), batch_size, False),
            num_processes=world,
            process_index=r,
            **kw,
        )
        out.append((len(bs), [i for batch in bs for i in batch]))
    return out


@pytest.mark.parametrize("kind", ["global", "block"])
@pytest.mark.parametrize("split_batches", [False, True])
def test_accelerate_batch_sharding_gets_the_global_order(
    kind, split_batches, monkeypatch, no_launcher_env
):
    pytest.importorskip("accelerate")
    # As in a process launched with 2 ranks: the sampler alone would split by rank,
    # and Accelerate's BatchSamplerShard would split the rest again (half covered).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    data = 120 if kind == "global" else np.array([0, 30, 60, 90, 120])
    shards = _accelerate_shards(
        lambda: make(kind, data, seed=4), 10, 2, split_batches=split_batches
    )
    (len0, ids0), (_, ids1) = shards
    assert sorted(ids0 + ids1) == list(range(120))  # one disjoint cover
    # The global order, dealt by Accelerate: whole batches round-robin, or halves.
    order = list(make(kind, data, seed=4, num_replicas=1, rank=0))
    batches = [order[b * 10 : b * 10 + 10] for b in range(12)]
    if split_batches:
        assert len0 == 12 and ids0 == [i for b in batches for i in b[:5]]
    else:
        assert len0 == 6 and ids0 == [i for b in batches[0::2] for i in b]


def test_sampler_remembers_it_is_sharded_outside(monkeypatch, no_launcher_env):
    pytest.importorskip("accelerate")
    from accelerate.data_loader import BatchSamplerShard

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    s = GlobalShuffleSampler(40, seed=2)
    assert len(s) == 20  # on its own: rank 1 of 2
    bs = BatchSamplerShard(BatchSampler(s, 5, False), num_processes=2, process_index=1)
    assert len(bs) == 4  # len() through the wrapper already sees the global order
    assert len(s) == 40 and (s.num_replicas, s.rank) == (1, 0)
    state = s.state_dict()
    assert state["num_replicas"] == 1


def test_explicit_world_under_accelerate_raises(monkeypatch, no_launcher_env):
    pytest.importorskip("accelerate")
    from accelerate.data_loader import BatchSamplerShard

    s = GlobalShuffleSampler(40, num_replicas=2, rank=0)
    bs = BatchSamplerShard(BatchSampler(s, 5, False), num_processes=2, process_index=0)
    with pytest.raises(ValueError, match="without num_replicas"):
        list(bs)


def test_plain_dataloader_is_not_mistaken_for_a_sharder(monkeypatch, no_launcher_env):
    pytest.importorskip("accelerate")
    import accelerate  # noqa: F401  (imported: the lookup is active)

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    s = GlobalShuffleSampler(30, seed=1)
    loader = DataLoader(list(range(30)), batch_size=4, sampler=s)
    got = [i for b in loader for i in b.tolist()]
    assert got == list(GlobalShuffleSampler(30, seed=1, num_replicas=2, rank=0))
    assert s._external is None


# -------------------------------------------------------------------- pad=False (eval)


@pytest.mark.parametrize("kind", ["global", "block", "dealt"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 23, 73])
def test_unpadded_split_covers_every_sample_once(kind, world, n):
    data = n if kind == "global" else (np.array([0, n]) if n != 73 else OFFSETS)
    parts = [list(make(kind, data, num_replicas=world, rank=r, pad=False)) for r in range(world)]
    assert sorted(itertools.chain(*parts)) == list(range(n))
    lengths = [len(p) for p in parts]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == [
        len(make(kind, data, num_replicas=world, rank=r, pad=False)) for r in range(world)
    ]
    if kind == "global":
        # Unshuffled, it is DistributedSampler's order without the padded tail.
        for r in range(world):
            plain = make(kind, data, num_replicas=world, rank=r, pad=False, shuffle=False)
            assert list(plain) == list(range(r, n, world))


def _run(kind, data, world, pos, pad, drop=False, epoch=1):
    consumed, states = [], []
    for r in range(world):
        s = make(kind, data, num_replicas=world, rank=r, seed=8, pad=pad, drop_last=drop)
        s.set_epoch(epoch)
        consumed += list(itertools.islice(iter(s), pos))
        states.append(s)
    return consumed, states[0].state_dict()


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(["global", "block", "dealt"]),
    n=st.integers(0, 200),
    old_w=st.integers(1, 5),
    new_w=st.integers(1, 5),
    frac=st.floats(0, 1),
    pad_old=st.booleans(),
    pad_new=st.booleans(),
)
def test_property_unpadded_resume(kind, n, old_w, new_w, frac, pad_old, pad_new):
    data = data_for(kind, n)
    total = length(kind, data)
    per_old = -(-total // old_w)
    pos = int(frac * per_old)
    consumed, state = _run(kind, data, old_w, pos, pad_old)
    parts = []
    for r in range(new_w):
        t = make(kind, data, num_replicas=new_w, rank=r, pad=pad_new)
        t.load_state_dict(state)
        parts.append(list(t))
    rest = set(range(total)) - set(consumed)
    got = collections.Counter(itertools.chain(*parts))
    if pad_new:
        assert rest <= set(got) and 0 <= sum(got.values()) - len(rest) < new_w
    else:
        assert set(got) == rest and all(v == 1 for v in got.values())
    if old_w == new_w and pad_old == pad_new:
        for r in range(new_w):
            s = make(kind, data, num_replicas=new_w, rank=r, seed=8, pad=pad_new)
            s.set_epoch(1)
            assert parts[r] == list(s)[pos:]


def test_pad_is_saved_and_checked():
    s = GlobalShuffleSampler(11, num_replicas=2, rank=0, pad=False)
    assert s.state_dict()["pad"] is False
    assert s.total_size == 11
    assert GlobalShuffleSampler(11, num_replicas=2, rank=0).total_size == 12


def test_resumable_loader_is_exported():
    assert tg.ResumableLoader.__module__ == "torchgrain.loader"


# ---------------------------------------------------------------------------- binding


def test_loader_binding_checks_its_values():
    for bad in ({"batch_size": 0}, {"step": 0}, {"num_workers": -1}, {"pad_to": 0}):
        with pytest.raises(ValueError):
            tg.LoaderBinding(**bad)
    assert tg.LoaderBinding(batch_size=8).positions_per_step == 8
    assert tg.LoaderBinding(batch_size=8, step=16).positions_per_step == 16
    with pytest.raises(TypeError, match="LoaderBinding"):
        GlobalShuffleSampler(10).bind_loader({"batch_size": 2})


def test_bind_needs_a_torchgrain_sampler():
    with pytest.raises(TypeError, match="torchgrain sampler"):
        tg.bind(DataLoader(list(range(4)), batch_size=2))
    with pytest.raises(TypeError, match="torchgrain sampler"):
        tg.bind(DataLoader(list(range(4))), sampler=object())


def test_bound_to_a_sharder_the_order_is_global_and_padded_like_the_loader(
    monkeypatch, no_launcher_env
):
    # As in rank 1 of 2 under a loader that splits batches itself and fills its last
    # step of 20 (Accelerate's BatchSamplerShard with even_batches).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    binding = tg.LoaderBinding(batch_size=10, sharder="x.Sharder", step=20, pad_to=20)
    s = GlobalShuffleSampler(1001, seed=3)
    s.bind_loader(binding)
    assert (s.num_replicas, s.rank, len(s)) == (1, 0, 1020)
    order = list(s)
    assert sorted(set(order)) == list(range(1001)) and order[1001:] == order[:19]
    # A resume inside the padding continues exactly.
    it = iter(s)
    head = [next(it) for _ in range(1010)]
    state = s.state_dict()
    assert (state["pad_to"], state["num_replicas"], state["position"]) == (20, 1, 1010)
    t = GlobalShuffleSampler(1001, seed=3)
    t.bind_loader(binding)
    t.load_state_dict(state)
    assert head + list(t) == order
    # Without the binding (a plain loader), a padded state is re-split: the rest once.
    u = GlobalShuffleSampler(1001, seed=3, num_replicas=1, rank=0)
    u.load_state_dict(state)
    assert list(u) == []
    with pytest.raises(ValueError, match="without num_replicas"):
        GlobalShuffleSampler(10, num_replicas=2, rank=0).bind_loader(binding)
    # pad=False (evaluation): never padded.
    e = GlobalShuffleSampler(1001, seed=3, pad=False)
    e.bind_loader(binding)
    assert len(e) == 1001
