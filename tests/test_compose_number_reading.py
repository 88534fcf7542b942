"""Indices, weights and fractions are read as the numbers they print as: a batch index
past int64 is named, a numpy float weight or fraction is its decimal, and weights by
name give every dataset one."""

from __future__ import annotations

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.compose.mix import mixture_weights
from torchgrain.compose.subset import split_counts
from torchgrain.sources.index import ShardIndex


@pytest.mark.parametrize(
    "batch", [[0, 2**63], [2**63, -1], (1, 2**63), [np.uint64(2**63), 0], [[0, 1], [2, 2**63]]]
)
def test_a_batch_index_past_int64_among_others_is_the_index_error_naming_it(batch):
    with pytest.raises(IndexError, match=f"record index {2**63} out of range"):
        ShardIndex([3, 4]).check(batch)


def test_a_float_in_a_batch_is_the_type_error_naming_it():
    with pytest.raises(TypeError, match=r"\[1\.5\]"):
        ShardIndex([3, 4]).check([0, 1.5])
    assert ShardIndex([3, 4]).check([6, 0]).tolist() == [6, 0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_float_weights_are_the_decimals_they_print_as(dtype):
    weights = list(np.array([0.9, 0.1], dtype))
    assert mixture_weights([5, 5], weights) == mixture_weights([5, 5], [0.9, 0.1])
    m = tg.mix([[{"x": i} for i in range(10)]] * 2, weights, length=5)
    assert m.source.counts.tolist() == [5, 0]


def test_numpy_integer_weights_are_exact_and_complex_ones_refused():
    big = 2**62 + 1
    assert mixture_weights([1, 1], [np.int64(big), np.uint64(big - 2)]) == mixture_weights(
        [1, 1], [big, big - 2]
    )
    with pytest.raises(TypeError, match="numbers"):
        mixture_weights([1, 1], [np.complex64(1), 1])


def test_weights_by_name_must_name_every_dataset():
    data = {"web": [{"x": 1}] * 4, "books": [{"x": 2}] * 4, "code": [{"x": 3}] * 4}
    with pytest.raises(ValueError, match=r"\['books', 'code'\] have no weight"):
        tg.mix(data, {"web": 0.7})
    m = tg.mix(data, {"web": 0.7, "books": 0, "code": 0})  # weight 0: left out, said so
    assert m.source.counts.tolist() == [len(m), 0, 0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_numpy_float_fractions_are_the_decimals_they_print_as(dtype):
    for fractions in ([0.9, 0.1], [0.8, 0.1, 0.1], [0.7, 0.2, 0.1]):
        named = dict(zip("abc", np.array(fractions, dtype)))
        want = split_counts(1000, dict(zip("abc", fractions)))
        assert split_counts(1000, named) == want
        assert sum(want.values()) == 1000
        parts = tg.split(tg.Dataset([{"x": i} for i in range(100)]), named, seed=0)
        assert sorted(r["x"] for p in parts.values() for r in p) == list(range(100))
