"""A sharded source's pins (the versions of its remote files it holds): filled by its
opening or its first read, never by pickling it; and the shard sizes an opening found,
given to ShardedSource._init_shards."""

from __future__ import annotations

import pickle

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace, _two_tfrecords
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import remote, responses
from torchgrain.sources.base import ShardedSource


@pytest.mark.timeout(60)
def test_pickling_a_remote_source_leaves_its_pins_as_they_were(tmp_path, monkeypatch):
    """A source whose opening pinned nothing of its file holds the version its first read
    found: pickled before that read, its pickle carries the process's pin of the file,
    and the source still holds nothing (pickling filled its pins, so that a pickle taken
    before the first read decided what the source itself accepts); pickled after, the
    pickle carries the pin it holds. A spawned copy refuses the file replaced since."""
    served = _two_tfrecords(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        with monkeypatch.context() as m:  # an opening that pinned nothing
            m.setattr(remote, "held_pins", lambda fs, paths: [None] * len(paths))
            src = tg.TFRecordSource(f"{srv.url}/tf/a.tfrecord", retry=QUICK, index_dir=None)
        assert src._held == [None]
        before = pickle.dumps(src)
        assert src._held == [None]
        assert src[3]["v"] == [b"a3"]
        (held,) = src._held
        assert held is not None
        after = pickle.dumps(src)
        assert src._held == [held] and src._held[0] is held
        _replace(served, (tmp_path / "b").read_bytes())
        for state in (before, after):
            monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
            with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
                pytest.fail(f"a spawned copy read the new file: {pickle.loads(state)[3]}")


class _Sized(ShardedSource):
    """Two local shards whose sizes its opening found."""

    def __init__(self, paths: list[str]) -> None:
        import fsspec

        self._init_shards(
            filesystem=fsspec.filesystem("file"), paths=paths, counts=[1, 1], sizes={0: 5, 1: 7}
        )

    def _open_reader(self, shard, path, filesystem):
        return open(path, "rb")

    keys = property(lambda self: ["b"])
    schema = property(lambda self: {"b": "bytes"})

    def __getitems__(self, indices):
        return [{"b": b""} for _ in indices]


def test_init_shards_keeps_the_sizes_an_opening_found(tmp_path):
    """``sizes=`` of _init_shards are the shards' sizes a pass's cache-fit check uses (no
    size asked of any file), and travel with a copy."""
    src = _Sized([str(tmp_path / "missing-0"), str(tmp_path / "missing-1")])
    assert src.cache_fit.sizes == {0: 5, 1: 7}
    assert src.shard_nbytes(1) == 7
    assert pickle.loads(pickle.dumps(src)).cache_fit.sizes == {0: 5, 1: 7}


@pytest.mark.timeout(60)
def test_a_batch_checks_the_version_of_each_cached_copy_it_opens_once(tmp_path, monkeypatch):
    """A batch over shards whose copies are in the shard cache but not open worked out
    each one's version (a pin check and a hash of its validator) twice: once to ask
    whether the cache holds it, again to open it."""
    from torchgrain.io.shard_cache import ShardCache

    (tmp_path / "tf").mkdir()
    for k in range(3):
        records = [encode_tf_example({"v": [b"%d-%d" % (k, i)]}) for i in range(4)]
        write_tfrecord(records, tmp_path / "tf" / f"a{k}.tfrecord")
    with RangeHTTPServer(tmp_path) as srv:
        urls = [f"{srv.url}/tf/a{k}.tfrecord" for k in range(3)]
        cache = tmp_path / "cache"

        def open_():
            return tg.TFRecordSource(
                urls, retry=QUICK, index_dir=None, cache_dir=cache, io_threads=4
            )

        assert [r["v"] for r in open_().__getitems__([0, 4, 8])] == [[b"0-0"], [b"1-0"], [b"2-0"]]
        src = open_()  # the copies are there; none is open
        versions = []
        real = ShardCache._version
        monkeypatch.setattr(
            ShardCache, "_version", lambda self, *a: versions.append(a[1]) or real(self, *a)
        )
        srv.reset_counts()
        assert [r["v"] for r in src.__getitems__([1, 5, 9])] == [[b"0-1"], [b"1-1"], [b"2-1"]]
        assert srv.gets() == 0
        assert sorted(versions) == sorted(src._fs._strip_protocol(u) for u in urls)
        versions.clear()
        assert [r["v"] for r in src.__getitems__([2, 6])] == [[b"0-2"], [b"1-2"]]
        assert versions == []  # (open: no version work)
