"""A remote batch's byte ranges, fetched across its shards at once.

:class:`BatchRanges` is a helper a :class:`~torchgrain.sources.base.ShardedSource` holds
(``src.ranges``). Per batch, without a shard cache,
:meth:`BatchRanges.prefetch` fetches the byte ranges of all the batch's shards at once,
with up to ``max_inflight`` requests in flight, into this process's range store, where
the batch's reads find them; the pass's range read-ahead
(:class:`~torchgrain.io.readahead.RangeReadAhead`) fetches its steps through it too.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import fsspec
import numpy as np

from torchgrain.errors import DatasetNotFoundError, RemoteIOError
from torchgrain.io.ranges import fetch_batch, range_store
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.sources.options import ReadOptions

__all__ = ["BATCH_GAP", "BatchRanges", "IOState"]

T = TypeVar("T")

#: Ranges of a remote batch closer than this are fetched as one request. Small: with
#: many requests in flight, latency is paid once per batch either way, and a larger gap
#: fetches bytes nobody asked for (a 64 KiB gap between 1 KiB records of a global
#: shuffle would fetch ~30x what is delivered).
BATCH_GAP = 4 << 10

#: A batch's ``(shard, rows, positions)`` groups, and the ``(path, url, ranges)`` per
#: shard its reads will fetch.
Groups = Sequence[tuple[int, np.ndarray, Any]]
Files = list[tuple[str, str, list[tuple[int, int]]]]


class IOState(Protocol):
    """What :class:`BatchRanges` uses of a source's per-process state."""

    lock: threading.Lock
    io: dict[str, int]  # the counters: "remote_reads", "retries"
    fs: fsspec.AbstractFileSystem  # the source's filesystem, made for this process
    range_ahead: Any  # the pass's RangeReadAhead, or None


@dataclasses.dataclass(eq=False)
class BatchRanges:
    """Fetches a remote batch's byte ranges at once: ``plan(groups)`` gives the ranges a
    batch's reads will fetch (None where the format cannot plan them), ``state()`` this
    process's :class:`IOState`, ``remote()`` whether reads go over the network now (no
    local copies); ``options`` say how (``max_inflight``, ``io_threads``,
    ``multi_range``), ``retry`` the policy of its requests.

    Example:
        >>> fetch = BatchRanges(lambda groups: None, None, lambda: False, ReadOptions(), None)
        >>> fetch.prefetch([(0, np.arange(2), None)]) is None  # local: each read reads its own
        True
    """

    plan: Callable[[Groups], Files | None]
    state: Callable[[], IOState]
    remote: Callable[[], bool]
    options: ReadOptions
    retry: RetryPolicy

    def prefetch(
        self,
        groups: Groups,
        *,
        owner: object | None = None,
        lenient: bool = False,
        planned: list[int] | None = None,
        read: Callable[[int], object] | None = None,
        early: dict[int, object] | None = None,
    ) -> object | None:
        """Fetch a remote batch's byte ranges (``plan``) across all its shards at once,
        with up to ``max_inflight`` requests in flight, into this process's range store,
        where the batch's reads find them. Returns the owner token of what it put
        (release it with :meth:`release`), or None when the batch is read shard by shard.

        Transient failures are retried per the source's policy (only the ranges still
        missing are asked again); a batch that outlasts it raises
        :class:`~torchgrain.RemoteIOError` naming the URL. Other failures (a missing or
        truncated shard) are left to the shard's own read, which names the shard and
        the record index. With ``lenient`` (read-ahead), every failure is. ``planned``,
        when given, gets the bytes the batch's ranges hold appended (read-ahead sizes its
        steps by it).

        ``read(k)`` and ``early``: the batch's group ``k`` read (and decoded) as soon as
        all its ranges are in the store, while the other groups' requests are still in
        flight, its result (or the exception it raised) put in ``early[k]``; the caller
        reads the other groups afterwards, and raises a group's exception in the order it
        would have met it. Same bytes, same checks: only sooner."""
        if not self.remote() or not groups:
            return None
        files = self.plan(groups)
        if not files:
            return None
        if planned is not None:
            planned.append(_nbytes(files))
        if len(files) != len(groups):
            read = None  # (one entry per group, as plan gives them)
        if owner is None:  # a batch read here: the pass's range read-ahead may start
            owner = object()
            ahead = self.state().range_ahead
            if ahead is not None and ahead.pending:
                # This batch's bytes per record size the walk's first steps.
                ahead.kick(per_record=_nbytes(files) / max(1, sum(len(g[1]) for g in groups)))
        store, opts = range_store(), self.options
        asked = [f[1] for f in files]  # the files of the last attempt, named if it fails

        def label() -> str:
            return asked[0] if len(asked) == 1 else f"{asked[0]} and {len(asked) - 1} more"

        def ready(k: int) -> None:
            if read is None or early is None or k in early:
                return
            try:
                early[k] = read(k)
            except Exception as e:  # raised by the caller in the group's turn
                early[k] = e

        def fetch() -> None:
            count_io(self.state(), "remote_reads")
            # A retry asks only for the groups not read yet (their ranges were taken).
            left = [k for k in range(len(files)) if early is None or k not in early]
            asked[:] = [files[k][1] for k in left] or asked
            fetch_batch(
                self.state().fs,
                [files[k] for k in left],
                store=store,
                owner=owner,
                gap=BATCH_GAP,
                # io_threads=1 keeps its meaning: remote reads one at a time.
                max_inflight=opts.max_inflight if opts.io_threads > 1 else 1,
                multi_range=opts.multi_range,
                ready=None if read is None else (lambda j: ready(left[j])),
            )

        try:
            retry_call(
                fetch,
                url=label,
                policy=self.retry,
                what="range read of a batch",
                on_retry=lambda attempt, exc: count_io(self.state(), "retries"),
            )
        except (RemoteIOError, DatasetNotFoundError, PermissionError):
            # Out of retries, or missing or denied (never asked again): named the URL.
            store.drop(owner)
            if lenient:
                return None
            raise
        except Exception:
            if lenient:
                store.drop(owner)
                return None
            # Corrupt or truncated: the shard's own read meets it again and names the
            # shard and the record index.
        return owner

    @staticmethod
    def release(owner: object | None) -> None:
        """Forget what :meth:`prefetch` put and the batch did not use."""
        if owner is not None:
            range_store().drop(owner)


def count_io(state: IOState, key: str) -> None:
    """Add one to ``state``'s I/O counter ``key`` ("remote_reads", "retries")."""
    with state.lock:
        state.io[key] += 1


def take_early(early: dict[int, Any], k: int, read: Callable[[Any], T], group: Any) -> T:
    """Group ``k``'s result as :meth:`BatchRanges.prefetch` read it early, its error
    raised now, in the group's turn; else ``read(group)`` now.

    Example:
        >>> early = {0: ["early"], 1: ValueError("bad")}
        >>> take_early(early, 0, lambda g: ["now"], None), take_early(early, 2, len, "ab")
        (['early'], 2)
        >>> take_early(early, 1, len, "ab")
        Traceback (most recent call last):
        ...
        ValueError: bad
    """
    if k not in early:
        return read(group)
    got = early.pop(k)
    if isinstance(got, BaseException):
        raise got
    return got


def _nbytes(files: Files) -> int:
    """The bytes the ranges of a batch's ``plan`` hold."""
    return sum(int(e) - int(s) for _, _, ranges in files for s, e in ranges)
