"""Batched reads of one-record chunks, planned with numpy: one file's batch, or many files'.

``group_size:1`` files (what TFDS, Grain and torchgrain write) hold one record per chunk,
so a batch of ``n`` records is ``n`` chunks. Decoding each through the careful path
(:meth:`~.riegeli.ChunkDecoder._local_chunk`) costs microseconds of Python per record;
here the chunks' headers are gathered in one fancy index, checked and located in one
:func:`_plan`, and decompressed in one loop with no Python code per record. Chunks the
plan does not recognise (a header cut by a block boundary, an empty record, another
compression) and frames that fail are read by the careful path, which checks and
reports everything: the plan is a shortcut, never a weaker check.

* :class:`OneRecordBatches`: the batch of one file (``ArrayRecordFile.read``).
* :func:`read_mapped`: chunks of many files mapped in one address range
  (:class:`~torchgrain.io.region.ShardRegion`), with no Python work per file.
* :func:`read_many`: deprecated, each file's ``read``.

Example:
    >>> _varints(np.array([[0xAC, 0x02, 0, 0]], np.uint8))
    (array([300]), array([2]))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from torchgrain.formats.arrayrecord.riegeli import (
    BLOCK,
    BLOCK_HEADER,
    CHUNK_HEADER,
    CHUNK_SIMPLE,
    UNCOMPRESSED,
    ZSTD,
    ChunkDecoder,
    phys_end,
    strip_block_headers,
)

if TYPE_CHECKING:
    from torchgrain.formats.arrayrecord.file import ArrayRecordFile
    from torchgrain.formats.arrayrecord.footer import Footer

__all__ = ["OneRecordBatches", "read_many", "read_mapped"]

_BATCH_MAX_RECORD = 64 << 20  # larger records are decompressed one by one
# Bytes gathered at each chunk of a batch: the 40-byte header and the simple chunk's
# preamble (a one-record zstd chunk's sizes buffer takes 12 bytes).
_HEADS = 64
_HEAD_BYTES = np.arange(_HEADS)
_HEAD_WORDS = np.arange(0, _HEADS, 8)
_FOUR = np.arange(4)
# A varint word's lowest ending bit, for a varint of 1, 2, 3 or 4 bytes.
_LAST_BYTE = np.array([0x80, 0x8000, 0x800000, 0x80000000], np.int64)
_JOIN_AT_ONCE = 1 << 20  # bytes of a batch's frames cut by block headers joined up front


class OneRecordBatches(ChunkDecoder):
    """Reads a batch of a local file's one-record chunks through one numpy plan.

    The base of :class:`~.file.ArrayRecordFile`, which provides its map
    (``_local_view()``) and the careful path for one chunk (``chunk_record(c, f)``).
    Per process it learns whether the file's chunks are zstd or uncompressed
    (``_raw_chunks``) and keeps the map as a uint8 array.
    """

    _local_view: Callable[[], memoryview]
    chunk_record: Callable[[int, Footer], bytes]

    def _reset_handles(self) -> None:
        super()._reset_handles()
        # The mapped file as a uint8 array, for gathering chunk headers of a batch.
        self._u8: np.ndarray | None = None
        self._u8_view: memoryview | None = None
        # Whether the file's one-record chunks are uncompressed (None: not known yet).
        self._raw_chunks: bool | None = None
        self._layout_misses = 0  # chunks that fitted neither layout while not known

    # ------------------------------------------------------------------ one file
    def _heads(self, cs: np.ndarray, f: Footer) -> tuple[memoryview, np.ndarray, np.ndarray]:
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
        self, cs: np.ndarray, f: Footer, raw: bool = False
    ) -> tuple[memoryview, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where the values of local chunks ``cs`` (int64) of a ``group_size:1`` file
        (every chunk one record, as its footer says) lie, for the common layout.

        Returns ``(view, ok, payload, end, size, cut)`` as :func:`_plan` does, for the
        map ``view``.
        """
        view, pos, heads = self._heads(cs, f)
        return (view, *_plan(pos, heads, len(view), f.chunk_ends[cs], f.decoded_sizes[cs], raw))

    def _layout(self, arr: np.ndarray, f: Footer) -> bool | None:
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

    def _read_singles(self, arr: np.ndarray, f: Footer) -> list[bytes] | None:
        """Records at valid rows ``arr`` of a local ``group_size:1`` file, in request order,
        when most chunks have the common layout (else None: take the general path).

        No sort and no per-record Python code: the chunk of row ``r`` is chunk ``r``. A
        row asked for twice is decompressed twice (the same bytes). zstd chunks are
        decompressed; uncompressed ones are sliced out of the map (which layout a file
        has is learnt from its first batch).
        """
        raw = bool(self._layout(arr, f))
        view, ok, payload, end, decoded, cut = self._chunk_plan(arr, f, raw=raw)
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
        # Unusual chunks (a header split by a block boundary, data crossing two
        # boundaries, an empty record) take the careful path, one by one.
        for k in np.flatnonzero(~ok).tolist():  # ascending: each lands at its position
            out.insert(k, self.chunk_record(int(arr[k]), f))
        return out


def read_many(
    files: Sequence[ArrayRecordFile],
    rows: Sequence[np.ndarray],
    *,
    chunk_cache: Any = None,
    cache_keys: Sequence[Any] | None = None,
) -> list[list[bytes]]:
    """``[files[k].read(rows[k]) for k ...]`` (with ``chunk_cache`` and ``cache_keys[k]``).

    Deprecated (a ``DeprecationWarning``): it planned the one-record chunks of several
    files together, which :class:`~torchgrain.ArrayRecordSource` now does through one map
    of the dataset's shards (:func:`read_mapped`); call :meth:`ArrayRecordFile.read` for
    each file instead.

    Example:
        >>> import tempfile, os
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> from torchgrain.formats.arrayrecord import ArrayRecordFile
        >>> paths = [os.path.join(tempfile.mkdtemp(), f"{k}.array_record") for k in range(2)]
        >>> for k, path in enumerate(paths):
        ...     w = ArrayRecordWriter(path, "group_size:1")
        ...     for i in range(20):
        ...         w.write(b"%d-%d" % (k, i))
        ...     w.close()
        >>> files = [ArrayRecordFile(p) for p in paths]
        >>> import warnings
        >>> with warnings.catch_warnings(action="ignore"):
        ...     read_many(files, [np.array([3, 1]), np.array([19])])
        [[b'0-3', b'0-1'], [b'1-19']]
    """
    warnings.warn(
        "read_many(files, rows) is deprecated: call files[k].read(rows[k]) for each file "
        "(ArrayRecordSource reads local batches through one map of the shards)",
        DeprecationWarning,
        stacklevel=2,
    )
    keys = cache_keys if cache_keys is not None else [None] * len(files)
    return [
        f.read(r, chunk_cache=chunk_cache, cache_key=key) for f, r, key in zip(files, rows, keys)
    ]


def read_mapped(
    u8: np.ndarray,
    view: memoryview,
    pos: np.ndarray,
    chunk_ends: np.ndarray,
    file_ends: np.ndarray,
    decoded: np.ndarray,
    *,
    decoder: ChunkDecoder,
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
        >>> from torchgrain.formats.arrayrecord import ArrayRecordFile
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
    out: list[Any] = [None] * len(pos)
    if ok.all():  # the common case: no Python work per record
        vals = decoder._decompress_frames(_frames(view, payload, end, cut), dec.tolist())
        if vals is not None:
            return vals
    else:
        z = np.flatnonzero(ok)
        vals = decoder._decompress_frames(
            _frames(view, payload[z], end[z], cut[z]), dec[z].tolist()
        )
        miss = np.flatnonzero(~ok)
        # Files written uncompressed: the same plan for raw chunks (no learning per file).
        raw = miss[heads[miss, CHUNK_HEADER] == UNCOMPRESSED]
        if vals is not None and not len(raw):  # a few unusual chunks: in their places
            for k in miss.tolist():  # ascending: each lands at its position
                vals.insert(k, careful(k))
            return vals
        got: list[tuple[np.ndarray, Iterable[Any]]] = [(z, vals or ())]
        if len(raw):
            ok, payload, end, _, cut = _plan(
                pos[raw], heads[raw], file_ends[raw], chunk_ends[raw], decoded[raw], True
            )
            got.append((raw[ok], map(bytes, _frames(view, payload[ok], end[ok], cut[ok]))))
        for rows, values in got:
            for k, v in zip(rows.tolist(), values):
                out[k] = v
    # Unusual chunks and frames that failed: the careful path, which names them.
    return [careful(k) if v is None else v for k, v in enumerate(out)]


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
    bytes at each (:meth:`OneRecordBatches._heads`), ``size`` the files' sizes, and
    ``chunk_ends`` and ``decoded_sizes`` what the footers say of them; rows may come
    from several files. One-record zstd chunks whose header sits inside one block (what
    ``group_size:1`` files hold) are recognised with numpy alone, checked against the
    footer. Returns ``(ok, payload, end, decoded, cut)``: chunk ``k`` with ``ok[k]``
    holds one zstd frame at ``[payload[k], end[k])`` of its file that decompresses to
    ``decoded[k]`` bytes, less the 24-byte block headers in that range where ``cut[k]``
    is not 0 (see :func:`_frames`). With ``raw``, the same for uncompressed chunks
    instead: the frame is the record itself. Chunks that are not ``ok`` must take
    :meth:`~.riegeli.ChunkDecoder._local_chunk`, which checks and reports everything.
    """
    fields = heads.view("<u8")  # the header's five fields, then data
    data_size = fields[:, 1].astype(np.int64)
    type_num, decoded = fields[:, 3], fields[:, 4]
    start = pos + CHUNK_HEADER
    # Data that runs into the next blocks has their 24-byte headers in it (one 12 KiB
    # record in five, every record over 64 KiB): its frame is cut there.
    boundary = ((start >> 16) + 1) << 16
    end = phys_end(start, data_size)  # elementwise
    cut = (end > boundary).astype(np.int64)
    ok = (
        # The header inside a block, data after it: its offset in the block is in
        # [BLOCK_HEADER, BLOCK - CHUNK_HEADER), one unsigned comparison.
        ((pos - BLOCK_HEADER) & (BLOCK - 1) < BLOCK - CHUNK_HEADER - BLOCK_HEADER)
        & (pos + _HEADS <= size)
        & (end <= chunk_ends)
        & (type_num == (1 << 8 | CHUNK_SIMPLE))  # a simple chunk of one record
        & (decoded == decoded_sizes)
        & (data_size > 3)
        # zstandard's batch call frees twice on an empty output (a crash, not an
        # error): empty records, and implausibly large ones, take the careful path.
        & (decoded - 1 < _BATCH_MAX_RECORD)  # (unsigned: 0 wraps above it)
    )
    # Simple chunk: compression byte, varint size of the sizes buffer, the sizes buffer
    # (skipped: one record's size is the decoded size), then the values. The preamble
    # must lie before the first cut.
    kind = heads[:, CHUNK_HEADER]
    sizes_len = heads[:, CHUNK_HEADER + 1].astype(np.int64)
    if raw:
        # Uncompressed: the sizes buffer (one varint: the record's size), then the record
        # to the chunk's end.
        value, length = _varints(heads[:, CHUNK_HEADER + 2 : CHUNK_HEADER + 6])
        payload = start + 2 + sizes_len
        ok &= (
            (kind == UNCOMPRESSED)
            & (sizes_len >= 1)
            & (length == sizes_len)
            & (value == decoded)
            & (data_size - 2 - sizes_len == decoded)
            & (payload <= boundary)
        )
        return ok, payload, end, decoded, cut
    # zstd: the values' varint size, then the frame; both must lie in ``heads``.
    room = _HEADS - CHUNK_HEADER - 2 - 4
    at = CHUNK_HEADER + 2 + np.minimum(sizes_len, room)
    # Four bytes of each row from ``at``: one gather from the flat rows (cheaper per
    # call than take_along_axis).
    at += np.arange(0, len(at) * _HEADS, _HEADS)
    value, length = _varints(heads.reshape(-1)[at[:, None] + _FOUR])
    q = start + 2 + sizes_len
    payload = q + length
    ok &= (
        (kind == ZSTD)
        & (sizes_len <= room)
        & (length > 0)
        & (value == decoded)
        & (data_size > payload - start)
        & (payload <= boundary)
    )
    return ok, payload, end, decoded, cut


def _varints(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(value, length)`` of the varint at the start of each row of ``b`` (uint8, 4
    columns); length 0 where it runs past 4 bytes.

    Example:
        >>> _varints(np.array([[5, 0, 0, 0], [0x80 | 44, 2, 0, 0], [255, 255, 255, 255]], np.uint8))
        (array([  5, 300,   0]), array([1, 2, 0]))
    """
    # The four bytes as one little-endian word: whole-row steps, no reductions along
    # rows (each costs microseconds on a batch's few rows).
    w = np.ascontiguousarray(b).view("<u4").reshape(-1).astype(np.int64)
    stop = ~w & 0x80808080  # the bytes that end a varint
    length = np.searchsorted(_LAST_BYTE, stop & -stop, side="right")  # (lowest of them)
    value = (w & 0x7F) | (w >> 1 & 0x3F80) | (w >> 2 & 0x1FC000) | (w >> 3 & 0xFE00000)
    return value & ((1 << 7 * length) - 1), length


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
            out[k] = strip_block_headers(out[k], int(starts[k]))
        return out
    cut = cuts.astype(bool).tolist()
    return (strip_block_headers(x, a) if c else x for x, a, c in zip(out, starts.tolist(), cut))
