"""A Parquet shard the server refuses (HTTP 401/403) is access denied, not a corrupt file,
whether the refusal meets the dataset's opening or a later read's opening of the shard."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import FaultProxy, RangeHTTPServer
from tests.test_remote_audit_review import QUICK


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [401, 403])
def test_a_shard_refused_after_the_opening_is_access_denied_at_its_read(tmp_path, code):
    pq.write_table(pa.table({"i": list(range(30))}), tmp_path / "p.parquet", row_group_size=10)
    with RangeHTTPServer(tmp_path) as srv, FaultProxy(srv.url) as proxy:
        src = tg.ParquetSource(f"{proxy.url}/p.parquet", retry=QUICK)
        proxy.inject("status", times=None, code=code)
        with pytest.raises(PermissionError, match=f"HTTP {code}") as e:
            src[25]
        assert "p.parquet" in str(e.value)
