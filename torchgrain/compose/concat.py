"""Concatenation: several datasets, of any formats, as one index space.

``tg.concat([a, b, c])`` is a :class:`~torchgrain.Dataset` over a :class:`Concat` view:
item ``i`` is item ``i - offsets[k]`` of dataset ``k``, found by a binary search over the
``len(datasets) + 1`` prefix offsets (the only state the view adds; the same
:class:`~torchgrain.sources.index.ShardIndex` that maps a source's records to its
shards). A batch is read with one batched call per dataset it touches
(:mod:`torchgrain.compose.view`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from torchgrain.columns import ColumnBatch, column_of
from torchgrain.compose.view import View
from torchgrain.dataset import Dataset
from torchgrain.errors import SchemaMismatchError
from torchgrain.protocols import HasBlockOffsets
from torchgrain.sources.index import ShardIndex

__all__ = ["Concat", "concat"]


class Concat(View):
    """The records of ``children``, one after the other (see :func:`concat`).

    Args:
        children: the datasets, in order.
        names: a name per dataset (errors name them; with ``source_field``, records carry
            them); None: records carry the dataset's position.
        source_field: a key added to every record, holding its dataset's name or
            position; None adds nothing.

    It offers ``block_offsets()`` only when every dataset has blocks (a plain sequence
    has none).
    """

    def __init__(
        self,
        children: Sequence[Any],
        *,
        names: Sequence[str] | None = None,
        source_field: str | None = None,
    ) -> None:
        super().__init__(children, names=names)
        self._index = ShardIndex([len(c) for c in self.children])
        self.source_field = source_field
        self._labels: list[Any] | None = None
        if source_field is not None:
            if not isinstance(source_field, str):
                raise TypeError(f"source_field must be a str, got {source_field!r}")
            if source_field in self._keys:
                raise self._clash(
                    [k for k, c in enumerate(self.children) if source_field in c.keys]
                )
            self._labels = list(self.names if names is not None else range(len(self.children)))
            if self._keys:
                self._keys.append(source_field)
                self._schema[source_field] = "str" if names is not None else "int"

    def __len__(self) -> int:
        return len(self._index)

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._index._locate(indices)

    @property
    def offsets(self) -> np.ndarray:
        """Where each dataset starts in the view (``len(children) + 1`` int64 offsets)."""
        return self._index.offsets

    def _label(self, records: list[Any], which: np.ndarray) -> list[Any]:
        if self._labels is None:
            return records
        labels, field = self._labels, self.source_field
        out = []
        for rec, k in zip(records, which.tolist()):
            if not isinstance(rec, dict):
                raise TypeError(
                    f"concat(source_field={field!r}) needs records that are dicts; "
                    f"{self.describe_child(k)} returned a {type(rec).__name__}"
                )
            if field in rec:  # keys not declared (a list, transforms): checked here
                raise self._clash([k])
            out.append({**rec, field: labels[k]})
        return out

    def _clash(self, children: list[int]) -> SchemaMismatchError:
        read = " or ".join(self.describe_child(k) for k in children)
        return SchemaMismatchError(
            f"concat(source_field={self.source_field!r}): {self.source_field!r} is already "
            f"a key of the records of {read}: choose another name"
        )

    def _label_columns(self, batch: ColumnBatch, which: np.ndarray) -> ColumnBatch:
        if self._labels is None:
            return batch
        labels = self._labels
        if self.source_field in batch:
            raise self._clash(sorted(set(which.tolist())) or [0])
        batch[self.source_field] = (
            which.astype(np.int64)
            if isinstance(labels[0], int)
            else column_of([labels[k] for k in which.tolist()])
        )
        return batch

    def offers(self, capability: type) -> bool:
        if capability is HasBlockOffsets:
            return all(isinstance(c, HasBlockOffsets) for c in self.children)
        return super().offers(capability)

    def block_offsets(self) -> np.ndarray:
        """Every dataset's storage blocks, shifted to where it starts in the view (so
        :class:`~torchgrain.BlockShuffleSampler` keeps its reads inside them).

        Raises:
            TypeError: a dataset has no block boundaries (a plain sequence).
        """
        parts = [np.zeros(1, dtype=np.int64)]
        for k, child in enumerate(self.children):
            try:
                blocks = np.asarray(child.block_offsets(), dtype=np.int64)
            except TypeError as e:
                raise TypeError(f"{self.describe_child(k)}: {e}") from None
            parts.append(blocks[1:] + self._index.offsets[k])
        return np.unique(np.concatenate(parts))

    def identity(self) -> Any:
        return (self.source_field, self._labels)

    def __repr__(self) -> str:
        named = "" if self.source_field is None else f", source_field={self.source_field!r}"
        return f"{super().__repr__()[:-1]}{named})"


def concat(
    datasets: Sequence[Any] | Mapping[str, Any], *, source_field: str | None = None
) -> Dataset:
    """The records of ``datasets``, one after the other, as one :class:`~torchgrain.Dataset`.

    ``datasets`` are any :class:`~torchgrain.Source` (Parquet, ArrayRecord and TFRecord
    together), :class:`~torchgrain.Dataset` (its transforms apply, ``random_map`` keyed
    by the dataset's own index) or what a Dataset accepts; a dict names them. Their keys
    and schemas must agree (``SchemaMismatchError`` naming both otherwise; see
    :func:`~torchgrain.compose.view.merge_schemas`). Item ``i`` resolves to its dataset by
    a binary search over the datasets' offsets (O(number of datasets) memory), a batch is
    read with one batched call per dataset it touches, and the result's
    ``block_offsets`` are the datasets' blocks, shifted, so every sampler drives it:
    :class:`~torchgrain.GlobalShuffleSampler` shuffles across all of them.
    ``.random_map`` on the result is keyed by the concatenated index.

    Args:
        datasets: a list of datasets, or a dict ``name -> dataset`` (in its order).
        source_field: a key added to each record: the record's dataset's position in the
            list, or its name in the dict. None adds nothing.

    Example:
        >>> import tempfile, os, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": i} for i in range(3)], os.path.join(d, "a"))
        >>> _ = tg.write_parquet([{"x": i} for i in range(10, 12)], os.path.join(d, "b"))
        >>> ds = tg.concat({"web": tg.ArrayRecordSource(os.path.join(d, "a")),
        ...                 "books": tg.ParquetSource(os.path.join(d, "b"))},
        ...                source_field="source")
        >>> len(ds), ds[3], ds.block_offsets().tolist()
        (5, {'x': 10, 'source': 'books'}, [0, 1, 2, 3, 5])
        >>> [r["x"] for r in ds.__getitems__([4, 0, 3])]
        [11, 0, 10]
    """
    names, children = named_datasets(datasets, "concat")
    return Dataset(Concat(children, names=names, source_field=source_field))


def named_datasets(datasets: Any, what: str) -> tuple[list[str] | None, list[Any]]:
    """The names (None for a list) and the datasets of a list or a dict ``name -> dataset``
    given to ``what``.

    Example:
        >>> named_datasets({"a": [1], 2: [3]}, "concat")
        (['a', '2'], [[1], [3]])
    """
    if isinstance(datasets, Mapping):
        return [str(k) for k in datasets], list(datasets.values())
    if isinstance(datasets, (str, bytes)) or not isinstance(datasets, Sequence):
        raise TypeError(f"{what} needs a list or dict of datasets, got {type(datasets).__name__}")
    return None, list(datasets)
