"""torchgrain against LitData and Mosaic Streaming reading from an S3-compatible store.

A real S3 server (moto's, on 127.0.0.1) sits behind a throttling TCP proxy
(:class:`Throttle`) that holds every request 20-50 ms before passing it on and caps the
bandwidth of responses (per connection and in total), in a process of its own. The same
records as ``peers.py`` (default 100,000 of ~1 KiB: about 110 MB) are written by each
loader's own writer in shards of about the same size (default 32 of them), uploaded, and
read with a local cache budget of a third of the dataset, for two epochs in one fresh
process per measurement, ``num_workers`` 2, batch 256:

* ``tg_global_range``: ``ArrayRecordSource("s3://...")`` + ``GlobalShuffleSampler``: byte-range
  reads of just the records each batch needs (no shard cache).
* ``tg_block_cache``: ``ArrayRecordSource(..., cache_dir=, cache_dir_bytes=)`` +
  ``BlockShuffleSampler`` over shards (``block_offsets=src.index.offsets``, window 4),
  with the shard read-ahead in the sampler's order (the default with a shard cache).
* ``tg_block_cache_noahead``: the same with ``read_ahead_bytes=0``.
* ``litdata``: ``StreamingDataset("s3://...", shuffle=True, max_cache_size=,
  storage_options={"endpoint_url": ...})`` + ``StreamingDataLoader``.
* ``mosaic``: ``StreamingDataset(remote="s3://...", local=, cache_limit=, shuffle=True)``
  with ``S3_ENDPOINT_URL`` (its documented override) + DataLoader.

Reported per epoch: samples/s, time to first batch, shuffle quality (distinct 2,048-id
chunks per batch, as in ``peers.py``), and the check that each id came once with its bytes.
An epoch that runs past ``--epoch-seconds`` is cut there and its rate is over what it read
(marked ``partial``). Ratios are against ``tg_block_cache`` in the same round.

Run:  .venv-peers/bin/python benchmarks/peers_remote.py              (about 30 minutes)
      .venv-peers/bin/python benchmarks/peers_remote.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import peers  # noqa: E402
from benchmarks._common import RESULTS_DIR  # noqa: E402

BUCKET = "peers"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BASELINE = "tg_block_cache"
CONFIGS = {
    "tg_global_range": "torchgrain ArrayRecord, global shuffle, byte-range reads",
    "tg_block_cache": "torchgrain ArrayRecord, block shuffle (4 shards), shard cache + read-ahead",
    "tg_block_cache_noahead": "torchgrain, the same, read_ahead_bytes=0",
    "tg_block_cache_w8": "torchgrain, the same with 8 shards shuffled together",
    "litdata": "LitData StreamingDataset(shuffle=True), max_cache_size",
    "mosaic": "Mosaic StreamingDataset(shuffle=True), cache_limit",
    "mosaic_block": "Mosaic, the same with shuffle_block_size = 4 shards of samples",
}


# ----------------------------------------------------------------------------- throttle


class Throttle:
    """A TCP proxy for HTTP traffic: each request (a chunk from the client that starts
    with an HTTP method) waits ``latency`` (uniform in ``[lo, hi]`` seconds) before it
    is forwarded; responses are paced to ``conn_rate`` bytes/s per connection and
    ``total_rate`` bytes/s over all connections."""

    METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")

    def __init__(
        self, upstream: tuple[str, int], lo: float, hi: float, conn_rate: float, total_rate: float
    ):
        self.upstream = upstream
        self.lo, self.hi = lo, hi
        self.conn_rate, self.total_rate = conn_rate, total_rate
        self._free_at = 0.0  # when the shared link is next free
        self.requests = 0

    async def _pace(self, n: int, conn: list[float]) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._free_at = max(now, self._free_at) + n / self.total_rate
        conn[0] = max(now, conn[0]) + n / self.conn_rate
        wait = max(self._free_at, conn[0]) - now
        if wait > 0:
            await asyncio.sleep(wait)

    async def _hold_requests(self, data: bytes) -> None:
        """Client to store: a request waits its time to first byte."""
        if data.startswith(self.METHODS):
            self.requests += 1
            await asyncio.sleep(random.uniform(self.lo, self.hi))

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: Any) -> None:
        """Copy ``r`` to ``w``, awaiting ``delay(chunk)`` before each chunk goes on."""
        try:
            while data := await r.read(1 << 16):
                await delay(data)
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*self.upstream)
        except OSError:
            cw.close()
            return
        conn = [0.0]  # this connection's bandwidth clock (store to client)

        async def pace(data: bytes) -> None:
            await self._pace(len(data), conn)

        await asyncio.gather(self._pipe(cr, uw, self._hold_requests), self._pipe(ur, cw, pace))

    async def serve(self, ready: Any) -> None:
        srv = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512)
        ready.put(srv.sockets[0].getsockname()[1])
        async with srv:
            await srv.serve_forever()


def _store_process(lo: float, hi: float, conn_rate: float, total_rate: float, q: Any) -> None:
    import logging

    from tests.servers import start_moto_s3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log

    _, endpoint = start_moto_s3()
    q.put(endpoint)
    host, port = endpoint.rsplit("//", 1)[1].split(":")
    asyncio.run(Throttle((host, int(port)), lo, hi, conn_rate, total_rate).serve(q))


def start_store(lo: float, hi: float, conn_rate: float, total_rate: float) -> tuple[str, str, Any]:
    """Start moto + the throttle in a process of their own; returns
    ``(direct endpoint, throttled endpoint, process)``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_store_process, args=(lo, hi, conn_rate, total_rate, q), daemon=True)
    proc.start()
    direct = q.get(timeout=120)
    port = q.get(timeout=60)
    return direct, f"http://127.0.0.1:{port}", proc


def upload(endpoint: str, local: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    for d, _, files in os.walk(local):
        for f in files:
            path = os.path.join(d, f)
            key = os.path.relpath(path, local).replace(os.sep, "/")
            s3.upload_file(path, BUCKET, key)


# ----------------------------------------------------------------------------- writers


def write_formats(local: str, n: int, payload: int, shards: int) -> list[dict[str, Any]]:
    import torchgrain as tg

    rows = []
    shard_bytes = n * (payload + 16) // shards

    def timed(fmt: str, fn: Any) -> None:
        d = os.path.join(local, fmt)
        t0 = time.perf_counter()
        fn(d)
        rows.append(
            {"format": fmt, "write_s": time.perf_counter() - t0, "size_mib": peers._du(d) / 2**20}
        )

    timed(
        "tg_arrayrecord",
        lambda d: tg.write_array_record(list(peers.records(n, payload)), d, num_shards=shards),
    )

    def lit(d: str) -> None:
        import functools

        from litdata import optimize

        optimize(
            fn=functools.partial(peers._litdata_fn, payload=payload),
            inputs=list(range(n)),
            output_dir=d,
            chunk_bytes=shard_bytes,
            num_workers=1,
        )

    timed("litdata", lit)

    def mosaic(d: str) -> None:
        peers._stub_torchvision()
        from streaming import MDSWriter

        cols = {"id": "int64", "label": "int64", "payload": "bytes"}
        with MDSWriter(out=d, columns=cols, size_limit=shard_bytes) as w:
            for r in peers.records(n, payload):
                w.write(r)

    timed("mosaic", mosaic)
    return rows


# ----------------------------------------------------------------------------- one run


def _loader(name: str, endpoint: str, cache: str, budget: int, shard_samples: int) -> Any:
    import torch

    url = f"s3://{BUCKET}"
    if name.startswith("tg_"):
        import torchgrain as tg

        so = {"endpoint_url": endpoint}
        if name == "tg_global_range":
            src = tg.ArrayRecordSource(f"{url}/tg_arrayrecord", storage_options=so)
        else:
            src = tg.ArrayRecordSource(
                f"{url}/tg_arrayrecord",
                storage_options=so,
                cache_dir=cache,
                cache_dir_bytes=budget,
                read_ahead_bytes=0 if name.endswith("noahead") else None,
            )
        ds = tg.Dataset(src)
        if name == "tg_global_range":
            sampler = tg.GlobalShuffleSampler(ds, seed=0)
        else:
            window = 8 if name.endswith("_w8") else 4
            sampler = tg.BlockShuffleSampler(
                ds, seed=0, window=window, block_offsets=src.index.offsets
            )
        loader = torch.utils.data.DataLoader(
            ds, batch_size=256, sampler=sampler, num_workers=2, multiprocessing_context="fork"
        )
        return loader, sampler.set_epoch
    if name == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(
            f"{url}/litdata",
            cache_dir=cache,
            shuffle=True,
            seed=0,
            max_cache_size=budget,
            storage_options={"endpoint_url": endpoint},
        )
        loader = StreamingDataLoader(ds, batch_size=256, num_workers=2)
        return loader, None  # StreamingDataLoader advances the epoch itself
    if name.startswith("mosaic"):
        peers._stub_torchvision()
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        os.environ["S3_ENDPOINT_URL"] = endpoint
        ds = StreamingDataset(
            remote=f"{url}/mosaic",
            local=cache,
            shuffle=True,
            shuffle_seed=0,
            batch_size=256,
            cache_limit=budget,
            # py1e's default block (262,144 samples) spans the whole dataset here, so
            # every batch draws from every shard; a block of a few shards is what its
            # docs suggest for a cache smaller than the dataset.
            shuffle_block_size=4 * shard_samples if name == "mosaic_block" else None,
        )
        loader = torch.utils.data.DataLoader(ds, batch_size=256, num_workers=2)
        return loader, None  # Mosaic's dataset counts its epochs itself
    raise ValueError(name)


def child(
    name: str,
    endpoint: str,
    n: int,
    payload: int,
    budget: int,
    epochs: int,
    limit: float,
    stall: float = 60.0,
    shard_samples: int = 3125,
) -> dict[str, Any]:
    import torch  # noqa: F401

    cache = tempfile.mkdtemp(prefix=f"tg-peers-cache-{name}-")
    exp_crc, _ = peers.expected(n, payload)
    out: dict[str, Any] = {"loader": name, "epochs": []}
    progress = {"t": time.perf_counter(), "records": 0, "epoch": 0}

    def watchdog() -> None:
        # A loader that stops delivering (a cache too small for its read pattern) is
        # reported as stalled instead of holding the whole benchmark.
        while True:
            time.sleep(1.0)
            if time.perf_counter() - progress["t"] > stall:
                out["error"] = (
                    f"stalled: no batch for {stall:.0f} s in epoch {progress['epoch'] + 1} "
                    f"after {progress['records']:,} records"
                )
                print(json.dumps(out), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    faulthandler.dump_traceback_later(stall + 30, exit=True)
    try:
        t_open = time.perf_counter()
        loader, set_epoch = _loader(name, endpoint, cache, budget, shard_samples)
        out["open_s"] = time.perf_counter() - t_open
        for epoch in range(epochs):
            if set_epoch is not None:
                set_epoch(epoch)
            t0 = time.perf_counter()
            first = None
            ids_l, lab_l, crc_l, len_l = [], [], [], []
            partial = False
            it = iter(loader)
            progress.update(t=time.perf_counter(), records=0, epoch=epoch)
            for b in it:
                # Backstop for a hang that holds the GIL (the watchdog thread cannot
                # run then): dump every thread's stack to stderr and exit.
                faulthandler.dump_traceback_later(stall + 30, exit=True)
                progress["t"] = time.perf_counter()
                progress["records"] += len(b["id"])
                if first is None:
                    first = time.perf_counter() - t0
                ids_l.append(np.asarray(b["id"]).astype(np.int64).reshape(-1))
                lab_l.append(np.asarray(b["label"]).astype(np.int64).reshape(-1))
                ps = [bytes(p) for p in b["payload"]]
                crc_l.append(np.fromiter((zlib.crc32(p) for p in ps), np.uint32, len(ps)))
                len_l.append(np.fromiter((len(p) for p in ps), np.int64, len(ps)))
                if time.perf_counter() - t0 > limit:
                    partial = True
                    break
            wall = time.perf_counter() - t0
            if partial:
                del it  # shuts the workers down
            ids = np.concatenate(ids_l)
            labels = np.concatenate(lab_l)
            crcs, lens = np.concatenate(crc_l), np.concatenate(len_l)
            if partial:
                dup = len(ids) - len(np.unique(ids))
                bad = int((crcs != exp_crc[ids]).sum() + (labels != (ids * 7919) % 1000).sum())
                check = f"partial: {len(ids):,} of {n:,} read" + (
                    f"; {dup} duplicated, {bad} bad" if dup or bad else ", intact"
                )
            else:
                check = peers.check_epoch(ids, labels, crcs, lens, n, payload)
            distinct, corr = peers.shuffle_quality(ids)
            out["epochs"].append(
                {
                    "epoch": epoch,
                    "samples": len(ids),
                    "seconds": wall,
                    "rate": len(ids) / wall,
                    "first_batch_s": first,
                    "distinct_chunks": distinct,
                    "lag1_corr": corr,
                    "check": check,
                }
            )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def run_child(name: str, endpoint: str, args: argparse.Namespace, budget: int) -> dict[str, Any]:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child", name, "--endpoint", endpoint,
        "--n", str(args.n), "--payload", str(args.payload), "--budget", str(budget),
        "--epochs", str(args.epochs), "--epoch-seconds", str(args.epoch_seconds),
        "--shards", str(args.shards),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": endpoint,
        "S3_ENDPOINT_URL": endpoint,
        "TOKENIZERS_PARALLELISM": "false",
    }
    timeout = args.epochs * (args.epoch_seconds + 120) + 120
    rc, stdout, stderr = peers.run_captured(cmd, env, timeout)
    if rc is None:
        return {"loader": name, "error": f"timed out after {timeout:.0f}s"}
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    lines = (stderr or stdout).strip().splitlines()
    tail = lines[-3:]
    if any("Timeout (" in line for line in lines):  # faulthandler's dump: name the hang
        tail = [line for line in lines if line.strip().startswith("File")][:6]
    return {"loader": name, "error": f"exit {rc}: {' | '.join(tail)}"}


def summarize(runs: list[dict[str, Any]], names: list[str], epochs: int) -> list[dict[str, Any]]:
    rows = []
    for e in range(epochs):
        base = {
            r["round"]: r["epochs"][e]["rate"]
            for r in runs
            if r["loader"] == BASELINE and len(r.get("epochs", [])) > e
        }
        for name in names:
            mine = [r for r in runs if r["loader"] == name]
            good = [r for r in mine if len(r.get("epochs", [])) > e]
            row: dict[str, Any] = {"loader": name, "epoch": e + 1, "description": CONFIGS[name]}
            if not good:
                row["check"] = (mine[0].get("error", "no result") if mine else "not run")[-200:]
                rows.append(row)
                continue
            ep = [r["epochs"][e] for r in good]
            ratios = [
                r["epochs"][e]["rate"] / base[r["round"]] for r in good if base.get(r["round"])
            ]
            row.update(
                {
                    "rate": statistics.median(x["rate"] for x in ep),
                    "rate_min": min(x["rate"] for x in ep),
                    "rate_max": max(x["rate"] for x in ep),
                    "x_block_cache": statistics.median(ratios) if ratios else None,
                    "first_batch_s": statistics.median(x["first_batch_s"] or 0 for x in ep),
                    "distinct_chunks": statistics.median(x["distinct_chunks"] for x in ep),
                    "lag1_corr": statistics.median(x["lag1_corr"] for x in ep),
                    "check": " / ".join(sorted({x["check"] for x in ep})),
                }
            )
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--payload", type=int, default=1024)
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--epoch-seconds", type=float, default=90.0, help="cut an epoch after this")
    p.add_argument("--latency-ms", type=float, nargs=2, default=[20.0, 50.0], help="lo hi")
    p.add_argument("--conn-mbps", type=float, default=50.0, help="MB/s per connection")
    p.add_argument("--total-mbps", type=float, default=100.0, help="MB/s over all connections")
    p.add_argument("--only", nargs="*")
    p.add_argument("--quick", action="store_true", help="20,000 records, 16 shards, one round")
    p.add_argument("--json", default="peers_remote", help="results name (benchmarks/results/)")
    p.add_argument("--plot-only", action="store_true", help="redraw NAME.png from NAME.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        r = child(
            args.child,
            args.endpoint,
            args.n,
            args.payload,
            args.budget,
            args.epochs,
            args.epoch_seconds,
            shard_samples=-(-args.n // args.shards),
        )
        print(json.dumps(r), flush=True)
        return 0
    if args.plot_only:  # draw the plot of saved results again
        saved = os.path.join(RESULTS_DIR, f"{args.json}.json")
        with open(saved) as f:
            doc = json.load(f)
        plot(doc["results"], os.path.join(RESULTS_DIR, f"{args.json}.png"), doc["records"])
        return 0
    if args.quick:
        args.n, args.shards, args.rounds = min(args.n, 20_000), min(args.shards, 16), 1

    from benchmarks._common import describe_machine, print_table, write_json

    names = [k for k in CONFIGS if not args.only or k in args.only]
    for k, v in CREDENTIALS.items():  # moto takes any
        os.environ.setdefault(k, v)
    print(f"machine: {describe_machine()}")
    local = tempfile.mkdtemp(prefix="tg-peers-remote-")
    proc = None
    try:
        writes = write_formats(local, args.n, args.payload, args.shards)
        data_bytes = peers._du(os.path.join(local, "tg_arrayrecord"))
        budget = data_bytes // 3
        lo, hi = (x / 1000 for x in args.latency_ms)
        direct, endpoint, proc = start_store(lo, hi, args.conn_mbps * 1e6, args.total_mbps * 1e6)
        upload(direct, local)
        print(
            f"{args.n:,} records of ~{args.payload} B in {args.shards} shards per format "
            f"({data_bytes / 2**20:.0f} MiB as ArrayRecord), cache budget {budget / 2**20:.0f} MiB, "
            f"{args.latency_ms[0]:.0f}-{args.latency_ms[1]:.0f} ms per request, "
            f"{args.conn_mbps:.0f} MB/s per connection, {args.total_mbps:.0f} MB/s in all; "
            f"2 workers, batch 256, {args.epochs} epochs, {args.rounds} rounds",
            flush=True,
        )
        for w in writes:
            print(
                f"  write {w['format']}: {w['write_s']:.1f} s, {w['size_mib']:.1f} MiB", flush=True
            )
        runs = []
        for rnd in range(args.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                r = run_child(name, endpoint, args, budget)
                r["round"] = rnd
                runs.append(r)
                if "error" in r:
                    print(f"  round {rnd} {name:<22} {r['error']}", flush=True)
                for e in r.get("epochs", []):
                    print(
                        f"  round {rnd} {name:<22} epoch {e['epoch'] + 1}: {e['rate']:>8,.0f}/s  "
                        f"first {e['first_batch_s'] or 0:.2f}s  chunks {e['distinct_chunks']:.1f}  "
                        f"{e['check']}",
                        flush=True,
                    )
        rows = summarize(runs, names, args.epochs)
        print()
        print_table(
            rows,
            [
                "loader",
                "epoch",
                "rate",
                "x_block_cache",
                "first_batch_s",
                "distinct_chunks",
                "lag1_corr",
                "check",
            ],
        )
        write_json(
            args.json,
            {
                "records": args.n,
                "payload_bytes": args.payload,
                "shards": args.shards,
                "data_bytes": data_bytes,
                "cache_budget_bytes": budget,
                "latency_ms": args.latency_ms,
                "conn_mbps": args.conn_mbps,
                "total_mbps": args.total_mbps,
                "workers": 2,
                "batch_size": 256,
                "baseline": BASELINE,
                "writes": writes,
                "results": rows,
                "runs": runs,
            },
        )
        plot(rows, os.path.join(RESULTS_DIR, f"{args.json}.png"), args.n)
    finally:
        if proc is not None:
            proc.kill()
        shutil.rmtree(local, ignore_errors=True)
    return 0


def plot(rows: list[dict[str, Any]], path: str, n: int) -> None:
    """Speed against shuffle quality, one panel per epoch (red: torchgrain; an x: a
    loader that stalled or was cut before the epoch's end, at the rate it had)."""
    peers.plot(
        rows, path, n, panel="epoch", panel_title="epoch {} from the throttled store",
        xlabel="distinct shards per batch of 256 (uniform ~49)", ylabel="samples/s",
        title="records of ~1 KiB from S3 (moto) behind a slow proxy, cache 1/3 of data",
        flagged=" (cut/stalled)",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
