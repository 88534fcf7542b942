"""How one row group of a Parquet dataset gets into memory: decoded from its file, or
mapped from the node's decoded disk cache.

:class:`RowGroupLoader` is the part of :class:`~torchgrain.ParquetSource` below the
batch: per-process readers of the files (:class:`ParquetReader`: pyarrow's reader, one
read at a time), the decode of a row group's selected columns (bounded by
``max_row_group_bytes`` before pyarrow allocates, counted against the footer and then
the columns' page headers (:mod:`torchgrain.formats.parquet_pages`), widened to the
dataset's merged schema), and the decoded disk cache
(:class:`~torchgrain.sources.parquet.decoded_cache.DecodedCache`) that holds decoded row
groups for every process of the machine (:func:`decoded_cache_for` resolves the
``decoded_cache=`` option). The source fills in the row-group index this part reads.

Example:
    >>> import tempfile, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_parquet([{"x": i} for i in range(5)], d)
    >>> src = tg.ParquetSource(d, decoded_cache=False)
    >>> isinstance(src, RowGroupLoader), src._load(0, 0).table.num_rows
    (True, 5)
    >>> decoded_cache_for(False, None, 1 << 40, 0) is None
    True
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import warnings
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    UnsafePathError,
)
from torchgrain.formats.parquet_pages import ColumnChunk, chunk_pages, chunk_range, footer_chunks
from torchgrain.io import changes, remote
from torchgrain.io.fs import default_cache_dir
from torchgrain.sources.base import ShardedSource
from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key, on_network_filesystem
from torchgrain.sources.parquet.footers import (
    NOT_THE_BYTES,
    bounded_footer,
    footer_bytes,
    local_version,
)
from torchgrain.sources.parquet.values import RowGroup, holds_time_ns, inexact_time

__all__ = ["ParquetReader", "RowGroupLoader", "StagedInput", "decoded_cache_for"]

# What a row group mapped from the decoded disk cache is charged in the in-memory cache:
# its bookkeeping, and a share of the maps a process keeps: at most _MAX_MAPS per
# source, whatever cache_bytes (a process can hold vm.max_map_count maps, 65,530 by
# default, and past that every mmap fails, malloc's for large blocks included).
_MAPPED_BYTES = 64 << 10
_MAX_MAPS = 4096
# decoded_cache="auto" turns the disk cache on when the selected columns' decoded size
# (estimated from the footers) exceeds both cache_bytes and this.
_AUTO_MIN_BYTES = 256 << 20


class RowGroupLoader(ShardedSource):
    """Reading one row group of a Parquet dataset (see the module docstring); the
    source's constructor sets the attributes below."""

    # Row-group index (numpy, one entry per row group): global row offsets (R + 1),
    # owning shard, number within its file.
    _rg_offsets: np.ndarray
    _rg_shard: np.ndarray
    _rg_local: np.ndarray
    _file_fields: list[pa.Field]  # the merged schema of the files' selected columns
    _file_schema: pa.Schema
    _schema_bytes: bytes
    _present: np.ndarray  # bool (num_shards, num_file_columns)
    _row_bytes: np.ndarray  # least bytes a row of each file takes, decoded
    _identities: list[tuple[Any, ...]]  # what each file's decoded-cache entries hash
    _verify: bool
    max_row_group_bytes: int
    int96_timestamp_unit: str  # "ns", "us", "ms" or "s"
    decoded_cache: DecodedCache | None

    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> ParquetReader:
        handle = fd = staged = None
        try:
            if filesystem is None:
                # pre_buffer coalesces reads through Arrow's I/O threads, which pays on
                # object storage; on a local file it only adds thread hand-offs (block
                # reads measured 15-35% faster without, most on small row groups).
                # Page headers are read through a descriptor of our own (same inode).
                fd = changes.open_regular(path)  # (before pyarrow's open: a FIFO blocks it)
                version = local_version(os.fstat(fd))
                seen = None if self._remote else self._identities[shard][1]
                if seen is not None and version[:3] != seen[:3]:  # (replaced: not read)
                    raise CorruptDataError(  # (a cached copy's footer digest is checked)
                        "it changed since the dataset was opened (its size, modification "
                        "time or inode): open it again"
                    )
                # Arrow opens the file our descriptor holds, not what the path names by
                # then (a file swapped in between would be read at this one's offsets).
                proc_fd = f"/proc/self/fd/{fd}"
                source = proc_fd if os.path.exists(proc_fd) else path
                with open(fd, "rb", closefd=False) as f:
                    footer = self._checked_footer(shard, f)  # (bounded: named if damaged)
                if seen is not None and version != seen:
                    raise CorruptDataError(
                        "it changed since the dataset was opened (its change time: written "
                        "in place with its size and times put back, or its mode, owner or "
                        "links changed): open it again"
                    )
            else:
                # Reads are range requests with a deadline, checked to bring back exactly
                # the bytes asked for, through a read-ahead buffer like fsspec's own
                # (neighbouring row groups often come in one request).
                # The size the footer read found at open (pinned: answers of another
                # file are refused), and no size lookup here.
                # Of the version the dataset's opening read: one a later opening pinned is
                # refused, not read at the old footer's offsets.
                # (keyed as every pin of the file is: the path without its protocol)
                rpath = filesystem._strip_protocol(path)
                handle = remote.open_input(
                    filesystem,
                    rpath,
                    url=path,
                    size=self._identities[shard][1][0],
                    seen=self._held_version(shard),
                )
                raw = handle.raw if isinstance(handle, io.BufferedReader) else None
                if isinstance(raw, remote.RemoteFile):
                    # Column chunks are fetched once, their page headers checked, and
                    # Arrow decodes from the same bytes (StagedInput).
                    staged = StagedInput(handle, filesystem, rpath)
                source = staged or handle
                footer = self._checked_footer(shard, source)
            # Arrow reads no footer of its own: the one the dataset's opening read.
            pf = pq.ParquetFile(
                source,
                metadata=footer[0],
                pre_buffer=filesystem is not None,
                page_checksum_verification=self._verify,
                coerce_int96_timestamp_unit=self.int96_timestamp_unit,
            )
        except FileNotFoundError as e:
            # Keep the cause: fsspec's HTTP filesystem reports a 503 this way too, and
            # retries tell the two apart by it.
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from e
        except (pa.ArrowException, OSError, ValueError) as e:
            if handle is not None:
                handle.close()
            if fd is not None:
                os.close(fd)
            if isinstance(e, (UnsafePathError, PermissionError)):  # refused: not corrupt
                raise
            raise CorruptDataError(
                f"cannot open Parquet shard {path!r} (shard {shard} of {self.num_shards}): {e}"
            ) from e
        return ParquetReader(pf, footer[1], handle, fd, staged)

    def _checked_footer(self, shard: int, f: Any) -> tuple[pq.FileMetaData, bytes]:
        """The footer of ``shard``'s open file ``f`` (its metadata, and serialized), read
        no longer than :data:`MAX_FOOTER_BYTES` (the file may have been replaced by one
        that claims any length) and refused unless it is the one the dataset's opening
        read (its digest)."""
        size = f.seek(0, io.SEEK_END)  # (a remote file's: pinned, no request)
        source = bounded_footer(f, size)
        with pq.ParquetFile(source) as pf:
            md = pf.metadata
        footer = footer_bytes(source, md)
        if hashlib.sha256(footer).hexdigest() != self._identities[shard][2]:
            raise CorruptDataError(
                "it changed since the dataset was opened (its footer differs): open it again"
            )
        return md, footer.to_pybytes()

    def _load(self, group: int, index: int) -> RowGroup:
        """Decode one row group, or map it from the decoded disk cache (built there by the
        first process of the machine that needed it)."""
        disk = self.decoded_cache
        if disk is None:
            return RowGroup(self._decode(group, index))
        shard = int(self._rg_shard[group])
        local = int(self._rg_local[group])
        key = entry_key(
            self._identities[shard], local, self._present[shard].tobytes(), self._schema_bytes
        )

        def build() -> pa.Table:
            # Never publish what a file changed since the dataset was opened holds under
            # the key of what it held then (checked before the decode, of the file read,
            # by _check_pages, and after it).
            table = self._decode(group, index)
            self._check_unchanged(shard, index)
            return table

        table, path, pin = disk.get_or_build_pinned(
            key,
            build,
            schema=self._file_schema,
            num_rows=int(self._rg_offsets[group + 1] - self._rg_offsets[group]),
            name=f"row group {local} of {self.paths[shard]!r}",
        )
        charge = max(_MAPPED_BYTES, self.cache_bytes // _MAX_MAPS)
        if path is None:  # not stored (too large, disk full): decoded here, checked
            return RowGroup(table)
        # (an entry another version of torchgrain stored was not checked when decoded)
        self._check_times(table, group)
        return RowGroup(table, (charge, path, pin))

    def _drop_changed(self, entries: list[RowGroup | None]) -> None:
        """Set to None the cached row groups mapped from decoded-cache files that were
        written or truncated since they were mapped, and let those files go (they are
        decoded and stored again when loaded): reading such a map could kill the
        process with SIGBUS. Without a change this is one ``poll`` for the batch."""
        if self.decoded_cache is None:
            return
        mapped = [k for k, e in enumerate(entries) if e is not None and e.pin is not None]
        while mapped:
            got = changes.first_changed([entries[k].pin for k in mapped])  # type: ignore[union-attr]
            if got is None:
                return
            k = mapped[got[0]]
            entry = entries[k]
            assert entry is not None and entry.pin is not None and entry.path is not None
            self.decoded_cache.forget(entry.path, entry.pin)
            entries[k] = None
            mapped = mapped[got[0] + 1 :]

    def _check_unchanged(
        self, shard: int, index: int, version: tuple[int, ...] | None = None
    ) -> None:
        """Raise if a local file was written or replaced since opening (its size,
        modification time, inode or change time changed): the file at its path, or the
        one a reader has open (its ``version``). The change time catches a write in
        place with the size and modification time put back (``cp -p``, ``rsync
        --inplace -t``); a ``chmod``, ``chown`` or new link moves it too, and is
        refused alike (nothing tells it from a write)."""
        if self._remote:
            return
        path = self.paths[shard]
        if version is None:
            version = local_version(os.stat(path))
        if version != self._identities[shard][1]:
            raise CorruptDataError(
                f"Parquet shard {path!r} (shard {shard}) changed since the dataset was "
                f"opened (record index {index}): its size, modification time, inode or "
                "change time differs (written, even with its times put back, or its mode, "
                "owner or links changed): open it again"
            )

    def _decode(self, group: int, index: int, *, check_times: bool = True) -> pa.Table:
        shard = int(self._rg_shard[group])
        local = int(self._rg_local[group])
        num_rows = int(self._rg_offsets[group + 1] - self._rg_offsets[group])
        present = self._present[shard]
        names = [f.name for f, p in zip(self._file_fields, present) if p]
        # A row takes a byte at least while Arrow decodes it (a nullable value's
        # definition level takes two; a boolean's bit or a null's nothing would count 0:
        # a footer claiming 2**31 rows of them made pyarrow reserve 4 GiB).
        need = num_rows * max(1, int(self._row_bytes[shard]))
        if need > self.max_row_group_bytes:
            raise CorruptDataError(
                f"{self._where(shard, local)} says it holds {num_rows} rows: {need} bytes at "
                f"least, decoded, more than max_row_group_bytes={self.max_row_group_bytes} "
                f"allows (record index {index}; a larger max_row_group_bytes reads it, if the "
                "file is trusted)"
            )

        def read() -> pa.Table:
            while True:  # a reader evicted meanwhile (closed) is opened again
                try:
                    reader = self._reader(shard)
                except CorruptDataError as e:
                    raise CorruptDataError(f"{e} (record index {index})") from e
                table = self._read_checked(reader, shard, local, names, index)
                if table is not None:
                    return table

        try:
            table = self._io(read, shard, f"read of row group {local} (record index {index})")
        except (*NOT_THE_BYTES, DatasetNotFoundError, CorruptDataError):
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptDataError(
                f"cannot decode {self._where(shard, local)}"
                f"{self._failing_column(shard, local, names)} while reading record index "
                f"{index}: {e}"
            ) from e
        if table.num_rows != num_rows:
            raise CorruptDataError(
                f"row group {local} of {self.paths[shard]!r} (shard {shard}) decoded "
                f"{table.num_rows} rows but its footer says {num_rows} (record index {index})"
            )
        # Arrow does not check strings' UTF-8 on read: bytes that are not would fail a
        # conversion later with a bare UnicodeDecodeError (about 5% of a string decode).
        for name, col in zip(table.column_names, table.columns):
            try:
                col.validate(full=True)
            except pa.ArrowInvalid as e:
                raise CorruptDataError(
                    f"cannot decode {self._where(shard, local)}, column {name!r}: {e} "
                    f"(record index {index})"
                ) from None
        if check_times:  # (before a cast to the merged type could fail)
            self._check_times(table, group)
        if table.schema.equals(self._file_schema):
            return table  # the common case: this file has every column with its type
        arrays = [
            table.column(f.name).cast(f.type) if p else pa.nulls(num_rows, f.type)
            for f, p in zip(self._file_fields, present)
        ]
        return pa.Table.from_arrays(arrays, schema=self._file_schema)

    def _check_times(self, table: pa.Table, group: int) -> None:
        """Refuse a row group holding a time64[ns] value (at any depth) that is not a
        whole number of microseconds: ``datetime.time`` would hold it truncated, another
        time (pyarrow's ``to_pylist`` drops the nanoseconds silently). One vectorised
        pass over each time64[ns] leaf; columns of other types cost a cached type test."""
        for i, (name, kind) in enumerate(zip(table.column_names, table.schema.types)):
            if not holds_time_ns(kind):
                continue
            found = inexact_time(table.column(i))
            if found is None:
                continue
            row, ns = found
            shard, local = int(self._rg_shard[group]), int(self._rg_local[group])
            record = int(self._rg_offsets[group]) + row
            raise RecordDecodeError(
                f"{self._where(shard, local)}, column {name!r}: record index {record} holds "
                f"the time64[ns] time of day {_clock(ns)} ({ns} ns after midnight), whose "
                "nanoseconds datetime.time cannot hold (it keeps microseconds: the value "
                "would read as another time). Write the column as time64[us] (rounded as "
                "you choose) or as int64 nanoseconds, or read the dataset with columns= "
                "leaving it out"
            )

    def _read_checked(
        self, reader: ParquetReader, shard: int, local: int, names: list[str], index: int
    ) -> pa.Table | None:
        """Row group ``local``'s columns ``names``, their page headers checked first;
        None if ``reader`` was closed."""
        with reader.lock:  # pyarrow's reader is not safe for concurrent reads
            if reader.closed:
                return None
            # Arrow reads on its own threads: they keep to this read's deadline.
            with remote.carrying(reader.handle):
                try:
                    self._check_pages(reader, shard, local, names, index)
                    return reader.pf.read_row_group(local, columns=names, use_threads=False)
                finally:
                    if reader.staged is not None:
                        reader.staged.clear()

    def _check_pages(
        self, reader: ParquetReader, shard: int, local: int, names: list[str], index: int
    ) -> None:
        """Refuse a row group whose selected columns' page headers say they need more
        than ``max_row_group_bytes``, before any page is inflated: the fixed part of their
        values (the pages' value counts times each value's width: the footer's rows
        undercount lists), or the rest of what their pages inflate to (each column's
        bytes beyond its fixed part: strings' bytes, or a decompression bomb's). Arrow
        allocates no more than the headers declare (it refuses a page that inflates to
        more), so decoding takes at most twice the ceiling. Two things the headers do not
        bound are read first: a dictionary-encoded string column's values (each a copy of
        its entry), and INT96 timestamps (refused where their int64 in nanoseconds or
        microseconds would wrap).

        Runs under ``reader.lock``; a remote file's column chunks are fetched here, once,
        for this check and Arrow's decode."""
        # A local file changed since the dataset was opened is not read: the footer its
        # reader holds may be older than the dataset's, its pages newer than both (read
        # through it, a file rewritten with its columns swapped read them swapped). A
        # row group read again (a small cache) is not checked again while its file is
        # unchanged; remote files are pinned when opened.
        version = reader.version()
        self._check_unchanged(shard, index, version)
        key = (local, tuple(names), version)
        if key in reader.checked and reader.staged is None:
            return
        leaves = reader.leaves(key[1])
        where = self._where(shard, local)
        try:
            row_group = reader.footer()[local]
            chunks = [row_group[j] for j, *_ in leaves]
        except (CorruptDataError, IndexError) as e:
            raise CorruptDataError(
                f"cannot decode {where}: its footer: "
                f"{e or 'fewer column chunks than columns'} (record index {index})"
            ) from None
        if reader.staged is not None:
            reader.staged.stage([chunk_range(c) for c in chunks])
            if key in reader.checked:
                return
        # Each leaf's (what it takes at most, name, its values' fixed part, what its
        # pages inflate to); the dictionary-encoded strings and INT96 timestamps, read
        # below once these fit (such a read takes no more than the decode does).
        sizes: list[tuple[int, str, int, int]] = []
        strings, int96 = [], []
        for (j, bits, name, kind), chunk in zip(leaves, chunks):
            try:
                pages = chunk_pages(reader.read_at, *chunk_range(chunk), chunk.num_values)
            except CorruptDataError as e:
                raise CorruptDataError(
                    f"cannot decode {where}, column {name!r}: {e} (record index {index})"
                ) from None
            inflated = max(pages.dictionary_bytes, pages.data_bytes)
            own = (pages.values * bits + 7) // 8
            if kind == "BYTE_ARRAY" and pages.dictionary_bytes:
                strings.append((len(sizes), j, pages))
            elif kind == "INT96":
                int96.append((j, name))
            sizes.append((max(own, inflated), name, own, inflated))
        self._check_sizes(sizes, where, index)
        ceiling = self.max_row_group_bytes
        for k, j, pages in strings:
            # Arrow copies a dictionary entry for each value naming it (one 16 KiB entry
            # named 4,096 times: a 300-byte file decodes to 64 MiB): the longest entry
            # each at most (bounded by the dictionary page, then, read with the first
            # row, by its longest entry), or what they add up to (read with every row;
            # plain pages a writer fell back to cost 3x a decode here).
            most = pages.values * (pages.dictionary_bytes - 4) + pages.data_bytes
            for rows in (1, None):
                if most <= ceiling:
                    break
                found = reader.read_leaf(local, j, rows)
                arrays = [a for a in found if isinstance(a, pa.DictionaryArray)]
                if rows is None:
                    most = sum(map(_dictionary_value_bytes, arrays))
                elif any(len(a.dictionary) for a in arrays):  # (empty: not read yet)
                    longest = max(int(_entry_lengths(a).max(initial=0)) for a in arrays)
                    most = pages.values * longest + pages.data_bytes
            _, name, own, inflated = sizes[k]
            if most > inflated:
                sizes[k] = (max(own, most), name, own, most)
                self._check_sizes(sizes, where, index)
        unit = self.int96_timestamp_unit
        limit, dates, wider = _INT96_WRAPS.get(unit, (0, "", ""))
        for j, name in int96 if limit else []:
            # An INT96 timestamp read as timestamp[ns] wraps outside 1677-2262 (Spark's
            # 9999-12-31 read as 1816-03-29), as timestamp[us] outside about 292,000
            # years of 1970; in milliseconds none wraps, so they are read so first (a
            # second decode of these columns).
            for a in reader.read_leaf(local, j):
                if not pa.types.is_timestamp(a.type):
                    continue
                low, high = pc.min_max(a.cast(pa.int64())).values()
                if low.is_valid and max(-low.as_py(), high.as_py()) > limit:
                    raise CorruptDataError(
                        f"{where}, column {name!r}: an INT96 timestamp outside {dates}, "
                        f"which timestamp[{unit}] cannot hold (it would read as another "
                        f'date; record index {index}; int96_timestamp_unit="{wider}" reads it)'
                    )
        reader.checked.add(key)

    def _check_sizes(self, sizes: list[tuple[int, str, int, int]], where: str, index: int) -> None:
        """Refuse a row group whose leaves' ``sizes`` (see _check_pages) need more than
        ``max_row_group_bytes``, naming the largest leaf."""
        fixed = sum(own for _, _, own, _ in sizes)
        rest = sum(max(0, inflated - own) for _, _, own, inflated in sizes)
        if max(fixed, rest) > self.max_row_group_bytes:
            _, name, own, inflated = max(sizes)
            raise CorruptDataError(
                f"{where}, column {name!r}: its pages say it inflates to {inflated} "
                f"bytes (its values' fixed part: {own}); the selected columns' fixed part "
                f"({fixed} bytes) or what they inflate to beyond it ({rest}) is more than "
                f"max_row_group_bytes={self.max_row_group_bytes} allows (record index "
                f"{index}; a larger max_row_group_bytes reads it, if the file is trusted)"
            )

    def _where(self, shard: int, local: int) -> str:
        return f"row group {local} of {self.paths[shard]!r} (shard {shard} of {self.num_shards})"

    def _failing_column(self, shard: int, local: int, names: list[str]) -> str:
        """ ", column NAME" for the first of ``names`` whose own read fails, for an error
        message (a failed decode is read again column by column); "" if none does."""
        if len(names) < 2:
            return f", column {names[0]!r}" if names else ""
        reader = self._reader(shard)
        for name in names:
            try:
                if self._read_checked(reader, shard, local, [name], -1) is None:
                    return ""  # closed meanwhile
            except Exception:  # any failure names the column
                return f", column {name!r}"
        return ""


def _clock(ns: int) -> str:
    """A time64[ns] value as ``HH:MM:SS.nnnnnnnnn``.

    Example:
        >>> _clock(36_000_000_000_001)
        '10:00:00.000000001'
    """
    seconds, frac = divmod(ns, 1_000_000_000)
    minutes, sec = divmod(seconds, 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours:02d}:{minute:02d}:{sec:02d}.{frac:09d}"


def decoded_cache_for(
    option: bool | str | os.PathLike | DecodedCache,
    max_bytes: int | None,
    data_bytes: int,
    cache_bytes: int,
) -> DecodedCache | None:
    """The decoded disk cache ``decoded_cache=option`` asks for (see ParquetSource)."""
    if isinstance(option, DecodedCache):
        return option
    if option is False or option is None:
        return None
    auto = option == "auto"
    if auto and (cache_bytes <= 0 or data_bytes <= max(cache_bytes, _AUTO_MIN_BYTES)):
        return None
    directory: Any = option
    if option is True or auto:
        directory = os.path.join(default_cache_dir(), "parquet-decoded")
        if auto and on_network_filesystem(directory):
            warnings.warn(
                f"torchgrain: the data exceed the row-group cache, but {directory!r} is on "
                "a network filesystem (quotas, slow writes, unsafe locks): the decoded "
                "Parquet cache stays off. Pass decoded_cache=DIR on a local disk (or set "
                "TORCHGRAIN_CACHE) to turn it on.",
                stacklevel=4,
            )
            return None
    try:
        return DecodedCache(directory, max_bytes=max_bytes)
    except OSError as e:
        if not auto:
            raise
        warnings.warn(
            f"torchgrain: the decoded Parquet cache cannot use {directory!r} ({e}); "
            "reading without it (pass decoded_cache=DIR to choose another directory)",
            stacklevel=4,
        )
        return None


# Bits a value of each Parquet physical type takes while Arrow decodes it (a
# FIXED_LEN_BYTE_ARRAY's are its length; a BYTE_ARRAY's offset is 32 bits).
_PHYSICAL_BITS = {"BOOLEAN": 1, "INT32": 32, "INT64": 64, "INT96": 96, "FLOAT": 32, "DOUBLE": 64}
# For the INT96 units whose int64 can wrap: the milliseconds since 1970 it holds (give
# or take a millisecond), those dates, and the next unit, which reads them.
_INT96_WRAPS = {
    "ns": ((1 << 63) // 10**6 - 1, "1677-09-21..2262-04-11", "us"),
    "us": ((1 << 63) // 10**3 - 1, "-290308-12-21..294247-01-10", "ms"),
}


def _leaf_arrays(todo: list[pa.Array]) -> list[pa.Array]:
    """The arrays of the leaves below the arrays ``todo`` (through lists, maps and
    structs)."""
    found = []
    while todo:
        a = todo.pop()
        if isinstance(a, (pa.ListArray, pa.LargeListArray, pa.FixedSizeListArray)):
            todo.append(a.values)  # a map's: its entries' struct
        elif isinstance(a, pa.StructArray):
            todo += [a.field(i) for i in range(a.type.num_fields)]
        else:
            found.append(a)
    return found


def _entry_lengths(a: pa.DictionaryArray) -> np.ndarray:
    return pc.binary_length(a.dictionary).fill_null(0).to_numpy().astype(np.int64)


def _dictionary_value_bytes(a: pa.DictionaryArray) -> int:
    """The bytes of a dictionary array's values once decoded (their entries' lengths:
    nothing is decoded)."""
    indices = a.indices.fill_null(0).to_numpy()
    return int(_entry_lengths(a).take(indices, mode="clip").sum()) if len(a.dictionary) else 0


class ParquetReader:
    """One open Parquet file of one process.

    pyarrow's ``ParquetFile`` must not be read from two threads at once (it crashed
    the process when we tried): reads hold ``lock``. ``close`` waits for a read in
    progress, and a reader closed (evicted) meanwhile is opened again by its user.
    Page headers are read with :meth:`read_at`: through ``fd`` (a local file), the
    column chunks ``staged`` for Arrow (a remote one), or ``handle``; the column chunks
    are parsed from ``footer``, the serialized footer ``pf`` was opened with.
    """

    __slots__ = (
        "_footer",
        "_leaves",
        "_serialized",
        "checked",
        "closed",
        "fd",
        "handle",
        "lock",
        "pf",
        "staged",
    )

    def __init__(
        self,
        pf: pq.ParquetFile,
        footer: bytes,
        handle: Any,
        fd: int | None = None,
        staged: StagedInput | None = None,
    ) -> None:
        self.pf = pf
        self._serialized: bytes | None = footer
        self.handle = handle
        self.fd = fd
        self.staged = staged
        self.lock = threading.Lock()
        self.closed = False
        self._leaves: dict[tuple[str, ...], list[tuple[int, int, str, str]]] = {}
        self._footer: list[list[ColumnChunk]] | None = None
        # (row group, columns, version) whose page headers passed the check.
        self.checked: set[tuple[int, tuple[str, ...], tuple[int, ...] | None]] = set()

    def version(self) -> tuple[int, ...] | None:
        """A local file's size, modification time, inode and change time (of the
        descriptor: the file read); None for a remote one."""
        return None if self.fd is None else local_version(os.fstat(self.fd))

    def read_at(self, offset: int, size: int) -> bytes:
        """At most ``size`` bytes of the file from ``offset`` (fewer at its end)."""
        if self.fd is not None:
            return os.pread(self.fd, size, offset)
        source = self.staged or self.handle
        source.seek(offset)
        return source.read(size)

    def footer(self) -> list[list[ColumnChunk]]:
        """Each row group's column chunks, parsed once from the serialized footer (not
        through pyarrow's metadata objects: some hostile footers make them abort the
        process)."""
        if self._footer is None:
            serialized = self._serialized  # (None: parsed by another thread meanwhile)
            if serialized is not None:
                self._footer = footer_chunks(serialized)
                self._serialized = None
        assert self._footer is not None
        return self._footer

    def leaves(self, names: tuple[str, ...]) -> list[tuple[int, int, str, str]]:
        """``(index, bits per value, path, physical type)`` of each leaf column that
        reading the columns ``names`` decodes (pyarrow's choice: every leaf below a
        name)."""
        found = self._leaves.get(names)
        if found is None:
            wanted = set(names)
            schema = self.pf.metadata.schema
            found = []
            for j, path in enumerate(self.pf.reader.column_paths):
                if any(".".join(path[:k]) in wanted for k in range(1, len(path) + 1)):
                    column = schema.column(j)
                    kind = column.physical_type
                    width = column.length * 8 if kind == "FIXED_LEN_BYTE_ARRAY" else None
                    bits = width or _PHYSICAL_BITS.get(kind, 32)
                    found.append((j, bits, ".".join(path), kind))
            self._leaves[names] = found
        return found

    def read_leaf(self, local: int, leaf: int, rows: int | None = None) -> list[pa.Array]:
        """The arrays of the leaf column ``leaf`` in row group ``local`` (its first
        ``rows`` rows; None: all), read by a pyarrow reader of its own over the same
        bytes that keeps a string column's dictionary (no value is copied out of it)
        and reads INT96 timestamps in milliseconds (none wraps). Runs under ``lock``."""
        source = self.staged or self.handle if self.fd is None else os.fdopen(os.dup(self.fd), "rb")
        try:
            pf = pq.ParquetFile(
                source,
                metadata=self.pf.metadata,
                pre_buffer=False,
                read_dictionary=[leaf],
                coerce_int96_timestamp_unit="ms",
            )
            if rows is None:
                table = pf.reader.read_row_group(local, column_indices=[leaf], use_threads=False)
                return _leaf_arrays(table.column(0).chunks)
            batches = pf.reader.iter_batches(
                rows, [local], column_indices=[leaf], use_threads=False
            )
            batch = next(batches, None)
            return [] if batch is None else _leaf_arrays([batch.column(0)])
        finally:
            if self.fd is not None:
                source.close()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.pf.close()
            finally:
                if self.fd is not None:
                    os.close(self.fd)
                if self.handle is not None:
                    self.handle.close()


class StagedInput(io.RawIOBase):
    """A remote Parquet file as Arrow reads it, whose column chunks about to be decoded
    are fetched first (:meth:`stage`: their page headers are checked in these bytes)
    and then served to Arrow from memory: one fetch of each chunk, no request more than
    Arrow's own. Reads elsewhere (the footer) go to ``handle``.

    Example:
        >>> import fsspec
        >>> from torchgrain.io import remote
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe("/s/f", b"0123456789")
        >>> f = StagedInput(remote.open_input(fs, "/s/f"), fs, "/s/f")
        >>> f.stage([(2, 3)]); f.seek(3), f.read(2), f.read(4)
        (3, b'34', b'5678')
    """

    # Arrow's pre-buffering merges ranges less than this apart (hole_size_limit), and
    # reads up to this many bytes past a chunk in files of old parquet-mr writers.
    _HOLE = 8192
    _PADDING = 100

    def __init__(self, handle: Any, fs: Any, path: str) -> None:
        super().__init__()
        self.handle = handle
        self.name = getattr(handle, "name", path)
        self._fs = fs
        self._path = path
        self._pos = 0
        self._size = handle.seek(0, io.SEEK_END)
        self._ranges: list[tuple[int, bytes]] = []

    def stage(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch ``(start, length)`` ranges (merged as Arrow merges them), in one
        concurrent batch of requests, to serve the reads that follow. Each request reads
        ahead :data:`~torchgrain.io.remote.REMOTE_BUFFER` bytes at least, kept for the
        next row groups (neighbouring row groups often come in one request)."""
        merged: list[list[int]] = []
        for start, length in sorted(ranges):
            end = start + length + self._PADDING
            if merged and start <= merged[-1][1] + self._HOLE:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        kept, wanted = [], []
        for s, e in merged:
            e = min(e, self._size)
            if s >= e:
                continue
            held = [(b, blob) for b, blob in self._ranges if b <= s and e <= b + len(blob)]
            if held:
                kept.append(held[0])
            else:
                wanted.append((s, min(max(e, s + remote.REMOTE_BUFFER), self._size)))
        if wanted:
            blobs = remote.cat_ranges(
                self._fs,
                self._path,
                [s for s, _ in wanted],
                [e for _, e in wanted],
                url=self.name,
                what="column chunks",
            )
            raw = getattr(self.handle, "raw", None)
            if isinstance(raw, remote.RemoteFile):
                # Of the version the reader opened: cat_ranges checks answers against
                # this process's pin, which a later opening may have taken anew.
                raw.check_unchanged()
            kept += [(s, bytes(b)) for (s, _), b in zip(wanted, blobs)]
        self._ranges = kept

    def clear(self) -> None:
        """Forget what was staged, but for a read-ahead's worth (its first ranges)."""
        kept, room = [], remote.REMOTE_BUFFER
        for start, blob in self._ranges:
            if len(blob) > room:
                break
            kept.append((start, blob))
            room -= len(blob)
        self._ranges = kept

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence, self._size)
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        pos = self._pos
        if size is not None and size >= 0:
            for start, blob in self._ranges:
                if start <= pos and pos + size <= start + len(blob):
                    self._pos = pos + size
                    if pos == start and size == len(blob):
                        return blob  # Arrow's read of a whole merged range: no copy
                    return blob[pos - start : pos - start + size]
        self.handle.seek(pos)
        data = self.handle.read(size)
        self._pos = pos + len(data)
        return data

    def close(self) -> None:
        self._ranges = []
        super().close()
