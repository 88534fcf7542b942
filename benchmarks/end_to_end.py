"""End to end: a simulated training loop fed by each loader, shuffled, on the same data.

The same records (a 3,072-byte uint8 "image" and an int64 label; ``--records`` of them)
are written once as torchgrain ArrayRecord shards and as Parquet files (the Hugging Face
``datasets`` Arrow cache is built from the Parquet files). Every loader then feeds the
same loop, a globally shuffled stream of batches into a fixed-time "training step"
(``--step-ms``, a sleep), for ``--steps`` steps or ``--max-seconds``, whichever comes
first:

===========================  ===========================================================
torchgrain-arrayrecord       ``tg.Dataset(tg.ArrayRecordSource)`` + ``GlobalShuffleSampler``
                             in a torch DataLoader
torchgrain-parquet           ``tg.Dataset(tg.ParquetSource)`` + ``GlobalShuffleSampler``
torch-naive-parquet          a hand-written map-style Dataset: ``read_row_group`` per item
                             (file handles kept per worker), DataLoader ``shuffle=True``
grain                        ``grain.MapDataset.source(ArrayRecordDataSource).shuffle()
                             .map(decode).batch()`` over the same ArrayRecord shards;
                             with workers: ``.mp_prefetch(num_workers)``, without: Grain's
                             default in-process read threads
hf-datasets                  ``datasets.Dataset.from_parquet(...).with_format("torch")``
                             in a DataLoader with ``shuffle=True``
===========================  ===========================================================

each with ``num_workers`` 0 and 2 (``--workers``). Each configuration runs in a fresh
Python process (no state, file cache of the interpreter, or forked reader shared between
configurations); the dataset files are in the OS page cache for all of them.

Reported per configuration: samples/s after the first batch (steady state), the
fraction of that time the loop waited for data, and the time to the first batch
(worker start-up and first reads). The step's own ceiling is ``batch / step``
samples/s; a loader that reaches it has hidden all loading behind the step.

Each configuration runs ``--repeats`` times (the naive loader once), round-robin over
the configurations; the median is reported.

Run:   python benchmarks/end_to_end.py                    (~4 min on 2 cores)
       python benchmarks/end_to_end.py --records 65536 --steps 100 --workers 0 2 4
Writes benchmarks/results/end_to_end.json and end_to_end.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS_DIR, describe_machine, print_table, write_json

IMAGE_BYTES = 3072
SLOW = ("torch-naive-parquet",)  # measured once: a single pass takes minutes
LOADERS = (
    "torchgrain-arrayrecord",
    "torchgrain-parquet",
    "torch-naive-parquet",
    "grain",
    "hf-datasets",
)


# ------------------------------------------------------------------------------- data
def prepare(data_dir: str, records: int, shards: int, row_group: int) -> None:
    """Write the ArrayRecord shards, the Parquet files and the HF Arrow cache (once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    stamp = os.path.join(data_dir, f"ready-{records}-{shards}-{row_group}")
    if os.path.exists(stamp):
        return
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (records, IMAGE_BYTES), dtype=np.uint8)
    labels = np.arange(records, dtype=np.int64)  # label = global index: order is checkable
    tg.write_array_record(  # a list: shard i takes a contiguous slice, like the Parquet files
        [{"image": images[i], "label": int(labels[i])} for i in range(records)],
        os.path.join(data_dir, "ar"),
        num_shards=shards,
    )
    pq_dir = os.path.join(data_dir, "pq")
    os.makedirs(pq_dir, exist_ok=True)
    per = -(-records // shards)
    for s in range(shards):
        lo, hi = s * per, min(records, (s + 1) * per)
        flat = pa.array(images[lo:hi].reshape(-1))
        table = pa.table(
            {
                "image": pa.FixedSizeListArray.from_arrays(flat, IMAGE_BYTES),
                "label": pa.array(labels[lo:hi]),
            }
        )
        pq.write_table(
            table, os.path.join(pq_dir, f"part-{s:05d}.parquet"), row_group_size=row_group
        )
    _hf_dataset(data_dir)  # builds the Arrow cache
    with open(stamp, "w") as f:
        f.write("ok\n")


def _parquet_files(data_dir: str) -> list[str]:
    d = os.path.join(data_dir, "pq")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".parquet"))


def _ar_files(data_dir: str) -> list[str]:
    d = os.path.join(data_dir, "ar")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if ".array_record" in f)


def _hf_dataset(data_dir: str) -> Any:
    import datasets

    datasets.disable_progress_bars()
    return datasets.Dataset.from_parquet(
        _parquet_files(data_dir), cache_dir=os.path.join(data_dir, "hf_cache")
    )


# ---------------------------------------------------------------------------- loaders
class NaiveParquet:
    """What a first Parquet Dataset usually looks like: one row group read per item."""

    def __init__(self, files: Sequence[str]) -> None:
        import pyarrow.parquet as pq

        self.files = list(files)
        starts = []  # (global start, file, row group)
        total = 0
        for f, path in enumerate(self.files):
            md = pq.ParquetFile(path).metadata
            for g in range(md.num_row_groups):
                starts.append((total, f, g))
                total += md.row_group(g).num_rows
        self.starts = np.array([s[0] for s in starts], dtype=np.int64)
        self.where = [(s[1], s[2]) for s in starts]
        self.total = total
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> dict[str, Any]:
        import pyarrow.parquet as pq

        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        f, g = self.where[k]
        pf = self._handles.get(f)
        if pf is None:
            pf = self._handles[f] = pq.ParquetFile(self.files[f])
        table = pf.read_row_group(g)
        row = index - int(self.starts[k])
        return {
            "image": table.column("image")[row].values.to_numpy(),
            "label": table.column("label")[row].as_py(),
        }


def _decode_msgpack(data: bytes) -> dict[str, Any]:
    from torchgrain.formats.codecs import get_codec

    return get_codec("msgpack").decode(data)


def make_loader(name: str, data_dir: str, batch_size: int, workers: int, seed: int) -> Iterable:
    import torch
    from torch.utils.data import DataLoader

    import torchgrain as tg

    common: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers}
    if workers:
        common.update(prefetch_factor=2, persistent_workers=True)
    if name == "torchgrain-arrayrecord":
        ds = tg.Dataset(tg.ArrayRecordSource(os.path.join(data_dir, "ar")))
        return DataLoader(ds, sampler=tg.GlobalShuffleSampler(ds, seed=seed), **common)
    if name == "torchgrain-parquet":
        ds = tg.Dataset(tg.ParquetSource(_parquet_files(data_dir)))
        return DataLoader(ds, sampler=tg.GlobalShuffleSampler(ds, seed=seed), **common)
    if name == "torch-naive-parquet":
        gen = torch.Generator().manual_seed(seed)
        return DataLoader(
            NaiveParquet(_parquet_files(data_dir)), shuffle=True, generator=gen, **common
        )
    if name == "hf-datasets":
        gen = torch.Generator().manual_seed(seed)
        hf = _hf_dataset(data_dir).with_format("torch")
        return DataLoader(hf, shuffle=True, generator=gen, **common)
    if name == "grain":
        import grain

        src = grain.sources.ArrayRecordDataSource(_ar_files(data_dir))
        ds = grain.MapDataset.source(src).shuffle(seed=seed).map(_decode_msgpack)
        it = ds.batch(batch_size, drop_remainder=True).to_iter_dataset()
        if workers:
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        return it
    raise ValueError(f"unknown loader {name!r}; choose from {', '.join(LOADERS)}")


# -------------------------------------------------------------------------- one run
def run_one(
    name: str,
    data_dir: str,
    *,
    batch_size: int,
    workers: int,
    steps: int,
    step_s: float,
    max_seconds: float,
    seed: int,
) -> dict[str, Any]:
    """Feed ``steps`` fixed-time steps from loader ``name``; time the waits."""
    import torch

    t_build = time.perf_counter()
    loader = make_loader(name, data_dir, batch_size, workers, seed)
    it: Iterator = iter(loader)
    start = time.perf_counter()
    first_wait = None
    wait = 0.0
    done = samples = 0
    seen = set()
    while done < steps:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        if first_wait is None:
            first_wait = t1 - t0
            steady_start = t1
        else:
            wait += t1 - t0
            samples += len(batch["label"])
        # (HF's torch format widens the uint8 column to int64: its cost, paid in its loader)
        image = torch.as_tensor(batch["image"])
        if image.shape != (batch_size, IMAGE_BYTES):
            raise AssertionError(f"{name}: image batch {tuple(image.shape)} {image.dtype}")
        seen.update(int(x) for x in torch.as_tensor(batch["label"]).tolist())
        time.sleep(step_s)  # the training step
        done += 1
        # steady-state budget, counted from the first batch (start-up is reported apart)
        if time.perf_counter() - steady_start > max_seconds and done >= 2:
            break
    end = time.perf_counter()
    steady = end - steady_start
    # a shuffled stream: labels (= global indices) far from sequential
    labels = sorted(seen)
    spread = (labels[-1] - labels[0]) / max(len(labels), 1) if labels else 0.0
    del it, loader
    return {
        "loader": name,
        "workers": workers,
        "steps": done,
        "samples": samples,
        "build_s": round(start - t_build, 4),
        "first_batch_s": round(first_wait or 0.0, 4),
        "steady_s": round(steady, 4),
        "samples_per_s": samples / steady if steady > 0 else 0.0,
        "wait_fraction": wait / steady if steady > 0 else 0.0,
        "distinct_labels": len(seen),
        "label_spread": round(spread, 2),
    }


def run_isolated(args: argparse.Namespace, name: str, workers: int) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter; returns its result (or the error)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        name,
        "--one-workers",
        str(workers),
        "--data-dir",
        args.data_dir,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--step-ms",
        str(args.step_ms),
        "--max-seconds",
        str(args.max_seconds),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.max_seconds + 120, env=env
        )
    except subprocess.TimeoutExpired:
        return {"loader": name, "workers": workers, "error": "timed out"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"loader": name, "workers": workers, "error": " | ".join(tail)}
    return json.loads(lines[-1])


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median samples/s (all rates kept under ``runs_samples_per_s``)."""
    good = [r for r in results if "error" not in r]
    if not good:
        return results[0]
    good.sort(key=lambda r: r["samples_per_s"])
    med = dict(good[len(good) // 2])
    med["runs_samples_per_s"] = [round(r["samples_per_s"], 1) for r in good]
    med["repeats"] = len(good)
    return med


# ------------------------------------------------------------------------- reporting
def plot(rows: Sequence[dict[str, Any]], ceiling: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["workers"] for r in rows})
    names = [n for n in LOADERS if any(r["loader"] == n for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(workers)
    for j, w in enumerate(workers):
        by = {r["loader"]: r for r in rows if r["workers"] == w}
        x = np.arange(len(names)) + (j - (len(workers) - 1) / 2) * width
        rate = [by.get(n, {}).get("samples_per_s", 0.0) for n in names]
        waitf = [100 * by.get(n, {}).get("wait_fraction", 0.0) for n in names]
        ax1.bar(x, rate, width, label=f"num_workers={w}")
        ax2.bar(x, waitf, width, label=f"num_workers={w}")
    ax1.axhline(ceiling, color="k", ls="--", lw=1, label="step ceiling")
    for ax, title in ((ax1, "samples/s (steady state)"), (ax2, "time waiting for data (%)")):
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=32_768)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--row-group", type=int, default=1024, help="Parquet rows per row group")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument(
        "--max-seconds", type=float, default=3.0, help="steady-state time per configuration"
    )
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    p.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    p.add_argument("--data-dir", default=None, help="where to write the data (kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json-name", default="end_to_end")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--one-workers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.one:
        result = run_one(
            args.one,
            args.data_dir,
            batch_size=args.batch_size,
            workers=args.one_workers,
            steps=args.steps,
            step_s=args.step_ms / 1e3,
            max_seconds=args.max_seconds,
            seed=args.seed,
        )
        print(json.dumps(result))
        return None
    if args.prepare_only:
        prepare(args.data_dir, args.records, args.shards, args.row_group)
        return None

    tmp = None
    if args.data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="torchgrain-e2e-")
        args.data_dir = tmp.name
    print(f"machine: {describe_machine()}")
    t0 = time.perf_counter()
    # Written by a child process, so that no process that later forks workers has used
    # the ArrayRecord C++ writer or reader.
    subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--prepare-only",
            "--data-dir",
            args.data_dir,
            "--records",
            str(args.records),
            "--shards",
            str(args.shards),
            "--row-group",
            str(args.row_group),
        ],
        check=True,
    )
    print(
        f"data: {args.records:,} records of {IMAGE_BYTES} B + label, {args.shards} shards; "
        f"Parquet row groups of {args.row_group} rows; prepared in {time.perf_counter() - t0:.1f}s"
    )
    ceiling = args.batch_size / (args.step_ms / 1e3)
    print(
        f"loop: batch {args.batch_size}, step {args.step_ms} ms (ceiling {ceiling:,.0f} "
        f"samples/s), {args.steps} steps or {args.max_seconds}s per configuration"
    )
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    # Repeats go round all configurations, so a busy moment of a shared machine does not
    # land on one loader only; the naive loader (minutes per pass) runs once.
    for rep in range(args.repeats):
        for workers in args.workers:
            for name in args.loaders:
                if rep and name in SLOW:
                    continue
                r = run_isolated(args, name, workers)
                runs.setdefault((name, workers), []).append(r)
                if "error" in r:
                    print(f"  {name:<24} workers={workers}: FAILED {r['error']}")
                else:
                    print(
                        f"  {name:<24} workers={workers}: {r['samples_per_s']:>9,.0f} "
                        f"samples/s, wait {100 * r['wait_fraction']:.0f}%, first batch "
                        f"{r['first_batch_s']:.2f}s"
                    )
    rows = [_median_run(v) for v in runs.values()]
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        ref = next(
            (
                x
                for x in ok
                if x["loader"] == "torchgrain-arrayrecord" and x["workers"] == r["workers"]
            ),
            None,
        )
        r["vs_torchgrain_ar"] = round(r["samples_per_s"] / ref["samples_per_s"], 3) if ref else None
        r["wait_pct"] = round(100 * r["wait_fraction"], 1)
    print()
    print_table(
        rows,
        [
            "loader",
            "workers",
            "samples_per_s",
            "wait_pct",
            "first_batch_s",
            "vs_torchgrain_ar",
            "steps",
            "error",
        ],
    )
    verdict = {}
    for w in args.workers:
        same = [r for r in ok if r["workers"] == w]
        tg_best = max(
            (r["samples_per_s"] for r in same if r["loader"].startswith("torchgrain")),
            default=0.0,
        )
        peers = {
            r["loader"]: r["samples_per_s"]
            for r in same
            if not r["loader"].startswith("torchgrain")
        }
        verdict[str(w)] = {
            "torchgrain_best": tg_best,
            "peers": peers,
            "torchgrain_ahead_of": sorted(k for k, v in peers.items() if tg_best >= v),
            "behind": sorted(k for k, v in peers.items() if tg_best < v),
        }
    payload = {
        "records": args.records,
        "image_bytes": IMAGE_BYTES,
        "shards": args.shards,
        "row_group": args.row_group,
        "batch_size": args.batch_size,
        "step_ms": args.step_ms,
        "ceiling_samples_per_s": ceiling,
        "steps": args.steps,
        "max_seconds": args.max_seconds,
        "repeats": args.repeats,
        "results": rows,
        "verdict": verdict,
    }
    write_json(args.json_name, payload)
    if not args.no_plot and ok:
        plot(ok, ceiling, os.path.join(RESULTS_DIR, f"{args.json_name}.png"))
    if tmp is not None:
        tmp.cleanup()
    return payload


if __name__ == "__main__":
    main()
