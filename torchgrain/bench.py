"""``torchgrain bench``: how fast can your own dataset be read, and what would help.

Reads a dataset through the same path training uses (a :class:`~torchgrain.Dataset` in
a stock DataLoader with worker processes) in each access order:

* ``sequential``: records in storage order (the best case for any format);
* ``shuffled``: a global shuffle (:class:`~torchgrain.GlobalShuffleSampler`);
* ``block-shuffled``: :class:`~torchgrain.BlockShuffleSampler` (shuffled blocks, rows
  shuffled within a sliding window of blocks), for sources whose storage blocks
  (``Source.block_offsets``) hold several records: Parquet row groups, ArrayRecord
  written with ``group_size`` > 1 (chunks), runs of TFRecord records.

Orders are measured in interleaved rounds of ``round_seconds`` until they settle within
5% (the median reported, with its spread; time to the first batch apart). It reports
records/s, tokens/s, record MB/s, worker busyness and :func:`torchgrain.stats`, and
suggestions that never recommend an order that measured slower. Batches are collated as
training collates them (``collate``).

Design notes: docs/design-notes.md#bench.

Example:
    >>> import tempfile, numpy as np, torchgrain as tg
    >>> from torchgrain.bench import run_bench
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_array_record([{"x": np.zeros(16, np.float32)} for _ in range(64)], d)
    >>> report = run_bench(d, batch_size=8, num_workers=0, seconds=0.3, repeats=2, out=None)
    >>> [m["mode"] for m in report["modes"]][:2], len(report["modes"][0]["runs"])
    (['sequential', 'shuffled'], 2)
    >>> report["modes"][0]["records_per_s"] > 0
    True
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from torchgrain.io.retry import RetryPolicy, current_policy, using
from torchgrain.protocols import HasBlockOffsets

__all__ = [
    "available_cpus",
    "default_workers",
    "open_dataset_source",
    "recommend",
    "record_nbytes",
    "run_bench",
    "suggest",
    "token_column",
]

#: The most DataLoader workers ``bench`` starts unless told: each costs start-up time
#: and memory, which a short measurement pays for.
MAX_DEFAULT_WORKERS = 16


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or ``taskset``'s
    limit), not the machine's total.

    Example:
        >>> available_cpus() >= 1
        True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity masks on this system
        return os.cpu_count() or 1


def default_workers() -> int:
    """The DataLoader workers ``bench`` uses unless told: one per CPU this process may
    use (:func:`available_cpus`), at most ``MAX_DEFAULT_WORKERS``.

    Example:
        >>> 1 <= default_workers() <= min(available_cpus(), MAX_DEFAULT_WORKERS)
        True
    """
    return min(available_cpus(), MAX_DEFAULT_WORKERS)


def record_nbytes(obj: Any) -> int:
    """Approximate decoded size of a record: array, bytes and string payloads, 8 per scalar.

    Example:
        >>> record_nbytes({"a": np.zeros(4, np.float32), "b": b"xyz", "c": 1})
        27
    """
    torch = sys.modules.get("torch")  # a tensor means torch is imported; importing it is slow
    if isinstance(obj, np.ndarray) or (torch is not None and isinstance(obj, torch.Tensor)):
        return int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray, memoryview, str)):
        return len(obj)
    if isinstance(obj, (dict, list, tuple)):
        return sum(map(record_nbytes, obj.values() if isinstance(obj, dict) else obj))
    return 8


def open_dataset_source(
    path: str | Sequence[str],
    *,
    fmt: str = "auto",
    columns: Sequence[str] | None = None,
    cache_bytes: int | None = None,
    retry: RetryPolicy | None = None,
) -> tuple[Any, str]:
    """Open ``path`` as a source of any registered format; returns ``(source, format)``.

    ``fmt="auto"`` detects the format from file names (a composition file,
    :mod:`torchgrain.compose.spec`, gives its mixture or concatenation, format
    ``"composition"``); the source is opened by
    ``tg.open`` (:func:`torchgrain.sources.registry.open`), which says when the format
    takes no ``columns`` (or ``cache_bytes``). Opening reads only metadata (a manifest,
    footers or cached indexes). ``cache_bytes`` sets the source's per-process block
    cache (None: its default); ``retry`` its remote reads' policy (None: its default).

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_parquet([{"x": i, "y": -i} for i in range(4)], d)
        >>> src, fmt = open_dataset_source(d, columns=["y"])
        >>> fmt, src[3]
        ('parquet', {'y': -3})
    """
    from torchgrain.compose.spec import is_spec, load_spec
    from torchgrain.sources import registry

    if is_spec(path) and fmt == "auto":
        if columns or cache_bytes is not None:
            raise ValueError(
                f"{path!r} describes a composition: give columns in its entries "
                "(columns= and cache_bytes= are for one dataset)"
            )
        return load_spec(path, retry).source, "composition"
    with using(retry or current_policy()):
        name = registry.detect_format(path) if fmt == "auto" else fmt
    options = {"columns": list(columns) if columns else None, "retry": retry}
    options = {k: v for k, v in {**options, "cache_bytes": cache_bytes}.items() if v is not None}
    return registry.open(path, format=name, **options), name


#: Names a column of token ids usually has (besides any ``X`` written with ``num_X``).
TOKEN_NAMES = ("tokens", "input_ids", "token_ids")
_TOKEN_TYPE = re.compile(r"(u?int\d*\[(\?|\d+)\]|list\[int\])")


def token_column(schema: dict[str, str]) -> str | None:
    """The column of token ids in ``schema`` (key -> type as ``describe_value`` writes it),
    or None: a 1-D integer list or array (``int32[?]``, ``list[int]``; every type of a
    ``|``-joined union) named ``tokens``, ``input_ids`` or ``token_ids``, or with a
    ``num_<name>`` count beside it (what ``torchgrain convert --tokenize`` writes).

    Example:
        >>> token_column({"text": "str", "ids": "int32[?]", "num_ids": "int"})
        'ids'
        >>> token_column({"input_ids": "int64[7]|int64[9]"}), token_column({"x": "int32[?]"})
        ('input_ids', None)
    """
    for name, kind in schema.items():
        ints = all(_TOKEN_TYPE.fullmatch(k) for k in str(kind).split("|"))
        if ints and (name in TOKEN_NAMES or f"num_{name}" in schema):
            return name
    return None


def _records_per_block(source: Any) -> int:
    """Typical records per storage block (an ArrayRecord file's group size); 1 for a
    dataset without blocks, or with one block of all its records (a mixture: a block
    shuffle of it is the global shuffle)."""
    if not isinstance(source, HasBlockOffsets):
        return 1
    sizes = np.diff(source.block_offsets())
    sizes = sizes[sizes > 0]
    return int(np.median(sizes)) if len(sizes) > 1 else 1


#: What ``collate=`` may name: how bench's DataLoader collates its batches.
COLLATES = ("default", "pad", "none")


def _collate_fn(collate: str) -> Callable[[list[Any]], Any] | None:
    """The collate ``collate`` names (:data:`COLLATES`); None: the list of records."""
    if collate == "none":
        return None
    import torch.utils.data

    import torchgrain as tg
    import torchgrain.dataset  # (registers its dict collate: ragged keys named)

    return torch.utils.data.default_collate if collate == "default" else tg.pad_collate()


def _counted(
    collate: Callable[[list[Any]], Any] | None, tokens: str | None, batch: list[Any]
) -> tuple[Any, int, int, int]:
    """bench's ``collate_fn`` (``collate`` and ``tokens`` bound): counts a batch's records,
    their bytes and the token ids in field ``tokens`` in the worker that read it, then
    collates it as training would; returns ``(collated batch, records, bytes, tokens)``."""
    t = tokens
    ntokens = sum(len(r[t]) for r in batch if r.get(t) is not None) if t else 0
    counts = len(batch), sum(map(record_nbytes, batch)), ntokens
    return (collate(batch) if collate is not None else batch, *counts)


def _check_collates(
    ds: Any, n: int, batch_size: int, collate: str, path: Any, seed: int = 0
) -> None:
    """Collate a batch of ``ds`` here, before any timing, so that records training could
    not collate fail with that error (naming the dataset), not in a worker mid-run."""
    from torchgrain.errors import RaggedBatchError

    fn = _collate_fn(collate)
    if fn is None or n == 0:
        return
    rng = np.random.default_rng(seed)  # records from all over: ragged ones show
    idx = sorted(set(rng.integers(0, n, size=min(batch_size, n)).tolist()) | {0})
    records = ds.__getitems__(idx)
    hint = "; bench collates batches as training does: pass --collate pad (collate='pad')"
    hint += " to pad variable-length fields, or --collate none to time reading alone"
    try:
        fn(records)
    except RaggedBatchError as e:
        raise RaggedBatchError(f"{path!r}: {e}{hint}") from e
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"the records of {path!r} cannot be collated by the {collate} collate: {e}{hint}"
        ) from e


def _forever(sampler: Any, first_epoch: int) -> Iterator[int]:
    """Pass after pass of ``sampler`` (a new epoch each pass, from ``first_epoch``), so a
    timed run never runs dry and each round reads another permutation."""
    for epoch in itertools.count(first_epoch):
        sampler.set_epoch(epoch)
        yield from map(int, sampler)


#: An access order: its name, its sampler's, and ``make(dataset, round)`` giving the
#: indices it reads.
Plan = tuple[str, str, Callable[[Any, int], Iterator[int]]]


def _plans(
    n: int, group_size: int, seed: int, batch_size: int, num_workers: int, repeats: int
) -> list[Plan]:
    """The access orders to measure."""
    import torchgrain as tg

    def shuffled(sampler: Any, **options: Any) -> Callable[[Any, int], Iterator[int]]:
        return lambda ds, r: _forever(sampler(ds, num_replicas=1, rank=0, seed=seed, **options), r)

    out: list[Plan] = [
        # Storage order, each round from another place (not where the page cache is warm).
        ("sequential", "SequentialSampler", lambda ds, r: _cycle(n, r, repeats)),
        ("shuffled", "GlobalShuffleSampler", shuffled(tg.GlobalShuffleSampler)),
    ]
    # Blocks worth shuffling (Parquet row groups, ArrayRecord chunks of several records,
    # runs of TFRecord records): with blocks of one record, a block shuffle is a global
    # shuffle. Each worker gets its own part of the epoch (batch_size/num_workers).
    if group_size > 1:
        block = shuffled(tg.BlockShuffleSampler, batch_size=batch_size, num_workers=num_workers)
        out.append(("block-shuffled", "BlockShuffleSampler", block))
    return out


def _cycle(n: int, r: int, repeats: int) -> Iterator[int]:
    """Round ``r``'s storage order: from ``n * r // repeats``, modulo ``n``, for ever."""
    return (i % n for i in itertools.count(n * r // repeats))


def _measure(
    ds: Any, sampler: Any, seconds: float, tokens: str | None, collate: str, **loader: int
) -> dict[str, Any]:
    """One timed read of ``ds`` in ``sampler``'s order, in a DataLoader of its own
    (``loader``: its ``batch_size``, ``num_workers`` and ``prefetch_factor``), its
    batches collated in the workers by ``collate`` (:data:`COLLATES`; counting the
    token ids in field ``tokens`` of the records when given).

    The clock starts when every worker has delivered its first batch (the loader hands
    out batches from its workers in turn): what came before is start-up (forking,
    opening files, cold caches), reported as ``first_batch_s``.
    """
    import torch.utils.data

    import torchgrain as tg

    num_workers = loader["num_workers"]
    data_loader = torch.utils.data.DataLoader(
        ds,
        batch_size=loader["batch_size"],
        sampler=sampler,
        num_workers=num_workers,
        prefetch_factor=loader["prefetch_factor"] if num_workers else None,
        collate_fn=functools.partial(_counted, _collate_fn(collate), tokens),
    )
    warm = max(num_workers, 1)
    records = nbytes = ntokens = 0
    start = time.perf_counter()
    first = timed_from = last = None
    it = iter(data_loader)
    try:
        for k, (_, n, size, ntok) in enumerate(it):
            now = time.perf_counter()
            first = first or now
            if k < warm:
                timed_from = now
                continue
            records, nbytes, ntokens, last = records + n, nbytes + size, ntokens + ntok, now
            if now - timed_from >= seconds and k > warm:  # type: ignore[operator]
                break  # (two batches timed at least)
    finally:
        del it  # stops the workers
    end = time.perf_counter()
    elapsed = max((last or end) - (timed_from or start), 1e-9)
    rep = tg.stats(data_loader)
    busy = sum(
        row["read_seconds"] + row["decode_seconds"] + row["transform_seconds"]
        for row in rep.workers.values()
    )
    return {
        "records": records,
        "bytes": nbytes,
        "seconds": elapsed,
        "records_per_s": records / elapsed,
        "tokens_per_s": ntokens / elapsed if tokens is not None else None,
        "first_batch_s": (first or end) - start,
        "busy_fraction": busy / (warm * (end - start)) if rep.workers else None,
    }


def _spread(runs: list[dict[str, Any]]) -> float:
    """(highest - lowest) / median of the rounds' rates."""
    rates = [r["records_per_s"] for r in runs]
    median = statistics.median(rates)
    return (max(rates) - min(rates)) / median if median else 0.0


def _summary(mode: str, sampler: str, runs: list[dict[str, Any]], stats: Any) -> dict[str, Any]:
    """One access order over its rounds: the median rate and the spread of the rounds."""
    rates = [r["records_per_s"] for r in runs]
    records = sum(r["records"] for r in runs)
    per_record = sum(r["bytes"] for r in runs) / max(records, 1)
    median = statistics.median(rates)
    busy = [r["busy_fraction"] for r in runs if r["busy_fraction"] is not None]
    tokens = [r["tokens_per_s"] for r in runs if r["tokens_per_s"] is not None]
    return {
        "mode": mode,
        "sampler": sampler,
        "runs": [round(x, 1) for x in rates],
        "records_per_s": median,
        "records_per_s_min": min(rates),
        "records_per_s_max": max(rates),
        "tokens_per_s": statistics.median(tokens) if tokens else None,
        "spread": _spread(runs),
        "records": records,
        "seconds": round(sum(r["seconds"] for r in runs), 4),
        "mb_per_s": median * per_record / 1e6,
        "bytes_per_record": per_record,
        "first_batch_s": round(statistics.median(r["first_batch_s"] for r in runs), 4),
        "busy_fraction": statistics.median(busy) if busy else None,
        "busy_min": min(busy) if busy else None,
        "busy_max": max(busy) if busy else None,
        "stats": stats,
    }


def _rate(m: dict[str, Any]) -> str:
    """``12,345 records/s [11,900-12,800]``: the median and, when measured, the spread."""
    lo, hi = m.get("records_per_s_min"), m.get("records_per_s_max")
    spread = f" [{lo:,.0f}-{hi:,.0f}]" if lo is not None and hi is not None and hi > lo else ""
    return f"{m['records_per_s']:,.0f} records/s{spread}"


def _faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a`` read faster than ``b`` beyond the spread of both (every repeat of
    ``a`` beat every repeat of ``b``)."""
    return a.get("records_per_s_min", a["records_per_s"]) > b.get(
        "records_per_s_max", b["records_per_s"]
    )


def recommend(modes: Sequence[dict[str, Any]]) -> str:
    """The sampler the measurements favour for a shuffled epoch.

    ``BlockShuffleSampler`` only when it read faster than the global shuffle beyond
    the spread of their repeats; otherwise ``GlobalShuffleSampler``, the true shuffle.

    Example:
        >>> recommend([{"mode": "shuffled", "records_per_s": 100.0},
        ...            {"mode": "block-shuffled", "records_per_s": 900.0}])
        'BlockShuffleSampler'
        >>> recommend([{"mode": "shuffled", "records_per_s": 100.0, "records_per_s_max": 150.0},
        ...            {"mode": "block-shuffled", "records_per_s": 120.0,
        ...             "records_per_s_min": 90.0}])
        'GlobalShuffleSampler'
    """
    by = {m["mode"]: m for m in modes}
    shuf, block = by.get("shuffled"), by.get("block-shuffled")
    faster = shuf is not None and block is not None and _faster(block, shuf)
    return "BlockShuffleSampler" if faster else "GlobalShuffleSampler"


def _slow_shuffle_remedies(fmt: str, group_size: int | None) -> str:
    if fmt == "parquet":
        return (
            "a random row decodes its whole Parquet row group: give ParquetSource a larger "
            "cache_bytes (try it here with --cache-bytes), or convert to ArrayRecord with group_size 1 (torchgrain convert "
            "... --to array_record) for O(1) random access"
        )
    if group_size is not None and group_size > 1:
        return (
            f"the shards were written with group_size {group_size}: each random record "
            f"decompresses {group_size} records; rewrite with group_size 1"
        )
    return "random reads pay the storage's latency per record: more workers keep more in flight"


def suggest(
    modes: Sequence[dict[str, Any]],
    *,
    fmt: str,
    num_workers: int,
    batch_size: int,
    group_size: int | None = None,
    cpu_count: int | None = None,
) -> list[str]:
    """Advice from measured numbers: each line is ``headline: the numbers behind it``.

    The sampler a headline (before the first colon) names depends only on which
    measurements beat which: an access order is recommended only when it measured
    faster beyond the spread of the repeats (``records_per_s_min`` /
    ``records_per_s_max``, when given); a difference within the spread is said to be.
    The other lines compare numbers with fixed thresholds (workers busy in every round
    above 80% or in none above 40%, shuffled reads below half the sequential rate, a
    first batch after more than 1 s, batches under 32 records), so a measurement close
    to one may give the line in one run and not in the next.

    Example:
        >>> modes = [{"mode": "sequential", "records_per_s": 1000.0, "busy_fraction": 0.95,
        ...           "first_batch_s": 0.1},
        ...          {"mode": "shuffled", "records_per_s": 100.0, "busy_fraction": 0.97,
        ...           "first_batch_s": 0.1}]
        >>> for line in suggest(modes, fmt="parquet", num_workers=2, batch_size=256,
        ...                     cpu_count=8):
        ...     print(line.split(":")[0])
        increase num_workers
        use GlobalShuffleSampler, and make random reads cheaper
    """
    cpus = cpu_count or available_cpus()
    by = {m["mode"]: m for m in modes}
    out: list[str] = []
    seq, shuf, block = (by.get(k) for k in ("sequential", "shuffled", "block-shuffled"))
    if num_workers == 0:
        out.append(
            "use worker processes: with num_workers=0 every read happens in the training "
            f"loop; try --workers {min(MAX_DEFAULT_WORKERS, cpus)} (DataLoader num_workers) "
            "to overlap loading with the step"
        )
    else:
        # Claims about the workers hold in every round: the busiest order's least busy
        # round for "busy", its busiest round for "idle".
        busy = [m for m in modes if m.get("busy_fraction") is not None]
        top = max((m.get("busy_min", m["busy_fraction"]) for m in busy), default=0.0)
        idle_top = max((m.get("busy_max", m["busy_fraction"]) for m in busy), default=1.0)
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
                f"fewer workers: num_workers={num_workers} exceeds the {cpus} CPUs this "
                "process may use; extra workers add memory and start-up time without adding "
                "throughput"
            )
        elif busy and idle_top < 0.4:
            out.append(
                f"the main process is the limit: the workers were idle {100 * (1 - idle_top):.0f}% "
                "of the time, waiting for it to take their batches. Larger batches cost less "
                "per record; pin_memory and CudaPrefetcher overlap the copy to the GPU"
            )
    if shuf is not None:
        if block is not None and _faster(block, shuf):  # (what recommend() says)
            out.append(
                "use BlockShuffleSampler if a block-local shuffle is random enough for your "
                f"model: it read {_rate(block)}, {block['records_per_s'] / shuf['records_per_s']:.1f}x "
                f"the global shuffle's {_rate(shuf)}. To shuffle globally at speed: "
                + _slow_shuffle_remedies(fmt, group_size)
            )
        elif block is not None and _faster(shuf, block):
            out.append(
                f"use GlobalShuffleSampler: the global shuffle read {_rate(shuf)}, faster than "
                f"BlockShuffleSampler's {_rate(block)}, and it mixes the whole dataset"
            )
        elif block is not None:
            out.append(
                f"use GlobalShuffleSampler: the global shuffle ({_rate(shuf)}) and "
                f"BlockShuffleSampler ({_rate(block)}) differ by less than the spread of "
                "their repeats: the block shuffle gains nothing measurable here, and the "
                "global one mixes the whole dataset"
            )
        elif seq is not None and seq["records_per_s"] > 0:
            ratio = shuf["records_per_s"] / seq["records_per_s"]
            if _faster(seq, shuf) and ratio < 0.5:
                out.append(
                    "use GlobalShuffleSampler, and make random reads cheaper: shuffled reads "
                    f"ran at {ratio:.2f}x the sequential rate ({_rate(shuf)} against "
                    f"{_rate(seq)}); " + _slow_shuffle_remedies(fmt, group_size)
                )
            else:
                within = "" if _faster(seq, shuf) else ", within the spread of the repeats"
                out.append(
                    f"use GlobalShuffleSampler: a global shuffle costs little here ({ratio:.2f}x "
                    f"the sequential rate{within}: {_rate(shuf)} against {_rate(seq)})"
                )
    first = max((m["first_batch_s"] for m in modes), default=0.0)
    if num_workers and first > 1.0:
        out.append(
            f"use persistent_workers=True: the first batch took {first:.1f}s (worker start-up "
            "and first reads); persistent workers start once, not every epoch"
        )
    if seq and seq.get("bytes_per_record", 0) > 0 and batch_size < 32:
        out.append(
            f"raise the batch size: at {batch_size} records per batch the per-batch overhead "
            "(~0.1-0.5 ms between processes) is paid for few records"
        )
    return out


def run_bench(
    path: str | Sequence[str],
    *,
    batch_size: int = 256,
    num_workers: int | None = None,
    seconds: float | None = None,
    repeats: int = 3,
    fmt: str = "auto",
    columns: Sequence[str] | None = None,
    cache_bytes: int | None = None,
    prefetch_factor: int = 4,
    seed: int = 0,
    tokens: str | None = "auto",
    collate: str = "default",
    round_seconds: float = 3.0,
    settle: float = 0.05,
    out: Callable[[str], None] | None = print,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """Measure ``path`` in each access order; print and return the results.

    Each round of each order lasts ``round_seconds``; rounds go on past ``repeats``
    until the last ``repeats`` of every order lie within ``settle`` (a share of their
    median) of each other, at most ``2 * repeats`` (docs/design-notes.md#bench).
    ``seconds``, when given, is instead the measured time in total, shared by exactly
    ``repeats`` rounds of every order. Start-up until each worker's first batch comes
    on top. ``collate`` is how batches are collated (:data:`COLLATES`: ``"default"``,
    ``"pad"``, ``"none"``); records it cannot collate raise before anything is timed
    (:class:`~torchgrain.errors.RaggedBatchError` for ragged fields, else ValueError).
    ``num_workers=None`` is :func:`default_workers`.
    ``cache_bytes`` sets each worker's block cache (Parquet row groups, ArrayRecord
    chunks; None: the source's default), to see what a larger one, or none, changes.
    ``tokens`` names a field of token ids to report tokens/s of (``"auto"``: the one
    :func:`token_column` finds in the source's schema; None: none). ``retry`` is the
    policy of remote reads, in every worker (None: the source's default).

    Returns a dict with ``format``, ``num_records``, ``num_workers``, ``modes`` (one dict
    per access order: ``records_per_s`` (the median), ``tokens_per_s`` (the median; None
    without a token column), ``records_per_s_min`` /
    ``records_per_s_max`` and ``runs`` (every repeat), ``mb_per_s``, ``first_batch_s``,
    ``busy_fraction``, ``stats``, ``rounds`` (measured, the last ``repeats`` reported),
    ``settled`` (whether they lay within ``settle``)), ``recommendation`` (the sampler
    the numbers favour) and ``suggestions``. ``out=None`` prints nothing.
    """
    num_workers = default_workers() if num_workers is None else num_workers
    for name, value, ok, need in (
        ("batch_size", batch_size, batch_size >= 1, ">= 1"),
        ("num_workers", num_workers, num_workers >= 0, ">= 0"),
        ("repeats", repeats, repeats >= 1, ">= 1"),
        ("seconds", seconds, seconds is None or seconds > 0, "> 0"),
        ("round_seconds", round_seconds, round_seconds > 0, "> 0"),
    ):
        if not ok:
            raise ValueError(f"{name} must be {need}, got {value}")
    if collate not in COLLATES:
        raise ValueError(f"collate must be one of {COLLATES}, got {collate!r}")
    import torchgrain as tg

    say = out or (lambda _line: None)
    source, fmt = open_dataset_source(
        path, fmt=fmt, columns=columns, cache_bytes=cache_bytes, retry=retry
    )
    n = len(source)
    if n == 0:
        raise ValueError(f"{path!r} holds no records")
    keys = list(source.keys or [])
    if tokens == "auto":
        tokens = token_column(dict(source.schema or {}))
    elif tokens is not None:
        kind = dict(source.schema or {}).get(tokens)
        if keys and tokens not in keys:
            raise ValueError(f"{path!r} has no column {tokens!r} to count tokens of ({keys})")
        if kind is not None and not all(_TOKEN_TYPE.fullmatch(k) for k in kind.split("|")):
            raise ValueError(f"column {tokens!r} of {path!r} is {kind}, not a list of token ids")
    _check_collates(tg.Dataset(source), n, batch_size, collate, path, seed)
    group_size = _records_per_block(source)
    plans = _plans(n, group_size, seed, batch_size, num_workers, repeats)
    fixed = seconds is not None
    per = seconds / (len(plans) * repeats) if seconds is not None else round_seconds
    max_rounds = repeats if fixed else 2 * repeats
    say(
        f"dataset   {path}\nformat    {fmt}, {n:,} records in "
        f"{source.num_shards} shard(s)"
        + (f", {group_size} records per block" if group_size > 1 else "")
        + (f", token ids in {tokens!r}" if tokens else "")
    )
    say(
        f"loader    batch_size {batch_size}, num_workers {num_workers} ({available_cpus()} "
        f"CPUs available), prefetch_factor {prefetch_factor if num_workers else '-'}, "
        + ("batches not collated" if collate == "none" else f"{collate} collate")
    )
    until = f"; up to {max_rounds} rounds, until the last {repeats} of each order lie within"
    say(
        f"timing    {len(plans)} access orders x {repeats} rounds, {per:.1f}s each, timed "
        "after every worker's first batch"
        + ("" if fixed else f"{until} {100 * settle:.0f}% of their median")
    )
    loader = dict(batch_size=batch_size, num_workers=num_workers, prefetch_factor=prefetch_factor)
    datasets = {mode: tg.Dataset(source) for mode, *_ in plans}  # a stats table each
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode, *_ in plans}

    def settled() -> bool:
        return all(_spread(v[-repeats:]) <= settle for v in runs.values())

    r = 0
    while r < max_rounds and not (r >= repeats and (fixed or settled())):
        # Each round starts with another order, so that none always runs first (cold).
        for mode, _, make in plans[r % len(plans) :] + plans[: r % len(plans)]:
            m = _measure(datasets[mode], make(datasets[mode], r), per, tokens, collate, **loader)
            runs[mode].append(m)
            say(
                f"  round {r + 1}/{max_rounds}  {mode:<15}{m['records_per_s']:>12,.0f} records/s"
                + (f"{m['tokens_per_s']:>14,.0f} tokens/s" if tokens else "")
                + f"  (first batch after {m['first_batch_s']:.2f}s)"
            )
        r += 1
    modes = [
        {
            **_summary(mode, sampler, runs[mode][-repeats:], tg.stats(datasets[mode])),
            "rounds": len(runs[mode]),
            "settled": _spread(runs[mode][-repeats:]) <= settle,
        }
        for mode, sampler, _ in plans
    ]
    if not fixed and not settled():
        say(
            f"\nnot settled: after {r} rounds, the last {repeats} of an order still differ by "
            f"more than {100 * settle:.0f}% (other work on the machine?); the spread says how much"
        )
    say("")
    header = (
        f"{'access':<16}{'records/s':>12}{'spread':>22}{'record MB/s':>13}"
        f"{'first batch s':>15}{'workers busy':>14}" + (f"{'tokens/s':>14}" if tokens else "")
    )
    say(header)
    say("-" * len(header))
    for m in modes:
        busy = "-" if m["busy_fraction"] is None else f"{100 * m['busy_fraction']:.0f}%"
        spread = f"{m['records_per_s_min']:,.0f}-{m['records_per_s_max']:,.0f}"
        say(
            f"{m['mode']:<16}{m['records_per_s']:>12,.0f}{spread:>22}{m['mb_per_s']:>13,.1f}"
            f"{m['first_batch_s']:>15.2f}{busy:>14}"
            + (f"{m['tokens_per_s']:>14,.0f}" if tokens else "")
        )
    say(
        f"records/s: median of the last {repeats} rounds, spread: lowest-highest of them; "
        "record MB/s: "
        "the records as delivered (decoded arrays, bytes, strings);\nfirst batch s: from "
        "starting the workers to the first batch (median); workers busy: share of the time "
        "the workers spent reading, decoding and transforming"
        + (f"; tokens/s: token ids in {tokens!r} (median)" if tokens else "")
    )
    for k, m in enumerate(modes):
        say(f"\n{m['mode']} ({m['sampler']}), all rounds: per-process time (tg.stats)")
        say(m["stats"].table(legend=k == 0))
    tips = suggest(
        modes,
        fmt=fmt,
        num_workers=num_workers,
        batch_size=batch_size,
        # The advice on group sizes speaks of ArrayRecord chunks (decompressed whole).
        group_size=group_size if fmt == "array_record" else None,
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
        "repeats": repeats,
        "collate": collate,
        "tokens": tokens,
        "modes": modes,
        "recommendation": recommend(modes),
        "suggestions": tips,
    }
