"""Dataset.map_batch (vectorised map) against the same work done per record with map.

The transform is a cheap per-record function, the case where per-call Python overhead
dominates and tf.data's guide recommends vectorising: standardise a 64-float feature
vector, clip it to [-3, 3], store it as float16, and scale a scalar. Records come from an in-memory list (so reading is nearly
free and the transform's cost shows) and from an ArrayRecord dataset on disk; each is
read with ``__getitems__`` in batches, as the DataLoader reads them, and with the
default collate on top. Timings are interleaved and taken in the same run.

Run: ``python benchmarks/map_batch.py [--batch-size 256] [--records 16384]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from torch.utils.data import default_collate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import describe_machine, print_table, write_json

import torchgrain as tg

DIM = 64
MEAN = np.linspace(-1, 1, DIM, dtype=np.float32)
STD = np.linspace(0.5, 2, DIM, dtype=np.float32)


def per_record(rec: dict) -> dict:
    x = np.clip((rec["x"] - MEAN) / STD, -3.0, 3.0).astype(np.float16)
    return {**rec, "x": x, "w": rec["w"] * 0.5}


def per_batch(records: list[dict]) -> list[dict]:
    x = np.clip((tg.stack_key(records, "x") - MEAN) / STD, -3.0, 3.0).astype(np.float16)
    w = tg.stack_key(records, "w") * 0.5
    return [{**r, "x": xi, "w": wi} for r, xi, wi in zip(records, x, w)]


def make_records(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    return [{"x": x[i], "w": float(i % 13), "label": i % 10} for i in range(n)]


def time_epoch(ds: tg.Dataset, batch_size: int, collate: bool) -> float:
    """Seconds per record to read one epoch of batches (and collate them)."""
    n = len(ds)
    t0 = time.perf_counter()
    for start in range(0, n - batch_size + 1, batch_size):
        recs = ds.__getitems__(range(start, start + batch_size))
        if collate:
            default_collate(recs)
    return (time.perf_counter() - t0) / (n - n % batch_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--records", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved epochs per variant")
    args = ap.parse_args()
    print(f"machine: {describe_machine()}")

    records = make_records(args.records)
    # Same results either way (checked here, and in tests/test_transforms.py).
    a = tg.Dataset(records).map(per_record).__getitems__(range(8))
    b = tg.Dataset(records).map_batch(per_batch).__getitems__(range(8))
    assert all(np.allclose(x["x"], y["x"]) and x["w"] == y["w"] for x, y in zip(a, b))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tg.write_array_record(records, tmp, num_shards=4)
        sources = {"in-memory list": records, "ArrayRecord": tg.ArrayRecordSource(tmp)}
        for source_name, src in sources.items():
            for collate in (False, True):
                variants = {
                    "read only": tg.Dataset(src),
                    "map (per record)": tg.Dataset(src).map(per_record),
                    "map_batch": tg.Dataset(src).map_batch(per_batch),
                }
                best = {k: float("inf") for k in variants}
                for _ in range(args.repeats):
                    for name, ds in variants.items():
                        best[name] = min(best[name], time_epoch(ds, args.batch_size, collate))
                base = best["read only"]
                for name in ("map (per record)", "map_batch"):
                    rows.append(
                        {
                            "source": source_name,
                            "collate": collate,
                            "variant": name,
                            "us_per_record": best[name] * 1e6,
                            "transform_us_per_record": (best[name] - base) * 1e6,
                            "read_only_us_per_record": base * 1e6,
                        }
                    )
                per, vec = rows[-2], rows[-1]
                if vec["transform_us_per_record"] > 0.05:  # else lost in the noise
                    vec["transform_speedup"] = (
                        per["transform_us_per_record"] / vec["transform_us_per_record"]
                    )
                vec["total_speedup"] = per["us_per_record"] / vec["us_per_record"]
    print(f"batch size {args.batch_size}, {args.records} records, best of {args.repeats}\n")
    print_table(
        rows,
        [
            "source",
            "collate",
            "variant",
            "us_per_record",
            "read_only_us_per_record",
            "transform_us_per_record",
            "transform_speedup",
            "total_speedup",
        ],
    )
    write_json(
        "map_batch",
        {
            "settings": {"batch_size": args.batch_size, "records": args.records},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
