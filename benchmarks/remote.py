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

``--large``: large records from a slow store against local disk instead (issue 38): 1,024
records of 100 KiB in 16 shards, a global shuffle with no shard cache and no DataLoader
workers (the reading process fetches the next batches while it decodes), 24 batches of
32 timed from the start of the pass, at ``--latency-ms`` 30 by default, from nginx with its
Lua module when installed (``benchmarks/_nginx_store.py``), else the threaded store. Each
pass runs in a fresh process, local and remote interleaved, ``--repeats`` rounds; the
ratio is the median of the rounds' ratios, and the process CPU per record of each is
reported (the remote one includes receiving the bytes). Target: remote >= 0.5x local.
``--trees A,B``: the remote pass of other checkouts too, in the same rounds (paired A/B).
Writes benchmarks/results/remote_large.json.

Run:  python benchmarks/remote.py            (about two minutes on 2 cores)
      python benchmarks/remote.py --latency-ms 50 --workers 4
      python benchmarks/remote.py --large --latency-ms 30 --repeats 5
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


def _large_pass(where: str, batches: int, batch: int, max_inflight: int) -> dict:
    """One pass over ``where`` in this (fresh) process: records/s and CPU s per record."""
    src = (
        tg.ArrayRecordSource(where, max_inflight=max_inflight)
        if "://" in where
        else tg.ArrayRecordSource(where)
    )
    src.__getitems__([int(o) for o in src.index.offsets[:-1]])  # footers read first
    ds = tg.Dataset(src)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        sampler=tg.GlobalShuffleSampler(ds, seed=0),
        collate_fn=lambda b: sum(len(r["x"]) for r in b),
    )
    t0, c0 = time.perf_counter(), time.process_time()
    it = iter(loader)
    got = sum(next(it) for _ in range(batches))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert got == batches * batch * len(src[0]["x"])
    return {"records/s": batches * batch / seconds, "cpu us/record": 1e6 * cpu / (batches * batch)}


def large_vs_local(args: argparse.Namespace) -> None:
    """``--large``: 100 KiB records from the store against local disk (module docstring)."""
    from benchmarks import _nginx_store

    print(describe_machine())
    work = tempfile.mkdtemp(prefix="tg-bench-remote-large-")
    server = None
    runs: dict[str, list[dict]] = {"local": [], "remote": []}
    try:
        rng = np.random.default_rng(0)
        d = os.path.join(work, "big")
        tg.write_array_record(({"x": rng.bytes(100 << 10)} for _ in range(1024)), d, num_shards=16)
        store = "nginx" if _nginx_store.available() else "threaded"
        if store == "nginx":
            server, url = _nginx_store.start(work)
            _nginx_store.set_speed(url, args.latency_ms / 1000, args.mbps * 1e6)
        else:
            url, server = start_http_store(work, args.latency_ms / 1000, args.mbps * 1e6)
        print(f"store {store}: {args.latency_ms:g} ms per request; 1,024 x 100 KiB, 16 shards")
        # --trees: other checkouts' remote passes beside this one's (paired A/B), each
        # run by that checkout's copy of this script (its torchgrain).
        passes = [("local", d, __file__), ("remote", f"{url}/big", __file__)]
        for tree in filter(None, args.trees.split(",")):
            runs[f"remote@{os.path.basename(tree.rstrip('/'))}"] = []
            script = os.path.join(tree, "benchmarks", "remote.py")
            passes.append((f"remote@{os.path.basename(tree.rstrip('/'))}", f"{url}/big", script))
        for r in range(args.repeats):
            for mode, where, script in passes:
                cmd = [sys.executable, script, "--one-large", where, str(args.max_inflight)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    raise RuntimeError(f"{mode} failed:\n{out.stderr[-4000:]}")
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {json.dumps({m: v[-1] for m, v in runs.items()})}")
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)

    def over_local(mode: str) -> float:
        return statistics.median(
            x["records/s"] / y["records/s"] for x, y in zip(runs[mode], runs["local"])
        )

    ratio = over_local("remote")
    rows = [
        {
            "mode": mode,
            "records/s": statistics.median(x["records/s"] for x in runs[mode]),
            "over local": 1.0 if mode == "local" else over_local(mode),
            "cpu us/record": statistics.median(x["cpu us/record"] for x in runs[mode]),
        }
        for mode in runs
    ]
    print_table(rows, ["mode", "records/s", "over local", "cpu us/record"])
    target = {"remote_over_local": ratio, "target": ">= 0.5", "met": ratio >= 0.5}
    print(target)
    write_json(
        "remote_large",
        {"config": vars(args), "store": store, "runs": runs, "rows": rows, "target": target},
    )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one-large":
        print(json.dumps(_large_pass(sys.argv[2], 24, 32, int(sys.argv[3]))))
        return
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
    p.add_argument("--max-inflight", type=int, default=128, help="--large: requests in flight")
    p.add_argument("--large", action="store_true", help="100 KiB records vs local disk only")
    p.add_argument(
        "--trees",
        default="",
        help="--large: other checkouts (comma-separated) whose remote passes run beside",
    )
    args = p.parse_args()
    if args.large:
        if "--latency-ms" not in sys.argv:
            args.latency_ms = 30.0
        large_vs_local(args)
        return
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
