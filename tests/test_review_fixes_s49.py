"""Behaviour that held before the resume, node-store, listing, footer and key fixes."""

from __future__ import annotations

import functools
import threading
import typing

import pytest
import torch

from torchgrain.sources.node_index.derived import callable_fingerprint


def _locked(fn):
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with lock:
            return fn(*args, **kwargs)

    return wrapper


class _KeepsLarge:
    def __call__(self, r):
        return r["x"] > 1

    @_locked  # (a helper method whose decorator holds a lock: no part of what is kept)
    def refresh(self):
        return 1


def test_callable_object_with_locked_helper_keys_the_same_twice():
    assert callable_fingerprint(_KeepsLarge()) == callable_fingerprint(_KeepsLarge())


_T = typing.TypeVar("_T")


class _GenericKeep(typing.Generic[_T]):
    def __call__(self, r):
        return r["x"] > 1


class _Keeps(typing.Protocol):
    def __call__(self, r) -> bool: ...


class _ProtocolKeep(_Keeps):
    def __call__(self, r):
        return r["x"] > 1


class _TorchDataset(torch.utils.data.Dataset):  # (Generic[T_co] among its bases)
    def keep(self, r):
        return r["x"] > 1


@pytest.mark.parametrize(
    "make",
    [_GenericKeep, _ProtocolKeep, lambda: _GenericKeep().__call__, lambda: _TorchDataset().keep],
    ids=["generic", "protocol", "bound-method", "torch-dataset-method"],
)
def test_callable_of_a_generic_or_protocol_class_keys_the_same_twice(make):
    assert callable_fingerprint(make()) == callable_fingerprint(make())


_CALLS: list[int] = []


class _CountingGenericKeep(typing.Generic[_T]):
    def __call__(self, r):
        _CALLS.append(1)
        return int(r["x"]) > 3


def test_filter_with_generic_predicate_reuses_its_index(tmp_path):
    import numpy as np

    import torchgrain as tg

    tg.write_array_record([{"x": np.int64(i)} for i in range(10)], tmp_path / "ar")
    _CALLS.clear()
    for _ in range(2):
        ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "ar")).filter(
            _CountingGenericKeep(), index_dir=tmp_path / "idx"
        )
        assert len(ds) == 6
    assert len(_CALLS) == 10  # (the second opening maps the first one's index)
    assert len(list((tmp_path / "idx").glob("filter-*.tgindex"))) == 1
