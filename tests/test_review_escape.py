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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.errors import TorchgrainError
from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key


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


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    """A web server: ``flat/a.parquet`` (0..4) inside a dataset, ``secret/b.parquet``
    (100..102) outside it."""
    root = tmp_path_factory.mktemp("www")
    for sub, values in (("flat", np.arange(5)), ("secret", np.arange(100, 103))):
        (root / sub).mkdir()
        pq.write_table(
            pa.table({"x": values}), root / sub / f"{'a' if sub == 'flat' else 'b'}.parquet"
        )
    with RangeHTTPServer(root) as srv:
        yield srv


def _secret(log) -> list[str]:
    return [p for _, p in log if "secret" in p]


def test_a_redirect_is_refused_behind_a_chained_url_too(www):
    www.redirects["/flat/r.parquet"] = "/secret/b.parquet"
    www.log.clear()
    try:
        with pytest.raises(tg.UnsafePathError, match="redirects to"):
            tg.ParquetSource([f"simplecache::{www.url}/flat/r.parquet"], cache_bytes=0)
        assert _secret(www.log) == []
    finally:
        www.redirects.clear()


def test_a_beam_shard_writes_no_journal_record_through_a_linked_journal_folder(tmp_path):
    from torchgrain.beam import ConvertShard
    from torchgrain.convert.inputs import open_input
    from torchgrain.convert.journal import plan_tasks
    from torchgrain.convert.tasks import Job
    from torchgrain.sources.registry import get_output

    src, dst, elsewhere = tmp_path / "in", tmp_path / "out", tmp_path / "elsewhere"
    tg.write_parquet([{"x": i} for i in range(4)], src)
    dst.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, dst / ".torchgrain-convert")
    output = get_output("array_record")
    compression, options = output.options(1, None)
    inp = open_input(str(src), "auto", "auto", None)
    tasks = plan_tasks(inp.counts, len(inp.paths), None, "array_record")
    job = Job(inp, str(dst), "array_record", options, compression, 32 << 20, True, output=output)
    with contextlib.suppress(TorchgrainError, OSError):  # refusing is a right outcome too
        ConvertShard(job)(tasks[0])
    assert os.listdir(elsewhere) == [], "a shard's record was written outside DST"


def test_a_linked_folder_of_shards_is_read_or_named_never_skipped_silently(tmp_path):
    tg.write_parquet([{"x": i} for i in range(3)], tmp_path / "ds")
    tg.write_parquet([{"x": 100 + i} for i in range(2)], tmp_path / "more")
    os.symlink(tmp_path / "more", tmp_path / "ds" / "more")
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        try:
            n = len(tg.open(str(tmp_path / "ds")))
        except (TorchgrainError, OSError) as e:  # refusing, naming the link, is right too
            assert "more" in str(e)
            return
    assert n == 5 or any("more" in str(w.message) for w in told), (
        f"{n} records: the linked folder's 2 were skipped without a word"
    )
