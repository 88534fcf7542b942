"""Byte ranges of remote files: coalesced reads, fetched across a batch's files at once.

Random access reads a few byte ranges per file per batch. Ranges that touch or nearly
touch are merged and all fetched in one ``cat_ranges`` call (requests in flight
together, latency paid once). How near is near depends on the store (:func:`coalescing`): one
that answers several ranges in one request (an HTTP file server) gets them so, and
nearby ranges merged across a hole only on stores that answer one range per request
(S3, GCS, servers without multi-range support), where a request costs ~150 us of CPU.

A batch that touches many remote files is fetched across all of them at once
(:func:`fetch_batch`: up to ``max_inflight`` requests in flight in the process) into
this process's :class:`RangeStore`, where the readers' own :func:`fetch_ranges` calls
then find their bytes; read-ahead puts the ranges of batches still to come there too,
within a byte budget.

Example:
    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe("/r/f", b"0123456789")
    >>> [bytes(b) for b in fetch_ranges(fs, "/r/f", [(6, 8), (0, 2)])]
    [b'67', b'01']
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem

from torchgrain.errors import CorruptDataError
from torchgrain.io import inflight, process, remote
from torchgrain.io.paths import is_http
from torchgrain.io.responses import pinned
from torchgrain.io.retry import (
    http_status,
    is_transient,
    permanent_error,
    remaining_seconds,
    wait_seconds,
)

__all__ = [
    "RangeStore",
    "coalesce",
    "coalescing",
    "fetch_batch",
    "fetch_ranges",
    "range_store",
    "version_of",
]

#: Ranges closer than this are fetched as one request (the bytes between come along).
DEFAULT_GAP = 1 << 16
#: The most bytes one coalesced request asks for: a larger merge would fetch far more
#: than asked for, in one request that cannot overlap with others.
MAX_REQUEST = 4 << 20

#: A batch's ranges of one file closer than this are fetched as one request from a store
#: that answers one range per request (as Arrow's read coalescing does: its
#: ``CacheOptions.hole_size_limit``). A request costs the client ~150 us of CPU and the
#: store a round trip; a hole of this size costs ~1 us of CPU per KiB and its transfer.
#: Measured on global shuffles of 1 KiB records (benchmarks/remote_global.py and
#: remote_global_s3.py, docs/object-storage.md).
SINGLE_RANGE_GAP = 64 << 10
#: The most bytes such a merged request asks for (Arrow's ``range_size_limit``): far-apart
#: ranges are never merged into a large read of bytes nobody asked for.
SINGLE_RANGE_MAX = 256 << 10


def coalescing(
    fs: fsspec.AbstractFileSystem, path: str, gap: int, *, multi_range: bool = True
) -> tuple[int, int]:
    """``(gap, max_request)`` for a batch's ranges of ``path`` on ``fs``: ``gap`` (and
    :data:`MAX_REQUEST`) where they travel together anyway (with ``multi_range``, an
    ``http(s)://`` server not known to answer multi-range requests otherwise; local and
    in-memory files), else :data:`SINGLE_RANGE_GAP` and :data:`SINGLE_RANGE_MAX`: an object
    store (``s3://``, ``gs://``...), or an HTTP server that answered a multi-range request
    with the whole file or one range (:func:`torchgrain.io.inflight.multirange_servers`:
    from the next batch on, in each process).

    Example:
        >>> import fsspec
        >>> coalescing(fsspec.filesystem("memory"), "/x", 4096)
        (4096, 4194304)
    """
    if not isinstance(fs, AsyncFileSystem):
        return gap, MAX_REQUEST  # no requests: nothing to save
    if (
        multi_range
        and is_http(fs)
        and inflight.multirange_servers(fs).get(inflight._origin(path), True)
    ):
        return gap, MAX_REQUEST
    return max(gap, SINGLE_RANGE_GAP), SINGLE_RANGE_MAX


def coalesce(
    ranges: Sequence[tuple[int, int]], gap: int = DEFAULT_GAP, max_request: int = MAX_REQUEST
) -> tuple[list[int], list[list[int]]]:
    """``(order, merged)``: the ranges' indices sorted by start, and ``[start, end]``
    requests covering them, neighbours closer than ``gap`` merged (a merge stops
    growing at ``max_request`` bytes).

    Example:
        >>> coalesce([(10, 20), (0, 4), (30, 40)], gap=4)
        ([1, 0, 2], [[0, 4], [10, 20], [30, 40]])
        >>> coalesce([(10, 20), (0, 4), (22, 40)], gap=4)[1]
        [[0, 4], [10, 40]]
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    merged: list[list[int]] = []
    for i in order:
        s, e = ranges[i]
        if (
            merged
            and s <= merged[-1][1] + gap
            and (e <= merged[-1][1] or e - merged[-1][0] <= max_request)
        ):
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return order, merged


def _slices(
    ranges: Sequence[tuple[int, int]],
    order: list[int],
    merged: list[list[int]],
    blobs: list,
    *,
    own: bool = False,
) -> list[memoryview]:
    """The bytes of each range, cut from the blobs fetched for the ``merged`` requests.
    ``own``: a range cut from a blob holding bytes no range asked for is copied out, so
    that a range kept (in the :class:`RangeStore`) does not keep its request's hole alive
    (a 1 KiB range would hold up to :data:`SINGLE_RANGE_MAX` bytes)."""
    out: list[memoryview] = [memoryview(b"")] * len(ranges)
    at = [0] * len(ranges)
    used = [0] * len(merged)
    j = 0
    for i in order:
        s, e = ranges[i]
        while not (merged[j][0] <= s and e <= merged[j][1]):
            j += 1
        at[i] = j
        used[j] += e - s
        # Read-only: a body read into a bytearray is still no one's to write.
        out[i] = memoryview(blobs[j]).toreadonly()[s - merged[j][0] : e - merged[j][0]]
    if own:
        # A blob that is a view of a larger body (one part of a multi-range answer)
        # keeps that whole body alive too.
        held = [_held(b) for b in blobs]
        for i in order:
            m = merged[at[i]]
            if used[at[i]] < m[1] - m[0] or held[at[i]] > m[1] - m[0]:
                out[i] = memoryview(bytes(out[i]))
    return out


def _held(blob: Any) -> int:
    """The bytes a blob keeps alive: a view keeps its whole underlying buffer."""
    view = memoryview(blob)
    return view.nbytes if view.obj is None else memoryview(view.obj).nbytes


class RangeStore:
    """Byte ranges of remote files fetched before their reader asks for them, per process.

    Keyed by ``(url, start, end)``: a reader's :func:`fetch_ranges` takes the ranges it
    finds here (each is served once, then dropped) and fetches only the rest. What a
    batch's own reads need is always put (:meth:`put`, they are needed now); read-ahead
    puts only while the store holds less than ``max_bytes`` (:meth:`room`), and
    :meth:`drop` forgets what a cancelled read-ahead put.

    Example:
        >>> store = RangeStore(max_bytes=100)
        >>> store.put("u", [(0, 3)], [memoryview(b"abc")], owner=1)
        >>> store.nbytes, store.take("u", [(0, 3), (5, 6)])
        (3, [<memory at 0x...>, None])
        >>> store.nbytes
        0
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        # (url, start, end) -> (its bytes, who put them, the version they are of)
        self._ranges: dict[tuple[str, int, int], tuple[memoryview, object, object]] = {}
        # Ranges being fetched now -> set when their fetch ends (whether or not it worked).
        self._pending: dict[tuple[str, int, int], threading.Event] = {}
        self.nbytes = 0
        self.stats = {"served": 0, "put": 0, "dropped": 0}

    def room(self) -> int:
        """Bytes read-ahead may still put."""
        return self.max_bytes - self.nbytes

    def put(
        self,
        url: str,
        ranges: Sequence[tuple[int, int]],
        views: Sequence[memoryview],
        owner: object,
        version: object = None,
    ) -> None:
        """Store ``views``, the bytes of ``ranges`` of ``url`` of ``version`` (this
        process's pin of the file when they were asked for: :func:`version_of`)."""
        with self._lock:
            for (s, e), v in zip(ranges, views):
                key = (url, s, e)
                if key not in self._ranges:
                    self._ranges[key] = (v, owner, version)
                    self.nbytes += e - s
                    self.stats["put"] += 1

    def claim(
        self, url: str, ranges: Sequence[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[threading.Event]]:
        """``(mine, others)``: of ``ranges`` neither stored nor being fetched, those the
        caller now fetches (release them with :meth:`release`), and the events of those
        another fetch (read-ahead's) is bringing: a range is never asked for twice."""
        mine, others = [], []
        with self._lock:
            for s, e in ranges:
                key = (url, s, e)
                if key in self._ranges:
                    continue
                event = self._pending.get(key)
                if event is None:
                    self._pending[key] = threading.Event()
                    mine.append((s, e))
                else:
                    others.append(event)
        return mine, others

    def release(self, url: str, ranges: Sequence[tuple[int, int]]) -> None:
        """End a :meth:`claim` (its fetch arrived or failed): wake who waits for it."""
        with self._lock:
            events = [self._pending.pop((url, s, e), None) for s, e in ranges]
        for event in events:
            if event is not None:
                event.set()

    def take(
        self, url: str, ranges: Sequence[tuple[int, int]], version: object = None
    ) -> list[memoryview | None]:
        """The stored bytes of each range of ``version`` of ``url`` (removed from the
        store), None where absent; bytes of another version (the file was opened again
        since, re-uploaded: they were fetched before) are dropped, never served."""
        out: list[memoryview | None] = []
        with self._lock:
            for s, e in ranges:
                got = self._ranges.pop((url, s, e), None)
                if got is not None:
                    self.nbytes -= e - s
                    if got[2] is not version:
                        self.stats["dropped"] += 1
                        got = None
                    else:
                        self.stats["served"] += 1
                out.append(None if got is None else got[0])
        return out

    def drop(self, owner: object) -> None:
        """Forget every range ``owner`` put (a cancelled read-ahead's)."""
        with self._lock:
            gone = [k for k, (_, o, _) in self._ranges.items() if o is owner]
            for k in gone:
                del self._ranges[k]
                self.nbytes -= k[2] - k[1]
            self.stats["dropped"] += len(gone)


_STORE: tuple[tuple[int, int], RangeStore] | None = None
_STORE_LOCK = threading.Lock()


def range_store() -> RangeStore:
    """This process's :class:`RangeStore` (a forked child starts with an empty one).

    Example:
        >>> range_store() is range_store()
        True
    """
    global _STORE
    token = process.token()
    with _STORE_LOCK:
        if _STORE is None or _STORE[0] != token:
            _STORE = (token, RangeStore())
        return _STORE[1]


def _raise_failure(blob: BaseException, label: str, s: int, e: int) -> None:
    """Raise a failed request's error: as it is when it is retried (transient), as
    :class:`~torchgrain.DatasetNotFoundError` or ``PermissionError`` naming the file when
    it is missing or denied, as it is for another HTTP status, else as corrupt data."""
    # (a 400 to a range read: some stores' answer to bytes past the end, as 416)
    skip = is_transient(blob) or http_status(blob) == 400
    clearer = None if skip else permanent_error(blob, label, f"reading bytes {s}-{e}")
    if clearer is not None:
        raise clearer from blob
    if is_transient(blob) or isinstance(
        blob, (FileNotFoundError, PermissionError, CorruptDataError)
    ):
        raise blob
    raise remote.refused(blob, label, s, e) from blob


def fetch_batch(
    fs: fsspec.AbstractFileSystem,
    files: Sequence[tuple[str, str, Sequence[tuple[int, int]]]],
    *,
    store: RangeStore,
    owner: object,
    gap: int = DEFAULT_GAP,
    max_inflight: int = 64,
    multi_range: bool = True,
    raise_errors: bool = True,
    wait_for_others: bool = True,
    ready: Callable[[int], None] | None = None,
) -> int:
    """Fetch the byte ranges of many files of ``fs`` together into ``store``.

    ``files`` holds ``(path, url, ranges)``; ranges already in the store are skipped,
    those another fetch is bringing waited for (:meth:`RangeStore.claim`), the others
    coalesced per file (see :func:`coalesce`; ``gap`` where the store takes several ranges
    in one request, else the store's own: :func:`coalescing`) and requested with at most
    ``max_inflight`` in flight (:func:`~torchgrain.io.inflight.cat_many`; ``multi_range``:
    several ranges of a file in one request where the server answers so). What arrived is
    put in the store even when other requests failed (a retry asks only for the rest).
    ``ready(k)``, when given, is called (on the calling thread, while other requests may
    still be in flight) once every range of ``files[k]`` is in the store; a file some of
    whose ranges failed or came from another fetch is not told. Returns the number of
    requests made.

    Raises (with ``raise_errors``, else failures are left to the readers):
        RequestTimeout / ResponseSizeError: a transient failure (retried by the
            operation in progress), naming the URL and the range.
        FileNotFoundError, PermissionError, CorruptDataError: as their reads would.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/fb/a", b"0123456789"); fs.pipe("/fb/b", b"abcdef")
        >>> store = RangeStore()
        >>> fetch_batch(fs, [("/fb/a", "memory://fb/a", [(0, 2), (4, 6)]),
        ...                  ("/fb/b", "memory://fb/b", [(1, 3)])], store=store, owner=None)
        2
        >>> [bytes(v) for v in store.take("memory://fb/a", [(4, 6), (0, 2)])]
        [b'45', b'01']
    """
    told: set[int] = set()
    waited: set[int] = set()

    def tell(k: int) -> None:
        if ready is not None and k not in waited:
            told.add(k)
            ready(k)

    def fetch(todo: Sequence[int]) -> tuple[int, list[threading.Event]]:
        """Fetch what the store lacks of ``files[k]`` for each ``k`` in ``todo``: the number
        of requests made, and the events of the ranges another fetch is bringing."""
        waited.clear()
        claimed: list[tuple[int, str, list[tuple[int, int]]]] = []
        waits: list[threading.Event] = []
        try:
            for k in todo:
                _path, url, ranges = files[k]
                want = [
                    r for r in dict.fromkeys((int(s), int(e)) for s, e in ranges) if r[0] < r[1]
                ]
                mine, others = store.claim(url, want)
                claimed.append((k, url, mine))
                waits.extend(others)
                if others:
                    waited.add(k)
            return request(claimed), waits
        finally:
            for _k, url, mine in claimed:
                store.release(url, mine)

    def request(claimed: list[tuple[int, str, list[tuple[int, int]]]]) -> int:
        """Fetch the ``claimed`` ranges; tell each file's reader once it is all stored."""
        asked: list[tuple[str, str, int, int]] = []  # each request's (path, url, start, end)
        plans = []
        plan_of: list[int] = []  # each request's plan
        left: list[int] = []  # each plan's requests not answered yet
        for k, url, need in claimed:
            path = files[k][0]
            if not need:
                tell(k)  # all in the store already (or being brought by another fetch)
                continue
            order, merged = coalesce(need, *coalescing(fs, path, gap, multi_range=multi_range))
            plan_of.extend([len(plans)] * len(merged))
            left.append(len(merged))
            plans.append((k, url, need, order, merged, len(asked), version_of(fs, path)))
            asked += [(path, url, s, e) for s, e in merged]
        if not asked:
            return 0
        paths, urls, starts, ends = map(list, zip(*asked))
        failure: list[tuple[BaseException, str, int, int]] = []

        def settle(plan: tuple, results: list) -> bool:
            """Put what arrived of one file's requests in the store; True if all of it did."""
            k, url, need, order, merged, at, before = plan
            got = results[at : at + len(merged)]
            ok = [j for j, b in enumerate(got) if not isinstance(b, BaseException)]
            bad = len(ok) < len(merged)
            if bad and not failure:
                j = next(j for j, b in enumerate(got) if isinstance(b, BaseException))
                failure.append((got[j], url, *merged[j]))
            if not ok:
                return False
            if bad:  # keep the ranges whose request arrived
                fine = [merged[j] for j in ok]
                order = [
                    i for i in order if any(m[0] <= need[i][0] and need[i][1] <= m[1] for m in fine)
                ]
            version = version_of(fs, files[k][0])
            if before is not None and version is not before:
                return False  # (opened again meanwhile, re-uploaded: its reader fetches)
            views = _slices(need, order, [merged[j] for j in ok], [got[j] for j in ok], own=True)
            store.put(url, [need[i] for i in order], [views[i] for i in order], owner, version)
            return not bad

        # Each file is put in the store, and its reader told, as soon as its last request is
        # answered: the reader decodes it while the other files' requests are in flight.
        got_so_far: list = [None] * len(starts)

        def arrived(idx: list[int], blobs: list) -> None:
            for i, blob in zip(idx, blobs):
                got_so_far[i] = blob
                n = plan_of[i]
                left[n] -= 1
                if left[n] == 0 and settle(plans[n], got_so_far):
                    tell(plans[n][0])

        blobs = inflight.cat_many(
            fs,
            paths,
            starts,
            ends,
            urls=urls,
            max_inflight=max_inflight,
            multi_range=multi_range,
            arrived=arrived,
        )
        for n, plan in enumerate(plans):
            if left[n] > 0:  # (a request timed out: never arrived)
                settle(plan, blobs)
        if failure and raise_errors:
            _raise_failure(*failure[0])
        return len(starts)

    made, waits = fetch(range(len(files)))
    if waits and wait_for_others:
        # Ranges another fetch (read-ahead) was bringing: wait for it to end, then fetch
        # whatever it did not bring (it failed, or was cancelled and dropped them), once:
        # what is still missing then, its reader fetches.
        for event in waits:
            event.wait(wait_seconds(remaining_seconds(0)[0]))
        made += fetch([k for k in range(len(files)) if k not in told])[0]  # told: read already
    return made


def version_of(fs: fsspec.AbstractFileSystem, path: str) -> object:
    """This process's pin of remote file ``path`` (of ``fs``) now: the version its range
    answers are checked against, an object that a later opening which pins the file anew
    (re-uploaded since) replaces. None for a local or in-memory file, or one not pinned.

    Example:
        >>> version_of(fsspec.filesystem("memory"), "/c/p") is None
        True
    """
    return pinned(path) if isinstance(fs, AsyncFileSystem) else None


def fetch_ranges(
    fs: fsspec.AbstractFileSystem,
    path: str,
    ranges: Sequence[tuple[int, int]],
    *,
    gap: int = DEFAULT_GAP,
    name: str | None = None,
) -> list[memoryview]:
    """Bytes ``[start, end)`` of ``path`` for each range, in the order given.

    Raises:
        FileNotFoundError: the file does not exist (its name in the message).
        CorruptDataError: the file is shorter than a range.
        Exception: what a failed request raised (transient ones are retried by the
            operation in progress: :func:`~torchgrain.io.retry.retry_call`).
    """
    label = name or path
    store = range_store()
    if store.nbytes:
        # Fetched ahead by this batch's fetch_batch, or by read-ahead.
        have = store.take(label, ranges, version_of(fs, path))
        if any(v is not None for v in have):
            missing = [r for r, v in zip(ranges, have) if v is None]
            rest = iter(fetch_ranges(fs, path, missing, gap=gap, name=name) if missing else [])
            return [v if v is not None else next(rest) for v in have]
    order, merged = coalesce(ranges, gap)
    try:
        # Each response is checked to hold exactly the bytes asked for, and the request
        # has a deadline (torchgrain.io.remote).
        blobs = remote.cat_ranges(
            fs, path, [m[0] for m in merged], [m[1] for m in merged], url=label
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{label} does not exist") from e
    return _slices(ranges, order, merged, blobs)
