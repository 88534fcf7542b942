"""Mixture weights past a float's range are refused as weights, not by an OverflowError."""

from __future__ import annotations

from fractions import Fraction

import pytest

import torchgrain as tg


@pytest.mark.parametrize(
    "big", [10**400, Fraction(10**400, 3), 10**5000], ids=["int", "fraction", "unprintable"]
)
def test_a_weight_past_a_floats_range_is_a_value_error_naming_the_weights(big):
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        tg.mix([[{"x": 1}] * 3, [{"x": 2}] * 3], weights=[big, 1])


def test_a_large_weight_within_a_floats_range_is_kept_exactly():
    m = tg.mix([[{"x": 1}] * 3, [{"x": 2}] * 3], weights=[10**300, 1])
    assert [r["x"] for r in m] == [1, 1, 1]
