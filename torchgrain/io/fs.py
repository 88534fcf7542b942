"""Resolve user-given paths (directory, glob, file, list, fsspec URL) to shard files.

Sources accept any of these, local or remote; this module turns them into a sorted,
de-duplicated list of concrete file paths plus the fsspec filesystem that reads them.

What a directory listing or a glob finds is the dataset's word, not the user's: every
file found must be inside the directory or the glob's fixed prefix
(:func:`torchgrain.io.paths.confine`), and on HTTP(S), where a listing is a page of links
the server writes, directories are walked here, one confined level at a time, so that no
request is ever made for a link that points elsewhere.
"""

from __future__ import annotations

import contextvars
import dataclasses
import fnmatch
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote

import fsspec
import numpy as np
from fsspec.core import split_protocol, url_to_fs

try:
    from fsspec.utils import glob_translate
except ImportError:  # fsspec before 2023.12: the same translation, below
    glob_translate = None

from torchgrain.errors import CorruptDataError, DatasetNotFoundError, RemoteIOError, warn_once
from torchgrain.io import paths as _paths
from torchgrain.io import process, remote
from torchgrain.io.retry import RetryPolicy, current_policy, using

PathLike = str | os.PathLike
T = TypeVar("T")


def default_cache_dir() -> str:
    """Where torchgrain keeps what it derives from datasets (demo data, TFRecord indexes):
    ``$TORCHGRAIN_CACHE``, else ``$XDG_CACHE_HOME/torchgrain``, else ``~/.cache/torchgrain``.

    Example:
        >>> default_cache_dir().endswith("torchgrain") or "TORCHGRAIN_CACHE" in os.environ
        True
    """
    return os.environ.get("TORCHGRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "torchgrain"
    )


def get_filesystem(
    path: PathLike,
    storage_options: dict[str, Any] | None = None,
    *,
    retry: RetryPolicy | None = None,
    allow_redirects: bool = False,
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path_without_protocol)`` for a local path or fsspec URL.

    For ``http(s)://`` and ``s3://`` the transport gets the connect and between-bytes
    timeouts of ``retry`` (default: :func:`~torchgrain.io.retry.current_policy`) where
    ``storage_options`` set none, and HTTP(S) redirects are refused unless
    ``allow_redirects`` (see :func:`~torchgrain.io.remote.storage_options_with_deadlines`).

    Example:
        >>> fs, p = get_filesystem("/tmp")
        >>> fs.protocol[0] in ("file", "local")
        True
    """
    text = os.fspath(path)
    policy = retry or current_policy()
    if "::" not in text:
        protocol = split_protocol(text)[0]
        if protocol is not None:
            storage_options = remote.storage_options_with_deadlines(
                protocol, storage_options, policy, allow_redirects=allow_redirects
            )
    else:  # a chain (simplecache::s3://...): each layer takes the options keyed by its name
        storage_options = dict(storage_options or {})
        for link in text.split("::")[1:]:
            protocol = split_protocol(link)[0] or link
            storage_options[protocol] = remote.storage_options_with_deadlines(
                protocol, storage_options.get(protocol), policy, allow_redirects=allow_redirects
            )
    fs, stripped = url_to_fs(text, **(storage_options or {}))
    if is_local(fs):
        stripped = canonical_local_path(stripped)
    return fs, stripped


def canonical_local_path(path: str) -> str:
    """A local absolute ``path`` (or glob) with its ``.``/``..`` and empty segments
    resolved as the operating system resolves them.

    The user's own path is trusted, but what a listing below it finds is checked against
    it segment by segment (:mod:`torchgrain.io.paths`), so ``../data/pq`` must become the
    directory it names first. The part up to the last dot segment goes through
    ``os.path.realpath`` (``link/..`` is the parent of the link's target, not the
    directory holding the link); the names after it are kept as given. A glob's pattern
    part is left alone.

    Example:
        >>> canonical_local_path("/data/train/../val//x.parquet")
        '/data/val/x.parquet'
        >>> canonical_local_path("/data/val/*.parquet")
        '/data/val/*.parquet'
    """
    head, tail = path, ""
    if has_glob(path):
        cut = path.rfind("/", 0, min(path.index(c) for c in "*?[" if c in path))
        head, tail = path[: max(cut, 0)], path[max(cut, 0) :]
    parts = head.split("/")
    dots = [k for k, part in enumerate(parts) if part in (".", "..")]
    if not dots and "" not in parts[1:-1]:
        return path  # already canonical: the common case costs a split
    last = dots[-1] + 1 if dots else 1
    base = os.path.realpath("/".join(parts[:last]) or "/").rstrip("/") if dots else ""
    rest = "".join(f"/{part}" for part in parts[last:] if part)
    return (base + rest + tail) or "/"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when ``fs`` is the local filesystem.

    Example:
        >>> is_local(get_filesystem("/tmp")[0])
        True
    """
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("file", "local") for p in protocols)


def filesystem_for_this_process(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """A copy of ``fs`` made in (and bound to) the calling process.

    Async fsspec filesystems (s3fs, gcsfs, http) are tied to the event loop of the
    process that created them; in a forked DataLoader worker that loop does not run,
    and using the parent's instance raises or hangs. Unpickling builds a new instance
    (fsspec's instance cache is per process). Local filesystems are returned as is.

    Example:
        >>> fs = get_filesystem("/tmp")[0]
        >>> filesystem_for_this_process(fs) is fs
        True
    """
    return fs if is_local(fs) else pickle.loads(pickle.dumps(fs))


def map_files(fn: Callable[[int], T], n: int, *, max_workers: int = 16) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]``, run on up to ``max_workers`` threads: opening a dataset
    reads every shard's footer or index, and remote reads wait on latency, not CPU.

    Example:
        >>> map_files(lambda i: i * i, 4)
        [0, 1, 4, 9]
    """
    if n <= 1 or max_workers <= 1:
        return [fn(i) for i in range(n)]
    # The threads run in the caller's context: its retry policy and the deadline of the
    # operation in progress hold for the requests they make.
    context = contextvars.copy_context()
    with process.thread_pool(min(max_workers, n), "torchgrain-files") as pool:
        return list(pool.map(lambda i: context.copy().run(fn, i), range(n)))


def _unstrip(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Give back a URL that fsspec can open again (keeps the protocol for remote files)."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def has_glob(path: str, fs: fsspec.AbstractFileSystem | None = None) -> bool:
    """Whether ``path`` (of ``fs``) is a glob: it holds ``*``, ``[`` or ``?``, except on
    HTTP(S), where a ``?`` starts the URL's query (a signed URL's), never a wildcard, as
    fsspec's HTTP filesystem reads it.

    Example:
        >>> from fsspec.implementations.http import HTTPFileSystem
        >>> has_glob("/d/a?.parquet"), has_glob("https://h/a.parquet?sig=x", HTTPFileSystem())
        (True, False)
    """
    return any(ch in path for ch in ("*[" if fs is not None and _paths.is_http(fs) else "*?["))


def expand_paths(
    paths: PathLike | Sequence[PathLike],
    *,
    suffixes: Iterable[str],
    storage_options: dict[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    kind: str = "shard",
    allow_external: bool = False,
) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Expand a directory, glob, file, or list of them into sorted shard paths.

    A directory is searched recursively for files whose name contains one of
    ``suffixes`` (so ``.array_record`` also finds ``x.array_record-00000-of-00008``).
    Files starting with ``_`` or ``.``, and files in directories starting with ``.`` or
    ``_`` (an ``index_dir`` kept inside the data directory, Spark's ``_temporary``), are
    skipped.

    What a listing or glob finds stays inside the directory (or the glob's fixed prefix):
    a data file listed outside it, or under a name with dot segments, backslashes or
    control characters in any decoding, is an :class:`~torchgrain.UnsafePathError` unless
    ``allow_external`` (and even then no directory outside is walked).

    Raises:
        DatasetNotFoundError: when a path does not exist or nothing matches.
        UnsafePathError: a listing names a data file outside its directory.

    Example:
        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp()
        >>> _ = pathlib.Path(d, "a.parquet").write_bytes(b"")
        >>> fs, files = expand_paths(d, suffixes=[".parquet"])
        >>> [pathlib.Path(f).name for f in files]
        ['a.parquet']
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise DatasetNotFoundError(f"no {kind} paths given")
    suffixes = tuple(suffixes)
    out: list[str] = []
    resolved = []
    for item in map(os.fspath, items):
        if filesystem is None:
            item_fs, stripped = get_filesystem(
                item, storage_options, allow_redirects=allow_external
            )
        else:
            item_fs, stripped = filesystem, filesystem._strip_protocol(item)
            if is_local(filesystem):
                stripped = canonical_local_path(stripped)
        resolved.append((item, item_fs, stripped))
    named = [(f, p, item) for item, f, p in resolved if not has_glob(p, f)]
    _refresh_named(named, suffixes, allow_external)
    for item, item_fs, stripped in resolved:
        listing = _Listing(item_fs, item, suffixes, allow_external)
        if has_glob(stripped, item_fs):
            found = sorted(listing.glob(stripped))
            if not found:
                raise DatasetNotFoundError(f"glob {item!r} matched no {kind} file")
        elif remote.isdir(item_fs, stripped, url=item):
            listed = listing.find(stripped)
            found = sorted(
                p for p in listed if _is_data_file(p, suffixes) and not _hidden(stripped, p)
            )
            skipped = non_data_files(stripped, listed, suffixes)
            if not found:
                raise DatasetNotFoundError(
                    f"directory {item!r} holds no {kind} file (looked for names containing "
                    f"{', '.join(suffixes)}){describe_files(stripped, skipped, '; it holds ')}"
                )
            if skipped:
                warn_once(
                    ("skipped files", _unstrip(item_fs, stripped), kind),
                    f"{item!r} holds {describe_files(stripped, skipped)}, skipped: not "
                    f"{kind} data (its files' names contain {', '.join(suffixes)}); "
                    "`torchgrain inspect` lists them",
                )
            check_shard_sets(found, where=item)
        elif remote.isfile(item_fs, stripped, url=item):
            found = [stripped]
        else:  # (a FIFO, socket or device is never opened: a FIFO blocks its reader)
            there = is_local(item_fs) and os.path.exists(stripped)
            problem = "is not a regular file" if there else "does not exist"
            raise DatasetNotFoundError(f"{kind} path {item!r} {problem}")
        if _paths.is_http(item_fs) and not allow_external:
            # Two links to one file (a.x, %61.x) would read its records twice (a disk or an
            # object store lists each file once).
            _paths.check_distinct(found, where=f"the listing of {item!r}")
        out.extend(_unstrip(item_fs, p) for p in found)
    return resolved[0][1], list(dict.fromkeys(out))  # the first occurrence of each path, in order


# Files beside a dataset's data that are its own metadata, skipped without a notice (as are
# names starting with "." or "_", in any directory below the root: _SUCCESS, .crc files,
# _delta_log/): torchgrain's manifest and index, TFDS's metadata, a README or a licence.
_METADATA_NAMES = re.compile(
    r"(torchgrain\.json|.*\.tgindex|dataset_info\.json|features\.json|.*\.labels\.txt"
    r"|(readme|licen[cs]e|copying|citation)([._-].*)?)",
    re.IGNORECASE,
)


def non_data_files(root: str, listed: Iterable[str], suffixes: Iterable[str]) -> list[str]:
    """The files of a listing of directory ``root`` that a source skips and the user should
    hear of: not data (no name containing one of ``suffixes``), not hidden, not named
    ``_...`` (nor below such a directory), and not metadata (a manifest, an index,
    ``features.json``, a README...). Sorted.

    Example:
        >>> non_data_files("/d", ["/d/a.parquet", "/d/stats.csv", "/d/_SUCCESS",
        ...                       "/d/README.md", "/d/.x/y.csv"], [".parquet"])
        ['/d/stats.csv']
    """
    suffixes = tuple(suffixes)
    base = root.rstrip("/")
    out = []
    for p in listed:
        if _is_data_file(p, suffixes):
            continue
        rel = p[len(base) :] if p.startswith(base) else p
        segments = [s for s in rel.split("/") if s]
        hidden = not segments or any(s.startswith((".", "_")) for s in segments)
        if not (hidden or _METADATA_NAMES.fullmatch(segments[-1])):
            out.append(p)
    return sorted(out)


def skipped_files(
    paths: PathLike | Sequence[PathLike],
    suffixes: Iterable[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_external: bool = False,
) -> list[str]:
    """The files of the directories among ``paths`` that a source of files named with
    ``suffixes`` skips and the user should hear of (:func:`non_data_files`), as
    ``torchgrain inspect`` lists them. One listing per directory.

    Example:
        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp()
        >>> for name in ("a.parquet", "stats.csv", "_SUCCESS"):
        ...     _ = pathlib.Path(d, name).write_bytes(b"")
        >>> [pathlib.Path(f).name for f in skipped_files(d, [".parquet"])]
        ['stats.csv']
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    suffixes = tuple(suffixes)
    out: list[str] = []
    for item in map(os.fspath, items):
        fs, p = get_filesystem(item, storage_options, allow_redirects=allow_external)
        if has_glob(p, fs) or not remote.isdir(fs, p, url=item):
            continue
        listed = _Listing(fs, item, suffixes, allow_external).find(p)
        out.extend(_unstrip(fs, f) for f in non_data_files(p, listed, suffixes))
    return out


def describe_files(
    root: str, files: Sequence[str], lead: str = "", most: int = 5, *, noun: str = "other file"
) -> str:
    """``files`` named relative to ``root`` for a message: the first ``most`` and a count
    of ``noun`` (``""`` for none, else ``lead`` in front).

    Example:
        >>> describe_files("/d", ["/d/a.csv", "/d/sub/b.txt"], "; it holds ")
        "; it holds 2 other files: 'a.csv', 'sub/b.txt'"
        >>> describe_files("/d", ["/d/more"], noun="linked folder")
        "1 linked folder: 'more'"
    """
    if not files:
        return ""
    base = root.rstrip("/") + "/"
    names = [f[len(base) :] if f.startswith(base) else f for f in files]
    shown = ", ".join(repr(n) for n in names[:most])
    more = f" and {len(names) - most} more" if len(names) > most else ""
    count = f"1 {noun}" if len(names) == 1 else f"{len(names)} {noun}s"
    return f"{lead}{count}: {shown}{more}"


def list_files(
    fs: fsspec.AbstractFileSystem,
    root: str,
    suffixes: Iterable[str],
    *,
    where: str | None = None,
    allow_external: bool = False,
) -> list[str]:
    """The files below directory ``root`` (a path of ``fs``), found by a listing confined
    to it as in :func:`expand_paths` (data files are those named with ``suffixes``).

    Example:
        >>> import fsspec
        >>> mem = fsspec.filesystem("memory")
        >>> mem.pipe("/lf/a/x.parquet", b"")
        >>> list_files(mem, "/lf", [".parquet"])
        ['/lf/a/x.parquet']
    """
    return _Listing(fs, where or root, tuple(suffixes), allow_external).find(root)


#: Directory levels below a dataset's root that a listing may go (hive partitions use a
#: few); a listing deeper than this is refused rather than walked forever.
MAX_LISTING_DEPTH = 32
#: Directories one listing may walk (HTTP(S): one request each).
MAX_LISTED_DIRECTORIES = 100_000
#: Objects one S3 listing may name (a page holds up to 1,000): ~100 MB of names.
MAX_LISTED_OBJECTS = 1_000_000


def _fill_dircache(
    fs: fsspec.AbstractFileSystem, prefix: str, files: list[dict[str, Any]], folders: list[str]
) -> None:
    """Put a finished S3 listing of ``prefix`` (``bucket/key...``) in ``fs.dircache`` as
    s3fs's own listing would, so that each file's size and ETag asks no HEAD request.
    The folders the prefix lists whole are entered, each replacing what was there (a
    shard rewritten since its last listing has its new size); in a folder it lists in
    part (``bucket/data/`` of ``bucket/data/c``), already cached, the entries whose
    names go on with the prefix are replaced."""
    listed: dict[str, dict[str, dict[str, Any]]] = {}
    part = prefix.rsplit("/", 1)[0] if not prefix.endswith("/") else None

    def enter(name: str, info: dict[str, Any]) -> None:
        parent = name.rsplit("/", 1)[0]
        while "/" in name and (f"{parent}/".startswith(prefix) or parent == part):
            entries = listed.setdefault(parent, {})
            if name in entries:
                return
            entries[name] = info
            name, parent = parent, parent.rsplit("/", 1)[0]
            info = folder(name)

    def folder(name: str) -> dict[str, Any]:
        return dict(Key=name, name=name, Size=0, size=0, StorageClass="DIRECTORY", type="directory")

    for c in files:
        enter(c["Key"], {**c, "name": c["Key"], "size": c["Size"]})
    for name in folders:
        enter(name, folder(name))
    with _DIRCACHE_LOCK:
        if part is not None:
            entries = listed.pop(part, {})
            if part in fs.dircache:  # (alone, a part is never taken for the folder's listing)
                kept = [e for e in fs.dircache[part] if not e["name"].startswith(prefix)]
                _cache(fs, part, [*kept, *entries.values()])
        for name, entries in listed.items():
            _cache(fs, name, entries.values())


def _cache(fs: fsspec.AbstractFileSystem, folder: str, entries: Iterable[dict[str, Any]]) -> None:
    fs.dircache[folder] = sorted(entries, key=lambda info: info["name"])


#: Guards each read-modify-write of an S3 filesystem's listing cache: two threads opening
#: at once each keep the other's entries.
_DIRCACHE_LOCK = threading.Lock()


def _new_dircache_lock() -> None:
    global _DIRCACHE_LOCK  # (a thread may have held it at the fork: the child's copy stays held)
    _DIRCACHE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_dircache_lock)

#: Objects an S3 listing page names.
_S3_PAGE = 1000


def _refresh_named(
    named: Iterable[tuple[fsspec.AbstractFileSystem, str, str]],
    suffixes: tuple[str, ...],
    allow_external: bool,
) -> None:
    """Ask S3 anew about the named paths ``(fs, path, url)`` whose folder s3fs's listing
    cache holds (a listing of it since), and put the answers there: a shard added,
    rewritten or removed since is seen as it is now. Each such folder is asked once: one
    HEAD for one name, else one listing (page by page) of its names' common prefix, or a
    HEAD per name where fewer than that listing's pages. (A folder is listed anew when
    opened: nothing is asked here.)"""
    folders: dict[tuple[int, str], tuple[fsspec.AbstractFileSystem, dict[str, str]]] = {}
    for fs, path, url in named:
        s3 = _s3_of(fs)
        if s3 is None:
            continue
        path = path.rstrip("/")
        parent = s3._parent(path)
        cached = s3.dircache.get(parent)
        if path in s3.dircache or cached is None:
            continue
        if any(e["name"] == path and e["type"] == "directory" for e in cached):
            continue
        folders.setdefault((id(s3), parent), (s3, {}))[1].setdefault(path, url)
    for (_, parent), (s3, urls) in folders.items():
        prefix = os.path.commonprefix(list(urls))  # noqa: RUF071 - of keys
        under = sum(e["name"].startswith(prefix) for e in s3.dircache.get(parent, ()))
        if len(urls) > 1 and max(1, -(-under // _S3_PAGE)) < len(urls):
            where = next(iter(urls.values())).rsplit("/", 1)[0] + "/"
            start = prefix[len(parent) + 1 :]
            _Listing(s3, where, suffixes, allow_external)._s3_keys(
                s3, parent, start, one_level=True
            )
            continue
        for path, url in urls.items():
            info = remote._info_or_none(s3, path, url, refresh=True)
            with _DIRCACHE_LOCK:
                cached = s3.dircache.get(parent)
                if cached is not None:  # (else dropped since: s3fs asks anew)
                    kept = [e for e in cached if e["name"] != path]
                    _cache(s3, parent, [*kept, info] if info is not None else kept)


def _s3_of(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem | None:
    """The S3 filesystem ``fs`` lists through (a chain's caching layer lists its inner
    one's), or None. Only s3fs's, not version-aware (that one lists object versions)."""
    for layer in (fs, getattr(fs, "fs", None)):
        if layer is None or not hasattr(layer, "_call_s3"):
            continue
        protocols = layer.protocol
        protocols = protocols if isinstance(protocols, (tuple, list)) else (protocols,)
        if {"s3", "s3a"} & set(protocols) and not getattr(layer, "version_aware", False):
            return layer
    return None


#: A glob's wildcards inside one path segment: a run of stars, ``?``, a ``[...]`` class.
_WILDCARD = re.compile(r"\*+|\?|\[!?\]?[^\]]*\]")


def _glob_translate(pattern: str) -> str:
    """A regular expression for ``pattern``, as fsspec's ``glob_translate`` makes it
    (fsspec >= 2023.12; this serves older ones): ``/`` separates segments, ``*`` and ``?``
    stay inside one, a ``*`` segment is one non-empty segment, a ``**`` segment any
    number of them.

    Example:
        >>> rx = re.compile(_glob_translate("a/**/*.parquet"))
        >>> [bool(rx.match(p)) for p in ("a/x.parquet", "a/b/c/x.parquet", "b/x.parquet")]
        [True, True, False]
    """
    parts = pattern.split("/")
    out = []
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:.+/)?")
            continue
        if "**" in part:
            raise ValueError("Invalid pattern: '**' can only be an entire path component")
        if part == "*":
            out.append("[^/]+" if last else "[^/]+/")
            continue
        pos = 0
        for m in _WILDCARD.finditer(part):
            out.append(re.escape(part[pos : m.start()]))
            token = m.group()
            if token[0] == "*":
                out.append("[^/]*")
            elif token == "?":
                out.append("[^/]")
            else:  # a class: fnmatch's translation, without its (?s:...)\Z wrapper
                out.append(fnmatch.translate(token)[4:-3])
            pos = m.end()
        out.append(re.escape(part[pos:]))
        if not last:
            out.append("/")
    return rf"(?s:{''.join(out)})\Z"


class _Listing:
    """The files below one user-given root, found by listing and confined to the root."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        item: str,
        suffixes: tuple[str, ...],
        allow_external: bool,
    ) -> None:
        self.fs, self.item, self.suffixes, self.allow_external = fs, item, suffixes, allow_external

    def _keep(self, root: str, path: str) -> bool:
        """Whether a listed file is kept: inside ``root``; outside, a data file is an
        error (unless external paths are allowed) and anything else is not ours."""
        if _paths.is_inside(self.fs, root, path):
            return True
        if not _looks_like_data(path, self.suffixes):
            return False  # a parent-directory link, an index page, another site's page
        if self.allow_external:
            return True
        _paths.confine(self.fs, root, path, where=f"the listing of {self.item!r}")
        raise AssertionError("unreachable")  # pragma: no cover - confine raised

    def find(self, root: str, max_depth: int | None = None, start: str = "") -> list[str]:
        """The files below ``root`` (S3: only the keys below ``root/start``)."""
        fs = self.fs
        if not _paths.is_http(fs):
            # Object stores and local disks list by prefix: nothing outside is requested.
            s3 = _s3_of(fs)
            if s3 is not None:
                found = self._s3_keys(s3, root, start, one_level=max_depth == 1)
            elif is_local(fs):
                found = self._regular(root, self._local_find(root))
            else:
                found = remote.call(fs, "find", root, url=self.item, what="listing")
            return [p for p in found if self._keep(root, p)]
        # HTTP(S): a listing is the server's page of links. Walk it level by level and
        # request only directories inside the root (fsspec's own find would follow
        # every link it is given). The walk, all its pages, keeps to one deadline: a
        # server serving each page slowly (but in time) must not make it endless.
        end = time.monotonic() + current_policy().deadline
        # A file linked from two pages (a flat index and its folder's) is one file; two
        # links written otherwise ("a", "%61") are refused as naming one file twice.
        found: dict[str, None] = {}  # (in the order found)
        pending = [(root, 0)]
        seen = {root.rstrip("/")}
        while pending:
            directory, depth = pending.pop()
            if len(seen) > MAX_LISTED_DIRECTORIES:
                raise CorruptDataError(
                    f"the listing of {self.item!r} has more than {MAX_LISTED_DIRECTORIES} "
                    "directories: refusing to walk it further"
                )
            walked = f"{len(seen)} directories"
            entries = self._in_time(
                end, walked, fs, "ls", directory, detail=True, url=directory, what="listing"
            )
            for entry in entries:
                # A link "./name" (Caddy's listings) is "name", as a browser and aiohttp
                # resolve it; fsspec joins it as written. A dot segment in any other
                # reading (%2e) is still refused.
                name = re.sub(r"/(?:\./)+", "/", entry["name"])
                if entry.get("type") != "directory":
                    if name not in found and self._keep(root, name):
                        found[name] = None
                    continue
                key = name.rstrip("/")
                if key in seen or not _paths.is_inside(fs, root, name):
                    continue  # a parent link, a loop, another site: never requested
                if max_depth is not None and depth + 1 >= max_depth:
                    continue  # a glob's pattern cannot match below this level
                if depth + 1 > MAX_LISTING_DEPTH:
                    raise CorruptDataError(
                        f"the listing of {self.item!r} goes deeper than {MAX_LISTING_DEPTH} "
                        f"directories ({name!r}): refusing to walk it further"
                    )
                seen.add(key)
                pending.append((name, depth + 1))
        return list(found)

    def _s3_keys(
        self, fs: fsspec.AbstractFileSystem, root: str, start: str = "", *, one_level: bool = False
    ) -> list[str]:
        """The objects below prefix ``root`` of an S3 filesystem (one level of them if
        ``one_level``) whose names go on with ``start``, page by page under one deadline. s3fs's own listing follows a
        continuation token for as long as the server sends one, keeping every page: a
        token seen before, or more than :data:`MAX_LISTED_OBJECTS` objects, is refused."""
        bucket, key, _ = fs.split_path(root)
        ask = {
            "Bucket": bucket,
            "Prefix": (key.rstrip("/") + "/" if key else "") + start,
            **fs.req_kw,
        }
        if one_level:
            ask["Delimiter"] = "/"
        end = time.monotonic() + current_policy().deadline
        keys: list[dict[str, Any]] = []
        folders: list[str] = []
        tokens: set[int] = set()  # (hashes: a token is as long as the server makes it)
        while True:
            walked = f"{len(tokens) + 1} pages"
            page = self._in_time(
                end, walked, fs, "call_s3", "list_objects_v2", url=self.item, what="listing", **ask
            )
            for c in page.get("Contents") or ():
                if c["Key"][-1:] != "/":  # (a folder's placeholder is no file)
                    keys.append({**c, "Key": f"{bucket}/{c['Key']}", "type": "file"})
            for c in page.get("CommonPrefixes") or ():
                folders.append(f"{bucket}/{c['Prefix'].rstrip('/')}")
            if len(keys) > MAX_LISTED_OBJECTS:
                raise CorruptDataError(
                    f"the listing of {self.item!r} has more than {MAX_LISTED_OBJECTS} objects "
                    "(fs.MAX_LISTED_OBJECTS): refusing to hold it; name a narrower prefix"
                )
            if not page.get("IsTruncated"):
                _fill_dircache(fs, f"{bucket}/{ask['Prefix']}", keys, folders)
                return [c["Key"] for c in keys]
            token = page.get("NextContinuationToken") or ""
            if not token or hash(token) in tokens:
                named = "a continuation token seen before" if token else "no continuation token"
                raise CorruptDataError(
                    f"the listing of {self.item!r} does not end: page {len(tokens) + 1} says "
                    f"there is more but names {named}"
                )
            tokens.add(hash(token))
            ask["ContinuationToken"] = token

    def _local_find(self, root: str, max_depth: int | None = None) -> dict[str, dict[str, Any]]:
        """Each non-folder below a local ``root`` with its listed type (a link, a FIFO:
        ``type`` "other"; a linked folder is one, never walked)."""
        return remote.call(
            self.fs, "find", root, maxdepth=max_depth, detail=True, url=self.item, what="listing"
        )

    def _regular(self, root: str, found: dict[str, dict[str, Any]]) -> list[str]:
        """The regular files (and links to them) of a local listing below ``root``. A
        FIFO is never opened (its open waits for a writer), nor a socket or device: those
        a user would look for are named in a warning, as is a linked folder (fsspec does
        not walk one). A link named like data whose target is missing (a disk not
        mounted) is an error: its records would be lost. Only what the listing does not
        call a plain file is looked at again."""
        kept, odd, linked = [], [], []
        for p, info in found.items():
            if info.get("type") == "file" or os.path.isfile(p):  # (a link is "other")
                kept.append(p)
            elif not os.path.isdir(p):
                odd.append(p)
            elif os.path.islink(p) and not _hidden(root, p) and _is_data_file(p, ("",)):
                linked.append(p)  # listed, never walked (one named "." or "_" is not ours)
        data = [p for p in odd if _is_data_file(p, self.suffixes) and not _hidden(root, p)]
        for p in data:
            if not os.path.exists(p):  # (a FIFO, socket or device exists)
                link = f", a link to {os.readlink(p)!r}," if os.path.islink(p) else ""
                raise DatasetNotFoundError(
                    f"{self.item!r} holds {p!r}{link} which does not exist: its records "
                    "cannot be read (restore its target, or remove the link)"
                )
        told = sorted({*data, *non_data_files(root, odd, self.suffixes)})
        if told or linked:
            what = [describe_files(root, told), describe_files(root, linked, noun="linked folder")]
            warn_once(  # keyed by what it names (format detection lists other suffixes)
                ("not regular files", root, tuple(told), tuple(linked)),
                f"{self.item!r} holds {' and '.join(filter(None, what))}, skipped: not regular "
                "files (a FIFO, socket or device is never opened; nor a link to a missing file; "
                "a listing does not walk into a linked folder: name the folder to read it)",
            )
        return kept

    def _in_time(self, end: float, walked: str, *call: Any, **kwargs: Any) -> Any:
        """``remote.call(*call, **kwargs)`` within what is left of the listing's deadline
        (``end``, of the current policy); past it, a RemoteIOError saying what was
        ``walked``."""
        policy = current_policy()
        left, cause = end - time.monotonic(), None
        try:
            if left > 0:
                with using(dataclasses.replace(policy, deadline=left)):
                    return remote.call(*call, **kwargs)
        except RemoteIOError as e:
            if time.monotonic() < end:
                raise
            cause = e
        raise RemoteIOError(
            f"the listing of {self.item!r} did not end within its {policy.deadline:g} s "
            f"deadline (RetryPolicy.deadline) after {walked}; name the files (or a glob), "
            "or give the source a longer deadline"
        ) from cause

    def glob(self, pattern: str) -> list[str]:
        fs = self.fs
        cut = min(pattern.index(c) for c in "*?[" if c in pattern)
        base = pattern[:cut].rsplit("/", 1)[0] if "/" in pattern[:cut] else ""
        rel = pattern[len(base) :].lstrip("/")
        depth = None if "**" in rel else rel.count("/") + 1
        translate = glob_translate or _glob_translate
        regex = re.compile(translate(rel))
        if is_local(fs):
            # Listed to its depth: what the pattern names, and a linked folder it passes
            # (one matching a leading part of it: named in a warning), is looked at.
            root = base or ("/" if pattern.startswith("/") else "")
            parts = rel.split("/")
            leads = [re.compile(translate("/".join(parts[:k]))) for k in range(1, len(parts))]

            def named(p: str, info: dict[str, Any]) -> bool:
                r = p[len(base) :].lstrip("/")
                if regex.fullmatch(r):
                    return True
                linked = bool(info.get("islink")) and any(x.fullmatch(r) for x in leads)
                return linked and os.path.isdir(p)

            found = self._local_find(root, depth)
            found = {p: info for p, info in found.items() if named(p, info)}
            return [p for p in self._regular(root, found) if self._keep(root, p)]
        if not _paths.is_http(fs) and _s3_of(fs) is None:
            found = remote.call(fs, "glob", pattern, url=self.item, what="listing")
            files = [p for p in found if remote.isfile(fs, p, url=_unstrip(fs, p))]
            return [p for p in files if self._keep(base, p)]
        return [
            p
            for p in self.find(
                base, max_depth=depth, start=re.split(r"[*?\[/]", rel, maxsplit=1)[0]
            )
            if regex.fullmatch(p[len(base) :].lstrip("/"))
        ]


_SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5,})-of-(?P<n>\d{5,})(?P<ext>\.[^/]*)?$")


class ShardPaths(Sequence[str]):
    """A dataset's shard paths, held compactly: a process keeps them for as long as it
    reads, and 10,000 Python strings cost it a megabyte.

    Paths named ``PREFIX-00000-of-N.EXT`` ... in order (what writers make) are kept as
    the pattern alone; others as one byte string per path beyond their common prefix.

    Example:
        >>> p = ShardPaths([f"/d/data-{i:05d}-of-00003.x" for i in range(3)])
        >>> p[2], len(p), list(p) == [f"/d/data-{i:05d}-of-00003.x" for i in range(3)]
        ('/d/data-00002-of-00003.x', 3, True)
        >>> q = ShardPaths(["/d/a.x", "/d/bb.x"])
        >>> q[-1], q[0:1]
        ('/d/bb.x', ['/d/a.x'])
    """

    __slots__ = ("_n", "_names", "_prefix", "_template")

    def __init__(self, paths: Sequence[str]) -> None:
        paths = list(paths)
        self._n = len(paths)
        self._template: tuple[str, int, str] | None = None
        self._names: np.ndarray | None = None
        m = _SHARD_NAME.match(paths[0]) if paths else None
        if m and int(m["i"]) == 0 and int(m["n"]) == len(paths):
            head = f"{m['stem']}-"
            tail = f"-of-{m['n']}{m['ext'] or ''}"
            width = len(m["i"])
            if all(p == f"{head}{i:0{width}d}{tail}" for i, p in enumerate(paths)):
                self._template = (head, width, tail)
                self._prefix = ""
                return
        # by character, not by path component: only the shared text is stored once
        self._prefix = prefix = os.path.commonprefix(paths)  # noqa: RUF071 ("" for none)
        rest = [p[len(prefix) :].encode("utf-8", "surrogateescape") for p in paths]
        self._names = np.array(rest, dtype=f"S{max(map(len, rest), default=1) or 1}")
        if any(r.endswith(b"\0") for r in rest):  # numpy would strip them: keep a list
            self._names = np.array(rest, dtype=object)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"shard {i} out of range [0, {self._n})")
        if self._template is not None:
            head, width, tail = self._template
            return f"{head}{i:0{width}d}{tail}"
        assert self._names is not None
        return self._prefix + self._names[i].decode("utf-8", "surrogateescape")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ShardPaths, list, tuple)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardPaths({self._n} paths, first {self[0]!r})" if self._n else "ShardPaths([])"

    def __getstate__(self) -> tuple[Any, ...]:
        return (self._n, self._template, self._prefix, self._names)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._n, self._template, self._prefix, self._names = state


def check_shard_sets(paths: Sequence[str], *, where: str = "") -> None:
    """Refuse a directory whose ``NAME-00003-of-00008`` shard sets are incomplete.

    Writers (torchgrain's, TFDS, Beam) name shards ``...-iiiii-of-nnnnn``; a directory
    missing some of them was copied or written only in part, and reading it would
    silently drop records.

    Example:
        >>> check_shard_sets(["d/a-00000-of-00002.x", "d/a-00001-of-00002.x"])
        >>> check_shard_sets(["d/a-00000-of-00003.x"])
        Traceback (most recent call last):
        ...
        torchgrain.errors.DatasetNotFoundError: incomplete shard set d/a-*-of-00003.x: shards 1, 2 of 3 are missing
    """
    sets: dict[tuple[str, str, str], set[int]] = {}
    for p in paths:
        m = _SHARD_NAME.match(p.rstrip("/"))
        if m:
            key = (m["stem"], m["n"], m["ext"] or "")
            sets.setdefault(key, set()).add(int(m["i"]))
    for (stem, n, ext), have in sets.items():
        missing = sorted(set(range(int(n))) - have)
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise DatasetNotFoundError(
                f"incomplete shard set {stem}-*-of-{n}{ext}{' in ' + where if where else ''}: "
                f"shards {shown} of {int(n)} are missing"
            )


def _looks_like_data(path: str, suffixes: tuple[str, ...]) -> bool:
    """Whether a listed location would be a data file in any reading of its name
    (``..%2fsecret%2fx.parquet`` is ``x.parquet`` to a server that decodes it)."""
    for _ in range(_paths.MAX_DECODINGS + 1):
        if _is_data_file(path.replace("\\", "/"), suffixes):
            return True
        decoded = unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True  # encoded more times than anyone decodes: treat it as data


def _hidden(root: str, path: str) -> bool:
    """Whether ``path`` lies in a directory below ``root`` whose name starts with ``.`` or
    ``_`` (``root/.index/x``, ``root/_temporary/0/x``, ``root/_delta_log/x``): not the
    dataset's (an index or cache kept beside it, a ``.git``, a job's uncommitted attempts,
    a table log), as pyarrow, Spark and Hive skip them.

    Example:
        >>> _hidden("/d", "/d/.index/a.tfrecord"), _hidden("/d", "/d/_temporary/0/a.parquet")
        (True, True)
        >>> _hidden("/home/.cache/d", "/home/.cache/d/a")
        False
    """
    base = root.rstrip("/") + "/"
    if not path.startswith(base):
        return False  # (outside: the listing's confinement decides)
    return any(s.startswith((".", "_")) for s in path[len(base) :].split("/")[:-1])


def _is_data_file(path: str, suffixes: tuple[str, ...]) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return not name.startswith((".", "_")) and any(s in name for s in suffixes)
