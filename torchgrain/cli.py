"""The ``torchgrain`` command line: demo, inspect, convert, bench (the jobs around training)."""

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


def _flatten(rec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _open_for_inspect(path: Any, codec: str) -> tuple[str, Any]:
    """(format name, source) for a dataset of any registered format."""
    from torchgrain.sources.registry import detect_format, get_format

    try:
        fmt = detect_format(path)
    except ValueError:
        fmt = "array_record"  # a bare directory of shards without telling names
    options = {"codec": codec} if codec != "auto" else {}
    return fmt, get_format(fmt).source(path, **options)


def _head(src: Any, n: int) -> list[dict[str, Any]]:
    """The first ``n`` records, read in order (compressed files have no random access)."""
    out: list[dict[str, Any]] = []
    for shard in range(src.num_shards):
        for rec in src.iter_shard(shard, 0, n - len(out)):
            out.append(rec)
        if len(out) >= n:
            break
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    from torchgrain.formats.codecs import describe_value
    from torchgrain.io import remote
    from torchgrain.io.fs import get_filesystem
    from torchgrain.sources.base import RecordBytesSource, ShardedSource

    fmt, src = _open_for_inspect(args.path, args.codec)
    counts = [int(n) for n in src.shard_counts]
    samples = _head(src, max(args.samples, 1))
    codec = src.codec.name if isinstance(src, RecordBytesSource) else fmt
    integrity = [
        src.shard_integrity(i) if isinstance(src, ShardedSource) else (None, None)
        for i in range(len(src.paths))
    ]
    fs = get_filesystem(src.paths[0])[0] if src.paths else None
    sizes: list[int] = []
    for (size, _), p in zip(integrity, src.paths):
        if size is not None:
            sizes.append(size)
        else:
            sizes.append(
                remote.file_size(fs, get_filesystem(p)[1], url=p) if fs is not None else -1
            )
    # Types of every key, nested dicts flattened to "a/b", from the sampled records.
    keys: dict[str, str] = {}
    for rec in samples:
        for k, v in _flatten(rec).items():
            t = describe_value(v)
            keys[k] = t if keys.get(k, t) == t else f"{keys[k]}|{t}"
    schema = src.schema
    known = [c for c in counts if c >= 0]
    out = {
        "paths": args.path,
        "format": fmt,
        "num_shards": len(src.paths),
        "num_records": sum(known) if len(known) == len(counts) else None,
        "num_bytes": sum(sizes),
        "codec": codec,
        "keys": keys,
        "schema": schema,
        "shards": [
            {"path": p, "num_records": n, "num_bytes": b}
            for p, n, b in zip(src.paths, counts, sizes)
        ],
    }
    for shard, (_, checksum) in zip(out["shards"], integrity):
        if checksum:
            shard["checksum"] = checksum
    if args.json:
        out["samples"] = [
            {k: _summarise(v) for k, v in _flatten(r).items()} for r in samples[: args.samples]
        ]
        print(json.dumps(out, indent=1, default=str))
        return 0
    total = out["num_records"]
    print(f"dataset     {args.path}")
    print(f"format      {fmt}, codec {codec}")
    print(
        f"records     {'unknown' if total is None else f'{total:,}'} in "
        f"{len(src.paths)} shard(s), {sum(sizes) / 1e6:,.1f} MB"
    )
    print("keys (from the first records)")
    for k, t in keys.items():
        print(f"  {k:<24} {t}")
    if schema and schema != keys:
        print("schema")
        for k, t in schema.items():
            print(f"  {k:<24} {t}")
    print("shards")
    shown = out["shards"][: args.max_shards]
    for s in shown:
        n = "?" if s["num_records"] < 0 else f"{s['num_records']:,}"
        print(f"  {n:>10}  {s['num_bytes'] / 1e6:>10,.2f} MB  {s['path']}")
    if len(out["shards"]) > len(shown):
        print(f"  ... {len(out['shards']) - len(shown)} more")
    for i, rec in enumerate(samples[: args.samples]):
        print(f"record {i}")
        for k, v in _flatten(rec).items():
            print(f"  {k:<24} {_summarise(v)}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import torchgrain as tg

    m = tg.convert(
        args.src,
        args.dst,
        to=args.to,
        num_shards=args.num_shards,
        match_shards=args.match_shards,
        group_size=args.group_size,
        workers=args.workers,
        codec=args.codec,
        compression=args.compression,
        src_format=args.src_format,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        progress=False if args.quiet else None,
    )
    if not args.quiet:
        size = sum(s.num_bytes for s in m.shards)
        print(
            f"wrote {m.num_records:,} records in {len(m.shards)} {args.to} shard(s), "
            f"{size / 1e6:,.1f} MB, to {args.dst}"
        )
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

    c = sub.add_parser(
        "convert",
        help="convert Parquet / TFRecord / ArrayRecord to torchgrain ArrayRecord or Parquet",
        description="Convert a dataset; resumable (rerun after a crash to continue), "
        "parallel, every shard verified (count and checksum).",
    )
    c.add_argument("src", nargs="+", help="source directory, glob, file(s) or URL")
    c.add_argument("dst", help="output directory")
    c.add_argument("--to", choices=["array_record", "parquet"], default="array_record")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--num-shards", type=int, default=None, help="contiguous output shards")
    g.add_argument(
        "--match-shards", action="store_true", help="one output shard per input (default)"
    )
    c.add_argument("--group-size", type=int, default=1, help="records per ArrayRecord chunk")
    c.add_argument("--workers", type=int, default=1, help="converter processes")
    c.add_argument(
        "--codec",
        default="auto",
        help="how input records decode: auto, tf_example, raw, msgpack (TFRecord/ArrayRecord)",
    )
    c.add_argument(
        "--compression",
        default=None,
        help="ArrayRecord: zstd[:LEVEL] (default zstd:3), snappy, brotli, uncompressed; "
        "Parquet: zstd (default), snappy, gzip, lz4, none",
    )
    c.add_argument(
        "--src-format", default="auto", choices=["auto", "parquet", "tfrecord", "array_record"]
    )
    c.add_argument("--overwrite", action="store_true", help="replace what DST holds")
    c.add_argument("--no-verify", action="store_true", help="skip reading shards back")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    c.set_defaults(func=cmd_convert)

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
    for attr in ("path", "src"):
        value = getattr(args, attr, None)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, attr, value[0])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from torchgrain.errors import TorchgrainError

        if isinstance(
            e, (TorchgrainError, FileNotFoundError, FileExistsError, IndexError, ValueError)
        ):
            print(f"torchgrain: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
