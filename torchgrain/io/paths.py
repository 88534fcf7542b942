"""Canonical paths and URLs, and the rule that keeps a dataset inside its root.

A dataset's names (a manifest's, a listing's, metadata's) are untrusted:
``%2e%2e/secret/x`` passes a naive ``..`` test and is decoded later. So every name is
canonicalised and checked here, before any request: in every reading (as written, after
each percent-decoding, after NFKC) it has no dot segment, empty segment, backslash or
control character; it is bounded in length and distinct from the dataset's other names;
it is relative; a listed location must lie inside the root (same scheme, host, port, user
and path prefix).

Symbolic links inside a local dataset directory are the owner's doing and are followed as
usual; nothing here resolves them.

Design notes: docs/design-notes.md#io-paths.

Example:
    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> resolve_inside(fs, "/data/ds", "part-0.array_record", where="ds")
    'memory:///data/ds/part-0.array_record'
    >>> unsafe_reason("%2e%2e/secret/x")
    'has a dot segment (.. or .) once percent-decoded'
    >>> is_inside(fs, "/data/ds", "/data/ds/sub/x"), is_inside(fs, "/data/ds", "/data/dsx")
    (True, False)
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import types
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from torchgrain.errors import UnsafePathError

__all__ = [
    "MAX_DECODINGS",
    "MAX_NAME_BYTES",
    "MAX_SEGMENT_BYTES",
    "check_distinct",
    "confine",
    "is_http",
    "is_inside",
    "local_file_in",
    "resolve_all",
    "resolve_inside",
    "unsafe_reason",
    "url_key",
]

#: Rounds of percent-decoding a name is checked through; a name that still decodes to
#: something new after them is refused.
MAX_DECODINGS = 4
#: The longest name a dataset may give for one of its files, in UTF-8 bytes (Linux's
#: PATH_MAX), and for one segment of it (NAME_MAX on every common filesystem).
MAX_NAME_BYTES = 4096
MAX_SEGMENT_BYTES = 255

# Names made only of these characters (and no "." / ".." segment) need no further look:
# the common case (``data-00003-of-00064.array_record``, ``key=value/part-0.parquet``)
# costs one regex match.
_PLAIN = re.compile(
    r"[A-Za-z0-9_=+,@-][A-Za-z0-9_.=+,@-]*(?:/[A-Za-z0-9_=+,@-][A-Za-z0-9_.=+,@-]*)*"
)
# A scheme (``http:``, ``file:``) or a Windows drive (``c:``) in front of a name.
_SCHEME_OR_DRIVE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# IIS's non-standard ``%uXXXX`` escape of one UTF-16 code unit.
_IIS_ESCAPE = re.compile(r"%[uU]([0-9A-Fa-f]{4})")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_http(fs: Any) -> bool:
    """True for fsspec's HTTP(S) filesystem, whose paths are full URLs and whose listings
    are pages the server writes.

    Example:
        >>> import fsspec
        >>> is_http(fsspec.filesystem("memory"))
        False
    """
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("http", "https") for p in protocols)


def _readings(text: str) -> list[str]:
    """``text`` as written, after each round of percent-decoding, and NFKC-normalised."""
    out = [text]
    for _ in range(MAX_DECODINGS):
        decoded = unquote(out[-1], errors="strict")  # (a text without "%": itself)
        if decoded == out[-1]:
            break
        out.append(decoded)
    else:
        if unquote(out[-1], errors="strict") != out[-1]:
            raise _Unsafe(f"is percent-encoded more than {MAX_DECODINGS} times")
    out += [iis for r in out if (iis := _IIS_ESCAPE.sub(lambda m: chr(int(m[1], 16)), r)) != r]
    return out + [nfkc for r in out if (nfkc := unicodedata.normalize("NFKC", r)) != r]


class _Unsafe(Exception):
    """Why a name is unsafe (turned into an UnsafePathError by the caller)."""


def _check_reading(reading: str, *, relative: bool, http: bool) -> None:
    for ch in reading:
        cat = unicodedata.category(ch)
        if cat == "Cc":
            raise _Unsafe(f"contains the control character {ch!r}")
        if cat == "Cs":
            raise _Unsafe("contains a lone surrogate (not a valid string)")
    if "\\" in reading:
        raise _Unsafe("contains a backslash (a separator to some servers and to Windows)")
    if relative:
        if reading.startswith("/"):
            raise _Unsafe("is an absolute path")
        if "://" in reading or "::" in reading:
            raise _Unsafe("is a URL")
        if _SCHEME_OR_DRIVE.match(reading):
            raise _Unsafe("starts with a scheme or a drive letter")
        if http and ("?" in reading or "#" in reading):
            raise _Unsafe("contains '?' or '#', which an HTTP client would not send as a path")
        segments = reading.split("/")
    else:
        # A location: one leading "/" and one trailing "/" (a directory) are its own.
        segments = reading.strip("/").split("/") if reading.strip("/") else []
    for seg in segments:
        # "..;x" is ".." to servers that drop path parameters; "...", ".. " are ".." or
        # "." to Windows, which drops trailing dots and spaces.
        head = seg.split(";", 1)[0]
        if seg in (".", ".."):
            raise _Unsafe("has a dot segment (.. or .)")
        if head == "":
            raise _Unsafe("has an empty segment (//)")
        if head.rstrip(". ") == "":
            raise _Unsafe(f"has a segment that servers read as '.' or '..' ({seg!r})")


def _check(text: object, *, relative: bool, http: bool) -> None:
    if not isinstance(text, str):
        raise _Unsafe(f"is a {type(text).__name__}, not a string")
    if not text:
        raise _Unsafe("is empty")
    if relative and len(text) > MAX_SEGMENT_BYTES // 4:  # a UTF-8 character: 1 to 4 bytes
        _check_length(text)
    if _PLAIN.fullmatch(text if relative else text.strip("/")):
        return  # no segment starts with ".", no escape, no special character
    try:
        readings = _readings(text)
    except UnicodeDecodeError:
        raise _Unsafe(
            "has a percent-escape that is not UTF-8 (an overlong or broken sequence)"
        ) from None
    for k, reading in enumerate(readings):
        try:
            _check_reading(reading, relative=relative, http=http)
        except _Unsafe as e:
            how = "" if k == 0 else (" once percent-decoded" if "%" in text else " once normalised")
            raise _Unsafe(f"{e}{how}") from None


def _check_length(name: str) -> None:
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise _Unsafe(f"is {size} bytes long, more than {MAX_NAME_BYTES}")
    longest = max(len(seg.encode("utf-8", "surrogatepass")) for seg in name.split("/"))
    if longest > MAX_SEGMENT_BYTES:
        raise _Unsafe(f"has a segment of {longest} bytes, more than {MAX_SEGMENT_BYTES}")


def unsafe_reason(name: object, *, http: bool = False) -> str | None:
    """Why ``name`` is not a safe relative path for a dataset to give (None when it is).

    Example:
        >>> unsafe_reason("train/part-0.parquet") is None
        True
        >>> unsafe_reason("a\\\\..\\\\x")
        'contains a backslash (a separator to some servers and to Windows)'
        >>> unsafe_reason("%252e%252e/x")
        'has a dot segment (.. or .) once percent-decoded'
        >>> unsafe_reason("\\uff0e\\uff0e/x")
        'has a dot segment (.. or .) once normalised'
    """
    try:
        _check(name, relative=True, http=http)
    except _Unsafe as e:
        return str(e)
    return None


def _location_key(fs: Any, location: str, *, trusted: bool) -> tuple[tuple, tuple[str, ...]]:
    """``(authority, decoded path segments)`` of a location, for comparisons.

    Untrusted locations (listed by a dataset) must pass the checks; trusted ones (given by
    the user) only have their dot segments resolved.
    """
    http = is_http(fs)
    if http:
        parts = urlsplit(location)
        if not trusted and (parts.query or parts.fragment or location.endswith(("?", "#"))):
            raise _Unsafe("has a query or a fragment")
        authority = _authority(parts)
        path = parts.path
    else:
        authority = ()
        # An absolute path is already in the form listings give (and stripping is not free)
        path = location if location.startswith("/") else fs._strip_protocol(location)
    if not trusted:
        _check(path or "/", relative=False, http=http)
    text = _decoded(path, "NFC")
    if trusted:
        text = posixpath.normpath("/" + text)
    return authority, tuple(s for s in text.split("/") if s)


def _authority(parts: SplitResult) -> tuple:
    """A URL's scheme, host, port (its scheme's default when none is written), user and
    password, for comparisons."""
    scheme = parts.scheme.lower()
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        raise _Unsafe("has an invalid port") from None
    return (scheme, (parts.hostname or "").lower(), port, parts.username, parts.password)


def url_key(url: str) -> tuple[tuple, tuple[str, ...]] | None:
    """The ``(authority, path segments)`` of an http(s) URL that :func:`is_inside`
    compares: segments percent-decoded, neither checked nor resolved (what a listing
    finds is confined by its caller). None for a URL with an invalid port.

    Example:
        >>> url_key("http://H:80/my%20data/a.x") == url_key("http://h/my data/a.x")
        True
        >>> url_key("http://h/d/a.x")
        (('http', 'h', 80, None, None), ('d', 'a.x'))
    """
    parts = urlsplit(url)
    try:
        authority = _authority(parts)
    except _Unsafe:
        return None
    return authority, tuple(s for s in _decoded(parts.path, "NFC").split("/") if s)


def _decoded(text: str, form: str) -> str:
    """``text`` percent-decoded until it stops changing (:data:`MAX_DECODINGS` rounds at
    most), then in Unicode normal ``form``: one reading of a name, for comparisons."""
    if "%" not in text and text.isascii():
        return text  # the common case, for free
    for _ in range(MAX_DECODINGS):
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    return unicodedata.normalize(form, text)


@functools.lru_cache(maxsize=256)
def _root_key(cls: type, protocol: Any, root: str) -> tuple[tuple, tuple[str, ...]]:
    """A root's key (the same for every listed location compared with it). What
    :func:`_location_key` needs of a filesystem, its protocol and path stripping, are
    its class's in fsspec: the cache holds no instance."""
    kind = types.SimpleNamespace(protocol=protocol, _strip_protocol=cls._strip_protocol)
    return _location_key(kind, root, trusted=True)


def _key_of_root(fs: Any, root: str) -> tuple[tuple, tuple[str, ...]]:
    protocol = fs.protocol if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return _root_key(type(fs), protocol, root)


def is_inside(fs: Any, root: str, location: str) -> bool:
    """Whether ``location`` (listed by a dataset) is ``root`` or below it, and safe.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("http")
        >>> is_inside(fs, "http://h/ds", "http://h/ds/a/x.parquet")
        True
        >>> is_inside(fs, "http://h/ds", "http://h/ds/%2e%2e/secret/x.parquet")
        False
        >>> is_inside(fs, "http://h/ds", "http://evil/ds/x.parquet")
        False
    """
    try:
        auth, segs = _location_key(fs, location, trusted=False)
    except _Unsafe:
        return False
    root_auth, root_segs = _key_of_root(fs, root)
    return auth == root_auth and segs[: len(root_segs)] == root_segs


def local_file_in(root: str, name: str) -> str | None:
    """The local file ``root/name`` when it lies in the directory ``root``, else None.

    ``name`` comes from data (an old manifest, a conversion plan): ``..``, absolute
    names and links in its directories are resolved before the check, so a writer that
    removes a dataset's old files removes only that dataset's.

    Example:
        >>> local_file_in("/data/ds", "a/x.parquet"), local_file_in("/data/ds", "../x")
        ('/data/ds/a/x.parquet', None)
        >>> local_file_in("/data/ds", "/etc/passwd") is None
        True
    """
    path = os.path.normpath(os.path.join(root, name))
    real_root = os.path.realpath(root)
    where = os.path.realpath(os.path.dirname(path))
    return path if os.path.commonpath([real_root, where]) == real_root else None


def confine(fs: Any, root: str, location: str, *, where: str, what: str = "file") -> str:
    """``location`` unchanged when it is inside ``root``; else :class:`UnsafePathError`.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> confine(fs, "/ds", "/ds/x", where="the listing of /ds")
        '/ds/x'
        >>> confine(fs, "/ds", "/ds/../etc/x", where="the listing of /ds")
        Traceback (most recent call last):
        ...
        torchgrain.errors.UnsafePathError: the listing of /ds names file '/ds/../etc/x', which is outside the dataset's root '/ds' (it has a dot segment (.. or .)); if you trust this dataset, open it with allow_external_paths=True
    """
    try:
        auth, segs = _location_key(fs, location, trusted=False)
        root_auth, root_segs = _key_of_root(fs, root)
        if auth != root_auth:
            raise _Unsafe("is on another host or scheme")
        if segs[: len(root_segs)] != root_segs:
            raise _Unsafe("is not below it")
    except _Unsafe as e:
        raise UnsafePathError(
            f"{where} names {what} {location!r}, which is outside the dataset's root {root!r} "
            f"(it {e}); if you trust this dataset, open it with allow_external_paths=True"
        ) from None
    return location


def resolve_inside(
    fs: Any,
    root: str,
    name: object,
    *,
    where: str,
    what: str = "file",
    allow_external: bool = False,
) -> str:
    """The location of the file a dataset names ``name``, relative to its ``root``.

    ``root`` is a path of ``fs`` (as ``fs._strip_protocol`` gives it, or a full URL for
    HTTP). The result is a local path or a URL that fsspec opens. Unless
    ``allow_external`` (the user trusts the dataset), ``name`` must be a safe relative path
    (see the module docstring), so the result is below ``root``.

    Raises:
        UnsafePathError: naming ``where``, ``what`` and the offending name, and why.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("file")
        >>> resolve_inside(fs, "/data/ds", "a/b.tfrecord", where="manifest")
        '/data/ds/a/b.tfrecord'
        >>> resolve_inside(fs, "/data/ds", "../x", where="the manifest of /data/ds", what="shard 0")
        Traceback (most recent call last):
        ...
        torchgrain.errors.UnsafePathError: the manifest of /data/ds names shard 0 '../x', which is not a path inside the dataset directory /data/ds: it has a dot segment (.. or .); a dataset's files must be named by relative paths below it. If you trust this dataset, open it with allow_external_paths=True
    """
    return resolve_all(
        fs, root, [name], where=where, what=lambda _: what, allow_external=allow_external
    )[0]


def resolve_all(
    fs: Any,
    root: str,
    names: Sequence[object],
    *,
    where: str,
    what: Callable[[int], str] = lambda k: f"file {k}",
    allow_external: bool = False,
) -> list[str]:
    """:func:`resolve_inside` for many names of one dataset (a manifest's shards);
    ``what(k)`` names the ``k``-th in errors.

    Example:
        >>> import fsspec
        >>> resolve_all(fsspec.filesystem("memory"), "/ds", ["a", "b/c"], where="manifest")
        ['memory:///ds/a', 'memory:///ds/b/c']
    """
    from torchgrain.io.fs import is_local

    http = is_http(fs)
    local = is_local(fs)
    base = root.rstrip("/")
    prefix = base if local else fs.unstrip_protocol(base)
    out = []
    for k, name in enumerate(names):
        try:
            if allow_external:
                _check_external(name)
            else:
                _check(name, relative=True, http=http)
        except _Unsafe as e:
            raise UnsafePathError(
                f"{where} names {what(k)} {name!r:.300}, which is not a path inside the dataset "
                f"directory {root}: it {e}; a dataset's files must be named by relative paths "
                "below it. If you trust this dataset, open it with allow_external_paths=True"
            ) from None
        assert isinstance(name, str)
        if not allow_external:
            # A checked relative name below the root stays below it: nothing to resolve.
            out.append(f"{prefix}/{name}")
        elif "://" in name or "::" in name:
            out.append(name)
        else:
            # ".." means the parent directory, here as on a local disk (an object store
            # would take it literally: "sub/../x" must not need "sub" to exist).
            path = name if name.startswith("/") else f"{base}/{name}"
            path = path if http else posixpath.normpath(path)
            out.append(path if local else fs.unstrip_protocol(path))
    if not allow_external:
        check_distinct(names, where=where, what=what, ignore_case=True)  # type: ignore[arg-type]
    return out


def check_distinct(
    names: Sequence[str],
    *,
    where: str,
    what: Callable[[int], str] = lambda k: f"file {k}",
    ignore_case: bool = False,
) -> None:
    """Refuse two ``names`` that are one file to some reader: equal once percent-decoded
    and NFKC-normalised (an HTTP client sends ``a%2ex`` as ``a.x``; a server decodes
    ``%2f``), or, with ``ignore_case``, once case-folded (a case-insensitive disk).

    Raises:
        UnsafePathError: naming ``where`` and both names.

    Example:
        >>> check_distinct(["a.x", "b.x"], where="m")
        >>> check_distinct(["a.x", "A%2ex"], where="m", ignore_case=True)
        Traceback (most recent call last):
        ...
        torchgrain.errors.UnsafePathError: m names file 1 'A%2ex' and file 0 'a.x', which are one file to a server that decodes %-escapes or to a case-insensitive filesystem; if you trust this dataset, open it with allow_external_paths=True
    """
    seen: dict[str, int] = {}
    for k, name in enumerate(names):
        key = _decoded(name, "NFKC")
        if ignore_case:
            key = key.casefold()
        first = seen.setdefault(key, k)
        if first != k:
            to = "a server that decodes %-escapes" + (
                " or to a case-insensitive filesystem" if ignore_case else ""
            )
            raise UnsafePathError(
                f"{where} names {what(k)} {name!r} and {what(first)} {names[first]!r}, which "
                f"are one file to {to}; if you trust this dataset, open it with "
                "allow_external_paths=True"
            )


def _check_external(name: object) -> None:
    """What even a trusted dataset may not name: a non-string, nothing, control characters."""
    if not isinstance(name, str):
        raise _Unsafe(f"is a {type(name).__name__}, not a string")
    if not name:
        raise _Unsafe("is empty")
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in name):
        raise _Unsafe("contains a control character or a lone surrogate")
