"""A broken or hostile server never hangs a read, and never gets wrong bytes through.

Every source reads through :class:`tests.servers.FaultProxy`, in front of a static HTTP
server or of moto's S3 server. Each fault mode either ends in data byte-identical to a
local read (the fault is retried) or, when it never stops, in a torchgrain error naming
the URL, within the time the test's ``timeout`` mark states (small deadlines come from the
tests' RetryPolicy; the defaults are checked without waiting for them).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from tests.conftest import make_records
from tests.servers import FaultProxy, RangeHTTPServer
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.fs import get_filesystem
from torchgrain.io.retry import RequestTimeout, RetryPolicy

# Small deadlines. FAST rides through faults injected a few times (five attempts; a
# response that sends nothing for 0.3 s is given up); GIVE_UP ends a fault that never
# stops within its 1.2 s deadline.
FAST = RetryPolicy(
    attempts=5,
    base_delay=0.01,
    max_delay=0.05,
    connect_timeout=2.0,
    read_timeout=0.3,
    request_timeout=3.0,
    deadline=6.0,
)
GIVE_UP = RetryPolicy(
    attempts=3,
    base_delay=0.01,
    max_delay=0.05,
    connect_timeout=2.0,
    read_timeout=0.2,
    request_timeout=0.8,
    deadline=1.2,
)
FORMATS = ("array_record", "parquet", "tfrecord")
SUFFIX = {"array_record": ".array_record", "parquet": ".parquet", "tfrecord": ".tfrecord"}


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    recs = make_records(30, image_shape=(8, 8, 3))
    tg.write_array_record(recs, root / "ar", num_shards=3)
    (root / "pq").mkdir()
    rng = np.random.default_rng(0)
    for k in range(3):
        # 80 KB files: the footer read (the last 64 KiB) does not bring the first row group.
        t = pa.table(
            {"x": np.arange(k * 20, k * 20 + 20), "b": [rng.bytes(4000) for _ in range(20)]}
        )
        pq.write_table(t, root / "pq" / f"part-{k}.parquet", row_group_size=7)
    (root / "tf").mkdir()
    for k in range(2):
        write_tfrecord(
            [encode_tf_example({"x": [k * 10 + i], "pad": [b"y" * 300]}) for i in range(10)],
            root / "tf" / f"part-{k}.tfrecord",
        )
    return root


@pytest.fixture(scope="module")
def proxy(www):
    with RangeHTTPServer(www) as srv, FaultProxy(srv.url) as p:
        yield p


@pytest.fixture(autouse=True)
def _no_faults_left(request, monkeypatch):
    # A small read-ahead buffer: every Parquet row group is a request of its own (made
    # on Arrow's I/O threads), as in files larger than the buffer.
    monkeypatch.setattr("torchgrain.io.remote.REMOTE_BUFFER", 1024)
    yield
    if "proxy" in request.fixturenames:
        request.getfixturevalue("proxy").clear()


def _opened(make, attempts=3):
    """``make()``, tried ``attempts`` times where the opening of a source is not what a
    test is about: with these policies' sub-second timeouts, a machine busy for a few
    seconds can fail the listing (it did, in a run of the whole suite), and the reads
    after it are what is under test. A test that injects faults before the opening
    passes 1."""
    for attempt in range(1, attempts + 1):
        try:
            return make()
        except tg.RemoteIOError:
            if attempt == attempts:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def _open(kind, base, *, open_attempts=3, **kw):
    """A source over ``base`` (a URL or the local root) that reads the network on every
    call (no decoded-block cache), opened by :func:`_opened`."""
    kw = {"retry": FAST, "io_threads": 1, **kw}
    if kind == "array_record":
        return _opened(
            lambda: tg.ArrayRecordSource(f"{base}/ar", cache_bytes=0, **kw), open_attempts
        )
    if kind == "parquet":
        return _opened(lambda: tg.ParquetSource(f"{base}/pq", cache_bytes=0, **kw), open_attempts)
    return _opened(lambda: tg.TFRecordSource(f"{base}/tf", index_dir=None, **kw), open_attempts)


def _local(kind, www):
    return _open(kind, str(www))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


APIS = {
    "getitem": lambda src, idx: [src[i] for i in idx],
    "getitems": lambda src, idx: src.__getitems__(idx),
    "read_columns": lambda src, idx: src.read_columns(idx),
}


def _check(api, got, want):
    if api == "read_columns":
        assert _same(got.records(), want.records())
    else:
        assert _same(got, want)


# Faults that a retry gets through; each is injected once per read call.
RECOVERABLE = {
    "stall": {"kind": "stall"},
    "stall-before-headers": {"kind": "stall_headers"},
    "slow-trickle": {"kind": "trickle", "step": 2048, "pause": 0.02},
    "cut-short": {"kind": "truncate", "times": 2},
    "reset": {"kind": "reset", "times": 2},
    "500-burst": {"kind": "status", "code": 500, "times": 3},
    "503-burst": {"kind": "status", "code": 503, "times": 3},
    "length-longer-then-close": {"kind": "longer"},
    "length-longer-then-silence": {"kind": "longer", "close": False},
    "length-shorter": {"kind": "shorter", "times": 2},
    "range-ignored": {"kind": "ignore_range"},
    "garbled": {"kind": "garbled", "times": 2},
}


def _rotation(k: int) -> list[tuple[str, str]]:
    """The three formats, each with one of the three APIs, rotated by ``k``: over the
    fault modes every format meets every API."""
    apis = list(APIS)
    return [(fmt, apis[(i + k) % 3]) for i, fmt in enumerate(FORMATS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(RECOVERABLE))
def test_a_fault_that_stops_is_retried_and_the_data_is_byte_identical(www, proxy, fault):
    spec = dict(RECOVERABLE[fault])
    kind = spec.pop("kind")
    times = spec.pop("times", 1)
    for fmt, api in _rotation(list(RECOVERABLE).index(fault)):
        src, local = _open(fmt, proxy.url), _local(fmt, www)
        n = len(src)
        idx = [n - 1, 0, n // 2, 3]
        proxy.clear()
        proxy.inject(kind, times=times, match=SUFFIX[fmt], method="GET", **spec)
        _check(api, APIS[api](src, idx), APIS[api](local, idx))
        assert proxy.hits() == times, (fmt, api)


# Faults that never stop: each read ends in a RemoteIOError naming the file.
PERMANENT = {
    "stall": ({"kind": "stall"}, "Timeout"),
    "stall-before-headers": ({"kind": "stall_headers"}, "Timeout"),
    "trickle": ({"kind": "trickle", "step": 1, "pause": 0.1}, "RequestTimeout"),
    "cut-short": ({"kind": "truncate"}, "Payload|ContentLength|ResponseSize|Disconnect"),
    "503": ({"kind": "status", "code": 503}, "HTTP 503"),
    "length-shorter": ({"kind": "shorter"}, "ResponseSizeError"),
    "range-ignored": ({"kind": "ignore_range"}, "does not honour Range"),
    "garbled": ({"kind": "garbled"}, "BadStatusLine"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(PERMANENT))
def test_a_fault_that_never_stops_ends_in_a_remote_io_error_naming_the_file(www, proxy, fault):
    spec, cause = PERMANENT[fault]
    spec = dict(spec)
    kind = spec.pop("kind")
    cases = _rotation(list(PERMANENT).index(fault))
    for fmt, api in cases if fault == "stall" else cases[:1]:
        src = _open(fmt, proxy.url, retry=GIVE_UP)
        proxy.clear()
        proxy.inject(kind, times=None, match=SUFFIX[fmt], method="GET", **spec)
        start = time.monotonic()
        with pytest.raises(tg.RemoteIOError) as ei:
            APIS[api](src, [1])
        took = time.monotonic() - start
        message = str(ei.value)
        assert re.search(rf"{re.escape(proxy.url)}/\w+/[^ ]*{re.escape(SUFFIX[fmt])}", message)
        assert re.search(cause, message), message
        # The policy's 1.2 s deadline, with slack for a busy machine: never a hang.
        assert took < GIVE_UP.deadline + 20, took


@pytest.mark.timeout(60)
def test_a_stalled_open_ends_in_an_error_naming_the_manifest(proxy):
    proxy.inject("stall", times=None, match="torchgrain.json", method="GET")
    with pytest.raises(tg.RemoteIOError, match=r"ar/torchgrain\.json"):
        tg.ArrayRecordSource(f"{proxy.url}/ar", retry=GIVE_UP)


@pytest.mark.timeout(60)
def test_a_stalled_footer_read_at_open_ends_in_an_error_naming_the_file(proxy):
    proxy.inject("stall", times=None, match=".parquet", method="GET")
    with pytest.raises(tg.RemoteIOError, match=r"pq/part-\d\.parquet"):
        tg.ParquetSource(f"{proxy.url}/pq", retry=GIVE_UP)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["array_record", "parquet"])
def test_a_shard_cache_download_gets_through_faults_and_ends_clearly_on_a_stall(
    www, proxy, tmp_path, fmt
):
    cache = {"cache_dir_bytes": 1 << 30, "read_ahead_bytes": 0}
    src = _open(fmt, proxy.url, cache_dir=tmp_path / "c", **cache)
    local = _local(fmt, www)
    for kind in ("truncate", "stall", "shorter", "longer"):
        proxy.clear()
        proxy.inject(kind, times=1, match=SUFFIX[fmt], method="GET")
        shard = ["truncate", "stall", "shorter", "longer"].index(kind) % src.num_shards
        first = int(src.shard_counts[:shard].sum())
        assert _same(src[first], local[first])
    src = _open(fmt, proxy.url, cache_dir=tmp_path / "c2", retry=GIVE_UP, **cache)
    proxy.clear()
    proxy.inject("stall", times=None, match=SUFFIX[fmt], method="GET")
    with pytest.raises(tg.RemoteIOError, match=rf"download of .*{re.escape(SUFFIX[fmt])}"):
        src[0]
    assert not [f for f in os.listdir(tmp_path / "c2") if f.startswith(".tmp-")]


def _collect(loader):
    return [r for batch in loader for r in batch]


@pytest.mark.timeout(180)
def test_a_stalled_worker_does_not_stall_the_loader(www, proxy):
    local = _local("array_record", www)

    def loader(src):
        src[0]  # used in the parent first, as users do
        return torch.utils.data.DataLoader(
            tg.Dataset(src),
            batch_size=5,
            num_workers=2,
            multiprocessing_context="fork",
            collate_fn=lambda b: b,
        )

    # A stall in each worker now and then: retried, every record arrives intact.
    patient = loader(_open("array_record", proxy.url))
    proxy.inject("stall", times=2, match=".array_record", method="GET")
    assert _same(_collect(patient), local.__getitems__(list(range(len(local)))))
    # A server that stalls for good: the loader raises in the training loop, naming
    # the file, instead of waiting forever for its workers.
    impatient = loader(_open("array_record", proxy.url, retry=GIVE_UP))
    proxy.clear()
    proxy.inject("stall", times=None, match=".array_record", method="GET")
    with pytest.raises(tg.RemoteIOError, match=r"ar/data-\d+-of-\d+\.array_record"):
        _collect(impatient)


# ----------------------------------------------------------------------------- S3
@pytest.fixture(scope="module")
def s3_proxy(www, moto_s3):
    client, endpoint = moto_s3
    client.create_bucket(Bucket="faults")
    for sub in ("ar", "pq"):
        for f in sorted(os.listdir(www / sub)):
            client.upload_file(str(www / sub / f), "faults", f"{sub}/{f}")
    with FaultProxy(endpoint) as p:
        yield p


def _s3(kind, proxy, retry=FAST):
    """A source over the S3 copy of the dataset, opened by :func:`_opened`."""
    opts = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
    kw = {"storage_options": opts, "retry": retry, "io_threads": 1, "cache_bytes": 0}
    if kind == "array_record":
        return _opened(lambda: tg.ArrayRecordSource("s3://faults/ar", **kw))
    return _opened(lambda: tg.ParquetSource("s3://faults/pq", **kw))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["array_record", "parquet"])
def test_s3_reads_get_through_faults_and_end_clearly_when_the_store_stalls(www, s3_proxy, fmt):
    src, local = _s3(fmt, s3_proxy), _local(fmt, www)
    idx = [len(src) - 1, 0, 5]
    for kind, extra in (("status", {"code": 503, "times": 2}), ("truncate", {}), ("stall", {})):
        s3_proxy.clear()
        s3_proxy.inject(kind, match=SUFFIX[fmt], method="GET", **extra)
        assert _same(src.__getitems__(idx), local.__getitems__(idx)), kind
    # A stalled read ends by read_timeout; request_timeout and deadline leave moto time
    # to answer the opening's lookups on a busy machine (they took over 0.8 s there).
    src = _s3(fmt, s3_proxy, retry=dataclasses.replace(GIVE_UP, request_timeout=10, deadline=12))
    s3_proxy.clear()
    s3_proxy.inject("stall", times=None, match=SUFFIX[fmt], method="GET")
    with pytest.raises(
        tg.RemoteIOError,
        match=rf"faults/{'ar' if fmt == 'array_record' else 'pq'}/.*{re.escape(SUFFIX[fmt])}",
    ):
        src.__getitems__([2])


# --------------------------------------------------------------- the deadlines
def test_the_default_deadlines_are_finite_and_reach_the_transports():
    p = RetryPolicy()
    assert (p.connect_timeout, p.read_timeout, p.request_timeout, p.deadline) == (10, 20, 60, 90)
    assert p.min_rate == 1 << 20
    # A read that makes no progress: no attempt starts after the deadline (a stalled
    # request earns no time: test_retries_of_a_stalled_read_never_push_the_deadline_back),
    # and the one in flight ends by the read timeout: under two minutes in all.
    assert p.deadline + p.read_timeout < 120
    http_fs, _ = get_filesystem("http://127.0.0.1:9/x")
    timeout = http_fs.client_kwargs["timeout"]
    assert (timeout.sock_connect, timeout.sock_read, timeout.total) == (10, 20, None)
    pytest.importorskip("s3fs")
    s3_fs, _ = get_filesystem("s3://b/x", {"endpoint_url": "http://127.0.0.1:9", "anon": True})
    assert s3_fs.config_kwargs["connect_timeout"] == 10
    assert s3_fs.config_kwargs["read_timeout"] == 20


def test_the_defaults_are_what_the_documentation_states():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "troubleshooting.md")) as f:
        page = f.read()
    section = page[page.index("## Deadlines") :]
    section = section[: section.index("\n## ", 4)]
    p = RetryPolicy()
    for name, value in (
        ("connect_timeout", p.connect_timeout),
        ("read_timeout", p.read_timeout),
        ("request_timeout", p.request_timeout),
        ("deadline", p.deadline),
    ):
        assert re.search(rf"`{name}`[^|\n]*\b{value:g} s", section), name


def test_settings_the_user_gave_are_kept():
    import aiohttp

    mine = aiohttp.ClientTimeout(total=5)
    fs, _ = get_filesystem("http://127.0.0.1:9/y", {"client_kwargs": {"timeout": mine}})
    assert fs.client_kwargs["timeout"] is mine
    pytest.importorskip("s3fs")
    s3_fs, _ = get_filesystem(
        "s3://b/y", {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"read_timeout": 3}}
    )
    assert s3_fs.config_kwargs["read_timeout"] == 3


def test_a_sources_retry_policy_sets_its_transport_timeouts(proxy):
    src = _open("array_record", proxy.url)
    timeout = src._fs.client_kwargs["timeout"]
    assert (timeout.sock_connect, timeout.sock_read) == (FAST.connect_timeout, FAST.read_timeout)


@pytest.mark.timeout(60)
def test_the_operation_deadline_cuts_retries_short(proxy):
    patient = RetryPolicy(
        attempts=1000, base_delay=0.01, max_delay=0.01, read_timeout=0.2, deadline=1
    )
    src = _open("array_record", proxy.url, retry=patient)
    proxy.inject("stall", times=None, match=".array_record", method="GET")
    with pytest.raises(tg.RemoteIOError, match="its 1 s deadline passed") as ei:
        src[0]
    attempts = int(re.search(r"after (\d+) attempts", str(ei.value)).group(1))
    assert 1 < attempts < 1000


@pytest.mark.timeout(60)
def test_retries_of_a_stalled_read_never_push_the_deadline_back(proxy):
    """Each request may take the time of its bytes at ``min_rate``; were that added to the
    operation's deadline on every attempt, retries of a large read that stalls would go on
    past it (with the defaults, a 24 MiB row group of a stalling server failed after 123 s).
    Here every attempt would add 128 s: the 1.5 s deadline must still end the retries."""
    slow_link = RetryPolicy(
        attempts=50,
        base_delay=0.01,
        max_delay=0.01,
        read_timeout=0.3,
        request_timeout=5,
        min_rate=1024,  # a 128 KiB chunk read: 128 s at min_rate
        deadline=1.5,
    )
    src = _open("array_record", proxy.url, retry=slow_link)
    proxy.inject("stall", times=None, match=".array_record", method="GET")
    start = time.monotonic()
    with pytest.raises(tg.RemoteIOError, match=r"its 1\.5 s deadline passed") as ei:
        src[0]
    attempts = int(re.search(r"after (\d+) attempts", str(ei.value)).group(1))
    assert attempts < 50
    # No attempt after the deadline; the last one ends by the read timeout (slack for a
    # busy machine): never the 50 x 0.3 s of every attempt.
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_a_request_that_completes_extends_its_operations_deadline():
    from torchgrain.io.retry import remaining_seconds, request_done, retry_call

    p = RetryPolicy(request_timeout=50, min_rate=100, deadline=10)

    def op():
        first = remaining_seconds(1000)[0]  # 10 s left + its own 10 s
        request_done(0)  # failed or empty: earns nothing
        again = remaining_seconds(1000)[0]
        request_done(1000)  # brought 1000 bytes: 10 s more for the operation
        return first, again, remaining_seconds(0)[0]

    first, again, after = retry_call(op, url="x", policy=p)
    assert 19 < first <= 20 and 19 < again <= 20 and 19 < after <= 20


@pytest.mark.skipif(
    os.environ.get("TORCHGRAIN_DEADLINE_CHECK") != "1",
    reason="about 2 minutes: `make deadlines` runs it (TORCHGRAIN_DEADLINE_CHECK=1)",
)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["stall", "stall_headers"])
def test_with_the_default_settings_a_stalled_large_read_ends_within_two_minutes(tmp_path, fault):
    rng = np.random.default_rng(0)
    (tmp_path / "pq").mkdir()
    # One 24 MiB row group: one request of 24 MiB, 24 s at the default min_rate.
    table = pa.table({"b": [rng.bytes(1 << 20) for _ in range(24)]})
    pq.write_table(table, tmp_path / "pq" / "big.parquet", compression="none")
    with RangeHTTPServer(tmp_path) as srv, FaultProxy(srv.url) as proxy:
        src = tg.ParquetSource(f"{proxy.url}/pq", cache_bytes=0)  # the default RetryPolicy
        proxy.inject(fault, times=None, match=".parquet", method="GET")
        start = time.monotonic()
        with pytest.raises(tg.RemoteIOError, match=r"pq/big\.parquet"):
            src[0]
        took = time.monotonic() - start
    print(f"{fault}: RemoteIOError after {took:.1f} s")
    assert took < 120


@pytest.mark.timeout(120)
def test_an_http_directory_walk_ends_by_the_deadline_however_many_slow_pages_it_has(tmp_path):
    """Each page of a listing is a request of its own: a server that trickles every page
    (never slower than the read timeout, each page within the request timeout) and lists
    many directories would keep the walk going for pages x deadline. The walk as a whole
    keeps to the deadline."""
    for k in range(40):
        (tmp_path / "wide" / f"d{k:02}").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "wide" / "a.parquet")
    patient_pages = RetryPolicy(
        attempts=2, read_timeout=1, request_timeout=5, deadline=2, base_delay=0.01
    )
    with RangeHTTPServer(tmp_path) as srv, FaultProxy(srv.url) as proxy:
        # 512 bytes every 0.3 s: about 0.3 s a page, 13 s for the 41 pages.
        proxy.inject("trickle", times=None, match="/wide", method="GET", step=512, pause=0.3)
        start = time.monotonic()
        with pytest.raises(tg.RemoteIOError, match=r"listing of .*/wide.* 2 s deadline"):
            tg.ParquetSource(f"{proxy.url}/wide", retry=patient_pages)
        assert time.monotonic() - start < 10
        assert len(proxy.log) < 40


def test_invalid_deadlines_are_refused():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="read_timeout"):
            RetryPolicy(read_timeout=bad)
    with pytest.raises(TypeError):
        RetryPolicy(deadline="90")  # type: ignore[arg-type]


def test_a_request_timeout_is_transient():
    from torchgrain.io.retry import is_transient

    assert is_transient(RequestTimeout("x"))


@pytest.mark.timeout(60)
def test_parquet_reads_on_arrows_threads_keep_to_the_sources_policy(proxy):
    """Arrow reads row groups on its own I/O threads: they must still be single attempts
    of the source's operation (else a policy of one attempt would be silently retried)."""
    once = RetryPolicy(attempts=1, read_timeout=0.3, request_timeout=2, deadline=4)
    src = _open("parquet", proxy.url, retry=once)
    # The reader's footer read (this thread) goes through; the row group's (Arrow's) stalls.
    proxy.inject("stall", times=1, skip=1, match=".parquet", method="GET")
    with pytest.raises(tg.RemoteIOError, match="after 1 attempt "):
        src.__getitems__([3])
    assert proxy.hits() == 1


@pytest.mark.timeout(60)
def test_opening_keeps_to_the_sources_policy_on_its_threads(www, proxy):
    """Shard footers are read on a pool of threads at open: one attempt means one."""
    once = RetryPolicy(attempts=1, read_timeout=0.3, request_timeout=2, deadline=4)
    proxy.inject("status", times=1, code=503, match=".array_record", method="GET")
    with pytest.raises(tg.RemoteIOError, match="HTTP 503"):
        tg.ArrayRecordSource(f"{proxy.url}/ar/*.array_record", retry=once)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["status", "reset"])
def test_a_server_failing_at_open_is_retried_not_taken_for_a_missing_dataset(www, proxy, fmt, kind):
    """fsspec's own probes say "does not exist" for a 503 (HTTP ``exists``) or a
    timeout (``isdir``): every probe of the dataset's files and directories must retry."""
    proxy.inject(kind, times=3)  # the first requests of the open, whatever they are
    src = _open(fmt, proxy.url, open_attempts=1)
    assert proxy.hits() == 3
    local = _local(fmt, www)
    assert _same(src.__getitems__([0, len(src) - 1]), local.__getitems__([0, len(src) - 1]))


# ------------------------------------------------------------------ response sizes
# A flood: 256 MiB of zeros whatever was asked for, chunked (no end in sight) or declared.
FLOODS = {"endless-chunked": {}, "huge-length": {"length": 1 << 40}}
FLOOD_TOTAL = 256 << 20
# What may go out to one request before the client hangs up: the bytes asked for, plus
# what the loopback's socket buffers hold (a few MiB). Reading whole bodies takes 256 MiB.
FLOOD_SLACK = 32 << 20


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flood", list(FLOODS))
@pytest.mark.parametrize("target", ["manifest", *FORMATS])
def test_a_body_far_larger_than_asked_for_is_given_up_without_being_buffered(
    www, proxy, flood, target
):
    """A server that ignores ``Range`` and sends a huge or endless body: fsspec would read
    it whole before torchgrain could look at it; each response is read only up to the
    bytes asked for."""
    if target == "manifest":
        proxy.inject("flood", times=None, match="torchgrain.json", method="GET", total=FLOOD_TOTAL)
        with pytest.raises(tg.RemoteIOError, match=r"ar/torchgrain\.json.*holds more than"):
            tg.ArrayRecordSource(f"{proxy.url}/ar", retry=GIVE_UP)
    else:
        src = _open(target, proxy.url, retry=GIVE_UP)
        proxy.clear()
        proxy.inject(
            "flood",
            times=None,
            match=SUFFIX[target],
            method="GET",
            total=FLOOD_TOTAL,
            **FLOODS[flood],
        )
        with pytest.raises(tg.RemoteIOError, match="holds more than") as ei:
            src.__getitems__([1])
        assert SUFFIX[target] in str(ei.value)
    assert proxy.hits() >= 1
    assert proxy.flooded / proxy.hits() < FLOOD_SLACK, proxy.flooded


def _cached(base, cache_dir, **kw):
    """An ArrayRecord source over ``base`` that reads whole shards into ``cache_dir``."""
    kw = {"cache_dir_bytes": 1 << 30, "read_ahead_bytes": 0, **kw}
    return _open("array_record", base, cache_dir=cache_dir, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "error"), [(404, tg.DatasetNotFoundError), (403, PermissionError)]
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_error_answer_longer_than_the_range_asked_for_is_still_that_error(
    proxy, fmt, code, error
):
    """A server's error page is often longer than a small range: it is the error it
    says (never retried), not a response that ignored the range."""
    src = _open(fmt, proxy.url, retry=GIVE_UP)
    proxy.clear()
    proxy.inject("status", times=None, match=SUFFIX[fmt], method="GET", code=code, size=1 << 20)
    with pytest.raises(error, match=re.escape(SUFFIX[fmt])):
        src.__getitems__([1])
    assert proxy.hits() == 1


@pytest.mark.timeout(120)
def test_a_shard_cache_download_stops_at_the_shards_size(proxy, tmp_path):
    src = _cached(proxy.url, tmp_path / "c", retry=GIVE_UP)
    proxy.clear()
    proxy.inject("flood", times=None, match=".array_record", method="GET", total=FLOOD_TOTAL)
    with pytest.raises(tg.RemoteIOError, match=r"download brought more than the \d+ bytes"):
        src[0]
    assert proxy.flooded / proxy.hits() < FLOOD_SLACK, proxy.flooded
    assert not [f for f in os.listdir(tmp_path / "c") if f.startswith(".tmp-")]


@pytest.mark.timeout(60)
def test_a_download_retried_on_its_own_counts_each_transfer_afresh(www, proxy, tmp_path):
    from torchgrain.io import remote
    from torchgrain.io.retry import using

    name = "ar/data-00000-of-00003.array_record"
    want = (www / name).read_bytes()
    proxy.inject("truncate", times=1, match=".array_record", method="GET")
    with using(FAST):  # outside any operation: get_file retries by itself
        fs, url = get_filesystem(f"{proxy.url}/{name}")
        remote.get_file(fs, url, str(tmp_path / "x"), nbytes=len(want))
    assert proxy.hits() == 1
    assert (tmp_path / "x").read_bytes() == want


@pytest.mark.timeout(60)
def test_a_trickled_download_ends_once_it_falls_behind_min_rate(proxy, tmp_path):
    """A trickle never trips the transport's read timeout, and a shard's own limit
    (request_timeout + size / min_rate: here 128 s) is long: the download stops once it
    is behind min_rate after its first request_timeout seconds."""
    slow_link = RetryPolicy(
        attempts=2, base_delay=0.01, read_timeout=1, request_timeout=1, min_rate=1024, deadline=2
    )
    src = _cached(proxy.url, tmp_path / "c", retry=slow_link)
    proxy.clear()
    # 640 bytes/s, under min_rate's 1024.
    proxy.inject("trickle", times=None, match=".array_record", method="GET", step=64, pause=0.1)
    start = time.monotonic()
    with pytest.raises(tg.RemoteIOError, match=r"download .* fell behind 1024 bytes/s"):
        src[0]
    assert time.monotonic() - start < 30


@pytest.mark.timeout(60)
def test_a_listing_page_larger_than_the_ceiling_is_given_up_without_being_buffered(
    proxy, monkeypatch
):
    monkeypatch.setattr("torchgrain.io.remote.MAX_PAGE_BYTES", 1 << 20, raising=False)
    proxy.inject(
        "flood", times=None, match="/pq", method="GET", total=FLOOD_TOTAL, content_type="text/html"
    )
    with pytest.raises(tg.RemoteIOError, match=r"/pq.*MAX_PAGE_BYTES"):
        tg.ParquetSource(f"{proxy.url}/pq", retry=GIVE_UP)
    assert proxy.flooded / proxy.hits() < FLOOD_SLACK, proxy.flooded


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_server_that_reports_no_size_is_an_error_naming_the_file(proxy, fmt):
    proxy.inject("no_length", times=None, match=SUFFIX[fmt])
    with pytest.raises(tg.CorruptDataError, match=rf"{re.escape(SUFFIX[fmt])}.*reports no size"):
        _open(fmt, proxy.url, retry=GIVE_UP, open_attempts=1)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flood", list(FLOODS))
@pytest.mark.parametrize("fmt", ["array_record", "parquet"])
def test_an_s3_body_far_larger_than_asked_for_is_given_up_without_being_buffered(
    s3_proxy, fmt, flood
):
    s3_proxy.clear()
    src = _s3(fmt, s3_proxy)  # patient at open: moto can be slow on a busy machine
    s3_proxy.inject(
        "flood", times=None, match=SUFFIX[fmt], method="GET", total=FLOOD_TOTAL, **FLOODS[flood]
    )
    try:
        with pytest.raises(tg.RemoteIOError, match="holds more than") as ei:
            src.__getitems__([1])
        assert SUFFIX[fmt] in str(ei.value)
        assert s3_proxy.flooded / s3_proxy.hits() < FLOOD_SLACK, s3_proxy.flooded
    finally:
        s3_proxy.clear()
