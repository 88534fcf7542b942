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

__all__ = [
    "ChunkPages",
    "ColumnChunk",
    "PageHeader",
    "chunk_pages",
    "chunk_range",
    "footer_chunks",
    "page_header",
]

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
_FIXED = {_TRUE: 0, _FALSE: 0, _BYTE: 1, _DOUBLE: 8}  # bytes of a value (a boolean's: none)


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


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it (IndexError past the end)."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + 1
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _skip(buf: bytes, pos: int, t: int, depth: int) -> int:
    """The position after a value of Thrift type ``t`` at ``pos``."""
    if t in (_I32, _I64, _I16):
        while buf[pos] & 0x80:
            pos += 1
        return pos + 1
    if t == _BINARY:
        n, pos = _varint(buf, pos)
        return pos + n
    if t == _STRUCT:
        if depth >= _MAX_DEPTH:
            raise ValueError(f"Thrift values nested more than {_MAX_DEPTH} deep")
        return _fields(buf, pos, None, depth + 1)
    if t in _FIXED:
        return pos + _FIXED[t]
    if depth > _MAX_DEPTH:
        raise ValueError(f"Thrift values nested more than {_MAX_DEPTH} deep")
    if t in (_LIST, _SET):
        size, kind, pos = _list_head(buf, pos)
        return _skip_items(buf, pos, kind, size, depth + 1)
    if t == _MAP:
        size, pos = _varint(buf, pos)
        if size:
            kinds = buf[pos]
            pos += 1
            for _ in range(size):
                for kind in (kinds >> 4, kinds & 15):
                    # A boolean key or value takes a byte of its own.
                    pos = pos + 1 if kind in (_TRUE, _FALSE) else _skip(buf, pos, kind, depth + 1)
                if pos > len(buf):
                    raise IndexError
        return pos
    raise ValueError(f"unknown Thrift type {t}")


def _zigzag(buf: bytes, pos: int) -> tuple[int, int]:
    n, pos = _varint(buf, pos)
    return (n >> 1) ^ -(n & 1), pos


def page_header(buf: bytes) -> PageHeader | None:
    """The page header at the start of ``buf``, or None when it goes on past ``buf``'s
    end; a header that is not one raises ``ValueError``. Every field is read (a field
    given twice counts as its last, as in Arrow), only those that size a page are kept.

    Example:
        >>> page_header(bytes([0x15, 0x00, 0x15, 0x10, 0x15, 0x0C, 0x2C, 0x15, 0x06, 0x00, 0x00]))
        PageHeader(type=0, uncompressed_size=8, compressed_size=6, num_values=3, header_size=11)
        >>> page_header(bytes([0x15, 0x00])) is None
        True
    """
    top: dict[int, int] = {}
    values = pos = 0
    own = False  # whether the struct open at depth 2 is the page kind's own header
    ids = [0]  # the last field id of each struct open, outermost first
    depth = 1
    try:
        # One loop over every field of every struct, with the Thrift types as literals
        # (5: i32, 4/6: i16/i64, 8: binary, 12: struct, 1/2: booleans; a header is read
        # once a page, on the decode path); containers, which headers lack, are skipped.
        while True:
            head = buf[pos]
            pos += 1
            t = head & 15
            if not t:  # the end of a struct
                depth -= 1
                if not depth:
                    break
                ids.pop()
                continue
            if head > 15:
                fid = ids[-1] + (head >> 4)
            else:
                fid, pos = _zigzag(buf, pos)
            ids[-1] = fid
            if 3 < t < 7:
                v, pos = _varint(buf, pos)
                if t == 5 and fid <= 3:
                    if depth == 1:  # type, uncompressed and compressed size
                        top[fid] = (v >> 1) ^ -(v & 1)
                    elif fid == 1 and own and depth == 2:  # its num_values
                        values = (v >> 1) ^ -(v & 1)
            elif t == 8:
                n = buf[pos]
                if n < 0x80:
                    pos += 1 + n
                else:
                    n, pos = _varint(buf, pos)
                    pos += n
            elif t == 12:
                if depth == 1:
                    own = fid in (5, 7, 8)  # data, dictionary, data v2 page headers
                    if own:
                        top[fid] = 1
                elif depth >= _MAX_DEPTH:
                    raise ValueError(f"Thrift structs nested more than {_MAX_DEPTH} deep")
                depth += 1
                ids.append(0)
            elif t > 2:
                pos = _skip(buf, pos, t, depth)
    except IndexError:
        return None
    if pos > len(buf):
        return None
    if 1 not in top or 2 not in top or 3 not in top:
        raise ValueError("a page header without its type or sizes")
    kind, uncompressed, compressed = top[1], top[2], top[3]
    if uncompressed < 0 or compressed < 0 or values < 0:
        raise ValueError(
            f"a page header with negative sizes or value count "
            f"({uncompressed}, {compressed}, {values})"
        )
    needs = 5 if kind == DATA_PAGE else 7 if kind == DICTIONARY_PAGE else 8
    if kind in (DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2) and needs not in top:
        raise ValueError(f"a page of type {kind} without its own header")
    # (tuple.__new__: a third of the time of PageHeader(...), once a page)
    return tuple.__new__(PageHeader, (kind, uncompressed, compressed, values, pos))


class ColumnChunk(NamedTuple):
    """Where one column chunk lies, from its file's footer (``ColumnMetaData``): the
    values it holds, its bytes, and the offsets of its first data page and of its
    dictionary page (None: none), and what its pages say they inflate to; its physical
    type (parquet.thrift's ``Type``: 0 BOOLEAN, 1 INT32, 2 INT64, 4 FLOAT, 5 DOUBLE,
    6 BYTE_ARRAY...) and statistics as written (the plain-encoded ``min_value`` and
    ``max_value``, in the column's own sort order, and ``null_count``; None where the
    writer gave none), untrusted: what a filter's pushdown prunes row groups with."""

    num_values: int
    total_compressed_size: int
    data_page_offset: int
    dictionary_page_offset: int | None
    total_uncompressed_size: int = 0
    physical_type: int | None = None
    null_count: int | None = None
    min_value: bytes | None = None
    max_value: bytes | None = None


def _fields(
    buf: bytes, pos: int, field: Callable[[int, int, int], int | None] | None, depth: int = 1
) -> int:
    """Read a struct at ``pos``, nested ``depth`` deep: ``field(id, type, pos)`` reads a
    field's value and returns the position after it, or returns None to have it skipped
    (``field`` None: every field is). Returns the position after the struct."""
    fid = 0
    while True:
        head = buf[pos]
        pos += 1
        t = head & 15
        if not t:
            return pos
        if head > 15:
            fid += head >> 4
        else:
            fid, pos = _zigzag(buf, pos)
        after = None if field is None else field(fid, t, pos)
        pos = _skip(buf, pos, t, depth) if after is None else after


def _list_head(buf: bytes, pos: int) -> tuple[int, int, int]:
    """``(size, element type, position after)`` of the list or set header at ``pos``."""
    head = buf[pos]
    size, pos = head >> 4, pos + 1
    if size == 15:
        size, pos = _varint(buf, pos)
    return size, head & 15, pos


def _skip_items(
    buf: bytes, pos: int, kind: int, size: int, depth: int, item: Callable[[int], int] | None = None
) -> int:
    """The position after ``size`` list elements of Thrift type ``kind`` at ``pos``, each
    read with ``item(pos)`` if given (struct elements), else skipped."""
    if kind in (_TRUE, _FALSE):  # a boolean element takes a byte of its own
        return pos + size
    for _ in range(size):  # each element takes a byte at least: as many as buf has
        pos = _skip(buf, pos, kind, depth) if item is None else item(pos)
        if pos > len(buf):
            raise IndexError
    return pos


def _list(buf: bytes, pos: int, item: Callable[[int], int]) -> int:
    """Read a list of structs at ``pos`` with ``item(pos)`` (the position after each)."""
    size, kind, pos = _list_head(buf, pos)
    return _skip_items(buf, pos, kind, size, 1, item if kind == _STRUCT else None)


def footer_chunks(footer: bytes) -> list[list[ColumnChunk]]:
    """Each row group's column chunks, read from a Parquet footer (the Thrift
    ``FileMetaData`` before the file's last 8 bytes) without pyarrow: pyarrow's
    ``RowGroupMetaData.column`` aborts the process on some hostile footers (a C++
    exception it does not catch), which its reader refuses with an error.

    Example:
        >>> import io, pyarrow as pa, pyarrow.parquet as pq
        >>> sink = io.BytesIO()
        >>> pq.write_table(pa.table({"x": [1, 2, 3]}), sink)
        >>> data = sink.getvalue()
        >>> n = int.from_bytes(data[-8:-4], "little")
        >>> chunk = footer_chunks(data[-8 - n : -8])[0][0]
        >>> chunk.num_values, chunk.dictionary_page_offset
        (3, 4)

    Raises:
        CorruptDataError: a footer that is not one.
    """
    groups: list[list[ColumnChunk]] = []

    def chunk(pos: int) -> int:
        found: dict[int, Any] = {}
        stats: dict[int, Any] = {}

        def statistics(fid: int, t: int, pos: int) -> int | None:
            if fid == 3 and t == _I64:  # null_count
                stats[fid], pos = _zigzag(footer, pos)
                return pos
            if fid in (5, 6) and t == _BINARY:  # max_value, min_value
                n, pos = _varint(footer, pos)
                if pos + n > len(footer):
                    raise IndexError
                stats[fid] = bytes(footer[pos : pos + n])
                return pos + n
            return None

        def column_meta(fid: int, t: int, pos: int) -> int | None:
            # The physical type; num_values, sizes, page offsets.
            if (fid == 1 and t == _I32) or (fid in (5, 6, 7, 9, 11) and t == _I64):
                found[fid], pos = _zigzag(footer, pos)
                return pos
            if fid == 12 and t == _STRUCT:
                return _fields(footer, pos, statistics)
            return None

        def field(fid: int, t: int, pos: int) -> int | None:
            if fid == 3 and t == _STRUCT:
                return _fields(footer, pos, column_meta)
            return None

        pos = _fields(footer, pos, field)
        if 5 not in found or 7 not in found or 9 not in found:
            raise ValueError("a column chunk without its metadata")
        sizes = found[5], found[7], found[9], found.get(11), found.get(6, 0), found.get(1)
        groups[-1].append(ColumnChunk(*sizes, stats.get(3), stats.get(6), stats.get(5)))
        return pos

    def group(pos: int) -> int:
        groups.append([])

        def field(fid: int, t: int, pos: int) -> int | None:
            return _list(footer, pos, chunk) if fid == 1 and t == _LIST else None

        return _fields(footer, pos, field)

    def top(fid: int, t: int, pos: int) -> int | None:
        return _list(footer, pos, group) if fid == 4 and t == _LIST else None

    try:
        if _fields(footer, 0, top) > len(footer):
            raise IndexError
    except (IndexError, ValueError) as e:
        raise CorruptDataError(
            f"a Parquet footer that cannot be read: {e or 'truncated'}"
        ) from None
    return groups


def chunk_range(column: Any) -> tuple[int, int]:
    """``(start, length)`` of a column chunk in its file (a :class:`ColumnChunk`, or
    pyarrow's ``ColumnChunkMetaData`` of a trusted file), as Arrow computes it: from its
    dictionary page when it has one before its first data page."""
    start = column.data_page_offset
    dictionary = column.dictionary_page_offset
    if dictionary is not None and 0 < dictionary < start:
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
