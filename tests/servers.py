"""Real servers on 127.0.0.1 for remote-storage tests and benchmarks.

* :class:`RangeHTTPServer`: a threaded static-file HTTP server with ``Range`` support
  (what object stores give ``http(s)://`` clients), directory listings that fsspec's
  HTTP filesystem understands, per-path request counters, and injectable faults:
  a delay before every response (time-to-first-byte), the next *k* requests answered
  503, reset, or cut off in the middle of the body.
* :func:`start_moto_s3`: moto's S3-compatible server in a thread (``moto[server]``).
* :class:`FaultProxy`: an HTTP proxy in front of either (or any HTTP server) that logs
  every request and injects the faults of a hostile or broken server: stalls (before the
  headers or in the middle of a body, socket kept open), trickled bodies, bodies cut
  short, connection resets, 500/503 bursts, a ``Content-Length`` longer or shorter than
  the body, a ``Range`` ignored.

Example:
    >>> import tempfile, pathlib, urllib.request
    >>> root = tempfile.mkdtemp()
    >>> _ = pathlib.Path(root, "a.bin").write_bytes(b"0123456789")
    >>> with RangeHTTPServer(root) as srv:
    ...     req = urllib.request.Request(srv.url + "/a.bin", headers={"Range": "bytes=2-4"})
    ...     urllib.request.urlopen(req).read()
    b'234'
"""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import html
import http.client
import io
import os
import posixpath
import re
import socket
import struct
import sys
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
_RANGES = re.compile(r"bytes=(\d+-\d+(?:,\d+-\d+)*)$")

#: How :class:`RangeHTTPServer` answers a request for several ranges (its ``multirange``).
MULTIRANGE_MODES = (
    "parts",  # one part per range (nginx, Apache)
    "merge",  # one range from the first byte asked to the last
    "ignore",  # the whole file, status 200 (a server without multi-range support)
    # broken answers, each of which the client must detect:
    "short_part",  # the last part one byte short of its Content-Range
    "wrong_total",  # a part names another file size
    "shifted",  # the first part's Content-Range starts one byte later (length kept)
    "missing_part",  # the last range left out
    "extra_parts",  # every part twice
    "no_boundary",  # multipart/byteranges without a boundary
    "huge",  # 4 MiB of junk after the closing boundary
)


def _ranges(header: str, size: int) -> list[tuple[int, int]] | None:
    """The half-open ranges of a ``Range: bytes=a-b,c-d`` header (explicit ranges only)
    within a file of ``size`` bytes, or None."""
    m = _RANGES.match(header.strip())
    if m is None:
        return None
    out = []
    for spec in m.group(1).split(","):
        a, b = (int(x) for x in spec.split("-"))
        if a > b or a >= size:
            return None
        out.append((a, min(size, b + 1)))
    return out


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, like a real object store

    def log_message(self, format: str, *args: Any) -> None:  # quiet in tests
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        srv = self.server.owner
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        srv._count(self.command, rel)
        with srv._lock:
            srv.log.append((self.command, self.path))
            srv.range_log.append(self.headers.get("Range"))
        with srv._lock:
            srv._inflight += 1
            srv.max_inflight = max(srv.max_inflight, srv._inflight)
        try:
            if srv.latency_s:
                time.sleep(srv.latency_s)
            self._respond(body)
        finally:
            with srv._lock:
                srv._inflight -= 1

    def _respond(self, body: bool) -> None:
        srv = self.server.owner
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        fault = srv._take_fault()
        if fault == "503":
            self._send_plain(503, b"slow down")
            return
        if fault == "reset":
            # RST instead of FIN: the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        target = srv.redirects.get(rel)
        if target is not None and self.command in srv.redirect_methods:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        page = srv.listings.get(rel.rstrip("/") or "/")
        if page is not None:
            data = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            if srv.listing_ranges:  # a static index.html, as a CDN serves it
                self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        path = os.path.normpath(os.path.join(srv.root, rel.lstrip("/")))
        if not path.startswith(srv.root):
            self._send_plain(403, b"forbidden")
            return
        if rel.lstrip("/").startswith("forbidden"):
            self._send_plain(403, b"forbidden")
            return
        if os.path.isdir(path):
            self._listing(path, rel, body)
            return
        if not os.path.isfile(path):
            self._send_plain(404, b"not found")
            return
        st = os.stat(path)
        size = st.st_size
        # Validators as nginx writes them: ETag "<mtime hex>-<size hex>", Last-Modified.
        etag = f'"{int(st.st_mtime):x}-{size:x}"' if srv.etags else None
        modified = email.utils.formatdate(st.st_mtime, usegmt=True) if srv.etags else None
        wanted = self.headers.get("If-Match")
        if wanted is not None and srv.etags and wanted.strip() not in ("*", etag):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._validators = (etag, modified)
        ranges = _ranges(self.headers.get("Range", ""), size)
        if body and ranges is not None and len(ranges) > 1 and srv.multirange != "ignore":
            self._multipart(path, size, ranges, srv.multirange)
            return
        start, end, status = 0, size, 200
        m = _RANGE.match(self.headers.get("Range", "").strip())
        if m and srv.answer in ("whole", "first"):
            # A server that ignores Range: the whole file, or (broken) as many of its
            # first bytes as were asked for, with status 200.
            if srv.answer == "first" and m.group(1) and m.group(2):
                end = min(size, int(m.group(2)) - int(m.group(1)) + 1)
            m = None
        if m and size:
            a, b = m.group(1), m.group(2)
            if a == "":
                start, end = max(0, size - int(b)), size
            else:
                start, end = int(a), size if b == "" else min(size, int(b) + 1)
            if start >= size or start >= end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
            if srv.answer_shift and start >= srv.answer_shift:
                # Other bytes than asked, honestly named: the same length, earlier.
                start, end = start - srv.answer_shift, end - srv.answer_shift
        accepts = self.headers.get("Accept-Encoding", "")
        if body and status == 206 and srv.gzip_ranges and "gzip" in accepts:
            self._gzipped(path, start, end, size)
            return
        self.send_response(status)
        ctype = "application/json" if path.endswith(".json") else "application/octet-stream"
        if srv.content_types:
            self.send_header("Content-Type", ctype)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        self._send_validators()
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            n = end - start
            if fault == "truncate":
                n //= 2
            step = 1 << 16 if srv.rate_bytes_per_s else 1 << 20
            while n > 0:
                block = f.read(min(n, step))
                if not block:
                    break
                self.wfile.write(block)
                n -= len(block)
                if srv.rate_bytes_per_s:
                    time.sleep(len(block) / srv.rate_bytes_per_s)
        if fault == "truncate":
            self.close_connection = True

    def _gzipped(self, path: str, start: int, end: int, size: int) -> None:
        """A range compressed on the fly for a client that accepts gzip (a server or
        proxy that compresses partial content): the body is the gzip of the bytes named
        by ``Content-Range``, ``Content-Length`` the compressed length."""
        with open(path, "rb") as f:
            f.seek(start)
            data = gzip.compress(f.read(end - start))
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(data)))
        self._send_validators()
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        self.wfile.write(data)

    def _send_validators(self) -> None:
        etag, modified = getattr(self, "_validators", (None, None))
        if etag is not None:
            self.send_header("ETag", etag)
        if modified is not None:
            self.send_header("Last-Modified", modified)

    def _multipart(self, path: str, size: int, ranges: list[tuple[int, int]], mode: str) -> None:
        """Several ranges in one answer, as nginx sends them (``mode="parts"``), merged into
        one range (``"merge"``, which RFC 9110 allows), or broken in one of the ways of
        :data:`MULTIRANGE_MODES`."""
        with open(path, "rb") as f:
            data = f.read()
        if mode == "merge":
            start, end = min(s for s, _ in ranges), max(e for _, e in ranges)
            self.send_response(206)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self._send_validators()
            self.end_headers()
            self.wfile.write(data[start:end])
            return
        boundary = "00000000000000000001"
        parts = []
        for k, (start, end) in enumerate(ranges):
            first, last, total, chunk = start, end - 1, size, data[start:end]
            if mode == "short_part" and k == len(ranges) - 1:
                chunk = chunk[:-1]  # (the Content-Range still declares all of it)
            elif mode == "wrong_total" and k == 1:
                total = size + 1
            elif mode == "shifted" and k == 0:
                first, last = start + 1, end  # other bytes than it sends, same length
            elif mode == "missing_part" and k == len(ranges) - 1:
                continue
            head = (
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Range: bytes {first}-{last}/{total}\r\n\r\n"
            )
            parts.append(head.encode() + chunk)
        if mode == "extra_parts":
            parts += parts
        payload = b"".join(parts) + f"\r\n--{boundary}--\r\n".encode()
        if mode == "huge":
            payload += b"x" * (4 << 20)
        self.send_response(206)
        ctype = "multipart/byteranges"
        if mode != "no_boundary":
            ctype += f"; boundary={boundary}"
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self._send_validators()
        self.end_headers()
        self.wfile.write(payload)

    def _listing(self, path: str, rel: str, body: bool) -> None:
        base = rel if rel.endswith("/") else rel + "/"
        links = []
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            href = posixpath.join(base, urllib.parse.quote(name))
            if os.path.isdir(full):
                href += "/"
            links.append(f'<a href="{html.escape(href)}">{html.escape(name)}</a>')
        data = ("<html><body>\n" + "\n".join(links) + "\n</body></html>\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _send_plain(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    owner: Any  # the RangeHTTPServer or FaultProxy it serves for

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hang up mid-body all the time (cancelled reads, injected faults);
        # that is not a server error worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


_S = TypeVar("_S", bound="_Serving")


class _Serving:
    """A server on 127.0.0.1 in a background thread: its URL, and closing it (also as a
    context manager)."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._httpd = _Server(("127.0.0.1", 0), handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeHTTPServer(_Serving):
    """Serve ``root`` over HTTP on 127.0.0.1 in a background thread.

    Attributes you may change while it runs: ``latency_s`` (delay before each
    response), ``rate_bytes_per_s`` (throttle bodies; 0 = unlimited) and ``multirange``
    (how a request for several ranges is answered: one of :data:`MULTIRANGE_MODES`,
    default ``"parts"``, as nginx does). Use
    :meth:`fail_next` to inject faults, :attr:`requests` / :meth:`gets` to count what
    clients asked for, :attr:`log` for every ``(method, raw request path)`` in order,
    and :attr:`max_inflight` for the most requests served at once. :attr:`listings` maps
    a directory path (``"/ds"``) to the HTML page served for it (a hostile listing; with
    ``Accept-Ranges: bytes`` where :attr:`listing_ranges`, as a static page is), and
    :attr:`redirects` a path to the ``Location`` of a 302 answer.

    A file's answers carry ``ETag`` and ``Last-Modified`` as nginx writes them (from its
    modification time, in seconds, and size), and ``If-Match`` is honoured (``412``);
    ``etags=False`` sends neither and ignores ``If-Match``. Replacing a file under
    :attr:`root` while the server runs is a swapped object (each request reads the
    file afresh). How one range is answered: :attr:`answer` ``"range"`` (``206``, as
    asked), ``"whole"`` (``200`` and the whole file) or ``"first"`` (``200`` and as many
    of the file's first bytes as were asked for); :attr:`answer_shift` > 0: a ``206``
    holding the bytes that many earlier, named so in its ``Content-Range``;
    ``content_types=False``: no ``Content-Type`` on files.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        latency_s: float = 0.0,
        rate_bytes_per_s: float = 0,
        multirange: str = "parts",
    ) -> None:
        if multirange not in MULTIRANGE_MODES:
            raise ValueError(multirange)
        self.multirange = multirange
        self.answer = "range"
        self.answer_shift = 0
        self.content_types = True
        self.etags = True
        self.root = os.path.realpath(os.fspath(root))
        self.latency_s = latency_s
        self.rate_bytes_per_s = rate_bytes_per_s
        self.max_inflight = 0
        self._inflight = 0
        self.requests: Counter[tuple[str, str]] = Counter()
        self.log: list[tuple[str, str]] = []
        self.range_log: list[str | None] = []  # each request's Range header, in order
        self.listings: dict[str, str] = {}
        self.listing_ranges = False  # :attr:`listings` served with Accept-Ranges: bytes
        self.gzip_ranges = False  # a single range gzipped when the client accepts gzip
        self.redirects: dict[str, str] = {}
        self.redirect_methods = {"GET", "HEAD"}  # the methods :attr:`redirects` answer
        self._faults: list[str] = []
        self._lock = threading.Lock()
        self._serve(_Handler)

    def fail_next(self, k: int, kind: str = "503") -> None:
        """Answer the next ``k`` requests with a fault: ``"503"``, ``"reset"`` (TCP RST
        before any response) or ``"truncate"`` (headers, then half the body, then close)."""
        if kind not in ("503", "reset", "truncate"):
            raise ValueError(kind)
        with self._lock:
            self._faults.extend([kind] * k)

    def pending_faults(self) -> int:
        with self._lock:
            return len(self._faults)

    def _take_fault(self) -> str | None:
        with self._lock:
            return self._faults.pop(0) if self._faults else None

    def _count(self, method: str, path: str) -> None:
        with self._lock:
            self.requests[(method, path)] += 1

    def gets(self, path: str | None = None) -> int:
        """GET requests served (for one path, or in total)."""
        with self._lock:
            if path is None:
                return sum(v for (m, _), v in self.requests.items() if m == "GET")
            return self.requests[("GET", path)]

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.log.clear()
            self.range_log.clear()
            self.max_inflight = 0


def start_moto_s3() -> tuple[Any, str]:
    """Start moto's S3 server on a free port of 127.0.0.1; returns ``(server, endpoint)``.

    Sets dummy AWS credentials in the environment (moto accepts any), so that boto3,
    s3fs and forked/spawned workers all find them.
    """
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- fault proxy
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    }
)
FAULTS = (
    "stall",
    "stall_headers",
    "trickle",
    "truncate",
    "reset",
    "status",
    "longer",
    "shorter",
    "ignore_range",
    "flood",
    "no_length",
    "garbled",
)


class _Fault:
    def __init__(
        self,
        kind: str,
        times: int | None,
        match: str,
        method: str | None,
        skip: int,
        params: dict[str, Any],
    ) -> None:
        self.kind, self.times, self.match, self.method = kind, times, match, method
        self.skip, self.params = skip, params
        self.hits = 0


class _ProxyHandler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._proxy()

    def do_HEAD(self) -> None:
        self._proxy()

    def do_PUT(self) -> None:
        self._proxy()

    def do_POST(self) -> None:
        self._proxy()

    def do_DELETE(self) -> None:
        self._proxy()

    def _proxy(self) -> None:
        proxy: FaultProxy = self.server.owner
        proxy._record(self.command, self.path)
        n = int(self.headers.get("Content-Length") or 0)
        request_body = self.rfile.read(n) if n else None
        fault = proxy._take(self.command, self.path)
        kind = fault.kind if fault is not None else None
        if kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if kind == "stall_headers":
            proxy._release.wait(600)  # the request is read; nothing is ever answered
            self.close_connection = True
            return
        if kind == "status":
            code = fault.params.get("code", 503)
            data = f"injected {code}".encode().ljust(fault.params.get("size", 0), b" ")
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            return
        if kind == "garbled":
            line = fault.params.get("line", "HTTP/1.1 2OO OK")
            self.wfile.write(f"{line}\r\nContent-Length: x1\r\n\r\nnot http".encode())
            self.close_connection = True
            return
        if kind == "flood" and self.command == "GET":
            p = fault.params
            self._flood(
                proxy,
                p.get("length"),
                p.get("total", 1 << 30),
                p.get("content_type", "application/octet-stream"),
            )
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if kind == "ignore_range":
            headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        conn = http.client.HTTPConnection(proxy._host, proxy._port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            if request_body is not None:
                conn.putheader("Content-Length", str(len(request_body)))
            conn.endheaders(request_body)
            resp = conn.getresponse()
            status, reason = resp.status, resp.reason
            resp_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
            declared = resp.getheader("Content-Length")
            data = resp.read()
        finally:
            conn.close()
        length = len(data)
        if self.command == "HEAD" and declared is not None:
            length = int(declared)  # a HEAD answer has no body, only the length
        if kind == "longer":
            length += fault.params.get("extra", 100)
        elif kind == "shorter":
            length = max(0, length - fault.params.get("missing", max(1, length // 2)))
        self.send_response(status, reason)
        for k, v in resp_headers:
            self.send_header(k, v)
        if kind == "no_length":
            self.send_header("Connection", "close")  # the body ends when the socket does
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        if kind == "shorter":
            data = data[:length]
        if kind == "stall":
            self.wfile.write(data[: fault.params.get("after", len(data) // 2)])
            self.wfile.flush()
            proxy._release.wait(600)  # headers and part of the body sent; socket kept open
            self.close_connection = True
            return
        if kind == "truncate":
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        if kind == "trickle":
            step, pause = fault.params.get("step", 1), fault.params.get("pause", 0.2)
            for i in range(0, len(data), step):
                self.wfile.write(data[i : i + step])
                self.wfile.flush()
                if proxy._release.wait(pause):
                    break
            self.close_connection = True
            return
        self.wfile.write(data)
        if kind == "longer":
            if fault.params.get("close", True):
                self.close_connection = True  # fewer bytes than promised, then FIN
            else:
                proxy._release.wait(600)  # fewer bytes than promised, then silence
                self.close_connection = True

    def _flood(self, proxy: FaultProxy, length: int | None, total: int, content_type: str) -> None:
        """A 200 answer whatever the ``Range``: ``total`` zero bytes (declared as
        ``length``, or chunked when None), counted in ``proxy.flooded`` as they go out."""
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        block = bytes(1 << 16)
        frame = b"%x\r\n%s\r\n" % (len(block), block) if length is None else block
        self.close_connection = True
        try:
            for _ in range(total // len(block)):
                if proxy._release.is_set():
                    return
                self.wfile.write(frame)
                with proxy._lock:
                    proxy.flooded += len(block)
        except OSError:
            pass  # the client hung up: what it wanted


class FaultProxy(_Serving):
    """A logging, fault-injecting HTTP proxy on 127.0.0.1 in front of ``upstream`` (a
    :class:`RangeHTTPServer`'s or moto's URL; S3 clients use :attr:`url` as their
    ``endpoint_url``).

    :meth:`inject` queues a fault for the requests whose path contains ``match`` (and of
    ``method``, when given), ``times`` times (``None``: every one), after letting the
    first ``skip`` of them through. Kinds:

    * ``"stall"``: headers and the first ``after`` body bytes (default half), then
      nothing, the socket held open; ``"stall_headers"``: nothing at all;
    * ``"trickle"``: the body ``step`` bytes every ``pause`` seconds (default 1 / 0.2 s);
    * ``"truncate"``: half the body, then the connection closed;
    * ``"reset"``: a TCP reset instead of an answer;
    * ``"status"``: an error answer (``code``, default 503), its body padded to ``size``
      bytes;
    * ``"longer"``: a ``Content-Length`` ``extra`` bytes (default 100) above the body,
      then the connection closed (``close=False``: held open);
    * ``"shorter"``: a ``Content-Length`` (and body) ``missing`` bytes short (default half);
    * ``"ignore_range"``: the ``Range`` header dropped (the whole file comes back);
    * ``"flood"``: a GET answered 200 with ``total`` zero bytes (default 1 GiB) whatever
      it asked for, declared as ``length`` (default: chunked, no length), of
      ``content_type``; the bytes that went out before the client hung up are counted
      in :attr:`flooded`;
    * ``"no_length"``: the answer without a ``Content-Length`` (the body, if any, ends
      when the connection closes), so that the client learns no size from it;
    * ``"garbled"``: an answer no HTTP parser accepts (a status line of ``line``, default
      ``HTTP/1.1 2OO OK``, and a ``Content-Length`` that is no number), then the connection
      closed: a broken proxy or a flipped bit on the way.

    :attr:`log` holds every ``(method, raw path)`` the proxy was asked for, faulty or not.

    Example:
        >>> import tempfile, pathlib, urllib.request
        >>> root = tempfile.mkdtemp()
        >>> _ = pathlib.Path(root, "a.bin").write_bytes(b"0123456789")
        >>> with RangeHTTPServer(root) as srv, FaultProxy(srv.url) as proxy:
        ...     proxy.inject("status", times=1, code=500)
        ...     try:
        ...         urllib.request.urlopen(proxy.url + "/a.bin")
        ...     except urllib.error.HTTPError as e:
        ...         print(e.code)
        ...     urllib.request.urlopen(proxy.url + "/a.bin").read(), proxy.log
        500
        (b'0123456789', [('GET', '/a.bin'), ('GET', '/a.bin')])
    """

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self.log: list[tuple[str, str]] = []
        self.flooded = 0
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._serve(_ProxyHandler)

    def inject(
        self,
        kind: str,
        *,
        times: int | None = 1,
        match: str = "",
        method: str | None = None,
        skip: int = 0,
        **params: Any,
    ) -> None:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; known: {FAULTS}")
        with self._lock:
            self._faults.append(_Fault(kind, times, match, method, skip, params))

    def clear(self) -> None:
        """Drop the queued faults (stalled connections stay stalled until :meth:`close`)
        and zero :attr:`flooded`."""
        with self._lock:
            self._faults.clear()
            self.flooded = 0

    def hits(self) -> int:
        """Requests that received a fault so far."""
        with self._lock:
            return sum(f.hits for f in self._faults)

    def paths(self, method: str | None = None) -> list[str]:
        """The request paths logged (without the query), percent-decoded once."""
        with self._lock:
            return [
                urllib.parse.unquote(urllib.parse.urlsplit(p).path)
                for m, p in self.log
                if method is None or m == method
            ]

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.log.append((method, path))

    def _take(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.times is not None and f.hits >= f.times:
                    continue
                if f.match not in urllib.parse.unquote(path) or (
                    f.method is not None and f.method != method
                ):
                    continue
                if f.skip > 0:
                    f.skip -= 1  # let this one through untouched
                    return None
                f.hits += 1
                return f
        return None

    def close(self) -> None:
        self._release.set()  # stalled answers end
        super().close()


# ------------------------------------------------------------------- S3 listing pages
def s3_listing_server(page: Any) -> tuple[ThreadingHTTPServer, str, list[int]]:
    """An S3 endpoint whose ``n``-th listing page (from 1) is ``page(n)`` (an XML text;
    every other request a 404); returns ``(server, url, [pages served])``."""
    served = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            if "list-type=2" not in self.path:
                return self.do_HEAD()
            served[0] += 1
            body = page(served[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", served


def s3_listing_page(n: int, token: str, truncated: bool = True) -> str:
    """Listing page ``n`` of bucket ``bkt`` under ``ds/``: one key, ``ds/x<n>.array_record``,
    and ``token`` as its continuation token (none when empty)."""
    more = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        "<Name>bkt</Name><Prefix>ds/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
        f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{more}"
        f"<Contents><Key>ds/x{n}.array_record</Key><LastModified>2020-01-01T00:00:00.000Z"
        '</LastModified><ETag>"a"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass>'
        "</Contents></ListBucketResult>"
    )


def parquet_bytes(rows: int) -> bytes:
    """A Parquet file of one int column ``x`` holding ``0..rows-1``, as bytes (an object
    to put in a bucket)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(rows))}), buf)
    return buf.getvalue()


def parquet_column(url: str) -> list[int]:
    """Column ``x`` of every record of the Parquet dataset at ``url``, sorted."""
    import torchgrain as tg

    src = tg.ParquetSource(url)
    try:
        return sorted(int(src[i]["x"]) for i in range(len(src)))
    finally:
        src.close()


def make_bucket(client: Any, name: str) -> str:
    """Bucket ``name`` on the S3 server ``client`` talks to (made unless it exists)."""
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=name)
    return name
