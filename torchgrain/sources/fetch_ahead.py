"""What a sharded source fetches ahead of its reads.

Part of :class:`~torchgrain.sources.base.ShardedSource` (a base class of it, not an API of
its own). At the start of a pass, :meth:`FetchAhead.read_ahead` checks that the pass fits
the source's caches, then starts the background walk that suits the storage: the shards
ahead downloaded into the shard cache (:class:`~torchgrain.io.readahead.ShardReadAhead`),
or, without one, the byte ranges of the records ahead fetched into this process's range
store (:class:`~torchgrain.io.readahead.RangeReadAhead`). Per batch, without a shard
cache, :meth:`FetchAhead._prefetch_ranges` fetches the byte ranges of all the batch's
shards at once, with up to ``max_inflight`` requests in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from torchgrain.errors import DatasetNotFoundError, RemoteIOError
from torchgrain.io.ranges import fetch_batch, range_store
from torchgrain.io.retry import retry_call
from torchgrain.sources.block_cache import CacheFit

__all__ = ["BATCH_GAP", "FetchAhead"]

#: Ranges of a remote batch closer than this are fetched as one request. Small: with
#: many requests in flight, latency is paid once per batch either way, and a larger gap
#: fetches bytes nobody asked for (a 64 KiB gap between 1 KiB records of a global
#: shuffle would fetch ~30x what is delivered).
BATCH_GAP = 4 << 10


class FetchAhead:
    """The read-ahead of :class:`~torchgrain.sources.base.ShardedSource`: a pass's
    shards or records ahead, and a remote batch's byte ranges across its shards."""

    def read_ahead(
        self,
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> list[CacheFit]:
        """Prepare for a sampler's pass: ``order(a, b)`` are the indices at positions
        ``[a, b)``, the pass reads from ``start`` on (``count`` more), ``position()``
        is how far it got. Samplers call this at the start of each pass.

        First, whether the pass fits this source's caches (:meth:`check_cache_fit`):
        one that does not is reported once per source and process with a
        :class:`~torchgrain.CacheThrashWarning`, and every check is returned (the
        :class:`~torchgrain.Dataset` keeps them for :func:`tg.stats <torchgrain.stats>`).

        Then, on remote storage with a shard cache, the shards the pass will read are
        downloaded in the background ahead of ``position()`` (see
        :mod:`torchgrain.io.readahead`); nothing with ``read_ahead_bytes=0``. A new
        call cancels the previous walk.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> src = tg.ArrayRecordSource(d)  # local files: nothing to read ahead
            >>> src.read_ahead(lambda a, b: list(range(a, b)), 0, len(src), lambda: 0)
            []
            >>> src.read_ahead_bytes
            0
        """
        fits = self.check_cache_fit(order, start, count) if order is not None else []
        if self._reads_remote:
            self._range_read_ahead(order, start, count, position)
            return fits
        if self.cache is None or not self._remote or self.read_ahead_bytes <= 0:
            return fits
        from torchgrain.io.readahead import ShardReadAhead

        st = self._proc()
        with st.lock:
            if st.read_ahead is None:
                st.read_ahead = ShardReadAhead(self, self.read_ahead_bytes, threads=self.io_threads)
            ra = st.read_ahead
        ra.begin(order, start, count, position)
        return fits

    def _range_read_ahead(
        self,
        order: Callable[[int, int], np.ndarray] | None,
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> None:
        """Without a shard cache: fetch the byte ranges of the records ahead of
        ``position()`` into this process's range store while the loader decodes (see
        :class:`~torchgrain.io.readahead.RangeReadAhead`), where this process reads the
        batches (no DataLoader workers: the walk starts at this process's first batch
        read). A new pass cancels the old one's."""
        from torchgrain.io.readahead import RangeReadAhead

        st = self._proc()
        with st.lock:
            ra = st.range_ahead
            if ra is None and order is not None and self.max_inflight > 1:
                ra = st.range_ahead = RangeReadAhead(self)
        if ra is None:
            return
        if order is None or count <= start:
            ra.cancel()
            return
        ra.begin(order, start, count, position)  # walked once this process reads a batch

    def _batch_ranges(
        self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]]
    ) -> list[tuple[str, str, list[tuple[int, int]]]] | None:
        """``(path, url, ranges)`` per shard of a batch's ``(shard, rows, positions)``
        groups: the byte ranges its reads will fetch, or None where the format cannot
        plan them (its reads then fetch their own, one shard at a time)."""
        return None

    def _prefetch_ranges(
        self,
        groups: Sequence[tuple[int, np.ndarray, np.ndarray]],
        *,
        owner: object | None = None,
        lenient: bool = False,
        planned: list[int] | None = None,
        read: Callable[[int], object] | None = None,
        early: dict[int, object] | None = None,
    ) -> object | None:
        """Fetch a remote batch's byte ranges (:meth:`_batch_ranges`) across all its
        shards at once, with up to ``max_inflight`` requests in flight, into this
        process's range store, where the batch's reads find them. Returns the owner
        token of what it put (release it with :meth:`_release_ranges`), or None when
        the batch is read shard by shard.

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
        if not self._reads_remote or not groups:
            return None
        files = self._batch_ranges(groups)
        if not files:
            return None
        if planned is not None:
            planned.append(_nbytes(files))
        if len(files) != len(groups):
            read = None  # (one entry per group, as _batch_ranges gives them)
        if owner is None:  # a batch read here: the pass's range read-ahead may start
            owner = object()
            ahead = self._proc().range_ahead
            if ahead is not None and ahead.pending:
                # This batch's bytes per record size the walk's first steps.
                ahead.kick(per_record=_nbytes(files) / max(1, sum(len(g[1]) for g in groups)))
        store = range_store()
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
            with self._proc().lock:
                self._proc().io["remote_reads"] += 1
            # A retry asks only for the groups not read yet (their ranges were taken).
            left = [k for k in range(len(files)) if early is None or k not in early]
            asked[:] = [files[k][1] for k in left] or asked
            fetch_batch(
                self._fs,
                [files[k] for k in left],
                store=store,
                owner=owner,
                gap=BATCH_GAP,
                # io_threads=1 keeps its meaning: remote reads one at a time.
                max_inflight=self.max_inflight if self.io_threads > 1 else 1,
                multi_range=self.multi_range,
                ready=None if read is None else (lambda j: ready(left[j])),
            )

        try:
            retry_call(
                fetch,
                url=label,
                policy=self._retry,
                what="range read of a batch",
                on_retry=self._count_retry,
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
    def _release_ranges(owner: object | None) -> None:
        """Forget what :meth:`_prefetch_ranges` put and the batch did not use."""
        if owner is not None:
            range_store().drop(owner)


def _nbytes(files: Sequence[tuple[str, str, Sequence[tuple[int, int]]]]) -> int:
    """The bytes the ranges of :meth:`FetchAhead._batch_ranges` hold."""
    return sum(int(e) - int(s) for _, _, ranges in files for s, e in ranges)
