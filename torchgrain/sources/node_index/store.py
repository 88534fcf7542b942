"""Index files of a node index: their arrays, checks, and where they live on a machine.

What the ArrayRecord, TFRecord and derived indexes (:mod:`.arrayrecord`, :mod:`.tfrecord`,
:mod:`.derived`) share, and their interface to it: the arrays of an index file or of
memory (:class:`IndexArrays`, :class:`NodeIndex`), the checks of their shapes and prefix
sums (:func:`check_shape`, :func:`check_prefix`, :func:`check_meta_int`), a build into a
file or memory (:func:`build_index`), and the index directory (:func:`cached_index`,
:func:`open_trusted`): a key per set of files (:func:`index_key`), one builder per machine
under its lock, and stamps of verified files. The directory is a node-local store
(:class:`IndexDir`): its lock per index, byte budget and eviction, temp files and
atomic publish. A directory that cannot take an index (read-only, or with no room: a
full disk, a spent quota, a file-size limit) leaves nothing partial in it; the index is
built in the process's memory instead, with a warning (for no room, once per directory
and process, naming the directory, the file and the remedy).

Building streams: the shards are read in parallel threads (:func:`in_order`), each
shard's entries written into the index file's columns as soon as the shards before it
are, with at most :data:`BUILD_BYTES` of parsing held at once whatever the number of
records; a build that takes more than a few seconds says how far it has got on stderr
(:class:`BuildProgress`).

Example:
    >>> index_key("tfrecord", [("a", 1, 2)]) == index_key("tfrecord", [("a", 1, 2)])
    True
    >>> check_prefix(np.array([0, 2, 5]), 5, "(in memory)", "rec_base").tolist()
    [2, 3]
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import functools
import hashlib
import os
import re
import stat
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import numpy as np

from torchgrain.caches import announce, size_text
from torchgrain.errors import CorruptDataError, DatasetNotFoundError
from torchgrain.formats.index_file import INDEX_SUFFIX, IndexFile, IndexFileWriter
from torchgrain.io import process
from torchgrain.io.atomic import DISK_FULL_ERRNOS
from torchgrain.io.cache_records import file_identity
from torchgrain.io.file_hash import verify_file_hash
from torchgrain.io.fs import default_cache_dir
from torchgrain.io.node_store import NodeStore, unlink_quietly

# The names users see (re-exported by torchgrain.sources.node_index); the index kinds'
# interface to the store (see the module docstring) is public too.
__all__ = [
    "BUILD_BYTES",
    "COUNTERS",
    "INDEX_DIR_BYTES",
    "INDEX_LOCK_WAIT_ENV",
    "INDEX_NAME",
    "BuildProgress",
    "default_index_dir",
    "index_lock_wait",
    "open_index",
]

#: The index file torchgrain's writers put beside a dataset's shards.
INDEX_NAME = "torchgrain" + INDEX_SUFFIX
#: Indexes built (``*_builds``) and beside-the-shards indexes verified, in this process.
COUNTERS = {"arrayrecord_builds": 0, "tfrecord_builds": 0, "verified": 0}
#: Index files an index directory keeps, in bytes; the least recently used go first.
INDEX_DIR_BYTES = 32 << 30
#: The layout version every index kind writes in its metadata and its key.
VERSION = 1
_BATCH = 256  # shards whose footers are read together while building
#: Bytes an index build may hold at once for shards read but not yet written into the
#: index file (their parsed footers or offsets, as estimated by the reader); a shard
#: that needs more than this alone is read alone.
BUILD_BYTES = 256 << 20
# Shards read at once: parsing a footer is CPU work (as many as there are cores), and a
# few more hide disk or network waits. Not more: each thread's allocator arena keeps
# some of what it freed (about a footer's parse), after the build too.
_BUILD_THREADS = max(4, min(16, os.cpu_count() or 1))
_PROGRESS_AFTER = 2.0  # seconds of building before progress is reported
_PROGRESS_EVERY = 5.0  # seconds between progress lines
_T = TypeVar("_T")
# Why an index directory cannot take an index (anything else is raised; EAGAIN: its
# eviction lock held by another process, NodeStore._evict_lock).
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}
_UNWRITABLE |= {errno.EAGAIN, errno.ELOOP}  # (ELOOP: a link where a lock file goes)
_UNWRITABLE |= DISK_FULL_ERRNOS
_STAMPS = "verified"  # stamps of index files whose contents were checked
#: The environment variable bounding, in seconds, how long an open waits for another
#: process's build of the same index (default 900) before building it too; ``0``: never.
INDEX_LOCK_WAIT_ENV = "TORCHGRAIN_INDEX_LOCK_WAIT"
_LOCK_WAIT = 900.0  # (its default)
_SAY_WAIT = 5.0  # seconds of waiting for another process's build before saying so


def index_lock_wait(deadline: float | None = None) -> float:
    """Seconds an open waits for another process's build of the same index before building
    it too: ``$TORCHGRAIN_INDEX_LOCK_WAIT``, else 900, and at most a
    source's retry ``deadline`` when it was given one (``retry=RetryPolicy(deadline=...)``).

    Raises:
        ValueError: the variable is not a number of seconds >= 0 (named).

    Example:
        >>> index_lock_wait() == float(os.environ.get(INDEX_LOCK_WAIT_ENV, 900))
        True
        >>> index_lock_wait(2.0)
        2.0
    """
    text = os.environ.get(INDEX_LOCK_WAIT_ENV, "").strip()
    try:
        wait = float(text) if text else _LOCK_WAIT
    except ValueError:
        wait = -1.0
    if not 0 <= wait < float("inf"):
        raise ValueError(f"{INDEX_LOCK_WAIT_ENV} must be a number of seconds >= 0, got {text!r}")
    return wait if deadline is None else min(wait, max(0.0, deadline))


def default_index_dir(kind: str) -> str:
    """``<torchgrain cache>/<kind>-index`` (see :func:`~torchgrain.io.fs.default_cache_dir`).

    Example:
        >>> default_index_dir("arrayrecord").endswith("arrayrecord-index")
        True
    """
    return os.path.join(default_cache_dir(), f"{kind}-index")


# ---------------------------------------------------------------- the arrays
class IndexArrays:
    """Named arrays from an index file (mapped) or from memory; pickles as the file's name."""

    #: ``(index directory, class)`` of an index from :func:`cached_index`: pickling puts
    #: its file back there when it was evicted while mapped (see :func:`_file_in_place`).
    placed: tuple[str, Any] | None = None

    def __init__(
        self, kind: str, arrays: dict[str, np.ndarray], meta: dict[str, Any], file: IndexFile | None
    ) -> None:
        self.kind, self.arrays, self.meta, self.file = kind, arrays, meta, file

    @property
    def path(self) -> str | None:
        """The index file mapped (None: in memory)."""
        return self.file.path if self.file is not None else None

    def __getstate__(self) -> dict[str, Any]:
        if self.file is None:
            return {"kind": self.kind, "arrays": self.arrays, "meta": self.meta}
        if self.placed is not None:
            f = _file_in_place(self.file, *self.placed)
            return {"kind": self.kind, "path": f.path, "identity": f.identity}
        # (an index beside a dataset): not written since it was mapped, else raised here;
        # then its times now, not a rewrite (a touch, chmod or hard link moves them)
        f = self.file
        f.check()
        identity = f.identity
        with contextlib.suppress(OSError):
            now = file_identity(os.stat(f.path))
            identity = now if now[:3] == identity[:3] else identity
        return {"kind": self.kind, "path": f.path, "identity": identity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.kind = state["kind"]
        if "path" not in state:
            self.arrays, self.meta, self.file = state["arrays"], state["meta"], None
            return
        # A spawned worker maps the file its parent opened: the very same file.
        f = IndexFile.open(state["path"], self.kind)
        if f.identity != tuple(state["identity"]):
            raise _replaced(state["path"])
        self.arrays, self.meta, self.file = f.arrays, f.meta, f


def _replaced(path: str) -> CorruptDataError:
    return CorruptDataError(
        f"index file {path!r} was replaced after the dataset was opened; open the dataset again"
    )


class NodeIndex:
    """What the ArrayRecord and TFRecord indexes share: their arrays (:class:`IndexArrays`),
    checked by the subclass's ``_derive`` when made and when unpickled (a pickle carries
    the index file's name, not its arrays)."""

    kind: str
    counts: np.ndarray  # records per shard
    file_size: np.ndarray  # bytes per shard (and rec_base, mtime_ns: see _counts)

    def __init__(self, arrays: IndexArrays) -> None:
        self._a = arrays
        self._derive()

    def _derive(self) -> None:
        raise NotImplementedError

    @property
    def path(self) -> str | None:
        """The mapped index file (None: the index is in memory)."""
        return self._a.path

    @property
    def num_shards(self) -> int:
        return len(self.counts)

    def check_unchanged(self, *, polled: bool = False) -> None:
        """Raise :class:`~torchgrain.io.changes.ChangedWhileOpen` if the index file this
        index maps was written or truncated since it was opened (see
        :meth:`IndexFile.check`); sources call it before each read."""
        f = self._a.file
        if f is not None:
            f.check(polled=polled)

    def __getstate__(self) -> IndexArrays:
        return self._a

    def __setstate__(self, arrays: IndexArrays) -> None:
        self._a = arrays
        self._derive()

    def _counts(self) -> tuple[dict[str, np.ndarray], dict[str, Any], str, int, np.ndarray]:
        """For ``_derive``: the arrays, the metadata, the index's name in errors, the
        number of shards the metadata gives and the records per shard (checked against
        its number of records); sets the arrays every kind has, checked: ``rec_base``,
        ``file_size`` and ``mtime_ns``."""
        a, meta = self._a.arrays, self._a.meta
        where = repr(self._a.path) if self._a.path else "(in memory)"
        if meta.get("version") != VERSION:
            raise index_error(where, f"unsupported version {meta.get('version')!r:.20}")
        s = check_meta_int(meta, where, "num_shards")
        n = check_meta_int(meta, where, "num_records")
        self.rec_base = check_shape(a, where, "rec_base", (s + 1,))
        self.file_size = check_shape(a, where, "file_size", (s,))
        self.mtime_ns = check_shape(a, where, "mtime_ns", (s,))
        return a, meta, where, s, check_prefix(self.rec_base, n, where, "rec_base")

    def not_made_for(self, key: str, sizes: np.ndarray) -> str | None:
        """Why this index does not describe the files of ``key`` (:func:`index_key`) whose
        sizes are ``sizes``, or None."""
        if self._a.meta.get("key") != key:  # a file under another's name
            return "it was made for other files"
        if self.num_shards != len(sizes) or not np.array_equal(self.file_size, sizes):
            return "it describes other files"
        return None


def index_error(where: str, msg: str) -> CorruptDataError:
    """The error for a damaged index: ``index WHERE: MSG`` (``where``: its file, quoted).

    Example:
        >>> str(index_error("'/i.tgindex'", "bad num_shards"))
        "index '/i.tgindex': bad num_shards"
    """
    return CorruptDataError(f"index {where}: {msg}")


def check_shape(
    a: dict[str, np.ndarray], where: str, name: str, shape: tuple[int, ...]
) -> np.ndarray:
    """The array ``a[name]``, which must have ``shape`` (else :func:`index_error`).

    Example:
        >>> check_shape({"n": np.zeros(3)}, "(in memory)", "n", (3,)).shape
        (3,)
    """
    arr = a.get(name)
    if arr is None or arr.shape != shape:
        got = None if arr is None else arr.shape
        raise index_error(where, f"array {name!r} has shape {got}, expected {shape}")
    return arr


def check_meta_int(meta: dict[str, Any], where: str, key: str) -> int:
    """``meta[key]``, which must be an int in ``[0, 2**62)`` (else :func:`index_error`).

    Example:
        >>> check_meta_int({"num_shards": 4}, "(in memory)", "num_shards")
        4
    """
    v = meta.get(key)
    if type(v) is not int or not 0 <= v < 1 << 62:
        raise index_error(where, f"bad {key} {v!r:.40}")
    return v


def check_prefix(arr: np.ndarray, total: int, where: str, name: str) -> np.ndarray:
    """The counts of the prefix sum ``arr``, which must rise from 0 to ``total`` (else
    :func:`index_error`); see the module's example."""
    if len(arr) == 0 or arr[0] != 0 or arr[-1] != total or bool((np.diff(arr) < 0).any()):
        raise index_error(where, f"{name} is not a prefix sum from 0 to {total}")
    return np.diff(arr)


class _MemorySink:
    """What :class:`IndexFileWriter` does, into memory."""

    def __init__(self, kind: str, columns: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self.kind = kind
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in columns}
        self.columns = columns

    def append(self, name: str, rows: np.ndarray) -> None:
        dtype, trailing = self.columns[name]
        self.parts[name].append(np.asarray(rows, dtype=np.dtype(dtype)).reshape(-1, *trailing))

    def arrays(self, meta: dict[str, Any]) -> IndexArrays:
        out = {}
        for k, parts in self.parts.items():
            dtype, trailing = self.columns[k]
            arr = np.concatenate(parts) if parts else np.zeros((0, *trailing), np.dtype(dtype))
            arr.setflags(write=False)
            out[k] = arr
        return IndexArrays(self.kind, out, meta, None)

    def abort(self) -> None:
        self.parts = {}


def open_index(path: str, cls: Any) -> Any:
    """Map and validate the index file at ``path`` as ``cls`` (:class:`ArrayRecordIndex`
    or :class:`TFRecordIndex`)."""
    f = IndexFile.open(path, cls.kind)
    return cls(IndexArrays(cls.kind, f.arrays, f.meta, f))


def build_index(
    cls: Any,
    out: str | None,
    columns: dict[str, tuple[str, tuple[int, ...]]],
    fill: Callable[[Any], dict[str, Any]],
) -> Any:
    """A new index ``cls`` (:class:`NodeIndex`): ``fill(sink)`` appends its columns to the
    sink (an :class:`IndexFileWriter` or a :class:`_MemorySink`) and returns its metadata.
    Published atomically at ``out`` and mapped from there, or in memory (``out=None``);
    nothing is left at ``out`` when building fails."""
    sink: Any = (
        IndexFileWriter(out, cls.kind, columns)
        if out is not None
        else _MemorySink(cls.kind, columns)
    )
    try:
        meta = fill(sink)
        if out is None:
            return cls(sink.arrays(meta))
        sink.publish(meta)
    except BaseException:
        sink.abort()
        raise
    return open_index(out, cls)


# ------------------------------------------------------------------ building
class BuildProgress:
    """Says on stderr how far a long index build has got: ``torchgrain: indexing N shards
    of WHAT: k/N`` once the build has run :data:`_PROGRESS_AFTER` seconds, then every
    :data:`_PROGRESS_EVERY` seconds, and a last line with the time taken; nothing for a
    build shorter than that (a progress bar would only flicker in logs).

    Example:
        >>> p = BuildProgress(3, "/data/train")
        >>> p.update(3); p.close()  # fast: silent
    """

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what, self.said = total, what, False
        self.start = time.monotonic()
        self._next = self.start + _PROGRESS_AFTER

    def update(self, done: int) -> None:
        """``done`` of the ``total`` shards are indexed."""
        now = time.monotonic()
        if now >= self._next:
            self._say(f"{done}/{self.total}")
            self._next = now + _PROGRESS_EVERY

    def close(self) -> None:
        """The build ended (the last line, if any was said)."""
        if self.said:
            self._say(f"{self.total}/{self.total}, done in {time.monotonic() - self.start:.1f} s")

    def _say(self, how_far: str) -> None:
        self.said = True
        # The stream is looked up now: a test or a notebook may have replaced it.
        print(
            f"torchgrain: indexing {self.total} shards of {self.what}: {how_far}",
            file=sys.stderr,
            flush=True,
        )


def dataset_name(paths: Sequence[str]) -> str:
    """What a set of shard paths is called in progress lines: their common directory.

    Example:
        >>> dataset_name(["/d/train/a.x", "/d/train/b.x"]), dataset_name(["/d/a.x"])
        ('/d/train', '/d/a.x')
    """
    if len(paths) == 1:
        return str(paths[0])
    try:  # the first and the last: O(1), and paths are sorted
        return os.path.commonpath([os.path.dirname(paths[0]), os.path.dirname(paths[-1])])
    except ValueError:  # relative and absolute, or other drives
        return f"{paths[0]} and {len(paths) - 1} more"


class _Threads(process.ForkSafeThreadPool):
    """The threads of one build (:func:`in_order`), never running across a fork (see
    :class:`~torchgrain.io.process.ForkSafeThreadPool`): right before this process forks,
    the calls not yet started are cancelled (:class:`_Call` submits them again) and the
    running ones joined; while the fork is under way the build runs its calls in its own
    thread, starting none, and on threads again after it. A forked child gets threads of
    its own."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, "torchgrain-index")
        # The threads run in the caller's context (its retry policy and deadlines), as
        # map_files's do.
        self.context = contextvars.copy_context()

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> Future:  # type: ignore[override]
        return super().submit(self.context.copy().run, fn, arg)

    def close(self) -> None:
        """Cancel the calls not started and join the running ones."""
        with self._lock:
            pool = self._pool  # kept until joined: a fork meanwhile joins it too
        if pool is not None and self._token == process.token():
            pool.shutdown(wait=True, cancel_futures=True)
        self.shutdown()

    def _stop_threads_for_fork(self, wait: bool = True, cancel_futures: bool = True) -> None:
        super()._stop_threads_for_fork(wait, cancel_futures)


class _Call:
    """``fn(arg)`` on a build's threads (:class:`_Threads`), submitted again when a fork
    cancelled it before it started."""

    def __init__(self, threads: _Threads, fn: Callable[[Any], Any], arg: Any) -> None:
        self.threads, self.fn, self.arg = threads, fn, arg
        self.future = threads.submit(fn, arg)

    def result(self) -> Any:
        while True:
            try:
                return self.future.result()
            except CancelledError:
                if not self.future.cancelled():
                    raise  # fn's own
                self.future = self.threads.submit(self.fn, self.arg)


def in_order(
    n: int,
    peek: Callable[[int], tuple[Any, int]],
    work: Callable[[Any], _T],
    *,
    budget: int | None = None,
    max_workers: int | None = None,
    close: Callable[[Any], None] | None = None,
) -> Iterator[_T]:
    """``work(peek(i)[0])`` for ``i`` in ``0..n-1``, run on threads and yielded in order.

    ``peek(i)`` is cheap and returns ``(state, cost)``: the bytes ``work`` will hold until
    its result is consumed (the caller's next step after the yield). ``work`` starts in
    order, and only while the costs of the results started and not yet consumed stay within
    ``budget`` (default :data:`BUILD_BYTES`; one that needs more runs alone): an index of
    any size is built in bounded memory, its shards written as they come, in parallel as
    far as the budget allows. The first error (in order) is raised; shards not yet started
    are then not read. Only this generator starts work, and no thread waits for it: one
    left unfinished (its caller raised) leaves nothing blocked. No thread of a build runs
    across a fork (:class:`_Threads`): a fork waits for the calls running, and the build
    goes on after it. ``close(state)`` (when given) is called, once the threads are
    done, on the state of each shard peeked whose result was not handed over (the build
    failed or was left first): what a peek opened is closed then, not by the garbage
    collector (``work`` closes it itself when it fails).

    Example:
        >>> list(in_order(4, lambda i: (i, 1), lambda x: x * x))
        [0, 1, 4, 9]
    """
    budget = BUILD_BYTES if budget is None else budget
    workers = _BUILD_THREADS if max_workers is None else max_workers
    if n <= 1 or workers <= 1:
        for i in range(n):
            yield work(peek(i)[0])
        return
    threads = _Threads(min(workers, n))
    peeks: collections.deque[_Call] = collections.deque()  # shards peeked, not started
    # Started, in order, with their states (closed if their results are not handed over).
    works: collections.deque[tuple[_Call, int, Any]] = collections.deque()
    peeked = used = 0
    try:
        for _ in range(n):
            # Peek a few shards ahead (each may hold an open file: a few, not all).
            while peeked < n and len(peeks) + len(works) < 2 * workers:
                peeks.append(_Call(threads, peek, peeked))
                peeked += 1
            # Start the next shards while the budget allows (the first always), without
            # waiting on a peek while there is a result to hand over.
            while peeks and (not works or peeks[0].future.done()):
                try:
                    state, cost = peeks[0].result()
                except Exception:
                    works.append((peeks.popleft(), 0, None))  # raised in its turn
                    continue
                if works and used + cost > budget:
                    break
                peeks.popleft()
                works.append((_Call(threads, work, state), cost, state))
                used += cost
                del state
            call, cost, _ = works[0]
            result = call.result()
            works.popleft()
            del call
            yield result
            del result
            used -= cost
    finally:
        threads.close()  # every call now finished or cancelled
        if close is not None:
            done = [c.future.result()[0] for c in peeks if _succeeded(c.future)]
            for state in done + [state for _, _, state in works if state is not None]:
                with contextlib.suppress(OSError):  # the build's own error goes on
                    close(state)


def _succeeded(fut: Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None


# ------------------------------------------------------------------ placement
def index_key(kind: str, items: Sequence[tuple[Any, ...]]) -> str:
    """The name of an index of ``kind`` describing ``items`` (per file: its path, size,
    modification time...): a hex blake2b of them and :data:`VERSION`; see the module's
    example."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind}\0{VERSION}\0".encode())
    for item in items:
        h.update("\0".join(map(str, item)).encode() + b"\n")
    return h.hexdigest()


class IndexDir(NodeStore):
    """An index directory (:func:`cached_index`) as a node-local store: its entries are
    the index files, at most :data:`INDEX_DIR_BYTES` of them. An index's lock file lies
    beside it (``<file>.lock``, as before the store), and that file's time, touched at
    each open, is the index's last use: the index's own times key its verification stamp.
    One per directory and process (:func:`index_store`): :attr:`disk_full` lasts.

    Example:
        >>> import tempfile
        >>> d = IndexDir(tempfile.mkdtemp())
        >>> d.max_bytes == INDEX_DIR_BYTES, d._temp_of(".x.tgindex-0-7-0a1b2c3d.rows.tmp-7-0")
        (True, ('x.tgindex', 0))
    """

    _WHAT = "the dataset index"
    _LOCK_DIR, _TMP_PREFIX, _OLD_TMP_DIR = "", ".", ""
    _ENTRIES = "[!.]*" + INDEX_SUFFIX
    max_bytes = property(lambda self: INDEX_DIR_BYTES)  # (looked up when used)

    # The running total of the entries' bytes, kept by every process that publishes, in
    # the eviction lock's file (its 8 bytes; the lock itself is a flock on the file, and
    # a file of its own would show in the directory's listing): a publish under the
    # budget lists the directory for reservations only (sweeping killed writers' temp
    # files), not every entry's size as well.
    _USAGE = "evict.lock"

    def __init__(self, directory: str) -> None:
        self.directory, self.min_free_bytes = directory, 0

    def _remedy(self) -> str:
        return (
            "Free space on that disk, or pass index_dir= a directory on a disk with room (its "
            "default lies under $TORCHGRAIN_CACHE; index_dir=None keeps indexes in memory)."
        )

    def _last_use(self, path: str, st: os.stat_result) -> int:
        try:
            return os.stat(path + ".lock").st_mtime_ns
        except OSError:
            return st.st_mtime_ns

    def _temp_of(self, stem: str) -> tuple[str, int] | None:
        # .<file>-0-<pid>-<random> (reserved: an index's size is known once built, and
        # room made at its publish), and its writer's ..<that>[.<column>].tmp-<pid>-<random>
        # (or .<file>[.<column>].tmp-<pid>-<random> of an earlier release's writer)
        entry, suffix, _ = stem.lstrip(".").rpartition(INDEX_SUFFIX)
        return (entry + suffix, 0) if suffix else None

    def _own_lock(self, name: str) -> bool:
        # <8 hex>-<name>: a builder's lock of its own (cached_index), whose shared lock
        # was held too long; no index is named so (a kind, or 32 hex digits, comes first)
        return _OWN_LOCK.fullmatch(name) is not None

    def _put(self, tmp: str, path: str) -> None:
        """Publish the complete temp file ``tmp`` as the index ``path``, its last use now
        (its lock file's time: the lock may be older than the index)."""
        self._publish(tmp, path, os.path.getsize(tmp))
        with contextlib.suppress(OSError):
            os.utime(path + ".lock")

    def writer(self, name: str) -> EntryWriter | None:
        """Entry ``name`` (a file name ending in ``.tgindex``) to write a piece at a time
        and publish: counted against the directory's budget, least recently used entries
        evicted to make room for it, as the indexes :func:`cached_index` builds. None when
        another process writes it now, or this one found the disk full.

        Raises:
            OSError: the directory cannot take it (a
                :class:`~torchgrain.CacheDiskFullError` on a full disk, said once).

        Example:
            >>> import tempfile
            >>> d = index_store(tempfile.mkdtemp())
            >>> w = d.writer("a.tgindex")
            >>> w.write(b"abc"); w.publish()
            >>> open(os.path.join(d.directory, "a.tgindex"), "rb").read(), d.total_bytes()
            (b'abc', 3)
        """
        if self.disk_full:
            return None
        stack = contextlib.ExitStack()
        try:
            if not stack.enter_context(self._lock(name, wait=0)):
                stack.close()
                return None
            self._remove_temps(name)  # a killed writer's
            tmp = self._reserve(name, 0, evict=False)
            stack.callback(unlink_quietly, tmp)  # (once published: gone already)
            with self._writing(tmp):
                file = stack.enter_context(open(tmp, "wb"))  # noqa: SIM115 (held by the writer)
        except BaseException:
            stack.close()
            raise
        return EntryWriter(self, name, tmp, file, stack)


_OWN_LOCK = re.compile(r"[0-9a-f]{8}-.+")


class EntryWriter:
    """An entry of an :class:`IndexDir` being written (:meth:`IndexDir.writer`): its
    lock held and its temp file open until :meth:`publish` or :meth:`discard`."""

    def __init__(
        self, store: IndexDir, name: str, tmp: str, file: Any, stack: contextlib.ExitStack
    ) -> None:
        self.store, self.name, self._tmp, self.file, self._stack = store, name, tmp, file, stack

    def write(self, data: bytes | memoryview, at: int | None = None) -> None:
        """Write ``data`` (at offset ``at``, else after what was written).

        Raises:
            OSError: as :meth:`IndexDir.writer`."""
        with self.store._writing(self._tmp):
            if at is not None:
                self.file.seek(at)
            self.file.write(data)
            if at is not None:
                self.file.seek(0, os.SEEK_END)

    def publish(self) -> None:
        """Put the entry in place (a reader sees a whole entry or none); raises as
        :meth:`write`."""
        try:
            path = os.path.join(self.store.directory, self.name)
            with self.store._writing(self._tmp):
                self.file.close()
            self.store._put(self._tmp, path)
        finally:
            self.discard()

    def discard(self) -> None:
        """Delete what was written (nothing once published) and release the entry."""
        self._stack.close()


@functools.cache
def index_store(directory: str) -> IndexDir:
    """The :class:`IndexDir` of ``directory``: one per directory and process."""
    return IndexDir(directory)


def _stamps(directory: str, make: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The stamps' folder ``directory`` opened (made first, ``make``) as its index
    directory's folder (:meth:`NodeStore._folder`): a link there is never followed, an
    OSError (ELOOP): no stamp is written, read or deleted where it points."""
    return index_store(os.path.dirname(directory))._folder(directory, make=make)


def _prune_stamps(index_dir: str) -> None:
    """Delete stamps unused for a week (a missing stamp costs one more verification)."""
    old = time.time() - 7 * 86400
    with contextlib.suppress(OSError), _stamps(os.path.join(index_dir, _STAMPS)) as fd:
        for name in os.listdir(fd):
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode) and st.st_mtime < old:
                    os.unlink(name, dir_fd=fd)


def _stamp(f: IndexFile, index_dir: str | None, expect: str | None) -> str | None:
    """Where the stamp of a verified index file goes: keyed by the file's path, inode,
    size and times (writing to a file, or setting its times, changes its ctime) and the
    checksum it was verified against."""
    if index_dir is None:
        return None
    st = os.stat(f.path)
    if file_identity(st) != f.identity:
        return None  # replaced since it was opened: verify what was opened, stamp nothing
    # (identity: device, inode, size, modification and change times)
    item = (os.path.abspath(f.path), *file_identity(st), expect or f.checksum)
    return os.path.join(index_dir, _STAMPS, index_key("verified", [item]))


def _write_stamp(stamp: str | None) -> None:
    if stamp is not None:
        directory, name = os.path.split(stamp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
        with contextlib.suppress(OSError), _stamps(directory, make=True) as fd:
            os.close(os.open(name, flags | os.O_CLOEXEC, 0o666, dir_fd=fd))


def _stamped(stamp: str) -> bool:
    """Whether the stamp ``stamp`` is there (its last use moved to now)."""
    directory, name = os.path.split(stamp)
    try:
        with _stamps(directory) as fd:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            with contextlib.suppress(OSError):
                os.utime(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def open_trusted(path: str, cls: Any, index_dir: str | None, expect: str | None = None) -> Any:
    """Open the index file at ``path`` and check its contents once per machine: against
    ``expect`` (a manifest's ``blake2b-file`` checksum of the whole file) or its own
    header checksum. A stamp in ``index_dir`` remembers a verified file (see
    :func:`_stamp`); without ``index_dir`` every open verifies.

    Raises:
        FileNotFoundError: no such file.
        CorruptDataError: not a valid index, or its contents fail the checksum.
    """
    ix = open_index(path, cls)
    f = ix._a.file
    stamp = _stamp(f, index_dir, expect)
    if stamp is not None and _stamped(stamp):
        return ix
    if expect is not None:
        try:
            verify_file_hash(path, expect, name=f"index file {path!r}")
        except CorruptDataError:
            raise
        except ValueError as e:  # (an unknown algorithm: the manifest's word)
            raise CorruptDataError(f"index file {path!r}: the manifest's checksum: {e}") from None
    elif not f.verify():
        raise CorruptDataError(
            f"index file {path!r} is damaged: its contents do not match its checksum"
        )
    COUNTERS["verified"] += 1
    _write_stamp(stamp)
    return ix


def cached_index(
    index_dir: str,
    name: str,
    cls: Any,
    build: Callable[[str | None], Any],
    fits: Callable[[Any], str | None],
    *,
    deadline: float | None = None,
) -> Any:
    """The index ``name`` in ``index_dir``: opened when present and valid (``fits(ix)``
    says why an index does not describe the files, or None), else built once per
    machine into a temp file of the directory (``build(tmp)``), which the store
    publishes as ``name``; built in memory (``build(None)``) when the directory cannot
    be written. Another process's build of it under way is waited for at most
    :func:`index_lock_wait` seconds (``deadline``: a source's retry deadline), and said
    on stderr after a few seconds; then this process builds it too.

    Example:
        >>> import tempfile
        >>> class Demo:
        ...     kind = "demo"
        ...     def __init__(self, arrays): self._a = arrays
        >>> build = lambda out: build_index(Demo, out, {"a": ("<i8", ())}, lambda sink: {})
        >>> d = tempfile.mkdtemp()
        >>> ix = cached_index(d, "k.tgindex", Demo, build, lambda ix: None)
        >>> ix._a.path == os.path.join(d, "k.tgindex"), sorted(os.listdir(d))
        (True, ['.tmp', 'evict.lock', 'k.tgindex', 'k.tgindex.lock', 'verified'])
    """
    path = os.path.join(index_dir, name)

    def try_open() -> Any:
        try:
            ix = open_trusted(path, cls, index_dir)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None  # (a directory there: the publish says it cannot write, once)
        except CorruptDataError as e:
            warnings.warn(f"rebuilding a damaged dataset index: {e}", stacklevel=4)
            return None
        why = fits(ix)
        if why is not None:
            warnings.warn(f"rebuilding dataset index {path!r}: {why}", stacklevel=4)
            return None
        with contextlib.suppress(OSError):
            os.utime(path + ".lock")  # its place in the directory's LRU
        ix._a.placed = (index_dir, cls)
        return ix

    ix = try_open()
    if ix is not None:
        return ix
    store = index_store(index_dir)
    if store.disk_full:  # found with no room by this process (which said so)
        return build(None)
    try:
        # (waiting a bounded time, then building anyway: the rename keeps it whole)
        wait = index_lock_wait(deadline)
        with _build_lock(store, name, wait) as held, contextlib.ExitStack() as stack:
            ix = try_open()  # another process may have built it meanwhile
            if ix is None:
                own = name
                if held:
                    store._remove_temps(name)  # a killed builder's
                else:  # its temp files go under a lock of their own: sweeps keep them
                    own = f"{uuid.uuid4().hex[:8]}-{name}"
                    # No other process takes it: it goes (still held) when the build ends,
                    # or with the temp file of a killed build (NodeStore._reserved).
                    stack.enter_context(store._lock(own, drop=True))
                tmp = store._reserve(own, 0, evict=False)
                # (gone before its lock is let go: a sweep in between would keep it)
                stack.callback(unlink_quietly, tmp)
                with store._writing(path):
                    build(tmp)
                store._put(tmp, path)
                ix = open_index(path, cls)
                ix._a.placed = (index_dir, cls)
                _write_stamp(_stamp(ix._a.file, index_dir, None))  # built here: sound
                announce(
                    "the dataset index directory",
                    index_dir,
                    f"{size_text(INDEX_DIR_BYTES)}, least recently used files deleted "
                    "first; index_dir= sets it, index_dir=None keeps indexes in memory",
                )
                _prune_stamps(index_dir)
        return ix
    except OSError as e:
        if e.errno not in _UNWRITABLE or isinstance(e, DatasetNotFoundError):
            raise
        # (no room is said once per directory and process: disk_full is set)
        warnings.warn(
            f"torchgrain: {e} Keeping the dataset index in this process's memory instead."
            if e.errno in DISK_FULL_ERRNOS
            else f"cannot write the dataset index into {index_dir!r} ({e}); keeping it in "
            "this process's memory instead (pass index_dir= a writable directory)",
            stacklevel=3,
        )
        return build(None)


@contextlib.contextmanager
def _build_lock(store: IndexDir, name: str, wait: float) -> Iterator[bool]:
    """Hold the lock of the index ``name``'s build, waited for at most ``wait`` seconds;
    yields whether it is held. A wait past :data:`_SAY_WAIT` says what it waits for (the
    lock held by another process: a build under way, or a builder stopped or stuck)."""
    first = min(wait, _SAY_WAIT)
    with store._lock(name, wait=first) as held:
        if held or wait <= first:
            yield held
            return
    lock = store._lock_path(name)
    warnings.warn(
        f"torchgrain: waiting up to {wait:g} s for another process's build of a dataset index "
        f"in {store.directory!r} (it holds {lock!r}), then building it here too. If no "
        "process builds it (one stopped, or stuck on its disk: see `fuser` on the lock), "
        f"end that process; {INDEX_LOCK_WAIT_ENV}= (seconds) or the source's "
        "retry=RetryPolicy(deadline=) bounds the wait",
        stacklevel=5,
    )
    with store._lock(name, wait=wait - first) as held:
        yield held


def _file_in_place(f: IndexFile, index_dir: str, cls: Any) -> IndexFile:
    """The file under ``f``'s name in ``index_dir`` holding ``f``'s bytes, for processes
    that map it by that name (a pickle carries the name): ``f`` itself, or (``f`` was
    evicted, or deleted, while mapped here) the same index built again by another process
    (verified: size, checksum and metadata, its contents checked once per machine), or
    else ``f``'s mapped bytes published there again, by :func:`cached_index`'s rules.

    Raises:
        CorruptDataError: another index now has that name; or ``f`` cannot be copied
            (it changed while mapped), or put back (the directory cannot take it).
    """
    with contextlib.suppress(OSError):
        st = os.stat(f.path)
        if file_identity(st) == f.identity:  # (a rewrite in place is another file)
            return f

    def same(ix: Any) -> None:
        g = ix._a.file
        if (g.nbytes, g.checksum, g.meta) != (f.nbytes, f.checksum, f.meta):
            raise _replaced(f.path)

    def copy(tmp: str | None) -> None:
        if tmp is None:  # (the directory said why it cannot take it)
            raise CorruptDataError(
                f"index file {f.path!r} was deleted while mapped, and its directory cannot "
                "take it again: processes that map it by name (spawned workers) cannot"
            )
        f.check()  # the bytes verified when opened: none written, none truncated (SIGBUS)
        with open(tmp, "wb") as out:  # (buffered: it writes all of a large buffer)
            out.write(f._mm)

    return cached_index(index_dir, os.path.basename(f.path), cls, copy, same)._a.file
