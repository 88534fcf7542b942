"""The pack build of token windows: the same bins as the plain best-fit decreasing it
replaced, in memory that holds nothing per document but a few int64 arrays."""

from __future__ import annotations

import bisect
import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgrain.tokens.windows import _best_fit


def _reference(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing as it was first written (a Python list of every length, a
    dict of lists of open windows): the bins every index built so far holds."""
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] > 0]
    which = np.empty(len(order), np.int64)
    sizes: list[int] = []
    free: dict[int, list[int]] = {}
    count = 0
    for j, n in enumerate(lengths[order].tolist()):
        k = bisect.bisect_left(sizes, n)
        if k == len(sizes):
            b, room = count, seq_len
            count += 1
        else:
            room = sizes[k]
            same = free[room]
            b = same.pop()
            if not same:
                del sizes[k], free[room]
        which[j] = b
        left = room - n
        if left > 0:
            same = free.get(left)
            if same is None:
                free[left] = [b]
                bisect.insort(sizes, left)
            else:
                same.append(b)
    grouped = np.argsort(which, kind="stable")
    bins = np.zeros(count + 1, np.int64)
    np.cumsum(np.bincount(which, minlength=count), out=bins[1:])
    return order[grouped], bins


def test_the_bins_are_those_of_the_plain_best_fit(monkeypatch):
    """A few thousand random lengths (ties, empty documents, full windows), with slices
    of the order far smaller than the input: the same documents in the same windows."""
    monkeypatch.setattr("torchgrain.tokens.windows._PACK_STEP", 97)
    rng = np.random.default_rng(38)
    for seq_len, n in ((64, 3000), (512, 4000), (4096, 2000)):
        lens = np.minimum(rng.geometric(4 / seq_len, n), seq_len).astype(np.int64)
        lens[rng.random(n) < 0.05] = 0
        lens[rng.random(n) < 0.02] = seq_len
        got, want = _best_fit(lens, seq_len), _reference(lens, seq_len)
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[0], want[0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 16), max_size=60), st.integers(16, 24))
def test_the_bins_match_on_any_lengths(lengths, seq_len):
    lens = np.array(lengths, np.int64)
    got, want = _best_fit(lens, seq_len), _reference(lens, seq_len)
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[0], want[0])


def test_the_pack_build_holds_no_python_object_per_document():
    """2*10^5 documents: the plain version held a Python int and a list slot per length
    besides its arrays (52 bytes a document at its peak, tracemalloc, numpy's arrays
    included); now the sorted order, each document's window and their grouping (34)."""
    n, seq_len = 200_000, 2048
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.geometric(1 / 600, n), seq_len).astype(np.int64)
    tracemalloc.start()
    try:
        docs, bins = _best_fit(lens, seq_len)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(docs) == n and bins[-1] == n
    assert peak / n < 44, f"{peak / n:.1f} bytes a document at the peak"
