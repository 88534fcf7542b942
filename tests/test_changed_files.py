"""Files changed under a reader's memory maps: an error naming the file, never SIGBUS.

Reading a page of a map past the end of a file truncated since it was mapped raises
SIGBUS, which kills the process (Python cannot recover from it). Each case runs the
reader in a child process and truncates or rewrites the file under its open maps: the
child must exit normally with ``ChangedWhileOpen`` (a ``CorruptDataError``), or, for the
decoded Parquet cache, rebuild the entry and read the right records.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import torchgrain
from tests.servers import RangeHTTPServer
from tests.test_shard_cache_safety import (
    NO_BLOCK_CACHE,
    PAYLOAD,
    _bytes,
    _copy_holding,
    _expected,
    _flip_payload,
    _read,
    _source,
    _write,
)

ROOT = os.path.dirname(os.path.dirname(torchgrain.__file__))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux maps")

PRELUDE = """
import os, sys, numpy as np, torchgrain as tg
d = sys.argv[1]

def expect_changed(fn):
    try:
        fn()
    except tg.CorruptDataError as e:
        assert "changed while open" in str(e), str(e)
        print("RAISED", e)
        return
    print("NOT RAISED")

def ar_dataset(n=400, shards=2):
    tg.write_array_record(
        ({"x": np.full(32, i, np.float32), "y": i} for i in range(n)),
        os.path.join(d, "ar"), num_shards=shards, group_size=1,
    )
    return os.path.join(d, "ar"), sorted(
        os.path.join(d, "ar", p) for p in os.listdir(os.path.join(d, "ar"))
        if p.endswith(".array_record")
    )
"""


def run_child(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def assert_raised(p: subprocess.CompletedProcess, times: int = 1) -> None:
    assert p.returncode == 0, (
        f"the reader died (rc {p.returncode}; -7 is SIGBUS): {p.stderr[-3000:]}"
    )
    assert p.stdout.count("RAISED ") == times and "NOT RAISED" not in p.stdout, p.stdout
    assert "changed while open" in p.stdout


def test_arrayrecord_shard_truncated_under_the_region(tmp_path):
    # The batch path (all shards in one mapped region) and the one-record path.
    p = run_child(
        tmp_path,
        """
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, index_dir=os.path.join(d, "ix"))
        before = src.__getitems__(list(range(0, 400, 3)))
        os.truncate(paths[0], 4096)  # cp of a shorter file over it, in effect
        expect_changed(lambda: src.__getitems__(list(range(0, 400, 3))))
        expect_changed(lambda: src[0])
        """,
    )
    assert_raised(p, 2)
    assert paths_named(p.stdout)


def paths_named(out: str) -> bool:
    return ".array_record'" in out or ".tfrecord'" in out or ".tgindex'" in out


def test_arrayrecord_shard_truncated_shard_by_shard(tmp_path):
    # max_mapped_shards=0: each shard read through its own ArrayRecordFile map.
    p = run_child(
        tmp_path,
        """
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, max_mapped_shards=0, index_dir=None)
        src.__getitems__(list(range(0, 400, 3)))
        src[1]
        with open(paths[0], "r+b") as f:  # rsync --inplace of a shorter file
            f.truncate(4096)
        expect_changed(lambda: src.__getitems__(list(range(0, 400, 3))))
        expect_changed(lambda: src[1])
        """,
    )
    assert_raised(p, 2)


def test_arrayrecord_same_size_rewrite_with_its_time_restored_is_seen(tmp_path):
    # rsync -a --inplace of other contents of the same size keeps the size and the
    # modification time: only the inotify watch sees it (a stat cannot).
    p = run_child(
        tmp_path,
        """
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, index_dir=os.path.join(d, "ix"))
        src.__getitems__(list(range(0, 400, 3)))
        st = os.stat(paths[0])
        with open(paths[0], "r+b") as f:
            f.seek(100)
            f.write(b"\\xff" * 4000)
        os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns))
        expect_changed(lambda: src.__getitems__(list(range(0, 400, 3))))
        """,
    )
    assert_raised(p)


def test_tfrecord_shard_truncated(tmp_path):
    p = run_child(
        tmp_path,
        """
        from torchgrain.formats.tfrecord import write_tfrecord
        for s in range(2):
            write_tfrecord([bytes([s]) * 300] * 400, os.path.join(d, f"t-{s}.tfrecord"))
        src = tg.TFRecordSource(os.path.join(d, "t-*.tfrecord"), index_dir=None, codec="raw")
        src.__getitems__([0, 1, 500, 799])
        os.truncate(os.path.join(d, "t-0.tfrecord"), 1000)
        expect_changed(lambda: src.__getitems__([0, 399, 500]))
        """,
    )
    assert_raised(p)
    assert paths_named(p.stdout)


@pytest.mark.parametrize("kind", ["arrayrecord", "tfrecord"])
def test_index_file_truncated(tmp_path, kind):
    p = run_child(
        tmp_path,
        f"""
        kind = {kind!r}
        ix = os.path.join(d, "ix")
        if kind == "arrayrecord":
            root, _ = ar_dataset()
            src = tg.ArrayRecordSource(root, index_dir=ix)
            index_path = src._dindex.path
        else:
            from torchgrain.formats.tfrecord import write_tfrecord
            write_tfrecord([b"r" * 100] * 400, os.path.join(d, "t.tfrecord"))
            src = tg.TFRecordSource(os.path.join(d, "t.tfrecord"), index_dir=ix, codec="raw")
            index_path = src.format.shards.index.path
        assert index_path is not None
        src.__getitems__([0, 1, 2, 399])
        os.truncate(index_path, 64)
        expect_changed(lambda: src.__getitems__([0, 200, 399]))
        expect_changed(lambda: src[5])
        """,
    )
    assert_raised(p, 2)
    assert ".tgindex'" in p.stdout


def test_forked_worker_sees_a_shard_truncated_after_the_fork(tmp_path):
    # The child inherits the parent's maps and watches them again itself.
    p = run_child(
        tmp_path,
        """
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, index_dir=os.path.join(d, "ix"))
        src.__getitems__(list(range(0, 400, 3)))
        pid = os.fork()
        if pid == 0:
            try:
                src.__getitems__(list(range(0, 400, 3)))  # the inherited maps still read
                os.truncate(paths[1], 4096)
                expect_changed(lambda: src.__getitems__(list(range(0, 400, 3))))
                sys.stdout.flush()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        expect_changed(lambda: src.__getitems__(list(range(0, 400, 3))))  # the parent too
        """,
    )
    assert_raised(p, 2)


def test_decoded_cache_entry_truncated_between_epochs_is_rebuilt(tmp_path):
    p = run_child(
        tmp_path,
        """
        import glob
        tg.write_parquet(
            ({"x": np.full(16, i, np.float32), "y": i} for i in range(3000)),
            os.path.join(d, "pq"), num_shards=3,
        )
        src = tg.ParquetSource(os.path.join(d, "pq"), decoded_cache=os.path.join(d, "dc"))
        idx = list(range(0, 3000, 7))
        first = src.__getitems__(idx)  # epoch 1: every row group mapped from the cache
        entries = glob.glob(os.path.join(d, "dc", "??", "*.arrow"))
        assert entries
        for e in entries:
            os.truncate(e, 100)
        again = src.__getitems__(idx)  # epoch 2, the same source
        assert [r["y"] for r in again] == idx
        assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(first, again))
        cols = src.read_columns(idx)
        assert list(cols["y"]) == idx
        stats = src.io_stats
        assert stats["decoded_changed"] == len(entries), stats
        print("REBUILT", stats["decoded_builds"])
        """,
    )
    assert p.returncode == 0, f"the reader died (rc {p.returncode}): {p.stderr[-3000:]}"
    assert "REBUILT 6" in p.stdout, p.stdout


def test_values_handed_out_do_not_point_into_maps(tmp_path):
    # msgpack numpy values decode zero-copy from the record's bytes, which are copies:
    # truncating the shard afterwards leaves the user's arrays readable.
    p = run_child(
        tmp_path,
        """
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, index_dir=os.path.join(d, "ix"))
        got = src.__getitems__(list(range(0, 400, 3)))
        for q in paths:
            os.truncate(q, 0)
        print("SUM", sum(float(r["x"].sum()) for r in got))
        """,
    )
    assert p.returncode == 0, f"the reader died (rc {p.returncode}): {p.stderr[-3000:]}"
    assert "SUM" in p.stdout


def test_without_a_watch_a_stat_sees_a_truncation(tmp_path):
    from torchgrain.io.changes import Pin, changed

    path = tmp_path / "f"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    pin = Pin(fd, str(path))
    os.close(fd)
    pin.release()  # as where inotify is not available: the path is stat-ed
    assert pin.wd == -1 and changed(pin) is None
    os.truncate(path, 10)
    assert changed(pin) is not None
    os.replace(tmp_path / "f", tmp_path / "g")
    assert "deleted or replaced" in changed(pin)


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord", "parquet"])
def test_a_cached_copy_changed_then_deleted_by_another_process_is_downloaded_again(tmp_path, fmt):
    """A shard cache's copy open in this process is written in place, then deleted (as
    another process does once the copy fails its check): the path is missing, as after
    an eviction, but the open reader's bytes changed. The read downloads the copy again
    and returns the right records (not the changed bytes, nor ChangedWhileOpen)."""
    root = tmp_path / "www"
    root.mkdir()
    with RangeHTTPServer(str(root)) as srv:
        _write(str(root), fmt)
        cache = tmp_path / "cache"
        src = _source(fmt, srv.url, str(root), cache, **NO_BLOCK_CACHE[fmt])
        assert _read(src, "record", [33]) == _expected([33])  # its copy is open now
        victim = _copy_holding(cache, 33)
        _flip_payload(victim, 33, keep_mtime=False)
        os.unlink(victim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _read(src, "record", [33, 34]) == _expected([33, 34])
            assert _read(src, "batch", [32, 33]) == _expected([32, 33])
    assert bytes([33]) * PAYLOAD in _bytes(victim)  # downloaded again


def test_a_cached_copy_changed_between_its_check_and_the_read_is_fetched_again(
    tmp_path, monkeypatch
):
    """A copy written in place right after the read checked it (a change racing the
    read): the read lets the copy go, fetches it again (downloaded again: its CRC fails)
    and returns the right record, not ChangedWhileOpen nor the changed bytes."""
    root = tmp_path / "www"
    root.mkdir()
    with RangeHTTPServer(str(root)) as srv:
        _write(str(root), "array_record")
        cache = tmp_path / "cache"
        src = _source("array_record", srv.url, str(root), cache, **NO_BLOCK_CACHE["array_record"])
        assert _read(src, "record", [33]) == _expected([33])  # its copy is open now
        victim = _copy_holding(cache, 33)
        checked = type(src.cached_copies)._still_readable
        flips = []

        def check_then_change(self, copy, shard):
            ok = checked(self, copy, shard)
            if not flips:  # once: the copy fetched again is left alone
                flips.append(copy.path)
                _flip_payload(copy.path, 33, keep_mtime=False)
            return ok

        monkeypatch.setattr(type(src.cached_copies), "_still_readable", check_then_change)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _read(src, "record", [33]) == _expected([33])
    assert flips == [victim]
    assert bytes([33]) * PAYLOAD in _bytes(victim)  # downloaded again


def test_forked_worker_reads_a_shard_replaced_by_a_rename_before_the_fork(tmp_path):
    # A shard replaced by a rename (the atomic way to update a file) leaves the old inode
    # under the parent's maps, which nobody can open or truncate by its path: a worker
    # forked after it (a new epoch's workers) reads the old records, as the parent does.
    p = run_child(
        tmp_path,
        """
        import shutil
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, index_dir=None)
        idx = list(range(0, 400, 3))
        before = src.__getitems__(idx)
        for path in paths:
            shutil.copy(path, path + ".new")
            os.replace(path + ".new", path)
        same = lambda got: [int(r["y"]) for r in got] == [int(r["y"]) for r in before]
        print("PARENT", same(src.__getitems__(idx)))
        pid = os.fork()
        if pid == 0:
            try:
                print("CHILD", same(src.__getitems__(idx)), flush=True)
            except Exception as e:
                print("CHILD RAISED", e, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        """,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "PARENT True" in p.stdout and "CHILD True" in p.stdout, p.stdout


def test_forked_worker_refuses_a_shard_truncated_then_replaced_after_an_overflow(tmp_path):
    # The parent's queue overflowed (events lost): a child forked after a shard was
    # truncated, then replaced by a rename, cannot tell it from a bare rename, and must
    # refuse it rather than read the truncated inode its maps hold (SIGBUS).
    p = run_child(
        tmp_path,
        """
        import shutil
        from torchgrain.io import changes
        root, paths = ar_dataset()
        src = tg.ArrayRecordSource(root, index_dir=None)
        idx = list(range(0, 400, 3))
        src.__getitems__(idx)
        shutil.copy(paths[0], paths[0] + ".new")
        os.truncate(paths[0], 4096)
        os.replace(paths[0] + ".new", paths[0])
        w = changes._watcher
        os.read(w.fd, 1 << 16)  # the truncation's event, lost as in an overflow
        w.lost = True  # (what IN_Q_OVERFLOW sets)
        pid = os.fork()
        if pid == 0:
            try:
                expect_changed(lambda: src.__getitems__(idx))
                sys.stdout.flush()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        """,
    )
    assert_raised(p)


def test_pins_collected_at_exit_print_nothing(tmp_path):
    # A reference cycle through the script's globals keeps the source alive until the
    # modules' globals are cleared at the interpreter's exit: its pins' __del__ must not
    # print "Exception ignored" once per mapped file.
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, numpy as np, torchgrain as tg
            from torchgrain.io import changes
            root = os.path.join(sys.argv[1], "ar")
            tg.write_array_record(({"y": i} for i in range(40)), root, num_shards=4)
            src = tg.ArrayRecordSource(root, max_mapped_shards=0, index_dir=None)
            src.__getitems__(list(range(40)))
            changes.check = lambda *a, **k: None  # module -> script globals -> source
            """
        )
    )
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Exception ignored" not in p.stderr, p.stderr[-3000:]
