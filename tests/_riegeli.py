"""Build ArrayRecord files field by field, for tests that need files no honest writer makes.

:func:`build` lays out a Riegeli/records file the way array_record's writer does (file
signature, data chunks, footer chunk, padding to a block boundary, postscript in the last
64 KiB block) from :class:`Chunk` descriptions. Every field a reader trusts can be set
on its own: the chunk header's data size, decoded size and record count, the varint
size prefixes of the compressed buffers, the record sizes, the footer's entries. Block
headers and every hash are computed over what is written, so a file built with lies in
it passes ``verify_checksums``: only the size checks stand between it and the reader,
as with a file from a hostile writer.

Example:
    >>> import tempfile, os
    >>> from torchgrain.formats.arrayrecord_file import ArrayRecordFile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.array_record")
    >>> _ = write(path, [Chunk([b"a", b"bc"], "brotli"), Chunk([b"d"], "zstd")])
    >>> ArrayRecordFile(path, verify_checksums=True).read_range(0, 3)
    [b'a', b'bc', b'd']
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import cramjam
import zstandard

from torchgrain.formats._highwayhash import riegeli_hash

BLOCK = 1 << 16
BLOCK_HEADER = 24
USABLE = BLOCK - BLOCK_HEADER
MAGIC = 0x71930E704FDAE05E
COMPRESSION_BYTE = {"none": 0, "brotli": 0x62, "zstd": 0x7A, "snappy": 0x73}


def varint(v: int) -> bytes:
    out = bytearray()
    v &= (1 << 64) - 1
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def compress(kind: str, raw: bytes) -> bytes:
    """One Riegeli compressed buffer: varint decompressed size, then the stream
    (uncompressed buffers have no prefix)."""
    if kind == "none":
        return raw
    return varint(len(raw)) + stream(kind, raw)


def stream(kind: str, raw: bytes) -> bytes:
    if kind == "zstd":
        return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    if kind == "brotli":
        return bytes(cramjam.brotli.compress(raw))
    if kind == "snappy":
        return bytes(cramjam.snappy.compress_raw(raw))
    raise ValueError(kind)


@dataclasses.dataclass
class Chunk:
    """A simple chunk of ``records``; any other field set overrides what is computed."""

    records: list[bytes]
    compression: str = "zstd"
    #: record sizes written in the sizes buffer (default: the true ones)
    sizes: list[int] | None = None
    #: raw bytes of the sizes buffer / the values buffer, compressed as written
    sizes_buffer: bytes | None = None
    values_buffer: bytes | None = None
    #: chunk header fields
    data_size: int | None = None
    decoded_size: int | None = None
    num_records: int | None = None
    chunk_type: int = 0x72
    #: the footer's entry for this chunk (default: the truth)
    footer_decoded: int | None = None
    footer_records: int | None = None
    #: bytes appended to the chunk's data (counted in data_size unless it is set)
    trailing: bytes = b""

    def data(self) -> bytes:
        kind = self.compression
        sizes = self.sizes if self.sizes is not None else [len(r) for r in self.records]
        sizes_buf = self.sizes_buffer
        if sizes_buf is None:
            sizes_buf = compress(kind, b"".join(varint(s) for s in sizes))
        values_buf = self.values_buffer
        if values_buf is None:
            values_buf = compress(kind, b"".join(self.records))
        return (
            bytes([COMPRESSION_BYTE[kind]])
            + varint(len(sizes_buf))
            + sizes_buf
            + values_buf
            + self.trailing
        )

    @property
    def true_decoded(self) -> int:
        return sum(map(len, self.records))


def _phys_end(pos: int, size: int) -> int:
    return pos + size + (size + (pos + USABLE - 1) % BLOCK) // USABLE * BLOCK_HEADER


class _Writer:
    """Logical bytes in, physical bytes (with block headers) out."""

    def __init__(self) -> None:
        self.out = bytearray()

    @property
    def pos(self) -> int:
        return len(self.out)

    def chunk(self, header_and_data: bytes, end_logical: int | None = None) -> int:
        """Write one chunk; returns where it starts. ``end_logical`` pads the chunk to
        that many logical bytes."""
        begin = self.pos
        body = header_and_data
        if end_logical is not None and end_logical > len(body):
            body = body + bytes(end_logical - len(body))
        end = _phys_end(begin, len(body))
        src = 0
        while self.pos < end:
            if self.pos % BLOCK == 0:
                prev = self.pos - begin
                nxt = end - self.pos
                fields = struct.pack("<QQ", prev, nxt)
                self.out += struct.pack("<Q", riegeli_hash(fields)) + fields
                continue
            room = min(BLOCK - self.pos % BLOCK, end - self.pos)
            self.out += body[src : src + room]
            src += room
        return begin


def _header(data: bytes, chunk_type: int, num_records: int, decoded: int, data_size: int) -> bytes:
    m = (1 << 64) - 1  # lies are cut to the 64-bit fields they are written in
    fields = struct.pack(
        "<QQQQ",
        data_size & m,
        riegeli_hash(data),
        (chunk_type | (num_records << 8)) & m,
        decoded & m,
    )
    return struct.pack("<Q", riegeli_hash(fields)) + fields


def _proto_varint_field(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(value)


def _proto_bytes_field(field: int, value: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(value)) + value


def write(path: str, chunks: list[Chunk], **kw: Any) -> bytes:
    """:func:`build` the file and write it to ``path``; returns its bytes."""
    data = build(chunks, **kw)
    with open(path, "wb") as f:
        f.write(data)
    return data


def build(
    chunks: list[Chunk],
    *,
    footer_compression: str | None = None,
    num_records: int | None = None,
    num_chunks: int | None = None,
    writer_options: str = "group_size:1",
    footer_offsets: list[int] | None = None,
    postscript_footer_offset: int | None = None,
) -> bytes:
    """The bytes of an ArrayRecord file holding ``chunks`` (see the module docstring)."""
    w = _Writer()
    w.chunk(_header(b"", 0x73, 0, 0, 0))  # file signature
    offsets, decoded_sizes, counts = [], [], []
    for c in chunks:
        data = c.data()
        n = len(c.records) if c.num_records is None else c.num_records
        decoded = c.true_decoded if c.decoded_size is None else c.decoded_size
        size = len(data) if c.data_size is None else c.data_size
        head = _header(data, c.chunk_type, n, decoded, size)
        # Riegeli: a chunk spans at least as many bytes as it has records.
        offsets.append(w.chunk(head + data, end_logical=min(len(c.records), 1 << 20)))
        decoded_sizes.append(c.true_decoded if c.footer_decoded is None else c.footer_decoded)
        counts.append(len(c.records) if c.footer_records is None else c.footer_records)
    if footer_offsets is not None:
        offsets = footer_offsets
    total = sum(counts) if num_records is None else num_records
    meta = (
        _proto_varint_field(1, 1)
        + _proto_varint_field(2, len(chunks) if num_chunks is None else num_chunks)
        + _proto_varint_field(3, total)
        + _proto_bytes_field(4, writer_options.encode())
    )
    footer_records = [_proto_bytes_field(1, meta)] + [
        _proto_varint_field(1, o) + _proto_varint_field(2, d) + _proto_varint_field(3, k)
        for o, d, k in zip(offsets, decoded_sizes, counts)
    ]
    fc = Chunk(footer_records, footer_compression or (chunks[0].compression if chunks else "zstd"))
    fdata = fc.data()
    footer_offset = w.chunk(
        _header(fdata, 0x72, len(footer_records), fc.true_decoded, len(fdata)) + fdata
    )
    # A padding chunk up to a block boundary, where the postscript starts.
    target = -(-(w.pos + 41) // BLOCK) * BLOCK
    n = target - w.pos - 40
    while _phys_end(w.pos, 40 + n) > target:
        n -= 1
    pad = bytes(n)
    w.chunk(_header(pad, 0x70, 0, 0, len(pad)) + pad)
    assert w.pos == target
    if postscript_footer_offset is not None:
        footer_offset = postscript_footer_offset
    post = _proto_varint_field(1, footer_offset) + _proto_varint_field(2, MAGIC)
    pc = Chunk([post] * 3, "none")
    pdata = pc.data()
    w.chunk(_header(pdata, 0x72, 3, pc.true_decoded, len(pdata)) + pdata)
    w.out += bytes(BLOCK - w.pos % BLOCK if w.pos % BLOCK else 0)
    return bytes(w.out)
