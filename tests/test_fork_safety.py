"""torchgrain's threads never run across a fork, and workers start with any start method.

A forked child inherits every lock in the state it was in, but none of the threads that
would release them; Python 3.12 warns ("This process is multi-threaded, use of fork()
may lead to deadlocks in the child") when a process with threads forks. torchgrain's
I/O pools and read-ahead stop before a fork and start again after it
(torchgrain/io/process.py). Python 3.14 starts DataLoader workers with forkserver by
default: the pipeline works under fork, spawn and forkserver alike.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader

import torchgrain as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORK_SCRIPT = r"""
import json, multiprocessing, os, tempfile, threading, time, warnings

seen_at_fork = []


def at_fork():
    # Registered before torchgrain is imported, so it runs after torchgrain's own
    # before-fork hooks: the threads that will still be alive when the process forks.
    names = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    seen_at_fork.append(sorted(n for n in names if n.startswith("torchgrain")))


os.register_at_fork(before=at_fork)

import subprocess, sys

import fsspec
import numpy as np

import torchgrain as tg

# Written by another process: array_record's C++ writer keeps a thread pool alive in the
# process that used it, which is not torchgrain's to stop.
d = tempfile.mkdtemp()
subprocess.run([sys.executable, "-c", "import sys, torchgrain as tg; "
                "tg.write_array_record([{'x': i} for i in range(64)], sys.argv[1], num_shards=8)",
                d], check=True)
store = fsspec.filesystem("memory")
for name in os.listdir(d):
    with open(os.path.join(d, name), "rb") as f:
        store.pipe(f"/forks/{name}", f.read())
# Remote shards read by a pool of I/O threads, and a read-ahead walk that waits (its
# budget is full and the reader never moves on).
pooled = tg.ArrayRecordSource("memory://forks", io_threads=4)
cached = tg.ArrayRecordSource("memory://forks", cache_dir=tempfile.mkdtemp(), read_ahead_bytes=1)
batch = [0, 9, 17, 30, 63]
assert [r["x"] for r in pooled.__getitems__(batch)] == batch
cached.read_ahead(lambda a, b: np.arange(a, b), 0, 64, lambda: 0)


def live():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("torchgrain"))


deadline = time.monotonic() + 60
while not any("read-ahead" in n for n in live()) and time.monotonic() < deadline:
    time.sleep(0.01)
before = live()


def child():
    ok = [r["x"] for r in pooled.__getitems__(batch)] == batch
    ok = ok and [r["x"] for r in cached.__getitems__(batch)] == batch
    os._exit(0 if ok else 3)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(120)
# Nothing was started inside the fork (Python >= 3.12 counts threads after its hooks):
# the walk goes on when torchgrain next runs here, as when a sampler draws indices.
from torchgrain.io import process as tg_process
tg_process.restart_stopped_threads()
deadline = time.monotonic() + 60
while not any("read-ahead" in n for n in live()) and time.monotonic() < deadline:
    time.sleep(0.01)
after = live()
again = [r["x"] for r in pooled.__getitems__(batch)] == batch
print(json.dumps({
    "before": before, "at_fork": seen_at_fork, "after": after, "child": p.exitcode,
    "again": again, "warnings": [str(w.message) for w in caught if "fork" in str(w.message)],
}))
"""


def test_no_torchgrain_thread_runs_across_a_fork():
    # No other library's thread either (numpy's BLAS pool, pyarrow's jemalloc background
    # thread): then Python >= 3.12 has nothing to warn about.
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        JE_ARROW_MALLOC_CONF="background_thread:false",
    )
    proc = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("torchgrain-io" in n for n in got["before"]), got
    assert any("read-ahead" in n for n in got["before"]), got
    assert got["at_fork"] == [[]], got  # stopped, all of them, when the process forked
    assert got["child"] == 0, got  # the child reads through both sources
    assert any("read-ahead" in n for n in got["after"]), got  # the walk goes on after
    assert got["again"], got
    assert got["warnings"] == [], got  # Python >= 3.12 warns about threads at a fork


# --------------------------------------------------------------------- start methods


def _noise(record, rng):
    return {"x": record["x"], "noise": float(rng.random())}


def _records(root):
    return tg.Dataset(tg.ArrayRecordSource(root)).random_map(_noise, seed=3)


@pytest.mark.parametrize("method", ["fork", "forkserver"])  # spawn: test_dataset, test_columns
def test_workers_start_with_every_start_method(tmp_path, method):
    root = str(tmp_path / "data")
    tg.write_array_record([{"x": i} for i in range(60)], root, num_shards=3)
    ds = _records(root)
    sampler = tg.BlockShuffleSampler(ds, window=2, seed=1, deal_to_workers=True)
    loader = tg.ResumableLoader(
        DataLoader(
            ds,
            batch_size=6,
            sampler=sampler,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context=method,
        )
    )
    # What the loop should get, computed in this process on separate objects.
    reference = _records(root)
    expected = tg.BlockShuffleSampler(
        reference, window=2, seed=1, batch_size=6, num_workers=2, num_replicas=1, rank=0
    )
    for epoch in range(2):
        batches = list(loader)
        expected.set_epoch(epoch)
        ids = [int(i) for b in batches for i in b["x"]]
        assert ids == list(expected)  # dealt to the workers by the bound loader's shape
        noise = [float(n) for b in batches for n in b["noise"]]
        assert noise == [reference[i]["noise"] for i in ids]  # the epoch reached the workers
    report = tg.stats(loader)
    assert report.total["records"] == 120
    assert set(report.workers) == {"worker 0", "worker 1"}


def test_threads_stopped_for_a_fork_start_again_when_a_sampler_draws_indices():
    """Not inside the fork (Python >= 3.12 counts threads after its hooks and would
    warn): when the parent's sampler next draws indices."""
    import torchgrain as tg
    from torchgrain.io import process

    calls = []

    class Owner:
        def _stop_threads_for_fork(self):
            calls.append("stop")

        def _restart_threads_after_fork(self):
            calls.append("restart")

    owner = Owner()
    process.stop_threads_at_fork(owner)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert calls == ["stop"]  # stopped for the fork, not restarted inside it
    sampler = tg.GlobalShuffleSampler(10, seed=0, num_replicas=1, rank=0)
    assert sorted(sampler) == list(range(10))
    assert calls == ["stop", "restart"]
    del owner


# ----------------------------------------------------------- inherited connections
def _collected(batch):
    """The batch's ``x``, after a garbage collection in the worker (as happens sooner or
    later in every worker: here it frees what the worker inherited and no longer uses)."""
    gc.collect()
    return [r["x"] for r in batch]


@pytest.mark.timeout(120)
def test_a_forked_worker_leaves_the_parents_http_connections_working(tmp_path):
    """A forked child inherits the parent's event loop with its epoll instance, and
    epoll registrations belong to that shared instance: a worker closing the inherited
    pooled connections (fsspec closes a dropped filesystem's sessions) removed them from
    the parent's epoll, and the parent's next request on one never heard its answer: a
    read timeout (20 s by default) per connection, or a hang without one. With one
    attempt allowed, the parent's reads after the workers ran must simply succeed."""
    from tests.servers import RangeHTTPServer
    from torchgrain.io.retry import RetryPolicy

    root = tmp_path / "www"
    tg.write_array_record([{"x": i} for i in range(64)], root / "ds", num_shards=4)
    once = RetryPolicy(attempts=1, read_timeout=15, request_timeout=30, deadline=60)
    with RangeHTTPServer(root) as srv:
        url = f"{srv.url}/ds"
        # Shards downloaded whole (the parent first, as users do), then read by workers.
        src = tg.ArrayRecordSource(url, retry=once, cache_dir=tmp_path / "cache")
        assert src[0]["x"] == 0
        loader = DataLoader(
            tg.Dataset(src),
            batch_size=8,
            num_workers=2,
            multiprocessing_context="fork",
            collate_fn=_collected,
        )
        assert sorted(x for b in loader for x in b) == list(range(64))
        # The parent's connections are its own still: a new source reads through them.
        again = tg.ArrayRecordSource(url, retry=once, cache_bytes=0, io_threads=4)
        for _ in range(3):  # every pooled connection used again, one attempt each
            assert [r["x"] for r in again.__getitems__([1, 17, 33, 49])] == [1, 17, 33, 49]
        again.close()
        src.close()


@pytest.mark.timeout(60)
def test_a_forked_child_cannot_write_into_the_parents_connections():
    """Closing an inherited HTTPS connection sends a TLS close_notify through the socket
    the child shares with the parent (at once, when nothing is queued): the server would
    end the parent's connection. Shown here with a plain write through an inherited
    transport on fsspec's loop: nothing the child sends may reach the peer, and the
    parent's connection carries on."""
    import asyncio
    import socket
    import threading

    import fsspec.asyn

    import torchgrain.io.remote  # noqa: F401  (installs the fork hook, as sources do)

    server = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def serve():
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(65536):
                received.extend(chunk)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    loop = fsspec.asyn.get_loop()

    async def connect():
        return await asyncio.open_connection(*server.getsockname())

    async def send(writer, data, close=False):
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()
            await writer.wait_closed()

    _, writer = fsspec.asyn.sync(loop, connect)
    fsspec.asyn.sync(loop, send, writer, b"parent 1;")
    pid = os.fork()
    if pid == 0:  # the child: write, then close, through the inherited transport
        try:
            writer.transport.write(b"child;")
            writer.transport.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    fsspec.asyn.sync(loop, send, writer, b"parent 2;", True)
    thread.join(timeout=30)
    server.close()
    assert bytes(received) == b"parent 1;parent 2;"


@pytest.mark.timeout(60)
def test_the_inherited_loop_is_inert_in_the_child(tmp_path):
    """What the hook leaves in a forked child: the replaced sockets are close-on-exec as
    the originals were; a transport with a write pending at the fork (registered for
    writing too) closes without error; and the loop no longer says it runs, so fsspec
    closes a freed filesystem's connections at once (it waited a second for the parent's
    loop thread, which is not in the child, once per filesystem)."""
    import asyncio
    import socket

    import fsspec.asyn

    import torchgrain.io.remote  # noqa: F401  (installs the fork hook, as sources do)

    server = socket.create_server(("127.0.0.1", 0))  # accepts, never reads
    server.listen()
    loop = fsspec.asyn.get_loop()

    async def stuffed():
        _, writer = await asyncio.open_connection(*server.getsockname())
        writer.write(b"x" * (64 << 20))  # far more than the socket buffers: left pending
        return writer

    writer = fsspec.asyn.sync(loop, stuffed)
    peer, _ = server.accept()
    fd = writer.transport.get_extra_info("socket").fileno()
    assert not os.get_inheritable(fd) and writer.transport.get_write_buffer_size() > 0
    report = tmp_path / "child.json"
    pid = os.fork()
    if pid == 0:
        out = {}
        try:
            out["inheritable"] = os.get_inheritable(fd)
            out["running"] = loop.is_running()
            writer.transport.close()  # unregisters its reader and writer
            from fsspec.implementations.http import HTTPFileSystem

            session = _FakeSession()
            HTTPFileSystem.close_session(loop, session)
            out["close_session"] = session.calls
        except BaseException as e:  # reported to the parent, which fails the test
            out["error"] = repr(e)
        finally:
            report.write_text(json.dumps(out))
            os._exit(0)
    os.waitpid(pid, 0)
    got = json.loads(report.read_text())
    fsspec.asyn.sync(loop, _close, writer)
    peer.close()
    server.close()
    assert got.get("error") is None, got
    assert got["inheritable"] is False and got["running"] is False, got
    # Closed at once: the connector directly, not through the (absent) loop thread,
    # which fsspec waited a second for.
    assert got["close_session"] == ["connector"], got


class _FakeSession:
    """What fsspec's close_session uses of an aiohttp session: ``close()`` on a running
    loop, else its connector's ``_close()``; records which it was given."""

    def __init__(self):
        self.calls = []
        session = self

        class Connector:
            def _close(self):
                session.calls.append("connector")

        self._connector = Connector()

    def close(self):
        self.calls.append("session.close")

        async def closing():
            pass

        return closing()


async def _close(writer):
    writer.transport.abort()
