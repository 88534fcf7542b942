"""ParquetSource: random access, key-value records over sharded Parquet files.

Parquet decodes whole row groups (per column), so reading one record at a time with
``ParquetFile.read_row_group`` re-decodes a row group per record. This source instead

* indexes every row group of every file from the files' footers only (read in
  parallel threads; no data page is read when opening),
* groups a batch request by row group and decodes each needed row group once (only the
  requested columns),
* keeps decoded row groups in Arrow's compact form in a per-process
  :class:`~torchgrain.sources.block_cache.BlockCache` bounded in bytes, and builds a
  batch's Python records or columns from it per batch
  (:mod:`~torchgrain.sources.parquet.values`), and
* for data bigger than that cache, keeps decoded row groups on local disk, memory-mapped
  and shared by every process of the machine
  (:class:`~torchgrain.sources.parquet.decoded_cache.DecodedCache`): each row group is
  decoded once per machine, and a global shuffle reads at the in-memory rate.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from torchgrain.columns import ColumnBatch, column_of
from torchgrain.diagnostics import COUNTER, count_decode, count_read, local_counters
from torchgrain.errors import RecordDecodeError, check_ceiling
from torchgrain.io import changes
from torchgrain.io.retry import using
from torchgrain.sources.base import shard_rows
from torchgrain.sources.block_cache import CacheBlocks
from torchgrain.sources.options import DEFAULT_CACHE_BYTES, ReadOptions
from torchgrain.sources.parquet.decoded_cache import DecodedCache
from torchgrain.sources.parquet.footers import local_version, read_footers
from torchgrain.sources.parquet.loading import RowGroupLoader, decoded_cache_for
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
from torchgrain.sources.parquet.values import (
    GatherPlan,
    GroupViews,
    RowGroup,
    RowTemplates,
    RowViews,
    arrow_column,
    build_records,
    converted_bytes,
    copy_records,
    gather,
    int64_array,
    take_rows,
    views_bytes,
)

__all__ = ["DEFAULT_MAX_ROW_GROUP_BYTES", "ParquetSource"]

#: The most bytes a row group's columns may need decoded, counting only the fixed part of
#: each value (:func:`~torchgrain.sources.parquet.schema.fixed_bytes`: 8 bytes per int64,
#: 4 per string or list), unless a source is given another ``max_row_group_bytes``.
#: Writers cut row groups far below it (pyarrow at 1 Mi rows, 64 Mi rows before
#: version 15; Spark at 128 MiB); a footer that claims more rows makes pyarrow reserve
#: memory for them all before it finds out.
DEFAULT_MAX_ROW_GROUP_BYTES = 16 << 30

_SEQUENTIAL_ROWS = 1 << 16  # most rows per read when reading a file in order
# What pyarrow's conversion of a decoded value to Python raises for one Python cannot
# hold (decoding errors are CorruptDataErrors before this).
_UNCONVERTIBLE = (OverflowError, pa.ArrowInvalid)
T = TypeVar("T")
# A mapped entry's access time (its LRU position in the disk cache) is refreshed at most
# this often while a process uses it.
_TOUCH_SECONDS = 60.0
# Remedies of a pass whose row groups do not fit a cache (cache_blocks).
_SHUFFLE = (
    "use BlockShuffleSampler (row groups in random order, rows shuffled within a window "
    "of a few: each decoded once a pass)"
)
_CONVERT = (
    "convert to ArrayRecord (torchgrain convert SRC DST --to array_record): records read "
    "one by one, no row groups"
)


class ParquetSource(RowGroupLoader):
    """Random-access, key-value view of one or many Parquet files.

    Args:
        paths: a directory (searched recursively for ``*.parquet`` / ``*.parq``, including
            hive-partitioned ``key=value/`` sub-directories), a glob, a single file, a list
            of these, or fsspec URLs (``s3://``, ``gs://``, ``memory://``...).
        columns: the columns to read (default: all); only their pages are read and decoded.
            Partition keys may be listed too.
        options: how the files are read (:class:`~torchgrain.ReadOptions`); each of its
            fields is also accepted as a keyword argument, which replaces that field. Here
            ``cache_bytes`` is this process's row-group cache, in bytes of decoded Arrow data
            (default 256 MiB; ``0`` disables it; :meth:`cache_info` reports it),
            ``max_open_files`` defaults to 64, and ``verify_checksums`` is off (pages
            carry a CRC only where the writer added one).
        decoded_cache: the node-shared cache of decoded row groups on local disk:
            ``"auto"`` (default: on when the selected columns' decoded size exceeds both
            ``cache_bytes`` and 256 MiB, and the directory is not on a network filesystem),
            ``True``, a directory path or a
            :class:`~torchgrain.sources.parquet.decoded_cache.DecodedCache`, or ``False``.
            :attr:`decoded_cache` is the cache in use, or None.
        decoded_cache_bytes: that directory's budget (default: 64 GiB, or half of the disk's
            free space plus what the cache holds, whichever is less); it never fills its disk.
        partitioning: ``"hive"`` (default) turns ``key=value`` directory names into columns;
            ``None`` ignores directory names.
        max_row_group_bytes: the most bytes one row group's selected columns (and each of
            their pages) may need decoded, checked from the footer and page headers before
            pyarrow reserves memory (default 16 GiB, :data:`DEFAULT_MAX_ROW_GROUP_BYTES`);
            over it is a :class:`~torchgrain.CorruptDataError`.
        int96_timestamp_unit: the unit INT96 timestamps (Spark's legacy default) read at:
            ``"ns"`` (default; Arrow's), ``"us"``, ``"ms"`` or ``"s"``. In nanoseconds a
            date outside 1677-09-21..2262-04-11 (Spark's 9999-12-31) is a
            :class:`~torchgrain.CorruptDataError`; ``"us"`` reads it.
        filter: a :class:`pyarrow.compute.Expression` (or any predicate
            :func:`~torchgrain.compose.filter.filter_dataset` takes): the source is then the
            rows where it holds, found once per machine and pushed down to the files.

    Records are dicts ``{column: value}`` (numbers, ``str``, ``bytes``, numpy arrays for lists
    of numbers, ``dict`` for structs, ``numpy.datetime64``, ``None``). The files' schemas are
    merged at open (a missing nullable column reads as ``None``, lossless widening applied,
    anything else a :class:`~torchgrain.SchemaMismatchError`). Opening reads only the footers;
    each process opens its own readers, so the source pickles small. The value table, schema
    rules and caching by access order: docs/parquet.md#parquetsource-in-full.

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

    def __new__(cls, *args: Any, filter: Any = None, **kwargs: Any) -> Any:
        # With a filter, the constructor returns a filtered view of the whole source
        # (a Source, not a ParquetSource): the reads, caches and checks stay the
        # source's own, and nothing below has to know about filters.
        if filter is None:
            return super().__new__(cls)
        from torchgrain.compose.filter import filter_dataset

        return filter_dataset(cls(*args, **kwargs), filter).source

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        columns: Sequence[str] | None = None,
        options: ReadOptions | None = None,
        decoded_cache: bool | str | os.PathLike | DecodedCache = "auto",
        decoded_cache_bytes: int | None = None,
        partitioning: str | None = "hive",
        max_row_group_bytes: int = DEFAULT_MAX_ROW_GROUP_BYTES,
        int96_timestamp_unit: str = "ns",
        filter: Any = None,  # (taken by __new__)
        **read_options: Any,
    ) -> None:
        opts = ReadOptions.build(options, read_options)
        cache_bytes = opts.cache_bytes_or(DEFAULT_CACHE_BYTES)
        self._verify = opts.verify_or(False)
        self.max_row_group_bytes = check_ceiling("max_row_group_bytes", max_row_group_bytes, 0)
        if decoded_cache_bytes is not None:
            check_ceiling("decoded_cache_bytes", decoded_cache_bytes, 1)
        if int96_timestamp_unit not in ("ns", "us", "ms", "s"):
            raise ValueError(
                f"int96_timestamp_unit must be 'ns', 'us', 'ms' or 's', got {int96_timestamp_unit!r}"
            )
        self.int96_timestamp_unit = int96_timestamp_unit
        if partitioning not in ("hive", None):
            raise ValueError(f"partitioning must be 'hive' or None, got {partitioning!r}")
        self.partitioning = partitioning
        if isinstance(columns, str):
            raise TypeError("columns must be a sequence of column names, not a string")
        if columns is not None:
            columns = list(columns)
            dup = sorted({c for c in columns if columns.count(c) > 1})
            if dup:
                raise ValueError(f"columns lists {dup[0]!r} more than once")
        retry = opts.retry_policy
        with using(retry):  # the transport and open-time requests keep to its deadlines
            fs, files, bases = resolve(
                paths,
                opts.storage_options,
                opts.filesystem,
                allow_external=opts.allow_external_paths,
            )
        parts = partitions(fs, files, bases) if partitioning == "hive" else [{} for _ in files]
        part_keys = check_partition_keys(files, parts)

        counts, schemas, rg_bytes, identities = read_footers(
            fs, files, retry, columns, int96_timestamp_unit
        )
        fields, present = merge_file_schemas(files, schemas, columns, part_keys)
        self._file_fields: list[pa.Field] = fields
        self._file_schema = pa.schema(fields)
        self._present = present  # bool (num_shards, num_file_columns)
        # Bytes a row of each file takes at least, decoded (for max_row_group_bytes).
        widths = np.array([fixed_bytes(f.type) for f in fields], dtype=np.int64)
        self._row_bytes = present.astype(np.int64) @ widths
        self._part_keys = [k for k in part_keys if columns is None or k in columns]
        # Every partition key's values and every column of the files, read or not: a
        # filter expression may name any of them (pushdown.matching_rows).
        parsed = {key: partition_values([p[key] for p in parts]) for key in part_keys}
        self._part_values: dict[str, np.ndarray] = {k: v for k, (v, _) in parsed.items()}
        self._part_types: dict[str, pa.DataType] = {k: t for k, (_, t) in parsed.items()}
        self._file_columns = all_names(schemas)
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
        by_name.update({k: pa.field(k, t) for k, t in self._part_types.items()})
        self.arrow_schema: pa.Schema = pa.schema([by_name[k] for k in self._keys])
        self._file_pos = [file_names.index(k) if k in file_names else -1 for k in self._keys]

        # Row-group index, all numpy: global row offsets (R + 1), owning shard, local number.
        rg_counts = np.concatenate([np.zeros(0, np.int64), *counts]).astype(np.int64)
        self._rg_offsets = np.concatenate([[0], np.cumsum(rg_counts)]).astype(np.int64)
        self._rg_shard = np.repeat(np.arange(len(files), dtype=np.int64), [len(c) for c in counts])
        first = np.searchsorted(self._rg_shard, self._rg_shard)  # each file's first row group
        self._rg_local = np.arange(len(rg_counts), dtype=np.int64) - first
        # Estimated decoded bytes of each row group (the selected columns), from footers.
        self._rg_bytes = np.concatenate([np.zeros(0, np.int64), *rg_bytes]).astype(np.int64)
        for a in (self._rg_offsets, self._rg_shard, self._rg_local, self._rg_bytes):
            a.setflags(write=False)
        self._identities = identities  # what each file's decoded-cache entries hash
        self._schema_bytes = self._file_schema.serialize().to_pybytes()
        self.decoded_cache: DecodedCache | None = decoded_cache_for(
            decoded_cache, decoded_cache_bytes, int(self._rg_bytes.sum()), cache_bytes
        )
        # Records are built per batch from the compact data; when the whole dataset's
        # records, converted, fit the cache beside it, row groups are converted whole
        # once and records copied from them (faster still; a process stops converting
        # at its cache's first eviction, so a wrong estimate cannot make it thrash).
        self._convert_rows = (
            self.decoded_cache is None
            and 0
            < int(self._rg_bytes.sum()) + converted_bytes(int(rg_counts.sum()), len(self._keys))
            <= cache_bytes
        )
        self._init_shards(
            filesystem=fs,
            paths=files,
            counts=np.array([int(c.sum()) for c in counts], dtype=np.int64),
            options=opts,
            # The footer reads found each file's size: a pass's cache-fit check asks for none.
            sizes={k: int(ident[1][0]) for k, ident in enumerate(identities)},
        )
        # Reads use Arrow's take, which imports pyarrow.compute (about 50 ms) on first
        # use: import it here, so that forked DataLoader workers inherit it.
        import pyarrow.compute  # noqa: F401

    # ------------------------------------------------------------ the contract
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
        for f, pos in zip(self.arrow_schema, self._file_pos):  # (in the order of keys)
            name = value_type_name(f.type)
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
        if len(idx) == 0:
            return []
        return self._converted(self._records, idx)

    def _records(self, idx: np.ndarray) -> list[dict[str, Any]]:
        groups = self._rg_offsets.searchsorted(idx, side="right") - 1
        distinct, first, which = np.unique(groups, return_index=True, return_inverse=True)
        t_start = time.perf_counter()
        convert = self._convert_rows and self._blocks.evictions == 0
        form = "templates" if convert else "rows"
        entries, read_seconds = self._entries(distinct.tolist(), idx[first], form)
        rows = idx - self._rg_offsets[groups]
        # Every entry is prepared for the form asked for (one converted before the cache
        # first evicted, its table let go, is loaded again for building records).
        if convert:
            out = copy_records([e.templates for e in entries], which, rows)
        else:
            constants = self._constants(self._rg_shard[distinct][which])
            views = [e.rows for e in entries]
            out = build_records(self._keys, self._file_pos, views, which, rows, constants)
        count_decode(time.perf_counter() - t_start - read_seconds)
        trimmer().settle()  # the decode buffers this read freed go back to the system
        return out

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        """Read a batch as columns, without a Python object per row where the types allow
        (see :func:`~torchgrain.sources.parquet.values.arrow_column`): numbers, fixed-size lists,
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
        return self._converted(self._columns, idx)

    def _columns(self, idx: np.ndarray) -> ColumnBatch:
        groups = self._rg_offsets.searchsorted(idx, side="right") - 1
        plan = GatherPlan(groups, idx - self._rg_offsets[groups])
        distinct = plan.groups.tolist()
        t_start = time.perf_counter()
        entries, read_seconds = self._entries(distinct, idx[plan.first], "views")
        views = [entry.views for entry in entries]
        gathered = gather(views, plan)
        columns: dict[str, Any] = {}
        shards = self._rg_shard[groups]
        for key, pos in zip(self._keys, self._file_pos):
            if pos < 0:  # a hive partition key: one value per file
                columns[key] = column_of(self._part_values[key][shards].tolist())
                continue
            col = gathered.get(int(pos))
            if col is None:  # Arrow does it: each group's rows, then request order
                joined = take_rows([e.table.column(int(pos)) for e in entries], plan)
                col = arrow_column(joined.take(int64_array(plan.where)))
            columns[key] = col
        count_decode(time.perf_counter() - t_start - read_seconds)
        trimmer().settle()  # the decode buffers this read freed go back to the system
        return ColumnBatch(columns, num_rows=len(idx))

    def check_unchanged(self, shard: int) -> None:
        """Raise if local ``shard``'s file is not the version the opening read (its size,
        modification time, inode or change time differs): its row groups in this
        process's caches are of that version."""
        if not self._remote:
            path = self._paths[shard]
            if local_version(os.stat(path)) != tuple(self._identities[shard][1]):
                raise changes.changed_since_opening(shard, path)

    def _converted(self, read: Callable[[np.ndarray], T], idx: np.ndarray) -> T:
        """``read(idx)``, a value Python cannot hold (a nested date past year 9999, a
        timestamp of an unknown time zone: pyarrow's conversion raises) an error naming
        a record of ``idx`` that holds one (found by halving: a few reads), its file and
        row group."""
        try:
            return read(idx)
        except _UNCONVERTIBLE as e:
            error = e
        part = idx
        while len(part) > 1:
            half = part[: len(part) // 2]
            try:
                read(half)
            except _UNCONVERTIBLE as e:
                part, error = half, e
            else:
                part = part[len(half) :]
        try:
            read(part)
            what = f"one of records {idx[:8].tolist()}{' ...' if len(idx) > 8 else ''}"
        except _UNCONVERTIBLE as e:
            error, what = e, f"record index {int(part[0])}"
        g = int(self._rg_offsets.searchsorted(int(part[0]), side="right")) - 1
        where = self._where(int(self._rg_shard[g]), int(self._rg_local[g]))
        raise RecordDecodeError(
            f"{what} ({where}) holds a value Python cannot hold: {error} "
            "(read the dataset with columns= leaving that column out, or rewrite it)"
        ) from error

    def shard_version(self, shard: int) -> tuple | None:
        """The version of remote ``shard`` this source's opening read: as pinned, else
        (a store whose answers carry no ETag or Last-Modified) the version its footer
        read found (``(size, version, None)``; a file of a store that gives none is
        this opening's own: no other opening shares what is derived from it); None for
        a local file (see :meth:`check_unchanged`).

        Example:
            >>> import io, fsspec, pyarrow as pa, pyarrow.parquet as pq, torchgrain as tg
            >>> b = io.BytesIO(); pq.write_table(pa.table({"x": [1]}), b)
            >>> fsspec.filesystem("memory").pipe("/v/a.parquet", b.getvalue())
            >>> tg.ParquetSource("memory://v/a.parquet").shard_version(0)[0] == len(b.getvalue())
            True
        """
        held = super().shard_version(shard)
        if not self._remote or (held is not None and any(held[1:])):
            return held
        size, version = self._identities[shard][1]
        return (size, version, None)

    def record_settings(self) -> tuple:
        """``partitioning``, ``int96_timestamp_unit`` and the files' whole schema (a
        filter's expression may name columns it does not read): what the same files
        give other values under (see :meth:`Source.record_settings
        <torchgrain.Source.record_settings>`).

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_parquet([{"x": 1}], d)
            >>> tg.ParquetSource(d).record_settings()[:2]
            ('hive', 'ns')
        """
        return (self.partitioning, self.int96_timestamp_unit, self._schema_bytes)

    @property
    def io_stats(self) -> dict[str, int]:
        """This process's I/O counters; with the decoded disk cache, its counters too
        (``decoded_hits``: row groups mapped, ``decoded_builds``: decoded and written
        by this process, ``decoded_waits``, ``decoded_corrupt``, ``decoded_evictions``,
        ``decoded_bytes_written``, ``decoded_not_stored``)."""
        out = super().io_stats
        if self.decoded_cache is not None:
            out.update({f"decoded_{k}": v for k, v in self.decoded_cache.stats.items()})
        return out

    def cache_blocks(self) -> list[CacheBlocks]:
        """The caches a pass goes through (see :meth:`check_cache_fit`): the in-memory
        row-group cache, or with the decoded disk cache on, that (the in-memory one then
        holds maps of it, no decoded data); and for remote files with ``cache_dir``, the
        shard cache. Row groups cost their decoded size estimated from the footers."""
        out = super().cache_blocks()
        disk = self.decoded_cache
        if disk is None and self.cache_bytes <= 0:
            return out
        # In memory, converted records hold Python objects beside the values, or else
        # the views records are built from are charged too (_convert_rows needs no disk).
        convert = self._convert_rows
        per_row = converted_bytes(1, len(self._keys)) if convert else 0
        per_group = views_bytes(len(self._file_fields)) if disk is None and not convert else 0

        def cost(g: np.ndarray) -> np.ndarray:
            rows = self._rg_offsets[g + 1] - self._rg_offsets[g]
            return self._rg_bytes[g] + per_row * rows + per_group

        if disk is None:
            remedies: tuple[str, ...] = (
                "decoded_cache=True (each row group decoded once per machine into a "
                "memory-mapped disk cache, read at the in-memory rate after)",
                _SHUFFLE,
                "raise cache_bytes above the working set, memory allowing (every "
                "DataLoader worker holds its own)",
                _CONVERT,
            )
        else:
            remedies = (
                "raise decoded_cache_bytes above the working set (disk allowing)",
                _SHUFFLE,
                _CONVERT,
            )
        out.append(
            CacheBlocks(
                cache="row-group cache" if disk is None else "decoded disk cache",
                unit="row group",
                offsets=self._rg_offsets,
                nbytes=cost,
                capacity=self.cache_bytes if disk is None else disk.max_bytes,
                per_process=disk is None,
                total=int(cost(np.arange(self.num_row_groups)).sum()),
                remedies=remedies,
            )
        )
        return out

    def block_offsets(self) -> np.ndarray:
        """Global record offsets of the row groups (for :class:`BlockShuffleSampler`).

        An int64 array that starts at 0, ends at ``len(self)`` and is strictly
        increasing (empty row groups and files are left out). Needs no I/O.
        """
        return np.unique(self._rg_offsets)

    def iter_shard(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of one file, in order, a row group at a time: each
        decoded once, straight from the file (a sequential read, such as a conversion,
        neither needs nor fills the caches; a dataset bigger than the memory cache is not
        copied into the decoded disk cache by reading it once)."""
        start, stop = shard_rows(self.index.counts, shard, start, stop)
        base = int(self.index.offsets[shard])
        a, end = base + start, base + stop
        while a < end:
            g = int(self._rg_offsets.searchsorted(a, side="right")) - 1
            first, last = int(self._rg_offsets[g]), int(self._rg_offsets[g + 1])
            t0 = time.perf_counter()
            table = self._decode(g, a)
            count_read(time.perf_counter() - t0, table.nbytes)
            views = RowViews(table)
            for c in range(a, min(end, last), _SEQUENTIAL_ROWS):
                d = min(c + _SEQUENTIAL_ROWS, end, last)
                rows = np.arange(c - first, d - first, dtype=np.int64)
                which = np.zeros(len(rows), dtype=np.int64)
                constants = self._constants(np.full(len(rows), shard))
                try:
                    out = build_records(self._keys, self._file_pos, [views], which, rows, constants)
                except _UNCONVERTIBLE:
                    self._converted(self._records, np.arange(c, d))  # (names the record)
                    raise
                yield from out
            a = min(end, last)

    # ---------------------------------------------------------------- reading
    def _entries(
        self, groups: list[int], first: np.ndarray, form: str
    ) -> tuple[list[RowGroup], float]:
        """The cached entries of ``groups`` (a batch's distinct row groups), loading the
        missing ones, each prepared for one batch format (``form``, see
        :meth:`_prepare`); and the seconds spent loading. ``first[k]`` is a record index
        in ``groups[k]`` (for error messages).
        """
        cache = self._blocks
        entries: list[RowGroup | None] = cache.get_many(groups)  # counts a miss per absent
        self._drop_changed(entries)  # mapped ones whose decoded-cache file changed: reload
        # A row group converted to records has dropped its table: read as missing by a
        # format that needs the table.
        missing = [
            k
            for k, e in enumerate(entries)
            if e is None or (e.table is None and (form != "templates" or e.templates is None))
        ]
        read_seconds = 0.0
        read_bytes = 0
        if missing:
            trimmer()  # made before the first decode: its baseline excludes decoded data
            t0 = time.perf_counter()
            preparing = 0.0
            loaded = self._map(lambda k: self._load(groups[k], int(first[k])), missing)
            for k, entry in zip(missing, loaded):
                # A row group mapped from the decoded disk cache was read too (its table's
                # bytes, not the small charge the memory cache takes for a map).
                read_bytes += entry.table.nbytes if entry.table is not None else entry.nbytes
                entries[k] = entry
                # Prepared at once: a row group converted to records lets its table go
                # before the next one is decoded.
                t1 = time.perf_counter()
                self._prepare([entry], [groups[k]], form)
                preparing += time.perf_counter() - t1
            read_seconds = time.perf_counter() - t0 - preparing
        self._prepare(entries, groups, form)  # type: ignore[arg-type]  # (the hits)
        now = time.monotonic()
        for entry in entries:
            assert entry is not None
            if entry.path is not None and now - entry.touched > _TOUCH_SECONDS:
                entry.touched = now  # refresh its place in the disk cache's LRU order
                assert self.decoded_cache is not None
                self.decoded_cache.touch(entry.path)
        counters = local_counters()
        counters[COUNTER["cache_misses"]] += len(missing)
        counters[COUNTER["cache_hits"]] += len(entries) - len(missing)
        count_read(read_seconds, read_bytes)
        return entries, read_seconds  # type: ignore[return-value]

    def _constants(self, shards: np.ndarray) -> dict[int, list[Any]]:
        """The values of the hive partition keys in files ``shards`` (one per row), by
        key position."""
        return {
            j: self._part_values[key][shards].tolist()
            for j, (key, pos) in enumerate(zip(self._keys, self._file_pos))
            if pos < 0
        }

    def _prepare(self, entries: list[RowGroup], groups: list[int], form: str) -> None:
        """Prepare cached row groups for a batch format, each once (a benign race), and
        charge the cache for what that adds: ``"rows"`` (views for building records),
        ``"templates"`` (records converted whole, while they fit the cache) or
        ``"views"`` (packed columns)."""
        cache = self._blocks
        for group, entry in zip(groups, entries):
            if getattr(entry, form) is not None:
                continue
            if form == "rows":
                entry.rows = RowViews(entry.table)
            elif form == "templates":
                one = self._constants(self._rg_shard[group : group + 1])  # (a value each)
                constants = {j: v * entry.table.num_rows for j, v in one.items()}
                entry.templates = RowTemplates(entry.table, self._keys, self._file_pos, constants)
                if entry.path is None and entry.views is None:
                    entry.drop_table()  # the converted records hold its values
                    # Let its buffers go now, not at the end of the batch (a global
                    # shuffle's first batch converts nearly every row group).
                    trimmer().settle()
            else:
                entry.views = GroupViews(entry.table)
            if cache.max_bytes > 0:
                cache.put(group, entry, entry.charge())

    def __repr__(self) -> str:
        return (
            f"ParquetSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"num_row_groups={self.num_row_groups}, keys={self._keys})"
        )
