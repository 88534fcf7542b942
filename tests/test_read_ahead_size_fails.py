"""A pass's read-ahead walk over a shard whose size lookup fails goes on to warm the
others; the read that needs that shard reports the error, naming its file."""

from __future__ import annotations

import numpy as np
import pytest

from tests.servers import FaultProxy, RangeHTTPServer
from tests.test_read_ahead_steady import PER, SHARDS, _batch, _labels, _open, _write
from tests.test_remote_audit_review import QUICK


@pytest.mark.timeout(120)
def test_read_ahead_walks_past_a_shard_whose_size_lookup_fails(tmp_path):
    _write("arrayrecord", tmp_path / "www" / "ds")
    with RangeHTTPServer(tmp_path / "www") as srv, FaultProxy(srv.url) as proxy:
        src = _open("arrayrecord", f"{proxy.url}/ds", tmp_path / "cache", retry=QUICK)
        third = src.paths[2]
        known = src.shard_nbytes

        def shard_nbytes(shard: int) -> int:
            if shard == 2:
                raise OSError(f"{third}: the server would not tell its size")
            return known(shard)

        src.shard_nbytes = shard_nbytes
        # The shard's download fails too, while read-ahead walks the pass.
        proxy.inject("status", times=None, match=third.rsplit("/", 1)[1], code=503)
        src.read_ahead(lambda a, b: np.arange(a, b), 0, len(src), lambda: 0)
        ra = src._proc().read_ahead
        assert ra.join(timeout=60)
        assert ra.fetched == SHARDS - 1  # the walk went past the shard it could not size
        with pytest.raises(Exception) as e:
            src.__getitems__([2 * PER + 1])
        assert third.rsplit("/", 1)[1] in str(e.value)
        proxy.clear()
        got = _labels(_batch(src.__getitems__(list(range(SHARDS * PER)))))
        assert got == list(range(SHARDS * PER))
