"""torchgrain's caches on disk: where they are, what they hold, and clearing them.

What torchgrain writes on its own lies under one root, :func:`~torchgrain.io.fs.default_cache_dir`
(``$TORCHGRAIN_CACHE``, else ``~/.cache/torchgrain``), one directory per cache:

* ``parquet-decoded``: decoded Parquet row groups (the node's decoded disk cache);
* ``<kind>-index``: node-shared index files: ``arrayrecord-index`` and
  ``tfrecord-index`` (record offsets), and derived ones (``filter-index``,
  ``windows-index``, ``select-index``...);
* ``demo-<N>``: the datasets ``torchgrain demo`` made.

A shard cache (the local copies of remote shards) lives where ``cache_dir=`` says:
:func:`list_caches` and :func:`clear_cache` take its directory.

Each cache says once per process, when it first writes, where it writes and its budget
(:func:`announce`, a :class:`CacheNotice`). Clearing deletes what lies inside a cache's
directory and never follows a symbolic link: a link is removed, never what it points to.

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(root, "filter-index"))
    >>> with open(os.path.join(root, "filter-index", "k.tgindex"), "wb") as f:
    ...     _ = f.write(b"x" * 10)
    >>> [(c["name"], c["bytes"], c["entries"]) for c in list_caches(root)]
    [('filter-index', 10, 1)]
    >>> clear_cache("filter-index", root)["bytes"], list_caches(root)[0]["bytes"]
    (10, 0)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from typing import Any

from torchgrain.errors import warn_once

__all__ = ["CacheNotice", "announce", "clear_cache", "list_caches"]


class CacheNotice(UserWarning):
    """A cache of torchgrain's writes to disk for the first time in this process: where,
    and within what budget. Silence it with
    ``warnings.filterwarnings("ignore", category=torchgrain.caches.CacheNotice)``."""


def announce(what: str, directory: str, budget: str) -> bool:
    """Say once per process and directory that ``what`` writes under ``directory``
    within ``budget``, and how to see and clear it; whether it said so.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     announce("a cache", "/tmp/tg-example", "1 GB"), announce("a", "/tmp/tg-example", "")
        (True, False)
        >>> print(seen[0].message)  # doctest: +ELLIPSIS
        torchgrain: a cache writes to /tmp/tg-example (budget 1 GB); see it with `torchgrain cache list`...
    """
    directory = os.path.abspath(directory)
    return warn_once(
        ("cache writes", directory),
        f"torchgrain: {what} writes to {directory} (budget {budget}); see it with "
        "`torchgrain cache list`, empty it with `torchgrain cache clear "
        f"{_name_in_root(directory)}`",
        CacheNotice,
    )


def size_text(nbytes: int) -> str:
    """``nbytes`` for people: ``'64.0 GiB'``.

    Example:
        >>> size_text(64 << 30), size_text(1536)
        ('64.0 GiB', '1.5 KiB')
    """
    if nbytes < 1024:
        return f"{int(nbytes)} bytes"
    power = min(3, (int(nbytes).bit_length() - 1) // 10)  # the largest unit below it
    return f"{nbytes / 1024**power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"


def _name_in_root(directory: str) -> str:
    from torchgrain.io.fs import default_cache_dir

    root = os.path.abspath(default_cache_dir())
    return os.path.basename(directory) if os.path.dirname(directory) == root else directory


def _kind(name: str, path: str) -> tuple[str, str]:
    """(what the directory holds, the suffix of its entries; "" for any file)."""
    if name == "parquet-decoded":
        return "decoded Parquet row groups", ".arrow"
    if name.endswith("-index"):
        return f"{name[: -len('-index')]} index files", ".tgindex"
    if name.startswith("demo-"):
        return "torchgrain demo dataset", ""
    if os.path.isdir(os.path.join(path, ".sums")):
        return "shard cache (local copies of remote shards)", ""
    return "other", ""


def _marked(path: str) -> bool:
    """Whether ``path`` holds a shard or decoded cache's bookkeeping (.sums or .locks)."""
    return any(os.path.isdir(os.path.join(path, m)) for m in (".sums", ".locks"))


def _walk(path: str) -> tuple[int, list[str]]:
    """Bytes of the regular files under ``path`` and their paths, never through a link."""
    total, files = 0, []
    stack = [path]  # not os.walk: it recurses a level deep per directory before 3.12
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            elif e.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    total += e.stat(follow_symlinks=False).st_size
                    files.append(e.path)
    return total, files


def _describe(name: str, path: str) -> dict[str, Any]:
    kind, suffix = _kind(name, path)
    nbytes, files = _walk(path)
    rel = [os.path.relpath(f, path) for f in files]
    if suffix:
        entries = sum(f.endswith(suffix) for f in rel)
    else:  # data files: not bookkeeping (dot-named files and folders, locks)
        entries = sum(
            not any(p.startswith(".") for p in f.split(os.sep)) and not f.endswith(".lock")
            for f in rel
        )
    return {
        "name": name,
        "kind": kind,
        "path": path,
        "bytes": nbytes,
        "entries": entries,
        "dataset": path if name.startswith("demo-") else None,
    }


def list_caches(
    root: str | os.PathLike | None = None, extra: Sequence[str | os.PathLike] = ()
) -> list[dict[str, Any]]:
    """Each cache under ``root`` (default: :func:`~torchgrain.io.fs.default_cache_dir`)
    and each directory of ``extra`` (a shard cache's ``cache_dir``): dicts of ``name``,
    ``kind`` (what it holds), ``path``, ``bytes`` (its files' sizes), ``entries`` (the
    cached items: row groups, index files, shard copies, dataset files) and ``dataset``
    (the dataset it holds, where known; else None). Links inside are not followed; a
    link at the root is not a cache of torchgrain's, and is not listed.
    """
    from torchgrain.io.fs import default_cache_dir

    root = os.path.realpath(os.fspath(root if root is not None else default_cache_dir()))
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    out = [
        _describe(e.name, e.path)
        for e in entries
        if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
    ]
    for d in extra:
        path = os.path.realpath(os.fspath(d))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"cache directory {os.fspath(d)!r} does not exist")
        out.append(_describe(path, path))
    return out


def clear_cache(name: str, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Delete what the cache ``name`` holds: a name :func:`list_caches` gives under
    ``root``, or the path of a shard cache or decoded-cache directory elsewhere. Returns
    the cache as :func:`list_caches` described it before. The directory stays; links
    inside are removed, never followed (nothing outside the directory is deleted).
    Processes reading a file deleted here keep reading it (POSIX).

    Raises:
        ValueError: ``name`` is not a cache of torchgrain's (not under ``root``, a link,
            a directory there or elsewhere that is not one of its caches).
    """
    from torchgrain.io.fs import default_cache_dir

    root = os.path.realpath(os.fspath(root if root is not None else default_cache_dir()))
    if os.sep in name or name in (".", ".."):
        path = os.path.abspath(name)
        if os.path.islink(path) or not _marked(path):
            raise ValueError(
                f"{name!r} is not a torchgrain cache directory (a shard cache or decoded "
                "cache holds .sums or .locks); nothing deleted"
            )
        before = _describe(path, path)
    else:
        path = os.path.join(root, name)
        # "" would be the root itself: every cache at once.
        if not name or name.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
            known = [c["name"] for c in list_caches(root)]
            raise ValueError(f"no cache {name!r} in {root}; the caches there are {known}")
        before = _describe(name, path)
        if before["kind"] == "other" and not _marked(path):  # a dataset kept beside them
            raise ValueError(f"{path!r} is not a torchgrain cache; nothing deleted")
    for e in list(os.scandir(path)):
        if e.name == ".locks" and e.is_dir(follow_symlinks=False):
            continue  # locks other processes may hold (empty files)
        if e.is_dir(follow_symlinks=False):
            # rmtree removes links without following them (and refuses a top-level one).
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
    return before
