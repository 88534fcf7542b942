"""Reading ArrayRecord from a high-latency HTTP store: sequential vs parallel vs cache.

A local HTTP server with Range support (run in its own process) adds a fixed delay to
every request (default 20 ms time-to-first-byte, like an object store) and limits each
connection's bandwidth (default 50 MB/s). DataLoader workers (default 2) read globally
shuffled batches through ``ArrayRecordSource``:

1. ``sequential``: one request at a time per worker (``io_threads=1``): the shards of a
   batch are fetched one after another.
2. ``parallel``: ``io_threads=8``: the shards of a batch are fetched concurrently.
3. ``cache, epoch 2``: with ``cache_dir``, a second epoch reads the warm local copies;
   compared with reading the same files from local disk.
4. ``byte-range`` vs ``whole-shard``: a first epoch over a dataset larger than the
   cache, with large shards: byte-range reads of the needed chunks vs downloading each
   touched shard into a cache too small to keep them.

Targets: parallel >= 4x sequential; warm cache within 1.2x of local files; byte-range
>= 10x whole-shard download on the larger-than-cache first epoch.

Run:  python benchmarks/remote.py            (about two minutes on 2 cores)
      python benchmarks/remote.py --latency-ms 50 --workers 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchgrain as tg
from benchmarks._common import describe_machine, print_table, start_http_store, write_json


def _write(root: str, name: str, n: int, shards: int, nbytes: int) -> str:
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 255, nbytes, dtype=np.uint8)
    d = os.path.join(root, name)
    tg.write_array_record(
        ({"image": np.roll(blob, i), "label": i % 1000} for i in range(n)), d, num_shards=shards
    )
    return d


def _loader(src, args, sampler, persistent=False):
    return torch.utils.data.DataLoader(
        tg.Dataset(src),
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        prefetch_factor=2,
        persistent_workers=persistent,
        multiprocessing_context="fork",
        collate_fn=len,
    )


def _rate(src, args, batches, epoch=0):
    """Records/s over the first ``batches`` batches of an epoch, worker start-up
    included (which, if anything, understates the faster modes)."""
    sampler = tg.GlobalShuffleSampler(len(src), seed=0)
    sampler.set_epoch(epoch)
    n = 0
    t0 = time.perf_counter()
    for i, b in enumerate(_loader(src, args, sampler)):
        n += b
        if i + 1 >= batches:
            break
    return n / (time.perf_counter() - t0)


def _epoch_rates(src, args, epochs):
    """(first-epoch records/s incl. start-up, records/s of the later epochs) with
    persistent workers, so later epochs pay no start-up."""
    sampler = tg.GlobalShuffleSampler(len(src), seed=0)
    loader = _loader(src, args, sampler, persistent=True)
    t0 = time.perf_counter()
    first = sum(loader)
    t1 = time.perf_counter()
    n = 0
    for e in range(1, epochs + 1):
        sampler.set_epoch(e)
        n += sum(loader)
    t2 = time.perf_counter()
    del loader
    return first / (t1 - t0), n / (t2 - t1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--mbps", type=float, default=50.0, help="per-connection MB/s")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--batches", type=int, default=24, help="timed batches per remote mode")
    p.add_argument("--epochs", type=int, default=6, help="warm epochs timed (cache vs local)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--big-shard-mb", type=int, default=64)
    args = p.parse_args()
    print(describe_machine())
    work = tempfile.mkdtemp(prefix="tg-bench-remote-")
    rows = []
    results = {}
    try:
        small = _write(work, "small", n=8192, shards=32, nbytes=3072)  # ~25 MB, 32 shards
        big_n = args.big_shard_mb * 2**20 // 65536 * 8
        big = _write(work, "big", n=big_n, shards=8, nbytes=65536)  # 8 shards of big_shard_mb
        url, server = start_http_store(work, args.latency_ms / 1000, args.mbps * 1e6)
        print(
            f"server {url}: {args.latency_ms:g} ms per request, {args.mbps:g} MB/s per "
            f"connection; {args.workers} workers, batch {args.batch_size}"
        )

        # 1. sequential vs parallel extraction (same files, same order)
        seq = tg.ArrayRecordSource(f"{url}/small", io_threads=1)
        par = tg.ArrayRecordSource(f"{url}/small", io_threads=args.io_threads)
        r_seq, r_par = [], []
        for _ in range(args.repeats):
            r_seq.append(_rate(seq, args, max(4, args.batches // 3)))
            r_par.append(_rate(par, args, args.batches))
        seq_rate, par_rate = statistics.median(r_seq), statistics.median(r_par)
        rows += [
            {"mode": "sequential fetch (io_threads=1)", "records/s": seq_rate, "ratio": 1.0},
            {
                "mode": f"parallel extraction (io_threads={args.io_threads})",
                "records/s": par_rate,
                "ratio": par_rate / seq_rate,
            },
        ]
        results["parallel_vs_sequential"] = par_rate / seq_rate

        # 2. cache: first epoch (cold), then warm epochs vs local files
        cache_dir = os.path.join(work, "cache")
        cached = tg.ArrayRecordSource(
            f"{url}/small", cache_dir=cache_dir, cache_bytes=1 << 30, io_threads=args.io_threads
        )
        local = tg.ArrayRecordSource(small)
        warm, loc = [], []
        cold, _ = _epoch_rates(cached, args, 0)
        for _ in range(args.repeats):
            warm.append(_epoch_rates(cached, args, args.epochs)[1])
            loc.append(_epoch_rates(local, args, args.epochs)[1])
        warm_rate, local_rate = statistics.median(warm), statistics.median(loc)
        rows += [
            {
                "mode": "cache, epoch 1 (cold: downloads)",
                "records/s": cold,
                "ratio": cold / seq_rate,
            },
            {
                "mode": "cache, epoch 2+ (warm)",
                "records/s": warm_rate,
                "ratio": warm_rate / seq_rate,
                "vs local": local_rate / warm_rate,
            },
            {"mode": "local files", "records/s": local_rate, "ratio": local_rate / seq_rate},
        ]
        results["local_over_warm_cache"] = local_rate / warm_rate

        # 3. larger-than-cache first epoch: byte ranges vs whole-shard downloads
        shard_bytes = max(os.path.getsize(os.path.join(big, f)) for f in os.listdir(big))
        small_cache = os.path.join(work, "small-cache")
        ranged = tg.ArrayRecordSource(f"{url}/big", io_threads=args.io_threads)
        whole = tg.ArrayRecordSource(
            f"{url}/big",
            cache_dir=small_cache,
            cache_bytes=int(shard_bytes * 2.5),  # holds 2 of the 8 shards
            io_threads=args.io_threads,
        )
        r_rng, r_whole = [], []
        for r in range(args.repeats):
            r_rng.append(_rate(ranged, args, args.batches, epoch=r))
            r_whole.append(_rate(whole, args, max(4, args.batches // 4), epoch=r))
        rng_rate, whole_rate = statistics.median(r_rng), statistics.median(r_whole)
        rows += [
            {
                "mode": f"whole-shard download, 8x{shard_bytes / 2**20:.0f} MiB, cache 2.5 shards",
                "records/s": whole_rate,
                "ratio": whole_rate / seq_rate,
            },
            {
                "mode": "byte-range global shuffle, same files",
                "records/s": rng_rate,
                "ratio": rng_rate / seq_rate,
                "vs whole": rng_rate / whole_rate,
            },
        ]
        results["byte_range_vs_whole_shard"] = rng_rate / whole_rate
        server.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print_table(rows, ["mode", "records/s", "ratio", "vs local", "vs whole"])
    print()
    targets = {
        "parallel_vs_sequential": (">=", 4.0),
        "local_over_warm_cache": ("<=", 1.2),
        "byte_range_vs_whole_shard": (">=", 10.0),
    }
    for k, (op, t) in targets.items():
        v = results[k]
        ok = v >= t if op == ">=" else v <= t
        print(f"{k}: {v:.2f} (target {op} {t}) {'OK' if ok else 'MISSED'}")
    write_json(
        "remote",
        {
            "config": vars(args),
            "rows": rows,
            "ratios": results,
            "targets": {k: f"{op} {t}" for k, (op, t) in targets.items()},
        },
    )


if __name__ == "__main__":
    main()
