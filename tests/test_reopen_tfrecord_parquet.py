"""The scenario of tests/test_arrayrecord_reopen.py for TFRecord and Parquet sources named
by file URLs: a shard's reader let go (one open reader at most), its file replaced on the
server by one of the same size and count, and another opening pinning the new version;
the first source's reader opened again must refuse the new bytes."""

from __future__ import annotations

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK, _parquet, _replace_parquet
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord


@pytest.mark.timeout(60)
def test_a_tfrecord_reader_opened_again_after_a_new_opening_refuses_the_new_version(tmp_path):
    (tmp_path / "www").mkdir()
    for name, ch in (("www/a", b"a"), ("www/b", b"a"), ("v2", b"b")):
        write_tfrecord(
            [encode_tf_example({"v": [ch + b"%d" % i]}) for i in range(5)], tmp_path / name
        )
    with RangeHTTPServer(tmp_path / "www") as srv:
        urls = [f"{srv.url}/a", f"{srv.url}/b"]
        first = tg.TFRecordSource(urls, retry=QUICK, index_dir=None, max_open_files=1)
        assert first[1]["v"] == [b"a1"]
        assert first[6]["v"] == [b"a1"]  # shard 0's reader let go
        _replace(tmp_path / "www" / "a", (tmp_path / "v2").read_bytes())
        assert tg.TFRecordSource(urls, retry=QUICK, index_dir=None)[1]["v"] == [b"b1"]
        with pytest.raises(tg.RemoteIOError, match="changed") as e:
            pytest.fail(f"read the new file at the old opening: {first[2]}")
        assert "/a" in str(e.value)
        assert first[7]["v"] == [b"a2"]


@pytest.mark.timeout(60)
def test_a_parquet_reader_opened_again_after_a_new_opening_refuses_the_new_version(tmp_path):
    (tmp_path / "www").mkdir()
    _parquet(tmp_path / "www" / "a.parquet", 0)
    _parquet(tmp_path / "www" / "b.parquet", 100)
    with RangeHTTPServer(tmp_path / "www") as srv:
        urls = [f"{srv.url}/a.parquet", f"{srv.url}/b.parquet"]

        def source() -> tg.ParquetSource:
            return tg.ParquetSource(urls, retry=QUICK, cache_bytes=0, max_open_files=1)

        first = source()
        assert first[1] == {"x": 1}
        assert first[150] == {"x": 150}  # shard 0's reader let go
        _replace_parquet(tmp_path / "www" / "a.parquet", 1000)
        assert source()[1] == {"x": 1001}
        with pytest.raises(tg.RemoteIOError, match="changed") as e:
            pytest.fail(f"read the new file at the old opening: {first[2]}")
        assert "a.parquet" in str(e.value)
        assert first[151] == {"x": 151}
