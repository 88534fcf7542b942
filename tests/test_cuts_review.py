"""Review of behaviour changes: each test reproduced a bug on real components (servers on
127.0.0.1, files written here) and was a strict xfail until the bug was fixed."""

from __future__ import annotations

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [401, 403])
def test_a_refused_parquet_opening_is_access_denied_whichever_request_is_refused(tmp_path, code):
    """Every request from the ``skip``-th on refused: the opening fails with
    PermissionError (naming the URL and the status) or, past its last request, succeeds;
    never as a corrupt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.servers import FaultProxy

    pq.write_table(pa.table({"i": list(range(30))}), tmp_path / "p.parquet", row_group_size=10)
    seen = []
    with RangeHTTPServer(tmp_path) as srv:
        for skip in range(8):
            with FaultProxy(srv.url) as proxy:  # (a new origin: nothing cached of it)
                proxy.inject("status", times=None, skip=skip, code=code)
                try:
                    tg.ParquetSource(f"{proxy.url}/p.parquet", retry=QUICK)
                except PermissionError as e:
                    assert f"HTTP {code}" in str(e), e
                    seen.append("denied")
                except Exception as e:
                    pytest.fail(f"skip={skip}: {type(e).__name__}: {e}")
                else:
                    seen.append("ok")
    assert "denied" in seen
