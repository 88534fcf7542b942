"""A true global shuffle straight from an object store: measured against its physical bound.

A store that is not the bottleneck serves ArrayRecord datasets of 1 KiB and 100 KiB
records in 16 shards: nginx with its Lua module adding the latency by a timer
(``benchmarks/_nginx_store.py``, used when installed: ``apt-get install nginx-core
libnginx-mod-http-lua``), else ``benchmarks/_fast_store.py`` (one asyncio process,
Range support, one write per answer; a few thousand requests/s here, which can be the
bound: ``--store`` picks). Before anything torchgrain, it measures:

* the store's own **capacity**: requests/s (1 KiB ranges) and bytes/s (100 KiB ranges)
  with no added latency, from a client that is not torchgrain (raw HTTP/1.1 over
  asyncio streams, 16 kept-alive connections);
* the **client CPU per request** of the two ways torchgrain could keep many requests in
  flight: all of them on fsspec's event loop (``torchgrain.io.inflight.cat_many``) or a
  thread pool of blocking deadline-aware calls (``torchgrain.io.remote.cat_file``).

Then, for each record size, latency (10/30/80 ms) and DataLoader ``num_workers`` (0, 2),
one global-shuffle pass of a few batches (``GlobalShuffleSampler``, no shard cache):

* ``before``: each batch read shard by shard, ``io_threads`` (8) shards at a time (the
  path before ``max_inflight``);
* ``single``: the batch's records fetched across all its shards at once, ``max_inflight``
  requests in flight per process (and with 0 workers the next batches fetched while one
  is decoded), one range per request (``multi_range=False``);
* ``after``: the same with the default ``multi_range=True``: up to 64 ranges of a shard
  in one request (nginx answers ``multipart/byteranges``; the asyncio store does not, and
  is then asked one range per request);
* ``local``: the same files on local disk.

Beside each rate it prints the bound
``min(max_inflight * processes / (latency + record / rate), store capacity,
bandwidth / record size)`` in records/s (one request per record, which ``after`` goes
beyond where the store answers several ranges in one response; the store sends each
response at ``--mbps``, 50 MB/s, as object stores cap each connection), the ratio to
it, requests per record and bytes fetched per byte delivered (counted by the store over
the timed batches, from the start of the pass: with workers, their footer reads count).
Worker start-up is inside the timed pass (fork: fast).

This machine has 2 cores shared with other work, and the store, the loader and its
workers share them: the settings are small (a few thousand 1 KiB records, a few hundred
100 KiB ones, per measurement) and the numbers indicative.

Run:  python benchmarks/remote_global.py [--quick] [--max-inflight 64]
Writes benchmarks/results/remote_global.json.

``--coalescing`` runs issue 38's setting instead (32k 1 KiB records in 16 shards, 30 ms a
request, 2 workers, 16 batches of 256), every pass in a fresh process, rounds
interleaved, on nginx answering one range per request (``max_ranges 1``: the whole file
for several ranges, as S3 and GCS do) and on nginx answering multi-range requests:

* ``base``: the starting code (``--base``, another checkout of torchgrain), as is;
* ``per_record``: this code asked one range per record (no coalescing at all);
* ``earlier``: each shard's ranges read on its own, merged across 64 KiB holes (the
  path before the batch-wide fetch);
* ``single``: the batch-wide fetch, one range per request (``multi_range=False``),
  nearby ranges merged within the store's gap and size cap
  (:func:`torchgrain.io.ranges.coalescing`);
* ``after``: the defaults (multi-range requests where the server answers them, else as
  ``single`` once the server has answered one otherwise);
* ``gap_<K>k`` (``--gaps``): ``after`` with another single-range gap, for tuning.

Targets (one-range store): ``after`` at least ``per_record``'s and ``earlier``'s rate.
Writes benchmarks/results/remote_global_coalescing.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A pass in a fresh process may import another checkout of torchgrain (--base).
if os.environ.get("TG_TREE"):
    sys.path.insert(0, os.environ["TG_TREE"])

import numpy as np
import torch

import torchgrain as tg
from benchmarks._common import RESULTS_DIR, describe_machine, machine, print_table

SHARDS = 16


def _write(root: str, name: str, n: int, size: int) -> str:
    rng = np.random.default_rng(0)
    d = os.path.join(root, name)
    tg.write_array_record(({"x": rng.bytes(size)} for _ in range(n)), d, num_shards=SHARDS)
    return d


def _store(root: str, kind: str = "asyncio") -> tuple[subprocess.Popen, str]:
    """Start the store (``nginx`` or ``asyncio``) serving ``root``: ``(process, url)``."""
    if kind == "nginx":
        from benchmarks import _nginx_store

        return _nginx_store.start(root)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(here, "_fast_store.py"), root],
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()  # type: ignore[union-attr]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


# --------------------------------------------------------------- store, measured alone
async def _raw_client(
    host: str, port: int, path: str, size: int, span: int, seconds: float, conns: int
) -> tuple[int, int]:
    """Requests and body bytes a plain HTTP/1.1 client gets in ``seconds``."""
    done = [0, 0]
    stop = time.perf_counter() + seconds

    async def one(seed: int) -> None:
        rng = random.Random(seed)
        reader, writer = await asyncio.open_connection(host, port)
        while time.perf_counter() < stop:
            a = rng.randrange(0, span - size)
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={a}-{a + size - 1}\r\n\r\n".encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(n)
            done[0] += 1
            done[1] += n
        writer.close()

    await asyncio.gather(*(one(k) for k in range(conns)))
    return done[0], done[1]


def _capacity(url: str, path: str, span: int, size: int, seconds: float) -> dict[str, float]:
    host, port = url.split("//")[1].split(":")
    n, nbytes = asyncio.run(_raw_client(host, int(port), path, size, span, seconds, 16))
    return {"requests_per_s": n / seconds, "bytes_per_s": nbytes / seconds}


def _client_cpu(url: str, path: str, span: int, n: int, inflight: int) -> dict[str, float]:
    """Client CPU per 1 KiB range: one range per request all on fsspec's loop, or on a
    pool of blocking calls, and up to 64 ranges per request on the loop (multi-range)."""
    from torchgrain.io import remote
    from torchgrain.io.fs import get_filesystem
    from torchgrain.io.inflight import cat_many

    fs, rpath = get_filesystem(url + path)
    rng = random.Random(1)
    starts = [rng.randrange(0, span - 1024) for _ in range(n)]
    ends = [s + 1024 for s in starts]

    def loop() -> None:
        cat_many(fs, [rpath] * n, starts, ends, max_inflight=inflight, multi_range=False)

    def multi() -> None:
        cat_many(fs, [rpath] * n, starts, ends, max_inflight=inflight)

    def pool() -> None:
        with ThreadPoolExecutor(inflight) as ex:
            list(ex.map(lambda s: remote.cat_file(fs, rpath, s, s + 1024), starts))

    out = {}
    for name, fn in (
        ("event_loop", loop),
        ("thread_pool", pool),
        ("multi_range", multi),
        ("event_loop", loop),
        ("thread_pool", pool),
        ("multi_range", multi),
    ):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        out[f"{name}_us_cpu_per_request"] = 1e6 * cpu / n  # the second round counts
        out[f"{name}_requests_per_s"] = n / wall
    return out


# ------------------------------------------------------------------ loader, measured
def _pass(src: Any, *, workers: int, batch: int, batches: int, reset: Any = None) -> float:
    """Records/s over the first ``batches`` batches of a pass, timed from its start (a
    warm-up would let read-ahead fetch the timed batches before the clock starts)."""
    # Footers read first (one record of each shard): with workers, each worker still
    # reads them in its first batch.
    src.__getitems__([int(o) for o in src.index.offsets[:-1]])
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=0)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        collate_fn=lambda b: sum(len(r["x"]) for r in b),
        multiprocessing_context="fork" if workers else None,
        prefetch_factor=2 if workers else None,
    )
    if reset is not None:
        reset()
    t0 = time.perf_counter()
    it = iter(loader)
    got = 0
    for _ in range(batches):
        got += next(it) > 0
    dt = time.perf_counter() - t0
    del it
    return batches * batch / dt


VARIANTS = ("before", "single", "after")


def _source(location: str, variant: str, inflight: int) -> Any:
    if variant == "local":
        return tg.ArrayRecordSource(location)
    src = tg.ArrayRecordSource(location, max_inflight=inflight, multi_range=variant == "after")
    if variant == "before":
        # The path before max_inflight: each shard's ranges read on its own, io_threads
        # shards at a time (coalesced with the 64 KiB gap of a shard's own reads).
        src.ranges.plan = lambda groups: None
    return src


# ------------------------------------------------- issue 38's setting, fresh processes
def _patch(spec: dict[str, Any]) -> Any:
    """Apply a pass's variant to this process's torchgrain: the source to read, and a
    reset to call when the timing starts (counting requests from there)."""
    from torchgrain.io import ranges

    variant = spec["variant"]
    if variant == "per_record":  # every range its own request
        from torchgrain.sources import fetch_ahead

        fetch_ahead.BATCH_GAP = -1
        ranges.SINGLE_RANGE_GAP = -1
    elif variant.startswith("gap_"):
        ranges.SINGLE_RANGE_GAP = int(variant[4:-1]) << 10
    if spec.get("cap"):
        ranges.SINGLE_RANGE_MAX = int(spec["cap"])
    src = tg.ArrayRecordSource(
        spec["location"],
        storage_options=spec.get("storage_options"),
        max_inflight=spec["max_inflight"],
        multi_range=variant not in ("single", "per_record"),
    )
    if variant == "earlier":
        src.ranges.plan = lambda groups: None
    return src


def _count_s3_requests() -> Any:
    """A request counter shared with forked workers, counting every S3 GET torchgrain
    makes in this process tree (no S3 server here counts them)."""
    import multiprocessing as mp

    from torchgrain.io import responses

    count = mp.get_context("fork").Value("q", 0)
    inner = responses._s3_cat_file

    async def counted(*args: Any, **kwargs: Any) -> Any:
        with count.get_lock():
            count.value += 1
        return await inner(*args, **kwargs)

    responses._s3_cat_file = counted
    responses._S3_READS["cat_file"] = counted
    return count


def _one_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """One pass in this process (started fresh for it): records/s, requests, bytes."""
    count = _count_s3_requests() if spec.get("storage_options") else None
    src = _patch(spec)
    stats = spec.get("stats_url")

    def reset() -> None:
        if stats:
            _get(f"{stats}/__reset")
        if count is not None:
            count.value = 0

    rate = _pass(
        src, workers=spec["workers"], batch=spec["batch"], batches=spec["batches"], reset=reset
    )
    out: dict[str, Any] = {"records_per_s": rate}
    if stats:
        out.update(json.loads(_get(f"{stats}/__stats")))
    if count is not None:
        out["requests"] = count.value
    src.close()
    return out


def _fresh_pass(spec: dict[str, Any], tree: str | None = None) -> dict[str, Any]:
    """:func:`_one_pass` in a new interpreter (``tree``: another checkout's torchgrain)."""
    env = dict(os.environ)
    env.pop("TG_TREE", None)
    if tree:
        env["TG_TREE"] = tree
    got = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--one-pass", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if got.returncode != 0:
        raise RuntimeError(f"{spec['variant']} pass failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def run_variants(
    specs: dict[str, dict[str, Any]], rounds: int, base: str | None, tree: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Each variant's passes, ``rounds`` times, interleaved (the machine's load drifts);
    ``base`` runs the starting code's checkout, the others ``tree`` (default: this one)."""
    got: dict[str, list[dict[str, Any]]] = {v: [] for v in specs}
    for _ in range(rounds):
        for variant, spec in specs.items():
            got[variant].append(_fresh_pass(spec, base if variant == "base" else tree))
            print(f"  {variant}: {got[variant][-1]}", flush=True)
    return got


def summarise(
    got: dict[str, list[dict[str, Any]]], delivered: int, record: int, **fields: Any
) -> list[dict[str, Any]]:
    """A row per variant: median records/s, its rounds, requests per record (median)."""
    rows = []
    for variant, passes in got.items():
        row: dict[str, Any] = {
            **fields,
            "variant": variant,
            "records_per_s": statistics.median(p["records_per_s"] for p in passes),
            "rounds": [round(p["records_per_s"]) for p in passes],
        }
        if all("requests" in p for p in passes):
            row["requests"] = statistics.median(p["requests"] for p in passes)
            row["requests_per_record"] = row["requests"] / delivered
        if all("body_bytes" in p for p in passes):
            row["fetched_per_delivered"] = statistics.median(
                p["body_bytes"] / (delivered * record) for p in passes
            )
        rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]], store: str) -> dict[str, Any]:
    """Issue 38's targets on a one-range store: ``after`` at least ``per_record``'s and
    ``earlier``'s rate (met/missed), and the ratios to ``base``."""
    rate = {r["variant"]: r["records_per_s"] for r in rows if r["store"] == store}
    out: dict[str, Any] = {"store": store}
    for other in ("per_record", "earlier", "base"):
        if other in rate and "after" in rate:
            out[f"after_over_{other}"] = rate["after"] / rate[other]
    for other in ("per_record", "earlier"):
        if f"after_over_{other}" in out:
            out[f"after_at_least_{other}"] = "met" if out[f"after_over_{other}"] >= 1 else "missed"
    return out


def coalescing_main(a: argparse.Namespace) -> None:
    from benchmarks import _nginx_store

    print(f"machine: {describe_machine()}")
    root = tempfile.mkdtemp(prefix="tg-remote-coalescing-")
    size, delivered = 1024, a.batches * 256
    _write(root, "r1024", a.records, size)
    variants = ["base", "per_record", "earlier", "single", "after"]
    variants += [f"gap_{int(g)}k" for g in a.gaps.split(",") if g]
    if not a.base:
        variants.remove("base")
    rows: list[dict[str, Any]] = []
    try:
        for store, max_ranges in (("one-range", 1), ("multi-range", None)):
            proc, url = _nginx_store.start(root, max_ranges=max_ranges)
            try:
                _get(f"{url}/__rate?bps={a.mbps * 1e6}")
                _get(f"{url}/__latency?s={a.latency_ms / 1000}")
                print(f"store: nginx, {store}")
                specs = {
                    v: {
                        "variant": v,
                        "location": f"{url}/r1024",
                        "workers": a.workers_n,
                        "batch": 256,
                        "batches": a.batches,
                        "max_inflight": a.max_inflight,
                        "stats_url": url,
                    }
                    for v in variants
                    if store == "one-range" or not v.startswith("gap_")
                }
                got = run_variants(specs, a.rounds, a.base, a.tree)
                rows += summarise(got, delivered, size, store=store, latency_ms=a.latency_ms)
            finally:
                proc.kill()
        print()
        print_table(rows, ["store", "variant", "records_per_s", "rounds", "requests"])
        out = {
            "machine": machine(),
            "settings": {
                "records": a.records,
                "record_bytes": size,
                "shards": SHARDS,
                "workers": a.workers_n,
                "batch": 256,
                "batches": a.batches,
                "latency_ms": a.latency_ms,
                "mbps_per_response": a.mbps,
                "max_inflight": a.max_inflight,
                "rounds": a.rounds,
                "base": a.base,
                "note": "fresh process per pass, rounds interleaved; 2 shared cores",
            },
            "targets": [targets(rows, "one-range")],
            "rows": rows,
        }
        print(json.dumps(out["targets"], indent=1))
        os.makedirs(RESULTS_DIR, exist_ok=True)
        name = a.out or "remote_global_coalescing.json"
        with open(os.path.join(RESULTS_DIR, name), "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote benchmarks/results/{name}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one-pass":
        print(json.dumps(_one_pass(json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--coalescing", action="store_true", help="issue 38's setting (see above)")
    p.add_argument("--base", default=None, help="--coalescing: the starting code's checkout")
    p.add_argument("--tree", default=None, help="--coalescing: the checkout to measure")
    p.add_argument("--records", type=int, default=32768, help="--coalescing: 1 KiB records")
    p.add_argument("--batches", type=int, default=16, help="--coalescing: batches of 256")
    p.add_argument("--workers-n", type=int, default=2, help="--coalescing: DataLoader workers")
    p.add_argument("--latency-ms", type=float, default=30, help="--coalescing: per request")
    p.add_argument("--gaps", default="", help="--coalescing: single-range gaps to try (KiB)")
    p.add_argument("--quick", action="store_true", help="30 ms only, fewer batches")
    p.add_argument("--max-inflight", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="interleaved before/after rounds")
    p.add_argument("--out", default=None, help="file name under benchmarks/results/")
    p.add_argument("--latencies-ms", default="10,30,80")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--sizes-kib", default="1,100", help="record sizes to run (KiB)")
    p.add_argument("--mbps", type=float, default=50.0, help="bandwidth per response, MB/s")
    p.add_argument(
        "--store",
        choices=("auto", "nginx", "asyncio"),
        default="auto",
        help="nginx with its Lua module (auto: when installed) or the asyncio store",
    )
    a = p.parse_args()
    if a.coalescing:
        coalescing_main(a)
        return
    from benchmarks import _nginx_store

    if a.store == "auto":
        a.store = "nginx" if _nginx_store.available() else "asyncio"
    latencies = [30] if a.quick else [int(x) for x in a.latencies_ms.split(",")]
    workers_list = [int(x) for x in a.workers.split(",")]
    print(f"machine: {describe_machine()}")
    root = tempfile.mkdtemp(prefix="tg-remote-global-")
    # Sparse batches, as in a dataset far larger than a batch: a batch's records of one
    # shard lie far apart (4,096 records per shard for 16 per batch), so no two share a
    # request unless the reader fetches the bytes between them.
    sizes = {
        1024: dict(n=65536, batch=256, batches=12 if a.quick else 24),
        100 * 1024: dict(n=1024, batch=32, batches=12 if a.quick else 24),
    }
    proc = None
    try:
        for size, cfg in sizes.items():
            cfg["dir"] = _write(root, f"r{size}", cfg["n"], size)
        proc, url = _store(root, a.store)
        print(f"store: {a.store}")
        big = sorted(os.listdir(sizes[100 * 1024]["dir"]))[0]
        path = f"/r{100 * 1024}/{big}"
        span = os.path.getsize(os.path.join(sizes[100 * 1024]["dir"], big))
        seconds = 1.0 if a.quick else 2.0
        cap_small = _capacity(url, path, span, 1024, seconds)
        cap_big = _capacity(url, path, span, 100 * 1024, seconds)
        cpu = _client_cpu(url, path, span, 1000 if a.quick else 2000, a.max_inflight)
        print(
            f"store capacity (no added latency, raw asyncio client, 16 connections): "
            f"{cap_small['requests_per_s']:,.0f} req/s of 1 KiB, "
            f"{cap_big['bytes_per_s'] / 1e6:,.0f} MB/s in 100 KiB ranges"
        )
        print(
            "client CPU per 1 KiB range: one per request, event loop "
            f"{cpu['event_loop_us_cpu_per_request']:.0f} us, thread pool "
            f"{cpu['thread_pool_us_cpu_per_request']:.0f} us; 64 per request (multi-range) "
            f"{cpu['multi_range_us_cpu_per_request']:.0f} us"
        )
        _get(f"{url}/__rate?bps={a.mbps * 1e6}")
        rows = []
        wanted = {int(x) * 1024 for x in a.sizes_kib.split(",")}
        for size, cfg in sizes.items():
            if size not in wanted:
                continue
            rec = size
            for workers in workers_list:
                local = _pass(
                    _source(cfg["dir"], "local", a.max_inflight),
                    workers=workers,
                    batch=cfg["batch"],
                    batches=cfg["batches"],
                )
                for lat in latencies:
                    _get(f"{url}/__latency?s={lat / 1000}")
                    procs = max(workers, 1)
                    # Each request takes the latency plus its bytes at the per-response rate.
                    per_request = lat / 1000 + rec / (a.mbps * 1e6)
                    bound = min(
                        a.max_inflight * procs / per_request,
                        cap_small["requests_per_s"] if size <= 4096 else cap_big["requests_per_s"],
                        cap_big["bytes_per_s"] / rec,
                    )
                    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
                    counted: dict[str, dict] = {}
                    for _ in range(a.rounds):  # interleaved: the machine's load drifts
                        for variant in VARIANTS:
                            src = _source(f"{url}/r{size}", variant, a.max_inflight)
                            rates[variant].append(
                                _pass(
                                    src,
                                    workers=workers,
                                    batch=cfg["batch"],
                                    batches=cfg["batches"],
                                    reset=lambda: _get(f"{url}/__reset"),
                                )
                            )
                            src.close()
                            counted[variant] = json.loads(_get(f"{url}/__stats"))
                    ratios = [x / y for x, y in zip(rates["after"], rates["before"])]
                    over_single = [x / y for x, y in zip(rates["after"], rates["single"])]
                    for variant in VARIANTS:
                        rate = statistics.median(rates[variant])
                        stats = counted[variant]
                        # Counted over the timed batches (workers' footer reads included,
                        # and with 0 workers what read-ahead fetched of later batches).
                        delivered = cfg["batches"] * cfg["batch"]
                        rows.append(
                            {
                                "record": f"{size // 1024} KiB",
                                "workers": workers,
                                "latency_ms": lat,
                                "variant": variant,
                                "records_per_s": rate,
                                "bound": bound,
                                "of_bound": rate / bound,
                                "local_records_per_s": local,
                                "of_local": rate / local,
                                "requests_per_record": stats["requests"] / delivered,
                                "fetched_per_delivered": stats["body_bytes"] / (delivered * rec),
                                "after_over_before": statistics.median(ratios),
                                "after_over_single": statistics.median(over_single),
                                "rounds": [round(r) for r in rates[variant]],
                            }
                        )
                        print_table([rows[-1]], list(rows[-1]))
        print()
        print_table(rows, list(rows[0]))
        out = {
            "machine": machine(),
            "settings": {
                "max_inflight": a.max_inflight,
                "shards": SHARDS,
                "sizes": {
                    str(k): {kk: v for kk, v in c.items() if kk != "dir"} for k, c in sizes.items()
                },
                "store": a.store,
                "note": "2 shared cores: store, loader and workers on the same cores; indicative",
            },
            "store_capacity": {"1KiB": cap_small, "100KiB": cap_big},
            "client_cpu_per_request": cpu,
            "rows": rows,
        }
        os.makedirs(RESULTS_DIR, exist_ok=True)
        name = a.out or ("remote_global_quick.json" if a.quick else "remote_global.json")
        with open(os.path.join(RESULTS_DIR, name), "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote benchmarks/results/{name}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
