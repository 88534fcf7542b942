"""Memory over a whole epoch: how much a reading process grows, against its ``cache_bytes``.

The same records (an int64 id and ``--row-bytes`` of random bytes) are written as one
Parquet file (``--row-groups`` row groups) and as one ArrayRecord file (``--group-size``
records per chunk, zstd). Each case reads one whole epoch through a stock DataLoader
(batch 256, default collate) in a fresh process:

* ``parquet-global``: ``ParquetSource`` + ``GlobalShuffleSampler``,
* ``parquet-block``: ``ParquetSource`` + ``BlockShuffleSampler(window=8)``,
* ``arrayrecord-global``: ``ArrayRecordSource`` + ``GlobalShuffleSampler``,

each with 0 and 2 DataLoader workers. A thread samples the memory of the process and of
its DataLoader workers (``/proc/PID/smaps_rollup``; workers found with psutil when it is
installed, else ``/proc/PID/task/*/children``) every ``--interval`` seconds, from just
before the first batch to the last one:

* ``uss``: private memory (Private_Clean + Private_Dirty), summed over the processes,
* ``pss``: proportional set size (shared pages divided among their sharers), summed,
* ``anon``: the anonymous part of PSS (heap, Arrow's pool), ``file``: file-backed
  (memory-mapped shards, libraries).

Growth is a sample minus the one taken before the first batch (with workers, the
workers do not exist yet: they fork from the main process, so the sum of PSS starts at
the main process's). The budget is ``cache_bytes`` per reading process (each worker has
its own cache; the main process reads when there are no workers); ``ratio`` is the peak
growth over it, and ``over`` the peak growth minus the budget: the constant docs/parquet.md
states.

Run:   python benchmarks/memory.py [--rows 200000] [--cache-mib 256] [--workers 0,2]
Small: python benchmarks/memory.py --rows 40000 --row-groups 8 --cache-mib 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import describe_machine, print_table, write_json

MIB = 1 << 20
CASES = ("parquet-global", "parquet-block", "arrayrecord-global")


# -------------------------------------------------------------------- memory
def rollup(pid: int) -> dict[str, int] | None:
    """Bytes of ``uss``, ``pss``, ``anon`` and ``file`` of one process (None if gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    kb: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kb[name] = int(parts[0])
    return {
        "uss": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024,
        "pss": kb.get("Pss", 0) * 1024,
        "anon": kb.get("Pss_Anon", 0) * 1024,
        "file": kb.get("Pss_File", 0) * 1024,
    }


def children(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        out = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
        return out


def total(pid: int) -> dict[str, int]:
    """Memory of ``pid`` and its children, summed."""
    out = {"uss": 0, "pss": 0, "anon": 0, "file": 0, "procs": 0}
    for p in [pid, *children(pid)]:
        r = rollup(p)
        if r is not None:
            for k, v in r.items():
                out[k] += v
            out["procs"] += 1
    return out


class Sampler(threading.Thread):
    """Samples :func:`total` of this process every ``interval`` seconds until stopped."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[dict[str, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        pid = os.getpid()
        while not self.done.wait(self.interval):
            self.samples.append(total(pid))


# ---------------------------------------------------------------------- data
def build(root: str, rows: int, row_groups: int, row_bytes: int, group_size: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    rng = np.random.default_rng(0)
    payload = [rng.bytes(row_bytes) for _ in range(rows)]
    ids = np.arange(rows, dtype=np.int64)
    pq_dir = os.path.join(root, "parquet")
    os.makedirs(pq_dir)
    table = pa.table({"id": pa.array(ids), "data": pa.array(payload, pa.binary())})
    pq.write_table(
        table, os.path.join(pq_dir, "data.parquet"), row_group_size=-(-rows // row_groups)
    )
    tg.write_array_record(
        ({"id": int(i), "data": payload[i]} for i in range(rows)),
        os.path.join(root, "arrayrecord"),
        group_size=group_size,
    )


# ----------------------------------------------------------------- one case
def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Read one epoch as ``spec`` says (in this fresh process); return the memory figures."""
    import numpy as np
    import torch

    import torchgrain as tg

    source, order = spec["case"].split("-")
    cache_bytes = spec["cache_mib"] * MIB
    if source == "parquet":
        src = tg.ParquetSource(os.path.join(spec["root"], "parquet"), cache_bytes=cache_bytes)
    else:
        src = tg.ArrayRecordSource(
            os.path.join(spec["root"], "arrayrecord"), cache_bytes=cache_bytes
        )
    ds = tg.Dataset(src)
    workers = spec["workers"]
    bs = spec["batch_size"]
    if order == "global":
        sampler = tg.GlobalShuffleSampler(ds, seed=0)
    else:
        sampler = tg.BlockShuffleSampler(
            ds, window=8, seed=0, batch_size=bs, num_workers=max(1, workers)
        )
    loader = torch.utils.data.DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=workers)
    n_batches = len(loader)
    seen = np.zeros(len(src), dtype=bool)
    gc.collect()
    base = total(os.getpid())
    sampler_thread = Sampler(spec["interval"])
    sampler_thread.start()
    t0 = time.perf_counter()
    end = None
    for b, batch in enumerate(loader):
        seen[batch["id"].numpy()] = True
        if b == n_batches - 1:  # the workers are still alive: the end of the epoch
            end = total(os.getpid())
    seconds = time.perf_counter() - t0
    sampler_thread.done.set()
    sampler_thread.join()
    assert seen.all(), "the epoch missed records"
    assert end is not None
    samples = [*sampler_thread.samples, end]
    key = "pss" if workers else "uss"
    peak = max(s[key] for s in samples)
    info = src.cache_info() if workers == 0 else None
    readers = max(1, workers)
    budget = readers * cache_bytes
    return {
        "case": spec["case"],
        "workers": workers,
        "measure": key,
        "base_mib": base[key] / MIB,
        "peak_growth_mib": (peak - base[key]) / MIB,
        "end_growth_mib": (end[key] - base[key]) / MIB,
        "peak_uss_growth_mib": (max(s["uss"] for s in samples) - base["uss"]) / MIB,
        "peak_anon_growth_mib": (max(s["anon"] for s in samples) - base["anon"]) / MIB,
        "peak_file_growth_mib": (max(s["file"] for s in samples) - base["file"]) / MIB,
        "budget_mib": budget / MIB,
        "ratio": (peak - base[key]) / budget,
        "over_mib": (peak - base[key] - budget) / MIB,
        "over_per_reader_mib": (peak - base[key] - budget) / MIB / readers,
        "cache_held_mib": None if info is None else info.current_bytes / MIB,
        "samples": len(samples),
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--row-groups", type=int, default=20, help="Parquet row groups")
    ap.add_argument("--row-bytes", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=16, help="ArrayRecord records per chunk")
    ap.add_argument("--cache-mib", type=int, default=256, help="cache_bytes of each source")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    ap.add_argument("--data-dir", default=None, help="where to write the data (default: tmp)")
    ap.add_argument("--no-json", action="store_true")
    ap.add_argument("--run-case", help=argparse.SUPPRESS)  # internal: one case, JSON out
    args = ap.parse_args()
    if args.run_case:
        print(json.dumps(run_case(json.loads(args.run_case))))
        return

    print(f"machine: {describe_machine()}")
    tmp = tempfile.TemporaryDirectory(prefix="tg-memory-bench-")
    root = args.data_dir or tmp.name
    if not os.path.exists(os.path.join(root, "parquet")):
        build(root, args.rows, args.row_groups, args.row_bytes, args.group_size)
    print(
        f"data: {args.rows} rows of {args.row_bytes} B, Parquet {args.row_groups} row groups, "
        f"ArrayRecord group_size {args.group_size}; cache_bytes {args.cache_mib} MiB"
    )
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        for case in args.cases.split(","):
            spec = {
                "case": case,
                "workers": workers,
                "root": root,
                "cache_mib": args.cache_mib,
                "batch_size": args.batch_size,
                "interval": args.interval,
            }
            cmd = [sys.executable, os.path.abspath(__file__), "--run-case", json.dumps(spec)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(
                f"{case:<20} workers={workers}: {row['measure']} +{row['peak_growth_mib']:.0f} "
                f"MiB peak, +{row['end_growth_mib']:.0f} at the end, budget "
                f"{row['budget_mib']:.0f} ({row['seconds']:.1f} s)",
                flush=True,
            )
            rows.append(row)
    print()
    print_table(
        rows,
        [
            "case",
            "workers",
            "measure",
            "peak_growth_mib",
            "end_growth_mib",
            "budget_mib",
            "ratio",
            "over_per_reader_mib",
            "peak_anon_growth_mib",
            "peak_file_growth_mib",
        ],
    )
    if not args.no_json:
        write_json(
            "memory",
            {
                "config": {k: v for k, v in vars(args).items() if k != "run_case"},
                "rows": rows,
            },
        )
    tmp.cleanup()


if __name__ == "__main__":
    main()
