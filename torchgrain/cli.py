"""The ``torchgrain`` command line: demo, inspect, convert, bench (the jobs around training)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import itertools
import json
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import numpy as np

import torchgrain as tg
from torchgrain.bench import default_workers, run_bench, token_column
from torchgrain.caches import clear_cache, list_caches, size_text
from torchgrain.compose.spec import is_spec, load_spec
from torchgrain.convert import DEFAULT_OUTPUT, check_output_dir
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.formats.codecs import available_codecs, describe_value
from torchgrain.io import remote
from torchgrain.io.changes import open_regular
from torchgrain.io.fs import default_cache_dir, get_filesystem, skipped_files
from torchgrain.io.retry import RetryPolicy, current_policy, using
from torchgrain.sources import registry
from torchgrain.sources.base import RecordBytesSource, ShardedSource
from torchgrain.tokens.windows import count_column


def _summarise(value: Any, limit: int = 60) -> str:
    if isinstance(value, np.ndarray):
        body = np.array2string(value.ravel()[:6], threshold=6)
        return f"ndarray {value.dtype}{list(value.shape)} {body}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fields(rec: dict[str, Any]) -> dict[str, str]:
    """A record's fields, nested dicts flattened to ``a/b``, each summarised."""
    return {k: _summarise(v) for k, v in _flatten(rec).items()}


def _print_fields(title: str, fields: dict[str, Any]) -> None:
    print(title)
    for k, v in fields.items():
        # Names come from the data: shown escaped where a terminal would act on them.
        k, v = (t if t.isprintable() else repr(t) for t in (str(k), str(v)))
        print(f"  {k:<24} {v}")


def _flatten(rec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rec.items():
        out.update(_flatten(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _head(src: Any, n: int) -> list[dict[str, Any]]:
    """The first ``n`` records, read in order (compressed files have no random access)."""
    shards = (src.iter_shard(shard, 0, n) for shard in range(src.num_shards))
    return list(itertools.islice(itertools.chain.from_iterable(shards), n))


def _token_summary(src: Any, column: str) -> dict[str, Any]:
    """Token count and document length percentiles of a column of token ids, from the
    lengths a token-window index is built from: a ``num_<column>`` count alone when the
    records have one (Parquet reads that column only), else the tokens' list offsets
    (Parquet) or one pass over the records (in worker processes); kept in memory."""
    ds = tg.Dataset(src)
    count = count_column(ds, column)
    w = ds.windows(column, 1, lengths=count, index_dir=None, progress=False)
    lengths = np.diff(w.source.offsets)
    some = lengths if len(lengths) else np.zeros(1, np.int64)  # (zeros for no document)
    q = np.percentile(some, [50, 90, 99])
    return {
        "column": column,
        "lengths_from": count or column,
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "mean": float(some.mean()),
        "min": int(some.min()),
        **{f"p{p}": float(v) for p, v in zip((50, 90, 99), q)},
        "max": int(some.max()),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    fmt = _input_format("PATH", args.path, args.format)
    if fmt == "auto":
        return _inspect_spec(args)
    options = {} if args.codec == "auto" else {"codec": args.codec}
    if args.retry is not None:
        options["retry"] = args.retry
    src = registry.open(args.path, format=fmt, **options)
    counts = [int(n) for n in src.shard_counts]
    samples = _head(src, max(args.samples, 1))
    codec = src.codec.name if isinstance(src, RecordBytesSource) else fmt
    integrity = [
        src.shard_integrity(i) if isinstance(src, ShardedSource) else (None, None)
        for i in range(len(src.paths))
    ]
    sizes = [
        remote.file_size(*get_filesystem(p), url=p) if size is None else size
        for (size, _), p in zip(integrity, src.paths)
    ]
    # Types of every key, nested dicts flattened to "a/b", from the sampled records.
    keys: dict[str, str] = {}
    for rec in samples:
        for k, v in _flatten(rec).items():
            t = describe_value(v)
            keys[k] = t if keys.get(k, t) == t else f"{keys[k]}|{t}"
    schema = src.schema
    out = {
        "paths": args.path,
        "format": fmt,
        "num_shards": len(src.paths),
        "num_records": None if min(counts, default=0) < 0 else sum(counts),
        "num_bytes": sum(sizes),
        "codec": codec,
        "keys": keys,
        "schema": schema,
        "shards": [
            {"path": p, "num_records": n, "num_bytes": b, **({"checksum": c} if c else {})}
            for p, n, b, (_, c) in zip(src.paths, counts, sizes, integrity)
        ],
    }
    column = token_column({**keys, **schema}) if args.tokens == "auto" else args.tokens
    if column is not None and column not in keys and column not in (src.keys or []):
        raise CliError(f"argument --tokens: the records have no column {column!r}")
    if column:
        out["tokens"] = _token_summary(src, column)
    # Files of the dataset's directories that are not its data (a stray stats.csv).
    out["skipped"] = skipped_files(args.path, registry.get_format(fmt).suffixes)
    if args.json:
        out["samples"] = [_fields(r) for r in samples[: args.samples]]
        print(json.dumps(out, indent=1, default=str))
        return 0
    total = out["num_records"]
    print(f"dataset     {args.path}")
    print(f"format      {fmt}, codec {codec}")
    print(
        f"records     {'unknown' if total is None else f'{total:,}'} in "
        f"{len(src.paths)} shard(s), {sum(sizes) / 1e6:,.1f} MB"
    )
    _print_fields("keys (from the first records)", keys)
    if schema and schema != keys:
        _print_fields("schema", schema)
    print("shards")
    shown = out["shards"][: args.max_shards]
    for s in shown:
        n = "?" if s["num_records"] < 0 else f"{s['num_records']:,}"
        print(f"  {n:>10}  {s['num_bytes'] / 1e6:>10,.2f} MB  {s['path']}")
    if len(out["shards"]) > len(shown):
        print(f"  ... {len(out['shards']) - len(shown)} more")
    if t := out.get("tokens"):
        print(
            f"tokens      {t['tokens']:,} in {t['column']!r} ({t['documents']:,} documents; "
            f"counted from {t['lengths_from']!r})\n  length    mean {t['mean']:,.1f}, min "
            f"{t['min']:,}, p50 {t['p50']:,.0f}, p90 {t['p90']:,.0f}, p99 {t['p99']:,.0f}, "
            f"max {t['max']:,}"
        )
    if out["skipped"]:
        print("skipped (not data)", *(f"  {path}" for path in out["skipped"]), sep="\n")
    for i, rec in enumerate(samples[: args.samples]):
        _print_fields(f"record {i}", _fields(rec))
    return 0


def _inspect_spec(args: argparse.Namespace) -> int:
    """``inspect`` of a composition file: its datasets, the records each gives per epoch,
    the merged keys and the first records."""
    from torchgrain.compose.mix import Mix  # (imports torch)

    ds = load_spec(args.path, args.retry)
    view = ds.source
    sources = view.sources if isinstance(view, Mix) else view
    counts = view.counts.tolist() if isinstance(view, Mix) else [len(c) for c in sources.children]
    out: dict[str, Any] = {
        "path": args.path,
        "kind": "mix" if isinstance(view, Mix) else "concat",
        "num_records": len(ds),
        "datasets": [
            {"name": name, "dataset": repr(child), "num_records": len(child), "per_epoch": c}
            for name, child, c in zip(sources.names, sources.children, counts)
        ],
        "schema": ds.schema,
    }
    if isinstance(view, Mix):
        for entry, w in zip(out["datasets"], view.weights):
            entry["weight"] = float(w)
        out["seed"] = view.seed
    samples = ds.__getitems__(list(range(min(args.samples, len(ds)))))
    if args.json:
        out["samples"] = [_fields(r) if isinstance(r, dict) else r for r in samples]
        print(json.dumps(out, indent=1, default=str))
        return 0
    print(f"composition {args.path}: {out['kind']} of {len(counts)} datasets")
    print(f"records     {len(ds):,} per epoch")
    for entry in out["datasets"]:
        weight = f"  weight {entry['weight']:.4g}" if "weight" in entry else ""
        print(
            f"  {entry['name']:<12} {entry['per_epoch']:>12,} of {entry['num_records']:,}"
            f"{weight}  {entry['dataset']}"
        )
    if out["schema"]:
        _print_fields("schema", out["schema"])
    for i, rec in enumerate(samples):
        _print_fields(f"record {i}", _fields(rec if isinstance(rec, dict) else {"": rec}))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    root = default_cache_dir()
    if args.action == "list":
        if args.names or args.all:
            raise CliError("list takes no NAME or --all (give shard caches with --dir)")
        caches = list_caches(root, args.dir)
        if args.json:
            print(json.dumps({"root": root, "caches": caches}, indent=1))
            return 0
        print(f"root  {root}")
        for c in caches:
            print(
                f"  {c['name']:<20} {size_text(c['bytes']):>12} {c['entries']:>9,} entries  "
                f"{c['kind']}" + (f" ({c['dataset']})" if c["dataset"] else "")
            )
        if not caches:
            print("  (no caches)")
        print(f"total {size_text(sum(c['bytes'] for c in caches))}")
        return 0
    if args.all and args.names:
        raise CliError("clear takes NAME... or --all, not both")
    # What list shows as "other" is not torchgrain's: left alone.
    mine = [c["name"] for c in list_caches(root) if c["kind"] != "other"] if args.all else []
    names = [*mine, *args.names, *map(os.path.abspath, args.dir)]
    if not names and not args.all:
        raise CliError("clear needs NAME..., --dir DIR or --all (see torchgrain cache list)")
    cleared = [clear_cache(name, root) for name in names]  # (a ValueError names the cache)
    if args.json:
        print(json.dumps({"root": root, "cleared": cleared}, indent=1))
    else:
        for c in cleared:
            print(f"cleared {c['name']}: {size_text(c['bytes'])}, {c['entries']:,} entries")
    return 0


def _column_names(text: str) -> list[str]:
    """``a,b`` -> ``["a", "b"]`` (an argparse type)."""
    names = [c.strip() for c in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty column name in {text!r}")
    return names


def cmd_convert(args: argparse.Namespace) -> int:
    _input_format("SRC", args.src, args.src_format, specs=False)
    _check_directory("DST", args.dst)
    try:
        check_output_dir(args.src, args.dst)
    except ValueError as e:
        raise CliError(f"argument DST: {e}") from None
    to = args.to or DEFAULT_OUTPUT
    m = tg.convert(
        args.src,
        args.dst,
        to=to,
        **_same_names(
            args,
            "num_shards match_shards group_size workers codec compression src_format "
            "overwrite columns retry",
        ),
        verify=not args.no_verify,
        progress=False if args.quiet else None,
        tokenize=_tokenize_option(args),
    )
    if not args.quiet:
        size = sum(s.num_bytes for s in m.shards)
        print(
            f"wrote {m.num_records:,} records in {len(m.shards)} {to} shard(s), "
            f"{size / 1e6:,.1f} MB, to {args.dst}"
        )
    return 0


def _tokenize_option(args: argparse.Namespace) -> Any:
    """``convert --tokenize``: the tokenize function, from the tokenizer's JSON file."""
    if args.tokenize is None:
        return None
    from torchgrain.tokens.tokenize import tokenize

    data = _read_regular("--tokenize", args.tokenize)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CliError("--tokenize needs the tokenizers package: pip install tokenizers") from None
    try:
        tokenizer = Tokenizer.from_str(data.decode())
    except Exception as e:  # the library's own error type for a malformed file
        raise CliError(f"argument --tokenize: cannot load {args.tokenize!r}: {e}") from None
    tokens = args.tokens_column
    return tokenize(args.text_column, tokenizer, tokens, lengths=f"num_{tokens}")


def cmd_demo(args: argparse.Namespace) -> int:
    from torchgrain.demo import run_demo

    run_demo(
        **_same_names(args, "data_dir num_records batch_size epochs max_steps seed device"),
        num_workers=args.workers,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    _input_format("PATH", args.path, args.format)
    report = run_bench(
        args.path,
        **_same_names(
            args,
            "batch_size seconds round_seconds collate repeats columns cache_bytes "
            "prefetch_factor seed tokens retry",
        ),
        num_workers=args.workers,
        fmt=args.format,
        # Each line as it comes, also into a pipe or a log file.
        out=None if args.json else functools.partial(print, flush=True),
    )
    if args.json:
        for mode in report["modes"]:
            mode["workers"] = mode.pop("stats").workers
        print(json.dumps(report, indent=1, default=str))
    return 0


def _retry_policy(args: argparse.Namespace) -> RetryPolicy | None:
    """The policy ``--retries``, ``--deadline`` and ``--request-timeout`` make (the
    default's other fields), or None where none is given (each source's default).

    Example:
        >>> p = _retry_policy(build_parser().parse_args(["inspect", "d", "--retries", "0"]))
        >>> p.attempts, p.deadline
        (1, 90.0)
    """
    retries = getattr(args, "retries", None)
    given = {k: getattr(args, k, None) for k in ("deadline", "request_timeout")}
    given["attempts"] = None if retries is None else retries + 1
    given = {k: v for k, v in given.items() if v is not None}
    return RetryPolicy(**given) if given else None


def _same_names(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """The options ``names`` of ``args``, passed on as keyword arguments of the same names."""
    return {name: getattr(args, name) for name in names.split()}


# ------------------------------------------------------------------- errors
class CliError(ValueError):
    """A mistake in the command line: printed as ``torchgrain CMD: error: MESSAGE``."""


# What a command reports in one line; anything else is a bug, shown with its traceback.
_USER_ERRORS = (TorchgrainError, OSError, ValueError, IndexError, ImportError, NotImplementedError)


def _check_exists(arg: str, paths: str | list[str]) -> None:
    """Every local path, directory or glob given for ``arg`` names something.

    Remote URLs are left to the source, which reports a missing object by its URL.
    """
    for p in [paths] if isinstance(paths, str) else paths:
        if "://" in p and not p.startswith("file://"):
            continue
        local = p.removeprefix("file://")
        if glob.has_magic(local):
            # fsspec's glob, as the sources list: glob.glob walks into linked directories
            # (two links to "." made DIR/**/*.parquet 2**40 paths).
            if not fsspec.filesystem("file").glob(local):
                raise CliError(f"argument {arg}: {p!r} matches no file")
        elif not os.path.exists(local):
            raise CliError(f"argument {arg}: {p!r} does not exist")


def _read_regular(arg: str, path: str) -> bytes:
    """The bytes of the local regular file ``path`` given for ``arg``; a FIFO, socket or
    device there is refused, never waited on or read without end.

    Example:
        >>> import tempfile
        >>> _read_regular("--tokenize", tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchgrain.cli.CliError: argument --tokenize: '...' is a directory, not a file
    """
    if "://" in path and not path.startswith("file://"):
        raise CliError(f"argument {arg}: {path!r} must be a local file")
    _check_exists(arg, path)
    try:
        fd = open_regular(path.removeprefix("file://"))
    except IsADirectoryError:
        raise CliError(f"argument {arg}: {path!r} is a directory, not a file") from None
    except CorruptDataError:
        raise CliError(
            f"argument {arg}: {path!r} is not a regular file (a FIFO, socket or device)"
        ) from None
    except OSError as e:
        raise CliError(f"argument {arg}: cannot read {path!r}: {e.strerror}") from None
    with open(fd, "rb") as f:
        return f.read()


def _check_directory(arg: str, path: str) -> None:
    """A local output ``path`` is a directory or can be made one: no file stands at it
    or above it."""
    if "://" in path and not path.startswith("file://"):
        return
    d = target = os.path.abspath(path.removeprefix("file://"))
    while not os.path.exists(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        above = "" if d == target else f" ({d!r} is a file)"
        raise CliError(f"argument {arg}: {path!r} is not a directory{above}")


def _input_format(arg: str, path: Any, fmt: str, specs: bool = True) -> str:
    """``fmt``, or the format of input ``path`` from its file names (``"auto"`` for a
    composition file, with ``specs``), once every local path named exists; errors name
    ``arg``."""
    _check_exists(arg, path)
    if fmt != "auto" or (specs and is_spec(path)):
        return fmt
    try:
        return registry.detect_format(path)
    except ValueError as e:
        raise CliError(f"argument {arg}: {e}") from None


# Library messages speak of Python arguments; on the command line they are flags.
_FLAGS = [
    (re.compile(r"\b(?:src_)?format=(?=\W|$)"), "--format"),
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bcodec=(?=\W|$)"), "--codec"),
    (re.compile(r"\bcolumns=(?=\W|$)"), "--columns"),
    (re.compile(r"\ballow_external_paths=True\b"), "--allow-external-paths"),
    (re.compile(r"\bretry=(?=\W|$)"), "--retries, --deadline and --request-timeout"),
    (re.compile(r"\bRetryPolicy\.deadline\b"), "--deadline"),
    (re.compile(r"\bRetryPolicy\.request_timeout\b"), "--request-timeout"),
]


def _cli_words(message: str) -> str:
    """A library error message in the command line's words (flags, not arguments), on
    one line.

    Example:
        >>> _cli_words("'d' holds files of several formats (a, b); pass format=")
        "'d' holds files of several formats (a, b); pass --format"
        >>> _cli_words("d already holds a dataset; pass overwrite=True")
        'd already holds a dataset; pass --overwrite'
    """
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return re.sub(r"\s*\n\s*", " ", message).strip()  # one line, whatever a library said


# ------------------------------------------------------------------ parsing
def _number(cast: type, name: str, ok: Callable[[Any], bool], need: str) -> Any:
    """An argparse type: ``cast`` of the text, refused unless ``ok``."""

    def parse(text: str) -> Any:
        value = cast(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {need}, got {value}")
        return value

    parse.__name__ = name  # argparse names the type in its errors
    return parse


_positive_int = _number(int, "positive integer", lambda v: v >= 1, "a positive integer")
_non_negative_int = _number(int, "integer", lambda v: v >= 0, "0 or more")
_positive_float = _number(float, "number", lambda v: v > 0, "more than 0")
_seconds = _number(float, "seconds", lambda v: math.isfinite(v) and v > 0, "finite and more than 0")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default in its help (except where there is none to show, or
    the help already says it as ``(default...``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        # (The help action's default is SUPPRESS; an appending option's is [].)
        none = default is None or default is False or default is argparse.SUPPRESS
        if none or default == [] or "(default" in text or not action.option_strings:
            return text
        return f"{text} (default: {' '.join(default) if isinstance(default, list) else default})"


def build_parser() -> argparse.ArgumentParser:
    """The ``torchgrain`` argument parser (one subcommand per job).

    Example:
        >>> args = build_parser().parse_args(["bench", "data/", "--seconds", "3"])
        >>> args.command, args.path, args.seconds, args.repeats
        ('bench', ['data/'], 3.0, 3)
    """
    p = argparse.ArgumentParser(
        prog="torchgrain",
        description="Fast, deterministic data loading for PyTorch from Parquet and ArrayRecord.",
        formatter_class=_HelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def options(parser: Any, table: dict[Any, Any]) -> None:
        """Add ``table``'s arguments, each ``key: help`` (or ``add_argument``'s keywords,
        help included). A key ``"--flag"`` is an on/off flag; ``(name, kind, default,
        metavar, nargs)`` (the last two optional) takes strings (kind None), one of the
        choices ``kind`` (a tuple) or numbers ``kind`` parses (metavar N)."""
        for key, help in table.items():
            kw = {**help} if isinstance(help, dict) else {"help": help}
            if isinstance(key, str):
                parser.add_argument(*key.split(), action="store_true", **kw)
                continue
            name, kind, default, metavar, nargs = (*key, None, None)[:5]
            if isinstance(kind, tuple):
                kw["choices"] = kind
            elif kind is not None:
                kw["type"], metavar = kind, metavar or "N"
            if default is not None:
                kw["default"] = default
            parser.add_argument(name, metavar=metavar, nargs=nargs, **kw)

    def command(name: str, func: Any, help: str, table: dict[Any, Any], **kwargs: Any) -> Any:
        c = sub.add_parser(name, help=help, formatter_class=_HelpFormatter, **kwargs)
        c.set_defaults(parser=c, func=func)  # parser: unknown options get this usage
        options(c, table)
        return c

    # Formats and outputs are the registry's: a format registered before this runs is
    # one more choice.
    formats = ("auto", *registry.formats())
    outputs = tuple(registry.output_formats())
    codecs = ", ".join(["auto", *available_codecs()])
    markers = "; ".join(f"{f.marker}: {f.name}" for f in registry.formats().values() if f.marker)
    markers = f" ({markers})" if markers else ""
    auto = "auto: from its file names"
    token_names = "named tokens, input_ids or token_ids, or with a num_COLUMN beside it)"
    o: dict[Any, Any] = {
        ("--data-dir", None, None, "DIR"): "where to build the dataset, reused when it is "
        "there (default: demo-N under ~/.cache/torchgrain)",
        ("--num-records", _positive_int, 10_000): "dataset size",
        ("--batch-size", _positive_int, 64): "records per step",
        ("--workers", _non_negative_int, 2): "DataLoader num_workers",
        ("--epochs", _positive_int, 2): "passes over the dataset",
        ("--max-steps", _positive_int, None): "stop after this many steps",
        ("--seed", int, 0): "shuffle and augmentation seed",
        ("--device", None, None): "cpu or cuda (default: cuda if available)",
    }
    command("demo", cmd_demo, "build a synthetic dataset and train a small model on it", o)

    o = {
        ("path", None, None, "PATH", "+"): "dataset directory, glob, file(s) or URL",
        ("--format", formats, "auto"): f"the dataset's format; {auto}{markers}",
        ("--codec", None, "auto"): f"how encoded records decode (formats with a codec): {codecs}",
        ("--samples", _non_negative_int, 2): "records to print",
        ("--max-shards", _non_negative_int, 20): "shards to list",
        ("--tokens", None, "auto", "COLUMN"): "count the tokens and document lengths of this "
        "column of token ids, reading its num_COLUMN alone when there is one (auto: a "
        f"list-of-ints column {token_names}",
        "--json": "machine-readable output",
    }
    i = command("inspect", cmd_inspect, "shards, record count, keys, schema, codec, samples", o)

    o = {
        ("src", None, None, "SRC", "+"): "source directory, glob, file(s) or URL",
        ("dst", None, None, "DST"): "output directory (not inside SRC; created if needed)",
        ("--to", outputs, None): f"output format (default: {DEFAULT_OUTPUT})",
    }
    c = command(
        "convert",
        cmd_convert,
        f"convert a dataset of any format ({', '.join(registry.formats())}) to "
        f"{' or '.join(outputs)}",
        o,
        description="Convert a dataset; resumable (rerun after a crash to continue), "
        "parallel, every shard verified (count and checksum).",
    )
    o = {
        ("--num-shards", _positive_int, None): "cut the records into this many contiguous "
        "output shards",
        "--match-shards": "one output shard per input file (the default without --num-shards)",
    }
    options(c.add_mutually_exclusive_group(), o)
    o = {
        ("--group-size", _positive_int, 1): "records per ArrayRecord chunk",
        ("--workers", _positive_int, 1): "converter processes",
        ("--codec", None, "auto"): f"how input records decode (formats with a codec): {codecs}",
        ("--compression", None, None): "ArrayRecord: zstd[:LEVEL] (default zstd:3), snappy, "
        "brotli, uncompressed; Parquet: zstd (default), snappy, gzip, lz4, none",
        ("--format", formats, "auto"): {
            "help": f"the input's format; {auto}",
            "dest": "src_format",
        },
        # The earlier name of --format, still accepted.
        ("--src-format", formats, "auto"): {"help": argparse.SUPPRESS, "dest": "src_format"},
        ("--tokenize", None, None, "TOKENIZER_JSON"): "tokenize --text-column with this "
        "Hugging Face tokenizer.json; writes the ids (int32) and their count "
        "(num_TOKENS_COLUMN)",
        ("--text-column", None, "text", "NAME"): "with --tokenize: the text field",
        ("--tokens-column", None, "tokens", "NAME"): "with --tokenize: the field written "
        "(its count: num_NAME)",
        ("--columns", _column_names, None, "A,B"): {
            "help": "convert only these columns (Parquet input reads only them); comma-separated",
            "action": "extend",
        },
        "--overwrite": "replace what DST holds",
        "--no-verify": "skip reading shards back",
        "-q --quiet": "no progress bar or summary",
    }
    options(c, o)

    o = {
        ("path", None, None, "PATH", "+"): "dataset directory, glob or file(s)",
        ("--batch-size", _positive_int, 256): "DataLoader batch_size",
        ("--workers", _non_negative_int, None): "DataLoader num_workers (default: one per "
        f"CPU this process may use, at most 16: {default_workers()} here)",
        ("--seconds", _positive_float, None, "S"): "measured time in total, split into "
        "exactly --repeats rounds per access order (a quick look; default: rounds of "
        "--round-seconds until they settle)",
        ("--round-seconds", _positive_float, 3.0, "S"): "each round's measured time; rounds "
        "go on (at most 2x --repeats) until the last --repeats of each order lie within 5%% "
        "of their median",
        ("--collate", ("default", "pad", "none"), "default"): "how batches are collated in "
        "the workers: default (torch's, as a DataLoader without collate_fn), pad "
        "(tg.pad_collate: variable-length fields padded), none (lists of records: reading "
        "alone)",
        ("--repeats", _positive_int, 3): "rounds per access order (the spread)",
        ("--prefetch-factor", _positive_int, 4): "DataLoader prefetch_factor",
        ("--format", formats, "auto"): f"the dataset's format; {auto}",
        ("--columns", None, None, None, "+"): "Parquet columns to read",
        ("--cache-bytes", _non_negative_int, None): "each worker's block cache (Parquet row "
        "groups, ArrayRecord chunks), in bytes; 0: none (default: the source's, 256 MiB)",
        ("--seed", int, 0): "shuffle seed",
        ("--tokens", None, "auto", "COLUMN"): "report tokens/s of this column of token ids "
        f"(auto: a list-of-ints column {token_names}",
        "--json": "machine-readable output",
    }
    b = command(
        "bench",
        cmd_bench,
        "measure reading a dataset (sequential and shuffled) and suggest what would help",
        o,
        description="Read a dataset through a DataLoader in each access order, several "
        "rounds each, and print the median rate, the spread of the rounds and suggestions.",
    )

    o = {
        ("action", ("list", "clear"), None): "list, or clear",
        ("names", None, None, "NAME", "*"): "clear: the caches (from list)",
        "--all": "clear: every cache listed",
        ("--dir", None, None, "DIR"): {
            "help": "a shard cache's directory (cache_dir=) to list or clear too",
            "action": "append",
            "default": [],
        },
        "--json": "machine-readable output",
    }
    command(
        "cache",
        cmd_cache,
        "list torchgrain's caches on disk (size, entries, dataset) or clear them",
        o,
        description="torchgrain's caches under $TORCHGRAIN_CACHE (default "
        "~/.cache/torchgrain): decoded Parquet row groups, dataset indexes, demo data; "
        "and shard caches (cache_dir=) given with --dir. Clearing deletes only what lies "
        "inside a cache's directory (links are removed, never followed).",
    )
    policy = RetryPolicy()
    for reads in (i, c, b):
        o = {
            "--allow-external-paths": "read files a dataset names outside its directory (a "
            "manifest's shard paths, an HTTP listing's links): only for datasets you trust",
        }
        options(reads, o)
        # Defaults shown, not set: without these options each source keeps its own.
        o = {
            ("--retries", _non_negative_int, None): "retries of a remote read that failed "
            "transiently (HTTP 5xx or 429, a reset connection, a timeout); 0: none "
            f"(default: {policy.attempts - 1})",
            ("--deadline", _seconds, None, "S"): "seconds one remote read may take, its "
            "retries and the waits between them included (plus 1 s per MiB it brought): a "
            f"stalled server fails within about this (default: {policy.deadline:g})",
            ("--request-timeout", _seconds, None, "S"): "seconds one remote request may take "
            "before it is cancelled and retried (plus 1 s per MiB it asks for) (default: "
            f"{policy.request_timeout:g})",
        }
        options(reads.add_argument_group("remote reads (http(s)://, s3://, gs://, ...)"), o)
    return p


def _exit_on_broken_pipe() -> int:
    """The reader of our output went away (``torchgrain inspect ... | head``): stop
    quietly, with the status a Unix tool killed by SIGPIPE has (128 + 13)."""
    # Nothing more reaches the pipe, not even Python's flush at exit.
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + int(signal.SIGPIPE)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler stopping the job), raised where the command is, so that
    it stops as after Ctrl-C: a conversion removes its half-written shard and the
    folders a first run created, DataLoader workers are shut down."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def _stop_on_sigterm() -> Any:
    """Turn SIGTERM into :class:`_Terminated`; returns the handler to put back (None
    where none was changed: not the main thread, or SIGTERM is ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return None
    signal.signal(signal.SIGTERM, _raise_terminated)
    return signal.SIG_DFL if previous is None else previous  # None: set outside Python


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchgrain`` command; returns the exit status.

    Errors are one line, ``torchgrain COMMAND: error: ...``, naming the path and the
    option concerned; status 2 for errors, 141 when the output pipe closed early, 130
    after Ctrl-C and 143 after SIGTERM (both stop the command with its clean-up).

    Example:
        >>> main(["--help"])  # doctest: +SKIP
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = getattr(args, "parser", parser)
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    for attr in ("path", "src"):
        value = getattr(args, attr, None)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, attr, value[0])
    args.retry = _retry_policy(args)
    previous = _stop_on_sigterm()
    # --allow-external-paths: every dataset this command opens, here and in the worker
    # processes it starts, is read with allow_external_paths=True (they inherit it).
    allow, env = getattr(args, "allow_external_paths", False), registry.ALLOW_EXTERNAL_PATHS_ENV
    trusted = os.environ.get(env)
    if allow:
        os.environ[env] = "1"
    try:
        # The policy passed to every source this command opens (and through them to the
        # processes it starts), and in force for its lookups outside them (format
        # detection, file sizes, a conversion's fingerprint).
        with using(args.retry or current_policy()):
            return int(args.func(args) or 0)
    except _Terminated:
        return 128 + int(signal.SIGTERM)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _exit_on_broken_pipe()
    except _USER_ERRORS as e:  # (anything else is a bug: the traceback says where)
        try:
            print(f"{command.prog}: error: {_cli_words(str(e))}", file=sys.stderr)
        except BrokenPipeError:
            return _exit_on_broken_pipe()
        return 2
    finally:
        if allow and trusted is None:
            os.environ.pop(env, None)
        elif allow:
            os.environ[env] = trusted
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
