"""A record's Python floats become float64 tensors, as torch's default collate makes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.columns import ColumnBatch
from torchgrain.transforms import ToTensor


@pytest.mark.parametrize("form", ["records", "columns"])
def test_pad_collate_keeps_python_numbers_dtypes(form):
    recs = [{"x": [1, 2.5], "n": (3, 4), "h": [np.float16(1.5)]}, {"x": [0.1], "n": [5], "h": []}]
    batch = recs if form == "records" else ColumnBatch.from_records(recs)
    out = tg.pad_collate(batch, keys=["x", "n", "h"])
    assert out["x"].dtype == torch.float64 and out["x"].tolist() == [[1.0, 2.5], [0.1, 0.0]]
    assert out["n"].dtype == torch.int64 and out["n"].tolist() == [[3, 4], [5, 0]]
    assert out["h"].dtype == torch.float16


def test_pad_collate_names_a_list_that_is_not_numbers():
    with pytest.raises(TypeError, match=r"field 'x' of record 1 .* got an array of object"):
        tg.pad_collate([{"x": [1]}, {"x": [1, None]}], keys=["x"])


def test_to_tensor_keeps_python_floats_float64():
    out = ToTensor(keys=["x", "y", "n"])({"x": [1e300, 0.1], "y": 0.1, "n": [1, 2]})
    assert out["x"].dtype == torch.float64 and out["x"].tolist() == [1e300, 0.1]
    assert out["y"].dtype == torch.float64 and out["y"].item() == 0.1
    assert out["n"].dtype == torch.int64
    with pytest.raises(TypeError, match="key 'x' holds a object array"):
        ToTensor(keys=["x"])({"x": [1, None]})
