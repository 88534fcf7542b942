"""Many range requests in flight at once, over one event loop: a batch's byte ranges.

:func:`cat_many` fetches the byte ranges of many files of one filesystem with at most
``max_inflight`` requests in flight per process, each keeping the deadline and response
checks of :mod:`torchgrain.io.remote` (its failure is returned in its place, so a caller
keeps what arrived and asks again for the rest). :mod:`torchgrain.io.ranges` builds a
batch-wide fetch on it.

Over ``http(s)://`` the ranges of one file go out together, up to
:data:`~torchgrain.io.byteranges.MAX_RANGES` in one request (``multipart/byteranges``,
read strictly by :mod:`torchgrain.io.byteranges`): nginx, Apache and other file servers
answer so, and a request costs the client far more CPU than a 1 KiB range does. A server
that answers a multi-range request otherwise (the whole file, too few ranges, a malformed
body) has those ranges asked one per request, and is asked so from then on (per
filesystem and origin; until a server has answered one, its first multi-range request
goes first and the others wait for its headers, a fraction of a second at most); so is one that refuses it with an
error status (403, 416, 501...) or drops it twice in a row, while the same ranges asked
alone are served. A missing file, a busy server (429, 5xx) or a timeout is returned for
every range, as one range's request would be, and retried by the operation. See
:func:`_limited_ranges`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import queue
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.exceptions import FSTimeoutError

from torchgrain.io import remote
from torchgrain.io.byteranges import (
    MAX_RANGES,
    MultipartError,
    boundary_of,
    merge_ranges,
    parse_byteranges,
    range_header,
    response_limit,
    single_part,
    slice_parts,
)
from torchgrain.io.paths import is_http
from torchgrain.io.remote import (
    cat_file,
    check_length,
    redirect_refusal,
    remaining_seconds,
    request_done,
)
from torchgrain.io.responses import (
    RangeAnswerError,
    ResponseSizeError,
    check_file_answer,
    content_range,
    ranged_get,
    read_capped,
    request_coroutine,
    socket_pieces,
)
from torchgrain.io.retry import RequestTimeout, is_transient_status, wait_seconds

__all__ = ["cat_many", "multirange_servers"]


#: Semaphores bounding the requests in flight on one event loop: ``{loop: {limit: sem}}``.
_LIMITS: weakref.WeakKeyDictionary[Any, dict[int, asyncio.Semaphore]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)
class _Servers:
    """What one filesystem object has learnt of the servers it asked for several ranges
    at once, per origin: ``answers`` (True: it answers them so; False: it does not, and
    is asked one range per request), ``strikes`` (against it, while the same ranges asked
    alone were served: 1 per multi-range request in a row whose connection dropped, 2 for
    one refused with an error status; at 2 it answers False) and ``asking``
    (the loop and the event of the first multi-range request, set once it is answered:
    see :func:`_first_asked`)."""

    answers: dict[str, bool] = dataclasses.field(default_factory=dict)
    strikes: dict[str, int] = dataclasses.field(default_factory=dict)
    asking: dict[str, tuple[Any, asyncio.Event]] = dataclasses.field(default_factory=dict)


def _servers(fs: Any) -> _Servers:
    # Kept on the filesystem object itself: fsspec's filesystems compare equal by their
    # options, and the record is of this object (a copy unpickled elsewhere starts anew).
    known = fs.__dict__.get("_torchgrain_servers")
    if known is None:
        known = fs.__dict__["_torchgrain_servers"] = _Servers()
    return known


def multirange_servers(fs: fsspec.AbstractFileSystem) -> dict[str, bool]:
    """Whether each origin (``"https://host:port"``) ``fs`` has asked for several ranges
    at once answers them so (absent: not asked yet); the dictionary is the live record.

    Example:
        >>> import fsspec
        >>> multirange_servers(fsspec.filesystem("memory"))
        {}
    """
    return _servers(fs).answers


def _semaphore(limit: int) -> asyncio.Semaphore:
    sems = _LIMITS.setdefault(asyncio.get_running_loop(), {})
    sem = sems.get(limit)
    if sem is None:
        sem = sems[limit] = asyncio.Semaphore(limit)
    return sem


async def _limited(
    fs: AsyncFileSystem, path: str, start: int, end: int, limit: int, seconds: float
) -> bytes:
    """One range request, started when one of the loop's ``limit`` slots is free, and
    cancelled ``seconds`` after it started (its wait for a slot does not count)."""
    async with _semaphore(limit):
        try:
            return await asyncio.wait_for(
                request_coroutine(fs, "cat_file", page_limit=remote.MAX_PAGE_BYTES)(
                    path, start=start, end=end
                ),
                seconds,
            )
        except asyncio.TimeoutError as e:
            raise FSTimeoutError(f"bytes {start}-{end}") from e


@functools.cache
def _http_filesystem() -> type | None:
    try:
        from fsspec.implementations.http import HTTPFileSystem
    except ImportError:  # aiohttp missing: no HTTP filesystem either
        return None
    return HTTPFileSystem


def _origin(path: str) -> str:
    parts = urlsplit(path)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _multirange_server(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether ``path``'s ranges may go out together: an HTTP(S) file whose server has
    not answered a multi-range request otherwise."""
    http = _http_filesystem()
    if http is None or not isinstance(fs, http) or not is_http(fs):
        return False
    return _servers(fs).answers.get(_origin(path), True)


class _Refused(Exception):
    """A multi-range request refused with an error status that one range asked alone may
    not get (a firewall's 403 for many ranges, a 416, a 501)."""


async def _get_ranges(
    fs: Any, path: str, merged: list[tuple[int, int]], heard: asyncio.Event | None = None
) -> tuple[list[tuple[int, memoryview]], int | None]:
    """The parts of one multi-range GET of ``merged`` (sorted, apart) as ``(first byte,
    bytes)``, and the file size they declare; ``heard`` is set once a 206's headers are
    in (see :func:`_first_asked`). Raises :class:`_Refused` for an error status, as one
    range's request would for a missing file or a busy server, and a
    :class:`MultipartError` for an answer that is not what was asked for (the whole file,
    a broken body); one with two ``Content-Range`` headers is a :class:`RangeAnswerError`."""
    async with ranged_get(fs, path, range_header(merged)) as r:
        if r.status != 206:  # (its body, the whole file or an error page, is never read)
            if r.status in (404, 410):  # the file is gone: as one range's request raises it
                raise FileNotFoundError(path)
            if is_transient_status(r.status):
                r.raise_for_status()  # as fsspec's own request raises it: retried
            if r.status < 300:  # the whole file: the server ignores ranges, and will again
                raise MultipartError(f"status {r.status}, not a multi-range answer")
            raise _Refused(f"status {r.status}")
        if heard is not None:
            heard.set()
        ranged = content_range(path, r.headers)  # (two are refused before the body)
        body = await read_capped(
            socket_pieces(r.content),
            response_limit(merged),
            r.content_length,
            why=f"{path}: a multi-range answer holds more than {len(merged)} ranges do",
        )
    boundary = boundary_of(r.headers.get("Content-Type"))
    try:
        if boundary is not None:
            parts, size = parse_byteranges(body, boundary, max_parts=len(merged))
        else:
            # One part: the server merged the ranges (RFC 9110 allows it) into one.
            parts, size = single_part(ranged, body)
    except MultipartError:
        raise
    except Exception as e:  # whatever else a malformed answer trips
        raise MultipartError(f"{type(e).__name__}: {e}") from e
    # The parts agree with each other; the file they are of must be the one opened.
    check_file_answer(path, size, r.headers.get("ETag"), r.headers.get("Last-Modified"))
    return parts, size


def _dropped(exc: BaseException) -> bool:
    """Whether a request failed at the connection (closed, reset, a body cut short)
    rather than with an answer."""
    import aiohttp

    return isinstance(
        exc, (ConnectionError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
    )


def _exact_parts(
    parts: Sequence[tuple[int, memoryview]], ranges: Sequence[tuple[int, int]]
) -> list[memoryview] | None:
    """Each range's part, where every range is exactly one part of the answer (the usual
    answer to ranges apart): views of the body, not copies (a copy of every byte costs
    about 0.3 ms per MB here, a tenth of receiving it). None otherwise.

    Example:
        >>> body = memoryview(b"abcdef")
        >>> [bytes(v) for v in _exact_parts([(0, body[:2]), (9, body[2:])], [(9, 13), (0, 2)])]
        [b'cdef', b'ab']
        >>> _exact_parts([(0, body)], [(0, 2), (4, 6)]) is None  # merged: sliced instead
        True
    """
    by_first = {first: data for first, data in parts}
    out = []
    for s, e in ranges:
        data = by_first.get(s)
        if data is None or len(data) != e - s:
            return None
        out.append(data)
    return out


#: The longest a multi-range request waits for the headers of the first one to a server
#: not asked yet (a round trip, usually) before going out as if it had not waited.
_PROBE_WAIT = 0.2


async def _first_asked(known: _Servers, origin: str, seconds: float) -> asyncio.Event | None:
    """Until a multi-range request to ``origin`` is answered, the first is sent alone and
    the others wait for its headers, :data:`_PROBE_WAIT` or their own ``seconds`` at most:
    a server that sends the whole file for several ranges (as stores answering one range
    per request do) then sends one file, not one per file of the batch, each of which
    would be asked again range by range. A stalled or failed first request holds the
    others back no longer, and its failure stays its own. Returns the event to set once
    this request's headers are in (the first), else None."""
    if origin in known.answers:
        return None
    loop = asyncio.get_running_loop()
    held = known.asking.get(origin)
    # A forked child runs another loop; a first request answered without teaching
    # anything (a timeout, a busy server) leaves the next to ask.
    if held is None or held[0] is not loop or held[1].is_set():
        known.asking[origin] = (loop, asyncio.Event())
        return known.asking[origin][1]
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(held[1].wait(), min(_PROBE_WAIT, seconds))
    return None


async def _limited_ranges(
    fs: Any,
    path: str,
    ranges: list[tuple[int, int]],
    limit: int,
    seconds: float,
    seconds_each: list[float],
) -> list[Any]:
    """``ranges`` of ``path`` in one multi-range request (one of the loop's ``limit``
    slots), cancelled ``seconds`` after it started; the ranges its answer does not hold
    are asked one per request (``seconds_each``).

    What the server is remembered for (:func:`multirange_servers`): ``True`` after a
    faithful answer; ``False`` after the whole file or a broken body, and after an error
    status or two dropped connections in a row for a multi-range request while the same
    ranges asked one by one were served. A missing file, a busy server (429, 5xx) or a
    timeout is returned for every range as one range's request would be (retried).
    """
    origin = _origin(path)
    known = _servers(fs)
    out: list[Any] = [None] * len(ranges)
    # Strikes against the server if the ranges asked alone are served: an error status
    # (2, at once), a dropped connection (1: two in a row).
    strike = 0
    first = await _first_asked(known, origin, seconds)
    try:
        if known.answers.get(origin, True):  # (else the first request taught otherwise)
            async with _semaphore(limit):
                parts, size = await asyncio.wait_for(
                    _get_ranges(fs, path, merge_ranges(ranges), first), seconds
                )
            # Ranges past the end of the file: left out by the server, each asked alone
            # (its own request names the problem).
            out = _exact_parts(parts, ranges) or slice_parts(parts, ranges, size=size)
            known.answers[origin] = True
            known.strikes.pop(origin, None)
    except asyncio.TimeoutError as e:
        err = RequestTimeout(
            f"range read of {path}: {len(ranges)} ranges in one request did not complete "
            f"within its {seconds:.3g} s limit (RetryPolicy.request_timeout, or the "
            "operation's deadline)"
        )
        err.__cause__ = e
        return [err] * len(ranges)
    except RangeAnswerError as e:
        return [e] * len(ranges)  # another file than the one opened: retried, then an error
    except (MultipartError, ResponseSizeError):
        known.answers[origin] = False  # a broken answer: never asked so again
    except _Refused:
        strike = 2
    except Exception as e:
        if not _dropped(e):
            return [e] * len(ranges)  # as one range's request would fail: retried, or named
        strike = 1
    finally:
        if first is not None:
            first.set()
    alone = [k for k, got in enumerate(out) if got is None]
    if alone:
        got = await asyncio.gather(
            *(_limited(fs, path, *ranges[k], limit, seconds_each[k]) for k in alone),
            return_exceptions=True,
        )
        for k, blob in zip(alone, got):
            out[k] = blob
        if strike and all(not isinstance(b, BaseException) for b in got):
            known.strikes[origin] = known.strikes.get(origin, 0) + strike
            if known.strikes[origin] >= 2:
                known.answers[origin] = False
    return out


def _requests(
    fs: fsspec.AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    multi_range: bool = True,
) -> list[list[int]]:
    """The requests for ``paths[i], starts[i], ends[i]``: lists of indices, each either one
    range or, for a server that answers several, up to :data:`MAX_RANGES` (merged) ranges
    of one file."""
    by_path: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        by_path.setdefault(p, []).append(i)
    out: list[list[int]] = []
    for p, idx in by_path.items():
        if len(idx) < 2 or not multi_range or not _multirange_server(fs, p):
            out.extend([i] for i in idx)
            continue
        idx.sort(key=lambda i: starts[i])
        group: list[int] = []
        merged = 0
        reach = -1
        for i in idx:
            if ends[i] <= starts[i]:
                out.append([i])  # an empty range: asked alone (fsspec answers b"")
                continue
            if starts[i] > reach and merged == MAX_RANGES:
                out.append(group)
                group, merged, reach = [], 0, -1
            merged += starts[i] > reach
            reach = max(reach, ends[i])
            group.append(i)
        if group:
            out.append(group)
    return out


def cat_many(
    fs: fsspec.AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    *,
    urls: Sequence[str] | None = None,
    max_inflight: int = 64,
    multi_range: bool = True,
    what: str = "range read",
    arrived: Callable[[list[int], list[Any]], None] | None = None,
) -> list[bytes | BaseException]:
    """Bytes ``[starts[i], ends[i])`` of ``paths[i]`` for each ``i``, of any files of
    ``fs``, with at most ``max_inflight`` requests in flight in this process (on an
    async filesystem all of them are on its event loop: one thread, no thread per
    request). Each result is checked as :func:`cat_file`'s; a request that failed has
    its exception in its place (a :class:`~torchgrain.io.retry.RequestTimeout` or a
    :class:`ResponseSizeError` for a transient failure, naming the URL and the range),
    so a caller can keep what arrived and ask again for the rest. ``arrived(indices,
    results)``, when given, is called on the calling thread with each file's results as
    soon as its last request is answered, while the others are still in flight (requests
    go out file after file: the first files complete first). With ``multi_range``,
    the ranges of one ``http(s)://`` file go out up to
    :data:`~torchgrain.io.byteranges.MAX_RANGES` in a request (see the module docstring).

    Each request gets :meth:`~torchgrain.io.retry.RetryPolicy.request_seconds` of its
    size from when it is sent, cut to what the operation in progress has left. Local
    and in-memory filesystems are read one range after another.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/m1", b"0123456789"); fs.pipe("/c/m2", b"abcdef")
        >>> cat_many(fs, ["/c/m1", "/c/m2", "/c/m2"], [0, 1, 4], [2, 3, 9])[:2]
        [b'01', b'bc']
    """
    labels = list(urls) if urls is not None else list(paths)
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight!r}")
    out: list[bytes | BaseException] = []
    if not isinstance(fs, AsyncFileSystem) or fs.asynchronous:
        for p, s, e, label in zip(paths, starts, ends, labels):
            try:
                out.append(cat_file(fs, p, s, e, url=label, what=what))
            except Exception as exc:
                out.append(exc)
            if arrived is not None:
                arrived([len(out) - 1], out[-1:])
        return out
    total = sum(e - s for s, e in zip(starts, ends))
    left, _, policy = remaining_seconds(total)
    if left <= 0:
        err = RequestTimeout(f"{what}: the operation's {policy.deadline:g} s deadline has passed")
        return [err] * len(starts)

    requests = _requests(fs, paths, starts, ends, multi_range)

    def seconds(nbytes: int) -> float:
        return min(left, policy.request_seconds(nbytes))

    def request(idx: list[int]) -> Any:
        if len(idx) == 1:
            (i,) = idx
            return _limited(
                fs, paths[i], starts[i], ends[i], max_inflight, seconds(ends[i] - starts[i])
            )
        ranges = [(starts[i], ends[i]) for i in idx]
        return _limited_ranges(
            fs,
            paths[idx[0]],
            ranges,
            max_inflight,
            seconds(sum(e - s for s, e in merge_ranges(ranges))),
            [seconds(e - s) for s, e in ranges],
        )

    def finish(i: int, blob: Any) -> Any:
        """Request ``i``'s result as the caller gets it: errors named, lengths checked."""
        p, s, e, label = paths[i], starts[i], ends[i], labels[i]
        if isinstance(blob, FSTimeoutError):
            return RequestTimeout(
                f"{what} of {label} (bytes {s}-{e}) did not complete within its "
                f"{seconds(e - s):.3g} s limit "
                "(RetryPolicy.request_timeout, or the operation's deadline)"
            )
        if isinstance(blob, FileNotFoundError):
            return redirect_refusal(blob) or blob
        elif not isinstance(blob, BaseException):
            try:
                check_length(fs, p, s, e, len(blob), label)
                request_done(e - s)
            except Exception as bad:
                return bad
        return blob

    def collect(path: str, late: Any = None) -> tuple[list[int], list[Any]]:
        """One file's results as the caller gets them (indices, results), put in ``got``;
        ``late``: the result of its requests that were not answered."""
        idx, blobs = [], []
        for k in of_file[path]:
            result = late if results[k] is None else results[k]  # (None: unanswered)
            many = len(requests[k]) > 1 and not isinstance(result, BaseException)
            for j, i in enumerate(requests[k]):
                got[i] = finish(i, result[j] if many else result)
                idx.append(i)
                blobs.append(got[i])
        return idx, blobs

    # The requests go out on fs's loop; each file's results are handed to ``arrived`` on
    # the calling thread once its last request is answered (the caller works on them while
    # the others are in flight). The loop wakes the calling thread once per file, not per
    # request: each wake-up is a handover of the GIL, which the busy loop pays for.
    if fs.loop is None or fs.loop.is_closed():
        raise RuntimeError("Loop is not running")
    of_file: dict[str, list[int]] = {}  # the requests of each file, in order
    for k, idx in enumerate(requests):
        of_file.setdefault(paths[idx[0]], []).append(k)
    unanswered = {p: len(ks) for p, ks in of_file.items()}  # (the loop's own)
    results: list[Any] = [None] * len(requests)  # written by the loop, read once told
    done: queue.SimpleQueue = queue.SimpleQueue()  # files all of whose requests are in

    def answered(k: int, task: asyncio.Future) -> None:
        if task.cancelled():
            return  # timed out (or the caller raised): nothing more comes
        results[k] = task.exception() or task.result()
        path = paths[requests[k][0]]
        unanswered[path] -= 1
        if not unanswered[path]:
            done.put(path)

    async def send() -> None:
        tasks = []
        for k, idx in enumerate(requests):
            tasks.append(asyncio.ensure_future(request(idx)))
            tasks[-1].add_done_callback(functools.partial(answered, k))
        await asyncio.gather(*tasks, return_exceptions=True)

    count = len(starts)
    got: list[Any] = [None] * count
    waiting = set(of_file)
    future = asyncio.run_coroutine_threadsafe(send(), fs.loop)
    deadline = time.monotonic() + left + policy.request_timeout
    try:
        while waiting:
            try:
                path = done.get(timeout=wait_seconds(deadline - time.monotonic()))
            except queue.Empty:
                break
            waiting.discard(path)
            idx, blobs = collect(path)
            if arrived is not None:
                arrived(idx, blobs)
    finally:
        if waiting:
            future.cancel()
    if waiting:
        # What arrived of a file still waiting is kept; the rest timed out.
        err = RequestTimeout(
            f"{what} of {count} ranges: requests of {len(waiting)} files did not complete "
            f"within {left:.3g} s"
        )
        for path in waiting:
            collect(path, err)
    return got
