"""Shared helpers for the benchmark scripts: machine description, ratio tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict[str, Any]:
    """Cores, memory and versions of the machine a benchmark ran on."""
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def describe_machine() -> str:
    m = machine()
    gpu = f", GPU {m['cuda']}" if m.get("cuda") else ", no GPU"
    return (
        f"{m['cpu_count']} cores, {m['mem_gib']} GiB RAM{gpu}, Python {m['python']}, "
        f"torch {m.get('torch', '?')}"
    )


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print rows as an aligned text table (floats formatted compactly)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v == 0 or abs(v) >= 100:
                return f"{v:,.0f}"
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(name: str, payload: dict[str, Any]) -> str:
    """Write ``benchmarks/results/NAME.json`` with the machine description added."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    doc = {"benchmark": name, "machine": machine(), "argv": sys.argv[1:], **payload}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"wrote {path}")
    return path


def _serve_forever(root: str, latency_s: float, rate: float, q: Any) -> None:
    from tests.servers import RangeHTTPServer

    srv = RangeHTTPServer(root, latency_s=latency_s, rate_bytes_per_s=rate)
    q.put(srv.url)
    while True:
        time.sleep(3600)


def start_http_store(root: str, latency_s: float, rate_bytes_per_s: float) -> tuple[str, Any]:
    """Serve ``root`` over HTTP with Range support from a process of its own, adding
    ``latency_s`` before every response and capping each connection's bandwidth (an
    object store's behaviour); returns ``(url, process)``: ``process.kill()`` stops it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve_forever, args=(root, latency_s, rate_bytes_per_s, q))
    proc.daemon = True
    proc.start()
    return q.get(timeout=60), proc
