"""Riegeli framing of ArrayRecord files: blocks, chunk headers, and decoding chunks.

The lowest layer of the ArrayRecord reader: bytes of a file in, a chunk's values out,
with every declared size checked and every allocation under a ceiling
(``max_chunk_bytes``). What the footer says of each chunk, and which chunk holds a
record, is :mod:`.footer`'s and :mod:`.file`'s business.

Layout reminders (Riegeli/records):

* The file is cut into 64 KiB blocks; each block starts with a 24-byte block header
  that interrupts whatever chunk runs across it, even inside a chunk header.
* A chunk is a 40-byte header (hash, data size, data hash, type + record count,
  decoded size), ``data_size`` bytes of data, then padding.
* A simple chunk's data is: compression type byte, varint length of the compressed
  record-size buffer, that buffer, then the compressed values. Each compressed
  buffer starts with a varint of its decompressed size (not when uncompressed).

Example:
    >>> phys_end(100, 40), phys_end(BLOCK - 8, 40)  # the second meets a block header
    (140, 65592)
    >>> len(strip_block_headers(memoryview(bytes(BLOCK * 2))[BLOCK - 6 : BLOCK + 24], BLOCK - 6))
    6
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import cramjam
import numpy as np
import zstandard

from torchgrain.errors import CorruptDataError
from torchgrain.formats._highwayhash import riegeli_hash
from torchgrain.formats._proto import decode_varints
from torchgrain.io import process

if TYPE_CHECKING:
    from torchgrain.formats.arrayrecord.footer import Footer

__all__ = [
    "BLOCK",
    "BLOCK_HEADER",
    "BLOCK_HEADER_STRUCT",
    "BROTLI",
    "CHUNK_HEADER",
    "CHUNK_HEADER_STRUCT",
    "CHUNK_SIMPLE",
    "CHUNK_TRANSPOSED",
    "COMPRESSIONS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "SNAPPY",
    "UNCOMPRESSED",
    "USABLE",
    "ZSTD",
    "ChunkDecodeError",
    "ChunkDecoder",
    "TransposedChunkError",
    "phys_end",
    "read_varint",
    "strip_block_headers",
]

#: The most bytes one compressed chunk may decompress to, unless a reader is given another
#: ``max_chunk_bytes``. array_record's writer bounds a chunk by its record count
#: (``group_size``), not by bytes; with ``group_size:1`` (what TFDS, Grain and torchgrain
#: write) a chunk is one record, and 1 GiB is beyond the records these hold in practice.
DEFAULT_MAX_CHUNK_BYTES = 1 << 30

# The Riegeli layout the reader's modules share (see the module docstring).
BLOCK = 1 << 16  #: bytes per block
BLOCK_HEADER = 24  #: bytes of the header at the start of every block
USABLE = BLOCK - BLOCK_HEADER  #: bytes of chunks per block
CHUNK_HEADER = 40  #: bytes of a chunk header

CHUNK_SIMPLE = 0x72  #: chunk type 'r': records with their sizes
CHUNK_TRANSPOSED = 0x74  #: chunk type 't' (writer option ``transpose``, not supported)

# Compression types: the first byte of a simple chunk's data.
UNCOMPRESSED = 0
BROTLI = 0x62  # 'b'
ZSTD = 0x7A  # 'z'
SNAPPY = 0x73  # 's'
COMPRESSIONS = {UNCOMPRESSED: "none", BROTLI: "brotli", ZSTD: "zstd", SNAPPY: "snappy"}
#: header_hash, data_size, data_hash, type | num_records << 8, decoded_data_size
CHUNK_HEADER_STRUCT = struct.Struct("<5Q")
BLOCK_HEADER_STRUCT = struct.Struct("<3Q")  #: header_hash, previous_chunk, next_chunk
# What a compressed stream of n bytes can hold at most, so that a size it declares can be
# refused before anything is allocated: zstd's densest block is 4 bytes (an RLE block) per
# 128 KiB of output; snappy's is a 3-byte copy of 64 bytes. Brotli has no useful bound.
_ZSTD_MAX_RATIO = 1 << 15
_SNAPPY_MAX_RATIO = 22


class TransposedChunkError(CorruptDataError, NotImplementedError):
    """The file holds transposed chunks (writer option ``transpose``), which are not supported."""


class ChunkDecodeError(ValueError):
    """Bytes of a chunk failed a check: the reader re-raises it as a
    :class:`~torchgrain.CorruptDataError` naming the file and chunk
    (:meth:`ChunkDecoder._corrupt`)."""


_SHARED = threading.local()  # per thread: the decompression context readers share


def phys_end(pos: int, size: int) -> int:
    """Physical end of ``size`` logical bytes starting at physical ``pos``.

    Adds 24 bytes for every block header met on the way (a header at ``pos`` itself
    counts when ``size > 0``); this is Riegeli's ``AddWithOverhead``. Works on numpy
    arrays elementwise.

    Example:
        >>> phys_end(100, 40), phys_end(BLOCK - 8, 40)  # the second meets a block header
        (140, 65592)
    """
    # (``& (BLOCK - 1)``: ``% BLOCK`` for a power of two, cheaper on arrays)
    return pos + size + (size + (pos + USABLE - 1 & BLOCK - 1)) // USABLE * BLOCK_HEADER


def strip_block_headers(buf: memoryview, pos: int) -> memoryview | bytes:
    """Logical bytes of the physical bytes ``buf`` that start at file position ``pos``.

    Zero-copy when ``buf`` crosses no block boundary (the common case).

    Example:
        >>> buf = memoryview(bytes(BLOCK * 2))[BLOCK - 6 : BLOCK + 24]
        >>> len(strip_block_headers(buf, BLOCK - 6))  # 6 bytes, then a block header
        6
    """
    end = pos + len(buf)
    boundary = -(-pos // BLOCK) * BLOCK  # first block start >= pos
    if boundary >= end:
        return buf
    pieces = []
    cur = pos
    while boundary < end:
        pieces.append(buf[cur - pos : boundary - pos])
        cur = min(boundary + BLOCK_HEADER, end)
        boundary += BLOCK
    pieces.append(buf[cur - pos :])
    return b"".join(pieces)


def read_varint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """Decode one varint64 from ``buf[pos:end]``; returns (value, next position).

    Example:
        >>> read_varint(b"\\x00\\xac\\x02", 1, 3)
        (300, 3)
    """
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ChunkDecodeError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


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
        raise ChunkDecodeError(f"decompressed {got} bytes, the chunk declares {size}")
    return memoryview(buf)


def _declaring(frames: Iterable[Any], sizes: list[int]) -> Iterator[Any]:
    """``frames``, each checked to declare its size in ``sizes`` as it is reached (a
    ValueError otherwise), for frames made one at a time (see :func:`.batch._frames`)."""
    for frame, size in zip(frames, sizes):
        if zstandard.frame_content_size(frame) not in (size, -1):
            raise ValueError("a zstd frame declares another size than its chunk")
        yield frame


class ChunkDecoder:
    """Decodes the chunks of one ArrayRecord file, checking every size they declare.

    The state it needs is set by the reader it serves (:class:`~.file.ArrayRecordFile`,
    which is one): ``_url`` (the file's name in errors), ``_verify`` (check Riegeli's
    HighwayHash of headers and data), ``_max_chunk`` (the ceiling on what one chunk may
    decompress to), ``_footer`` (the file's index, for :meth:`_decode_chunk`), and,
    per process, ``_token`` and ``_tls`` (this thread's zstd context), which
    :meth:`_reset_handles` makes anew after a fork.

    Every check fails with :class:`ChunkDecodeError`, which the reader re-raises as a
    :class:`~torchgrain.CorruptDataError` naming the file, chunk and record
    (:meth:`_corrupt`).
    """

    _url: str
    _verify: bool
    _max_chunk: int
    _footer: Footer | None
    _token: tuple[int, int]
    _tls: threading.local

    def _reset_handles(self) -> None:
        self._token = process.token()
        self._tls = threading.local()

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

    def _zstd(self) -> zstandard.ZstdDecompressor:
        # One decompression context per thread (they are not thread-safe) and per
        # process (``_reset_handles`` replaces the thread-local store after fork),
        # shared by every reader of the thread: a context holds tens of KiB, and a
        # process may read thousands of files.
        if self._token != process.token():
            self._reset_handles()
        d = getattr(self._tls, "zstd", None)
        if d is None:
            # This thread's context (a new one after a fork).
            if getattr(_SHARED, "token", None) != self._token:
                _SHARED.zstd, _SHARED.token = zstandard.ZstdDecompressor(), self._token
            d = self._tls.zstd = _SHARED.zstd
        return d

    def _chunk_payload(self, buf: memoryview, pos: int) -> tuple[int, int, int, Any]:
        """Parse the chunk that starts at physical ``pos``; ``buf`` holds the bytes
        [pos, bound) that it may occupy. Returns (chunk_type, num_records,
        decoded_data_size, data) with block headers removed from ``data``."""
        if pos % BLOCK and pos % BLOCK < BLOCK_HEADER:
            raise ChunkDecodeError(f"chunk offset {pos} lies inside a block header")
        bound = pos + len(buf)
        hdr_end = phys_end(pos, CHUNK_HEADER)
        if hdr_end > bound:
            raise ChunkDecodeError(
                f"chunk header at offset {pos} runs past the chunk's end ({bound}): truncated"
            )
        # (a view of the buffer, unless a block header interrupts the chunk header)
        header = strip_block_headers(buf[: hdr_end - pos], pos)
        header_hash, data_size, data_hash, type_num, decoded = CHUNK_HEADER_STRUCT.unpack(header)
        if self._verify and riegeli_hash(header[8:]) != header_hash:
            raise ChunkDecodeError(f"chunk header at offset {pos} fails its checksum")
        # Bound data_size by the bytes that exist before touching them.
        if data_size > bound - hdr_end:
            raise ChunkDecodeError(
                f"chunk at offset {pos} claims {data_size} data bytes but at most "
                f"{bound - hdr_end} follow it (corrupt or truncated)"
            )
        data_end = phys_end(hdr_end, data_size)
        if data_end > bound:
            raise ChunkDecodeError(
                f"chunk at offset {pos} with {data_size} data bytes runs past its end ({bound})"
            )
        data = strip_block_headers(buf[hdr_end - pos : data_end - pos], hdr_end)
        if self._verify:
            self._verify_block_headers(buf, pos, data_end)
            if riegeli_hash(data) != data_hash:
                raise ChunkDecodeError(f"chunk data at offset {pos} fails its checksum")
        return type_num & 0xFF, type_num >> 8, decoded, data

    @staticmethod
    def _verify_block_headers(buf: memoryview, pos: int, end: int) -> None:
        """Check the hash and back-pointer of every block header inside [pos, end)."""
        b = -(-pos // BLOCK) * BLOCK
        while b < end:
            header = buf[b - pos : b - pos + BLOCK_HEADER]
            stored, previous_chunk, _ = BLOCK_HEADER_STRUCT.unpack(header)
            if riegeli_hash(header[8:]) != stored:
                raise ChunkDecodeError(f"block header at offset {b} fails its checksum")
            if previous_chunk != b - pos:
                raise ChunkDecodeError(
                    f"block header at offset {b} says its chunk starts at "
                    f"{b - previous_chunk}, not {pos}"
                )
            b += BLOCK

    def _declared(self, ctype: int, comp: Any, limit: int, exact: bool) -> tuple[int, Any]:
        """The size a compressed buffer declares (checked against ``limit``,
        ``max_chunk_bytes`` and, for zstd, its frame header and what a stream of this
        length can hold) and its compressed payload: nothing is allocated before this."""
        if not comp:
            raise ChunkDecodeError("compressed buffer is empty")
        size, p = read_varint(comp, 0, len(comp))
        if size > limit or (exact and size != limit):
            raise ChunkDecodeError(
                f"compressed buffer declares {size} decompressed bytes, expected "
                f"{'' if exact else 'at most '}{limit}"
            )
        if size > self._max_chunk:
            raise ChunkDecodeError(self._over_ceiling(size))
        payload = comp[p:]
        if ctype == ZSTD:
            try:
                declared = zstandard.frame_content_size(payload)
            except zstandard.ZstdError as e:
                raise ChunkDecodeError(f"zstd decompression failed: {e}") from None
            if declared >= 0 and declared != size:
                raise ChunkDecodeError(f"zstd frame declares {declared} bytes, chunk says {size}")
            if size > len(payload) * _ZSTD_MAX_RATIO:
                raise ChunkDecodeError(
                    f"a zstd stream of {len(payload)} bytes cannot hold the {size} it declares"
                )
        return size, payload

    def _decompress(self, ctype: int, comp: Any, limit: int, exact: bool) -> Any:
        """Decompress one Riegeli buffer; its size must equal (or not exceed) ``limit``.

        Nothing is allocated from a declared size before it is checked against ``limit``,
        ``max_chunk_bytes`` and what a stream of this length can hold, and the output
        buffer is exactly the declared size: a stream that holds less or more is an error.
        """
        if ctype == UNCOMPRESSED:
            n = len(comp)
            if n > limit or (exact and n != limit):
                raise ChunkDecodeError(f"uncompressed buffer has {n} bytes, expected {limit}")
            return comp
        size, payload = self._declared(ctype, comp, limit, exact)
        try:
            if ctype == ZSTD:
                out = self._zstd().decompress(payload, max_output_size=size)
            elif ctype == SNAPPY:
                declared = cramjam.snappy.decompress_raw_len(payload)
                if declared != size:
                    raise ChunkDecodeError(
                        f"snappy stream declares {declared} bytes, chunk says {size}"
                    )
                if size > len(payload) * _SNAPPY_MAX_RATIO:
                    raise ChunkDecodeError(
                        f"a snappy stream of {len(payload)} bytes cannot hold the {size} it declares"
                    )
                out = _decompress_into(cramjam.snappy.decompress_raw_into, payload, size)
            elif ctype == BROTLI:
                # Into a buffer of exactly the declared size: a stream that holds more
                # fails as soon as it fills it, one that holds less leaves a count short.
                out = _decompress_into(cramjam.brotli.decompress_into, payload, size)
            else:
                raise ChunkDecodeError(f"unknown compression type {ctype:#x}")
        except (ChunkDecodeError, MemoryError):
            raise
        except Exception as e:
            raise ChunkDecodeError(
                f"{COMPRESSIONS.get(ctype, hex(ctype))} decompression failed: {e}"
            ) from e
        if len(out) != size:
            raise ChunkDecodeError(f"decompressed {len(out)} bytes, expected {size}")
        return out

    def _max_span(self) -> int:
        """The most bytes a chunk of this file (the footer's too) may span: its header,
        data that decodes to at most ``max_chunk_bytes`` (and takes about as much when
        uncompressed), block headers and padding to a block boundary, with room to spare."""
        return 2 * (self._max_chunk + BLOCK)

    def _over_ceiling(self, size: int) -> str:
        return (
            f"the chunk declares {size} decompressed bytes, more than max_chunk_bytes="
            f"{self._max_chunk} allows (a larger max_chunk_bytes reads it, if the file "
            "is trusted)"
        )

    def _fits(self, n: int, span: int) -> None:
        """Riegeli pads a chunk to at least as many bytes as it has records (a record's
        position is its chunk's offset plus its index): a chunk spanning ``span`` bytes
        that claims more lies, and decoding their sizes would cost ~44 bytes each."""
        if n > span:
            why = f"the chunk claims {n} records in {span} bytes"
            if n > self._max_chunk:  # their sizes alone, a byte each, are over it
                why += f", their sizes alone over max_chunk_bytes={self._max_chunk}"
            raise ChunkDecodeError(why)

    def _simple_head(self, data: Any, decoded: int) -> tuple[int, int, int]:
        """``(compression type, start, end)`` of a simple chunk's record-size buffer in
        its ``data``, checked before anything is decompressed."""
        n = len(data)
        if n < 2:
            raise ChunkDecodeError(f"simple chunk data has only {n} bytes")
        ctype = data[0]
        if ctype not in COMPRESSIONS:
            raise ChunkDecodeError(f"unknown compression type {ctype:#x}")
        if ctype != UNCOMPRESSED and decoded > self._max_chunk:
            raise ChunkDecodeError(self._over_ceiling(decoded))
        sizes_len, p = read_varint(data, 1, n)
        if sizes_len > n - p:
            raise ChunkDecodeError(
                f"record-size buffer claims {sizes_len} bytes, only {n - p} remain"
            )
        return ctype, p, p + sizes_len

    def _decode_simple(self, data: Any, num_records: int, decoded: int) -> tuple[Any, Any]:
        """Decode a simple chunk into (values buffer, record boundaries or None).

        Boundaries are None when the chunk holds one record (the whole buffer). With
        several records, the record sizes are decoded and checked against the decoded
        size before the values are decompressed.
        """
        ctype, p, vstart = self._simple_head(data, decoded)
        if num_records == 1 and ctype == ZSTD:
            # Hot path (group_size 1, zstd): any failed check falls through to the
            # general path, which reports it.
            out = self._zstd_single(data, 0, len(data), decoded)
            if out is not None:
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
                v, q = read_varint(sizes_raw, q, end)
                total += v
                bounds.append(total)
            if q != end:
                raise ChunkDecodeError("record-size buffer has trailing bytes")
        else:
            try:
                sizes, _ = decode_varints(np.frombuffer(sizes_raw, np.uint8))
            except ValueError as e:
                raise ChunkDecodeError(f"record-size buffer: {e}") from e
            if sizes.size != num_records:
                raise ChunkDecodeError(
                    f"record-size buffer holds {sizes.size} sizes, expected {num_records}"
                )
            if sizes.size and int(sizes.max()) > decoded:
                raise ChunkDecodeError("a record size exceeds the chunk's decoded size")
            bounds = np.zeros(num_records + 1, np.int64)
            np.cumsum(sizes.astype(np.int64), out=bounds[1:])
            total = int(bounds[-1])
        if total != decoded:
            raise ChunkDecodeError(f"record sizes add up to {total}, chunk decodes to {decoded}")
        return self._decompress(ctype, data[vstart:], decoded, exact=True), bounds

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
                size, q = read_varint(view, q - 2, end)
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

    def _local_chunk(self, c: int, view: Any, fast: tuple, base: int = 0) -> tuple[Any, Any]:
        """Decode local chunk ``c`` from ``view``, the file's bytes from offset ``base``
        on (the whole map, or the chunk alone); the common case (header and data inside
        one block, no checksum verification) is parsed in place with no copy and few
        checks."""
        offs, ends, _, recs = fast
        pos = offs[c]
        try:
            simple = self._simple_chunk(view, pos, c, fast, pos - base)
            if simple is None:  # anything unusual: the path that checks and reports all
                return self._decode_chunk(c, view[pos - base : ends[c] - base])
            start, size, nrec, decoded = simple
            end = start + size
            if nrec == 1 and size > 3 and view[start] == ZSTD:
                out = self._zstd_single(view, start, end, decoded)
                if out is not None:
                    return out, None
            return self._decode_simple(view[start:end], nrec, decoded)
        except ChunkDecodeError as e:
            raise self._corrupt(str(e), chunk=c, row=recs[c]) from None

    def _simple_chunk(
        self, buf: Any, pos: int, c: int, fast: tuple[Any, Any, Any, Any], at: int
    ) -> tuple[int, int, int, int] | None:
        """For chunk ``c`` (file offset ``pos``, its header at ``buf[at]``): ``(where its data starts in buf, its size, records, decoded size)`` in the
        common case (header and data inside one block, a simple chunk whose counts match
        the footer, no verification), which needs no further checks; else None."""
        _, ends, dsizes, recs = fast
        m = pos & 0xFFFF
        if (
            m < BLOCK_HEADER
            or m + CHUNK_HEADER > BLOCK
            or at + CHUNK_HEADER > len(buf)
            or self._verify
        ):
            return None
        _, data_size, _, type_num, decoded = CHUNK_HEADER_STRUCT.unpack_from(buf, at)
        start = pos + CHUNK_HEADER
        end = start + data_size
        nrec = type_num >> 8
        if (
            start & 0xFFFF
            and start >> 16 == (end - 1) >> 16
            and end <= ends[c]
            and type_num & 0xFF == CHUNK_SIMPLE
            and decoded == dsizes[c]
            and nrec == recs[c + 1] - recs[c]
            and nrec <= ends[c] - pos
        ):
            return at + CHUNK_HEADER, data_size, nrec, decoded
        return None

    def _decode_chunk(self, c: int, buf: memoryview) -> tuple[Any, Any]:
        f = self._footer
        assert f is not None
        pos = int(f.chunk_offsets[c])
        ctype, num_records, decoded, data = self._chunk_payload(buf, pos)
        expected_n = int(f.record_offsets[c + 1] - f.record_offsets[c])
        if ctype == CHUNK_TRANSPOSED:
            raise TransposedChunkError(
                f"{self._where(c)}: the chunk is transposed (written with the 'transpose' "
                "writer option), which this reader does not decode; rewrite the file "
                "without 'transpose' (e.g. torchgrain.write_array_record or "
                "ArrayRecordWriter(path, 'group_size:1'))"
            )
        if ctype != CHUNK_SIMPLE:
            raise ChunkDecodeError(f"chunk type {ctype:#x} at offset {pos} is not a record chunk")
        if num_records != expected_n:
            raise ChunkDecodeError(
                f"chunk header says {num_records} records, the footer says {expected_n}"
            )
        if decoded != int(f.decoded_sizes[c]):
            raise ChunkDecodeError(
                f"chunk header says {decoded} decoded bytes, the footer says {int(f.decoded_sizes[c])}"
            )
        self._fits(num_records, len(buf))
        return self._decode_simple(data, num_records, decoded)

    def _decompress_frames(self, frames: Iterable[Any], sizes: list[int]) -> list[bytes] | None:
        """zstd ``frames`` (see :func:`.batch._frames`) of ``sizes[k]`` bytes each, decompressed
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
