"""TFRecord with many files: global-shuffle rate over 8 files vs 10,000 files.

The same tiny records (16 bytes, so that the loader's own costs show) are written with
torchgrain's TFRecord writer into 8 files and into 10,000 files. Every measurement runs
in a fresh process, rounds interleaved: ``TFRecordSource(codec="raw")`` (its offsets
index built beforehand, in its own process, and mapped), ``tg.Dataset``,
``tg.GlobalShuffleSampler`` and a ``DataLoader`` with batches of 256 and 0 or 2
workers, timed from the loader's first batch request to the end of the window (the
first ``--window`` records of the epoch; the whole epoch by default), wall and CPU
seconds (the workers' CPU included).

The result is the 10,000-file rate over the 8-file rate, per round and worker setting
(median and range; also per CPU-second, steadier on a shared machine), against the
target of 0.7x (issue 38: 0.06x before, 22,806 vs 360,041 records/s). ``--base PATH`` also runs another checkout of torchgrain on the same
files (paired A/B, rounds interleaved): this checkout's 8-file rate over the base's (no
slowdown on the small path), and with ``--base-many`` the base's ratio too.

    python benchmarks/tfrecord_many_files.py --base /path/to/previous/checkout
    python benchmarks/tfrecord_many_files.py --records 400000 --rounds 1   # quick

Numbers from a shared machine are indicative: look at the ratios and their ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 256
TARGET = 0.7


def build(directory: str, n: int, files: int) -> str:
    """``n`` 16-byte records in ``files`` TFRecord files (torchgrain's writer)."""
    sys.path.insert(0, ROOT)
    from torchgrain.formats.tfrecord import write_tfrecord

    done = os.path.join(directory, ".complete")
    if os.path.exists(done):
        return directory
    os.makedirs(directory, exist_ok=True)
    pack = struct.Struct("<QQ").pack
    for s in range(files):
        a, b = n * s // files, n * (s + 1) // files
        records = (pack(i, i * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF) for i in range(a, b))
        write_tfrecord(records, os.path.join(directory, f"part-{s:05d}.tfrecord"))
    open(done, "w").close()
    return directory


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child(directory: str, index_dir: str, workers: int, window: int, only_index: bool) -> dict:
    """One timed pass in this (new) process; see the module docstring."""
    import warnings

    warnings.simplefilter("ignore")
    import torch  # imported before timing, as in a training script

    import torchgrain as tg

    t0 = time.perf_counter()
    src = tg.TFRecordSource(directory, codec="raw", index_dir=index_dir)
    opened = time.perf_counter() - t0
    if only_index:
        return {"open_seconds": opened, "records": len(src)}
    ds = tg.Dataset(src)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=BATCH,
        sampler=tg.GlobalShuffleSampler(ds, seed=0),
        num_workers=workers,
        collate_fn=lambda b: len(b),
    )
    want = window or len(src)
    n = 0
    t0, c0 = time.perf_counter(), _cpu()
    it = iter(loader)
    for got in it:
        n += got
        if n >= want:
            break
    seconds = time.perf_counter() - t0
    del it, loader  # (workers joined: their CPU counted)
    cpu = _cpu() - c0
    return {"records": n, "seconds": seconds, "cpu_seconds": cpu, "open_seconds": opened}


def run_child(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=code, NO_ALBUMENTATIONS_UPDATE="1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
        cwd=code,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} of {code} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_600_000)
    ap.add_argument("--files", type=int, nargs=2, default=[8, 10_000])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--window", type=int, default=0, help="records timed (0: the epoch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/torchgrain-tfrecord-many")
    ap.add_argument("--base", default=None, help="another checkout, measured beside this one")
    ap.add_argument(
        "--base-many",
        action="store_true",
        help="measure the base on the many files too (slow before issue 38: ~20k rec/s)",
    )
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        d, index_dir, workers, window, only_index = args.child
        print(json.dumps(child(d, index_dir, int(workers), int(window), only_index == "1")))
        return

    sys.path.insert(0, HERE)
    from _common import describe_machine, print_table, write_json

    print(describe_machine())
    few, many = args.files
    data = {
        k: build(os.path.join(args.dir, f"{args.records}-{k}"), args.records, k)
        for k in (few, many)
    }
    codes = {"this": ROOT} | ({"base": os.path.abspath(args.base)} if args.base else {})
    runs = [(c, k) for c in codes for k in data if c == "this" or k == few or args.base_many]
    index = {(c, k): os.path.join(args.dir, f"index-{c}-{args.records}-{k}") for c, k in runs}
    builds = {}  # seconds of the first open of each (building the index unless there)
    for (c, k), ix in index.items():  # each checkout's index, built once, in its own process
        builds[f"{c} {k} files"] = run_child(codes[c], data[k], ix, "0", "0", "1")["open_seconds"]
    rates: dict[tuple[str, int, int], list[float]] = {}
    cpu_rates: dict[tuple[str, int, int], list[float]] = {}  # records per CPU-second
    for r in range(args.rounds):
        for w in args.workers:
            for c, k in runs:
                rep = run_child(codes[c], data[k], index[c, k], str(w), str(args.window), "0")
                rate = rep["records"] / rep["seconds"]
                rates.setdefault((c, w, k), []).append(rate)
                cpu_rates.setdefault((c, w, k), []).append(rep["records"] / rep["cpu_seconds"])
                print(
                    f"  round {r + 1}/{args.rounds} {c:<4} {w} workers {k:>6} files: "
                    f"{rate:>10,.0f} rec/s ({rep['records'] / rep['cpu_seconds']:,.0f}/CPU-s)",
                    flush=True,
                )
    rows = []
    for w in args.workers:
        for c in codes:
            row = {"checkout": c, "workers": w}
            row[f"{few} files rec/s"] = statistics.median(rates[c, w, few])
            if (c, w, many) in rates:
                ratios = [m / f for m, f in zip(rates[c, w, many], rates[c, w, few])]
                row[f"{many} files rec/s"] = statistics.median(rates[c, w, many])
                row["ratio"] = statistics.median(ratios)
                row["ratio range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
                per_cpu = zip(cpu_rates[c, w, many], cpu_rates[c, w, few])
                row["CPU-s ratio"] = statistics.median(m / f for m, f in per_cpu)
                row["target"] = TARGET
                row["met"] = statistics.median(ratios) >= TARGET
            if c == "this" and "base" in codes:
                ab = [t / b for t, b in zip(rates["this", w, few], rates["base", w, few])]
                row[f"{few} files vs base"] = statistics.median(ab)
                row[f"{few} files vs base range"] = f"{min(ab):.2f}-{max(ab):.2f}"
            rows.append(row)
    print(f"\n{args.records:,} records of 16 B, global shuffle, batch {BATCH}, fresh processes")
    print_table(rows, list(dict.fromkeys(k for row in rows for k in row)))
    write_json(
        "tfrecord_many_files",
        {
            "records": args.records,
            "files": [few, many],
            "target_ratio": TARGET,
            "rows": rows,
            "rates": {f"{c} {w} workers {k} files": v for (c, w, k), v in rates.items()},
            "cpu_rates": {f"{c} {w} workers {k} files": v for (c, w, k), v in cpu_rates.items()},
            "index_open_seconds": builds,  # the first open: the index built, or mapped if there
            "args": vars(args),
        },
    )


if __name__ == "__main__":
    main()
