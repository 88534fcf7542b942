"""The contract a file format implements, and the source torchgrain builds around it.

A format says how to open one shard file (:class:`ShardFormat`) and how to read records
of an open shard (:class:`ShardReader`); a reader that can also say where its records'
bytes lie (:class:`ReadsByteRanges`) lets a remote batch be fetched across all its shards
at once; a format may also count its shards at once (:class:`IndexesShards`), read a
whole batch itself (:class:`ReadsBatches`) and leave decoding its records' bytes to a
codec (:class:`EncodedFormat`). :class:`FormatSource` is the rest, the same as for the built-in formats: file
listing, per-process readers that survive ``fork``, the open-file LRU, retries,
``io_threads``, the shard cache (``cache_dir``), read-ahead, cache-fit checks, the
``tg.stats`` counters, small pickles and errors that name the shard, file and record.
A format reads its file only through :class:`ShardFile` (bounded, checked reads of a file
pinned to its version), never through fsspec itself. docs/sources.md has a complete example.
"""

from __future__ import annotations

import copy
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import fsspec
import numpy as np

from torchgrain.columns import ColumnBatch, scratch
from torchgrain.diagnostics import count_decode, count_read
from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    TorchgrainError,
)
from torchgrain.formats.codecs import SCHEMA_SAMPLE_FIRST, Codec, merge_schema
from torchgrain.io import changes, remote
from torchgrain.io.fs import is_local, map_files
from torchgrain.io.ranges import fetch_ranges
from torchgrain.io.retry import RetryPolicy, retry_call, using
from torchgrain.sources.base import ShardedSource, iter_in_blocks
from torchgrain.sources.cache_fit import listed_sizes
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.options import ReadOptions

__all__ = [
    "EncodedFormat",
    "FormatSource",
    "IndexesShards",
    "ReadsBatches",
    "ReadsByteRanges",
    "ShardCounts",
    "ShardFile",
    "ShardFormat",
    "ShardReader",
    "decode_columns",
    "decode_record",
    "decode_records",
    "named_rows",
]

T = TypeVar("T")

#: The most bytes one :meth:`ShardFile.read` or :meth:`ShardFile.read_ranges` call reads
#: unless told otherwise.
MAX_FILE_BYTES = 1 << 30

#: What a bug in a format's own code raises, as opposed to what bad bytes make it raise:
#: these surface as they are (see :class:`FormatSource`).
BUGS = (TypeError, AttributeError, NameError, AssertionError, NotImplementedError, ImportError)


class ShardFile:
    """One shard file, opened for reading: its number in the dataset, its path or URL and
    its filesystem (None for a local file). A local file is held open (a copy in the shard
    cache stays readable once evicted) until :meth:`close`, and pinned: a file written in
    place since it was opened is a :class:`~torchgrain.CorruptDataError` at the next read
    (:mod:`torchgrain.io.changes`: an inotify watch, ~0.1 ms to add and remove, and one
    check a read; ``watch=False`` for a file read once, e.g. to count). A remote one is pinned to the
    size (``size``, else asked) and version it has now (``fresh=True``: a dataset's opening,
    which takes the server's version anew; else the version this process pinned before,
    which must be ``seen``, the ``(size, ETag, Last-Modified)`` the dataset's opening read,
    when given): a file replaced later is an error, never mixed bytes. Reads count their bytes in the process's statistics, unless
    ``count=False`` (a source that counts the records it returns). A context manager
    (closes on exit).

    Raises:
        FileNotFoundError: the file does not exist.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "f.bin")
        >>> _ = open(p, "wb").write(b"0123456789")
        >>> with ShardFile(0, p) as f:
        ...     f.size, [bytes(b) for b in f.read_ranges([(8, 10), (0, 2)])], bytes(f.read())
        (10, [b'89', b'01'], b'0123456789')
        >>> ShardFile(0, p).read_ranges([(8, 12)])
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: ...f.bin': bytes [8, 12) lie outside the file of 10 bytes
    """

    def __init__(
        self,
        shard: int,
        path: str,
        filesystem: fsspec.AbstractFileSystem | None = None,
        size: int = -1,
        *,
        watch: bool = True,
        count: bool = True,
        fresh: bool = False,
        seen: tuple | None = None,
    ) -> None:
        self.shard, self.path, self.filesystem, self._count = shard, path, filesystem, count
        self._fd: int | None = None
        self._pin: changes.Pin | None = None
        if filesystem is None:
            fd = changes.open_regular(path)
            try:
                if watch:
                    self._pin = changes.Pin(fd, path)
                #: The file's size in bytes.
                self.size: int = os.fstat(fd).st_size if self._pin is None else self._pin.size
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return
        self._rpath = filesystem._strip_protocol(path)
        self.size = size if size >= 0 else remote.file_size(filesystem, self._rpath, url=path)
        # Every answer must be of this version: the one found now by an opening (``fresh``),
        # else the one this process pinned when it opened the dataset.
        self._version = remote.Version(filesystem, self._rpath, self.size, seen, fresh)

    def read(self, *, max_bytes: int = MAX_FILE_BYTES) -> memoryview:
        """The whole file (read-only, not copied); a :class:`~torchgrain.CorruptDataError`
        when it holds more than ``max_bytes``."""
        return self.read_ranges([(0, self.size)], max_bytes=max_bytes)[0]

    def read_ranges(
        self, ranges: Sequence[tuple[int, int]], *, max_bytes: int = MAX_FILE_BYTES
    ) -> list[memoryview]:
        """Bytes ``[start, end)`` of each range, in the order given (remote ones coalesced
        and fetched together, or taken from what the batch fetched ahead). A range that is
        not two integers within the file, ranges of more than ``max_bytes`` in all, a file
        shorter than its size or changed since it was opened: a
        :class:`~torchgrain.CorruptDataError`."""
        ranges = self._checked(ranges, max_bytes)
        fs = self.filesystem
        if fs is not None:
            out = fetch_ranges(fs, self._rpath, ranges, name=self.path)
            self._version.check()  # (this process pinned another version since: raises)
        else:
            if self._fd is None:
                raise ValueError(f"I/O operation on closed file {self.path!r}")
            out = [memoryview(os.pread(self._fd, e - s, s)) for s, e in ranges]
            # After the reads: a change made before they ended is seen.
            if self._pin is not None:
                changes.check(self._pin, repr(self.path))
            for (s, e), got in zip(ranges, out):
                if len(got) != e - s:
                    raise CorruptDataError(
                        f"{self.path!r} is truncated: bytes [{s}, {e}) of a {self.size}-byte "
                        f"file ended after {len(got)}"
                    )
        if self._count:
            count_read(0, sum(e - s for s, e in ranges))
        return out

    def _checked(self, ranges: Sequence[tuple[int, int]], max_bytes: int) -> list[tuple[int, int]]:
        """``ranges`` as pairs of ints, each within the file and ``max_bytes`` in all."""
        out, total = [], 0
        for r in ranges:
            try:
                s, e = map(operator.index, r)  # (a float is refused, not truncated)
            except (TypeError, ValueError):
                raise CorruptDataError(f"{self.path!r}: {r!r} is not a byte range") from None
            if not 0 <= s <= e <= self.size:
                raise CorruptDataError(
                    f"{self.path!r}: bytes [{s}, {e}) lie outside the file of {self.size} bytes"
                )
            total += e - s
            out.append((s, e))
        if total > max_bytes:
            raise CorruptDataError(
                f"{self.path!r}: a read of {total} bytes, more than the {max_bytes} allowed"
            )
        return out

    def close(self) -> None:
        """Close the local file (a remote one holds nothing)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            if self._pin is not None:
                self._pin.release()
            os.close(fd)

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class ShardReader(Protocol):
    """An open shard: how many records it holds, and records read by row. Called from
    several threads (different shards' readers at once; keep shared state locked)."""

    def __len__(self) -> int: ...

    def read(self, rows: np.ndarray) -> list[dict[str, Any]]:
        """The records at ``rows`` (int64, in that order, repeats allowed)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ReadsByteRanges(Protocol):
    """What a :class:`ShardReader` adds to have its records' bytes fetched for it: a batch
    of a remote dataset is then fetched across all its shards at once (coalesced, many
    requests in flight, retried), and each shard decodes its rows from what arrived."""

    def byte_ranges(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """``(start, end)`` in the file of each record at ``rows``, one per row."""
        ...

    def decode(self, rows: np.ndarray, chunks: list[memoryview]) -> list[dict[str, Any]]:
        """The records at ``rows`` from the bytes of their :meth:`byte_ranges`."""
        ...


@runtime_checkable
class ShardFormat(Protocol):
    """A file format: its name, the name fragments of its files (``.parquet`` also finds
    ``x.parquet.zst``) and how to open one of them."""

    name: str
    suffixes: tuple[str, ...]

    def open(self, file: ShardFile) -> ShardReader:
        """A reader of ``file`` (which it may keep, and need not close)."""
        ...


@runtime_checkable
class ShardCounts(Protocol):
    """What :meth:`IndexesShards.index_shards` gives: each shard's record count and size in
    bytes (int64 arrays, one entry per shard, in dataset order)."""

    counts: np.ndarray
    sizes: np.ndarray


@runtime_checkable
class IndexesShards(Protocol):
    """What a :class:`ShardFormat` adds when it counts and sizes all its shards at once,
    without opening each (an index built once per machine, a manifest): a dataset of
    10,000 files then opens a shard only to read it, and a reader's count that differs
    from the index's is a :class:`~torchgrain.CorruptDataError` (the file changed). Each
    :class:`FormatSource` indexes a copy of the format (what it keeps is that source's)."""

    def index_shards(
        self, files: Sequence[str], filesystem: fsspec.AbstractFileSystem, options: ReadOptions
    ) -> ShardCounts:
        """The counts and sizes of ``files`` (on ``filesystem``, read as ``options`` say)."""
        ...


@runtime_checkable
class EncodedFormat(Protocol):
    """What a :class:`ShardFormat` adds when its records are encoded bytes that one codec
    decodes (TFRecord, ArrayRecord): its readers' ``read`` and ``decode`` (and
    :meth:`ReadsBatches.read_batch`) give each record's bytes, and the source decodes
    them: a batch in one call where the codec can (``decode_batch``), straight into
    columns for :meth:`FormatSource.read_columns` (``decode_columns``), and a record
    that does not decode is a :class:`~torchgrain.RecordDecodeError` naming its shard,
    row and record index. ``record_codec`` is read once the format has indexed its shards
    (a name of its own: a format with a ``codec`` whose readers decode is not one)."""

    record_codec: Codec


@runtime_checkable
class ReadsBatches(Protocol):
    """What a :class:`ShardFormat` adds when it reads a whole batch across its shards at
    once, faster than shard by shard (TFRecord maps every local file in one address
    range and plans a batch with numpy, with no Python step per file). The format holds
    what it reads with, per process (dropped when pickled, given up by :meth:`close`);
    its errors name the shard, file and record
    (:func:`name_error`)."""

    def read_batch(
        self, paths: Sequence[str], shards: np.ndarray, rows: np.ndarray, indices: np.ndarray
    ) -> list[Any] | None:
        """The records at ``rows`` of ``shards`` (global ``indices``, all checked; the
        dataset's files are ``paths``), in that order, or None to have them read shard by
        shard through the readers. The source has just read this process's file events
        (:func:`torchgrain.io.changes.poll`): checks of maps may pass ``polled=True``."""
        ...

    def read_one(self, paths: Sequence[str], shard: int, row: int, index: int) -> Any | None:
        """The record at ``row`` of ``shard`` (global ``index``) for ``source[index]``,
        cheaper than a batch of one, or None to read it as one."""
        ...

    def close(self) -> None:
        """Give up what this process reads batches with (it is made again when needed)."""
        ...


class _Shard:
    """A format's reader of one shard, the file it reads and its record count. Closed once
    no read uses it: the reader LRU may let it go while another thread reads it."""

    __slots__ = ("closed", "count", "file", "lock", "ranged", "reader", "users")

    def __init__(self, file: ShardFile, reader: ShardReader, count: int) -> None:
        self.file, self.reader, self.count = file, reader, count
        self.ranged = isinstance(reader, ReadsByteRanges)  # (asked once: ~10 us a time)
        self.lock = threading.Lock()
        self.users, self.closed = 0, False

    def use(self) -> bool:
        """Count a read of it; False when it is closed (open the shard again)."""
        with self.lock:
            self.users += not self.closed
            return not self.closed

    def done(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.closed and not self.users
        if last:
            self._close()

    def close(self) -> None:
        with self.lock:
            now = not self.closed and not self.users
            self.closed = True
        if now:
            self._close()

    def _close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.file.close()


class FormatSource(ShardedSource):
    """A source over the files of any :class:`ShardFormat`, read as ``options`` say.

    ``format`` is the format (a subclass may set it as a class attribute instead: such a
    class is what :meth:`Format.for_source <torchgrain.sources.Format.for_source>`
    registers). Each shard is opened here to count its records (remote ones concurrently
    on ``io_threads``, sized from the directory listing where it has sizes), and its
    reader kept for the reads (up to ``max_open_files``). A batch reads each of its shards
    once (remote ones concurrently, or fetched across all shards at once when the readers
    give :class:`ReadsByteRanges`), in request order, unless the format reads it whole
    (:class:`ReadsBatches`); a format of encoded records (:class:`EncodedFormat`) has
    them decoded here. ``keys`` and ``schema`` come from the first 1,000 records
    (:func:`~torchgrain.sources.merge_schema`). Design notes:
    docs/design-notes.md#sources-format.

    What the format raises: a torchgrain error or an ``OSError`` stays what it is; a bug
    of its code (``TypeError``, ``AttributeError``, ``NameError``, ``AssertionError``,
    ``NotImplementedError``, ``ImportError``) surfaces as itself, with a note naming the
    format, shard, file and record (Python 3.11+); anything else (``ValueError``,
    ``struct.error``, ``KeyError``, a library's own error...) is bad bytes: a
    CorruptDataError. A format that meets bad bytes as a ``TypeError`` raises a
    CorruptDataError itself.

    Raises:
        DatasetNotFoundError: no file of the format, or a missing shard (naming it).
        CorruptDataError: a shard the format cannot read, a reader that returns another
            number of records than asked, or byte ranges outside the file (naming the
            format, shard, file and the first record that fails alone).

    Example:
        >>> import os, tempfile, numpy as np, torchgrain as tg
        >>> class Lines:  # one record per line of a .lines file
        ...     name, suffixes = "lines", (".lines",)
        ...     def open(self, file):
        ...         return LinesReader(str(file.read(), "utf-8").splitlines())
        >>> class LinesReader:
        ...     def __init__(self, lines):
        ...         self.lines = lines
        ...     def __len__(self):
        ...         return len(self.lines)
        ...     def read(self, rows):
        ...         return [{"line": self.lines[r]} for r in rows.tolist()]
        ...     def close(self):
        ...         pass
        >>> d = tempfile.mkdtemp()
        >>> for i in range(2):
        ...     _ = open(os.path.join(d, f"{i}.lines"), "w").write(f"a{i}\\nb{i}\\n")
        >>> src = tg.FormatSource(d, format=Lines(), io_threads=2)
        >>> len(src), src.num_shards, src.__getitems__([3, 0]), src.schema
        (4, 2, [{'line': 'b1'}, {'line': 'a0'}], {'line': 'str'})
    """

    format: ClassVar[ShardFormat]

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        format: ShardFormat | None = None,
        options: ReadOptions | None = None,
        **read_options: Any,
    ) -> None:
        fmt = format if format is not None else getattr(type(self), "format", None)
        if fmt is None:
            raise TypeError("FormatSource needs a format= (or a subclass's format attribute)")
        self.format = fmt  # type: ignore[misc]
        self._schema: dict[str, str] | None = None
        # (the format's capabilities, asked once: a batch asks them again otherwise)
        self._encoded = isinstance(fmt, EncodedFormat)
        self._batches = isinstance(fmt, ReadsBatches)
        opts = ReadOptions.build(options, read_options)
        retry = opts.retry_policy
        fs, files = opts._expand(paths, fmt.suffixes, fmt.name)
        self._num_files = len(files)  # (for errors of the opening, before the index)
        where = None if is_local(fs) else fs
        if isinstance(fmt, IndexesShards):  # counted and sized without opening a shard
            # (a copy: the index it keeps is this source's, whoever else uses the format)
            fmt = self.format = copy.copy(fmt)  # type: ignore[misc]
            with using(retry):
                got = fmt.index_shards(files, fs, opts)
            sizes = dict(enumerate(np.asarray(got.sizes).tolist()))
            self._init_shards(
                filesystem=fs,
                paths=files,
                counts=got.counts,
                options=opts,
                cache_bytes=0,  # (a format's reader keeps what it decodes, if anything)
                sizes=sizes,
            )
            return
        with using(retry):  # the open-time requests keep to its deadlines
            listed = listed_sizes(fs, files) if where is not None else {}
        # The readers opened to count are kept for the reads, as many as the reader LRU
        # holds (none when a remote shard is read through its cached copy).
        limit = (
            self.default_max_open_files if opts.max_open_files == "auto" else opts.max_open_files
        )
        keep = 0 if where is not None and opts.cache_dir is not None else limit or len(files)
        opened: dict[int, _Shard] = {}
        counts = np.zeros(len(files), np.int64)
        sizes: dict[int, int] = {}

        def count(k: int) -> None:
            shard = self._open(k, files[k], where, listed.get(k, -1), retry, k < keep, True)
            counts[k], sizes[k] = shard.count, shard.file.size
            if k < keep:
                opened[k] = shard
            else:
                shard.close()

        try:  # (remote shards concurrently, on io_threads)
            map_files(count, len(files), max_workers=1 if where is None else opts.io_threads)
        except BaseException:
            for shard in opened.values():
                shard.close()
            raise
        self._init_shards(
            filesystem=fs, paths=files, counts=counts, options=opts, cache_bytes=0, sizes=sizes
        )
        self._proc().readers.update(sorted(opened.items()))

    # ---------------------------------------------------------------- contract
    @property
    def schema(self) -> dict[str, str]:
        """Record key -> value type, from the first 1,000 records (a key some lack is
        ``|null``, types that differ ``a|b``)."""
        if self._schema is None:
            schema: dict[str, str] = {}
            for record in iter_in_blocks(self, 0, min(len(self), SCHEMA_SAMPLE_FIRST), 128):
                schema = merge_schema(schema, record)
            self._schema = schema
        return dict(self._schema)

    def shard_integrity(self, shard: int) -> tuple[int | None, str | None]:
        """``(size, None)``: the size the shard had when the dataset was opened (a cached
        copy of another size is not served; a download of another size fails)."""
        return self.cache_fit.sizes.get(shard), None

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._batches:
            shard, row = self.index.locate_one(index)
            changes.poll()  # (read_one checks its maps with polled=True, as read_batch)
            t0 = time.perf_counter()
            got = self.format.read_one(self._paths, shard, row, int(index))  # type: ignore[attr-defined]
            if got is not None:
                if not self._encoded:
                    count_read(time.perf_counter() - t0, 0)
                    return got
                t1 = time.perf_counter()
                count_read(t1 - t0, len(got))
                got = self._decode(got, shard, row, int(index))
                count_decode(time.perf_counter() - t1)
                return got
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The records at ``indices``: the whole batch at once where the format reads
        batches (:class:`ReadsBatches`), else each shard read once, remote ones
        concurrently (or fetched together), in request order."""
        return self._records(self.index.check(indices), decode=self._encoded)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        """The records at ``indices`` as columns: for a format of encoded records
        (:class:`EncodedFormat`), decoded for the whole batch at once where the codec has
        a column form (``decode_columns``: msgpack, raw); else built from the records."""
        if not self._encoded:
            return super().read_columns(indices)
        idx = self.index.check(indices)
        if len(idx) == 0:
            return ColumnBatch.from_records([])
        blobs = self._records(idx)
        t0 = time.perf_counter()
        codec = self.format.record_codec  # type: ignore[attr-defined]
        batch = decode_columns(
            codec,
            blobs,
            lambda: decode_records(codec, blobs, named_rows(self.index, idx, self._describe)),
        )
        count_decode(time.perf_counter() - t0)
        return batch

    def close(self) -> None:
        """Close this process's readers (and what the format reads batches with)."""
        super().close()
        if self._batches:
            self.format.close()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(format={self.format.name!r}, num_records={len(self)}, "
            f"num_shards={self.num_shards})"
        )

    # ---------------------------------------------------------------- reading
    def _records(self, idx: np.ndarray, *, decode: bool = False) -> list[Any]:
        """The records at checked indices ``idx``, in request order (an encoded format's
        as their bytes, unless ``decode``): the format's batch read where it has one, else
        shard by shard (each shard's decoded as soon as it is read, while the rest
        arrive). This process's file events are read once for it
        (:func:`torchgrain.io.changes.poll`): :meth:`ReadsBatches.read_batch` and a
        reader's :meth:`ReadsByteRanges.decode` may check their maps with
        ``polled=True``."""
        changes.poll()
        if self._batches and len(idx):
            t0 = time.perf_counter()
            shards, rows = self.index.locate(idx, checked=True)
            got = self.format.read_batch(self._paths, shards, rows, idx)  # type: ignore[attr-defined]
            if got is not None:
                if len(got) != len(idx):
                    raise CorruptDataError(
                        f"the {self.format.name} format's read_batch returned {len(got)} "
                        f"records for {len(idx)} indices"
                    )
                count_read(time.perf_counter() - t0, sum(map(len, got)) if self._encoded else 0)
                return self._decode_all(got, idx) if decode else got

        def group(g: tuple[int, np.ndarray, Any], reader: _Shard | None = None) -> list[Any]:
            got = self._read_group(g[0], g[1], reader)
            return self._decode_all(got, idx if g[2] is None else idx[g[2]]) if decode else got

        return self._read_shard_groups(self.index.split(idx), len(idx), group)

    def _decode_all(self, blobs: list[Any], idx: np.ndarray) -> list[dict[str, Any]]:
        """The records ``blobs`` at indices ``idx`` decoded (:func:`decode_records`)."""
        t0 = time.perf_counter()
        codec = self.format.record_codec  # type: ignore[attr-defined]
        out = decode_records(codec, blobs, named_rows(self.index, idx, self._describe))
        count_decode(time.perf_counter() - t0)
        return out

    def _describe(self, shard: int) -> str:
        return self._where(shard, self._paths[shard])

    def _decode(self, data: Any, shard: int, row: int, index: int) -> dict[str, Any]:
        """Record ``index`` (``row`` of ``shard``) decoded (:func:`decode_record`)."""
        where = lambda: self._describe(shard)  # noqa: E731
        return decode_record(self.format.record_codec, data, where, row, index)  # type: ignore[attr-defined]

    def _open(
        self,
        shard: int,
        path: str,
        fs: fsspec.AbstractFileSystem | None,
        size: int,
        retry: RetryPolicy,
        watch: bool = True,
        fresh: bool = False,
        seen: tuple | None = None,
    ) -> _Shard:
        """Open and count ``shard`` with the format (remote ones retried), errors naming it
        (``fresh``, ``seen``: as :class:`ShardFile`'s)."""

        def attempt() -> _Shard:
            file = ShardFile(shard, path, fs, size, watch=watch, fresh=fresh, seen=seen)
            try:
                reader = self.format.open(file)
                return _Shard(file, reader, len(reader))
            except BaseException:
                file.close()
                raise

        try:
            if fs is None:
                return attempt()
            return retry_call(attempt, url=path, policy=retry, what=f"open of shard {shard}")
        except Exception as e:
            named = self._named(e, shard, path, None)
            if named is None:
                raise
            raise named from e

    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> _Shard:
        # The version the dataset's opening read: one a later opening pinned is refused.
        size = self.cache_fit.sizes.get(shard, -1)
        seen = self._held_version(shard)
        opened = self._open(shard, path, filesystem, size, self._retry, seen=seen)
        n, want = opened.count, int(self.index.counts[shard])
        if n != want:
            opened.close()
            raise _mark(
                CorruptDataError(
                    f"{self._where(shard, path)} holds {n} records where the dataset counted "
                    f"{want} when it was opened: the file changed"
                ),
                None,
            )
        return opened

    def _using(self, k: int, shard: _Shard | None, fn: Callable[[_Shard], T]) -> T:
        """``fn`` of this process's reader of shard ``k`` (or ``shard``), which stays open
        meanwhile (one the reader LRU closed before the read began is opened again)."""
        s = shard or self._reader(k)
        while not s.use():
            s = self._reader(k)
        try:
            return fn(s)
        finally:
            s.done()

    def _ranges(self, s: _Shard, rows: np.ndarray) -> list[tuple[int, int]]:
        """The byte ranges of ``rows``, one per row (checked against the file when read)."""
        ranges = s.reader.byte_ranges(rows)  # type: ignore[attr-defined]
        if len(ranges) != len(rows):
            raise CorruptDataError(
                f"the reader gave {len(ranges)} byte ranges for {len(rows)} records"
            )
        return ranges

    def _batch_ranges(
        self, groups: Sequence[tuple[int, np.ndarray, np.ndarray | None]]
    ) -> list[tuple[str, str, list[tuple[int, int]]]] | None:
        def planned(s: _Shard, k: int, rows: np.ndarray) -> tuple[str, str, list] | None:
            if not s.ranged:
                return None  # each shard's read fetches its own
            ranges = self._in_shard(
                lambda r: s.file._checked(_unique(self._ranges(s, r))[0], _ceiling(s)), k, rows
            )
            return (s.file._rpath, s.file.path, ranges)

        # The shards not open in this process are opened concurrently (a remote open may
        # ask the file's size); planning on threads costs more than it saves.
        readers = self._proc().readers
        list(self._map(self._reader, [g[0] for g in groups if g[0] not in readers]))
        files = [self._using(g[0], None, lambda s, g=g: planned(s, *g[:2])) for g in groups]
        return None if None in files else files  # type: ignore[return-value]

    def _read_group(
        self, k: int, rows: np.ndarray, shard: _Shard | None = None
    ) -> list[dict[str, Any]]:
        """The records at ``rows`` of shard ``k`` (one read), errors naming them."""

        def read(s: _Shard, rows: np.ndarray) -> list[dict[str, Any]]:
            t0 = time.perf_counter()
            if s.ranged:
                unique, where = _unique(self._ranges(s, rows))
                got = s.file.read_ranges(unique, max_bytes=_ceiling(s))
                chunks = got if isinstance(where, range) else [got[j] for j in where]
                t1 = time.perf_counter()
                count_read(t1 - t0, 0)  # (ShardFile counts the bytes)
                records = s.reader.decode(rows, chunks)
                count_decode(time.perf_counter() - t1)
            else:
                records = s.reader.read(rows)
                count_read(time.perf_counter() - t0, 0)
            if len(records) != len(rows):
                raise CorruptDataError(
                    f"the reader returned {len(records)} records for {len(rows)} rows"
                )
            return list(records)

        what = f"read of shard {k} (record index {int(self.index.offsets[k] + rows[0])})"
        return self._in_shard(
            lambda r: self._io(lambda: self._using(k, shard, lambda s: read(s, r)), k, what),
            k,
            rows,
        )

    def _in_shard(self, fn: Callable[[np.ndarray], T], k: int, rows: np.ndarray) -> T:
        """``fn(rows)``, its errors naming the format, shard ``k``, file and record: of bad
        data in several rows, the first row that fails alone."""
        try:
            return fn(rows)
        except Exception as e:
            base = int(self.index.offsets[k])
            named = self._named(e, k, self._paths[k], base + int(rows[0]))
            if isinstance(named, CorruptDataError) and len(rows) > 1 and not _is_named(e):
                for j in range(len(rows)):
                    try:
                        fn(rows[j : j + 1])
                    except Exception as alone:
                        one = self._named(alone, k, self._paths[k], base + int(rows[j]))
                        if isinstance(one, CorruptDataError):
                            raise one from alone
                        break
            if named is None:
                raise
            raise named from e

    def _where(self, shard: int, path: str) -> str:
        return shard_where(self.format.name, shard, self._num_files, path)

    def _named(self, e: Exception, shard: int, path: str, index: int | None) -> Exception | None:
        return name_error(e, self._where(shard, path), index)


def shard_where(name: str, shard: int, num_shards: int, path: str) -> str:
    """The one way an error names a shard: its format, number and file.

    Example:
        >>> shard_where("TFRecord", 2, 8, "/d/b.tfrecord")
        "TFRecord shard 2 of 8 '/d/b.tfrecord'"
    """
    return f"{name} shard {shard} of {num_shards} {path!r}"


def name_error(e: Exception, where: str, index: int | None) -> Exception | None:
    """``e`` as a torchgrain error that ends with ``(<where>, record index <index>)``, the
    one wording of every shard's read (``where`` from :func:`shard_where`; ``index``
    None for a shard's open), or None to raise ``e`` as it is: a torchgrain error or
    ``OSError`` stays what it is; a missing file is a DatasetNotFoundError, a directory
    in a shard's place a CorruptDataError; a bug
    (:data:`BUGS`) gets a note; anything else is bad bytes, a CorruptDataError. An
    error named once is named again only to add the record its open lacked.

    Example:
        >>> e = name_error(CorruptDataError("bad frame"), "TFRecord shard 2 of 8 'b'", 17)
        >>> str(e), name_error(e, "TFRecord shard 2 of 8 'b'", 17) is None
        ("bad frame (TFRecord shard 2 of 8 'b', record index 17)", True)
    """
    at = "" if index is None else f"record index {index}"
    # (bad bytes that are also a NotImplementedError, TransposedChunkError, are bad bytes)
    bug = isinstance(e, BUGS) and not isinstance(e, CorruptDataError)
    if _is_named(e):  # named without its record (by the shard's open): add it
        if not at or e._torchgrain_at is not None or bug:  # type: ignore[attr-defined]
            return None
        return _mark(type(e)(f"{e} ({at})"), index)
    where = where + (f", {at}" if at else "")
    if bug:
        if hasattr(e, "add_note"):  # (Python 3.11+)
            e.add_note(f"raised reading {where}")
        _mark(e, None)
        return None
    if isinstance(e, CorruptDataError):
        return _mark(type(e)(f"{e} ({where})"), index)
    if isinstance(e, FileNotFoundError) and not isinstance(e, TorchgrainError):
        return _mark(DatasetNotFoundError(f"{where} does not exist: {e}"), index)
    if isinstance(e, IsADirectoryError) and not isinstance(e, TorchgrainError):
        return _mark(CorruptDataError(f"{e.filename!r} is not a regular file ({where})"), index)
    if isinstance(e, (TorchgrainError, OSError)):
        return None
    return _mark(CorruptDataError(f"{where}: {type(e).__name__}: {e}"), index)


def decode_record(
    codec: Codec, data: Any, where: Callable[[], str], row: int, index: int
) -> dict[str, Any]:
    """Record ``index`` (``row`` of the shard ``where()`` names, :func:`shard_where`, asked
    only on a failure) decoded from ``data``; a :class:`~torchgrain.RecordDecodeError`
    naming it when it does not decode.

    Example:
        >>> from torchgrain.formats.codecs import get_codec
        >>> decode_record(get_codec("msgpack"), bytes([0xC1]), lambda: "shard 0 'a'", 4, 9)
        Traceback (most recent call last):
        ...
        torchgrain.errors.RecordDecodeError: cannot decode record 9 (shard 0 'a', row 4) with codec 'msgpack': ...
    """
    try:
        return codec.decode(data)
    except Exception as e:
        detail = str(e) if isinstance(e, RecordDecodeError) else f"{type(e).__name__}: {e}"
        raise RecordDecodeError(
            f"cannot decode record {index} ({where()}, row {row}) with codec "
            f"{codec.name!r}: {detail}"
        ) from (None if isinstance(e, RecordDecodeError) else e)


def named_rows(
    index: ShardIndex, idx: np.ndarray, describe: Callable[[int], str]
) -> Callable[[], Iterator[tuple[str, int, int]]]:
    """:func:`decode_records`'s ``where`` for checked indices ``idx`` of ``index``: each
    one's shard (as ``describe(shard)`` names it, :func:`shard_where`), row and index.

    Example:
        >>> from torchgrain.sources.index import ShardIndex
        >>> list(named_rows(ShardIndex([2, 3]), np.array([4, 0]), lambda k: f"shard {k}")())
        [('shard 1', 2, 4), ('shard 0', 0, 0)]
    """

    def where() -> Iterator[tuple[str, int, int]]:
        shards, rows = index.locate(idx, checked=True)
        for k, row, i in zip(shards.tolist(), rows.tolist(), idx.tolist()):
            yield describe(k), row, i

    return where


def decode_records(
    codec: Codec, blobs: list[Any], where: Callable[[], Iterable[tuple[str, int, int]]]
) -> list[dict[str, Any]]:
    """``blobs`` decoded in one call where the codec can (``decode_batch``), else one by
    one; of a failure, the first record that does not decode is named
    (:func:`decode_record`; ``where()`` gives each blob's shard, row and index, asked only
    then).

    Example:
        >>> from torchgrain.formats.codecs import get_codec
        >>> decode_records(get_codec("raw"), [b"a", b"b"], lambda: [])
        [{'bytes': b'a'}, {'bytes': b'b'}]
    """
    try:
        out = codec.decode_batch(blobs)
    except Exception:
        out = None  # one by one below, to name the record
    if out is None:
        decode = codec.decode
        try:
            out = [decode(b) for b in blobs]
        except Exception:
            # Find the culprit (the calls above do not track positions).
            for b, (at, row, index) in zip(blobs, where()):
                decode_record(codec, b, lambda at=at: at, row, index)
            raise
    return out


def decode_columns(
    codec: Codec, blobs: list[Any], records: Callable[[], list[dict[str, Any]]]
) -> ColumnBatch:
    """``blobs`` as columns, decoded for the whole batch at once where the codec has a
    column form (``decode_columns``: msgpack, raw), else built from ``records()`` (also
    where the batch decoder fails: the records one by one name the culprit).

    Example:
        >>> from torchgrain.formats.codecs import get_codec
        >>> decode_columns(get_codec("raw"), [b"ab", b"c"], lambda: []).records()
        [{'bytes': b'ab'}, {'bytes': b'c'}]
    """
    lengths = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
    ends = np.cumsum(lengths)
    try:
        batch = codec.decode_columns(_joined(blobs, ends), ends - lengths, ends)
    except Exception:
        batch = None
    if batch is None:  # no column form, or not a uniform batch: from the records
        batch = ColumnBatch.from_records(records())
    return batch


def _joined(blobs: list[Any], ends: np.ndarray) -> np.ndarray:
    """The blobs one after the other in one buffer (recycled when large)."""
    total = int(ends[-1]) if len(ends) else 0
    buf = scratch(total)
    if total < (1 << 20):
        buf[:] = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        return buf
    # (large: one copy, not a joined bytes copied again)
    return np.concatenate([np.frombuffer(b, dtype=np.uint8) for b in blobs], out=buf)


def _unique(
    ranges: Sequence[tuple[int, int]],
) -> tuple[list[tuple[int, int]], Sequence[int]]:
    """The distinct ``ranges`` (a batch may ask a record twice), and where each of
    ``ranges`` is among them (a ``range`` when they are all distinct: one set, no Python
    step per range).

    Example:
        >>> _unique([(5, 9), (0, 2), (5, 9)])
        ([(5, 9), (0, 2)], [0, 1, 0])
        >>> _unique([(5, 9), (0, 2)])
        ([(5, 9), (0, 2)], range(0, 2))
    """
    try:
        if len(set(ranges)) == len(ranges):
            return list(ranges), range(len(ranges))
    except TypeError:  # (unhashable pairs: lists)
        pass
    first: dict[tuple[int, int], int] = {}
    where = [first.setdefault(tuple(r), len(first)) for r in ranges]  # type: ignore[misc]
    return list(first), where


def _ceiling(s: _Shard) -> int:
    """The most bytes one read of shard ``s``'s distinct ranges may take: its file's
    size where that is more than :data:`MAX_FILE_BYTES` (the records of a batch, however
    large, lie within their file; ranges outside it are refused)."""
    return max(MAX_FILE_BYTES, s.file.size)


def _mark(e: Exception, index: int | None) -> Exception:
    """``e``, marked as naming its shard (and record ``index``, when not None): a later
    step adds only what it lacks."""
    e._torchgrain_at = index  # type: ignore[attr-defined]
    return e


def _is_named(e: BaseException) -> bool:
    return hasattr(e, "_torchgrain_at")
