"""Filters: building a selection index over Parquet, against HF datasets' ``filter``.

Every measurement runs in a fresh process, on the same files, in one run:

1. ``build``: the selection of 10^7 Parquet rows (an int64 ``id``, a float32 ``score``
   uniform in [0, 1), a short string; row groups of 2^17 rows) where ``score < 0.5``,
   with the same number of processes on both sides:
   torchgrain ``Dataset(ParquetSource).filter(columns(fn, keys=["score"]),
   num_workers=P)`` (vectorised: a ColumnBatch of the score column in, bools out), the
   same reading every column (``columns(fn)``), and ``filter(fn)`` (one record at a time),
   each into a fresh index directory; HF ``datasets``
   ``Dataset.from_parquet(...).filter(fn, batched=True, input_columns=["score"],
   num_proc=P)``, the same with every column, and ``filter(fn, num_proc=P)`` (its Arrow
   conversion of the files is timed apart and left out). Batches of about 1,000 rows on
   both sides (their defaults), and for the score column, 16,384 on both sides. Target: torchgrain
   >= 2x HF. Skipped, with a message, when ``datasets`` is not importable.
2. ``pushdown``: ``ParquetSource(files, filter=pc.field("id") < rows // 100)``: row
   groups read of all, and its time against the vectorised pass above. Target: only
   the row groups that can match are read.
3. ``memory``: a fresh process opens the filtered dataset (the selection built above:
   memory-mapped, checked), resolves 200 random batches of 256 through it, and reports
   the private memory it gained (``Anonymous`` of ``/proc/self/smaps_rollup``: the
   mapped selection is the page cache's, shared by every process) per kept record;
   then reads 20 batches of records (the row-group cache's memory, beside it). Target:
   <= 1 byte per record per process.

Run:  python benchmarks/compose_filter.py [--rows 10000000] [--procs 2] [--records-rows N]
      [--data DIR]
Writes benchmarks/results/compose_filter.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import describe_machine, print_table, write_json

ROW_GROUP = 1 << 17
BIG_BATCH = 1 << 14


def write_data(d: str, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = 1 << 21
    for k, start in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - start)
        table = pa.table(
            {
                "id": np.arange(start, start + n, dtype=np.int64),
                "score": rng.random(n, dtype=np.float32),
                "text": pa.array(np.char.mod("r%d", np.arange(n) % 1000).tolist()),
            }
        )
        pq.write_table(table, os.path.join(d, f"part-{k:04d}.parquet"), row_group_size=ROW_GROUP)


def _private_bytes() -> int:
    """This process's own memory: its anonymous pages (a mapped file's pages are the
    page cache's, shared by every process that maps it)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["Anonymous"].split()[0]) * 1024


# ------------------------------------------------------------------ one measurement
def _low_score(batch):  # vectorised: both libraries hand a batch of columns
    return np.asarray(batch["score"]) < 0.5


def _low_score_values(score):  # HF's input_columns=["score"]: the column's values
    return np.asarray(score) < 0.5


def _low_score_record(rec):
    return rec["score"] < 0.5


def one(kind: str, d: str, ix: str, procs: int, rows: int) -> dict:
    out: dict = {}
    if kind.startswith("tg") or kind in ("pushdown", "memory"):
        import torchgrain.compose.filter  # (torch imported before the clock starts)
    if kind.startswith("tg"):
        import torchgrain as tg
        from torchgrain.compose.filter import columns

        ds = tg.Dataset(tg.ParquetSource(d))
        t0 = time.perf_counter()
        if kind == "tg_columns":
            f = ds.filter(columns(_low_score), num_workers=procs, index_dir=ix, progress=False)
        elif kind.startswith("tg_columns_keys"):
            predicate = columns(_low_score, keys=["score"])
            size = BIG_BATCH if kind.endswith("_big") else 1024
            f = ds.filter(
                predicate, num_workers=procs, index_dir=ix, progress=False, batch_size=size
            )
        else:
            f = ds.filter(_low_score_record, num_workers=procs, index_dir=ix, progress=False)
        out["seconds"] = time.perf_counter() - t0
        out["kept"] = len(f)
    elif kind == "pushdown":
        import pyarrow.compute as pc

        import torchgrain as tg

        os.environ["TORCHGRAIN_CACHE"] = ix
        t0 = time.perf_counter()
        src = tg.ParquetSource(d, filter=pc.field("id") < rows // 100)
        out["seconds"] = time.perf_counter() - t0
        out["kept"] = len(src)
        out["row_groups_read"] = src.index.meta["row_groups_read"]
        out["row_groups"] = src.index.meta["row_groups"]
    elif kind == "memory":
        import torchgrain as tg
        from torchgrain.compose.filter import columns

        ds = tg.Dataset(tg.ParquetSource(d))
        ds[0]
        before = _private_bytes()
        predicate = columns(_low_score, keys=["score"])
        f = ds.filter(predicate, index_dir=ix, progress=False)  # mapped, checked
        view = f.source
        rng = np.random.default_rng(1)
        for _ in range(200):  # what resolving batches costs the view
            view.locate(rng.integers(0, len(f), 256))
        out["private_bytes_gained"] = _private_bytes() - before
        out["kept"] = len(f)
        out["bytes_per_record"] = out["private_bytes_gained"] / len(f)
        for _ in range(20):  # and reading records through it (the row-group cache's)
            f.__getitems__(rng.integers(0, len(f), 256).tolist())
        out["private_bytes_after_reads"] = _private_bytes() - before
    elif kind.startswith("hf"):
        import datasets

        datasets.disable_progress_bars()
        cache = os.path.join(ix, "hf")
        t0 = time.perf_counter()
        hf = datasets.Dataset.from_parquet(os.path.join(d, "*.parquet"), cache_dir=cache)
        out["convert_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if kind == "hf_columns":
            kept = hf.filter(_low_score, batched=True, num_proc=procs or None)
        elif kind.startswith("hf_columns_keys"):
            kept = hf.filter(
                _low_score_values,
                batched=True,
                input_columns=["score"],
                num_proc=procs or None,
                batch_size=BIG_BATCH if kind.endswith("_big") else 1000,
            )
        else:
            kept = hf.filter(_low_score_record, num_proc=procs or None)
        out["seconds"] = time.perf_counter() - t0
        out["kept"] = len(kept)
    return out


def fresh(kind: str, d: str, ix: str, procs: int, rows: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, d, ix, str(procs), str(rows)]
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument(
        "--records-rows",
        type=int,
        default=1_000_000,
        help="rows of the record-at-a-time comparison (slow on both sides)",
    )
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--data", help="keep the generated Parquet files here (reused if there)")
    p.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        kind, d, ix, procs, rows = args.one
        print(json.dumps(one(kind, d, ix, int(procs), int(rows))))
        return
    print(f"machine: {describe_machine()}")
    try:
        import datasets  # noqa: F401

        have_hf = True
    except ImportError:
        have_hf = False
        print(
            "HF datasets is not importable: the comparison with its filter is skipped "
            "(pip install datasets)"
        )
    root = tempfile.mkdtemp(prefix="tg-filter-bench-")
    try:
        results: dict = {"rows": args.rows, "procs": args.procs}
        table = []
        for label, rows, kinds in (
            ("vectorised, score only", args.rows, ("tg_columns_keys", "hf_columns_keys")),
            (
                "vectorised, score only, batches of 16384",
                args.rows,
                ("tg_columns_keys_big", "hf_columns_keys_big"),
            ),
            ("vectorised, all columns", args.rows, ("tg_columns", "hf_columns")),
            ("per record", args.records_rows, ("tg_records", "hf_records")),
        ):
            d = os.path.join(args.data or root, f"data-{rows}")
            if not os.path.exists(d):
                write_data(d + ".part", rows)
                os.rename(d + ".part", d)
            row = {"predicate": label, "rows": rows}
            for kind in kinds:
                if kind.startswith("hf") and not have_hf:
                    continue
                ix = tempfile.mkdtemp(dir=root)
                if kind == "tg_columns_keys":
                    built = ix  # the memory measurement maps this selection
                r = fresh(kind, d, ix, args.procs, rows)
                print(f"{kind} ({rows} rows): {r}", flush=True)
                results[f"{kind}_{rows}"] = r
                side = "torchgrain" if kind.startswith("tg") else "hf"
                row[f"{side}_s"] = r["seconds"]
                row[f"{side}_rows_per_s"] = rows / r["seconds"]
                if side == "hf":
                    row["hf_convert_s"] = r["convert_seconds"]
            if "hf_s" in row:
                row["ratio"] = row["hf_s"] / row["torchgrain_s"]
            table.append(row)
        print(f"\nbuilding the selection (score < 0.5), {args.procs} processes each")
        print_table(
            table,
            [
                "predicate",
                "rows",
                "torchgrain_s",
                "hf_s",
                "ratio",
                "torchgrain_rows_per_s",
                "hf_rows_per_s",
                "hf_convert_s",
            ],
        )
        d = os.path.join(args.data or root, f"data-{args.rows}")
        push = fresh("pushdown", d, tempfile.mkdtemp(dir=root), args.procs, args.rows)
        push["vs_vectorised_pass"] = (
            results[f"tg_columns_keys_{args.rows}"]["seconds"] / push["seconds"]
        )
        results["pushdown"] = push
        print(
            f"\npushdown id < {args.rows // 100}: {push['row_groups_read']} of "
            f"{push['row_groups']} row groups read, {push['seconds']:.2f} s "
            f"({push['vs_vectorised_pass']:.1f}x the vectorised pass), {push['kept']} kept"
        )
        mem = fresh("memory", d, built, args.procs, args.rows)
        results["memory"] = mem
        print(
            f"\nprivate memory of a process opening the filtered dataset: "
            f"{mem['private_bytes_gained'] / 2**20:.1f} MiB for {mem['kept']} kept records: "
            f"{mem['bytes_per_record']:.3f} bytes per record"
        )
        results["table"] = table
        write_json("compose_filter", results)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
