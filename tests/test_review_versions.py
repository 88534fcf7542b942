"""Remote file versions held by readers, sources and cached copies: cases where a
reader refuses a version it never read, or serves one its opening did not read."""

from __future__ import annotations

import os
import pickle
import time

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace, _two_tfrecords
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.arrayrecord.file import ArrayRecordFile
from torchgrain.io import responses


def _two_versions(tmp_path) -> tuple[str, bytes]:
    """One ArrayRecord shard served from ``tmp_path/www/ar`` and a same-size second
    version of it (records ``b*`` for ``a*``) in ``tmp_path/v2``: the name and the second version's bytes."""
    (tmp_path / "www").mkdir()
    for name, ch in (("www/ar", "a"), ("v2", "b")):
        rows = [{"v": f"{ch}{i}" * 20} for i in range(8)]
        tg.write_array_record(rows, tmp_path / name, num_shards=1)
    (shard,) = sorted(n for n in os.listdir(tmp_path / "v2") if n.endswith(".array_record"))
    return shard, (tmp_path / "v2" / shard).read_bytes()


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


@pytest.mark.timeout(60)
def test_an_old_sources_refused_reopen_leaves_the_new_sources_pin(tmp_path):
    (tmp_path / "www").mkdir()
    for name, pad in (("www/ar", 0), ("v2", 60000)):  # v2: same counts, larger files
        rows = [{"v": f"{name[-2:]}{i}" + os.urandom(pad).hex()} for i in range(8)]
        tg.write_array_record(rows, tmp_path / name, num_shards=2)
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/ar"
        old = tg.ArrayRecordSource(url, retry=QUICK, max_open_files=1)
        assert old[0]["v"] == "ar0"
        assert old[int(old.index.offsets[1])]["v"] == "ar4"  # shard 0's reader let go
        later = time.time() + 100
        for name in os.listdir(tmp_path / "v2"):  # the dataset uploaded again
            served = tmp_path / "www" / "ar" / name
            assert served.stat().st_size != (tmp_path / "v2" / name).stat().st_size or (
                not name.endswith(".array_record")
            )
            served.write_bytes((tmp_path / "v2" / name).read_bytes())
            os.utime(served, (later, later))
        new = tg.ArrayRecordSource(url, retry=QUICK)
        assert new[0]["v"].startswith("v20")
        with pytest.raises(tg.RemoteIOError, match="data-00000-of-00002"):
            old[1]  # refused, as it should be: its opening read another version
        assert new[1]["v"].startswith("v21")  # refused: the old size pinned again


@pytest.mark.timeout(60)
def test_a_spawned_copy_of_old_and_new_sources_of_one_file_reads_the_new_one(tmp_path, monkeypatch):
    served = _two_tfrecords(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        url = f"{srv.url}/tf/a.tfrecord"
        old = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
        assert old[0] == {"v": [b"a0"]}
        _replace(served, (tmp_path / "b").read_bytes())
        new = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
        both = tg.concat([old, new])
        assert both[5] == {"v": [b"b0"]}
        with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
            both[0]  # the old source's read: refused
        state = pickle.dumps(both)
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        child = pickle.loads(state)  # RemoteIOError: "another version of the file"
        assert child[5] == {"v": [b"b0"]}
        with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
            child[0]


@pytest.mark.timeout(60)
def test_a_spawned_old_source_leaves_the_new_versions_cached_copy(tmp_path, monkeypatch):
    served = _two_tfrecords(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        url, cache = f"{srv.url}/tf/a.tfrecord", str(tmp_path / "cache")
        old = tg.TFRecordSource([url], retry=QUICK, index_dir=None, cache_dir=cache)
        assert old[0] == {"v": [b"a0"]}
        state = pickle.dumps(old)
        _replace(served, (tmp_path / "b").read_bytes())
        new = tg.TFRecordSource([url], retry=QUICK, index_dir=None, cache_dir=cache)
        assert new[0] == {"v": [b"b0"]}
        copy = new.cached_copies.cache.local_path(url)
        ident = os.stat(copy).st_ino
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        srv.reset_counts()
        with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
            pickle.loads(state)[0]
        assert os.path.exists(copy) and os.stat(copy).st_ino == ident  # deleted
        assert srv.gets() == 0  # the new file downloaded, then refused
