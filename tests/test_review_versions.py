"""Remote file versions held by readers, sources and cached copies: cases where a
reader refuses a version it never read, or serves one its opening did not read."""

from __future__ import annotations

import os

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.arrayrecord.file import ArrayRecordFile


def _two_versions(tmp_path) -> tuple[str, bytes]:
    """One ArrayRecord shard served from ``tmp_path/www/ar`` and a same-size second
    version of it (records ``b*`` for ``a*``) in ``tmp_path/v2``: the name and the second version's bytes."""
    (tmp_path / "www").mkdir()
    for name, ch in (("www/ar", "a"), ("v2", "b")):
        rows = [{"v": f"{ch}{i}" * 20} for i in range(8)]
        tg.write_array_record(rows, tmp_path / name, num_shards=1)
    (shard,) = sorted(n for n in os.listdir(tmp_path / "v2") if n.endswith(".array_record"))
    return shard, (tmp_path / "v2" / shard).read_bytes()


@pytest.mark.xfail(
    strict=True,
    reason="ArrayRecordFile built without seen= takes this process's pin at construction "
    "(remote.Version), not at its first read: a reader that has read nothing yet is refused "
    "the version a later opening pinned, which a reader built a moment later reads",
)
@pytest.mark.timeout(60)
def test_a_remote_arrayrecord_file_that_read_nothing_reads_the_version_pinned_since(tmp_path):
    shard, new = _two_versions(tmp_path)
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/ar/{shard}"
        assert tg.ArrayRecordSource([url], retry=QUICK)[0] == {"v": "a0" * 20}
        early = ArrayRecordFile(url)  # nothing read yet: no offsets taken from any version
        _replace(tmp_path / "www" / "ar" / shard, new)
        assert tg.ArrayRecordSource([url], retry=QUICK)[0] == {"v": "b0" * 20}
        late = ArrayRecordFile(url)
        assert b"b0" in late.read([0])[0]
        assert b"b0" in early.read([0])[0]  # refused: "changed since it was read from"
