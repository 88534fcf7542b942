"""Pipeline statistics: where the time goes, per DataLoader worker.

Every torchgrain :class:`~torchgrain.Dataset` owns a small shared-memory table (one row
per process: the main process and up to 63 workers) that its ``__getitems__`` updates
after each batch: records and bytes read, seconds spent reading (I/O and
decompression), decoding records, and running transforms, and cache hits/misses.
Workers write their own row; the training process reads the whole table at any time
with :func:`stats`, without any message passing. Wrapping the loader in :func:`timed`
adds the consumer's side: how long the training loop waited for each batch.

Example:
    >>> import tempfile, numpy as np, torch, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_array_record([{"x": np.zeros(4, np.float32)} for _ in range(32)], d)
    >>> ds = tg.Dataset(tg.ArrayRecordSource(d))
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=8)
    >>> for batch in tg.timed(loader):
    ...     pass
    >>> report = tg.stats(loader)
    >>> report.total["records"], report.total["batches"], report.consumer["batches"]
    (32.0, 4.0, 4.0)
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["COUNTERS", "PipelineStats", "StatsReport", "local_counters", "stats", "timed"]

logger = logging.getLogger("torchgrain")

#: What each process counts. Sources add to the ``read``/``decode``/``cache`` fields of
#: their process's :func:`local_counters`; the Dataset adds the rest, and publishes the
#: change over each batch into its own table.
COUNTERS = (
    "batches",
    "records",
    "bytes_read",
    "read_seconds",
    "decode_seconds",
    "transform_seconds",
    "cache_hits",
    "cache_misses",
    "wait_seconds",
)
_INDEX = {name: i for i, name in enumerate(COUNTERS)}
_ROWS = 64  # row 0: main process; rows 1..63: DataLoader workers 0..62 (and beyond, folded)
_CONSUMER_ROW = _ROWS  # the training loop's waits
_local = np.zeros(len(COUNTERS), dtype=np.float64)


def _reset_local_counters() -> None:
    global _local
    _local = np.zeros(len(COUNTERS), dtype=np.float64)


# A forked child (a DataLoader worker) starts from zero.
os.register_at_fork(after_in_child=_reset_local_counters)


def local_counters() -> np.ndarray:
    """This process's running counters (a float64 array indexed like :data:`COUNTERS`).

    Sources add to it cheaply, e.g. ``local_counters()[COUNTER["bytes_read"]] += n``.
    """
    return _local


COUNTER = _INDEX


def _row_of_this_process() -> int:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0
    return min(1 + info.id, _ROWS - 1)


class PipelineStats:
    """The shared table behind :func:`stats` (one per Dataset chain).

    Pickled into spawned workers while they start, inherited by forked ones; pickled
    any other way it becomes a private copy (like the epoch).
    """

    __slots__ = ("_shared",)

    def __init__(self) -> None:
        size = (_ROWS + 1) * len(COUNTERS)
        try:
            self._shared = multiprocessing.RawArray("d", size)
        except OSError:  # pragma: no cover - no shared memory available
            self._shared = None

    def _table(self) -> np.ndarray:
        if self._shared is None:
            self._shared = multiprocessing.RawArray("d", (_ROWS + 1) * len(COUNTERS))
        return np.frombuffer(self._shared, dtype=np.float64).reshape(_ROWS + 1, len(COUNTERS))

    def publish(self, delta: np.ndarray) -> None:
        """Add one batch's counters to this process's row (only this process writes it)."""
        self._table()[_row_of_this_process()] += delta

    def add_wait(self, seconds: float, batches: int = 1) -> None:
        row = self._table()[_CONSUMER_ROW]
        row[_INDEX["wait_seconds"]] += seconds
        row[_INDEX["batches"]] += batches

    def reset(self) -> None:
        """Zero the table."""
        self._table()[:] = 0

    def snapshot(self) -> np.ndarray:
        return self._table().copy()

    def __getstate__(self) -> tuple[Any]:
        spawning = multiprocessing.context.get_spawning_popen() is not None
        # A tuple, never a bare None: pickle skips __setstate__ for a None state,
        # which would leave the slot unset.
        return (self._shared if spawning else None,)

    def __setstate__(self, state: tuple[Any]) -> None:
        (self._shared,) = state


@dataclass
class StatsReport:
    """A snapshot of a pipeline's counters, per process and in total."""

    workers: dict[str, dict[str, float]]
    total: dict[str, float]
    consumer: dict[str, float]

    @property
    def wait_fraction(self) -> float | None:
        """Consumer wait time over wall time of the timed loop, when :func:`timed` was used."""
        wall = self.consumer.get("wall_seconds", 0.0)
        return self.consumer["wait_seconds"] / wall if wall else None

    def __str__(self) -> str:
        cols = ("records", "MB", "read s", "decode s", "transform s", "cache hit/miss")
        lines = [f"{'process':<10}" + "".join(f"{c:>16}" for c in cols)]
        for name, row in [*self.workers.items(), ("total", self.total)]:
            vals = (
                f"{row['records']:,.0f}",
                f"{row['bytes_read'] / 1e6:,.1f}",
                f"{row['read_seconds']:.2f}",
                f"{row['decode_seconds']:.2f}",
                f"{row['transform_seconds']:.2f}",
                f"{row['cache_hits']:,.0f}/{row['cache_misses']:,.0f}",
            )
            lines.append(f"{name:<10}" + "".join(f"{v:>16}" for v in vals))
        if self.consumer["batches"]:
            frac = self.wait_fraction
            lines.append(
                f"consumer waited {self.consumer['wait_seconds']:.2f}s for "
                f"{self.consumer['batches']:,.0f} batches"
                + (f" ({100 * frac:.1f}% of loop time)" if frac is not None else "")
            )
        return "\n".join(lines)


def _find_stats(obj: Any) -> PipelineStats:
    for candidate in (obj, getattr(obj, "dataset", None), getattr(obj, "loader", None)):
        st = getattr(candidate, "_stats", None)
        if isinstance(st, PipelineStats):
            return st
        inner = getattr(candidate, "dataset", None)
        st = getattr(inner, "_stats", None)
        if isinstance(st, PipelineStats):
            return st
    raise TypeError(f"{type(obj).__name__} is not a torchgrain Dataset or a DataLoader over one")


def stats(obj: Any, *, reset: bool = False) -> StatsReport:
    """Report per-worker read/decode/transform time, bytes, records and cache counters.

    ``obj`` is a torchgrain Dataset, a DataLoader over one, or an iterator returned by
    :func:`timed`. With ``reset=True`` the counters are zeroed after the snapshot.
    """
    st = _find_stats(obj)
    table = st.snapshot()
    workers = {}
    for r in range(_ROWS):
        if table[r].any():
            name = "main" if r == 0 else f"worker {r - 1}"
            workers[name] = dict(zip(COUNTERS, table[r].tolist()))
    total = dict(zip(COUNTERS, table[:_ROWS].sum(axis=0).tolist()))
    consumer = dict(zip(COUNTERS, table[_CONSUMER_ROW].tolist()))
    consumer["wall_seconds"] = getattr(obj, "wall_seconds", 0.0)
    if reset:
        st.reset()
    return StatsReport(workers=workers, total=total, consumer=consumer)


class timed(Iterable[Any]):
    """Iterate ``loader`` and record how long the consumer waited for each batch.

    Args:
        loader: a DataLoader (or any iterable) over a torchgrain Dataset.
        log_every: if set, log a one-line :func:`stats` summary every N batches
            (logger ``"torchgrain"``, level INFO).

    The wait is the time spent inside ``next()``: zero when the pipeline keeps up.
    """

    def __init__(self, loader: Iterable[Any], *, log_every: int | None = None) -> None:
        self.loader = loader
        self.dataset = getattr(loader, "dataset", None)
        self.log_every = log_every
        self.wall_seconds = 0.0
        self._stats = _find_stats(loader)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        n = 0
        start = time.perf_counter()
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self._stats.add_wait(time.perf_counter() - t0)
                n += 1
                if self.log_every and n % self.log_every == 0:
                    self.wall_seconds += time.perf_counter() - start
                    start = time.perf_counter()
                    rep = stats(self)
                    logger.info(
                        "torchgrain: %d batches, %.0f records read, consumer wait %.1f%%",
                        n,
                        rep.total["records"],
                        100 * (rep.wait_fraction or 0.0),
                    )
                yield batch
        finally:
            # Also when the loop stops early (break, exception): its waits are counted.
            self.wall_seconds += time.perf_counter() - start
