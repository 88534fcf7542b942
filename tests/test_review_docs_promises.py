"""What the documentation pages promise, checked against the code where the two part.

Each test asserts the page's promise; a strict xfail marks one the code does not keep yet
(its reason names the page's line and what the code does instead).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.cli import main
from torchgrain.errors import CorruptDataError, SchemaMismatchError


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def _option_help(text: str, option: str) -> str:
    """The help of ``option`` in argparse's ``--help`` output (its lines joined)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(option))
    out = [lines[start]]
    for line in lines[start + 1 :]:
        if line.lstrip().startswith("-") or not line.startswith(" " * 8):
            break
        out.append(line)
    return " ".join(" ".join(out).split())


# ------------------------------------------------------------------ the command line
def test_bench_help_shows_the_default_of_collate(capsys):
    text = _option_help(_help(capsys, "bench"), "--collate")
    assert re.search(r"\(default: default\)", text), text


def test_cache_help_shows_no_empty_default(capsys):
    text = _option_help(_help(capsys, "cache", "list"), "--dir")
    assert "(default: )" not in text, text


# ------------------------------------------------------------------ composing
def test_concat_source_field_clash_is_a_schema_mismatch_naming_the_input(tmp_path):
    tg.write_parquet([{"id": i} for i in range(4)], tmp_path / "books")
    tg.write_parquet([{"id": i} for i in range(4)], tmp_path / "web")
    # Both inputs declare the key; an error naming either input keeps the promise.
    with pytest.raises(SchemaMismatchError, match=r"books|web"):
        tg.concat(
            {
                "web": tg.ParquetSource(tmp_path / "web"),
                "books": tg.ParquetSource(tmp_path / "books"),
            },
            source_field="id",
        )


# ------------------------------------------------------------------ indices
def test_a_dataset_over_a_list_refuses_a_negative_index():
    ds = tg.Dataset([{"i": i} for i in range(3)])
    with pytest.raises(IndexError) as e:
        ds[-1]
    assert "-1" in str(e.value) and "3" in str(e.value)


@pytest.mark.parametrize("batched", [False, True])
def test_a_dataset_over_a_list_names_an_index_out_of_range_and_its_size(batched):
    ds = tg.Dataset([{"i": i} for i in range(3)])
    with pytest.raises(IndexError) as e:
        ds.__getitems__([0, 7]) if batched else ds[7]
    assert "7" in str(e.value) and "3" in str(e.value), str(e.value)


def test_a_source_and_a_dataset_over_it_refuse_a_negative_index(tmp_path):
    # What the promise above holds the list-backed dataset to.
    tg.write_parquet([{"i": i} for i in range(3)], tmp_path / "d")
    for ds in (tg.open(tmp_path / "d"), tg.Dataset(tg.open(tmp_path / "d"))):
        with pytest.raises(IndexError, match=r"record index -1 out of range for a dataset of 3"):
            ds[-1]


# ------------------------------------------------------------------ shard cache
@pytest.mark.parametrize(
    "fmt",
    [
        "array_record",
        "parquet",
    ],
)
def test_a_shard_over_the_cache_budget_is_a_value_error_naming_url_size_and_budget(tmp_path, fmt):
    records = [{"x": np.zeros(100, np.uint8)} for _ in range(20)]
    if fmt == "parquet":
        tg.write_parquet(records, tmp_path / "srv" / "d")
    else:
        tg.write_array_record(records, tmp_path / "srv" / "d")
    cache = tmp_path / "cache"
    with RangeHTTPServer(tmp_path / "srv") as srv:
        src = tg.open(f"{srv.url}/d", cache_dir=str(cache), cache_dir_bytes=100)
        with pytest.raises(ValueError) as e:
            src[0]
    assert not isinstance(e.value, CorruptDataError), e.value
    text = str(e.value)
    assert srv.url in text and "100" in text and str(cache) in text, text


# ------------------------------------------------------------------ notices
def test_tg_open_names_a_linked_folder_once(tmp_path):
    import warnings

    from torchgrain.errors import DatasetWarning

    tg.write_parquet([{"i": 1}], tmp_path / "d")
    tg.write_parquet([{"i": 2}], tmp_path / "elsewhere")
    (tmp_path / "d" / "more").symlink_to(tmp_path / "elsewhere")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert len(tg.open(tmp_path / "d")) == 1
    told = [str(w.message) for w in seen if issubclass(w.category, DatasetWarning)]
    assert len([m for m in told if "linked folder" in m]) == 1, told


# ------------------------------------------------------------------ option values
def _bad_option(tmp_path, fmt: str, **options):
    if fmt == "parquet":
        tg.write_parquet([{"i": i} for i in range(4)], tmp_path / "d")
    else:
        tg.write_array_record([{"i": i} for i in range(4)], tmp_path / "d")
    return tg.open(tmp_path / "d", **options)


@pytest.mark.parametrize("cache", [True, "auto"])
def test_a_bad_decoded_cache_bytes_is_an_error_naming_it(tmp_path, cache):
    with pytest.raises(ValueError, match="decoded_cache_bytes"):
        _bad_option(tmp_path, "parquet", decoded_cache=cache, decoded_cache_bytes=-5)


def test_a_bad_index_dir_is_an_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="index_dir"):
        _bad_option(tmp_path, "array_record", index_dir=5)
