"""Paired A/B of the small-data Parquet paths between two checkouts (e.g. main and a branch).

The paths of ``parquet_access.py`` and ``columns.py`` whose data fits the in-memory
row-group cache, each timed in a fresh process importing torchgrain from checkout A or
B, rounds interleaved (A, B, A, B...), batches of 256 through a ``DataLoader`` with 0
workers (where the source's own cost shows; with workers, pickling the records to the
main process costs the same for both):

* ``records-global``: ``parquet_access.py``'s data (200k rows of ~1 KiB: id, label,
  score, 64-char text, binary payload; 8 files of 64 row groups),
  ``ParquetSource(cache_bytes=1 GiB)``, records, ``GlobalShuffleSampler``: epoch 0
  (``cold``) and epoch 1 (``warm``).
* ``records-block``: the same, ``BlockShuffleSampler(window=8)``, one epoch.
* ``columns-global``: ``columns.py``'s Parquet data (200k rows: int64, int32, float32,
  float32[16], 24-120 byte binary; one file of 20 row groups), ``batch_format=
  "columns"``, ``GlobalShuffleSampler``: cold and warm.
* ``columns-block``: the same, ``BlockShuffleSampler(window=4)``, one epoch.

Prints each path's median B/A ratio of rates over rounds (the ratio within a round),
with its range. A ratio >= ~0.95 on this noisy machine reads as "no slower".

Run: ``python benchmarks/parquet_ab.py --a /work/main --b . [--rounds 5]``
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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

BATCH = 256
CASES = ("records-global", "records-block", "columns-global", "columns-block")


def _passthrough(batch: Any) -> Any:
    return batch


def child(case: str, root: str, data: str) -> dict[str, float]:
    sys.path.insert(0, root)
    import torch

    import torchgrain as tg

    assert os.path.dirname(os.path.abspath(tg.__file__)) == os.path.join(
        os.path.abspath(root), "torchgrain"
    ), tg.__file__
    kind, order = case.split("-")
    if kind == "records":
        src = tg.ParquetSource(os.path.join(data, "access"), cache_bytes=1 << 30)
        ds = tg.Dataset(src)
        collate = _passthrough
    else:
        src = tg.ParquetSource(os.path.join(data, "columns"), cache_bytes=1 << 30)
        ds = tg.Dataset(src, batch_format="columns")
        collate = None
    if order == "global":
        sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
        epochs = (("cold", 0), ("warm", 1))
    else:
        window = 8 if kind == "records" else 4
        sampler = tg.BlockShuffleSampler(ds, seed=0, window=window, num_replicas=1, rank=0)
        epochs = (("epoch", 0),)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, collate_fn=collate)
    out = {}
    for name, epoch in epochs:
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += len(batch) if kind == "records" else len(batch["id"])
        out[name] = n / (time.perf_counter() - t0)
        assert n == len(ds)
    return out


def run(case: str, root: str, data: str) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--root", root]
    out = subprocess.run(
        [*cmd, "--data", data],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, PYTHONPATH=""),
    )
    if out.returncode != 0:
        raise RuntimeError(f"{case} in {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def columns_table(rows: int, rng: Any) -> Any:
    """The columns cases' table (a pyarrow Table): ids, labels, scores, 16-float vectors
    and 24-120 byte payloads, drawn from ``rng`` (perf_ab.py builds the same)."""
    import numpy as np
    import pyarrow as pa

    lengths = rng.integers(24, 121, rows)
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "label": pa.array((np.arange(rows) % 1000).astype(np.int32)),
            "score": pa.array(rng.random(rows, dtype=np.float32)),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.random(rows * 16, dtype=np.float32)), 16
            ),
            "payload": pa.array([rng.bytes(int(k)) for k in lengths], pa.binary()),
        }
    )


def make_data(data: str) -> None:
    import numpy as np
    import pyarrow.parquet as pq
    from parquet_access import make_files

    access = os.path.join(data, "access")
    os.makedirs(access)
    make_files(access, 200_000, 8, 64, 1024)
    rows = 200_000
    table = columns_table(rows, np.random.default_rng(0))
    cols = os.path.join(data, "columns")
    os.makedirs(cols)
    pq.write_table(table, os.path.join(cols, "part-0.parquet"), row_group_size=rows // 20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="/work/main", help="checkout A (the baseline)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="checkout B")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.root, args.data)))
        return
    print(f"machine: {describe_machine()}")
    print(f"A = {args.a}\nB = {args.b}")
    data = tempfile.mkdtemp(prefix="tg-parquet-ab-")
    try:
        make_data(data)
        cases = args.cases.split(",")
        rounds = []
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for case in cases:
                first, second = ("a", "b") if r % 2 == 0 else ("b", "a")
                res = {k: run(case, getattr(args, k), data) for k in (first, second)}
                row[case] = res
            rounds.append(row)
            print(f"round {r}: {json.dumps(row)}")
    finally:
        shutil.rmtree(data, ignore_errors=True)
    table = []
    summary: dict[str, Any] = {}
    for case in cases:
        for phase in rounds[0][case]["a"]:
            ratios = [r[case]["b"][phase] / r[case]["a"][phase] for r in rounds]
            a = statistics.median(r[case]["a"][phase] for r in rounds)
            b = statistics.median(r[case]["b"][phase] for r in rounds)
            key = f"{case} {phase}"
            summary[key] = {
                "a": a,
                "b": b,
                "ratio": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
            table.append(
                {
                    "path": key,
                    "A rows/s": a,
                    "B rows/s": b,
                    "B/A median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
            )
    print_table(table, ["path", "A rows/s", "B rows/s", "B/A median", "min", "max"])
    write_json("parquet_ab", {"a": args.a, "b": args.b, "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
