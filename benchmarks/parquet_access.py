"""Shuffled random access to Parquet: torchgrain against the alternatives, same files, same run.

All paths read the same Parquet files (default: 200k rows of ~1 KiB in 8 files of 64
row groups) and hand the training loop per-record dicts through a
``torch.utils.data.DataLoader`` (batch size 256, a pass-through collate, so what is
measured is reading and decoding, not tensor stacking):

* ``naive``: the textbook map-style Dataset, ``pq.ParquetFile(f).read_row_group(rg)``
  per sample, then the row; random order; measured on a time budget.
* ``tg-global``: ``tg.Dataset(tg.ParquetSource(dir, cache_bytes=1 GiB))`` with
  ``GlobalShuffleSampler`` (a true global shuffle). Its speed comes from the per-worker
  row-group cache holding the decoded data (~270 MB here); ``tg-global-small-cache``
  runs the same with a 64 MiB cache (time budget) to show what happens when it does not.
* ``tg-block``: the same source with ``BlockShuffleSampler`` (row groups shuffled,
  rows shuffled within a sliding window of 8 row groups).
* ``hf``: Hugging Face ``datasets`` on the same files (``Dataset.from_parquet``,
  ``.shuffle(seed)``, map-style reads of whole batches); its one-off conversion to
  its Arrow cache is timed separately and not counted.
* ``scan``: pyarrow reading every file in order with ``iter_batches`` and making the
  same per-row dicts (``to_pylist``), consumed by the same loop as the loaders' batches
  (it collects every id): the sequential limit. ``scan-decode`` only decodes (no Python
  rows), for reference.
* ``scan-loader``: the same sequential scan as an ``IterableDataset`` in the same
  DataLoader (worker ``k`` of ``W`` scans files ``k, k + W, ...``; each yields its
  batches of per-row dicts): the sequential limit *through the loader*, the like-for-like
  bound for a path with ``num_workers`` workers (with workers, every record is pickled
  over to the main process whatever reads it).
* ``loader-ceiling``: records already in memory handed through the same DataLoader:
  with workers, every record is pickled over to the main process, which bounds every
  path here (a reader can at best reach it).

With workers, ``tg-block`` passes the loader's ``batch_size`` and ``num_workers`` to
the sampler, so each worker reads its own part of the epoch (as docs/parquet.md advises).

Each DataLoader path runs with ``num_workers`` 0 and 2. Rates are rows/s; the
ratios in the table are the result (absolute numbers depend on the machine).

Every path runs ``--repeats`` rounds (interleaved). Timings on a shared machine drift, so
the rates shown are each path's best round, and every ratio is the median over rounds of
the ratio within one round (block/scan and block/scan-loader against scans run just
before and after the block path). Rows per CPU-second (main process plus workers) are
reported too, as they depend less on other load.

Run: ``python benchmarks/parquet_access.py [--rows 200000] [--repeats 2] [--naive-seconds 4]``
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, describe_machine, print_table, write_json

import torchgrain as tg
from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler


# ----------------------------------------------------------------------- data
def make_files(root: str, rows: int, files: int, row_groups: int, row_bytes: int) -> list[str]:
    """Write ``files`` Parquet files of ``row_groups`` row groups each (~row_bytes per row)."""
    rng = np.random.default_rng(0)
    per_file = rows // files
    rg_rows = max(1, -(-per_file // row_groups))
    text_len = 64
    payload_len = max(0, row_bytes - text_len - 16)
    paths = []
    start = 0
    for f in range(files):
        n = per_file if f < files - 1 else rows - start
        ids = np.arange(start, start + n, dtype=np.int64)
        words = rng.integers(0, 26, size=(n, text_len), dtype=np.uint8) + ord("a")
        text = pa.array([w.tobytes().decode() for w in words], pa.string())
        payload = pa.array([rng.bytes(payload_len) for _ in range(n)], pa.binary())
        table = pa.table(
            {
                "id": pa.array(ids),
                "label": pa.array((ids % 1000).astype(np.int32)),
                "score": pa.array(rng.random(n, dtype=np.float32)),
                "text": text,
                "payload": payload,
            }
        )
        path = os.path.join(root, f"part-{f:05d}.parquet")
        pq.write_table(table, path, row_group_size=rg_rows)
        paths.append(path)
        start += n
    return paths


# ---------------------------------------------------------------- the naive way
class NaiveParquetDataset(torch.utils.data.Dataset):
    """What a map-style Parquet Dataset usually looks like: one row group read per sample."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.locations = []  # (file, row group, first row) for every row group
        offsets = [0]
        for f in files:
            md = pq.read_metadata(f)
            for rg in range(md.num_row_groups):
                self.locations.append((f, rg))
                offsets.append(offsets[-1] + md.row_group(rg).num_rows)
        self.offsets = np.array(offsets)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> dict[str, Any]:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        f, rg = self.locations[k]
        table = pq.ParquetFile(f).read_row_group(rg)
        return table.slice(i - int(self.offsets[k]), 1).to_pylist()[0]


class Prebuilt(torch.utils.data.Dataset):
    """``rows`` records served from memory (the first 4096 of ``src``, repeated)."""

    def __init__(self, src: Any, rows: int) -> None:
        self.records = src.__getitems__(list(range(min(4096, rows))))
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        k = len(self.records)
        return [{**self.records[i % k], "id": i} for i in indices]


def passthrough(batch: list[Any]) -> list[Any]:
    return batch


class ScanDataset(torch.utils.data.IterableDataset):
    """The sequential scan in a DataLoader: each worker reads its share of the files in
    order and yields batches of per-row dicts (``to_pylist``)."""

    def __init__(self, files: list[str], batch_size: int) -> None:
        self.files = files
        self.batch_size = batch_size

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        k, w = (info.id, info.num_workers) if info is not None else (0, 1)
        for f in self.files[k::w]:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=self.batch_size):
                yield batch.to_pylist()


# ------------------------------------------------------------------- measuring
def cpu_seconds() -> float:
    """CPU time of this process plus its finished children (DataLoader workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_loader(
    dataset: Any,
    *,
    sampler: Any = None,
    workers: int,
    batch_size: int,
    epochs: int = 1,
    budget: float | None = None,
    batched: bool = False,
) -> dict[str, Any]:
    """Rows/s of each epoch (persistent workers), CPU seconds of all, and the ids seen.

    With ``budget``, one epoch is cut after that many seconds. ``batched``: the dataset
    yields whole batches itself (an IterableDataset).
    """
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None if batched else batch_size,
        sampler=sampler,
        shuffle=False,
        num_workers=workers,
        collate_fn=passthrough,
        multiprocessing_context="fork" if workers else None,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
    )
    cpu0 = cpu_seconds()
    rates, ids, total = [], [], 0
    for epoch in range(epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        seen = []
        n = 0
        t0 = time.perf_counter()
        for batch in loader:
            n += len(batch)
            seen.append(np.fromiter((r["id"] for r in batch), np.int64, len(batch)))
            if budget is not None and time.perf_counter() - t0 >= budget:
                break
        rates.append(n / (time.perf_counter() - t0))
        ids.append(np.concatenate(seen) if seen else np.zeros(0, np.int64))
        total += n
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()  # joins the workers, so their CPU time is counted
    cpu = cpu_seconds() - cpu0
    return {"rates": rates, "rows": total, "cpu_s": cpu, "ids": ids}


def check_epoch(name: str, ids: np.ndarray, rows: int) -> None:
    if len(ids) != rows or not np.array_equal(np.sort(ids), np.arange(rows)):
        raise AssertionError(f"{name}: the epoch did not deliver every row exactly once")


def scan(files: list[str], batch_size: int, rows_too: bool) -> float:
    """Rows/s of a sequential pyarrow read: per-row dicts (``rows_too``), or decode only.

    With rows, the loop does the consumer work every loader path does (it collects
    each record's id), so the comparison is reading against reading.
    """
    t0 = time.perf_counter()
    n = 0
    seen = []
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
            if rows_too:
                rows = batch.to_pylist()
                n += len(rows)
                seen.append(np.fromiter((r["id"] for r in rows), np.int64, len(rows)))
            else:
                n += batch.num_rows
    rate = n / (time.perf_counter() - t0)
    if rows_too:
        check_epoch("scan", np.concatenate(seen), n)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--row-groups", type=int, default=64, help="per file")
    ap.add_argument("--row-bytes", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--window", type=int, default=8, help="BlockShuffleSampler window")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per loader (persistent workers)")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--naive-seconds", type=float, default=4.0)
    ap.add_argument(
        "--repeats", type=int, default=2, help="rounds over all paths; the best is kept"
    )
    ap.add_argument(
        "--global-cache-mib",
        type=int,
        default=1024,
        help="row-group cache per worker for tg-global (the decoded data must fit)",
    )
    ap.add_argument(
        "--small-cache-mib",
        type=int,
        default=64,
        help="also run tg-global with this cache (smaller than the data; 0: skip)",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--data-dir", default=None, help="where to write the files (default: tmp)")
    ap.add_argument("--no-json", action="store_true")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]

    print(f"machine: {describe_machine()}")
    tmp = tempfile.mkdtemp(prefix="tg-parquet-bench-")
    root = args.data_dir or os.path.join(tmp, "data")
    os.makedirs(root, exist_ok=True)
    try:
        t0 = time.perf_counter()
        files = make_files(root, args.rows, args.files, args.row_groups, args.row_bytes)
        size = sum(os.path.getsize(f) for f in files)
        print(
            f"data: {args.rows} rows, {args.files} files x {args.row_groups} row groups, "
            f"{size / 2**20:.0f} MiB on disk (written in {time.perf_counter() - t0:.1f} s)"
        )
        results: list[dict[str, Any]] = []

        def add(path: str, w: int | None, run: dict[str, Any], **extra: Any) -> None:
            """Record a run; over repeated rounds keep each path's best numbers."""
            rates = run["rates"]
            row = {
                "path": path,
                "workers": w,
                "rows_per_s": rates[0],
                "rows_per_s_epoch2": rates[1] if len(rates) > 1 else None,
                "rows": run["rows"],
                "cpu_s": run["cpu_s"],
                "rows_per_cpu_s": run["rows"] / run["cpu_s"] if run["cpu_s"] else None,
                **extra,
            }
            more = "".join(f", {k}={v:.3g}" for k, v in extra.items() if v is not None)
            e2 = f"{rates[1]:>10,.0f}" if len(rates) > 1 else " " * 10
            print(
                f"  {path:<21} workers={w!s:<4} {rates[0]:>10,.0f} {e2} rows/s  "
                f"{row['rows_per_cpu_s'] or 0:>9,.0f} rows/cpu-s  ({run['rows']} rows{more})"
            )
            for old in results:
                if old["path"] == path and old["workers"] == w:
                    old["rounds"].append(dict(row))
                    for key in ("rows_per_s", "rows_per_s_epoch2", "rows_per_cpu_s"):
                        if row[key] is not None:
                            old[key] = max(old[key] or 0, row[key])
                    return
            row["rounds"] = [dict(row)]
            results.append(row)

        def scan_run(rows_too: bool) -> dict[str, Any]:
            cpu0 = cpu_seconds()
            rate = scan(files, args.batch_size, rows_too)
            return {"rates": [rate], "rows": args.rows, "cpu_s": cpu_seconds() - cpu0}

        def scan_loader_run(w: int) -> dict[str, Any]:
            run = run_loader(
                ScanDataset(files, args.batch_size),
                workers=w,
                batch_size=args.batch_size,
                batched=True,
            )
            for ids in run["ids"]:
                check_epoch("scan-loader", ids, args.rows)
            return run

        hf = hf_prepare = None
        if not args.skip_hf:
            try:
                import datasets
            except ImportError:
                print("hf: `datasets` is not installed; skipped (pip install datasets)")
            else:
                datasets.disable_progress_bars()
                t0 = time.perf_counter()
                hf = datasets.Dataset.from_parquet(files, cache_dir=os.path.join(tmp, "hf"))
                hf_prepare = time.perf_counter() - t0
                print(f"hf: from_parquet conversion took {hf_prepare:.1f} s (not counted)")
                hf = hf.shuffle(seed=0)

        ep = args.epochs
        for rnd in range(args.repeats):
            print(f"round {rnd + 1} of {args.repeats}:               epoch 1    epoch 2")
            add("scan", None, scan_run(True))
            add("scan-decode", None, scan_run(False))
            for w in workers:
                naive = NaiveParquetDataset(files)
                perm = torch.randperm(len(naive), generator=torch.Generator().manual_seed(0))
                run = run_loader(
                    naive,
                    sampler=perm.tolist(),
                    workers=w,
                    batch_size=args.batch_size,
                    budget=args.naive_seconds,
                )
                add("naive", w, run)

                src = tg.ParquetSource(root, cache_bytes=args.global_cache_mib << 20)
                ds = tg.Dataset(src)
                sampler = GlobalShuffleSampler(ds, seed=0)
                run = run_loader(
                    ds, sampler=sampler, workers=w, batch_size=args.batch_size, epochs=ep
                )
                for ids in run["ids"]:
                    check_epoch("tg-global", ids, args.rows)
                decodes = src.cache_info().misses if w == 0 else None
                add("tg-global", w, run, row_group_decodes=decodes)

                if w == 0 and args.small_cache_mib:
                    # The same global shuffle when the decoded data does not fit the cache.
                    src = tg.ParquetSource(root, cache_bytes=args.small_cache_mib << 20)
                    ds = tg.Dataset(src)
                    run = run_loader(
                        ds,
                        sampler=GlobalShuffleSampler(ds, seed=0),
                        workers=w,
                        batch_size=args.batch_size,
                        budget=args.naive_seconds,
                    )
                    info = src.cache_info()
                    hit_rate = info.hits / max(1, info.hits + info.misses)
                    add(
                        "tg-global-small", w, run, cache_mib=args.small_cache_mib, hit_rate=hit_rate
                    )

                # The machine's speed drifts (shared VMs): the scans also run right before
                # and after the block path, and block/scan is taken against their mean.
                paired_scan = scan(files, args.batch_size, True)
                loader_scans = [scan_loader_run(w)]
                src = tg.ParquetSource(root)
                ds = tg.Dataset(src)
                # With workers, the sampler deals each worker its own part of the epoch.
                sampler = BlockShuffleSampler(
                    ds, window=args.window, seed=0, batch_size=args.batch_size, num_workers=w
                )
                run = run_loader(
                    ds, sampler=sampler, workers=w, batch_size=args.batch_size, epochs=ep
                )
                for ids in run["ids"]:
                    check_epoch("tg-block", ids, args.rows)
                paired_scan = (paired_scan * scan(files, args.batch_size, True)) ** 0.5
                loader_scans.append(scan_loader_run(w))
                paired_loader = (loader_scans[0]["rates"][0] * loader_scans[1]["rates"][0]) ** 0.5
                for lrun in loader_scans:
                    add("scan-loader", w, lrun)
                decodes = src.cache_info().misses if w == 0 else None
                add(
                    "tg-block",
                    w,
                    run,
                    row_group_decodes=decodes,
                    paired_scan=paired_scan,
                    paired_ratio=run["rates"][0] / paired_scan,
                    paired_loader_scan=paired_loader,
                    paired_loader_ratio=run["rates"][0] / paired_loader,
                )

                # The most any reader can deliver through this DataLoader setup: records
                # already in memory, only handed over (pickled to the main process
                # when there are workers).
                run = run_loader(
                    Prebuilt(src, args.rows), workers=w, batch_size=args.batch_size, epochs=1
                )
                add("loader-ceiling", w, run)

                if hf is not None:
                    run = run_loader(hf, workers=w, batch_size=args.batch_size, epochs=ep)
                    for ids in run["ids"]:
                        check_epoch("hf", ids, args.rows)
                    add("hf", w, run)

        def get(path: str, w: int | None, key: str = "rows_per_s") -> float | None:
            for r in results:
                if r["path"] == path and r["workers"] == w:
                    return r[key]
            return None

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        def per_round(a: str, b: str, w: int | None, key: str = "rows_per_s") -> float | None:
            """Median over rounds of a's rate over b's in the same round (rounds are
            interleaved, so each pair ran under about the same machine load)."""
            ra = next((r["rounds"] for r in results if r["path"] == a and r["workers"] == w), [])
            rb = next((r["rounds"] for r in results if r["path"] == b and r["workers"] == w), [])
            pairs = [ratio(x[key], y[key]) for x, y in zip(ra, rb)]
            pairs = [p for p in pairs if p is not None]
            return float(np.median(pairs)) if pairs else None

        def paired(path: str, w: int | None, key: str = "paired_ratio") -> float | None:
            """Median over rounds of the path's rate over the scans run just around it."""
            for r in results:
                if r["path"] == path and r["workers"] == w:
                    return float(np.median([x[key] for x in r["rounds"]]))
            return None

        scan_rate = get("scan", None)
        table = []
        for w in workers:
            nv, h, g, b = (get(p, w) for p in ("naive", "hf", "tg-global", "tg-block"))
            ceiling = get("loader-ceiling", w)
            scan_loader = get("scan-loader", w)
            h2, g2, b2 = (get(p, w, "rows_per_s_epoch2") for p in ("hf", "tg-global", "tg-block"))
            table.append(
                {
                    "workers": w,
                    "naive": nv,
                    "hf": h,
                    "tg-global": g,
                    "tg-block": b,
                    "scan-loader": scan_loader,
                    "ceiling": ceiling,
                    "hf e2": h2,
                    "global e2": g2,
                    "block e2": b2,
                    "global/naive": per_round("tg-global", "naive", w),
                    "block/scan": paired("tg-block", w),
                    "block/scan-loader": paired("tg-block", w, "paired_loader_ratio"),
                    "block/ceiling": per_round("tg-block", "loader-ceiling", w),
                    "global/hf": per_round("tg-global", "hf", w),
                    "block/hf": per_round("tg-block", "hf", w),
                    "global/hf e2": per_round("tg-global", "hf", w, "rows_per_s_epoch2"),
                    "global/hf cpu": per_round("tg-global", "hf", w, "rows_per_cpu_s"),
                    "block/hf cpu": per_round("tg-block", "hf", w, "rows_per_cpu_s"),
                }
            )
        print(
            f"\nrows/s, epoch 1 unless marked e2 (scan, one process: {scan_rate:,.0f} rows/s; "
            f"decode only: {get('scan-decode', None):,.0f} rows/s)"
        )
        cols = list(table[0])
        print_table(table, cols[:10])
        print()
        print_table(table, [cols[0], *cols[10:]])
        print(
            "targets: block/scan >= 0.5, global/naive >= 20, global/hf and block/hf >= 1\n"
            "(rates: the best round; ratios: the median over rounds of the ratio within a\n"
            " round, block/scan and block/scan-loader against the scans run just before and\n"
            " after the block path; scan: one process; scan-loader: the scan through the same\n"
            " DataLoader with the same number of workers)\n"
            "(cpu: rows per CPU-second of the main process and its workers, both epochs;\n"
            " ceiling: records already in memory through the same DataLoader, the most\n"
            " any reader can deliver with this many workers on this machine)"
        )

        payload = {
            "config": vars(args),
            "bytes_on_disk": size,
            "hf_prepare_s": hf_prepare,
            "results": results,
            "ratios": table,
        }
        if not args.no_json:
            write_json("parquet_access", payload)
            plot(table, scan_rate)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plot(table: list[dict[str, Any]], scan_rate: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    paths = ["naive", "hf", "tg-global", "tg-block", "scan-loader"]  # epoch 1
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(table)
    for k, row in enumerate(table):
        xs = np.arange(len(paths)) + k * width
        ax.bar(xs, [row[p] or 0 for p in paths], width, label=f"num_workers={row['workers']}")
    ax.axhline(
        scan_rate, color="gray", linestyle="--", label="pyarrow sequential scan, one process"
    )
    labels = [p if p != "scan-loader" else "sequential scan\nthrough the loader" for p in paths]
    ax.set_xticks(np.arange(len(paths)) + width * (len(table) - 1) / 2, labels)
    ax.set_yscale("log")
    ax.set_ylabel("rows/s, epoch 1 (log scale)")
    ax.set_title("Shuffled reads of the same Parquet files")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(RESULTS_DIR, "parquet_access.png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
