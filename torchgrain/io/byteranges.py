"""Several byte ranges of one file in one HTTP request, and the strict reading of the
``multipart/byteranges`` answer (RFC 9110, section 14.6).

A global shuffle asks each shard for a few small records per batch: one request per
record costs the client far more CPU than the bytes do (fsspec and aiohttp spend about
150 µs on each). An HTTP server that serves files (nginx, Apache, Caddy, Go's and
Node's file servers) answers ``Range: bytes=0-9,500-509`` with one response holding
every range as a part, each with its own ``Content-Range``. Object stores (S3, GCS,
Azure) do not: :mod:`torchgrain.io.inflight` uses this only for ``http(s)://`` URLs and
asks one range per request of a server that answers otherwise.

The answer is untrusted: every requested range must lie within one part whose
``Content-Range`` names the same file size, each part must hold exactly the bytes its
``Content-Range`` declares and be followed by the boundary, and the headers of a part are
bounded. Anything else is a :class:`MultipartError`, never bytes.

Example:
    >>> header = range_header([(0, 4), (10, 12)])
    >>> header
    'bytes=0-3,10-11'
    >>> body = (
    ...     b"\\r\\n--B\\r\\nContent-Range: bytes 0-3/20\\r\\n\\r\\nabcd"
    ...     b"\\r\\n--B\\r\\nContent-Range: bytes 10-11/20\\r\\n\\r\\nkl\\r\\n--B--\\r\\n"
    ... )
    >>> parts, size = parse_byteranges(body, "B")
    >>> [bytes(v) for v in slice_parts(parts, [(0, 2), (10, 12), (1, 4)])], size
    ([b'ab', b'kl', b'bcd'], 20)
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence

__all__ = [
    "MAX_PART_HEADER_BYTES",
    "MAX_RANGES",
    "MultipartError",
    "boundary_of",
    "merge_ranges",
    "parse_byteranges",
    "range_header",
    "response_limit",
    "single_part",
    "slice_parts",
]

#: The most ranges one request asks for (Apache answers at most 200 by default; the
#: header stays under 2 KiB).
MAX_RANGES = 64

#: The most bytes a part's boundary line and headers may take (nginx writes about 90).
MAX_PART_HEADER_BYTES = 1024

# RFC 2046's boundary characters (a space only inside quotes, never last).
_BOUNDARY = re.compile(
    r"""boundary=(?:"([0-9A-Za-z'()+_,./:=? -]{0,69}[0-9A-Za-z'()+_,./:=?-])"|"""
    r"""([0-9A-Za-z'()+_./:=?-]{1,70}))(?:$|[\s;])""",
    re.IGNORECASE,
)
_CONTENT_RANGE = re.compile(rb"bytes (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)", re.IGNORECASE)


class MultipartError(ValueError):
    """A ``multipart/byteranges`` answer that is not exactly what was asked for."""


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The half-open ``ranges`` sorted, with those that overlap or touch merged (a server
    may refuse overlapping ranges); ranges with a gap between them stay apart.

    Example:
        >>> merge_ranges([(10, 12), (0, 4), (3, 6), (6, 8), (20, 20)])
        [(0, 8), (10, 12)]
    """
    out: list[tuple[int, int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def range_header(ranges: Sequence[tuple[int, int]]) -> str:
    """The ``Range`` header value asking for the half-open ``ranges`` (non-empty, in the
    order given).

    Example:
        >>> range_header([(0, 1), (5, 10)])
        'bytes=0-0,5-9'
    """
    if not ranges or any(s < 0 or e <= s for s, e in ranges):
        raise ValueError(f"ranges must be non-empty and each non-empty: {list(ranges)[:4]}")
    return "bytes=" + ",".join(f"{s}-{e - 1}" for s, e in ranges)


def response_limit(ranges: Sequence[tuple[int, int]]) -> int:
    """The most bytes a faithful answer for ``ranges`` holds: their bytes, plus a part's
    boundary and headers each, plus the closing boundary.

    Example:
        >>> response_limit([(0, 100)])
        2228
    """
    return sum(e - s for s, e in ranges) + (len(ranges) + 1) * MAX_PART_HEADER_BYTES + 80


def boundary_of(content_type: str | None) -> str | None:
    """The boundary of a ``multipart/byteranges`` ``Content-Type``, else None.

    Example:
        >>> boundary_of("multipart/byteranges; boundary=00000000000000000001")
        '00000000000000000001'
        >>> boundary_of('multipart/byteranges; boundary="a b"'), boundary_of("text/plain")
        ('a b', None)
        >>> boundary_of("multipart/byteranges; boundary=\u20ac") is None  # not RFC 2046
        True
    """
    if not content_type:
        return None
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/byteranges":
        return None
    m = _BOUNDARY.search(params)
    return (m[1] or m[2]) if m else None


def parse_byteranges(
    body: bytes | bytearray, boundary: str, *, size: int | None = None, max_parts: int = MAX_RANGES
) -> tuple[list[tuple[int, memoryview]], int | None]:
    """The parts of a ``multipart/byteranges`` ``body`` (``(first byte, view of body)``
    each, in the order sent: nothing copied), and the file size they declare (None if
    all say ``*``). Each part's ``Content-Range`` must be well formed, hold as many bytes
    as it declares, name the same file size as the others (and ``size``, when given), and
    be followed by the boundary; the body must end with the closing boundary and hold at
    most ``max_parts`` parts (a server may merge the ranges asked for, never split them).

    Example:
        >>> parts, size = parse_byteranges(
        ...     b"--x\\r\\nContent-Range: bytes 2-3/9\\r\\n\\r\\nhi\\r\\n--x--", "x")
        >>> [(first, bytes(data)) for first, data in parts], size
        ([(2, b'hi')], 9)
        >>> parse_byteranges(b"--x\\r\\nContent-Range: bytes 2-4/9\\r\\n\\r\\nhi\\r\\n--x--", "x")
        Traceback (most recent call last):
        ...
        torchgrain.io.byteranges.MultipartError: part 0: bytes 2-4 are not followed by the boundary
    """
    try:
        delim = b"--" + boundary.encode("ascii")
    except UnicodeEncodeError:
        raise MultipartError(f"boundary {boundary[:80]!r} is not ASCII") from None
    view = memoryview(body).toreadonly()  # a bytearray body: its parts stay read-only
    # The first boundary may follow a preamble (RFC 2046); nginx sends a blank line.
    pos = body.find(delim)
    if pos < 0 or pos > MAX_PART_HEADER_BYTES:
        raise MultipartError("the body does not start with its boundary")
    pos += len(delim)
    parts: list[tuple[int, memoryview]] = []
    total: int | None = size
    while True:
        if body.startswith(b"--", pos):
            return parts, total
        if len(parts) == max_parts:
            raise MultipartError(f"more than the {max_parts} parts asked for")
        head_end = body.find(b"\r\n\r\n", pos, pos + MAX_PART_HEADER_BYTES)
        if head_end < 0:
            raise MultipartError(f"part {len(parts)}: no end of its headers within bounds")
        if not body.startswith(b"\r\n", pos):
            raise MultipartError(f"part {len(parts)}: the boundary is not followed by CRLF")
        first = last = None
        for line in body[pos + 2 : head_end].split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                raise MultipartError(f"part {len(parts)}: a header line without a colon")
            if name.strip().lower() == b"content-range":
                m = _CONTENT_RANGE.fullmatch(value.strip())
                if m is None or first is not None:
                    raise MultipartError(f"part {len(parts)}: bad Content-Range {value[:80]!r}")
                first, last = int(m[1]), int(m[2])
                if m[3] != b"*":
                    declared = int(m[3])
                    if total is None:
                        total = declared
                    elif declared != total:
                        raise MultipartError(
                            f"part {len(parts)}: file size {declared}, not {total}"
                        )
        if first is None or last is None:
            raise MultipartError(f"part {len(parts)}: no Content-Range")
        if last < first or (total is not None and last >= total):
            raise MultipartError(f"part {len(parts)}: bytes {first}-{last} of {total}")
        start = head_end + 4
        end = start + last - first + 1
        if not body.startswith(b"\r\n" + delim, end):
            raise MultipartError(
                f"part {len(parts)}: bytes {first}-{last} are not followed by the boundary"
            )
        parts.append((first, view[start:end]))
        pos = end + 2 + len(delim)


def slice_parts(
    parts: Sequence[tuple[int, bytes | memoryview]],
    ranges: Sequence[tuple[int, int]],
    *,
    size: int | None = None,
) -> list[memoryview | None]:
    """The bytes of each half-open range in ``ranges``, from the part that holds all of it
    (a server may merge ranges into one part), as a view of that part (nothing copied:
    the parts are views of a response body no one writes to or reuses); a range no part
    holds is a :class:`MultipartError`, except one that ends past ``size`` (the file's,
    as the parts declare it): servers leave those out, and it is None.

    Example:
        >>> [bytes(v) for v in slice_parts([(10, b"abcdef")], [(11, 13), (15, 16)])]
        [b'bc', b'f']
        >>> slice_parts([(10, b"abcdef")], [(15, 17)])
        Traceback (most recent call last):
        ...
        torchgrain.io.byteranges.MultipartError: no part holds bytes 15-17
        >>> slice_parts([(10, b"abcdef")], [(15, 17)], size=16)
        [None]
    """
    ordered = sorted(parts, key=lambda p: p[0])
    firsts = [p[0] for p in ordered]
    out: list[memoryview | None] = []
    for s, e in ranges:
        k = bisect.bisect_right(firsts, s) - 1
        # the part starting last at or before s; a longer one further left may hold it too
        while k >= 0:
            first, data = ordered[k]
            if first + len(data) >= e:
                out.append(memoryview(data)[s - first : e - first])
                break
            k -= 1
        else:
            if size is None or e <= size:
                raise MultipartError(f"no part holds bytes {s}-{e}")
            out.append(None)
    return out


def single_part(
    content_range: str | None, body: bytes | bytearray
) -> tuple[list[tuple[int, memoryview]], int | None]:
    """The answer to a multi-range request that is one ``206`` range (a server merged the
    ranges, as RFC 9110 allows) as :func:`parse_byteranges` gives parts: its
    ``Content-Range`` must be well formed and name exactly the bytes of ``body`` (a view
    of it, nothing copied).

    Example:
        >>> parts, size = single_part("bytes 2-4/9", b"abc")
        >>> [(first, bytes(data)) for first, data in parts], size
        ([(2, b'abc')], 9)
        >>> single_part("bytes 2-5/9", b"abc")
        Traceback (most recent call last):
        ...
        torchgrain.io.byteranges.MultipartError: part 0: bytes 2-5 of 9 hold 3 bytes
    """
    m = _CONTENT_RANGE.fullmatch((content_range or "").strip().encode("latin-1", "replace"))
    if m is None:
        raise MultipartError(f"part 0: bad Content-Range {(content_range or '')[:80]!r}")
    first, last = int(m[1]), int(m[2])
    total = None if m[3] == b"*" else int(m[3])
    if last < first or (total is not None and last >= total) or last - first + 1 != len(body):
        raise MultipartError(f"part 0: bytes {first}-{last} of {total} hold {len(body)} bytes")
    return [(first, memoryview(body).toreadonly())], total
