"""``torchgrain bench``: how fast can your own dataset be read, and what would help.

Reads a dataset through the same path training uses (a :class:`~torchgrain.Dataset` in
a stock DataLoader with worker processes) for a fixed time in each access order:

* ``sequential``: records in storage order (the best case for any format);
* ``shuffled``: a global shuffle (:class:`~torchgrain.GlobalShuffleSampler`);
* ``block-shuffled``: :class:`~torchgrain.BlockShuffleSampler` (shuffled blocks, rows
  shuffled within a sliding window of blocks), for Parquet (row groups) and for ArrayRecord
  written with ``group_size`` > 1 (chunks).

It reports records/s and MB/s (decoded bytes of the records that arrived), the time to
the first batch (worker start-up and first reads), the per-worker breakdown of
:func:`torchgrain.stats`, and suggestions drawn from the measured numbers.

Batches are not collated (``collate_fn`` returns the list of records), so the figures
are for reading and decoding; collation and transforms come on top.

Example:
    >>> import tempfile, numpy as np, torchgrain as tg
    >>> from torchgrain.bench import run_bench
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_array_record([{"x": np.zeros(16, np.float32)} for _ in range(64)], d)
    >>> report = run_bench(d, batch_size=8, num_workers=0, seconds=0.3, out=None)
    >>> [m["mode"] for m in report["modes"]][:2]
    ['sequential', 'shuffled']
    >>> report["modes"][0]["records_per_s"] > 0
    True
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data

__all__ = ["open_dataset_source", "record_nbytes", "run_bench", "suggest"]


def record_nbytes(obj: Any) -> int:
    """Approximate decoded size of a record: array, bytes and string payloads, 8 per scalar.

    Example:
        >>> record_nbytes({"a": np.zeros(4, np.float32), "b": b"xyz", "c": 1})
        27
    """
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(record_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(record_nbytes(v) for v in obj)
    return 8


def open_dataset_source(
    path: str | Sequence[str], *, fmt: str = "auto", columns: Sequence[str] | None = None
) -> tuple[Any, str]:
    """Open ``path`` as a source of any registered format; returns ``(source, format)``.

    ``fmt="auto"`` detects the format from file names (the format registry). Opening
    reads only metadata (a manifest, footers or cached indexes).
    """
    from torchgrain.sources.registry import detect_format, get_format

    name = detect_format(path) if fmt == "auto" else fmt
    cls = get_format(name).source
    options: dict[str, Any] = {}
    if columns:
        if "columns" not in inspect.signature(cls).parameters:
            raise ValueError(f"--columns applies to formats with columns (Parquet), not {name}")
        options["columns"] = list(columns)
    return cls(path, **options), name


def _records_per_block(source: Any) -> int:
    """Typical records per storage block (an ArrayRecord file's group size)."""
    sizes = np.diff(source.block_offsets())
    sizes = sizes[sizes > 0]
    return int(np.median(sizes)) if len(sizes) else 1


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


class _Forever(torch.utils.data.Sampler[int]):
    """Pass after pass of ``sampler`` (a new epoch each pass), so a timed run never runs dry."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        epoch = 0
        while True:
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            yield from (int(i) for i in self.sampler)
            epoch += 1


def _plans(
    source: Any,
    fmt: str,
    group_size: int | None,
    seed: int,
    batch_size: int | None = None,
    num_workers: int = 0,
) -> list[tuple[str, Callable[[Any], Any]]]:
    """The access orders to measure: (name, sampler factory taking the Dataset)."""
    import torchgrain as tg

    out: list[tuple[str, Callable[[Any], Any]]] = [
        ("sequential", torch.utils.data.SequentialSampler)
    ]
    out.append(
        ("shuffled", lambda ds: tg.GlobalShuffleSampler(ds, num_replicas=1, rank=0, seed=seed))
    )
    # Blocks worth shuffling: Parquet row groups, ArrayRecord chunks of several records.
    # (With group_size 1 every block is one record: a block shuffle is a global shuffle.)
    if fmt == "parquet" or (group_size or 1) > 1:
        # Each worker gets its own part of the epoch (the loader's batch_size/num_workers).
        deal = {"batch_size": batch_size, "num_workers": num_workers} if batch_size else {}
        out.append(
            (
                "block-shuffled",
                lambda ds: tg.BlockShuffleSampler(ds, num_replicas=1, rank=0, seed=seed, **deal),
            )
        )
    return out


def _measure(
    source: Any,
    mode: str,
    make_sampler: Callable[[Any], Any],
    *,
    batch_size: int,
    num_workers: int,
    prefetch_factor: int,
    seconds: float,
) -> dict[str, Any]:
    import torchgrain as tg

    ds = tg.Dataset(source)  # a fresh Dataset: its own stats table
    sampler = make_sampler(ds)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        sampler=_Forever(sampler),
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers else None,
        collate_fn=_as_list,
    )
    records = nbytes = batches = 0
    start = time.perf_counter()
    first = None
    it = iter(loader)
    try:
        for batch in it:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                records += len(batch)
                batches += 1
            nbytes += sum(record_nbytes(r) for r in batch)
            if now - start >= seconds and batches >= 2:
                break
    finally:
        del it  # stops the workers
    end = time.perf_counter()
    elapsed = max(end - (first or start), 1e-9)
    rep = tg.stats(ds)
    per_record = nbytes / max(records + (batch_size if first else 0), 1)
    busy = {
        name: row["read_seconds"] + row["decode_seconds"] + row["transform_seconds"]
        for name, row in rep.workers.items()
    }
    return {
        "mode": mode,
        "sampler": type(sampler).__name__,
        "records": records,
        "seconds": round(elapsed, 4),
        "first_batch_s": round((first or end) - start, 4),
        "records_per_s": records / elapsed,
        "mb_per_s": records * per_record / elapsed / 1e6,
        "bytes_per_record": per_record,
        "busy_fraction": (
            sum(busy.values()) / (max(num_workers, 1) * (end - start)) if busy else None
        ),
        "stats": rep,
    }


def suggest(
    modes: Sequence[dict[str, Any]],
    *,
    fmt: str,
    num_workers: int,
    batch_size: int,
    group_size: int | None = None,
    cpu_count: int | None = None,
) -> list[str]:
    """Advice from measured numbers (each line says which number led to it).

    Example:
        >>> modes = [{"mode": "sequential", "records_per_s": 1000.0, "busy_fraction": 0.95,
        ...           "first_batch_s": 0.1},
        ...          {"mode": "shuffled", "records_per_s": 100.0, "busy_fraction": 0.97,
        ...           "first_batch_s": 0.1}]
        >>> for line in suggest(modes, fmt="parquet", num_workers=2, batch_size=256,
        ...                     cpu_count=8):
        ...     print(line.split(":")[0])
        increase num_workers
        shuffled reads are slow
    """
    cpus = cpu_count or os.cpu_count() or 1
    by = {m["mode"]: m for m in modes}
    out: list[str] = []
    seq, shuf = by.get("sequential"), by.get("shuffled")
    block = by.get("block-shuffled")
    if num_workers == 0:
        out.append(
            "use worker processes: with num_workers=0 every read happens in the training "
            f"loop; try --workers {min(8, cpus)} (DataLoader num_workers) to overlap loading "
            "with the step"
        )
    else:
        busy = [m["busy_fraction"] for m in modes if m.get("busy_fraction") is not None]
        top = max(busy) if busy else 0.0
        if top > 0.8 and num_workers < cpus:
            out.append(
                f"increase num_workers: the {num_workers} worker(s) were busy reading and "
                f"decoding {100 * top:.0f}% of the time and {cpus} CPUs are available; try "
                f"--workers {min(cpus, 2 * num_workers)}"
            )
        elif top > 0.8:
            out.append(
                f"CPU-bound: {num_workers} workers busy {100 * top:.0f}% of the time on "
                f"{cpus} CPUs; more workers will not help. Read fewer columns, store "
                "smaller records, or cache decoded data"
            )
        elif num_workers > cpus:
            out.append(
                f"num_workers={num_workers} exceeds the {cpus} CPUs; extra workers add "
                "memory and start-up time without adding throughput"
            )
        elif busy and top < 0.4:
            out.append(
                f"the workers were idle {100 * (1 - top):.0f}% of the time: the main process "
                "(receiving batches) is the limit, not reading. Larger batches cost less "
                "per record; pin_memory and CudaPrefetcher overlap the copy to the GPU"
            )
    if seq and shuf and seq["records_per_s"] > 0:
        ratio = shuf["records_per_s"] / seq["records_per_s"]
        if ratio < 0.5:
            why = f"{ratio:.2f}x the sequential rate"
            if block and block["records_per_s"] > 1.5 * shuf["records_per_s"]:
                alt = (
                    f"BlockShuffleSampler read {block['records_per_s']:,.0f} records/s "
                    f"({block['records_per_s'] / seq['records_per_s']:.2f}x sequential): use "
                    "it if a block-local shuffle is random enough for your model"
                )
            else:
                alt = "use BlockShuffleSampler to read each block once per epoch"
            if fmt == "parquet":
                out.append(
                    f"shuffled reads are slow: {why}. Random rows decode whole Parquet row "
                    f"groups. {alt}; or give ParquetSource a larger cache_bytes; or convert "
                    "to ArrayRecord with group_size 1 (torchgrain convert ... --to "
                    "array_record) for O(1) random access"
                )
            elif group_size is not None and group_size > 1:
                out.append(
                    f"shuffled reads are slow: {why}. The shards were written with "
                    f"group_size {group_size}: each random record decompresses "
                    f"{group_size} records. Rewrite with group_size 1, or {alt}"
                )
            else:
                out.append(
                    f"shuffled reads are slow: {why}. Random reads pay the storage's "
                    f"latency per record; add workers to keep more reads in flight, or {alt}"
                )
        else:
            how = "costs little" if ratio < 1.0 else "is as fast as sequential reading"
            out.append(
                f"global shuffle {how} here ({ratio:.2f}x the sequential rate): "
                "GlobalShuffleSampler is the right default"
            )
    first = max((m["first_batch_s"] for m in modes), default=0.0)
    if num_workers and first > 1.0:
        out.append(
            f"the first batch took {first:.1f}s (worker start-up and first reads): use "
            "persistent_workers=True so workers start once, not every epoch"
        )
    if seq and seq.get("bytes_per_record", 0) > 0 and batch_size < 32:
        out.append(
            f"batch size {batch_size} is small: per-batch overhead (~0.1-0.5 ms between "
            "processes) is paid for few records; larger batches raise records/s"
        )
    return out


def run_bench(
    path: str | Sequence[str],
    *,
    batch_size: int = 256,
    num_workers: int = 8,
    seconds: float = 10.0,
    fmt: str = "auto",
    columns: Sequence[str] | None = None,
    prefetch_factor: int = 4,
    seed: int = 0,
    out: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Measure ``path`` in each access order for ``seconds`` in total; print and return.

    Returns a dict with ``format``, ``num_records``, ``modes`` (one dict per access order:
    ``records_per_s``, ``mb_per_s``, ``first_batch_s``, ``busy_fraction``, ``stats``) and
    ``suggestions``. ``out=None`` prints nothing.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    say = out or (lambda _line: None)
    source, fmt = open_dataset_source(path, fmt=fmt, columns=columns)
    n = len(source)
    if n == 0:
        raise ValueError(f"{path!r} holds no records")
    group_size = _records_per_block(source) if fmt == "array_record" else None
    plans = _plans(source, fmt, group_size, seed, batch_size, num_workers)
    say(
        f"dataset   {path}\nformat    {fmt}, {n:,} records in "
        f"{source.num_shards} shard(s)" + (f", group_size {group_size}" if group_size else "")
    )
    say(
        f"loader    batch_size {batch_size}, num_workers {num_workers}, prefetch_factor "
        f"{prefetch_factor if num_workers else '-'}, {seconds / len(plans):.1f}s per access "
        "order, batches not collated"
    )
    modes = []
    for mode, make in plans:
        modes.append(
            _measure(
                source,
                mode,
                make,
                batch_size=batch_size,
                num_workers=num_workers,
                prefetch_factor=prefetch_factor,
                seconds=seconds / len(plans),
            )
        )
    say("")
    header = f"{'access':<16}{'records/s':>12}{'MB/s':>10}{'first batch s':>15}{'workers busy':>14}"
    say(header)
    say("-" * len(header))
    for m in modes:
        busy = "-" if m["busy_fraction"] is None else f"{100 * m['busy_fraction']:.0f}%"
        say(
            f"{m['mode']:<16}{m['records_per_s']:>12,.0f}{m['mb_per_s']:>10,.1f}"
            f"{m['first_batch_s']:>15.2f}{busy:>14}"
        )
    for m in modes:
        say(f"\n{m['mode']} ({m['sampler']}): per-process time (tg.stats)")
        say(str(m["stats"]))
    tips = suggest(
        modes,
        fmt=fmt,
        num_workers=num_workers,
        batch_size=batch_size,
        group_size=group_size,
    )
    say("\nsuggestions")
    for tip in tips:
        say(f"  - {tip}")
    return {
        "path": path,
        "format": fmt,
        "num_records": n,
        "batch_size": batch_size,
        "num_workers": num_workers,
        "modes": modes,
        "suggestions": tips,
    }
