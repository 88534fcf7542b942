"""Composed datasets held to their promises across epochs: a selection found once is
never one whose records change with the epoch, a split's parts stay disjoint, a label
never overwrites a record's own value, and a mixture's numbers never wrap around."""

from __future__ import annotations

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.compose.mix import Mix
from torchgrain.sampling.permutation import KeyedPermutations


def ids(prefix, n):
    return [{"id": f"{prefix}{i}", "x": i} for i in range(n)]


def _all(ds):
    return ds.__getitems__(range(len(ds)))


def _noise(rec, rng):
    return {**rec, "x": int(rng.integers(100))}


@pytest.mark.parametrize("changing", ["mixture", "random_map"])
def test_a_filter_over_a_dataset_wrapping_records_that_change_with_the_epoch_is_refused(changing):
    # tg.Dataset(dataset) adapts the inner Dataset as a sequence: the check of what
    # changes with the epoch did not look through it, and the selection found at epoch 0
    # served other records at epoch 1 (ones the predicate rejects).
    if changing == "mixture":
        inner = tg.mix([ids("a", 40), ids("b", 6)], [0.5, 0.5], seed=1)
    else:
        inner = tg.Dataset(ids("c", 20)).random_map(_noise, seed=0)
    with pytest.raises(TypeError, match="change with the epoch"):
        tg.Dataset(inner).filter(
            lambda r: r["x"] % 2 == 0, index_dir=None, progress=False, num_workers=0
        )


@pytest.mark.parametrize("columns", [False, True])
def test_source_field_never_overwrites_a_key_of_records_whose_keys_are_unknown(columns):
    # Records of a list or of a Dataset with transforms do not declare their keys, so
    # the check made when the concatenation is built cannot see a clash: the label
    # replaced the records' own "source" without a word.
    web = tg.Dataset([{"id": 0, "source": "crawl"}]).map(dict)
    books = [{"id": 1, "source": "library"}]
    for ds in (
        tg.concat({"web": web, "books": books}, source_field="source"),
        tg.mix({"web": web, "books": books}, source_field="source"),
    ):
        with pytest.raises(ValueError, match="source"):
            if columns:
                ds.source.read_columns([0, 1])
            else:
                _all(ds)


def test_a_split_of_a_mixture_keeps_its_parts_disjoint_across_epochs():
    # A mixture's positions read other records at another epoch, so the parts of a
    # split by position were disjoint at each epoch but not across them: a record held
    # out at epoch 0 was trained on at epoch 1. Refused, as a filter of one is.
    mixed = tg.mix({"a": ids("a", 100), "b": ids("b", 10)}, {"a": 0.5, "b": 0.5})
    try:
        parts = tg.split(mixed, {"train": 0.5, "val": 0.5}, seed=0)
    except TypeError as e:
        assert "mixture" in str(e)
        return
    mixed.set_epoch(0)
    held_out = {r["id"] for r in _all(parts["val"])}
    mixed.set_epoch(1)
    assert not held_out & {r["id"] for r in _all(parts["train"])}


def test_windows_of_a_mixture_are_refused_or_read_each_epochs_documents():
    docs_a = [{"t": [100 * k + j for j in range(k % 7 + 1)]} for k in range(40)]
    docs_b = [{"t": [10**5 + 100 * k + j for j in range(k % 7 + 1)]} for k in range(6)]
    mixed = tg.mix([docs_a, docs_b], [0.5, 0.5], seed=1)
    try:
        win = mixed.windows("t", 4, index_dir=None, progress=False)
    except TypeError as e:
        assert "epoch" in str(e)
        return
    win.set_epoch(1)
    got = [int(t) for r in _all(win) for t in r["input_ids"]]
    stream = [t for r in _all(mixed) for t in r["t"]]  # the mixture at epoch 1
    assert got == stream[: len(got)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"weights": [1e-300, 1], "stopping": "all_exhausted"},  # 10**301 records
        {"length": 2**63},  # its counts' sum wrapped to a negative length
    ],
)
def test_a_mixture_of_more_records_than_int64_holds_is_a_value_error_naming_its_length(kwargs):
    with pytest.raises(ValueError, match="records per epoch"):
        tg.mix([ids("a", 10), ids("b", 3)], **kwargs)


def test_a_mixture_at_a_large_epoch_reads_its_own_draws_not_wrapped_ones():
    # Draw numbers epoch * c_k + j were int64: at epoch 2**44 with 2**20 draws per epoch
    # they wrapped to epoch 0's, so that epoch repeated epoch 0's records exactly.
    sizes = [10, 10]
    m = Mix([ids("a", 10), ids("b", 10)], [1, 1], seed=3, length=2**21)
    epoch = 2**44
    m.set_epoch(epoch)
    positions = np.arange(0, 64)
    source, record = m.draws(positions)
    _, draw = m._order(positions)
    for k, j, got in zip(source.tolist(), draw.tolist(), record.tolist()):
        g = epoch * int(m.counts[k]) + j  # the draw's number, in exact integers
        p, within = divmod(g, sizes[k])
        perms = KeyedPermutations(np.array(sizes), 3, epoch=p, tag=b"mix")
        assert got == int(perms(np.array([k]), np.array([within]))[0])


def test_weights_by_name_of_two_datasets_whose_names_read_alike_are_refused():
    # {1: ..., "1": ...}: names are str(key), so both datasets took the weight of "1"
    # (a 50/50 mixture where 90/10 was asked for).
    with pytest.raises(ValueError, match="'1'"):
        tg.mix({1: ids("a", 30), "1": ids("b", 30)}, {1: 0.9, "1": 0.1})


class _Sized:
    """Records never read: only a length (what a mixture's order depends on)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i}


def test_a_shuffled_batch_of_an_upsampled_mixture_is_resolved_in_a_few_permutation_calls(
    monkeypatch,
):
    import torchgrain.compose.mix as mix_module

    made = []

    class Counted(KeyedPermutations):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("epoch"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(mix_module, "KeyedPermutations", Counted)
    m = Mix([_Sized(1000), _Sized(10**7)], [0.1, 0.9], stopping="all_exhausted")
    batch = np.random.default_rng(0).permutation(len(m))[:256]
    m.draws(batch)
    assert len(made) <= 2, f"{len(made)} permutation families for one batch"


def test_draws_over_many_passes_are_those_of_each_pass_s_own_family():
    """The batched evaluation over many passes gives what each pass's permutation family
    gives on its own (the same records, in the same places), at small and huge epochs."""
    from torchgrain.compose.mix import _Passes

    rng = np.random.default_rng(5)
    sizes = [1, 3, 1000, 7]
    passes = _Passes(sizes, seed=11)
    for base in (0, 2**61):
        source = rng.integers(0, len(sizes), 500)
        g = (
            rng.integers(0, 40, 500) * np.array(sizes)[source]
            + rng.integers(0, 10**6, 500) % np.array(sizes)[source]
        )
        g = g.astype(object) + base if base else g
        want = np.empty(500, np.int64)
        for k in range(500):
            n = sizes[source[k]]
            fam = KeyedPermutations(np.array(sizes), 11, epoch=int(g[k] // n), tag=b"mix")
            want[k] = fam(source[k : k + 1], np.array([int(g[k] % n)]))[0]
        assert passes(source, g).tolist() == want.tolist()
