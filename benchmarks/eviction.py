"""Shard-cache eviction: LRU against Belady's rule, in hit ratio and bytes downloaded.

A simulation (no I/O): a dataset of ``--shards`` equal shards (``--records`` records) is
read for one epoch in batches of ``--batch`` through a global shuffle
(``GlobalShuffleSampler``) and a block shuffle (``BlockShuffleSampler``, shards as
blocks, ``--window`` of them at a time). Each batch reads each shard it touches once
(what ``ShardedSource`` does with a shard cache); the sequence of those shard reads is
replayed through a cache of 1/3 and 1/10 of the dataset's bytes, cold at the start,
under:

* ``lru``: least recently used first (``ShardCache``'s default);
* ``belady``: what ``ShardCache(eviction="belady")`` does: furthest next use first,
  uses known as far as read-ahead scans ahead (``_HORIZON`` positions of the order,
  65,536 records), unknown ones counting as never, least recently used among those;
* ``bound``: Belady's rule knowing the whole epoch: the most hits any policy gets with
  equal shards.

Prints, and writes to ``benchmarks/results/eviction.json``, the hit ratio of each, the
ratio of ``belady`` to the bound, and the bytes each downloads in the epoch.

Run:  python benchmarks/eviction.py [--shards 60 --records 120000 --batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import torchgrain as tg
from benchmarks._common import RESULTS_DIR, describe_machine, machine, print_table
from torchgrain.io.eviction import simulate
from torchgrain.io.readahead import _HORIZON


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _trace(order: np.ndarray, index: tg.ShardIndex, batch: int) -> tuple[np.ndarray, float]:
    """The shard reads of an epoch (each batch's shards, in order of first need) and
    the mean number of reads per batch."""
    shards = index.locate(order)[0]
    reads = []
    for a in range(0, len(shards), batch):
        part = shards[a : a + batch]
        _, first = np.unique(part, return_index=True)
        reads.append(part[np.sort(first)])
    return np.concatenate(reads), len(np.concatenate(reads)) / len(reads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=60)
    p.add_argument("--records", type=int, default=120_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--shard-mb", type=float, default=256.0, help="bytes per shard, for the report")
    a = p.parse_args()
    print(f"machine: {describe_machine()}")
    counts = np.full(a.shards, a.records // a.shards, dtype=np.int64)
    index = tg.ShardIndex(counts)
    n = int(counts.sum())
    offsets = index.offsets
    samplers = {
        "global": tg.GlobalShuffleSampler(_Sized(n), seed=0, num_replicas=1, rank=0),
        "block": tg.BlockShuffleSampler(
            _Sized(n), seed=0, window=a.window, block_offsets=offsets, num_replicas=1, rank=0
        ),
    }
    shard_bytes = int(a.shard_mb * 1e6)
    rows = []
    for name, sampler in samplers.items():
        order = np.asarray(sampler.indices(0, len(sampler)))
        trace, per_batch = _trace(order, index, a.batch)
        horizon = int(_HORIZON / a.batch * per_batch)  # in shard reads
        for frac in (3, 10):
            capacity = a.shards // frac
            sims = {
                "lru": simulate(trace, capacity=capacity, policy="lru"),
                "belady": simulate(trace, capacity=capacity, policy="belady", horizon=horizon),
                "bound": simulate(trace, capacity=capacity, policy="belady"),
            }
            row = {
                "shuffle": name,
                "cache": f"1/{frac}",
                "reads": len(trace),
                **{f"{k}_hit_ratio": v.hit_ratio for k, v in sims.items()},
                "belady_of_bound": sims["belady"].hits / max(sims["bound"].hits, 1),
                **{
                    f"{k}_GB_downloaded": v.bytes_downloaded * shard_bytes / 1e9
                    for k, v in sims.items()
                },
            }
            rows.append(row)
    print(f"{a.shards} shards of {a.shard_mb:g} MB, {n:,} records, batches of {a.batch}")
    print_table(rows, list(rows[0]))
    out = {
        "machine": machine(),
        "settings": vars(a) | {"horizon_positions": _HORIZON},
        "rows": rows,
    }
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, "eviction.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("wrote benchmarks/results/eviction.json")


if __name__ == "__main__":
    main()
