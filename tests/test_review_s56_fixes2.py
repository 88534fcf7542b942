"""Collation of a key whose values are of several types, and columns after a map_batch:
what the default collate and a columns pipeline give for values users have."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

import torchgrain as tg


def _batch(values, num_workers=0):
    ds = tg.Dataset([{"x": v} for v in values])
    return next(iter(DataLoader(ds, batch_size=len(values), num_workers=num_workers)))["x"]


def test_bfloat16_scalar_tensor_beside_floats_collates():
    """A 0-d bfloat16 tensor beside Python floats under one key collates, each value held
    exactly (a float64 batch), rather than failing with numpy's 'unsupported ScalarType
    BFloat16' naming no key."""
    out = _batch([0.5, torch.tensor(1.0, dtype=torch.bfloat16), 2.0, 3.0])
    assert out.dtype == torch.float64
    assert out.tolist() == [0.5, 1.0, 2.0, 3.0]


def test_scalar_tensor_requiring_grad_beside_floats_collates():
    """A 0-d tensor that requires grad beside Python floats collates as torch collates it
    (float64, values kept), rather than failing with "Can't call numpy() on Tensor that
    requires grad"."""
    with warnings.catch_warnings():  # (newer torch warns of a tensor given to torch.tensor)
        warnings.simplefilter("ignore", UserWarning)
        out = _batch([0.5, torch.tensor(1.0, requires_grad=True), 2.0, 3.0])
    assert out.tolist() == [0.5, 1.0, 2.0, 3.0]


def test_float32_beside_float64_arrays_collate_in_a_worker():
    """float32 and float64 arrays under one key collate in a DataLoader worker as in the
    main process (where they stack as float64, exactly), rather than being refused only
    because a worker stacks into the first array's dtype."""
    rng = np.random.default_rng(0)
    values = [rng.random(3).astype(np.float32), rng.random(3)] * 2
    main = _batch(values, num_workers=0)
    assert main.dtype == torch.float64
    out = _batch(values, num_workers=2)
    assert torch.allclose(out.double(), main, atol=1e-6)
