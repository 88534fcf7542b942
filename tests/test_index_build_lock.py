"""A dataset index's build lock another process holds (a builder stopped, or stuck on its
disk): an open says what it waits for after a few seconds, and waits at most
$TORCHGRAIN_INDEX_LOCK_WAIT seconds, or the source's retry deadline, then builds too."""

from __future__ import annotations

import os
import time
import warnings

import pytest

import torchgrain as tg
from tests._locks import array_record_without_index, hold_flock
from torchgrain.io.retry import RetryPolicy
from torchgrain.sources.node_index import store as node_index


def _index_lock(tmp_path, data: str) -> str:
    probe = str(tmp_path / "probe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg.ArrayRecordSource(data, codec="msgpack", index_dir=probe)
    (name,) = [n for n in os.listdir(probe) if n.endswith(".tgindex.lock")]
    return name


def test_a_held_index_build_lock_is_said_then_waited_for_at_most_the_knob(tmp_path, monkeypatch):
    data = array_record_without_index(tmp_path)
    name, idx = _index_lock(tmp_path, data), tmp_path / "idx"
    monkeypatch.setattr(node_index, "_SAY_WAIT", 0.2)
    monkeypatch.setenv(node_index.INDEX_LOCK_WAIT_ENV, "0.8")
    fd = hold_flock(str(idx / name))
    try:
        start = time.monotonic()
        with pytest.warns(UserWarning, match="waiting up to 0.8 s") as said:
            src = tg.ArrayRecordSource(data, codec="msgpack", index_dir=str(idx))
        took = time.monotonic() - start
    finally:
        os.close(fd)
    assert len(src) == 10 and 0.8 <= took < 5, took
    (w,) = [w for w in said if "waiting up to" in str(w.message)]
    assert str(idx / name) in str(w.message) and node_index.INDEX_LOCK_WAIT_ENV in str(w.message)


def test_an_index_build_lock_wait_keeps_to_the_sources_retry_deadline(tmp_path, monkeypatch):
    data = array_record_without_index(tmp_path)
    name, idx = _index_lock(tmp_path, data), tmp_path / "idx"
    fd = hold_flock(str(idx / name))
    try:
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            src = tg.ArrayRecordSource(
                data, codec="msgpack", index_dir=str(idx), retry=RetryPolicy(deadline=0.3)
            )
        took = time.monotonic() - start
    finally:
        os.close(fd)
    assert len(src) == 10 and took < 3, took
    assert not [w for w in said if "waiting up to" in str(w.message)]  # (not long enough)


def test_a_bad_index_lock_wait_variable_is_an_error_naming_it(monkeypatch):
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(node_index.INDEX_LOCK_WAIT_ENV, bad)
        with pytest.raises(ValueError, match=node_index.INDEX_LOCK_WAIT_ENV):
            node_index.index_lock_wait()
    monkeypatch.setenv(node_index.INDEX_LOCK_WAIT_ENV, "30")
    assert node_index.index_lock_wait() == 30.0 and node_index.index_lock_wait(2.5) == 2.5
    monkeypatch.delenv(node_index.INDEX_LOCK_WAIT_ENV)
    assert node_index.index_lock_wait() == 900.0


def test_a_tfrecord_index_build_lock_wait_keeps_to_the_sources_retry_deadline(tmp_path):
    from torchgrain.formats.tfrecord import write_tfrecord

    data = tmp_path / "tf"
    data.mkdir()
    for k in range(2):
        write_tfrecord([b"r%d" % i for i in range(5)], str(data / f"part-{k}.tfrecord"))
    probe, idx = tmp_path / "probe", tmp_path / "idx"
    tg.TFRecordSource(str(data), codec="raw", index_dir=str(probe))
    (name,) = [n for n in os.listdir(probe) if n.startswith("tfrecord-") and n.endswith(".lock")]
    fd = hold_flock(str(idx / name))
    try:
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            src = tg.TFRecordSource(
                str(data), codec="raw", index_dir=str(idx), retry=RetryPolicy(deadline=0.3)
            )
        took = time.monotonic() - start
    finally:
        os.close(fd)
    assert len(src) == 10 and took < 3, took
