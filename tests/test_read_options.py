"""ReadOptions: one frozen value for the options every sharded source shares."""

from __future__ import annotations

import dataclasses
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.retry import RetryPolicy


@pytest.fixture
def datasets(tmp_path):
    """One small dataset per built-in format: {format name: (source class, path)}."""
    ar, pqd, tfr = tmp_path / "ar", tmp_path / "pq", tmp_path / "tfr"
    tg.write_array_record([{"x": i} for i in range(6)], ar, num_shards=2)
    tg.write_parquet([{"x": i} for i in range(6)], pqd)
    os.makedirs(tfr)
    write_tfrecord([encode_tf_example({"x": [i]}) for i in range(6)], str(tfr / "a.tfrecord"))
    return {
        "array_record": (tg.ArrayRecordSource, str(ar)),
        "parquet": (tg.ParquetSource, str(pqd)),
        "tfrecord": (tg.TFRecordSource, str(tfr)),
    }


def test_read_options_are_frozen_comparable_and_pickle():
    opts = tg.ReadOptions(cache_bytes=1 << 20, storage_options={"anon": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.cache_bytes = 0  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(opts)) == opts
    assert dataclasses.replace(opts, io_threads=2) != opts
    given = {"anon": True}
    assert tg.ReadOptions(storage_options=given).storage_options is not given  # copied


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("cache_bytes", -1, ValueError),
        ("cache_bytes", 1.5, ValueError),
        ("cache_bytes", True, ValueError),
        ("cache_dir_bytes", 0, ValueError),
        ("read_ahead_bytes", -1, ValueError),
        ("io_threads", 0, ValueError),
        ("io_threads", "8", ValueError),
        ("max_open_files", 0, ValueError),
        ("max_open_files", "all", ValueError),
        ("retry", 3, TypeError),
        ("storage_options", "anon", TypeError),
        ("filesystem", "/tmp", TypeError),
        ("cache_dir", 3, TypeError),
        ("allow_external_paths", "yes", TypeError),
        ("multi_range", 1, TypeError),
        ("verify_checksums", 1, TypeError),
    ],
)
def test_each_bad_option_is_refused_naming_the_option(field, value, error):
    with pytest.raises(error, match=rf"^{field} must be"):
        tg.ReadOptions(**{field: value})


def test_an_unknown_keyword_is_a_type_error_naming_it(datasets):
    for cls, path in datasets.values():
        with pytest.raises(TypeError, match="'cache_byte'"):
            cls(path, cache_byte=0)
    with pytest.raises(TypeError, match="options must be a ReadOptions"):
        tg.ArrayRecordSource(datasets["array_record"][1], options={"cache_bytes": 0})


@pytest.mark.parametrize("fmt", ["array_record", "parquet", "tfrecord"])
def test_the_older_keyword_arguments_build_the_same_options(datasets, fmt, tmp_path):
    cls, path = datasets[fmt]
    values = {
        "cache_bytes": 1 << 20,
        "cache_dir": str(tmp_path / "shards"),
        "cache_dir_bytes": 1 << 30,
        "read_ahead_bytes": 1 << 20,
        "io_threads": 3,
        "retry": RetryPolicy(attempts=2),
        "max_open_files": 5,
        "allow_external_paths": False,
        "verify_checksums": True,
    }
    by_keywords = cls(path, **values)
    by_value = cls(path, options=tg.ReadOptions(**values))
    assert by_keywords.options == by_value.options == tg.ReadOptions(**values)
    for attr in ("cache_bytes", "io_threads", "max_open_files", "read_ahead_bytes", "_verify"):
        assert getattr(by_keywords, attr) == getattr(by_value, attr), attr
    assert by_keywords.retry == by_value.retry == RetryPolicy(attempts=2)
    assert by_value._verify is True and by_value.max_open_files == 5
    assert [r["x"] for r in by_value.__getitems__([5, 0])] == [
        r["x"] for r in by_keywords.__getitems__([5, 0])
    ]


def test_a_keyword_replaces_that_field_of_the_options(datasets):
    cls, path = datasets["parquet"]
    src = cls(path, options=tg.ReadOptions(cache_bytes=1 << 20, io_threads=3), cache_bytes=0)
    assert src.options == tg.ReadOptions(cache_bytes=0, io_threads=3)
    assert src.cache_bytes == 0 and src.io_threads == 3


def test_tg_open_passes_cache_bytes_to_every_format(datasets):
    for name, (cls, path) in datasets.items():
        src = tg.open(path, cache_bytes=1 << 20)
        assert type(src) is cls and src.options.cache_bytes == 1 << 20, name
        assert len(src) == 6
    # TFRecord keeps no decoded blocks: its cache stays empty, whatever the budget.
    assert tg.open(datasets["tfrecord"][1], cache_bytes=1 << 20).cache_bytes == 0


def test_each_format_says_why_its_checksums_default_as_they_do(datasets):
    defaults = {"array_record": False, "parquet": False, "tfrecord": True}
    for name, (cls, path) in datasets.items():
        assert cls(path)._verify is defaults[name], name
        assert cls(path, verify_checksums=not defaults[name])._verify is not defaults[name]
        assert "verify_checksums" in cls.__doc__, name  # the reason is stated there


def test_parquet_verify_checksums_catches_a_damaged_page(tmp_path):
    path = tmp_path / "a.parquet"
    values = list(range(1000, 3000))
    pq.write_table(
        pa.table({"x": values}),
        path,
        write_page_checksum=True,
        compression="none",
        use_dictionary=False,
    )
    data = bytearray(path.read_bytes())
    # Flip a byte of the first value in the data page (plain int64s: 1000 then 1001;
    # the statistics hold 1000 alone).
    at = data.index((1000).to_bytes(8, "little") + (1001).to_bytes(8, "little"))
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(tg.CorruptDataError, match=r"a\.parquet"):
        tg.ParquetSource(str(path), verify_checksums=True, decoded_cache=False)[0]
    assert tg.ParquetSource(str(path), decoded_cache=False)[0]["x"] == 1001  # unchecked
