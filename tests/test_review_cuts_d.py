"""Behaviour that cuts of lines must keep: datasets derived by map/filter, sources' options."""

from __future__ import annotations

from torchgrain.dataset import Dataset


class _Overriding(Dataset):
    """A Dataset subclass whose reads differ from the plain Dataset's."""

    def __getitems__(self, indices):  # type: ignore[override]
        return ["overridden"] * len(indices)


def test_derived_dataset_of_subclass_is_plain_dataset() -> None:
    child = _Overriding([{"a": 1}, {"a": 2}]).map(lambda r: r["a"] * 10)
    assert type(child) is Dataset
    assert child.__getitems__([0, 1]) == [10, 20]


def test_derived_dataset_carries_only_pipeline_attributes() -> None:
    ds = Dataset([1, 2])
    ds.note = "mine"  # type: ignore[attr-defined]
    assert not hasattr(ds.map(abs), "note")


def test_sharded_source_exposes_its_request_options(tmp_path) -> None:
    import torchgrain as tg

    tg.write_array_record([{"i": i} for i in range(4)], tmp_path / "ar", num_shards=2)
    src = tg.ArrayRecordSource(tmp_path / "ar")
    assert src.max_inflight == src.options.max_inflight
    assert src.multi_range == src.options.multi_range


def test_format_says_whether_convert_writes_it() -> None:
    from torchgrain.sources import formats, get_format

    for name in formats():
        fmt = get_format(name)
        assert fmt.convert_output is (fmt.output is not None)
