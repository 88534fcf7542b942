"""ShardIndex: global record index -> (shard, local row) through a prefix-sum array.

The whole mapping lives in one int64 numpy array of ``num_shards + 1`` offsets, so a
dataset of a billion records over 10,000 shards costs 80 KB of index, shares
copy-on-write pages with forked workers untouched, and pickles small.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


class ShardIndex:
    """Maps global record indices to ``(shard, row)`` pairs.

    Args:
        counts: number of records in each shard, in dataset order.

    Example:
        >>> idx = ShardIndex([3, 0, 2])
        >>> len(idx), idx.num_shards
        (5, 3)
        >>> shards, rows = idx.locate([0, 2, 3, 4])
        >>> shards.tolist(), rows.tolist()
        ([0, 0, 2, 2], [0, 2, 0, 1])
    """

    __slots__ = ("offsets",)

    def __init__(self, counts: Sequence[int] | np.ndarray) -> None:
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 1:
            raise ValueError("counts must be one-dimensional")
        if (counts < 0).any():
            raise ValueError("shard record counts must be >= 0")
        self.offsets = np.concatenate(([0], np.cumsum(counts)))
        self.offsets.setflags(write=False)

    @classmethod
    def from_offsets(cls, offsets: np.ndarray) -> ShardIndex:
        """A ShardIndex over ready prefix sums (``num_shards + 1`` int64, from 0, never
        decreasing), used as they are: a mapped dataset index's cost no memory.

        Example:
            >>> ShardIndex.from_offsets(np.array([0, 3, 3, 5])).counts.tolist()
            [3, 0, 2]
        """
        offsets = np.asarray(offsets)
        if (
            offsets.ndim != 1
            or offsets.dtype != np.int64
            or len(offsets) == 0
            or offsets[0] != 0
            or bool((np.diff(offsets) < 0).any())
        ):
            raise ValueError("offsets must be int64 prefix sums starting at 0")
        new = cls.__new__(cls)
        new.offsets = offsets
        return new

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.offsets) - 1

    @property
    def counts(self) -> np.ndarray:
        """Records per shard (int64 array)."""
        return np.diff(self.offsets)

    def check(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Validate indices and return them as an int64 array.

        Raises:
            IndexError: for a negative or out-of-range index (no wrap-around).
            TypeError: for a non-integer index.
        """
        if isinstance(indices, (list, tuple)) and bool in set(map(type, indices)):
            raise TypeError("record indices must be integers, got bool")
        arr = np.asarray(indices)
        if arr.dtype.kind == "f" and isinstance(indices, (list, tuple)):
            # Ints past int64 mixed with others promote to float64: check them as ints.
            arr = np.asarray(indices, dtype=object)
        if arr.dtype == object or arr.dtype.kind not in "iu":
            if arr.size == 0:
                return np.zeros(0, dtype=np.int64)
            bad = [
                i
                for i in np.ravel(arr)
                if not isinstance(i, numbers.Integral) or isinstance(i, bool)
            ]
            if bad or arr.dtype.kind not in "iuO":
                raise TypeError(f"record indices must be integers, got {bad[:1] or arr.dtype}")
        n = len(self)
        if arr.size and arr.dtype.kind in "uO":
            # Check before the cast to int64, which would overflow (Python ints) or
            # wrap (uint64) and then name the wrong index.
            flat = np.ravel(arr)
            out = flat[flat >= n] if arr.dtype.kind == "u" else [i for i in flat if not 0 <= i < n]
            if len(out):
                raise IndexError(
                    f"record index {int(out[0])} out of range for a dataset of {n} records"
                )
        arr = arr.astype(np.int64, copy=False).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            bad_i = int(arr[(arr < 0) | (arr >= n)][0])
            raise IndexError(f"record index {bad_i} out of range for a dataset of {n} records")
        return arr

    def locate(
        self, indices: Sequence[int] | np.ndarray, *, checked: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(shard_ids, local_rows)`` for valid global indices (vectorised);
        ``checked``: ``indices`` come from :meth:`check` (not checked again)."""
        return self._locate(indices if checked else self.check(indices))  # type: ignore[arg-type]

    def _locate(self, arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(self.offsets) == 2:  # one shard: rows are the indices
            return np.zeros(len(arr), dtype=np.int64), arr
        shards = np.searchsorted(self.offsets, arr, side="right") - 1
        return shards, arr - self.offsets[shards]

    def split(self, idx: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        """Checked indices (from :meth:`check`) grouped by shard.

        Returns ``(shard, rows in request order, positions in the request)`` per shard,
        as :func:`group_by_shard` does, except that ``positions`` is None when every
        index falls in one shard (the common case of one-shard datasets and
        shard-local orders: nothing to sort or scatter).

        Example:
            >>> ix = ShardIndex([3, 2])
            >>> [(s, r.tolist(), p) for s, r, p in ix.split(np.array([4, 3]))]
            [(1, [1, 0], None)]
            >>> [(s, r.tolist(), p.tolist()) for s, r, p in ix.split(np.array([4, 0, 3]))]
            [(0, [0], [1]), (1, [1, 0], [0, 2])]
        """
        if len(idx) == 0:
            return []
        offsets = self.offsets
        if len(offsets) == 2:
            return [(0, idx, None)]
        shards = np.searchsorted(offsets, idx, side="right") - 1
        first = int(shards[0])
        if first == int(shards[-1]) and bool((shards == first).all()):
            return [(first, idx - offsets[first], None)]
        return group_by_shard(shards, idx - offsets[shards])

    def locate_one(self, index: int) -> tuple[int, int]:
        """Scalar fast path of :meth:`locate`."""
        if not isinstance(index, numbers.Integral) or isinstance(index, bool):
            raise TypeError(f"record index must be an integer, got {type(index).__name__}")
        index = int(index)
        n = int(self.offsets[-1])
        if index < 0 or index >= n:
            raise IndexError(f"record index {index} out of range for a dataset of {n} records")
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return shard, index - int(self.offsets[shard])

    def __getstate__(self):
        return self.offsets

    def __setstate__(self, offsets):
        self.offsets = offsets

    def __repr__(self) -> str:
        return f"ShardIndex(num_shards={self.num_shards}, num_records={len(self)})"


def group_by_shard(
    shards: np.ndarray, rows: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Group positions of a request by shard.

    Returns a list of ``(shard, rows_in_request_order, positions)``, where
    ``positions`` are the places in the original request those rows fill.

    Example:
        >>> g = group_by_shard(np.array([1, 0, 1]), np.array([5, 7, 2]))
        >>> [(s, r.tolist(), p.tolist()) for s, r, p in g]
        [(0, [7], [1]), (1, [5, 2], [0, 2])]
    """
    if len(shards) == 0:
        return []
    order = np.argsort(shards, kind="stable")
    sorted_shards = shards[order]
    cuts = [0, *(np.flatnonzero(np.diff(sorted_shards)) + 1).tolist(), len(order)]
    heads = sorted_shards[cuts[:-1]].tolist()
    return [
        (shard, rows[pos], pos)
        for shard, pos in zip(heads, (order[a:b] for a, b in itertools.pairwise(cuts)))
    ]


def in_request_order(results: Iterable[list[Any]], groups: Sequence[tuple], n: int) -> list[Any]:
    """Per-group results (one list per ``(shard, rows, positions)`` group, as
    :meth:`ShardIndex.split` gives them) as one list of ``n`` in the request's order.

    Example:
        >>> g = group_by_shard(np.array([1, 0, 1]), np.array([5, 7, 2]))
        >>> in_request_order([["b"], ["a", "c"]], g, 3)
        ['a', 'b', 'c']
    """
    out: list[Any] = [None] * n
    for (_, _, positions), items in zip(groups, results):
        if positions is None:  # one group: already in order
            return list(items)
        for p, item in zip(positions.tolist(), items):
            out[p] = item
    return out
