"""ParquetSource: random access, key-value records over sharded Parquet files.

Parquet decodes whole row groups (per column), so reading one record at a time with
``ParquetFile.read_row_group`` re-decodes a row group per record. This source instead

* indexes every row group of every file from the files' footers only (read in
  parallel threads; no data page is read when opening),
* groups a batch request by row group, decodes each needed row group once (only the
  requested columns) and converts it column-wise to Python/numpy values, and
* keeps decoded row groups in a per-process :class:`~torchgrain.io.cache.RowGroupCache`
  bounded in bytes, so block-local orders (:class:`~torchgrain.BlockShuffleSampler`)
  and repeated hits pay one decode per row group.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchgrain.diagnostics import COUNTER, local_counters
from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RemoteIOError,
    SchemaMismatchError,
)
from torchgrain.io.cache import DEFAULT_CACHE_BYTES, CacheInfo, RowGroupCache
from torchgrain.io.fs import (
    expand_paths,
    filesystem_for_this_process,
    get_filesystem,
    is_local,
)
from torchgrain.io.retry import retry_call
from torchgrain.sources._index import ShardIndex

__all__ = ["PARQUET_SUFFIXES", "ParquetSource", "arrow_type_name", "common_type", "merge_types"]

PARQUET_SUFFIXES = (".parquet", ".parq")
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)")
# Open ParquetFile readers kept per process (each holds a file descriptor and a footer).
_MAX_OPEN_FILES = 64
# Rough cost of one Python object held in a cached row group (object header + pointer),
# added to the Arrow buffer size when charging the cache.
_PY_OBJECT_BYTES = 48
_FOOTER_THREADS = 16
# A row group first read with at least 1/_CONVERT_WHOLE of its rows in one batch is
# converted whole at once (block-local reads); otherwise only those rows, until reuse.
_CONVERT_WHOLE = 16
# Per-process state inherited through fork is kept referenced (never freed) in the
# child: releasing it would write to every inherited page (refcounts, allocator
# metadata) and turn shared copy-on-write pages into private copies.
_INHERITED: list[Any] = []


class _ProcessState:
    """Readers and cache owned by one process."""

    __slots__ = ("cache", "files", "lock", "pid")

    def __init__(self, cache_bytes: int) -> None:
        self.pid = os.getpid()
        self.files: OrderedDict[int, _Reader] = OrderedDict()
        self.cache = RowGroupCache(cache_bytes)
        self.lock = threading.Lock()


class ParquetSource:
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
        (6, 2, {'x': 'list<double>', 'label': 'int64', 'split': 'int64'})
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
    ) -> None:
        if partitioning not in ("hive", None):
            raise ValueError(f"partitioning must be 'hive' or None, got {partitioning!r}")
        if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an integer >= 0, got {cache_bytes!r}")
        if isinstance(columns, str):
            raise TypeError("columns must be a sequence of column names, not a string")
        if columns is not None:
            columns = list(columns)
            dup = sorted({c for c in columns if columns.count(c) > 1})
            if dup:
                raise ValueError(f"columns lists {dup[0]!r} more than once")
        self.cache_bytes = cache_bytes
        fs, files, bases = _resolve(paths, storage_options, filesystem)
        self._fs = fs
        self._local_fs = is_local(fs)
        self.paths: list[str] = files

        parts = _partitions(fs, files, bases) if partitioning == "hive" else [{} for _ in files]
        part_keys = _check_partition_keys(files, parts)

        counts, schemas = self._read_footers()
        fields, present = _merge_schemas(files, schemas, columns, part_keys)
        self._file_fields: list[pa.Field] = fields
        self._file_schema = pa.schema(fields)
        self._present = present  # bool (num_shards, num_file_columns)
        self._part_keys = [k for k in part_keys if columns is None or k in columns]
        self._part_values: dict[str, np.ndarray] = {}
        part_types: dict[str, pa.DataType] = {}
        for key in self._part_keys:
            values, typ = _partition_values([p[key] for p in parts])
            self._part_values[key] = values
            part_types[key] = typ
        file_names = [f.name for f in fields]
        if columns is not None:
            known = set(file_names) | set(self._part_keys)
            missing = [c for c in columns if c not in known]
            if missing:
                raise ValueError(
                    f"column {missing[0]!r} is in no Parquet file of this dataset; "
                    f"columns are {[*_all_names(schemas), *part_keys]}"
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
        self.index = ShardIndex(np.array([int(c.sum()) for c in counts], dtype=np.int64))
        self._proc: _ProcessState | None = None
        # Reads use Arrow's take, which imports pyarrow.compute (about 50 ms) on first
        # use: import it here, so that forked DataLoader workers inherit it.
        import pyarrow.compute  # noqa: F401

    # ----------------------------------------------------------------- opening
    def _read_footers(self) -> tuple[list[np.ndarray], list[pa.Schema]]:
        def one(shard: int) -> tuple[np.ndarray, pa.Schema]:
            md = self._metadata(shard)
            counts = np.array(
                [md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64
            )
            return counts, md.schema.to_arrow_schema()

        n = len(self.paths)
        if n == 1:
            results = [one(0)]
        else:
            with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, n)) as pool:
                results = list(pool.map(one, range(n)))
        return [r[0] for r in results], [r[1] for r in results]

    def _metadata(self, shard: int) -> pq.FileMetaData:
        path = self.paths[shard]
        try:
            if self._local_fs:
                return pq.read_metadata(path)
            with self._fs.open(path, "rb") as f:
                return pq.read_metadata(f)
        except FileNotFoundError:
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from None
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptDataError(
                f"cannot read the Parquet footer of {path!r} (shard {shard} of "
                f"{len(self.paths)}): {e}"
            ) from e

    def _state(self) -> _ProcessState:
        st = self._proc
        if st is None or st.pid != os.getpid():
            if st is not None:
                _INHERITED.append(st)
                # Forked: the parent's async filesystem (s3fs, http) is bound to an
                # event loop that does not run in this process.
                self._fs = filesystem_for_this_process(self._fs)
            st = self._proc = _ProcessState(self.cache_bytes)
        return st

    def _file(self, st: _ProcessState, shard: int) -> _Reader:
        with st.lock:
            reader = st.files.get(shard)
            if reader is not None:
                st.files.move_to_end(shard)
                return reader
        path = self.paths[shard]
        handle = None
        try:
            if self._local_fs:
                # pre_buffer coalesces reads through Arrow's I/O threads, which pays on
                # object storage; on a local file it only adds thread hand-offs (block
                # reads measured 15-35% faster without, most on small row groups).
                pf = pq.ParquetFile(path, pre_buffer=False)
            else:
                handle = self._fs.open(path, "rb")
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
        reader = _Reader(pf, handle)
        evicted = []
        with st.lock:
            other = st.files.get(shard)
            if other is not None:  # another thread opened it meanwhile: use that one
                evicted.append(reader)
                reader = other
            else:
                st.files[shard] = reader
                while len(st.files) > _MAX_OPEN_FILES:
                    evicted.append(st.files.popitem(last=False)[1])
        for old in evicted:  # outside st.lock: waits for a read in progress on it
            old.close()
        return reader

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
        """Record key -> pyarrow type name (``int64``, ``string``, ``list<float>``...)."""
        return {f.name: arrow_type_name(f.type) for f in self.arrow_schema}

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
        return self._gather(groups[order], rows[order], idx[order], order)

    def block_offsets(self) -> np.ndarray:
        """Global record offsets of the row groups (for :class:`BlockShuffleSampler`).

        An int64 array that starts at 0, ends at ``len(self)`` and is strictly
        increasing (empty row groups and files are left out). Needs no I/O.
        """
        return np.unique(self._rg_offsets)

    def cache_info(self) -> CacheInfo:
        """This process's row-group cache counters (a miss is one row-group decode)."""
        return self._state().cache.cache_info()

    def close(self) -> None:
        """Close this process's open readers and empty its cache (both reopen lazily)."""
        st = self._proc
        if st is None or st.pid != os.getpid():
            return
        with st.lock:
            readers = list(st.files.values())
            st.files.clear()
        for reader in readers:
            reader.close()
        st.cache.clear()

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
        st = self._state()
        cache = st.cache
        t_start = time.perf_counter()
        read_seconds = 0.0
        read_bytes = 0
        entries = cache.get_many(distinct)  # counts a miss per absent group
        local = rows.copy()  # row of each value in its group's converted rows
        converted: list[_RowGroup] = []
        for k, entry in enumerate(entries):
            g, s, e = distinct[k], starts[k], ends[k]
            if entry is None:
                t0 = time.perf_counter()
                table = self._decode(st, g, int(indices[s]))
                read_seconds += time.perf_counter() - t0
                read_bytes += table.get_total_buffer_size()
                if self._block_local(e - s, n, table.num_rows):
                    entry = self._convert_group(table, g)
                else:
                    entry = _RowGroup(table, None)
                if cache.max_bytes > 0:
                    cache.put(g, entry, entry.nbytes)
                if entry.records is None:
                    taken = table.take(_int64_array(local[s:e]))
                    converted.append(self._convert_group(taken, g))
                    local[s:e] = np.arange(e - s)
                    continue
            elif entry.records is None:
                # Reuse is proven: convert the whole row group once. A new entry replaces
                # the cached one (never mutated in place: another thread may be reading it).
                entry = self._convert_group(entry.table, g)
                cache.put(g, entry, entry.nbytes)  # re-charged at its converted size
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
        misses = sum(1 for entry in entries if entry is None)
        counters[COUNTER["cache_misses"]] += misses
        counters[COUNTER["cache_hits"]] += len(entries) - misses
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

    def _convert_group(self, table: pa.Table, group: int) -> _RowGroup:
        """Convert decoded rows of ``group`` into record templates (see :meth:`_gather`)."""
        n = table.num_rows
        shard = int(self._rg_shard[group])
        columns = [_convert(c) for c in table.columns]
        records: list[dict[str, Any]] = [{} for _ in range(n)]
        mutable: list[tuple[str, _Column]] = []
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
        return _RowGroup(None, records, mutable, nbytes)

    def _decode(self, st: _ProcessState, group: int, index: int) -> pa.Table:
        shard = int(self._rg_shard[group])
        local = int(self._rg_local[group])
        num_rows = int(self._rg_offsets[group + 1] - self._rg_offsets[group])
        present = self._present[shard]
        names = [f.name for f, p in zip(self._file_fields, present) if p]

        def read() -> pa.Table:
            while True:
                reader = self._file(st, shard)
                with reader.lock:  # pyarrow's reader is not safe for concurrent reads
                    if not reader.closed:  # (else evicted meanwhile: open it again)
                        return reader.pf.read_row_group(local, columns=names, use_threads=False)

        try:
            if self._local_fs:
                table = read()
            else:
                table = retry_call(
                    read,
                    url=self.paths[shard],
                    what=f"read of row group {local} (record index {index})",
                )
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

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc"] = None  # readers and cache are per process
        return state

    def __repr__(self) -> str:
        return (
            f"ParquetSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"num_row_groups={self.num_row_groups}, keys={self._keys})"
        )


# ----------------------------------------------------------------- resolution
def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _resolve(
    paths: Any,
    storage_options: dict[str, Any] | None,
    filesystem: fsspec.AbstractFileSystem | None,
) -> tuple[fsspec.AbstractFileSystem, list[str], list[str]]:
    """Expand ``paths`` to files; also return, per file, the base directory of its item."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise DatasetNotFoundError("no Parquet paths given")
    fs: fsspec.AbstractFileSystem | None = filesystem
    files: list[str] = []
    bases: list[str] = []
    seen: set[str] = set()
    for item in items:
        item_fs, found = expand_paths(
            item,
            suffixes=PARQUET_SUFFIXES,
            storage_options=storage_options,
            filesystem=filesystem,
            kind="Parquet",
        )
        if fs is None:
            fs = item_fs
        elif item_fs is not fs and item_fs.protocol != fs.protocol:
            raise ValueError(
                f"Parquet paths mix filesystems ({fs.protocol} and {item_fs.protocol}); "
                "give one filesystem's paths"
            )
        text = os.fspath(item)
        if filesystem is None:
            stripped = get_filesystem(text, storage_options)[1]
        else:
            stripped = filesystem._strip_protocol(text)
        stripped = stripped.rstrip("/")
        if _has_glob(stripped):
            prefix = stripped[: min(stripped.index(c) for c in "*?[" if c in stripped)]
            base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        elif len(found) == 1 and item_fs._strip_protocol(found[0]).rstrip("/") == stripped:
            base = posixpath.dirname(stripped)  # a single file: no partition directories
        else:
            base = stripped
        for f in found:
            if f not in seen:
                seen.add(f)
                files.append(f)
                bases.append(base)
    assert fs is not None
    return fs, files, bases


def _partitions(
    fs: fsspec.AbstractFileSystem, files: list[str], bases: list[str]
) -> list[dict[str, str | None]]:
    """Hive ``key=value`` directory names between each file and its base directory."""
    out = []
    for f, base in zip(files, bases):
        path = fs._strip_protocol(f)
        rel = path[len(base) :].lstrip("/") if base and path.startswith(base) else path
        parts: dict[str, str | None] = {}
        for seg in rel.split("/")[:-1]:
            if "=" not in seg:
                continue
            key, _, value = seg.partition("=")
            key = unquote(key)
            if key:
                parts[key] = None if value == _HIVE_NULL else unquote(value)
        out.append(parts)
    return out


def _check_partition_keys(files: list[str], parts: list[dict[str, str | None]]) -> list[str]:
    if not files:
        return []
    keys = list(parts[0])
    for f, p in zip(files, parts):
        if set(p) != set(keys):
            raise SchemaMismatchError(
                f"hive partition keys differ: {files[0]!r} has {keys} but {f!r} has {list(p)}"
            )
    return keys


def _partition_values(values: list[str | None]) -> tuple[np.ndarray, pa.DataType]:
    """Per-shard values of one partition key, as int64 when all are integers."""
    present = [v for v in values if v is not None]
    typ: pa.DataType = pa.string()
    if present and all(_INT_RE.fullmatch(v) and abs(int(v)) < 2**63 for v in present):
        typ = pa.int64()
        values = [None if v is None else int(v) for v in values]
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr, typ


# ---------------------------------------------------------------------- schema
def _all_names(schemas: list[pa.Schema]) -> list[str]:
    names: dict[str, None] = {}
    for s in schemas:
        names.update(dict.fromkeys(s.names))
    return list(names)


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def merge_types(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type both ``a`` and ``b`` widen to without loss, or None (see ParquetSource).

    Example:
        >>> import pyarrow as pa
        >>> merge_types(pa.int32(), pa.int64()), merge_types(pa.int64(), pa.string())
        (DataType(int64), None)
    """
    a, b = _value_type(a), _value_type(b)
    if a.equals(b):
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b):
        return a
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        sa, sb = pa.types.is_signed_integer(a), pa.types.is_signed_integer(b)
        if sa == sb:
            return a if a.bit_width >= b.bit_width else b
        signed, unsigned = (a, b) if sa else (b, a)
        return signed if signed.bit_width > unsigned.bit_width else None
    if pa.types.is_floating(a) and pa.types.is_floating(b):
        return a if a.bit_width >= b.bit_width else b
    for small, large in ((pa.string(), pa.large_string()), (pa.binary(), pa.large_binary())):
        if {str(a), str(b)} == {str(small), str(large)}:
            return large
    return None


def common_type(types: Sequence[pa.DataType]) -> pa.DataType | None:
    """The narrowest of ``types`` that all of them widen to without loss, or None.

    Unlike folding :func:`merge_types` over a list, the answer does not depend on the
    order: ``uint8, int8, int16`` gives ``int16`` whichever comes first.

    Example:
        >>> import pyarrow as pa
        >>> common_type([pa.uint8(), pa.int8(), pa.int16()])
        DataType(int16)
        >>> common_type([pa.uint8(), pa.int8()]) is None   # no int16 among them
        True
    """
    values = [_value_type(t) for t in types]
    values = [t for t in values if not pa.types.is_null(t)]
    if not values:
        return pa.null()
    if all(pa.types.is_integer(t) for t in values):
        signed = [t for t in values if pa.types.is_signed_integer(t)]
        unsigned = [t for t in values if not pa.types.is_signed_integer(t)]
        widest_s = max(signed, key=lambda t: t.bit_width) if signed else None
        widest_u = max(unsigned, key=lambda t: t.bit_width) if unsigned else None
        if widest_s is None or widest_u is None:
            return widest_s or widest_u
        return widest_s if widest_s.bit_width > widest_u.bit_width else None
    out: pa.DataType | None = values[0]
    for t in values[1:]:
        out = merge_types(out, t)
        if out is None:
            return None
    return out


def _merge_schemas(
    files: list[str],
    schemas: list[pa.Schema],
    columns: list[str] | None,
    part_keys: list[str],
) -> tuple[list[pa.Field], np.ndarray]:
    """Merge the selected columns of every file; return fields and a presence matrix."""
    wanted = None if columns is None else set(columns)
    # name -> [(file, type, nullable)], in file order; names in order of first appearance
    seen: dict[str, list[tuple[int, pa.DataType, bool]]] = {}
    for i, s in enumerate(schemas):
        names = s.names
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SchemaMismatchError(f"{files[i]!r} has more than one column named {dup!r}")
        for field in s:
            name = field.name
            if wanted is not None and name not in wanted:
                continue
            if name in part_keys:
                raise SchemaMismatchError(
                    f"column {name!r} of {files[i]!r} is also a hive partition key in its path"
                )
            seen.setdefault(name, []).append((i, field.type, field.nullable))
    names = list(seen)
    present = np.zeros((len(files), len(names)), dtype=bool)
    for i, s in enumerate(schemas):
        have = set(s.names)
        present[i] = [n in have for n in names]
    fields = []
    for j, name in enumerate(names):
        entries = seen[name]
        typ = common_type([t for _, t, _ in entries])
        if typ is None:
            a, b = _conflict(entries)
            raise SchemaMismatchError(
                f"column {name!r} has type {arrow_type_name(a[1])} in {files[a[0]]!r} but "
                f"{arrow_type_name(b[1])} in {files[b[0]]!r}"
            )
        if not present[:, j].all():
            missing_in = files[int(np.flatnonzero(~present[:, j])[0])]
            required = next((i for i, _, nullable in entries if not nullable), None)
            if required is not None:
                raise SchemaMismatchError(
                    f"column {name!r} is missing from {missing_in!r} but is required "
                    f"(not nullable) in {files[required]!r}"
                )
        fields.append(pa.field(name, typ, nullable=True))
    present.setflags(write=False)
    return fields, present


def _conflict(entries: list[tuple[int, pa.DataType, bool]]) -> tuple[Any, Any]:
    """Two entries (file, type, nullable) whose types have no common type: the first
    file whose type breaks the merge, and an earlier file it conflicts with."""
    for k in range(1, len(entries)):
        if common_type([t for _, t, _ in entries[: k + 1]]) is None:
            for e in entries[:k]:
                if common_type([e[1], entries[k][1]]) is None:
                    return e, entries[k]
            return entries[0], entries[k]
    return entries[0], entries[-1]


def arrow_type_name(t: pa.DataType) -> str:
    """Short pyarrow name of a type, as :attr:`ParquetSource.schema` shows it.

    Example:
        >>> import pyarrow as pa
        >>> arrow_type_name(pa.list_(pa.float32())), arrow_type_name(pa.list_(pa.int8(), 3))
        ('list<float>', 'fixed_size_list<int8>[3]')
    """
    if pa.types.is_dictionary(t):
        return arrow_type_name(t.value_type)
    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list<{arrow_type_name(t.value_type)}>[{t.list_size}]"
    if pa.types.is_large_list(t):
        return f"large_list<{arrow_type_name(t.value_type)}>"
    if pa.types.is_list(t):
        return f"list<{arrow_type_name(t.value_type)}>"
    if pa.types.is_map(t):
        return f"map<{arrow_type_name(t.key_type)}, {arrow_type_name(t.item_type)}>"
    if pa.types.is_struct(t):
        inner = ", ".join(f"{f.name}: {arrow_type_name(f.type)}" for f in t)
        return f"struct<{inner}>"
    return str(t)


# ------------------------------------------------------------------ conversion
class _Column:
    """One decoded column of a row group, converted once, ready to gather rows from.

    ``plain`` columns hold a Python list of final, immutable values (numbers, str,
    bytes, None, numpy datetime64 scalars...), gathered by plain list indexing, which
    keeps a global shuffle (about one row per row group per batch) cheap. Other
    columns build a fresh value per record: ``"copy"`` (numpy arrays, copied so that
    callers may write to them), ``"lists"`` (Python lists, shallow-copied), ``"struct"`` (dicts from converted children) and
    ``"arrow"`` (anything else, through ``to_pylist``).
    """

    __slots__ = ("kind", "nbytes", "plain", "values")

    def __init__(self, kind: str, values: Any, nbytes: int) -> None:
        self.kind = kind
        self.plain = kind == "plain"
        self.values = values
        self.nbytes = int(nbytes)

    def get(self, r: int) -> Any:
        return self.take([r])[0]

    def take(self, rows: list[int]) -> list[Any]:
        values = self.values
        kind = self.kind
        if kind == "plain":
            return [values[r] for r in rows]
        if kind == "copy":
            return [_copy_value(values[r]) for r in rows]
        if kind == "lists":  # lists of immutable values: a shallow copy is private
            return [None if values[r] is None else list(values[r]) for r in rows]
        if kind == "struct":
            names, children, valid = values
            if not names:
                out: list[Any] = [{} for _ in rows]
            else:
                cols = [c.take(rows) for c in children]
                out = [dict(zip(names, vals)) for vals in zip(*cols)]
            if valid is not None:
                out = [rec if valid[r] else None for rec, r in zip(out, rows)]
            return out
        return values.take(_int64_array(rows)).to_pylist()


class _RowGroup:
    """A cached row group: its decoded Arrow table, or its converted records.

    ``records`` holds one template dict per row (immutable values filled in);
    ``mutable`` the ``(key, column)`` pairs whose values are made fresh per read.
    """

    __slots__ = ("mutable", "nbytes", "records", "table")

    def __init__(
        self,
        table: pa.Table | None,
        records: list[dict[str, Any]] | None,
        mutable: list[tuple[str, _Column]] | None = None,
        nbytes: int | None = None,
    ) -> None:
        self.table = table
        self.records = records
        self.mutable = mutable or []
        if nbytes is None:
            assert table is not None
            nbytes = table.nbytes
        self.nbytes = int(nbytes)


def _int64_array(values: Any) -> pa.Array:
    """An Arrow int64 array of ``values`` over a numpy buffer.

    ``pa.array`` would import pandas (about 0.3 s, again in every DataLoader worker
    whose parent never imported it) just to ask whether its input is a pandas object.
    """
    buf = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(buf), [None, pa.py_buffer(buf)])


# Arrow buffers are read straight into numpy here: ``Array.to_numpy`` imports pandas on
# first use (~0.3 s), which every DataLoader worker would pay again at each epoch.
def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """Arrow's little-endian bitmap as a bool array of ``n`` values from bit ``offset``."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little", count=offset + n)[offset:].view(np.bool_)


def _null_mask(arr: pa.Array) -> np.ndarray | None:
    if arr.null_count == 0:
        return None
    if pa.types.is_null(arr.type):
        return np.ones(len(arr), dtype=bool)
    return ~_bits(arr.buffers()[0], arr.offset, len(arr))


def _numpy_dtype(t: pa.DataType) -> tuple[np.dtype, np.dtype | None]:
    """(storage dtype, dtype to view/cast as) of a fixed-width number or temporal type."""
    if pa.types.is_integer(t):
        kind = "i" if pa.types.is_signed_integer(t) else "u"
        return np.dtype(f"<{kind}{t.bit_width // 8}"), None
    if pa.types.is_floating(t):
        return np.dtype(f"<f{t.bit_width // 8}"), None
    if pa.types.is_timestamp(t):
        return np.dtype("<i8"), np.dtype(f"datetime64[{t.unit}]")
    if pa.types.is_duration(t):
        return np.dtype("<i8"), np.dtype(f"timedelta64[{t.unit}]")
    if pa.types.is_date32(t):
        return np.dtype("<i4"), np.dtype("datetime64[D]")
    if pa.types.is_date64(t):
        return np.dtype("<i8"), np.dtype("datetime64[ms]")
    raise TypeError(f"no numpy dtype for {t}")


def _primitive_numpy(arr: pa.Array) -> np.ndarray:
    """Values of a bool/number/temporal array (whatever sits in null slots)."""
    n = len(arr)
    buf = arr.buffers()[1]
    boolean = pa.types.is_boolean(arr.type)
    if buf is None:  # no data buffer (e.g. all null): the values are never looked at
        storage = np.dtype(bool) if boolean else _numpy_dtype(arr.type)[0]
        buf = np.zeros((arr.offset + n) * storage.itemsize, dtype=np.uint8)
    if boolean:
        return _bits(buf, arr.offset, n)
    storage, view = _numpy_dtype(arr.type)
    values = np.frombuffer(buf, dtype=storage, count=arr.offset + n)[arr.offset :]
    if view is None:
        return values
    if view.itemsize == storage.itemsize:
        return values.view(view)
    return values.astype(view)


def _with_nulls(values: list[Any], mask: np.ndarray | None) -> list[Any]:
    if mask is not None:
        for i in np.flatnonzero(mask).tolist():
            values[i] = None
    return values


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


# Values that ``to_pylist`` turns into immutable Python objects in a fast C loop.
_PYLIST_TYPES = (
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_binary,
    pa.types.is_large_binary,
    pa.types.is_fixed_size_binary,
    pa.types.is_decimal,
    pa.types.is_time,
)


def _convert(col: pa.ChunkedArray | pa.Array) -> _Column:
    """Convert a column column-wise (no per-cell pyarrow scalars) for gathering."""
    if isinstance(col, pa.ChunkedArray):  # combine_chunks copies even a single chunk
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    n = len(arr)
    # Python lists cost a pointer per value plus the value object (small for numbers).
    overhead = n * _PY_OBJECT_BYTES
    if pa.types.is_null(t):
        return _Column("plain", [None] * n, n * 8)
    if _is_number(t):
        mask = _null_mask(arr)
        values = _primitive_numpy(arr).tolist()
        return _Column("plain", _with_nulls(values, mask), arr.nbytes + overhead)
    if _is_temporal(t):
        # numpy scalars keep the unit (nanoseconds included); Python datetime cannot.
        mask = _null_mask(arr)
        values = list(_primitive_numpy(arr))
        return _Column("plain", _with_nulls(values, mask), arr.nbytes + overhead)
    if any(is_type(t) for is_type in _PYLIST_TYPES):
        return _Column("plain", arr.to_pylist(), arr.nbytes + overhead)
    if _is_list(t):
        converted = _lists_to_numpy(arr)
        if converted is not None:
            return converted
    elif pa.types.is_map(t):
        converted = _maps_to_python(arr)
        if converted is not None:
            return converted
    elif pa.types.is_struct(t):
        children = [_convert(c) for c in arr.flatten()]
        names = [f.name for f in t]
        mask = _null_mask(arr)
        valid = None if mask is None else (~mask).tolist()
        nbytes = sum(c.nbytes for c in children) + overhead
        return _Column("struct", (names, children, valid), nbytes)
    return _Column("arrow", arr, arr.nbytes + overhead)


def _list_offsets(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """``(offsets, child)``: row i's items are ``child[offsets[i]:offsets[i + 1]]``."""
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
        return offsets, arr.values
    dtype = np.int64 if pa.types.is_large_list(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=dtype, count=arr.offset + len(arr) + 1)
    return offsets[arr.offset :].astype(np.int64), arr.values


def _leaf_numpy(arr: pa.Array) -> np.ndarray | None:
    """A numeric/bool/temporal child as numpy (null slots undefined), else None."""
    t = arr.type
    if not (_is_number(t) or _is_temporal(t)):
        return None
    values = _primitive_numpy(arr)
    values.setflags(write=False)
    return values


def _nulls_only_in_null_rows(
    child: pa.Array, outer: np.ndarray, n: int, mask: np.ndarray | None
) -> bool:
    """True when every null item of ``child`` lies in a null row (e.g. fixed-size lists)."""
    child_mask = _null_mask(child)
    if child_mask is None:
        return True
    pos = np.flatnonzero(child_mask)
    owner = np.searchsorted(outer, pos, side="right") - 1
    owner = owner[(owner >= 0) & (owner < n) & (pos < outer[-1])]
    return mask is not None and bool(mask[owner].all())


def _lists_to_numpy(arr: pa.Array) -> _Column | None:
    """List columns of numbers as per-row numpy arrays (2-D where rectangular).

    Rows are read-only views of one buffer here; ``take`` copies them, so callers get
    writable arrays that do not alias the cache. Lists whose items are not numbers, or
    hold nulls, become Python lists.
    """
    n = len(arr)
    mask = _null_mask(arr)
    outer, child = _list_offsets(arr)
    bounds = outer.tolist()
    leaf = None
    if not _is_list(child.type):
        leaf = _leaf_numpy(child)
        if leaf is None or not _nulls_only_in_null_rows(child, outer, n, mask):
            return _lists_to_python(arr, mask, bounds, child)
        if pa.types.is_fixed_size_list(arr.type):
            k = arr.type.list_size
            rows: list[Any] = list(leaf[bounds[0] : bounds[0] + n * k].reshape(n, k))
        else:
            rows = [leaf[bounds[i] : bounds[i + 1]] for i in range(n)]
    else:
        inner, grandchild = _list_offsets(child)
        leaf = _leaf_numpy(grandchild)
        if leaf is None or child.null_count or grandchild.null_count:
            return None
        if pa.types.is_fixed_size_list(arr.type) and pa.types.is_fixed_size_list(child.type):
            a, b = arr.type.list_size, child.type.list_size
            start = int(inner[bounds[0]])
            rows = list(leaf[start : start + n * a * b].reshape(n, a, b))
        else:
            lengths = np.diff(inner)
            rows = []
            for i in range(n):
                lo, hi = bounds[i], bounds[i + 1]
                lens = lengths[lo:hi]
                if hi == lo:
                    rows.append(leaf[0:0].reshape(0, 0))
                elif (lens == lens[0]).all():
                    part = leaf[int(inner[lo]) : int(inner[hi])]
                    rows.append(part.reshape(hi - lo, int(lens[0])))
                else:
                    rows.append([leaf[int(inner[j]) : int(inner[j + 1])] for j in range(lo, hi)])
    return _Column("copy", _with_nulls(rows, mask), leaf.nbytes + n * 2 * _PY_OBJECT_BYTES)


def _lists_to_python(
    arr: pa.Array, mask: np.ndarray | None, bounds: list[int], child: pa.Array
) -> _Column | None:
    """Lists of strings, bytes, or numbers with null items, as Python lists."""
    values = _convert(child)
    if not values.plain:
        return None
    items = values.values
    n = len(arr)
    rows: list[Any] = [items[bounds[i] : bounds[i + 1]] for i in range(n)]
    return _Column("lists", _with_nulls(rows, mask), values.nbytes + n * _PY_OBJECT_BYTES)


def _maps_to_python(arr: pa.MapArray) -> _Column | None:
    """Map columns as lists of ``(key, value)`` tuples, like ``to_pylist``."""
    n = len(arr)
    mask = _null_mask(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=arr.offset + n + 1)
    bounds = offsets[arr.offset :].tolist()
    key_arr, item_arr = arr.values.flatten()
    keys, items = _convert(key_arr), _convert(item_arr)
    if not (keys.plain and items.plain):
        return None
    pairs = list(zip(keys.values, items.values))
    rows: list[Any] = [pairs[bounds[i] : bounds[i + 1]] for i in range(n)]
    nbytes = keys.nbytes + items.nbytes + (len(pairs) + n) * _PY_OBJECT_BYTES
    return _Column("lists", _with_nulls(rows, mask), nbytes)


def _copy_value(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        return v.copy()
    return [a.copy() for a in v]


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
