"""pad_collate's dtype beside empty rows, uint64 rows checked among others, and the
shapes of tokenizer results tokenize_batch takes or refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.tokens.tokenize import tokenize_batch


def test_pad_collate_all_empty_rows_keep_their_dtype() -> None:
    out = tg.pad_collate([{"x": np.array([])}, {"x": np.array([])}], keys=["x"])
    assert out["x"].shape == (2, 0)
    assert out["x"].dtype == torch.float64


def test_pad_collate_float_row_with_values_still_makes_floats() -> None:
    batch = [{"x": np.array([], dtype=np.int64)}, {"x": np.array([0.5])}]
    out = tg.pad_collate(batch, keys=["x"])
    assert out["x"].dtype == torch.float64
    assert out["x"].tolist() == [[0.0], [0.5]]


def test_pad_collate_uint64_row_past_int64_among_others_is_named() -> None:
    batch = [
        {"x": np.array([1], dtype=np.int32)},
        {"x": np.array([1], dtype=np.int32)},
        {"x": np.array([3, 2**63 + 1], dtype=np.uint64)},
    ]
    with pytest.raises(ValueError, match="record 2 "):
        tg.pad_collate(batch, keys=["x"])


def test_tokenize_result_1d_int_array_is_refused() -> None:
    with pytest.raises(TypeError, match="text 0 ids of shape"):
        tokenize_batch(lambda texts: np.array([1, 2]), ["a", "b"])


def test_tokenize_result_2d_array_is_refused() -> None:
    with pytest.raises(TypeError, match="padded"):
        tokenize_batch(lambda texts: np.zeros((2, 3), np.int64), ["a", "b"])


def test_tokenize_0d_bytes_not_utf8_is_named() -> None:
    with pytest.raises(ValueError, match="text 0 of the batch is not UTF-8"):
        tokenize_batch(lambda texts: [[1]], [np.array(b"\xff")])
