"""Read ArrayRecord files in Python, without array_record's C++ library.

An ArrayRecord file is a Riegeli/records file whose data chunks are indexed by a
footer: one entry (chunk offset, decoded size, record count) per chunk, located
through a postscript in the file's last 64 KiB. :class:`ArrayRecordFile` parses
that footer once into numpy arrays and then reads any record with one chunk read
and one decompression.

Why not the C++ reader: it does not survive ``fork`` (a parent that read a zstd
file crashes its forked DataLoader workers), its ``read([i])`` scans every chunk,
and it reads only local files. This reader keeps no state that a fork can break
(handles are reopened per process), finds a record's chunk by binary search or
division, and reads remote files (any fsspec filesystem) with byte-range requests.

Layout reminders (Riegeli/records):

* The file is cut into 64 KiB blocks; each block starts with a 24-byte block header
  that interrupts whatever chunk runs across it, even inside a chunk header.
* A chunk is a 40-byte header (hash, data size, data hash, type + record count,
  decoded size), ``data_size`` bytes of data, then padding.
* A simple chunk's data is: compression type byte, varint length of the compressed
  record-size buffer, that buffer, then the compressed values. Each compressed
  buffer starts with a varint of its decompressed size (not when uncompressed).

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
import itertools
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import cramjam
import fsspec
import numpy as np
import zstandard

from torchgrain.errors import CorruptDataError, check_ceiling
from torchgrain.formats._highwayhash import riegeli_hash
from torchgrain.io import process, remote
from torchgrain.io.fs import get_filesystem, is_local, map_files
from torchgrain.io.ranges import fetch_ranges

__all__ = [
    "ArrayRecordFile",
    "TransposedChunkError",
    "read_many",
    "read_mapped",
    "read_num_records",
]

#: The most bytes one compressed chunk may decompress to, unless a reader is given another
#: ``max_chunk_bytes``. array_record's writer bounds a chunk by its record count
#: (``group_size``), not by bytes; with ``group_size:1`` (what TFDS, Grain and torchgrain
#: write) a chunk is one record, and 1 GiB is beyond the records these hold in practice.
DEFAULT_MAX_CHUNK_BYTES = 1 << 30

_BLOCK = 1 << 16
_BLOCK_HEADER = 24
_USABLE = _BLOCK - _BLOCK_HEADER
_CHUNK_HEADER = 40
_MAGIC = 0x71930E704FDAE05E

_CHUNK_SIGNATURE = 0x73  # 's'
_CHUNK_METADATA = 0x6D  # 'm'
_CHUNK_PADDING = 0x70  # 'p'
_CHUNK_SIMPLE = 0x72  # 'r'
_CHUNK_TRANSPOSED = 0x74  # 't'

_NONE = 0
_BROTLI = 0x62  # 'b'
_ZSTD = 0x7A  # 'z'
_SNAPPY = 0x73  # 's'
_COMPRESSIONS = {_NONE: "none", _BROTLI: "brotli", _ZSTD: "zstd", _SNAPPY: "snappy"}

_HEADER = struct.Struct("<5Q")  # header_hash, data_size, data_hash, type|num_records, decoded
_BATCH_MIN = 8  # chunks per read from which decoding them together pays
_MANY_MIN = 2  # rows of a file from which read_many plans them with other files' rows
_BATCH_MAX_RECORD = 64 << 20  # larger records are decompressed one by one
# Bytes gathered at each chunk of a batch: the 40-byte header and the simple chunk's
# preamble (a one-record zstd chunk's sizes buffer takes 12 bytes).
_HEADS = 64
_HEAD_BYTES = np.arange(_HEADS)
_HEAD_WORDS = np.arange(0, _HEADS, 8)
_FOUR = np.arange(4)
_JOIN_AT_ONCE = 1 << 20  # bytes of a batch's frames cut by block headers joined up front
_ENTRY_TAGS = np.array([8, 16, 24], np.uint8)  # fields 1-3 of ArrayRecordFooter, varint
_BLOCK_HEADER_STRUCT = struct.Struct("<3Q")  # header_hash, previous_chunk, next_chunk
# What a compressed stream of n bytes can hold at most, so that a size it declares can be
# refused before anything is allocated: zstd's densest block is 4 bytes (an RLE block) per
# 128 KiB of output; snappy's is a 3-byte copy of 64 bytes. Brotli has no useful bound.
_ZSTD_MAX_RATIO = 1 << 15
_SNAPPY_MAX_RATIO = 22

# How many bytes at the end of a remote file to fetch in the first request: the
# postscript (64 KiB) plus, usually, the whole footer, so opening costs one round trip.
_REMOTE_TAIL = 1 << 20
# Coalesce remote chunk ranges whose gap is at most this many bytes into one request.
_REMOTE_GAP = 1 << 16


class TransposedChunkError(CorruptDataError, NotImplementedError):
    """The file holds transposed chunks (writer option ``transpose``), which are not supported."""


class _ChunkDecodeError(ValueError):
    """Internal: bytes failed a check; re-raised as CorruptDataError naming file and chunk."""


def _fast_views(f: _Footer) -> tuple[memoryview, memoryview, memoryview, memoryview]:
    """memoryviews over an index's arrays: indexing one gives a Python int several times
    faster than indexing the numpy array (the hot path reads 4 per chunk)."""
    return (
        memoryview(f.chunk_offsets),
        memoryview(f.chunk_ends),
        memoryview(f.decoded_sizes),
        memoryview(f.record_offsets),
    )


_SHARED = threading.local()  # per thread: the decompression context readers share


def _thread_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompression context (a new one after a fork)."""
    token = process.token()
    if getattr(_SHARED, "token", None) != token:
        _SHARED.zstd = zstandard.ZstdDecompressor()
        _SHARED.token = token
    return _SHARED.zstd


def _phys_end(pos: int, size: int) -> int:
    """Physical end of ``size`` logical bytes starting at physical ``pos``.

    Adds 24 bytes for every block header met on the way (a header at ``pos`` itself
    counts when ``size > 0``); this is Riegeli's ``AddWithOverhead``.
    """
    return pos + size + (size + (pos + _USABLE - 1) % _BLOCK) // _USABLE * _BLOCK_HEADER


def _strip_block_headers(buf: memoryview, pos: int) -> memoryview | bytes:
    """Logical bytes of the physical bytes ``buf`` that start at file position ``pos``.

    Zero-copy when ``buf`` crosses no block boundary (the common case).
    """
    end = pos + len(buf)
    boundary = -(-pos // _BLOCK) * _BLOCK  # first block start >= pos
    if boundary >= end:
        return buf
    pieces = []
    cur = pos
    while boundary < end:
        pieces.append(buf[cur - pos : boundary - pos])
        cur = min(boundary + _BLOCK_HEADER, end)
        boundary += _BLOCK
    pieces.append(buf[cur - pos :])
    return b"".join(pieces)


def _varint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """Decode one varint64 from ``buf[pos:end]``; returns (value, next position)."""
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _ChunkDecodeError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _varints_numpy(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode a buffer that is exactly a sequence of varint64s, vectorised.

    Returns (values as uint64, start byte of each varint). Raises ValueError when the
    buffer ends inside a varint or a varint is longer than 10 bytes.
    """
    if raw.size == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    if raw[-1] >= 0x80:
        raise ValueError("buffer ends inside a varint")
    ends = np.flatnonzero(raw < 0x80)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        raise ValueError("varint longer than 10 bytes")
    if int(lengths.max()) == 1:
        return raw.astype(np.uint64), starts
    within = np.arange(raw.size, dtype=np.int64) - np.repeat(starts, lengths)
    parts = (raw & 0x7F).astype(np.uint64) << (within * 7).astype(np.uint64)
    return np.add.reduceat(parts, starts), starts


def _parse_proto(buf: bytes | memoryview) -> dict[int, Any]:
    """Parse a flat protobuf message: field number -> last value (int or bytes).

    Only what the ArrayRecord footer and postscript use; fixed-width fields are kept
    as ints, groups are rejected.
    """
    out: dict[int, Any] = {}
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            out[field], pos = _varint(buf, pos, end)
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if n > end - pos:
                raise ValueError("length-delimited field runs past the message")
            out[field] = bytes(buf[pos : pos + n])
            pos += n
        elif wire == 1:
            if end - pos < 8:
                raise ValueError("truncated fixed64 field")
            out[field] = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == 5:
            if end - pos < 4:
                raise ValueError("truncated fixed32 field")
            out[field] = int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


class _Footer:
    """The parsed index of one file: plain numpy arrays and ints, cheap to pickle.

    ``footer_head`` and ``mtime_ns`` are set on an index that did not come from the
    file itself (a dataset's index file): the file must still have them (the 40 bytes
    of its footer chunk's header, which hold a hash of the footer; its modification
    time, where not 0) when a process maps it.
    """

    __slots__ = (
        "chunk_ends",
        "chunk_offsets",
        "decoded_sizes",
        "file_size",
        "footer_head",
        "footer_offset",
        "group_size",
        "mtime_ns",
        "num_records",
        "record_offsets",
        "writer_options",
    )

    def __init__(self, **kw: Any) -> None:
        self.footer_head = None
        self.mtime_ns = 0
        for k, v in kw.items():
            setattr(self, k, v)

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class ArrayRecordFile:
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
        footer: _Footer | None = None,
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
        self._footer: _Footer | None = footer
        self._lock = threading.RLock()
        self._reset_handles()

    # ------------------------------------------------------------------ process state
    def _reset_handles(self) -> None:
        self._token = process.token()
        self._file: Any = None
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._tls = threading.local()
        # memoryviews over the footer arrays: indexing one gives a Python int several
        # times faster than indexing the numpy array (the hot path reads 4 per chunk).
        self._fast: tuple[memoryview, memoryview, memoryview, memoryview] | None = None
        # The mapped file as a uint8 array, for gathering chunk headers of a batch.
        self._u8: np.ndarray | None = None
        # Whether the file's one-record chunks are uncompressed (None: not known yet).
        self._raw_chunks: bool | None = None
        self._layout_misses = 0  # chunks that fitted neither layout while not known
        self._u8_view: memoryview | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self._url,
            "fs": self._fs,
            "path": self._path,
            "local": self._local,
            "verify": self._verify,
            "footer": self._footer,
            "max_chunk": self._max_chunk,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._url = state["url"]
        self._fs = state["fs"]
        self._path = state["path"]
        self._local = state["local"]
        self._verify = state["verify"]
        self._footer = state["footer"]
        self._max_chunk = state.get("max_chunk", DEFAULT_MAX_CHUNK_BYTES)
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
        """Release this process's file handles; the object can still be used (it reopens).

        Example:
            >>> ArrayRecordFile("/nonexistent.array_record").close()
        """
        if self._token != process.token():
            # Handles inherited through fork belong to the parent; just forget them.
            self._reset_handles()
            return
        view, mm, fh = self._view, self._mm, self._file
        self._reset_handles()
        if view is not None:
            view.release()
        if mm is not None:
            # A view still held elsewhere keeps the map alive; it is unmapped when
            # the last view is released.
            with contextlib.suppress(BufferError):
                mm.close()
        if fh is not None:
            fh.close()

    def _where(self, chunk: int | None = None, row: int | None = None) -> str:
        s = f"ArrayRecord file {self._url!r}"
        if chunk is not None:
            s += f", chunk {chunk}"
        if row is not None:
            s += f", record {row}"
        return s

    def _corrupt(
        self, msg: str, chunk: int | None = None, row: int | None = None
    ) -> CorruptDataError:
        return CorruptDataError(f"{self._where(chunk, row)}: {msg}")

    def _local_view(self) -> memoryview:
        """The whole local file as a memoryview over an mmap, opened once per process."""
        if self._token != process.token():
            self._reset_handles()
        view = self._view
        if view is not None:
            return view
        with self._lock:
            if self._view is None:
                try:
                    fh = open(self._path, "rb")  # noqa: SIM115 - kept open with the map
                except FileNotFoundError as e:
                    raise FileNotFoundError(f"{self._where()} does not exist") from e
                try:
                    size = os.fstat(fh.fileno()).st_size
                    if size < _BLOCK:
                        raise self._corrupt(
                            f"not an ArrayRecord file: {size} bytes, shorter than the "
                            "64 KiB postscript block (truncated?)"
                        )
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except BaseException:
                    fh.close()
                    raise
                view = memoryview(mm)
                try:
                    self._check_given_footer(view, fh)
                except BaseException:
                    view.release()
                    mm.close()
                    fh.close()
                    raise
                self._file, self._mm = fh, mm
                self._view = view
            return self._view

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
        elif bytes(view[f.footer_offset : f.footer_offset + _CHUNK_HEADER]) != f.footer_head:
            why = f"its footer (at offset {f.footer_offset}) differs from the index's"
        if why is not None:
            raise self._corrupt(f"the file changed after the dataset's index was made: {why}")

    def _zstd(self) -> zstandard.ZstdDecompressor:
        # One decompression context per thread (they are not thread-safe) and per
        # process (``_reset_handles`` replaces the thread-local store after fork),
        # shared by every reader of the thread: a context holds tens of KiB, and a
        # process may read thousands of files.
        if self._token != process.token():
            self._reset_handles()
        d = getattr(self._tls, "zstd", None)
        if d is None:
            d = self._tls.zstd = _thread_decompressor()
        return d

    @classmethod
    def _over(
        cls,
        view: memoryview,
        url: str,
        footer: _Footer,
        like: ArrayRecordFile,
        fast: tuple[memoryview, memoryview, memoryview, memoryview] | None = None,
    ) -> ArrayRecordFile:
        """A reader of a file another object keeps mapped (``view``, valid while it is
        used), with its index given (and ``fast``, what :meth:`_fast_index` made of it
        before): for reading a few chunks, with no handle of its own; ``like``'s
        decompression contexts are used."""
        like._zstd()  # ``like`` of this process, with this thread's context
        new = cls.__new__(cls)
        new.__dict__.update(
            _url=url,
            _path=url,
            _fs=None,
            _local=True,
            _verify=False,
            _max_chunk=like._max_chunk,
            _footer=footer,
            _lock=like._lock,  # never taken: the footer is given, the view made
            _token=like._token,
            _file=None,
            _mm=None,
            _view=view,
            _tls=like._tls,
            _fast=fast,
            _u8=None,
            _raw_chunks=None,
            _layout_misses=0,
            _u8_view=None,
        )
        return new

    # ------------------------------------------------------------------ raw bytes
    def _fetch(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """Physical byte ranges [start, end) of the file, as memoryviews."""
        if self._local:
            view = self._local_view()
            if ranges and max(e for _, e in ranges) > len(view):
                raise self._corrupt(f"file is truncated: {len(view)} bytes")
            return [view[s:e] for s, e in ranges]
        # Remote: ranges that touch or nearly touch are fetched together, in one batch.
        try:
            return fetch_ranges(self._fs, self._path, ranges, gap=_REMOTE_GAP, name=self._url)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self._where()} does not exist") from e
        except CorruptDataError as e:
            raise self._corrupt(str(e).replace(f"{self._url}: ", "", 1)) from e

    # ------------------------------------------------------------------ chunks
    def _chunk_payload(self, buf: memoryview, pos: int) -> tuple[int, int, int, Any]:
        """Parse the chunk that starts at physical ``pos``; ``buf`` holds the bytes
        [pos, bound) that it may occupy. Returns (chunk_type, num_records,
        decoded_data_size, data) with block headers removed from ``data``."""
        if pos % _BLOCK and pos % _BLOCK < _BLOCK_HEADER:
            raise _ChunkDecodeError(f"chunk offset {pos} lies inside a block header")
        bound = pos + len(buf)
        hdr_end = _phys_end(pos, _CHUNK_HEADER)
        if hdr_end > bound:
            raise _ChunkDecodeError(
                f"chunk header at offset {pos} runs past the chunk's end ({bound}): truncated"
            )
        if hdr_end - pos != _CHUNK_HEADER:  # a block header interrupts the chunk header
            header = _strip_block_headers(buf[: hdr_end - pos], pos)
        else:
            header = buf[:_CHUNK_HEADER]
        header_hash, data_size, data_hash, type_num, decoded = _HEADER.unpack(header)
        if self._verify and riegeli_hash(header[8:]) != header_hash:
            raise _ChunkDecodeError(f"chunk header at offset {pos} fails its checksum")
        # Bound data_size by the bytes that exist before touching them.
        if data_size > bound - hdr_end:
            raise _ChunkDecodeError(
                f"chunk at offset {pos} claims {data_size} data bytes but at most "
                f"{bound - hdr_end} follow it (corrupt or truncated)"
            )
        data_end = _phys_end(hdr_end, data_size)
        if data_end > bound:
            raise _ChunkDecodeError(
                f"chunk at offset {pos} with {data_size} data bytes runs past its end ({bound})"
            )
        data = _strip_block_headers(buf[hdr_end - pos : data_end - pos], hdr_end)
        if self._verify:
            self._verify_block_headers(buf, pos, data_end)
        if self._verify and riegeli_hash(data) != data_hash:
            raise _ChunkDecodeError(f"chunk data at offset {pos} fails its checksum")
        return type_num & 0xFF, type_num >> 8, decoded, data

    @staticmethod
    def _verify_block_headers(buf: memoryview, pos: int, end: int) -> None:
        """Check the hash and back-pointer of every block header inside [pos, end)."""
        b = -(-pos // _BLOCK) * _BLOCK
        while b < end:
            header = buf[b - pos : b - pos + _BLOCK_HEADER]
            stored, previous_chunk, _ = _BLOCK_HEADER_STRUCT.unpack(header)
            if riegeli_hash(header[8:]) != stored:
                raise _ChunkDecodeError(f"block header at offset {b} fails its checksum")
            if previous_chunk != b - pos:
                raise _ChunkDecodeError(
                    f"block header at offset {b} says its chunk starts at "
                    f"{b - previous_chunk}, not {pos}"
                )
            b += _BLOCK

    def _decompress(self, ctype: int, comp: Any, limit: int, exact: bool) -> Any:
        """Decompress one Riegeli buffer; its size must equal (or not exceed) ``limit``.

        Nothing is allocated from a declared size before it is checked against ``limit``,
        ``max_chunk_bytes`` and what a stream of this length can hold, and the output
        buffer is exactly the declared size: a stream that holds less or more is an error.
        """
        if ctype == _NONE:
            n = len(comp)
            if n > limit or (exact and n != limit):
                raise _ChunkDecodeError(f"uncompressed buffer has {n} bytes, expected {limit}")
            return comp
        if not comp:
            raise _ChunkDecodeError("compressed buffer is empty")
        size = comp[0]
        if size < 0x80:
            p = 1
        else:
            size, p = _varint(comp, 0, len(comp))
        if size > limit or (exact and size != limit):
            raise _ChunkDecodeError(
                f"compressed buffer declares {size} decompressed bytes, expected "
                f"{'' if exact else 'at most '}{limit}"
            )
        if size > self._max_chunk:
            raise _ChunkDecodeError(self._over_ceiling(size))
        payload = comp[p:]
        try:
            if ctype == _ZSTD:
                declared = zstandard.frame_content_size(payload)
                if declared >= 0 and declared != size:
                    raise _ChunkDecodeError(
                        f"zstd frame declares {declared} bytes, chunk says {size}"
                    )
                if size > len(payload) * _ZSTD_MAX_RATIO:
                    raise _ChunkDecodeError(
                        f"a zstd stream of {len(payload)} bytes cannot hold the {size} it declares"
                    )
                out = self._zstd().decompress(payload, max_output_size=size)
            elif ctype == _SNAPPY:
                declared = cramjam.snappy.decompress_raw_len(payload)
                if declared != size:
                    raise _ChunkDecodeError(
                        f"snappy stream declares {declared} bytes, chunk says {size}"
                    )
                if size > len(payload) * _SNAPPY_MAX_RATIO:
                    raise _ChunkDecodeError(
                        f"a snappy stream of {len(payload)} bytes cannot hold the {size} it declares"
                    )
                out = _decompress_into(cramjam.snappy.decompress_raw_into, payload, size)
            elif ctype == _BROTLI:
                # Into a buffer of exactly the declared size: a stream that holds more
                # fails as soon as it fills it, one that holds less leaves a count short.
                out = _decompress_into(cramjam.brotli.decompress_into, payload, size)
            else:
                raise _ChunkDecodeError(f"unknown compression type {ctype:#x}")
        except (_ChunkDecodeError, MemoryError):
            raise
        except Exception as e:
            raise _ChunkDecodeError(
                f"{_COMPRESSIONS.get(ctype, hex(ctype))} decompression failed: {e}"
            ) from e
        if len(out) != size:
            raise _ChunkDecodeError(f"decompressed {len(out)} bytes, expected {size}")
        return out

    def _max_span(self) -> int:
        """The most bytes a chunk of this file (the footer's too) may span: its header,
        data that decodes to at most ``max_chunk_bytes`` (and takes about as much when
        uncompressed), block headers and padding to a block boundary, with room to spare."""
        return 2 * (self._max_chunk + _BLOCK)

    def _over_ceiling(self, size: int) -> str:
        return (
            f"the chunk declares {size} decompressed bytes, more than max_chunk_bytes="
            f"{self._max_chunk} allows (a larger max_chunk_bytes reads it, if the file "
            "is trusted)"
        )

    def _decode_simple(self, data: Any, num_records: int, decoded: int) -> tuple[Any, Any]:
        """Decode a simple chunk into (values buffer, record boundaries or None).

        Boundaries are None when the chunk holds one record (the whole buffer). With
        several records, the record sizes are decoded and checked against the decoded
        size before the values are decompressed.
        """
        n = len(data)
        if n < 2:
            raise _ChunkDecodeError(f"simple chunk data has only {n} bytes")
        ctype = data[0]
        if ctype not in _COMPRESSIONS:
            raise _ChunkDecodeError(f"unknown compression type {ctype:#x}")
        if ctype != _NONE and decoded > self._max_chunk:
            raise _ChunkDecodeError(self._over_ceiling(decoded))
        sizes_len = data[1]
        if sizes_len < 0x80:
            p = 2
        else:
            sizes_len, p = _varint(data, 1, n)
        if sizes_len > n - p:
            raise _ChunkDecodeError(
                f"record-size buffer claims {sizes_len} bytes, only {n - p} remain"
            )
        vstart = p + sizes_len
        if num_records == 1 and ctype == _ZSTD and vstart < n:
            # Hot path (group_size 1, zstd): everything checked, nothing extra called.
            # Any failed check falls through to the general path, which reports it.
            size = data[vstart]
            q = vstart + 1
            if size >= 0x80:
                size, q = _varint(data, vstart, n)
            if size == decoded:
                payload = data[q:]
                try:
                    fits = zstandard.frame_content_size(payload) == size
                    if fits:
                        try:
                            d = self._tls.zstd
                        except AttributeError:
                            d = self._zstd()
                        out = d.decompress(payload, max_output_size=size)
                except zstandard.ZstdError:
                    fits = False
                if fits and len(out) == size:
                    return out, None
        if num_records == 1:
            # The sizes buffer holds one varint equal to the decoded size: skip it.
            return self._decompress(ctype, data[vstart:], decoded, exact=True), None
        sizes_raw = self._decompress(ctype, data[p:vstart], 10 * num_records, False)
        if num_records <= 32:
            bounds = [0]
            q, end = 0, len(sizes_raw)
            total = 0
            for _ in range(num_records):
                v, q = _varint(sizes_raw, q, end)
                total += v
                bounds.append(total)
            if q != end:
                raise _ChunkDecodeError("record-size buffer has trailing bytes")
        else:
            try:
                sizes, _ = _varints_numpy(np.frombuffer(sizes_raw, np.uint8))
            except ValueError as e:
                raise _ChunkDecodeError(f"record-size buffer: {e}") from e
            if sizes.size != num_records:
                raise _ChunkDecodeError(
                    f"record-size buffer holds {sizes.size} sizes, expected {num_records}"
                )
            if sizes.size and int(sizes.max()) > decoded:
                raise _ChunkDecodeError("a record size exceeds the chunk's decoded size")
            bounds = np.zeros(num_records + 1, np.int64)
            np.cumsum(sizes.astype(np.int64), out=bounds[1:])
            total = int(bounds[-1])
        if total != decoded:
            raise _ChunkDecodeError(f"record sizes add up to {total}, chunk decodes to {decoded}")
        return self._decompress(ctype, data[vstart:], decoded, exact=True), bounds

    def _fast_index(self, f: _Footer) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        fast = self._fast
        if fast is None:
            fast = self._fast = _fast_views(f)
        return fast

    def _zstd_single(self, view: memoryview, start: int, end: int, decoded: int) -> Any:
        """The hottest case inlined: a one-record zstd chunk at ``view[start:end]``.

        The sizes buffer is skipped (its one size is the decoded size) and the values
        are decompressed straight from the map. Returns None when anything looks
        unusual, so the general path can decode or report it.
        """
        q = start + 1
        n = view[q]
        q += 1
        if n >= 0x80:
            return None
        q += n  # skip the record-size buffer
        if q + 2 >= end:
            return None
        size = view[q]
        q += 1
        if size >= 0x80:
            b = view[q]
            q += 1
            if b >= 0x80:
                size, q = _varint(view, q - 2, end)
            else:
                size = (size & 0x7F) | (b << 7)
        if size != decoded or size > self._max_chunk:
            return None
        payload = view[q:end]
        try:
            if zstandard.frame_content_size(payload) != size:
                return None
            try:
                d = self._tls.zstd
            except AttributeError:
                d = self._zstd()
            out = d.decompress(payload, max_output_size=size)
        except (zstandard.ZstdError, ValueError):
            return None
        return out if len(out) == size else None

    def _local_chunk(self, c: int, view: memoryview, fast: tuple) -> tuple[Any, Any]:
        """Decode local chunk ``c``; the common case (header and data inside one block,
        no checksum verification) is parsed in place with no copy and few checks."""
        offs, ends, _, recs = fast
        pos = offs[c]
        simple = self._simple_chunk(view, pos, c, fast)
        if simple is not None:
            start, size, nrec, decoded = simple
            end = start + size
            if nrec == 1 and end - start > 3 and view[start] == _ZSTD:
                out = self._zstd_single(view, start, end, decoded)
                if out is not None:
                    return out, None
            try:
                return self._decode_simple(view[start:end], nrec, decoded)
            except _ChunkDecodeError as e:
                raise self._corrupt(str(e), chunk=c, row=recs[c]) from None
        # Anything unusual: the general path, which checks and reports everything.
        try:
            return self._decode_chunk(c, view[pos : ends[c]])
        except _ChunkDecodeError as e:
            raise self._corrupt(str(e), chunk=c, row=recs[c]) from None

    def _simple_chunk(
        self, buf: Any, pos: int, c: int, fast: tuple[Any, Any, Any, Any], at: int | None = None
    ) -> tuple[int, int, int, int] | None:
        """For chunk ``c`` (file offset ``pos``, its header at ``buf[at]``, default
        ``at=pos``): ``(where its data starts in buf, its size, records, decoded size)`` in the
        common case (header and data inside one block, a simple chunk whose counts match
        the footer, no verification), which needs no further checks; else None."""
        _, ends, dsizes, recs = fast
        m = pos & 0xFFFF
        if m < _BLOCK_HEADER or m + _CHUNK_HEADER > _BLOCK or self._verify:
            return None
        at = pos if at is None else at
        _, data_size, _, type_num, decoded = _HEADER.unpack_from(buf, at)
        start = pos + _CHUNK_HEADER
        end = start + data_size
        nrec = type_num >> 8
        if (
            start & 0xFFFF
            and start >> 16 == (end - 1) >> 16
            and end <= ends[c]
            and type_num & 0xFF == _CHUNK_SIMPLE
            and decoded == dsizes[c]
            and nrec == recs[c + 1] - recs[c]
        ):
            return at + _CHUNK_HEADER, data_size, nrec, decoded
        return None

    def _decode_chunk(self, c: int, buf: memoryview) -> tuple[Any, Any]:
        f = self._footer
        assert f is not None
        pos = int(f.chunk_offsets[c])
        ctype, num_records, decoded, data = self._chunk_payload(buf, pos)
        expected_n = int(f.record_offsets[c + 1] - f.record_offsets[c])
        if ctype == _CHUNK_TRANSPOSED:
            raise TransposedChunkError(
                f"{self._where(c)}: the chunk is transposed (written with the 'transpose' "
                "writer option), which this reader does not decode; rewrite the file "
                "without 'transpose' (e.g. torchgrain.write_array_record or "
                "ArrayRecordWriter(path, 'group_size:1'))"
            )
        if ctype != _CHUNK_SIMPLE:
            raise _ChunkDecodeError(f"chunk type {ctype:#x} at offset {pos} is not a record chunk")
        if num_records != expected_n:
            raise _ChunkDecodeError(
                f"chunk header says {num_records} records, the footer says {expected_n}"
            )
        if decoded != int(f.decoded_sizes[c]):
            raise _ChunkDecodeError(
                f"chunk header says {decoded} decoded bytes, the footer says {int(f.decoded_sizes[c])}"
            )
        return self._decode_simple(data, num_records, decoded)

    # ------------------------------------------------------------------ footer
    def _ensure_footer(self) -> _Footer:
        f = self._footer
        if f is None:
            with self._lock:
                if self._footer is None:
                    self._footer = self._read_footer()
            f = self._footer
        return f

    def _read_footer(self) -> _Footer:
        # The whole tail in one read: locally a view of the map, remotely one request.
        if self._local:
            view = self._local_view()
            size = len(view)
            tail_start = 0
            tail = view
        else:
            try:
                size = remote.file_size(self._fs, self._path, url=self._url)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{self._where()} does not exist") from e
            if size < _BLOCK:
                raise self._corrupt(
                    f"not an ArrayRecord file: {size} bytes, shorter than the 64 KiB "
                    "postscript block (truncated?)"
                )
            tail_start = max(0, size - _REMOTE_TAIL)
            tail = memoryview(
                remote.cat_file(self._fs, self._path, tail_start, size, url=self._url)
            )
            if len(tail) != size - tail_start:
                raise self._corrupt("file changed size while it was being opened")

        post_pos = size - _BLOCK
        try:
            ctype, n, decoded, data = self._chunk_payload(tail[post_pos - tail_start :], post_pos)
            if ctype != _CHUNK_SIMPLE or n < 1:
                raise _ChunkDecodeError("the last 64 KiB block holds no postscript chunk")
            values, bounds = self._decode_simple(data, n, decoded)
            first = values[: bounds[1]] if bounds is not None else values
            post = _parse_proto(first)
        except (_ChunkDecodeError, ValueError, struct.error) as e:
            raise self._corrupt(
                f"not an ArrayRecord file or truncated (bad postscript at offset {post_pos}: {e})"
            ) from None
        if post.get(2) != _MAGIC or not isinstance(post.get(1), int):
            raise self._corrupt(
                "not an ArrayRecord file: the postscript lacks the ArrayRecord magic number"
            )
        footer_offset = post[1]
        if not _CHUNK_HEADER <= footer_offset < post_pos:
            raise self._corrupt(
                f"postscript points to footer offset {footer_offset} outside the file"
            )
        # Between the footer's start and the postscript: the footer chunk and padding.
        # A postscript pointing further back would make a remote open fetch the file's
        # data as its footer.
        if post_pos - footer_offset > self._max_span():
            raise self._corrupt(
                f"postscript points to a footer at offset {footer_offset}, "
                f"{post_pos - footer_offset} bytes before it: more than a footer within "
                f"max_chunk_bytes={self._max_chunk} takes (a larger max_chunk_bytes reads "
                "it, if the file is trusted)"
            )

        if footer_offset >= tail_start:
            fbuf = tail[footer_offset - tail_start : post_pos - tail_start]
        else:
            fbuf = self._fetch([(footer_offset, post_pos)])[0]
        try:
            ctype, n, decoded, data = self._chunk_payload(fbuf, footer_offset)
            if ctype == _CHUNK_TRANSPOSED:
                raise _ChunkDecodeError("the footer chunk is transposed")
            if ctype != _CHUNK_SIMPLE or n < 1:
                raise _ChunkDecodeError(f"footer chunk has type {ctype:#x} and {n} records")
            values, bounds = self._decode_simple(data, n, decoded)
            if bounds is None:
                bounds = np.array([0, len(values)], np.int64)
            bounds = np.asarray(bounds, np.int64)
            meta_msg = _parse_proto(memoryview(values)[: int(bounds[1])])
            meta_raw = meta_msg.get(1)
            if not isinstance(meta_raw, bytes):
                raise _ChunkDecodeError("footer metadata lacks array_record_metadata")
            meta = _parse_proto(meta_raw)
        except (_ChunkDecodeError, ValueError, struct.error) as e:
            raise self._corrupt(f"bad footer at offset {footer_offset}: {e}") from None
        if meta.get(1) != 1:
            raise self._corrupt(f"unsupported ArrayRecord version {meta.get(1)!r}")
        num_chunks = int(meta.get(2, 0))
        num_records = int(meta.get(3, 0))
        writer_options = meta.get(4, b"")
        writer_options = (
            writer_options.decode("utf-8", "replace") if isinstance(writer_options, bytes) else ""
        )
        if num_chunks != n - 1:
            raise self._corrupt(
                f"footer metadata says {num_chunks} chunks, the footer holds {n - 1} entries"
            )
        offsets, dsizes, counts = self._parse_entries(values, bounds)
        if num_chunks:
            if float(counts.sum(dtype=np.float64)) >= 2.0**62:  # int64 sums would wrap
                raise self._corrupt("footer entries hold more than 2**62 records")
            if int(counts.sum()) != num_records:
                raise self._corrupt(
                    f"footer entries hold {int(counts.sum())} records, metadata says {num_records}"
                )
            if (
                offsets[0] < _CHUNK_HEADER
                or (num_chunks > 1 and bool(np.any(np.diff(offsets) <= 0)))
                or offsets[-1] >= footer_offset
            ):
                raise self._corrupt("footer chunk offsets are not increasing within the file")
        elif num_records:
            raise self._corrupt(f"footer has no chunks but metadata says {num_records} records")
        record_offsets = np.zeros(num_chunks + 1, np.int64)
        np.cumsum(counts, out=record_offsets[1:])
        chunk_ends = np.empty(num_chunks, np.int64)
        chunk_ends[:-1] = offsets[1:]
        if num_chunks:
            chunk_ends[-1] = footer_offset
            # A remote read fetches a chunk to the next one's offset: chunks listed far
            # apart would make a read of one record fetch the bytes between.
            spans = chunk_ends - offsets
            c = int(np.argmax(spans))
            if int(spans[c]) > self._max_span():
                raise self._corrupt(
                    f"it spans {int(spans[c])} bytes to the next chunk's offset, more than a "
                    f"chunk within max_chunk_bytes={self._max_chunk} takes (a larger "
                    "max_chunk_bytes reads it, if the file is trusted)",
                    chunk=c,
                )
        # Uniform group size (all chunks but the last hold g records) allows a division
        # instead of a binary search for single-record reads.
        group = 0
        if num_chunks and counts[0] > 0:
            g = int(counts[0])
            if bool(np.all(counts[:-1] == g)) and int(counts[-1]) <= g and int(counts[-1]) > 0:
                group = g
        return _Footer(
            chunk_offsets=offsets,
            chunk_ends=chunk_ends,
            decoded_sizes=dsizes,
            record_offsets=record_offsets,
            num_records=num_records,
            writer_options=writer_options,
            footer_offset=footer_offset,
            file_size=size,
            group_size=group,
        )

    def _entries_fast(
        self, raw: np.ndarray, rec_starts: np.ndarray, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Vectorised parse of footer entries as the writer lays them out: per entry
        exactly ``08 <varint> 10 <varint> 18 <varint>``. Returns None for any other
        layout (the general parser then handles it)."""
        if n == 0:
            z = np.zeros(0, np.int64)
            return z, z.copy(), z.copy()
        if raw.size == 0 or raw[-1] >= 0x80:
            return None
        ends = np.flatnonzero(raw < 0x80)  # last byte of every varint
        if ends.size != 6 * n:
            return None
        # Per entry six varints: tag 1, field 1, tag 2, field 2, tag 3, field 3. Tags are
        # the single bytes 8, 16, 24, each right after the varint before it, and entry k
        # starts with its tag 8 at rec_starts[k].
        tags = ends[0::2]
        if not (
            np.array_equal(ends[0::6], rec_starts)
            and np.array_equal(tags[1:], ends[1:-1:2] + 1)
            and bool((raw[tags].reshape(n, 3) == _ENTRY_TAGS).all())
        ):
            return None
        lengths = ends[1::2] - tags  # bytes of each field's varint
        if int(lengths.max()) > 8:  # >= 2^56: no real offset, size or count
            return None  # (the general parser names the entry)
        # Each field's varint as the 8 little-endian bytes from where it starts (one
        # gather through an unaligned uint64 view), its 7-bit groups packed together in
        # three steps, cut to its length.
        padded = np.zeros(raw.size + 8, np.uint8)
        padded[: raw.size] = raw
        words = np.ndarray((raw.size,), dtype="<u8", buffer=padded, strides=(1,))
        x = words[tags + 1]
        x = (x & 0x007F007F007F007F) | ((x & 0x7F007F007F007F00) >> 1)
        x = (x & 0x00003FFF00003FFF) | ((x & 0x3FFF00003FFF0000) >> 2)
        x = (x & 0x000000000FFFFFFF) | ((x & 0x0FFFFFFF00000000) >> 4)
        x &= np.left_shift(np.uint64(1), (7 * lengths).astype(np.uint64)) - np.uint64(1)
        out = x.astype(np.int64).reshape(n, 3).T
        return out[0].copy(), out[1].copy(), out[2].copy()

    def _parse_entries(
        self, values: Any, bounds: np.ndarray, vectorised: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Footer entries 1..n as (chunk_offset, decoded_size, num_records) int64 arrays."""
        n = len(bounds) - 2
        if vectorised:
            body_start = int(bounds[1])
            raw = np.frombuffer(values, np.uint8)[body_start : int(bounds[-1])]
            fields = self._entries_fast(raw, bounds[1:-1] - body_start, n)
            if fields is not None:
                return fields
        # Any protobuf layout (fields in another order, missing or repeated): per entry.
        out = np.zeros((n, 3), np.int64)
        mv = memoryview(values)
        for i in range(n):
            try:
                msg = _parse_proto(mv[int(bounds[i + 1]) : int(bounds[i + 2])])
            except ValueError as e:
                raise self._corrupt(f"footer entry {i}: {e}") from None
            for j in range(3):
                x = msg.get(j + 1, 0)
                if not isinstance(x, int) or x >= 1 << 62:
                    raise self._corrupt(f"footer entry {i}: bad field {j + 1}: {x!r}")
                out[i, j] = x
        return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy()

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

    def _chunk_of(self, rows: np.ndarray, f: _Footer) -> np.ndarray:
        if f.group_size:
            return rows // f.group_size
        return np.searchsorted(f.record_offsets, rows, side="right") - 1

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
            if len(chunks) >= _BATCH_MIN and not self._verify:
                return self._local_batch(chunks, view, fast, f)
            local_chunk = self._local_chunk
            return [local_chunk(c, view, fast) for c in chunks]
        ranges = [(int(f.chunk_offsets[c]), int(f.chunk_ends[c])) for c in chunks]
        bufs = self._fetch(ranges)
        out = []
        for c, buf in zip(chunks, bufs):
            try:
                out.append(self._decode_chunk(c, buf))
            except _ChunkDecodeError as e:
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
        if arr.dtype.kind not in "iu":
            if arr.dtype.kind == "f" or arr.dtype == object:
                arr = arr.astype(np.int64)
            else:
                raise TypeError(f"rows must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False).ravel()
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= f.num_records:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{self._where(row=bad)}: row out of range [0, {f.num_records})")
        if f.group_size == 1 and self._local and not self._verify and n >= _BATCH_MIN:
            out_singles = self._read_singles(arr, f)
            if out_singles is not None:
                return out_singles
        chunk_ids = self._chunk_of(arr, f)
        # Sorting groups rows by chunk and makes local reads walk the file forwards.
        order = np.argsort(chunk_ids, kind="stable")
        sorted_chunks = chunk_ids[order]
        uniq, first = np.unique(sorted_chunks, return_index=True)
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
                if isinstance(bounds, np.ndarray):
                    bounds = bounds.tolist() if ends[k] - first[k] > 8 else bounds
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

    def _heads(self, cs: np.ndarray, f: _Footer) -> tuple[memoryview, np.ndarray, np.ndarray]:
        """``(view, pos, heads)`` of local chunks ``cs``: the map, their offsets, and the
        first :data:`_HEADS` bytes at each (a chunk's header and the start of its data),
        gathered in one fancy index. Rows of chunks too close to the end of the file
        hold other bytes (:func:`_plan` rejects them); every file whose footer parsed
        holds at least :data:`_HEADS` bytes (its signature chunk)."""
        view = self._local_view()
        u8 = self._u8
        if u8 is None or self._u8_view is not view:
            u8 = self._u8 = np.frombuffer(view, dtype=np.uint8)
            self._u8_view = view
        pos = f.chunk_offsets[cs]
        at = np.minimum(pos, len(u8) - _HEADS)
        return view, pos, u8[at[:, None] + _HEAD_BYTES]

    def _chunk_plan(
        self, cs: np.ndarray, f: _Footer, raw: bool = False
    ) -> tuple[memoryview, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where the values of local chunks ``cs`` (int64) lie, for the common layout.

        Returns ``(view, ok, payload, end, size, cut)`` as :func:`_plan` does, for the
        map ``view``.
        """
        view, pos, heads = self._heads(cs, f)
        ok, payload, end, decoded, cut = _plan(
            pos, heads, len(view), f.chunk_ends[cs], f.decoded_sizes[cs], raw
        )
        if f.group_size != 1:  # the footer must agree: one record in the chunk
            recs = f.record_offsets
            ok &= recs[cs + 1] - recs[cs] == 1
        return view, ok, payload, end, decoded, cut

    def _decompress_frames(self, frames: Iterable[Any], sizes: list[int]) -> list[bytes] | None:
        """zstd ``frames`` (see :func:`_frames`) of ``sizes[k]`` bytes each, decompressed
        (None when any fails or differs in size: the careful path then finds and names
        the culprit)."""
        try:
            d = self._tls.zstd
        except AttributeError:
            d = self._zstd()
        if sizes and max(sizes) > self._max_chunk:
            return None
        # zstd allocates what a frame's header declares, whatever ``sizes`` says: a frame
        # of a few KiB can declare (and hold) gigabytes. Each must declare its size, or
        # none (then ``sizes`` bounds what it may decompress to). libzstd checks that a
        # frame holds what it declares, so when all declare theirs, the lengths of the
        # output need no check.
        try:
            if isinstance(frames, list):
                declared = list(map(zstandard.frame_content_size, frames))
                exact = declared == sizes
                if not exact and any(c not in (s, -1) for c, s in zip(declared, sizes)):
                    return None
            else:
                frames = _declaring(frames, sizes)
                exact = False
            # One call per frame, with no Python code per frame: zstandard's batch call
            # writes all output into one new buffer, whose fresh pages cost more than the
            # calls it saves, and each record would still need a copy of its own.
            out = list(map(d.decompress, frames, sizes))
        except (zstandard.ZstdError, ValueError):
            return None
        return out if exact or list(map(len, out)) == sizes else None

    def _layout(self, arr: np.ndarray, f: _Footer) -> bool | None:
        """Whether this file's one-record chunks are uncompressed (True) or zstd (False),
        learnt from the first chunks ``arr`` that fit either plan; None while none has.
        After 64 chunks that fit neither (other compressions), the answer is False: the
        zstd plan then fails for most chunks and the general path reads them."""
        raw = self._raw_chunks
        if raw is not None:
            return raw
        zstd = int(self._chunk_plan(arr, f)[1].sum())
        plain = int(self._chunk_plan(arr, f, raw=True)[1].sum()) if zstd < len(arr) else 0
        if zstd or plain:
            self._raw_chunks = plain > zstd
        else:
            self._layout_misses += len(arr)
            if self._layout_misses >= 64:
                self._raw_chunks = False
        return self._raw_chunks

    def _read_singles(self, arr: np.ndarray, f: _Footer) -> list[bytes] | None:
        """Records at valid rows ``arr`` of a local ``group_size:1`` file, in request order,
        when most chunks have the common layout (else None: take the general path).

        No sort and no per-record Python code: the chunk of row ``r`` is chunk ``r``. A
        row asked for twice is decompressed twice (the same bytes). zstd chunks are
        decompressed; uncompressed ones are sliced out of the map (which layout a file
        has is learnt from its first batch).
        """
        raw = bool(self._layout(arr, f))
        view, ok, payload, end, decoded, cut = self._chunk_plan(arr, f, raw=raw)
        if ok.all():
            frames = _frames(view, payload, end, cut)
            if raw:
                return list(map(bytes, frames))
            return self._decompress_frames(frames, decoded.tolist())
        # Some chunks are unusual (a header split by a block boundary, data crossing two
        # boundaries, an empty record): those take the careful path, one by one.
        good = np.flatnonzero(ok)
        if len(good) < len(arr) // 2:
            return None
        frames = _frames(view, payload[good], end[good], cut[good])
        if raw:
            out = list(map(bytes, frames))
        else:
            out = self._decompress_frames(frames, decoded[good].tolist())
        if out is None:
            return None
        for k in np.flatnonzero(~ok).tolist():  # ascending: each lands at its position
            out.insert(k, self._careful_record(int(arr[k]), f))
        return out

    def _careful_record(self, c: int, f: _Footer) -> bytes:
        """The record of local one-record chunk ``c``, through :meth:`_local_chunk` (which
        checks and reports everything)."""
        fast = self._fast or self._fast_index(f)
        values, bounds = self._local_chunk(c, self._local_view(), fast)
        if bounds is None:
            return values if type(values) is bytes else bytes(values)
        j = c - fast[3][c]  # 0: one record per chunk
        return bytes(values[int(bounds[j]) : int(bounds[j + 1])])

    def _local_batch(
        self, chunks: list[int], view: memoryview, fast: tuple, f: _Footer
    ) -> list[tuple[Any, Any]]:
        """Decode many local chunks at once: the common case vectorised
        (:meth:`_chunk_plan`), every other chunk through :meth:`_local_chunk`. Returns
        what :meth:`_read_chunks` does, in the order given.
        """
        cs = np.asarray(chunks, dtype=np.int64)
        view, ok, payload, end, decoded, cut = self._chunk_plan(cs, f)
        out: list[Any] = [None] * len(chunks)
        fast_k = np.flatnonzero(ok)
        values = None
        if len(fast_k):
            frames = _frames(view, payload[fast_k], end[fast_k], cut[fast_k])
            values = self._decompress_frames(frames, decoded[fast_k].tolist())
            if values is not None:
                for k, v in zip(fast_k.tolist(), values):
                    out[k] = (v, None)
        if values is None or len(fast_k) < len(chunks):
            local_chunk = self._local_chunk
            for k, c in enumerate(chunks):
                if out[k] is None:
                    out[k] = local_chunk(c, view, fast)
        return out

    def _pread_chunks(self, chunks: list[int], f: _Footer, size: int) -> list[tuple[Any, Any]]:
        """Local chunks read with ``pread`` (see :meth:`_read_chunks`); the common case
        (header and data inside one block, no verification) decoded as
        :meth:`_local_chunk` does, anything else by the general path."""
        fd = self._file.fileno()
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
            try:
                simple = self._simple_chunk(buf, pos, c, fast, at=0)
                if simple is not None:
                    start, nbytes, nrec, decoded = simple
                    data = buf[start : start + nbytes]
                    out.append(self._decode_simple(data, nrec, decoded))
                    continue
                out.append(self._decode_chunk(c, buf))
            except _ChunkDecodeError as e:
                raise self._corrupt(str(e), chunk=c, row=int(f.record_offsets[c])) from None
        return out

    def _read_one(self, row: int, f: _Footer) -> bytes:
        if not 0 <= row < f.num_records:
            raise IndexError(f"{self._where(row=row)}: row out of range [0, {f.num_records})")
        if f.group_size:
            c = row // f.group_size
        else:
            c = int(np.searchsorted(f.record_offsets, row, side="right")) - 1
        view = self._view
        if view is not None and self._token[1] == process.generation:
            fast = self._fast or self._fast_index(f)
            values, bounds = self._local_chunk(c, view, fast)
        else:
            values, bounds = self._read_chunks([c])[0]
        if bounds is None:
            return values if type(values) is bytes else bytes(values)
        j = row - int(f.record_offsets[c])
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
        f = self._ensure_footer()
        start = max(0, int(start))
        stop = min(int(stop), f.num_records)
        if stop <= start:
            return []
        c0 = int(np.searchsorted(f.record_offsets, start, side="right")) - 1
        c1 = int(np.searchsorted(f.record_offsets, stop - 1, side="right"))
        chunks = list(range(c0, c1))
        out: list[bytes] = []
        for c, (values, bounds) in zip(chunks, self._read_chunks(chunks)):
            base = int(f.record_offsets[c])
            lo = max(start - base, 0)
            hi = min(stop - base, int(f.record_offsets[c + 1]) - base)
            if bounds is None:
                out.append(values if isinstance(values, bytes) else bytes(values))
                continue
            b = bounds.tolist() if isinstance(bounds, np.ndarray) else bounds
            out.extend(bytes(values[b[j] : b[j + 1]]) for j in range(lo, hi))
        return out


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
        f = ArrayRecordFile(p, filesystem=filesystem, max_chunk_bytes=max_chunk_bytes)
        try:
            return f.num_records
        finally:
            f.close()

    return np.array(
        map_files(lambda i: count(paths[i]), len(paths), max_workers=max_workers), np.int64
    )


def read_many(
    files: Sequence[ArrayRecordFile],
    rows: Sequence[np.ndarray],
    *,
    chunk_cache: Any = None,
    cache_keys: Sequence[Any] | None = None,
) -> list[list[bytes]]:
    """``[files[k].read(rows[k]) for k ...]``, with the work on local ``group_size:1``
    files of one layout done for all of them at once.

    A batch of a global shuffle touches many shards a few records each: planning each
    file's chunks with numpy on its own costs more than decoding them. Here each file
    gathers its chunks' headers (:meth:`ArrayRecordFile._heads`), and one :func:`_plan`
    and one decompression loop serve the whole batch. Files that do not qualify (remote,
    checksummed, grouped, fewer than two rows) take :meth:`ArrayRecordFile.read` (with
    ``chunk_cache`` and ``cache_keys[k]``); unusual chunks of the others (a header split
    by a block boundary, an empty record) are read one by one by the careful path, which
    checks and reports everything.

    Example:
        >>> import tempfile, os
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> paths = [os.path.join(tempfile.mkdtemp(), f"{k}.array_record") for k in range(2)]
        >>> for k, path in enumerate(paths):
        ...     w = ArrayRecordWriter(path, "group_size:1")
        ...     for i in range(20):
        ...         w.write(b"%d-%d" % (k, i))
        ...     w.close()
        >>> files = [ArrayRecordFile(p) for p in paths]
        >>> read_many(files, [np.array([3, 1]), np.array([19])])
        [[b'0-3', b'0-1'], [b'1-19']]
    """
    keys = cache_keys if cache_keys is not None else [None] * len(files)

    def one(k: int) -> list[bytes]:
        return files[k].read(rows[k], chunk_cache=chunk_cache, cache_key=keys[k])

    out: list[Any] = [None] * len(files)
    layouts: dict[bool, list[int]] = {False: [], True: []}
    for k, (file, r) in enumerate(zip(files, rows)):
        f = file._ensure_footer()
        raw = None
        arr = np.asarray(r)
        if (
            len(arr) >= _MANY_MIN
            and arr.ndim == 1
            and arr.dtype.kind in "iu"
            and f.group_size == 1
            and file._local
            and not file._verify
        ):
            raw = file._raw_chunks
            if raw is None and _rows_fit(file, f, arr):
                raw = file._layout(arr.astype(np.int64), f)
        if raw is None:  # read() checks the rows and reads the file on its own
            out[k] = one(k)
        else:
            layouts[raw].append(k)
    for raw, ks in layouts.items():
        if len(ks) == 1:
            out[ks[0]] = one(ks[0])
        elif ks:
            for k, records in zip(ks, _read_many_singles(files, rows, ks, raw, one)):
                out[k] = records
    return out


def _read_many_singles(
    files: Sequence[ArrayRecordFile],
    rows: Sequence[np.ndarray],
    ks: list[int],
    raw: bool,
    one: Any,
) -> list[list[bytes]]:
    """:func:`read_many` for files ``ks``, of one layout (all zstd, or all
    uncompressed); ``one(k)`` reads file ``k`` on its own (used when a zstd frame fails,
    to find and name it)."""
    files = [files[k] for k in ks]
    rows = [np.asarray(rows[k], dtype=np.int64) for k in ks]
    counts = [len(r) for r in rows]
    every = np.concatenate(rows)
    if ((every < 0) | (every >= np.repeat([g._footer.num_records for g in files], counts))).any():
        for file, r in zip(files, rows):  # the first file with a bad row raises
            _rows_fit(file, file._footer, r, strict=True)
    views, pos, heads, sizes, ends, decoded_sizes = [], [], [], [], [], []
    for file, cs in zip(files, rows):
        f = file._footer
        view, p, h = file._heads(cs, f)
        views.append(view)
        pos.append(p)
        heads.append(h)
        sizes.append(np.full(len(cs), len(view), np.int64))
        ends.append(f.chunk_ends[cs])
        decoded_sizes.append(f.decoded_sizes[cs])
    ok, payload, end, decoded, cut = _plan(
        np.concatenate(pos),
        np.concatenate(heads),
        np.concatenate(sizes),
        np.concatenate(ends),
        np.concatenate(decoded_sizes),
        raw,
    )
    bounds = np.cumsum([0, *counts]).tolist()
    spans = list(zip(views, bounds, bounds[1:], strict=False))
    if ok.all():
        parts = (_frames(v, payload[a:b], end[a:b], cut[a:b]) for v, a, b in spans)
        lengths = decoded
    else:  # unusual chunks are left out here and read one by one below
        keep = [np.flatnonzero(ok[a:b]) + a for _, a, b in spans]
        parts = (_frames(v, payload[k], end[k], cut[k]) for (v, _, _), k in zip(spans, keep))
        lengths = decoded[ok]
    frames = itertools.chain.from_iterable(parts)
    if raw:
        flat = list(map(bytes, frames))
    else:
        flat = files[0]._decompress_frames(frames, lengths.tolist())
        if flat is None:  # a frame failed: the files on their own find and name it
            return [one(k) for k in ks]
    unusual = np.flatnonzero(~ok)
    if len(unusual):
        owner = (np.searchsorted(bounds, unusual, side="right") - 1).tolist()
        for r, j in zip(unusual.tolist(), owner):  # ascending: each lands at its place
            file = files[j]
            flat.insert(r, file._careful_record(int(every[r]), file._footer))
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]


def read_mapped(
    u8: np.ndarray,
    view: memoryview,
    pos: np.ndarray,
    chunk_ends: np.ndarray,
    file_ends: np.ndarray,
    decoded: np.ndarray,
    *,
    decoder: ArrayRecordFile,
    careful: Callable[[int], bytes],
    words: np.ndarray | None = None,
) -> list[bytes]:
    """The records of one-record chunks of many local files, in the order given, with
    no Python work per file: one gather of the chunks' headers, one :func:`_plan`, one
    decompression loop for the whole batch.

    ``u8`` and ``view`` are one address space holding every file, each at a 64 KiB
    aligned base (a :class:`~torchgrain.io.region.ShardRegion`); ``pos``,
    ``chunk_ends`` and ``file_ends`` are each chunk's start, its end (the next chunk or
    the footer) and its file's end there, and ``decoded`` what the index says the
    chunk decodes to. The caller has bounded them (``base + 40 <= pos < chunk_end <=
    footer <= file_end``, ``file_end - base >= 64 KiB``), so every byte read lies in a
    mapped file (``words``, if given, is ``u8`` as the little-endian uint64 starting at
    each byte, for a cheaper gather). zstd chunks are decompressed with ``decoder``'s context; uncompressed
    ones are copied out. Chunks that are unusual (a header cut by a block boundary, an
    empty record, another compression) or fail are read by ``careful(k)`` (row ``k``
    of the batch), the path that checks and reports everything.

    Example:
        >>> import tempfile, os
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "m.array_record")
        >>> w = ArrayRecordWriter(path, "group_size:1")
        >>> for i in range(3):
        ...     w.write(b"rec %d" % i)
        >>> w.close()
        >>> f = ArrayRecordFile(path)
        >>> u8 = np.frombuffer(f._local_view(), np.uint8)
        >>> c = np.array([2, 0])
        >>> read_mapped(u8, f._local_view(), f.chunk_offsets[c], f._footer.chunk_ends[c],
        ...             np.full(2, len(u8)), f._footer.decoded_sizes[c], decoder=f,
        ...             careful=lambda k: f.read([int(c[k])])[0])
        [b'rec 2', b'rec 0']
    """
    at = np.minimum(pos, file_ends - _HEADS)
    if words is not None:  # 8 bytes per element gathered
        heads = words[at[:, None] + _HEAD_WORDS].view(np.uint8)
    else:
        heads = u8[at[:, None] + _HEAD_BYTES]
    ok, payload, end, dec, cut = _plan(pos, heads, file_ends, chunk_ends, decoded, False)
    if ok.all():
        out = decoder._decompress_frames(_frames(view, payload, end, cut), dec.tolist())
        # A frame failed: the careful path finds and names it.
        return out if out is not None else [careful(k) for k in range(len(pos))]
    miss = np.flatnonzero(~ok)
    # Files written uncompressed: the same plan for raw chunks (no learning per file).
    raw = miss[heads[miss, _CHUNK_HEADER] == _NONE]
    raw_vals: list[bytes] = []
    if len(raw):
        r_ok, r_payload, r_end, _, r_cut = _plan(
            pos[raw], heads[raw], file_ends[raw], chunk_ends[raw], decoded[raw], True
        )
        raw = raw[r_ok]
        raw_vals = list(map(bytes, _frames(view, r_payload[r_ok], r_end[r_ok], r_cut[r_ok])))
        if len(raw) == len(pos):
            return raw_vals
    z = np.flatnonzero(ok)
    vals: list[Any] = []
    if len(z):
        vals = decoder._decompress_frames(
            _frames(view, payload[z], end[z], cut[z]), dec[z].tolist()
        ) or [careful(k) for k in z.tolist()]
    if len(raw) == 0:  # zstd chunks and a few unusual ones: those take their places
        for k in miss.tolist():  # ascending: each lands at its position
            vals.insert(k, careful(k))
        return vals
    out: list[Any] = [None] * len(pos)
    for keys, values in ((z, vals), (raw, raw_vals)):
        for k, v in zip(keys.tolist(), values):
            out[k] = v
    for k in np.setdiff1d(miss, raw).tolist():
        out[k] = careful(k)
    return out


def _rows_fit(file: ArrayRecordFile, f: _Footer, rows: np.ndarray, strict: bool = False) -> bool:
    """Whether every row lies in ``[0, num_records)``; with ``strict``, raise the
    IndexError that :meth:`ArrayRecordFile.read` raises instead of returning False."""
    lo, hi = int(rows.min()), int(rows.max())
    if lo >= 0 and hi < f.num_records:
        return True
    if strict:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{file._where(row=bad)}: row out of range [0, {f.num_records})")
    return False


def _plan(
    pos: np.ndarray,
    heads: np.ndarray,
    size: int | np.ndarray,
    chunk_ends: np.ndarray,
    decoded_sizes: np.ndarray,
    raw: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Which one-record chunks have the common layout, and where their frames lie.

    ``pos`` are the chunks' offsets in their files, ``heads`` the first :data:`_HEADS`
    bytes at each (:meth:`ArrayRecordFile._heads`), ``size`` the files' sizes, and
    ``chunk_ends`` and ``decoded_sizes`` what the footers say of them; rows may come
    from several files. One-record zstd chunks whose header sits inside one block (what
    ``group_size:1`` files hold) are recognised with numpy alone, checked against the
    footer. Returns ``(ok, payload, end, decoded, cut)``: chunk ``k`` with ``ok[k]``
    holds one zstd frame at ``[payload[k], end[k])`` of its file that decompresses to
    ``decoded[k]`` bytes, less the 24-byte block headers in that range where ``cut[k]``
    is not 0 (see :func:`_frames`). With ``raw``, the same for uncompressed chunks
    instead: the frame is the record itself. Chunks that are not ``ok`` must take
    :meth:`ArrayRecordFile._local_chunk`, which checks and reports everything.
    """
    fields = heads.view("<u8")  # the header's five fields, then data
    data_size = fields[:, 1].astype(np.int64)
    type_num, decoded = fields[:, 3], fields[:, 4]
    low = pos & 0xFFFF
    start = pos + _CHUNK_HEADER
    # Data that runs into the next blocks has their 24-byte headers in it (one 12 KiB
    # record in five, every record over 64 KiB): its frame is cut there.
    boundary = ((start >> 16) + 1) << 16
    end = _phys_end(start, data_size)  # elementwise
    cut = (end > boundary).astype(np.int64)
    ok = (
        (low >= _BLOCK_HEADER)
        & (low + _CHUNK_HEADER < _BLOCK)  # the header inside a block, data after it
        & (pos + _HEADS <= size)
        & (end <= chunk_ends)
        & (type_num == (1 << 8 | _CHUNK_SIMPLE))  # a simple chunk of one record
        & (decoded == decoded_sizes)
        & (data_size > 3)
        # zstandard's batch call frees twice on an empty output (a crash, not an
        # error): empty records, and implausibly large ones, take the careful path.
        & (decoded > 0)
        & (decoded <= _BATCH_MAX_RECORD)
    )
    # Simple chunk: compression byte, varint size of the sizes buffer, the sizes buffer
    # (skipped: one record's size is the decoded size), then the values. The preamble
    # must lie before the first cut.
    kind = heads[:, _CHUNK_HEADER]
    sizes_len = heads[:, _CHUNK_HEADER + 1].astype(np.int64)
    if raw:
        # Uncompressed: the sizes buffer (one varint: the record's size), then the record
        # to the chunk's end.
        value, length = _varints(heads[:, _CHUNK_HEADER + 2 : _CHUNK_HEADER + 6])
        payload = start + 2 + sizes_len
        ok &= (
            (kind == _NONE)
            & (sizes_len >= 1)
            & (length == sizes_len)
            & (value == decoded)
            & (data_size - 2 - sizes_len == decoded)
            & (payload <= boundary)
        )
        return ok, payload, end, decoded, cut
    # zstd: the values' varint size, then the frame; both must lie in ``heads``.
    room = _HEADS - _CHUNK_HEADER - 2 - 4
    at = _CHUNK_HEADER + 2 + np.minimum(sizes_len, room)
    value, length = _varints(np.take_along_axis(heads, at[:, None] + _FOUR, axis=1))
    q = start + 2 + sizes_len
    payload = q + length
    ok &= (
        (kind == _ZSTD)
        & (sizes_len <= room)
        & (length > 0)
        & (value == decoded)
        & (data_size > payload - start)
        & (payload <= boundary)
    )
    return ok, payload, end, decoded, cut


def _decompress_into(into: Any, payload: Any, size: int) -> memoryview:
    """``into(payload, buffer)`` (cramjam's ``decompress_into``) with a buffer of exactly
    ``size`` bytes, which it must fill.

    The buffer is left uninitialised (a ``bytearray`` would be zeroed): a stream that
    claims far more than it holds then costs only the pages it really writes, not its
    claim. Nothing unwritten is ever returned: a stream that falls short is an error.
    """
    buf = np.empty(size, np.uint8)
    got = into(payload, buf)
    if got != size:
        raise _ChunkDecodeError(f"decompressed {got} bytes, the chunk declares {size}")
    return memoryview(buf)


def _declaring(frames: Iterable[Any], sizes: list[int]) -> Iterator[Any]:
    """``frames``, each checked to declare its size in ``sizes`` as it is reached (a
    ValueError otherwise), for frames made one at a time (see :func:`_frames`)."""
    for frame, size in zip(frames, sizes):
        if zstandard.frame_content_size(frame) not in (size, -1):
            raise ValueError("a zstd frame declares another size than its chunk")
        yield frame


def _varints(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(value, length)`` of the varint at the start of each row of ``b`` (uint8, 4
    columns); length 0 where it runs past 4 bytes.

    Example:
        >>> _varints(np.array([[5, 0, 0, 0], [0x80 | 44, 2, 0, 0], [255, 255, 255, 255]], np.uint8))
        (array([  5, 300,   0]), array([1, 2, 0]))
    """
    b = b.astype(np.int64)
    more = b >= 0x80
    length = np.where(more.all(axis=1), 0, np.argmin(more, axis=1) + 1)
    used = length[:, None] > _FOUR
    value = (((b & 0x7F) << (7 * _FOUR)) * used).sum(axis=1)
    return value, length


def _frames(
    view: memoryview, starts: np.ndarray, ends: np.ndarray, cuts: np.ndarray
) -> Iterable[Any]:
    """``view[starts[k]:ends[k]]`` for every k, less the block headers inside where
    ``cuts[k]`` is not 0 (those joined into bytes). When the joined frames would hold
    more than :data:`_JOIN_AT_ONCE` bytes, they are joined one at a time as the result
    is iterated, so that each can be freed before the next is made (a batch of 100 KiB
    records joined at once costs a page fault per 4 KiB of fresh memory).

    Example:
        >>> v = memoryview(bytes(range(256)) * 257)
        >>> a, b = _frames(v, np.array([0, 65530]), np.array([3, 65570]), np.array([0, 1]))
        >>> bytes(a), len(b), b[5:7]   # 6 bytes, a 24-byte block header, 10 bytes
        (b'\\x00\\x01\\x02', 16, b'\\xff\\x18')
    """
    out = list(map(view.__getitem__, map(slice, starts.tolist(), ends.tolist())))
    at = np.flatnonzero(cuts)
    if len(at) == 0:
        return out
    if int((ends[at] - starts[at]).sum()) <= _JOIN_AT_ONCE:
        for k in at.tolist():
            out[k] = _strip_block_headers(out[k], int(starts[k]))
        return out
    cut = cuts.astype(bool).tolist()
    return (_strip_block_headers(x, a) if c else x for x, a, c in zip(out, starts.tolist(), cut))
