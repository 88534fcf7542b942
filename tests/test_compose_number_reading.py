"""Indices, weights and fractions are read as the numbers they print as: a batch index
past int64 is named, a numpy float weight or fraction is its decimal, and weights by
name give every dataset one."""

from __future__ import annotations

import numpy as np
import pytest

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
