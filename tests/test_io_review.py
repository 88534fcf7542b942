"""Faults of the batch-wide range reads (io/inflight: a file's results handed over once its
last request is in; the first multi-range request to a server sent alone, the others
waiting for it) found by reproduction against a server whose answers stall. Each is a
strict xfail: it fails because of the fault, and passes once it is fixed."""

from __future__ import annotations

import random
import threading
import time

import fsspec
import pytest

from tests.servers import FaultProxy, RangeHTTPServer
from torchgrain.io import inflight
from torchgrain.io.remote import storage_options_with_deadlines
from torchgrain.io.retry import RequestTimeout, RetryPolicy, using

DATA = {f"f{k}": random.Random(k).randbytes(200_000) for k in range(3)}
RANGES = [(0, 100), (1000, 1100)]  # two ranges of a file: one multi-range request


@pytest.fixture
def root(tmp_path):
    for name, data in DATA.items():
        (tmp_path / f"{name}.bin").write_bytes(data)
    return tmp_path


def _fs():
    opts = storage_options_with_deadlines("http", {})
    opts["skip_instance_cache"] = True
    return fsspec.filesystem("http", **opts)


def _batch(base, names, ranges=RANGES):
    urls = [f"{base}/{n}.bin" for n in names for _ in ranges]
    starts = [s for _ in names for s, _ in ranges]
    ends = [e for _ in names for _, e in ranges]
    return urls, starts, ends


def test_a_multirange_request_unanswered_at_the_batch_deadline_is_a_request_timeout(root):
    # Every request stalls and one is in flight at a time: the batch's deadline (its
    # seconds plus one request timeout) passes while the last files' multi-range requests
    # are still waiting. Their ranges must come back as RequestTimeout (as in the starting
    # code); _streamed calls spread(idx, None) -> list(None) and cat_many raises TypeError.
    with RangeHTTPServer(root) as srv, FaultProxy(srv.url) as proxy:
        proxy.inject("stall_headers", times=None)
        urls, starts, ends = _batch(proxy.url, ["f0", "f1", "f2"])
        with using(RetryPolicy(request_timeout=0.5)):
            got = inflight.cat_many(_fs(), urls, starts, ends, max_inflight=1)
    assert all(isinstance(g, RequestTimeout) for g in got), got


def test_a_stalled_first_request_of_one_thread_does_not_fail_another_threads_batch(root):
    # Thread A's first multi-range request to the server (large ranges: a long limit of
    # its own) stalls after its headers. Thread B then asks for two small ranges of another
    # file, which the server answers at once. B waits for A's request to be answered
    # (_first_asked awaits its event with no limit), past B's own deadline: B gets
    # RequestTimeout (here: TypeError, the fault above) for a file that was never even
    # asked for, where the starting code served B's bytes in about 10 ms.
    slow = RetryPolicy(request_timeout=1.0, min_rate=100_000)  # A's request: ~2.5 s
    with RangeHTTPServer(root) as srv, FaultProxy(srv.url) as proxy:
        proxy.inject("stall", times=1, match="f0", after=10)
        fs = _fs()
        big = [(0, 50_000), (100_000, 150_000)]

        def first() -> None:
            with using(slow):
                inflight.cat_many(fs, *_batch(proxy.url, ["f0"], big))

        a = threading.Thread(target=first, daemon=True)
        a.start()
        deadline = time.monotonic() + 10
        while not proxy.log and time.monotonic() < deadline:
            time.sleep(0.01)  # A's request is at the server
        try:
            with using(RetryPolicy(request_timeout=0.5)):
                got = inflight.cat_many(fs, *_batch(proxy.url, ["f1"]))
        finally:
            a.join(10)
    assert got == [DATA["f1"][s:e] for s, e in RANGES]


def test_a_stalled_first_request_does_not_hold_back_the_batchs_other_files(root):
    # The first multi-range request to a server not asked yet stalls (headers never
    # come). The starting code handed the other files to arrived= (decode as they arrive)
    # within milliseconds and f0's timeout last; now the others are not even sent until
    # f0's request times out, so f0's timeout comes first and the whole batch is a
    # request timeout late.
    order = []
    with RangeHTTPServer(root) as srv, FaultProxy(srv.url) as proxy:
        proxy.inject("stall_headers", times=1, match="f0")
        urls, starts, ends = _batch(proxy.url, ["f0", "f1", "f2"])

        def arrived(idx, blobs):
            order.append(urls[idx[0]].rsplit("/", 1)[1])

        with using(RetryPolicy(request_timeout=1.0)):
            got = inflight.cat_many(_fs(), urls, starts, ends, arrived=arrived)
    assert [
        g == DATA[u.rsplit("/", 1)[1][:-4]][s:e] for g, u, s, e in zip(got, urls, starts, ends)
    ][2:] == [True] * 4
    assert order[-1] == "f0.bin", order
