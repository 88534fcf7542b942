"""The index of an ArrayRecord file: its postscript and footer, parsed into numpy arrays.

The postscript is in the last 64 KiB (file sizes are multiples of 64 KiB): a simple
uncompressed chunk holding 3 identical copies of (footer offset, magic). The footer
chunk uses the file's own compression; record 0 is the footer metadata (writer options
are in it), then one (chunk offset, decoded size, record count) entry per chunk.
:func:`parse_footer` turns them into a :class:`_Footer`: per chunk its offset, end and
decoded size, and the prefix sums of its record counts, all checked against each other
and against the file before any is used.

Example:
    >>> _parse_proto(bytes([0x08, 0x96, 0x01, 0x12, 0x02]) + b"hi")
    {1: 150, 2: b'hi'}
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from torchgrain.formats.arrayrecord.riegeli import (
    _BLOCK,
    _CHUNK_HEADER,
    _CHUNK_SIMPLE,
    _CHUNK_TRANSPOSED,
    ChunkDecoder,
    _ChunkDecodeError,
    _varint,
)

__all__ = ["parse_entries", "parse_footer"]

_MAGIC = 0x71930E704FDAE05E
_ENTRY_TAGS = np.array([8, 16, 24], np.uint8)  # fields 1-3 of ArrayRecordFooter, varint


def _fast_views(f: _Footer) -> tuple[memoryview, memoryview, memoryview, memoryview]:
    """memoryviews over an index's arrays: indexing one gives a Python int several times
    faster than indexing the numpy array (the hot path reads 4 per chunk)."""
    return (
        memoryview(f.chunk_offsets),
        memoryview(f.chunk_ends),
        memoryview(f.decoded_sizes),
        memoryview(f.record_offsets),
    )


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


def parse_footer(
    dec: ChunkDecoder,
    tail: memoryview,
    tail_start: int,
    size: int,
    fetch: Callable[[list[tuple[int, int]]], list[memoryview]],
) -> _Footer:
    """The index of a file of ``size`` bytes, from its postscript and footer.

    ``tail`` holds the file's bytes from ``tail_start`` to its end (at least the last
    64 KiB: the postscript block); ``fetch(ranges)`` reads byte ranges of the file, for a
    footer that begins before ``tail``. Chunks are decoded by ``dec`` (the file's reader),
    under its ``max_chunk_bytes``: a postscript that places the footer, or a footer that
    places a chunk, further away than a chunk within that ceiling takes is refused.

    Raises:
        CorruptDataError: not an ArrayRecord file, or a corrupt postscript or footer
            (named by ``dec``).
    """
    post_pos = size - _BLOCK
    try:
        ctype, n, decoded, data = dec._chunk_payload(tail[post_pos - tail_start :], post_pos)
        if ctype != _CHUNK_SIMPLE or n < 1:
            raise _ChunkDecodeError("the last 64 KiB block holds no postscript chunk")
        values, bounds = dec._decode_simple(data, n, decoded)
        first = values[: bounds[1]] if bounds is not None else values
        post = _parse_proto(first)
    except (_ChunkDecodeError, ValueError, struct.error) as e:
        raise dec._corrupt(
            f"not an ArrayRecord file or truncated (bad postscript at offset {post_pos}: {e})"
        ) from None
    if post.get(2) != _MAGIC or not isinstance(post.get(1), int):
        raise dec._corrupt(
            "not an ArrayRecord file: the postscript lacks the ArrayRecord magic number"
        )
    footer_offset = post[1]
    if not _CHUNK_HEADER <= footer_offset < post_pos:
        raise dec._corrupt(f"postscript points to footer offset {footer_offset} outside the file")
    # Between the footer's start and the postscript: the footer chunk and padding.
    # A postscript pointing further back would make a remote open fetch the file's
    # data as its footer.
    if post_pos - footer_offset > dec._max_span():
        raise dec._corrupt(
            f"postscript points to a footer at offset {footer_offset}, "
            f"{post_pos - footer_offset} bytes before it: more than a footer within "
            f"max_chunk_bytes={dec._max_chunk} takes (a larger max_chunk_bytes reads "
            "it, if the file is trusted)"
        )

    if footer_offset >= tail_start:
        fbuf = tail[footer_offset - tail_start : post_pos - tail_start]
    else:
        fbuf = fetch([(footer_offset, post_pos)])[0]
    try:
        ctype, n, decoded, data = dec._chunk_payload(fbuf, footer_offset)
        if ctype == _CHUNK_TRANSPOSED:
            raise _ChunkDecodeError("the footer chunk is transposed")
        if ctype != _CHUNK_SIMPLE or n < 1:
            raise _ChunkDecodeError(f"footer chunk has type {ctype:#x} and {n} records")
        values, bounds = dec._decode_simple(data, n, decoded)
        if bounds is None:
            bounds = np.array([0, len(values)], np.int64)
        bounds = np.asarray(bounds, np.int64)
        meta_msg = _parse_proto(memoryview(values)[: int(bounds[1])])
        meta_raw = meta_msg.get(1)
        if not isinstance(meta_raw, bytes):
            raise _ChunkDecodeError("footer metadata lacks array_record_metadata")
        meta = _parse_proto(meta_raw)
    except (_ChunkDecodeError, ValueError, struct.error) as e:
        raise dec._corrupt(f"bad footer at offset {footer_offset}: {e}") from None
    if meta.get(1) != 1:
        raise dec._corrupt(f"unsupported ArrayRecord version {meta.get(1)!r}")
    num_chunks = int(meta.get(2, 0))
    num_records = int(meta.get(3, 0))
    writer_options = meta.get(4, b"")
    writer_options = (
        writer_options.decode("utf-8", "replace") if isinstance(writer_options, bytes) else ""
    )
    if num_chunks != n - 1:
        raise dec._corrupt(
            f"footer metadata says {num_chunks} chunks, the footer holds {n - 1} entries"
        )
    offsets, dsizes, counts = parse_entries(dec, values, bounds)
    if num_chunks:
        if float(counts.sum(dtype=np.float64)) >= 2.0**62:  # int64 sums would wrap
            raise dec._corrupt("footer entries hold more than 2**62 records")
        if int(counts.sum()) != num_records:
            raise dec._corrupt(
                f"footer entries hold {int(counts.sum())} records, metadata says {num_records}"
            )
        if (
            offsets[0] < _CHUNK_HEADER
            or (num_chunks > 1 and bool(np.any(np.diff(offsets) <= 0)))
            or offsets[-1] >= footer_offset
        ):
            raise dec._corrupt("footer chunk offsets are not increasing within the file")
    elif num_records:
        raise dec._corrupt(f"footer has no chunks but metadata says {num_records} records")
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
        if int(spans[c]) > dec._max_span():
            raise dec._corrupt(
                f"it spans {int(spans[c])} bytes to the next chunk's offset, more than a "
                f"chunk within max_chunk_bytes={dec._max_chunk} takes (a larger "
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
    raw: np.ndarray, rec_starts: np.ndarray, n: int
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


def parse_entries(
    dec: ChunkDecoder, values: Any, bounds: np.ndarray, vectorised: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Footer entries 1..n as (chunk_offset, decoded_size, num_records) int64 arrays."""
    n = len(bounds) - 2
    if vectorised:
        body_start = int(bounds[1])
        raw = np.frombuffer(values, np.uint8)[body_start : int(bounds[-1])]
        fields = _entries_fast(raw, bounds[1:-1] - body_start, n)
        if fields is not None:
            return fields
    # Any protobuf layout (fields in another order, missing or repeated): per entry.
    out = np.zeros((n, 3), np.int64)
    mv = memoryview(values)
    for i in range(n):
        try:
            msg = _parse_proto(mv[int(bounds[i + 1]) : int(bounds[i + 2])])
        except ValueError as e:
            raise dec._corrupt(f"footer entry {i}: {e}") from None
        for j in range(3):
            x = msg.get(j + 1, 0)
            if not isinstance(x, int) or x >= 1 << 62:
                raise dec._corrupt(f"footer entry {i}: bad field {j + 1}: {x!r}")
            out[i, j] = x
    return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy()
