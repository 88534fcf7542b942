"""Known faults of the streaming index build, the fork checks and multi-range reads.

Each test reproduces one fault and is expected to fail until it is fixed (strict xfail:
a fix turns it into an unexpected pass, and the marker is then removed).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import torchgrain
import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.errors import CorruptDataError
from torchgrain.io.fs import get_filesystem
from torchgrain.io.ranges import RangeStore, fetch_batch, version_of
from torchgrain.sources.node_index import build_arrayrecord_index

TG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchgrain.__file__)))


def _run(tmp_path, code: str) -> str:
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=TG_ROOT, PYTHONWARNINGS="ignore"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")
def test_a_forked_child_freeing_its_copy_of_a_pin_keeps_the_parents_watch(tmp_path):
    """The parent must still see a write to a file it mapped after a forked child let
    go of its copy of the parent's pin. A garbage collection in an earlier after-fork
    hook (threading's, logging's, random's) frees such copies before torchgrain's hook
    counts the fork; a hook registered before torchgrain is imported does the same,
    deterministically."""
    out = _run(
        tmp_path,
        """
        import os
        held = []
        # Runs in the child before torchgrain's hooks (registered later).
        os.register_at_fork(after_in_child=held.clear)
        from torchgrain.io import changes

        with open("f", "wb") as f:
            f.write(b"abcdef")
        fd = os.open("f", os.O_RDONLY)
        held.append(changes.Pin(fd, os.path.abspath("f")))
        os.close(fd)
        changes.check(held[0], "f")
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        with open("f", "r+b") as f:  # rewritten in place, same size and inode
            f.write(b"XYZ")
        try:
            changes.check(held[0], "f")
            print("unseen")
        except changes.ChangedWhileOpen:
            print("seen")
        """,
    )
    assert out == "seen"


def test_no_index_build_thread_runs_across_a_fork(tmp_path):
    """io/process promises that no torchgrain thread runs across a fork (a child gets
    every lock those threads held, and none of the threads to release them). A build
    in one thread while another forks (a DataLoader starting its workers)."""
    out = _run(
        tmp_path,
        """
        import os, threading
        seen = []
        # "before" hooks run in reverse order of registration: this one after
        # torchgrain's, which stop torchgrain's threads.
        os.register_at_fork(before=lambda: seen.append(sorted(
            t.name for t in threading.enumerate() if t.name.startswith("torchgrain"))))
        from torchgrain.sources.node_index import store

        started, release = threading.Event(), threading.Event()

        def work(x):
            started.set()
            # The fork waits for the shards being read: a second each, not longer.
            release.wait(1)
            return x

        got = []

        def build():
            for x in store.in_order(16, lambda i: (i, 1), work, max_workers=4):
                got.append(x)

        t = threading.Thread(target=build)
        t.start()
        started.wait(30)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        release.set()
        os.waitpid(pid, 0)
        t.join(60)
        assert got == list(range(16)), got  # the parent's build went on after the fork
        print(seen[0])
        """,
    )
    assert out == "[]"


def test_a_failed_build_closes_the_shards_it_opened_ahead(tmp_path):
    """A shard that cannot be read fails the build; the shards after it that were
    already opened to peek at their footers are closed by the build, not left to the
    garbage collector (ResourceWarning: unclosed file)."""
    paths = []
    for k in range(24):
        d = tmp_path / str(k)
        tg.write_array_record([{"x": i} for i in range(3)], d)
        paths.append(str(next(d.glob("*.array_record"))))
    with open(paths[2], "r+b") as f:
        f.truncate(1000)
    gc.collect()  # what earlier tests left to the collector warns before, not in, the check
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CorruptDataError, match=paths[2]):
            build_arrayrecord_index(paths)
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def test_a_range_kept_from_a_multirange_answer_holds_only_its_own_bytes(tmp_path):
    """16 ranges of 1,000 bytes in one multi-range request; the reader takes 15. The
    one left in the range store (counted there as 1,000 bytes) must not keep the
    whole response body (~17.8 KB, up to 64 ranges a request) alive."""
    d = tmp_path / "www" / "ds"
    rng = np.random.default_rng(0)
    tg.write_array_record([{"b": rng.bytes(40 << 10)} for _ in range(40)], d, num_shards=1)
    name = next(d.glob("*.array_record")).name
    with RangeHTTPServer(tmp_path / "www", latency_s=0.0) as srv:
        srv.multirange = "parts"  # one part per range, as nginx answers
        url = f"{srv.url}/ds/{name}"
        fs, path = get_filesystem(url)
        ranges = [(k * 100_000, k * 100_000 + 1000) for k in range(16)]
        store = RangeStore()
        fetch_batch(fs, [(path, url, ranges)], store=store, owner=None)
        assert srv.gets() == 1
    data = (d / name).read_bytes()
    version = version_of(fs, path)  # (of the version fetched)
    assert [bytes(v) for v in store.take(url, ranges[:15], version)] == [
        data[s:e] for s, e in ranges[:15]
    ]
    (kept,) = store.take(url, ranges[15:], version)
    assert bytes(kept) == data[ranges[15][0] : ranges[15][1]]
    held = kept.obj.nbytes if isinstance(kept.obj, memoryview) else len(kept.obj)
    assert held <= 2 * len(kept), f"a kept range of {len(kept)} bytes holds {held} bytes"


def test_remote_shards_index_under_a_budget_below_the_unknown_footer_cost(tmp_path, monkeypatch):
    """build_arrayrecord_index(filesystem=...) of shards on another filesystem, with
    store.BUILD_BYTES at 8 MiB: the shards exist there, and are indexed (with the
    default budget they are); the build must not look for them on the local disk."""
    import fsspec

    from torchgrain.sources.node_index import store

    fs = fsspec.filesystem("memory")
    names = []
    for k in range(3):
        d = tmp_path / str(k)
        tg.write_array_record([{"x": i} for i in range(5)], d)
        names.append(f"/review-build/{k}.array_record")
        fs.pipe(names[-1], next(d.glob("*.array_record")).read_bytes())
    try:
        assert build_arrayrecord_index(names, filesystem=fs).counts.tolist() == [5, 5, 5]
        monkeypatch.setattr(store, "BUILD_BYTES", 8 << 20)
        assert build_arrayrecord_index(names, filesystem=fs).counts.tolist() == [5, 5, 5]
    finally:
        fs.rm("/review-build", recursive=True)
