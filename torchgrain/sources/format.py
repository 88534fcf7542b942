"""The contract a file format implements, and the source torchgrain builds around it.

A format says how to open one shard file (:class:`ShardFormat`) and how to read records
of an open shard (:class:`ShardReader`); a reader that can also say where its records'
bytes lie (:class:`ReadsByteRanges`) lets a remote batch be fetched across all its shards
at once. :class:`FormatSource` is the rest, the same as for the built-in formats: file
listing, per-process readers that survive ``fork``, the open-file LRU, retries,
``io_threads``, the shard cache (``cache_dir``), read-ahead, cache-fit checks, the
``tg.stats`` counters, small pickles and errors that name the shard, file and record.
A format reads its file only through :class:`ShardFile` (bounded whole-file reads and
checked byte ranges), never through fsspec itself. docs/sources.md has a complete example.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import fsspec
import numpy as np

from torchgrain.diagnostics import count_decode, count_read
from torchgrain.errors import CorruptDataError, DatasetNotFoundError, TorchgrainError
from torchgrain.formats.codecs import describe_value
from torchgrain.io import process, remote
from torchgrain.io.fs import expand_paths, is_local
from torchgrain.io.ranges import fetch_ranges
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.sources.base import ShardedSource
from torchgrain.sources.options import ReadOptions

__all__ = ["FormatSource", "ReadsByteRanges", "ShardFile", "ShardFormat", "ShardReader"]

#: The most bytes :meth:`ShardFile.read` reads unless told otherwise.
MAX_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class ShardFile:
    """One shard file, opened for reading: its number in the dataset, its path or URL and
    its filesystem (None for a local file). A local file is held open (a copy in the shard
    cache stays readable once evicted) until :meth:`close`; a remote one is pinned to the
    size and version it has now (a file replaced later is an error, never mixed bytes).

    Raises:
        FileNotFoundError: the file does not exist.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "f.bin")
        >>> _ = open(p, "wb").write(b"0123456789")
        >>> f = ShardFile(0, p)
        >>> f.size, [bytes(b) for b in f.read_ranges([(8, 10), (0, 2)])], f.read(max_bytes=10)
        (10, [b'89', b'01'], b'0123456789')
        >>> f.read_ranges([(8, 12)])
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: ...f.bin': bytes [8, 12) lie outside the file of 10 bytes
        >>> f.close()
    """

    shard: int
    path: str
    filesystem: fsspec.AbstractFileSystem | None = None
    #: The file's size in bytes (for a remote file: asked when not given).
    size: int = -1
    _fd: int | None = field(default=None, init=False, repr=False, compare=False)
    _seen: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fs = self.filesystem
        if fs is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            object.__setattr__(self, "_fd", fd)
            object.__setattr__(self, "size", os.fstat(fd).st_size)
            return
        path = fs._strip_protocol(self.path)
        if self.size < 0:
            object.__setattr__(self, "size", remote.file_size(fs, path, url=self.path))
        remote.pin(fs, path, self.size)  # every answer must be of this version of the file
        object.__setattr__(self, "_seen", remote.unchanged_since(fs, path, None))

    def read(self, *, max_bytes: int = MAX_FILE_BYTES) -> bytes:
        """The whole file; a :class:`~torchgrain.CorruptDataError` when it holds more than
        ``max_bytes``."""
        if self.size > max_bytes:
            raise CorruptDataError(
                f"{self.path!r} is {self.size} bytes, more than the {max_bytes} allowed"
            )
        return bytes(self.read_ranges([(0, self.size)])[0])

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Bytes ``[start, end)`` of each range, in the order given (remote ones coalesced
        and fetched together, or taken from what the batch fetched ahead); a range outside
        the file or a file shorter than its size is a :class:`~torchgrain.CorruptDataError`."""
        bad = _outside(ranges, self.size)
        if bad is not None:
            s, e = ranges[bad]
            raise CorruptDataError(
                f"{self.path!r}: bytes [{s}, {e}) lie outside the file of {self.size} bytes"
            )
        fs = self.filesystem
        if fs is not None:
            path = fs._strip_protocol(self.path)
            got = fetch_ranges(fs, path, ranges, name=self.path)
            # Raises if this process has pinned another version of the file since.
            object.__setattr__(self, "_seen", remote.unchanged_since(fs, path, self._seen))
            return got
        assert self._fd is not None
        out = [memoryview(os.pread(self._fd, e - s, s)) for s, e in ranges]
        for (s, e), got in zip(ranges, out):
            if len(got) != e - s:
                raise CorruptDataError(
                    f"{self.path!r} is truncated: bytes [{s}, {e}) of a {self.size}-byte file "
                    f"ended after {len(got)}"
                )
        return out

    def close(self) -> None:
        """Close the local file (a remote one holds nothing)."""
        fd = self._fd
        if fd is not None:
            object.__setattr__(self, "_fd", None)
            os.close(fd)


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


class ShardFormat(Protocol):
    """A file format: its name, the name fragments of its files (``.parquet`` also finds
    ``x.parquet.zst``) and how to open one of them."""

    name: str
    suffixes: tuple[str, ...]

    def open(self, file: ShardFile) -> ShardReader:
        """A reader of ``file`` (which it may keep, and need not close)."""
        ...


class _Shard:
    """A format's reader of one shard and the file it reads."""

    __slots__ = ("file", "reader")

    def __init__(self, file: ShardFile, reader: ShardReader) -> None:
        self.file, self.reader = file, reader

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.file.close()


class FormatSource(ShardedSource):
    """A source over the files of any :class:`ShardFormat`, read as ``options`` say.

    ``format`` is the format (a subclass may set it as a class attribute instead: such a
    class is what :meth:`Format.for_source <torchgrain.sources.Format.for_source>`
    registers). Each shard is opened once here to count its records (remote ones
    concurrently on ``io_threads``); a batch reads each of its shards once (remote ones
    concurrently, or fetched across all shards at once when the readers give
    :class:`ReadsByteRanges`), in request order. ``keys`` and ``schema`` come from the
    first record.

    Raises:
        DatasetNotFoundError: no file of the format, or a missing shard (naming it).
        CorruptDataError: a shard the format cannot read, a reader that returns another
            number of records than asked, or byte ranges outside the file (naming the
            format, shard, file and record index).

    Example:
        >>> import os, tempfile, numpy as np, torchgrain as tg
        >>> class Lines:  # one record per line of a .lines file
        ...     name, suffixes = "lines", (".lines",)
        ...     def open(self, file):
        ...         return LinesReader(file.read().decode().splitlines())
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
        opts = ReadOptions.build(options, read_options)
        fs, files = expand_paths(
            paths,
            suffixes=fmt.suffixes,
            storage_options=opts.storage_options,
            filesystem=opts.filesystem,
            kind=fmt.name,
            allow_external=opts.allow_external_paths,
        )
        self._schema: dict[str, str] | None = None
        retry = opts.retry or RetryPolicy()
        where = None if is_local(fs) else fs

        def count(k: int) -> tuple[int, int]:
            shard = self._open(k, files[k], where, -1, retry)
            try:
                return len(shard.reader), shard.file.size
            finally:
                shard.close()

        if where is not None and opts.io_threads > 1 and len(files) > 1:
            with process.thread_pool(opts.io_threads, "torchgrain-open") as pool:
                counted = list(pool.map(count, range(len(files))))
        else:
            counted = [count(k) for k in range(len(files))]
        self._init_shards(
            filesystem=fs,
            paths=files,
            counts=np.array([n for n, _ in counted], dtype=np.int64),
            options=opts,
        )
        self._sizes = {k: size for k, (_, size) in enumerate(counted)}

    # ---------------------------------------------------------------- contract
    @property
    def schema(self) -> dict[str, str]:
        """Record key -> value type, from the first record."""
        if self._schema is None:
            first = self.__getitems__([0]) if len(self) else [{}]
            self._schema = {k: describe_value(v) for k, v in first[0].items()}
        return dict(self._schema)

    @property
    def keys(self) -> list[str]:
        return list(self.schema)

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The records at ``indices``: each shard read once, remote ones concurrently (or
        fetched together), in request order."""
        idx = self.index.check(indices)
        groups = self.index.split(idx)
        early: dict[int, Any] = {}
        fetched = self._prefetch_ranges(
            groups,
            read=(lambda k: self._read_group(groups[k][0], groups[k][1]))
            if len(groups) > 1
            else None,
            early=early,
        )
        try:
            opened = self._prefetch_copies([g[0] for g in groups])

            def one(k: int) -> list[dict[str, Any]]:
                got = early.pop(k, None)
                if isinstance(got, BaseException):
                    raise got  # raised in the group's turn, as a read now would
                return (
                    got
                    if got is not None
                    else self._read_group(*groups[k][:2], opened.get(groups[k][0]))
                )

            results = (
                [one(k) for k in range(len(groups))]
                if fetched
                else self._map(one, range(len(groups)))
            )
            out: list[Any] = [None] * len(idx)
            for (_, _, positions), records in zip(groups, results):
                if positions is None:
                    out = records
                for p, record in zip([] if positions is None else positions.tolist(), records):
                    out[p] = record
            if opened:
                self._close_evicted_copies()
            return out
        finally:
            self._release_ranges(fetched)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(format={self.format.name!r}, num_records={len(self)}, "
            f"num_shards={self.num_shards})"
        )

    # ---------------------------------------------------------------- reading
    def _open(
        self,
        shard: int,
        path: str,
        fs: fsspec.AbstractFileSystem | None,
        size: int,
        retry: RetryPolicy,
    ) -> _Shard:
        """Open ``shard`` with the format (remote ones retried), errors naming it."""

        def attempt() -> _Shard:
            file = ShardFile(shard, path, fs, size)
            try:
                return _Shard(file, self.format.open(file))
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
        opened = self._open(shard, path, filesystem, self._sizes.get(shard, -1), self._retry)
        n, want = len(opened.reader), int(self.index.counts[shard])
        if n != want:
            opened.close()
            raise CorruptDataError(
                f"{self.format.name} shard {shard} {path!r} holds {n} records where the "
                f"dataset counted {want} when it was opened: the file changed"
            )
        return opened

    def _ranges(self, shard: _Shard, k: int, rows: np.ndarray) -> list[tuple[int, int]]:
        """The byte ranges of ``rows`` of shard ``k``, checked: one per row, in the file."""
        ranges = [(int(s), int(e)) for s, e in shard.reader.byte_ranges(rows)]  # type: ignore[attr-defined]
        size = shard.file.size
        bad = 0 if len(ranges) != len(rows) else _outside(ranges, size)
        if bad is not None:
            wrong = (
                f"{len(ranges)} byte ranges for {len(rows)} records"
                if len(ranges) != len(rows)
                else f"bytes {list(ranges[bad])} of a {size}-byte file"
            )
            raise CorruptDataError(
                f"{self.format.name} shard {k} {shard.file.path!r}: the reader gave {wrong} "
                f"(record index {int(self.index.offsets[k] + rows[bad])})"
            )
        return ranges

    def _batch_ranges(
        self, groups: Sequence[tuple[int, np.ndarray, np.ndarray | None]]
    ) -> list[tuple[str, str, list[tuple[int, int]]]] | None:
        shards = list(self._map(self._reader, [g[0] for g in groups]))
        if not all(isinstance(s.reader, ReadsByteRanges) for s in shards):
            return None  # each shard's read fetches its own
        return [
            (self._fs._strip_protocol(s.file.path), s.file.path, self._ranges(s, k, rows))
            for (k, rows, _), s in zip(groups, shards)
        ]

    def _read_group(
        self, k: int, rows: np.ndarray, shard: _Shard | None = None
    ) -> list[dict[str, Any]]:
        """The records at ``rows`` of shard ``k`` (one read), errors naming them."""

        def read() -> list[dict[str, Any]]:
            s = shard or self._reader(k)  # (here: a cached copy stays open for the read)
            t0 = time.perf_counter()
            if isinstance(s.reader, ReadsByteRanges):
                chunks = s.file.read_ranges(self._ranges(s, k, rows))
                t1 = time.perf_counter()
                count_read(t1 - t0, sum(len(c) for c in chunks))
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

        first = int(self.index.offsets[k] + rows[0])
        try:
            return self._io(read, k, f"read of shard {k} (record index {first})")
        except Exception as e:
            named = self._named(e, k, self._paths[k], first)
            if named is None:
                raise
            raise named from e

    def _named(self, e: Exception, shard: int, path: str, index: int | None) -> Exception | None:
        """``e`` as a torchgrain error naming the format, shard, file and record index (a
        missing file a DatasetNotFoundError, anything else not an I/O error, what the
        format raised on bad bytes, a CorruptDataError), or None to raise it as it is."""
        where = f"{self.format.name} shard {shard} {path!r}" + (
            "" if index is None else f", record index {index}"
        )
        if isinstance(e, CorruptDataError):
            if f"shard {shard} " not in str(e):
                return type(e)(f"{e} ({where})")
            return (
                None
                if index is None or "record index" in str(e)
                else type(e)(f"{e} (record index {index})")
            )
        if isinstance(e, FileNotFoundError) and not isinstance(e, TorchgrainError):
            return DatasetNotFoundError(f"{where} does not exist: {e}")
        if isinstance(e, (TorchgrainError, OSError)):
            return None
        return CorruptDataError(f"{where}: {type(e).__name__}: {e}")


def _outside(ranges: Sequence[tuple[int, int]], size: int) -> int | None:
    """The position of the first range not within a file of ``size`` bytes, or None."""
    for k, (s, e) in enumerate(ranges):
        if not 0 <= s <= e <= size:
            return k
    return None
