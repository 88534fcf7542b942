"""A cheap HTTP object store for benchmarks: asyncio, Range support, injected latency.

The threaded test server (``tests/servers.py``) costs a thread and several writes per
request and answers a client that sends the next request on a kept-alive connection
only after a delayed-ACK wait (~40 ms): it, not the client, would be what a benchmark
measures. This one runs in a process of its own, on one event loop, answers each request
with one write (``TCP_NODELAY``), serves files from memory maps, and adds its latency
with a timer (no thread per waiting request). It understands what fsspec's HTTP
filesystem and a plain client send: ``GET``/``HEAD`` with an optional
``Range: bytes=a-b``, and ``GET`` of a directory (an HTML page of links).

Control paths: ``/__latency?s=0.03`` sets the latency, ``/__rate?bps=50e6`` a bandwidth
per response (its body is sent that much later: object stores cap each connection), ``/__stats`` returns the counts
(requests, body bytes) as JSON, ``/__reset`` zeroes them.

Run:  python benchmarks/_fast_store.py ROOT [--port 0]   (prints its URL, then serves)
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import mmap
import os
import re
import socket
import urllib.parse

_RANGE = re.compile(rb"bytes=(\d+)-(\d*)")


class _Store:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.latency = 0.0
        self.rate = 0.0  # bytes/s per response; 0: no cap
        self.maps: dict[str, memoryview] = {}
        self.requests = 0
        self.body_bytes = 0

    def view(self, rel: str) -> memoryview | None:
        v = self.maps.get(rel)
        if v is None:
            path = os.path.realpath(os.path.join(self.root, rel.lstrip("/")))
            if not path.startswith(self.root) or not os.path.isfile(path):
                return None
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                v = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b"")
            self.maps[rel] = v
        return v

    def answer(self, method: bytes, target: bytes, headers: dict[bytes, bytes]) -> bytes:
        url = urllib.parse.urlsplit(target.decode())
        rel = urllib.parse.unquote(url.path)
        if rel == "/__latency":
            self.latency = float(urllib.parse.parse_qs(url.query)["s"][0])
            return _reply(200, b"ok")
        if rel == "/__rate":
            self.rate = float(urllib.parse.parse_qs(url.query)["bps"][0])
            return _reply(200, b"ok")
        if rel == "/__stats":
            return _reply(
                200, json.dumps({"requests": self.requests, "body_bytes": self.body_bytes}).encode()
            )
        if rel == "/__reset":
            self.requests = self.body_bytes = 0
            return _reply(200, b"ok")
        self.requests += 1
        full = os.path.join(self.root, rel.lstrip("/"))
        if os.path.isdir(full):
            base = rel if rel.endswith("/") else rel + "/"
            links = "".join(
                f'<a href="{html.escape(base + n)}">{html.escape(n)}</a>\n'
                for n in sorted(os.listdir(full))
            )
            return _reply(200, links.encode(), "text/html", head=method == b"HEAD")
        v = self.view(rel)
        if v is None:
            return _reply(404, b"not found")
        m = _RANGE.fullmatch(headers.get(b"range", b""))
        if m is None:
            body = v if method == b"GET" else None
            self.body_bytes += len(v) if body is not None else 0
            return _reply(200, body, length=len(v))
        a = int(m[1])
        b = min(int(m[2]) if m[2] else len(v) - 1, len(v) - 1)
        if a >= len(v):
            return _reply(416, b"")
        extra = f"Content-Range: bytes {a}-{b}/{len(v)}\r\n"
        body = v[a : b + 1] if method == b"GET" else None
        self.body_bytes += b + 1 - a if body is not None else 0
        return _reply(206, body, extra=extra, length=b + 1 - a)


def _reply(
    status: int,
    body: bytes | memoryview | None,
    ctype: str = "application/octet-stream",
    *,
    extra: str = "",
    length: int | None = None,
    head: bool = False,
) -> bytes:
    n = len(body) if length is None and body is not None else (length or 0)
    reason = {200: "OK", 206: "Partial Content", 404: "Not Found", 416: "Range Not Satisfiable"}
    top = (
        f"HTTP/1.1 {status} {reason.get(status, 'OK')}\r\nContent-Length: {n}\r\n"
        f"Content-Type: {ctype}\r\nAccept-Ranges: bytes\r\n{extra}\r\n"
    ).encode()
    return top if body is None or head else top + bytes(body)


class _Connection(asyncio.Protocol):
    def __init__(self, store: _Store) -> None:
        self.store = store
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        # Replies leave in request order: number -> reply, once due.
        self.ready: dict[int, bytes] = {}
        self.taken = self.sent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            method, target, _ = lines[0].split(b" ", 2)
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
            control = target.startswith(b"/__")
            reply = self.store.answer(method, target, headers)
            slot = self.taken
            self.taken += 1
            delay = 0.0 if control else self.store.latency
            if self.store.rate and not control:
                delay += len(reply) / self.store.rate
            loop = asyncio.get_running_loop()
            if delay > 0:
                loop.call_later(delay, self._due, slot, reply)
            else:
                self._due(slot, reply)

    def _due(self, slot: int, reply: bytes) -> None:
        self.ready[slot] = reply
        while self.sent in self.ready:
            out = self.ready.pop(self.sent)
            self.sent += 1
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def _serve(root: str, port: int) -> None:
    store = _Store(root)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(store), "127.0.0.1", port, backlog=1024)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    asyncio.run(_serve(a.root, a.port))


if __name__ == "__main__":
    main()
