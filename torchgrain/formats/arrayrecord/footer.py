"""The index of an ArrayRecord file: its postscript and footer, parsed into numpy arrays.

The postscript is in the last 64 KiB (file sizes are multiples of 64 KiB): a simple
uncompressed chunk holding 3 identical copies of (footer offset, magic). The footer
chunk uses the file's own compression; record 0 is the footer metadata (writer options
are in it), then one (chunk offset, decoded size, record count) entry per chunk.
:func:`parse_footer` turns them into a :class:`Footer`: per chunk its offset, end and
decoded size, and the prefix sums of its record counts, all checked against each other
and against the file before any is used.

Example:
    >>> parse_proto(bytes([0x08, 0x96, 0x01, 0x12, 0x02]) + b"hi")
    {1: 150, 2: b'hi'}
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import zstandard

from torchgrain.formats._proto import decode_varints
from torchgrain.formats.arrayrecord.riegeli import (
    BLOCK,
    CHUNK_HEADER,
    CHUNK_HEADER_STRUCT,
    CHUNK_SIMPLE,
    CHUNK_TRANSPOSED,
    ZSTD,
    ChunkDecodeError,
    ChunkDecoder,
    phys_end,
    read_varint,
    strip_block_headers,
)

__all__ = ["Footer", "FooterReader", "fast_views", "parse_entries", "parse_footer", "parse_proto"]

_MAGIC = 0x71930E704FDAE05E
_ENTRY_TAGS = np.array([8, 16, 24], np.uint8)  # fields 1-3 of ArrayRecordFooter, varint


def fast_views(f: Footer) -> tuple[memoryview, memoryview, memoryview, memoryview]:
    """memoryviews over an index's arrays (chunk offsets, chunk ends, decoded sizes,
    record offsets): indexing one gives a Python int several times faster than indexing
    the numpy array (the hot path reads 4 per chunk).

    Example:
        >>> f = Footer(chunk_offsets=np.array([0, 9]), chunk_ends=np.array([9, 20]),
        ...            decoded_sizes=np.array([3, 4]), record_offsets=np.array([0, 1, 2]))
        >>> fast_views(f)[1][1]
        20
    """
    arrays = (f.chunk_offsets, f.chunk_ends, f.decoded_sizes, f.record_offsets)
    return tuple(map(memoryview, arrays))  # type: ignore[return-value]


def parse_proto(buf: bytes | memoryview) -> dict[int, Any]:
    """Parse a flat protobuf message: field number -> last value (int or bytes).

    Only what the ArrayRecord footer and postscript use; fixed-width fields are kept
    as ints, groups are rejected.

    Example:
        >>> parse_proto(b"\\x08\\x96\\x01\\x12\\x02hi")
        {1: 150, 2: b'hi'}
    """
    out: dict[int, Any] = {}
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = read_varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            out[field], pos = read_varint(buf, pos, end)
        elif wire == 2:
            n, pos = read_varint(buf, pos, end)
            if n > end - pos:
                raise ValueError("length-delimited field runs past the message")
            out[field] = bytes(buf[pos : pos + n])
            pos += n
        elif wire in (1, 5):  # fixed64, fixed32
            width = 8 if wire == 1 else 4
            if end - pos < width:
                raise ValueError(f"truncated fixed{8 * width} field")
            out[field] = int.from_bytes(buf[pos : pos + width], "little")
            pos += width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


class Footer:
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


def parse_footer(
    dec: ChunkDecoder,
    tail: memoryview,
    tail_start: int,
    size: int,
    fetch: Callable[[list[tuple[int, int]]], list[memoryview]],
) -> Footer:
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
    return FooterReader(dec, tail, tail_start, size, fetch).footer()


class _Stream:
    """One buffer of a simple chunk (its record sizes or its values), read front to back
    a piece at a time: a zstd stream is decompressed as it is read (the whole buffer is
    never held), other compressions are decompressed whole first. The same checks as
    :meth:`ChunkDecoder._decompress`, before anything is allocated from a declared size;
    a stream that holds fewer or more bytes than it declares is an error."""

    def __init__(self, dec: ChunkDecoder, ctype: int, comp: Any, limit: int, exact: bool) -> None:
        self._reader: Any = None
        self._buf: Any = None
        self.pos = 0
        if ctype != ZSTD or not comp:
            self._buf = memoryview(dec._decompress(ctype, comp, limit, exact)).cast("B")
            self.size = len(self._buf)
            return
        size, payload = dec._declared(ctype, comp, limit, exact)
        # A context of its own: the record sizes and the values are read in turns.
        self._reader = zstandard.ZstdDecompressor().stream_reader(payload)
        self.size = size

    def read(self, k: int) -> Any:
        """The next ``k`` bytes (``k`` at most what is left)."""
        a = self.pos
        self.pos += k
        if self._reader is None:
            return self._buf[a : a + k]
        pieces = []
        try:
            while k:
                got = self._reader.read(k)
                if not got:
                    raise ChunkDecodeError(f"decompressed {a} bytes, expected {self.size}")
                pieces.append(got)
                a += len(got)
                k -= len(got)
        except zstandard.ZstdError as e:
            raise ChunkDecodeError(f"zstd decompression failed: {e}") from None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def finish(self) -> None:
        """Check that the stream holds nothing after the bytes read."""
        if self._reader is not None:
            try:
                more = self._reader.read(1)
            except zstandard.ZstdError as e:
                raise ChunkDecodeError(f"zstd decompression failed: {e}") from None
            if more:
                raise ChunkDecodeError(f"decompressed more than the {self.size} bytes expected")
            self._reader.close()


class FooterReader:
    """A file's postscript and footer chunk header, read and checked; the footer's
    entries read by :meth:`slices`, all at once or a slice of chunks at a time (a
    footer of any size in bounded memory, for :mod:`torchgrain.sources.node_index`).
    Arguments as :func:`parse_footer`'s; a footer chunk that begins before ``tail`` is
    fetched (:attr:`unfetched` bytes) when its entries are first read, its 40-byte
    header only until then.

    Example:
        >>> import os, tempfile
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> from torchgrain.formats.arrayrecord.file import ArrayRecordFile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.array_record")
        >>> w = ArrayRecordWriter(p, "group_size:1")
        >>> for i in range(5):
        ...     w.write(b"%d" % i)
        >>> w.close()
        >>> f = ArrayRecordFile(p)
        >>> view = f._local_view()
        >>> r = FooterReader(f, view, 0, len(view), f._fetch)
        >>> [ends.tolist() for _, _, ends in r.slices(step=2)], r.group_size
        ([[1, 2], [3, 4], [5]], 1)
    """

    def __init__(
        self,
        dec: ChunkDecoder,
        tail: memoryview,
        tail_start: int,
        size: int,
        fetch: Callable[[list[tuple[int, int]]], list[memoryview]],
    ) -> None:
        post_pos = size - BLOCK
        try:
            ctype, n, decoded, data = dec._chunk_payload(tail[post_pos - tail_start :], post_pos)
            if ctype != CHUNK_SIMPLE or n < 1:
                raise ChunkDecodeError("the last 64 KiB block holds no postscript chunk")
            dec._fits(n, size - post_pos)
            values, bounds = dec._decode_simple(data, n, decoded)
            first = values[: bounds[1]] if bounds is not None else values
            post = parse_proto(first)
        except (ChunkDecodeError, ValueError, struct.error) as e:
            raise dec._corrupt(
                f"not an ArrayRecord file or truncated (bad postscript at offset {post_pos}: {e})"
            ) from None
        if post.get(2) != _MAGIC or not isinstance(post.get(1), int):
            raise dec._corrupt(
                "not an ArrayRecord file: the postscript lacks the ArrayRecord magic number"
            )
        footer_offset = post[1]
        if not CHUNK_HEADER <= footer_offset < post_pos:
            raise dec._corrupt(
                f"postscript points to footer offset {footer_offset} outside the file"
            )
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
        self._dec, self._fetch, self._post_pos = dec, fetch, post_pos
        #: Where the footer chunk begins; the file's size.
        self.footer_offset, self.file_size = footer_offset, size
        #: Bytes of the footer chunk that reading its entries fetches first (0: in ``tail``).
        self.unfetched = 0
        if footer_offset >= tail_start:
            fbuf = tail[footer_offset - tail_start : post_pos - tail_start]
            self.head = bytes(fbuf[:CHUNK_HEADER])
            self._load(fbuf)
        else:
            # Its header only (its entry count: what reading them costs); the chunk is
            # fetched when they are read, by a caller that counts it in its budget.
            fbuf = fetch([(footer_offset, phys_end(footer_offset, CHUNK_HEADER))])[0]
            self.head = bytes(fbuf[:CHUNK_HEADER])
            try:
                header = strip_block_headers(fbuf, footer_offset)[:CHUNK_HEADER]
                n = CHUNK_HEADER_STRUCT.unpack(header)[3] >> 8
                dec._fits(n, post_pos - footer_offset)
            except (struct.error, ChunkDecodeError) as e:
                raise self._bad(e) from None
            self.unfetched, self._data = post_pos - footer_offset, None
            #: The footer's chunk count (checked against its metadata as it is read).
            self.num_chunks = n - 1
        #: From the footer's metadata, once :meth:`slices` has begun.
        self.num_records, self.writer_options = 0, ""
        #: Records in every chunk but the last (which holds at most as many), or 0:
        #: known once :meth:`slices` is done.
        self.group_size = 0

    def _load(self, fbuf: memoryview) -> None:
        """The footer chunk ``fbuf`` (from its offset to the postscript), checked."""
        dec = self._dec
        try:
            ctype, n, decoded, data = dec._chunk_payload(fbuf, self.footer_offset)
            if ctype == CHUNK_TRANSPOSED:
                raise ChunkDecodeError("the footer chunk is transposed")
            if ctype != CHUNK_SIMPLE or n < 1:
                raise ChunkDecodeError(f"footer chunk has type {ctype:#x} and {n} records")
            dec._fits(n, len(fbuf))
        except (ChunkDecodeError, ValueError, struct.error) as e:
            raise self._bad(e) from None
        if self.unfetched and (bytes(fbuf[:CHUNK_HEADER]) != self.head or n - 1 != self.num_chunks):
            raise dec._corrupt(f"its footer (at offset {self.footer_offset}) changed while read")
        self._n, self._decoded, self._data, self.num_chunks = n, decoded, data, n - 1

    def _bad(self, e: Exception) -> Exception:
        return self._dec._corrupt(f"bad footer at offset {self.footer_offset}: {e}")

    def _metadata(self, first: Any) -> None:
        dec = self._dec
        meta_raw = parse_proto(first).get(1)
        if not isinstance(meta_raw, bytes):
            raise ChunkDecodeError("footer metadata lacks array_record_metadata")
        meta = parse_proto(meta_raw)
        if meta.get(1) != 1:
            raise dec._corrupt(f"unsupported ArrayRecord version {meta.get(1)!r}")
        num_chunks = int(meta.get(2, 0))
        self.num_records = int(meta.get(3, 0))
        options = meta.get(4, b"")
        self.writer_options = (
            options.decode("utf-8", "replace") if isinstance(options, bytes) else ""
        )
        if num_chunks != self._n - 1:
            raise dec._corrupt(
                f"footer metadata says {num_chunks} chunks, the footer holds {self._n - 1} entries"
            )

    def _whole(self) -> Iterator[tuple[Any, np.ndarray, int]]:
        values, bounds = self._dec._decode_simple(self._data, self._n, self._decoded)
        bounds = np.asarray([0, len(values)] if bounds is None else bounds, np.int64)
        self._metadata(memoryview(values)[: int(bounds[1])])
        yield values, bounds, 0

    def _streamed(self, step: int) -> Iterator[tuple[Any, np.ndarray, int]]:
        """The footer's records ``step`` at a time: (their values, their bounds after an
        empty record 0, the first entry's number), record 0 read as the metadata."""
        data, n, decoded = self._data, self._n, self._decoded
        ctype, p, vstart = self._dec._simple_head(data, decoded)
        sizes = _Stream(self._dec, ctype, data[p:vstart], 10 * n, False)
        values = _Stream(self._dec, ctype, data[vstart:], decoded, True)
        pend = np.zeros(0, np.uint8)  # record-size bytes read, not yet decoded
        total = 0

        def take(k: int) -> np.ndarray:
            # Each varint ends with the one byte of it below 0x80: k more sizes take at
            # least as many more bytes as they lack ends (read 64 KiB at least, so long
            # varints take few rounds).
            nonlocal pend, total
            have = int(np.count_nonzero(pend < 0x80))
            while have < k:
                want = min(max(k - have, 1 << 16), sizes.size - sizes.pos)
                if want == 0:
                    raise ChunkDecodeError(f"record-size buffer holds fewer than {n} sizes")
                more = np.frombuffer(sizes.read(want), np.uint8)
                have += int(np.count_nonzero(more < 0x80))
                pend = np.concatenate([pend, more])
                # pend holds `have` varints and the start of one more, 10 bytes each at
                # most: a run of continuation bytes is refused here, not gathered whole.
                if len(pend) > 10 * have + 9:
                    raise ChunkDecodeError("record-size buffer: a varint longer than 10 bytes")
            cut = int(np.flatnonzero(pend < 0x80)[k - 1]) + 1
            got = decode_varints(pend[:cut])[0]
            pend = pend[cut:]
            if int(got.max()) > decoded:
                raise ChunkDecodeError("a record size exceeds the chunk's decoded size")
            got = got.astype(np.int64)
            total += int(got.sum())
            if total > decoded:
                raise ChunkDecodeError(
                    f"record sizes add up to more than {decoded}, the chunk's decoded size"
                )
            return got

        self._metadata(values.read(int(take(1)[0])))
        for a in range(0, n - 1, step):
            got = take(min(step, n - 1 - a))
            bounds = np.zeros(len(got) + 2, np.int64)
            np.cumsum(got, out=bounds[2:])
            yield values.read(int(bounds[-1])), bounds, a
        if len(pend) or sizes.pos != sizes.size:
            raise ChunkDecodeError("record-size buffer has trailing bytes")
        sizes.finish()
        if total != decoded:
            raise ChunkDecodeError(f"record sizes add up to {total}, chunk decodes to {decoded}")
        values.finish()

    def footer(self) -> Footer:
        """The whole footer, decoded at once, as a :class:`Footer`.

        Raises:
            CorruptDataError: a corrupt footer (named by the reader).
        """
        parts = list(self._slices(None))  # one slice (none for a file of no chunks)
        offsets, dsizes, ends = parts[0] if parts else [np.zeros(0, np.int64) for _ in range(3)]
        record_offsets = np.concatenate([np.zeros(1, np.int64), ends])
        chunk_ends = np.empty(len(offsets), np.int64)
        chunk_ends[:-1] = offsets[1:]
        if len(offsets):
            chunk_ends[-1] = self.footer_offset
        return Footer(
            chunk_offsets=offsets,
            chunk_ends=chunk_ends,
            decoded_sizes=dsizes,
            record_offsets=record_offsets,
            num_records=self.num_records,
            writer_options=self.writer_options,
            footer_offset=self.footer_offset,
            file_size=self.file_size,
            group_size=self.group_size,
        )

    def slices(
        self, step: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The footer's entries as ``(chunk offsets, decoded sizes, record ends)`` int64
        arrays (record ends: the prefix sums of the chunks' record counts), all in one
        slice (``step=None``: the footer decoded whole) or ``step`` chunks at a time
        (decoded as they come: what is held does not grow with the number of chunks).
        Every check of the entries is made on the slice that shows it, the record count
        and the last chunk's on the last: a caller that writes slices as they come
        drops what it wrote when this raises.

        Raises:
            CorruptDataError: a corrupt footer (named by the reader).
        """
        return self._slices(step)

    def _slices(self, step: int | None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if self._data is None:  # the footer chunk, fetched by whoever reads its entries
            self._load(self._fetch([(self.footer_offset, self._post_pos)])[0])
        dec, footer_offset, num_chunks = self._dec, self.footer_offset, self.num_chunks
        parts = self._whole() if step is None else self._streamed(max(1, step))
        total, prev, group = 0, -1, -1
        while True:
            try:
                part = next(parts, None)
            except (ChunkDecodeError, ValueError, struct.error) as e:
                raise self._bad(e) from None
            if part is None:
                break
            values, bounds, a = part
            del part
            offsets, dsizes, counts = parse_entries(dec, values, bounds, first=a)
            del values, bounds
            k = len(offsets)
            if not k:
                continue
            last = a + k == num_chunks
            s = float(counts.sum(dtype=np.float64))
            if s + total >= 2.0**62:  # int64 sums would wrap
                raise dec._corrupt("footer entries hold more than 2**62 records")
            ends = np.cumsum(counts)
            ends += total
            total = int(ends[-1])
            if last and total != self.num_records:
                raise dec._corrupt(
                    f"footer entries hold {total} records, metadata says {self.num_records}"
                )
            steps = np.diff(offsets)
            if (
                int(offsets[0]) <= max(prev, CHUNK_HEADER - 1)
                or (k > 1 and int(steps.min()) <= 0)
                or int(offsets[-1]) >= footer_offset
            ):
                raise dec._corrupt("footer chunk offsets are not increasing within the file")
            # A remote read fetches a chunk to the next one's offset: chunks listed far
            # apart would make a read of one record fetch the bytes between.
            spans = np.empty(k + 1, np.int64)
            spans[0] = int(offsets[0]) - prev if a else 0
            spans[1:k] = steps
            spans[k] = footer_offset - int(offsets[-1]) if last else 0
            c = int(np.argmax(spans))
            if int(spans[c]) > dec._max_span():
                raise dec._corrupt(
                    f"it spans {int(spans[c])} bytes to the next chunk's offset, more than a "
                    f"chunk within max_chunk_bytes={dec._max_chunk} takes (a larger "
                    "max_chunk_bytes reads it, if the file is trusted)",
                    chunk=a + c - 1,
                )
            prev = int(offsets[-1])
            # Uniform group size (all chunks but the last hold g records) allows a
            # division instead of a binary search for single-record reads.
            if group < 0:
                group = int(counts[0])
            if group > 0:
                body = counts[:-1] if last else counts
                if not bool(np.all(body == group)) or (last and not 0 < int(counts[-1]) <= group):
                    group = 0
            del counts
            yield offsets, dsizes, ends
        if num_chunks == 0 and self.num_records:
            raise dec._corrupt(f"footer has no chunks but metadata says {self.num_records} records")
        self.group_size = max(group, 0)


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
    dec: ChunkDecoder, values: Any, bounds: np.ndarray, vectorised: bool = True, first: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Footer entries 1..n as (chunk_offset, decoded_size, num_records) int64 arrays;
    ``first``: the number of entry 1 in the footer (a slice of it), for errors."""
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
            msg = parse_proto(mv[int(bounds[i + 1]) : int(bounds[i + 2])])
        except ValueError as e:
            raise dec._corrupt(f"footer entry {first + i}: {e}") from None
        for j in range(3):
            x = msg.get(j + 1, 0)
            if not isinstance(x, int) or x >= 1 << 62:
                raise dec._corrupt(f"footer entry {first + i}: bad field {j + 1}: {x!r}")
            out[i, j] = x
    return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy()
