"""Ints past int64 at the edges of ToTensor, the default collate and Parquet output: a
NaN beside them, negative ints beside uint64 in a batch, numpy ints beside them in
nested records, shards of one schema."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.tokens.collate import exact_numpy, holds_tensor
from torchgrain.transforms import ToTensor

BIG = 2**63 + 5


@pytest.mark.parametrize("value", [[math.nan, BIG], [BIG, math.nan], [[math.nan, 1], [BIG, 2]]])
def test_an_int_past_int64_beside_a_nan_is_refused(value):
    with pytest.raises(ValueError, match=r"9223372036854775813 \(past int64\) beside nan"):
        exact_numpy(value)


@pytest.mark.parametrize("value", [[math.nan, 1.5], [1.5, 2**63 - 1], [1e19, 2.0], [[1e19]]])
def test_floats_stay_numpys(value):
    want = np.asarray(value)
    got = exact_numpy(value)
    assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)


def test_holds_tensor():
    class Sub(torch.Tensor):
        pass

    assert not holds_tensor([1, 2.5, True]) and not holds_tensor([[1], np.int64(2)])
    assert holds_tensor((1, torch.tensor(2))) and holds_tensor([torch.zeros(1).as_subclass(Sub)])


def _loader_batch(records):
    ds = tg.Dataset(records).map(ToTensor(keys=["k"]))
    return next(iter(torch.utils.data.DataLoader(ds, batch_size=len(records))))


def test_default_collate_refuses_a_negative_int_beside_uint64_naming_the_key():
    with pytest.raises(TypeError, match=r"key 'k': entry 1 holds -2 beside uint64 at entry 0"):
        _loader_batch([{"k": [1, BIG]}, {"k": [-2, 3]}])


def test_default_collate_makes_bools_and_ints_beside_uint64_uint64():
    batch = _loader_batch([{"k": [True, False]}, {"k": [1, BIG]}, {"k": [2, 3]}])
    assert batch["k"].dtype == torch.uint64
    assert batch["k"].tolist() == [[1, 0], [1, BIG], [2, 3]]


def test_write_parquet_names_a_numpy_int_beside_an_int_past_int64_in_a_struct(tmp_path):
    records = [{"m": {"a": [np.int16(-4)]}}, {"m": {"a": [2**63]}}]
    with pytest.raises(
        TypeError, match=r"record 0 holds -4 and record 1 holds 9223372036854775808"
    ):
        tg.write_parquet(records, tmp_path)


def test_write_parquet_keeps_a_numpy_int_type_beside_another_key_past_int64(tmp_path):
    import pyarrow.parquet as pq

    (path,) = tg.write_parquet([{"m": {"a": np.int32(3), "b": 2**63}}], tmp_path)
    assert str(pq.read_schema(path).field("m").type) == "struct<a: int32, b: uint64>"


def test_write_parquet_shards_without_records_have_the_dataset_columns(tmp_path):
    import pyarrow.parquet as pq

    paths = tg.write_parquet([{"ids": [BIG]}], tmp_path, num_shards=3)
    assert {str(pq.read_schema(p)) for p in paths} == {str(pq.read_schema(paths[0]))}
    assert [r["ids"].tolist() for r in tg.Dataset(tg.ParquetSource(str(tmp_path)))] == [[BIG]]
