"""Sampler benchmark: index rate and memory vs DistributedSampler, and shuffle quality.

Part 1 (speed and memory). Each measurement runs in its own subprocess, so peak RSS
(``resource.getrusage(...).ru_maxrss``) belongs to that measurement alone; the
table reports the peak's growth over the process's RSS just before the work:

* ``GlobalShuffleSampler`` vectorised: ``sampler.indices(start, stop)`` over the
  whole epoch in 1M-index chunks.
* ``BlockShuffleSampler`` vectorised (``block_vectorised``): the same, over blocks of
  1,000 rows with a window of 8.
* ``GlobalShuffleSampler`` iterated: ``for i in sampler`` (what a DataLoader does).
* ``DistributedSampler``: ``for i in sampler`` (``torch.randperm`` + ``tolist``).
* ``torch.randperm`` alone: the vectorised core of DistributedSampler.

Rates use CPU time of the measuring process (``time.process_time``), which is less
disturbed than wall time on a shared machine; wall time is reported too. At
``N = 10**9`` only our sampler runs (DistributedSampler would need ~36 GB): it
draws a prefix of the epoch and reports the RSS growth.

Part 2 (shuffle quality vs block locality), on a dataset of 1,000 blocks of 1,000
rows: mean |i[t+1] - i[t]| / N (a uniform shuffle gives 1/3), lag-1 correlation,
distinct blocks among 256 consecutive samples, the number of other blocks each block
shares a batch of 256 with over the epoch (how widely rows mix), and block decodes per block per
epoch for 4 DataLoader workers (round-robin batches of 256) that each keep an LRU
cache of 8, 10, 32 or 34 decoded blocks (the ideal is 4: each worker decodes each
block once; dealt to the workers, 1). A sliding window of ``w`` blocks needs a cache
of ``w + 1`` blocks when a batch spans two stripes, hence ``w`` and ``w + 2``.

Run: ``python benchmarks/sampler.py`` (about two minutes; ``--quick`` for a smoke
run, ``--sizes 1e7,1e8`` to choose sizes). Writes benchmarks/results/sampler.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _common import describe_machine, print_table, write_json  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# ----------------------------------------------------------------------------- child


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DistributedSampler

    from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler

    n, mode, limit = int(spec["n"]), spec["mode"], spec.get("limit")
    base = _rss()
    c0, w0 = time.process_time(), time.perf_counter()
    first = None
    count = 0
    checksum = 0
    if mode in ("ours_vectorised", "block_vectorised"):
        if mode == "ours_vectorised":
            s = GlobalShuffleSampler(n, num_replicas=1, rank=0, seed=0)
        else:  # blocks of 1,000 rows (Parquet row groups, say), a window of 8
            offsets = np.append(np.arange(0, n, 1000, dtype=np.int64), n)
            s = BlockShuffleSampler(None, block_offsets=offsets, window=8, num_replicas=1, rank=0)
        stop = min(len(s), int(limit)) if limit else len(s)
        step = 1 << 20
        for start in range(0, stop, step):
            chunk = s.indices(start, min(start + step, stop))
            if first is None:
                first = time.perf_counter() - w0
            checksum ^= int(np.bitwise_xor.reduce(chunk))
            count += len(chunk)
    elif mode == "ours_iter":
        s = GlobalShuffleSampler(n, num_replicas=1, rank=0, seed=0)
        it = iter(s)
        stop = min(len(s), int(limit)) if limit else len(s)
        first_i = next(it)
        first = time.perf_counter() - w0
        count, checksum = 1, first_i
        for _i in it:
            count += 1
            if count == stop:
                break
    elif mode == "torch_iter":
        s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0)
        it = iter(s)
        first_i = next(it)
        first = time.perf_counter() - w0
        count, checksum = 1, first_i
        for _i in it:
            count += 1
    elif mode == "torch_randperm":
        g = torch.Generator()
        g.manual_seed(0)
        perm = torch.randperm(n, generator=g)
        first = time.perf_counter() - w0
        count = len(perm)
        checksum = int(perm[0])
    else:
        raise ValueError(mode)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "n": n,
        "mode": mode,
        "count": count,
        "cpu_s": cpu,
        "wall_s": wall,
        "first_index_s": first,
        "rate_per_s": count / cpu if cpu else float("inf"),
        "peak_rss_growth_mib": max(0, peak - base) / 2**20,
        "checksum": checksum,
    }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- quality


def quality_metrics(order: np.ndarray, block: int, n_blocks: int) -> dict[str, float]:
    o = order.astype(np.int64)
    n = len(o)
    blocks = o // block
    jumps = np.abs(np.diff(o)).mean() / n
    lag1 = float(np.corrcoef(o[:-1], o[1:])[0, 1])
    w = 256
    m = (n // w) * w
    win = np.sort(blocks[:m].reshape(-1, w), axis=1)
    distinct = float(((np.diff(win, axis=1) != 0).sum(axis=1) + 1).mean())
    # Block decodes with 4 workers taking batches round-robin, each with an LRU cache.
    decodes = {}
    batch_blocks = [np.unique(blocks[b : b + 256]).tolist() for b in range(0, n, 256)]
    # Mixing across batches: how many other blocks each block shares a batch with.
    together = np.zeros((n_blocks, n_blocks), dtype=bool)
    for wanted in batch_blocks:
        together[np.ix_(wanted, wanted)] = True
    partners = float(together.sum(axis=1).mean() - 1)
    for cache_blocks in (8, 10, 32, 34):
        caches = [collections.OrderedDict() for _ in range(4)]
        count = 0
        for b, wanted in enumerate(batch_blocks):
            cache = caches[b % 4]
            for blk in wanted:
                if blk in cache:
                    cache.move_to_end(blk)
                else:
                    count += 1
                    cache[blk] = True
                    if len(cache) > cache_blocks:
                        cache.popitem(last=False)
        decodes[cache_blocks] = count / n_blocks
    return {
        "mean_abs_jump_over_n": float(jumps),
        "lag1_corr": lag1,
        "distinct_blocks_per_256": distinct,
        "batch_partner_blocks": partners,
        "decodes_per_block_lru8": decodes[8],
        "decodes_per_block_lru10": decodes[10],
        "decodes_per_block_lru32": decodes[32],
        "decodes_per_block_lru34": decodes[34],
    }


def quality_table() -> list[dict[str, Any]]:
    from torch.utils.data import DistributedSampler

    from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler

    block, n_blocks = 1000, 1000
    n = block * n_blocks
    offsets = np.arange(0, n + 1, block)
    orders = {
        "GlobalShuffleSampler": GlobalShuffleSampler(n, num_replicas=1, rank=0).indices(),
        "BlockShuffleSampler(window=8)": BlockShuffleSampler(
            None, block_offsets=offsets, window=8, num_replicas=1, rank=0
        ).indices(),
        "BlockShuffleSampler(window=32)": BlockShuffleSampler(
            None, block_offsets=offsets, window=32, num_replicas=1, rank=0
        ).indices(),
        # Told the loader's batch_size and num_workers: each worker reads its own part.
        "BlockShuffleSampler(window=8, dealt to 4 workers)": BlockShuffleSampler(
            None,
            block_offsets=offsets,
            window=8,
            num_replicas=1,
            rank=0,
            batch_size=256,
            num_workers=4,
        ).indices(),
        "DistributedSampler(shuffle=True)": np.fromiter(
            DistributedSampler(range(n), num_replicas=1, rank=0), dtype=np.int64, count=n
        ),
        "sequential (no shuffle)": np.arange(n),
    }
    rows = []
    for name, order in orders.items():
        assert np.array_equal(np.sort(order), np.arange(n)), name
        rows.append({"sampler": name, **quality_metrics(order, block, n_blocks)})
    return rows


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1e7,1e8", help="dataset sizes compared with torch")
    ap.add_argument(
        "--iter-limit", type=float, default=2e7, help="indices drawn by Python iteration"
    )
    ap.add_argument("--big", type=float, default=1e9, help="size for the memory check (0: skip)")
    ap.add_argument("--big-draw", type=float, default=2e8, help="indices drawn at --big")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    if args.quick:
        args.sizes, args.iter_limit, args.big, args.big_draw = "1e6", 1e6, 1e9, 5e6

    print(f"machine: {describe_machine()}")
    sizes = [int(float(x)) for x in args.sizes.split(",")]
    rows = []
    for n in sizes:
        res = {
            mode: run_child(
                {"n": n, "mode": mode, "limit": args.iter_limit if mode == "ours_iter" else None}
            )
            for mode in (
                "ours_vectorised",
                "block_vectorised",
                "ours_iter",
                "torch_iter",
                "torch_randperm",
            )
        }
        torch_rate = res["torch_iter"]["rate_per_s"]
        torch_mem = res["torch_iter"]["peak_rss_growth_mib"]
        for mode, r in res.items():
            rows.append(
                {
                    "N": f"{n:.0e}",
                    "method": mode,
                    "indices": r["count"],
                    "M idx/s (cpu)": r["rate_per_s"] / 1e6,
                    "x torch iter": r["rate_per_s"] / torch_rate,
                    "first idx s": r["first_index_s"],
                    "wall s": r["wall_s"],
                    "peak +MiB": r["peak_rss_growth_mib"],
                    "mem / torch": r["peak_rss_growth_mib"] / torch_mem if torch_mem else None,
                    **{"_raw": r},
                }
            )
    big = None
    if args.big:
        big = run_child({"n": int(args.big), "mode": "ours_vectorised", "limit": args.big_draw})
        rows.append(
            {
                "N": f"{int(args.big):.0e}",
                "method": "ours_vectorised",
                "indices": big["count"],
                "M idx/s (cpu)": big["rate_per_s"] / 1e6,
                "first idx s": big["first_index_s"],
                "wall s": big["wall_s"],
                "peak +MiB": big["peak_rss_growth_mib"],
                "_raw": big,
            }
        )
    print("\nIndex generation (one rank = whole epoch; torch at 1e9 would need ~36 GB)")
    cols = [
        "N",
        "method",
        "indices",
        "M idx/s (cpu)",
        "x torch iter",
        "first idx s",
        "wall s",
        "peak +MiB",
        "mem / torch",
    ]
    print_table(rows, cols)
    if big:
        ok_mem = big["peak_rss_growth_mib"] < 50
        ok_rate = big["rate_per_s"] >= 20e6
        print(
            f"\nN=1e9: peak RSS growth {big['peak_rss_growth_mib']:.1f} MiB (target < 50: "
            f"{'met' if ok_mem else 'MISSED'}), vectorised {big['rate_per_s'] / 1e6:.1f}M idx/s "
            f"(target >= 20M: {'met' if ok_rate else 'MISSED'})"
        )

    print("\nShuffle quality vs block locality (1,000 blocks x 1,000 rows)")
    q = quality_table()
    print_table(
        q,
        [
            "sampler",
            "mean_abs_jump_over_n",
            "lag1_corr",
            "distinct_blocks_per_256",
            "batch_partner_blocks",
            "decodes_per_block_lru8",
            "decodes_per_block_lru10",
            "decodes_per_block_lru32",
            "decodes_per_block_lru34",
        ],
    )

    write_json(
        "sampler",
        {
            "speed": [
                {k: v for k, v in r.items() if k != "_raw"} | {"raw": r["_raw"]} for r in rows
            ],
            "quality": q,
        },
    )


if __name__ == "__main__":
    main()
