"""The peers benchmark's own checks: the epoch check catches what it must, the shuffle
measure means what it says, and the throttling proxy passes bytes through intact."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import urllib.request
import zlib

import numpy as np
import pytest

from benchmarks import peers
from benchmarks.peers_remote import Throttle
from tests.servers import RangeHTTPServer

N, PAYLOAD = 5000, 64


def _epoch(order: np.ndarray, mangle=None):
    blob = peers._blob(PAYLOAD)
    ids, labels, crcs, lens = [], [], [], []
    for i in order:
        p = peers.payload_of(int(i), blob, PAYLOAD)
        if mangle is not None:
            p = mangle(int(i), p)
        ids.append(i)
        labels.append(peers.label_of(int(i)))
        crcs.append(zlib.crc32(p))
        lens.append(len(p))
    return (np.array(ids), np.array(labels), np.array(crcs, np.uint32), np.array(lens))


def test_records_vary_and_some_end_in_zeros():
    recs = list(peers.records(50, PAYLOAD))
    assert len({len(r["payload"]) for r in recs}) > 5
    assert sum(r["payload"].endswith(b"\0\0\0\0") for r in recs) >= 10
    assert len({r["payload"] for r in recs}) == 50


def test_check_epoch_accepts_a_clean_shuffled_epoch():
    order = np.random.default_rng(0).permutation(N)
    assert peers.check_epoch(*_epoch(order), N, PAYLOAD) == "ok"


def test_check_epoch_reports_missing_duplicated_and_corrupt_records():
    order = np.random.default_rng(0).permutation(N)
    order[:3] = order[3:6]  # 3 duplicated, 3 missing
    msg = peers.check_epoch(*_epoch(order), N, PAYLOAD)
    assert "3 missing" in msg and "3 duplicated" in msg
    # fixed-width bytes columns drop trailing zeros: caught as a wrong length
    strip = peers.check_epoch(*_epoch(np.arange(N), lambda i, p: p.rstrip(b"\0")), N, PAYLOAD)
    blob = peers._blob(PAYLOAD)
    ending0 = sum(peers.payload_of(i, blob, PAYLOAD).endswith(b"\0") for i in range(N))
    assert ending0 >= N // 5
    assert strip == f"{ending0} payloads of the wrong length"
    flip = peers.check_epoch(
        *_epoch(np.arange(N), lambda i, p: bytes([p[0] ^ 1]) + p[1:] if i == 7 else p), N, PAYLOAD
    )
    assert flip == "1 payloads with wrong bytes"


def test_shuffle_quality_tells_uniform_from_sequential():
    n = 200_000
    uniform, corr = peers.shuffle_quality(np.random.default_rng(0).permutation(n))
    assert 88 < uniform < 96 and abs(corr) < 0.01
    seq, corr_seq = peers.shuffle_quality(np.arange(n))
    assert seq <= 2 and corr_seq > 0.99


def test_throttle_passes_range_requests_through_intact(tmp_path):
    data = os.urandom(300_000)
    (tmp_path / "obj.bin").write_bytes(data)
    with RangeHTTPServer(tmp_path) as srv:
        host, port = srv.url.rsplit("//", 1)[1].split(":")
        throttle = Throttle((host, int(port)), 0.001, 0.002, 50e6, 100e6)
        ready: list[int] = []

        class Q:
            def put(self, v: int) -> None:
                ready.append(v)

        loop = asyncio.new_event_loop()
        task = loop.create_task(throttle.serve(Q()))

        def run() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        for _ in range(200):
            if ready:
                break
            threading.Event().wait(0.05)
        assert ready, "the proxy did not start"
        url = f"http://127.0.0.1:{ready[0]}/obj.bin"
        assert urllib.request.urlopen(url).read() == data
        req = urllib.request.Request(url, headers={"Range": "bytes=1000-1999"})
        assert urllib.request.urlopen(req).read() == data[1000:2000]
        assert throttle.requests == 2
        loop.call_soon_threadsafe(task.cancel)
        t.join(timeout=10)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
