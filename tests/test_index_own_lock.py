"""A dataset index built under a lock of its own (its shared lock held too long by another
process): that lock file goes when the build ends, fails, or its builder is killed (with
its temp file, at the next sweep); a lock another process holds, or an index's shared lock,
is never deleted."""

from __future__ import annotations

import os
import sys

import pytest

from tests._locks import hold_flock
from torchgrain.io import node_store
from torchgrain.sources.node_index import store as node_index

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock")

NAME = "demo-0123456789abcdef0123456789abcdef.tgindex"
OWN = "0a1b2c3d-" + NAME


class Demo:
    kind = "demo"

    def __init__(self, arrays) -> None:
        self._a = arrays


def _locks(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".lock") and n != "evict.lock")


def test_a_failed_give_up_build_deletes_its_temp_file_then_its_lock(tmp_path, monkeypatch) -> None:
    d = str(tmp_path)
    store = node_index.index_store(d)
    dropped = []  # the temp files left when the own lock is deleted
    unlink_if = node_store._unlink_if

    def watching(path: str, fd: int) -> None:
        dropped.append([p for p, _, _ in store._temps()])
        unlink_if(path, fd)

    monkeypatch.setattr(node_store, "_unlink_if", watching)

    def build(out):
        assert out is not None and os.path.exists(out)
        raise ValueError("no")

    fd = hold_flock(os.path.join(d, NAME + ".lock"))  # another process's build
    try:
        with pytest.raises(ValueError, match="no"):
            node_index.cached_index(d, NAME, Demo, build, lambda ix: None, deadline=0)
    finally:
        os.close(fd)
    assert dropped == [[]]  # (its temp file went first: no sweep can make the lock again)
    assert _locks(d) == [NAME + ".lock"] and store._temps() == []


def test_a_sweep_keeps_a_held_own_lock_and_its_temp_file(tmp_path) -> None:
    d = str(tmp_path)
    store = node_index.index_store(d)
    with store._lock(OWN):
        tmp = store._reserve(OWN, 0, evict=False)
    fd = hold_flock(store._lock_path(OWN))  # its builder, alive
    try:
        store._reserved()
        assert os.path.exists(tmp) and os.path.exists(store._lock_path(OWN))
    finally:
        os.close(fd)
    store._reserved()  # (its builder gone)
    assert not os.path.exists(tmp) and not os.path.exists(store._lock_path(OWN))


def test_a_sweep_keeps_an_index_shared_lock_file(tmp_path) -> None:
    d = str(tmp_path)
    store = node_index.index_store(d)
    with store._lock(NAME):
        tmp = store._reserve(NAME, 0, evict=False)  # a killed builder's
    store._reserved()
    assert not os.path.exists(tmp) and os.path.exists(store._lock_path(NAME))


def test_only_own_lock_names_are_own(tmp_path) -> None:
    store = node_index.index_store(str(tmp_path))
    assert store._own_lock(OWN)
    for name in (NAME, "0123456789abcdef0123456789abcdef-a.offsets.tgindex", "k.tgindex"):
        assert not store._own_lock(name)
