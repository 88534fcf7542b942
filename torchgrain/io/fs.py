"""Resolve user-given paths (directory, glob, file, list, fsspec URL) to shard files.

Sources accept any of these, local or remote; this module turns them into a sorted,
de-duplicated list of concrete file paths plus the fsspec filesystem that reads them.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
import numpy as np
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
        if paths:
            m = _SHARD_NAME.match(paths[0])
            if m and int(m["i"]) == 0 and int(m["n"]) == len(paths):
                head = f"{m['stem']}-"
                tail = f"-of-{m['n']}{m['ext'] or ''}"
                width = len(m["i"])
                if all(p == f"{head}{i:0{width}d}{tail}" for i, p in enumerate(paths)):
                    self._template = (head, width, tail)
                    self._prefix = ""
                    return
        # by character, not by path component: only the shared text is stored once
        prefix = os.path.commonprefix(paths) if paths else ""  # noqa: RUF071
        self._prefix = prefix
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

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(self._n))

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


def _is_data_file(path: str, suffixes: tuple[str, ...]) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith((".", "_")):
        return False
    return any(s in name for s in suffixes)
