"""Reproducers: pad_collate's dtype of integer ids beside an empty float row, and texts
and tokenizer results that tokenize_batch refuses."""

from __future__ import annotations

import numpy as np
import torch

import torchgrain as tg
from torchgrain.tokens.tokenize import tokenize_batch


def test_pad_collate_empty_float64_row_keeps_int64_ids() -> None:
    big = 2**53 + 1
    batch = [{"input_ids": np.array([])}, {"input_ids": np.array([big, 7], dtype=np.int64)}]
    out = tg.pad_collate(batch, keys=["input_ids"])
    assert out["input_ids"].dtype == torch.int64
    assert out["input_ids"][1].tolist() == [big, 7]


def test_pad_collate_empty_float32_tensor_row_keeps_int64_ids() -> None:
    big = 2**24 + 1
    batch = [
        {"input_ids": torch.tensor([])},
        {"input_ids": torch.tensor([big], dtype=torch.int64)},
    ]
    out = tg.pad_collate(batch, keys=["input_ids"])
    assert out["input_ids"].dtype == torch.int64
    assert out["input_ids"][1].tolist() == [big]


def test_pad_collate_empty_python_list_row_keeps_int_dtype() -> None:
    batch = [{"input_ids": []}, {"input_ids": np.array([2**53 + 1], dtype=np.int64)}]
    out = tg.pad_collate(batch, keys=["input_ids"])
    assert out["input_ids"].dtype == torch.int64
    assert out["input_ids"].tolist() == [[0], [2**53 + 1]]


def _ones(texts: list[str]) -> list[list[int]]:
    return [[len(t)] for t in texts]


def test_tokenize_text_0d_str_array() -> None:
    assert [r.tolist() for r in tokenize_batch(_ones, [np.array("abc")])] == [[3]]


def test_tokenize_text_0d_bytes_array() -> None:
    assert [r.tolist() for r in tokenize_batch(_ones, [np.array(b"abc")])] == [[3]]


def test_tokenize_result_jagged_object_array() -> None:
    def tok(texts: list[str]) -> np.ndarray:
        out = np.empty(len(texts), dtype=object)
        for i, t in enumerate(texts):
            out[i] = np.arange(len(t), dtype=np.int64)
        return out

    assert [r.tolist() for r in tokenize_batch(tok, ["ab", "c"])] == [[0, 1], [0]]


def test_tokenize_result_list_of_numpy_int_arrays() -> None:
    def tok(texts: list[str]) -> list[np.ndarray]:
        return [np.arange(len(t), dtype=np.int64) for t in texts]

    assert [r.tolist() for r in tokenize_batch(tok, ["ab", "c"])] == [[0, 1], [0]]
