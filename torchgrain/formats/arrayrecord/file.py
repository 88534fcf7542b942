"""Read ArrayRecord files in Python, without array_record's C++ library.

An ArrayRecord file is a Riegeli/records file whose data chunks are indexed by a
footer: one entry (chunk offset, decoded size, record count) per chunk, located
through a postscript in the file's last 64 KiB. :class:`ArrayRecordFile` parses
that footer once into numpy arrays (:mod:`.footer`) and then reads any record with one
chunk read and one decompression (:mod:`.riegeli`); a batch of one-record chunks is
planned with numpy (:mod:`.batch`).

Why not the C++ reader: it does not survive ``fork`` (a parent that read a zstd
file crashes its forked DataLoader workers), its ``read([i])`` scans every chunk,
and it reads only local files. This reader keeps no state that a fork can break
(handles are reopened per process), finds a record's chunk by binary search or
division, and reads remote files (any fsspec filesystem) with byte-range requests.

Example:
    >>> import tempfile, os
    >>> from array_record.python.array_record_module import ArrayRecordWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "x.array_record")
    >>> w = ArrayRecordWriter(path, "group_size:1")
    >>> for i in range(5):
    ...     w.write(b"record %d" % i)
    >>> w.close()
    >>> f = ArrayRecordFile(path)
    >>> f.num_records
    5
    >>> f.read([4, 0, 4])
    [b'record 4', b'record 0', b'record 4']
    >>> f.read_range(1, 3)
    [b'record 1', b'record 2']
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import CorruptDataError, RemoteIOError, check_ceiling
from torchgrain.formats.arrayrecord.batch import OneRecordBatches
from torchgrain.formats.arrayrecord.footer import Footer, fast_views, parse_footer
from torchgrain.formats.arrayrecord.riegeli import (
    BLOCK,
    CHUNK_HEADER,
    DEFAULT_MAX_CHUNK_BYTES,
    ChunkDecodeError,
)
from torchgrain.io import changes, process, remote
from torchgrain.io.fs import get_filesystem, is_local, map_files
from torchgrain.io.ranges import fetch_ranges
from torchgrain.io.responses import RangeAnswerError

__all__ = ["ArrayRecordFile", "read_num_records"]

_BATCH_MIN = 8  # records per read from which planning them together pays
# How many bytes at the end of a remote file to fetch in the first request: the
# postscript (64 KiB) plus, usually, the whole footer, so opening costs one round trip.
_REMOTE_TAIL = 1 << 20
# Coalesce remote chunk ranges whose gap is at most this many bytes into one request.
_REMOTE_GAP = 1 << 16


#: What a reader over another's map (:meth:`ArrayRecordFile.over`) has of its own: the
#: handles and per-file state :meth:`ArrayRecordFile._reset_handles` leaves (no pin: the
#: region that maps the file checks it), of a local file read unverified.
_OVER = dict.fromkeys(("_file", "_mm", "_pin", "_u8", "_u8_view", "_raw_chunks", "_fs", "_version"))
_OVER.update(_layout_misses=0, _local=True, _verify=False)


class _Descriptor:
    """An open file descriptor, closed by :meth:`close` or when the last reader holding
    it lets go (a reader closed while another thread reads through it: the read keeps
    its file, never a number the system gave to another file meanwhile)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self, _close: Any = os.close) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:  # noqa: SIM105 (``_close`` bound now: at the interpreter's exit ``os``
                _close(fd)  # and ``contextlib`` may be gone)
            except OSError:
                pass

    __del__ = close


class ArrayRecordFile(OneRecordBatches):
    """Reads one ArrayRecord file (local path or fsspec URL) without the C++ library.

    Nothing is opened in ``__init__``; the footer is read and parsed on first use into
    numpy arrays. File handles (an mmap for local files) belong to the process that
    opened them: after a fork the object notices the new process id and reopens, so
    one object can be used in a parent and then in forked, spawned or forkserver
    DataLoader workers. Pickling keeps the path, filesystem and parsed index only.

    Args:
        path: local path or fsspec URL (``s3://``, ``https://``, ``memory://`` ...).
        filesystem: the fsspec filesystem to read ``path`` with (default: inferred).
        verify_checksums: verify Riegeli's HighwayHash of every chunk header and of
            the data of every chunk read (pure Python, a few MB/s: for audits).
        max_chunk_bytes: the most bytes one compressed chunk (so one record) may
            decompress to (default :data:`DEFAULT_MAX_CHUNK_BYTES`, 1 GiB). A chunk that
            declares more is refused before anything is allocated for it, and no chunk
            is decompressed past the size it declares.
        footer: the file's index as a dataset's index file holds it
            (:meth:`torchgrain.sources.node_index.ArrayRecordIndex.footer`), used
            instead of parsing the file's footer; a local file is checked against it
            (size, footer chunk header) when first mapped in each process.
        size: a remote file's size, as the dataset's opening found it: every answer must
            be of a file of this size (see :class:`torchgrain.io.remote.Version`).
        seen: the ``(size, ETag, Last-Modified)`` of a remote file that the dataset's
            opening read: a version pinned since by a later opening is refused (default:
            the one its first read finds).

    Raises:
        CorruptDataError: (on first use) not an ArrayRecord file, truncated, or corrupt
            (sizes that disagree, a chunk over ``max_chunk_bytes``); the message names
            the file and, where it applies, the chunk and record.
        TransposedChunkError: reading a chunk written with the ``transpose`` option.

    Example:
        >>> import tempfile, os
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "y.array_record")
        >>> w = ArrayRecordWriter(path, "group_size:2,snappy")
        >>> for i in range(3):
        ...     w.write(b"r%d" % i)
        >>> w.close()
        >>> f = ArrayRecordFile(path)
        >>> f.num_records, f.record_offsets.tolist()
        (3, [0, 2, 3])
        >>> f.read([2, 1])
        [b'r2', b'r1']
        >>> f.close()
    """

    def __init__(
        self,
        path: str,
        *,
        filesystem: fsspec.AbstractFileSystem | None = None,
        verify_checksums: bool = False,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        footer: Footer | None = None,
        size: int | None = None,
        seen: tuple | None = None,
    ) -> None:
        self._max_chunk = check_ceiling("max_chunk_bytes", max_chunk_bytes, 1)
        self._url = os.fspath(path)
        if filesystem is None:
            filesystem, stripped = get_filesystem(self._url)
        else:
            stripped = filesystem._strip_protocol(self._url)
        self._fs = filesystem
        self._path = stripped
        self._local = is_local(filesystem)
        self._verify = bool(verify_checksums)
        self._footer: Footer | None = footer
        self._version = None if self._local else remote.Version(filesystem, stripped, size, seen)
        self._lock = threading.RLock()
        self._reset_handles()

    # ------------------------------------------------------------------ process state
    def _reset_handles(self) -> None:
        super()._reset_handles()  # this process's zstd contexts and batch state
        self._file: Any = None
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._pin: changes.Pin | None = None  # checked before each read through the map
        # memoryviews over the footer arrays: indexing one gives a Python int several
        # times faster than indexing the numpy array (the hot path reads 4 per chunk).
        self._fast: tuple[memoryview, memoryview, memoryview, memoryview] | None = None

    _STATE = ("_url", "_fs", "_path", "_local", "_verify", "_footer", "_max_chunk", "_version")

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._reset_handles()

    @property
    def has_index(self) -> bool:
        """Whether the footer has been read and parsed (in this or a parent process)."""
        return self._footer is not None

    def for_child(self) -> ArrayRecordFile:
        """A new reader of the same file sharing this one's parsed index (numpy arrays,
        read only), with no handle, lock or decompression context of its own yet: what
        a forked child uses instead of parsing the footer again.

        Example:
            >>> import tempfile, os
            >>> from array_record.python.array_record_module import ArrayRecordWriter
            >>> path = os.path.join(tempfile.mkdtemp(), "c.array_record")
            >>> w = ArrayRecordWriter(path, "group_size:1")
            >>> w.write(b"a")
            >>> w.close()
            >>> f = ArrayRecordFile(path)
            >>> g = f.for_child()
            >>> g.has_index, f.num_records, g.has_index, g.read([0])
            (False, 1, False, [b'a'])
            >>> f.for_child().record_offsets is f.record_offsets
            True
        """
        new = ArrayRecordFile.__new__(ArrayRecordFile)
        new.__setstate__(self.__getstate__())
        return new

    def __repr__(self) -> str:
        n = self._footer.num_records if self._footer is not None else "?"
        return f"ArrayRecordFile({self._url!r}, num_records={n})"

    def __enter__(self) -> ArrayRecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of this process's file handles; the object can still be used (it
        reopens). They close as the last read holding them ends: a read in progress in
        another thread (a reader the reader limit evicts, a source's ``close``) goes on
        with the descriptor and map it took, never with a descriptor number reused by
        another file (handles inherited through fork are the parent's: only forgotten).

        Example:
            >>> ArrayRecordFile("/nonexistent.array_record").close()
        """
        self._reset_handles()

    def _local_view(self) -> memoryview:
        """The whole local file as a memoryview over an mmap, opened once per process;
        checked not to have changed since it was mapped (each call: a truncated file
        would kill the process with SIGBUS when read through the map)."""
        if self._token != process.token():
            self._reset_handles()
        view = self._view
        if view is not None:
            pin = self._pin
            if pin is not None:
                changes.check(pin, self._where())
            return view
        with self._lock:
            if self._view is None:
                try:
                    fh = _Descriptor(changes.open_regular(self._path))  # kept with the map
                except FileNotFoundError as e:
                    raise FileNotFoundError(f"{self._where()} does not exist") from e
                with contextlib.ExitStack() as undo:  # on an error: all closed, last first
                    undo.callback(fh.close)
                    pin = changes.Pin(fh.fileno(), self._path)
                    self._check_size(pin.size)
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                    undo.callback(mm.close)
                    view = memoryview(mm)
                    undo.callback(view.release)
                    self._check_given_footer(view, fh)
                    undo.pop_all()
                self._file, self._mm, self._pin = fh, mm, pin
                self._view = view
            return self._view

    def _check_size(self, size: int) -> None:
        if size < BLOCK:
            raise self._corrupt(
                f"not an ArrayRecord file: {size} bytes, shorter than the 64 KiB "
                "postscript block (truncated?)"
            )

    def _check_given_footer(self, view: memoryview, fh: Any) -> None:
        """A footer that came from a dataset's index must describe this very file."""
        f = self._footer
        if f is None or f.footer_head is None:
            return
        why = None
        if len(view) != f.file_size:
            why = f"it is {len(view)} bytes, the index says {f.file_size}"
        elif f.mtime_ns and os.fstat(fh.fileno()).st_mtime_ns != f.mtime_ns:
            why = "its modification time differs from the index's"
        elif bytes(view[f.footer_offset : f.footer_offset + CHUNK_HEADER]) != f.footer_head:
            why = f"its footer (at offset {f.footer_offset}) differs from the index's"
        if why is not None:
            raise self._corrupt(f"the file changed after the dataset's index was made: {why}")

    @classmethod
    def over(
        cls,
        view: memoryview,
        url: str,
        footer: Footer,
        like: ArrayRecordFile,
        fast: tuple[memoryview, memoryview, memoryview, memoryview] | None = None,
    ) -> ArrayRecordFile:
        """A reader of a local file another object keeps mapped (``view``, valid while
        it is used; the mapper checks it has not changed), with its index given (and
        ``fast``, :func:`~.footer.fast_views` of it): for reading a few chunks, with no
        handle of its own; ``like``'s decompression contexts are used.

        Example:
            >>> import tempfile, os
            >>> from array_record.python.array_record_module import ArrayRecordWriter
            >>> path = os.path.join(tempfile.mkdtemp(), "o.array_record")
            >>> w = ArrayRecordWriter(path, "group_size:1")
            >>> for i in range(3):
            ...     w.write(b"rec %d" % i)
            >>> w.close()
            >>> f = ArrayRecordFile(path)
            >>> g = ArrayRecordFile.over(f._local_view(), path, f._ensure_footer(), f)
            >>> g.chunk_record(2)
            b'rec 2'
        """
        like._zstd()  # ``like`` of this process, with this thread's context
        new = cls.__new__(cls)
        # ``like``'s lock (never taken), token and contexts, no handles: no system call
        # or thread-local per reader (a copy of _OVER and nine keys: the fewest instructions).
        new.__dict__ = dict(
            _OVER,
            _max_chunk=like._max_chunk,
            _lock=like._lock,
            _token=like._token,
            _tls=like._tls,
            _url=url,
            _path=url,
            _footer=footer,
            _view=view,
            _fast=fast,
        )
        return new

    # ------------------------------------------------------------------ raw bytes
    def _fetch(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """Physical byte ranges [start, end) of a remote file, as memoryviews (a local
        file is read through its map: its footer from the whole-file tail). Ranges
        that touch or nearly touch are fetched together, in one batch."""
        try:
            got = fetch_ranges(self._fs, self._path, ranges, gap=_REMOTE_GAP, name=self._url)
            try:
                self._version.check()  # (the file its footer came from: not one re-opened since)
            except RangeAnswerError as e:  # (another version pinned: no retry reads this one)
                raise RemoteIOError(f"{self._where()}: {e}") from e
            return got
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self._where()} does not exist") from e
        except CorruptDataError as e:
            raise self._corrupt(str(e).replace(f"{self._url}: ", "", 1)) from e

    def _fast_index(self, f: Footer) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        fast = self._fast
        if fast is None:
            fast = self._fast = fast_views(f)
        return fast

    # ------------------------------------------------------------------ footer
    def _ensure_footer(self) -> Footer:
        f = self._footer
        if f is None:
            with self._lock:
                if self._footer is None:
                    self._footer = parse_footer(self, *self._tail(), self._fetch)
            f = self._footer
        return f

    def _tail(self) -> tuple[memoryview, int, int]:
        """The file's last bytes, at least its postscript block (what
        :func:`parse_footer` takes): ``(bytes, where they begin, the file's size)``."""
        # The whole tail in one read: locally a view of the map, remotely one request.
        if self._local:
            view = self._local_view()
            return view, 0, len(view)
        try:
            size = remote.file_size(self._fs, self._path, url=self._url)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self._where()} does not exist") from e
        self._check_size(size)
        tail_start = max(0, size - _REMOTE_TAIL)
        tail = memoryview(remote.cat_file(self._fs, self._path, tail_start, size, url=self._url))
        self._version.check()  # (the version of these bytes, not one pinned later)
        if len(tail) != size - tail_start:
            raise self._corrupt("file changed size while it was being opened")
        return tail, tail_start, size

    # ------------------------------------------------------------------ public API
    @property
    def num_records(self) -> int:
        """Number of records in the file (from the footer)."""
        return self._ensure_footer().num_records

    def __len__(self) -> int:
        return self.num_records

    @property
    def record_offsets(self) -> np.ndarray:
        """int64, ``num_chunks + 1`` prefix sums: chunk ``c`` holds rows
        ``record_offsets[c]`` to ``record_offsets[c + 1]``."""
        return self._ensure_footer().record_offsets

    @property
    def chunk_offsets(self) -> np.ndarray:
        """int64 file offsets of the data chunks."""
        return self._ensure_footer().chunk_offsets

    @property
    def writer_options(self) -> str:
        """The writer options stored in the footer, e.g. ``"group_size:1,...,zstd:3,..."``
        (empty for files written before the footer recorded them)."""
        return self._ensure_footer().writer_options

    @property
    def path(self) -> str:
        """The path or URL this file was opened with."""
        return self._url

    def _chunk_of(self, rows: np.ndarray, f: Footer) -> np.ndarray:
        if f.group_size:
            return rows // f.group_size
        return np.searchsorted(f.record_offsets, rows, side="right") - 1

    def chunk_ranges(
        self, rows: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """``(chunks, ranges)``: the chunks holding local ``rows`` (sorted, unique) and the
        physical byte range ``[start, end)`` each is read from: what a remote
        :meth:`read` of those rows fetches (reads the footer first, if not yet read).

        Raises:
            IndexError: a row is outside ``[0, num_records)``.

        Example:
            >>> import tempfile, os
            >>> from array_record.python.array_record_module import ArrayRecordWriter
            >>> path = os.path.join(tempfile.mkdtemp(), "c.array_record")
            >>> w = ArrayRecordWriter(path, "group_size:2")
            >>> for i in range(6):
            ...     w.write(b"%d" % i)
            >>> w.close()
            >>> chunks, ranges = ArrayRecordFile(path).chunk_ranges([5, 0, 1])
            >>> chunks.tolist(), len(ranges), ranges[0][0] < ranges[0][1] <= ranges[1][0]
            ([0, 2], 2, True)
        """
        f = self._ensure_footer()
        arr = np.asarray(rows, dtype=np.int64).ravel()
        if len(arr):
            self._check_rows(int(arr.min()), int(arr.max()), f)
        chunks = np.unique(self._chunk_of(arr, f))
        return chunks, list(zip(f.chunk_offsets[chunks].tolist(), f.chunk_ends[chunks].tolist()))

    def _check_rows(self, lo: int, hi: int, f: Footer) -> None:
        """Rows ``lo`` to ``hi`` (the least and greatest asked for) must be in the file."""
        if lo < 0 or hi >= f.num_records:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{self._where(row=bad)}: row out of range [0, {f.num_records})")

    def _read_chunks(self, chunks: list[int], *, unmapped: bool = False) -> list[tuple[Any, Any]]:
        """Decoded chunks. With ``unmapped`` (their contents are kept elsewhere, in a
        chunk cache), local chunks are read with ``pread``, not through the map: a
        shuffled epoch would otherwise map in the whole file, whose pages count in the
        process's private memory (USS) beside the cache (a fault maps a whole folio of
        the page cache: a random 16 KiB chunk mapped about 420 KiB on ext4 under
        Linux 6.18). Dropping the map's pages instead cost 20% of the read rate in
        re-faults; ``pread`` costs a system call and a copy per chunk."""
        f = self._footer
        assert f is not None
        if self._local:
            view = self._local_view()
            if unmapped:
                return self._pread_chunks(chunks, f, len(view))
            fast = self._fast_index(f)
            local_chunk = self._local_chunk
            return [local_chunk(c, view, fast) for c in chunks]
        bufs = self._fetch([(int(f.chunk_offsets[c]), int(f.chunk_ends[c])) for c in chunks])
        out = []
        for c, buf in zip(chunks, bufs):
            try:
                out.append(self._decode_chunk(c, buf))
            except ChunkDecodeError as e:
                raise self._corrupt(str(e), chunk=c, row=int(f.record_offsets[c])) from None
        return out

    def read(
        self,
        rows: Sequence[int] | np.ndarray,
        *,
        chunk_cache: Any = None,
        cache_key: Any = None,
    ) -> list[bytes]:
        """Records at local ``rows`` (any order, duplicates allowed), in request order.

        Each chunk that holds several records is read and decompressed once per call
        (a local ``group_size:1`` file decompresses a row asked for twice twice, in
        request order, without sorting); remote reads of one call are fetched together. With ``chunk_cache`` (an LRU with ``get_many(keys)``
        and ``put(key, value, nbytes)``, e.g. a
        :class:`~torchgrain.sources.block_cache.BlockCache`), decompressed chunks that
        hold several records are kept under ``(cache_key, chunk)`` for later calls, so a
        block-local order decompresses each chunk once; files of one record per chunk
        (``group_size:1``) bypass it.

        Raises:
            IndexError: a row is outside ``[0, num_records)``.
            CorruptDataError: a chunk is corrupt (the message names file, chunk, record).

        Example:
            >>> import tempfile, os
            >>> from array_record.python.array_record_module import ArrayRecordWriter
            >>> path = os.path.join(tempfile.mkdtemp(), "z.array_record")
            >>> w = ArrayRecordWriter(path, "group_size:10")
            >>> for i in range(30):
            ...     w.write(b"%d" % i)
            >>> w.close()
            >>> ArrayRecordFile(path).read([29, 3, 3, 17])
            [b'29', b'3', b'3', b'17']
        """
        f = self._ensure_footer()
        if isinstance(rows, (int, np.integer)):
            raise TypeError("read() takes a sequence of rows; use read([i]) for one record")
        n = len(rows)
        if n == 1:
            return [self._read_one(int(rows[0]), f)]
        if n == 0:
            return []
        arr = np.asarray(rows)
        if arr.dtype.kind not in "iuf" and arr.dtype != object:
            raise TypeError(f"rows must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False).ravel()
        self._check_rows(int(arr.min()), int(arr.max()), f)
        if f.group_size == 1 and self._local and not self._verify and n >= _BATCH_MIN:
            out_singles = self._read_singles(arr, f)
            if out_singles is not None:
                return out_singles
        chunk_ids = self._chunk_of(arr, f)
        # Sorting groups rows by chunk and makes local reads walk the file forwards.
        order = np.argsort(chunk_ids, kind="stable")
        uniq, first = np.unique(chunk_ids[order], return_index=True)
        uniq_list = uniq.tolist()
        if chunk_cache is not None and f.num_records > len(f.chunk_offsets):
            decoded = self._read_chunks_cached(uniq_list, chunk_cache, cache_key)
        else:
            decoded = self._read_chunks(uniq_list)
        out: list[Any] = [None] * n
        ends = [*first.tolist()[1:], n]
        order_l = order.tolist()
        local = (arr - f.record_offsets[chunk_ids]).tolist()
        for k, (values, bounds) in enumerate(decoded):
            if bounds is None:
                rec = bytes(values) if not isinstance(values, bytes) else values
                for i in order_l[first[k] : ends[k]]:
                    out[i] = rec
            else:
                if isinstance(bounds, np.ndarray) and ends[k] - first[k] > 8:
                    bounds = bounds.tolist()
                for i in order_l[first[k] : ends[k]]:
                    j = local[i]
                    out[i] = bytes(values[int(bounds[j]) : int(bounds[j + 1])])
        return out

    def _read_chunks_cached(
        self, chunks: list[int], cache: Any, cache_key: Any
    ) -> list[tuple[Any, Any]]:
        keys = [(cache_key, c) for c in chunks]
        out = cache.get_many(keys)
        missing = [k for k, hit in enumerate(out) if hit is None]
        if missing:
            # Kept decompressed: read without mapping the file's pages in (see _read_chunks).
            decoded = self._read_chunks([chunks[k] for k in missing], unmapped=True)
            for k, chunk in zip(missing, decoded):
                out[k] = chunk
                values, bounds = chunk
                # Uncompressed chunks are views of the buffer read (never of the map).
                if bounds is not None:
                    cache.put(keys[k], chunk, len(values) + 8 * len(bounds))
        return out

    def _pread_chunks(self, chunks: list[int], f: Footer, size: int) -> list[tuple[Any, Any]]:
        """Local chunks read with ``pread`` (see :meth:`_read_chunks`), each decoded by
        :meth:`_local_chunk`."""
        fh = self._file  # (held: the descriptor stays open while it is read)
        while fh is None:  # closed meanwhile by another thread: opened again
            self._local_view()
            fh = self._file
        fd = fh.fileno()
        fast = self._fast or self._fast_index(f)
        offs, ends = fast[0], fast[1]
        out = []
        for c in chunks:
            pos, end_c = offs[c], ends[c]
            if end_c > size:
                raise self._corrupt(f"file is truncated: {size} bytes", chunk=c)
            buf = memoryview(os.pread(fd, end_c - pos, pos))
            if len(buf) != end_c - pos:
                raise self._corrupt(
                    f"file is truncated: read {len(buf)} of {end_c - pos} bytes", chunk=c
                )
            out.append(self._local_chunk(c, buf, fast, pos))
        return out

    def _read_one(self, row: int, f: Footer) -> bytes:
        self._check_rows(row, row, f)
        g = f.group_size
        c = row // g if g else int(np.searchsorted(f.record_offsets, row, side="right")) - 1
        return self.chunk_record(c, f, row - int(f.record_offsets[c]))

    def chunk_record(self, c: int, f: Footer | None = None, j: int = 0) -> bytes:
        """The record of local one-record chunk ``c`` (record ``j`` of a chunk of
        several), through the careful path (:meth:`_local_chunk`, which checks and
        reports everything; a local chunk through the map, mapped now if not yet, else
        checked unchanged); ``f`` is the file's index (default: its own).

        Example:
            >>> import tempfile, os
            >>> from array_record.python.array_record_module import ArrayRecordWriter
            >>> from torchgrain.formats.arrayrecord import ArrayRecordFile
            >>> path = os.path.join(tempfile.mkdtemp(), "c.array_record")
            >>> w = ArrayRecordWriter(path, "group_size:1")
            >>> for i in range(3):
            ...     w.write(b"rec %d" % i)
            >>> w.close()
            >>> ArrayRecordFile(path).chunk_record(1)
            b'rec 1'
        """
        f = f or self._ensure_footer()
        if not self._local:
            values, bounds = self._read_chunks([c])[0]
        else:
            view = self._view
            if view is None or self._token[1] != process.generation:
                view = self._local_view()
            elif self._pin is not None:  # (a reader over another's map has none)
                changes.check(self._pin, self._where())
            values, bounds = self._local_chunk(c, view, self._fast or self._fast_index(f))
        if bounds is None:
            return values if type(values) is bytes else bytes(values)
        return bytes(values[int(bounds[j]) : int(bounds[j + 1])])

    def read_range(self, start: int, stop: int) -> list[bytes]:
        """Records ``start`` to ``stop - 1`` (clipped to the file), in order.

        Example:
            >>> import tempfile, os
            >>> from array_record.python.array_record_module import ArrayRecordWriter
            >>> path = os.path.join(tempfile.mkdtemp(), "r.array_record")
            >>> w = ArrayRecordWriter(path, "group_size:4,uncompressed")
            >>> for i in range(10):
            ...     w.write(b"%d" % i)
            >>> w.close()
            >>> ArrayRecordFile(path).read_range(2, 7)
            [b'2', b'3', b'4', b'5', b'6']
        """
        start = max(0, int(start))
        stop = min(int(stop), self.num_records)
        return self.read(np.arange(start, stop)) if start < stop else []


def read_num_records(
    paths: Sequence[str],
    filesystem: fsspec.AbstractFileSystem | None = None,
    max_workers: int = 16,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> np.ndarray:
    """Record counts of ArrayRecord files, read from their footers in parallel threads.

    For opening datasets that have no manifest; remote footers cost one request each.
    ``max_chunk_bytes`` bounds the footer chunk as :class:`ArrayRecordFile` does.

    Example:
        >>> import tempfile, os
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> d = tempfile.mkdtemp()
        >>> for k in (2, 3):
        ...     w = ArrayRecordWriter(os.path.join(d, f"{k}.array_record"), "group_size:1")
        ...     for i in range(k):
        ...         w.write(b"x")
        ...     w.close()
        >>> read_num_records([os.path.join(d, "2.array_record"), os.path.join(d, "3.array_record")]).tolist()
        [2, 3]
    """
    paths = list(paths)

    def count(p: str) -> int:
        with ArrayRecordFile(p, filesystem=filesystem, max_chunk_bytes=max_chunk_bytes) as f:
            return f.num_records

    return np.array(
        map_files(lambda i: count(paths[i]), len(paths), max_workers=max_workers), np.int64
    )
