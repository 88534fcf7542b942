"""An ArrayRecordSource named by URL (a list of files, or a directory with a manifest)
whose shard's file is replaced on the server by one of the same size and count, after
which another opening pins the new version: the first source, reading that shard again
(its reader let go: one open reader at most) or for the first time through its shard
cache, refuses the new bytes rather than read them at its own opening's counts."""

from __future__ import annotations

import os

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.manifest import MANIFEST_NAME


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("by", "cache"),
    [
        ("urls", False),
        ("manifest", False),
        ("urls", True),
        ("manifest", True),
    ],
    ids=["urls-direct", "manifest-direct", "urls-cached", "manifest-cached"],
)
def test_a_shard_read_after_a_new_opening_refuses_the_new_version(tmp_path, by, cache):
    (tmp_path / "www").mkdir()
    for name, ch in (("www/ar", "a"), ("v2", "b")):
        rows = [{"v": f"{ch}{i}" * 20} for i in range(8)]
        tg.write_array_record(rows, tmp_path / name, num_shards=2)
    shards = sorted(n for n in os.listdir(tmp_path / "v2") if n.endswith(".array_record"))
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = [f"{srv.url}/ar/{n}" for n in shards] if by == "urls" else f"{srv.url}/ar"

        def source(name: str) -> tg.ArrayRecordSource:
            kw = {"cache_dir": str(tmp_path / name)} if cache else {}
            return tg.ArrayRecordSource(url, retry=QUICK, max_open_files=1, **kw)

        first = source("c1")
        second_shard = int(first.index.offsets[1])
        if not cache:  # shard 0's reader opened, then let go
            assert first[0] == {"v": "a0" * 20}
        assert first[second_shard] == {"v": "a4" * 20}
        _replace(tmp_path / "www" / "ar" / shards[0], (tmp_path / "v2" / shards[0]).read_bytes())
        if by == "manifest":  # the dataset uploaded again, its manifest too
            new = (tmp_path / "v2" / MANIFEST_NAME).read_bytes()
            (tmp_path / "www" / "ar" / MANIFEST_NAME).write_bytes(new)
        assert source("c2")[1] == {"v": "b1" * 20}
        if by == "urls" and cache:
            # Its opening copied the shards into its own cache: it reads v1 from there.
            assert first[1] == {"v": "a1" * 20}
        else:
            # A download checked against the first manifest's checksum is refused by it.
            refused = tg.CorruptDataError if by == "manifest" and cache else tg.RemoteIOError
            with pytest.raises(refused) as e:
                first[1]
            assert shards[0] in str(e.value)
        assert first[second_shard + 1] == {"v": "a5" * 20}
