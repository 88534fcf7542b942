"""Split strategies: how a sampler's order is shared out between ranks (and workers).

A sampler's epoch order is a sequence of ``N`` positions (see
:class:`~torchgrain.sampling.ResumableSampler`). The ranks split a *virtual stream* of
``L`` of those positions: the whole order on a fresh epoch, what is left of it after a
resume onto a different world. :class:`Shares` says how many positions each rank draws
(DistributedSampler's padding and drop_last rules, applied by the base sampler), and a
:class:`Split` says which positions of the virtual stream they are, in which order:

* :class:`InterleavedSplit`: rank ``r`` takes ``r, r + W, r + 2W, ...``
  (DistributedSampler's round robin; :class:`~torchgrain.GlobalShuffleSampler`).
* :class:`ContiguousSplit`: rank ``r`` takes one contiguous run, optionally dealt to the
  DataLoader's workers batch by batch (:class:`~torchgrain.BlockShuffleSampler`).

Example:
    >>> shares = Shares(10, num_replicas=2)
    >>> InterleavedSplit().positions(shares, rank=1, start=0, stop=5).tolist()
    [1, 3, 5, 7, 9]
    >>> ContiguousSplit().positions(shares, rank=1, start=0, stop=5).tolist()
    [5, 6, 7, 8, 9]
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from typing import Any

import numpy as np

__all__ = ["ContiguousSplit", "InterleavedSplit", "Shares", "Split"]

# DataLoader workers a loaded state may name (each is a process: far above any loader).
_MAX_WORKERS = 1 << 16
# Workers of all ranks together a loaded state may name (a re-split walks each one).
_MAX_READERS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shares:
    """How many positions of a virtual stream of ``length`` each of ``num_replicas``
    ranks draws: DistributedSampler's rules.

    Padded (the default): ``ceil(L / W)`` each, the positions past ``L`` standing for
    ``v mod L`` (the order's first positions again). ``drop_last``: ``floor(L / W)``
    each. ``pad=False``: ``L // W``, one more for the first ``L % W`` ranks (every
    position exactly once). A single replica draws ``L`` padded up to a multiple of
    ``pad_to`` (under a loader that splits batches itself and fills its last step).

    Attributes:
        length: ``L``, the positions of the virtual stream.
        num_replicas: ``W``, the ranks splitting it.
        drop_last, pad, pad_to: the rules above.

    Example:
        >>> s = Shares(10, num_replicas=4)
        >>> [s.count(r) for r in range(4)], [s.start(r) for r in range(4)]
        ([3, 3, 3, 3], [0, 3, 6, 9])
        >>> s = Shares(10, num_replicas=4, pad=False)
        >>> [s.count(r) for r in range(4)], [s.start(r) for r in range(4)]
        ([3, 3, 2, 2], [0, 3, 6, 8])
    """

    length: int
    num_replicas: int = 1
    drop_last: bool = False
    pad: bool = True
    pad_to: int = 1

    def count(self, rank: int) -> int:
        """Positions rank ``rank`` draws."""
        length, w = self.length, self.num_replicas
        if w == 1:  # padded up to a multiple of pad_to
            return length if self.pad_to <= 1 else -(-length // self.pad_to) * self.pad_to
        if self.drop_last:
            return length // w
        if self.pad:
            return -(-length // w)
        return length // w + (rank < length % w)

    def start(self, rank: int) -> int:
        """The ranks before ``rank`` draw this many positions together (where rank
        ``rank``'s run starts, for a contiguous split)."""
        length, w = self.length, self.num_replicas
        if w == 1:
            return 0
        if self.pad and not self.drop_last:
            return rank * -(-length // w)
        return rank * (length // w) + (0 if self.drop_last else min(rank, length % w))


class Split(abc.ABC):
    """How the virtual stream is split between ranks: a strategy object.

    A split is a value: equal splits give every rank the same order, and a resume in
    the same world continues in place only under an equal split (otherwise the rest of
    the epoch is re-split, as for a new world size). :meth:`state` is saved with the
    sampler's state and :meth:`from_state` rebuilds the split a state was drawn with.

    A new split implements :meth:`positions` and :meth:`consumed`; both must stay O(1)
    (or O(ranks + workers)) in memory apart from the positions asked for.

    Example:
        >>> import numpy as np
        >>> class Reversed(Split):  # rank r's share, last position first
        ...     def positions(self, shares, rank, start, stop):
        ...         end = shares.start(rank) + shares.count(rank)
        ...         return end - 1 - np.arange(start, stop, dtype=np.int64)
        ...     def consumed(self, shares, position):
        ...         return [(shares.start(r) + shares.count(r) - min(position, shares.count(r)),
        ...                  shares.start(r) + shares.count(r))
        ...                 for r in range(shares.num_replicas)]
        >>> Reversed().positions(Shares(10, 2), 0, 0, 5).tolist()
        [4, 3, 2, 1, 0]
    """

    @abc.abstractmethod
    def positions(self, shares: Shares, rank: int, start: int, stop: int) -> np.ndarray:
        """Virtual positions of rank ``rank``'s draws ``[start, stop)``, as a fresh int64
        array the caller may modify (``0 <= start < stop <= shares.count(rank)``).

        Values from ``shares.length`` on are padding; the sampler maps them to
        ``v mod length``.
        """

    @abc.abstractmethod
    def consumed(self, shares: Shares, position: int) -> list[tuple[int, int]]:
        """Intervals ``[a, b)`` of virtual positions drawn once every rank drew its first
        ``position`` (or all it has); intervals may overlap or pass ``shares.length``
        (padding)."""

    def state(self) -> dict[str, Any]:
        """What identifies this split in a sampler's saved state (plain ints)."""
        return {}

    def from_state(self, state: dict[str, Any]) -> Split:
        """The split that ``state`` (saved by a sampler using this kind of split) was
        drawn with; by default this one."""
        return self

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.state() == self.state()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.state().items()))))


class InterleavedSplit(Split):
    """Round robin: rank ``r`` of ``W`` draws virtual positions ``r, r + W, r + 2W, ...``
    (DistributedSampler's split).

    Example:
        >>> InterleavedSplit().positions(Shares(7, 3), rank=2, start=0, stop=3).tolist()
        [2, 5, 8]
    """

    def positions(self, shares: Shares, rank: int, start: int, stop: int) -> np.ndarray:
        w = shares.num_replicas
        return np.arange(start * w + rank, stop * w + rank, w, dtype=np.int64)

    def consumed(self, shares: Shares, position: int) -> list[tuple[int, int]]:
        # After every rank drew `position`, the prefix of position * W is consumed.
        return [(0, min(position * shares.num_replicas, shares.length))]


class ContiguousSplit(Split):
    """Contiguous runs: rank ``r`` draws the ``count(r)`` positions from
    ``start(r)`` on (see :class:`Shares`), so each rank stays on about ``1 / W`` of the
    order.

    With ``batch_size`` and ``num_workers > 1`` the rank's run is dealt to a
    DataLoader's workers: the run is cut into ``num_workers`` contiguous parts and
    batch ``b`` (``batch_size`` draws) comes from part ``b % num_workers``, which is the
    batch the DataLoader hands to worker ``b % num_workers``: each worker reads its own
    part of the run.

    Example:
        >>> shares = Shares(12, num_replicas=1)
        >>> ContiguousSplit().positions(shares, 0, 0, 12).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
        >>> ContiguousSplit(batch_size=2, num_workers=2).positions(shares, 0, 0, 12).tolist()
        [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    """

    def __init__(self, batch_size: int | None = None, num_workers: int = 0) -> None:
        if batch_size is not None and operator.index(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if operator.index(num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.batch_size = batch_size
        self.num_workers = num_workers

    @property
    def dealing(self) -> tuple[int, int] | None:
        """``(batch_size, num_workers)`` when the run is dealt to workers, else None."""
        b, w = self.batch_size, self.num_workers or 0
        return (int(b), int(w)) if b is not None and w > 1 else None

    def state(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "num_workers": self.num_workers}

    def from_state(self, state: dict[str, Any]) -> ContiguousSplit:
        batch_size, workers = state.get("batch_size"), state.get("num_workers") or 0
        # A saved run is re-split over each rank's workers one by one: bound what a state
        # names, all ranks' workers together too (2**20 ranks of 2**16 workers: hours).
        replicas = operator.index(state.get("num_replicas", 1))
        for key, value, top in (
            ("batch_size", 1 if batch_size is None else batch_size, 1 << 62),
            ("num_workers", workers, min(_MAX_WORKERS, _MAX_READERS // max(1, replicas))),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"sampler state field {key!r} must be an int, got {value!r}")
            if not 0 <= value <= top:
                raise ValueError(f"sampler state field {key!r} out of [0, {top}]: {value}")
        return ContiguousSplit(batch_size, workers)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ContiguousSplit) and other.dealing == self.dealing

    def __hash__(self) -> int:
        return hash((ContiguousSplit, self.dealing))

    def __repr__(self) -> str:
        return f"ContiguousSplit(batch_size={self.batch_size}, num_workers={self.num_workers})"

    def positions(self, shares: Shares, rank: int, start: int, stop: int) -> np.ndarray:
        first = shares.start(rank)
        config = self.dealing
        if config is None:
            return np.arange(first + start, first + stop, dtype=np.int64)
        return first + _deal(np.arange(start, stop, dtype=np.int64), shares.count(rank), *config)

    def consumed(self, shares: Shares, position: int) -> list[tuple[int, int]]:
        # Rank r's run starts at start(r) and has count(r) draws; without dealing it
        # consumed the run's first `position` (or all of it), with dealing a prefix of
        # each worker's part of the run.
        config = self.dealing
        out: list[tuple[int, int]] = []
        for r in range(shares.num_replicas):
            start, count = shares.start(r), shares.count(r)
            drawn = min(position, count)
            if config is None:
                out.append((start, start + drawn))
            else:
                out.extend(
                    (start + a, start + b) for a, b in _dealt_prefixes(count, drawn, *config)
                )
        return out


def _dealt_parts(count: int, batch_size: int, num_workers: int) -> np.ndarray:
    """Start of each worker's part of a run of ``count`` (and the end), int64."""
    nb = -(-count // batch_size)
    w = np.arange(num_workers, dtype=np.int64)
    batches = np.maximum(0, -(-(nb - w) // num_workers))  # batches b < nb with b % W == w
    lengths = batches * batch_size
    if nb:
        lengths[(nb - 1) % num_workers] -= nb * batch_size - count  # the short last batch
    starts = np.zeros(num_workers + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


def _deal(j: np.ndarray, count: int, batch_size: int, num_workers: int) -> np.ndarray:
    """Run position of draw ``j``: batch ``b = j // batch_size`` is the
    ``b // num_workers``-th batch of worker ``b % num_workers``'s contiguous part.
    A bijection of ``[0, count)``."""
    starts = _dealt_parts(count, batch_size, num_workers)
    b = j // batch_size
    return starts[b % num_workers] + (b // num_workers) * batch_size + j % batch_size


def _dealt_prefixes(
    count: int, pos: int, batch_size: int, num_workers: int
) -> list[tuple[int, int]]:
    """Run intervals of the first ``pos`` draws of a dealt run of ``count``."""
    starts = _dealt_parts(count, batch_size, num_workers).tolist()
    if pos >= count:
        return [(0, count)]
    full, rem = divmod(pos, batch_size)  # batches before `full` are whole (not the last)
    out = []
    for w in range(num_workers):
        drawn = max(0, -(-(full - w) // num_workers)) * batch_size
        if rem and full % num_workers == w:
            drawn += rem
        if drawn:
            out.append((starts[w], starts[w] + drawn))
    return out
