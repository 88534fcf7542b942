"""Retries with exponential backoff and jitter for reads from object storage.

Object stores fail transiently all the time at scale: a 503 ``SlowDown``, a reset
connection, a read timeout. A training job must ride through those without losing its
place, yet must stop at once on errors that no retry can fix (404, 403): retrying a
missing object only hides a typo in a path for minutes.

:func:`is_transient` decides by walking the whole exception chain (``__cause__`` and
``__context__``), because fsspec often wraps the transport error: the HTTP filesystem
reports a 503 on ``info()`` as ``FileNotFoundError`` *caused by* the 503, and readers wrap
failed range reads in their own errors.

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

import errno
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torchgrain.errors import DatasetNotFoundError, RemoteIOError

__all__ = ["RetryPolicy", "http_status", "is_transient", "retry_call"]

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
    """How often and how patiently to retry a transient failure.

    The delay before retry ``k`` (0-based) is ``min(max_delay, base_delay * 2**k)``
    scaled by a random factor in ``[1 - jitter, 1]``, so that many workers hitting the
    same throttled bucket do not retry in lock-step.

    Args:
        attempts: total tries, the first included (1 disables retries).
        base_delay: seconds before the first retry.
        max_delay: cap on one delay, in seconds.
        jitter: fraction of each delay that is randomised (0 to 1).

    Example:
        >>> p = RetryPolicy(attempts=4, base_delay=0.1, max_delay=0.3, jitter=0.0)
        >>> [p.delay(k) for k in range(3)]
        [0.1, 0.2, 0.3]
    """

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 10.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("delays must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first retry)."""
        d = min(self.max_delay, self.base_delay * (2.0**retry))
        if self.jitter:
            d *= 1.0 - self.jitter * (rng or random).random()
        return d


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception (or one it wraps) carries, if any.

    Knows aiohttp's ``ClientResponseError.status``, botocore's ``ClientError`` response
    metadata and ``requests``' ``HTTPError.response``.

    Example:
        >>> http_status(ValueError("x")) is None
        True
    """
    for e in _chain(exc):
        status = getattr(e, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            meta = response.get("ResponseMetadata") or {}
            code = meta.get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        code = getattr(response, "status_code", None)
        if isinstance(code, int):
            return code
    return None


def _error_code(e: BaseException) -> str | None:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        err = response.get("Error") or {}
        code = err.get("Code")
        return str(code) if code is not None else None
    return None


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
        return status in _TRANSIENT_STATUS
    for e in _chain(exc):
        if _error_code(e) in _TRANSIENT_CODES:
            return True
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
            return True
        if any(t.__name__ in _TRANSIENT_NAMES for t in type(e).__mro__):
            return True
    return False


def _describe(exc: BaseException) -> str:
    """Name the transient failure itself, not a wrapper that hides it (fsspec's HTTP
    filesystem reports a 503 on ``info()`` as a FileNotFoundError)."""
    status = http_status(exc)
    culprit = exc
    for e in _chain(exc):
        if (status is not None and http_status(e) == status) or (
            status is None
            and (
                isinstance(e, (ConnectionError, TimeoutError))
                or any(t.__name__ in _TRANSIENT_NAMES for t in type(e).__mro__)
            )
        ):
            culprit = e
    text = f"{type(culprit).__name__}: {culprit}"
    return f"HTTP {status}, {text}" if status is not None else text


def _permanent(exc: BaseException, url: str, what: str) -> BaseException | None:
    """A clearer exception for errors no retry can fix, or None to re-raise as is."""
    status = http_status(exc)
    if isinstance(exc, DatasetNotFoundError):
        return None
    if status in (404, 410) or (
        status is None and any(isinstance(e, FileNotFoundError) for e in _chain(exc))
    ):
        return DatasetNotFoundError(f"{url} does not exist ({what} failed: {exc})")
    if status in (401, 403) or (
        status is None and any(isinstance(e, PermissionError) for e in _chain(exc))
    ):
        return PermissionError(
            f"access to {url} was denied ({what} failed: {exc}); check the credentials in "
            "storage_options"
        )
    return None


def retry_call(
    fn: Callable[..., T],
    *args: Any,
    url: str,
    policy: RetryPolicy | None = None,
    what: str = "read",
    on_retry: Callable[[int, BaseException], None] | None = None,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)``, retrying transient failures per ``policy``.

    Args:
        fn: the operation; it must be safe to repeat (reads and whole-file downloads are).
        url: the object concerned, named in errors.
        policy: attempts and delays (default :class:`RetryPolicy()`).
        what: a few words for error messages (``"download"``, ``"range read"``).
        on_retry: called with ``(attempt, exception)`` before each retry (for counters).

    Raises:
        RemoteIOError: the last try failed transiently; names the URL and the attempts.
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
    policy = policy or RetryPolicy()
    rng = random.Random()
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not is_transient(e):
                clearer = _permanent(e, url, what)
                if clearer is None:
                    raise
                raise clearer from e
            if attempt == policy.attempts:
                raise RemoteIOError(
                    f"{what} of {url} failed after {attempt} attempt"
                    f"{'s' if attempt > 1 else ''} (transient errors; last: {_describe(e)})"
                ) from e
            if on_retry is not None:
                on_retry(attempt, e)
            time.sleep(policy.delay(attempt - 1, rng))
    raise AssertionError("unreachable")  # pragma: no cover
