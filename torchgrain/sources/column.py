"""One column of a dataset, read the cheapest way its format allows.

Content-aware samplers (by length, by source) and statistics need one value per record;
:func:`read_column` gives them that column without building the records:

* a :class:`~torchgrain.ParquetSource` (or a Dataset without transforms over one) opens
  its files again for that column alone (:func:`~torchgrain.sources.parquet.pushdown.column_source`):
  no other column is read or decoded; a hive partition key costs no read at all;
* any other source, or a Dataset, is read with ``read_columns`` (through the Dataset's
  transforms, at its current epoch, when it has any), ``chunk`` records at a time: the
  whole dataset is never in memory, only the column being built.

Indices are read in increasing order (a row group or chunk is decoded once, not once per
chunk that touches it) and the values put back in the order asked.
"""

from __future__ import annotations

import copy
import reprlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchgrain.columns import Ragged, column_of, gather_ranges, row_of
from torchgrain.errors import TorchgrainError
from torchgrain.sources.base import Source
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.parquet.pushdown import column_source
from torchgrain.sources.parquet.source import ParquetSource

__all__ = ["read_column"]


def read_column(
    source: Any, key: str, *, indices: Sequence[int] | np.ndarray | None = None, chunk: int = 65536
) -> np.ndarray | Ragged:
    """The values of ``key`` for every record of ``source`` (or the records at
    ``indices``, in that order), read the cheapest way (see the module docstring).

    Args:
        source: a :class:`~torchgrain.Source`, a :class:`~torchgrain.Dataset` (its
            records as its transforms make them), or anything a Dataset takes.
        key: the record key (column) to read.
        indices: the records to read (integers in ``[0, len(source))``, repeats
            allowed); all of them by default.
        chunk: records per read: memory beyond the result is about one chunk of
            records (of this column only, for Parquet).

    Returns:
        One value per record, as a batch column holds it
        (:mod:`torchgrain.columns`): numbers and bools a numpy array ``[n]``, arrays of
        one dtype and shape a numpy array ``[n, ...]``; bytes, strings and lists of
        numbers of different lengths a :class:`~torchgrain.columns.Ragged` (one buffer
        and ``n + 1`` offsets, no Python object per record: ``.lengths()`` is each
        value's length, ``col[i]`` a value); anything else (nulls, nested values, mixed
        types) an object array ``[n]``. The result costs about twice its size while it
        is assembled.

    Raises:
        KeyError: the records have no ``key`` (the message names the keys they have).
        IndexError, TypeError: an index out of range, or not an integer.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> rows = ({"text": "ab" * i, "label": i % 3} for i in range(6))
        >>> _ = tg.write_parquet(rows, d)
        >>> src = tg.ParquetSource(d)
        >>> tg.sources.read_column(src, "label").tolist()
        [0, 1, 2, 0, 1, 2]
        >>> tg.sources.read_column(src, "text", indices=[5, 1]).lengths().tolist()
        [10, 2]
        >>> tg.sources.read_column(src, "txt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        KeyError: "no key 'txt' in ParquetSource(...): its keys are ['text', 'label']"
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    source = _unwrap(source)
    n = len(source)
    order = None  # (None: already in reading order)
    if indices is None:
        idx = np.arange(n, dtype=np.int64)
    else:
        idx = ShardIndex(np.array([n], dtype=np.int64)).check(indices)
        if not (idx[1:] >= idx[:-1]).all():
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
    keys = [] if _is_dataset(source) else list(getattr(source, "keys", []))
    if keys and key not in keys:
        raise KeyError(f"no key {key!r} in {_name(source)}: its keys are {keys}")
    read, close = _reader(source, key)
    try:
        parts = [read(idx[a : a + chunk]) for a in range(0, len(idx), chunk)]
    finally:
        close()
    col = _join(parts)
    if order is None:
        return col
    back = np.empty(len(order), dtype=np.int64)
    back[order] = np.arange(len(order))
    return _take(col, back)


def _unwrap(source: Any) -> Any:
    """A Dataset without transforms as the source it reads; anything else as it is."""
    # (torchgrain.dataset imports torch: a Dataset exists only once it is imported)
    while _is_dataset(source) and not source._ops:
        source = source._source
    if not isinstance(source, Source) and not _is_dataset(source):
        from torchgrain.adapters import SequenceSource

        source = SequenceSource(source)
    return source


def _is_dataset(source: Any) -> bool:
    dataset = sys.modules.get("torchgrain.dataset")
    return dataset is not None and isinstance(source, dataset.Dataset)


def _name(source: Any) -> str:
    text = repr(source)  # (a long one, a list's, shortened)
    return reprlib.repr(source) if len(text) > 300 else text


def _reader(source: Any, key: str) -> tuple[Any, Any]:
    """``(read, close)``: ``read(indices)`` the column of those records."""
    if isinstance(source, ParquetSource) and key in source._part_keys:
        # A hive partition key: one value per file, named by the path.
        values, ends = source._part_values[key], np.cumsum(source.shard_counts)
        return (
            lambda ix: column_of(values[ends.searchsorted(ix, side="right")].tolist())
        ), lambda: None
    if isinstance(source, ParquetSource) and source.keys != [key]:
        sub = column_source(source, [key])
        return (lambda ix: _get(sub.read_columns(ix), key, source, ix)), sub.close
    if _is_dataset(source):
        ds = copy.copy(source)
        ds.batch_format = "columns"
        return (lambda ix: _get(ds.__getitems__(ix)[0], key, source, ix)), lambda: None
    return (lambda ix: _get(source.read_columns(ix), key, source, ix)), lambda: None


def _get(batch: Any, key: str, source: Any, ix: np.ndarray) -> Any:
    if key not in batch:
        raise KeyError(f"no key {key!r} in {_name(source)}: its records have {list(batch)}")
    col = batch[key]
    if len(col) != len(ix):  # (else values would land on other records' places)
        raise TorchgrainError(
            f"{_name(source)} gave {len(col)} values of {key!r} for {len(ix)} records "
            f"(records {ix[:8].tolist()}...)"
        )
    return col


def _join(parts: list[Any]) -> np.ndarray | Ragged:
    """The chunks' columns as one: their arrays joined where they agree (a dtype and a
    shape, a kind of Ragged), else an object array of the values."""
    if not parts:
        return np.empty(0, dtype=object)
    if all(isinstance(p, np.ndarray) and p.dtype != object for p in parts) and all(
        p.dtype == parts[0].dtype and p.shape[1:] == parts[0].shape[1:] for p in parts
    ):
        return np.concatenate(parts)
    ragged = [_as_ragged(p) for p in parts]
    first = ragged[0]
    if first is not None and all(
        r is not None
        and r.kind == first.kind
        and (r.kind != "array" or r.values.dtype == first.values.dtype)
        for r in ragged
    ):
        lengths = np.concatenate([np.diff(r.offsets) for r in ragged])
        offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        return Ragged(
            np.concatenate([r.values[: r.offsets[-1]] for r in ragged]), offsets, first.kind
        )
    values = [
        v for p in parts for v in (p if _is_objects(p) else (row_of(p, i) for i in range(len(p))))
    ]
    return np.fromiter(values, dtype=object, count=len(values))  # (nested values as they are)


def _is_objects(part: Any) -> bool:
    """Whether a chunk's column is an object array: its values are held as they are."""
    return isinstance(part, np.ndarray) and part.dtype == object and part.ndim == 1


def _as_ragged(part: Any) -> Ragged | None:
    """A chunk's column as a Ragged starting at offset 0, when it is one (or a 2-D array,
    rows of one length: what lists of numbers give when a chunk's happen to agree)."""
    if isinstance(part, Ragged):
        offsets = np.asarray(part.offsets, dtype=np.int64)
        values = np.asarray(part.values)[offsets[0] : offsets[-1]]
        return Ragged(values, offsets - offsets[0], part.kind)
    if isinstance(part, np.ndarray) and part.ndim == 2 and part.dtype != object:
        rows, width = part.shape
        offsets = np.arange(rows + 1, dtype=np.int64) * width
        return Ragged(part.reshape(-1), offsets, "array")
    return None


def _take(col: np.ndarray | Ragged, rows: np.ndarray) -> np.ndarray | Ragged:
    """``col``'s rows ``rows``, in that order."""
    if isinstance(col, np.ndarray):
        return col[rows]
    starts = col.offsets[:-1][rows]
    lengths = col.offsets[1:][rows] - starts
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    values = np.empty(int(offsets[-1]), dtype=col.values.dtype)
    gather_ranges(col.values, starts, lengths, values)
    return Ragged(values, offsets, col.kind)
