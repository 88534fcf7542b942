"""The packed-window index check: one rule for documents it leaves out."""

from types import SimpleNamespace

import numpy as np
import pytest

from torchgrain.tokens.windows import _check_bins


def _index(docs: list[int], bins: list[int], tokens: int) -> SimpleNamespace:
    arrays = {"docs": np.array(docs, np.int64), "bins": np.array(bins, np.int64)}
    # (none of these documents is longer than seq_len=8: none truncated)
    return SimpleNamespace(arrays=arrays, meta={"tokens": tokens, "truncated": 0})


@pytest.mark.parametrize(
    ("offsets", "docs", "bins", "tokens", "why"),
    [
        ([0, 3, 5], [1, 0], [0, 2], 5, None),  # every document placed
        ([0, 3, 5], [0], [0, 1], 3, "it leaves out documents"),  # windows, one missing
        ([0, 3, 3], [0], [0, 1], 3, "it leaves out documents"),  # an empty one missing
        ([0, 3, 5], [], [0], 0, "it leaves out documents"),  # no windows, tokens exist
        ([0, 0, 0], [], [0], 0, None),  # no windows and no tokens at all
        ([0, 3, 5], [1, 0], [0, 2], 4, "its token count is wrong"),
    ],
)
def test_check_bins(offsets, docs, bins, tokens, why):
    assert _check_bins(_index(docs, bins, tokens), np.array(offsets, np.int64), 8, 0) == why
