"""Remote reads under hostile or merely unusual servers: a directory listing's links
and a server's validators, each against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq

import torchgrain as tg
from tests import servers
from tests.servers import RangeHTTPServer
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import remote
from torchgrain.io.fs import get_filesystem
from torchgrain.io.retry import RetryPolicy, retry_call, using


class _LastModifiedOnly(servers._Handler):
    """A file server that sends ``Last-Modified`` and no ``ETag`` (Python's
    ``http.server``, many static servers and CDNs configured without ETags)."""

    def _send_validators(self) -> None:
        _, modified = getattr(self, "_validators", (None, None))
        if modified is not None:
            self.send_header("Last-Modified", modified)


class _LastModifiedServer(RangeHTTPServer):
    def _serve(self, handler: type) -> None:
        super()._serve(_LastModifiedOnly)


def test_a_listed_file_whose_name_starts_with_http_is_read(tmp_path):
    """A directory listing with relative links (nginx's autoindex, Apache's, Python's
    ``http.server``) naming ``https_logs.parquet`` beside ``a.parquet``: both files are
    the dataset's. The file named ``http...`` was silently left out (its rows lost), as
    if it were a link to another site."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.table({"x": [3, 4]}), tmp_path / "ds" / "https_logs.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            '<html><body>\n<a href="a.parquet">a.parquet</a>\n'
            '<a href="https_logs.parquet">https_logs.parquet</a>\n</body></html>\n'
        )
        src = tg.ParquetSource(srv.url + "/ds/")
        try:
            assert sorted(src[i]["x"] for i in range(len(src))) == [1, 2, 3, 4]
        finally:
            src.close()


def test_a_tfrecord_file_re_uploaded_on_a_server_without_etags_is_indexed_anew(tmp_path):
    """A TFRecord file served with ``Last-Modified`` and no ``ETag``, re-uploaded with the
    same size and other records (a new ``Last-Modified``), then opened again: its kept
    index was built for the old version and must not be used. It was (the version
    stamp was empty), so the new opening counted the old file's 2 records, not the 3
    the file holds, and reading them failed."""
    (tmp_path / "ds").mkdir()
    path = tmp_path / "ds" / "a.tfrecord"
    write_tfrecord([b"A" * 30, b"B" * 10], path)
    os.utime(path, (1_600_000_000, 1_600_000_000))
    index_dir = str(tmp_path / "index")
    with _LastModifiedServer(tmp_path) as srv:
        url = srv.url + "/ds/a.tfrecord"
        first = tg.TFRecordSource(url, codec="raw", index_dir=index_dir)
        assert [first[i]["bytes"] for i in range(len(first))] == [b"A" * 30, b"B" * 10]
        first.close()
        size = os.path.getsize(path)
        write_tfrecord([b"C" * 10, b"D" * 4, b"E" * 10], path)  # the same size, 3 records
        assert os.path.getsize(path) == size
        os.utime(path, (1_600_000_900, 1_600_000_900))  # a new Last-Modified
        again = tg.TFRecordSource(url, codec="raw", index_dir=index_dir)
        try:
            assert len(again) == 3
            assert [again[i]["bytes"] for i in range(3)] == [b"C" * 10, b"D" * 4, b"E" * 10]
        finally:
            again.close()


class _TwoContentRanges(BaseHTTPRequestHandler):
    """Answers a range request with a ``206`` holding the file's first bytes, under two
    ``Content-Range`` headers: the range asked first, then the bytes it holds (a proxy
    that adds its own header beside its upstream's)."""

    protocol_version = "HTTP/1.1"
    data = bytes(range(256)) * 16

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(self.data)))
        self.end_headers()

    def do_GET(self) -> None:
        first, last = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        size, n = len(self.data), last - first + 1
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Range", f"bytes 0-{n - 1}/{size}")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        self.wfile.write(self.data[:n])


def test_a_range_answer_with_two_content_ranges_is_never_taken_for_the_range(tmp_path):
    """A ``206`` with two ``Content-Range`` headers (a field that may appear once), the
    first naming the bytes asked for, the second the file's first bytes, which its body
    holds: it says of itself that it holds other bytes, and is refused (retried, then a
    ``RemoteIOError`` naming the URL). It was taken for the range: bytes 0-99 handed over
    as bytes 1000-1099, without an error."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TwoContentRanges)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/f.bin"
    policy = RetryPolicy(attempts=2, base_delay=0.01, request_timeout=5, deadline=10)
    try:
        with using(policy):
            fs, path = get_filesystem(url, {"skip_instance_cache": True})
        try:
            got = retry_call(
                lambda: remote.cat_file(fs, path, 1000, 1100, url=url), url=url, policy=policy
            )
        except tg.RemoteIOError as e:
            assert url in str(e)
        else:
            assert bytes(got) == _TwoContentRanges.data[1000:1100]
    finally:
        server.shutdown()
        server.server_close()
