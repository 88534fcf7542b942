"""Cases the fixes of list-to-tensor conversion, sources' indexing and their kin do not
keep yet (strict xfails: each passes once its cause is fixed)."""

from __future__ import annotations

import pytest
import torch

import torchgrain as tg


@pytest.mark.xfail(
    strict=True,
    reason="transforms.py _to_tensor: np.asarray of a list of bfloat16 tensors (numpy has "
    "no bfloat16): 'Got unsupported ScalarType BFloat16', where torch.as_tensor kept them",
)
def test_to_tensor_keeps_a_list_of_bfloat16_scalar_tensors():
    x = [torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(2.5, dtype=torch.bfloat16)]
    out = tg.ToTensor(keys=["x"])({"x": x})["x"]
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [1.5, 2.5]
