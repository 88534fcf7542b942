"""Behaviour the line cuts and fixes after e20345b changed (each xfail test names the
commit; it passes at e20345b)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from docs.snippets.fixed_format import FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK


def _replace(path: Path, data: bytes) -> None:
    """``path`` rewritten with ``data`` (its size), with a later modification time
    (another ETag and Last-Modified)."""
    assert len(data) == path.stat().st_size
    path.write_bytes(data)
    later = time.time() + 100
    os.utime(path, (later, later))


@pytest.mark.timeout(60)
def test_a_source_opened_before_a_replacement_refuses_it_through_its_shard_cache(tmp_path):
    (tmp_path / "www").mkdir()
    (served,) = write_fixed([{"v": f"a{i}"} for i in range(8)], str(tmp_path / "www"))
    (other,) = write_fixed([{"v": f"b{i}"} for i in range(8)], str(tmp_path / "v2"))
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{os.path.basename(served)}"
        first = FixedSource(url, retry=QUICK, cache_dir=str(tmp_path / "c1"))
        _replace(tmp_path / "www" / os.path.basename(served), Path(other).read_bytes())
        # (refused at e20345b, which pinned the first version for the process)
        with contextlib.suppress(Exception):
            FixedSource(url, retry=QUICK, cache_dir=str(tmp_path / "c2"))[3]
        with pytest.raises(Exception, match="changed") as e:
            first[3]
        assert os.path.basename(served) in str(e.value)
