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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchgrain.errors import CorruptDataError, DatasetNotFoundError, SchemaMismatchError
from torchgrain.io.cache import DEFAULT_CACHE_BYTES, CacheInfo, RowGroupCache
from torchgrain.io.fs import expand_paths, get_filesystem, is_local
from torchgrain.sources._index import ShardIndex

__all__ = ["PARQUET_SUFFIXES", "ParquetSource", "arrow_type_name"]

PARQUET_SUFFIXES = (".parquet", ".parq")
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)")
# Open ParquetFile readers kept per process (each holds a file descriptor and a footer).
_MAX_OPEN_FILES = 64
# Rough cost of one Python object held in a cached row group (object header + pointer),
# added to the Arrow buffer size when charging the cache.
_PY_OBJECT_BYTES = 64
_FOOTER_THREADS = 16
# Per-process state inherited through fork is kept referenced (never freed) in the
# child: releasing it would write to every inherited page (refcounts, allocator
# metadata) and turn shared copy-on-write pages into private copies.
_INHERITED: list[Any] = []


class _ProcessState:
    """Readers and cache owned by one process."""

    __slots__ = ("cache", "files", "lock", "pid")

    def __init__(self, cache_bytes: int) -> None:
        self.pid = os.getpid()
        self.files: OrderedDict[int, tuple[pq.ParquetFile, Any]] = OrderedDict()
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
        cache_bytes: budget of this process's row-group cache, in decoded bytes
            (default 256 MiB; ``0`` disables it). Each DataLoader worker has its own.
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
            st = self._proc = _ProcessState(self.cache_bytes)
        return st

    def _file(self, st: _ProcessState, shard: int) -> pq.ParquetFile:
        with st.lock:
            item = st.files.get(shard)
            if item is not None:
                st.files.move_to_end(shard)
                return item[0]
        path = self.paths[shard]
        handle = None
        try:
            if self._local_fs:
                pf = pq.ParquetFile(path)
            else:
                handle = self._fs.open(path, "rb")
                pf = pq.ParquetFile(handle, pre_buffer=True)
        except FileNotFoundError:
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from None
        except (pa.ArrowException, OSError, ValueError) as e:
            if handle is not None:
                handle.close()
            raise CorruptDataError(
                f"cannot open Parquet shard {path!r} (shard {shard} of {self.num_shards}): {e}"
            ) from e
        with st.lock:
            st.files[shard] = (pf, handle)
            while len(st.files) > _MAX_OPEN_FILES:
                _, (old, old_handle) = st.files.popitem(last=False)
                _close_reader(old, old_handle)
        return pf

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
        groups = np.searchsorted(self._rg_offsets, idx, side="right") - 1
        rows = idx - self._rg_offsets[groups]
        order = np.argsort(groups, kind="stable")
        groups, rows = groups[order], rows[order]
        cuts = np.flatnonzero(np.diff(groups)) + 1
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), n]

        st = self._state()
        file_cols: list[list[Any]] = [[] for _ in self._file_fields]
        for s, e in zip(starts, ends):
            g = int(groups[s])
            values = self._read_rows(st, g, rows[s:e], int(idx[order[s]]))
            for out, vals in zip(file_cols, values):
                out.extend(vals)
        shards = self._rg_shard[groups]
        key_cols: list[list[Any]] = []
        for key, pos in zip(self._keys, self._file_pos):
            if pos >= 0:
                key_cols.append(file_cols[pos])
            else:
                key_cols.append(self._part_values[key][shards].tolist())
        keys = self._keys
        if key_cols:
            records = [dict(zip(keys, vals)) for vals in zip(*key_cols)]
        else:
            records = [{} for _ in range(n)]
        if np.all(order[1:] > order[:-1]):
            return records
        out: list[Any] = [None] * n
        for p, rec in zip(order.tolist(), records):
            out[p] = rec
        return out

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
            files = list(st.files.values())
            st.files.clear()
        for pf, handle in files:
            _close_reader(pf, handle)
        st.cache.clear()

    # ---------------------------------------------------------------- reading
    def _read_rows(
        self, st: _ProcessState, group: int, rows: np.ndarray, index: int
    ) -> list[list[Any]]:
        """Values of ``rows`` of row group ``group``, one list per file column."""
        if not self._file_fields:
            return []
        if st.cache.max_bytes == 0:
            # No cache: convert only the requested rows (the lookup only counts the miss).
            st.cache.get(group)
            table = self._decode(st, group, index)
            taken = table.take(pa.array(rows))
            cols = [_convert(c) for c in taken.columns]
            every = np.arange(len(rows))
            return [_gather(c, every) for c in cols]
        cols = st.cache.get_or_load(group, lambda: self._load(st, group, index))
        return [_gather(c, rows) for c in cols]

    def _load(self, st: _ProcessState, group: int, index: int) -> tuple[list[_Column], int]:
        table = self._decode(st, group, index)
        cols = [_convert(c) for c in table.columns]
        return cols, sum(c.nbytes for c in cols)

    def _decode(self, st: _ProcessState, group: int, index: int) -> pa.Table:
        shard = int(self._rg_shard[group])
        local = int(self._rg_local[group])
        num_rows = int(self._rg_offsets[group + 1] - self._rg_offsets[group])
        present = self._present[shard]
        names = [f.name for f, p in zip(self._file_fields, present) if p]
        pf = self._file(st, shard)
        try:
            table = pf.read_row_group(local, columns=names, use_threads=False)
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
        arrays = []
        for field, p in zip(self._file_fields, present):
            if not p:
                arrays.append(pa.nulls(num_rows, field.type))
                continue
            col = table.column(field.name)
            if not col.type.equals(field.type):
                col = col.cast(field.type)
            arrays.append(col)
        return pa.Table.from_arrays(arrays, schema=pa.schema(self._file_fields))

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


def _merge_schemas(
    files: list[str],
    schemas: list[pa.Schema],
    columns: list[str] | None,
    part_keys: list[str],
) -> tuple[list[pa.Field], np.ndarray]:
    """Merge the selected columns of every file; return fields and a presence matrix."""
    wanted = None if columns is None else set(columns)
    merged: dict[str, tuple[pa.DataType, bool, int]] = {}  # name -> (type, nullable, file)
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
            if name not in merged:
                merged[name] = (_value_type(field.type), field.nullable, i)
                continue
            typ, nullable, first = merged[name]
            new = merge_types(typ, field.type)
            if new is None:
                raise SchemaMismatchError(
                    f"column {name!r} has type {arrow_type_name(typ)} in {files[first]!r} but "
                    f"{arrow_type_name(field.type)} in {files[i]!r}"
                )
            merged[name] = (new, nullable or field.nullable, first)
    names = list(merged)
    present = np.zeros((len(files), len(names)), dtype=bool)
    for i, s in enumerate(schemas):
        have = set(s.names)
        present[i] = [n in have for n in names]
    fields = []
    for j, name in enumerate(names):
        typ, nullable, first = merged[name]
        if not present[:, j].all():
            missing_in = files[int(np.flatnonzero(~present[:, j])[0])]
            if not nullable:
                raise SchemaMismatchError(
                    f"column {name!r} is missing from {missing_in!r} but is required "
                    f"(not nullable) in {files[first]!r}"
                )
        fields.append(pa.field(name, typ, nullable=True))
    present.setflags(write=False)
    return fields, present


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
    """One decoded column of a row group, ready to gather rows from.

    ``kind`` says how to gather: ``"tolist"`` (a numpy array whose ``tolist()`` gives
    the Python values), ``"items"`` (numpy datetime/timedelta arrays and 2-D+ arrays:
    one numpy scalar or fresh row array per record), ``"copy"`` (an object array of
    read-only numpy views, copied per record), ``"struct"`` and ``"arrow"`` (anything
    else: ``to_pylist`` of the taken rows).
    """

    __slots__ = ("data", "kind", "nbytes")

    def __init__(self, kind: str, data: Any, nbytes: int) -> None:
        self.kind = kind
        self.data = data
        self.nbytes = int(nbytes)


def _object_array(values: list[Any]) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: numpy would broadcast nested arrays
        arr[i] = v
    return arr


def _null_mask(arr: pa.Array) -> np.ndarray | None:
    if arr.null_count == 0:
        return None
    return arr.is_null().to_numpy(zero_copy_only=False)


_NUMPY_KINDS = "biufcmM"


def _convert(col: pa.ChunkedArray | pa.Array) -> _Column:
    """Convert a column to a gatherable form, column-wise (no per-cell pyarrow scalars)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    n = len(arr)
    size = arr.nbytes
    if pa.types.is_null(t):
        return _Column("tolist", np.full(n, None, dtype=object), n * 8)
    simple = (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_duration(t)
    )
    if simple:
        mask = _null_mask(arr)
        temporal = not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))
        if mask is None:
            values = arr.to_numpy(zero_copy_only=False)
            return _Column("items" if temporal else "tolist", values, values.nbytes)
        values = arr.fill_null(False if pa.types.is_boolean(t) else 0)
        values = values.to_numpy(zero_copy_only=False)
        obj = _object_array(list(values) if temporal else values.tolist())
        obj[mask] = None
        return _Column("tolist", obj, size + n * _PY_OBJECT_BYTES)
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
        or pa.types.is_time(t)
    ):
        values = arr.to_numpy(zero_copy_only=False)
        return _Column("tolist", values, size + n * _PY_OBJECT_BYTES)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        converted = _lists_to_numpy(arr)
        if converted is not None:
            return converted
    elif pa.types.is_struct(t):
        children = [_convert(c) for c in arr.flatten()]
        names = [f.name for f in t]
        valid = None if arr.null_count == 0 else ~_null_mask(arr)
        return _Column(
            "struct",
            (names, children, valid),
            sum(c.nbytes for c in children) + n * _PY_OBJECT_BYTES,
        )
    return _Column("arrow", arr, size + n * _PY_OBJECT_BYTES)


def _list_offsets(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """``(offsets, child)``: row i's items are ``child[offsets[i]:offsets[i + 1]]``."""
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
        return offsets, arr.values
    return arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64, copy=False), arr.values


def _leaf_numpy(arr: pa.Array) -> np.ndarray | None:
    """A numeric/bool/temporal child as numpy, or None when numpy cannot hold it."""
    t = arr.type
    numeric = (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_duration(t)
    )
    if not numeric or arr.null_count:
        return None
    values = arr.to_numpy(zero_copy_only=False)
    if values.dtype.kind not in _NUMPY_KINDS:
        return None
    values.setflags(write=False)
    return values


def _lists_to_numpy(arr: pa.Array) -> _Column | None:
    """List columns of numbers as per-row numpy arrays (2-D where rectangular)."""
    n = len(arr)
    mask = _null_mask(arr)
    outer, child = _list_offsets(arr)
    ct = child.type
    nested = pa.types.is_list(ct) or pa.types.is_large_list(ct) or pa.types.is_fixed_size_list(ct)
    if not nested:
        leaf = _leaf_numpy(child)
        if leaf is None:
            return None
        if pa.types.is_fixed_size_list(arr.type) and mask is None:
            k = arr.type.list_size
            start = int(outer[0])
            mat = leaf[start : start + n * k].reshape(n, k)
            return _Column("items", mat, mat.nbytes)
        bounds = outer.tolist()
        rows = [leaf[bounds[i] : bounds[i + 1]] for i in range(n)]
        nbytes = leaf.nbytes
    else:
        if child.null_count:
            return None
        inner, grandchild = _list_offsets(child)
        leaf = _leaf_numpy(grandchild)
        if leaf is None:
            return None
        if (
            pa.types.is_fixed_size_list(arr.type)
            and pa.types.is_fixed_size_list(ct)
            and mask is None
        ):
            a, b = arr.type.list_size, ct.list_size
            start = int(inner[outer[0]])
            cube = leaf[start : start + n * a * b].reshape(n, a, b)
            return _Column("items", cube, cube.nbytes)
        lengths = np.diff(inner)
        bounds = outer.tolist()
        rows = []
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            lens = lengths[lo:hi]
            if hi == lo:
                rows.append(leaf[0:0].reshape(0, 0))
            elif (lens == lens[0]).all():
                rows.append(leaf[int(inner[lo]) : int(inner[hi])].reshape(hi - lo, int(lens[0])))
            else:
                rows.append([leaf[int(inner[j]) : int(inner[j + 1])] for j in range(lo, hi)])
        nbytes = leaf.nbytes
    if mask is not None:
        for i in np.flatnonzero(mask).tolist():
            rows[i] = None
    return _Column("copy", _object_array(rows), nbytes + n * 2 * _PY_OBJECT_BYTES)


def _copy_value(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        return v.copy()
    return [a.copy() for a in v]


def _gather(col: _Column, rows: np.ndarray) -> list[Any]:
    """The values of ``rows`` (local row numbers) of a converted column."""
    kind = col.kind
    if kind == "tolist":
        return col.data[rows].tolist()
    if kind == "items":
        return list(col.data[rows])
    if kind == "copy":
        return [_copy_value(v) for v in col.data[rows].tolist()]
    if kind == "struct":
        names, children, valid = col.data
        values = [_gather(c, rows) for c in children]
        out: list[Any] = [dict(zip(names, vals)) for vals in zip(*values)]
        if not names:
            out = [{} for _ in range(len(rows))]
        if valid is not None:
            ok = valid[rows]
            out = [rec if good else None for rec, good in zip(out, ok.tolist())]
        return out
    return col.data.take(pa.array(rows)).to_pylist()


def _close_reader(pf: pq.ParquetFile, handle: Any) -> None:
    try:
        pf.close()
    finally:
        if handle is not None:
            handle.close()
