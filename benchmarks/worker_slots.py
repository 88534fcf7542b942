"""Columns batches from DataLoader workers: reusable memfd slots against torch's transport.

``Dataset(..., batch_format="columns")`` has each worker write a batch's columns into
one of a few reusable shared-memory slots the main process maps once
(``worker_slots=8``, the default); ``worker_slots=0`` gives every batch a fresh
shared-memory segment that torch's pickler passes by file descriptor (torch's own path).
Beside them, for images, ``batch_format="records"``: torch's default collate stacks the
records into a fresh shared-memory tensor in the worker (torch's own transport, end to
end). Two batch shapes, 2 workers, ``prefetch_factor=2``:

* ``images``: 256 records of ``uint8[3, 224, 224]`` (38.5 MB a batch);
* ``records``: 256 records of 1 KiB of bytes and an int64 label.

The training loop copies each batch into a preallocated tensor (what pinning or a
host-to-device copy does with it) and drops it. Each measurement runs in a fresh
process, the two variants alternate within each round (paired), and the table gives
medians over rounds of: batches per second, and the main process's CPU time per batch
spent in ``next()`` plus the copy.

Run:  python benchmarks/worker_slots.py [--rounds 5] [--batches 40]
Writes benchmarks/results/worker_slots.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import describe_machine, print_table, write_json

BATCH = 256
DISTINCT = 512  # records held in memory; batches cycle through them


def _one(case: str, variant: str, batches: int) -> dict:
    import numpy as np
    import torch

    import torchgrain as tg

    rng = np.random.default_rng(0)
    if case == "images":
        recs = [
            {"image": rng.integers(0, 255, (3, 224, 224), dtype=np.uint8), "label": i}
            for i in range(DISTINCT)
        ]
    else:
        recs = [{"data": rng.bytes(1024), "label": i} for i in range(DISTINCT)]
    if variant == "records":
        ds = tg.Dataset(recs)
    else:
        ds = tg.Dataset(recs, batch_format="columns", worker_slots=int(variant))
    order = [i % DISTINCT for i in range(batches * BATCH)]
    loader = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, sampler=order, num_workers=2, prefetch_factor=2
    )
    key = "image" if case == "images" else "data"
    dst = None
    cpu = 0.0
    timed = 0
    it = iter(loader)
    t0 = None
    for k in range(batches):
        c = time.thread_time()
        batch = next(it)
        col = batch[key]
        if isinstance(col, tg.columns.Ragged):
            col = col.values
        if dst is None or dst.shape != col.shape:
            dst = torch.empty_like(col)
        dst.copy_(col)
        del batch, col
        if k >= 4:  # after the workers' start and first batches
            cpu += time.thread_time() - c
            timed += 1
        if k == 3:
            t0 = time.perf_counter()
    wall = time.perf_counter() - t0
    return {"batches_per_s": timed / wall, "main_cpu_ms": 1e3 * cpu / timed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--one", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1], args.batches)))
        return
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for case in ("images", "records"):
            variants = ["8", "0"] + (["records"] if case == "images" else [])
            for slots in variants if r % 2 == 0 else variants[::-1]:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        case,
                        slots,
                        "--batches",
                        str(args.batches),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                runs.setdefault(f"{case}-{slots}", []).append(json.loads(out.splitlines()[-1]))
                print(case, slots, runs[f"{case}-{slots}"][-1], flush=True)
    rows = []
    for case, other in (("images", "0"), ("images", "records"), ("records", "0")):
        a, b = runs[f"{case}-8"], runs[f"{case}-{other}"]
        rate = [x["batches_per_s"] / y["batches_per_s"] for x, y in zip(a, b)]
        cpu = [x["main_cpu_ms"] / y["main_cpu_ms"] for x, y in zip(a, b)]
        rows.append(
            {
                "case": case,
                "against": "worker_slots=0" if other == "0" else "batch_format='records'",
                "slots_batches_per_s": statistics.median(x["batches_per_s"] for x in a),
                "other_batches_per_s": statistics.median(x["batches_per_s"] for x in b),
                "rate_ratio": statistics.median(rate),
                "rate_ratio_min": min(rate),
                "rate_ratio_max": max(rate),
                "slots_main_cpu_ms": statistics.median(x["main_cpu_ms"] for x in a),
                "other_main_cpu_ms": statistics.median(x["main_cpu_ms"] for x in b),
                "cpu_ratio": statistics.median(cpu),
            }
        )
    print(describe_machine())
    print_table(rows, list(rows[0]))
    write_json("worker_slots", {"args": vars(args), "runs": runs, "rows": rows})


if __name__ == "__main__":
    main()
