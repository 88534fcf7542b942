"""Composed datasets against simple references: concatenations, mixtures, filters,
subsets, splits and token windows give the records (and tokens) a list comprehension
over the inputs gives, refuse every index outside themselves, and count exactly."""

from __future__ import annotations

import math
import pickle
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.compose.mix import MixOrder, mixture_counts, mixture_weights
from torchgrain.compose.subset import split_counts

QUIET = {"index_dir": None, "progress": False, "num_workers": 0}


def _all(ds):
    return ds.__getitems__(list(range(len(ds))))


def _recs(prefix, n):
    return [{"id": f"{prefix}{i}", "x": i} for i in range(n)]


def _even(r):
    return r["x"] % 2 == 0


# ---------------------------------------------------------------- references
def _ref_counts(length, weights):
    """Largest remainder in exact arithmetic, a weight being the decimal it prints as."""
    exact = [Fraction(str(w)) for w in weights]
    shares = [length * w / sum(exact) for w in exact]
    counts = [math.floor(s) for s in shares]
    order = sorted(range(len(shares)), key=lambda k: (counts[k] - shares[k], k))
    for k in order[: length - sum(counts)]:
        counts[k] += 1
    return counts


def _ref_order(counts):
    """Draw j of source k at time (2j + 1) / (2 c_k), merged, ties to the lower k."""
    times = sorted(
        (Fraction(2 * j + 1, 2 * c), k, j) for k, c in enumerate(counts) for j in range(c)
    )
    return [k for _, k, _ in times], [j for _, _, j in times]


def _ref_windows(docs, seq_len, bos=None, eos=None):
    stream, pos, doc = [], [], []
    for d, t in enumerate(docs):
        full = ([bos] if bos is not None else []) + list(t) + ([eos] if eos is not None else [])
        stream += full
        pos += list(range(len(full)))
        doc += [d] * len(full)
    n = max(0, (len(stream) - 1) // seq_len)
    return [
        (stream[i * seq_len : (i + 1) * seq_len], stream[i * seq_len + 1 : (i + 1) * seq_len + 1])
        for i in range(n)
    ]


def _pairs(windows):
    return [(w["input_ids"].tolist(), w["labels"].tolist()) for w in windows]


# ---------------------------------------------------------------- indices
def _composed():
    a, b = tg.Dataset(_recs("a", 10)), tg.Dataset(_recs("b", 5))
    docs = tg.Dataset([{"t": np.arange(3 * k, 3 * k + k % 4, dtype=np.int64)} for k in range(12)])
    win = docs.windows("t", 2, index_dir=None, progress=False)
    return {
        "concat": tg.concat([a, b]),
        "mix": tg.mix([a, b], [0.5, 0.5]),
        "mix of mix": tg.mix([tg.mix([a, b], [0.5, 0.5]), tg.Dataset(_recs("c", 4))], [1, 1]),
        "filter": a.filter(_even, **QUIET),
        "select": a.select([3, 1, 4, 1]),
        "split": tg.split(a, {"t": 0.7, "v": 0.3}, seed=1)["v"],
        "windows": win,
        "concat of filter of windows": tg.concat(
            [win.filter(lambda w: int(w["input_ids"][0]) % 2 == 0, **QUIET), win]
        ),
    }


@pytest.mark.parametrize("name", list(_composed()))
def test_every_composed_dataset_refuses_indices_outside_itself(name):
    ds = _composed()[name]
    n = len(ds)
    assert n > 0
    first = ds[0]
    assert _same(ds[np.int64(0)], first) and _same(ds[np.uint32(0)], first)
    for bad in (-1, -n, n, np.int64(n), np.int64(-1), 2**63, 2**64):
        with pytest.raises(IndexError):
            ds[bad]
        with pytest.raises(IndexError):
            ds.__getitems__([bad])
    for bad in (-1, n, 2**64):
        with pytest.raises(IndexError):
            ds.__getitems__([0, bad])
    with pytest.raises(IndexError):
        ds.__getitems__(np.array([0, 2**63], np.uint64))
    for bad in (True, np.True_, 0.0, slice(0, 1)):
        with pytest.raises(TypeError):
            ds[bad]
    with pytest.raises(TypeError):
        ds.__getitems__(np.array([True, False]))


@pytest.mark.parametrize("name", ["concat", "filter", "windows"])
def test_a_batch_with_an_index_past_int64_is_an_index_error_naming_it(name):
    ds = _composed()[name]
    with pytest.raises(IndexError, match=str(2**63)):
        ds.__getitems__([0, 2**63])


def _same(x, y):
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return np.array_equal(np.asarray(x), np.asarray(y))
    return x == y


# ---------------------------------------------------------------- mixtures
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=5).filter(lambda c: sum(c) > 0))
def test_the_mixture_order_is_the_merge_of_evenly_spaced_draw_times(counts):
    source, draw = MixOrder(counts)(np.arange(sum(counts)))
    assert (source.tolist(), draw.tolist()) == _ref_order(counts)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from([0, 1, 2, 3, 0.1, 0.25, 0.3, 0.5, 0.6, 0.9, 1e-3]), min_size=1, max_size=4
    ),
    st.integers(0, 200),
)
def test_mixture_counts_are_the_exact_largest_remainder(weights, length):
    if not any(weights):
        return
    got = mixture_counts(length, mixture_weights([1] * len(weights), weights)).tolist()
    assert got == _ref_counts(length, weights)


def test_numpy_float32_weights_are_the_decimals_they_print_as():
    # [0.9, 0.1] of 5 records: shares 4.5 and 0.5, the tie to the earlier dataset.
    weights = np.array([0.9, 0.1], np.float32)
    assert [str(w) for w in weights] == ["0.9", "0.1"]
    python = tg.mix([_recs("a", 10), _recs("b", 10)], [0.9, 0.1], length=5)
    numpy = tg.mix([_recs("a", 10), _recs("b", 10)], list(weights), length=5)
    assert python.source.counts.tolist() == [5, 0]
    assert numpy.source.counts.tolist() == python.source.counts.tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    sizes=st.lists(st.integers(0, 12), min_size=2, max_size=3),
    weights=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    stopping=st.sampled_from(["first_exhausted", "all_exhausted"]),
    seed=st.integers(0, 3),
    epochs=st.integers(1, 3),
)
def test_a_mixture_draws_each_record_once_per_pass_in_its_exact_counts(
    sizes, weights, stopping, seed, epochs
):
    weights = weights[: len(sizes)]
    if not any(w and n for w, n in zip(weights, sizes)) or any(
        n == 0 and w for n, w in zip(sizes, weights)
    ):
        return
    parts = [[{"k": k, "r": r} for r in range(n)] for k, n in enumerate(sizes)]
    m = tg.mix(parts, weights, seed=seed, stopping=stopping)
    counts = m.source.counts.tolist()
    assert counts == _ref_counts(len(m), weights)
    drawn = [[] for _ in sizes]
    for e in range(epochs):
        m.set_epoch(e)
        got = _all(m)
        again = pickle.loads(pickle.dumps(m))
        again.set_epoch(e)
        assert _all(again) == got  # a function of (seed, epoch)
        per = [[r["r"] for r in got if r["k"] == k] for k in range(len(sizes))]
        assert [len(p) for p in per] == counts
        for k, p in enumerate(per):
            drawn[k] += p
    for k, n in enumerate(sizes):
        for p in range(0, len(drawn[k]) - n + 1, max(n, 1)):  # each whole pass: every record once
            assert sorted(drawn[k][p : p + n]) == list(range(n))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, -0.5, "1", None, True])
def test_bad_weights_are_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        tg.mix([_recs("a", 4), _recs("b", 4)], [1, bad])


def test_a_component_of_no_records_needs_weight_zero():
    with pytest.raises(ValueError, match="no records"):
        tg.mix([_recs("a", 4), []], [1, 1])
    m = tg.mix([_recs("a", 4), []], [1, 0])
    assert [r["id"] for r in sorted(_all(m), key=lambda r: r["x"])] == [f"a{i}" for i in range(4)]


# ---------------------------------------------------------------- concat / select / split
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4), data=st.data())
def test_concat_and_select_batches_spanning_inputs_are_the_list_reference(sizes, data):
    parts = [_recs(f"p{k}-", n) for k, n in enumerate(sizes)]
    flat = [r for p in parts for r in p]
    ds = tg.concat([tg.Dataset(p) if k % 2 else p for k, p in enumerate(parts)])
    assert len(ds) == len(flat)
    if not flat:
        return
    idx = data.draw(st.lists(st.integers(0, len(flat) - 1), max_size=12))
    assert ds.__getitems__(idx) == [flat[i] for i in idx]
    sel = ds.select(np.array(idx, np.uint16))
    assert _all(sel) == [flat[i] for i in idx]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 60),
    fractions=st.lists(
        st.sampled_from([0.0, 0.1, 0.2, 0.25, 1 / 3, 0.5, 0.7]), min_size=1, max_size=4
    ),
    seed=st.integers(0, 5),
)
def test_split_parts_are_disjoint_and_cover_what_the_fractions_say(n, fractions, seed):
    if sum(fractions) > 1 + 1e-9:
        return
    named = {f"p{k}": f for k, f in enumerate(fractions)}
    parts = tg.split(tg.Dataset(_recs("r", n)), named, seed=seed)
    got = {k: [r["x"] for r in _all(p)] for k, p in parts.items()}
    seen = [x for v in got.values() for x in v]
    assert len(seen) == len(set(seen))
    assert {k: len(v) for k, v in got.items()} == split_counts(n, named)
    if abs(sum(fractions) - 1) < 1e-9:
        assert sorted(seen) == list(range(n))


# ---------------------------------------------------------------- windows
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lengths=st.lists(st.integers(0, 9), max_size=10),
    seq_len=st.sampled_from([1, 2, 5]),
    keep=st.integers(0, 3),
)
def test_windows_of_composed_documents_are_the_reference_stream_cut(lengths, seq_len, keep):
    docs = [[1000 * d + j for j in range(n)] for d, n in enumerate(lengths)]
    recs = [{"t": np.array(t, np.int64), "d": d} for d, t in enumerate(docs)]
    half = len(recs) // 2
    inputs = {
        "concat": (tg.concat([recs[:half], tg.Dataset(recs[half:])]), docs),
        "filter": (
            tg.Dataset(recs).filter(lambda r: r["d"] % 4 != keep, **QUIET),
            [t for d, t in enumerate(docs) if d % 4 != keep],
        ),
        "select": (tg.Dataset(recs).select(list(range(len(recs)))[::-1]), docs[::-1]),
    }
    for name, (ds, want) in inputs.items():
        w = ds.windows("t", seq_len, eos=7, index_dir=None, progress=False)
        assert _pairs(_all(w)) == _ref_windows(want, seq_len, eos=7), name


def _parquet_windows(tmp_path, tokens, type_, seq_len=2):
    path = str(tmp_path / "tokens.parquet")
    pq.write_table(pa.table({"t": pa.array(tokens, pa.list_(type_))}), path)
    return tg.Dataset(tg.ParquetSource(path)).windows("t", seq_len, index_dir=None, progress=False)


def test_uint32_token_ids_above_2_31_are_read_unwrapped(tmp_path):
    tokens = [[2**32 - 1, 2**31 + 5, 7], [1, 2**31]]
    w = _parquet_windows(tmp_path, tokens, pa.uint32())
    assert _pairs(_all(w)) == _ref_windows(tokens, 2)
    assert all(np.asarray(x["input_ids"]).dtype == np.int64 for x in _all(w))


@pytest.mark.parametrize(
    "tokens, type_", [([[2**64 - 1, 1], [2, 3]], pa.uint64()), ([[5, -3], [2, 3]], pa.int64())]
)
def test_token_ids_outside_int64_or_negative_are_named_errors(tmp_path, tokens, type_):
    w = _parquet_windows(tmp_path, tokens, type_, seq_len=1)
    with pytest.raises(tg.CorruptDataError, match="token id"):
        _all(w)


def test_composed_datasets_over_windows_read_the_windows_they_name():
    docs = [list(range(10 * d, 10 * d + d % 5)) for d in range(16)]
    ds = tg.Dataset([{"t": np.array(t, np.int64)} for t in docs])
    w = ds.windows("t", 3, bos=1, eos=2, index_dir=None, progress=False)
    ref = _ref_windows(docs, 3, bos=1, eos=2)
    assert _pairs(_all(w)) == ref
    even = w.filter(lambda x: int(x["input_ids"][0]) % 2 == 0, **QUIET)
    kept = [r for r in ref if r[0][0] % 2 == 0]
    assert _pairs(_all(even)) == kept
    both = tg.concat([even, w.select([0, len(w) - 1])])
    assert _pairs(_all(both)) == [*kept, ref[0], ref[-1]]
    mixed = tg.mix([even, w], [1, 1], stopping="all_exhausted")
    got = _pairs(_all(mixed))
    assert all(g in ref for g in got) and len(got) == len(mixed)


def test_weights_by_name_that_leave_a_dataset_out_are_refused():
    with pytest.raises(ValueError, match="books"):
        tg.mix({"web": _recs("w", 10), "books": _recs("b", 10)}, {"web": 0.7})


def test_numpy_float32_fractions_that_sum_to_1_put_every_record_in_a_part():
    fractions = dict(zip(["train", "val"], np.array([0.9, 0.1], np.float32)))
    parts = tg.split(tg.Dataset(_recs("r", 100)), fractions, seed=0)
    assert sum(len(p) for p in parts.values()) == 100


def test_numpy_float32_fractions_that_print_as_summing_to_1_are_accepted():
    fractions = dict(zip("abc", np.array([0.8, 0.1, 0.1], np.float32)))
    assert sum(split_counts(1000, fractions).values()) == 1000


def _first_token_even(w):
    return int(w["input_ids"][0]) % 2 == 0


def test_a_mixture_of_a_filter_of_windows_reads_alike_in_two_workers(tmp_path):
    path = str(tmp_path / "docs.parquet")
    docs = [list(range(100 * d, 100 * d + d % 7)) for d in range(40)]
    pq.write_table(pa.table({"t": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=7)
    w = tg.Dataset(tg.ParquetSource(path)).windows("t", 3, eos=1, index_dir=None, progress=False)
    ref = _ref_windows(docs, 3, eos=1)
    even = w.filter(_first_token_even, **QUIET)
    mixed = tg.mix({"even": even, "all": w.select(range(0, len(w), 2))}, {"even": 2, "all": 1})
    sampler = tg.GlobalShuffleSampler(mixed, seed=5)
    loader = torch.utils.data.DataLoader(
        mixed, batch_size=4, sampler=sampler, num_workers=2, collate_fn=list
    )
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = list(sampler)
        sampler.set_epoch(epoch)  # the same pass again, on purpose
        got = [x for batch in loader for x in batch]
        want = mixed.__getitems__(order)
        assert _pairs(got) == _pairs(want)
        assert all(p in ref for p in _pairs(got))


def _codepoints(texts):
    return [[ord(c) for c in t] for t in texts]


@pytest.mark.parametrize("text", [np.array("hi"), np.array([104, 105])], ids=["str", "int64"])
def test_a_numpy_array_that_is_not_utf8_bytes_is_never_tokenized_as_its_memory(text):
    from torchgrain.tokens.tokenize import tokenize

    ds = tg.Dataset([{"text": text}, {"text": "yo"}]).map_batch(tokenize("text", _codepoints))
    try:
        got = [r["tokens"].tolist() for r in _all(ds)]
    except (TypeError, ValueError):
        return  # refused: a text that is not a string, named
    assert got == [[104, 105], [121, 111]]


def test_a_concatenation_of_a_filter_and_a_split_resumes_exactly_in_other_workers():
    docs = tg.Dataset([{"t": np.arange(10 * d, 10 * d + d % 5, dtype=np.int64)} for d in range(30)])
    w = docs.windows("t", 2, index_dir=None, progress=False)
    both = tg.concat(
        {
            "even": w.filter(_first_token_even, **QUIET),
            "part": tg.split(w, {"a": 0.6, "b": 0.4}, seed=2)["b"],
        },
        source_field="from",
    )

    def loader(workers):
        sampler = tg.GlobalShuffleSampler(both, seed=9)
        return tg.ResumableLoader(
            torch.utils.data.DataLoader(
                both, batch_size=3, sampler=sampler, num_workers=workers, collate_fn=list
            )
        )

    whole = [(x["from"], *_pairs([x])[0]) for b in loader(0) for x in b]
    assert sorted(map(str, whole)) == sorted(
        map(str, ((x["from"], *_pairs([x])[0]) for x in _all(both)))
    )
    first, head = loader(2), []
    for k, batch in enumerate(first):
        head += batch
        if k == 2:
            state = first.state_dict()
            break
    rest = loader(0)
    rest.load_state_dict(state)
    tail = [x for b in rest for x in b]
    assert [(x["from"], *_pairs([x])[0]) for x in head + tail] == whole


@pytest.mark.parametrize("columns", [False, True])
def test_pad_collate_never_wraps_uint64_ids_above_int64(columns):
    from torchgrain.columns import ColumnBatch

    big = 2**63 + 5
    batch = [{"labels": np.array([big, 1], np.uint64)}, {"labels": np.array([7], np.uint64)}]
    try:
        out = tg.pad_collate(ColumnBatch.from_records(batch) if columns else batch)
    except (ValueError, OverflowError, tg.CorruptDataError):
        return  # refused, as windows refuse a token id above 2**63 - 1
    assert int(out["labels"][0, 0]) == big
