"""What a remote server may send back: bodies with a byte cap, range answers of the file
opened.

The checks :mod:`torchgrain.io.remote` puts on every response (see its docstring): a
body read in pieces and given up as soon as it holds more than was asked for
(:func:`read_capped`), and torchgrain's own HTTP(S) and S3 requests, which read so
(:func:`request_coroutine`).

A range answer is the range asked, of the file opened (:func:`check_range_answer`): a
``206`` whose ``Content-Range`` names other bytes (or that has two), or a file of another
size than the one pinned when the file was opened (:func:`pin`), or whose
``ETag``/``Last-Modified`` differ from the first answer's, is a :class:`RangeAnswerError`;
so is a ``200`` (the whole file) unless it is exactly the range asked. A pinned ``ETag``
is sent as ``If-Match`` (HTTP and S3), so a store that honours it answers ``412`` for a
replaced object.

A directory listing over HTTP(S) is a page of links, read as a browser reads them
(:func:`page_links`).

Example:
    >>> import asyncio
    >>> chunks = [b"ab", b""]
    >>> async def read(n):
    ...     return chunks.pop(0)[:n]
    >>> asyncio.run(read_capped(read, 4, None, why="too long"))
    b'ab'
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import html.entities
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin

from torchgrain.io import paths as _paths
from torchgrain.io.paths import is_http
from torchgrain.io.retry import error_chain

__all__ = [
    "Pin",
    "RangeAnswerError",
    "ResponseSizeError",
    "changed_error",
    "check_range_answer",
    "content_range",
    "differ",
    "page_links",
    "pin",
    "pinned",
    "read_capped",
    "request_coroutine",
    "socket_pieces",
    "too_long",
]


class ResponseSizeError(ConnectionError):
    """A response held more or fewer bytes than were asked for while the file has them
    (a transport fault, or a server that ignores ``Range``): transient, so retried."""


class RangeAnswerError(ResponseSizeError):
    """A range answer that is not the range asked, of the file opened: other bytes (its
    ``Content-Range``), a file of another size, another ``ETag`` or ``Last-Modified``, or
    ``412`` to ``If-Match`` (the object was replaced while it was read). Retried once from
    scratch (a proxy's glitch), then :class:`~torchgrain.RemoteIOError` naming the URL
    (:attr:`retries`): offsets taken from the old file never index the new one."""

    #: How many times an operation retries it (see :func:`torchgrain.io.retry.retry_call`).
    retries = 1


@dataclass
class Pin:
    """What identifies a remote object a process reads: its size, and the ``ETag`` and
    ``Last-Modified`` of the first answer that had them.

    Example:
        >>> Pin(10, '"e1"')
        Pin(size=10, etag='"e1"', modified=None)
    """

    size: int | None = None
    etag: str | None = None
    modified: str | None = None
    #: Taken from an unpickled source's pickle, no answer has confirmed it yet (see
    #: :func:`torchgrain.io.remote.restore_pins`).
    restored: bool = field(default=False, repr=False, compare=False)


#: Per process (inherited by forked workers): object path -> its pin. One small entry per
#: file read, never more than the dataset's files.
_PINS: dict[str, Pin] = {}


def pin(path: str, size: int | None, *, fresh: bool = False) -> None:
    """Pin the size of ``path`` (a filesystem path, as its requests name it) from what the
    dataset's opening recorded (an index, a manifest, a footer read): answers naming another
    size are :class:`RangeAnswerError`. A size different from the one pinned replaces the
    pin (a later opening of a changed file), forgetting its ``ETag``; so does ``fresh``
    (a size just asked of the server, for a read of the file as it is now: a manifest, an
    index build), whatever the size: a file replaced by one of the same size is read anew,
    not refused for the rest of the process.

    Example:
        >>> pin("h://x/doc", 10); pinned("h://x/doc").size
        10
        >>> check_range_answer("h://x/doc", 2, 4, 206, "bytes 2-3/11", None, None)
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.RangeAnswerError: h://x/doc: the answer names a file of 11 bytes, not the 10 pinned when it was opened (the file changed on the server?)
    """
    if size is None:
        if fresh:  # an opening that knows no size yet: the first answer pins it
            _PINS.pop(path, None)
        return
    got = _PINS.get(path)
    if fresh or got is None or got.size != int(size):
        _PINS[path] = Pin(int(size))


def unchanged_since(path: str, seen: tuple | None) -> tuple | None:
    """What this process has pinned of ``path`` now (size, ``ETag``, ``Last-Modified``),
    checked against ``seen``, what it had pinned when a reader took offsets from the
    file: a later opening in this process may have pinned it anew (a file re-uploaded
    since), and a reader of the old version must not read the new one at its old
    offsets. Raises :class:`RangeAnswerError` when a field known then
    differs now; returns what to pass next time.

    Example:
        >>> pin("h://x/u", 10); seen = unchanged_since("h://x/u", None)
        >>> unchanged_since("h://x/u", seen) == seen
        True
        >>> pin("h://x/u", 12)
        >>> unchanged_since("h://x/u", seen)
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.RangeAnswerError: h://x/u changed since it was read from: (12, None, None) now, (10, None, None) then (open the dataset again)
    """
    got = _PINS.get(path)
    now = (got.size, got.etag, got.modified) if got is not None else (None, None, None)
    if seen is None:
        return now
    if differ(seen, now):
        raise RangeAnswerError(
            f"{path} changed since it was read from: {now} now, {seen} then "
            "(open the dataset again)"
        )
    return tuple(a if a is not None else b for a, b in zip(seen, now))


def differ(a: tuple, b: tuple) -> bool:
    """Whether two versions (size, ``ETag``, ``Last-Modified``) are of other files: a
    field both know differs (a weakened ETag, ``W/"x"``, is the same object's).

    Example:
        >>> differ((3, '"x"', None), (3, 'W/"x"', "Mon")), differ((3, None, None), (4, None, None))
        (False, True)
    """
    return any(
        x is not None and y is not None and not (_same_tag(x, y) if k == 1 else x == y)
        for k, (x, y) in enumerate(zip(a, b))
    )


def pinned(path: str) -> Pin | None:
    """The pin of ``path``, if any (see :func:`pin`)."""
    return _PINS.get(path)


def if_match(path: str) -> str | None:
    """The ``ETag`` to send as ``If-Match`` for ``path``: a strong one (a weak one never
    matches ``If-Match``), once an answer gave it."""
    etag = getattr(_PINS.get(path), "etag", None)
    return etag if etag is not None and not etag.startswith("W/") else None


def _same_tag(a: str, b: str) -> bool:
    # A compressing proxy may weaken a tag (W/"x"): the object is the same.
    return a.removeprefix("W/") == b.removeprefix("W/")


def check_file_answer(
    path: str,
    size: int | None,
    etag: str | None,
    modified: str | None,
    *,
    complete: bool = True,
) -> None:
    """Check that an answer (a multi-range one, whose parts agree with each other) is of
    the file pinned for ``path``: its size, ``ETag`` and ``Last-Modified`` (see
    :func:`pin`; the first answer of a file with no pin pins it). Once a validator is
    pinned, an answer must carry one the pin has, and the same: one that carries none of
    them (a proxy that drops them, a server that names the version otherwise now) could
    be of any version, and a validator the pin lacks is taken only from an answer that
    also matched one it has. ``complete=False``: the headers are what a listing gave (a
    filesystem's ``info``, which may leave a validator out), checked where they are
    given.

    Raises:
        RangeAnswerError: another size or validator than pinned, or none of the pinned
            validators.

    Example:
        >>> pin("h://x/m", 9)
        >>> check_file_answer("h://x/m", 9, '"v1"', None)
        >>> check_file_answer("h://x/m", 9, '"v2"', None)
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.RangeAnswerError: h://x/m: the answer's ETag is '"v2"', not '"v1"' as when it was first read: the file changed on the server while it was being read
    """
    got = _PINS.get(path)
    if got is None:
        _PINS[path] = Pin(size, etag or None, modified or None)
        return
    if size is not None:
        if got.size is None:
            got.size = size
        elif size != got.size:
            raise RangeAnswerError(
                f"{path}: the answer names a file of {size} bytes, not the {got.size} pinned "
                "when it was opened (the file changed on the server?)"
            )
    etag, modified = etag or None, modified or None
    matched = False
    for name, have, new in (("ETag", got.etag, etag), ("Last-Modified", got.modified, modified)):
        if have is None or new is None:
            continue
        if not (_same_tag(have, new) if name == "ETag" else have == new):
            raise RangeAnswerError(
                f"{path}: the answer's {name} is {new[:80]!r}, not {have[:80]!r} as when it "
                "was first read: the file changed on the server while it was being read"
            )
        matched = True
    if not matched and (got.etag or got.modified) is not None:
        if complete:
            raise RangeAnswerError(
                f"{path}: the answer carries none of the validators the file was first read "
                f"with (ETag {got.etag!r}, Last-Modified {got.modified!r}; this answer's: "
                f"{etag!r}, {modified!r}): it may be of another version of the file (a "
                "server or proxy that drops or changes them on some answers cannot be read "
                "safely)"
            )
        return  # (a listing's: nothing of it to pin)
    got.etag = got.etag or etag
    got.modified = got.modified or modified
    got.restored = False  # (an answer of this version)


def restore(path: str, version: tuple) -> Pin:
    """Pin ``version`` (size, ``ETag``, ``Last-Modified``) of ``path`` from an unpickled
    source's pickle, where this process has pinned nothing of it, and return the pin now.
    A pin that only another pickle restored (no answer here confirmed it) of another
    version pins neither: the pin is emptied and the first answer decides, so that the
    order pickles are loaded in never refuses the source of the version the server
    serves (the other one is refused at its read).

    Raises:
        RangeAnswerError: another version pinned by an opening or an answer here.

    Example:
        >>> restore("h://x/r", (3, '"v1"', None)).etag
        '"v1"'
        >>> restore("h://x/r", (3, '"v0"', None))  # two pickles, no answer yet
        Pin(size=None, etag=None, modified=None)
        >>> check_file_answer("h://x/r", 3, '"v1"', None)  # the server's answer
        >>> restore("h://x/r", (3, '"v0"', None))
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.RangeAnswerError: h://x/r: the answer's ETag is '"v0"', not '"v1"' as when it was first read: the file changed on the server while it was being read
    """
    got = _PINS.get(path)
    if got is not None and got.restored:
        now = (got.size, got.etag, got.modified)
        if now == (None, None, None) or differ(now, version):
            _PINS[path] = got = Pin(restored=True)
            return got
    check_file_answer(path, *version, complete=False)  # (a pickle's: it may know fewer)
    if got is None or got.restored:
        _PINS[path].restored = True  # (no answer of it yet)
    return _PINS[path]


_ANSWER_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)", re.IGNORECASE)


def check_range_answer(
    path: str,
    start: int,
    end: int,
    status: int,
    content_range: str | None,
    etag: str | None,
    modified: str | None,
    *,
    length: int | None = None,
) -> None:
    """Check the answer to a request for bytes ``[start, end)`` of ``path`` (``status``,
    and its ``Content-Range``, ``ETag``, ``Last-Modified`` headers; ``length``: a ``200``'s
    ``Content-Length``, where given) against what was asked and the pin of ``path``
    (:func:`pin`).

    A ``206`` must name ``start`` and ``end - 1`` (or end early at the file's last byte:
    the file is shorter, which the caller reports) of a file of the pinned size. A ``200``
    is the whole file: it is used only when that is the range asked (from byte 0 to the
    pinned size, or, where no size is pinned, to its ``Content-Length``). Any other ``200`` is refused before its body is read: a server that
    sends the first bytes of a file whatever was asked would otherwise pass for one that
    honours ``Range``, and slicing a range out of a whole shard costs a shard per record.

    Raises:
        RangeAnswerError: any other answer (transient: retried once).

    Example:
        >>> check_range_answer("h://x/e", 4, 8, 206, "bytes 4-7/20", '"a"', None)
        >>> check_range_answer("h://x/e", 8, 12, 206, "bytes 7-10/20", None, None)
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.RangeAnswerError: h://x/e: asked for bytes 8-11, the answer holds bytes 7-10 (Content-Range 'bytes 7-10/20')
    """
    if status == 200:
        got = _PINS.get(path)
        size = got.size if got is not None else None
        if size is None and start == 0 and length == end:
            size = length  # (none pinned: a whole file of the bytes asked for is them)
        if start != 0 or size is None or end != size or length not in (None, size):
            held = (
                f"holds more than the {end - start} bytes asked for"
                if length is None or length > end - start
                else f"holds {length} bytes from the file's start, not the range asked for"
            )
            raise RangeAnswerError(
                f"{path}: the answer to bytes {start}-{end - 1} (status 200: a whole "
                f"file{'' if size is None else f'; {size} bytes pinned'}) {held}: the "
                "server does not honour Range requests, or the response is corrupt"
            )
        check_file_answer(path, None, etag, modified)
        return
    m = _ANSWER_RANGE.fullmatch((content_range or "").strip())
    if status != 206 or m is None:
        raise RangeAnswerError(
            f"{path}: asked for bytes {start}-{end - 1}, the answer (status {status}) has "
            f"no byte range (Content-Range {(content_range or '')[:80]!r})"
        )
    first, last = int(m[1]), int(m[2])
    total = None if m[3] == "*" else int(m[3])
    short = total is not None and last == total - 1 and last < end - 1
    if (
        first != start
        or (last != end - 1 and not short)
        or last < first
        or (total is not None and last >= total)
    ):
        raise RangeAnswerError(
            f"{path}: asked for bytes {start}-{end - 1}, the answer holds bytes "
            f"{first}-{last} (Content-Range {content_range[:80]!r})"
        )
    check_file_answer(path, total, etag, modified)


async def read_capped(
    read: Callable[[int], Awaitable[bytes]], limit: int, declared: int | None, *, why: str
) -> bytes | bytearray:
    """A body read with ``read(n)`` (up to ``n`` bytes, ``b""`` at its end; it may return
    more, see :func:`socket_pieces`), holding at most ``limit`` bytes: one more is a
    :class:`ResponseSizeError` saying ``why``, raised before the rest is read (before any,
    when the ``declared`` length is already over).

    A body that comes in one piece is that piece; one in several pieces with a
    ``declared`` length is copied piece by piece into one buffer of that length (a
    ``bytearray``, never reused): each byte is copied once, where joining the pieces
    copied it again (~30% of the event loop's time for 100 KiB ranges).

    Example:
        >>> import asyncio
        >>> chunks = [b"abc", b"def", b""]
        >>> async def read(n):
        ...     return chunks.pop(0)[:n]
        >>> asyncio.run(read_capped(read, 4, None, why="too long"))
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.ResponseSizeError: too long
        >>> chunks = [b"abc", b"def", b""]
        >>> asyncio.run(read_capped(read, 6, 6, why="too long"))
        bytearray(b'abcdef')
    """
    if declared is not None and declared > limit:
        raise ResponseSizeError(why)
    pieces: list[bytes] = []
    buf: bytearray | None = None
    got = 0
    while part := await read(limit + 1 - got):
        end = got + len(part)
        if end > limit:
            raise ResponseSizeError(why)
        if buf is None and pieces and declared is not None and end <= declared:
            buf = bytearray(declared)  # a second piece: into one buffer from now on
            buf[:got] = pieces.pop()
        if buf is None:
            pieces.append(part)
        elif end <= len(buf):
            buf[got:end] = part
        else:  # more than declared (a faulty transport): the pieces joined, as before
            pieces, buf = [bytes(buf[:got]), part], None
        got = end
    if buf is not None:
        return buf if got == len(buf) else buf[:got]
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def socket_pieces(content: Any) -> Callable[[int], Awaitable[bytes]]:
    """A ``read(n)`` for :func:`read_capped` of an aiohttp ``StreamReader``: the pieces
    as they arrived from the socket, one per call (``readchunk``), where ``read(n)`` and
    ``readany()`` join whatever is buffered into a new ``bytes`` first.

    Example:
        >>> import asyncio
        >>> class Content:
        ...     got = [(b"ab", False), (b"", True), (b"c", False), (b"", False)]
        ...     async def readchunk(self):
        ...         return self.got.pop(0)
        >>> asyncio.run(read_capped(socket_pieces(Content()), 8, 3, why="too long"))
        bytearray(b'abc')
    """

    async def read(n: int) -> bytes:
        while True:
            data, chunk_end = await content.readchunk()
            if data or not chunk_end:  # (b"", True): the end of an HTTP chunk, not the body
                return data

    return read


def range_request(fs: Any, path: str, ranges: str) -> tuple[dict[str, Any], str | None]:
    """The keyword arguments of a GET of ``ranges`` (a ``Range`` header's value) of
    ``path`` with HTTP filesystem ``fs``'s own options, and the ``ETag`` it sends as
    ``If-Match`` (None: none pinned yet).

    Example:
        >>> class FS: kwargs = {"headers": {"X": "1"}}
        >>> range_request(FS(), "h://x/r", "bytes=0-9")[0]["headers"]["Range"]
        'bytes=0-9'
    """
    kw = dict(fs.kwargs)
    # The file's bytes: a server that compresses partial content for a client accepting
    # gzip (aiohttp's default) sends a body whose length is not the range's.
    kw["headers"] = {**(kw.get("headers") or {}), "Range": ranges, "Accept-Encoding": "identity"}
    tag = if_match(path)
    if tag is not None:
        kw["headers"]["If-Match"] = tag
    return kw, tag


@contextlib.asynccontextmanager
async def ranged_get(fs: Any, path: str, ranges: str) -> AsyncIterator[Any]:
    """The answer to a GET of ``ranges`` of ``path`` (see :func:`range_request`): a ``412``
    to its ``If-Match`` is raised as :func:`changed_error`, and the answer is closed when
    the block raises (the rest of its body, an error page or the whole file, is never
    read)."""
    kw, tag = range_request(fs, path, ranges)
    session = await fs.set_session()
    async with session.get(fs.encode_url(path), **kw) as r:
        try:
            if r.status == 412 and tag is not None:
                raise changed_error(path, tag)
            yield r
        except BaseException:
            r.close()
            raise


def content_range(path: str, headers: Any) -> str | None:
    """The ``Content-Range`` of an answer for ``path`` (aiohttp's ``headers``), None where
    it has none. A field that may appear once: an answer with two (a proxy that adds its
    own beside its upstream's) says two things of the bytes it holds, and is refused.

    Raises:
        RangeAnswerError: more than one ``Content-Range``.

    Example:
        >>> from multidict import CIMultiDict
        >>> content_range("h://x/n", CIMultiDict([("Content-Range", "bytes 0-1/4")]))
        'bytes 0-1/4'
        >>> content_range("h://x/n", CIMultiDict([("Content-Range", "bytes 2-3/4")] * 2))
        Traceback (most recent call last):
        ...
        torchgrain.io.responses.RangeAnswerError: h://x/n: the answer has 2 Content-Range headers ('bytes 2-3/4', 'bytes 2-3/4'): it cannot say which bytes it holds
    """
    got = headers.getall("Content-Range", ())
    if len(got) > 1:
        named = ", ".join(repr(v[:80]) for v in got[:4])
        raise RangeAnswerError(
            f"{path}: the answer has {len(got)} Content-Range headers ({named}): it cannot "
            "say which bytes it holds"
        )
    return got[0] if got else None


def too_long(path: str, start: int, end: int) -> str:
    """Why a response for bytes ``[start, end)`` of ``path`` holding more is refused.

    Example:
        >>> too_long("h://x/t", 2, 4)
        'h://x/t: the response for bytes 2-3 holds more than the 2 bytes asked for: the server does not honour Range requests, or the response is corrupt'
    """
    return (
        f"{path}: the response for bytes {start}-{end - 1} holds more than the {end - start} "
        "bytes asked for: the server does not honour Range requests, or the response is corrupt"
    )


def changed_error(path: str, tag: str | None) -> RangeAnswerError:
    """The error for a ``412`` answer to ``If-Match`` ``tag`` (sent for ``path``): the file
    was replaced on the server since it was first read.

    Example:
        >>> print(changed_error("h://x/c", '"v1"'))
        h://x/c: the server answers 412 to If-Match '"v1"', the ETag pinned when it was first read: the file changed on the server since
    """
    return RangeAnswerError(
        f"{path}: the server answers 412 to If-Match {tag!r}, the ETag pinned when it was "
        "first read: the file changed on the server since"
    )


async def _http_cat_file(
    fs: Any, path: str, start: int | None = None, end: int | None = None, *, page_limit: int
) -> bytes:
    """fsspec's HTTP ``cat_file`` with the answer checked (:func:`check_range_answer`):
    one GET of bytes ``[start, end)``, ``If-Match`` the pinned ``ETag``, its body read with
    a byte cap. Without a range (a page, a manifest) fsspec's own, through the capped
    response of :func:`torchgrain.io.remote._client`."""
    if start is None or end is None or start >= end:
        return await fs._cat_file(path, start=start, end=end)
    async with ranged_get(fs, path, f"bytes={start}-{end - 1}") as r:
        if r.status >= 400:  # (an error page is no answer: the status says it all)
            fs._raise_not_found_for_status(r, path)
        check_range_answer(
            path,
            start,
            end,
            r.status,
            content_range(path, r.headers),
            r.headers.get("ETag"),
            r.headers.get("Last-Modified"),
            length=r.content_length,
        )
        return await read_capped(
            socket_pieces(r.content), end - start, r.content_length, why=too_long(path, start, end)
        )


async def _s3_cat_file(
    fs: Any, path: str, start: int | None = None, end: int | None = None, *, page_limit: int
) -> bytes:
    """One S3 GET (of bytes ``[start, end)``, or all), read with a byte cap (without a
    range: ``page_limit``, :data:`torchgrain.io.remote.MAX_PAGE_BYTES` where remote calls);
    a range's answer is checked (:func:`check_range_answer`), ``IfMatch`` the pinned ETag."""
    bucket, key, version = fs.split_path(path)
    extra: dict[str, Any] = {"VersionId": version} if version else {}
    ranged = start is not None and end is not None
    tag = None
    if ranged:
        extra["Range"] = f"bytes={start}-{end - 1}"
        tag = if_match(path)
        if tag is not None:
            extra["IfMatch"] = tag
        limit, why = end - start, too_long(path, start, end)
    else:
        limit = page_limit
        why = f"{path}: the object holds more than {limit} bytes (remote.MAX_PAGE_BYTES)"
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
    except Exception as e:
        if tag is None or not _precondition_failed(e):
            raise
        raise changed_error(path, tag) from None  # (its 412 is no status to give up on)
    body = resp["Body"]
    try:
        if ranged:
            modified = resp.get("LastModified")
            check_range_answer(
                path,
                start,
                end,
                int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 206),
                resp.get("ContentRange"),
                resp.get("ETag"),
                None if modified is None else str(modified),
                length=resp.get("ContentLength"),
            )
        return await read_capped(body.read, limit, resp.get("ContentLength"), why=why)
    finally:
        body.close()


async def _http_get_file(
    fs: Any, rpath: str, lpath: str, callback: Any = None, *, page_limit: int, **kwargs: Any
) -> None:
    """fsspec's HTTP ``get_file`` with its answer checked: one GET, ``If-Match`` the
    pinned ``ETag``, the answer's validators checked against the pin
    (:func:`check_file_answer`) before a byte is written; the body streamed to ``lpath``
    through ``callback`` (which stops a body too long or too slow; the caller checks the
    size of what arrived)."""
    kw = dict(fs.kwargs)
    tag = if_match(rpath)
    if tag is not None:  # (a compressed body, as the server may send it, is decoded)
        kw["headers"] = {**(kw.get("headers") or {}), "If-Match": tag}
    session = await fs.set_session()
    async with session.get(fs.encode_url(rpath), **kw) as r:
        if r.status == 412 and tag is not None:
            raise changed_error(rpath, tag)
        fs._raise_not_found_for_status(r, rpath)
        check_file_answer(rpath, None, r.headers.get("ETag"), r.headers.get("Last-Modified"))
        if callback is not None:
            callback.set_size(r.content_length)
        with open(lpath, "wb") as f:
            while chunk := await r.content.read(1 << 20):
                f.write(chunk)
                if callback is not None:
                    callback.relative_update(len(chunk))


def _precondition_failed(exc: BaseException) -> bool:
    """Whether an S3 error (as s3fs raises it, wrapped or not) is a ``412``."""
    for e in error_chain(exc, suppressed=True):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and (
            (response.get("Error") or {}).get("Code") in ("PreconditionFailed", "412")
            or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 412
        ):
            return True
        if "PreconditionFailed" in str(e) or "Precondition Failed" in str(e):
            return True
    return False


async def _cat_ranges(
    read: Callable[..., Awaitable[bytes]],
    fs: Any,
    paths: list[str],
    starts: list[int],
    ends: list[int],
    *,
    page_limit: int,
) -> list[bytes | BaseException]:
    """``read`` (:func:`_s3_cat_file`, :func:`_http_cat_file`) for each range,
    concurrently; failures are returned in place (as fsspec's ``cat_ranges`` does)."""
    reads = [read(fs, p, s, e, page_limit=page_limit) for p, s, e in zip(paths, starts, ends)]
    return await asyncio.gather(*reads, return_exceptions=True)


async def _http_head(fs: Any, path: str, *, page_limit: int) -> dict[str, Any]:
    """One ``HEAD`` of ``path``: ``{"status", "headers", "url"}`` (the redirect from a
    directory's URL to the same with a trailing slash is followed, no other)."""
    kw = dict(fs.kwargs)
    # The size of the file, not of a compression.
    kw["headers"] = {**(kw.get("headers") or {}), "Accept-Encoding": "identity"}
    kw.setdefault("allow_redirects", True)  # refused by the client's check, but that one
    session = await fs.set_session()
    async with session.head(fs.encode_url(path), **kw) as r:
        return {"status": r.status, "headers": dict(r.headers), "url": str(r.url)}


# A page's links, as a browser reads them: the ``href`` of each ``<a`` tag, and
# (``simple_links``) each bare http(s) URL in its text. A tag runs to its ``>`` outside
# quotes; its attributes, to the next quote like the one that opened the value. Each
# pattern is one pass (no nested quantifiers over the same characters: fsspec's
# backtracked in cubic time over spaces inside an ``<a`` tag).
_A_TAG = re.compile(r"""<[aA](?=[\t\n\f\r /])(?:[^>"']|"[^"]*"|'[^']*')*""")
_ATTRIBUTE = re.compile(
    r"""([^\t\n\f\r />][^\t\n\f\r />=]*)[\t\n\f\r ]*"""
    r"""(?:=[\t\n\f\r ]*("[^"]*"|'[^']*'|[^\t\n\f\r >"'][^\t\n\f\r >]*))?"""
)
# What a browser makes no link of: a comment (one left open runs to the page's end), and
# the text of a <script> or <style> element (a script's string "<a href='x'>" is no tag).
# One pass: each alternative scans forward once from its start.
_NOT_MARKUP = re.compile(
    r"""<!--(?:-?>|.*?(?:--!?>|\Z))"""
    r"""|<(script|style)(?=[\t\n\f\r />])(?:[^>"']|"[^"]*"|'[^']*')*"""
    r"""(?:>.*?(?:</\1(?=[\t\n\f\r />])|\Z))?""",
    re.IGNORECASE | re.DOTALL,
)
_BARE_URL = re.compile(r"""(?P<url>http[s]?://[-a-zA-Z0-9@:%_+.~#?&/=]+)""")
_ABSOLUTE = re.compile(r"(?i:https?:)|/")
_HTTP_SCHEME = re.compile(r"(?i)https?:")
# A character reference, as html.unescape finds them.
_CHARREF = re.compile(r"&(#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)")


def _href(tag: str) -> str | None:
    """The raw value of the first ``href`` attribute of ``<a`` tag ``tag``, if any (a
    browser takes the first of two)."""
    for m in _ATTRIBUTE.finditer(tag, 2):
        if m[1].lower() == "href":
            value = m[2] or ""
            return value[1:-1] if value[:1] in ("'", '"') else value
    return None


def _attribute_reference(m: re.Match[str]) -> str:
    ref = m[1]
    if ref[0] == "#" or ref in html.entities.html5:
        return html.unescape(m[0])  # a number, a name ending in ";", a legacy one alone
    for end in range(len(ref) - 1, 1, -1):
        if ref[:end] in html.entities.html5:  # a legacy name without ";" ("&not")
            after = ref[end]
            if after == "=" or (after.isascii() and after.isalnum()):
                return m[0]  # in an attribute, "&notes" is the text it is
            return html.entities.html5[ref[:end]] + ref[end:]
    return m[0]


def unescape_attribute(value: str) -> str:
    """An HTML attribute's value as a browser reads it: ``html.unescape``, but for a
    legacy reference without ``;`` followed by a letter, digit or ``=``, left as it is.

    Example:
        >>> unescape_attribute("q&amp;a&not;r&notes&not.x&#39;")
        "q&a¬r&notes¬.x'"
    """
    return _CHARREF.sub(_attribute_reference, value) if "&" in value else value


def page_links(url: str, text: str, *, simple_links: bool = True) -> list[str]:
    """The links of listing page ``url`` (its HTML ``text``) that may be its entries, as
    URLs, sorted: each resolved against the page as a browser does (HTML entities
    unescaped as in an attribute: ``q&amp;a`` is ``q&a``, ``r&notes`` itself), ``url``
    taken for a folder. An http(s) URL or a path from the server's root is kept only
    below ``url`` (same scheme, host, port and percent-decoded path segments, as
    :func:`~torchgrain.io.paths.is_inside` compares them: ``/my%20data/a.x`` is below
    ``http://h/my data/``); any other link is relative (``https_logs.parquet`` too:
    fsspec took every link starting with ``http`` for another site's, and its file was
    lost; ``a:b.parquet`` too, a name, not a scheme) and is kept wherever it resolves,
    but ``..``: the listing's caller confines what it finds. As for a browser, a link in a
    comment or a ``<script>``/``<style>`` is none, spaces around an ``href`` and a
    ``#fragment`` are not part of its URL, and a link to the page itself is no entry.

    Example:
        >>> page = '<a href="https_logs.x">h</a> <a href="q&amp;a.x">q</a> <a href="../">up</a>'
        >>> page += '<a href="/d/s/">s</a> <a href="http://other/d/b.x">o</a> <a href="a:b.x">'
        >>> page_links("http://h/d", page)
        ['http://h/d/a:b.x', 'http://h/d/https_logs.x', 'http://h/d/q&a.x', 'http://h/d/s/']
    """
    text = _NOT_MARKUP.sub("", text)
    hrefs = [
        unescape_attribute(href).strip(" \t\n\f\r")
        for tag in _A_TAG.findall(text)
        if (href := _href(tag))
    ]
    if simple_links:
        hrefs += map(html.unescape, _BARE_URL.findall(text))  # (text, not an attribute)
    folder = url.rstrip("/") + "/"
    root = _paths.url_key(folder)
    out = set()
    for link in hrefs:
        link = link.partition("#")[0]  # (a fragment is never sent: "a.x#sha256=..." is a.x)
        if _ABSOLUTE.match(link):
            got = urljoin(folder, link)
            if got.startswith(folder) and len(got) > len(folder):
                out.add(got)  # (the common case, without decoding)
                continue
            key = _paths.url_key(got) if _HTTP_SCHEME.match(got) else None
            if (
                root is not None
                and key is not None
                and key[0] == root[0]
                and key[1][: len(root[1])] == root[1]
                and len(key[1]) > len(root[1])
            ):
                out.add(got)
        elif link not in ("..", "../"):  # (an FTP-like parent)
            out.add(urljoin(folder, "./" + link))  # ("./": a colon in a name is no scheme)
    out.discard(folder)  # ("#top", "./": the page itself)
    return sorted(out)


async def _http_listing(fs: Any, url: str, *, page_limit: int) -> tuple[list[str], bool]:
    """The links of page ``url`` (:func:`page_links`; for a URL ending in ``/`` with none,
    those of the URL without it, as fsspec lists), and whether it is a folder's page even
    without any: one at a URL ending in ``/``, asked or redirected to (an empty folder's
    listing has no link but ``../``, and is no file; a file served as ``text/html`` by a
    server's wrong default type has none either, and is a file)."""
    if fs.use_listings_cache and url in fs.dircache:
        return [e["name"] for e in fs.dircache[url]], url.endswith("/")
    names = []
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), **fs.kwargs) as r:
        fs._raise_not_found_for_status(r, url)
        mimetype = r.headers.get("Content-Type")
        if mimetype is not None:
            mimetype = mimetype.partition(";")[0].strip().lower()
        folder = url.endswith("/") or str(r.url).endswith("/")
        if mimetype in ("text/html", None):
            try:
                text = await r.text(errors="ignore")
                names = page_links(url, text, simple_links=fs.simple_links)
            except UnicodeDecodeError:
                pass  # binary, not HTML
    if not names and url.endswith("/"):
        names = await _http_ls(fs, url.rstrip("/"), detail=False, page_limit=page_limit)
    fs.dircache[url] = [_entry(n) for n in names]
    return names, folder


async def _http_ls(
    fs: Any, url: str, detail: bool = True, *, page_limit: int, **kwargs: Any
) -> list[Any]:
    """fsspec's HTTP ``ls``, its links read by :func:`page_links` (the page read by
    fsspec's session, capped at ``page_limit`` by :func:`torchgrain.io.remote._client`)."""
    names, _ = await _http_listing(fs, url, page_limit=page_limit)
    return [_entry(n) for n in names] if detail else names


def _entry(name: str) -> dict[str, Any]:
    return {"name": name, "size": None, "type": "directory" if name.endswith("/") else "file"}


async def _http_isdir(fs: Any, path: str, *, page_limit: int) -> bool:
    """fsspec's HTTP ``isdir``: whether ``path`` is a page of links, or a folder's page
    with none (:func:`_http_listing`: an empty folder is a dataset without files, its
    page never read as one)."""
    try:
        names, folder = await _http_listing(fs, path, page_limit=page_limit)
    except (FileNotFoundError, ValueError):
        return False
    return bool(names) or folder


_S3_READS: dict[str, Callable[..., Awaitable[Any]]] = {
    "cat_file": _s3_cat_file,
    "cat_ranges": functools.partial(_cat_ranges, _s3_cat_file),
}
_HTTP_READS: dict[str, Callable[..., Awaitable[Any]]] = {
    "head": _http_head,
    "ls": _http_ls,
    "isdir": _http_isdir,
    "cat_file": _http_cat_file,
    "cat_ranges": functools.partial(_cat_ranges, _http_cat_file),
    "get_file": _http_get_file,
}


def request_coroutine(fs: Any, method: str, *, page_limit: int) -> Callable[..., Awaitable[Any]]:
    """The coroutine function making request ``method`` (``"cat_file"``, ``"cat_ranges"``,
    ``"head"``...) on async filesystem ``fs``: torchgrain's own on HTTP(S) and S3, where
    fsspec's would buffer a whole body before anyone can check its length (a body read
    with a byte cap, ``page_limit`` for one without a range; a range answer checked by
    :func:`check_range_answer`), else ``fs._<method>``.

    Example:
        >>> from fsspec.implementations.http import HTTPFileSystem
        >>> request_coroutine(HTTPFileSystem(), "cat_file", page_limit=1 << 20).func.__name__
        '_http_cat_file'
    """
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    reads = _S3_READS if {"s3", "s3a"} & set(protocols) else _HTTP_READS if is_http(fs) else {}
    own = reads.get(method)
    if own is None:
        return getattr(fs, "_" + method)
    return functools.partial(own, fs, page_limit=page_limit)
