"""Real servers on 127.0.0.1 for remote-storage tests and benchmarks.

* :class:`RangeHTTPServer`: a threaded static-file HTTP server with ``Range`` support
  (what object stores give ``http(s)://`` clients), directory listings that fsspec's
  HTTP filesystem understands, per-path request counters, and injectable faults:
  a delay before every response (time-to-first-byte), the next *k* requests answered
  503, reset, or cut off in the middle of the body.
* :func:`start_moto_s3`: moto's S3-compatible server in a thread (``moto[server]``).

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

import html
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
from typing import Any

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


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
        size = os.path.getsize(path)
        start, end, status = 0, size, 200
        m = _RANGE.match(self.headers.get("Range", "").strip())
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
        self.send_response(status)
        ctype = "application/json" if path.endswith(".json") else "application/octet-stream"
        self.send_header("Content-Type", ctype)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
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
    owner: RangeHTTPServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hang up mid-body all the time (cancelled reads, injected faults);
        # that is not a server error worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class RangeHTTPServer:
    """Serve ``root`` over HTTP on 127.0.0.1 in a background thread.

    Attributes you may change while it runs: ``latency_s`` (delay before each
    response) and ``rate_bytes_per_s`` (throttle bodies; 0 = unlimited). Use
    :meth:`fail_next` to inject faults, :attr:`requests` / :meth:`gets` to count what
    clients asked for, and :attr:`max_inflight` for the most requests served at once.
    """

    def __init__(
        self, root: str | os.PathLike, *, latency_s: float = 0.0, rate_bytes_per_s: float = 0
    ) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.latency_s = latency_s
        self.rate_bytes_per_s = rate_bytes_per_s
        self.max_inflight = 0
        self._inflight = 0
        self.requests: Counter[tuple[str, str]] = Counter()
        self._faults: list[str] = []
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

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
            self.max_inflight = 0

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> RangeHTTPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
