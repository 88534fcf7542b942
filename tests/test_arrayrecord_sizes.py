"""ArrayRecord shards named one by one (no manifest): the opening's footer reads found
each file's size, so a pass's start (its shard-cache fit check) asks the server nothing."""

from __future__ import annotations

import os

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK


@pytest.mark.timeout(60)
def test_a_pass_start_asks_no_size_of_shards_named_by_url(tmp_path):
    tg.write_array_record([{"x": i} for i in range(40)], tmp_path / "www" / "ds", num_shards=4)
    names = sorted(n for n in os.listdir(tmp_path / "www" / "ds") if "array_record" in n)
    with RangeHTTPServer(tmp_path / "www") as srv:
        urls = [f"{srv.url}/ds/{n}" for n in names]
        src = tg.ArrayRecordSource(urls, cache_dir=tmp_path / "cache", retry=QUICK)
        srv.reset_counts()
        assert src.check_cache_fit(lambda a, b: range(a, b), 0, len(src)) != []
        assert [src.shard_nbytes(k) for k in range(4)] == [
            os.path.getsize(tmp_path / "www" / "ds" / n) for n in names
        ]
        assert dict(srv.requests) == {}
