"""The page headers of a Parquet column chunk, read without reading its pages.

Arrow inflates each page of a column chunk into a buffer of the size its header declares
(``uncompressed_page_size``) and refuses a page whose data inflate to more or less than
that, for every codec. So the headers bound what decoding a column chunk allocates,
before any page is inflated: :func:`chunk_pages` walks them (a few hundred bytes each,
one every page: a header, then ``compressed_page_size`` bytes of page data, then the next
header) and sums what they declare. A hostile file controls these numbers too, but
whatever it declares, Arrow allocates no more than that.

Headers are Thrift structs in the compact protocol; :func:`page_header` reads the few
fields that size a page and skips every other field, known or not, as Arrow's Thrift
reader does.

Example:
    >>> import io, os, tempfile
    >>> import pyarrow as pa, pyarrow.parquet as pq
    >>> path = os.path.join(tempfile.mkdtemp(), "t.parquet")
    >>> pq.write_table(pa.table({"x": [b"a" * 1000] * 3}), path, compression="zstd")
    >>> col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    >>> with open(path, "rb") as f:
    ...     pages = chunk_pages(lambda pos, n: os.pread(f.fileno(), n, pos),
    ...                         *chunk_range(col), col.num_values)
    >>> pages.dictionary_bytes, pages.data_bytes > 0, pages.values, pages.pages
    (1004, True, 3, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torchgrain.errors import CorruptDataError

__all__ = ["ChunkPages", "PageHeader", "chunk_pages", "chunk_range", "page_header"]

# Page types (parquet.thrift's PageType).
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# Arrow refuses a page header larger than this (ReaderProperties' default
# max_page_header_size), and so do we.
MAX_HEADER_BYTES = 16 << 20
_FIRST_READ = 256  # bytes read for a header at first: pyarrow's headers take 20-60
_MAX_DEPTH = 64  # nesting of Thrift structs and containers in one header

# Thrift compact protocol types.
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY = range(9)
_LIST, _SET, _MAP, _STRUCT = 9, 10, 11, 12


class PageHeader(NamedTuple):
    """What sizes one page: its type, the bytes it inflates to and takes in the file, the
    values it holds (nulls included; a dictionary's entries), and the header's length."""

    type: int
    uncompressed_size: int
    compressed_size: int
    num_values: int
    header_size: int


class ChunkPages(NamedTuple):
    """Sums over one column chunk's pages: bytes its dictionary pages and its data pages
    take in memory (what they inflate to, or their bytes in the file where those are
    more), values its data pages hold, and pages."""

    dictionary_bytes: int
    data_bytes: int
    values: int
    pages: int


class _Short(Exception):
    """The header goes on past the bytes given."""


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise _Short
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"a negative length ({n})")
        if self.pos + n > len(self.buf):
            raise _Short
        self.pos += n

    def skip_value(self, t: int, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise ValueError(f"Thrift values nested more than {_MAX_DEPTH} deep")
        if t in (_TRUE, _FALSE):
            return
        if t == _BYTE:
            self.skip(1)
        elif t in (_I16, _I32, _I64):
            self.varint()
        elif t == _DOUBLE:
            self.skip(8)
        elif t == _BINARY:
            self.skip(self.varint())
        elif t in (_LIST, _SET):
            head = self.byte()
            size = head >> 4
            if size == 15:
                size = self.varint()
            for _ in range(size):
                # A boolean element takes a byte of its own (a field's is in its type).
                self.skip(1) if head & 15 in (_TRUE, _FALSE) else self.skip_value(
                    head & 15, depth + 1
                )
        elif t == _MAP:
            size = self.varint()
            if size:
                kinds = self.byte()
                for _ in range(size):
                    self.skip_value(kinds >> 4, depth + 1)
                    self.skip_value(kinds & 15, depth + 1)
        elif t == _STRUCT:
            self.struct(lambda fid, ft: False, depth + 1)
        else:
            raise ValueError(f"unknown Thrift type {t}")

    def struct(self, field: Callable[[int, int], bool], depth: int) -> None:
        """Read a struct's fields, calling ``field(id, type)`` on each: it reads the
        value and returns True, or returns False to have it skipped."""
        fid = 0
        while True:
            head = self.byte()
            t = head & 15
            if t == _STOP:
                return
            fid = fid + (head >> 4) if head >> 4 else self.zigzag()
            if not field(fid, t):
                self.skip_value(t, depth)


def page_header(buf: bytes) -> PageHeader | None:
    """The page header at the start of ``buf``, or None when it goes on past ``buf``'s
    end; a header that is not one raises ``ValueError``.

    Example:
        >>> page_header(bytes([0x15, 0x00, 0x15, 0x10, 0x15, 0x0C, 0x2C, 0x15, 0x06, 0x00, 0x00]))
        PageHeader(type=0, uncompressed_size=8, compressed_size=6, num_values=3, header_size=11)
        >>> page_header(bytes([0x15, 0x00])) is None
        True
    """
    r = _Reader(buf)
    top: dict[int, int] = {}
    values = [0]

    def inner(fid: int, t: int) -> bool:
        if fid == 1 and t == _I32:  # num_values, in each of the three page kinds' headers
            values[0] = r.zigzag()
            return True
        return False

    def field(fid: int, t: int) -> bool:
        if fid in (1, 2, 3) and t == _I32:  # type, uncompressed and compressed size
            top[fid] = r.zigzag()
            return True
        if fid in (5, 7, 8) and t == _STRUCT:  # data, dictionary, data v2 page headers
            top[fid] = 1
            r.struct(inner, 1)
            return True
        return False

    try:
        r.struct(field, 0)
    except _Short:
        return None
    if 1 not in top or 2 not in top or 3 not in top:
        raise ValueError("a page header without its type or sizes")
    kind, uncompressed, compressed = top[1], top[2], top[3]
    if uncompressed < 0 or compressed < 0 or values[0] < 0:
        raise ValueError(
            f"a page header with negative sizes or value count "
            f"({uncompressed}, {compressed}, {values[0]})"
        )
    needs = {DATA_PAGE: 5, DICTIONARY_PAGE: 7, DATA_PAGE_V2: 8}.get(kind)
    if needs is not None and needs not in top:
        raise ValueError(f"a page of type {kind} without its own header")
    return PageHeader(kind, uncompressed, compressed, values[0], r.pos)


def chunk_range(column: Any) -> tuple[int, int]:
    """``(start, length)`` of a column chunk in its file, from its footer metadata (a
    pyarrow ``ColumnChunkMetaData``), as Arrow computes it: from its dictionary page when
    it has one before its first data page."""
    start = column.data_page_offset
    dictionary = column.dictionary_page_offset
    if column.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
        start = dictionary
    return start, column.total_compressed_size


def chunk_pages(
    read_at: Callable[[int, int], bytes], start: int, length: int, num_values: int
) -> ChunkPages:
    """Walk the page headers of the column chunk ``[start, start + length)`` whose footer
    says it holds ``num_values`` values, reading each with ``read_at(offset, size)``
    (which may return fewer bytes at the end of the file). Like Arrow, it stops at the
    chunk's end or once the data pages hold ``num_values`` values.

    Raises:
        CorruptDataError: a header that is not one, or that goes on past the chunk's end
            or :data:`MAX_HEADER_BYTES` (the caller adds which file and column).
    """
    end = start + length
    pos = start
    dictionary = data = values = pages = 0
    while pos < end and values < num_values:
        size = min(_FIRST_READ, end - pos)
        while True:
            buf = read_at(pos, size)
            try:
                header = page_header(buf)
            except ValueError as e:
                raise CorruptDataError(f"page header at byte {pos}: {e}") from None
            if header is not None:
                break
            if size >= min(MAX_HEADER_BYTES, end - pos) or len(buf) < size:
                raise CorruptDataError(
                    f"page header at byte {pos} goes on past the column chunk's end "
                    f"(byte {end}) or {MAX_HEADER_BYTES} bytes"
                )
            size = min(size * 16, MAX_HEADER_BYTES, end - pos)
        pages += 1
        pos += header.header_size + header.compressed_size
        size = max(header.uncompressed_size, header.compressed_size)
        if header.type == DICTIONARY_PAGE:
            dictionary += size
        elif header.type in (DATA_PAGE, DATA_PAGE_V2):
            data += size
            values += header.num_values
    return ChunkPages(dictionary, data, values, pages)
