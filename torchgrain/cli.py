"""The ``torchgrain`` command line: demo, inspect, bench (and the jobs around training)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def _summarise(value: Any, limit: int = 60) -> str:
    if isinstance(value, np.ndarray):
        body = np.array2string(value.ravel()[:6], threshold=6)
        return f"ndarray {value.dtype}{list(value.shape)} {body}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cmd_inspect(args: argparse.Namespace) -> int:
    import torchgrain as tg

    src = tg.ArrayRecordSource(args.path, codec=args.codec)
    out = {
        "paths": args.path,
        "num_shards": src.num_shards,
        "num_records": len(src),
        "codec": src.codec.name,
        "keys": src.keys,
        "schema": src.schema,
        "shards": [{"path": p, "num_records": int(n)} for p, n in zip(src.paths, src.index.counts)],
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"dataset     {args.path}")
    print(f"records     {len(src):,} in {src.num_shards} shard(s), codec {src.codec.name}")
    print("schema")
    for k, t in src.schema.items():
        print(f"  {k:<20} {t}")
    print("shards")
    shown = out["shards"][: args.max_shards]
    for s in shown:
        print(f"  {s['num_records']:>10,}  {s['path']}")
    if len(out["shards"]) > len(shown):
        print(f"  ... {len(out['shards']) - len(shown)} more")
    for i in range(min(args.samples, len(src))):
        rec = src[i]
        print(f"record {i}")
        for k, v in rec.items():
            print(f"  {k:<20} {_summarise(v)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from torchgrain.demo import run_demo

    run_demo(
        args.data_dir,
        num_records=args.num_records,
        batch_size=args.batch_size,
        num_workers=args.workers,
        epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        device=args.device,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from torchgrain.bench import run_bench

    report = run_bench(
        args.path,
        batch_size=args.batch_size,
        num_workers=args.workers,
        seconds=args.seconds,
        fmt=args.format,
        columns=args.columns,
        prefetch_factor=args.prefetch_factor,
        seed=args.seed,
        out=None if args.json else print,
    )
    if args.json:
        for mode in report["modes"]:
            st = mode.pop("stats")
            mode["workers"] = st.workers
        print(json.dumps(report, indent=1, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchgrain",
        description="Fast, deterministic data loading for PyTorch from Parquet and ArrayRecord.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="build a synthetic dataset and train a small model on it")
    d.add_argument("--data-dir", default=None, help="where to build the dataset (cached)")
    d.add_argument("--num-records", type=int, default=10_000)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", help="shards, record count, keys, schema, codec, samples")
    i.add_argument("path", nargs="+", help="dataset directory, glob, file(s) or URL")
    i.add_argument("--codec", default="auto")
    i.add_argument("--samples", type=int, default=2, help="records to print")
    i.add_argument("--max-shards", type=int, default=20)
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_inspect)

    b = sub.add_parser(
        "bench",
        help="measure reading a dataset (sequential and shuffled) and suggest what would help",
    )
    b.add_argument("path", nargs="+", help="ArrayRecord or Parquet directory, glob or file(s)")
    b.add_argument("--batch-size", type=int, default=256)
    b.add_argument("--workers", type=int, default=8, help="DataLoader num_workers")
    b.add_argument("--seconds", type=float, default=10.0, help="total measuring time")
    b.add_argument("--prefetch-factor", type=int, default=4)
    b.add_argument(
        "--format",
        default="auto",
        choices=("auto", "array_record", "parquet"),
        help="default: by file suffix (.parquet/.parq/.pq: Parquet)",
    )
    b.add_argument("--columns", nargs="+", default=None, help="Parquet columns to read")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchgrain`` command.

    Example:
        >>> main(["--help"])  # doctest: +SKIP
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "path", None) is not None and len(args.path) == 1:
        args.path = args.path[0]
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from torchgrain.errors import TorchgrainError

        if isinstance(e, (TorchgrainError, FileNotFoundError, IndexError, ValueError)):
            print(f"torchgrain: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
