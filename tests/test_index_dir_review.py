"""The node-shared index directory as a node-local store (IndexDir): builds that race
for an index's lock, killed builders, eviction and the directory's hostile contents."""

from __future__ import annotations

import os
import pickle
import threading
import warnings

import numpy as np
import pytest

from torchgrain.errors import CorruptDataError
from torchgrain.sources.node_index import store

_COLUMNS = {"a": ("<i8", ())}


class _Demo:
    kind = "demo"

    def __init__(self, arrays):
        self._a = arrays


def _build(fill):
    return lambda out: store.build_index(_Demo, out, _COLUMNS, fill)


def _rows(ix) -> list[int]:
    return ix._a.arrays["a"].tolist()


def test_a_build_that_outwaits_the_lock_leaves_the_holders_build_whole(tmp_path, monkeypatch):
    # A process that waited _LOCK_WAIT for another's build builds too, without the lock:
    # it must not delete the temp files of the build still running under the lock.
    monkeypatch.setattr(store, "_LOCK_WAIT", 0.2)
    d = str(tmp_path / "index")
    writing, finish = threading.Event(), threading.Event()

    def slow(sink):
        sink.append("a", np.arange(5))
        writing.set()
        assert finish.wait(60)
        sink.append("a", np.arange(5, 10))
        return {}

    def fast(sink):
        sink.append("a", np.arange(10))
        return {}

    got: dict = {}

    def holder():
        try:
            got["ix"] = store.cached_index(d, "k.tgindex", _Demo, _build(slow), lambda ix: None)
        except BaseException as e:  # (reported below)
            got["error"] = e

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert writing.wait(60)
        ix = store.cached_index(d, "k.tgindex", _Demo, _build(fast), lambda ix: None)
    finally:
        finish.set()
        t.join(60)
    assert _rows(ix) == list(range(10))
    assert "error" not in got, got.get("error")
    assert _rows(got["ix"]) == list(range(10))


def _in_thread(got: dict, key: str, fn) -> threading.Thread:
    def run():
        try:
            got[key] = fn()
        except BaseException as e:  # (reported by the test)
            got[key] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_build_that_outwaited_the_lock_keeps_its_temps_once_the_lock_is_free(
    tmp_path, monkeypatch
):
    # The build it outwaited ends first and frees the lock; another index published
    # meanwhile sweeps the temp files whose index's lock is free: not this build's.
    monkeypatch.setattr(store, "_LOCK_WAIT", 0.2)
    d = str(tmp_path / "index")
    events = {k: threading.Event() for k in ("h_writing", "h_finish", "u_writing", "u_finish")}

    def slow(writing, finish):
        def fill(sink):
            sink.append("a", np.arange(5))
            events[writing].set()
            assert events[finish].wait(60)
            sink.append("a", np.arange(5, 10))
            return {}

        return fill

    def open_k(fill):
        return lambda: store.cached_index(d, "k.tgindex", _Demo, _build(fill), lambda ix: None)

    got: dict = {}
    threads = [_in_thread(got, "holder", open_k(slow("h_writing", "h_finish")))]
    try:
        assert events["h_writing"].wait(60)
        threads.append(_in_thread(got, "unlocked", open_k(slow("u_writing", "u_finish"))))
        assert events["u_writing"].wait(60)
        events["h_finish"].set()
        threads[0].join(60)

        def other(sink):
            sink.append("a", np.arange(3))
            return {}

        ix = store.cached_index(d, "o.tgindex", _Demo, _build(other), lambda ix: None)
        assert _rows(ix) == [0, 1, 2]
    finally:
        for e in events.values():
            e.set()
        for t in threads:
            t.join(60)
    for key in ("holder", "unlocked"):
        assert not isinstance(got[key], BaseException), (key, got[key])
        assert _rows(got[key]) == list(range(10))


@pytest.mark.parametrize(
    "hostile",
    [
        ["k.tgindex.lock/"],  # the index's own lock (the starting code raised too)
        ["evict.lock/"],  # the directory's eviction lock
        [".o.tgindex-0-1-0a1b2c3d", "o.tgindex.lock/"],  # another index's temp file's
    ],
)
def test_a_lock_file_that_is_a_directory_does_not_fail_the_build(tmp_path, hostile):
    d = tmp_path / "index"
    d.mkdir()
    for name in hostile:
        if name.endswith("/"):
            (d / name).mkdir()
        else:
            (d / name).write_bytes(b"x")

    def fill(sink):
        sink.append("a", np.arange(4))
        return {}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a directory that cannot take it says so)
        ix = store.cached_index(str(d), "k.tgindex", _Demo, _build(fill), lambda ix: None)
    assert _rows(ix) == [0, 1, 2, 3]
    assert not [n for n in os.listdir(d) if n.startswith(".k.")]  # nothing partial


def test_an_index_built_again_after_its_eviction_is_the_most_recently_used(tmp_path, monkeypatch):
    d = tmp_path / "index"

    def fill(sink):
        sink.append("a", np.arange(64))
        return {}

    def build(key, used=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store.cached_index(str(d), key + ".tgindex", _Demo, _build(fill), lambda ix: None)
        if used is not None:
            os.utime(d / (key + ".tgindex.lock"), (used, used))

    build("a", 1_000_000_000)
    size = os.path.getsize(d / "a.tgindex")
    monkeypatch.setattr(store, "INDEX_DIR_BYTES", size * 5 // 2)  # two indexes fit
    build("b", 1_000_000_100)
    build("c", 1_000_000_200)  # "a" goes
    assert not (d / "a.tgindex").exists()
    build("a")  # built again, now: "b" goes
    build("d")  # the least recently used is "c", not "a"
    assert sorted(n for n in os.listdir(d) if n.endswith(".tgindex")) == ["a.tgindex", "d.tgindex"]


def test_an_index_evicted_while_mapped_still_reaches_spawned_workers(tmp_path, monkeypatch):
    # A source pickles its index as the file's name; DataLoader workers that are spawned
    # (or forkserver's, each epoch unless persistent) map it again: after another
    # process's build evicted it, they must still get its records.
    d = str(tmp_path / "index")

    def fill(sink):
        sink.append("a", np.arange(64))
        return {}

    def open_(key):
        return store.cached_index(d, key + ".tgindex", _Demo, _build(fill), lambda ix: None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = open_("a")
        monkeypatch.setattr(store, "INDEX_DIR_BYTES", 1)
        open_("b")
    assert not os.path.exists(os.path.join(d, "a.tgindex"))  # evicted
    assert _rows(a) == list(range(64))  # mapped here: read on
    assert pickle.loads(pickle.dumps(a._a)).arrays["a"].tolist() == list(range(64))


def test_an_index_rebuilt_after_its_eviction_is_mapped_only_if_it_is_the_same(
    tmp_path, monkeypatch
):
    # Another process's build of the evicted index (the same key) took its name: spawned
    # workers map that file once it is checked to hold the same index, and refuse another.
    d = str(tmp_path / "index")

    def open_(key, n=64):
        def fill(sink):
            sink.append("a", np.arange(n))
            return {}

        return store.cached_index(d, key + ".tgindex", _Demo, _build(fill), lambda ix: None)

    path = os.path.join(d, "a.tgindex")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = open_("a")
        monkeypatch.setattr(store, "INDEX_DIR_BYTES", 1)
        open_("b")  # evicts "a"
        open_("a")  # built again: another file (this one's inode is still mapped)
        rebuilt = os.stat(path).st_ino
        assert rebuilt != a._a.file.identity[1]
        assert pickle.loads(pickle.dumps(a._a)).arrays["a"].tolist() == list(range(64))
        assert os.stat(path).st_ino == rebuilt  # mapped as it is, not published again
        os.unlink(path)
        open_("a", n=3)  # other contents under its name
        with pytest.raises(CorruptDataError, match="replaced"):
            pickle.dumps(a._a)
