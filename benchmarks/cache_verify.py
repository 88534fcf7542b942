"""What checking cached copies costs: check throughput, and warm epochs with it on vs off.

1. Throughput of the checks on a file in the page cache: the CRC-32 a hit is checked
   against (``file_crc``, once per process per copy), and for reference the whole-file
   hashes a download is checked against (``blake2b-file``, ``sha256``).
2. Warm epochs: an ArrayRecord dataset (default 50,000 records of 1 KiB in 32 shards)
   served over HTTP from a process of its own, its shard cache filled beforehand (by
   another process, as a DataLoader's workers find it). Each measurement is a fresh
   process that opens the source with the cache and reads two shuffled epochs in
   batches of 256 (``__getitems__``), then a pass of ``src[i]`` over 20,000 records: the
   first epoch includes each copy's check (this process has checked nothing yet), the
   second is the steady state. Modes: ``verify_hits`` on (the default) and off; with
   ``--baseline PATH``, also the same script against another checkout (e.g. the code
   before the checks). Rounds are interleaved; ratios are medians of per-round ratios.

Run:  python benchmarks/cache_verify.py [--records 50000] [--rounds 3] [--baseline PATH]
Writes benchmarks/results/cache_verify.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if "--child" not in sys.argv:  # a child imports torchgrain from the PYTHONPATH it is given
    sys.path.insert(0, ROOT)

BATCH = 256
SINGLES = 20_000


def throughput(mib: int) -> list[dict]:
    """GB/s of each check over a ``mib`` MiB file already in the page cache."""
    from torchgrain.io.file_hash import hash_file
    from torchgrain.io.shard_cache import file_crc

    d = tempfile.mkdtemp(prefix="tg-cache-verify-")
    path = os.path.join(d, "f")
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    checks = {
        "crc32 (hit check)": lambda: file_crc(path),
        "blake2b-file (download check)": lambda: hash_file(path, "blake2b-file"),
        "sha256 (download check)": lambda: hashlib.file_digest(open(path, "rb"), "sha256"),  # noqa: SIM115
    }
    rows = []
    for name, fn in checks.items():
        fn()  # page cache warm
        best = min(_timed(fn) for _ in range(3))
        gbps = mib * 2**20 / best / 1e9
        rows.append({"check": name, "GB/s": gbps, "s per GB": 1 / gbps})
    shutil.rmtree(d)
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(url: str, cache_dir: str, verify: str) -> dict:
    """Two epochs and a per-record pass in this (fresh) process."""
    import numpy as np

    import torchgrain as tg
    from torchgrain.io.shard_cache import ShardCache

    kw = {} if verify == "baseline" else {"verify_hits": verify == "on"}
    cache = ShardCache(cache_dir, max_bytes=1 << 34, **kw)
    src = tg.ArrayRecordSource(url, cache_dir=cache, cache_bytes=0)
    n = len(src)
    out = {}
    for epoch in range(2):
        order = np.random.default_rng(epoch).permutation(n)
        t0 = time.perf_counter()
        for a in range(0, n, BATCH):
            src.__getitems__(order[a : a + BATCH].tolist())
        out[f"epoch{epoch + 1}_s"] = time.perf_counter() - t0
    singles = np.random.default_rng(9).integers(0, n, SINGLES).tolist()
    t0 = time.perf_counter()
    for i in singles:
        src[i]
    out["per_record_us"] = (time.perf_counter() - t0) / SINGLES * 1e6
    out["verified"] = src.io_stats.get("cache_verified", 0)
    out["misses"] = src.io_stats.get("cache_misses", 0)
    return out


def _run_child(url: str, cache_dir: str, verify: str, path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, __file__, "--child", url, cache_dir, verify]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=50_000)
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mib", type=int, default=256, help="file size for the throughput part")
    p.add_argument("--baseline", help="another checkout to compare with (PYTHONPATH)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    import numpy as np

    import torchgrain as tg
    from benchmarks._common import describe_machine, print_table, start_http_store, write_json

    print(describe_machine())
    rows = throughput(args.mib)
    print_table(rows, ["check", "GB/s", "s per GB"])

    work = tempfile.mkdtemp(prefix="tg-cache-verify-")
    root = os.path.join(work, "www")
    rng = np.random.default_rng(0)
    recs = ({"x": rng.integers(0, 255, 1000, dtype=np.uint8), "i": i} for i in range(args.records))
    tg.write_array_record(
        _Sized(recs, args.records), os.path.join(root, "ds"), num_shards=args.shards
    )
    url, server = start_http_store(root, 0.0, 0.0)
    cache_dir = os.path.join(work, "cache")
    modes = {"on": ROOT, "off": ROOT}
    if args.baseline:
        modes["baseline"] = os.path.abspath(args.baseline)
    try:
        _run_child(f"{url}/ds", cache_dir, "off", ROOT)  # fills the cache
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode, path in modes.items():
                runs[mode].append(_run_child(f"{url}/ds", cache_dir, mode, path))
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)

    table = []
    for mode, rs in runs.items():
        table.append(
            {
                "mode": mode,
                "epoch 1 s": statistics.median(r["epoch1_s"] for r in rs),
                "epoch 2 s": statistics.median(r["epoch2_s"] for r in rs),
                "src[i] us": statistics.median(r["per_record_us"] for r in rs),
                "copies checked": rs[0]["verified"],
                "downloads": rs[0]["misses"],
            }
        )
    print_table(
        table, ["mode", "epoch 1 s", "epoch 2 s", "src[i] us", "copies checked", "downloads"]
    )

    def ratio(key: str, a: str, b: str) -> float:
        return statistics.median(x[key] / y[key] for x, y in zip(runs[a], runs[b]))

    ratios = {
        f"{key} {a}/{b}": ratio(key, a, b)
        for key in ("epoch1_s", "epoch2_s", "per_record_us")
        for a, b in [("on", "off")] + ([("on", "baseline")] if args.baseline else [])
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    write_json(
        "cache_verify",
        {
            "records": args.records,
            "shards": args.shards,
            "rounds": args.rounds,
            "throughput": rows,
            "warm": table,
            "ratios": ratios,
            "runs": runs,
        },
    )


class _Sized:
    def __init__(self, it, n):
        self._it, self._n = it, n

    def __len__(self):
        return self._n

    def __iter__(self):
        return self._it


if __name__ == "__main__":
    main()
