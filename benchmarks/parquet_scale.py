"""Parquet bigger than the cache, in records format, default options: torchgrain against
Hugging Face ``datasets`` on the same files, and against one decode of the data.

The data: ``--rows`` tiny records (an int64 id and a float64, 16 bytes decoded, so that
the loaders' own costs show) in 8 files of 50,000-row row groups. By default the
decoded data is 4x ``ParquetSource``'s default in-memory cache (256 MiB): 67M rows,
1 GiB. Every measurement runs in a fresh process (rounds interleaved), reading batches
of 256 records in the order of ``GlobalShuffleSampler(seed=0)`` (a true global shuffle):

* ``decode``: ``pq.read_table`` of every file, the cost of decoding the data once.
* ``tg-first``: ``tg.ParquetSource(dir)`` with default options (its decoded disk cache
  turns on by itself, in ``$TORCHGRAIN_CACHE``, pointed at the bench's directory and
  emptied first), epoch 0: the batches until every row group has been decoded into the
  disk cache (each once), then ``--batches`` more at the rate the rest of the epoch
  reads. ``first-epoch extra`` is the time of those first batches beyond what they take
  at that rate: what the first epoch costs on top of a later one.
* ``tg-epoch2``: a fresh process, the disk cache built: epoch 1's first ``--batches``
  batches (opening and checking every cached row group included: a second epoch with
  new DataLoader workers), then ``--batches`` more (``steady``); ``whole`` is the rate
  of the whole epoch, its first batches as measured and the rest at the steady rate.
* ``hf``: ``datasets.Dataset.from_parquet`` (its Arrow cache built once beforehand, not
  timed), python format, ``ds[batch]`` (``getitem``) and ``ds.__getitems__(batch)``
  (what a DataLoader calls), the same batches, ``--batches`` after ``--warmup``.
* ``main`` (with ``--main PATH``): the same source from another checkout, a few batches
  (the code before: a row cache of Python rows that thrashes here).

Targets (issue 28): ``tg-epoch2`` >= ``hf`` (its whole epoch, and even its first
batches); ``first-epoch extra`` <= 2x ``decode``. The machine is printed; ratios are the result, medians over rounds
(ranges shown).

Run: ``python benchmarks/parquet_scale.py [--rows N] [--rounds 3] [--batches 1000]``
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

BATCH = 256
ROW_GROUP = 50_000
FILES = 8
DEFAULT_CACHE = 256 << 20


# ----------------------------------------------------------------------- data
def make_files(root: str, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    per = -(-rows // FILES)
    for f in range(FILES):
        lo, hi = f * per, min(rows, (f + 1) * per)
        ids = np.arange(lo, hi, dtype=np.int64)
        x = np.random.default_rng(f).random(hi - lo)
        pq.write_table(
            pa.table({"id": ids, "x": x}),
            os.path.join(root, f"part-{f:03d}.parquet"),
            row_group_size=ROW_GROUP,
        )


def _order(n: int, epoch: int, count: int) -> Any:
    import torchgrain as tg

    s = tg.GlobalShuffleSampler(n, seed=0, num_replicas=1, rank=0)
    s.set_epoch(epoch)
    return s.indices(0, count * BATCH)


# ------------------------------------------------------------- child processes
def child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this fresh process."""
    sys.path.insert(0, args.main if mode == "main" else ROOT)
    if mode == "decode":
        import pyarrow.parquet as pq

        files = sorted(glob.glob(os.path.join(args.data, "*.parquet")))
        t0 = time.perf_counter()
        for f in files:
            pq.read_table(f)
        return {"seconds": time.perf_counter() - t0}
    if mode == "hf":
        import datasets

        datasets.disable_progress_bars()
        files = sorted(glob.glob(os.path.join(args.data, "*.parquet")))
        ds = datasets.Dataset.from_parquet(files, cache_dir=args.hf_cache)
        order = _order(len(ds), 1, args.warmup + 2 * args.batches)
        batches = [order[k : k + BATCH].tolist() for k in range(0, len(order), BATCH)]
        for b in batches[: args.warmup]:
            ds[b]
        out = {}
        for name, lo in (("getitem", args.warmup), ("getitems", args.warmup + args.batches)):
            part = batches[lo : lo + args.batches]
            t0 = time.perf_counter()
            for b in part:
                ds[b] if name == "getitem" else ds.__getitems__(b)
            out[name] = len(part) * BATCH / (time.perf_counter() - t0)
        return out
    import torchgrain as tg

    src = tg.ParquetSource(args.data)  # default options
    n = len(src)
    if mode == "main":
        order = _order(n, 1, args.main_batches)
        t0 = time.perf_counter()
        for k in range(0, len(order), BATCH):
            src.__getitems__(order[k : k + BATCH])
        return {"rate": len(order) / (time.perf_counter() - t0)}
    assert src.decoded_cache is not None, "the decoded disk cache did not turn on"
    groups = src.num_row_groups
    stats = src.decoded_cache.stats
    if mode == "tg-first":
        order = _order(n, 0, n // BATCH)
        k = 0
        t0 = time.perf_counter()
        while stats["builds"] + stats["hits"] < groups:
            src.__getitems__(order[k * BATCH : (k + 1) * BATCH])
            k += 1
        build = time.perf_counter() - t0
        t1 = time.perf_counter()
        for j in range(k, k + args.batches):
            src.__getitems__(order[j * BATCH : (j + 1) * BATCH])
        rate = args.batches * BATCH / (time.perf_counter() - t1)
        return {
            "build_batches": k,
            "build_seconds": build,
            "rest_rate": rate,
            "extra_seconds": build - k * BATCH / rate,
            "builds": stats["builds"],
            "row_groups": groups,
            "epoch_seconds_estimate": build + (n // BATCH - k) * BATCH / rate,
        }
    assert mode == "tg-epoch2"
    order = _order(n, 1, 2 * args.batches)
    t0 = time.perf_counter()
    for k in range(args.batches):
        src.__getitems__(order[k * BATCH : (k + 1) * BATCH])
    first = args.batches * BATCH / (time.perf_counter() - t0)
    t1 = time.perf_counter()
    for k in range(args.batches, 2 * args.batches):
        src.__getitems__(order[k * BATCH : (k + 1) * BATCH])
    steady = args.batches * BATCH / (time.perf_counter() - t1)
    # The whole epoch: its first batches (every row group opened and checked by this new
    # process) as measured, the rest at the steady rate.
    whole = n / (args.batches * BATCH / first + (n - args.batches * BATCH) / steady)
    return {
        "first": first,
        "steady": steady,
        "whole_epoch": whole,
        "builds": stats["builds"],
        "hits": stats["hits"],
    }


def run_child(mode: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--data", args.data]
    cmd += ["--batches", str(args.batches), "--warmup", str(args.warmup)]
    cmd += ["--hf-cache", args.hf_cache, "--main-batches", str(args.main_batches)]
    if args.main:
        cmd += ["--main", args.main]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4 * DEFAULT_CACHE // 16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--workdir", default="/tmp/torchgrain-parquet-scale")
    p.add_argument("--main", default=None, help="another checkout's root, for 'main'")
    p.add_argument("--main-batches", type=int, default=8)
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hf-cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    print(f"machine: {describe_machine()}")
    args.data = os.path.join(args.workdir, f"data-{args.rows}")
    args.hf_cache = os.path.join(args.workdir, "hf")
    tg_cache = os.path.join(args.workdir, "tg-cache")
    if not os.path.isdir(args.data):
        t0 = time.perf_counter()
        make_files(args.data, args.rows)
        print(f"wrote {args.rows:,} rows in {time.perf_counter() - t0:.0f}s")
    env = dict(os.environ, TORCHGRAIN_CACHE=tg_cache, PYTHONPATH="")
    run_child("hf", argparse.Namespace(**{**vars(args), "batches": 1, "warmup": 0}), env)
    decoded = os.path.join(tg_cache, "parquet-decoded")

    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r}
        row["decode"] = run_child("decode", args, env)["seconds"]
        shutil.rmtree(decoded, ignore_errors=True)
        row["tg-first"] = run_child("tg-first", args, env)
        row["hf"] = run_child("hf", args, env)
        row["tg-epoch2"] = run_child("tg-epoch2", args, env)
        if args.main:
            row["main"] = run_child("main", args, env)["rate"]
        rounds.append(row)
        print(f"round {r}: {json.dumps(row)}")

    def med(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    hf = [max(r["hf"]["getitem"], r["hf"]["getitems"]) for r in rounds]
    summary = {
        "decode_seconds": med([r["decode"] for r in rounds]),
        "first_epoch_extra_seconds": med([r["tg-first"]["extra_seconds"] for r in rounds]),
        "first_epoch_extra_over_decode": med(
            [r["tg-first"]["extra_seconds"] / r["decode"] for r in rounds]
        ),
        "tg_epoch2_first_batches_rate": med([r["tg-epoch2"]["first"] for r in rounds]),
        "tg_epoch2_whole_rate": med([r["tg-epoch2"]["whole_epoch"] for r in rounds]),
        "tg_steady_rate": med([r["tg-epoch2"]["steady"] for r in rounds]),
        "hf_rate": med(hf),
        "epoch2_first_batches_over_hf": med(
            [r["tg-epoch2"]["first"] / h for r, h in zip(rounds, hf)]
        ),
        "epoch2_whole_over_hf": med(
            [r["tg-epoch2"]["whole_epoch"] / h for r, h in zip(rounds, hf)]
        ),
        "steady_over_hf": med([r["tg-epoch2"]["steady"] / h for r, h in zip(rounds, hf)]),
    }
    if args.main:
        summary["main_rate"] = med([r["main"] for r in rounds])
        summary["epoch2_over_main"] = med([r["tg-epoch2"]["first"] / r["main"] for r in rounds])
    table = [
        {"measure": k, "median": v["median"], "min": v["min"], "max": v["max"]}
        for k, v in summary.items()
    ]
    print(
        f"\n{args.rows:,} rows ({args.rows * 16 / 2**20:,.0f} MiB decoded, "
        f"{args.rows * 16 / DEFAULT_CACHE:.1f}x the default cache), {args.rounds} rounds"
    )
    print_table(table, ["measure", "median", "min", "max"])
    write_json(
        "parquet_scale",
        {"rows": args.rows, "batch": BATCH, "rounds": rounds, "summary": summary},
    )
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
