"""Node-local stores at thousands of entries: a shard cache filled copy by copy, and the
first opening of a TFRecord dataset of many files (each file's offsets an entry of the
index directory), against another checkout of torchgrain.

Each case runs in a fresh process importing torchgrain from checkout A or B, rounds
interleaved (A, B / B, A ...), each with an empty store:

* ``shard-cache``: ``ShardCache.fetch`` of ``--copies`` tiny files of an in-memory
  filesystem into an empty cache directory (the loader's first epoch with
  ``cache_dir=`` over that many shards, without the network);
* ``tfrecord-open``: ``tg.TFRecordSource`` over ``--files`` TFRecord files of 40 records
  with an empty ``index_dir`` (the first process on a fresh machine).

Prints each case's seconds per checkout and the A/B ratio (median over rounds, and the
range), and writes ``results/<--json-name>.json``.

Run: ``python benchmarks/store_scale.py --a /path/to/baseline [--b .] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

CHILD = r"""
import os, sys, tempfile, time, warnings
warnings.simplefilter("ignore")
root, case, n, data, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path.insert(0, root)
import torchgrain as tg
if case == "shard-cache":
    import fsspec
    from torchgrain.io.shard_cache import ShardCache
    mem = fsspec.filesystem("memory")
    for i in range(n):
        mem.pipe(f"/scale/s{i}", b"x" * 100)
    cache = ShardCache(tempfile.mkdtemp(dir=work), max_bytes=1 << 40)
    t0 = time.perf_counter()
    for i in range(n):
        cache.fetch(f"memory://scale/s{i}")
else:
    t0 = time.perf_counter()
    tg.TFRecordSource(data, codec="raw", index_dir=tempfile.mkdtemp(dir=work))
print(time.perf_counter() - t0)
"""


def write_files(directory: str, n: int, checkout: str) -> None:
    if os.path.isdir(directory) and len(os.listdir(directory)) == n:
        return
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1])\n"
        "from torchgrain.formats.tfrecord import write_tfrecord\n"
        "d, n = sys.argv[2], int(sys.argv[3]); os.makedirs(d, exist_ok=True)\n"
        "for i in range(n):\n"
        "    write_tfrecord([b'x' * 16] * 40, os.path.join(d, f'part-{i:05d}.tfrecord'))\n"
    )
    subprocess.run([sys.executable, "-c", code, checkout, directory, str(n)], check=True)


def run(checkout: str, case: str, n: int, data: str, work: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, checkout, case, str(n), data, work],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="checkout B")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--copies", type=int, default=4000)
    p.add_argument("--files", type=int, default=10000)
    p.add_argument("--cases", default="shard-cache,tfrecord-open")
    p.add_argument("--json-name", default="store_scale")
    args = p.parse_args()
    print(describe_machine())
    work = tempfile.mkdtemp(prefix="store-scale-")
    data = os.path.join(work, "tf")
    write_files(data, args.files, args.b)
    rows, result = [], {}
    for case in args.cases.split(","):
        n = args.copies if case == "shard-cache" else args.files
        secs: dict[str, list[float]] = {"a": [], "b": []}
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                secs[side].append(run(getattr(args, side), case, n, data, work))
        ratios = [a / b for a, b in zip(secs["a"], secs["b"])]
        result[case] = {"n": n, "seconds": secs, "a_over_b": ratios}
        rows.append(
            {
                "case": case,
                "n": n,
                "A s": statistics.median(secs["a"]),
                "B s": statistics.median(secs["b"]),
                "A/B": statistics.median(ratios),
                "range": f"{min(ratios):.1f}-{max(ratios):.1f}",
            }
        )
    print_table(rows, ["case", "n", "A s", "B s", "A/B", "range"])
    print("wrote", write_json(args.json_name, {"args": vars(args), "cases": result}))


if __name__ == "__main__":
    main()
