"""Decode a batch of msgpack records into columns, vectorised over the records.

The records of a batch written by one pipeline are maps with the same keys in the same
order, each value of one msgpack family (integers, floats, bools, binaries, strings, or
torchgrain's ndarray extension). Given the batch as one buffer and each record's byte
range, :func:`decode_columns` walks the maps key by key for all records at once with
numpy: it reads each value's header byte, computes every record's value length from
lookup tables, and gathers the values into one column (an array ``[B, ...]`` for
numbers and arrays of one dtype and shape, a :class:`~torchgrain.columns.Ragged` for
binaries, strings and 1-D arrays of varying length). No Python object is made per
record. Anything else (nested maps or lists, nulls, keys in another order, a value
that does not fit in int64) returns None, and the caller decodes the records one by
one, which also reports what is wrong with a corrupt one.

Example:
    >>> import numpy as np
    >>> from torchgrain.formats.codecs import MsgpackCodec
    >>> recs = [MsgpackCodec().encode({"x": np.full(2, i, np.int16), "id": i, "s": "ab"[: i + 1]})
    ...         for i in range(2)]
    >>> buf = np.frombuffer(b"".join(recs), np.uint8)
    >>> ends = np.cumsum([len(r) for r in recs]); starts = ends - [len(r) for r in recs]
    >>> cols = decode_columns(buf, starts, ends)
    >>> cols["x"].tolist(), cols["id"].tolist(), cols["s"].tolist()
    ([[0, 0], [1, 1]], [0, 1], ['a', 'ab'])
"""

from __future__ import annotations

import codecs
import math
from typing import Any

import numpy as np

from torchgrain.columns import ColumnBatch, Ragged, can_stack, empty, gather_ranges

__all__ = ["decode_columns"]

_NDARRAY_EXT = 1  # torchgrain's extension type for numpy arrays (see codecs)
_MAX_NDIM = 32

# Families of a value's first byte.
_INT, _FLOAT, _BOOL, _BIN, _STR, _EXT = 1, 2, 3, 4, 5, 6
_FAMILY = np.zeros(256, dtype=np.uint8)
_FAMILY[0x00:0x80] = _INT  # positive fixint
_FAMILY[0xE0:0x100] = _INT  # negative fixint
_FAMILY[[0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3]] = _INT
_FAMILY[[0xCA, 0xCB]] = _FLOAT
_FAMILY[[0xC2, 0xC3]] = _BOOL
_FAMILY[[0xC4, 0xC5, 0xC6]] = _BIN
_FAMILY[0xA0:0xC0] = _STR  # fixstr
_FAMILY[[0xD9, 0xDA, 0xDB]] = _STR
_FAMILY[[0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8]] = _EXT

# Integers: (bytes after the header, signed) by header byte.
_INT_WIDTH = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False)}
_INT_WIDTH.update({0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)})
# Binaries and strings: (header length, width of the length field) by header byte.
_SIZED = {0xC4: (2, 1), 0xC5: (3, 2), 0xC6: (5, 4), 0xD9: (2, 1), 0xDA: (3, 2), 0xDB: (5, 4)}
# Extensions: (offset of the data, width of the length field); the type byte is just
# before the data.
_EXT_LAYOUT = {0xC7: (3, 1), 0xC8: (4, 2), 0xC9: (6, 4)}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


def _gather(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """``(len(pos), width)`` bytes at each position (callers bound-check first)."""
    return buf[pos[:, None] + np.arange(width)]


def _big_endian(buf: np.ndarray, pos: np.ndarray, width: int, signed: bool) -> np.ndarray:
    raw = np.ascontiguousarray(_gather(buf, pos, width))
    return raw.view(f">{'i' if signed else 'u'}{width}").ravel()


def decode_columns(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> ColumnBatch | None:
    """Columns of the msgpack maps at ``buf[starts[i]:ends[i]]``, or None (see the module).

    ``buf`` is a uint8 array; ``starts``/``ends`` int64 arrays, one per record.
    """
    b = len(starts)
    if b == 0:
        return ColumnBatch({}, num_rows=0)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if (ends <= starts).any() or int(ends.max()) > len(buf):
        return None
    head = buf[starts]
    if not (head == head[0]).all() or head[0] & 0xF0 != 0x80:
        return None  # not fixmaps of one size
    pos = starts + 1
    columns: dict[str, Any] = {}
    for _ in range(int(head[0]) & 0x0F):
        if (pos >= ends).any():
            return None
        key_head = buf[pos]
        if not (key_head == key_head[0]).all() or key_head[0] & 0xE0 != 0xA0:
            return None  # keys must be short strings, the same in every record
        klen = int(key_head[0]) & 0x1F
        if (pos + 1 + klen > ends).any():
            return None
        key_bytes = _gather(buf, pos + 1, klen)
        if klen and not (key_bytes == key_bytes[0]).all():
            return None
        try:
            key = key_bytes[0].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return None
        if key in columns:
            return None
        found = _value_column(buf, pos + 1 + klen, ends)
        if found is None:
            return None
        columns[key], pos = found
    if not (pos == ends).all():
        return None
    return ColumnBatch(columns, num_rows=b)


def _value_column(
    buf: np.ndarray, pos: np.ndarray, ends: np.ndarray
) -> tuple[Any, np.ndarray] | None:
    """``(column, positions after the values)`` of the values starting at ``pos``."""
    if (pos >= ends).any():
        return None
    t = buf[pos]
    family = _FAMILY[t]
    if not (family == family[0]).all() or family[0] == 0:
        return None
    kind = int(family[0])
    if kind == _INT:
        return _ints(buf, pos, t, ends)
    if kind == _FLOAT:
        wide = t == 0xCB
        end = pos + np.where(wide, 9, 5)
        if (end > ends).any():
            return None
        out = np.empty(len(pos), dtype=np.float64)
        out[wide] = _big_endian(buf, pos[wide] + 1, 8, False).view(">f8")
        out[~wide] = _big_endian(buf, pos[~wide] + 1, 4, False).view(">f4")
        return out, end
    if kind == _BOOL:
        return t == 0xC3, pos + 1
    if kind in (_BIN, _STR):
        return _sized(buf, pos, t, ends, "bytes" if kind == _BIN else "str")
    return _ndarrays(buf, pos, t, ends)


def _ints(
    buf: np.ndarray, pos: np.ndarray, t: np.ndarray, ends: np.ndarray
) -> tuple[Any, np.ndarray] | None:
    out = np.empty(len(pos), dtype=np.int64)
    end = pos + 1
    fix = (t < 0x80) | (t >= 0xE0)
    out[fix] = t[fix].astype(np.int64)
    out[t >= 0xE0] -= 256  # negative fixints
    for code in np.unique(t[~fix]).tolist():
        width, signed = _INT_WIDTH[code]
        m = t == code
        if (pos[m] + 1 + width > ends[m]).any():
            return None
        values = _big_endian(buf, pos[m] + 1, width, signed)
        if code == 0xCF and (values > np.iinfo(np.int64).max).any():
            return None  # an unsigned 64-bit value beyond int64: a list column
        out[m] = values.astype(np.int64)
        end[m] += width
    return out, end


def _sized(
    buf: np.ndarray, pos: np.ndarray, t: np.ndarray, ends: np.ndarray, kind: str
) -> tuple[Any, np.ndarray] | None:
    data = np.empty(len(pos), dtype=np.int64)
    length = np.empty(len(pos), dtype=np.int64)
    fix = (t & 0xE0) == 0xA0  # fixstr
    data[fix] = pos[fix] + 1
    length[fix] = (t[fix] & 0x1F).astype(np.int64)
    for code in np.unique(t[~fix]).tolist():
        header, width = _SIZED[code]
        m = t == code
        if (pos[m] + header > ends[m]).any():
            return None
        length[m] = _big_endian(buf, pos[m] + 1, width, False).astype(np.int64)
        data[m] = pos[m] + header
    end = data + length
    if (end > ends).any():
        return None
    offsets = np.zeros(len(pos) + 1, dtype=np.int64)
    np.cumsum(length, out=offsets[1:])
    values = empty((int(offsets[-1]),), np.uint8)
    gather_ranges(buf, data, length, values)
    if kind == "str" and len(values) and int(values.max()) >= 0x80 and not _utf8(values, offsets):
        return None  # the record path refuses it, naming the record
    return Ragged(values, offsets, kind), end


def _utf8(values: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether every string of a column (``values`` cut at ``offsets``) is UTF-8, as
    msgpack requires: the whole is, and no string starts inside a character."""
    inner = offsets[1:-1]
    inner = inner[inner < len(values)]
    if ((values[inner] & 0xC0) == 0x80).any():
        return False
    try:
        codecs.utf_8_decode(memoryview(values), "strict", True)
    except UnicodeDecodeError:
        return False
    return True


def _ndarrays(
    buf: np.ndarray, pos: np.ndarray, t: np.ndarray, ends: np.ndarray
) -> tuple[Any, np.ndarray] | None:
    """torchgrain's ndarray extension: ``[n][dtype str][ndim][shape u64 LE x ndim][data]``."""
    n = len(pos)
    data = np.empty(n, dtype=np.int64)
    length = np.empty(n, dtype=np.int64)
    for code in np.unique(t).tolist():
        m = t == code
        if code in _FIXEXT:
            data[m], length[m] = pos[m] + 2, _FIXEXT[code]
        else:
            data_off, width = _EXT_LAYOUT[code]
            if (pos[m] + data_off > ends[m]).any():
                return None
            length[m] = _big_endian(buf, pos[m] + 1, width, False).astype(np.int64)
            data[m] = pos[m] + data_off
    end = data + length
    if (end > ends).any() or not (buf[data - 1] == _NDARRAY_EXT).all() or (length < 2).any():
        return None
    # The array header of the first record; the others must match it (same dtype, and
    # for a dense column the same shape).
    first = int(data[0])
    dlen = int(buf[first])
    ndim_at = first + 1 + dlen
    if ndim_at >= int(ends[0]):
        return None
    ndim = int(buf[ndim_at])
    header = 2 + dlen + 8 * ndim
    if ndim > _MAX_NDIM or (length < header).any():
        return None
    try:
        dtype = np.dtype(buf[first + 1 : ndim_at].tobytes().decode("ascii"))
    except (TypeError, ValueError, SyntaxError, UnicodeDecodeError):  # ("i4,(": a SyntaxError)
        return None
    # A subarray dtype ("(2,)<i4") would add dimensions of its own: the records decide.
    if dtype.hasobject or dtype.names is not None or dtype.shape or dtype.itemsize == 0:
        return None
    heads = _gather(buf, data, header)
    # Shapes are untrusted uint64s: their products are taken exactly (Python ints),
    # never in int64, where they wrap around.
    shape = tuple(int(s) for s in heads[0, 2 + dlen :].view("<u8"))
    nbytes = math.prod(shape) * dtype.itemsize
    if (heads == heads[0]).all():
        if (
            nbytes > int(length.max())
            or not can_stack(n, shape, dtype.itemsize)
            or not (length == header + nbytes).all()
        ):
            return None
        out = empty((n, *shape), dtype)
        gather_ranges(
            buf, data + header, np.full(n, nbytes, np.int64), out.reshape(-1).view(np.uint8)
        )
        return out, end
    # Shapes differ: a ragged column when the arrays are 1-D of one dtype.
    if ndim != 1 or not (heads[:, : 2 + dlen] == heads[0, : 2 + dlen]).all():
        return None
    count = heads[:, 2 + dlen :].copy().view("<u8").ravel()
    # No more items than payload bytes (items are >= 1 byte), checked in uint64 before
    # any product: a count of 2**61 + 1 of 8-byte items wraps to 8 bytes in int64.
    if (count > (length - header).astype(np.uint64)).any():
        return None
    count = count.astype(np.int64)
    byte_len = count * dtype.itemsize
    if not (length == header + byte_len).all():
        return None
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(count, out=offsets[1:])
    values = empty((int(offsets[-1]),), dtype)
    gather_ranges(buf, data + header, byte_len, values.view(np.uint8))
    return Ragged(values, offsets, "array"), end
