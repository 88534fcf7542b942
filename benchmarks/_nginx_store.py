"""A compiled HTTP object store for benchmarks: nginx with Range support and latency.

The asyncio store (``benchmarks/_fast_store.py``) answers a few thousand requests/s on
this machine's shared cores; a benchmark whose bound is higher than that measures the
store. nginx (Debian: ``apt-get install nginx-core libnginx-mod-http-lua``) serves the
same files at tens of thousands of requests/s, and its Lua module adds the latency with a
timer (``ngx.sleep``: no thread or process waits). It offers the asyncio store's control
paths, so a benchmark can use either: ``/__latency?s=0.03``, ``/__rate?bps=50e6`` (each
response's bandwidth, nginx's ``limit_rate``), ``/__stats`` (requests and body bytes
served, as JSON) and ``/__reset``.

Example:
    >>> if available():  # doctest: +SKIP
    ...     proc, url = start("/data")
    ...     proc.kill()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

MODULES = "/usr/lib/nginx/modules"

_CONF = """
load_module {modules}/ndk_http_module.so;
load_module {modules}/ngx_http_lua_module.so;
{user}
worker_processes 1;
daemon off;
pid {run}/nginx.pid;
error_log {run}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  client_body_temp_path {run}/body;
  proxy_temp_path {run}/proxy;
  fastcgi_temp_path {run}/fastcgi;
  uwsgi_temp_path {run}/uwsgi;
  scgi_temp_path {run}/scgi;
  lua_shared_dict store 1m;
  {max_ranges}
  server {{
    listen 127.0.0.1:{port};
    root {root};
    autoindex on;
    location / {{
      access_by_lua_block {{
        local d = ngx.shared.store
        local rate = d:get("rate") or 0
        if rate > 0 then ngx.var.limit_rate = tostring(rate) end
        local s = d:get("latency") or 0
        if s > 0 then ngx.sleep(s) end
      }}
      log_by_lua_block {{
        local d = ngx.shared.store
        d:incr("requests", 1, 0)
        d:incr("body_bytes", tonumber(ngx.var.body_bytes_sent) or 0, 0)
      }}
    }}
    location = /__latency {{
      content_by_lua_block {{ ngx.shared.store:set("latency", tonumber(ngx.var.arg_s)); ngx.say("ok") }}
    }}
    location = /__rate {{
      content_by_lua_block {{ ngx.shared.store:set("rate", math.floor(tonumber(ngx.var.arg_bps))); ngx.say("ok") }}
    }}
    location = /__reset {{
      content_by_lua_block {{
        ngx.shared.store:set("requests", 0); ngx.shared.store:set("body_bytes", 0); ngx.say("ok")
      }}
    }}
    location = /__stats {{
      default_type application/json;
      content_by_lua_block {{
        local d = ngx.shared.store
        ngx.say(string.format('{{"requests": %d, "body_bytes": %d}}',
          d:get("requests") or 0, d:get("body_bytes") or 0))
      }}
    }}
  }}
}}
"""


def available() -> bool:
    """Whether nginx and its Lua module are installed.

    Example:
        >>> isinstance(available(), bool)
        True
    """
    return shutil.which("nginx") is not None and os.path.exists(
        os.path.join(MODULES, "ngx_http_lua_module.so")
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Nginx(subprocess.Popen):
    """The nginx master, leader of its own process group: :meth:`kill` ends it and its
    workers (killing the master alone leaves the workers serving), and removes its
    configuration and logs."""

    run_dir: str | None = None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.wait()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def start(root: str, *, max_ranges: int | None = None) -> tuple[subprocess.Popen, str]:
    """Serve ``root`` with nginx on 127.0.0.1; returns ``(process, url)``: ``kill()``
    stops nginx, workers included, and removes its configuration and logs (kept in a
    temporary directory while it runs). ``max_ranges=1``: a request for several ranges
    is answered with the whole file (nginx's ``max_ranges``), as a store that answers one
    range per request does."""
    run = tempfile.mkdtemp(prefix="tg-nginx-")
    port = _free_port()
    conf = os.path.join(run, "nginx.conf")
    with open(conf, "w") as f:
        # Started as root, nginx would serve as "nobody", who cannot read a private
        # temporary directory: its workers keep this user.
        user = "user root root;" if os.geteuid() == 0 else ""
        root = os.path.realpath(root)
        limit = "" if max_ranges is None else f"max_ranges {int(max_ranges)};"
        f.write(
            _CONF.format(
                modules=MODULES, run=run, port=port, root=root, user=user, max_ranges=limit
            )
        )
    proc = _Nginx(
        ["nginx", "-c", conf, "-p", run],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the workers go with it
    )
    proc.run_dir = run
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{url}/__reset", timeout=5) as r:
                r.read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"nginx did not start: {err[-2000:]}") from None
            time.sleep(0.05)


def set_speed(url: str, latency_s: float, rate_bytes_per_s: float) -> None:
    """Give the store at ``url`` (this module's nginx, or ``_common.start_http_store``'s
    server) a latency per request and a bandwidth, through its control paths."""
    for control in (f"__latency?s={latency_s}", f"__rate?bps={rate_bytes_per_s}"):
        with urllib.request.urlopen(f"{url}/{control}", timeout=30) as r:
            r.read()
