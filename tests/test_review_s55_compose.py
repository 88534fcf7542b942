"""pad_collate on a columns batch: a field too long for max_length is reported as such
(its name, the record, the limit) before its values are made a tensor."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.columns import ColumnBatch, Ragged


def test_a_ragged_column_over_max_length_is_reported_before_its_values_are_converted(
    tmp_path,
):
    """A Parquet list<timestamp> column is a Ragged of datetime64 values. With a row
    longer than max_length, pad_collate said so (ValueError naming the field, the
    record and the limit) before converting the values; it now fails first on torch's
    'can't convert np.ndarray of type numpy.datetime64', which names no field."""
    ts = pa.array([[1, 2, 3], [4]], pa.list_(pa.timestamp("ms")))
    pq.write_table(pa.table({"ts": ts}), tmp_path / "t.parquet")
    batch = tg.ParquetSource(str(tmp_path / "t.parquet")).read_columns([0, 1])
    assert isinstance(batch["ts"], Ragged)
    with pytest.raises(ValueError, match=r"field 'ts' of record 0 .* max_length=2"):
        tg.pad_collate(keys=["ts"], max_length=2)(batch)
    # The same for a Ragged built by hand.
    col = Ragged(np.array([1, 2, 3], object), np.array([0, 3]), "array")
    with pytest.raises(ValueError, match=r"field 's' of record 0 .* max_length=1"):
        tg.pad_collate(keys=["s"], max_length=1)(ColumnBatch({"s": col}, num_rows=1))
