"""Global-shuffle random access over ArrayRecord: torchgrain vs Grain vs the C++ reader.

On the same generated files (1 KiB and 100 KiB records, group_size 1, zstd), in the same
run, every reader follows the same GlobalShuffleSampler order:

* torchgrain: ``tg.Dataset(tg.ArrayRecordSource(d))`` through a torch DataLoader
  (batch 256, one process, and 2 workers), and the source's ``__getitems__`` alone;
* Grain: ``grain.MapDataset.source(ArrayRecordDataSource(files)).shuffle().batch()``;
* the C++ ``ArrayRecordReader``: a ``read(i, i + 1)`` loop (the single-core limit) and
  its batched ``read(indices)``;
* torchgrain's native reader (``ArrayRecordFile``): single reads, batches, open time.

Two kinds of rows. Warm: each reader runs for a time budget in this process, after its
first use. Fresh process: each reader (C++ loop, C++ batched, native single and batched,
the source's ``__getitems__`` with the raw and msgpack codecs, Dataset + DataLoader with
0 and 2 workers) opens the file and reads one whole shuffled pass in a new process of
its own (``benchmarks/_fresh.py``: the file in the page cache, the process cold, as a
DataLoader worker's first epoch is), rounds interleaved; ratios are medians of
per-round ratios, by wall time and by CPU time (the CPU time of one process, steadier
than wall time on a shared machine; DataLoader workers' CPU included). Grain is left
out of the fresh rows (a whole pass takes minutes).

Prints records/s and ratios and writes benchmarks/results/random_access.json.

    python benchmarks/random_access.py                 # 200k x 1 KiB and 2k x 100 KiB
    python benchmarks/random_access.py --small-records 20000 --seconds 2   # quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchgrain as tg
from benchmarks._common import describe_machine, print_table, write_json
from benchmarks._fresh import READERS, median_ratio, run_fresh
from benchmarks._fresh import rows as fresh_rows
from torchgrain.formats.arrayrecord_file import ArrayRecordFile

BATCH = 256


def build(directory: str, n: int, size: int) -> str:
    """A one-shard torchgrain dataset of ``n`` records holding ``size`` random bytes."""
    if os.path.exists(os.path.join(directory, "torchgrain.json")):
        return directory
    rng = np.random.default_rng(0)

    class Records:
        def __len__(self):
            return n

        def __iter__(self):
            for i in range(n):
                yield {"data": rng.bytes(size), "i": i}

    tg.write_array_record(Records(), directory, num_shards=1, group_size=1)
    return directory


def timed_rate(fn, budget: float) -> tuple[float, float]:
    """Call ``fn() -> records done`` repeatedly for about ``budget`` seconds.

    Returns records per wall second and per CPU second of this process (steadier on a
    shared machine; it misses the CPU of worker processes).
    """
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        done += fn()
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            return done / elapsed, done / (time.process_time() - cpu)


def _epochs(loader, sampler):
    """Batches of consecutive epochs, without end."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def order(n: int) -> np.ndarray:
    return tg.GlobalShuffleSampler(n, seed=0, num_replicas=1, rank=0).indices(0, n)


def bench_fresh(directory: str, rounds: int) -> tuple[list[dict], dict[str, float]]:
    """Fresh-process rows (one whole shuffled pass per reader and process) and ratios."""
    res = run_fresh(list(READERS), rounds, directory=directory)
    summary = {}
    for name, a, b in (
        ("source_raw_vs_cpp_loop", "source_raw", "cpp_single"),
        ("source_raw_vs_cpp_batched", "source_raw", "cpp_batched"),
        ("source_msgpack_vs_cpp_loop", "source_msgpack", "cpp_single"),
        ("native_single_vs_cpp_loop", "native_single", "cpp_single"),
        ("native_batched_vs_cpp_batched", "native_batched", "cpp_batched"),
        ("dataloader_1proc_vs_cpp_loop", "loader_0", "cpp_single"),
    ):
        summary[f"fresh_{name}"] = median_ratio(res[a], res[b])
        summary[f"fresh_{name}_cpu"] = median_ratio(res[a], res[b], "cpu_seconds")
    return fresh_rows(res, "cpp_single"), summary


def bench_file(directory: str, budget: float, with_grain: bool) -> list[dict]:
    from array_record.python.array_record_module import ArrayRecordReader

    src = tg.ArrayRecordSource(directory)
    path = src.paths[0]
    n = len(src)
    perm = order(n)
    rows: list[dict] = []

    def run(name, fn, per_call):
        pos = [0]

        def step():
            k = pos[0] % (n - per_call + 1) if n > per_call else 0
            fn(perm[k : k + per_call])
            pos[0] += per_call
            return per_call

        rate, cpu = timed_rate(step, budget)
        rows.append({"reader": name, "records/s": rate, "CPU rec/s": cpu})
        print(f"  {name:<48} {rate:>12,.0f} rec/s ({cpu:,.0f}/CPU-s)", flush=True)
        return rate

    # Open time first, while no reader threads or workers run: footer parse of a fresh
    # object (file in the page cache), best of 5; closing (unmapping) is not counted.
    t_nat, t_cpp = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        f = ArrayRecordFile(path)
        _ = f.num_records
        t_nat.append(time.perf_counter() - t0)
        f.close()
        t0 = time.perf_counter()
        r = ArrayRecordReader(path, "readahead_buffer_size:0")
        _ = r.num_records()
        t_cpp.append(time.perf_counter() - t0)
        r.close()
    rows.append(
        {"reader": "open: native footer parse (ms)", "records/s": None, "ms": 1000 * min(t_nat)}
    )
    rows.append({"reader": "open: C++ reader (ms)", "records/s": None, "ms": 1000 * min(t_cpp)})

    # The C++ reader, set up for random access as its docs advise.
    cpp = ArrayRecordReader(path, "readahead_buffer_size:0,max_parallelism:0")
    run(
        "C++ read(i, i+1) loop (single-core limit)",
        lambda idx: [cpp.read(int(i), int(i) + 1) for i in idx],
        BATCH,
    )
    cpp_batched = ArrayRecordReader(path, "readahead_buffer_size:0")
    run(
        "C++ read(indices), batches of 256",
        lambda idx: cpp_batched.read([int(i) for i in idx]),
        BATCH,
    )

    native = ArrayRecordFile(path)
    run("native ArrayRecordFile.read([i]) loop", lambda idx: [native.read([i]) for i in idx], BATCH)
    run("native ArrayRecordFile.read(batch of 256)", lambda idx: native.read(idx), BATCH)
    run("torchgrain source __getitems__ (decoded)", lambda idx: src.__getitems__(idx), BATCH)
    raw = tg.ArrayRecordSource(directory, codec="raw")
    run("torchgrain source __getitems__ (codec raw)", lambda idx: raw.__getitems__(idx), BATCH)

    # torchgrain through a DataLoader: the whole pipeline, collate included.
    for workers in (0, 2):
        ds = tg.Dataset(tg.ArrayRecordSource(directory))
        sampler = tg.GlobalShuffleSampler(ds, seed=0)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=BATCH,
            sampler=sampler,
            num_workers=workers,
            collate_fn=lambda b: b,
            persistent_workers=workers > 0,
        )
        it = _epochs(loader, sampler)
        next(it)  # start-up (worker fork) is not part of the steady-state rate

        def step(it=it):
            return len(next(it))

        rate, cpu = timed_rate(step, budget)
        name = f"torchgrain Dataset + DataLoader, {workers} workers"
        rows.append({"reader": name, "records/s": rate, "CPU rec/s": None if workers else cpu})
        print(f"  {name:<48} {rate:>12,.0f} rec/s", flush=True)
        del it, loader

    if with_grain:
        try:
            import grain
            from grain.python import ArrayRecordDataSource
        except ImportError:
            print("  grain not installed: skipped")
        else:
            ds = grain.MapDataset.source(ArrayRecordDataSource([path])).shuffle(seed=0)
            ds = ds.repeat().batch(BATCH)  # epochs back to back, like the loops above
            it = iter(ds)

            def grain_step():
                return len(next(it))

            rate, _ = timed_rate(grain_step, budget)
            rows.append(
                {"reader": "grain MapDataset.source().shuffle().batch()", "records/s": rate}
            )
            print(f"  {'grain MapDataset.source().shuffle().batch()':<48} {rate:>12,.0f} rec/s")

    return rows


def ratios(rows: list[dict]) -> dict[str, float]:
    r = {row["reader"]: row["records/s"] for row in rows if row["records/s"]}
    base = r["C++ read(i, i+1) loop (single-core limit)"]
    base_cpu = next(
        row["CPU rec/s"]
        for row in rows
        if row["reader"] == "C++ read(i, i+1) loop (single-core limit)"
    )
    for row in rows:
        if row["records/s"] and not row["reader"].startswith("fresh"):
            row["x C++ loop"] = row["records/s"] / base
            if row.get("CPU rec/s"):
                row["x C++ loop (CPU)"] = row["CPU rec/s"] / base_cpu
    out = {
        "torchgrain_dataloader_1proc_vs_cpp_loop": r["torchgrain Dataset + DataLoader, 0 workers"]
        / base,
        "native_single_vs_cpp_loop": r["native ArrayRecordFile.read([i]) loop"] / base,
        "native_batched_vs_cpp_batched": r["native ArrayRecordFile.read(batch of 256)"]
        / r["C++ read(indices), batches of 256"],
        "source_raw_vs_cpp_loop": r["torchgrain source __getitems__ (codec raw)"] / base,
        "source_raw_vs_cpp_batched": r["torchgrain source __getitems__ (codec raw)"]
        / r["C++ read(indices), batches of 256"],
    }
    grain_rate = r.get("grain MapDataset.source().shuffle().batch()")
    if grain_rate:
        out["torchgrain_dataloader_1proc_vs_grain"] = (
            r["torchgrain Dataset + DataLoader, 0 workers"] / grain_rate
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small-records", type=int, default=200_000)
    p.add_argument("--large-records", type=int, default=2_000)
    p.add_argument("--seconds", type=float, default=3.0, help="time budget per reader")
    p.add_argument("--dir", default=None, help="where to keep the generated files")
    p.add_argument("--no-grain", action="store_true")
    p.add_argument("--fresh-rounds", type=int, default=3, help="fresh-process rounds (0: none)")
    args = p.parse_args()
    root = args.dir or os.path.join(tempfile.gettempdir(), "torchgrain-bench-random-access")
    print(f"machine: {describe_machine()}")
    results = {}
    for label, n, size in (
        ("1KiB", args.small_records, 1024),
        ("100KiB", args.large_records, 100 * 1024),
    ):
        d = build(os.path.join(root, f"{label}-{n}"), n, size)
        print(f"\n{label} records x {n:,} (group_size 1, zstd):")
        rows = bench_file(d, args.seconds, with_grain=not args.no_grain)
        summary = ratios(rows)
        if args.fresh_rounds:
            frows, fsummary = bench_fresh(d, args.fresh_rounds)
            rows += frows
            summary.update(fsummary)
        print()
        print_table(
            rows,
            ["reader", "records/s", "x C++ loop", "CPU rec/s", "x C++ loop (CPU)", "rounds", "ms"],
        )
        for k, v in summary.items():
            print(f"  {k}: {v:.2f}x")
        results[label] = {"records": n, "record_bytes": size, "rows": rows, "ratios": summary}
    write_json(
        "random_access",
        {
            "batch_size": BATCH,
            "results": results,
            "targets": {
                "torchgrain_dataloader_1proc_vs_cpp_loop": 0.8,
                "torchgrain_dataloader_1proc_vs_grain": 50,
                "native_single_vs_cpp_loop": 1.0,
                "native_batched_vs_cpp_batched": 1.5,
                "open_ms": 50,
                "fresh_source_raw_vs_cpp_loop": 1.0,
                "fresh_source_raw_vs_cpp_batched": 1.5,
            },
        },
    )


if __name__ == "__main__":
    main()
