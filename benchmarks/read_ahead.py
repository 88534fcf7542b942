"""First epoch from a slow object store: shard read-ahead on vs off vs local disk.

A local HTTP server with Range support (a process of its own) adds a fixed delay to
every request and caps each connection's bandwidth, like an object store: nginx with its
Lua module when installed (``benchmarks/_nginx_store.py``; it costs the shared cores
little), else the threaded test server (``--store`` picks). An ArrayRecord
dataset (default 200,000 records of 1 KiB in 64 shards, about 3.3 MB each) is read for
one whole epoch through a DataLoader (default 2 workers, batch 256), with a shard cache
(``cache_dir``) a third of the dataset's size, so shards are evicted and fetched again
within the epoch:

* ``local``: the same files on local disk (the reference);
* ``remote, read-ahead off``: ``read_ahead_bytes=0``: each shard is downloaded when a
  worker first needs it;
* ``remote, read-ahead on``: the default: the sampler's order is walked ahead of the
  loader and up to half the cache's budget of shards is downloaded in the background,
  ``io_threads`` (8) at a time; ``4 downloads``: the same with ``io_threads=4``;
* ``remote, byte ranges, global``: for reference, a global shuffle that reads the
  records' byte ranges (no shard cache, ``io_threads=8``).

The block-shuffle rows use ``BlockShuffleSampler`` with the shards as blocks and
``--window`` of them shuffled together; the shuffle each row gives is reported as the mean
number of distinct 2,048-record runs (in write order) per batch (uniform: about 120 for
batches of 256 over 200,000 records). Each measurement runs in a fresh process (cold
workers, empty cache); rounds are interleaved; ratios are medians of per-round ratios.
Target: read-ahead >= 0.8x the local-disk rate.

Run:  python benchmarks/read_ahead.py [--latency-ms 30] [--mbps 50] [--rounds 3]
      python benchmarks/read_ahead.py --quick
Writes benchmarks/results/read_ahead.json (nginx) or read_ahead_threaded.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import describe_machine, print_table, start_http_store, write_json

RUN = 2048  # records per run of write order, for the shuffle measure
MODES = ("local", "off", "on4", "on", "global")
LABELS = {
    "local": "local disk, block shuffle",
    "off": "remote, read-ahead off",
    "on4": "remote, read-ahead, 4 downloads",
    "on": "remote, read-ahead on (8 downloads)",
    "global": "remote, byte ranges, global shuffle",
}


def _one(mode: str, where: str, cache: str, budget: int, args: argparse.Namespace) -> dict:
    """One epoch in this (fresh) process; the labels of every batch are checked."""
    import torch

    import torchgrain as tg

    if mode == "local":
        src = tg.ArrayRecordSource(where)
    elif mode == "global":
        src = tg.ArrayRecordSource(where, io_threads=8)
    else:
        src = tg.ArrayRecordSource(
            where,
            cache_dir=cache,
            cache_dir_bytes=budget,
            read_ahead_bytes=0 if mode == "off" else None,
            io_threads=4 if mode == "on4" else 8,  # concurrent downloads of the read-ahead
        )
    ds = tg.Dataset(src)
    if mode == "global":
        sampler = tg.GlobalShuffleSampler(ds, seed=0)
    else:
        sampler = tg.BlockShuffleSampler(
            ds, seed=0, window=args.window, block_offsets=src.index.offsets
        )
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        multiprocessing_context="fork" if args.workers else None,
        collate_fn=lambda records: np.array([r["label"] for r in records]),
    )
    limit = args.global_batches if mode == "global" else None
    t0 = time.perf_counter()
    first, seen, runs = None, [], []
    for k, labels in enumerate(loader):
        if first is None:
            first = time.perf_counter() - t0
        seen.append(labels)
        runs.append(len(np.unique(labels // RUN)))
        if limit is not None and k + 1 >= limit:
            break
    seconds = time.perf_counter() - t0
    got = np.concatenate(seen)
    if limit is None and not np.array_equal(np.sort(got), np.arange(len(src))):
        raise AssertionError(f"{mode}: the epoch did not deliver every record once")
    stats = src.cache.stats if src.cache is not None else {}
    return {
        "records/s": len(got) / seconds,
        "first batch s": first,
        "runs per batch": float(np.mean(runs)),
        "downloads": stats.get("misses", 0),
    }


def _measure(mode: str, where: str, cache: str, budget: int, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--one", mode, where, cache, str(budget)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--mbps", type=float, default=50.0, help="per-connection MB/s")
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--record-bytes", type=int, default=1024)
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--window", type=int, default=4, help="shards shuffled together")
    p.add_argument("--global-batches", type=int, default=40, help="batches timed (global)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="20,000 records, 1 round")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    p.add_argument(
        "--store",
        choices=("auto", "nginx", "threaded"),
        default="auto",
        help="nginx with its Lua module (auto: when installed) or the threaded test server",
    )
    args = p.parse_args()
    if args.store == "auto":
        from benchmarks import _nginx_store

        args.store = "nginx" if _nginx_store.available() else "threaded"
    if args.quick:
        args.records, args.shards, args.rounds = 20_000, 16, 1
    if args.one:
        mode, where, cache, budget = args.one
        print(json.dumps(_one(mode, where, cache, int(budget), args)))
        return
    argv = [a for a in sys.argv[1:] if a != "--quick"]
    argv += ["--records", str(args.records), "--shards", str(args.shards)]

    import torchgrain as tg

    print(describe_machine())
    work = tempfile.mkdtemp(prefix="tg-bench-read-ahead-")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    server = None
    try:
        rng = np.random.default_rng(0)
        blob = rng.integers(0, 255, args.record_bytes, dtype=np.uint8)
        data = os.path.join(work, "ds")

        class Records:  # sized: shard k holds a contiguous run of labels (write order)
            def __len__(self) -> int:
                return args.records

            def __iter__(self):
                for i in range(args.records):
                    yield {"x": np.roll(blob, i), "label": i}

        tg.write_array_record(Records(), data, num_shards=args.shards)
        total = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))
        if args.store == "nginx":
            from benchmarks import _nginx_store

            server, url = _nginx_store.start(work)
            _nginx_store.set_speed(url, args.latency_ms / 1000, args.mbps * 1e6)
        else:
            url, server = start_http_store(work, args.latency_ms / 1000, args.mbps * 1e6)
        budget = total // 3
        print(
            f"{args.records} records in {args.shards} shards, {total / 2**20:.1f} MiB; "
            f"{args.latency_ms:g} ms per request, {args.mbps:g} MB/s per connection; "
            f"cache {budget / 2**20:.1f} MiB; {args.workers} workers, batch {args.batch_size}, "
            f"window {args.window}; store: {args.store}"
        )
        for r in range(args.rounds):
            for mode in MODES:
                cache = os.path.join(work, f"cache-{mode}-{r}")
                where = data if mode == "local" else f"{url}/ds"
                runs[mode].append(_measure(mode, where, cache, budget, argv))
                shutil.rmtree(cache, ignore_errors=True)
            print(f"round {r + 1}/{args.rounds}: {json.dumps(runs)}", file=sys.stderr)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode])

    def ratio(a: str, b: str) -> float:
        return statistics.median(x["records/s"] / y["records/s"] for x, y in zip(runs[a], runs[b]))

    rows = []
    for mode in MODES:
        row = {"mode": LABELS[mode]}
        row.update({k: med(mode, k) for k in runs[mode][0]})
        row["x local"] = ratio(mode, "local")
        if mode in ("on", "on4"):
            row["x off"] = ratio(mode, "off")
        rows.append(row)
    cols = ["mode", "records/s", "x local", "x off", "first batch s", "runs per batch", "downloads"]
    print_table(rows, cols)
    target = {
        "on_vs_local": ratio("on", "local"),
        "target": ">= 0.8",
        "met": ratio("on", "local") >= 0.8,
    }
    print(target)
    write_json(
        "read_ahead" if args.store == "nginx" else "read_ahead_threaded",
        {"args": vars(args), "shards_bytes": total, "runs": runs, "rows": rows, "target": target},
    )


if __name__ == "__main__":
    main()
