"""Native ArrayRecord reader vs array_record's C++ reader, on the same files, in one run.

Writes two files with the C++ ``ArrayRecordWriter`` (zstd, group_size 1): N records of
1 KiB and M records of 100 KiB (half-entropy bytes, so zstd has work to do). Then:

* single-record random reads: native ``read([i])`` vs C++ ``read(i, i + 1)``;
* batched random reads (256 rows a batch): native ``read(rows)`` vs C++ ``read(rows)``
  (and vs a C++ ``read(i, i + 1)`` loop, the fastest way to batch with the C++ reader);
* batched decompression on a thread pool vs the sorted single-threaded loop;
* open time: footer parse of a fresh object (file in the page cache);
* fresh process: each reader (C++ ``read(i, i + 1)`` loop, C++ ``read(indices)``, native
  ``read([i])`` loop, native ``read(batch)``) opens the file and reads one whole shuffled
  pass in a new process of its own (``benchmarks/_fresh.py``; the file in the page
  cache, the process cold, as in a DataLoader worker's first epoch).

The warm comparisons run their contenders in alternating rounds and keep each one's
best round, which damps the noise of a shared machine; the fresh-process ones
interleave rounds too and report the median of per-round ratios. Results: a table and
``benchmarks/results/native_reader.json``.

Usage::

    python benchmarks/native_reader.py                 # short: 20k x 1 KiB, 300 x 100 KiB
    python benchmarks/native_reader.py --records 200000 --big-records 2000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import describe_machine, print_table, write_json
from _fresh import median_rate, median_ratio, run_fresh
from array_record.python.array_record_module import (
    ArrayRecordReader,
    ArrayRecordWriter,
)

from torchgrain.formats.arrayrecord_file import ArrayRecordFile

CPP_RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"


def write_file(path: str, n: int, size: int, seed: int) -> str:
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    tmp = path + ".tmp"
    w = ArrayRecordWriter(tmp, "group_size:1")
    block = 4096
    for start in range(0, n, block):
        k = min(block, n - start)
        data = rng.integers(0, 16, (k, size), dtype=np.uint8)  # ~4 bits of entropy a byte
        for row in data:
            w.write(row.tobytes())
    w.close()
    os.replace(tmp, path)
    return path


def best_of(
    rounds: int, contenders: dict[str, Callable[[], object]]
) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall time and best process CPU time of each contender over alternating rounds.

    CPU time (all threads of this process) is reported beside wall time because on a
    shared machine other people's jobs stretch wall time at random.
    """
    wall = dict.fromkeys(contenders, float("inf"))
    cpu = dict.fromkeys(contenders, float("inf"))
    for _ in range(rounds):
        for name, fn in contenders.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t)
            cpu[name] = min(cpu[name], time.process_time() - c)
    return wall, cpu


def threaded_read(f: ArrayRecordFile, pool: ThreadPoolExecutor, rows: list[int]) -> list[bytes]:
    """read(rows) with chunk decompression spread over a thread pool (for comparison)."""
    fo = f._footer
    assert fo is not None
    arr = np.asarray(rows, np.int64)
    chunks = np.unique(arr // fo.group_size).tolist()
    view = f._local_view()
    fast = f._fast_index(fo)
    decoded = dict(zip(chunks, pool.map(lambda c: f._local_chunk(c, view, fast), chunks)))
    return [decoded[r // fo.group_size][0] for r in rows]


def bench_file(label: str, path: str, args: argparse.Namespace, singles: int, batches: int):
    rng = np.random.default_rng(1)
    f = ArrayRecordFile(path)
    n = f.num_records
    cpp = ArrayRecordReader(path, CPP_RANDOM_ACCESS)
    single_rows = rng.integers(0, n, singles).tolist()
    batch_rows = [rng.integers(0, n, args.batch_size).tolist() for _ in range(batches)]

    # Same bytes from both readers before timing anything.
    check = batch_rows[0][:64]
    assert f.read(check) == cpp.read(check), "native and C++ readers disagree"

    def cpp_single():
        for i in single_rows:
            cpp.read(i, i + 1)

    def nat_single():
        for i in single_rows:
            f.read([i])

    def cpp_batch():
        for b in batch_rows:
            cpp.read(b)

    def cpp_batch_loop():
        for b in batch_rows:
            [cpp.read(i, i + 1)[0] for i in b]

    def nat_batch():
        for b in batch_rows:
            f.read(b)

    pool = ThreadPoolExecutor(args.threads)

    def nat_batch_threads():
        for b in batch_rows:
            threaded_read(f, pool, b)

    # Warm the page cache and both readers' lazy state.
    cpp_single()
    nat_single()
    w1, c1 = best_of(args.rounds, {"cpp": cpp_single, "native": nat_single})
    w2, c2 = best_of(
        args.rounds,
        {
            "cpp": cpp_batch,
            "cpp_loop": cpp_batch_loop,
            "native": nat_batch,
            "native_threads": nat_batch_threads,
        },
    )
    pool.shutdown()
    cpp.close()
    nb = batches * args.batch_size

    def row(test: str, count: int, w: dict, c: dict, new: str, old: str, call: str) -> dict:
        return {
            "file": label,
            "test": test,
            "native rec/s": count / w[new],
            "C++ rec/s": count / w[old],
            "ratio (wall)": w[old] / w[new],
            "ratio (CPU)": c[old] / c[new],
            "C++ call": call,
        }

    batch = f"batched random ({args.batch_size})"
    rows = [
        row("single random read", singles, w1, c1, "native", "cpp", "read(i, i+1)"),
        row(batch, nb, w2, c2, "native", "cpp", "read(indices)"),
        row(batch, nb, w2, c2, "native", "cpp_loop", "read(i, i+1) loop"),
        row(
            f"batched, {args.threads} decompression threads",
            nb,
            w2,
            c2,
            "native_threads",
            "native",
            "(C++ column: native 1 thread)",
        ),
    ]
    return rows


def bench_fresh(label: str, path: str, rounds: int) -> list[dict]:
    """One whole shuffled pass per reader, each in a new process; median per-round ratios."""
    res = run_fresh(
        ["cpp_single", "cpp_batched", "native_single", "native_batched"], rounds, file=path
    )

    def row(test: str, new: str, old: str, call: str) -> dict:
        return {
            "file": label,
            "test": f"fresh process, one shuffled pass: {test}",
            "native rec/s": median_rate(res[new]),
            "C++ rec/s": median_rate(res[old]),
            "ratio (wall)": median_ratio(res[new], res[old]),
            "ratio (CPU)": median_ratio(res[new], res[old], "cpu_seconds"),
            "C++ call": call,
        }

    return [
        row("single reads", "native_single", "cpp_single", "read(i, i+1)"),
        row("batches of 256", "native_batched", "cpp_batched", "read(indices)"),
        row("batches of 256", "native_batched", "cpp_single", "read(i, i+1) loop"),
    ]


def bench_open(path: str, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    def nat_open():
        f = ArrayRecordFile(path)
        f.num_records  # noqa: B018 - parses the footer
        f.close()

    def cpp_open():
        r = ArrayRecordReader(path, CPP_RANDOM_ACCESS)
        r.num_records()
        r.close()

    nat_open()
    cpp_open()
    return best_of(rounds, {"native": nat_open, "cpp": cpp_open})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=20_000, help="1 KiB records (full: 200000)")
    p.add_argument("--big-records", type=int, default=300, help="100 KiB records")
    p.add_argument("--singles", type=int, default=5_000, help="single reads per round")
    p.add_argument("--batches", type=int, default=20, help="batches per round (1 KiB file)")
    p.add_argument("--big-batches", type=int, default=2, help="batches per round (100 KiB file)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="threads for the threaded variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--fresh-rounds", type=int, default=3, help="fresh-process rounds per file (0: none)"
    )
    p.add_argument("--data-dir", default=None, help="keep generated files here between runs")
    p.add_argument("--json-name", default="native_reader")
    args = p.parse_args()

    data_dir = args.data_dir or tempfile.mkdtemp(prefix="native_reader_")
    os.makedirs(data_dir, exist_ok=True)
    print(f"machine: {describe_machine()}")
    t = time.perf_counter()
    small = write_file(
        os.path.join(data_dir, f"small_{args.records}.array_record"), args.records, 1024, 0
    )
    big = write_file(
        os.path.join(data_dir, f"big_{args.big_records}.array_record"),
        args.big_records,
        100 * 1024,
        1,
    )
    print(f"files ready in {time.perf_counter() - t:.1f}s ({data_dir})")

    rows = bench_file(f"{args.records} x 1 KiB", small, args, args.singles, args.batches)
    rows += bench_file(
        f"{args.big_records} x 100 KiB",
        big,
        args,
        max(1, args.singles // 20),
        args.big_batches,
    )
    if args.fresh_rounds:
        rows += bench_fresh(f"{args.records} x 1 KiB", small, args.fresh_rounds)
        rows += bench_fresh(f"{args.big_records} x 100 KiB", big, args.fresh_rounds)
    w, c = bench_open(small, max(args.rounds, 5))
    rows.append(
        {
            "file": f"{args.records} x 1 KiB",
            "test": f"open (footer of {args.records} chunks)",
            "native ms": w["native"] * 1e3,
            "C++ ms": w["cpp"] * 1e3,
            "ratio (wall)": w["cpp"] / w["native"],
            "ratio (CPU)": c["cpp"] / c["native"],
            "C++ call": "ArrayRecordReader(path)",
        }
    )
    cols = [
        "file",
        "test",
        "native rec/s",
        "C++ rec/s",
        "native ms",
        "C++ ms",
        "ratio (wall)",
        "ratio (CPU)",
        "C++ call",
    ]
    print("\n(ratio = C++ time / native time: > 1 means the native reader is faster)")
    print_table(rows, cols)
    write_json(args.json_name, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
