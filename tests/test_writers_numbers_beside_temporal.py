"""Values the Parquet writer must refuse rather than change or crash on: numbers beside
dates, datetimes, durations and times (Arrow's inference writes them as counts of the
unit: 5 beside dates is 1970-01-06), and numpy datetime64 scalars beside numpy numbers
in one place (pyarrow's inference of those kills the process)."""

from __future__ import annotations

import datetime as dt
import decimal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

import torchgrain as tg
from torchgrain.writers import records_to_table, write_parquet

TEMPORAL = {
    "date": dt.date(2020, 1, 2),
    "datetime": dt.datetime(2020, 1, 2, 3, 4, 5),
    "timedelta": dt.timedelta(days=1),
    "time": dt.time(1, 2, 3),
}
NUMBERS = [5, 5.5, decimal.Decimal("1.5"), np.int64(5), np.float32(0.5), np.uint8(1)]


@pytest.mark.parametrize("kind", sorted(TEMPORAL))
@pytest.mark.parametrize("number", NUMBERS, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("shape", ["rows", "list", "struct", "nested"])
def test_a_number_beside_temporal_values_is_refused(kind, number, shape):
    value = TEMPORAL[kind]
    records = {
        "rows": [{"x": value}, {"x": None}, {"x": number}],
        "list": [{"x": [value, None]}, {"x": [number]}],
        "struct": [{"x": {"a": value}}, {"x": {"a": number}}],
        "nested": [{"x": [[value], [number, None]]}],
    }[shape]
    with pytest.raises(TypeError, match=r"cannot store key 'x' in Parquet.*record"):
        records_to_table(records)


@pytest.mark.parametrize(
    "records",
    [
        [{"x": [dt.date(2020, 1, 2), np.array(5)]}],
        [{"x": {"a": np.array([dt.date(2020, 1, 2), 5], dtype=object)}}],
        [{"x": np.array([dt.datetime(2020, 1, 2), 5], dtype=object)}],
    ],
)
def test_a_number_in_an_array_beside_temporal_values_is_refused(records):
    with pytest.raises(TypeError, match=r"cannot store key 'x' in Parquet.*beside"):
        records_to_table(records)


@pytest.mark.parametrize("kind", sorted(TEMPORAL))
@pytest.mark.parametrize("number", [5, 5.0, np.int16(3)], ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("nesting", ["flat", "list", "struct"])
def test_a_number_in_a_typed_temporal_column_is_refused(kind, number, nesting):
    """With a schema (a Parquet source's columns, as tg.convert writes them), a number is
    not a count of a temporal column's unit either."""
    leaf = pa.array([TEMPORAL[kind]]).type
    typ, value = {
        "flat": (leaf, number),
        "list": (pa.list_(leaf), [TEMPORAL[kind], number]),
        "struct": (pa.struct([("a", leaf)]), {"a": number}),
    }[nesting]
    with pytest.raises(TypeError, match=r"cannot store key 'x' in Parquet as its source's"):
        records_to_table([{"x": value}], pa.schema({"x": typ}))
    ok = {"flat": TEMPORAL[kind], "list": [TEMPORAL[kind], None], "struct": {"a": None}}
    assert records_to_table([{"x": ok[nesting]}], pa.schema({"x": typ})).num_rows == 1


@pytest.mark.parametrize(
    "values",
    [
        [dt.date(2020, 1, 2), None, np.datetime64("2020-01-03")],
        [dt.timedelta(seconds=1), np.timedelta64(5, "us")],
        [dt.datetime(2020, 1, 2, 3), None],
        [dt.time(1), dt.time(2, 3, 4, 5)],
    ],
    ids=["dates", "durations", "datetimes", "times"],
)
def test_temporal_values_alone_are_written_exactly(tmp_path, values):
    path = tmp_path / "a.parquet"
    write_parquet([{"x": list(values)}], path)
    got = list(tg.ParquetSource(path)[0]["x"])
    for v, g in zip(values, got, strict=True):
        if v is None:
            assert g is None or np.isnat(g)
        elif isinstance(v, dt.time):
            assert g == v
        else:  # (read back as numpy values of the column's unit)
            temporal = np.datetime64 if isinstance(v, (dt.date, np.datetime64)) else np.timedelta64
            assert g == temporal(v)


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a crash there is a failure here, not the end of
    the test run)."""
    prelude = "import numpy as np, tempfile, os\nfrom torchgrain.writers import write_parquet\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "records",
    [
        "[{'x': [np.datetime64(1, 'ns'), np.int16(3)]}]",
        "[{'x': [np.datetime64(1, 'D'), None, np.float32(3)]}]",
        "[{'x': [[np.datetime64(1, 'ns')], [np.bool_(True)]]}]",
        "[{'x': {'a': [np.datetime64(1, 'ns')]}}, {'x': {'a': [np.uint8(1)]}}]",
        "[{'x': [{'k': np.datetime64(1, 's')}, {'k': np.int64(2)}]}]",
        "[{'y': 1}, {'x': [np.datetime64(1, 's'), 1]}, {'x': [np.complex64(1)]}]",
        "[{'x': [np.datetime64(1, 'ns'), np.void(b'ab')]}]",
        "[{'x': [np.array(np.datetime64(1, 'ns')), np.array(3, np.int16)]}]",
        "[{'x': {'a': np.array([np.datetime64(1, 'ns')])}}, {'x': {'a': [np.int16(3)]}}]",
        "[{'x': [[np.datetime64(1, 'ns')], np.array([3], np.int16)]}]",
        "[{'x': {'a': np.array([np.datetime64(1, 'ns'), np.int16(3)], dtype=object)}}]",
        "[{'x': np.array([np.datetime64(1, 'ns'), np.int16(3)], dtype=object)}]",
    ],
)
def test_numpy_datetimes_beside_numpy_numbers_are_refused_without_a_crash(records):
    proc = _run(
        f"""
        try:
            write_parquet({records}, os.path.join(tempfile.mkdtemp(), "a.parquet"))
        except TypeError as e:
            print("refused:", e)
        """
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "refused: cannot store key 'x' in Parquet" in proc.stdout, proc.stdout
    assert "datetime64 beside numpy" in proc.stdout and "(record " in proc.stdout


def test_the_refusal_names_the_first_record_that_clashes():
    proc = _run(
        """
        from torchgrain.writers import records_to_table
        records = [{"x": [np.datetime64(2, "s")]}, {"x": None}, {"x": [np.int8(3)]}]
        try:
            records_to_table(records + [{"x": [np.int16(1)]}] * 3)
        except TypeError as e:
            print("refused:", e)
        """
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "datetime64 beside numpy int8 values" in proc.stdout
    assert proc.stdout.rstrip().endswith("(record 2)"), proc.stdout


def test_numpy_datetimes_in_other_places_than_numbers_are_written(tmp_path):
    path = tmp_path / "a.parquet"
    records = [{"x": {"t": np.datetime64(1, "s"), "n": np.int16(3)}, "y": [np.int16(1)]}]
    write_parquet(records, path)
    got = tg.ParquetSource(path)[0]
    assert got["x"]["t"] == np.datetime64(1, "s") and got["x"]["n"] == 3
