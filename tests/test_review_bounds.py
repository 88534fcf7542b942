"""Reads and writes outside what a loader is given, waits without an end, and memory
held beyond the bytes on disk, found by reproduction.

A case that may wait runs in a child process with a timeout (a hang fails the test, it
never stalls the run), against files made here or a raw HTTP server on 127.0.0.1 whose
answers to chosen paths never come.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A policy whose every wait is short: a read it governs ends within about
#: ``deadline + read_timeout`` (1.5 s), after ``attempts`` tries.
POLICY = (
    "RetryPolicy(attempts=2, base_delay=0.05, jitter=0.0, connect_timeout=0.5, "
    "read_timeout=0.5, request_timeout=1.0, deadline=1.0)"
)


class SilentServer:
    """HTTP/1.1 on 127.0.0.1 serving ``files`` (path -> bytes, with ``Range``); a request
    whose path matches ``silent`` (a regex) from its ``after``-th on (1-based) is read and
    never answered, its connection held open until :meth:`close`."""

    def __init__(self, files: dict[str, bytes], silent: str = "$^", after: int = 1) -> None:
        self.files, self.silent, self.after = files, re.compile(silent), after
        self.matched = 0
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            try:
                while line := f.readline():
                    method, path = line.decode("latin-1").split(" ")[:2]
                    headers = {}
                    while (h := f.readline().decode("latin-1").strip()) != "":
                        key, _, value = h.partition(":")
                        headers[key.strip().lower()] = value.strip()
                    if self.silent.fullmatch(path):
                        self.matched += 1
                        if self.matched >= self.after:
                            self._stop.wait()  # never answered
                            return
                    conn.sendall(self._answer(method, path, headers.get("range")))
            except (OSError, ValueError):
                return

    def _answer(self, method: str, path: str, rng: str | None) -> bytes:
        data = self.files.get(path.split("?")[0])
        if data is None:
            return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        head, body = "200 OK", data
        if rng and (m := re.fullmatch(r"bytes=(\d*)-(\d*)", rng)):
            a = int(m[1]) if m[1] else max(0, len(data) - int(m[2]))
            b = min(int(m[2]) if m[1] and m[2] else len(data) - 1, len(data) - 1)
            head, body = (
                f"206 Partial Content\r\nContent-Range: bytes {a}-{b}/{len(data)}",
                data[a : b + 1],
            )
        out = f"HTTP/1.1 {head}\r\nAccept-Ranges: bytes\r\nContent-Length: {len(body)}\r\n\r\n"
        return out.encode() + (b"" if method == "HEAD" else body)


def run_child(code: str, timeout: float) -> tuple[str, float]:
    """Run ``code`` in a fresh interpreter (the repository importable); its stdout and
    the seconds it took. A child still running after ``timeout`` is killed and the test
    fails, naming the wait."""
    start = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, "NO_ALBUMENTATIONS_UPDATE": "1"},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"still waiting after {timeout:g} s")
    took = time.monotonic() - start
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, took


def _hold_locks(paths: list[str]) -> subprocess.Popen:
    """A process holding an exclusive ``flock`` on each of ``paths`` until its stdin closes."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            f"for p in {paths!r}:\n"
            "    fcntl.flock(os.open(p, os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def _release(holder: subprocess.Popen) -> None:
    """End a :func:`_hold_locks` process (its locks go with it)."""
    holder.stdin.close()
    holder.stdout.close()
    holder.wait(timeout=10)


# ------------------------------------------------------------------ local files


def test_a_fifo_named_as_the_dataset_index_file_is_not_waited_on(tmp_path):
    """A dataset directory whose ``torchgrain.tgindex`` is a FIFO (its manifest's size 0)
    opens (the index refused, the shards indexed instead) and reads, as a FIFO shard is
    refused (changes.open_regular)."""
    code = f"""
        import json, os, warnings
        import torchgrain as tg
        d = {str(tmp_path / "ds")!r}
        tg.write_array_record([{{"x": i}} for i in range(10)], d, num_shards=2)
        os.unlink(os.path.join(d, "torchgrain.tgindex"))
        os.mkfifo(os.path.join(d, "torchgrain.tgindex"))
        with open(os.path.join(d, "torchgrain.json")) as f:
            manifest = json.load(f)
        manifest["index"]["num_bytes"] = 0
        with open(os.path.join(d, "torchgrain.json"), "w") as f:
            json.dump(manifest, f)
        warnings.simplefilter("ignore")
        src = tg.ArrayRecordSource(d, index_dir=None)
        print(len(src), src[9]["x"])
    """
    out, _ = run_child(code, timeout=7)
    assert out.split() == ["10", "9"]


def test_an_index_dir_whose_eviction_lock_another_process_holds_does_not_block_opening(
    tmp_path,
):
    """Opening local ArrayRecord shards (no index yet) with ``index_dir`` whose eviction
    lock another process holds: the index is built and the source opens, without waiting
    for that process."""
    ds, ix = tmp_path / "ds", tmp_path / "ix"
    ix.mkdir()
    holder = _hold_locks([str(ix / "evict.lock")])
    try:
        code = f"""
            import os, warnings
            import torchgrain as tg
            from torchgrain.io import node_store
            node_store._EVICT_WAIT = 1.0  # (30 s by default: the bound, not its length)
            d = {str(ds)!r}
            tg.write_array_record([{{"x": i}} for i in range(10)], d, num_shards=2)
            os.unlink(os.path.join(d, "torchgrain.json"))  # (its index too: built here)
            os.unlink(os.path.join(d, "torchgrain.tgindex"))
            warnings.simplefilter("ignore")
            src = tg.ArrayRecordSource(d, index_dir={str(ix)!r})
            print(len(src), src[9]["x"])
        """
        out, _ = run_child(code, timeout=7)
        assert out.split() == ["10", "9"]
    finally:
        _release(holder)


def test_a_dangling_link_named_like_a_shard_is_not_skipped_silently(tmp_path):
    """A directory holding ``a.parquet`` and a link ``b.parquet`` to a missing file: the
    opening fails naming ``b.parquet``, or at least warns of it; it does not read
    ``a.parquet`` alone as if it were the whole dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "a.parquet")
    os.symlink(tmp_path / "elsewhere" / "b.parquet", tmp_path / "b.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tg.ParquetSource(str(tmp_path))
        except Exception as e:  # an error naming the file is the fix too
            told = str(e)
        else:
            told = " ".join(str(w.message) for w in caught)
    assert "b.parquet" in told, told


def test_convert_does_not_wait_on_a_fifo_in_its_journal(tmp_path):
    """An output directory whose journal holds a FIFO named like a shard's record: the
    conversion converts that shard (a record that is not a whole file is not ours) or
    fails naming it, without waiting for a writer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "src" / "a.parquet")
    journal = tmp_path / "dst" / ".torchgrain-convert"
    journal.mkdir(parents=True)
    os.mkfifo(journal / "shard-00000.json")
    code = f"""
        import torchgrain as tg
        try:
            tg.convert({str(tmp_path / "src")!r}, {str(tmp_path / "dst")!r}, to="array_record")
            print(len(tg.ArrayRecordSource({str(tmp_path / "dst")!r}, index_dir=None)))
        except Exception as e:
            print(e)
    """
    out, _ = run_child(code, timeout=8)
    assert out.strip() == "10" or "shard-00000.json" in out, out


def test_a_fork_after_a_mapped_shard_was_replaced_by_a_fifo_does_not_block_the_child(
    tmp_path,
):
    """A source reads a local ArrayRecord shard (mapped), a FIFO is renamed over the
    shard's path, and the process forks: the child reads (the map holds the old file)
    or raises, and ends."""
    code = f"""
        import os, time, warnings
        import torchgrain as tg
        warnings.simplefilter("ignore")
        d = {str(tmp_path / "ds")!r}
        tg.write_array_record([{{"x": i}} for i in range(100)], d, num_shards=1)
        os.unlink(os.path.join(d, "torchgrain.json"))
        os.unlink(os.path.join(d, "torchgrain.tgindex"))
        src = tg.ArrayRecordSource(d, index_dir=None)
        assert src[0] == {{"x": 0}}
        shard = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".array_record"))
        os.mkfifo(os.path.join(d, "fifo"))
        os.rename(os.path.join(d, "fifo"), shard)
        pid = os.fork()
        if pid == 0:
            try:
                src[99]
            except Exception:
                pass
            os._exit(0)
        end = time.monotonic() + 4
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > end:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                print("the child still waits after 4 s")
                break
            time.sleep(0.05)
        print("done")
    """
    out, _ = run_child(code, timeout=9)
    assert out.strip() == "done", out


def test_a_link_planted_as_a_store_lock_file_creates_nothing_outside_the_store(tmp_path):
    """An index directory whose ``evict.lock`` is a link to a file that does not exist:
    opening local shards with it makes no file at the link's target."""
    import torchgrain as tg

    ds, ix, target = tmp_path / "ds", tmp_path / "ix", tmp_path / "elsewhere" / "made"
    tg.write_array_record([{"x": i} for i in range(10)], str(ds), num_shards=1)
    (ds / "torchgrain.json").unlink()  # (its index too: built into the directory)
    (ds / "torchgrain.tgindex").unlink()
    ix.mkdir()
    target.parent.mkdir()
    os.symlink(target, ix / "evict.lock")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(OSError):  # refusing the directory is a fix too
            assert len(tg.ArrayRecordSource(str(ds), index_dir=str(ix))) == 10
    assert not os.path.lexists(target)


def test_a_parquet_footer_length_is_bounded_before_it_is_read(tmp_path):
    """A sparse Parquet file of 1 GiB whose footer claims all of it: the opening refuses
    it (naming the file) without reading or holding that much."""
    code = f"""
        import resource, struct, warnings
        import torchgrain as tg
        warnings.simplefilter("ignore")
        path, size = {str(tmp_path / "a.parquet")!r}, 1 << 30
        with open(path, "wb") as f:  # sparse: a few KiB on disk
            f.write(b"PAR1")
            f.truncate(size)
            f.seek(size - 8)
            f.write(struct.pack("<I", size - 16) + b"PAR1")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            tg.ParquetSource(path)
        except Exception as e:
            assert path in str(e), e
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grew >> 10)  # MiB
    """
    out, _ = run_child(code, timeout=9)
    assert int(out) < 256, f"the opening grew by {out.strip()} MiB"


def test_a_link_planted_as_the_stamps_directory_deletes_nothing_outside_it(tmp_path):
    """An index directory whose ``verified`` is a link to another directory holding a
    file last changed ten days ago: building an index there leaves that file alone."""
    import torchgrain as tg

    ds, ix, elsewhere = tmp_path / "ds", tmp_path / "ix", tmp_path / "elsewhere"
    tg.write_array_record([{"x": i} for i in range(10)], str(ds), num_shards=1)
    (ds / "torchgrain.json").unlink()  # (its index too: built into the directory)
    (ds / "torchgrain.tgindex").unlink()
    ix.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "notes.txt"
    precious.write_text("mine")
    old = time.time() - 10 * 86400
    os.utime(precious, (old, old))
    os.symlink(elsewhere, ix / "verified")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(OSError):  # refusing the directory is a fix too
            assert len(tg.ArrayRecordSource(str(ds), index_dir=str(ix))) == 10
    assert sorted(os.listdir(elsewhere)) == ["notes.txt"]


def test_a_shard_cache_whose_subdirectories_are_links_writes_nothing_where_they_point(
    tmp_path,
):
    """A remote Parquet shard read through a ``cache_dir`` whose ``.locks`` and
    ``.sums`` are links to other directories: nothing is written into those."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "a.parquet")
    cache, locks, sums = tmp_path / "cache", tmp_path / "locks", tmp_path / "sums"
    for d in (cache, locks, sums):
        d.mkdir()
    os.symlink(locks, cache / ".locks")
    os.symlink(sums, cache / ".sums")
    data = (tmp_path / "a.parquet").read_bytes()
    with SilentServer({"/ds/a.parquet": data}) as srv, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(OSError):  # refusing the directory is a fix too
            src = tg.ParquetSource(srv.url + "/ds/a.parquet", cache_dir=str(cache))
            assert src[1] == {"x": 1}
    assert os.listdir(locks) == [] and os.listdir(sums) == []


# ------------------------------------------------------------------ HTTP deadlines
# A source given ``retry=`` keeps every request of its opening to that policy: a server
# that never answers is a RemoteIOError naming the file within about the policy's
# deadline and read timeout, after its attempts (not the default policy's 90 s).

_OPEN_UNDER_POLICY = """
    import time, warnings
    import torchgrain as tg
    from torchgrain.io.retry import RetryPolicy
    warnings.simplefilter("ignore")
    start = time.monotonic()
    try:
        src = OPEN
        print("opened", len(src))
    except tg.RemoteIOError as e:
        print(f"{time.monotonic() - start:.2f}", e)
"""


def _open_under_policy(opening: str, timeout: float = 9) -> tuple[float, str]:
    """``(seconds, message)`` of the RemoteIOError that ``opening`` (a Python expression
    using ``policy``) raises in a child process."""
    code = _OPEN_UNDER_POLICY.replace("OPEN", opening).replace("policy", POLICY)
    out, _ = run_child(code, timeout=timeout)
    assert not out.startswith("opened"), out
    took, _, message = out.partition(" ")
    return float(took), message


def _attempts(message: str) -> int:
    """The attempts a RemoteIOError's message counts."""
    m = re.search(r"after (\d+) attempts?", message)
    assert m, message
    return int(m[1])


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """``(name, bytes)`` of an ArrayRecord shard of 200 records (no manifest served)."""
    import torchgrain as tg

    d = tmp_path_factory.mktemp("ar")
    tg.write_array_record([{"x": i, "s": "y" * 50} for i in range(200)], str(d), num_shards=1)
    name = next(n for n in os.listdir(d) if n.endswith(".array_record"))
    return name, (d / name).read_bytes()


def test_open_detects_the_format_within_the_retry_deadline(shard):
    name, data = shard
    with SilentServer({f"/{name}": data}, silent=".*") as srv:
        took, message = _open_under_policy(f"tg.open({srv.url + '/' + name!r}, retry=policy)")
    assert srv.url in message
    assert took < 4, (took, message)


def test_a_format_source_opens_within_the_retry_deadline():
    code = """
        class Lines:
            name, suffixes = "lines", (".lines",)
            def open(self, file):
                raise AssertionError("never reached")
    """
    with SilentServer({"/a.lines": b"x\ny\n"}, silent=".*") as srv:
        opening = f"tg.FormatSource({srv.url + '/a.lines'!r}, format=Lines(), retry=policy)"
        took, message = _open_under_policy(
            f"(exec({textwrap.dedent(code)!r}, globals()), {opening})[1]"
        )
    assert srv.url in message
    assert took < 4, (took, message)


def test_an_array_record_source_looks_for_tfds_metadata_within_the_retry_deadline(shard):
    name, data = shard
    with SilentServer({f"/{name}": data}, silent=r"/(features|dataset_info)\.json") as srv:
        took, message = _open_under_policy(
            f"tg.ArrayRecordSource({srv.url + '/' + name!r}, retry=policy)"
        )
    assert ".json" in message and _attempts(message) <= 2, message
    assert took < 4, (took, message)


def test_an_array_record_source_sniffs_its_codec_within_the_retry_deadline(shard):
    import torchgrain as tg

    name, data = shard
    path = f"/{name}"
    with SilentServer({path: data}, silent=re.escape(path), after=10**9) as srv:
        tg.ArrayRecordSource(srv.url + path, index_dir=None)  # count its opening's requests
        last = srv.matched
    assert last > 1
    with SilentServer({path: data}, silent=re.escape(path), after=last) as srv:
        took, message = _open_under_policy(
            f"tg.ArrayRecordSource({srv.url + path!r}, retry=policy)"
        )
    assert srv.url in message and _attempts(message) <= 2, message
    assert took < 4, (took, message)


def test_a_shard_cache_entry_lock_another_process_holds_does_not_block_reads(tmp_path):
    """A remote Parquet shard read through ``cache_dir`` whose copy's lock another
    process holds: the read ends within the retry policy's deadline (read by ranges, or
    an error naming the file), without waiting for that process."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    pq.write_table(pa.table({"x": list(range(100))}), tmp_path / "a.parquet")
    data = (tmp_path / "a.parquet").read_bytes()
    with SilentServer({"/ds/a.parquet": data}) as srv:
        url = srv.url + "/ds/a.parquet"
        first = tmp_path / "first"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the cache's notice)
            assert tg.ParquetSource(url, cache_dir=str(first))[5] == {"x": 5}
        entries = [n for n in os.listdir(first / ".locks") if n != "evict.lock"]
        assert entries
        (tmp_path / "cache" / ".locks").mkdir(parents=True)
        holder = _hold_locks([str(tmp_path / "cache" / ".locks" / n) for n in entries])
        try:
            code = f"""
                import warnings
                import torchgrain as tg
                from torchgrain.io.retry import RetryPolicy
                warnings.simplefilter("ignore")
                src = tg.ParquetSource({url!r}, cache_dir={str(tmp_path / "cache")!r},
                                       retry={POLICY})
                try:
                    print(src[5]["x"])
                except tg.RemoteIOError as e:
                    print(e)
            """
            out, _ = run_child(code, timeout=7)
        finally:
            _release(holder)
    assert out.strip() == "5" or url in out, out
