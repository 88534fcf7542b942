"""Subsets and splits: some records of a dataset, as a view.

* ``ds.select(indices)`` (:func:`select`): the records at any integer array of indices,
  in that order (repeats allowed), checked once against ``len(ds)``. Up to
  :data:`MAPPED_ABOVE` indices are kept in the view; a longer array is stored once per
  machine as a node-shared index file
  (:func:`~torchgrain.sources.node_index.derived.derived_index`) that every process maps
  read-only (a spawned worker gets its name, not a copy).
* ``tg.split(ds, {"train": 0.98, "val": 0.02}, seed=0)`` (:func:`split`): disjoint parts of
  exact sizes (:func:`split_counts`), each a contiguous range of positions of one keyed
  permutation of ``[0, len(ds))``: O(1) memory whatever the size, the same parts in every
  process from ``seed`` alone. With ``by="key"``, a record's part is decided by a hash of
  its value of that key instead, so it stays in its part when shards are added, removed
  or re-sharded (the parts are then filters of ``ds``, built by one pass each).

A part reads its parent through the parent's batched reads, keeps its transforms (a
``random_map`` of the parent stays keyed by the parent's index, so a record gets the same
augmentation in the part as in the whole) and forwards ``set_epoch`` and ``read_ahead``
(:mod:`torchgrain.compose.view`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from torchgrain.compose.filter import changes_with_epoch
from torchgrain.compose.mix import largest_remainder
from torchgrain.compose.view import View, check_indices, short_repr
from torchgrain.dataset import Dataset
from torchgrain.errors import CorruptDataError
from torchgrain.sampling.permutation import KeyedPermutation
from torchgrain.sources.node_index.derived import (
    DerivedIndex,
    dataset_fingerprint,
    derived_index,
    hash_parts,
)

__all__ = ["MAPPED_ABOVE", "Subset", "key_hash", "select", "split", "split_counts"]

#: Indices given to :func:`select` beyond this many are kept in a node-shared mapped file.
MAPPED_ABOVE = 1 << 20

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 20  # entries checked or written at a time (bounded temporaries)


class _ArrayRows:
    """Child indices held in an array (in memory), or mapped from a derived index (which
    pickles as its file's name: the array would be a copy)."""

    __slots__ = ("_rows", "index")

    def __init__(self, rows: np.ndarray | None, index: DerivedIndex | None = None) -> None:
        self._rows, self.index = (rows, None) if index is None else (None, index)

    @property
    def rows(self) -> np.ndarray:
        return self._rows if self.index is None else self.index.arrays["indices"]

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, positions: np.ndarray) -> np.ndarray:
        if self.index is not None:
            # A file written or truncated since it was mapped is refused (ChangedWhileOpen,
            # naming it): past its new end the mapping reads zeros, or dies of SIGBUS.
            self.index.check_unchanged()
        return self.rows[positions].astype(np.int64)

    def identity(self) -> Any:
        if self.index is not None:
            return ("rows", self.index.digest)
        return hash_parts(self.rows.dtype.str, np.ascontiguousarray(self.rows).tobytes())


class _PermutedRows:
    """Positions ``[start, start + count)`` of a keyed permutation of ``[0, n)``."""

    __slots__ = ("count", "perm", "seed", "start")

    def __init__(self, n: int, seed: int, start: int, count: int) -> None:
        self.perm = KeyedPermutation(n, seed=seed, tag=b"split")
        self.seed, self.start, self.count = seed, start, count

    def __len__(self) -> int:
        return self.count

    def take(self, positions: np.ndarray) -> np.ndarray:
        return self.perm(positions + self.start, check=False)

    def identity(self) -> Any:
        return ("split", self.perm.n, self.seed, self.start, self.count)


class Subset(View):
    """Item ``i`` is record ``rows[i]`` of ``parent`` (what :func:`select` and
    :func:`split` return, inside a :class:`~torchgrain.Dataset`).

    ``block_offsets`` is one block (the records of a subset are not where the parent
    stores them together), so :class:`~torchgrain.BlockShuffleSampler` shuffles it
    whole, as :class:`~torchgrain.GlobalShuffleSampler` would.
    """

    def __init__(self, parent: Any, rows: Any, *, label: str = "subset") -> None:
        super().__init__([parent])
        self.rows = rows
        self.label = label

    def __len__(self) -> int:
        return len(self.rows)

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(len(indices), np.int64), self.rows.take(indices)

    def identity(self) -> Any:
        return self.rows.identity()

    def __repr__(self) -> str:
        return f"Subset({self.children[0]!r}, {self.label}: {len(self)} records)"


def _wrap(ds: Dataset, view: View) -> Dataset:
    return Dataset(view, batch_format=ds.batch_format)


# ------------------------------------------------------------------ select
def select(ds: Any, indices: Any) -> Dataset:
    """The records of ``ds`` at ``indices``, in that order, as a new Dataset (what
    ``Dataset.select(indices)`` returns).

    ``indices`` is any one-dimensional integer array-like (repeats allowed), checked once
    here: a negative or out-of-range index raises ``IndexError`` and a non-integer
    ``TypeError``, naming ``ds``. More than :data:`MAPPED_ABOVE` indices are stored once
    per machine in a node-shared index file and memory-mapped (4 bytes an index below
    2^32 records, else 8), instead of held by every process.

    Example:
        >>> import torchgrain as tg
        >>> ds = tg.Dataset([{"x": i} for i in range(10)])
        >>> sub = ds.select([7, 2, 2])
        >>> len(sub), sub.__getitems__([0, 2])
        (3, [{'x': 7}, {'x': 2}])
        >>> ds.select([3, 10])
        Traceback (most recent call last):
        ...
        IndexError: select: record index 10 out of range for a dataset of 10 records \
(in Dataset(...))
    """
    ds = ds if isinstance(ds, Dataset) else Dataset(ds)
    n = len(ds)
    if isinstance(indices, (str, bytes, Mapping)):
        raise TypeError(f"select needs an array of integer indices, got {type(indices).__name__}")
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ValueError(f"select needs a one-dimensional array of indices, got shape {arr.shape}")
    dtype = "<u4" if n <= 1 << 32 else "<i8"
    if len(arr) <= MAPPED_ABOVE:
        rows = _ArrayRows(_checked(ds, arr, dtype))
    else:  # a chunk at a time: a large array (a memory-mapped one) is never copied whole
        rows = _ArrayRows(None, _mapped_selection(ds, arr, dtype))
    return _wrap(ds, Subset(ds, rows, label="select"))


def _checked(ds: Dataset, arr: np.ndarray, dtype: str) -> np.ndarray:
    try:
        return check_indices(arr, len(ds)).astype(dtype)
    except (IndexError, TypeError) as e:
        raise type(e)(f"select: {e} (in {short_repr(ds)})") from None


def _mapped_selection(ds: Dataset, arr: np.ndarray, dtype: str) -> DerivedIndex:
    n = len(ds)
    h = hashlib.blake2b(digest_size=16)
    for a in range(0, len(arr), _CHUNK):
        h.update(_checked(ds, arr[a : a + _CHUNK], dtype).tobytes())
    key = "select-" + hash_parts(dataset_fingerprint(ds), dtype, len(arr), h.hexdigest())

    def fill(sink: Any) -> dict[str, Any]:
        for a in range(0, len(arr), _CHUNK):
            sink.append("indices", _checked(ds, arr[a : a + _CHUNK], dtype))
        return {"count": len(arr), "length": n}

    def fits(ix: DerivedIndex) -> str | None:
        return _selection_problem(ix, n, arr, dtype)

    ix = derived_index("select", key, {"indices": (dtype, ())}, fill, fits=fits)
    problem = fits(ix)
    if problem is not None:
        raise CorruptDataError(f"selection index {ix.path or '(in memory)'} is damaged: {problem}")
    return ix


def _selection_problem(ix: DerivedIndex, n: int, arr: np.ndarray, dtype: str) -> str | None:
    """Why a stored selection is not ``arr`` (the indices asked for, known to be below
    ``n``): a file of the same key is untrusted, and is compared once, in chunks."""
    rows = ix.arrays.get("indices")
    if rows is None or rows.ndim != 1 or len(rows) != len(arr) or rows.dtype != dtype:
        return f"it does not hold {len(arr)} indices of type {dtype}"
    if ix.meta.get("count") != len(arr) or ix.meta.get("length") != n:
        return "it was made for another selection or dataset length"
    for a in range(0, len(rows), _CHUNK):
        differ = np.flatnonzero(rows[a : a + _CHUNK] != arr[a : a + _CHUNK])
        if len(differ):
            k = a + int(differ[0])
            return f"entry {k} is {int(rows[k])}, not the index {int(arr[k])} asked for"
    return None


# ------------------------------------------------------------------ split
def split_counts(n: int, fractions: Mapping[str, float | int]) -> dict[str, int]:
    """How many of ``n`` records each part of :func:`split` gets.

    Integer values are counts (their sum at most ``n``). Fractions (each ``>= 0``) are
    rounded by the largest-remainder method: each part gets ``floor(f * n)``, and the
    records left over go one each to the parts with the largest remainders (the earlier
    part on a tie). The counts sum to ``floor(s * n)``, where ``s`` is the fractions' sum
    rounded to 9 decimals (the fractions are scaled to sum to exactly ``s``): fractions
    that sum to 1 give every record a part; a smaller sum leaves the rest in none. A
    numpy float is the decimal it prints as (``np.float32(0.9)`` is 0.9).

    Example:
        >>> split_counts(10, {"train": 0.98, "val": 0.02})
        {'train': 10, 'val': 0}
        >>> split_counts(10, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
        {'a': 4, 'b': 3, 'c': 3}
        >>> split_counts(10, {"a": 0.25, "b": 0.25})
        {'a': 3, 'b': 2}
        >>> split_counts(10, {"train": 8, "val": 1})
        {'train': 8, 'val': 1}
    """
    if not isinstance(fractions, Mapping) or not fractions:
        raise ValueError("split needs a non-empty dict of part name -> fraction or count")
    values = list(fractions.values())
    for name, v in fractions.items():
        if not isinstance(name, str):
            raise TypeError(f"split part names must be strings, got {name!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"split part {name!r}: a fraction or a count, got {v!r}")
        if not v >= 0 or not math.isfinite(v):
            raise ValueError(f"split part {name!r}: must be >= 0, got {v!r}")
    if all(isinstance(v, (int, np.integer)) for v in values):
        if sum(int(v) for v in values) > n:
            raise ValueError(f"split counts {dict(fractions)} sum to more than {n} records")
        return {k: int(v) for k, v in fractions.items()}
    if any(isinstance(v, (int, np.integer)) and v != 0 for v in values):
        raise TypeError(f"split takes fractions or counts, not both: {dict(fractions)}")
    # A numpy float is the decimal it prints as (float32 0.9 is 0.9, not 0.899999976...).
    values = [float(str(v)) if isinstance(v, np.floating) else v for v in values]
    exact = [Fraction(float(v)) for v in values]
    # The sum, to 9 decimals: fractions meant to sum to 1 or 0.5 do, whatever float
    # rounding did to them; the parts are scaled to sum to exactly that.
    total = Fraction(f"{math.fsum(float(v) for v in values):.9f}")
    if total > 1:
        raise ValueError(f"split fractions {dict(fractions)} sum to {float(total)}, more than 1")
    if total:
        exact = [f * total / sum(exact) for f in exact]
    shares = [f * n for f in exact]
    return dict(zip(fractions, largest_remainder(shares, math.floor(sum(shares)))))


def key_hash(value: Any, seed: int = 0) -> int:
    """A stable 64-bit hash of a record's key value (BLAKE2b of its canonical bytes,
    keyed by ``seed``): the same for the same value whatever the process, machine, file
    format or numpy/Python type (``np.int64(3)`` and ``3`` hash alike; ``3`` and ``3.0``
    and ``"3"`` do not).

    Example:
        >>> import numpy as np
        >>> key_hash("doc-17") == key_hash("doc-17"), key_hash(np.int64(3)) == key_hash(3)
        (True, True)
        >>> key_hash(3) == key_hash(3.0), key_hash("a", seed=1) == key_hash("a")
        (False, False)
    """
    h = hashlib.blake2b(
        _canonical(value), digest_size=8, key=struct.pack("<Q", seed & _MASK64), person=b"tg.split"
    )
    return int.from_bytes(h.digest(), "little")


def _canonical(value: Any) -> bytes:
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OV":
            raise TypeError(f"split by= cannot hash an array of dtype {value.dtype}")
        data = np.ascontiguousarray(value)
        return b"a" + f"{data.dtype.str}{data.shape}".encode() + data.tobytes()
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        return b"n"
    if isinstance(value, bool):
        return b"?1" if value else b"?0"
    if isinstance(value, int):
        return b"i" + str(value).encode()
    if isinstance(value, float):
        return b"f" + struct.pack("<d", value)
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b" + bytes(value)
    raise TypeError(
        f"split by= hashes str, bytes, numbers, None and numpy arrays; got {type(value).__name__}"
    )


class _InPart:
    """The filter predicate of one part of a by-key split: the key's hash falls in
    ``[lo, hi)`` (of ``2**64``)."""

    def __init__(self, by: str, seed: int, lo: int, hi: int) -> None:
        self.by, self.seed, self.lo, self.hi = by, seed, lo, hi

    def __call__(self, record: Any) -> bool:
        try:
            value = record[self.by]
        except (KeyError, TypeError, IndexError):
            keys = list(record) if isinstance(record, dict) else type(record).__name__
            raise KeyError(f"split by={self.by!r}: the record has no such key ({keys})") from None
        return self.lo <= key_hash(value, self.seed) < self.hi


def split(
    ds: Any,
    fractions: Mapping[str, float | int],
    *,
    seed: int = 0,
    by: str | None = None,
    **filter_options: Any,
) -> dict[str, Dataset]:
    """Disjoint parts of ``ds``, as a dict ``name -> Dataset`` in the order given.

    Without ``by``: part ``k`` is the records at positions ``[c_0 + ... + c_{k-1}, c_0 +
    ... + c_k)`` of one keyed permutation of ``[0, len(ds))`` (seeded by ``seed``), with
    the exact counts ``c`` of :func:`split_counts` (largest remainder; fractions summing
    to 1 cover every record, a smaller sum leaves the rest out). O(1) memory, the same
    parts in every process and run for the same ``seed`` and ``len(ds)``.

    With ``by="key"``: a record goes to part ``k`` when :func:`key_hash` of its value of
    that key (keyed by ``seed``) falls in part ``k``'s share of the hash range. A record
    then stays in its part when shards are added, removed or re-sharded, and records
    with the same key value are in the same part; the sizes follow the fractions up to
    sampling error (not exact; counts are refused). Each part is a filter of ``ds``
    (``ds.filter``: one pass over ``ds`` per part, then a node-shared selection index);
    ``filter_options`` (``index_dir``, ``num_workers``, ``progress``...) go to it.

    Example:
        >>> import torchgrain as tg
        >>> ds = tg.Dataset([{"id": f"doc{i}"} for i in range(100)])
        >>> parts = tg.split(ds, {"train": 0.9, "val": 0.1}, seed=0)
        >>> {k: len(v) for k, v in parts.items()}
        {'train': 90, 'val': 10}
        >>> seen = [r["id"] for p in parts.values() for r in p.__getitems__(range(len(p)))]
        >>> sorted(seen) == sorted(r["id"] for r in ds)
        True
    """
    ds = ds if isinstance(ds, Dataset) else Dataset(ds)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    n = len(ds)
    if by is None:
        if filter_options:
            raise TypeError(f"split got options {sorted(filter_options)} that only by= takes")
        mixture = changes_with_epoch(ds, transforms=False)
        if mixture is not None:
            # Its positions read other records at another epoch: parts disjoint at each
            # epoch would share records across epochs (a held-out record trained on).
            raise TypeError(
                f"cannot split {mixture} by position: its positions read other records at "
                "each epoch, so the parts would share records; split each dataset before "
                "mixing them"
            )
        counts = split_counts(n, fractions)
        starts = itertools.accumulate(counts.values(), initial=0)
        return {
            name: _wrap(ds, Subset(ds, _PermutedRows(n, seed, a, c), label=f"split {name!r}"))
            for (name, c), a in zip(counts.items(), starts)
        }
    if not isinstance(by, str):
        raise TypeError(f"by must be a record key (a str), got {by!r}")
    if any(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in fractions.values()
    ):
        raise TypeError("split by= takes fractions, not counts (a hash cannot give exact counts)")
    # Shares of the 64-bit hash range, by the same largest-remainder rounding.
    bounds = split_counts(1 << 64, fractions)
    edges, parts = list(itertools.accumulate(bounds.values(), initial=0)), {}
    for name, lo, hi in zip(bounds, edges, edges[1:]):
        label = f"tg.split(by={by!r}, seed={seed}) part {name!r} [{lo}, {hi})"
        parts[name] = ds.filter(_InPart(by, seed, lo, hi), name=label, **filter_options)
    return parts
