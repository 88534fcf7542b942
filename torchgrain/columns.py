"""Batches as columns: one array per key instead of one Python dict per record.

A :class:`ColumnBatch` maps each key of a batch's records to

* a numpy array ``[B, ...]`` when every record holds a number, a bool, or an array of
  one dtype and shape there;
* a :class:`Ragged` when values differ in length (bytes, str, 1-D arrays of one dtype):
  one flat buffer and ``B + 1`` offsets, Arrow's layout for binary and list columns;
* a plain list otherwise (nulls, nested values, mixed types, str that UTF-8 cannot hold).

Sources that can (``ArrayRecordSource`` and ``TFRecordSource`` with the msgpack or raw
codec, ``ParquetSource``) build these straight from the bytes they decode, without a
Python object per record; ``tg.Dataset(src, batch_format="columns")`` hands them to the
DataLoader, whose default collate turns them into tensors without copying (in a worker,
the arrays already live in shared memory). This module needs only numpy.

Example:
    >>> import numpy as np
    >>> b = ColumnBatch.from_records([{"x": np.zeros(3, np.uint8), "s": b"ab"},
    ...                               {"x": np.ones(3, np.uint8), "s": b"c"}])
    >>> b["x"].shape, b["s"][1], len(b)
    ((2, 3), b'c', 2)
    >>> b.records()[0]["s"]
    b'ab'
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from torchgrain.io import process

# The public names; the helpers below them (can_stack, empty, gather_ranges, scratch,
# set_allocator, column_of, row_of, as_tensor, dtype_holding) serve the sources, the
# collators and the DataLoader workers.
__all__ = ["BufferPool", "ColumnBatch", "Ragged"]

# Ranges shorter than this on average are gathered with one fancy index; longer ones
# joined as bytes (one C loop over memoryview slices, then one copy) up to
# ``_JOIN_MAX``, and beyond it copied a slice at a time (memcpy speed, no index array
# of the size of the data). Measured on 256 ranges: 100 B - 1 KiB ranges join 2-3x
# faster than either neighbour.
_FANCY_MAX = 64
_JOIN_MAX = 4096


class Ragged:
    """Values of different lengths, one per row: ``values[offsets[i]:offsets[i + 1]]``.

    ``kind`` says what a row is: ``"bytes"``, ``"str"`` (UTF-8 in ``values``) or
    ``"array"`` (a 1-D numpy array of ``values.dtype``). The same layout as Arrow's
    binary and list arrays and torch's jagged nested tensors (:meth:`to_nested`); after
    collation ``values`` and ``offsets`` are tensors.

    Example:
        >>> r = Ragged.from_values([b"ab", b"", b"xyz"])
        >>> len(r), r[2], r.offsets.tolist()
        (3, b'xyz', [0, 2, 2, 5])
        >>> Ragged.from_values([np.arange(2.0), np.arange(1.0)])[0].tolist()
        [0.0, 1.0]
    """

    __slots__ = ("kind", "offsets", "values")

    def __init__(self, values: Any, offsets: Any, kind: str = "bytes") -> None:
        if kind not in ("bytes", "str", "array"):
            raise ValueError(f"kind must be 'bytes', 'str' or 'array', got {kind!r}")
        self.values = values
        self.offsets = offsets
        self.kind = kind

    @classmethod
    def from_values(cls, values: Sequence[Any]) -> Ragged:
        """From a list of bytes, str, or 1-D arrays of one dtype."""
        if values and isinstance(values[0], str):
            data, kind = [v.encode() for v in values], "str"
        elif values and isinstance(values[0], np.ndarray):
            data, kind = values, "array"
        else:
            data, kind = [bytes(v) for v in values], "bytes"
        lengths = np.fromiter((len(v) for v in data), dtype=np.int64, count=len(data))
        offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if kind == "array":
            dtype = data[0].dtype if data else np.dtype(np.float64)
            flat = empty((int(offsets[-1]),), dtype)
            if data:
                np.concatenate(data, out=flat)
        else:  # a writable copy (torch shares it without copying again)
            flat = empty((int(offsets[-1]),), np.uint8)
            flat[:] = np.frombuffer(b"".join(data), dtype=np.uint8)
        return cls(flat, offsets, kind)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        i %= len(self)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        row = self.values[a:b]
        if self.kind == "array":
            return row
        data = _as_numpy(row).tobytes()
        return data.decode() if self.kind == "str" else data

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[Any]:
        return list(self)

    def lengths(self) -> Any:
        """Length of each row (in bytes for ``bytes`` and ``str``)."""
        return self.offsets[1:] - self.offsets[:-1]

    def to_nested(self) -> Any:
        """A torch jagged nested tensor of the rows (``values`` as they are).

        The rows' shortest and longest lengths are recorded in it (torch >= 2.5), so
        ``torch.nested.to_padded_tensor`` pads to the longest row, not to the total
        length of all rows.

        Example:
            >>> import torch
            >>> nt = Ragged.from_values([np.arange(3), np.arange(1)]).to_nested()
            >>> torch.nested.to_padded_tensor(nt, 0).tolist()
            [[0, 1, 2], [0, 0, 0]]
        """
        import torch

        # (torch warns of a read-only array here: the nested tensor is a view users may
        # write to.)
        values, offsets = (
            x if isinstance(x, torch.Tensor) else torch.from_numpy(x)
            for x in (self.values, self.offsets)
        )
        lengths = offsets[1:] - offsets[:-1]
        kwargs = {}
        if _nested_takes_seqlen() and len(lengths):
            # One pass over B + 1 offsets (already on the host after collation); without
            # it the nested tensor takes its longest row to be all of ``values``.
            kwargs = {"min_seqlen": int(lengths.min()), "max_seqlen": int(lengths.max())}
        return torch.nested.nested_tensor_from_jagged(values, offsets, **kwargs)

    def to_padded(
        self, pad_value: Any = 0, multiple_of: int | None = None, *, side: str = "right"
    ) -> tuple[Any, Any]:
        """The rows as one torch tensor ``[rows, length]`` padded with ``pad_value``,
        and each row's length (an int64 tensor).

        ``length`` is the longest row's, rounded up to a multiple of ``multiple_of``
        when given (tensor cores like multiples of 8). ``side="left"`` puts the padding
        before each row. ``bytes`` and ``str`` rows come out as ``uint8``. The tensor has
        the values' dtype, or one that holds ``pad_value`` too (int64 for -100 and
        ``uint16`` tokens, as :func:`~torchgrain.pad_collate` pads them). The rows are
        copied with one scatter (no Python loop over rows).

        Example:
            >>> padded, lengths = Ragged.from_values([np.arange(3), np.arange(1)]).to_padded(
            ...     -1, multiple_of=4)
            >>> padded.tolist(), lengths.tolist()
            ([[0, 1, 2, -1], [0, -1, -1, -1]], [3, 1])
        """
        import torch

        if side not in ("right", "left"):
            raise ValueError(f"side must be 'right' or 'left', got {side!r}")
        values, offsets = as_tensor(self.values), as_tensor(self.offsets).to(torch.int64)
        rows = len(offsets) - 1
        lengths = offsets[1:] - offsets[:-1]
        if rows < 0 or values.dim() != 1:
            raise ValueError(
                f"a Ragged needs 1-D values and at least one offset, got values of shape "
                f"{list(values.shape)} and {len(offsets)} offsets"
            )
        start, end = (int(offsets[0]), int(offsets[-1])) if rows else (0, 0)
        if rows and (bool((lengths < 0).any()) or start < 0 or end > len(values)):
            raise ValueError(
                f"Ragged offsets must ascend within its {len(values)} values, got "
                f"{offsets[0].item()}..{offsets[-1].item()}"
                + (" (descending somewhere)" if bool((lengths < 0).any()) else "")
            )
        width = int(lengths.max()) if rows else 0
        if multiple_of is not None:
            if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
                raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
            width = -(-width // multiple_of) * multiple_of
        dtype = dtype_holding(values.dtype, pad_value)
        if dtype != values.dtype:  # torch.full would wrap -100 into uint16 tokens silently
            past = unsigned_past_int64(values[start:end]) if dtype == torch.int64 else None
            if past is not None:
                raise ValueError(
                    f"a Ragged's value {values[start + past].item()} is above "
                    f"2**63 - 1: int64, which the padding value {pad_value!r} needs, cannot "
                    "hold it"
                )
            values = values.to(dtype)
        out = torch.full((rows, width), pad_value, dtype=dtype, device=values.device)
        if end > start:
            row = torch.repeat_interleave(torch.arange(rows, device=lengths.device), lengths)
            # Column of each value: its position in the row (plus the row's padding on
            # the left).
            col = torch.arange(start, end, device=offsets.device) - offsets[:-1][row]
            if side == "left":
                col += width - lengths[row]
            # (torch has no indexed writes for unsigned types but uint8: the same bits as
            # the signed type of the same size.)
            signed = _signed_twin(values.dtype)
            target = out if signed is None else out.view(signed)
            target[row, col] = values[start:end].view(target.dtype)
        return out, lengths

    def map_arrays(self, fn: Callable[[Any], Any]) -> Ragged:
        """The same rows with ``fn`` applied to ``values`` and ``offsets`` (e.g. to move
        them to a device)."""
        return Ragged(fn(self.values), fn(self.offsets), self.kind)

    def pin_memory(self) -> Ragged:
        return self.map_arrays(lambda t: t.pin_memory())

    def to(self, *args: Any, **kwargs: Any) -> Ragged:
        return self.map_arrays(lambda t: t.to(*args, **kwargs))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Ragged)
            and self.kind == other.kind
            and np.array_equal(_as_numpy(self.offsets), _as_numpy(other.offsets))
            and np.array_equal(_as_numpy(self.values), _as_numpy(other.values))
        )

    def __repr__(self) -> str:
        return f"Ragged(kind={self.kind!r}, rows={len(self)}, values={_describe(self.values)})"


class ColumnBatch(dict):
    """A batch of records as columns: ``key -> array [B, ...] | Ragged | list``.

    ``len(batch)`` is the number of rows (by default the first column's length).
    :meth:`records` gives the rows back as dicts (what per-record transforms see);
    :meth:`from_records` builds a batch from dicts.

    Example:
        >>> import numpy as np
        >>> b = ColumnBatch({"x": np.arange(3), "name": ["a", "b", "c"]})
        >>> len(b), b.records()[1]["name"]
        (3, 'b')
    """

    __slots__ = ("num_rows",)

    def __init__(self, columns: dict[str, Any] | None = None, *, num_rows: int | None = None):
        super().__init__(columns or {})
        if num_rows is None:
            # dict's own size and values: len(self) is num_rows, not set yet
            num_rows = len(next(iter(dict.values(self)))) if dict.__len__(self) else 0
        self.num_rows = int(num_rows)

    def __len__(self) -> int:  # type: ignore[override]
        return self.num_rows

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Any]]) -> ColumnBatch:
        """Columns of ``records`` (dicts with the same keys; a key missing somewhere
        becomes a list column with ``None`` there)."""
        keys = dict.fromkeys(k for r in records for k in r)
        return cls({k: column_of([r.get(k) for r in records]) for k in keys}, num_rows=len(records))

    def records(self) -> list[dict[str, Any]]:
        """The rows as dicts, values as :func:`row_of` gives them (array rows are views
        into the columns)."""
        n = self.num_rows
        if not dict.__len__(self):
            return [{} for _ in range(n)]
        keys = list(dict.keys(self))
        out = [dict(zip(keys, row)) for row in zip(*map(_rows, dict.values(self)))]
        if len(out) < n:
            raise IndexError(f"a column of a batch of {n} rows has {len(out)}")
        return out[:n] if len(out) > n else out

    def take(self, rows: Sequence[int] | np.ndarray) -> ColumnBatch:
        """The batch's ``rows``, in that order."""
        idx = np.asarray(rows, dtype=np.int64)
        return ColumnBatch({k: _take(v, idx) for k, v in dict.items(self)}, num_rows=len(idx))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {_describe(v)}" for k, v in dict.items(self))
        return f"ColumnBatch({self.num_rows} rows; {inner})"

    def __reduce__(self) -> Any:
        return (_rebuild, (dict(self), self.num_rows))


def _rebuild(columns: dict[str, Any], num_rows: int) -> ColumnBatch:
    return ColumnBatch(columns, num_rows=num_rows)


def can_stack(rows: int, shape: Sequence[int], itemsize: int) -> bool:
    """Whether numpy can make an array of ``rows`` rows of ``shape`` (``itemsize`` bytes
    an item): every dimension an index, and the bytes of its non-zero dimensions within
    a signed 64-bit size (numpy's rule). Exact: shapes read from data are untrusted, and
    their product would wrap around in int64.

    Example:
        >>> can_stack(4, (2, 3), 8), can_stack(1, (0, 2**62), 1), can_stack(4, (0, 2**62), 1)
        (True, True, False)
    """
    dims = (rows, *shape)
    if not all(0 <= d < 1 << 63 for d in dims):
        return False
    return itemsize * math.prod(d for d in dims if d) < 1 << 63


# The array dtype of a column of Python scalars of one type.
_SCALAR_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64}


def column_of(values: list[Any]) -> Any:
    """The column form of one key's values (see the module docstring)."""
    if not values:
        return []
    first = values[0]
    if isinstance(first, np.ndarray):
        if all(isinstance(v, np.ndarray) and v.dtype == first.dtype for v in values):
            if all(v.shape == first.shape for v in values) and can_stack(
                len(values), first.shape, first.dtype.itemsize
            ):
                out = empty((len(values), *first.shape), first.dtype)
                for i, v in enumerate(values):
                    out[i] = v
                return out
            if all(v.ndim == 1 for v in values):
                return Ragged.from_values(values)
        return list(values)
    kinds = {type(v) for v in values}
    if len(kinds) == 1:
        kind = kinds.pop()
        if kind in _SCALAR_DTYPES:
            try:
                return np.array(values, dtype=_SCALAR_DTYPES[kind])
            except OverflowError:  # an int outside int64
                return list(values)
        if kind in (bytes, str):
            try:
                return Ragged.from_values(values)
            except UnicodeEncodeError:  # a str UTF-8 cannot hold (os.fsdecode's surrogates)
                return list(values)
        if issubclass(kind, np.generic) and len({v.dtype for v in values}) == 1:
            # (datetime64 of two units would be cast to the finer, where a far date wraps)
            return np.array(values)
    return list(values)


def _python_scalars(dtype: np.dtype) -> bool:
    """Whether a 1-D array of ``dtype`` holds what records hold as Python scalars: bools,
    ints and floats of any width (a Parquet record holds an ``int8`` or ``float32`` value as
    a Python number, so a map sees no numpy scalar that wraps: ``np.int8(3) * 100`` is 44).
    Records hold a ``datetime64``/``timedelta64`` as a numpy value of its unit: ``.item()``
    would turn a ``datetime64[ns]`` into an int."""
    return dtype.kind in "biuf"


def row_of(col: Any, i: int) -> Any:
    """Row ``i`` of a column (see :func:`column_of`) as a record holds it: a Python
    scalar for a 1-D array of numbers or bools or a 1-D tensor, a numpy scalar for a 1-D
    array of another dtype (``datetime64``...), a row otherwise.

    Example:
        >>> row_of(np.array([3, 4]), 1), row_of(Ragged.from_values([b"ab", b"c"]), 1)
        (4, b'c')
        >>> row_of(np.array([1, 2], "datetime64[ns]"), 0)
        np.datetime64('1970-01-01T00:00:00.000000001')
    """
    if isinstance(col, Ragged):
        return col[i]
    if isinstance(col, np.ndarray):
        return col[i].item() if col.ndim == 1 and _python_scalars(col.dtype) else col[i]
    if hasattr(col, "numpy"):  # a tensor after collation
        value = col[i]
        return value if value.ndim else value.item()
    return col[i]


def _rows(col: Any) -> Any:
    """Every row of a column, each as :func:`row_of` gives it, in one step per column."""
    if isinstance(col, np.ndarray):
        return col.tolist() if col.ndim == 1 and _python_scalars(col.dtype) else list(col)
    if hasattr(col, "numpy"):  # a tensor after collation
        return col.tolist() if col.ndim == 1 else list(col)
    return col


def _take(col: Any, idx: np.ndarray) -> Any:
    if isinstance(col, Ragged):
        return Ragged.from_values([col[i] for i in idx.tolist()])
    if isinstance(col, np.ndarray):
        return col[idx]
    return [col[i] for i in idx.tolist()]


@functools.cache
def _signed_twin(dtype: Any) -> Any:
    """The signed torch dtype of the size of unsigned ``dtype`` (uint16..uint64), or None."""
    import torch

    for bits in (16, 32, 64):
        if dtype == getattr(torch, f"uint{bits}", None):  # torch >= 2.3 has them
            return getattr(torch, f"int{bits}")
    return None


def dtype_holding(dtype: Any, pad: int | float) -> Any:
    """The torch ``dtype``, or one that holds the padding value too (-100 in uint16
    tokens: int64; 0.5 in int8 values: float32, in int32 ones: float64, exactly).

    Raises:
        ValueError: a padding value no dtype holds with every value of ``dtype``
            exactly (0.5 with 64-bit integers, whose ids a float would round; an
            integer outside int64).

    A uint64 ``dtype`` under a negative pad gives int64: values above ``2**63 - 1``
    do not fit it (see :func:`unsigned_past_int64`).

    Example:
        >>> import torch
        >>> dtype_holding(torch.uint16, -100), dtype_holding(torch.int32, 0)
        (torch.int64, torch.int32)
    """
    import torch

    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    if isinstance(pad, float) and not float(pad).is_integer():
        bits = 1 if dtype == torch.bool else torch.iinfo(dtype).bits
        if bits > 32:
            raise ValueError(
                f"a padding value {pad!r} in {dtype} values: no float dtype holds every "
                f"{dtype} value exactly; pad with an integer"
            )
        return torch.float32 if bits <= 16 else torch.float64
    if dtype == torch.bool:
        return dtype if pad in (0, 1) else torch.int64
    info = torch.iinfo(dtype)
    if info.min <= pad <= info.max:
        return dtype
    if not -(2**63) <= pad < 2**63:
        raise ValueError(f"a padding value {pad!r} outside int64 for {dtype} values")
    return torch.int64


def unsigned_past_int64(values: Any) -> int | None:
    """The position of the first value of a uint64 tensor above ``2**63 - 1`` (which
    int64 cannot hold), or None.

    Example:
        >>> import torch
        >>> unsigned_past_int64(torch.tensor([1, 2**63 + 5], dtype=torch.uint64))
        1
    """
    import torch

    if values.dtype != torch.uint64:
        return None
    over = torch.nonzero(values.view(torch.int64) < 0)
    return int(over[0, 0]) if len(over) else None


def as_tensor(x: Any) -> Any:
    """``x`` as a torch tensor (numpy arrays shared, not copied: a read-only one, say a
    view of a Parquet page, too; it is only read).

    Example:
        >>> as_tensor(np.arange(3)).tolist()
        [0, 1, 2]
    """
    import torch

    if isinstance(x, torch.Tensor):
        return x
    x = np.asarray(x)
    if x.flags.writeable:
        return torch.from_numpy(x)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(x)


@functools.cache
def _nested_takes_seqlen() -> bool:
    """Whether ``nested_tensor_from_jagged`` records min/max row lengths (torch >= 2.5)."""
    import inspect

    import torch

    return "max_seqlen" in inspect.signature(torch.nested.nested_tensor_from_jagged).parameters


def _as_numpy(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)


def _describe(col: Any) -> str:
    if isinstance(col, Ragged):
        return f"ragged {col.kind}"
    shape = getattr(col, "shape", None)
    if shape is not None:
        return f"{getattr(col, 'dtype', '?')}{list(shape)}"
    return f"list[{len(col)}]"


# ----------------------------------------------------------------- allocation
_allocator: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None


def set_allocator(fn: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None) -> None:
    """Where :func:`empty` allocates (a DataLoader worker puts batches in shared memory)."""
    global _allocator
    _allocator = fn


class BufferPool:
    """Large batch buffers, recycled once nothing refers to them any more.

    A batch of images is megabytes; a fresh allocation that large is mapped from the
    kernel page by page on first touch, which costs about as much as decoding the
    batch. The pool hands out arrays over buffers it keeps: views, slices and tensors
    made from such an array keep its memory's owner alive, and the buffer returns to the
    pool only when the last of them is gone. At most ``max_bytes`` of idle buffers are
    kept.

    Example:
        >>> pool = BufferPool(min_bytes=1024)
        >>> a = pool.empty((64, 64), np.uint8)
        >>> a.base is not None, pool.idle_bytes
        (True, 0)
        >>> del a
        >>> pool.idle_bytes
        4096
    """

    def __init__(self, max_bytes: int = 256 << 20, min_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self.idle_bytes = 0
        self._lock = threading.Lock()
        self._token = process.token()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """An uninitialised array, or None when it is too small to pool."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or dtype.hasobject:
            return None
        size = 1 << (nbytes - 1).bit_length()  # size classes: powers of two
        with self._lock:
            idle = self._idle.get(size)
            buf = idle.pop() if idle else None
            if buf is not None:
                self.idle_bytes -= size
        if buf is None:
            buf = np.empty(size, np.uint8)
        # ``flat`` owns no memory (its base is a memoryview): every view, slice or
        # tensor made from the result keeps ``flat`` itself alive, and the buffer goes
        # back to the pool when ``flat`` is collected.
        flat = np.frombuffer(memoryview(buf)[:nbytes], dtype=dtype)
        weakref.finalize(flat, self._give_back, buf)
        return flat.reshape(shape)

    def _give_back(self, buf: np.ndarray) -> None:
        # Runs as a finalizer: in whatever thread collects ``flat`` (a collection can
        # start at any allocation, so nothing is allocated while the lock is held and
        # this never re-enters itself), and in a forked child for arrays inherited from
        # the parent, whose pool and lock are not the child's (it returns nothing). It
        # never waits long: a buffer that cannot be returned is simply freed.
        if process.token() != self._token:
            return
        size = buf.nbytes
        fresh = [buf]  # the list of a new size class, made before the lock is taken
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            if self.idle_bytes + size <= self.max_bytes:
                idle = self._idle.setdefault(size, fresh)
                if idle is not fresh:
                    idle.append(buf)
                self.idle_bytes += size
        finally:
            self._lock.release()

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self.idle_bytes = 0


#: The pool :func:`empty` and :func:`scratch` draw large buffers from.
POOL = BufferPool()


def _reset_pool_after_fork() -> None:
    global POOL
    POOL = BufferPool(POOL.max_bytes, POOL.min_bytes)  # the parent's lock may be held


os.register_at_fork(after_in_child=_reset_pool_after_fork)


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new array for a batch column, from this process's allocator (see
    :func:`set_allocator`), else from :data:`POOL` when large, else plain numpy."""
    if _allocator is not None:
        out = _allocator(tuple(shape), np.dtype(dtype))
        if out is not None:
            return out
    out = POOL.empty(tuple(shape), dtype)
    return np.empty(shape, dtype) if out is None else out


def scratch(nbytes: int) -> np.ndarray:
    """A temporary uint8 buffer (from :data:`POOL` when large; never shared memory)."""
    out = POOL.empty((nbytes,), np.uint8)
    return np.empty(nbytes, np.uint8) if out is None else out


def gather_ranges(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray
) -> None:
    """Copy ``buf[starts[i] : starts[i] + lengths[i]]`` one after the other into ``out``
    (a flat uint8 array of ``lengths.sum()`` bytes).

    Example:
        >>> out = np.empty(4, np.uint8)
        >>> gather_ranges(np.arange(10, dtype=np.uint8), np.array([7, 1]), np.array([2, 2]), out)
        >>> out.tolist()
        [7, 8, 1, 2]
    """
    n = len(starts)
    if n == 0:
        return
    total = int(lengths.sum())
    if total <= _FANCY_MAX * n:
        ends = np.cumsum(lengths)
        base = np.repeat(starts - (ends - lengths), lengths)
        out[:total] = buf[base + np.arange(total)]
        return
    if total <= _JOIN_MAX * n and buf.flags.c_contiguous and buf.dtype == np.uint8:
        view = memoryview(buf)
        joined = b"".join(
            map(view.__getitem__, map(slice, starts.tolist(), (starts + lengths).tolist()))
        )
        out[:total] = np.frombuffer(joined, np.uint8)
        return
    pos = 0
    for s, length in zip(starts.tolist(), lengths.tolist()):
        out[pos : pos + length] = buf[s : s + length]
        pos += length
