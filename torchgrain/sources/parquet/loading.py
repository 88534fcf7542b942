"""How one row group of a Parquet dataset gets into memory: decoded from its file, or
mapped from the node's decoded disk cache.

:class:`RowGroupLoader` is the part of :class:`~torchgrain.ParquetSource` below the
batch: per-process readers of the files (:class:`ParquetReader`: pyarrow's reader, one
read at a time), the decode of a row group's selected columns (bounded by
``max_row_group_bytes`` before pyarrow allocates, counted against the footer, widened to
the dataset's merged schema), and the decoded disk cache
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

import os
import threading
import time
import warnings
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RemoteIOError,
    UnsafePathError,
)
from torchgrain.io import changes, remote
from torchgrain.io.fs import default_cache_dir
from torchgrain.sources.base import ShardedSource
from torchgrain.sources.parquet.decoded_cache import (
    DecodedCache,
    entry_key,
    on_network_filesystem,
)
from torchgrain.sources.parquet.footers import local_version
from torchgrain.sources.parquet.values import RowGroup

__all__ = ["ParquetReader", "RowGroupLoader", "decoded_cache_for"]

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
    decoded_cache: DecodedCache | None

    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> ParquetReader:
        handle = None
        try:
            if filesystem is None:
                # pre_buffer coalesces reads through Arrow's I/O threads, which pays on
                # object storage; on a local file it only adds thread hand-offs (block
                # reads measured 15-35% faster without, most on small row groups).
                pf = pq.ParquetFile(path, pre_buffer=False, page_checksum_verification=self._verify)
            else:
                # Reads are range requests with a deadline, checked to bring back exactly
                # the bytes asked for, through a read-ahead buffer like fsspec's own
                # (neighbouring row groups often come in one request).
                handle = remote.open_input(filesystem, path)
                pf = pq.ParquetFile(
                    handle, pre_buffer=True, page_checksum_verification=self._verify
                )
        except FileNotFoundError as e:
            # Keep the cause: fsspec's HTTP filesystem reports a 503 this way too, and
            # retries tell the two apart by it.
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from e
        except (pa.ArrowException, OSError, ValueError) as e:
            if handle is not None:
                handle.close()
            if isinstance(e, UnsafePathError):  # a refused redirect: not a corrupt file
                raise
            raise CorruptDataError(
                f"cannot open Parquet shard {path!r} (shard {shard} of {self.num_shards}): {e}"
            ) from e
        return ParquetReader(pf, handle)

    def _load(self, group: int, index: int) -> RowGroup:
        """Decode one row group, or map it from the decoded disk cache (built there by the
        first process of the machine that needed it)."""
        disk = self.decoded_cache
        if disk is None:
            return RowGroup(self._decode(group, index))
        shard = int(self._rg_shard[group])
        local = int(self._rg_local[group])
        key = entry_key(
            self._identities[shard],
            local,
            self._present[shard].tobytes(),
            self._schema_bytes,
        )

        def build() -> pa.Table:
            # Never publish what a file changed since the dataset was opened holds under
            # the key of what it held then (checked before and after the decode).
            self._check_unchanged(shard, index)
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
        if path is None:  # not stored (too large, disk full): decoded here
            return RowGroup(table)
        charge = max(_MAPPED_BYTES, self.cache_bytes // _MAX_MAPS)
        entry = RowGroup(table, mapped_bytes=charge, path=path)
        entry.pin = pin
        entry.touched = time.monotonic()
        return entry

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

    def _check_unchanged(self, shard: int, index: int) -> None:
        """Raise if a local file was written or replaced since opening (its size,
        modification time or inode changed; its change time is left out: a ``chmod``
        or ``touch -a`` changes that, not the data)."""
        if self._remote:
            return
        path = self.paths[shard]
        if local_version(os.stat(path))[:3] != self._identities[shard][1][:3]:
            raise CorruptDataError(
                f"Parquet shard {path!r} (shard {shard}) changed since the dataset was "
                f"opened (record index {index}): open it again"
            )

    def _decode(self, group: int, index: int) -> pa.Table:
        shard = int(self._rg_shard[group])
        local = int(self._rg_local[group])
        num_rows = int(self._rg_offsets[group + 1] - self._rg_offsets[group])
        present = self._present[shard]
        names = [f.name for f, p in zip(self._file_fields, present) if p]
        need = num_rows * int(self._row_bytes[shard])
        if need > self.max_row_group_bytes:
            raise CorruptDataError(
                f"row group {local} of {self.paths[shard]!r} (shard {shard} of "
                f"{self.num_shards}) says it holds {num_rows} rows: {need} bytes at least, "
                f"decoded, more than max_row_group_bytes={self.max_row_group_bytes} allows "
                f"(record index {index}; a larger max_row_group_bytes reads it, if the file "
                "is trusted)"
            )

        def read() -> pa.Table:
            while True:
                reader = self._reader(shard)
                with reader.lock:  # pyarrow's reader is not safe for concurrent reads
                    if not reader.closed:  # (else evicted meanwhile: open it again)
                        # Arrow reads on its own threads: they keep to this read's deadline.
                        with remote.carrying(reader.handle):
                            return reader.pf.read_row_group(local, columns=names, use_threads=False)

        try:
            table = self._io(read, shard, f"read of row group {local} (record index {index})")
        except (RemoteIOError, DatasetNotFoundError, PermissionError, UnsafePathError):
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptDataError(
                f"cannot decode row group {local} of {self.paths[shard]!r} (shard {shard} of "
                f"{self.num_shards}) while reading record index {index}: {e}"
            ) from e
        if table.num_rows != num_rows:
            raise CorruptDataError(
                f"row group {local} of {self.paths[shard]!r} (shard {shard}) decoded "
                f"{table.num_rows} rows but its footer says {num_rows} (record index {index})"
            )
        if table.schema.equals(self._file_schema):
            return table  # the common case: this file has every column with its type
        arrays = []
        for field, p in zip(self._file_fields, present):
            if not p:
                arrays.append(pa.nulls(num_rows, field.type))
                continue
            col = table.column(field.name)
            if not col.type.equals(field.type):
                col = col.cast(field.type)
            arrays.append(col)
        return pa.Table.from_arrays(arrays, schema=self._file_schema)


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
    if option is True or option == "auto":
        if option == "auto" and (
            cache_bytes <= 0 or data_bytes <= max(cache_bytes, _AUTO_MIN_BYTES)
        ):
            return None
        directory: str | os.PathLike = os.path.join(default_cache_dir(), "parquet-decoded")
        if option == "auto" and on_network_filesystem(directory):
            warnings.warn(
                f"torchgrain: the data exceed the row-group cache, but {directory!r} is on "
                "a network filesystem (quotas, slow writes, unsafe locks): the decoded "
                "Parquet cache stays off. Pass decoded_cache=DIR on a local disk (or set "
                "TORCHGRAIN_CACHE) to turn it on.",
                stacklevel=4,
            )
            return None
    else:
        directory = option
    try:
        return DecodedCache(directory, max_bytes=max_bytes)
    except OSError as e:
        if option != "auto":
            raise
        warnings.warn(
            f"torchgrain: the decoded Parquet cache cannot use {directory!r} ({e}); "
            "reading without it (pass decoded_cache=DIR to choose another directory)",
            stacklevel=4,
        )
        return None


class ParquetReader:
    """One open Parquet file of one process.

    pyarrow's ``ParquetFile`` must not be read from two threads at once (it crashed
    the process when we tried): reads hold ``lock``. ``close`` waits for a read in
    progress, and a reader closed (evicted) meanwhile is opened again by its user.
    """

    __slots__ = ("closed", "handle", "lock", "pf")

    def __init__(self, pf: pq.ParquetFile, handle: Any) -> None:
        self.pf = pf
        self.handle = handle
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.pf.close()
            finally:
                if self.handle is not None:
                    self.handle.close()
