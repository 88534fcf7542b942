"""A FormatSource named by URL: an opening pins the file as the server has it now, and a
source opened before a same-size replacement keeps refusing the new bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from docs.snippets.fixed_format import FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK


@pytest.mark.timeout(60)
def test_a_source_opened_before_a_replacement_refuses_it_after_a_new_opening(tmp_path):
    (tmp_path / "www").mkdir()
    (served,) = write_fixed([{"v": f"a{i}"} for i in range(8)], str(tmp_path / "www"))
    (other,) = write_fixed([{"v": f"b{i}"} for i in range(8)], str(tmp_path / "v2"))
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{os.path.basename(served)}"
        first = FixedSource(url, retry=QUICK, max_open_files=1)
        assert first[3] == {"v": "a3"}
        _replace(tmp_path / "www" / os.path.basename(served), Path(other).read_bytes())
        assert FixedSource(url, retry=QUICK)[3] == {"v": "b3"}
        with pytest.raises(Exception, match="changed") as e:
            first[5]
        assert os.path.basename(served) in str(e.value)


@pytest.mark.timeout(60)
def test_a_reader_opened_again_after_a_new_opening_refuses_the_new_version(tmp_path):
    """The source's reader of the replaced shard was let go (one open reader at most) and
    is opened again after another opening pinned the new version: it is refused, not read
    at the old opening's counts."""
    (tmp_path / "www").mkdir()
    served = write_fixed([{"v": f"a{i}"} for i in range(8)], str(tmp_path / "www"), num_shards=2)
    other = write_fixed([{"v": f"b{i}"} for i in range(8)], str(tmp_path / "v2"), num_shards=2)
    with RangeHTTPServer(tmp_path / "www") as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in served]
        first = FixedSource(urls, retry=QUICK, max_open_files=1)
        assert [first[0], first[5]] == [{"v": "a0"}, {"v": "a5"}]  # shard 0's reader let go
        _replace(Path(served[0]), Path(other[0]).read_bytes())
        assert FixedSource(urls, retry=QUICK)[1] == {"v": "b1"}
        with pytest.raises(Exception, match="changed") as e:
            first[1]
        assert os.path.basename(served[0]) in str(e.value)
        assert first[6] == {"v": "a6"}
