"""A FormatSource opened before a same-size replacement, read through its shard cache after
a later opening re-pinned the URL: a regression of the fresh pin at opening (b06f9b6),
a strict xfail until the cached copies were checked against the source's own version."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from docs.snippets.fixed_format import FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK


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
