"""Multi-range reads against servers that answer a multi-range request in hostile or
unusual ways (a raw HTTP server of the tests' own, each answer written byte by byte):
each test asks for bytes of a file and checks that what comes back is the file's bytes,
or an error naming the URL, and what the reader remembers of the server."""

from __future__ import annotations

import gzip
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
import pytest

import torchgrain as tg
from torchgrain.errors import UnsafePathError
from torchgrain.io import inflight
from torchgrain.io.byteranges import MAX_RANGES
from torchgrain.io.remote import storage_options_with_deadlines
from torchgrain.io.retry import RequestTimeout, RetryPolicy, using

DATA = random.Random(7).randbytes(50_000)
_MULTI = re.compile(r"bytes=(\d+-\d+(?:,\d+-\d+)+)$")
_ONE = re.compile(r"bytes=(\d+)-(\d+)$")


SIZE = len(DATA)


def _parts_body(ranges, boundary="BND", *, size=SIZE, nl=b"\r\n", data=DATA):
    out = b""
    for s, e in ranges:
        out += (
            nl + f"--{boundary}".encode() + nl + f"Content-Range: bytes {s}-{e - 1}/{size}".encode()
        )
        out += nl + nl + data[s:e]
    return out + nl + f"--{boundary}--".encode() + nl


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        srv = self.server
        rng = self.headers.get("Range", "")
        with srv.lock:
            srv.ranges.append(rng)
        m = _MULTI.match(rng)
        if m and srv.answer is not None:
            ranges = [tuple(int(x) for x in p.split("-")) for p in m[1].split(",")]
            ranges = [(a, b + 1) for a, b in ranges]
            self.close_connection = True
            srv.answer(self, ranges)
            return
        one = _ONE.match(rng)
        if one:
            s, e = int(one[1]), min(len(DATA), int(one[2]) + 1)
            body = DATA[s:e]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {s}-{e - 1}/{len(DATA)}")
        else:
            body = DATA
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = None


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.lock = threading.Lock()
        self.ranges: list[str] = []
        self.release = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def multi(self):
        return [r for r in self.ranges if "," in r]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.shutdown()
        self.server_close()


def _raw(h, head: bytes, body: bytes = b""):
    h.wfile.write(b"HTTP/1.1 " + head + b"\r\nConnection: close\r\n\r\n" + body)


def _multipart(h, body: bytes, *, ctype=b"multipart/byteranges; boundary=BND", extra=b""):
    _raw(
        h,
        b"206 Partial Content\r\nContent-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + extra,
        body,
    )


def _fs():
    opts = storage_options_with_deadlines("http", {})
    opts["skip_instance_cache"] = True
    return fsspec.filesystem("http", **opts)


RANGES = [(100, 200), (5000, 5100), (20_000, 21_000), (40_000, 40_010)]


def _read(srv, ranges=RANGES, fs=None):
    fs = fs or _fs()
    url = f"{srv.url}/f.bin"
    got = inflight.cat_many(fs, [url] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges])
    return fs, got


def _expect(got, ranges=RANGES):
    assert got == [DATA[s:e] for s, e in ranges]


# ------------------------------------------------- servers that refuse or break them
def test_a_boundary_outside_latin1_is_asked_one_range_per_request():
    # A boundary outside RFC 2046's characters is a malformed answer like any other: the
    # ranges are asked one per request (never an encoding error for a file that is fine).
    def answer(h, ranges):
        _multipart(h, _parts_body(ranges), ctype=b"multipart/byteranges; boundary=\xe2\x82\xac")

    with Server(answer) as srv:
        fs, got = _read(srv)
        _expect(got)
        assert inflight.multirange_servers(fs)[srv.url] is False


@pytest.mark.parametrize("how", ["latin1", "416", "501", "403", "reset"])
def test_a_source_over_a_server_that_breaks_multi_range_stops_asking_for_it(
    tmp_path, monkeypatch, how
):
    from tests import servers

    recs = [{"i": i, "b": DATA[i * 50 : i * 50 + 1000]} for i in range(300)]
    tg.write_array_record(recs, tmp_path / "ds", num_shards=2)

    def broken(self, path, size, ranges, mode):
        with open(path, "rb") as f:
            blob = f.read()
        body = _parts_body(ranges, data=blob, size=size)
        if how == "reset":  # the connection closed without an answer
            self.close_connection = True
            return
        if how != "latin1":
            self.wfile.write(b"HTTP/1.1 " + how.encode() + b" No\r\nContent-Length: 0\r\n\r\n")
            self.close_connection = True
            return
        self.wfile.write(
            b"HTTP/1.1 206 Partial Content\r\nContent-Type: multipart/byteranges; "
            b"boundary=\xff\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.close_connection = True

    monkeypatch.setattr(servers._Handler, "_multipart", broken)
    with servers.RangeHTTPServer(tmp_path) as srv:
        retry = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)
        src = tg.ArrayRecordSource(f"{srv.url}/ds", retry=retry)
        try:
            src.__getitems__([0, 299])  # footers
            for start in range(3):
                idx = list(range(start, 300, 7))
                got = src.__getitems__(idx)
                assert [r["b"] for r in got] == [recs[i]["b"] for i in idx]
            # The records arrive, and the server is remembered: only the first batch asks
            # each shard for its ranges together (aiohttp sends a request again once when
            # a kept-alive connection drops it).
            together = [r for r in srv.range_log if r and "," in r]
            assert len(together) <= (4 if how == "reset" else 2), len(together)
        finally:
            src.close()


@pytest.mark.parametrize("status", [b"416 Range Not Satisfiable", b"501 Not Implemented"])
def test_a_server_that_refuses_several_ranges_with_an_error_is_asked_one_at_a_time(status):
    # Such servers serve each range alone; the multi-range request is an optimisation the
    # reader chose, so its refusal should not fail a read one range per request would pass.
    with Server(lambda h, ranges: _raw(h, status + b"\r\nContent-Length: 0")) as srv:
        _, got = _read(srv)
        _expect(got)


# ----------------------------------------------- unusual answers, limits, other stores
@pytest.mark.parametrize(
    "name",
    [
        "out_of_order",
        "overlapping",
        "one_part_for_two",
        "star_size",
        "preamble",
        "boundary_in_data",
        "case",
        "quoted_boundary",
        "gzip",
    ],
)
def test_unusual_but_faithful_answers_give_the_files_bytes(name):
    def answer(h, ranges):
        ctype = b"multipart/byteranges; boundary=BND"
        extra = b""
        if name == "out_of_order":
            body = _parts_body(ranges[::-1])
        elif name == "overlapping":
            body = _parts_body([(r[0] - 50, r[1]) for r in ranges] + ranges)
        elif name == "one_part_for_two":
            body = _parts_body([(ranges[0][0], ranges[1][1]), *ranges[2:]])
        elif name == "star_size":
            body = _parts_body(ranges).replace(f"/{len(DATA)}".encode(), b"/*")
        elif name == "preamble":
            body = b"This is a preamble.\r\n" + _parts_body(ranges)
        elif name == "boundary_in_data":
            b = DATA[ranges[0][0] : ranges[0][0] + 8].hex()
            body = _parts_body(ranges, boundary=b)
            ctype = b"multipart/byteranges; boundary=" + b.encode()
        elif name == "case":
            body = _parts_body(ranges).replace(b"Content-Range: bytes", b"CONTENT-range: BYTES")
            ctype = b"Multipart/ByteRanges; BOUNDARY=BND"
        elif name == "quoted_boundary":
            body = _parts_body(ranges, boundary="a b:c")
            ctype = b'multipart/byteranges; boundary="a b:c"'
        else:
            body = gzip.compress(_parts_body(ranges))
            extra = b"\r\nContent-Encoding: gzip"
        _multipart(h, body, ctype=ctype, extra=extra)

    with Server(answer) as srv:
        _, got = _read(srv)
        _expect(got)


@pytest.mark.parametrize(
    "name",
    [
        "lf_only",
        "dup_content_range",
        "single_part_not_covering",
        "huge_length",
        "wrong_size_part",
        "other_offsets",
        "no_content_type",
        "status_200_body",
        "gzip_bomb",
        "gzip_bomb_no_length",
    ],
)
def test_broken_answers_end_in_the_files_bytes_one_range_per_request(name):
    def answer(h, ranges):
        ctype = b"multipart/byteranges; boundary=BND"
        if name == "lf_only":
            _multipart(h, _parts_body(ranges, nl=b"\n"))
        elif name == "dup_content_range":
            body = _parts_body(ranges).replace(
                b"Content-Range: bytes 100-199",
                b"Content-Range: bytes 100-199/50000\r\nContent-Range: bytes 0-99",
            )
            _multipart(h, body, ctype=ctype)
        elif name == "single_part_not_covering":
            s, e = ranges[0]
            _raw(
                h,
                b"206 Partial Content\r\nContent-Range: "
                + f"bytes {s}-{e - 1}/{len(DATA)}".encode()
                + b"\r\nContent-Length: "
                + str(e - s).encode(),
                DATA[s:e],
            )
        elif name == "huge_length":
            _raw(
                h,
                b"206 Partial Content\r\nContent-Type: "
                + ctype
                + b"\r\nContent-Length: 999999999999",
            )
        elif name == "wrong_size_part":
            _multipart(h, _parts_body(ranges).replace(b"bytes 5000-5099", b"bytes 5000-5098"))
        elif name == "other_offsets":  # bytes of another place, declared honestly: no range asked
            _multipart(h, _parts_body([(s + 1, e + 1) for s, e in ranges]))
        elif name == "no_content_type":
            body = _parts_body(ranges)
            _raw(h, b"206 Partial Content\r\nContent-Length: " + str(len(body)).encode(), body)
        elif name == "status_200_body":
            _raw(h, b"200 OK\r\nContent-Length: " + str(len(DATA)).encode(), DATA)
        elif name == "gzip_bomb":
            bomb = gzip.compress(b"\0" * (200 << 20))
            _multipart(h, bomb, extra=b"\r\nContent-Encoding: gzip")
        else:  # no Content-Length: read until the connection closes
            bomb = gzip.compress(b"\0" * (200 << 20))
            _raw(
                h,
                b"206 Partial Content\r\nContent-Type: " + ctype + b"\r\nContent-Encoding: gzip",
                bomb,
            )

    with Server(answer) as srv:
        fs, got = _read(srv)
        _expect(got)
        assert inflight.multirange_servers(fs)[srv.url] is False
        assert len(srv.multi()) == 1
        # and from then on, one range per request
        srv.ranges.clear()
        _, got = _read(srv, fs=fs)
        _expect(got)
        assert srv.multi() == []


def test_a_redirect_of_a_multi_range_request_is_refused():
    hits = []

    with Server(lambda h, r: hits.append(r)) as other:

        def answer(h, ranges):
            _raw(
                h, b"302 Found\r\nLocation: " + other.url.encode() + b"/f.bin\r\nContent-Length: 0"
            )

        with Server(answer) as srv:
            _, got = _read(srv)
            assert all(isinstance(g, UnsafePathError) for g in got), got
            assert other.ranges == []


def test_a_multipart_body_that_stalls_ends_in_a_request_timeout():
    def answer(h, ranges):
        body = _parts_body(ranges)
        h.wfile.write(
            b"HTTP/1.1 206 Partial Content\r\nContent-Type: multipart/byteranges; boundary=BND"
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:300]
        )
        h.wfile.flush()
        h.server.release.wait(120)

    with Server(answer) as srv, using(RetryPolicy(request_timeout=2, read_timeout=60)):
        _, got = _read(srv)
        assert all(isinstance(g, RequestTimeout) for g in got), got
        assert all(srv.url in str(g) for g in got)
        assert all("4 ranges in one request" in str(g) for g in got), got


def test_grouping_of_duplicates_overlaps_and_many_files_maps_back_to_each_index():
    def answer(h, ranges):
        _multipart(h, _parts_body(ranges))

    with Server(answer) as srv:
        fs = _fs()
        paths, starts, ends = [], [], []
        rng = random.Random(3)
        for _ in range(400):
            f = rng.choice(["a", "b", "c"])
            s = rng.randrange(0, len(DATA) - 500)
            e = s + rng.choice([0, 1, 7, 300])
            paths.append(f"{srv.url}/{f}.bin")
            starts.append(s)
            ends.append(e)
        paths += [paths[0]] * 3
        starts += [starts[0], starts[0], starts[0] + 1]
        ends += [ends[0], ends[0] + 5, ends[0] + 5]
        got = inflight.cat_many(fs, paths, starts, ends)
        assert got == [DATA[s:e] for s, e in zip(starts, ends)]


@pytest.mark.parametrize("n, requests", [(MAX_RANGES, 1), (MAX_RANGES + 1, 2), (3 * MAX_RANGES, 3)])
def test_at_most_max_ranges_apart_go_in_one_request(n, requests):
    def answer(h, ranges):
        assert len(ranges) <= MAX_RANGES
        _multipart(h, _parts_body(ranges))

    with Server(answer) as srv:
        ranges = [(k * 100, k * 100 + 10) for k in range(n)]
        ranges += [(s + 2, e) for s, e in ranges[::5]]  # overlapping: do not count
        random.Random(1).shuffle(ranges)
        _, got = _read(srv, ranges)
        _expect(got, ranges)
        assert len(srv.ranges) == requests  # a lone 65th range goes alone
        assert max(r.count(",") for r in srv.multi()) + 1 <= MAX_RANGES


def test_s3_is_asked_one_range_per_request(moto_s3, monkeypatch):
    client, endpoint = moto_s3
    client.create_bucket(Bucket="mr-review")
    client.put_object(Bucket="mr-review", Key="f.bin", Body=DATA)
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(
        anon=False,
        key="x",
        secret="y",
        client_kwargs={"endpoint_url": endpoint},
        skip_instance_cache=True,
    )

    def forbidden(*a, **k):
        raise AssertionError("multi-range request to S3")

    monkeypatch.setattr(inflight, "_limited_ranges", forbidden)
    got = inflight.cat_many(
        fs, ["mr-review/f.bin"] * 4, [s for s, _ in RANGES], [e for _, e in RANGES]
    )
    _expect(got)


def test_a_spawned_worker_reads_over_a_multi_range_server(tmp_path):
    from tests.servers import RangeHTTPServer
    from tests.test_remote_global import global_epoch

    recs = [{"i": i, "b": DATA[i * 50 : i * 50 + 1000]} for i in range(600)]
    tg.write_array_record(recs, tmp_path / "ds", num_shards=2)
    with RangeHTTPServer(tmp_path) as srv:
        src = tg.ArrayRecordSource(f"{srv.url}/ds")
        got, order = global_epoch(src, workers=1, batch_size=100, seed=1, key="b", context="spawn")
        assert [i for i, _ in got] == order
        assert all(b == recs[i]["b"] for i, b in got)
        assert any(r and "," in r for r in srv.range_log)


def test_one_range_past_the_end_does_not_turn_multi_range_off_for_the_origin():
    # nginx leaves out the ranges past the end of the file and answers the others; the
    # range past the end is an error either way, but the server does answer several ranges.
    def answer(h, ranges):
        _multipart(h, _parts_body([r for r in ranges if r[0] < len(DATA)]))

    with Server(answer) as srv:
        ranges = [*RANGES, (len(DATA) + 10, len(DATA) + 20)]
        fs, got = _read(srv, ranges)
        _expect(got[:-1])
        assert isinstance(got[-1], BaseException)
        assert inflight.multirange_servers(fs)[srv.url] is True


def test_a_server_sending_whole_files_is_sent_one_multirange_request_per_batch():
    """Until a server has answered a multi-range request, the first is sent alone and
    the batch's other files wait for what it teaches: a server that sends whole files
    (as a store answering one range per request does) gets one such request, not one per
    file, and every range comes back as the file's bytes."""

    def answer(h, ranges):
        _raw(h, b"200 OK\r\nContent-Length: " + str(SIZE).encode(), DATA)

    with Server(answer) as srv:
        urls = [f"{srv.url}/f{k}.bin" for k in range(4) for _ in RANGES]
        starts = [s for _ in range(4) for s, _ in RANGES]
        ends = [e for _ in range(4) for _, e in RANGES]
        fs = _fs()
        got = inflight.cat_many(fs, urls, starts, ends, max_inflight=8)
        assert [bytes(g) for g in got] == [DATA[s:e] for s, e in zip(starts, ends)]
        assert len(srv.multi()) == 1, srv.multi()
        assert inflight.multirange_servers(fs) == {srv.url: False}
