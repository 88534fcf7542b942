"""The ArrayRecord node index: every chunk of every shard of a dataset, in one set of arrays.

Built from the shards' footers (:func:`build_arrayrecord_index`), written beside a
torchgrain dataset's shards (:func:`write_dataset_index`), or found or built once per
machine (:func:`arrayrecord_index`); see :mod:`torchgrain.sources.node_index`.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import CorruptDataError, DatasetNotFoundError
from torchgrain.formats.arrayrecord.file import ArrayRecordFile
from torchgrain.formats.arrayrecord.footer import Footer, FooterReader
from torchgrain.formats.arrayrecord.riegeli import (
    CHUNK_HEADER,
    DEFAULT_MAX_CHUNK_BYTES,
)
from torchgrain.formats.index_file import INDEX_SUFFIX
from torchgrain.io.file_hash import file_checksum
from torchgrain.io.fs import map_files
from torchgrain.io.libc import trim_heap
from torchgrain.sources.node_index import store
from torchgrain.sources.node_index.store import (
    COUNTERS,
    INDEX_NAME,
    VERSION,
    BuildProgress,
    NodeIndex,
    build_index,
    cached_index,
    check_meta_int,
    check_prefix,
    check_shape,
    dataset_name,
    in_order,
    index_error,
    index_key,
    open_trusted,
)

__all__ = [
    "ArrayRecordIndex",
    "arrayrecord_index",
    "build_arrayrecord_index",
    "stat_shards",
    "write_dataset_index",
]

_MIN_FILE = 1 << 16  # an ArrayRecord file holds at least its 64 KiB postscript block
_UNREADABLE = -1  # the group size recorded for a shard that could not be indexed
# Bytes per chunk a footer holds at the peak of its parse (its entries' varints, the
# record sizes, the arrays made of them: ~210 measured with tracemalloc, zstd and none).
_PARSE_COST = 224
_AR_COLUMNS = {
    **dict.fromkeys(("rec_base", "chunk_base", "file_size", "mtime_ns", "group_size"), ("<i8", ())),
    "footer_head": ("|u1", (CHUNK_HEADER,)),
    **dict.fromkeys(("offsets", "record_offsets", "decoded"), ("<i8", ())),
}


class ArrayRecordIndex(NodeIndex):
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

    def _derive(self) -> None:
        a, meta, where, s, counts = self._counts()
        c = check_meta_int(meta, where, "num_chunks")
        self.chunk_base = check_shape(a, where, "chunk_base", (s + 1,))
        self.group_size = check_shape(a, where, "group_size", (s,))
        self.footer_head = check_shape(a, where, "footer_head", (s, CHUNK_HEADER))
        self.offsets = check_shape(a, where, "offsets", (c + s,))
        self.record_offsets = check_shape(a, where, "record_offsets", (c + s,))
        self.decoded = check_shape(a, where, "decoded", (c,))
        nchunks = check_prefix(self.chunk_base, c, where, "chunk_base")
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
            or bool((ok & (foot < CHUNK_HEADER)).any())
            or bool((ok & (foot > self.file_size - _MIN_FILE)).any())
            or bool((self.group_size < _UNREADABLE).any())
            or bool((~ok & (counts != 0)).any())
        ):
            raise index_error(
                where,
                "its per-shard entries are inconsistent (damaged or not made for these files)",
            )
        single = meta.get("single")
        if single is not bool(np.array_equal(nchunks, counts)):
            raise index_error(where, "its one-record-per-chunk flag disagrees with its counts")
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

    def footer(self, shard: int) -> Footer:
        """Shard ``shard``'s index as :class:`ArrayRecordFile` takes it (views of the
        index's arrays: nothing copied per record)."""
        g = int(self.chunk_base[shard])
        a = g + shard
        n = int(self.chunk_base[shard + 1]) - g
        return Footer(
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
            if bytes(view[fo : fo + CHUNK_HEADER]) != self.footer_head[shard].tobytes():
                return f"its footer (at offset {fo}) differs from the index's"
        return None


def _footer_of(r: FooterReader) -> Footer:
    """The whole footer of a shard whose parse fits in the build's budget."""
    return r.footer()


def _close_peeked(state: tuple[int, ArrayRecordFile | None, FooterReader | None, bool]) -> None:
    """Close the file a build's peek opened (the build ended before it was read)."""
    if state[1] is not None:
        state[1].close()


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

    Built in bounded memory: each footer is written into the index file's columns as
    soon as the shards before it are, and the footers parsed and not yet written hold
    at most :data:`~torchgrain.sources.node_index.store.BUILD_BYTES` (each costs about
    :data:`_PARSE_COST` bytes per chunk while parsed, its entry count read ahead from
    the footer chunk's header, plus the footer chunk itself where it is fetched apart
    from the file's last MiB). A footer that would cost more than the whole budget,
    local or remote, is decoded and written a slice of chunks at a time
    (:class:`~torchgrain.formats.arrayrecord.footer.FooterReader`; with ``tolerate``,
    read twice: checked whole before its first slice is written). A remote shard costs
    three ranged requests at most (its last MiB; where the footer begins before that,
    its 40-byte header, then the footer chunk), whatever its chunk count. A build of more
    than a few seconds reports its progress on stderr
    (:class:`~torchgrain.sources.node_index.store.BuildProgress`).

    Raises:
        CorruptDataError: a shard is not a readable ArrayRecord file (named).
    """

    # A footer whose parse would cost more than the whole budget is read a slice of
    # chunks at a time, a sixteenth of the budget each (what the threads' allocator
    # arenas keep afterwards), written as it is read.
    step = max(1, store.BUILD_BYTES // (16 * _PARSE_COST))

    def open_shard(i: int) -> tuple[ArrayRecordFile, FooterReader]:
        f = ArrayRecordFile(paths[i], filesystem=filesystem, max_chunk_bytes=max_chunk_bytes)
        try:
            return f, FooterReader(f, *f._tail(), f._fetch)
        except BaseException:
            f.close()
            raise

    def peek(i: int) -> tuple[tuple[int, ArrayRecordFile | None, FooterReader | None, bool], int]:
        # The postscript and footer chunk header (locally mapped, remotely fetched: the
        # last MiB, and the footer's header where it begins before it) tell the cost:
        # its parse, and the footer chunk that footer() fetches and holds.
        try:
            f, r = open_shard(i)
        except (CorruptDataError, OSError):
            return (i, None, None, False), 0  # raised again, and handled, by footer()
        cost = min(r.num_chunks + 1, 1 << 40) * _PARSE_COST
        if cost > store.BUILD_BYTES:  # read and written a slice at a time
            return (i, f, r, True), step * _PARSE_COST + r.unfetched
        return (i, f, r, False), cost + r.unfetched

    def footer(
        state: tuple[int, ArrayRecordFile | None, FooterReader | None, bool],
    ) -> tuple[Footer | FooterReader, bytes, ArrayRecordFile | None] | None:
        i, f, r, sliced = state
        try:
            if r is None:  # the peek failed: its error again, raised or tolerated
                f, r = open_shard(i)
            if not sliced:
                return _footer_of(r), r.head, None
            if tolerate:  # every check made before a slice is written
                for _ in r.slices(step):
                    pass
            got, f = (r, r.head, f), None  # the caller reads it, then closes the file
            return got
        except (CorruptDataError, OSError):  # not found, a directory, unreadable...
            if not tolerate:
                raise
            return None
        finally:
            if f is not None:
                f.close()

    s = len(paths)

    def fill(sink: Any) -> dict[str, Any]:
        counts = np.zeros(s, np.int64)
        nchunks = np.zeros(s, np.int64)
        progress = BuildProgress(s, dataset_name(paths))
        # Each shard's entries go into the sink (a file's columns) as soon as the shards
        # before it are in: nothing per record is held beyond the footers in flight.
        shards = in_order(s, peek, footer, budget=store.BUILD_BYTES, close=_close_peeked)
        for k, got in enumerate(shards):
            if got is None:  # (no chunks: a footer offset and file size of 0)
                sink.append("record_offsets", np.zeros(1))
                tail = (0, 0, _UNREADABLE, bytes(CHUNK_HEADER))
            else:  # a Footer, or a FooterReader of a large one: written a slice at a time
                ft, head, fh = got
                parts = (
                    ft.slices(step)
                    if fh is not None
                    else [(ft.chunk_offsets, ft.decoded_sizes, ft.record_offsets[1:])]
                )
                try:
                    sink.append("record_offsets", np.zeros(1))
                    for offsets, dsizes, ends in parts:
                        sink.append("offsets", offsets)
                        sink.append("record_offsets", ends)
                        sink.append("decoded", dsizes)
                        nchunks[k] += len(offsets)
                        del offsets, dsizes, ends
                finally:
                    if fh is not None:
                        fh.close()
                counts[k] = ft.num_records
                tail = (ft.footer_offset, ft.file_size, ft.group_size, head)
                del ft, fh, parts
            for name, v in zip(("offsets", "file_size", "group_size"), tail):
                sink.append(name, np.array([v]))
            sink.append("footer_head", np.frombuffer(tail[3], np.uint8).reshape(1, -1))
            del got  # its footer's arrays go now, not when the next one comes
            progress.update(k + 1)
        progress.close()
        sink.append("mtime_ns", np.asarray(mtimes if mtimes is not None else np.zeros(s), np.int64))
        for name, per in (("rec_base", counts), ("chunk_base", nchunks)):
            sink.append(name, np.concatenate([[0], np.cumsum(per)]))
        COUNTERS["arrayrecord_builds"] += 1
        return {
            "version": VERSION,
            "num_shards": s,
            "num_records": int(counts.sum()),
            "num_chunks": int(nchunks.sum()),
            "single": bool(np.array_equal(counts, nchunks)),
            "key": key,
        }

    ix = build_index(ArrayRecordIndex, out, _AR_COLUMNS, fill)
    # The footers' parses were freed into the build threads' malloc arenas, which glibc
    # keeps: given back now that the threads are gone (10^7 records in 64 shards, 4
    # threads: 37 MiB of private memory kept after the build, 24-32 MiB with this).
    trim_heap()
    return ix


def _beside_key(names: Iterable[str]) -> str:
    """What an index beside the shards describes: the shards' names, relative to it."""
    return index_key("beside", [(n,) for n in names])


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


def stat_shards(paths: Sequence[str]) -> list[os.stat_result | None]:
    """Each local shard's ``stat`` (None for one that does not exist): what an opening
    keeps of the files (sizes, times). One after another while they are quick (a local
    disk: ~2 µs each, where a thread pool costs ~20 µs a file); the rest on 8 threads
    once the first 64 took over 50 µs each (a network file system's round trips).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a")
        >>> _ = open(p, "wb").write(b"abc")
        >>> [None if st is None else st.st_size for st in stat_shards([p, p + "x"])]
        [3, None]
    """

    def one(path: str) -> os.stat_result | None:
        try:
            return os.stat(path)
        except FileNotFoundError:
            return None

    first = 64
    t0 = time.perf_counter()
    out = [one(p) for p in paths[:first]]
    rest = paths[first:]
    if len(rest) > 192 and time.perf_counter() - t0 > first * 50e-6:
        return out + map_files(lambda i: one(rest[i]), len(rest), max_workers=8)
    return out + [one(p) for p in rest]


def arrayrecord_index(
    paths: Sequence[str],
    *,
    index_dir: str | None,
    counts: np.ndarray | None = None,
    beside: tuple[str, dict[str, Any]] | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    lock_wait: float | None = None,
    stats: Sequence[os.stat_result | None] | None = None,
) -> ArrayRecordIndex:
    """The index of local ArrayRecord shards ``paths``, from wherever it is cheapest
    (see the module docstring): ``beside`` is the index file a manifest names, with its
    manifest entry; ``counts`` the records per shard the manifest promises;
    ``lock_wait`` bounds a wait for another process's build (see :func:`cached_index`);
    ``stats`` the shards' :func:`stat_shards`, where the caller took them (else taken
    here, when needed).

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
            ix = open_trusted(path, ArrayRecordIndex, index_dir, checksum)
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
    found: list[os.stat_result] = []
    for i, st in enumerate(stat_shards(paths) if stats is None else stats):
        if st is None:
            raise DatasetNotFoundError(f"shard {i} {paths[i]!r} does not exist")
        found.append(st)
    mtimes = [st.st_mtime_ns for st in found]

    # (the change time and inode too: a shard rewritten in place with its size and
    # modification time put back, as ``rsync --inplace -t`` does, is indexed anew)
    key = index_key(
        "array_record",
        [
            (os.path.abspath(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            for p, st in zip(paths, found)
        ],
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
    sizes = np.array([st.st_size for st in found], np.int64)

    def fits(ix: ArrayRecordIndex) -> str | None:
        # (counts: a manifest that disagrees with the shards is checked later)
        same = np.array_equal(ix.mtime_ns, np.asarray(mtimes, np.int64))
        return ix.not_made_for(key, sizes) or (
            None if same else "it describes other versions of the files"
        )

    name = "arrayrecord-" + key + INDEX_SUFFIX
    return cached_index(
        os.fspath(index_dir), name, ArrayRecordIndex, build, fits, deadline=lock_wait
    )
