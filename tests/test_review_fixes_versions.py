"""A remote reader that read nothing takes the version its first read finds: a later
opening that pins another version between that read and its check must not leave the
reader serving records of both versions."""

from __future__ import annotations

import os
import pickle

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace, _two_tfrecords
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.arrayrecord.file import ArrayRecordFile
from torchgrain.io import remote, responses


@pytest.mark.timeout(60)
def test_a_reupload_pinned_between_a_first_read_and_its_check_never_mixes_versions(
    tmp_path, monkeypatch
):
    (tmp_path / "www").mkdir()
    for name, ch in (("www/ar", "a"), ("v2", "b")):  # 2.4 MB: the tail read is 1 MiB
        rows = [{"v": ch * 300_000} for _ in range(8)]
        tg.write_array_record(rows, tmp_path / name, compression="uncompressed")
    (shard,) = [n for n in os.listdir(tmp_path / "v2") if n.endswith(".array_record")]
    new = (tmp_path / "v2" / shard).read_bytes()
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/ar/{shard}"
        early = ArrayRecordFile(url)  # nothing read yet
        check, raced = remote.Version.check, []

        def racing(self):
            if self is early._version and not raced:
                raced.append(1)  # another thread opens the file, re-uploaded since
                _replace(tmp_path / "www" / "ar" / shard, new)
                assert tg.ArrayRecordSource([url], retry=QUICK)[0]["v"][0] == "b"
            check(self)

        monkeypatch.setattr(remote.Version, "check", racing)
        seen = set()
        for i in (7, 0):
            try:
                seen.add(bytes(early.read([i])[0][-1:]))
            except tg.RemoteIOError as e:
                assert shard in str(e)
        assert raced and len(seen) <= 1, f"records of both versions: {seen}"


@pytest.mark.timeout(60)
def test_a_source_pickled_before_a_reupload_unpickled_first_leaves_the_new_one_readable(
    tmp_path, monkeypatch
):
    served = _two_tfrecords(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        url = f"{srv.url}/tf/a.tfrecord"
        old = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
        assert old[0] == {"v": [b"a0"]}
        before = pickle.dumps(old)
        _replace(served, (tmp_path / "b").read_bytes())
        new = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
        assert new[0] == {"v": [b"b0"]}
        after = pickle.dumps(new)
        monkeypatch.setattr(responses, "_PINS", {})  # another process
        assert pickle.loads(after)[0] == {"v": [b"b0"]}  # alone (or first): it reads
        monkeypatch.setattr(responses, "_PINS", {})
        stale = pickle.loads(before)
        with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
            stale[0]  # its opening read another version: refused
        assert pickle.loads(after)[0] == {"v": [b"b0"]}  # RemoteIOError at unpickling
