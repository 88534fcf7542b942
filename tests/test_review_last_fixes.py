"""Predicate keys and emptied pins: two predicates that select differently never share a
key, and a pin emptied by two pickles of two versions never refuses the version served."""

from __future__ import annotations

import collections
import functools
import os
import pickle
import re

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace, _two_tfrecords
from tests.test_remote_audit_review import QUICK
from tests.test_shard_cache_held_version import KINDS, _served, _workers_read
from torchgrain.io import responses
from torchgrain.sources.node_index.derived import callable_fingerprint


def _first_key_filter(d):
    return lambda r: r["k"] == next(iter(d))


def _lookup_filter(d):
    return lambda r: d[r["k"]] > 0


@pytest.mark.parametrize(
    "kind",
    [
        dict,
        collections.OrderedDict,
    ],
)
def test_dicts_of_another_order_never_share_a_predicate_key(kind):
    a = kind([("x", 1), ("y", 2)])
    b = kind([("y", 2), ("x", 1)])
    fa, fb = _first_key_filter(a), _first_key_filter(b)
    assert fa({"k": "x"}) != fb({"k": "x"})  # they select differently
    assert callable_fingerprint(fa) != callable_fingerprint(fb)


def test_defaultdicts_of_another_factory_never_share_a_predicate_key():
    zero = collections.defaultdict(int)
    one = collections.defaultdict(functools.partial(int, 1))
    fa, fb = _lookup_filter(zero), _lookup_filter(one)
    assert fa({"k": "m"}) != fb({"k": "m"})  # they select differently
    assert callable_fingerprint(fa) != callable_fingerprint(fb)


class State:
    def __init__(self, s):
        self.s = s

    def __reduce__(self):
        return (State, (None,), {1: "a", "b": 2, (3,): None, None: self.s})


class Tags(frozenset):
    """A set whose attribute changes what a predicate over it selects."""

    def __new__(cls, items, inside):
        out = super().__new__(cls, items)
        out.inside = inside
        return out

    def __reduce__(self):
        return (Tags, (tuple(self), self.inside))


def test_set_subclasses_of_another_state_never_share_a_predicate_key():
    a, b = Tags(["x"], True), Tags(["x"], False)
    fa = lambda r: (r["k"] in a) == a.inside  # noqa: E731
    fb = lambda r: (r["k"] in b) == b.inside  # noqa: E731
    assert fa({"k": "x"}) != fb({"k": "x"})  # they select differently
    assert callable_fingerprint(fa) != callable_fingerprint(fb)


def test_a_dict_keyed_with_mixed_types_keys_and_a_reduce_state():
    a, b = _lookup_filter(State(1)), _lookup_filter(State(2))
    assert callable_fingerprint(a) == callable_fingerprint(_lookup_filter(State(1)))
    assert callable_fingerprint(a) != callable_fingerprint(b)


def test_an_emptied_pin_never_refuses_a_whole_file_answer_of_the_served_version(monkeypatch):
    monkeypatch.setattr(responses, "_PINS", {})
    path = "h://x/whole"
    responses.restore(path, (3, '"v1"', None))  # the source opened since: served
    responses.restore(path, (5, '"v0"', None))  # a source pickled before the re-upload
    # The source of "v1" reads its whole file from a server that ignores Range:
    responses.check_range_answer(path, 0, 3, 200, None, '"v1"', None, length=3)


@pytest.mark.timeout(60)
def test_an_emptied_pin_leaves_the_new_versions_cached_copy(tmp_path, monkeypatch):
    served = _two_tfrecords(tmp_path)
    with RangeHTTPServer(tmp_path) as srv:
        url, cache = f"{srv.url}/tf/a.tfrecord", str(tmp_path / "cache")
        old = tg.TFRecordSource([url], retry=QUICK, index_dir=None, cache_dir=cache)
        assert old[0] == {"v": [b"a0"]}
        before = pickle.dumps(old)
        _replace(served, (tmp_path / "b").read_bytes())
        new = tg.TFRecordSource([url], retry=QUICK, index_dir=None, cache_dir=cache)
        assert new[0] == {"v": [b"b0"]}
        after = pickle.dumps(new)
        copy = new.cached_copies.cache.local_path(url)
        ident = os.stat(copy).st_ino
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        new_copy, old_copy = pickle.loads(after), pickle.loads(before)  # the pin emptied
        srv.reset_counts()
        with pytest.raises(tg.RemoteIOError, match=r"a\.tfrecord"):
            old_copy[0]  # the first read: of the old source
        assert os.path.exists(copy) and os.stat(copy).st_ino == ident  # deleted
        assert srv.gets() == 0  # the new file downloaded, then refused
        assert new_copy[0] == {"v": [b"b0"]}


def _pickles_across_reupload(url, cache, open_source, replace, v1, v2):
    """Pickles of a source opened before ``replace()`` (it reads ``v1``) and of one
    opened after it (``v2``), and that source."""
    first = open_source(url, cache)
    assert first[3] == v1
    before = pickle.dumps(first)
    replace()
    again = open_source(url, cache)
    assert again[3] == v2
    return before, pickle.dumps(again), again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [False, True], ids=["process", "forked-workers"])
@pytest.mark.parametrize("cached", [False, True], ids=["ranges", "cache"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_emptied_pin_refuses_the_old_source_at_its_first_read(
    tmp_path, monkeypatch, kind, cached, workers
):
    under, name, open_source, replace, (v1, v2) = _served(kind, tmp_path)
    cache = str(tmp_path / "cache") if cached else None
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{under}"
        before, after, _ = _pickles_across_reupload(url, cache, open_source, replace, v1, v2)
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        new_copy, old_copy = pickle.loads(after), pickle.loads(before)  # the pin emptied
        with pytest.raises(Exception, match=re.escape(name)):
            got = _workers_read(old_copy, 3) if workers else old_copy[3]
            pytest.fail(f"read the replaced file: {got} (v1: {v1})")
        assert new_copy[3] == v2
        assert _workers_read(new_copy, 3) == [v2, v2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cached", [False, True], ids=["ranges", "cache"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_emptied_pin_old_pickle_first_new_source_reads_first(
    tmp_path, monkeypatch, kind, cached
):
    under, name, open_source, replace, (v1, v2) = _served(kind, tmp_path)
    cache = str(tmp_path / "cache") if cached else None
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{under}"
        before, after, again = _pickles_across_reupload(url, cache, open_source, replace, v1, v2)
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        old_copy, new_copy = pickle.loads(before), pickle.loads(after)  # the pin emptied
        assert new_copy[3] == v2  # the first answer: of the version served
        with pytest.raises(tg.RemoteIOError, match=re.escape(name)):
            got = old_copy[3]
            pytest.fail(f"read the replaced file: {got} (v1: {v1})")
        assert new_copy[2] == again[2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["new-reads-first", "old-reads-first"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_emptied_pin_refuses_the_old_sources_batch_reads(tmp_path, monkeypatch, kind, order):
    under, name, open_source, replace, (v1, v2) = _served(kind, tmp_path)
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{under}"
        before, after, _ = _pickles_across_reupload(url, None, open_source, replace, v1, v2)
        monkeypatch.setattr(responses, "_PINS", {})  # a spawned worker's
        new_copy, old_copy = pickle.loads(after), pickle.loads(before)  # the pin emptied
        if order == "new-reads-first":
            assert new_copy.__getitems__([1, 3, 5])[1] == v2
        with pytest.raises(tg.RemoteIOError, match=re.escape(name)):
            got = old_copy.__getitems__([1, 3, 5, 7])
            pytest.fail(f"read the replaced file: {got} (v1: {v1})")
        assert new_copy.__getitems__([0, 3, 6])[1] == v2
