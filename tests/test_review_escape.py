"""Reads and writes outside what a user gave: a dataset's directory, a cache's directory,
a conversion's output directory. A link, a name or a listing found there (put by
whoever else can write to it) must not make torchgrain read or write elsewhere.

The strict xfails are open bugs: each asserts the right outcome and fails today for the
reason it names.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pyarrow as pa
import pytest

import torchgrain as tg
from torchgrain.errors import TorchgrainError
from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key


@pytest.mark.xfail(
    strict=True,
    reason="journal.locked opens DST/.torchgrain-convert/lock with O_CREAT and without "
    "O_NOFOLLOW: a link put there makes the conversion create the link's target outside DST",
)
def test_a_link_in_place_of_the_conversion_lock_creates_nothing_outside_the_output(tmp_path):
    src, dst = tmp_path / "in", tmp_path / "out"
    tg.write_parquet([{"x": i} for i in range(4)], src)
    (dst / ".torchgrain-convert").mkdir(parents=True)
    planted = tmp_path / "elsewhere" / "planted"
    planted.parent.mkdir()
    os.symlink(planted, dst / ".torchgrain-convert" / "lock")
    with contextlib.suppress(TorchgrainError, OSError):  # refusing is a right outcome too
        tg.convert(src, dst)
    assert not planted.exists(), "the conversion created a file outside its output directory"


@pytest.mark.xfail(
    strict=True,
    reason="DecodedCache publishes an entry into its key's folder (NodeStore._publish: "
    "makedirs, then a rename) without checking that the folder is not a link: the entry "
    "is written where the link points",
)
def test_a_link_in_place_of_a_decoded_cache_folder_gets_no_entry_outside_the_cache(tmp_path):
    directory, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache = DecodedCache(str(directory), max_bytes=1 << 20, min_free_bytes=0)
    key = entry_key("p", 0)
    os.symlink(elsewhere, directory / key[:2])  # anyone who can write to the cache can
    table = pa.table({"x": [1, 2]})
    with warnings.catch_warnings(), contextlib.suppress(OSError):
        warnings.simplefilter("ignore")
        cache.get_or_build(key, lambda: table, schema=table.schema, num_rows=2)
    assert os.listdir(elsewhere) == [], "the decoded cache wrote an entry outside its directory"
