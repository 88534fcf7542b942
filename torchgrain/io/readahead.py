"""Read-ahead of remote data, in the order a sampler will need it.

:class:`ShardReadAhead` downloads whole shards into the shard cache;
:class:`RangeReadAhead` (remote reads without a shard cache) fetches the byte ranges of
the next batches into the process's :class:`~torchgrain.io.ranges.RangeStore` while the
current batch is decoded.

A sampler knows its whole epoch order. When a pass starts, it hands that order to the
dataset (:meth:`ShardReadAhead.begin`); a background thread walks the order ahead of
the position the sampler has reached, finds the shards in the order of their first
use, and downloads them into the on-disk :class:`~torchgrain.io.shard_cache.ShardCache`
(shared by every process of the machine, so DataLoader workers find local copies).
At most ``budget`` bytes of shards whose first use still lies ahead are fetched; a new
pass (``set_epoch``, a resume, a new ``iter(loader)``) cancels the old walk.

Read-ahead only warms the cache: a shard it could not fetch is fetched (and its error
raised) by the read that needs it, so it never changes which records are delivered,
or their order.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from torchgrain.io import process
from torchgrain.io.ranges import range_store
from torchgrain.protocols import PlacedOrder

__all__ = ["RangeReadAhead", "ShardReadAhead"]

# Order positions scanned per step of the walk (one vectorised call of the sampler).
_SCAN = 8192
# Longest a fork waits for the walk's downloads in flight to finish.
_FORK_JOIN_SECONDS = 60.0
_FORK_RESTART_DELAY = 0.2
# eviction="belady": how far ahead of the reader the order is scanned for next uses, and
# how often (seconds) the cache's hints are rewritten.
_HORIZON = 8 * _SCAN
_ADVISE_EVERY = 0.5
# Range read-ahead: the most bytes a step asks for. A step's records are handed over
# together when all of them arrived, and two steps are in flight: 256 records of 1 MiB
# would hold 512 MiB in flight, far past the range store's budget (64 MiB), and 256 of
# 100 KiB kept the reader waiting for 25 MB before its next batch.
STEP_BYTES = 16 << 20


def _used_at(
    order: Callable[[int, int], np.ndarray], a: int, b: int
) -> tuple[np.ndarray, np.ndarray]:
    """The indices ``order`` gives for the pass's positions ``[a, b)``, and the position
    each is used at: what a :class:`~torchgrain.protocols.PlacedOrder` (a composition's
    order for a source under it) says, else its own when there is one per position (a
    source's own pass), else ``b - 1`` (an order made by hand that gives fewer or more,
    known to lie in ``[a, b)``: taken as used at the last, none counts as passed before
    the reader is there).

    Example:
        >>> _used_at(lambda a, b: [7, 3, 5], 10, 13)[1].tolist()
        [10, 11, 12]
        >>> _used_at(lambda a, b: [7], 10, 13)[1].tolist()
        [12]
    """
    if isinstance(order, PlacedOrder):
        indices, at = order.placed(a, b)
        return np.asarray(indices, np.int64), np.asarray(at, np.int64)
    indices = np.asarray(order(a, b), np.int64)
    if len(indices) == b - a:
        return indices, np.arange(a, b, dtype=np.int64)
    return indices, np.full(len(indices), b - 1, np.int64)


class _NextUses:
    """The next use of each shard ahead of the reader, told to a ``belady`` shard cache
    (:meth:`~torchgrain.io.shard_cache.ShardCache.advise`) as the reader moves on.

    Memory: one position per shard per scanned window of :data:`_SCAN` positions."""

    def __init__(self, src: Any, order: Callable[[int, int], np.ndarray], start: int, count: int):
        self.src, self.order, self.count = src, order, count
        self.scan = start
        self.future: dict[int, collections.deque[int]] = {}
        self.told: dict[int, int | None] = {}
        self.last = 0.0

    def update(self, reached: int, *, force: bool = False) -> None:
        import time

        now = time.monotonic()
        if not force and now - self.last < _ADVISE_EVERY:
            return
        self.last = now
        src = self.src
        while self.scan < min(self.count, reached + _HORIZON):
            stop = min(self.scan + _SCAN, self.count)
            indices, at = _used_at(self.order, self.scan, stop)
            shards = src.index.locate(indices)[0]
            uniq, first = np.unique(shards, return_index=True)
            for shard, k in zip(uniq.tolist(), first.tolist()):
                self.future.setdefault(shard, collections.deque()).append(int(at[k]))
            self.scan = stop
        hints: dict[int, int | None] = {}
        for shard in set(self.future) | set(self.told):
            uses = self.future.get(shard)
            while uses and uses[0] < reached:
                uses.popleft()
            use = uses[0] if uses else None
            if self.told.get(shard, -1) != use:
                self.told[shard] = use
                hints[shard] = use
        if hints:
            paths = src.cached_copies.paths  # (the compact sequence: only these are spelt out)
            src.cache.advise({paths[shard]: use for shard, use in hints.items()})


class _Walker:
    """A walk of a sampler's order on a thread of its own; a new generation cancels it."""

    _thread: threading.Thread | None = None
    _generation = 0
    _walk: Callable[..., None]

    def _start(self, name: str, *args: Any) -> None:
        self._thread = threading.Thread(target=self._walk, args=args, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the current walk to finish (its downloads included); whether it did."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _live(self, generation: int) -> bool:
        return self._generation == generation


class ShardReadAhead(_Walker):
    """Downloads a source's shards ahead of use (see the module docstring).

    Args:
        source: a :class:`~torchgrain.sources.base.ShardedSource` with a shard cache.
        budget: bytes of shards, not yet reached, that may sit fetched ahead.
        threads: concurrent downloads (sources pass their ``io_threads``, default 8:
            object stores cap each connection's bandwidth, not the sum).

    Sources make one per process (:meth:`~torchgrain.sources.base.ShardedSource.read_ahead`);
    made by hand it walks any order:

    Example:
        >>> import os, tempfile, fsspec, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": i} for i in range(40)], d, num_shards=4)
        >>> store = fsspec.filesystem("memory")  # stands in for an object store
        >>> for f in os.listdir(d):
        ...     store.pipe(f"/ra-doc/{f}", open(os.path.join(d, f), "rb").read())
        >>> src = tg.ArrayRecordSource("memory://ra-doc", cache_dir=tempfile.mkdtemp())
        >>> ra = ShardReadAhead(src, budget=1 << 20)
        >>> ra.begin(lambda a, b: list(range(a, b)), 0, len(src), position=lambda: 0)
        >>> ra.join(timeout=30), ra.fetched
        (True, 4)
    """

    def __init__(self, source: Any, budget: int, threads: int = 4) -> None:
        self.source = source
        self.budget = int(budget)
        self.threads = threads
        self._lock = threading.Lock()
        self._walk_args: tuple[Any, ...] | None = None  # the current walk, to restart it
        self._wake = threading.Event()  # set when the current walk is cancelled
        self._resume_walk = False
        self.fetched = 0  # shards downloaded ahead (for tests and stats)
        process.stop_threads_at_fork(self)

    def begin(
        self,
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
        position: Callable[[], int],
        *,
        delay: float = 0.0,
    ) -> None:
        """Start walking ``order(a, b)`` (the indices at positions ``[a, b)``) from
        ``start`` to ``count``, staying within the budget ahead of ``position()``
        (after ``delay`` seconds, unless cancelled meanwhile)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._wake.set()  # a walk still waiting to start gives up at once
            self._wake = wake = threading.Event()
        self._walk_args = (order, count, position)
        if self.budget <= 0 or count <= start:
            return
        self._start("torchgrain-read-ahead", generation, wake, delay, order, start, count, position)

    def cancel(self) -> None:
        """Stop the current walk (downloads in flight finish)."""
        with self._lock:
            self._generation += 1
            self._wake.set()

    def _stop_threads_for_fork(self) -> None:
        # The walk and its downloads stop (those in flight finish) before this process
        # forks, and start again from where the reader is once it has forked.
        thread = self._thread
        self._resume_walk = thread is not None and thread.is_alive()
        if self._resume_walk:
            self.cancel()
            thread.join(_FORK_JOIN_SECONDS)  # type: ignore[union-attr]

    def _restart_threads_after_fork(self) -> None:
        # After a short wait: a DataLoader forks its workers one after the other, and
        # a walk stopped again at the next fork should not have started downloads.
        if self._resume_walk and self._walk_args is not None:
            order, count, position = self._walk_args
            self.begin(order, position(), count, position, delay=_FORK_RESTART_DELAY)
        self._resume_walk = False

    def _walk(self, generation: int, wake: threading.Event, delay: float, *args: Any) -> None:
        process.note_thread()
        if delay > 0 and wake.wait(delay):
            return  # cancelled before it started
        # Read-ahead only warms the cache: the reads that need a shard fetch it
        # themselves and raise its errors.
        with contextlib.suppress(Exception):
            self._walk_order(generation, *args)

    def _walk_order(
        self,
        generation: int,
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> None:
        src = self.source
        n = src.num_shards
        # Positions of each shard's first (-1: not seen yet) and (latest scanned) last use,
        # and its size once known: the shards in use now must stay cached beside those
        # fetched ahead.
        first_use = np.full(n, -1, dtype=np.int64)
        last_use = np.full(n, -1, dtype=np.int64)
        sizes = np.zeros(n, dtype=np.int64)
        capacity = src.cache.max_bytes if src.cache is not None else None
        pending: collections.deque[tuple[int, int]] = collections.deque()  # (first use, shard)
        ahead: collections.deque[tuple[int, int]] = collections.deque()  # (first use, bytes)
        in_flight: list[Future[Any]] = []
        scan = start
        hints = (
            _NextUses(src, order, start, count)
            if capacity is not None and src.cache.eviction == "belady"
            else None
        )
        with process.thread_pool(self.threads, "torchgrain-read-ahead") as pool:
            while self._live(generation):
                if hints is not None:
                    hints.update(position())
                while len(pending) < 2 * self.threads and scan < count and (first_use < 0).any():
                    stop = min(scan + _SCAN, count)
                    indices, at = _used_at(order, scan, stop)
                    shards = src.index.locate(indices)[0]
                    uniq, back = np.unique(shards[::-1], return_index=True)
                    last_use[uniq] = at[len(shards) - 1 - back]
                    first = np.unique(shards, return_index=True)[1]
                    for k in np.sort(first).tolist():
                        s = int(shards[k])
                        if first_use[s] < 0:
                            first_use[s] = at[k]
                            pending.append((int(at[k]), s))
                    scan = stop
                in_flight = [f for f in in_flight if not f.done()]
                if not pending:
                    break
                reached = position()
                while ahead and ahead[0][0] < reached:
                    ahead.popleft()  # in use now: no longer ahead
                use, shard = pending[0]
                if sizes[shard] == 0:
                    try:
                        sizes[shard] = src.shard_nbytes(shard)
                    except Exception:  # its read reports the error: warm the others
                        pending.popleft()
                        continue
                if use < reached:  # the reader got there first
                    pending.popleft()
                    continue
                size = int(sizes[shard])
                held = sum(b for _, b in ahead)
                fits = held + size <= self.budget
                if fits and capacity is not None:
                    # Never evict a shard the loader is still reading to make room for one
                    # it reads later (a window of shards bigger than the cache's spare room).
                    live = (first_use >= 0) & (first_use <= reached) & (last_use >= reached)
                    fits = int(sizes[live].sum()) + held + size <= capacity
                if (ahead and not fits) or len(in_flight) >= self.threads:
                    threading.Event().wait(0.02)
                    continue
                pending.popleft()
                ahead.append((use, size))
                in_flight.append(pool.submit(self._fetch, generation, shard))
            for f in in_flight:
                if not self._live(generation):
                    f.cancel()
        # Every shard fetched once: the hints go on until the pass ends (a shard evicted
        # is fetched again by its reader; which one goes follows them).
        while hints is not None and self._live(generation) and position() < count:
            hints.update(position())
            threading.Event().wait(0.1)

    def _fetch(self, generation: int, shard: int) -> None:
        if not self._live(generation):
            return
        with contextlib.suppress(Exception):  # the read that needs it reports errors
            if self.source.prefetch_shard(shard):
                with self._lock:  # several downloads end at once
                    self.fetched += 1


class RangeReadAhead(_Walker):
    """Fetches the byte ranges of the records a sampler will ask for next (remote reads
    without a shard cache), in the process that reads them (the walk starts when the
    process reads a batch: see :meth:`kick`).

    A background thread walks the order from the reader's position, in steps of at most
    ``step`` records and about ``step_bytes`` bytes (default :data:`STEP_BYTES`; the
    reader's first batch tells the bytes per record, each step the next), two steps in
    flight, at most ``ahead`` records ahead of it and while the process's range store has
    room (its ``max_bytes``, plus the two steps that may start just under it, bounds the
    memory held, whatever the records' size); each step's ranges are fetched
    across all its shards at once (:meth:`~torchgrain.sources.fetch_ahead.BatchRanges.prefetch`,
    ``max_inflight`` in flight). What the reader passed without using is dropped, and a
    new pass (``set_epoch``, a resume, a new ``iter(loader)``) cancels the walk and
    drops what it fetched. Failures are left to the reads that need the bytes: read-ahead
    never changes what is delivered.

    Example:
        >>> import os, tempfile, fsspec, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": i} for i in range(40)], d, num_shards=4)
        >>> store = fsspec.filesystem("memory")
        >>> for f in os.listdir(d):
        ...     store.pipe(f"/rra-doc/{f}", open(os.path.join(d, f), "rb").read())
        >>> src = tg.ArrayRecordSource("memory://rra-doc")
        >>> ra = RangeReadAhead(src, step=8)
        >>> reached = [0]  # how far the reader got
        >>> ra.begin(lambda a, b: list(range(a, b)), 0, len(src), lambda: reached[0])
        >>> ra.kick()  # this process reads the batches: the walk starts
        >>> import time
        >>> deadline = time.monotonic() + 30
        >>> while ra.steps < 5 and time.monotonic() < deadline:
        ...     time.sleep(0.01)
        >>> ra.steps  # 40 records, 8 at a time
        5
        >>> src[3]["x"]  # served from what was fetched ahead
        3
        >>> reached[0] = len(src)  # the reader is done: the walk ends
        >>> ra.join(timeout=30)
        True
    """

    def __init__(
        self,
        source: Any,
        *,
        step: int = 256,
        ahead: int = 2048,
        step_bytes: int | None = None,
    ) -> None:
        self.source = source
        self.step = int(step)
        self.ahead = int(ahead)
        self.step_bytes = int(STEP_BYTES if step_bytes is None else step_bytes)
        self.per_record: float | None = None  # bytes per record, as last planned
        self._lock = threading.Lock()
        self._owners: collections.deque[tuple[int, object]] = collections.deque()
        # The pass begun and not yet walked: (order, start, count, position).
        self._pending: tuple[Any, int, int, Callable[[], int]] | None = None
        self._walking: tuple[Any, int, Callable[[], int]] | None = None  # (order, count, position)
        self.steps = 0  # steps fetched (for tests and stats)
        process.stop_threads_at_fork(self)

    def begin(
        self,
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> None:
        """Prepare the walk of ``order`` from ``start`` to ``count`` ahead of
        ``position()`` (cancelling the walk in progress). It starts at the next
        :meth:`kick`: when this process reads a batch. A process whose batches are read
        by DataLoader workers never reads one, and so never fetches what it would not
        use (nor runs a thread when the loader forks its workers)."""
        self.cancel()
        if count > start:
            with self._lock:
                self._pending = (order, start, count, position)

    @property
    def pending(self) -> bool:
        """Whether a walk is prepared and not started (the next :meth:`kick` starts it)."""
        return self._pending is not None

    def kick(self, per_record: float | None = None) -> None:
        """This process is reading a batch: start the walk :meth:`begin` prepared, from
        where the reader is, if it has not started. ``per_record``: the bytes per record
        of that batch, which sizes the first steps."""
        if per_record:
            self.per_record = float(per_record)
        with self._lock:
            pending, self._pending = self._pending, None
            generation = self._generation
        if pending is None:
            return
        order, start, count, position = pending
        start = max(start, position())
        if count <= start:
            return
        self._walking = (order, count, position)
        self._start("torchgrain-range-ahead", generation, order, start, count, position)

    def _stop_threads_for_fork(self) -> None:
        # The walk stops (what it fetched is dropped) before this process forks; the
        # next batch this process reads starts it again from where the reader is.
        thread = self._thread
        if thread is not None and thread.is_alive() and self._walking is not None:
            order, count, position = self._walking
            self.cancel()
            thread.join(_FORK_JOIN_SECONDS)
            with self._lock:
                self._pending = (order, position(), count, position)

    def _restart_threads_after_fork(self) -> None:
        pass  # restarted by the next kick()

    def cancel(self) -> None:
        """Stop the walk and drop what it fetched that was not used (requests in flight
        finish; what they bring is dropped too)."""
        with self._lock:
            self._generation += 1
            self._pending = None
            owners, self._owners = list(self._owners), collections.deque()
        store = range_store()
        for _, owner in owners:
            store.drop(owner)

    def _step(self, generation: int, idx: np.ndarray, owner: object) -> None:
        src = self.source
        planned: list[int] = []
        src.ranges.prefetch(src.index.split(idx), owner=owner, lenient=True, planned=planned)
        if planned and len(idx):
            self.per_record = planned[0] / len(idx)
        if not self._live(generation):
            range_store().drop(owner)  # cancelled while in flight
            return
        with self._lock:
            self.steps += 1

    def _walk(
        self,
        generation: int,
        order: Callable[[int, int], np.ndarray],
        pos: int,
        count: int,
        position: Callable[[], int],
    ) -> None:
        process.note_thread()
        src, store = self.source, range_store()
        in_flight: list[Future[Any]] = []
        # Two steps in flight: the next one's requests start while the last of this
        # one's are still out, so the process's max_inflight stays busy.
        with (
            process.thread_pool(2, "torchgrain-range-ahead") as pool,
            contextlib.suppress(Exception),  # the reads that need the bytes report errors
        ):
            while self._live(generation) and pos < count:
                reached = position()
                with self._lock:
                    # Steps the reader has passed: what it did not take is of no use.
                    while self._owners and self._owners[0][0] <= reached - self.step:
                        store.drop(self._owners.popleft()[1])
                pos = max(pos, reached)
                if pos >= count:
                    break
                in_flight = [f for f in in_flight if not f.done()]
                if len(in_flight) >= 2 or pos >= reached + self.ahead or store.room() <= 0:
                    threading.Event().wait(0.005)
                    continue
                step = self.step  # fewer records where that is more than step_bytes bytes
                if self.per_record:
                    step = max(1, min(step, int(self.step_bytes // self.per_record)))
                stop = min(pos + step, count)
                idx = src.index.check(np.asarray(order(pos, stop), dtype=np.int64))
                owner = object()
                with self._lock:
                    if not self._live(generation):
                        break
                    self._owners.append((stop, owner))
                in_flight.append(pool.submit(self._step, generation, idx, owner))
                pos = stop
            for f in in_flight:
                f.result()
            # All fetched: drop what the reader passes without taking (a range its own
            # batch fetched while read-ahead's request for it was in flight).
            while self._live(generation):
                with self._lock:
                    if not self._owners:
                        break
                    if self._owners[0][0] <= position() - self.step or position() >= count:
                        store.drop(self._owners.popleft()[1])
                        continue
                threading.Event().wait(0.05)
