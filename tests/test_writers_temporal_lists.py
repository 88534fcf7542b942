"""Lists of numpy dates and times beside a null, written with no schema: what a
ParquetSource returns for a ``list<date32>`` column with a null item, so what
Parquet -> ArrayRecord -> Parquet conversion writes back."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import torchgrain as tg
from torchgrain.writers import records_to_table

D = np.datetime64


def test_a_list_of_numpy_dates_with_a_null_is_written_as_dates():
    t = records_to_table([{"d": [D("2020-01-01"), None]}, {"d": [D("2020-01-02")]}])
    assert t.schema.field("d").type == pa.list_(pa.date32())
    assert t.column("d").cast(pa.list_(pa.int32())).to_pylist() == [[18262, None], [18263]]


def test_numpy_dates_with_a_null_nested_in_a_struct_keep_their_values():
    t = records_to_table([{"s": {"a": [D("2020-01-01T00:00:01", "s"), None]}}])
    kind = t.schema.field("s").type
    assert kind == pa.struct([("a", pa.list_(pa.timestamp("s")))])
    assert t.column("s").to_pylist()[0]["a"][1] is None
    assert (
        t.column("s").combine_chunks().field("a").flatten().cast(pa.int64()).to_pylist()[0]
        == 1577836801
    )


def test_durations_with_a_null_keep_their_unit():
    t = records_to_table([{"d": [np.timedelta64(5, "ms"), None]}])
    assert t.schema.field("d").type == pa.list_(pa.duration("ms"))
    assert t.column("d").combine_chunks().flatten().cast(pa.int64()).to_pylist() == [5, None]


def test_dates_of_two_units_in_one_list_are_still_refused():
    import pytest

    with pytest.raises(TypeError, match="key 'd'"):
        records_to_table([{"d": [D("2020-01-01"), D("2020-01-01T00:00:01"), None]}])


def test_parquet_to_array_record_and_back_keeps_a_list_of_dates_with_a_null(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    dates = pa.array([[18262, None], [1], []], pa.list_(pa.int32())).cast(pa.list_(pa.date32()))
    pq.write_table(pa.table({"d": dates}), src / "a.parquet")
    tg.convert(str(src), str(tmp_path / "ar"), to="array_record")
    tg.convert(str(tmp_path / "ar"), str(tmp_path / "back"), to="parquet")
    back = pq.read_table(tmp_path / "back").column("d")
    assert back.type == pa.list_(pa.date32())
    assert back.to_pylist() == dates.to_pylist()
