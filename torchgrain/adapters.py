"""SequenceSource: any sized, indexable object made into a :class:`~torchgrain.Source`.

:class:`~torchgrain.Dataset` reads from a :class:`~torchgrain.Source`. Anything else it
is given (a list, a torch dataset, another :class:`~torchgrain.Dataset`) is adapted once,
when the Dataset is built, by :class:`SequenceSource`; from then on the Dataset speaks
only the Source contract. The optional capabilities of the wrapped object
(:mod:`torchgrain.protocols`) are found once, here, and passed on.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.protocols import (
    HasBlockOffsets,
    ReadsAhead,
    ReadsBatches,
    ReadsColumns,
    SetsEpoch,
    SizedIndexable,
)
from torchgrain.sources.base import Source
from torchgrain.sources.index import ShardIndex

__all__ = ["SequenceSource", "checked_batch"]


class SequenceSource(Source):
    """A :class:`~torchgrain.Source` over any object with ``len(x)`` and ``x[i]``.

    Reads use the object's own batched reads where it has them
    (:class:`~torchgrain.protocols.ReadsBatches`,
    :class:`~torchgrain.protocols.ReadsColumns`), else one ``x[i]`` per index; its
    ``set_epoch`` and ``read_ahead`` are the object's, and offered
    (:class:`~torchgrain.protocols.DeclaresCapabilities`) only when the object has them.
    A plain sequence does not say what its records hold or where its storage blocks are:
    :attr:`keys` and :attr:`schema` are empty and :meth:`block_offsets` raises
    ``TypeError`` saying so, unless ``describes_records`` says the object is a record
    source itself (a :class:`~torchgrain.Dataset`), whose keys, schema and blocks are
    then its own.

    Args:
        items: the object to read from.
        describes_records: ``items`` has ``keys``, ``schema`` and ``block_offsets()``
            that describe its records.

    Example:
        >>> src = SequenceSource(["a", "b", "c"])
        >>> len(src), src[1], src.__getitems__([2, 0]), src.keys
        (3, 'b', ['c', 'a'], [])
        >>> isinstance(src, HasBlockOffsets), isinstance(src, ReadsAhead)
        (False, False)
        >>> src.block_offsets()
        Traceback (most recent call last):
        ...
        TypeError: list is not a torchgrain Source: it has no block boundaries (give \
BlockShuffleSampler block_offsets=)
    """

    def __init__(self, items: Any, *, describes_records: bool = False) -> None:
        if not isinstance(items, SizedIndexable):
            raise TypeError("source must have __len__ and __getitem__")
        self.items = items
        self.describes_records = bool(describes_records)
        self._batched = isinstance(items, ReadsBatches)
        self._columns = isinstance(items, ReadsColumns)
        self._index = ShardIndex([len(items)])

    def offers(self, capability: type) -> bool:
        """Whether the object has ``capability`` (blocks: only a record source's)."""
        blocks = capability is not HasBlockOffsets or self.describes_records
        return blocks and isinstance(self.items, capability)

    def block_offsets(self) -> np.ndarray:
        if not self.describes_records:
            raise TypeError(
                f"{type(self.items).__name__} is not a torchgrain Source: it has no "
                "block boundaries (give BlockShuffleSampler block_offsets=)"
            )
        return self.items.block_offsets()

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the object when it has ``set_epoch``."""
        if isinstance(self.items, SetsEpoch):
            self.items.set_epoch(epoch)

    def read_ahead(self, order: Any, start: int, count: int, position: Any) -> Any:
        """Passed on to the object when it has ``read_ahead``; None otherwise."""
        if isinstance(self.items, ReadsAhead):
            return self.items.read_ahead(order, start, count, position)
        return None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        # As every source: no wrap-around (a list would read its last item at -1, and
        # random_map would key its draws by -1), an error naming the index and size.
        try:
            if isinstance(index, (bool, np.bool_)):  # (a list would read record 0 or 1)
                raise TypeError
            i, n = operator.index(index), len(self.items)
        except TypeError:
            raise TypeError(
                f"record index must be an integer, got {type(index).__name__}"
            ) from None
        if not 0 <= i < n:
            raise IndexError(f"record index {i} out of range for a dataset of {n} records")
        return self.items[index]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        self._check(indices)
        if not self._batched:
            return [self.items[i] for i in indices]
        return checked_batch(self.items, self.items.__getitems__(indices), indices)

    def _check(self, indices: Sequence[int]) -> None:
        """``IndexError`` / ``TypeError`` for indices any source would refuse."""
        n = len(self.items)  # (a list may grow)
        if len(self._index) != n:
            self._index = ShardIndex([n])
        self._index.check(indices)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        if self._columns:
            self._check(indices)
            return self.items.read_columns(indices)
        return ColumnBatch.from_records(self.__getitems__(indices))

    @property
    def keys(self) -> list[str]:
        return list(self.items.keys) if self.describes_records else []

    @property
    def schema(self) -> dict[str, str]:
        return dict(self.items.schema) if self.describes_records else {}

    def __repr__(self) -> str:
        return f"SequenceSource({self.items!r})"


def checked_batch(reader: Any, records: list[Any], indices: Sequence[int]) -> list[Any]:
    """``records``, once they are known to be one per index: a batched read that loses or
    adds records is an error naming the reader, never a shifted batch.

    Example:
        >>> checked_batch([], ["a", "b"], [0, 1])
        ['a', 'b']
        >>> checked_batch([], ["a"], [0, 1])
        Traceback (most recent call last):
        RuntimeError: list.__getitems__ returned 1 records for 2 indices
    """
    if len(records) != len(indices):
        raise RuntimeError(
            f"{type(reader).__name__}.__getitems__ returned {len(records)} "
            f"records for {len(indices)} indices"
        )
    return records
