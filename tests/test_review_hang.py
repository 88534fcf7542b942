"""Waits without an end, found by reproduction: FIFOs where a file is read, locks another
live process holds, workers killed mid-epoch, passes that select nothing.

Each case that may wait runs in a child process with a hard timeout (a hang fails the
test, it never stalls the run).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import warnings

import torchgrain as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run_child(code: str, timeout: float) -> tuple[subprocess.CompletedProcess[str] | None, str]:
    """``(the finished child, its stderr)``, or ``(None, its stderr so far)`` when it ran
    past ``timeout`` seconds (it is killed)."""
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": ROOT}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        return None, _text(e.stderr)
    return done, done.stderr


def test_a_fifo_named_as_a_composition_file_is_refused_not_waited_on(tmp_path):
    spec = tmp_path / "mixture.json"
    os.mkfifo(spec)
    done, err = run_child(
        f"""
        from torchgrain.compose.spec import load_spec
        load_spec({str(spec)!r})
        """,
        timeout=10,
    )
    assert done is not None, f"load_spec of a FIFO still waited after 10 s: {err[-2000:]}"
    assert done.returncode != 0 and "SpecError" in err and str(spec) in err, err[-2000:]


def _index_lock_name(data: str, probe: str) -> str:
    """The name of the lock under which ``data``'s ArrayRecord index is built in an
    index directory (found by building it once in ``probe``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg.ArrayRecordSource(data, codec="msgpack", index_dir=probe)
    (name,) = [n for n in os.listdir(probe) if n.endswith(".tgindex.lock")]
    return name


def test_an_index_build_lock_another_process_holds_is_said_or_bounded(tmp_path):
    """Another process holds the lock of a dataset index's build (a stopped or stuck
    builder): the open either ends within seconds, or says on stderr what it waits for
    (the index directory), instead of 15 silent minutes."""
    data, idx = str(tmp_path / "ds"), tmp_path / "idx"
    tg.write_array_record([{"x": i} for i in range(10)], data, num_shards=2)
    for n in os.listdir(data):  # no manifest, no index beside the shards: one is built
        if not n.endswith(".array_record"):
            os.unlink(os.path.join(data, n))
    name = _index_lock_name(data, str(tmp_path / "probe"))
    idx.mkdir()
    fd = os.open(idx / name, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the other builder, alive
        done, err = run_child(
            f"""
            import torchgrain as tg
            from torchgrain.io.retry import RetryPolicy
            src = tg.ArrayRecordSource({data!r}, codec="msgpack", index_dir={str(idx)!r},
                                       retry=RetryPolicy(deadline=2.0))
            print(len(src))
            """,
            timeout=10,
        )
    finally:
        os.close(fd)
    if done is not None:  # it ended (bounded)
        assert done.returncode == 0 and done.stdout.split() == ["10"], err[-2000:]
    else:  # still waiting: it must have said for what
        assert "wait" in err.lower() and str(idx) in err, (
            f"after 10 s of waiting for the lock {idx / name}, stderr says: {err[-2000:]!r}"
        )


def test_a_worker_killed_mid_epoch_ends_the_prefetched_resumable_loop_with_an_error(tmp_path):
    """A DataLoader worker SIGKILLed mid-epoch under ResumableLoader(CudaPrefetcher(...)):
    the loop raises (torch's 'killed by signal', or a reset of the connection torch passes a
    batch's shared memory through, when the worker dies while handing one over) instead of
    waiting for its batches."""
    data = str(tmp_path / "ds")
    done, err = run_child(
        f"""
        import os, signal, warnings, torch
        import torchgrain as tg
        warnings.simplefilter("ignore")
        tg.write_array_record([{{"x": i}} for i in range(400)], {data!r}, num_shards=2)

        def boom(r):
            if int(r["x"]) == 150:
                os.kill(os.getpid(), signal.SIGKILL)
            return r

        ds = tg.Dataset(tg.ArrayRecordSource({data!r})).map(boom)
        sampler = tg.GlobalShuffleSampler(ds, seed=0)
        dl = torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=8, num_workers=2,
                                         persistent_workers=True)
        try:
            for _ in tg.ResumableLoader(tg.CudaPrefetcher(dl, device="cpu")):
                pass
        except Exception:  # torch's "killed by signal", or its fd transport's reset
            print("raised")
        """,
        timeout=14,
    )
    assert done is not None, f"the loop waited on a dead worker: {err[-2000:]}"
    assert done.stdout.split() == ["raised"], err[-2000:]


def test_a_filter_that_keeps_nothing_gives_an_empty_pass_and_loader(tmp_path):
    """A predicate that never holds: the selection pass ends, and a sampled, loaded
    epoch over it is empty (said once), not an endless search for a record."""
    data = str(tmp_path / "ds")
    done, err = run_child(
        f"""
        import torch
        import torchgrain as tg
        tg.write_parquet([{{"x": i}} for i in range(50)], {data!r})
        ds = tg.Dataset(tg.ParquetSource({data!r})).filter(
            lambda r: False, num_workers=0, progress=False, index_dir=None)
        s = tg.GlobalShuffleSampler(ds, seed=0)
        dl = torch.utils.data.DataLoader(ds, sampler=s, batch_size=4, num_workers=1)
        print(len(ds), len(list(s)), len(list(dl)))
        """,
        timeout=14,
    )
    assert done is not None, f"a pass over an empty selection did not end: {err[-2000:]}"
    assert done.stdout.split() == ["0", "0", "0"], err[-2000:]
    assert "no records" in err


_LOOPING_S3 = """
import threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAGE = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    "<Name>bkt</Name><Prefix>ds/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
    "<IsTruncated>true</IsTruncated><NextContinuationToken>again</NextContinuationToken>"
    "<Contents><Key>ds/x{n}.array_record</Key><LastModified>2020-01-01T00:00:00.000Z"
    '</LastModified><ETag>"a"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass>'
    "</Contents></ListBucketResult>"
)
pages = [0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _empty(self, code):
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self):
        self._empty(404)

    def do_GET(self):
        if "list-type=2" not in self.path:
            return self._empty(404)
        pages[0] += 1
        body = PAGE.format(n=pages[0]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
URL = f"http://127.0.0.1:{server.server_address[1]}"
"""


def test_an_s3_listing_that_repeats_its_continuation_token_ends_at_once(tmp_path):
    done, err = run_child(
        _LOOPING_S3
        + """
import torchgrain as tg
from torchgrain.io.retry import RetryPolicy

policy = RetryPolicy(attempts=1, connect_timeout=1.0, read_timeout=1.0,
                     request_timeout=7.0, deadline=8.0)
opts = {"endpoint_url": URL, "key": "k", "secret": "s"}
start = time.monotonic()
try:
    tg.ArrayRecordSource("s3://bkt/ds", storage_options=opts, retry=policy)
except tg.TorchgrainError as e:
    print(f"{time.monotonic() - start:.1f} {pages[0]}")
    print(e)
""",
        timeout=14,
    )
    assert done is not None, f"the listing did not end: {err[-2000:]}"
    seconds, pages = done.stdout.split("\n", 1)[0].split()
    # A loop is known at the second page that names the token of the first.
    assert float(seconds) < 4.0 and int(pages) <= 10, done.stdout


def test_a_fifo_named_as_the_tokenizer_file_is_refused_not_waited_on(tmp_path):
    src, fifo = str(tmp_path / "src"), tmp_path / "tokenizer.json"
    tg.write_parquet([{"text": "hello world"} for _ in range(5)], src)
    os.mkfifo(fifo)
    done, err = run_child(
        f"""
        import sys
        from torchgrain.cli import main
        sys.exit(main(["convert", {src!r}, {str(tmp_path / "out")!r}, "--tokenize",
                       {str(fifo)!r}]))
        """,
        timeout=10,
    )
    assert done is not None, f"convert --tokenize of a FIFO still waited after 10 s: {err}"
    assert done.returncode != 0 and "--tokenize" in err and str(fifo) in err, err[-2000:]


def test_a_stopped_builder_costs_one_decoded_cache_wait_not_one_per_entry(tmp_path):
    import zlib

    from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

    stripes = DecodedCache._STRIPES
    keys = [entry_key(f"part-{i}.parquet", 0) for i in range(5000)]
    stripe = zlib.crc32(keys[0].encode()) % stripes
    same = [k for k in keys if zlib.crc32(k.encode()) % stripes == stripe][1:4]
    locks = tmp_path / "cache" / DecodedCache._LOCK_DIR
    locks.mkdir(parents=True)
    fd = os.open(locks / f"{stripe}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # its builder, stopped while it builds keys[0]
        done, err = run_child(
            f"""
            import time, warnings
            import pyarrow as pa
            from torchgrain.sources.parquet.decoded_cache import DecodedCache
            warnings.simplefilter("ignore")
            cache = DecodedCache({str(tmp_path / "cache")!r}, max_bytes=1 << 20,
                                 min_free_bytes=0, lock_timeout=1.5)
            t = pa.table({{"x": [1, 2, 3]}})
            start = time.monotonic()
            for key in {same!r}:  # three other row groups, which nobody builds
                cache.get_or_build(key, lambda: t, schema=t.schema, num_rows=3)
            print(f"{{time.monotonic() - start:.2f}}")
            """,
            timeout=14,
        )
    finally:
        os.close(fd)
    assert done is not None and done.returncode == 0, err[-2000:]
    # At most one lock_timeout in all (the stripe is then known stuck), not one each.
    assert float(done.stdout) < 3.0, done.stdout
