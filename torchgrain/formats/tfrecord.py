"""Read and write TFRecord files without TensorFlow.

A TFRecord file is a sequence of records, each framed as::

    uint64  length            (little endian)
    uint32  masked_crc32c(length bytes)
    byte    data[length]
    uint32  masked_crc32c(data)

The checksums are CRC-32C (Castagnoli), "masked" by a rotation and an added
constant so that a CRC stored inside checksummed data does not checksum to itself.
Whole files may be gzip- or zlib-compressed (TensorFlow's ``compression_type``).

Both checksums are verified by default; a mismatch, a truncated record, a length
that cannot fit in the file or one over ``max_record_bytes`` (default
:data:`DEFAULT_MAX_RECORD_BYTES`, 1 GiB) raises
:class:`~torchgrain.errors.CorruptDataError` naming the file and the byte offset of the
record. Memory is bounded by that ceiling even in a compressed stream, where no file
size bounds a length.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "data.tfrecord")
    >>> write_tfrecord([b"alpha", b"", b"gamma"], path)
    3
    >>> list(iter_tfrecord(path))
    [b'alpha', b'', b'gamma']
    >>> index_tfrecord(path).tolist()
    [0, 21, 37]
    >>> read_tfrecord_at(path, 37)
    b'gamma'
"""

from __future__ import annotations

import array
import contextlib
import gzip
import io
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import IO, Any

import fsspec
import numpy as np
from google_crc32c import value as crc32c_bytes  # C (SSE4.2 / ARMv8 CRC): ~10 GB/s

from torchgrain.errors import CorruptDataError, RemoteIOError, TorchgrainError
from torchgrain.io import remote
from torchgrain.io.atomic import publish, temp_name
from torchgrain.io.fs import PathLike, get_filesystem, is_local
from torchgrain.io.responses import RangeAnswerError

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "crc32c",
    "index_tfrecord",
    "iter_tfrecord",
    "iter_tfrecord_offsets",
    "masked_crc32c",
    "parse_frame",
    "read_tfrecord_at",
    "resolve_compression",
    "write_tfrecord",
]

_HEADER = struct.Struct("<QI")  # length, masked crc of the length
_FOOTER = struct.Struct("<I")  # masked crc of the data
_LEN = struct.Struct("<Q")
_HEADER_SIZE = 12
_FRAME_OVERHEAD = 16
_MASK_DELTA = 0xA282EAD8
_READ_SIZE = 4 << 20  # read 4 MiB at a time: few syscalls, bounded memory

#: The longest record a reader accepts unless told otherwise (``max_record_bytes``).
#: TFRecord files mostly hold ``tf.train.Example`` protos, which protobuf caps at 2 GiB;
#: real ones (images, audio, token sequences) are kilobytes to megabytes.
DEFAULT_MAX_RECORD_BYTES = 1 << 30


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data`` (:data:`crc32c_bytes` takes ``bytes`` only,
    without the conversion: a hot path's callers pass bytes already).

    Example:
        >>> hex(crc32c(b"123456789"))
        '0xe3069283'
    """
    if type(data) is not bytes:
        data = bytes(data)  # the C extension only takes read-only bytes
    return crc32c_bytes(data)


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    """The masked CRC-32C that TFRecord stores: rotate right by 15, add a constant.

    Example:
        >>> masked_crc32c(b"")
        2726488792
    """
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def resolve_compression(path: PathLike, compression: str | None) -> str:
    """Normalise a compression option to ``""``, ``"gzip"`` or ``"zlib"``.

    ``None`` picks by file name: ``.gz``/``.gzip`` is gzip, ``.zlib``/``.zz`` is zlib,
    anything else is uncompressed. TensorFlow's spellings (``"GZIP"``, ``"ZLIB"``,
    ``""``) are accepted.

    Example:
        >>> resolve_compression("a.tfrecord.gz", None), resolve_compression("a", "ZLIB")
        ('gzip', 'zlib')
    """
    if compression is None:
        name = os.fspath(path).lower()
        return next((c for c, ends in _SUFFIXES.items() if name.endswith(ends)), "")
    c = _COMPRESSIONS.get(compression.lower())
    if c is None:
        raise ValueError(
            f"unknown TFRecord compression {compression!r}; use None, '', 'gzip' or 'zlib'"
        )
    return c


_SUFFIXES = {"gzip": (".gz", ".gzip"), "zlib": (".zlib", ".zz")}
_COMPRESSIONS = {"": "", "none": "", "gzip": "gzip", "zlib": "zlib"}


class _Stream(io.RawIOBase):
    def readable(self) -> bool:
        return True


class _ZlibStream(_Stream):
    """Decompressed view of one or more concatenated zlib streams, read in bounded steps."""

    def __init__(self, raw: IO[bytes], name: str) -> None:
        self._raw = raw
        self._name = name
        self._d = zlib.decompressobj()
        self._in = b""  # compressed bytes not yet given to the decompressor
        self._fresh = True  # current decompressor has consumed nothing yet
        self._out = b""

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = 1 << 62
        parts: list[bytes] = []
        want = size
        while want > 0:
            if self._out:
                parts.append(self._out[:want])
                self._out = self._out[want:]
                want -= len(parts[-1])
                continue
            if not self._in:
                self._in = self._raw.read(1 << 16)
                if not self._in:
                    if self._fresh:
                        break  # clean end after the last complete stream
                    raise CorruptDataError(f"{self._name}: zlib stream is truncated")
            self._fresh = False
            try:
                # max_length bounds how much a tiny, highly compressible input expands
                # into memory in one step.
                self._out = self._d.decompress(self._in, min(want, 1 << 20))
            except zlib.error as e:
                raise CorruptDataError(f"{self._name}: bad zlib data ({e})") from e
            if self._d.eof:
                # What follows the stream is all in unused_data: unconsumed_tail may
                # still hold a stale copy of it (a call that began with a tail left by
                # max_length), which read it twice.
                self._in = self._d.unused_data
                self._d = zlib.decompressobj()
                self._fresh = True
            else:
                self._in = self._d.unconsumed_tail
        return b"".join(parts)


class _GzipStream(_Stream):
    """gzip decompression that reports bad or truncated data as CorruptDataError."""

    def __init__(self, raw: IO[bytes], name: str) -> None:
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self._name = name

    def read(self, size: int = -1) -> bytes:
        try:
            return self._gz.read(size)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise CorruptDataError(f"{self._name}: bad or truncated gzip data ({e})") from e

    def close(self) -> None:
        self._gz.close()
        super().close()


def _resolve(
    path: PathLike, filesystem: fsspec.AbstractFileSystem | None
) -> tuple[fsspec.AbstractFileSystem, str]:
    if filesystem is not None:
        return filesystem, filesystem._strip_protocol(os.fspath(path))
    return get_filesystem(path)


def _file_size(fs: fsspec.AbstractFileSystem, path: str) -> int | None:
    try:
        size = remote.call(fs, "size", path, what="size lookup")
    except TorchgrainError:  # the server failed for good (RemoteIOError): say so now
        raise
    except Exception:  # some filesystems cannot stat cheaply; fall back to EOF checks
        return None
    return int(size) if size is not None else None


def iter_tfrecord(
    path: PathLike,
    *,
    filesystem: fsspec.AbstractFileSystem | None = None,
    verify: bool = True,
    compression: str | None = None,
    offset: int = 0,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    seen: tuple | None = None,
) -> Iterator[bytes]:
    """Yield the records of one TFRecord file, in order.

    Args:
        path: local path or fsspec URL.
        filesystem: fsspec filesystem to read ``path`` with (default: from the URL).
        verify: check both CRCs of every record (CRC-32C runs at several GB/s with
            ``google-crc32c``, so this costs little).
        compression: ``None`` (by suffix), ``""``, ``"gzip"`` or ``"zlib"``.
        offset: start at the record whose header is at this byte offset (an offset from
            :func:`index_tfrecord`; uncompressed files only).
        max_record_bytes: the longest record accepted (default 1 GiB): a longer length
            field is an error before any of the record is read.
        seen: a remote file's ``(size, ETag, Last-Modified)`` as a source's opening read
            it (:func:`torchgrain.io.remote.open_input`): a version this process pinned
            since is refused, not read.

    Raises:
        CorruptDataError: checksum mismatch, truncated record, a length field larger
            than the rest of the file or than ``max_record_bytes``; the message names
            the file and byte offset (an offset in the decompressed stream for
            compressed files).
        RemoteIOError: ``seen`` is not the version of the file this process has pinned.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.tfrecord.gz")
        >>> _ = write_tfrecord([b"a", b"bc"], p)
        >>> list(iter_tfrecord(p))
        [b'a', b'bc']
    """
    fs, p = _resolve(path, filesystem)
    name = os.fspath(path)
    comp = resolve_compression(name, compression)
    # Only an uncompressed file's size bounds a record's length; a compressed stream is
    # read incrementally so a bogus length hits EOF without a huge allocation.
    size = _file_size(fs, p) if comp == "" else None
    if offset and comp != "":
        raise ValueError(f"{name}: cannot start a compressed TFRecord file at an offset")
    try:  # remote reads with deadlines and checked lengths
        raw = remote.open_input(fs, p, seen=seen)
    except RangeAnswerError as e:  # (another version pinned since: no retry reads this one)
        raise RemoteIOError(f"{name}: {e}") from e
    wrap = {"gzip": _GzipStream, "zlib": _ZlibStream}.get(comp)
    stream = wrap(raw, p) if wrap else raw
    try:
        if offset:
            stream.seek(offset)
        yield from _iter_stream(stream, name, size, verify, offset, max_record_bytes)
    finally:
        stream.close()
        raw.close()


def _iter_stream(
    stream: IO[bytes],
    name: str,
    size: int | None,
    verify: bool,
    base: int = 0,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[bytes]:
    buf = b""
    pos = 0  # position of the next record in buf
    # base: file offset of buf[0]
    while True:
        avail = len(buf) - pos
        if avail < _HEADER_SIZE:
            chunk = stream.read(_READ_SIZE)
            if chunk:
                buf = buf[pos:] + chunk
                base += pos
                pos = 0
                continue
            if avail == 0:
                return  # else a truncated header, which _length reports
        offset = base + pos
        head = buf[pos : pos + _HEADER_SIZE]
        length = _length(head, name, offset, size, verify, max_record_bytes)
        end = pos + _HEADER_SIZE + length + 4
        if end > len(buf):
            # The record runs past the buffer: read exactly what is missing, in bounded
            # steps so a lying length in a compressed stream cannot allocate it up front.
            parts = [buf[pos:]]
            have = len(buf) - pos
            need = _HEADER_SIZE + length + 4
            while have < need:
                chunk = stream.read(min(need - have, 64 << 20))
                if not chunk:
                    raise CorruptDataError(
                        f"{name}: truncated record at byte offset {offset}: needs "
                        f"{need} bytes, the file ends after {have}"
                    )
                parts.append(chunk)
                have += len(chunk)
            buf = b"".join(parts)
            base = offset
            pos = 0
            end = need
        data = _data(buf, pos + _HEADER_SIZE, length, name, offset, verify)
        pos = end
        yield data


def index_tfrecord(
    path: PathLike,
    *,
    filesystem: fsspec.AbstractFileSystem | None = None,
    verify: bool = True,
) -> np.ndarray:
    """Byte offsets of every record of an uncompressed TFRecord file.

    Walks the 12-byte record headers without decoding data (see
    :func:`iter_tfrecord_offsets`, which gives them a chunk at a time, in bounded
    memory). ``verify`` checks each length's CRC, which catches a corrupted length
    before it can send the walk astray; data CRCs are checked when a record is read
    (:func:`read_tfrecord_at`).

    Returns:
        int64 array: ``offsets[i]`` is where record ``i``'s header starts; its data
        is ``length = offsets[i + 1] - offsets[i] - 16`` bytes (use the file size for
        the last record).

    Raises:
        CorruptDataError: truncated file, bad length checksum, impossible length.
        ValueError: the file is compressed (compressed streams have no random access).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.tfrecord")
        >>> _ = write_tfrecord([b"abc", b"de"], p)
        >>> index_tfrecord(p).tolist()
        [0, 19]
    """
    parts = list(iter_tfrecord_offsets(path, filesystem=filesystem, verify=verify))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


#: Offsets per array :func:`iter_tfrecord_offsets` yields (512 KiB of int64).
OFFSETS_CHUNK = 1 << 16


def iter_tfrecord_offsets(
    path: PathLike,
    *,
    filesystem: fsspec.AbstractFileSystem | None = None,
    verify: bool = True,
    chunk: int = OFFSETS_CHUNK,
    size: int | None = None,
) -> Iterator[np.ndarray]:
    """The byte offsets of an uncompressed TFRecord file's records, in int64 arrays of
    about ``chunk`` offsets each, as its headers are walked: memory stays bounded
    whatever the number of records.

    The file is read in 4 MiB blocks (one ranged read each for a remote file), records
    larger than a block seeked over and the header after one read alone; a run of
    records of one length (fixed-size records) is checked with numpy for a whole block
    at once (each length field and its CRC), so tiny records cost no Python step each.
    Errors as :func:`index_tfrecord`'s.

    ``size``: the file's size as already recorded (default: its size now); the walk
    stops there, so a file appended to since is indexed as it was (a shorter file is
    a truncated one).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.tfrecord")
        >>> _ = write_tfrecord([b"ab"] * 5 + [b"c"], p)
        >>> [a.tolist() for a in iter_tfrecord_offsets(p, chunk=4)]
        [[0, 18, 36, 54], [72, 90]]
    """
    name = os.fspath(path)
    if resolve_compression(name, None) != "":
        raise ValueError(f"{name}: compressed TFRecord files cannot be indexed")
    chunk = max(1, int(chunk))
    if filesystem is None and "://" not in name and "::" not in name:
        # A local path: opened directly (a dataset of 10^4 small files is walked in
        # about half the time it takes through the filesystem layer).
        with open(name, "rb") as f:
            if size is None:
                size = os.fstat(f.fileno()).st_size
            yield from _walk_buffered(f, name, size, verify, chunk)
        return
    fs, p = _resolve(path, filesystem)
    if size is None:
        size = remote.file_size(fs, p, url=name)
    # An index of the file as it is now: a same-size re-upload is indexed, not refused.
    # Unbuffered: each read of the walk is one ranged request of just the bytes it asks.
    with remote.open_input(fs, p, url=name, fresh=True, buffered=False) as f:
        yield from _walk_buffered(f, name, size, verify, chunk)


def _length(
    head: bytes, name: str, off: int, size: int | None, verify: bool, limit: int | None = None
) -> int:
    """The length field of the record header ``head`` at byte ``off``, checked: its CRC
    (``verify``), that the record fits in a file of ``size`` bytes and in ``limit``."""
    if len(head) < _HEADER_SIZE:
        raise CorruptDataError(
            f"{name}: truncated record header at byte offset {off} "
            f"({len(head)} of {_HEADER_SIZE} bytes present)"
        )
    length, len_crc = _HEADER.unpack(head)
    if verify and masked_crc32c(head[:8]) != len_crc:  # a remote block is a bytearray
        raise CorruptDataError(
            f"{name}: length checksum mismatch in the record at byte offset {off}"
        )
    if size is not None and length > size - off - _FRAME_OVERHEAD:
        raise CorruptDataError(
            f"{name}: truncated record (or corrupt length) at byte offset {off}: the length "
            f"field says {length} data bytes, the file has room for "
            f"{max(size - off - _FRAME_OVERHEAD, 0)}"
        )
    if limit is not None and length > limit:
        raise CorruptDataError(
            f"{name}: the record at byte offset {off} is {length} bytes long, more than "
            f"max_record_bytes={limit} allows (a larger max_record_bytes reads it, if the "
            "file is trusted)"
        )
    return length


_RUN = 4  # records of one length in a row before the rest of the block is tried at once


def _walk_buffered(f: Any, name: str, size: int, verify: bool, chunk: int) -> Iterator[np.ndarray]:
    # Read the file in large blocks and walk the headers; records larger than a block
    # are skipped with a seek, and the header after one is read alone (the next record is
    # likely as large: a block there would be mostly skipped, on a remote file fetched
    # for nothing). After _RUN records of one length, the records of that
    # length that follow in the block are checked at once (their length fields and
    # CRCs gathered with numpy): the first that differs is walked one by one again.
    out = array.array("q")
    off = 0
    buf = b""
    base = 0
    prev, same, stride = -1, 0, 0
    while off < size:
        rel = off - base
        if rel < 0 or rel + _HEADER_SIZE > len(buf):
            f.seek(off)
            buf = f.read(_HEADER_SIZE if stride > _READ_SIZE else _READ_SIZE)
            base = off
            rel = 0
        length = _length(buf[rel : rel + _HEADER_SIZE], name, off, size, verify)
        stride = _FRAME_OVERHEAD + length
        same = same + 1 if length == prev else 0
        prev = length
        # Whole frames in the block and within the size walked (a file appended to
        # since its size was read has more in the block: not indexed).
        run = min((min(len(buf), size - base) - rel) // stride, chunk)
        if same >= _RUN and run > 1:
            # The headers in place (no copy): rows of length low, high, length CRC.
            heads = np.ndarray((run, 3), "<u4", buf, rel, (stride, 4))
            ok = (heads[:, 0] == length & 0xFFFFFFFF) & (heads[:, 1] == length >> 32)
            if verify:
                ok &= heads[:, 2] == masked_crc32c(_LEN.pack(length))
            n = int(np.argmin(ok)) if not ok.all() else run
            out.frombytes(np.arange(off, off + n * stride, stride, dtype=np.int64).tobytes())
            off += n * stride
            # (n >= 1: the first is the record checked above)
        else:
            out.append(off)
            off += stride
        if len(out) >= chunk:
            yield np.frombuffer(out, np.int64).copy()
            out = array.array("q")
    if out:
        yield np.frombuffer(out, np.int64).copy()


def read_tfrecord_at(
    source: PathLike | IO[bytes],
    offset: int,
    *,
    filesystem: fsspec.AbstractFileSystem | None = None,
    verify: bool = True,
    name: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> bytes:
    """Read the one record whose header starts at byte ``offset`` (see :func:`index_tfrecord`).

    ``source`` is a path/URL or an already open binary file (seekable), which lets a
    caller keep one handle per shard for random access. A record longer than
    ``max_record_bytes`` raises :class:`~torchgrain.errors.CorruptDataError`.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.tfrecord")
        >>> _ = write_tfrecord([b"abc", b"de"], p)
        >>> read_tfrecord_at(p, 19)
        b'de'
    """
    if isinstance(source, (str, os.PathLike)):
        fs, p = _resolve(source, filesystem)
        name = os.fspath(source)
        with remote.open_input(fs, p, url=name) as f:
            return read_tfrecord_at(
                f, offset, verify=verify, name=name, max_record_bytes=max_record_bytes
            )
    f = source
    label = name or str(getattr(f, "name", "<stream>"))
    # Bound the read by what the file can hold before trusting the length.
    try:
        end = f.seek(0, io.SEEK_END)
    except (OSError, ValueError):  # pragma: no cover - unseekable-to-end streams
        end = None
    f.seek(offset)
    length = _length(f.read(_HEADER_SIZE), label, offset, end, verify, max_record_bytes)
    body = f.read(length + 4)
    if len(body) < length + 4:
        raise CorruptDataError(f"{label}: truncated record at byte offset {offset}")
    return _data(body, 0, length, label, offset, verify)


def parse_frame(frame: bytes | memoryview, *, name: str, offset: int, verify: bool = True) -> bytes:
    """The data of one whole framed record (header, data, footer) that starts at ``offset``.

    For readers that know where records start (an index from :func:`index_tfrecord`)
    and read each frame as one byte range.

    Example:
        >>> parse_frame(_frame(b"abc"), name="x", offset=0)
        b'abc'
    """
    if len(frame) < _FRAME_OVERHEAD:
        raise CorruptDataError(f"{name}: truncated record at byte offset {offset}")
    length, len_crc = _HEADER.unpack_from(frame, 0)
    if length != len(frame) - _FRAME_OVERHEAD:
        raise CorruptDataError(
            f"{name}: the record at byte offset {offset} says it holds {length} bytes but its "
            f"frame holds {len(frame) - _FRAME_OVERHEAD} (was the file changed after it was "
            "indexed?)"
        )
    if verify and masked_crc32c(frame[:8]) != len_crc:
        raise CorruptDataError(
            f"{name}: length checksum mismatch in the record at byte offset {offset}"
        )
    return _data(frame, _HEADER_SIZE, length, name, offset, verify)


def _data(buf: Any, at: int, length: int, name: str, offset: int, verify: bool) -> bytes:
    """The ``length`` data bytes at ``buf[at:]`` of the record at byte ``offset``, the
    CRC after them checked (``verify``)."""
    data = bytes(buf[at : at + length])  # (a bytes slice: not copied again)
    if verify and masked_crc32c(data) != _FOOTER.unpack_from(buf, at + length)[0]:
        raise CorruptDataError(
            f"{name}: data checksum mismatch in the record at byte offset {offset}"
        )
    return data


def _frame(record: bytes) -> bytes:
    length = _LEN.pack(len(record))
    return b"".join(
        (length, _FOOTER.pack(masked_crc32c(length)), record, _FOOTER.pack(masked_crc32c(record)))
    )


def write_tfrecord(
    records: Iterable[bytes | bytearray | memoryview],
    path: PathLike,
    *,
    filesystem: fsspec.AbstractFileSystem | None = None,
    compression: str | None = None,
) -> int:
    """Write ``records`` to a TFRecord file; returns the number written.

    The file is written under a temporary name beside ``path`` and renamed when
    complete, so readers never see a half-written file. ``compression`` as in
    :func:`iter_tfrecord` (``None``: ``.gz`` suffix means gzip).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.tfrecord")
        >>> write_tfrecord((bytes([i]) * i for i in range(4)), p)
        4
    """
    fs, p = _resolve(path, filesystem)
    comp = resolve_compression(os.fspath(path), compression)
    tmp = temp_name(p)  # (a remote path's parent is cut at "/" as a local one's)
    count = 0
    try:
        with fs.open(tmp, "wb") as raw:
            out: Any = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if comp == "gzip" else raw
            z = zlib.compressobj() if comp == "zlib" else None
            pending = bytearray()
            for rec in records:
                pending += _frame(rec if type(rec) is bytes else bytes(rec))
                count += 1
                if len(pending) >= _READ_SIZE:
                    out.write(z.compress(pending) if z else pending)
                    pending = bytearray()  # (a new one: the written one may still be held)
            if pending:
                out.write(z.compress(pending) if z else pending)
            if z:
                raw.write(z.flush())
            if out is not raw:
                out.close()
        if is_local(fs):
            publish(tmp, p)
        else:
            fs.mv(tmp, p)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise
    return count
