"""Composed datasets: a mixture and a concatenation against the same records in one source.

Every timed measurement runs in a fresh process, on the same files, in one run, rounds
interleaved (the median is reported):

1. ``rate``: one whole pass of a :class:`~torchgrain.GlobalShuffleSampler` (epoch 0,
   seed 0) through a ``DataLoader`` (batch 256, no collation, ``--workers``), over
   * ``one``: an ArrayRecord dataset of all the records;
   * ``concat``: ``tg.concat`` of the same records written as 3 datasets (50/30/20%);
   * ``mix``: ``tg.mix`` of those 3 datasets, weights proportional to their sizes, so
     an epoch is every record once (the same work as ``one``).
   Target: ``mix`` and ``concat`` >= 0.9x ``one``.
2. ``memory``: a fresh process builds ``tg.mix`` of the 3 datasets with an epoch of
   10^7 and then (another process) 10^9 positions, resolves 200 batches of 256
   positions drawn by a GlobalShuffleSampler from the middle of the epoch, then reads
   20 of them, and reports the private memory it gained (``Anonymous`` of
   ``/proc/self/smaps_rollup``) from after a warm-up on a mixture of 1,000 positions
   (imports, readers). Target: the same at both lengths.
3. ``windows``: in this process, the proportions of the 3 sources in every window of
   256 consecutive records of an epoch of 10^6 positions (weights 0.5/0.3/0.2), in the
   mixture's own order and after a GlobalShuffleSampler: the standard deviation and the
   largest deviation of a window's count from 256 w_k, against the binomial
   (``sqrt(B w (1 - w))``) and hypergeometric (``* sqrt((L - B) / (L - 1))``)
   expectations of a uniform shuffle.

Run:  python benchmarks/compose.py [--records 300000] [--rounds 3] [--workers 0]
      [--data DIR] [--filter]
Writes benchmarks/results/compose.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import describe_machine, print_table, write_json

BATCH = 256
PARTS = (0.5, 0.3, 0.2)  # the 3 datasets' shares of the records
LENGTHS = (10**7, 10**9)


def write_data(d: str, records: int) -> None:
    """The records as one dataset (``one``) and as 3 (``part0..2``), ArrayRecord, one
    record per chunk (random access), a 100-byte payload each."""
    import torchgrain as tg

    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, (records, 100), dtype=np.uint8)
    recs = [{"id": i, "payload": payload[i]} for i in range(records)]
    tg.write_array_record(recs, os.path.join(d, "one"), num_shards=4)
    bounds = np.cumsum([0, *(round(p * records) for p in PARTS)])
    bounds[-1] = records
    for k in range(len(PARTS)):
        part = recs[bounds[k] : bounds[k + 1]]
        tg.write_array_record(part, os.path.join(d, f"part{k}"), num_shards=2)


def _sources(d: str) -> list:
    import torchgrain as tg

    return [tg.ArrayRecordSource(os.path.join(d, f"part{k}")) for k in range(len(PARTS))]


def _dataset(kind: str, d: str, length: int | None = None):
    import torchgrain as tg

    if kind == "one":
        return tg.Dataset(tg.ArrayRecordSource(os.path.join(d, "one")))
    if kind == "concat":
        return tg.concat(_sources(d))
    return tg.mix(_sources(d), length=length)  # weights: the sizes; one pass of each


def _private_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def child_rate(kind: str, d: str, workers: int) -> dict:
    """One timed shuffled pass of ``kind`` in this (fresh) process."""
    import torch

    import torchgrain as tg

    ds = _dataset(kind, d)
    sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, sampler=sampler, num_workers=workers, collate_fn=_as_list
    )
    t0 = time.perf_counter()
    n = 0
    ids = 0
    for batch in loader:
        n += len(batch)
        ids += sum(r["id"] for r in batch)
    wall = time.perf_counter() - t0
    return {"kind": kind, "records": n, "id_sum": ids, "seconds": wall, "records_per_s": n / wall}


def _as_list(batch):
    return batch


def child_memory(d: str, length: int) -> dict:
    """Private memory a mixture of ``length`` positions costs this (fresh) process."""
    import torchgrain as tg

    sources = _sources(d)
    # Warm up on a small mixture first: imports, the readers and their caches are not
    # the memory a longer epoch costs.
    small = tg.mix(sources, length=1000)
    for b in range(4):
        small.__getitems__(list(range(b * BATCH % 1000, b * BATCH % 1000 + 10)))
    before = _private_bytes()
    ds = tg.mix(sources, length=length)
    sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
    start = length // 2
    for b in range(200):
        positions = sampler.indices(start + b * BATCH, start + (b + 1) * BATCH)
        ds.source.locate(positions)
    resolved = _private_bytes() - before
    for b in range(20):
        ds.__getitems__(sampler.indices(start + b * BATCH, start + (b + 1) * BATCH).tolist())
    return {
        "length": length,
        "private_mib_resolving": resolved / 2**20,
        "private_mib_with_reads": (_private_bytes() - before) / 2**20,
    }


def windows(length: int = 10**6, weights=(0.5, 0.3, 0.2)) -> list[dict]:
    """Per-window-of-256 proportion deviations (see the module docstring)."""
    import torchgrain as tg
    from torchgrain.compose.mix import MixOrder, mixture_counts, mixture_weights

    w = np.array(weights)
    counts = mixture_counts(length, mixture_weights([1] * len(w), list(weights)))
    order = MixOrder(counts)
    source = order(np.arange(length))[0]
    shuffled = source[
        tg.GlobalShuffleSampler(length, seed=0, num_replicas=1, rank=0).indices(0, length)
    ]
    binomial = np.sqrt(BATCH * w * (1 - w))
    hyper = binomial * np.sqrt((length - BATCH) / (length - 1))
    rows = []
    for name, seq in (("mixture order", source), ("global shuffle", shuffled)):
        win = seq[: length // BATCH * BATCH].reshape(-1, BATCH)
        got = np.stack([(win == k).sum(axis=1) for k in range(len(w))], axis=1)
        dev = got - BATCH * counts / length
        for k in range(len(w)):
            rows.append(
                {
                    "order": name,
                    "source": k,
                    "weight": float(w[k]),
                    "std": float(dev[:, k].std()),
                    "max_abs": float(np.abs(dev[:, k]).max()),
                    "binomial_std": float(binomial[k]),
                    "hypergeometric_std": float(hyper[k]),
                }
            )
    return rows


def _run_child(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# FILTER BENCHMARK HOOK: the filter's targets (building a selection over 10^7 Parquet
# rows against HF datasets' filter, pushdown, memory per record) are measured by
# benchmarks/compose_filter.py; `--filter` runs it here, after the mixture and
# concatenation, so that one command measures every composition target.
# ---------------------------------------------------------------------------
def run_filter_benchmark() -> None:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compose_filter.py")
    subprocess.run([sys.executable, script], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--data", help="keep the data here (default: a temporary directory)")
    ap.add_argument("--filter", action="store_true", help="also run compose_filter.py")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, d, *rest = args.child
        if what == "rate":
            print(json.dumps(child_rate(rest[0], d, int(rest[1]))))
        else:
            print(json.dumps(child_memory(d, int(rest[0]))))
        return

    print(describe_machine())
    d = args.data or tempfile.mkdtemp(prefix="tg-compose-")
    try:
        if not os.path.exists(os.path.join(d, "part2")):
            write_data(d, args.records)
        runs: dict[str, list[dict]] = {"one": [], "concat": [], "mix": []}
        for r in range(args.rounds):
            kinds = list(runs)
            for kind in kinds[r % 3 :] + kinds[: r % 3]:  # each round starts elsewhere
                runs[kind].append(_run_child(["rate", d, kind, str(args.workers)]))
        sums = {run["id_sum"] for rs in runs.values() for run in rs}
        assert len(sums) == 1, "every pass reads every record once"
        one = statistics.median(x["records_per_s"] for x in runs["one"])
        rate_rows = []
        for kind, rs in runs.items():
            rate = statistics.median(x["records_per_s"] for x in rs)
            rate_rows.append(
                {
                    "dataset": kind,
                    "records": rs[0]["records"],
                    "records_per_s": rate,
                    "min": min(x["records_per_s"] for x in rs),
                    "max": max(x["records_per_s"] for x in rs),
                    "vs_one": rate / one,
                }
            )
        print(f"\nshuffled pass, {args.rounds} rounds, workers={args.workers}, fresh processes")
        print_table(rate_rows, ["dataset", "records", "records_per_s", "min", "max", "vs_one"])

        memory = [_run_child(["memory", d, str(n)]) for n in LENGTHS]
        print("\nprivate memory of one process, by mixture length")
        print_table(memory, ["length", "private_mib_resolving", "private_mib_with_reads"])

        window_rows = windows()
        print(f"\nper-window-of-{BATCH} deviation from the weights, epoch of 10^6")
        print_table(
            window_rows,
            ["order", "source", "weight", "std", "max_abs", "binomial_std", "hypergeometric_std"],
        )
        write_json(
            "compose",
            {
                "records": args.records,
                "rounds": args.rounds,
                "workers": args.workers,
                "rate": rate_rows,
                "runs": runs,
                "memory": memory,
                "windows": window_rows,
            },
        )
    finally:
        if not args.data:
            shutil.rmtree(d, ignore_errors=True)
    if args.filter:
        run_filter_benchmark()


if __name__ == "__main__":
    main()
