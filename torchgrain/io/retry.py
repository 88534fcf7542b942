"""Retries with exponential backoff and jitter for reads from object storage.

A training job must ride through an object store's transient failures (a 503, a reset
connection, a timeout) and stop at once on errors no retry can fix (404, 403).
:func:`is_transient` decides by walking the whole exception chain; every operation ends
within its :class:`RetryPolicy`'s deadlines, kept for the operation in a context variable
(:func:`using`, :func:`current_policy`). Design notes: docs/design-notes.md#io-retry.

Example:
    >>> calls = []
    >>> def flaky():
    ...     calls.append(1)
    ...     if len(calls) < 3:
    ...         raise ConnectionResetError("reset by peer")
    ...     return "ok"
    >>> retry_call(flaky, url="s3://b/x", policy=RetryPolicy(attempts=5, base_delay=0.001))
    'ok'
    >>> len(calls)
    3
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torchgrain.errors import DatasetNotFoundError, RemoteIOError, TorchgrainError

__all__ = [
    "RequestTimeout",
    "RetryPolicy",
    "current_policy",
    "each_under",
    "error_chain",
    "http_status",
    "in_operation",
    "is_transient",
    "is_transient_status",
    "permanent_error",
    "remaining_seconds",
    "request_done",
    "retry_call",
    "using",
    "wait_seconds",
]

T = TypeVar("T")

# HTTP statuses worth another try: timeouts, throttling and server-side failures.
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504, 509, 598, 599})
_TRANSIENT_ERRNO = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
    }
)
# Exception class names (matched along the MRO) of transport libraries that fsspec
# backends raise; matched by name so that none of these libraries must be installed.
_TRANSIENT_NAMES = frozenset(
    {
        # aiohttp (fsspec http, gcsfs, s3fs through aiobotocore)
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientOSError",
        "ContentLengthError",
        # an answer aiohttp could not parse (a bad status line or header: a broken proxy,
        # a flipped bit); the ClientResponseError raised from it says 400, which the
        # server never sent (see http_status)
        "HttpProcessingError",
        # botocore / aiobotocore
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        # fsspec
        "FSTimeoutError",
        # requests / urllib3 (webhdfs, some custom filesystems)
        "ChunkedEncodingError",
        "ProtocolError",
        "IncompleteRead",
    }
)
# S3 / GCS error codes reported in a botocore ClientError that mean "try again".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, how patiently and for how long to try a remote read.

    The delay before retry ``k`` (0-based) is ``min(max_delay, base_delay * 2**min(k, 63))``
    scaled by a random factor in ``[1 - jitter, 1]``, so that many workers hitting the
    same throttled bucket do not retry in lock-step.

    Deadlines (seconds; all finite). With the defaults, a read from a server that stops
    sending ends in :class:`~torchgrain.RemoteIOError` within about ``deadline`` = 90 s,
    retries included: no attempt starts after it, and the one in flight then ends within
    ``read_timeout`` (at most 110 s in all, whatever the size of the read). A request for
    ``n`` bytes may take ``request_timeout + n / min_rate``, and an operation gets
    ``n / min_rate`` more for every ``n`` bytes its requests brought, so that a large
    download on a slow link is not cut off while it makes progress.

    Args:
        attempts: total tries, the first included (1 disables retries).
        base_delay: seconds before the first retry.
        max_delay: cap on one delay, in seconds.
        jitter: fraction of each delay that is randomised (0 to 1).
        connect_timeout: opening a connection (HTTP(S) and S3 transports; default 10).
        read_timeout: the longest wait for the next bytes of a response once the request
            is sent (HTTP(S) and S3 transports; default 20).
        request_timeout: one request, from sending it to its last byte, for requests of up
            to about a megabyte (every async fsspec filesystem; default 60).
        min_rate: bytes per second a large transfer must at least average: a request or
            operation for ``n`` bytes gets ``n / min_rate`` seconds more (default 1 MiB/s).
        deadline: one operation (a range read, a footer read, a download) with all its
            attempts and the waits between them (default 90).

    Example:
        >>> p = RetryPolicy(attempts=4, base_delay=0.1, max_delay=0.3, jitter=0.0)
        >>> [p.delay(k) for k in range(3)]
        [0.1, 0.2, 0.3]
        >>> RetryPolicy().request_seconds(2**20)  # a 1 MiB range: 60 s + 1 s
        61.0
    """

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 10.0
    jitter: float = 0.5
    connect_timeout: float = 10.0
    read_timeout: float = 20.0
    request_timeout: float = 60.0
    min_rate: float = float(1 << 20)
    deadline: float = 90.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if not (self.base_delay >= 0 and self.max_delay >= 0):  # (NaN too)
            raise ValueError(
                f"delays must be >= 0, got base_delay={self.base_delay!r}, "
                f"max_delay={self.max_delay!r}"
            )
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        for name in ("connect_timeout", "read_timeout", "request_timeout", "min_rate", "deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first retry)."""
        # (2.0**1024 is an OverflowError: past 2**63 any delay is max_delay anyway)
        d = min(self.max_delay, self.base_delay * 2.0 ** min(retry, 63))
        if self.jitter:
            d *= 1.0 - self.jitter * (rng or random).random()
        return d

    def request_seconds(self, nbytes: int = 0) -> float:
        """The time one request for ``nbytes`` bytes may take."""
        return self.request_timeout + max(nbytes, 0) / self.min_rate


class RequestTimeout(TimeoutError):
    """A remote request did not complete within its deadline (transient: retried)."""


class _Operation:
    """One retried operation in progress: its policy, start time and byte allowance."""

    __slots__ = ("allowance", "policy", "start")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.start = time.monotonic()
        # Seconds earned by the bytes its completed requests brought (never by a request
        # that failed: else every retry of a stalled read would push the deadline back).
        self.allowance = 0.0

    def remaining(self) -> float:
        return self.start + self.policy.deadline + self.allowance - time.monotonic()


_OPERATION: contextvars.ContextVar[_Operation | None] = contextvars.ContextVar(
    "torchgrain_operation", default=None
)
_POLICY: contextvars.ContextVar[RetryPolicy | None] = contextvars.ContextVar(
    "torchgrain_policy", default=None
)
_DEFAULT = RetryPolicy()


def current_policy() -> RetryPolicy:
    """The policy in force here: the operation's in progress, else :func:`using`'s, else
    the default :class:`RetryPolicy()`.

    Example:
        >>> current_policy() == RetryPolicy()
        True
        >>> with using(RetryPolicy(attempts=2)):
        ...     current_policy().attempts
        2
    """
    op = _OPERATION.get()
    if op is not None:
        return op.policy
    return _POLICY.get() or _DEFAULT


@contextlib.contextmanager
def using(policy: RetryPolicy | None) -> Iterator[None]:
    """Make ``policy`` the one in force for the remote requests made in this block (and
    for the filesystems created in it: their transport timeouts).

    Example:
        >>> with using(RetryPolicy(read_timeout=5)):
        ...     current_policy().read_timeout
        5
    """
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def each_under(policy: RetryPolicy | None, steps: Generator[T, None, None]) -> Iterator[T]:
    """The items of generator ``steps``, each of its steps run under ``policy``
    (:func:`using` set around each ``next``: a generator runs in its caller's context,
    not in the one it was made in); closing this closes ``steps``.

    Example:
        >>> def policies():
        ...     yield current_policy().read_timeout
        >>> list(each_under(RetryPolicy(read_timeout=5), policies()))
        [5]
    """
    try:
        while True:
            with using(policy):
                item = next(steps, _END)
            if item is _END:
                return
            yield item  # type: ignore[misc]
    finally:
        steps.close()


_END: Any = object()


def in_operation() -> bool:
    """Whether a :func:`retry_call` is in progress here (it retries what fails inside it).

    Example:
        >>> in_operation(), retry_call(in_operation, url="x")
        (False, True)
    """
    return _OPERATION.get() is not None


def remaining_seconds(nbytes: int = 0) -> tuple[float, float, RetryPolicy]:
    """``(seconds, request seconds, policy)`` for a request of ``nbytes`` made now: the
    request's own limit, cut to what the operation in progress has left plus the time of
    the request's own bytes at ``min_rate``. ``seconds`` may be <= 0: the operation is out
    of time. Call :func:`request_done` when the request has brought its bytes.

    Example:
        >>> remaining_seconds(0)[:2]
        (60.0, 60.0)
    """
    op, policy = _OPERATION.get(), current_policy()
    own = policy.request_seconds(nbytes)
    if op is None:
        return own, own, policy
    left = op.remaining()
    if left <= 0:
        return left, own, policy
    return min(own, left + max(nbytes, 0) / policy.min_rate), own, policy


def wait_seconds(seconds: float) -> float:
    """``seconds`` as a blocking wait (``Event.wait``, ``Queue.get``, ``time.sleep``) takes
    them: at least 0 and at most ``threading.TIMEOUT_MAX`` (about 292 years; a longer
    wait is an OverflowError, though a policy's seconds may be any finite number).

    Example:
        >>> wait_seconds(-1.0), wait_seconds(2.5), wait_seconds(1e10) == threading.TIMEOUT_MAX
        (0.0, 2.5, True)
    """
    return min(max(seconds, 0.0), threading.TIMEOUT_MAX)


def request_done(nbytes: int) -> None:
    """Credit the operation in progress with the time of ``nbytes`` brought by a request
    (at ``min_rate``): progress extends its deadline, failures do not.

    Example:
        >>> request_done(1 << 20)  # outside an operation: nothing to credit
    """
    op = _OPERATION.get()
    if op is not None:
        op.allowance += max(nbytes, 0) / op.policy.min_rate


def error_chain(exc: BaseException, *, suppressed: bool = False) -> Iterator[BaseException]:
    """``exc`` and the errors it wraps (``__cause__``, else ``__context__``; with
    ``suppressed``, a context hidden by ``raise ... from None`` too), each once.

    Example:
        >>> try:
        ...     try:
        ...         raise KeyError("inner")
        ...     except KeyError as e:
        ...         raise ValueError("outer") from e
        ... except ValueError as e:
        ...     [type(x).__name__ for x in error_chain(e)]
        ['ValueError', 'KeyError']
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        hidden = e.__suppress_context__ and not suppressed
        e = e.__cause__ or (None if hidden else e.__context__)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception (or one it wraps) carries, if any.

    Knows aiohttp's ``ClientResponseError.status``, botocore's ``ClientError`` response
    metadata and ``requests``' ``HTTPError.response``.

    Example:
        >>> http_status(ValueError("x")) is None
        True
    """
    for e in error_chain(exc):
        if _name_in_mro(e.__cause__, ("HttpProcessingError",)):
            continue  # aiohttp's code for an answer it could not parse, not the server's
        status = getattr(e, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            code = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        else:
            code = getattr(response, "status_code", None)
        if isinstance(code, int):
            return code
    return None


def _error_code(e: BaseException) -> str | None:
    response = getattr(e, "response", None)
    code = (response.get("Error") or {}).get("Code") if isinstance(response, dict) else None
    return None if code is None else str(code)


def is_transient_status(status: int) -> bool:
    """True for an HTTP status worth another try (timeouts, throttling, server-side
    failures): the statuses :func:`is_transient` retries.

    Example:
        >>> is_transient_status(503), is_transient_status(501), is_transient_status(404)
        (True, False, False)
    """
    return status in _TRANSIENT_STATUS


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or an error it wraps) is worth retrying.

    Transient: HTTP 408/429/5xx, connection resets and refusals, timeouts, truncated
    bodies, and the matching aiohttp/botocore/fsspec exception types. Never transient:
    any other 4xx (404 not found, 403 forbidden, ...), ``FileNotFoundError`` or
    ``PermissionError`` raised without a transient cause, and data errors.

    Example:
        >>> is_transient(ConnectionResetError()), is_transient(TimeoutError())
        (True, True)
        >>> is_transient(FileNotFoundError("s3://b/missing"))
        False
    """
    status = http_status(exc)
    if status is not None:
        return is_transient_status(status)
    return any(
        _error_code(e) in _TRANSIENT_CODES
        or _transient_type(e)
        or (isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO)
        for e in error_chain(exc)
    )


def _transient_type(e: BaseException) -> bool:
    """Whether ``e`` is a connection failure or a timeout by its type."""
    return isinstance(e, (ConnectionError, TimeoutError)) or _name_in_mro(e, _TRANSIENT_NAMES)


def _name_in_mro(e: BaseException | None, names: Collection[str]) -> bool:
    """Whether a class of ``e`` (None: no) has one of ``names``."""
    return e is not None and any(t.__name__ in names for t in type(e).__mro__)


def _retries(exc: BaseException) -> float:
    """How many times an error may be retried: the ``retries`` of an error in its chain
    that sets one (a range answer naming other bytes: once), else without limit (the
    policy's attempts)."""
    caps = [e.retries for e in error_chain(exc) if isinstance(getattr(e, "retries", None), int)]
    return min(caps) if caps else math.inf


def _describe(exc: BaseException) -> str:
    """Name the transient failure itself, not a wrapper that hides it (fsspec's HTTP
    filesystem reports a 503 on ``info()`` as a FileNotFoundError)."""
    status = http_status(exc)
    matches = [
        e
        for e in error_chain(exc)
        if (status is not None and http_status(e) == status)
        or (status is None and _transient_type(e))
    ]
    # The deepest cause that says something (a bare TimeoutError() explains nothing).
    culprit = ([e for e in matches if str(e)] or matches or [exc])[-1]
    text = f"{type(culprit).__name__}: {culprit}"
    return f"HTTP {status}, {text}" if status is not None else text


def permanent_error(exc: BaseException, url: str, what: str) -> BaseException | None:
    """A clearer exception for an error no retry can fix (a missing file:
    :class:`~torchgrain.DatasetNotFoundError`; access denied: ``PermissionError``; a
    request refused as bad, 400: :class:`~torchgrain.RemoteIOError`), naming ``url``, the
    status and ``what`` failed, or None to re-raise ``exc`` as is.

    Example:
        >>> permanent_error(FileNotFoundError("gone"), "s3://b/k", "range read")
        DatasetNotFoundError('s3://b/k does not exist (range read failed: gone)')
        >>> permanent_error(ValueError("bad"), "s3://b/k", "range read") is None
        True
    """
    status = http_status(exc)
    if isinstance(exc, TorchgrainError):
        return None
    if status in (404, 410) or (
        status is None and any(isinstance(e, FileNotFoundError) for e in error_chain(exc))
    ):
        return DatasetNotFoundError(f"{url} does not exist ({what} failed: {exc})")
    said = "" if status is None else f"HTTP {status}; "
    if status in (401, 403) or (
        status is None and any(isinstance(e, PermissionError) for e in error_chain(exc))
    ):
        return PermissionError(
            f"access to {url} was denied ({said}{what} failed: {exc}); check the "
            "credentials in storage_options"
        )
    if status == 400:
        return RemoteIOError(
            f"{url}: the server answered HTTP 400 (bad request) to the {what}: {exc}"
        )
    return None


def retry_call(
    fn: Callable[..., T],
    *args: Any,
    url: str | Callable[[], str],
    policy: RetryPolicy | None = None,
    what: str = "read",
    on_retry: Callable[[int, BaseException], None] | None = None,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)``, retrying transient failures per ``policy``.

    The call is one *operation*: the remote requests it makes keep to the policy's
    deadlines (see the module docstring). A ``retry_call`` made inside another operation
    does not retry on its own: the outer one retries, so attempts never multiply and the
    outer deadline holds.

    Args:
        fn: the operation; it must be safe to repeat (reads and whole-file downloads are).
        url: the object concerned, named in errors (or a function that names it when
            an error is raised: a batch whose files left change between attempts).
        policy: attempts, delays and deadlines (default: :func:`current_policy`).
        what: a few words for error messages (``"download"``, ``"range read"``).
        on_retry: called with ``(attempt, exception)`` before each retry (for counters).

    Raises:
        RemoteIOError: the last try failed transiently, or the operation's deadline
            passed; names the URL, the attempts and the time taken.
        DatasetNotFoundError: the object does not exist (HTTP 404/410, not retried).
        PermissionError: access denied (HTTP 401/403, not retried).
        Exception: any other non-transient error, unchanged, on its first occurrence.

    Example:
        >>> retry_call(int, "7", url="memory://x")
        7
        >>> try:
        ...     retry_call(open, "/nonexistent/shard", url="/nonexistent/shard")
        ... except DatasetNotFoundError as e:
        ...     print("not found")
        not found
    """
    name = url if callable(url) else (lambda: url)
    if _OPERATION.get() is not None:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            clearer = None if is_transient(e) else permanent_error(e, name(), what)
            if clearer is None:
                raise
            raise clearer from e
    policy = policy or current_policy()
    rng = random.Random()
    op = _Operation(policy)
    token = _OPERATION.set(op)
    try:
        for attempt in range(1, policy.attempts + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not is_transient(e):
                    clearer = permanent_error(e, name(), what)
                    if clearer is None:
                        raise
                    raise clearer from e
                delay = policy.delay(attempt - 1, rng)
                left = op.remaining()
                cap = _retries(e)
                if attempt == policy.attempts or left <= delay or attempt > cap:
                    spent = time.monotonic() - op.start
                    why = (
                        ""
                        if attempt == policy.attempts
                        else f", {cap} retr{'y' if cap == 1 else 'ies'} at most for this error"
                        if attempt > cap
                        else f", its {policy.deadline:g} s deadline passed"
                    )
                    raise RemoteIOError(
                        f"{what} of {name()} failed after {attempt} attempt"
                        f"{'s' if attempt > 1 else ''} in {spent:.1f} s{why} (transient "
                        f"errors; last: {_describe(e)})"
                    ) from e
                if on_retry is not None:
                    on_retry(attempt, e)
                time.sleep(wait_seconds(delay))
    finally:
        _OPERATION.reset(token)
    raise AssertionError("unreachable")  # pragma: no cover
