"""Batches as columns (``Dataset(..., batch_format="columns")``) against batches of records.

Every measurement runs in a fresh process (what a DataLoader worker, or a new training
run, sees), rounds interleaved, medians of per-round ratios:

1. ``image``: the demo's records (``uint8[64,64,3]`` image + label + id), ArrayRecord
   (zstd, as written by default; and uncompressed), ``GlobalShuffleSampler``, batch 256,
   one epoch through ``DataLoader`` with 0 workers: records (default collate stacks the
   records) vs columns. Target: columns >= 3x.
2. ``image, 2 workers``: the same with 2 workers; the training loop sleeps per batch so
   the workers stay ahead, and the CPU time the main process spends in
   ``next(loader)`` per record is what receiving a batch costs it (wall time beside it).
   Target: columns <= 1 us per record. Beside it, columns through torch's own path
   (``worker_slots=0``: a fresh shared-memory segment per batch) and the DataLoader's
   floor: the same loop over batches of a few bytes, what ``next()`` costs with no data.
3. ``parquet global``: 200,000 rows of numeric and binary columns (int64 id, int32 label,
   float32 score, float32[16] vector, 24-120 byte payload) in one file of 20 row groups,
   ``GlobalShuffleSampler``, one process: first epoch (cold) and second (warm cache).
   Target: warm >= 1M rows/s.
4. ``parquet block``: ``BlockShuffleSampler(window=4)`` over the same file, one cold
   epoch, vs pyarrow's own scan into the same columns (``iter_batches`` of 256 rows,
   numbers and binary offsets/values as zero-copy numpy views). Target: >= 1.0x.

Run:  python benchmarks/columns.py [--records 20000] [--rows 200000] [--rounds 3]
Writes benchmarks/results/columns.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import describe_machine, print_table, write_json

BATCH = 256


# ------------------------------------------------------------------ one measurement
class _Tiny:
    """A dataset whose every batch is a few bytes: what a DataLoader's next() costs alone."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices):
        return [{"label": len(indices)}]


def _collate_first(batch):
    return {"label": [0] * batch[0]["label"]}


def _image_epoch(path: str, fmt: str, workers: int, step_s: float) -> dict:
    import torch

    import torchgrain as tg

    t0 = time.perf_counter()
    if fmt == "floor":
        ds = _Tiny(20000)
        sampler = range(len(ds))
    else:
        src = tg.ArrayRecordSource(path)
        slots = {"worker_slots": 0} if fmt == "torchpath" else {}
        ds = tg.Dataset(src, batch_format="records" if fmt == "records" else "columns", **slots)
        sampler = tg.GlobalShuffleSampler(ds, seed=0)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        collate_fn=_collate_first if fmt == "floor" else None,
    )
    n = 0
    receive = 0.0
    receive_cpu = 0.0
    received = 0
    it = iter(loader)
    k = 0
    while True:
        t = time.perf_counter()
        c = time.thread_time()
        try:
            batch = next(it)
        except StopIteration:
            break
        dt = time.perf_counter() - t
        dc = time.thread_time() - c
        if k >= 4:  # after the workers' start and first batches
            receive += dt
            receive_cpu += dc
            received += len(batch["label"])
        k += 1
        n += len(batch["label"])
        if fmt != "floor":
            assert batch["image"].shape[1:] == (64, 64, 3)
        if step_s:
            time.sleep(step_s)
    wall = time.perf_counter() - t0
    return {
        "rate": n / wall,
        "records": n,
        "receive_us": 1e6 * receive / max(1, received),
        "receive_cpu_us": 1e6 * receive_cpu / max(1, received),
    }


def _parquet_global(path: str) -> dict:
    import torch

    import torchgrain as tg

    src = tg.ParquetSource(path, cache_bytes=1 << 30)
    ds = tg.Dataset(src, batch_format="columns")
    sampler = tg.GlobalShuffleSampler(ds, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    out = {}
    for epoch, name in ((0, "cold"), (1, "warm")):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        n = sum(len(b["label"]) for b in loader)
        out[name] = n / (time.perf_counter() - t0)
    return out


def _parquet_block(path: str) -> dict:
    import torch

    import torchgrain as tg

    src = tg.ParquetSource(path)
    ds = tg.Dataset(src, batch_format="columns")
    sampler = tg.BlockShuffleSampler(ds, seed=0, window=4)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    t0 = time.perf_counter()
    n = sum(len(b["label"]) for b in loader)
    return {"rate": n / (time.perf_counter() - t0)}


def _parquet_scan(path: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def numpy_column(arr: pa.Array):
        if pa.types.is_binary(arr.type) or pa.types.is_string(arr.type):
            _, offsets, values = arr.buffers()
            return (
                np.frombuffer(offsets, np.int32, count=len(arr) + 1 + arr.offset),
                np.frombuffer(values, np.uint8),
            )
        if pa.types.is_fixed_size_list(arr.type):
            k = arr.type.list_size
            return arr.values.to_numpy().reshape(-1, k)
        return arr.to_numpy()

    t0 = time.perf_counter()
    files = sorted(os.path.join(path, f) for f in os.listdir(path))
    n = 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH, use_threads=False):
            cols = [numpy_column(c) for c in batch.columns]
            n += len(cols[0]) if not isinstance(cols[0], tuple) else len(cols[0][0]) - 1
    return {"rate": n / (time.perf_counter() - t0)}


def _case(name: str, path: str) -> dict:
    if name.startswith(("image-", "raw-", "floor-")):
        _, fmt, workers = name.split("-")
        w = int(workers)
        return _image_epoch(path, fmt, w, step_s=0.05 if w else 0.0)
    import pyarrow as pa

    # pyarrow imports pandas (when installed) at the first ``to_numpy()``: 0.4 s here,
    # a library's start-up, not the epoch; paid before the clock for every Parquet case.
    pa.array([0]).to_numpy()
    return {
        "parquet-global": _parquet_global,
        "parquet-block": _parquet_block,
        "parquet-scan": _parquet_scan,
    }[name](path)


# ------------------------------------------------------------------ driver
def _fresh(name: str, path: str) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--case", name, "--path", path],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_data(root: str, records: int, rows: int) -> tuple[str, str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchgrain.demo import build_demo_dataset

    img = build_demo_dataset(os.path.join(root, "img"), records)
    import torchgrain as tg
    from torchgrain.demo import synthetic_records

    raw = os.path.join(root, "img-raw")
    tg.write_array_record(synthetic_records(records), raw, num_shards=8, compression="uncompressed")
    rng = np.random.default_rng(0)
    lengths = rng.integers(24, 121, rows)
    payload = [rng.bytes(int(k)) for k in lengths]
    table = pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "label": pa.array((np.arange(rows) % 1000).astype(np.int32)),
            "score": pa.array(rng.random(rows, dtype=np.float32)),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.random(rows * 16, dtype=np.float32)), 16
            ),
            "payload": pa.array(payload, pa.binary()),
        }
    )
    pq_dir = os.path.join(root, "pq")
    os.makedirs(pq_dir)
    pq.write_table(table, os.path.join(pq_dir, "part-0.parquet"), row_group_size=rows // 20)
    return img, raw, pq_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=20000, help="image records")
    p.add_argument("--rows", type=int, default=200000, help="Parquet rows")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        print(json.dumps(_case(a.case, a.path)))
        return

    print(describe_machine())
    with tempfile.TemporaryDirectory() as root:
        img, raw, pq_dir = _write_data(root, a.records, a.rows)
        cases = {
            "image-records-0": img, "image-columns-0": img,
            "raw-records-0": raw, "raw-columns-0": raw,
            "image-records-2": img, "image-columns-2": img, "image-torchpath-2": img,
            "floor-floor-2": img,
            "parquet-global": pq_dir, "parquet-block": pq_dir, "parquet-scan": pq_dir,
        }  # fmt: skip
        runs: dict[str, list[dict]] = {k: [] for k in cases}
        for r in range(a.rounds):
            for name, path in cases.items():
                runs[name].append(_fresh(name, path))
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    def ratio(num: str, nkey: str, den: str, dkey: str) -> float:
        return statistics.median(x[nkey] / y[dkey] for x, y in zip(runs[num], runs[den]))

    rows = [
        {"case": "image W=0: records", "rate": med("image-records-0", "rate"), "ratio": 1.0,
         "target": ""},
        {"case": "image W=0: columns", "rate": med("image-columns-0", "rate"),
         "ratio": ratio("image-columns-0", "rate", "image-records-0", "rate"),
         "target": ">= 3x records"},
        {"case": "image uncompressed W=0: records", "rate": med("raw-records-0", "rate"),
         "ratio": 1.0, "target": ""},
        {"case": "image uncompressed W=0: columns", "rate": med("raw-columns-0", "rate"),
         "ratio": ratio("raw-columns-0", "rate", "raw-records-0", "rate"), "target": ""},
        {"case": "image W=2: records, main-process CPU us/record receiving",
         "rate": med("image-records-2", "receive_cpu_us"), "ratio": 1.0, "target": ""},
        {"case": "image W=2: columns, main-process CPU us/record receiving",
         "rate": med("image-columns-2", "receive_cpu_us"),
         "ratio": ratio("image-columns-2", "receive_cpu_us", "image-records-2", "receive_cpu_us"),
         "target": "<= 1 us/record"},
        {"case": "image W=2: columns through torch's path (worker_slots=0), main CPU us/record",
         "rate": med("image-torchpath-2", "receive_cpu_us"),
         "ratio": ratio("image-torchpath-2", "receive_cpu_us", "image-records-2",
                        "receive_cpu_us"), "target": ""},
        {"case": "DataLoader floor W=2: a few bytes per batch, main CPU us/record",
         "rate": med("floor-floor-2", "receive_cpu_us"),
         "ratio": ratio("floor-floor-2", "receive_cpu_us", "image-records-2", "receive_cpu_us"),
         "target": ""},
        {"case": "image W=2: records, wall us/record in next()",
         "rate": med("image-records-2", "receive_us"), "ratio": 1.0, "target": ""},
        {"case": "image W=2: columns, wall us/record in next()",
         "rate": med("image-columns-2", "receive_us"),
         "ratio": ratio("image-columns-2", "receive_us", "image-records-2", "receive_us"),
         "target": ""},
        {"case": "parquet global, cold epoch", "rate": med("parquet-global", "cold"),
         "ratio": ratio("parquet-global", "cold", "parquet-scan", "rate"), "target": ""},
        {"case": "parquet global, warm epoch", "rate": med("parquet-global", "warm"),
         "ratio": ratio("parquet-global", "warm", "parquet-scan", "rate"),
         "target": ">= 1M rows/s"},
        {"case": "parquet block (window 4), cold epoch", "rate": med("parquet-block", "rate"),
         "ratio": ratio("parquet-block", "rate", "parquet-scan", "rate"),
         "target": ">= 1.0x scan"},
        {"case": "pyarrow scan into columns", "rate": med("parquet-scan", "rate"), "ratio": 1.0,
         "target": ""},
    ]  # fmt: skip
    print_table(rows, ["case", "rate", "ratio", "target"])
    by_case = {r["case"]: r for r in rows}
    targets = {
        "image_columns_vs_records_w0": by_case["image W=0: columns"]["ratio"],
        "image_columns_receive_us_w2": by_case[
            "image W=2: columns, main-process CPU us/record receiving"
        ]["rate"],
        "dataloader_floor_us_w2": by_case[
            "DataLoader floor W=2: a few bytes per batch, main CPU us/record"
        ]["rate"],
        "parquet_global_warm_rows_per_s": by_case["parquet global, warm epoch"]["rate"],
        "parquet_block_vs_scan": by_case["parquet block (window 4), cold epoch"]["ratio"],
    }
    targets["met"] = {
        "image_3x": targets["image_columns_vs_records_w0"] >= 3.0,
        "receive_1us": targets["image_columns_receive_us_w2"] <= 1.0,
        "parquet_1M": targets["parquet_global_warm_rows_per_s"] >= 1e6,
        "block_1x": targets["parquet_block_vs_scan"] >= 1.0,
    }
    print(json.dumps(targets["met"]))
    write_json("columns", {"args": vars(a), "runs": runs, "rows": rows, "targets": targets})


if __name__ == "__main__":
    main()
