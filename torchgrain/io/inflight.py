"""Many range requests in flight at once, over one event loop: a batch's byte ranges.

:func:`cat_many` fetches the byte ranges of many files of one filesystem with at most
``max_inflight`` requests in flight per process, each keeping the deadline and response
checks of :mod:`torchgrain.io.remote` (one request per range; its failure is returned in
its place, so a caller keeps what arrived and asks again for the rest).
:mod:`torchgrain.io.ranges` builds a batch-wide fetch on it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError

from torchgrain.errors import UnsafePathError
from torchgrain.io.remote import (
    _check_length,
    _coroutine,
    _raise_refusal,
    cat_file,
    remaining_seconds,
    request_done,
)
from torchgrain.io.retry import RequestTimeout

__all__ = ["cat_many"]


#: Semaphores bounding the requests in flight on one event loop: ``{loop: {limit: sem}}``.
_LIMITS: weakref.WeakKeyDictionary[Any, dict[int, asyncio.Semaphore]] = weakref.WeakKeyDictionary()


async def _limited(
    fs: AsyncFileSystem, path: str, start: int, end: int, limit: int, seconds: float
) -> bytes:
    """One range request, started when one of the loop's ``limit`` slots is free, and
    cancelled ``seconds`` after it started (its wait for a slot does not count)."""
    sems = _LIMITS.setdefault(asyncio.get_running_loop(), {})
    sem = sems.get(limit)
    if sem is None:
        sem = sems[limit] = asyncio.Semaphore(limit)
    async with sem:
        try:
            return await asyncio.wait_for(
                _coroutine(fs, "cat_file")(path, start=start, end=end), seconds
            )
        except asyncio.TimeoutError as e:
            raise FSTimeoutError(f"bytes {start}-{end}") from e


def cat_many(
    fs: fsspec.AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    *,
    urls: Sequence[str] | None = None,
    max_inflight: int = 64,
    what: str = "range read",
) -> list[bytes | BaseException]:
    """Bytes ``[starts[i], ends[i])`` of ``paths[i]`` for each ``i``, of any files of
    ``fs``, with at most ``max_inflight`` requests in flight in this process (on an
    async filesystem all of them are on its event loop: one thread, no thread per
    request). Each result is checked as :func:`cat_file`'s; a request that failed has
    its exception in its place (a :class:`~torchgrain.io.retry.RequestTimeout` or a
    :class:`ResponseSizeError` for a transient failure, naming the URL and the range),
    so a caller can keep what arrived and ask again for the rest.

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
        return out
    total = sum(e - s for s, e in zip(starts, ends))
    left, _, policy = remaining_seconds(total)
    if left <= 0:
        err = RequestTimeout(f"{what}: the operation's {policy.deadline:g} s deadline has passed")
        return [err] * len(starts)

    async def gather() -> list[Any]:
        return await asyncio.gather(
            *(
                _limited(fs, p, s, e, max_inflight, min(left, policy.request_seconds(e - s)))
                for p, s, e in zip(paths, starts, ends)
            ),
            return_exceptions=True,
        )

    try:
        # The loop bounds each request; this bounds the whole batch's wait.
        got = sync(fs.loop, gather, timeout=left + policy.request_timeout)
    except FSTimeoutError as e:
        err = RequestTimeout(f"{what} of {len(starts)} ranges did not complete within {left:.3g} s")
        err.__cause__ = e
        return [err] * len(starts)
    for p, s, e, label, blob in zip(paths, starts, ends, labels, got):
        if isinstance(blob, FSTimeoutError):
            blob = RequestTimeout(
                f"{what} of {label} (bytes {s}-{e}) did not complete within its "
                f"{min(left, policy.request_seconds(e - s)):.3g} s limit "
                "(RetryPolicy.request_timeout, or the operation's deadline)"
            )
        elif isinstance(blob, FileNotFoundError):
            try:
                _raise_refusal(blob)
            except UnsafePathError as refused:
                blob = refused
        elif not isinstance(blob, BaseException):
            try:
                _check_length(fs, p, s, e, len(blob), label)
                request_done(e - s)
            except Exception as bad:
                blob = bad
        out.append(blob)
    return out
