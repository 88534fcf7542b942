"""Collation of a key whose values are of several types, and columns after a map_batch:
what the default collate and a columns pipeline give for values users have."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg


def _batch(values, num_workers=0):
    ds = tg.Dataset([{"x": v} for v in values])
    return next(iter(DataLoader(ds, batch_size=len(values), num_workers=num_workers)))["x"]


@pytest.mark.xfail(
    strict=True,
    reason="numpy conversion of a bfloat16 tensor beside Python floats raises a bare TypeError",
)
def test_bfloat16_scalar_tensor_beside_floats_collates():
    """A 0-d bfloat16 tensor beside Python floats under one key collates, each value held
    exactly (a float64 batch), rather than failing with numpy's 'unsupported ScalarType
    BFloat16' naming no key."""
    out = _batch([0.5, torch.tensor(1.0, dtype=torch.bfloat16), 2.0, 3.0])
    assert out.dtype == torch.float64
    assert out.tolist() == [0.5, 1.0, 2.0, 3.0]


@pytest.mark.xfail(
    strict=True, reason="numpy conversion of a tensor requiring grad raises a bare RuntimeError"
)
def test_scalar_tensor_requiring_grad_beside_floats_collates():
    """A 0-d tensor that requires grad beside Python floats collates as torch collates it
    (float64, values kept), rather than failing with "Can't call numpy() on Tensor that
    requires grad"."""
    with pytest.warns(UserWarning):
        out = _batch([0.5, torch.tensor(1.0, requires_grad=True), 2.0, 3.0])
    assert out.tolist() == [0.5, 1.0, 2.0, 3.0]


@pytest.mark.xfail(
    strict=True,
    reason="in a worker torch stacks into the first array's dtype: float32 beside float64 "
    "arrays is refused with workers, stacked as float64 without",
)
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


@pytest.mark.xfail(
    strict=True,
    reason="ColumnBatch.records() turns an ArrayRecord source's float32/uint8 values into "
    "Python numbers: the columns batch after map_batch then map is float64/int64",
)
def test_columns_after_map_batch_keep_narrow_numpy_values_of_records(tmp_path):
    """An ArrayRecord source whose records hold numpy float32 and uint8 values (msgpack keeps
    their dtypes): with batch_format="columns", a map after a map_batch sees numpy values
    as a map alone does (not Python numbers) and the batch keeps the float32 and uint8 dtypes, as without the map_batch."""
    recs = [{"f": np.float32(i + 0.5), "u": np.uint8(200 + i)} for i in range(8)]
    tg.write_array_record(recs, str(tmp_path))
    seen = []

    def look(r):
        seen.append((type(r["f"]), type(r["u"])))
        return r

    def batches(ds):
        return next(iter(DataLoader(ds, batch_size=4, num_workers=0)))

    plain = batches(
        tg.Dataset(tg.ArrayRecordSource(str(tmp_path)), batch_format="columns").map(look)
    )
    assert all(not issubclass(t, (float, int)) for kinds in seen for t in kinds)
    seen.clear()
    ds = tg.Dataset(tg.ArrayRecordSource(str(tmp_path)), batch_format="columns")
    after = batches(ds.map_batch(lambda b: b).map(look))
    assert (plain["f"].dtype, plain["u"].dtype) == (torch.float32, torch.uint8)
    assert (after["f"].dtype, after["u"].dtype) == (torch.float32, torch.uint8)
    assert all(not issubclass(t, (float, int)) for kinds in seen for t in kinds)
    assert after["f"].tolist() == [0.5, 1.5, 2.5, 3.5]
