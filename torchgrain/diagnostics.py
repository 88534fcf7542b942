"""Pipeline statistics: where the time goes, per DataLoader and per worker.

Every torchgrain :class:`~torchgrain.Dataset` owns a small shared-memory table that its
``__getitems__`` updates after each batch: records and bytes read, seconds spent
reading (I/O and decompression), decoding records, and running transforms, and cache
hits/misses. The table has a slot for each DataLoader over the Dataset (a row per
process: the main process and up to 63 workers, and a row for the consumer), so that
loaders sharing one Dataset, say a training and an evaluation loader, are counted
apart. Workers write their own row of their loader's slot; the training process reads
the table at any time with :func:`stats`, without any message passing:
``stats(loader)`` reports what that loader read (its workers, or the main process while
it iterates with ``num_workers=0``), ``stats(dataset)`` the total over all loaders,
past ones included, and reads outside any loader. Wrapping the loader in :func:`timed`
adds the consumer's side: how long the training loop waited for each of its batches.

Up to 8 loaders alive at once over one Dataset are counted apart; more share the last
slot (each of them then reports the sum of those sharing it). A loader's slot is freed
for another when the loader is garbage collected.

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
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchgrain.errors import warn_once
from torchgrain.frameworks import dataloader as _dataloader
from torchgrain.io import process

__all__ = [
    "COUNTERS",
    "PipelineStats",
    "StatsReport",
    "count_decode",
    "count_read",
    "local_counters",
    "stats",
    "timed",
]

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
    "loop_seconds",
)
#: Where each counter is in a row: ``local_counters()[COUNTER["bytes_read"]]``.
COUNTER = {name: i for i, name in enumerate(COUNTERS)}
_BYTES_READ, _READ_SECONDS, _DECODE_SECONDS = (
    COUNTER[k] for k in ("bytes_read", "read_seconds", "decode_seconds")
)
_ROWS = 64  # row 0: main process; rows 1..63: DataLoader workers 0..62 (and beyond, folded)
_CONSUMER_ROW = _ROWS  # the training loop's waits
# The table holds one block of rows per DataLoader reading the Dataset, so that loaders
# sharing one Dataset (a train and an eval loader, the several loaders of a benchmark)
# are counted apart, and two more blocks for the Dataset's total only:
_RETIRED = 0  # loaders that are gone: their counts, merged in when their slot is freed
_OTHER = 1  # reads outside any DataLoader (direct indexing, as another Dataset's source)
_FIRST_SLOT = 2
_LOADER_SLOTS = 8  # loaders counted apart at a time; more fold into the last slot
_BLOCKS = _FIRST_SLOT + _LOADER_SLOTS
_LAST_SLOT = _BLOCKS - 1
_MAIN_DEPTH = 16  # frames from a batch read up to the DataLoader iterator (num_workers=0)
_local = np.zeros(len(COUNTERS), dtype=np.float64)
# Claims and releases of slots, in the process that owns the loaders. Re-entrant: a
# release runs when a batch sampler is freed, which may happen inside a claim.
_slot_lock = threading.RLock()


def _after_fork_in_child() -> None:
    global _local, _slot_lock
    _local = np.zeros(len(COUNTERS), dtype=np.float64)  # a forked worker starts from zero
    _slot_lock = threading.RLock()  # another thread may have held it at the fork


def local_counters() -> np.ndarray:
    """This process's running counters (a float64 array indexed like :data:`COUNTERS`).

    Sources add to it cheaply, e.g. ``local_counters()[COUNTER["bytes_read"]] += n``.
    """
    return _local


def count_read(seconds: float, nbytes: int) -> None:
    """Count a source's read: its seconds and the bytes it read, in this process.

    Example:
        >>> before = local_counters().copy()
        >>> count_read(0.5, 100)
        >>> (local_counters() - before)[[COUNTER["read_seconds"], COUNTER["bytes_read"]]]
        array([  0.5, 100. ])
    """
    _local[_READ_SECONDS] += seconds
    _local[_BYTES_READ] += nbytes


def count_decode(seconds: float) -> None:
    """Count a source's decoding time, in this process."""
    _local[_DECODE_SECONDS] += seconds


def _stats_of(dataset: Any) -> PipelineStats | None:
    """The table of a torchgrain Dataset, or of one that a wrapper (e.g. ``Subset``) holds."""
    for candidate in (dataset, getattr(dataset, "dataset", None)):
        if isinstance(st := getattr(candidate, "_stats", None), PipelineStats):
            return st
    return None


def _loader_of(obj: Any) -> Any | None:
    """What names the DataLoader behind ``obj``: the object it draws batches of indices
    from (:func:`torchgrain.frameworks.dataloader.loader_key`).

    The same object for every pass over a loader and the one its iterators keep. Found
    on a DataLoader (torch's, torchdata's StatefulDataLoader), through wrappers that
    pass attributes on (:class:`~torchgrain.ResumableLoader`, Accelerate's prepared
    loaders) and through those that keep the loader as ``.loader`` (:func:`timed`,
    :class:`~torchgrain.prefetch.CudaPrefetcher`). None for a Dataset, or anything
    without a loader.
    """
    import torch.utils.data

    for _ in range(4):
        if obj is None or isinstance(obj, torch.utils.data.Dataset):
            return None
        owner = _dataloader.loader_key(obj)
        if owner is not None:
            return owner
        obj = getattr(obj, "loader", None)
    return None


@dataclass
class _Owner:
    """Which slot each loader holds, known only to the process that iterates the loaders.

    The key is ``id()`` of the loader's batch sampler. A slot is freed when that object
    is, so a later loader that happens to get the same ``id()`` starts from zero. A
    forked worker sees a copy of its parent's (``token`` tells whose it is).
    """

    token: tuple[int, int] = field(default_factory=process.token)
    slots: dict[int, int] = field(default_factory=dict)
    pinned: dict[int, Any] = field(default_factory=dict)  # samplers without weakrefs


def _release(
    ref: weakref.ref[PipelineStats], key: int, block: int, owner_token: tuple[int, int]
) -> None:
    """A loader's batch sampler was freed: merge its counts into the retired block."""
    st = ref()
    # A forked copy of the sampler, not the loader's own. The token, not the generation
    # alone: in a new child a collection can run this before the after-fork hooks have
    # counted the fork (and re-made _slot_lock, which another thread of the parent may
    # have held).
    if st is None or owner_token != process.token():
        return
    with _slot_lock:
        owner = st._owner
        if owner.token != owner_token or owner.slots.get(key) != block:
            return
        del owner.slots[key]
        if block in owner.slots.values():  # other loaders folded into it still count there
            return
        table = st._table()
        table[_RETIRED] += table[block]
        table[block] = 0
        st._tag_array()[block] = 0


def _shared_array(typecode: str, n: int) -> Any:
    """``n`` zeros of ``typecode`` ("d" or "q") in shared memory, or, where none can be
    had, in this process's memory, with one warning per process: statistics never fail a
    read. (``/dev/shm`` full or out of inodes, and every temporary directory, or a
    file-size limit: the shared table is a file there.)"""
    try:
        return multiprocessing.RawArray(typecode, n)
    except OSError as e:
        warn_once(
            ("stats without shared memory", process.token()),
            f"torchgrain: the pipeline statistics cannot have shared memory ({e}); "
            "stats() counts only what each process reads itself until it ends. Free "
            "space (or files) in /dev/shm.",
            RuntimeWarning,
        )
        return np.zeros(n, dtype=np.float64 if typecode == "d" else np.int64)


class PipelineStats:
    """The shared table behind :func:`stats` (one per Dataset chain).

    A block of rows for each DataLoader reading the Dataset (a slot; there are 8): a
    row per process reading for that loader and a consumer row. The process that
    iterates a loader gives it a slot when the loader first reads, starts a worker or
    is timed, and keeps which slot is whose to itself; workers learn theirs when they
    start and write into it, each into its own row, without locking. More loaders at
    once than slots share the last one. A slot is freed, its counts kept for the
    Dataset's total, when its loader (its batch sampler) is garbage collected, so a
    later loader never inherits counts, even at the same address.

    Pickled into spawned workers while they start (with the slot of the loader that
    starts them), inherited by forked ones; pickled any other way it becomes a private
    copy (like the epoch).
    """

    __slots__ = (
        "__weakref__",
        "_owner",
        "_place",
        "_shared",
        "_spawned",
        "_tags",
        "_view",
        "cache_fit",
    )

    def __init__(self) -> None:
        self._shared = _shared_array("d", _BLOCKS * (_ROWS + 1) * len(COUNTERS))
        # The pid of the process that claimed each slot (0: free), so that processes
        # sharing one table (e.g. handed to spawned processes) take different slots.
        self._tags = _shared_array("q", _BLOCKS)
        self._init_local(None)

    def _init_local(self, worker_block: int | None) -> None:
        self._view: np.ndarray | None = None
        # In a worker spawned by a DataLoader iterator: (its pid, the slot to write).
        # (Stamped with the fork generation: these are made afresh when unpickled.)
        self._spawned = None if worker_block is None else (process.generation, worker_block)
        self._place: tuple[int, int | None, int] | None = None  # (generation, block, row)
        self._owner = _Owner()
        # The source's check of the latest sampler pass against its caches (a list of
        # CacheFit), kept in the process that runs the sampler; see Source.read_ahead.
        self.cache_fit: list[Any] = []

    def _table(self) -> np.ndarray:
        view = self._view
        if view is None:
            if self._shared is None:
                self._shared = _shared_array("d", _BLOCKS * (_ROWS + 1) * len(COUNTERS))
            view = np.frombuffer(self._shared, dtype=np.float64)
            view = self._view = view.reshape(_BLOCKS, _ROWS + 1, len(COUNTERS))
        return view

    def _tag_array(self) -> Any:
        if self._tags is None:
            self._tags = _shared_array("q", _BLOCKS)
        return self._tags

    # ------------------------------------------------------------------ slots
    def _slots(self) -> dict[int, int]:
        """This process's loader slots (a fresh map in a forked process)."""
        if self._owner.token[1] != process.generation:
            self._owner = _Owner()
        return self._owner.slots

    def _claim(self, loader: Any) -> int:
        """The slot of ``loader`` (a batch sampler), taking a free one the first time."""
        key = id(loader)
        with _slot_lock:
            slots = self._slots()
            block = slots.get(key)
            if block is not None:
                return block
            tags = self._tag_array()
            block = next((b for b in range(_FIRST_SLOT, _BLOCKS) if tags[b] == 0), _LAST_SLOT)
            tags[block] = os.getpid()
            slots[key] = block
            try:
                fin = weakref.finalize(
                    loader, _release, weakref.ref(self), key, block, self._owner.token
                )
                fin.atexit = False
            except TypeError:  # no weak references: keep it, so that its id stays its own
                self._owner.pinned[key] = loader
            return block

    def slot_of(self, loader: Any) -> int | None:
        """The slot ``loader`` (a batch sampler) holds in this process, or None."""
        return self._slots().get(id(loader))

    def _loader_block(self, it: Any) -> int:
        """The slot of the loader whose iterator ``it`` is, if it reads this table."""
        if it is None or _stats_of(_dataloader.iterator_dataset(it)) is not self:
            return _OTHER
        loader = _dataloader.iterator_key(it)
        return _OTHER if loader is None else self._claim(loader)

    def _locate(self) -> tuple[int, int | None, int]:
        """Where this process writes: once per process, except the loader in the main one."""
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        if info is None:  # not a worker: the loader is looked up at each batch
            place: tuple[int, int | None, int] = (process.generation, None, 0)
        else:
            spawned = self._spawned
            if spawned is not None and spawned[0] == process.generation:
                block = spawned[1]
            else:
                # A forked worker: the parent gave its loader a slot just before the
                # fork (see _before_fork), in the copy of the parent's map it holds.
                block = _OTHER
                it = _dataloader.loader_iterator(skip=3)
                if it is not None and _stats_of(_dataloader.iterator_dataset(it)) is self:
                    owner = self._owner
                    loader = _dataloader.iterator_key(it)
                    if process.forked_from(owner.token) and id(loader) in owner.slots:
                        block = owner.slots[id(loader)]
            place = (process.generation, block, min(1 + info.id, _ROWS - 1))
        self._place = place
        return place

    # ---------------------------------------------------------------- writing
    def publish(self, delta: np.ndarray) -> None:
        """Add one batch's counters to this process's row of its loader's slot.

        Only this process writes that row. A worker finds its row and slot once; the
        main process (``num_workers=0``) looks up the loader iterating it at each batch.
        """
        place = self._place
        if place is None or place[0] != process.generation:
            place = self._locate()
        block = place[1]
        if block is None:
            block = self._loader_block(_dataloader.loader_iterator(skip=2, depth=_MAIN_DEPTH))
        self._table()[block, place[2]] += delta

    def add_wait(
        self, seconds: float, batches: int = 1, loader: Any = None, *, loop: float = 0.0
    ) -> None:
        """Count the consumer's wait for ``batches`` batches of ``loader`` (a batch sampler)
        and ``loop`` seconds of the loop that took them (:func:`timed`)."""
        block = _OTHER if loader is None else self._claim(loader)
        row = self._table()[block, _CONSUMER_ROW]
        row[COUNTER["wait_seconds"]] += seconds
        row[COUNTER["batches"]] += batches
        row[COUNTER["loop_seconds"]] += loop

    # ---------------------------------------------------------------- reading
    def snapshot(self, loader: Any = None) -> np.ndarray:
        """A copy of ``loader``'s rows (zeros if it read nothing), or the sum over all."""
        table = self._table()
        if loader is None:
            return table.sum(axis=0)
        block = self.slot_of(loader)
        return table[block].copy() if block is not None else np.zeros_like(table[0])

    def reset(self, loader: Any = None) -> None:
        """Zero ``loader``'s rows, or the whole table."""
        block = slice(None) if loader is None else self.slot_of(loader)
        if block is not None:
            self._table()[block] = 0

    # --------------------------------------------------------------- pickling
    def __getstate__(self) -> tuple[Any, Any, int | None]:
        if multiprocessing.context.get_spawning_popen() is None:
            # A tuple, never a bare None: pickle skips __setstate__ for a None state,
            # which would leave the slots unset.
            return (None, None, None)
        # Starting a spawned (or forkserver) process. When a DataLoader iterator over
        # this Dataset starts it, the worker writes into that loader's slot.
        it = _dataloader.loader_iterator(skip=2)
        return (self._shared, self._tags, self._loader_block(it) if it is not None else None)

    def __setstate__(self, state: tuple[Any, Any, int | None]) -> None:
        self._shared, self._tags, worker_block = state
        self._init_local(worker_block)


def _before_fork() -> None:
    """Give the loader whose iterator is starting a worker by ``fork`` its slot now.

    The worker finds the slot in its copy of this process's memory (it holds the same
    frames, so it finds the same iterator).
    """
    try:
        it = _dataloader.loader_iterator(skip=2)
        st = _stats_of(_dataloader.iterator_dataset(it)) if it is not None else None
        if st is not None:
            st._loader_block(it)
    except Exception:  # pragma: no cover - statistics never stop a worker from starting
        logger.debug("torchgrain: no stats slot for a forked worker", exc_info=True)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


@dataclass
class StatsReport:
    """A snapshot of a pipeline's counters, per process and in total.

    ``cache_fit`` holds the source's check of the latest sampler pass against its caches
    (:class:`~torchgrain.sources.block_cache.CacheFit`: working set, cache size,
    simulated hit rate, whether it fits), made at the start of the pass in the process
    that runs the sampler; :attr:`cache_hit_rate` and :attr:`misses_per_batch` are what
    the readers measured.
    """

    workers: dict[str, dict[str, float]]
    total: dict[str, float]
    consumer: dict[str, float]
    cache_fit: list[Any] = field(default_factory=list)

    @property
    def wait_fraction(self) -> float | None:
        """Consumer wait time over wall time of the timed loop, when :func:`timed` was used."""
        wall = self.consumer.get("wall_seconds", 0.0)
        return self.consumer["wait_seconds"] / wall if wall else None

    @property
    def cache_hit_rate(self) -> float | None:
        """Measured share of block-cache lookups that hit (None before any lookup)."""
        looked = self.total["cache_hits"] + self.total["cache_misses"]
        return self.total["cache_hits"] / looked if looked else None

    @property
    def misses_per_batch(self) -> float | None:
        """Measured block-cache misses (blocks decoded or mapped) per batch read."""
        batches = self.total["batches"]
        return self.total["cache_misses"] / batches if batches else None

    @property
    def thrashing(self) -> list[Any]:
        """The caches the latest sampler pass cannot fit (empty when all fit)."""
        return [fit for fit in self.cache_fit if not fit.fits]

    #: What each column of the table counts (printed above it).
    LEGEND = (
        "read MB, read s: bytes the source read (after decompression, before decoding) and "
        "the time reading and decompressing them",
        "decode s: bytes to records and images (record codecs, Arrow, tg.decode_image); "
        "transform s: the other map functions",
    )

    def __str__(self) -> str:
        return self.table()

    def table(self, *, legend: bool = True) -> str:
        """The report as a table, a row per process, under a legend of its columns
        (``legend=False``: the table alone, for a second table under the first).

        Example:
            >>> import torchgrain as tg
            >>> ds = tg.Dataset([{"a": 1}] * 4)
            >>> _ = ds.__getitems__([0, 1])
            >>> tg.stats(ds).table(legend=False).split()[:3]
            ['process', 'records', 'read']
        """
        cols = ("records", "read MB", "read s", "decode s", "transform s", "cache hit/miss")
        lines = [
            *(self.LEGEND if legend else ()),
            f"{'process':<10}" + "".join(f"{c:>16}" for c in cols),
        ]
        for name, row in [*self.workers.items(), ("total", self.total)]:
            seconds = (f"{row[f'{k}_seconds']:.2f}" for k in ("read", "decode", "transform"))
            vals = (f"{row['records']:,.0f}", f"{row['bytes_read'] / 1e6:,.1f}", *seconds)
            vals += (f"{row['cache_hits']:,.0f}/{row['cache_misses']:,.0f}",)
            lines.append(f"{name:<10}" + "".join(f"{v:>16}" for v in vals))
        rate, per_batch = self.cache_hit_rate, self.misses_per_batch
        if rate is not None and per_batch is not None:
            lines.append(f"block cache: {100 * rate:.1f}% hits, {per_batch:,.1f} misses per batch")
        for fit in self.thrashing:
            lines.append("cache thrash: " + fit.message())
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
        if (st := _stats_of(candidate)) is not None:
            return st
    raise TypeError(f"{type(obj).__name__} is not a torchgrain Dataset or a DataLoader over one")


def stats(obj: Any, *, reset: bool = False) -> StatsReport:
    """Report per-worker read/decode/transform time, bytes, records and cache counters.

    ``obj`` is a torchgrain Dataset, a DataLoader over one (torch's or torchdata's
    ``StatefulDataLoader``), or a wrapper of such a loader: a
    :class:`~torchgrain.ResumableLoader`, an Accelerate prepared loader, an iterator
    returned by :func:`timed`. For a loader the report holds what that loader read
    (its workers, or ``main`` for the batches it read with ``num_workers=0``) and its
    consumer waits, also when other loaders read the same Dataset; zeros before it
    has read anything. For a Dataset it holds the sum over every loader that read it
    and reads outside any loader, each process row added up by name. With
    ``reset=True`` the counters reported are zeroed after the snapshot (those of the
    loader, or all of the Dataset's).

    Example:
        >>> import torch, torchgrain as tg
        >>> ds = tg.Dataset(list(range(12)))
        >>> train = torch.utils.data.DataLoader(ds, batch_size=4)
        >>> val = torch.utils.data.DataLoader(ds, batch_size=4, sampler=range(4))
        >>> _ = list(train), list(val)
        >>> [tg.stats(x).total["records"] for x in (train, val, ds)]
        [12.0, 4.0, 16.0]
    """
    st = _find_stats(obj)
    loader = _loader_of(obj)
    table = st.snapshot(loader)
    workers = {
        "main" if r == 0 else f"worker {r - 1}": dict(zip(COUNTERS, table[r].tolist()))
        for r in range(_ROWS)
        if table[r].any()
    }
    total = dict(zip(COUNTERS, table[:_ROWS].sum(axis=0).tolist()))
    consumer = dict(zip(COUNTERS, table[_CONSUMER_ROW].tolist()))
    consumer["wall_seconds"] = consumer["loop_seconds"]  # (the timed loops', as before)
    if reset:
        st.reset(loader)
    return StatsReport(workers, total, consumer, list(st.cache_fit))


class timed(Iterable[Any]):
    """Iterate ``loader`` and record how long the consumer waited for each batch.

    Args:
        loader: a DataLoader (or any iterable) over a torchgrain Dataset.
        log_every: if set, log a one-line :func:`stats` summary every N batches
            (logger ``"torchgrain"``, level INFO).

    The wait is the time spent inside ``next()``: zero when the pipeline keeps up. It
    counts for ``loader`` alone (:func:`stats` of this iterator or of the loader
    reports it, with the loop's time: ``wait_fraction``), or for the Dataset when
    ``loader`` is not a DataLoader.

    Example:
        >>> import torch, torchgrain as tg
        >>> loader = torch.utils.data.DataLoader(tg.Dataset(list(range(8))), batch_size=4)
        >>> for batch in tg.timed(loader):
        ...     pass
        >>> report = tg.stats(loader)
        >>> report.consumer["batches"], report.wait_fraction is not None
        (2.0, True)
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
        loader = _loader_of(self.loader)  # the waits count for this loader only
        n = 0
        start = time.perf_counter()
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                # The wait and the loop's time up to it, counted together: a report
                # taken at any point has both over the same stretch (a share <= 1).
                now = time.perf_counter()
                self.wall_seconds += now - start
                self._stats.add_wait(now - t0, loader=loader, loop=now - start)
                start = now
                n += 1
                if self.log_every and n % self.log_every == 0:
                    rep = stats(self)
                    logger.info(
                        "torchgrain: %d batches, %.0f records read, consumer wait %.1f%%",
                        n,
                        rep.total["records"],
                        100 * (rep.wait_fraction or 0.0),
                    )
                yield batch
        finally:
            # Also when the loop stops early (break, exception): its time is counted.
            seconds = time.perf_counter() - start
            self.wall_seconds += seconds
            self._stats.add_wait(0.0, 0, loader=loader, loop=seconds)
