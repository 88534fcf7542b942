"""Every request torchgrain makes to remote storage: with deadlines, checked, and confined.

A remote server may be slow, broken or hostile; this module is the one place where
torchgrain talks to fsspec about remote files, so that every request has a deadline
(:func:`storage_options_with_deadlines`, and a cancel after the request's own time limit),
every body has the length asked for and is never buffered past it, a range answer is the
range asked of the file opened (:func:`pin`,
:func:`~torchgrain.io.responses.check_range_answer`), redirects stay put, and a forked
child leaves the parent's connections alone (:mod:`torchgrain.io.loops`).
:func:`open_input` gives Parquet and TFRecord readers a file object whose reads are range
requests made here. Design notes: docs/design-notes.md#io-remote.

Local and in-memory filesystems are called directly: none of this costs them anything.
The checks on what a server sends back are in :mod:`torchgrain.io.responses`.

Example:
    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe("/r/f", b"0123456789")
    >>> cat_file(fs, "/r/f", 2, 5)
    b'234'
    >>> f = open_input(fs, "/r/f")
    >>> _ = f.seek(7); f.read()
    b'789'
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import numbers
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.callbacks import Callback
from fsspec.exceptions import FSTimeoutError

from torchgrain.errors import CorruptDataError, RemoteIOError, UnsafePathError
from torchgrain.io import loops  # noqa: F401  (its fork hook: see the module docstring)
from torchgrain.io.paths import is_http
from torchgrain.io.responses import (
    Pin,
    RangeAnswerError,
    ResponseSizeError,
    check_file_answer,
    differ,
    pinned,
    read_capped,
    request_coroutine,
    restore,
    too_long,
)
from torchgrain.io.responses import pin as _pin
from torchgrain.io.responses import unchanged_since as _unchanged_since
from torchgrain.io.retry import (
    RequestTimeout,
    RetryPolicy,
    current_policy,
    http_status,
    in_operation,
    is_transient,
    is_transient_status,
    permanent_error,
    remaining_seconds,
    request_done,
    retry_call,
)

__all__ = [
    "CappedS3Session",
    "RemoteFile",
    "ResponseSizeError",
    "call",
    "carrying",
    "cat_file",
    "cat_ranges",
    "check_length",
    "exists",
    "file_size",
    "get_file",
    "held_pins",
    "isdir",
    "isfile",
    "open_input",
    "pin",
    "pins_of",
    "redirect_refusal",
    "replaced_pins",
    "restore_pins",
    "storage_options_with_deadlines",
]

T = TypeVar("T")

#: Read-ahead buffer of a remote file (fsspec's HTTP files read 5 MB blocks): a read
#: that misses it fetches at least this much from where it starts.
REMOTE_BUFFER = 4 << 20


#: The most bytes read of an HTTP(S) response to a request without a byte range (a
#: directory listing page): a listing of 100,000 files is a few MiB.
MAX_PAGE_BYTES = 32 << 20


# ------------------------------------------------------------------- transport settings
def storage_options_with_deadlines(
    protocol: str,
    storage_options: dict[str, Any] | None,
    policy: RetryPolicy | None = None,
    *,
    allow_redirects: bool = False,
) -> dict[str, Any]:
    """``storage_options`` with the policy's transport timeouts added where the user set
    none: for ``http``/``https`` an ``aiohttp.ClientTimeout`` (connect, between bytes; no
    total, which the per-request deadline gives) and a client that reads bodies with a
    byte cap (see the module docstring) and refuses redirects unless ``allow_redirects``
    (a ``get_client`` of your own replaces both); for ``s3``/``s3a`` botocore's
    ``connect_timeout`` and ``read_timeout``, and an HTTP session that reads the answers
    botocore reads whole with the same cap (:class:`CappedS3Session`). Other protocols are
    returned unchanged (their requests still get the per-request deadline).

    Example:
        >>> opts = storage_options_with_deadlines("s3", {"anon": True})
        >>> opts["anon"], opts["config_kwargs"]["read_timeout"]
        (True, 20.0)
        >>> storage_options_with_deadlines("s3", {"config_kwargs": {"read_timeout": 5}})
        {'config_kwargs': {'read_timeout': 5, 'connect_timeout': 10.0, 'max_pool_connections': 256, 'http_session_cls': <class 'torchgrain.io.remote.CappedS3Session'>}}
    """
    policy = policy or current_policy()
    opts = dict(storage_options or {})
    if protocol in ("http", "https"):
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=None,  # a download may take long: the per-request deadline covers it
            sock_connect=policy.connect_timeout,
            sock_read=policy.read_timeout,
        )
        opts["client_kwargs"] = {"timeout": timeout, **(opts.get("client_kwargs") or {})}
        opts.setdefault("get_client", _client_following_redirects if allow_redirects else _client)
    elif protocol in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", float(policy.connect_timeout))
        config.setdefault("read_timeout", float(policy.read_timeout))
        # botocore keeps 10 connections unless told: a source's max_inflight needs more.
        config.setdefault("max_pool_connections", MAX_CONNECTIONS)
        if _takes_http_session_cls():
            config.setdefault("http_session_cls", CappedS3Session)
        opts["config_kwargs"] = config
    return opts


@functools.cache
def _takes_http_session_cls() -> bool:
    # aiobotocore's AioConfig takes http_session_cls since 2.12.2 (3.10.0 in
    # scripts/constraints.txt); an older one reads listings whole, as before.
    import inspect

    from aiobotocore.config import AioConfig

    return "http_session_cls" in inspect.signature(AioConfig).parameters


class CappedS3Session:
    """aiobotocore's HTTP session (``AioConfig(http_session_cls=...)``), whose answers
    botocore reads whole (a listing, an error, any answer but an object's body) are read
    with a byte cap: more than :data:`MAX_PAGE_BYTES` is a :class:`ResponseSizeError`
    naming the URL, given up before the rest is read (aiobotocore held a whole endless
    listing). An object's body is left to its reader (:func:`torchgrain.io.responses.
    request_coroutine` reads it capped). A class of this module, so that a filesystem's
    options pickle; what it makes is an ``aiobotocore.httpsession.AIOHTTPSession`` whose
    ``send`` reads the body itself: a hook on aiobotocore's session API (its ``send``, the
    request's ``stream_output``, the response's ``_content``; checked against 3.10.0)."""

    def __new__(cls, **kwargs: Any) -> Any:
        return _capped_s3_session()(**kwargs)


@functools.cache
def _capped_s3_session() -> type:
    from aiobotocore.httpsession import AIOHTTPSession

    class Session(AIOHTTPSession):
        async def send(self, request: Any) -> Any:
            stream = request.stream_output
            request.stream_output = True  # aiobotocore's send then leaves the body unread
            try:
                response = await super().send(request)
            finally:
                request.stream_output = stream
            if stream and response.status_code < 300:
                return response  # an object's body, for its reader
            raw = response.raw
            why = (
                f"{request.url}: the answer holds more than {MAX_PAGE_BYTES} bytes, the most "
                "torchgrain reads of a listing or an error (remote.MAX_PAGE_BYTES)"
            )
            # (a HEAD answer's Content-Length is the object's, and it has no body)
            declared = None if request.method == "HEAD" else raw.content_length
            # what botocore's parser reads
            response._content = await _read_whole(raw, MAX_PAGE_BYTES, declared, why)
            return response

    return Session


async def _read_whole(response: Any, limit: int, declared: int | None, why: str) -> bytes:
    """The body of aiohttp ``response`` (its ``content``), read with a byte cap
    (:func:`read_capped`), as ``bytes`` (as aiohttp's own read gives it: a body in pieces
    comes as a bytearray); the response is closed if the read fails (the rest of the body
    is never read)."""
    try:
        return bytes(await read_capped(response.content.read, limit, declared, why=why))
    except BaseException:
        response.close()
        raise


class _RedirectRefused(UnsafePathError, PermissionError):
    """A server redirected a request away from the URL asked for.

    A :class:`PermissionError` as well, so that fsspec's HTTP ``isdir`` (which treats a
    ``ValueError`` as "not a directory") lets it through.
    """


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


async def _client(**kwargs: Any) -> Any:
    """An ``aiohttp.ClientSession`` (what fsspec's HTTP filesystem uses) whose responses
    are read with a byte cap, and that refuses redirects, except from a directory's URL to
    the same URL with a trailing slash."""
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(_on_redirect)
    kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or []), trace]
    return await _client_following_redirects(**kwargs)


#: Connections one process keeps to a server (aiohttp's default is 100): enough for a
#: source's ``max_inflight`` requests at once, which bounds how many are in flight.
MAX_CONNECTIONS = 256


async def _client_following_redirects(**kwargs: Any) -> Any:
    """:func:`_client` for a server the user trusts: redirects are followed."""
    import aiohttp

    if "connector" not in kwargs:
        kwargs["connector"] = aiohttp.TCPConnector(limit=MAX_CONNECTIONS)
    return aiohttp.ClientSession(response_class=_capped_response(), **kwargs)


_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


@functools.cache
def _capped_response() -> type:
    """The ``aiohttp.ClientResponse`` of :func:`_client` (made on first use: aiohttp is
    only needed for HTTP(S))."""
    import aiohttp

    class CappedResponse(aiohttp.ClientResponse):
        """A response whose body is read in pieces, and given up as soon as it holds more
        than the request's ``Range`` asked for (without one, :data:`MAX_PAGE_BYTES`):
        fsspec reads whole bodies before torchgrain can look at them."""

        async def read(self) -> bytes:
            if self._body is None:
                asked = _RANGE.fullmatch(self.request_info.headers.get("Range", ""))
                if asked and self.status < 300:  # an error's page is no answer to the range
                    start, end = int(asked[1]), int(asked[2]) + 1
                    limit, why = end - start, too_long(str(self.url), start, end)
                else:
                    limit = MAX_PAGE_BYTES
                    why = (
                        f"{self.url}: the response holds more than {limit} bytes, the most "
                        "torchgrain reads of a page (remote.MAX_PAGE_BYTES)"
                    )
                self._body = await _read_whole(self, limit, self.content_length, why)
            return await super().read()

    return CappedResponse


# ------------------------------------------------------------------------- requests
def redirect_refusal(exc: BaseException) -> UnsafePathError | None:
    """The refused redirect behind ``exc`` (raised from it), or None: fsspec reports one
    as "not found" (its HTTP ``info`` turns every failure into FileNotFoundError), and it
    must not be taken for a missing file.

    Example:
        >>> redirect_refusal(FileNotFoundError("x")) is None
        True
        >>> try:
        ...     raise FileNotFoundError("h://x/a") from UnsafePathError("redirected")
        ... except FileNotFoundError as e:
        ...     redirect_refusal(e)
        UnsafePathError('redirected')
    """
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, UnsafePathError):
            refusal = type(cause)(*cause.args)
            refusal.__cause__ = exc
            return refusal
        cause = cause.__cause__ or cause.__context__
    return None


def call(
    fs: fsspec.AbstractFileSystem,
    method: str,
    *args: Any,
    url: str | None = None,
    what: str = "request",
    nbytes: int = 0,
    check: Callable[[Any], None] | None = None,
    **kwargs: Any,
) -> Any:
    """``fs.<method>(*args, **kwargs)`` with a deadline, and ``check(result)`` after it.

    On an async filesystem the request is cancelled after
    :meth:`~torchgrain.io.retry.RetryPolicy.request_seconds` of ``nbytes`` (cut to the
    operation's time left), raising :class:`~torchgrain.io.retry.RequestTimeout`; outside
    a retried operation the call is retried on its own (:func:`current_policy`). Other
    filesystems (local, memory) are called directly.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/x", b"abc")
        >>> call(fs, "size", "/c/x")
        3
    """
    label = url or str(args[0] if args else "")
    direct = not isinstance(fs, AsyncFileSystem) or fs.asynchronous

    def attempt() -> Any:
        try:
            out = getattr(fs, method)(*args, **kwargs) if direct else request()
        except Exception as e:  # (a chain's layers, simplecache::http, are direct)
            refusal = redirect_refusal(e) if isinstance(e, FileNotFoundError) else None
            if refusal is not None:
                raise refusal from e
            if _redirects_loop(e):  # (fsspec says "not found", or aiohttp's own error)
                raise RemoteIOError(f"{what} of {label}: the server's redirects go round") from e
            raise
        if check is not None:
            check(out)
        return out

    def request() -> Any:
        # One request through fsspec's ``sync``, cancelled when its time is up.
        seconds, own, policy = remaining_seconds(nbytes)
        if seconds <= 0:
            raise RequestTimeout(
                f"{what} of {label}: the operation's {policy.deadline:g} s deadline has passed"
            )
        try:
            out = sync(
                fs.loop,
                request_coroutine(fs, method, page_limit=MAX_PAGE_BYTES),
                *args,
                timeout=seconds,
                **kwargs,
            )
            request_done(nbytes)  # progress: the operation may take that much longer
            return out
        except FSTimeoutError as e:
            limit = (
                f"its {own:.3g} s limit (RetryPolicy.request_timeout)"
                if seconds >= own
                else f"the {seconds:.3g} s left of the operation's deadline (RetryPolicy.deadline)"
            )
            raise RequestTimeout(f"{what} of {label} did not complete within {limit}") from e

    if direct or in_operation():
        return attempt()
    return retry_call(attempt, url=label, what=what)


# ------------------------------------------------------------------------- probes
# fsspec's own probes answer "no" when a request fails: HTTP ``exists``/``isfile`` say a
# file answering 503 does not exist, the generic async ``isfile`` swallows every
# exception, ``isdir`` every OSError (timeouts included). A flaky server would then make
# a dataset "not exist". These ask ``info`` (or, for an HTTP directory, its listing) and
# let transient failures be retried; only "not found" is a "no".
def _answers_itself(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs``'s own probes can be taken at their word: a local or in-memory
    filesystem's. A chain's (``simplecache::http``) swallow a remote layer's failures, a
    refused redirect included: those ask ``info`` too."""
    return not isinstance(fs, AsyncFileSystem) and not isinstance(
        getattr(fs, "fs", None), fsspec.AbstractFileSystem
    )


def _info_or_none(fs: fsspec.AbstractFileSystem, path: str, url: str | None, **kwargs: Any) -> Any:
    """``fs.info(path, **kwargs)`` (see :func:`call`), or None for a missing file."""
    try:
        return call(fs, "info", path, url=url or path, what="lookup", **kwargs)
    except FileNotFoundError as e:
        if is_transient(e):
            raise  # inside an operation: it retries (fsspec reports a 503 on HEAD this way)
        return None


def exists(fs: fsspec.AbstractFileSystem, path: str, *, url: str | None = None) -> bool:
    """Whether ``path`` exists; a failing server is retried, not taken for a "no".

    Example:
        >>> import fsspec
        >>> exists(fsspec.filesystem("memory"), "/nowhere/x")
        False
    """
    if _answers_itself(fs):
        return fs.exists(path)
    return _info_or_none(fs, path, url) is not None


def isfile(fs: fsspec.AbstractFileSystem, path: str, *, url: str | None = None) -> bool:
    """Whether ``path`` is a file (see :func:`exists`).

    Example:
        >>> import fsspec
        >>> isfile(fsspec.filesystem("memory"), "/nowhere/x")
        False
    """
    if _answers_itself(fs):
        return fs.isfile(path)
    info = _info_or_none(fs, path, url)
    return info is not None and info.get("type", "file") == "file"


def isdir(fs: fsspec.AbstractFileSystem, path: str, *, url: str | None = None) -> bool:
    """Whether ``path`` is a directory (on HTTP(S): a page listing links; see :func:`exists`).

    Example:
        >>> import fsspec
        >>> isdir(fsspec.filesystem("memory"), "/nowhere")
        False
    """
    if not isinstance(fs, AsyncFileSystem):
        return fs.isdir(path)
    if is_http(fs):
        if _http_file(fs, path, url or path):
            return False  # a file: never fetched to find out (it may be GiBs)
        # A page of links, or a server whose HEAD says nothing: listing it is the only
        # way to tell; its own failures are not swallowed.
        return bool(call(fs, "isdir", path, url=url or path, what="listing"))
    info = _info_or_none(fs, path, url)
    return info is not None and info.get("type") == "directory"


def _http_file(fs: fsspec.AbstractFileSystem, path: str, label: str) -> bool:
    """Whether a ``HEAD`` says ``path`` is a file: answered ``200`` with a size, not at a
    URL ending in ``/``, and not an HTML page (a directory's listing is one, served with
    ``Accept-Ranges: bytes`` or not; a file may come without any ``Content-Type``).
    fsspec's HTTP ``isdir`` would GET the whole file and look for links in it. A server
    that refuses ``HEAD`` is asked as before; a busy one is retried."""
    if not path or path.endswith("/"):
        return False

    def busy(answer: dict[str, Any]) -> None:
        if is_transient_status(answer["status"]):  # retried, as any request is
            raise ConnectionError(f"HEAD of {label}: HTTP {answer['status']}")

    try:
        head = call(fs, "head", path, url=label, what="lookup", check=busy)
    except Exception as e:
        if is_transient(e) or isinstance(e, UnsafePathError):
            raise
        return False
    headers = {k.lower(): v for k, v in head["headers"].items()}
    # An HTML page is listed, whether or not it serves byte ranges: a directory's listing
    # served as a static file (an index.html, a CDN) says Accept-Ranges: bytes too.
    page = (
        str(headers.get("content-type", "")).lower().startswith(("text/html", "application/xhtml"))
    )
    return (
        head["status"] == 200
        and not str(head["url"]).endswith("/")
        and str(headers.get("content-length", "")).isdigit()
        and not page
    )


def _lookup(fs: fsspec.AbstractFileSystem, method: str, path: str, label: str, what: str) -> Any:
    """``call(fs, method, path)``, whose refusal (400, 401, 403) is raised as one: fsspec's
    HTTP ``info`` reports any failed answer as FileNotFoundError, and a refused one is not
    a missing file."""
    try:
        return call(fs, method, path, url=label, what=what)
    except FileNotFoundError as e:
        refusal = permanent_error(e, label, what) if http_status(e) in (400, 401, 403) else None
        if refusal is not None:
            raise refusal from e
        raise


def _redirects_loop(exc: BaseException) -> bool:
    """Whether aiohttp's ``TooManyRedirects`` is behind ``exc`` (raised from it)."""
    try:
        from aiohttp import TooManyRedirects
    except ImportError:  # (no HTTP client: nothing redirected)
        return False
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, TooManyRedirects):
        cause = cause.__cause__ or cause.__context__
    return cause is not None


def _checked_size(got: Any, label: str) -> int:
    if isinstance(got, bool) or not isinstance(got, numbers.Integral) or got < 0:
        raise CorruptDataError(
            f"{label}: the server reports no size ({got!r}); reading byte ranges needs one"
        )
    return int(got)


def file_size(fs: fsspec.AbstractFileSystem, path: str, *, url: str | None = None) -> int:
    """The size of ``path`` in bytes (a request with a deadline, see :func:`call`).

    Raises:
        CorruptDataError: the server reports no size (an HTTP server that answers without
            a ``Content-Length``), or not a size: reading byte ranges needs one.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/s", b"abc")
        >>> file_size(fs, "/c/s")
        3
    """
    label = url or path
    return _checked_size(_lookup(fs, "size", path, label, "size lookup"), label)


def size_and_version(
    fs: fsspec.AbstractFileSystem, path: str, *, url: str | None = None
) -> tuple[int, str | None]:
    """The size of remote ``path`` (checked as :func:`file_size` checks it) and what tells
    its versions apart: the store's version id, ETag or modification time, whichever it
    reports first (None: none), from one ``info`` request.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/v", b"abc")
        >>> size, version = size_and_version(fs, "/c/v")
        >>> size, version is not None
        (3, True)
    """
    size, version, _ = size_version_and_etag(fs, path, url=url)
    return size, version


def size_version_and_etag(
    fs: fsspec.AbstractFileSystem, path: str, *, url: str | None = None
) -> tuple[int, str | None, str | None]:
    """:func:`size_and_version`, and the ``ETag`` the store gives (None: none), from the
    same ``info`` request.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/e", b"abc")
        >>> size_version_and_etag(fs, "/c/e")[0]
        3
    """
    label = url or path
    info = _lookup(fs, "info", path, label, "size and version lookup")
    size = _checked_size(info.get("size"), label)
    version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k)), None)
    etag = info.get("ETag") or info.get("etag")
    return size, version, str(etag) if etag else None


# What names a version of a remote file in fsspec's info, the most specific first
# ("Last-Modified": HTTP's, for a server that sends no ETag).
_VERSION_KEYS = ("generation", "version_id", "VersionId", "ETag", "etag", "md5Hash")
_VERSION_KEYS += ("Last-Modified", "mtime", "LastModified", "last_modified", "updated", "created")


def pin(fs: fsspec.AbstractFileSystem, path: str, size: int | None, *, fresh: bool = False) -> None:
    """Pin the size of remote file ``path`` (of ``fs``) as the dataset's opening found it:
    every range answer must name a file of that size (and, once one has given them, the
    same ``ETag`` and ``Last-Modified``), see :func:`torchgrain.io.responses.pin`
    (``fresh``: a size just asked of the server, whose validators are taken anew). Local
    and in-memory files are left alone.

    Example:
        >>> import fsspec
        >>> pin(fsspec.filesystem("memory"), "/c/p", 3)
    """
    if isinstance(fs, AsyncFileSystem):
        _pin(path, size, fresh=fresh)


def pin_opened(
    fs: fsspec.AbstractFileSystem, path: str, size: int, etag: str | None = None
) -> None:
    """Pin remote ``path`` anew as a dataset's opening found it now (see :func:`pin`):
    its size and, where the store gave one, its ``ETag``, so that a reader of what the
    opening indexed refuses an answer of a file replaced since, even one of its size.
    Local and in-memory files are left alone.

    Example:
        >>> import fsspec
        >>> pin_opened(fsspec.filesystem("memory"), "/c/o", 3, '"v1"')
    """
    if isinstance(fs, AsyncFileSystem):
        _pin(path, size, fresh=True)
        if etag:
            check_file_answer(path, size, etag, None, complete=False)


def unchanged_since(fs: fsspec.AbstractFileSystem, path: str, seen: tuple | None) -> tuple | None:
    """For a reader of remote ``path`` that took offsets from it: raise if a later opening
    in this process pinned another version of the file (see
    :func:`torchgrain.io.responses.unchanged_since`); call it with ``None`` when the
    offsets are taken, then after each read with what it returned. Local and in-memory
    files: always ``None``.

    Example:
        >>> import fsspec
        >>> unchanged_since(fsspec.filesystem("memory"), "/c/p", None) is None
        True
    """
    if isinstance(fs, AsyncFileSystem):
        return _unchanged_since(path, seen)
    return None


class Version:
    """The version of remote file ``path`` (of ``fs``) that a reader takes offsets from.

    ``seen``: the ``(size, ETag, Last-Modified)`` a source's opening read. It is checked
    against this process's pin now: a later opening that pinned another version refuses
    the reader at once, and the reader never pins another size over it (it pins ``size``
    only of a file nothing has pinned). None: the reader read nothing of the file yet;
    ``size`` is pinned (:func:`pin`; ``fresh``: taken anew, an opening of the file as it
    is now) and the version is the one its first read finds.

    :meth:`check`, after each read, raises a :class:`~torchgrain.RemoteIOError` once a later opening in this
    process has pinned another version (see :func:`unchanged_since`).
    Local and in-memory files: never raises.

    Example:
        >>> import fsspec
        >>> v = Version(fsspec.filesystem("memory"), "/c/p", 3, None)
        >>> v.check(), v.seen
        (None, None)
    """

    def __init__(
        self, fs: Any, path: str, size: int | None, seen: tuple | None, fresh: bool = False
    ) -> None:
        self.fs, self.path = fs, path
        if seen is None:
            pin(fs, path, size, fresh=fresh)
        else:
            if seen[0] is None and size is not None:
                seen = (int(size), *seen[1:])
            seen = unchanged_since(fs, path, seen)  # (raises: another version pinned since)
            if seen is not None and pinned(path) is None:
                pin(fs, path, seen[0])
        self.seen = seen

    def check(self) -> None:
        """Raise if this process has pinned another version of the file than the reader's.
        Where it was given none, the first call takes what this process pins then as the
        reader's version: called right after the first read (whose answer the pin checked
        or set), a later opening that pins another version refuses the reader instead of
        becoming its version (records of both versions)."""
        self.seen = unchanged_since(self.fs, self.path, self.seen)


def held_pins(fs: fsspec.AbstractFileSystem, paths: Sequence[str]) -> list[Any] | None:
    """What this process has pinned of remote files ``paths`` of ``fs`` now (None for a
    file it has not), kept by a source as its opening left them: a later opening of a
    file replaced since pins a new one, never changing these (see :func:`pins_of`).
    Local and in-memory files: None.

    Example:
        >>> import fsspec
        >>> held_pins(fsspec.filesystem("memory"), ["/c/p"]) is None
        True
    """
    if not isinstance(fs, AsyncFileSystem):
        return None
    return [pinned(fs._strip_protocol(p)) for p in paths]


def pins_of(
    fs: fsspec.AbstractFileSystem, paths: Sequence[str], held: list[Any] | None = None
) -> list[tuple | None] | None:
    """What a source knows of the versions of remote files ``paths`` of ``fs`` (size,
    ``ETag``, ``Last-Modified``; None for a file it knows nothing of), for its pickle: a
    spawned worker restores them (:func:`restore_pins`) as a forked one inherits them,
    and refuses a file replaced on the server since the opening. ``held``: the pins
    the source kept (:func:`held_pins`), those of its own opening, whatever a later
    opening in this process pinned since; a file it has none of takes (and keeps, in
    ``held``) this process's pin of it now. Local and in-memory files: None.

    Example:
        >>> import fsspec
        >>> pins_of(fsspec.filesystem("memory"), ["/c/p"]) is None
        True
    """
    if not isinstance(fs, AsyncFileSystem):
        return None
    # Equal values are one object, pickled once: files written in the same second share a
    # Last-Modified, files of one size and no validator yet share a pin (8 -> 2 bytes).
    same: dict[Any, Any] = {}

    def one(k: int, path: str) -> tuple | None:
        got = held[k] if held is not None else None
        if got is None:
            got = pinned(fs._strip_protocol(path))
            if held is not None:
                held[k] = got
        if got is None:
            return None
        pin = (got.size, *(same.setdefault(v, v) for v in (got.etag, got.modified)))
        return same.setdefault(pin, pin)

    return [one(k, p) for k, p in enumerate(paths)]


def replaced_pins(
    fs: fsspec.AbstractFileSystem, paths: Sequence[str], pins: list[tuple | None] | None
) -> list[int] | None:
    """Where :func:`pins_of`'s ``pins`` of ``paths`` are not what this process pins now:
    versions a later opening here replaced (a file re-uploaded since), which a copy of
    the source holds but never pins in its process (see :func:`restore_pins`). None: none.

    Example:
        >>> from fsspec.implementations.http import HTTPFileSystem
        >>> fs = HTTPFileSystem()
        >>> pin(fs, "http://h/q", 3)
        >>> replaced_pins(fs, ["http://h/q"], [(3, None, None)]) is None
        True
        >>> replaced_pins(fs, ["http://h/q"], [(4, None, None)])
        [0]
    """
    out = []
    for k, (path, held) in enumerate(zip(paths, pins or ())):
        now = pinned(fs._strip_protocol(path)) if held is not None else None
        if now is not None and differ(held, (now.size, now.etag, now.modified)):
            out.append(k)
    return out or None


def restore_pins(
    fs: fsspec.AbstractFileSystem,
    paths: Sequence[str],
    pins: list[tuple | None] | None,
    replaced: Sequence[int] | None = None,
) -> list[Any] | None:
    """Pin in this process what :func:`pins_of` found of ``paths`` in another, where this
    one has pinned nothing of them yet; return the versions the unpickled source holds
    (as :func:`held_pins` does): those pickled. The versions ``replaced`` there by a later
    opening (:func:`replaced_pins`) are held, never pinned or checked here: as in the
    process it was pickled in, the source is refused when it reads such a file
    (:class:`Version`), and other sources of the file read. A version pinned here only
    by another unpickled source (no answer read it yet) refuses neither: the first answer
    decides which source reads (see :func:`torchgrain.io.responses.restore`). ``pins``
    None (local files): what this process pins now.

    Raises:
        RemoteIOError: this process has read or opened another version of one of the
            other files (a later opening of a file replaced since), naming its URL:
            offsets taken from one version never index the other.

    Example:
        >>> from fsspec.implementations.http import HTTPFileSystem
        >>> fs = HTTPFileSystem()
        >>> held = restore_pins(fs, ["http://h/r"], [(3, '"v1"', None)])
        >>> pins_of(fs, ["http://h/r"]), held == held_pins(fs, ["http://h/r"])
        ([(3, '"v1"', None)], True)
        >>> old = restore_pins(fs, ["http://h/r"], [(3, '"v0"', None)], replaced=[0])
        >>> pins_of(fs, ["http://h/r"]), pins_of(fs, ["http://h/r"], old)
        ([(3, '"v1"', None)], [(3, '"v0"', None)])
        >>> from torchgrain.io.responses import check_file_answer
        >>> check_file_answer("http://h/r", 3, '"v1"', None)  # an answer read here
        >>> restore_pins(fs, ["http://h/r"], [(3, '"v0"', None)])
        Traceback (most recent call last):
        ...
        torchgrain.errors.RemoteIOError: http://h/r: this process has read another version of the file (size, ETag, Last-Modified: (3, '"v1"', None)) than the dataset's opening did ((3, '"v0"', None)): the file changed on the server since; open the dataset again
    """
    if pins is None:
        return held_pins(fs, paths)
    skip = set(replaced or ())
    held: list[Any] = []
    for k, (path, version) in enumerate(zip(paths, pins)):
        if version is None:
            held.append(None)  # (the version its first read finds: see ShardedSource._io)
            continue
        key = fs._strip_protocol(path)
        if k not in skip:
            try:
                restore(key, version)
            except RangeAnswerError:
                now = pinned(key)
                raise RemoteIOError(
                    f"{path}: this process has read another version of the file (size, "
                    f"ETag, Last-Modified: {now and (now.size, now.etag, now.modified)}) "
                    f"than the dataset's opening did ({version}): the file changed on the "
                    "server since; open the dataset again"
                ) from None
        now = pinned(key)
        same = now is not None and (now.size, now.etag, now.modified) == version
        held.append(now if same else Pin(*version))
    return held


def check_length(
    fs: fsspec.AbstractFileSystem, path: str, start: int, end: int, got: int, label: str
) -> None:
    """Check that ``got`` bytes came back for bytes ``[start, end)`` of ``path`` (named
    ``label``): more is a :class:`ResponseSizeError` (transient); fewer is a
    :class:`~torchgrain.CorruptDataError` when the file is shorter (its size asked of
    ``fs``), else a :class:`ResponseSizeError`.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/l", b"abc")
        >>> check_length(fs, "/c/l", 0, 3, 3, "memory://c/l")
        >>> check_length(fs, "/c/l", 1, 5, 2, "memory://c/l")
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: memory://c/l: file is truncated: 3 bytes, so bytes 1-5 are missing
    """
    want = end - start
    if got == want:
        return
    if got > want:
        raise ResponseSizeError(
            f"{label}: {got} bytes came back for a range of {want} (bytes {start}-{end}): the "
            "server does not honour Range requests, or the response is corrupt"
        )
    size = call(fs, "size", path, url=label, what="size lookup")
    if size is not None and int(size) < end:
        raise CorruptDataError(
            f"{label}: file is truncated: {int(size)} bytes, so bytes {start}-{end} are missing"
        )
    raise ResponseSizeError(
        f"{label}: the response for bytes {start}-{end} ended after {got} of {want} bytes"
    )


def cat_file(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int | None = None,
    end: int | None = None,
    *,
    url: str | None = None,
    what: str = "read",
    limit: int | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of ``path`` (all of it without a range), exactly those.

    ``limit`` (for a whole-file read) fails a file larger than it before reading it.

    Raises:
        CorruptDataError: the file is shorter than the range (the server answered 416 or
            400), or larger than ``limit``.
        ResponseSizeError: (transient; inside an operation) the response's length is wrong.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/y", b"abcdef")
        >>> cat_file(fs, "/c/y", 4, 9)
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: /c/y: file is truncated: 6 bytes, so bytes 4-9 are missing
    """
    label = url or path
    if start is None and end is None:
        if limit is None:
            return call(fs, "cat_file", path, url=label, what=what)
        total = file_size(fs, path, url=label)
        if total > limit:
            raise CorruptDataError(f"{label} is {total} bytes, more than the {limit} allowed")
        # The file as it is now (a manifest rewritten since an earlier read is read anew).
        pin(fs, path, total, fresh=True)
        start, end = 0, total
    assert start is not None and end is not None
    if start >= end:
        return b""
    try:
        return call(
            fs,
            "cat_file",
            path,
            start=start,
            end=end,
            url=label,
            what=what,
            nbytes=end - start,
            check=lambda out: check_length(fs, path, start, end, len(out), label),
        )
    except Exception as exc:
        # A range past the file's end (416; 400 from some stores): the file is shorter
        # than the size it was read at, as cat_ranges says of the same answer.
        if http_status(exc) not in (400, 416):
            raise
        raise refused(exc, label, start, end) from exc


def cat_ranges(
    fs: fsspec.AbstractFileSystem,
    path: str,
    starts: Sequence[int],
    ends: Sequence[int],
    *,
    url: str | None = None,
    what: str = "range read",
) -> list[bytes]:
    """Bytes ``[starts[i], ends[i])`` of ``path`` for each ``i``, requested together.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/z", b"0123456789")
        >>> cat_ranges(fs, "/c/z", [0, 8], [2, 10])
        [b'01', b'89']
    """
    label = url or path
    starts, ends = list(starts), list(ends)

    def check(blobs: list[Any]) -> None:
        for s, e, blob in zip(starts, ends, blobs):
            if isinstance(blob, BaseException):
                if (
                    is_transient(blob)
                    or http_status(blob) in (401, 403, 404, 410)
                    or isinstance(blob, (FileNotFoundError, PermissionError))
                ):
                    raise blob  # retried, or named by the operation (not found, denied)
                raise refused(blob, label, s, e) from blob
            check_length(fs, path, s, e, len(blob), label)

    return call(
        fs,
        "cat_ranges",
        [path] * len(starts),
        starts,
        ends,
        url=label,
        what=what,
        nbytes=sum(e - s for s, e in zip(starts, ends)),
        check=check,
    )


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


def get_file(
    fs: fsspec.AbstractFileSystem, rpath: str, lpath: str, *, nbytes: int, url: str | None = None
) -> None:
    """Download ``rpath`` to the local file ``lpath`` (``nbytes`` long: its deadline grows
    with it). The caller checks the size and content of what arrived.

    A download is stopped (a transient failure, retried) as soon as it brings more than
    ``nbytes`` (a server sending an endless body would fill the disk), or falls behind
    ``min_rate`` after its first ``request_timeout`` seconds (a server trickling a few
    bytes now and then never trips the transport's read timeout, and a shard's deadline is
    long).

    Example:
        >>> import fsspec, os, tempfile
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/d", b"xyz")
        >>> local = os.path.join(tempfile.mkdtemp(), "d")
        >>> get_file(fs, "/c/d", local, nbytes=3)
        >>> open(local, "rb").read()
        b'xyz'
    """
    label = url or rpath
    seconds, _, policy = remaining_seconds(0)
    guard = _DownloadGuard(nbytes, label, grace=min(policy.request_timeout, seconds), policy=policy)
    call(fs, "get_file", rpath, lpath, url=label, what="download", nbytes=nbytes, callback=guard)


# ----------------------------------------------------------------------- file objects
class RemoteFile(io.RawIOBase):
    """A remote file as a seekable binary file whose every read is one checked range
    request with a deadline (:func:`cat_file`).

    Args:
        fs: the filesystem.
        path: the file's path on ``fs``.
        size: its size in bytes, when known (else asked for once); pinned (:func:`pin`).
        url: the name used in errors.
        fresh: an opening of the file as it is now (an index build): a size asked now and
            the validators of this file's answers are pinned anew (:func:`pin`).

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/f", b"0123456789")
        >>> f = RemoteFile(fs, "/c/f")
        >>> f.seek(-3, 2), f.read(2), f.tell(), f.read()
        (7, b'78', 9, b'9')
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        *,
        size: int | None = None,
        url: str | None = None,
        fresh: bool = False,
        seen: tuple | None = None,
    ) -> None:
        super().__init__()
        self._fs = fs
        self._path = path
        self.name = url or path
        self._size = int(file_size(fs, path, url=self.name) if size is None else size)
        # fresh: an opening that reads the file as it is now (an index build after the
        # file was replaced by one of the same size reads the new one); a read at offsets
        # found earlier keeps the pinned validators.
        self._version = Version(fs, path, self._size, seen, fresh and size is None)
        self._pos = 0
        self._context: contextvars.Context | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence] + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        context = self._context
        if context is not None and not in_operation():
            # Called from a reader's own thread (Arrow reads on its I/O threads): keep to
            # the operation that asked for the read (see carrying()).
            data = context.copy().run(cat_file, self._fs, self._path, self._pos, end, url=self.name)
        else:
            data = cat_file(self._fs, self._path, self._pos, end, url=self.name)
        self.check_unchanged()
        self._pos = end
        return data

    def check_unchanged(self) -> None:
        """Raise :class:`~torchgrain.RemoteIOError` if this process has pinned another
        version of the file than the one this file was opened on (see
        :func:`unchanged_since`): reads made around it (``cat_ranges``) call it too."""
        self._version.check()

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)


@contextlib.contextmanager
def carrying(file: Any) -> Iterator[None]:
    """While the block runs, reads of ``file`` (a :class:`RemoteFile`; anything else is
    left alone) keep to the caller's retry policy and operation deadline, even when a
    library makes them on threads of its own (Arrow reads Parquet pages on its I/O
    threads, which do not see the caller's context). One caller at a time per file.

    Example:
        >>> with carrying(None):
        ...     pass
    """
    raw = file.raw if isinstance(file, io.BufferedReader) else file
    if not isinstance(raw, RemoteFile):
        yield
        return
    raw._context = contextvars.copy_context()
    try:
        yield
    finally:
        raw._context = None


def open_input(
    fs: fsspec.AbstractFileSystem,
    path: str,
    *,
    url: str | None = None,
    buffered: bool = True,
    size: int | None = None,
    fresh: bool = False,
    seen: tuple | None = None,
) -> IO[bytes]:
    """Open ``path`` for reading: ``fs.open`` for a local or in-memory file, else a
    :class:`RemoteFile` behind a :data:`REMOTE_BUFFER`-byte read-ahead buffer (unless
    ``buffered=False``, for readers that ask for exactly the ranges they need). ``size``:
    the file's size as the dataset's opening found it (pinned, see :func:`pin`; else
    asked for now). ``fresh``: this is an opening of the file as it is now (an index
    build): the size asked and the validators of its answers are pinned anew. ``seen``:
    the ``(size, ETag, Last-Modified)`` a source's opening read; another version pinned
    since is refused.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/c/g", b"abc")
        >>> with open_input(fs, "/c/g") as f:
        ...     f.read()
        b'abc'
    """
    if not isinstance(fs, AsyncFileSystem):
        return fs.open(path, "rb")
    raw = RemoteFile(fs, path, url=url, size=size, fresh=fresh, seen=seen)
    return io.BufferedReader(raw, REMOTE_BUFFER) if buffered else raw  # type: ignore[return-value]


def refused(blob: BaseException, label: str, s: int, e: int) -> CorruptDataError:
    """The error for a range read that failed for good, with no clearer name (not
    missing, not denied): a status such as ``416`` (the file is shorter than its index
    says) or a body that could not be read, naming the file and the bytes.

    Example:
        >>> refused(ValueError("bad"), "http://h/a", 0, 8)
        CorruptDataError("http://h/a: reading bytes 0-8 failed: ValueError('bad')")
    """
    status = http_status(blob)
    if status is None:
        return CorruptDataError(f"{label}: reading bytes {s}-{e} failed: {blob!r}")
    return CorruptDataError(
        f"{label}: the server answered {status} to a read of bytes {s}-{e} ({blob}): the "
        "file may have changed on the server since it was indexed"
    )
