"""Dataset indexes shared by every process of a machine: record offsets in one mapped file.

What every process needs per record (where each ArrayRecord chunk lies, how many records
it holds, its decoded size; where each TFRecord record starts) lives in one index file
per dataset (:mod:`torchgrain.formats.index_file`), mapped read-only by every DataLoader
worker of every rank: the page cache holds it once per machine, no process holds a
private copy, opening a dataset maps one file, and a pickled source carries the file's
name, not its arrays. Where the index comes from:

* **Beside the shards** (``torchgrain.tgindex``): torchgrain's writer and converter write
  it with the shards and record its size and checksum in ``torchgrain.json``. Its
  checksum is verified once per machine (a stamp in the index directory remembers the
  verified file, keyed by its inode, size and times), then it is mapped where it lies.
* **Built once per machine** into the index directory (``index_dir``, by default
  ``<torchgrain cache>/arrayrecord-index`` or ``tfrecord-index``), for files from other
  tools, TFRecord files, or a dataset whose own index is missing, stale or damaged:
  keyed by every shard's path, size and modification time (a rewritten shard gets a new
  index), built by one process under a lock while the others wait, and published with a
  rename, so a reader sees a whole index or none.
* **In memory** (``index_dir=None``, or an index directory that cannot be written):
  the same arrays in this process's heap.

An index file is untrusted input: its array table is checked against its size, its
arrays against each other (counts, per-shard sentinels, footer positions) when opened,
every offset against its shard's bounds before use, and each shard against the index
when a process first maps it (its size, modification time, and the 40-byte header of
its footer chunk, which holds a hash of the whole footer): a stale or damaged index
ends in a rebuild or a :class:`~torchgrain.CorruptDataError`, never in other bytes.

``COUNTERS`` counts, per process, the indexes built and verified (tests use them).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import CorruptDataError, DatasetNotFoundError
from torchgrain.formats.arrayrecord_file import (
    _CHUNK_HEADER,
    DEFAULT_MAX_CHUNK_BYTES,
    ArrayRecordFile,
    _Footer,
)
from torchgrain.formats.index_file import INDEX_SUFFIX, IndexFile, IndexFileWriter
from torchgrain.io.file_hash import file_checksum, verify_file_hash
from torchgrain.io.fs import default_cache_dir, map_files

__all__ = [
    "COUNTERS",
    "INDEX_NAME",
    "ArrayRecordIndex",
    "TFRecordIndex",
    "arrayrecord_index",
    "tfrecord_index",
    "write_dataset_index",
]

#: The index file torchgrain's writers put beside a dataset's shards.
INDEX_NAME = "torchgrain" + INDEX_SUFFIX
#: Indexes built (``*_builds``) and beside-the-shards indexes verified, in this process.
COUNTERS = {"arrayrecord_builds": 0, "tfrecord_builds": 0, "verified": 0}
#: Index files an index directory keeps, in bytes; the least recently used go first.
INDEX_DIR_BYTES = 32 << 30
_VERSION = 1
_BATCH = 256  # shards whose footers are read together while building
# Why an index directory cannot take an index (anything else is raised).
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC}
_STAMPS = "verified"  # stamps of index files whose contents were checked
_LOCK_WAIT = 900.0  # seconds to wait for another process's build before building too
_MIN_FILE = 1 << 16  # an ArrayRecord file holds at least its 64 KiB postscript block
_UNREADABLE = -1  # the group size recorded for a shard that could not be indexed
_AR_COLUMNS = {
    "rec_base": ("<i8", ()),
    "chunk_base": ("<i8", ()),
    "file_size": ("<i8", ()),
    "mtime_ns": ("<i8", ()),
    "group_size": ("<i8", ()),
    "footer_head": ("|u1", (_CHUNK_HEADER,)),
    "offsets": ("<i8", ()),
    "record_offsets": ("<i8", ()),
    "decoded": ("<i8", ()),
}
_TF_COLUMNS = {
    "rec_base": ("<i8", ()),
    "file_size": ("<i8", ()),
    "mtime_ns": ("<i8", ()),
    "compressed": ("<i8", ()),
    "offsets": ("<i8", ()),
}


def default_index_dir(kind: str) -> str:
    """``<torchgrain cache>/<kind>-index`` (see :func:`~torchgrain.io.fs.default_cache_dir`).

    Example:
        >>> default_index_dir("arrayrecord").endswith("arrayrecord-index")
        True
    """
    return os.path.join(default_cache_dir(), f"{kind}-index")


# ---------------------------------------------------------------- the arrays
class _Arrays:
    """Named arrays from an index file (mapped) or from memory; pickles as the file's name."""

    def __init__(
        self, kind: str, arrays: dict[str, np.ndarray], meta: dict[str, Any], file: IndexFile | None
    ) -> None:
        self.kind = kind
        self.arrays = arrays
        self.meta = meta
        self.file = file

    @property
    def path(self) -> str | None:
        """The index file mapped (None: in memory)."""
        return self.file.path if self.file is not None else None

    def __getstate__(self) -> dict[str, Any]:
        if self.file is None:
            return {"kind": self.kind, "arrays": self.arrays, "meta": self.meta}
        return {"kind": self.kind, "path": self.file.path, "identity": self.file.identity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.kind = state["kind"]
        if "path" not in state:
            self.arrays, self.meta, self.file = state["arrays"], state["meta"], None
            return
        # A spawned worker maps the file its parent opened: the very same file.
        f = IndexFile.open(state["path"], self.kind)
        if f.identity != tuple(state["identity"]):
            raise CorruptDataError(
                f"index file {state['path']!r} was replaced after the dataset was opened; "
                "open the dataset again"
            )
        self.arrays, self.meta, self.file = f.arrays, f.meta, f


def _bad(where: str, msg: str) -> CorruptDataError:
    return CorruptDataError(f"index {where}: {msg}")


def _shape(a: dict[str, np.ndarray], where: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    arr = a.get(name)
    if arr is None or arr.shape != shape:
        got = None if arr is None else arr.shape
        raise _bad(where, f"array {name!r} has shape {got}, expected {shape}")
    return arr


def _meta_int(meta: dict[str, Any], where: str, key: str) -> int:
    v = meta.get(key)
    if type(v) is not int or not 0 <= v < 1 << 62:
        raise _bad(where, f"bad {key} {v!r:.40}")
    return v


def _prefix(arr: np.ndarray, total: int, where: str, name: str) -> np.ndarray:
    if len(arr) == 0 or arr[0] != 0 or arr[-1] != total or bool((np.diff(arr) < 0).any()):
        raise _bad(where, f"{name} is not a prefix sum from 0 to {total}")
    return np.diff(arr)


class ArrayRecordIndex:
    """Every chunk of every shard of an ArrayRecord dataset, in one set of arrays.

    For ``S`` shards, ``C`` chunks and ``N`` records: ``rec_base`` (``S + 1``: the
    dataset's first record of each shard), ``chunk_base`` (``S + 1``: first chunk),
    per shard ``file_size``, ``mtime_ns`` (0: not checked), ``group_size`` (records per
    chunk where uniform, else 0) and ``footer_head`` (the footer chunk's 40-byte header);
    per shard ``s`` its chunks' file offsets followed by its footer's offset
    (``offsets``, ``C + S``: chunk ``c`` of shard ``s`` is entry ``chunk_base[s] + s +
    c`` and ends where the next entry begins), their first records within the shard
    followed by its record count (``record_offsets``, same layout), and each chunk's
    decoded size (``decoded``, ``C``: entry ``chunk_base[s] + c``).

    Example:
        >>> import os, tempfile
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> d = tempfile.mkdtemp()
        >>> paths = [os.path.join(d, f"{k}.array_record") for k in range(2)]
        >>> for k, p in enumerate(paths):
        ...     w = ArrayRecordWriter(p, "group_size:1")
        ...     for i in range(3 + k):
        ...         w.write(b"%d" % i)
        ...     w.close()
        >>> ix = build_arrayrecord_index(paths)
        >>> ix.counts.tolist(), ix.single
        ([3, 4], True)
        >>> shard, row, entry, chunk = ix.chunks(np.array([4, 0]), ix.rec_base)
        >>> shard.tolist(), row.tolist(), ix.footer(1).num_records
        ([1, 0], [1, 0], 4)
    """

    kind = "array_record"

    def __init__(self, arrays: _Arrays) -> None:
        self._a = arrays
        self._derive()

    def _derive(self) -> None:
        a, meta = self._a.arrays, self._a.meta
        where = repr(self._a.path) if self._a.path else "(in memory)"
        if meta.get("version") != _VERSION:
            raise _bad(where, f"unsupported version {meta.get('version')!r:.20}")
        s = _meta_int(meta, where, "num_shards")
        n = _meta_int(meta, where, "num_records")
        c = _meta_int(meta, where, "num_chunks")
        self.rec_base = _shape(a, where, "rec_base", (s + 1,))
        self.chunk_base = _shape(a, where, "chunk_base", (s + 1,))
        self.file_size = _shape(a, where, "file_size", (s,))
        self.mtime_ns = _shape(a, where, "mtime_ns", (s,))
        self.group_size = _shape(a, where, "group_size", (s,))
        self.footer_head = _shape(a, where, "footer_head", (s, _CHUNK_HEADER))
        self.offsets = _shape(a, where, "offsets", (c + s,))
        self.record_offsets = _shape(a, where, "record_offsets", (c + s,))
        self.decoded = _shape(a, where, "decoded", (c,))
        counts = _prefix(self.rec_base, n, where, "rec_base")
        nchunks = _prefix(self.chunk_base, c, where, "chunk_base")
        # Per-shard consistency, vectorised: O(shards), whatever the number of records.
        starts = self.chunk_base[:-1] + np.arange(s, dtype=np.int64)
        ends = starts + nchunks
        foot = self.offsets[ends]
        # Shards that could not be indexed (unreadable when it was built, with counts
        # known from a manifest) have no entries; reading them reports their error.
        ok = self.group_size != _UNREADABLE
        if (
            bool((nchunks > counts).any())
            or bool(((counts > 0) & (nchunks == 0)).any())
            or bool((self.record_offsets[starts] != 0).any())
            or bool((self.record_offsets[ends] != counts).any())
            or bool((ok & (self.file_size < _MIN_FILE)).any())
            or bool((ok & (foot < _CHUNK_HEADER)).any())
            or bool((ok & (foot > self.file_size - _MIN_FILE)).any())
            or bool((self.group_size < _UNREADABLE).any())
            or bool((~ok & (counts != 0)).any())
        ):
            raise _bad(
                where,
                "its per-shard entries are inconsistent (damaged or not made for these files)",
            )
        single = meta.get("single")
        if single is not bool(np.array_equal(nchunks, counts)):
            raise _bad(where, "its one-record-per-chunk flag disagrees with its counts")
        # Nothing per shard is kept beyond the mapped arrays: with 10,000 shards, every
        # private array of them costs every process 80 KB.
        #: Every chunk of the dataset holds exactly one record (files written with
        #: ``group_size:1``): a record's chunk is found without a search.
        self.single = single

    @property
    def counts(self) -> np.ndarray:
        """Records per shard (a new array)."""
        return np.diff(self.rec_base)

    @property
    def num_chunks(self) -> np.ndarray:
        """Chunks per shard (a new array)."""
        return np.diff(self.chunk_base)

    def starts(self, shard: Any) -> Any:
        """Entry in :attr:`offsets` and :attr:`record_offsets` of the first chunk of
        ``shard`` (an int or an array of them)."""
        return self.chunk_base[shard] + shard

    def footer_offsets(self, shard: Any) -> Any:
        """Where the footer of ``shard`` (an int or an array of them) begins."""
        return self.offsets[self.chunk_base[shard + 1] + shard]

    @property
    def path(self) -> str | None:
        """The mapped index file (None: the index is in memory)."""
        return self._a.path

    @property
    def num_shards(self) -> int:
        return len(self.counts)

    def __getstate__(self) -> _Arrays:
        return self._a

    def __setstate__(self, arrays: _Arrays) -> None:
        self._a = arrays
        self._derive()

    def __repr__(self) -> str:
        where = self.path or "memory"
        return f"ArrayRecordIndex(shards={self.num_shards}, records={int(self.rec_base[-1])}, in {where!r})"

    # ------------------------------------------------------------------ lookups
    def chunks(
        self, idx: np.ndarray, rec_base: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(shard, row, entry, chunk)`` of valid global record indices ``idx``, in one
        vectorised step for the whole batch: the record's shard and row in it, its
        chunk's entry in :attr:`offsets` and :attr:`record_offsets`, and the chunk's
        number in the dataset (:attr:`decoded`). ``rec_base`` is :attr:`rec_base` as a
        private array (a binary search over it runs per batch).

        Raises:
            CorruptDataError: the index places a row in no chunk of its shard.
        """
        if len(rec_base) == 2:
            shard = np.zeros(len(idx), np.int64)
            row = idx
        else:
            shard = np.searchsorted(rec_base, idx, side="right") - 1
            row = idx - rec_base[shard]
        first_chunk = self.chunk_base[shard]
        if self.single:
            chunk = row
        else:
            gs = self.group_size[shard]
            chunk = row // np.maximum(gs, 1)
            nchunks = self.chunk_base[shard + 1] - first_chunk
            odd = np.flatnonzero(gs == 0)
            if len(odd):  # chunks of varying sizes: a search within each such shard
                for s in np.unique(shard[odd]).tolist():
                    at = odd[shard[odd] == s]
                    a = int(self.starts(s))
                    n = int(self.chunk_base[s + 1] - self.chunk_base[s])
                    recs = self.record_offsets[a : a + n + 1]
                    chunk[at] = np.searchsorted(recs, row[at], side="right") - 1
            # Bounds before use: the chunk exists and holds the row.
            entry = first_chunk + shard + chunk
            bad = (chunk < 0) | (chunk >= nchunks)
            if not bad.any():
                first = self.record_offsets[entry]
                bad = (first > row) | (self.record_offsets[entry + 1] <= row)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise self.error(int(shard[k]), f"places record {int(row[k])} in no chunk")
        return shard, row, first_chunk + shard + chunk, first_chunk + chunk

    def error(self, shard: int, msg: str) -> CorruptDataError:
        where = f"index file {self.path!r}" if self.path else "the dataset's index"
        return CorruptDataError(
            f"{where}, shard {shard}: {msg} (damaged, or not made for this shard; "
            + ("delete it to have it rebuilt)" if self.path else "reopen the dataset)")
        )

    def footer(self, shard: int) -> _Footer:
        """Shard ``shard``'s index as :class:`ArrayRecordFile` takes it (views of the
        index's arrays: nothing copied per record)."""
        g = int(self.chunk_base[shard])
        a = g + shard
        n = int(self.chunk_base[shard + 1]) - g
        return _Footer(
            chunk_offsets=self.offsets[a : a + n],
            chunk_ends=self.offsets[a + 1 : a + n + 1],
            decoded_sizes=self.decoded[g : g + n],
            record_offsets=self.record_offsets[a : a + n + 1],
            num_records=int(self.rec_base[shard + 1] - self.rec_base[shard]),
            writer_options="",
            footer_offset=int(self.offsets[a + n]),
            file_size=int(self.file_size[shard]),
            group_size=int(self.group_size[shard]),
            footer_head=self.footer_head[shard].tobytes(),
            mtime_ns=int(self.mtime_ns[shard]),
        )

    def mismatch(self, shard: int, st: os.stat_result, view: memoryview | None) -> str | None:
        """Why the file of ``shard`` (its ``stat`` and, when mapped, its bytes) is not the
        one indexed, or None when it is."""
        size = int(self.file_size[shard])
        if st.st_size != size:
            return f"it is {st.st_size} bytes, the index says {size}"
        mtime = int(self.mtime_ns[shard])
        if mtime and st.st_mtime_ns != mtime:
            return "its modification time differs from the index's"
        if view is not None and len(view) == size:
            fo = int(self.footer_offsets(shard))
            if bytes(view[fo : fo + _CHUNK_HEADER]) != self.footer_head[shard].tobytes():
                return f"its footer (at offset {fo}) differs from the index's"
        return None


def _footer_of(
    path: str, filesystem: fsspec.AbstractFileSystem | None, max_chunk_bytes: int
) -> tuple[_Footer, bytes]:
    f = ArrayRecordFile(path, filesystem=filesystem, max_chunk_bytes=max_chunk_bytes)
    try:
        ft = f._ensure_footer()
        fo = ft.footer_offset
        head = bytes(f._fetch([(fo, fo + _CHUNK_HEADER)])[0])
        return ft, head
    finally:
        f.close()


class _MemorySink:
    """What :class:`IndexFileWriter` does, into memory."""

    def __init__(self, kind: str, columns: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self.kind = kind
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in columns}
        self.columns = columns

    def append(self, name: str, rows: np.ndarray) -> None:
        dtype, trailing = self.columns[name]
        self.parts[name].append(np.asarray(rows, dtype=np.dtype(dtype)).reshape(-1, *trailing))

    def arrays(self, meta: dict[str, Any]) -> _Arrays:
        out = {}
        for k, parts in self.parts.items():
            dtype, trailing = self.columns[k]
            arr = np.concatenate(parts) if parts else np.zeros((0, *trailing), np.dtype(dtype))
            arr.setflags(write=False)
            out[k] = arr
        return _Arrays(self.kind, out, meta, None)

    def abort(self) -> None:
        self.parts = {}


def build_arrayrecord_index(
    paths: Sequence[str],
    *,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mtimes: Sequence[int] | None = None,
    out: str | None = None,
    tolerate: bool = False,
    key: str | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> ArrayRecordIndex:
    """Read the footers of ``paths`` (in parallel threads) into a dataset index: a file
    published atomically at ``out``, or arrays in memory. ``mtimes`` (nanoseconds) are
    recorded to be checked when the files are mapped (None: not checked). With
    ``tolerate`` (the record counts are known from elsewhere), a shard that cannot be
    read is indexed as holding nothing: its error is raised when it is read. ``key``
    (what the files are: paths, sizes, times) is recorded for :func:`arrayrecord_index`.
    Footers are read under ``max_chunk_bytes`` (see :class:`ArrayRecordFile`).

    Raises:
        CorruptDataError: a shard is not a readable ArrayRecord file (named).
    """

    def footer(i: int) -> tuple[_Footer, bytes] | None:
        try:
            return _footer_of(paths[i], filesystem, max_chunk_bytes)
        except (CorruptDataError, OSError):  # not found, a directory, unreadable...
            if not tolerate:
                raise
            return None

    s = len(paths)
    sink: Any = (
        IndexFileWriter(out, "array_record", _AR_COLUMNS)
        if out is not None
        else _MemorySink("array_record", _AR_COLUMNS)
    )
    try:
        counts = np.zeros(s, np.int64)
        nchunks = np.zeros(s, np.int64)
        for a in range(0, s, _BATCH):
            part = map_files(lambda i, a=a: footer(a + i), min(_BATCH, s - a))
            for i, got in enumerate(part):
                k = a + i
                if got is None:
                    sink.append("offsets", np.zeros(1))
                    sink.append("record_offsets", np.zeros(1))
                    sink.append("file_size", np.zeros(1))
                    sink.append("group_size", np.array([_UNREADABLE]))
                    sink.append("footer_head", np.zeros((1, _CHUNK_HEADER), np.uint8))
                    continue
                f, head = got
                counts[k] = f.num_records
                nchunks[k] = len(f.chunk_offsets)
                sink.append("offsets", np.append(f.chunk_offsets, f.footer_offset))
                sink.append("record_offsets", f.record_offsets)
                sink.append("decoded", f.decoded_sizes)
                sink.append("file_size", np.array([f.file_size]))
                sink.append("group_size", np.array([f.group_size]))
                sink.append("footer_head", np.frombuffer(head, np.uint8).reshape(1, -1))
        sink.append("mtime_ns", np.asarray(mtimes if mtimes is not None else np.zeros(s), np.int64))
        for name, per in (("rec_base", counts), ("chunk_base", nchunks)):
            base = np.zeros(s + 1, np.int64)
            np.cumsum(per, out=base[1:])
            sink.append(name, base)
        meta = {
            "version": _VERSION,
            "num_shards": s,
            "num_records": int(counts.sum()),
            "num_chunks": int(nchunks.sum()),
            "single": bool(np.array_equal(counts, nchunks)),
            "key": key,
        }
        COUNTERS["arrayrecord_builds"] += 1
        if out is None:
            return ArrayRecordIndex(sink.arrays(meta))
        sink.publish(meta)
    except BaseException:
        sink.abort()
        raise
    return open_index(out, ArrayRecordIndex)


def open_index(path: str, cls: Any) -> Any:
    """Map and validate the index file at ``path`` as ``cls`` (:class:`ArrayRecordIndex`
    or :class:`TFRecordIndex`)."""
    f = IndexFile.open(path, cls.kind)
    return cls(_Arrays(cls.kind, f.arrays, f.meta, f))


def write_dataset_index(root: str, names: Sequence[str]) -> dict[str, Any]:
    """Write the index of a torchgrain dataset's shards (``names`` in ``root``) beside
    them, as :data:`INDEX_NAME`; returns its manifest entry (path, size, checksum).

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": i} for i in range(3)], d)  # writes one
        >>> sorted(write_dataset_index(d, ["data-00000-of-00001.array_record"]))
        ['file_checksum', 'num_bytes', 'path']
    """
    path = os.path.join(root, INDEX_NAME)
    # The shards' names are part of what the index describes: a manifest edited to name
    # other files (with the same record counts) does not get this index.
    build_arrayrecord_index(
        [os.path.join(root, n) for n in names], out=path, key=_beside_key(names)
    )
    return {
        "path": INDEX_NAME,
        "num_bytes": os.path.getsize(path),
        "file_checksum": file_checksum(path),
    }


# ------------------------------------------------------------------ placement
def _beside_key(names: Iterable[str]) -> str:
    """What an index beside the shards describes: the shards' names, relative to it."""
    return _key("beside", [(n,) for n in names])


def _key(kind: str, items: Sequence[tuple[Any, ...]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind}\0{_VERSION}\0".encode())
    for item in items:
        h.update("\0".join(map(str, item)).encode() + b"\n")
    return h.hexdigest()


@contextlib.contextmanager
def _build_lock(path: str):
    """Hold ``path + '.lock'`` (one builder per machine); after a long wait, go on
    without it (publishing by rename stays atomic; the work may be done twice)."""
    import fcntl

    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)  # the umask applies
    try:
        deadline = time.monotonic() + _LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _prune(directory: str, keep: str) -> None:
    """Delete the least recently used index files beyond :data:`INDEX_DIR_BYTES` (a
    file's use is the time of its lock file, touched at each open), and stamps unused
    for a week (a missing stamp costs one more verification)."""
    try:
        entries = []
        for e in os.scandir(directory):
            if e.name.endswith(INDEX_SUFFIX) and e.path != keep:
                size = e.stat().st_size
                try:
                    used = os.stat(e.path + ".lock").st_mtime
                except OSError:
                    used = e.stat().st_mtime
                entries.append((used, size, e.path))
        total = sum(size for _, size, _ in entries)
        with contextlib.suppress(OSError):
            total += os.path.getsize(keep)
        for _, size, path in sorted(entries):
            if total <= INDEX_DIR_BYTES:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)  # a process that maps it keeps its pages
            with contextlib.suppress(OSError):
                os.unlink(path + ".lock")
            total -= size
        stamps = os.path.join(directory, _STAMPS)
        old = time.time() - 7 * 86400
        for e in os.scandir(stamps) if os.path.isdir(stamps) else ():
            if e.stat().st_mtime < old:
                with contextlib.suppress(OSError):
                    os.unlink(e.path)
    except OSError:
        pass


def _stamp(f: IndexFile, index_dir: str | None, expect: str | None) -> str | None:
    """Where the stamp of a verified index file goes: keyed by the file's path, inode,
    size and times (writing to a file, or setting its times, changes its ctime) and the
    checksum it was verified against."""
    if index_dir is None:
        return None
    st = os.stat(f.path)
    if (st.st_dev, st.st_ino, st.st_size) != f.identity:
        return None  # replaced since it was opened: verify what was opened, stamp nothing
    item = (
        os.path.abspath(f.path),
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
        expect or f.checksum,
    )
    return os.path.join(index_dir, _STAMPS, _key("verified", [item]))


def _write_stamp(stamp: str | None) -> None:
    if stamp is not None:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(stamp), exist_ok=True)
            with open(stamp, "w"):
                pass


def _open_trusted(path: str, cls: Any, index_dir: str | None, expect: str | None = None) -> Any:
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
    if stamp is not None and os.path.exists(stamp):
        with contextlib.suppress(OSError):
            os.utime(stamp)
        return ix
    if expect is not None:
        verify_file_hash(path, expect, name=f"index file {path!r}")
    elif not f.verify():
        raise CorruptDataError(
            f"index file {path!r} is damaged: its contents do not match its checksum"
        )
    COUNTERS["verified"] += 1
    _write_stamp(stamp)
    return ix


def _cached(
    index_dir: str,
    name: str,
    cls: Any,
    build: Callable[[str | None], Any],
    fits: Callable[[Any], str | None],
) -> Any:
    """The index ``name`` in ``index_dir``: opened when present and valid (``fits(ix)``
    says why an index does not describe the files, or None), else built once per
    machine (``build(path)``) and published; built in memory (``build(None)``) when the
    directory cannot be written."""
    path = os.path.join(index_dir, name)

    def try_open() -> Any:
        try:
            ix = _open_trusted(path, cls, index_dir)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except CorruptDataError as e:
            warnings.warn(f"rebuilding a damaged dataset index: {e}", stacklevel=4)
            return None
        why = fits(ix)
        if why is not None:
            warnings.warn(f"rebuilding dataset index {path!r}: {why}", stacklevel=4)
            return None
        with contextlib.suppress(OSError):
            os.utime(path + ".lock")  # its place in the directory's LRU
        return ix

    ix = try_open()
    if ix is not None:
        return ix
    try:
        os.makedirs(index_dir, exist_ok=True)
        with _build_lock(path):
            ix = try_open()  # another process may have built it meanwhile
            if ix is None:
                ix = build(path)
                _write_stamp(_stamp(ix._a.file, index_dir, None))  # built here: sound
                _prune(index_dir, path)
        return ix
    except OSError as e:
        if e.errno not in _UNWRITABLE or isinstance(e, DatasetNotFoundError):
            raise
        warnings.warn(
            f"cannot write the dataset index into {index_dir!r} ({e}); keeping it in this "
            "process's memory instead (pass index_dir= a writable directory)",
            stacklevel=3,
        )
        return build(None)


def _stats(paths: Sequence[str]) -> list[os.stat_result]:
    def one(i: int) -> os.stat_result:
        try:
            return os.stat(paths[i])
        except FileNotFoundError:
            raise DatasetNotFoundError(f"shard {i} {paths[i]!r} does not exist") from None

    return map_files(one, len(paths), max_workers=8 if len(paths) > 256 else 1)


def arrayrecord_index(
    paths: Sequence[str],
    *,
    index_dir: str | None,
    counts: np.ndarray | None = None,
    beside: tuple[str, dict[str, Any]] | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> ArrayRecordIndex:
    """The index of local ArrayRecord shards ``paths``, from wherever it is cheapest
    (see the module docstring): ``beside`` is the index file a manifest names, with its
    manifest entry; ``counts`` the records per shard the manifest promises.

    Raises:
        CorruptDataError: a shard is not a readable ArrayRecord file.
    """

    def agrees(ix: ArrayRecordIndex) -> str | None:
        if ix.num_shards != len(paths):
            return f"it indexes {ix.num_shards} shards, the dataset has {len(paths)}"
        if beside is not None:
            root = os.path.dirname(beside[0])
            names = (os.path.relpath(p, root) for p in paths)
            if ix._a.meta.get("key") != _beside_key(names):
                return "it was made for shards of other names than the manifest's"
        if counts is not None and not np.array_equal(ix.counts, counts):
            k = int(np.flatnonzero(ix.counts != counts)[0])
            return f"it gives shard {k} {int(ix.counts[k])} records, the manifest {int(counts[k])}"
        return None

    if beside is not None:
        path, entry = beside
        try:
            checksum = entry.get("file_checksum")
            if not isinstance(checksum, str):
                raise CorruptDataError("the manifest records no checksum for it")
            if os.path.getsize(path) != entry.get("num_bytes"):
                raise CorruptDataError(
                    f"it is {os.path.getsize(path)} bytes, the manifest says {entry.get('num_bytes')}"
                )
            ix = _open_trusted(path, ArrayRecordIndex, index_dir, checksum)
            why = agrees(ix)
            if why is not None:
                raise CorruptDataError(why)
            return ix
        except (OSError, CorruptDataError) as e:
            warnings.warn(
                f"not using the dataset's index file {path!r} ({e}); indexing the shards "
                "for this machine instead",
                stacklevel=3,
            )
    stats = _stats(paths)
    mtimes = [st.st_mtime_ns for st in stats]

    key = _key(
        "array_record",
        [(os.path.abspath(p), st.st_size, st.st_mtime_ns) for p, st in zip(paths, stats)],
    )

    def build(out: str | None) -> ArrayRecordIndex:
        return build_arrayrecord_index(
            paths,
            mtimes=mtimes,
            out=out,
            tolerate=counts is not None,
            key=key,
            max_chunk_bytes=max_chunk_bytes,
        )

    if index_dir is None:
        return build(None)
    sizes = np.array([st.st_size for st in stats], np.int64)

    def fits(ix: ArrayRecordIndex) -> str | None:
        if ix._a.meta.get("key") != key:  # a file under another's name
            return "it was made for other files"
        if ix.num_shards != len(paths) or not np.array_equal(ix.file_size, sizes):
            return "it describes other files"
        if not np.array_equal(ix.mtime_ns, np.asarray(mtimes, np.int64)):
            return "it describes other versions of the files"
        return None  # counts: a manifest that disagrees with the shards is checked later

    name = "arrayrecord-" + key + INDEX_SUFFIX
    return _cached(os.fspath(index_dir), name, ArrayRecordIndex, build, fits)


# ------------------------------------------------------------------ TFRecord
class TFRecordIndex:
    """Where every record of a TFRecord dataset starts, in one set of arrays.

    ``rec_base`` (``S + 1``), per shard ``file_size``, ``mtime_ns`` and ``compressed``
    (1: a gzip/zlib file, whose records are only counted), and per shard its records'
    byte offsets followed by its size (``offsets``: record ``i`` of shard ``s`` spans
    ``offsets[base[s] + i]`` to the next entry, ``base[s]`` counting the entries of the
    shards before it). A compressed shard has no offsets (no random access into a
    stream): only its size, so a stream of many tiny records costs nothing per record.
    """

    kind = "tfrecord"

    def __init__(self, arrays: _Arrays) -> None:
        self._a = arrays
        self._derive()

    def _derive(self) -> None:
        a, meta = self._a.arrays, self._a.meta
        where = repr(self._a.path) if self._a.path else "(in memory)"
        if meta.get("version") != _VERSION:
            raise _bad(where, f"unsupported version {meta.get('version')!r:.20}")
        s = _meta_int(meta, where, "num_shards")
        n = _meta_int(meta, where, "num_records")
        self.rec_base = _shape(a, where, "rec_base", (s + 1,))
        self.file_size = _shape(a, where, "file_size", (s,))
        self.mtime_ns = _shape(a, where, "mtime_ns", (s,))
        self.compressed = _shape(a, where, "compressed", (s,))
        counts = _prefix(self.rec_base, n, where, "rec_base")
        plain = self.compressed == 0
        entries = np.where(plain, counts, 0) + 1  # offsets, then the size
        base = np.zeros(s, np.int64)
        np.cumsum(entries[:-1], out=base[1:])
        self.offsets = _shape(a, where, "offsets", (int(entries.sum()),))
        if (
            bool((self.offsets[base + entries - 1] != self.file_size).any())
            or bool((plain & (counts > 0) & (self.offsets[base] != 0)).any())
            or bool((self.file_size < 0).any())
        ):
            raise _bad(
                where,
                "its per-shard entries are inconsistent (damaged or not made for these files)",
            )
        self.counts = counts
        #: Entry in :attr:`offsets` of each shard's first record (a private copy).
        self.base = base

    @property
    def path(self) -> str | None:
        return self._a.path

    @property
    def num_shards(self) -> int:
        return len(self.counts)

    def __getstate__(self) -> _Arrays:
        return self._a

    def __setstate__(self, arrays: _Arrays) -> None:
        self._a = arrays
        self._derive()


def tfrecord_index(
    paths: Sequence[str],
    infos: Sequence[tuple[int, str]],
    offsets_of: Callable[[int], np.ndarray],
    compressed: np.ndarray,
    *,
    index_dir: str | None,
) -> TFRecordIndex:
    """The index of TFRecord files ``paths``: ``infos[i]`` is file ``i``'s ``(size,
    version stamp)`` (its modification time or ETag), ``offsets_of(i)`` walks (or reads
    from a per-file cache) its record offsets (its record count, ``[n]``, for a
    compressed file). Built once per machine into ``index_dir``
    (in memory when None)."""
    s = len(paths)
    sizes = np.array([size for size, _ in infos], np.int64)
    key = _key("tfrecord", [(p, size, stamp) for p, (size, stamp) in zip(paths, infos)])

    def build(out: str | None) -> TFRecordIndex:
        sink: Any = (
            IndexFileWriter(out, "tfrecord", _TF_COLUMNS)
            if out is not None
            else _MemorySink("tfrecord", _TF_COLUMNS)
        )
        try:
            counts = np.zeros(s, np.int64)
            for a in range(0, s, _BATCH):
                part = map_files(lambda i, a=a: offsets_of(a + i), min(_BATCH, s - a))
                for i, offs in enumerate(part):
                    if compressed[a + i]:  # its count: a stream has no offsets
                        counts[a + i] = int(offs[0])
                        sink.append("offsets", sizes[a + i : a + i + 1])
                    else:
                        counts[a + i] = len(offs)
                        sink.append("offsets", np.append(offs, sizes[a + i]))
            base = np.zeros(s + 1, np.int64)
            np.cumsum(counts, out=base[1:])
            sink.append("rec_base", base)
            sink.append("file_size", sizes)
            sink.append("mtime_ns", np.zeros(s, np.int64))
            sink.append("compressed", np.asarray(compressed, np.int64))
            meta = {
                "version": _VERSION,
                "num_shards": s,
                "num_records": int(counts.sum()),
                "key": key,
            }
            COUNTERS["tfrecord_builds"] += 1
            if out is None:
                return TFRecordIndex(sink.arrays(meta))
            sink.publish(meta)
        except BaseException:
            sink.abort()
            raise
        return open_index(out, TFRecordIndex)

    if index_dir is None:
        return build(None)

    def fits(ix: TFRecordIndex) -> str | None:
        if ix._a.meta.get("key") != key:  # a file under another's name
            return "it was made for other files"
        if ix.num_shards != s or not np.array_equal(ix.file_size, sizes):
            return "it describes other files"
        if not np.array_equal(ix.compressed != 0, np.asarray(compressed, bool)):
            return "it describes other files"
        return None

    name = "tfrecord-" + key + INDEX_SUFFIX
    return _cached(os.fspath(index_dir), name, TFRecordIndex, build, fits)
