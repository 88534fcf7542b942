"""tg.mix: exact counts per epoch, passes without repeats, O(1) order, resume, the CLI."""

from __future__ import annotations

import collections
import json
import os
import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.compose.mix import Mix, MixOrder, mixture_counts, mixture_weights
from torchgrain.compose.spec import SpecError, load_spec


def ids(prefix, n):
    return [{"id": f"{prefix}{i}"} for i in range(n)]


def brute_order(counts):
    """The merge the mixture's order is defined as: draw j of source k at time
    (j + 0.5) / c_k, ties to the lower source, by sorting every draw."""
    times = [(Fraction(2 * j + 1, 2 * c), k, j) for k, c in enumerate(counts) for j in range(c)]
    times.sort()
    return [k for _, k, _ in times], [j for _, _, j in times]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(
        st.one_of(st.integers(0, 4), st.integers(0, 60)), min_size=1, max_size=6
    ).filter(lambda c: sum(c) > 0)
)
def test_order_is_the_merge_of_evenly_spaced_draws(counts):
    source, draw = MixOrder(counts)(np.arange(sum(counts)))
    assert (source.tolist(), draw.tolist()) == brute_order(counts)
    # Each prefix holds each source's share to within 1/2 + w (K - 2) / 2 draws.
    seen = np.cumsum(np.eye(len(counts), dtype=np.int64)[source], axis=0)
    share = np.outer(np.arange(1, sum(counts) + 1), counts) / sum(counts)
    w = np.array(counts) / sum(counts)
    assert (np.abs(seen - share) <= 0.5 + w * max(len(counts) - 2, 0) / 2 + 1e-9).all()
    if len(counts) == 2:
        assert (np.abs(seen - share) < 1).all()


def test_order_of_a_huge_epoch_uses_exact_integers():
    counts = [3_000_000_001, 2_000_000_000, 5]  # (2j + 1) * c_m overflows int64
    order = MixOrder(counts)
    L = sum(counts)
    pos = np.array([0, 1, 2, L // 2, L - 2, L - 1])
    source, draw = order(pos)
    assert source[-1] in (0, 1) and (draw >= 0).all()
    # The 5 draws of source 2 sit at the times (j + 0.5) / 5: positions around j/5 of L.
    hits = order(np.arange(L // 10 - 3, L // 10 + 3))[0]
    assert 2 in hits.tolist()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    data=st.data(),
)
def test_exact_counts_passes_and_cover(sizes, data):
    weights = data.draw(
        st.one_of(st.none(), st.lists(st.floats(0.05, 5), min_size=len(sizes), max_size=len(sizes)))
    )
    stopping = data.draw(st.sampled_from(["first_exhausted", "all_exhausted"]))
    seed = data.draw(st.integers(0, 2**64 - 1))
    m = Mix([ids(f"s{k}-", n) for k, n in enumerate(sizes)], weights, seed=seed, stopping=stopping)
    L, counts = len(m), m.counts
    w = [float(x) for x in mixture_weights(sizes, weights)]
    # Largest remainder: each count is the floor or the ceiling of its quota.
    assert counts.sum() == L and (np.abs(counts - L * np.array(w)) < 1).all()
    ratios = [Fraction(n) / w for n, w in zip(sizes, m.weights)]
    if stopping == "first_exhausted":  # L = floor(min n_k / w_k): no source repeats
        assert min(ratios) // 1 == L and (counts <= sizes).all()
    else:  # L = ceil(max n_k / w_k): every source gives a whole pass
        assert -(-max(ratios) // 1) == L and (counts >= sizes).all()
    # Over several epochs, each source's draws (in draw order) are whole passes,
    # each pass every record exactly once.
    drawn = collections.defaultdict(list)
    for epoch in range(3):
        m.set_epoch(epoch)
        source, record = m.draws(np.arange(L))
        assert np.bincount(source, minlength=len(sizes)).tolist() == counts.tolist()
        for k in range(len(sizes)):
            drawn[k].extend(record[source == k].tolist())
    for k, n in enumerate(sizes):
        got = drawn[k]
        for p in range(len(got) // n):
            assert sorted(got[p * n : (p + 1) * n]) == list(range(n))
        tail = got[len(got) // n * n :]
        assert len(set(tail)) == len(tail)


def test_stopping_rules_length_and_temperature():
    a, b = ids("a", 100), ids("b", 10)
    assert len(tg.mix([a, b], [0.5, 0.5])) == 20  # b runs out first
    assert len(tg.mix([a, b], [0.5, 0.5], stopping="all_exhausted")) == 200
    assert tg.mix([a, b]).source.counts.tolist() == [100, 10]  # proportional to sizes
    ds = tg.mix([a, b], [1, 2], length=7)
    assert len(ds) == 7 and ds.source.counts.tolist() == [2, 5]  # 2.33, 4.67
    t = tg.mix([a, b], temperature=2, length=1000).source
    assert t.counts.tolist() == [760, 240]  # sqrt(100) : sqrt(10)
    assert tg.mix([a, b], temperature=1).source.counts.tolist() == [100, 10]
    # 100 ** 200 is past the float range (was an OverflowError): b's share is 10 ** -200
    assert tg.mix([a, b], temperature=0.005).source.counts.tolist() == [100, 0]
    assert mixture_counts(10, mixture_weights([1, 1, 1], [1, 1, 1])).tolist() == [4, 3, 3]
    # weights by a name that is not a str (was weight 0 for dataset 2, without a word)
    assert tg.mix({"a": a, 2: b}, {"a": 0.5, 2: 0.5}).source.counts.tolist() == [10, 10]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"weights": [1]}, ValueError, "1 weights for 2 datasets"),
        ({"weights": [1, -1]}, ValueError, ">= 0"),
        ({"weights": [0, 0]}, ValueError, "not all be 0"),
        ({"weights": [1, float("nan")]}, ValueError, "finite"),
        ({"weights": [1, 1], "temperature": 2}, ValueError, "not both"),
        ({"temperature": 0}, ValueError, "> 0"),
        ({"stopping": "never"}, ValueError, "stopping"),
        ({"length": -1}, ValueError, "length"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tg.mix([ids("a", 3), ids("b", 2)], **kwargs)


def test_empty_source_named_and_weight_zero_allowed():
    with pytest.raises(ValueError, match=r"'empty'.*no records"):
        tg.mix({"a": ids("a", 3), "empty": []}, {"a": 1, "empty": 1})
    ds = tg.mix({"a": ids("a", 3), "empty": []}, {"a": 1, "empty": 0})
    assert sorted(r["id"] for r in ds.__getitems__(range(len(ds)))) == ["a0", "a1", "a2"]


def test_source_field_names_and_o1_memory():
    ds = tg.mix({"web": ids("w", 5), "books": ids("b", 3)}, source_field="src", length=10**9)
    assert len(ds) == 10**9 and ds.source.counts.tolist() == [625_000_000, 375_000_000]
    recs = ds.__getitems__([0, 1, 10**9 - 1])
    assert all(r["src"] == {"w": "web", "b": "books"}[r["id"][0]] for r in recs)
    # Nothing of the epoch's size: the pickled dataset is a few KB.
    assert len(pickle.dumps(ds)) < 20_000
    with pytest.raises(IndexError):
        ds[10**9]


def add_noise(rec, rng):
    return {**rec, "u": float(rng.random())}


def not_third(rec):
    return rec["x"] % 3 != 0


def _records(loader):
    return [r for batch in loader for r in batch]


def _flat(batch):
    return batch


@pytest.fixture(scope="module")
def two_formats(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    tg.write_parquet([{"id": f"p{i}", "x": i} for i in range(60)], str(d / "p"))
    tg.write_array_record([{"id": f"a{i}", "x": i} for i in range(13)], str(d / "a"))
    return d


def _mixture(d):
    return tg.mix(
        {"p": tg.ParquetSource(str(d / "p")), "a": tg.ArrayRecordSource(str(d / "a"))},
        {"p": 0.7, "a": 0.3},
        seed=11,
        stopping="all_exhausted",
    ).random_map(add_noise, seed=3)


def _epochs(ds, workers, ctx=None, epochs=(0, 1)):
    sampler = tg.GlobalShuffleSampler(ds, seed=5, num_replicas=1, rank=0)
    kw = {"multiprocessing_context": ctx, "persistent_workers": True} if workers else {}
    loader = DataLoader(
        ds, batch_size=8, sampler=sampler, num_workers=workers, collate_fn=_flat, **kw
    )
    out = []
    for e in epochs:
        sampler.set_epoch(e)
        out.append([(r["id"], r["u"]) for r in _records(loader)])
    return out


def test_same_order_whatever_workers_and_start_method(two_formats):
    ds = _mixture(two_formats)
    ref = _epochs(ds, 0)
    assert ref[0] != ref[1]
    assert _epochs(ds, 2, "spawn") == ref  # persistent workers see epoch 1 too
    n = len(ds)
    counts = collections.Counter(i[0][0] for i in ref[0])
    assert counts == {"p": ds.source.counts[0], "a": ds.source.counts[1]} and n == sum(
        counts.values()
    )


def test_mid_epoch_resume_is_exact(two_formats):
    def make():
        ds = _mixture(two_formats)
        s = tg.GlobalShuffleSampler(ds, seed=5, num_replicas=1, rank=0)
        return tg.ResumableLoader(
            DataLoader(ds, batch_size=8, sampler=s, num_workers=2, collate_fn=_flat)
        )

    def run(loader, stop_after=None):
        out = []
        for _ in range(loader.epoch, 2):
            for batch in loader:
                out.append([(r["id"], r["u"]) for r in batch])
                if len(out) == stop_after:
                    return out, json.loads(json.dumps(loader.state_dict()))
        return out, None

    full, _ = run(make())
    head, state = run(make(), stop_after=len(full) // 2 + 3)  # into the second epoch
    resumed = make()
    resumed.load_state_dict(state)
    rest, _ = run(resumed)
    assert head + rest == full


def _rank_main(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        ds = _distributed_mixture(tmp)
        sampler = tg.GlobalShuffleSampler(ds, seed=5)
        loader = tg.ResumableLoader(
            DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=_flat)
        )
        head = []
        for b in loader:
            head.extend((r["id"], r["u"]) for r in b)
            if len(head) == 12:
                break
        state = loader.state_dict()
        out = [None] * world
        dist.all_gather_object(out, {"head": head, "state": state})
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _distributed_mixture(tmp):
    parquet = tg.Dataset(tg.ParquetSource(os.path.join(tmp, "p")))
    parquet = parquet.filter(
        not_third, num_workers=0, progress=False, index_dir=os.path.join(tmp, "idx")
    )
    return tg.mix(
        [parquet, tg.ArrayRecordSource(os.path.join(tmp, "a"))],
        [0.6, 0.4],
        seed=2,
        stopping="all_exhausted",
    ).random_map(add_noise, seed=1)


def test_two_ranks_two_workers_then_elastic_resume_on_one(tmp_path):
    tg.write_parquet([{"id": f"p{i}", "x": i} for i in range(90)], str(tmp_path / "p"))
    tg.write_array_record([{"id": f"a{i}", "x": i} for i in range(17)], str(tmp_path / "a"))
    # Forked ranks (nothing read yet in this process): no interpreter start-up per rank.
    mp.start_processes(_rank_main, args=(2, str(tmp_path)), nprocs=2, start_method="fork")
    result = json.loads((tmp_path / "result.json").read_text())
    ds = _distributed_mixture(str(tmp_path))
    whole = [(r["id"], r["u"]) for r in ds.__getitems__(range(len(ds)))]  # epoch 0
    assert len(ds) == 100 and result[0]["state"] == result[1]["state"]
    one = tg.GlobalShuffleSampler(ds, seed=5, num_replicas=1, rank=0)
    resumed = tg.ResumableLoader(DataLoader(ds, batch_size=4, sampler=one, collate_fn=_flat))
    resumed.load_state_dict(result[0]["state"])
    rest = [(r["id"], r["u"]) for b in resumed for r in b]
    heads = result[0]["head"] + result[1]["head"]
    assert len(heads) == 24
    assert collections.Counter(map(tuple, heads + rest)) == collections.Counter(whole)
    kept = {i for i, _ in whole if i[0] == "p"}
    assert kept == {f"p{i}" for i in range(90) if i % 3 != 0}  # filtered, each once per pass


def test_spec_file_and_cli(two_formats, tmp_path, capsys, monkeypatch):
    from torchgrain.cli import main

    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))  # the filter's index

    spec = {
        "mix": [
            {
                "path": str(two_formats / "p"),
                "weight": 0.7,
                "name": "web",
                "filter": [["x", "<", 20]],
            },
            {"path": str(two_formats / "a"), "weight": 0.3, "format": "array_record"},
        ],
        "seed": 4,
        "stopping": "all_exhausted",
        "source_field": "src",
    }
    path = tmp_path / "mixture.json"
    path.write_text(json.dumps(spec))
    ds = load_spec(str(path))
    assert ds.source.counts.tolist() == [31, 13]
    assert {r["src"] for r in ds.__getitems__(range(len(ds)))} == {"web", "1"}
    assert main(["inspect", str(path), "--json", "--samples", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "mix" and out["num_records"] == 44 and len(out["samples"]) == 2
    assert [d["per_epoch"] for d in out["datasets"]] == [31, 13]
    assert (
        main(
            [
                "bench",
                str(path),
                "--seconds",
                "0.5",
                "--repeats",
                "1",
                "--workers",
                "0",
                "--batch-size",
                "8",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["num_records"] == 44 and report["format"] == "composition"
    assert os.listdir(tmp_path / "cache")

    concat = tmp_path / "concat.json"
    concat.write_text(json.dumps({"concat": [{"path": str(two_formats / "a")}] * 2}))
    assert main(["inspect", str(concat)]) == 0
    assert "concat of 2 datasets" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, match",
    [
        ([1], "one of 'mix' or 'concat'"),
        ({"mix": []}, "non-empty list"),
        ({"mix": [{"weight": 1}]}, "mix entry 0: 'path'"),
        ({"mix": [{"path": "a", "wieght": 1}]}, r"mix entry 0: unknown keys \['wieght'\]"),
        ({"mix": [{"path": "a", "weight": 1}, {"path": "a"}]}, "mix entry 1 has no 'weight'"),
        ({"mix": [{"path": "missing"}]}, "mix entry 0 \\('missing'\\)"),
        ({"mix": [{"path": "a", "filter": [["x", "<", 1]]}]}, "Parquet datasets only"),
        ({"mix": [{"path": "p", "filter": "x < 1"}]}, "'filter' must be"),
        ({"concat": [{"path": "a", "weight": 2}]}, "take no 'weight'"),
        ({"mix": [{"path": "a"}], "seeed": 1}, r"unknown keys \['seeed'\]"),
        ({"mix": [{"path": "a", "weight": -1}]}, ">= 0"),
        ({"mix": [{"path": "p", "filter": [["nope", "==", 1]]}]}, "mix entry 0: 'filter'.*nope"),
        ({"mix": [{"path": "p", "filter": [["x", "==", "a"]]}]}, "mix entry 0: 'filter'.*string"),
    ],
)
def test_spec_errors_name_the_file_and_entry(two_formats, spec, match):
    path = two_formats / "bad.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(SpecError, match=match) as e:
        load_spec(str(path))
    assert "bad.json" in str(e.value)


@pytest.mark.parametrize("name", ["deep.json", "deep.yaml"])
def test_spec_nested_past_the_stack_is_a_spec_error(tmp_path, name):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    path = tmp_path / name
    path.write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError from the parser
    with pytest.raises(SpecError, match=f"{name}: not valid"):
        load_spec(str(path))


class Prepared:
    """A dataset that records the read-ahead orders and epochs it is given."""

    def __init__(self, n):
        self.n, self.orders, self.epochs = n, [], []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": f"r{i}"}

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def read_ahead(self, order, start, count, position):
        self.orders.append(order(start, start + count).tolist())


def test_read_ahead_and_epoch_reach_the_sources_remapped():
    child = Prepared(5)
    ds = tg.mix([child, ids("b", 7)], [0.5, 0.5], stopping="all_exhausted")  # 14: 7 + 7
    ds.set_epoch(1)
    assert child.epochs == [1]
    ds.read_ahead(lambda a, b: np.arange(a, b)[::-1], 0, len(ds), lambda: 0)
    source, record = ds.source.draws(np.arange(len(ds))[::-1])
    assert child.orders == [record[source == 0].tolist()]  # epoch 1's draws, pass order
    assert len(child.orders[0]) == 7


def test_block_shuffle_sampler_drives_a_mixture():
    from torchgrain.sampling import BlockShuffleSampler

    a = [{"x": i} for i in range(30)]
    b = [{"x": 100 + i} for i in range(20)]
    ds = tg.mix([a, b], [0.5, 0.5], seed=1, length=40)
    assert ds.block_offsets().tolist() == [0, 40]
    sampler = BlockShuffleSampler(ds, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(40))
    xs = [ds[i]["x"] for i in order]
    assert sum(x < 100 for x in xs) == 20 and len(set(xs)) == 40
