"""Columns batches from source to training loop: every batch holds its own records.

Reproducers found by auditing the transport (worker slots, collate, prefetch) against a
plain read of the same indices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.columns import ColumnBatch


def _records(n=8):
    return [{"x": np.full(2, i, np.float32), "y": i} for i in range(n)]


def _drop_odd_x(batch):  # keeps the even rows of one column only
    return {"x": batch["x"][batch["y"] % 2 == 0], "y": batch["y"]}


def _short_column(batch):
    out = ColumnBatch(dict(batch), num_rows=len(batch))
    out["x"] = out["x"][:1]
    return out


@pytest.mark.parametrize("fn", [_drop_odd_x, _short_column])
def test_a_map_batch_column_of_another_length_is_an_error(fn):
    # A map_batch that loses rows of one column would pair each x with another record's
    # y without a word; one that returns a list of records of another length is refused.
    ds = tg.Dataset(_records(), batch_format="columns").map_batch(fn)
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    with pytest.raises(TypeError, match=r"column 'x' of \d rows for a batch of 4"):
        next(iter(loader))
