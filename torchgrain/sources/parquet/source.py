"""ParquetSource: random access, key-value records over sharded Parquet files.

Parquet decodes whole row groups (per column), so reading one record at a time with
``ParquetFile.read_row_group`` re-decodes a row group per record. This source instead

* indexes every row group of every file from the files' footers only (read in
  parallel threads; no data page is read when opening),
* groups a batch request by row group, decodes each needed row group once (only the
  requested columns) and converts it column-wise to Python/numpy values, and
* keeps decoded row groups in a per-process :class:`~torchgrain.sources.block_cache.BlockCache`
  bounded in bytes, so block-local orders (:class:`~torchgrain.BlockShuffleSampler`)
  and repeated hits pay one decode per row group.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchgrain.columns import ColumnBatch, column_of
from torchgrain.diagnostics import COUNTER, local_counters
from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RemoteIOError,
    check_ceiling,
)
from torchgrain.io.fs import is_local, map_files
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.io.shard_cache import ShardCache
from torchgrain.sources.base import DEFAULT_CACHE_DIR_BYTES, ShardedSource
from torchgrain.sources.block_cache import DEFAULT_CACHE_BYTES
from torchgrain.sources.parquet.columns import GatherPlan, GroupViews, arrow_column, gather
from torchgrain.sources.parquet.paths import (
    check_partition_keys,
    partition_values,
    partitions,
    resolve,
)
from torchgrain.sources.parquet.pool import trimmer
from torchgrain.sources.parquet.schema import (
    all_names,
    fixed_bytes,
    merge_file_schemas,
    value_type_name,
)
from torchgrain.sources.parquet.values import Column, RowGroup, convert_column, int64_array

__all__ = ["DEFAULT_MAX_ROW_GROUP_BYTES", "ParquetSource"]

#: The most bytes a row group's columns may need decoded, counting only the fixed part of
#: each value (:func:`~torchgrain.sources.parquet.schema.fixed_bytes`: 8 bytes per int64,
#: 4 per string or list), unless a source is given another ``max_row_group_bytes``.
#: Writers cut row groups far below it (pyarrow at 1 Mi rows, 64 Mi rows before
#: version 15; Spark at 128 MiB); a footer that claims more rows makes pyarrow reserve
#: memory for them all before it finds out.
DEFAULT_MAX_ROW_GROUP_BYTES = 16 << 30

_SEQUENTIAL_ROWS = 1 << 16  # most rows per read when reading a file in order
# A row group first read with at least 1/_CONVERT_WHOLE of its rows in one batch is
# converted whole at once (block-local reads); otherwise only those rows, until reuse.
_CONVERT_WHOLE = 16


class ParquetSource(ShardedSource):
    """Random-access, key-value view of one or many Parquet files.

    Args:
        paths: a directory (searched recursively for ``*.parquet`` / ``*.parq``,
            including hive-partitioned ``key=value/`` sub-directories), a glob, a single
            file, a list of these, or fsspec URLs (``s3://``, ``gs://``, ``memory://``...).
        columns: the columns to read (default: all). Only these columns' pages are read
            and decoded; partition keys may be listed too.
        cache_bytes: budget of this process's row-group cache, in bytes of decoded data
            (default 256 MiB; ``0`` disables it). Each DataLoader worker has its own;
            :meth:`cache_info` reports hits, misses (= row-group decodes) and evictions.
        filesystem: an fsspec filesystem to use instead of inferring one from ``paths``.
        storage_options: fsspec options for remote paths (e.g. ``endpoint_url``).
        partitioning: ``"hive"`` (default) turns ``key=value`` directory names below
            the directory (or the fixed prefix of the glob) you give into columns;
            ``None`` ignores directory names.
        cache_dir, cache_dir_bytes: a local directory (or a
            :class:`~torchgrain.io.shard_cache.ShardCache`) for whole copies of *remote*
            files, each downloaded once per machine and read locally after, and its byte
            budget (default 16 GiB).
        read_ahead_bytes: with ``cache_dir`` on remote storage, how many bytes of
            shards a sampler's future order may have downloaded ahead of use (default:
            half of ``cache_dir_bytes``; ``0`` turns read-ahead off). See
            :mod:`torchgrain.io.readahead`.
        io_threads: threads per process that read the remote row groups of one batch
            concurrently, and the shard read-ahead's concurrent downloads (1 =
            sequential; local files are read in the calling thread).
        retry: retry policy for remote footer and row-group reads and downloads
            (default :class:`~torchgrain.io.retry.RetryPolicy()`).
        max_open_files: files kept open per process (default 64; each holds a file
            descriptor and its footer).
        max_row_group_bytes: the most bytes one row group's selected columns may need
            decoded, counted from its footer's row count and the fixed part of each
            value (8 bytes per int64, 4 per string or list: a lower bound of the real
            size); default 16 GiB (:data:`DEFAULT_MAX_ROW_GROUP_BYTES`). A row group
            over it raises :class:`~torchgrain.CorruptDataError` before pyarrow reserves
            memory for it: a footer that claims billions of rows cannot make it do so.

    Records are dicts ``{column: value}``. Values map as follows:

    ==============================================  =========================================
    Parquet / Arrow type                            Python value
    ==============================================  =========================================
    integers, floats, bool                          ``int``, ``float``, ``bool``
    string / large_string                           ``str``
    binary / large_binary / fixed_size_binary       ``bytes``
    list / large_list / fixed_size_list of numbers  ``numpy.ndarray`` (1-D; a list of lists
                                                    is 2-D when rectangular, else a list of
                                                    1-D arrays); a fresh, writable array
    lists of strings, structs, or with null items   Python ``list`` (as ``to_pylist``)
    struct                                          ``dict``
    timestamp, date32, date64                       ``numpy.datetime64`` (same unit;
                                                    time-zone aware values in UTC)
    duration                                        ``numpy.timedelta64``
    time32 / time64, decimal                        ``datetime.time``, ``decimal.Decimal``
    dictionary-encoded                              the decoded value
    map, other types                                as ``pyarrow``'s ``to_pylist``
    null                                            ``None``
    ==============================================  =========================================

    :attr:`schema` names each key's type with pyarrow's names (``int64``, ``double``,
    ``string``, ``binary``, ``list<float>``, ``fixed_size_list<float>[3]``,
    ``struct<a: int64>``, ``timestamp[us]``...). Hive partition keys are ``int64`` when
    every value is a decimal integer, else ``string``; ``__HIVE_DEFAULT_PARTITION__``
    reads as ``None``.

    Schemas of the files are merged at open time (for the selected columns):

    * a column missing from some files reads as ``None`` there, provided it is nullable
      in a file that has it; a required (non-nullable) column missing from a file
      raises :class:`~torchgrain.SchemaMismatchError`;
    * lossless widening is accepted and applied when reading: integers of the same
      signedness to the wider one (and unsigned to a strictly wider signed integer),
      floats to the wider float, ``string``/``large_string``, ``binary``/
      ``large_binary``, a ``null``-typed column to the other type, dictionary-encoded
      to its value type;
    * anything else (``int64`` vs ``string``, ``int64`` vs ``double``, ``uint64`` vs
      ``int64``, different timestamp units, different list item types...) raises
      :class:`~torchgrain.SchemaMismatchError` naming both files and the column.

    Caching and access order: a row group is decoded whole, so the cost of a read
    depends on how often its row group is already in the cache. The first read of a
    row group caches its Arrow table and converts only the rows asked for; a second
    read converts the whole row group to Python values once (charged at their
    estimated size), after which rows are gathered without decoding. With
    :class:`~torchgrain.BlockShuffleSampler` a worker needs ``window + 1`` row groups
    of cache (one more for each further stripe a batch spans) and decodes each row
    group about once per epoch; with less, LRU eviction thrashes. With
    :class:`~torchgrain.GlobalShuffleSampler` nearly every record of a batch comes from
    a different row group: it is fast only while the decoded data (about its Arrow
    size plus ~48 bytes per value) fits in every worker's ``cache_bytes``; beyond that,
    each record costs a row-group decode, and a block shuffle (or converting to
    ArrayRecord) is the better choice.

    Opening reads only the files' footers (in parallel). No file handle is kept in
    the pickled state: each process opens its own readers on first use, and a forked
    child starts with fresh readers and an empty cache, so the source can be used in
    the parent before DataLoader workers fork, pickles small, and works with ``spawn``.

    Example:
        >>> import tempfile, os, pyarrow as pa, pyarrow.parquet as pq, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> for part in range(2):
        ...     t = pa.table({"x": [[1.0, 2.0]] * 3, "label": [part * 3 + i for i in range(3)]})
        ...     os.makedirs(f"{d}/split={part}")
        ...     pq.write_table(t, f"{d}/split={part}/data.parquet", row_group_size=2)
        >>> src = tg.ParquetSource(d)
        >>> len(src), src.num_shards, src.schema
        (6, 2, {'x': 'float64[?]', 'label': 'int', 'split': 'int'})
        >>> src.arrow_schema.field("x").type
        ListType(list<element: double>)
        >>> [r["label"] for r in src.__getitems__([5, 0, 3])]
        [5, 0, 3]
        >>> src[4]["x"], src[4]["split"]
        (array([1., 2.]), 1)
        >>> src.block_offsets().tolist()   # row groups of 2 + 1 rows in each file
        [0, 2, 3, 5, 6]
    """

    #: Tells :class:`~torchgrain.Dataset` that this source times its own reads.
    reports_stats = True

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        columns: Sequence[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        filesystem: fsspec.AbstractFileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        partitioning: str | None = "hive",
        cache_dir: str | os.PathLike | ShardCache | None = None,
        cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES,
        io_threads: int = 8,
        read_ahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        max_open_files: int | type[Ellipsis] | None = ...,
        max_row_group_bytes: int = DEFAULT_MAX_ROW_GROUP_BYTES,
    ) -> None:
        self.max_row_group_bytes = check_ceiling("max_row_group_bytes", max_row_group_bytes, 0)
        if partitioning not in ("hive", None):
            raise ValueError(f"partitioning must be 'hive' or None, got {partitioning!r}")
        if isinstance(columns, str):
            raise TypeError("columns must be a sequence of column names, not a string")
        if columns is not None:
            columns = list(columns)
            dup = sorted({c for c in columns if columns.count(c) > 1})
            if dup:
                raise ValueError(f"columns lists {dup[0]!r} more than once")
        fs, files, bases = resolve(paths, storage_options, filesystem)
        retry = retry or RetryPolicy()
        parts = partitions(fs, files, bases) if partitioning == "hive" else [{} for _ in files]
        part_keys = check_partition_keys(files, parts)

        counts, schemas = _read_footers(fs, files, retry)
        fields, present = merge_file_schemas(files, schemas, columns, part_keys)
        self._file_fields: list[pa.Field] = fields
        self._file_schema = pa.schema(fields)
        self._present = present  # bool (num_shards, num_file_columns)
        # Bytes a row of each file takes at least, decoded (for max_row_group_bytes).
        widths = np.array([fixed_bytes(f.type) for f in fields], dtype=np.int64)
        self._row_bytes = present.astype(np.int64) @ widths
        self._part_keys = [k for k in part_keys if columns is None or k in columns]
        self._part_values: dict[str, np.ndarray] = {}
        part_types: dict[str, pa.DataType] = {}
        for key in self._part_keys:
            values, typ = partition_values([p[key] for p in parts])
            self._part_values[key] = values
            part_types[key] = typ
        file_names = [f.name for f in fields]
        if columns is not None:
            known = set(file_names) | set(self._part_keys)
            missing = [c for c in columns if c not in known]
            if missing:
                raise ValueError(
                    f"column {missing[0]!r} is in no Parquet file of this dataset; "
                    f"columns are {[*all_names(schemas), *part_keys]}"
                )
            self._keys = list(columns)
        else:
            self._keys = file_names + self._part_keys
        by_name = {f.name: f for f in fields}
        by_name.update({k: pa.field(k, t) for k, t in part_types.items()})
        self.arrow_schema: pa.Schema = pa.schema([by_name[k] for k in self._keys])
        self._file_pos = [file_names.index(k) if k in file_names else -1 for k in self._keys]

        # Row-group index, all numpy: global row offsets (R + 1), owning shard, local number.
        rg_counts = np.concatenate([np.zeros(0, np.int64), *counts]).astype(np.int64)
        self._rg_offsets = np.zeros(len(rg_counts) + 1, dtype=np.int64)
        np.cumsum(rg_counts, out=self._rg_offsets[1:])
        self._rg_shard = np.repeat(np.arange(len(files), dtype=np.int64), [len(c) for c in counts])
        self._rg_local = np.concatenate(
            [np.zeros(0, np.int64), *[np.arange(len(c), dtype=np.int64) for c in counts]]
        )
        for a in (self._rg_offsets, self._rg_shard, self._rg_local):
            a.setflags(write=False)
        self._init_shards(
            filesystem=fs,
            paths=files,
            counts=np.array([int(c.sum()) for c in counts], dtype=np.int64),
            cache_bytes=cache_bytes,
            cache_dir=cache_dir,
            cache_dir_bytes=cache_dir_bytes,
            io_threads=io_threads,
            read_ahead_bytes=read_ahead_bytes,
            retry=retry,
            max_open_files=max_open_files,
        )
        # Reads use Arrow's take, which imports pyarrow.compute (about 50 ms) on first
        # use: import it here, so that forked DataLoader workers inherit it.
        import pyarrow.compute  # noqa: F401

    # ----------------------------------------------------------------- readers
    def _open_reader(
        self, shard: int, path: str, filesystem: fsspec.AbstractFileSystem | None
    ) -> _Reader:
        handle = None
        try:
            if filesystem is None:
                # pre_buffer coalesces reads through Arrow's I/O threads, which pays on
                # object storage; on a local file it only adds thread hand-offs (block
                # reads measured 15-35% faster without, most on small row groups).
                pf = pq.ParquetFile(path, pre_buffer=False)
            else:
                handle = filesystem.open(path, "rb")
                pf = pq.ParquetFile(handle, pre_buffer=True)
        except FileNotFoundError as e:
            # Keep the cause: fsspec's HTTP filesystem reports a 503 this way too, and
            # retries tell the two apart by it.
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from e
        except (pa.ArrowException, OSError, ValueError) as e:
            if handle is not None:
                handle.close()
            raise CorruptDataError(
                f"cannot open Parquet shard {path!r} (shard {shard} of {self.num_shards}): {e}"
            ) from e
        return _Reader(pf, handle)

    # ------------------------------------------------------------ the contract
    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_shards(self) -> int:
        """Number of Parquet files."""
        return self.index.num_shards

    @property
    def num_row_groups(self) -> int:
        """Number of row groups over all files (empty ones included)."""
        return len(self._rg_shard)

    @property
    def keys(self) -> list[str]:
        """The record keys: the selected columns, then hive partition keys."""
        return list(self._keys)

    @property
    def schema(self) -> dict[str, str]:
        """Record key -> type of its values (``int``, ``str``, ``float32[?]``...).

        The vocabulary every torchgrain source uses; :attr:`arrow_schema` has the
        Arrow types. A column some files lack (read as ``None`` there) adds ``|null``.
        """
        out = {}
        for f in self.arrow_schema:
            name = value_type_name(f.type)
            pos = self._file_pos[self._keys.index(f.name)]
            if pos >= 0 and not self._present[:, pos].all() and name != "null":
                name += "|null"
            out[f.name] = name
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.index.locate_one(index)  # TypeError / IndexError with the usual messages
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Read a batch; each row group is decoded at most once, records in request order.

        Duplicate indices give separate (equal) records.
        """
        idx = self.index.check(indices)
        n = len(idx)
        if n == 0:
            return []
        groups = self._rg_offsets.searchsorted(idx, side="right") - 1
        rows = idx - self._rg_offsets[groups]
        order = np.argsort(groups, kind="stable")
        out = self._gather(groups[order], rows[order], idx[order], order)
        trimmer().settle()  # the decode buffers this read freed go back to the system
        return out

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        """Read a batch as columns, without a Python object per row where the types allow
        (see :mod:`torchgrain.sources.parquet.columns`): numbers, fixed-size lists,
        binary, strings and lists of numbers are gathered from numpy views of the cached
        row groups' Arrow buffers straight into the batch's arrays; other columns go
        through Arrow ``take``.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_parquet(({"x": i, "s": str(i)} for i in range(10)), d)
            >>> b = tg.ParquetSource(d).read_columns([7, 2])
            >>> b["x"].tolist(), b["s"][0]
            ([7, 2], '7')
        """
        idx = self.index.check(indices)
        if len(idx) == 0:
            return ColumnBatch({key: [] for key in self._keys}, num_rows=0)
        out = self._read_columns(idx)
        trimmer().settle()  # the decode buffers this read freed go back to the system
        return out

    def _read_columns(self, idx: np.ndarray) -> ColumnBatch:
        n = len(idx)
        groups = self._rg_offsets.searchsorted(idx, side="right") - 1
        plan = GatherPlan(groups, idx - self._rg_offsets[groups])
        distinct = plan.groups.tolist()
        t_start = time.perf_counter()
        read_seconds = 0.0
        read_bytes = 0
        cache = self._blocks
        entries = cache.get_many(distinct)
        cached = [e is not None for e in entries]
        missing = [k for k, e in enumerate(entries) if e is None or e.table is None]
        if missing:
            t0 = time.perf_counter()
            decoded = self._map(
                lambda k: self._decode(distinct[k], int(idx[plan.first[k]])), missing
            )
            for k, table in zip(missing, decoded):
                read_bytes += table.get_total_buffer_size()
                entry = RowGroup(table, None)
                if entries[k] is None and cache.max_bytes > 0:
                    cached[k] = cache.put(distinct[k], entry, entry.nbytes)
                entries[k] = entry
            read_seconds = time.perf_counter() - t0
        views = []
        for k, entry in enumerate(entries):
            if entry.views is None:  # made once per cached row group (a benign race)
                entry.views = GroupViews(entry.table)
                if cached[k]:  # charged for the packed copy too
                    cache.put(distinct[k], entry, entry.nbytes + entry.views.nbytes)
            views.append(entry.views)
        gathered = gather(views, plan)
        columns: dict[str, Any] = {}
        shards = self._rg_shard[groups]
        for key, pos in zip(self._keys, self._file_pos):
            if pos < 0:  # a hive partition key: one value per file
                columns[key] = column_of(self._part_values[key][shards].tolist())
                continue
            col = gathered.get(int(pos))
            if col is None:  # Arrow does it: each group's rows, then request order
                parts = [
                    e.table.column(int(pos)).take(int64_array(r))
                    for e, r in zip(entries, plan.rows)
                ]
                joined = pa.chunked_array(parts, type=entries[0].table.schema.field(int(pos)).type)
                col = arrow_column(joined.combine_chunks().take(int64_array(plan.where)))
            columns[key] = col
        counters = local_counters()
        counters[COUNTER["cache_misses"]] += len(missing)
        counters[COUNTER["cache_hits"]] += len(entries) - len(missing)
        counters[COUNTER["read_seconds"]] += read_seconds
        counters[COUNTER["bytes_read"]] += read_bytes
        counters[COUNTER["decode_seconds"]] += time.perf_counter() - t_start - read_seconds
        return ColumnBatch(columns, num_rows=n)

    def block_offsets(self) -> np.ndarray:
        """Global record offsets of the row groups (for :class:`BlockShuffleSampler`).

        An int64 array that starts at 0, ends at ``len(self)`` and is strictly
        increasing (empty row groups and files are left out). Needs no I/O.
        """
        return np.unique(self._rg_offsets)

    def iter_shard(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of one file, in order, a row group at a time (each
        row group decoded once)."""
        base = int(self.index.offsets[shard])
        end = base + (int(self.index.counts[shard]) if stop is None else stop)
        bounds = self.block_offsets()
        a = base + max(start, 0)
        while a < end:
            g = int(np.searchsorted(bounds, a, side="right"))
            b = min(end, int(bounds[g]) if g < len(bounds) else end, a + _SEQUENTIAL_ROWS)
            yield from self.__getitems__(range(a, b))
            a = b

    # ---------------------------------------------------------------- reading
    def _gather(
        self, groups: np.ndarray, rows: np.ndarray, indices: np.ndarray, order: np.ndarray
    ) -> list[dict[str, Any]]:
        """The records at ``rows`` of ``groups`` (sorted by group), in request order.

        ``order[i]`` is the request position of the i-th (group-sorted) row.

        A converted row group holds one finished record per row (a dict with every
        key, immutable values filled in); a read hands out shallow copies, so a batch
        costs one C-level dict copy per record plus the per-record copies of mutable
        values (arrays, lists, dicts). Keeping a row's values together in one dict is
        also what makes a global shuffle cheap: gathering a row touches one object,
        not one per column scattered over the cache.

        A row group is cached in two steps. The first read decodes it and caches the
        Arrow table; unless that read looks block-local (:meth:`_block_local`), only
        the requested rows are converted. A later read (reuse is
        now proven) converts the whole row group once and caches that instead. So a
        global shuffle whose row groups fall out of the cache before being read again
        pays one decode and a few rows' conversion per row group, and a block-local
        or cache-resident read pays one full conversion per row group.
        """
        n = len(groups)
        cuts = np.flatnonzero(np.diff(groups)) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = [*cuts.tolist(), n]
        distinct = groups[starts].tolist()
        cache = self._blocks
        t_start = time.perf_counter()
        read_seconds = 0.0
        read_bytes = 0
        entries = cache.get_many(distinct)  # counts a miss per absent group
        misses = [k for k, entry in enumerate(entries) if entry is None]
        tables: dict[int, pa.Table] = {}
        if self._parallel(len(misses)):
            # Remote row groups of this batch: all requests in flight at once.
            t0 = time.perf_counter()
            decoded = self._map(
                lambda k: self._decode(distinct[k], int(indices[starts[k]])), misses
            )
            tables = dict(zip(misses, decoded))
            read_seconds += time.perf_counter() - t0
        local = rows.copy()  # row of each value in its group's converted rows
        converted: list[RowGroup] = []
        for k, entry in enumerate(entries):
            g, s, e = distinct[k], starts[k], ends[k]
            if entry is None:
                table = tables.pop(k, None)
                if table is None:
                    t0 = time.perf_counter()
                    table = self._decode(g, int(indices[s]))
                    read_seconds += time.perf_counter() - t0
                read_bytes += table.get_total_buffer_size()
                if self._block_local(e - s, n, table.num_rows):
                    entry = self._convert_group(table, g)
                else:
                    entry = RowGroup(table, None)
                if cache.max_bytes > 0:
                    cache.put(g, entry, entry.nbytes)
                if entry.records is None:
                    taken = table.take(int64_array(local[s:e]))
                    converted.append(self._convert_group(taken, g))
                    local[s:e] = np.arange(e - s)
                    continue
            elif entry.records is None:
                # Reuse is proven: convert the whole row group once. A new entry replaces
                # the cached one (never mutated in place: another thread may be reading it).
                entry = self._convert_group(entry.table, g)
                cache.put(g, entry, entry.nbytes)  # re-charged at its converted size
                # Let the table go now, not at the end of the batch (a batch of a global
                # shuffle converts every cached row group at its second read).
                entries[k] = entry
                trimmer().settle()
            converted.append(entry)

        # Copy each record in request order (one pass; a global shuffle touches a
        # different row group for nearly every record).
        which = np.repeat(np.arange(len(distinct)), np.diff([*starts, n]))
        which_req = np.empty(n, dtype=np.int64)
        which_req[order] = which
        local_req = np.empty(n, dtype=np.int64)
        local_req[order] = local
        templates = [c.records for c in converted]
        out = [templates[k][r].copy() for k, r in zip(which_req.tolist(), local_req.tolist())]
        if converted[0].mutable:
            # Values that must be fresh per record (arrays, lists, dicts) replace the
            # placeholders in the copies, group by group.
            in_group_order = [out[p] for p in order.tolist()]
            local_list = local.tolist()
            for c, s, e in zip(converted, starts, ends):
                recs = in_group_order[s:e]
                for key, col in c.mutable:
                    for rec, value in zip(recs, col.take(local_list[s:e])):
                        rec[key] = value
        counters = local_counters()
        counters[COUNTER["cache_misses"]] += len(misses)
        counters[COUNTER["cache_hits"]] += len(entries) - len(misses)
        counters[COUNTER["read_seconds"]] += read_seconds
        counters[COUNTER["bytes_read"]] += read_bytes
        counters[COUNTER["decode_seconds"]] += time.perf_counter() - t_start - read_seconds
        return out

    def _block_local(self, count: int, batch: int, group_rows: int) -> bool:
        """Whether ``count`` rows of a row group of ``group_rows`` in a batch of ``batch``
        point to block-local reads (the rest of the group will follow soon).

        A uniform global shuffle draws ``batch * group_rows / len(self)`` rows of the
        group on average (about one or less with many row groups); block-local orders
        draw many times that. A read of a good share of the group counts too.
        """
        if _CONVERT_WHOLE * count >= group_rows:
            return True
        return count >= 2 + 4 * batch * group_rows / max(1, len(self))

    def _convert_group(self, table: pa.Table, group: int) -> RowGroup:
        """Convert decoded rows of ``group`` into record templates (see :meth:`_gather`)."""
        n = table.num_rows
        shard = int(self._rg_shard[group])
        columns = [convert_column(c) for c in table.columns]
        records: list[dict[str, Any]] = [{} for _ in range(n)]
        mutable: list[tuple[str, Column]] = []
        nbytes = 0
        # Filled column by column: about 2x faster than a dict per row from a zip.
        for key, pos in zip(self._keys, self._file_pos):
            if pos < 0:  # a partition key: one value for the whole file
                value = self._part_values[key][shard : shard + 1].tolist()[0]
                for rec in records:
                    rec[key] = value
                continue
            col = columns[pos]
            nbytes += col.nbytes
            if col.plain:
                for rec, value in zip(records, col.values):
                    rec[key] = value
            else:  # a placeholder keeps the key order; each read fills a fresh value
                mutable.append((key, col))
                for rec in records:
                    rec[key] = None
        if records:
            nbytes += n * sys.getsizeof(records[0])
        return RowGroup(None, records, mutable, nbytes)

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
                        return reader.pf.read_row_group(local, columns=names, use_threads=False)

        try:
            table = self._io(read, shard, f"read of row group {local} (record index {index})")
        except (RemoteIOError, DatasetNotFoundError, PermissionError):
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

    def __repr__(self) -> str:
        return (
            f"ParquetSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"num_row_groups={self.num_row_groups}, keys={self._keys})"
        )


def _read_footers(
    fs: fsspec.AbstractFileSystem, files: list[str], retry: RetryPolicy
) -> tuple[list[np.ndarray], list[pa.Schema]]:
    """Row-group sizes and Arrow schema of every file, from the footers (in parallel)."""
    local = is_local(fs)

    def metadata(shard: int) -> pq.FileMetaData:
        path = files[shard]
        try:
            if local:
                return pq.read_metadata(path)
            with fs.open(path, "rb") as f:
                return pq.read_metadata(f)
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from e
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptDataError(
                f"cannot read the Parquet footer of {path!r} (shard {shard} of {len(files)}): {e}"
            ) from e

    def one(shard: int) -> tuple[np.ndarray, pa.Schema]:
        if local:
            md = metadata(shard)
        else:
            md = retry_call(metadata, shard, url=files[shard], policy=retry, what="footer read")
        counts = np.array(
            [md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64
        )
        # A footer's counts index every record: they must be counts, and agree.
        if (counts < 0).any() or float(counts.sum(dtype=np.float64)) != md.num_rows:
            raise CorruptDataError(
                f"the Parquet footer of {files[shard]!r} (shard {shard} of {len(files)}) "
                f"says {md.num_rows} rows but its row groups hold {counts.tolist()[:8]}"
            )
        return counts, md.schema.to_arrow_schema()

    results = map_files(one, len(files))
    return [r[0] for r in results], [r[1] for r in results]


class _Reader:
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
