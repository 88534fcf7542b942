"""A batch whose arrays hold more items at one list level than a Parquet list's int32
offsets count is refused naming the key, never written with wrapped offsets. The limit is
lowered here: the real one (2**31 - 1 items) would take gigabytes."""

from __future__ import annotations

import numpy as np
import pytest

from torchgrain import writers
from torchgrain.writers import records_to_table


@pytest.fixture
def limit(monkeypatch):
    monkeypatch.setattr(writers, "_LIST_ITEMS", 6)


def test_a_batch_of_arrays_up_to_the_limit_is_written(limit):
    records = [{"x": np.arange(3, dtype=np.int8)}, {"x": None}, {"x": np.arange(3, dtype=np.int8)}]
    t = records_to_table(records)
    assert t.column("x").to_pylist() == [[0, 1, 2], None, [0, 1, 2]]


def test_a_batch_of_arrays_past_the_limit_is_refused_naming_the_key(limit):
    records = [{"x": np.arange(4, dtype=np.int8)}, {"x": np.arange(3, dtype=np.int8)}]
    with pytest.raises(
        TypeError, match=r"cannot store key 'x'.*too many elements for one batch: 7"
    ):
        records_to_table(records)


def test_an_inner_level_past_the_limit_is_refused(limit):
    # Two rows of four items: 8 items at the inner level, 2 lists at the outer one.
    with pytest.raises(
        TypeError, match=r"cannot store key 'm'.*too many elements for one batch: 8"
    ):
        records_to_table([{"m": np.zeros((2, 4), np.float32)}])
