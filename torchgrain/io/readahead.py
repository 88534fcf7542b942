"""Read-ahead of remote shards into the shard cache, in the order a sampler will need them.

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from torchgrain.io import process

__all__ = ["ShardReadAhead"]

# Order positions scanned per step of the walk (one vectorised call of the sampler).
_SCAN = 8192
# Longest a fork waits for the walk's downloads in flight to finish.
_FORK_JOIN_SECONDS = 60.0
_FORK_RESTART_DELAY = 0.2


class ShardReadAhead:
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
        self._generation = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
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
        thread = threading.Thread(
            target=self._walk,
            args=(generation, wake, delay, order, start, count, position),
            name="torchgrain-read-ahead",
            daemon=True,
        )
        self._thread = thread
        thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the current walk to finish (its downloads included); whether it did."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

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

    def _live(self, generation: int) -> bool:
        return self._generation == generation

    def _walk(self, generation: int, wake: threading.Event, delay: float, *args: Any) -> None:
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
        seen = np.zeros(n, dtype=bool)
        # Positions of each shard's first and (latest scanned) last use, and its size once
        # known: the shards in use now must stay cached beside those fetched ahead.
        first_use = np.full(n, -1, dtype=np.int64)
        last_use = np.full(n, -1, dtype=np.int64)
        sizes = np.zeros(n, dtype=np.int64)
        capacity = src.cache.max_bytes if src.cache is not None else None
        pending: collections.deque[tuple[int, int]] = collections.deque()  # (first use, shard)
        ahead: collections.deque[tuple[int, int]] = collections.deque()  # (first use, bytes)
        in_flight: list[Future[Any]] = []
        scan = start
        with ThreadPoolExecutor(self.threads, thread_name_prefix="torchgrain-read-ahead") as pool:
            while self._live(generation):
                while len(pending) < 2 * self.threads and scan < count and not seen.all():
                    stop = min(scan + _SCAN, count)
                    shards = src.index.locate(np.asarray(order(scan, stop)))[0]
                    uniq, back = np.unique(shards[::-1], return_index=True)
                    last_use[uniq] = scan + len(shards) - 1 - back
                    first = np.unique(shards, return_index=True)[1]
                    for k in np.sort(first).tolist():
                        s = int(shards[k])
                        if not seen[s]:
                            seen[s] = True
                            first_use[s] = scan + k
                            pending.append((scan + k, s))
                    scan = stop
                in_flight = [f for f in in_flight if not f.done()]
                if not pending:
                    break
                reached = position()
                while ahead and ahead[0][0] < reached:
                    ahead.popleft()  # in use now: no longer ahead
                use, shard = pending[0]
                if sizes[shard] == 0:
                    sizes[shard] = src.shard_nbytes(shard)
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
                    self._wait(generation, 0.02)
                    continue
                pending.popleft()
                ahead.append((use, size))
                in_flight.append(pool.submit(self._fetch, generation, shard))
            for f in in_flight:
                if not self._live(generation):
                    f.cancel()

    def _wait(self, generation: int, seconds: float) -> None:
        threading.Event().wait(seconds)

    def _fetch(self, generation: int, shard: int) -> None:
        if not self._live(generation):
            return
        with contextlib.suppress(Exception):  # the read that needs it reports errors
            if self.source.prefetch_shard(shard):
                with self._lock:  # several downloads end at once
                    self.fetched += 1
