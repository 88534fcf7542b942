"""Resolve user-given paths (directory, glob, file, list, fsspec URL) to shard files.

Sources accept any of these, local or remote; this module turns them into a sorted,
de-duplicated list of concrete file paths plus the fsspec filesystem that reads them.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from torchgrain.errors import DatasetNotFoundError

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
    path: PathLike, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path_without_protocol)`` for a local path or fsspec URL.

    Example:
        >>> fs, p = get_filesystem("/tmp")
        >>> fs.protocol[0] in ("file", "local")
        True
    """
    return url_to_fs(os.fspath(path), **(storage_options or {}))


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
    if is_local(fs):
        return fs
    return pickle.loads(pickle.dumps(fs))


def map_files(fn: Callable[[int], T], n: int, *, max_workers: int = 16) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]``, run on up to ``max_workers`` threads: opening a dataset
    reads every shard's footer or index, and remote reads wait on latency, not CPU.

    Example:
        >>> map_files(lambda i: i * i, 4)
        [0, 1, 4, 9]
    """
    if n <= 1 or max_workers <= 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=min(max_workers, n)) as pool:
        return list(pool.map(fn, range(n)))


def _unstrip(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Give back a URL that fsspec can open again (keeps the protocol for remote files)."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def expand_paths(
    paths: PathLike | Sequence[PathLike],
    *,
    suffixes: Iterable[str],
    storage_options: dict[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    kind: str = "shard",
) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Expand a directory, glob, file, or list of them into sorted shard paths.

    A directory is searched recursively for files whose name contains one of
    ``suffixes`` (so ``.array_record`` also finds ``x.array_record-00000-of-00008``).
    Hidden files and files starting with ``_`` or ``.`` are skipped.

    Raises:
        DatasetNotFoundError: when a path does not exist or nothing matches.

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
    fs = filesystem
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if filesystem is None:
            item_fs, stripped = get_filesystem(item, storage_options)
        else:
            item_fs, stripped = filesystem, filesystem._strip_protocol(item)
        if fs is None:
            fs = item_fs
        if _has_glob(stripped):
            found = sorted(p for p in item_fs.glob(stripped) if item_fs.isfile(p))
            if not found:
                raise DatasetNotFoundError(f"glob {item!r} matched no {kind} file")
            out.extend(_unstrip(item_fs, p) for p in found)
        elif item_fs.isdir(stripped):
            found = sorted(p for p in item_fs.find(stripped) if _is_data_file(p, suffixes))
            if not found:
                raise DatasetNotFoundError(
                    f"directory {item!r} holds no {kind} file (looked for names containing "
                    f"{', '.join(suffixes)})"
                )
            check_shard_sets(found, where=item)
            out.extend(_unstrip(item_fs, p) for p in found)
        elif item_fs.isfile(stripped):
            out.append(_unstrip(item_fs, stripped))
        else:
            raise DatasetNotFoundError(f"{kind} path {item!r} does not exist")
    assert fs is not None
    # Keep the first occurrence of each path, preserving the order given.
    seen: set[str] = set()
    unique = [p for p in out if not (p in seen or seen.add(p))]
    return fs, unique


_SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5,})-of-(?P<n>\d{5,})(?P<ext>\.[^/]*)?$")


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


def _is_data_file(path: str, suffixes: tuple[str, ...]) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith((".", "_")):
        return False
    return any(s in name for s in suffixes)
