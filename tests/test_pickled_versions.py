"""Copies of sources holding versions of a remote file that a later opening replaced:
each copy holds the versions it was pickled with, whatever order they come in."""

from __future__ import annotations

import copy
import pickle

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import responses


def _old_and_new(tmp_path, srv) -> tuple[tg.TFRecordSource, tg.TFRecordSource]:
    """A source opened on a file, and one opened after the file's re-upload (same size)."""
    url = f"{srv.url}/tf/a.tfrecord"
    old = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
    assert old[0] == {"v": [b"a0"]}
    _replace(tmp_path / "tf" / "a.tfrecord", (tmp_path / "b").read_bytes())
    new = tg.TFRecordSource(url, retry=QUICK, index_dir=None)
    assert new[0] == {"v": [b"b0"]}
    return old, new


def _write(tmp_path) -> None:
    (tmp_path / "tf").mkdir()
    write_tfrecord(
        [encode_tf_example({"v": [b"a%d" % i]}) for i in range(5)], tmp_path / "tf" / "a.tfrecord"
    )
    write_tfrecord([encode_tf_example({"v": [b"b%d" % i]}) for i in range(5)], tmp_path / "b")


@pytest.mark.timeout(60)
def test_a_spawned_copy_of_new_then_old_sources_reads_the_new_one(tmp_path, monkeypatch):
    _write(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        old, new = _old_and_new(tmp_path, srv)
        state = pickle.dumps(tg.concat([new, old]))
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        child = pickle.loads(state)
        with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
            child[5]  # the old source's read
        assert child[0] == {"v": [b"b0"]}


@pytest.mark.timeout(60)
def test_a_copy_of_an_old_source_leaves_this_processs_pin(tmp_path):
    _write(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        old, new = _old_and_new(tmp_path, srv)
        again = copy.copy(old)
        for src in (old, again):
            with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
                src[1]
        assert new[1] == {"v": [b"b1"]}
        assert copy.copy(new)[2] == {"v": [b"b2"]}
