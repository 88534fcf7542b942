"""torchgrain/sources/parquet/values.py: the three ways a ParquetSource hands out values
(records built per batch from views, records copied from converted row groups, batch
columns) agree for every Arrow type, nulls, slices and row groups of several layouts."""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import torchgrain as tg
from torchgrain.columns import Ragged


def _same(a, b) -> bool:
    """Equal values of equal types (arrays: dtype, shape and items)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tolist() == b.tolist()
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _column_holds(col, values) -> bool:
    """A batch column holds the records' values (numpy columns: as numbers)."""
    if isinstance(col, np.ndarray):
        return len(col) == len(values) and np.array_equal(col, np.asarray(values))
    if isinstance(col, Ragged):
        return len(col) == len(values) and all(_same(col[i], v) for i, v in enumerate(values))
    return _same(list(col), values)


def _table(n: int) -> pa.Table:
    ts = datetime.datetime(2020, 1, 2, 3, 4, 5)

    def cycle(values, t=None):
        return pa.array([values[i % len(values)] for i in range(n)], t)

    return pa.table(
        {
            "i8": cycle([1, -2, 3], pa.int8()),
            "u64": cycle([1, 2**63, None], pa.uint64()),
            "f16": pa.array(np.arange(n, dtype=np.float16)),
            "f32": cycle([1.5, None], pa.float32()),
            "flag": cycle([True, None, False]),
            "null": pa.array([None] * n),
            "s": cycle(["a", None, "é", ""]),
            "ls": cycle(["a", "bc"], pa.large_string()),
            "lbin": cycle([b"x", None], pa.large_binary()),
            "fbin": cycle([b"ab", None], pa.binary(2)),
            "ts": cycle([ts, None], pa.timestamp("ns")),
            "tz": cycle([ts], pa.timestamp("ms", tz="UTC")),
            "d32": cycle([datetime.date(2020, 1, 1), None], pa.date32()),
            "dur": cycle([5, None], pa.duration("us")),
            "time": cycle([datetime.time(1, 2), None], pa.time64("us")),
            "dec": cycle([decimal.Decimal("1.25"), None], pa.decimal128(5, 2)),
            "cat": cycle(["x", "y", None]).dictionary_encode(),
            "lf": cycle([[1.0, 2.0], [3.0], [], None], pa.list_(pa.float32())),
            "lfnull": cycle([[1.0, None], [2.0]], pa.list_(pa.float64())),
            "large": cycle([[1, 2], [3]], pa.large_list(pa.int32())),
            "fsl": cycle([[1, 2, 3], None], pa.list_(pa.int16(), 3)),
            "ll": cycle(
                [[[1, 2], [3, 4]], [[5], []], None, [[None]]], pa.list_(pa.list_(pa.int64()))
            ),
            "lstr": cycle([["a", None], [], None], pa.list_(pa.string())),
            "struct": cycle([{"a": 1, "b": "x"}, None, {"a": None, "b": "y"}]),
            "map": cycle([[("k", 1)], None, []], pa.map_(pa.string(), pa.int32())),
        }
    )


def test_records_built_copied_and_columns_agree(tmp_path):
    n = 60
    table = _table(n)
    pq.write_table(table.slice(0, 30), tmp_path / "a.parquet", row_group_size=7)
    pq.write_table(table.slice(30), tmp_path / "b.parquet", row_group_size=11)
    idx = [59, 0, 3, 3, 31, 44, 17, 6, 7, 58]
    built = tg.ParquetSource(str(tmp_path), cache_bytes=0)  # records built per batch
    copied = tg.ParquetSource(str(tmp_path))  # small data: row groups converted whole
    expected = built.__getitems__(idx)
    for i, rec in zip(idx, expected):
        assert _same(rec, built[i]), i
    assert _same(copied.__getitems__(idx), expected)
    assert _same(copied.__getitems__(idx), expected)  # warm: copies again
    for src in (built, copied):
        batch = src.read_columns(idx)
        for k in expected[0]:
            assert _column_holds(batch[k], [rec[k] for rec in expected]), k
    # Arrays are fresh and writable; nulls are None.
    rec = built[1]
    assert rec["null"] is None and rec["s"] is None and rec["lf"].flags.writeable
    assert isinstance(copied.read_columns(idx)["lf"], list | Ragged)
