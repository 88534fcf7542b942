"""The default collate of a key whose values are of several types (records of schema-less
data, or a map's output): each value held exactly, in one dtype whatever the batch's
first value is, or a TypeError naming the key and entry, never a rounded batch."""

import numpy as np
import pytest
import torch

import torchgrain as tg


def _batch(values, **loader):
    ds = tg.Dataset([{"x": v} for v in values])
    return next(iter(torch.utils.data.DataLoader(ds, batch_size=len(values), **loader)))["x"]


@pytest.mark.parametrize("values", [[1, 0.1], [0.1, 1], [np.int64(3), 2.5], [2**40 + 1, 0.5]])
def test_ints_beside_floats_are_float64_whatever_comes_first(values):
    got = _batch(values)
    assert got.dtype == torch.float64
    assert got.tolist() == [float(v) for v in values]


def test_an_int_float64_would_round_is_refused_naming_the_key_and_entry():
    with pytest.raises(TypeError, match=r"key 'x': entry 1 holds 9007199254740993"):
        _batch([0.5, 2**53 + 1])
    with pytest.raises(
        TypeError, match=r"key 'x': entry 0 holds (np.uint64\()?9223372036854775809"
    ):
        _batch([np.uint64(2**63 + 1), 1.5])


def test_arrays_of_two_dtypes_are_refused_where_the_stack_would_round(tmp_path):
    with pytest.raises(TypeError, match="key 'x': entry 0"):
        _batch([np.array([2**63 + 1], np.uint64), np.array([1.5])])
    exact = _batch([np.array([1, 2], np.int32), np.array([3, 4], np.int64)])
    assert exact.tolist() == [[1, 2], [3, 4]]


def test_nan_and_nested_dicts_and_one_type_keys_are_as_before():
    assert _batch([float("nan"), 1])[1].item() == 1.0
    ds = tg.Dataset([{"d": {"a": 1}}, {"d": {"a": 0.1}}])
    got = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))["d"]["a"]
    assert got.dtype == torch.float64 and got.tolist() == [1.0, 0.1]
    same = _batch([np.float32(0.1), np.float32(0.2)])
    assert same.dtype == torch.float32


def test_in_a_worker_process_too():
    got = _batch([1, 0.1], num_workers=1)
    assert got.dtype == torch.float64 and got.tolist() == [1.0, 0.1]
