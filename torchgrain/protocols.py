"""Optional capabilities of datasets and sources, stated as protocols.

What a dataset or source *may* offer beyond the :class:`~torchgrain.Source` base, and what
torchgrain does with it; components check with ``isinstance`` (runtime-checkable), and a
class has a capability by defining the method. A wrapper (a Dataset, an adapter, a view)
says which of its methods work (:class:`DeclaresCapabilities`), so ``isinstance`` tells the
truth. The protocols: :class:`SetsEpoch`, :class:`ReadsAhead`, :class:`HasBlockOffsets`,
:class:`ReadsBatches`, :class:`ReadsColumns`, :class:`SizedIndexable`, :class:`Fingerprinted`.

Design notes: docs/design-notes.md#protocols.

Example:
    >>> class Shards:
    ...     def __len__(self):
    ...         return 4
    ...     def __getitem__(self, i):
    ...         return {"x": i}
    ...     def set_epoch(self, epoch):
    ...         self.epoch = epoch
    >>> isinstance(Shards(), SetsEpoch), isinstance(Shards(), ReadsAhead)
    (True, False)
    >>> isinstance([1, 2], SizedIndexable), isinstance(5, SizedIndexable)
    (True, False)
    >>> class Wrapped(Shards):  # has the method, but says it does not work here
    ...     def offers(self, capability):
    ...         return capability is not SetsEpoch
    >>> isinstance(Wrapped(), SetsEpoch), isinstance(Wrapped(), DeclaresCapabilities)
    (False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "DeclaresCapabilities",
    "Fingerprinted",
    "HasBlockOffsets",
    "PlacedOrder",
    "ReadsAhead",
    "ReadsBatches",
    "ReadsColumns",
    "SetsEpoch",
    "SizedIndexable",
]


@runtime_checkable
class DeclaresCapabilities(Protocol):
    """Has ``offers(capability)``: whether its methods of ``capability`` (one of the
    protocols below with a check that asks) work, which for a wrapper depends on what it
    wraps."""

    def offers(self, capability: type) -> bool: ...


class _Capability(type(Protocol)):  # type: ignore[misc]
    """The check of an optional capability: the methods (typing's structural check),
    and, for an object that :class:`DeclaresCapabilities`, its word, unless a subclass
    of the class that says defines the methods itself (they are its own: they work)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if not super().__instancecheck__(obj):
            return False
        mro = [vars(k) for k in type(obj).__mro__]

        def defined_at(name: str) -> int:
            return next((k for k, names in enumerate(mro) if name in names), len(mro))

        says = defined_at("offers")
        methods = [name for name in vars(cls) if not name.startswith("_")]
        if says == len(mro) or all(defined_at(name) < says for name in methods):
            return True
        return bool(obj.offers(cls))


@runtime_checkable
class SetsEpoch(Protocol, metaclass=_Capability):
    """Has ``set_epoch(epoch)``: told the epoch whenever a sampler's epoch changes."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class ReadsAhead(Protocol, metaclass=_Capability):
    """Has ``read_ahead(order, start, count, position)``: prepares for a sampler's pass.

    ``order(a, b)`` gives the dataset indices at the pass's positions ``[a, b)``, the
    pass reads ``count`` positions from ``start`` on, and ``position()`` says how far it
    got. ``order`` None (``count`` 0) cancels. What it returns is kept by a
    :class:`~torchgrain.Dataset` for :func:`tg.stats <torchgrain.stats>` (a list of
    cache checks, or None).
    """

    def read_ahead(
        self,
        order: Callable[[int, int], np.ndarray] | None,
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> Any: ...


@runtime_checkable
class PlacedOrder(Protocol):
    """An ``order`` for :meth:`ReadsAhead.read_ahead` that also says where each index is
    read: ``placed(a, b)`` gives ``order(a, b)`` and the position in ``[a, b)`` of each.

    A composition's order for one source under it is one (a source behind another input
    gets fewer indices than positions, one under token windows more); a sampler's order,
    with one index per position, needs not be.
    """

    def __call__(self, a: int, b: int) -> np.ndarray: ...

    def placed(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]: ...


@runtime_checkable
class HasBlockOffsets(Protocol, metaclass=_Capability):
    """Has ``block_offsets()``: int64 prefix offsets of its storage blocks, from 0 to
    ``len(self)``."""

    def block_offsets(self) -> np.ndarray: ...


@runtime_checkable
class ReadsBatches(Protocol):
    """Has ``__getitems__(indices)``: the records at ``indices``, in order, in one call."""

    def __getitems__(self, indices: Sequence[int]) -> list[Any]: ...


@runtime_checkable
class ReadsColumns(Protocol):
    """Has ``read_columns(indices)``: the records at ``indices`` as a
    :class:`~torchgrain.columns.ColumnBatch`."""

    def read_columns(self, indices: Sequence[int]) -> Any: ...


@runtime_checkable
class SizedIndexable(Protocol):
    """Has ``len(x)`` and ``x[i]``: a sequence of records."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class Fingerprinted(Protocol):
    """Has ``fingerprint()``: a string that changes when the data it reads changes (see
    :func:`torchgrain.sources.node_index.derived.dataset_fingerprint`)."""

    def fingerprint(self) -> str: ...
