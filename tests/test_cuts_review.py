"""Review of behaviour changes: each test reproduces a bug on real components (servers on
127.0.0.1, files written here) and is expected to fail until it is fixed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import torchgrain as tg
from docs.snippets.fixed_format import FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK


def _replace(path, data: bytes) -> None:
    """``path`` rewritten with ``data`` (its size), with a later modification time
    (another ETag and Last-Modified)."""
    assert len(data) == path.stat().st_size
    path.write_bytes(data)
    later = time.time() + 100
    os.utime(path, (later, later))


@pytest.mark.timeout(60)
def test_a_format_source_url_replaced_on_the_server_can_be_opened_again(tmp_path):
    """As ArrayRecord's (tests/test_pins_review): an opening reads the file as it is now."""
    (tmp_path / "www").mkdir()
    (served,) = write_fixed([{"v": f"a{i}"} for i in range(8)], str(tmp_path / "www"))
    (other,) = write_fixed([{"v": f"b{i}"} for i in range(8)], str(tmp_path / "v2"))
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{os.path.basename(served)}"
        assert FixedSource(url, retry=QUICK)[3] == {"v": "a3"}
        _replace(tmp_path / "www" / os.path.basename(served), Path(other).read_bytes())
        assert FixedSource(url, retry=QUICK)[3] == {"v": "b3"}


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
