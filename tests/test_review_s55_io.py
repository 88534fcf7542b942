"""Remote reads against real servers on 127.0.0.1: a batch's second round for ranges
another fetch was bringing (that fetch failing, or bringing them), a rewritten file
refused with a 412 in single- and multi-range reads, an HTTP listing's files once each,
in the order found."""

from __future__ import annotations

import os
import threading
import time

import fsspec
import numpy as np
import pytest

import torchgrain as tg
from tests.servers import FaultProxy, RangeHTTPServer
from torchgrain.io import fs as tfs
from torchgrain.io import inflight
from torchgrain.io.ranges import RangeStore, fetch_batch, version_of
from torchgrain.io.remote import storage_options_with_deadlines
from torchgrain.io.responses import RangeAnswerError
from torchgrain.io.retry import RetryPolicy, using

BLOB = np.random.default_rng(55).bytes(100_000)
SPEC = [("a", [(0, 100), (200, 300)]), ("b", [(0, 50)]), ("c", [(10, 20), (500, 600)])]


def _http() -> fsspec.AbstractFileSystem:
    opts = storage_options_with_deadlines("http", {})
    opts["skip_instance_cache"] = True
    return fsspec.filesystem("http", **opts)


@pytest.fixture
def root(tmp_path):
    for name in "abc":
        (tmp_path / f"{name}.bin").write_bytes(BLOB)
    return tmp_path


def _files(base: str) -> list[tuple[str, str, list[tuple[int, int]]]]:
    return [(f"{base}/{n}.bin", f"{base}/{n}.bin", r) for n, r in SPEC]


def _held(store: RangeStore, url: str, ranges, *, put: bool, after: float) -> threading.Thread:
    """Another fetch (a read-ahead) bringing ``ranges`` of ``url``: it ends ``after``
    seconds, having put them in the store (``put``) or failed."""
    mine, _ = store.claim(url, ranges)

    def end() -> None:
        time.sleep(after)
        if put:
            views = [memoryview(BLOB[s:e]) for s, e in ranges]
            store.put(url, ranges, views, None, version_of(_http(), url))  # (what it fetched)
        store.release(url, mine)

    t = threading.Thread(target=end)
    t.start()
    return t


def _check(store: RangeStore, files) -> None:
    for _, url, ranges in files:
        got = store.take(url, ranges, version_of(_http(), url))  # (of the version fetched)
        assert [bytes(v) for v in got] == [BLOB[s:e] for s, e in ranges]


@pytest.mark.parametrize("multirange", ["parts", "ignore"])
def test_ranges_a_failed_fetch_was_bringing_are_fetched_in_the_second_round(root, multirange):
    with RangeHTTPServer(root, multirange=multirange) as srv:
        fs, store, told, files = _http(), RangeStore(), [], _files(srv.url)
        other = _held(store, files[0][1], [(0, 100)], put=False, after=0.3)
        try:
            with using(RetryPolicy(attempts=1, deadline=10)):
                made = fetch_batch(fs, files, store=store, owner=None, gap=0, ready=told.append)
        finally:
            other.join()
        assert sorted(told) == [0, 1, 2]  # each file told once, the waited one too
        # (0, 100) asked for once, after the other fetch failed
        assert [r for (_, p), r in zip(srv.log, srv.range_log) if p == "/a.bin"] == [
            "bytes=200-299",
            "bytes=0-99",
        ]
        assert made == 5  # ranges asked for: 4 in the first round, (0, 100) in the second
        _check(store, files)


def test_ranges_another_fetch_brought_are_not_asked_for_again(root):
    with RangeHTTPServer(root, multirange="ignore") as srv:
        fs, store, told, files = _http(), RangeStore(), [], _files(srv.url)
        other = _held(store, files[0][1], [(0, 100)], put=True, after=0.3)
        try:
            with using(RetryPolicy(attempts=1, deadline=10)):
                made = fetch_batch(fs, files, store=store, owner=None, gap=0, ready=told.append)
        finally:
            other.join()
        assert sorted(told) == [0, 1, 2]
        assert made == 4  # a's (200, 300), b's, c's two; not a's (0, 100)
        assert srv.gets("/a.bin") == 1
        _check(store, files)


def test_a_second_round_failure_is_raised_naming_the_file(root):
    with RangeHTTPServer(root) as srv, FaultProxy(srv.url) as px:
        fs, store, told, files = _http(), RangeStore(), [], _files(px.url)
        # a.bin's (0, 100) is brought by another fetch, which fails; by then a.bin is gone
        px.inject("status", times=None, code=404, match="/a.bin", skip=1)
        other = _held(store, files[0][1], [(0, 100)], put=False, after=0.3)
        try:
            with (
                using(RetryPolicy(attempts=1, deadline=10)),
                pytest.raises(tg.DatasetNotFoundError, match=r"a\.bin does not exist"),
            ):
                fetch_batch(fs, files, store=store, owner=None, gap=0, ready=told.append)
        finally:
            other.join()
        assert sorted(told) == [1, 2]  # the others were read and told; a.bin never


@pytest.mark.parametrize("multi_range", [False, True])
def test_a_rewritten_file_is_refused_by_its_412(tmp_path, multi_range):
    path = tmp_path / "f.bin"
    path.write_bytes(BLOB)
    with RangeHTTPServer(tmp_path) as srv:
        fs, url = _http(), f"{srv.url}/f.bin"
        starts, ends = [0, 1000, 5000], [100, 1100, 5100]
        with using(RetryPolicy(attempts=1, deadline=10)):
            first = inflight.cat_many(fs, [url] * 3, starts, ends, multi_range=multi_range)
            assert [bytes(b) for b in first] == [BLOB[s:e] for s, e in zip(starts, ends)]
            os.utime(path, (1, 1))  # another ETag: the file rewritten
            again = inflight.cat_many(fs, [url] * 3, starts, ends, multi_range=multi_range)
        assert all(isinstance(b, RangeAnswerError) for b in again), again
        assert all("412" in str(b) and "changed on the server" in str(b) for b in again)


def test_an_http_listing_names_each_file_once_in_the_order_found(tmp_path):
    for p in ["ds/z.x", "ds/a.x", "ds/sub/m.x", "ds/sub/b.x"]:
        os.makedirs(os.path.dirname(tmp_path / p), exist_ok=True)
        (tmp_path / p).write_bytes(b"1")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            '<a href="z.x">z</a><a href="sub/">s</a><a href="a.x">a</a><a href="z.x">z</a>'
            '<a href="sub/m.x">m</a><a href="./a.x">a</a>'
        )
        srv.listings["/ds/sub"] = (
            '<a href="/ds/sub/m.x">m</a><a href="b.x">b</a><a href="/ds/z.x">z</a>'
        )
        got = tfs.list_files(_http(), f"{srv.url}/ds", [".x"])
    u = srv.url
    assert got == [f"{u}/ds/a.x", f"{u}/ds/sub/m.x", f"{u}/ds/z.x", f"{u}/ds/sub/b.x"]
