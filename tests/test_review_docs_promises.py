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
@pytest.mark.xfail(
    strict=True,
    reason="docs/conversion.md:390 and README.md:145 say --help shows every default; "
    "cli._HelpFormatter (torchgrain/cli.py:503) leaves out the default of any option whose "
    "help contains the word 'default', so bench --collate (default 'default') shows none",
)
def test_bench_help_shows_the_default_of_collate(capsys):
    text = _option_help(_help(capsys, "bench"), "--collate")
    assert re.search(r"\(default: default\)", text), text


@pytest.mark.xfail(
    strict=True,
    reason="docs/conversion.md:390 and README.md:145 say --help shows every default; "
    "cache --help shows '--dir DIR ... (default: )' (torchgrain/cli.py:505 joins the empty "
    "list default into nothing)",
)
def test_cache_help_shows_no_empty_default(capsys):
    text = _option_help(_help(capsys, "cache", "list"), "--dir")
    assert "(default: )" not in text, text


# ------------------------------------------------------------------ composing
@pytest.mark.xfail(
    strict=True,
    reason="docs/composing.md:56-58 says source_field never replaces a key the records "
    "have: a SchemaMismatchError naming the input when the inputs declare their keys; "
    "Concat.__init__ (torchgrain/compose/concat.py:57) raises a plain ValueError naming "
    "no input",
)
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
@pytest.mark.xfail(
    strict=True,
    reason="docs/troubleshooting.md:34 says a negative index is an IndexError naming the index "
    "and the dataset size (as every source does, docs/composing.md:19-20); a tg.Dataset over a "
    "list (SequenceSource.__getitem__, torchgrain/adapters.py:98-101) reads items[-1], the last "
    "record, with random_map draws keyed by -1 rather than by its own index",
)
def test_a_dataset_over_a_list_refuses_a_negative_index():
    ds = tg.Dataset([{"i": i} for i in range(3)])
    with pytest.raises(IndexError) as e:
        ds[-1]
    assert "-1" in str(e.value) and "3" in str(e.value)


@pytest.mark.xfail(
    strict=True,
    reason="docs/troubleshooting.md:34 says an index out of range is an IndexError naming the "
    "index and the dataset size; a tg.Dataset over a list raises Python's bare 'list index out "
    "of range' (torchgrain/adapters.py:101 and :105)",
)
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
        pytest.param(
            "parquet",
            marks=pytest.mark.xfail(
                strict=True,
                reason="docs/troubleshooting.md:53 says a shard larger than cache_dir_bytes is "
                "a ValueError naming the URL, size, budget and cache directory (not a "
                "CorruptDataError, which the table keeps for damaged data); ParquetSource "
                "wraps the shard cache's ValueError into CorruptDataError('cannot decode row "
                "group 0 ..., column ...') (torchgrain/sources/parquet/loading.py:300-304)",
            ),
        ),
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
@pytest.mark.xfail(
    strict=True,
    reason="docs/troubleshooting.md:62-63 says each notice is a warning issued once per dataset "
    "and process; tg.open of a directory holding a linked folder warns twice, once for the "
    "format's detection and once for the source's own listing (the warn_once key of "
    "torchgrain/io/fs.py:722 holds the suffixes listed, which differ between the two)",
)
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


@pytest.mark.xfail(
    strict=True,
    reason="docs/sources.md:169 says a bad value is an error naming the option; "
    "ParquetSource(decoded_cache=True, decoded_cache_bytes=-5) says 'max_bytes must be an "
    "integer > 0' (DecodedCache's own name, torchgrain/sources/parquet/decoded_cache.py), and "
    "with decoded_cache='auto' a bad decoded_cache_bytes is not checked at all",
)
@pytest.mark.parametrize("cache", [True, "auto"])
def test_a_bad_decoded_cache_bytes_is_an_error_naming_it(tmp_path, cache):
    with pytest.raises(ValueError, match="decoded_cache_bytes"):
        _bad_option(tmp_path, "parquet", decoded_cache=cache, decoded_cache_bytes=-5)


@pytest.mark.xfail(
    strict=True,
    reason="docs/sources.md:169 says a bad value is an error naming the option; index_dir=5 "
    "(ArrayRecord, TFRecord) is os.fspath's TypeError 'expected str, bytes or os.PathLike "
    "object, not int', which names no option",
)
def test_a_bad_index_dir_is_an_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="index_dir"):
        _bad_option(tmp_path, "array_record", index_dir=5)
