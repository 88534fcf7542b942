"""A global shuffle from an S3 server (moto's), against the bound its own capacity sets.

moto's S3 server runs in a process of its own on 127.0.0.1, with no latency added: its
own time per request is the limit. Before anything torchgrain, a plain client that is
not torchgrain (aiohttp, 16 connections, unsigned GETs of a public object) measures its
**capacity** in requests/s of 1 KiB ranges. Then one global-shuffle pass of a few batches
(``GlobalShuffleSampler``, no shard cache, ``s3://`` through s3fs) over an ArrayRecord
dataset of 1 KiB records in 16 shards, with 0 and 2 DataLoader workers: ``before``
(each shard's ranges read on its own, 8 shards at a time) and ``after`` (the batch's
records fetched across its shards at once, ``max_inflight`` in flight). The bound is the
capacity (one request per record); the ratio to it is printed beside each rate. The
store, the client and the workers share this machine's cores: indicative.

Each pass runs in a fresh process, rounds interleaved, with the variants of
``benchmarks/remote_global.py --coalescing``: ``base`` (the starting code, ``--base``),
``per_record`` (one request per record), ``earlier`` (each shard's ranges on its own,
merged across 64 KiB holes) and ``after`` (the batch-wide fetch, nearby ranges merged
within S3's gap and size cap: :func:`torchgrain.io.ranges.coalescing`). Requests are
counted in the client (every S3 GET torchgrain makes, workers included). Target:
``after`` at least ``per_record``'s and ``earlier``'s rate.

Run:  python benchmarks/remote_global_s3.py [--rounds 3] [--base /tmp/base]
Writes benchmarks/results/remote_global_s3.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import describe_machine, print_table, write_json
from benchmarks.remote_global import _write, run_variants, summarise, targets

BUCKET = "remote-global"


def _serve(q: Any) -> None:
    from tests.servers import start_moto_s3

    _server, endpoint = start_moto_s3()
    q.put(endpoint)
    while True:
        time.sleep(3600)


def _start_moto() -> tuple[Any, str]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(q,), daemon=True)
    proc.start()
    return proc, q.get(timeout=120)


async def _client(url: str, span: int, size: int, seconds: float, conns: int) -> int:
    """Requests of ``size`` bytes at random offsets a plain aiohttp client gets answered
    in ``seconds`` with ``conns`` connections."""
    import aiohttp

    done = 0
    stop = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(seed: int) -> None:
            nonlocal done
            rng = random.Random(seed)
            while time.perf_counter() < stop:
                a = rng.randrange(0, span - size)
                headers = {"Range": f"bytes={a}-{a + size - 1}"}
                async with session.get(url, headers=headers) as r:
                    if len(await r.read()) != size:
                        raise RuntimeError(f"{url}: a short answer ({r.status})")
                done += 1

        await asyncio.gather(*(one(k) for k in range(conns)))
    return done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--records", type=int, default=32768)
    p.add_argument("--batches", type=int, default=16, help="batches of 256 timed per pass")
    p.add_argument("--max-inflight", type=int, default=128)
    p.add_argument("--workers", default="2,0")
    p.add_argument("--base", default=None, help="the starting code's checkout (a variant)")
    p.add_argument("--tree", default=None, help="the checkout to measure (default: this)")
    a = p.parse_args()
    import boto3

    print(f"machine: {describe_machine()}")
    root = tempfile.mkdtemp(prefix="tg-remote-global-s3-")
    proc = None
    try:
        d = _write(root, "r1024", a.records, 1024)
        proc, endpoint = _start_moto()
        for var, value in (
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
        ):
            os.environ.setdefault(var, value)  # moto accepts any
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        names = sorted(os.listdir(d))
        for name in names:
            s3.upload_file(os.path.join(d, name), BUCKET, f"r1024/{name}")
        # A public copy of one shard for the plain client (unsigned requests).
        probe = next(n for n in names if n.endswith(".array_record"))
        with open(os.path.join(d, probe), "rb") as f:
            body = f.read()
        s3.put_object(Bucket=BUCKET, Key="probe", Body=body, ACL="public-read")
        capacity = asyncio.run(_client(f"{endpoint}/{BUCKET}/probe", len(body), 1024, 5.0, 16))
        capacity /= 5.0
        print(f"moto capacity (plain aiohttp client, 16 connections): {capacity:,.0f} req/s")
        opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        variants = ["base", "per_record", "earlier", "after"]
        if not a.base:
            variants.remove("base")
        rows = []
        for workers in (int(w) for w in a.workers.split(",")):
            specs = {
                v: {
                    "variant": v,
                    "location": f"s3://{BUCKET}/r1024",
                    "storage_options": opts,
                    "workers": workers,
                    "batch": 256,
                    "batches": a.batches,
                    "max_inflight": a.max_inflight,
                }
                for v in variants
            }
            got = run_variants(specs, a.rounds, a.base, a.tree)
            for row in summarise(got, 256 * a.batches, 1024, store="moto-s3", workers=workers):
                row["bound"] = capacity
                row["of_bound"] = row["records_per_s"] / capacity
                rows.append(row)
        print()
        print_table(rows, ["workers", "variant", "records_per_s", "rounds", "requests"])
        goals = []
        for workers in {r["workers"] for r in rows}:
            goal = targets([r for r in rows if r["workers"] == workers], "moto-s3")
            goals.append({**goal, "workers": workers})
        print(goals)
        write_json(
            "remote_global_s3",
            {
                "capacity_requests_per_s": capacity,
                "settings": {
                    "records": a.records,
                    "record_bytes": 1024,
                    "batch": 256,
                    "batches": a.batches,
                    "max_inflight": a.max_inflight,
                    "rounds": a.rounds,
                    "base": a.base,
                    "note": "fresh process per pass, rounds interleaved; 2 shared cores",
                },
                "targets": goals,
                "rows": rows,
            },
        )
    finally:
        if proc is not None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
