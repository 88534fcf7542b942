"""What a remote server may send back: bodies with a byte cap, downloads that keep pace,
no redirect away from the URL asked for.

The checks :mod:`torchgrain.io.remote` puts on every response (see its docstring): a
body read in pieces and given up as soon as it holds more than was asked for
(:func:`_read_capped`, also S3's GETs: :data:`_S3_READS`), a download stopped when it
brings too much or falls behind ``min_rate`` (:class:`_DownloadGuard`), and a redirect
refused unless it leads from a directory's URL to the same URL with a trailing slash
(:func:`_on_redirect`).

Example:
    >>> import asyncio
    >>> chunks = [b"ab", b""]
    >>> async def read(n):
    ...     return chunks.pop(0)[:n]
    >>> asyncio.run(_read_capped(read, 4, None, why="too long"))
    b'ab'
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fsspec.callbacks import Callback

from torchgrain.errors import UnsafePathError
from torchgrain.io.retry import RequestTimeout, RetryPolicy

__all__ = ["ResponseSizeError"]


class ResponseSizeError(ConnectionError):
    """A response held more or fewer bytes than were asked for while the file has them
    (a transport fault, or a server that ignores ``Range``): transient, so retried."""


class _RedirectRefused(UnsafePathError, PermissionError):
    """A server redirected a request away from the URL asked for.

    A :class:`PermissionError` as well, so that fsspec's HTTP ``isdir`` (which treats a
    ``ValueError`` as "not a directory") lets it through.
    """


async def _read_capped(
    read: Callable[[int], Awaitable[bytes]], limit: int, declared: int | None, *, why: str
) -> bytes:
    """A body read with ``read(n)`` (up to ``n`` bytes, ``b""`` at its end), holding at
    most ``limit`` bytes: one more is a :class:`ResponseSizeError` saying ``why``, raised
    before the rest is read (before any, when the ``declared`` length is already over).

    Example:
        >>> import asyncio
        >>> chunks = [b"abc", b"def", b""]
        >>> async def read(n):
        ...     return chunks.pop(0)[:n]
        >>> asyncio.run(_read_capped(read, 4, None, why="too long"))
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.ResponseSizeError: too long
    """
    if declared is not None and declared > limit:
        raise ResponseSizeError(why)
    parts: list[bytes] = []
    got = 0
    while part := await read(limit + 1 - got):
        got += len(part)
        if got > limit:
            raise ResponseSizeError(why)
        parts.append(part)
    return b"".join(parts)


async def _on_redirect(session: Any, context: Any, params: Any) -> None:
    import yarl

    location = params.response.headers.get("Location") or params.response.headers.get("URI")
    url = params.url
    target = url.join(yarl.URL(location or ""))
    if not url.path.endswith("/") and target == url.with_path(url.path + "/", encoded=True):
        return  # a directory's own URL
    raise _RedirectRefused(
        f"{url} redirects to {location!r}: torchgrain follows no redirect out of the "
        "URL asked for (a server could point it at any host). If you trust this server, "
        "open the dataset with allow_external_paths=True"
    )


async def _s3_cat_file(
    fs: Any, path: str, start: int | None = None, end: int | None = None, *, page_limit: int
) -> bytes:
    """One S3 GET (of bytes ``[start, end)``, or all), read with a byte cap (without a
    range: ``page_limit``, :data:`torchgrain.io.remote.MAX_PAGE_BYTES` where remote calls)."""
    bucket, key, version = fs.split_path(path)
    extra: dict[str, Any] = {"VersionId": version} if version else {}
    if start is not None and end is not None:
        extra["Range"] = f"bytes={start}-{end - 1}"
        limit = end - start
        why = (
            f"{path}: the response for bytes {start}-{end - 1} holds more than the {limit} "
            "bytes asked for: the server does not honour Range requests, or the response "
            "is corrupt"
        )
    else:
        limit = page_limit
        why = f"{path}: the object holds more than {limit} bytes (remote.MAX_PAGE_BYTES)"
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
    body = resp["Body"]
    try:
        return await _read_capped(body.read, limit, resp.get("ContentLength"), why=why)
    finally:
        body.close()


async def _s3_cat_ranges(
    fs: Any, paths: list[str], starts: list[int], ends: list[int], *, page_limit: int
) -> list[bytes | BaseException]:
    """:func:`_s3_cat_file` for each range, concurrently; failures are returned in place
    (as fsspec's ``cat_ranges`` does)."""
    reads = [
        _s3_cat_file(fs, p, s, e, page_limit=page_limit) for p, s, e in zip(paths, starts, ends)
    ]
    return await asyncio.gather(*reads, return_exceptions=True)


_S3_READS: dict[str, Callable[..., Awaitable[Any]]] = {
    "cat_file": _s3_cat_file,
    "cat_ranges": _s3_cat_ranges,
}


class _DownloadGuard(Callback):
    """fsspec's progress callback, used to stop a download that brings too much or too
    slowly (it is called with every piece written)."""

    def __init__(self, nbytes: int, url: str, *, grace: float, policy: RetryPolicy) -> None:
        super().__init__()
        self.limit, self.url, self.grace, self.policy = nbytes, url, grace, policy
        self.start = time.monotonic()

    def set_size(self, size: int | None) -> None:
        super().set_size(size)
        self.value, self.start = 0, time.monotonic()  # a transfer (re)starts

    def relative_update(self, inc: int = 1) -> None:
        self.value += inc
        if self.value > self.limit:
            raise ResponseSizeError(
                f"{self.url}: the download brought more than the {self.limit} bytes expected"
            )
        spent = time.monotonic() - self.start
        if spent > self.grace + self.value / self.policy.min_rate:
            raise RequestTimeout(
                f"download of {self.url} fell behind {self.policy.min_rate:g} bytes/s "
                f"(RetryPolicy.min_rate): {self.value} bytes in {spent:.1f} s"
            )
