"""Resume against the uninterrupted run, record by record.

A sampler's pass is a permutation (every index once per epoch over all ranks with
``pad=False``), fixed by (seed, epoch); a run resumed from any ``state_dict()`` yields
exactly the rest, for the global, block and sequential orders, 1-4 ranks, uneven
lengths, ``drop_last`` both ways, composed datasets and DataLoader workers. Each check
compares the resumed records with those of a run that was never stopped.
"""

from __future__ import annotations

import collections
import itertools
import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import torchgrain as tg

KINDS = ["global", "block", "sequential"]
LENGTHS = [0, 1, 2, 3, 5, 7, 11, 13, 23]
DEALINGS = [(None, None), (2, 2), (3, 2), (1, 3)]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # epoch-not-set and empty-dataset warnings
        yield


def _sampler(kind, n, world, rank, *, drop_last=False, pad=True, dealing=(None, None), seed=5):
    kw = dict(num_replicas=world, rank=rank, seed=seed, drop_last=drop_last, pad=pad)
    if kind == "block":
        offsets = np.unique(np.r_[0, np.linspace(0, n, 4).astype(int), n])
        batch_size, workers = dealing
        return tg.BlockShuffleSampler(
            None, block_offsets=offsets, window=2, batch_size=batch_size, num_workers=workers, **kw
        )
    return tg.GlobalShuffleSampler(n, shuffle=kind == "global", **kw)


def _state_after(sampler, p):
    """The state after ``p`` draws of a fresh pass, through JSON as a checkpoint is."""
    it = iter(sampler)
    for _ in range(p):
        next(it)
    return json.loads(json.dumps(sampler.state_dict()))


# ------------------------------------------------------------------- sampler level

settings_fast = settings(max_examples=150, deadline=None)


@settings_fast
@given(
    kind=st.sampled_from(KINDS),
    n=st.sampled_from(LENGTHS),
    world=st.integers(1, 4),
    epoch=st.integers(0, 3),
    dealing=st.sampled_from(DEALINGS),
)
def test_a_pass_without_padding_gives_every_index_once_over_the_ranks(
    kind, n, world, epoch, dealing
):
    drawn = []
    for rank in range(world):
        s = _sampler(kind, n, world, rank, pad=False, dealing=dealing)
        s.set_epoch(epoch)
        drawn += list(s)
    assert sorted(drawn) == list(range(n))
    again = _sampler(kind, n, world, 0, pad=False, dealing=dealing, seed=5)
    again.set_epoch(epoch)
    first = _sampler(kind, n, world, 0, pad=False, dealing=dealing)
    first.set_epoch(epoch)
    assert list(again) == list(first)  # (seed, epoch) fixes the order


@settings_fast
@given(
    kind=st.sampled_from(KINDS),
    n=st.sampled_from(LENGTHS),
    world=st.integers(1, 4),
    data=st.data(),
    drop_last=st.booleans(),
    pad=st.booleans(),
    epoch=st.integers(0, 3),
    dealing=st.sampled_from(DEALINGS),
)
def test_a_resume_at_any_position_continues_every_rank_exactly(
    kind, n, world, data, drop_last, pad, epoch, dealing
):
    rank = data.draw(st.integers(0, world - 1))
    make = lambda **kw: _sampler(  # noqa: E731
        kind, n, world, rank, drop_last=drop_last, pad=pad, dealing=dealing, **kw
    )
    full = make()
    full.set_epoch(epoch)
    full = list(full)
    p = data.draw(st.integers(0, len(full)))
    saved = make()
    saved.set_epoch(epoch)
    state = _state_after(saved, p)
    resumed = make(seed=99)  # the state's seed wins
    resumed.load_state_dict(state)
    assert list(resumed) == full[p:]
    # The loop of docs/samplers.md: set_epoch with the state's epoch keeps the position.
    again = make()
    again.load_state_dict(state)
    again.set_epoch(epoch)
    assert list(again) == full[p:]


@settings_fast
@given(
    kind=st.sampled_from(KINDS),
    n=st.sampled_from(LENGTHS),
    world=st.integers(2, 4),
    data=st.data(),
    drop_last=st.booleans(),
)
def test_rank_zeros_state_continues_every_rank_in_lockstep(kind, n, world, data, drop_last):
    ranks = [_sampler(kind, n, world, r, drop_last=drop_last) for r in range(world)]
    full = [list(s) for s in ranks]
    p = data.draw(st.integers(0, len(full[0])))
    state = _state_after(_sampler(kind, n, world, 0, drop_last=drop_last), p)
    for rank in range(world):
        resumed = _sampler(kind, n, world, rank, drop_last=drop_last)
        resumed.load_state_dict(state)
        assert list(resumed) == full[rank][p:]


stage = st.tuples(
    st.integers(1, 4), st.sampled_from(DEALINGS), st.integers(0, 12)
)  # world, dealing, draws per rank before the next checkpoint


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n=st.sampled_from(LENGTHS),
    stages=st.lists(stage, min_size=2, max_size=4),
    epoch=st.integers(0, 2),
)
def test_a_chain_of_elastic_resumes_gives_every_index_of_the_epoch_once(kind, n, stages, epoch):
    """Checkpoint in lockstep, resume on another world (and other dealing), again and
    again: the epoch's indices all come out, each once (``pad=False``)."""
    seen = collections.Counter()
    state = None
    for i, (world, dealing, p) in enumerate(stages):
        last = i == len(stages) - 1
        for rank in range(world):
            s = _sampler(kind, n, world, rank, pad=False, dealing=dealing)
            if state is None:
                s.set_epoch(epoch)
            else:
                s.load_state_dict(state)
            if last:
                seen.update(s)
            else:
                it = iter(s)
                seen.update(itertools.islice(it, p))
                if rank == 0:
                    saved = json.loads(json.dumps(s.state_dict()))
        state = None if last else saved
    assert sorted(seen.elements()) == list(range(n))


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_of_one_epoch_and_set_epoch(kind):
    n, p = 23, 7
    state = _state_after(_sampler(kind, n, 1, 0), p)
    epoch0 = list(_sampler(kind, n, 1, 0))
    epoch1 = _sampler(kind, n, 1, 0)
    epoch1.set_epoch(1)
    epoch1 = list(epoch1)
    # Loaded after set_epoch(1): the state's epoch and position win.
    s = _sampler(kind, n, 1, 0)
    s.set_epoch(1)
    s.load_state_dict(state)
    assert s.epoch == 0 and list(s) == epoch0[p:]
    # set_epoch(1) after the load: epoch 1 from its beginning.
    s = _sampler(kind, n, 1, 0)
    s.load_state_dict(state)
    s.set_epoch(1)
    assert list(s) == epoch1
    if kind != "sequential":
        assert epoch1 != epoch0


# ------------------------------------------------------------------- ResumableLoader

EPOCHS = 3


def _run(loader, stop=None):
    """The loop of docs/samplers.md over epochs up to EPOCHS: (epoch, batch) pairs;
    with ``stop``, also the loader's state after that many batches."""
    out = []
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            out.append((loader.epoch, batch if isinstance(batch, list) else batch.tolist()))
            if len(out) == stop:
                return out, json.loads(json.dumps(loader.state_dict()))
    return out, None


def _plain_loader(kind, n, world, rank, batch_size, loader_drop, sampler_drop, pad=True):
    s = _sampler(kind, n, world, rank, drop_last=sampler_drop, pad=pad)
    dl = DataLoader(list(range(n)), batch_size=batch_size, sampler=s, drop_last=loader_drop)
    return tg.ResumableLoader(dl)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 7, 13])
@pytest.mark.parametrize(("world", "batch_size"), [(1, 4), (2, 3), (3, 1)])
@pytest.mark.parametrize(
    ("loader_drop", "sampler_drop"), [(False, False), (True, False), (False, True)]
)
def test_a_loader_resumed_at_every_batch_of_every_epoch_is_the_run_never_stopped(
    kind, n, world, batch_size, loader_drop, sampler_drop
):
    for rank in range(world):
        args = (kind, n, world, rank, batch_size, loader_drop, sampler_drop)
        reference, _ = _run(_plain_loader(*args))
        for stop in range(1, len(reference) + 1):
            head, state = _run(_plain_loader(*args), stop)
            resumed = _plain_loader(*args)
            resumed.load_state_dict(state)
            tail, _ = _run(resumed)
            assert head + tail == reference, (rank, stop)
            if not loader_drop:  # another batch size: the same records, in order
                other = _plain_loader(kind, n, world, rank, batch_size + 1, False, sampler_drop)
                other.load_state_dict(state)
                tail, _ = _run(other)
                flat = lambda pairs: [(e, x) for e, b in pairs for x in b]  # noqa: E731
                assert flat(head + tail) == flat(reference), (rank, stop)


def _records(tag, n):
    return [{"id": f"{tag}{i}", "tokens": np.arange(i % 7 + 1) + 10 * i} for i in range(n)]


def _ids(batch):
    return [r["id"] if "id" in r else tuple(r["input_ids"].tolist()) for r in batch]


def _noisy(record, rng):
    return {**record, "id": f"{record['id']}:{int(rng.integers(1000))}"}


_FILTER = dict(index_dir=None, num_workers=0, progress=False)
COMPOSED = {
    "mix weights summing to 5": lambda: tg.mix(
        [_records("a", 5), _records("b", 3), _records("c", 2)], [3, 1.5, 0.5], seed=1
    ),
    "mix with a zero weight": lambda: tg.mix([_records("a", 5), _records("b", 3)], [1, 0]),
    "mix repeating an exhausted dataset": lambda: tg.mix(
        [_records("a", 7), _records("b", 2)], [0.3, 0.7], seed=3, stopping="all_exhausted"
    ),
    "mix of a given length": lambda: tg.mix(
        [_records("a", 3), _records("b", 2)], [0.5, 0.5], seed=4, length=11
    ),
    "mix with random maps": lambda: tg.mix(
        [tg.Dataset(_records("a", 7)).random_map(_noisy, seed=3), _records("b", 3)],
        [0.6, 0.4],
        seed=1,
        stopping="all_exhausted",
    ).random_map(_noisy, seed=4),
    "concat of a mix": lambda: tg.concat(
        [tg.mix([_records("a", 5), _records("b", 3)], stopping="all_exhausted"), _records("c", 3)]
    ),
    "select with repeats": lambda: tg.Dataset(_records("a", 9)).select([8, 1, 1, 5, 0, 3, 7]),
    "filter keeping nothing": lambda: tg.Dataset(_records("a", 9)).filter(
        lambda r: False, **_FILTER
    ),
    "filter": lambda: tg.Dataset(_records("a", 9)).filter(
        lambda r: int(r["id"][1:]) % 3 != 1, **_FILTER
    ),
    "windows in pack mode": lambda: tg.Dataset(_records("a", 9)).windows(
        "tokens", 5, mode="pack", index_dir=None, progress=False
    ),
    "mix of windows": lambda: tg.mix(
        [
            tg.Dataset(_records("a", 9)).windows(
                "tokens", 3, mode="pack", index_dir=None, progress=False
            ),
            tg.Dataset(_records("b", 4)).windows("tokens", 3, index_dir=None, progress=False),
        ],
        [0.6, 0.4],
        seed=5,
    ),
}


def _composed_loader(name, world=1, rank=0, num_workers=0, persistent=False, shuffle=True):
    ds = COMPOSED[name]()  # built anew: a resumed run is a new process
    s = tg.GlobalShuffleSampler(ds, num_replicas=world, rank=rank, seed=7, shuffle=shuffle)
    kw = dict(num_workers=num_workers, persistent_workers=persistent) if num_workers else {}
    return tg.ResumableLoader(DataLoader(ds, batch_size=3, sampler=s, collate_fn=_ids, **kw))


@pytest.mark.parametrize("name", list(COMPOSED))
@pytest.mark.parametrize(("world", "shuffle"), [(1, True), (2, False)])
def test_a_composed_dataset_resumed_at_every_batch_reads_the_same_records(name, world, shuffle):
    for rank in range(world):
        reference, _ = _run(_composed_loader(name, world, rank, shuffle=shuffle))
        for stop in range(1, len(reference) + 1):
            head, state = _run(_composed_loader(name, world, rank, shuffle=shuffle), stop)
            resumed = _composed_loader(name, world, rank, shuffle=shuffle)
            resumed.load_state_dict(state)
            tail, _ = _run(resumed)
            assert head + tail == reference, (rank, stop)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_mixture_read_by_workers_resumes_as_one_read_in_process(persistent):
    name = "mix with random maps"
    reference, _ = _run(_composed_loader(name))
    assert _run(_composed_loader(name, num_workers=2, persistent=persistent))[0] == reference
    for stop in (4, 9):
        head, state = _run(_composed_loader(name, num_workers=2, persistent=persistent), stop)
        resumed = _composed_loader(name, num_workers=2, persistent=persistent)
        resumed.load_state_dict(state)
        assert head + _run(resumed)[0] == reference


def _dealt_loader(num_workers):
    s = tg.BlockShuffleSampler(
        None, block_offsets=[0, 5, 11, 17, 23], window=2, seed=5, deal_to_workers=True,
        num_replicas=1, rank=0,
    )  # fmt: skip
    kw = dict(num_workers=num_workers, prefetch_factor=2) if num_workers else {}
    return tg.ResumableLoader(DataLoader(list(range(23)), batch_size=3, sampler=s, **kw))


def test_a_dealt_block_order_resumed_under_other_workers_keeps_every_epochs_records():
    """docs/samplers.md: resuming under another num_workers re-lays out the rest of the
    epoch exactly (the same records, another order)."""
    for stop in (2, 5):
        head, state = _run(_dealt_loader(2), stop)
        for workers in (3, 0):
            resumed = _dealt_loader(workers)
            resumed.load_state_dict(state)
            whole = head + _run(resumed)[0]
            for epoch in range(EPOCHS):
                got = sorted(x for e, b in whole if e == epoch for x in b)
                assert got == list(range(23)), (stop, workers, epoch)


# ------------------------------------------------------------------- known wrong


def _numbered_loader():
    s = tg.GlobalShuffleSampler(12, num_replicas=1, rank=0, seed=1)
    return tg.ResumableLoader(DataLoader(list(range(12)), batch_size=4, sampler=s))


def test_a_refused_loader_state_leaves_the_sampler_as_it_was():
    fresh = _run(_numbered_loader())[0]
    _, state = _run(_numbered_loader(), stop=1)
    loader = _numbered_loader()
    with pytest.raises(ValueError, match="epoch"):
        loader.load_state_dict({**state, "epoch": 7})
    assert _run(loader)[0] == fresh  # read: epoch 0 from its second batch on


def test_a_loader_state_of_the_next_epoch_but_mid_epoch_is_refused():
    _, state = _run(_numbered_loader(), stop=1)  # epoch 0, 8 records still to read
    assert (state["epoch"], state["sampler"]["position"]) == (0, 4)
    with pytest.raises(ValueError, match="epoch"):
        _numbered_loader().load_state_dict({**state, "epoch": 1})


def test_a_pass_that_goes_on_after_set_epoch_does_not_move_the_new_epochs_position():
    s = tg.GlobalShuffleSampler(70_000, num_replicas=1, rank=0, seed=1)
    old = iter(s)
    next(old)
    s.set_epoch(1)
    assert s.state_dict()["position"] == 0
    for _ in itertools.islice(old, 65_536):  # into the old pass's second chunk
        pass
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)  # nothing of epoch 1 drawn


def _stateful(num_workers, torch_sampler=False):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(10))
    if torch_sampler:
        s = DistributedSampler(data, num_replicas=1, rank=0, seed=4)
    else:
        s = tg.GlobalShuffleSampler(data, num_replicas=1, rank=0, seed=4)
    kw = dict(num_workers=num_workers, prefetch_factor=2) if num_workers else {}
    return StatefulDataLoader(data, batch_size=3, sampler=s, **kw), s


def _stateful_run(loader, sampler, start=0, save_after=None):
    """docs/samplers.md's StatefulDataLoader loop; with ``save_after``, the checkpoint
    taken when that epoch's loop is done: its state and the epoch to go on with."""
    out = []
    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        out += [(epoch, b.tolist()) for b in loader]
        if epoch == save_after:
            return out, {"loader": loader.state_dict(), "epoch": epoch + 1}
    return out, None


def _end_of_epoch_resume(num_workers, torch_sampler=False):
    reference, _ = _stateful_run(*_stateful(num_workers, torch_sampler))
    head, ckpt = _stateful_run(*_stateful(num_workers, torch_sampler), save_after=0)
    loader, sampler = _stateful(num_workers, torch_sampler)
    loader.load_state_dict(ckpt["loader"])
    return reference, head + _stateful_run(loader, sampler, start=ckpt["epoch"])[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_end_of_epoch_stateful_checkpoint_resumes_a_torch_sampler_exactly(num_workers):
    reference, resumed = _end_of_epoch_resume(num_workers, torch_sampler=True)
    assert resumed == reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_end_of_epoch_stateful_checkpoint_resumes_exactly(num_workers):
    reference, resumed = _end_of_epoch_resume(num_workers)
    assert resumed == reference


class _Hooked(Dataset):
    """Records 0..n-1; reading one first calls ``hook`` (a signal handler or a
    checkpoint thread that asks for the loader's state while a batch is read)."""

    def __init__(self, n, hook):
        self.n, self.hook = n, hook

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.hook()
        return i


def test_a_checkpoint_asked_for_while_a_pass_reads_its_first_batch_resumes_at_that_batch():
    saved = []

    def make(hook=lambda: None):
        s = tg.GlobalShuffleSampler(12, num_replicas=1, rank=0, seed=1)
        return tg.ResumableLoader(DataLoader(_Hooked(12, hook), batch_size=3, sampler=s))

    reference = _run(make())[0]
    loader = make(lambda: saved or saved.append(json.loads(json.dumps(loader.state_dict()))))
    assert _run(loader)[0] == reference
    resumed = make()
    resumed.load_state_dict(saved[0])  # taken before any batch reached the loop
    assert _run(resumed)[0] == reference


def test_a_checkpoint_at_the_start_of_an_epoch_after_a_pass_left_early():
    """A loop of a fixed number of steps per epoch, checkpointing as each epoch starts."""

    def loop(loader, start, stop_at=None):
        out = []
        for epoch in range(start, EPOCHS):
            loader.set_epoch(epoch)
            if epoch == stop_at:
                return out, json.loads(json.dumps(loader.state_dict()))
            for step, batch in enumerate(loader):
                out.append((epoch, batch.tolist()))
                if step == 1:
                    break  # two batches an epoch
        return out, None

    reference, _ = loop(_numbered_loader(), 0)
    head, state = loop(_numbered_loader(), 0, stop_at=1)
    assert (state["epoch"], state["sampler"]["position"]) == (1, 0)
    resumed = _numbered_loader()
    resumed.load_state_dict(state)
    assert head + loop(resumed, resumed.epoch)[0] == reference


class _LateSecondBatch(Dataset):
    """Records 0..11; record 3 (the second batch of 3, read by worker 1) is read only
    once the loop has the third batch (worker 0's second): the third batch comes first."""

    def __init__(self):
        import multiprocessing

        self.third_taken = multiprocessing.get_context("fork").Event()

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 3:
            self.third_taken.wait(timeout=10)
        return i


def test_a_loader_that_returns_batches_out_of_order_is_refused_or_resumed_exactly():
    data = _LateSecondBatch()

    def make(**kw):
        s = tg.GlobalShuffleSampler(12, num_replicas=1, rank=0, shuffle=False)
        return tg.ResumableLoader(DataLoader(data, batch_size=3, sampler=s, **kw))

    try:
        loader = make(num_workers=2, prefetch_factor=2, multiprocessing_context="fork",
                      in_order=False)  # fmt: skip
        taken = []
        for batch in loader:
            taken += batch.tolist()
            if 6 in taken:
                data.third_taken.set()
            if len(taken) == 6:
                state = json.loads(json.dumps(loader.state_dict()))
                break
    except (TypeError, ValueError):
        return  # refused: a loop cannot count such a loader's batches
    resumed = make()
    resumed.load_state_dict(state)
    rest = [x for batch in resumed for x in batch.tolist()]
    assert sorted(taken + rest) == list(range(12))


def test_a_mixture_under_a_loader_whose_sampler_was_built_from_its_length_moves_on():
    big = [{"id": f"a{i}"} for i in range(10)]
    mixed = tg.mix([big, [{"id": "b0"}, {"id": "b1"}]], [0.5, 0.5])  # 2 of big an epoch
    sampler = tg.GlobalShuffleSampler(len(mixed), num_replicas=1, rank=0)
    loader = tg.ResumableLoader(DataLoader(mixed, batch_size=4, sampler=sampler, collate_fn=_ids))
    seen = {x for _ in range(5) for batch in loader for x in batch}
    assert loader.epoch == 5
    assert {f"a{i}" for i in range(10)} <= seen  # one pass of big over 5 epochs
