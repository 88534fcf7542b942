"""Weighted mixtures: ``tg.mix(datasets, weights)``, exact counts per epoch in O(1) memory.

An epoch of a mixture has ``L`` positions. Source ``k`` fills exactly ``c_k`` of them
(``sum(c_k) == L``), and the order is a pure function of ``(seed, epoch, position)``:

* **Counts.** ``c_k`` is ``L * w_k`` rounded by the largest-remainder method (every
  source gets the floor, the sources with the largest fractional parts one more, ties
  to the lower source number), in exact rational arithmetic (a float weight is the
  decimal it prints as), so the counts never depend on float rounding.
* **Which source a position reads.** Source ``k``'s draws sit at the times
  ``(j + 0.5) / c_k`` for ``j < c_k``; position ``i`` is the ``i``-th of all those times
  in order (ties to the lower source number). Every prefix of the epoch then holds each
  source's share to within ``1/2 + w_k (K - 2) / 2`` records (less than one for two
  sources). The ``i``-th time is found by a few steps of a binary search for every
  source at once, in integer arithmetic, vectorised over a batch: O(K^2) work per
  position for K sources and nothing stored per position.
* **Which record a draw reads.** The ``j``-th draw of source ``k`` in epoch ``e`` is
  that source's draw number ``g = e * c_k + j`` over the whole run: pass
  ``p = g // n_k`` of the source, record ``g % n_k`` of member ``k`` of
  ``KeyedPermutations(sizes, seed, epoch=p, tag=b"mix")`` (one keyed permutation per
  source and pass). So a source gives every record once per pass, never the
  same record twice within a pass, and an upsampled source starts a new pass (a new
  order) exactly when it runs out, independently of the other sources' passes.
* **A mixture under a mixture.** A source whose positions read other records at
  another epoch (a mixture anywhere under it) is read, for its draws in pass ``p``, as
  at epoch ``p``: one pass over it is one of its epochs, so it too gives each of its
  records once per pass (read at the current epoch instead, a pass that spans epochs
  would read some records twice and others never).

A sampler over the mixture (global shuffle, block shuffle, distributed) sees an
ordinary map-style dataset of length ``L``; its position is the whole state, so
mid-epoch and elastic resume stay exact. The epoch the mixture uses is the one the
sampler sets (:meth:`Mix.set_epoch`), shared with DataLoader workers.
"""

from __future__ import annotations

import contextvars
import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.compose.concat import Concat, named_datasets
from torchgrain.compose.filter import changes_with_epoch
from torchgrain.compose.view import (
    View,
    check_indices,
    read_column_pairs,
    read_pairs,
    short_repr,
)
from torchgrain.dataset import Dataset, EpochCell
from torchgrain.sampling.permutation import KeyedPermutations
from torchgrain.sources.base import Source

__all__ = ["Mix", "MixOrder", "mix", "mixture_counts", "mixture_length", "mixture_weights"]

_STOPPING = ("first_exhausted", "all_exhausted")
# Above this epoch length, (2j + 1) * c_m no longer fits in int64: the order is then
# computed on Python integers (exact, slower); below it, on int64 arrays.
_INT64_LIMIT = 1 << 31
# Records per epoch at most: a sampler orders no more.
_MAX_LENGTH = 1 << 62
# Permutation families kept per process (one per pass number a batch touches).
_NUMBERS = (int, float, Fraction, np.integer, np.floating)  # what a weight may be
_PERMS_KEPT = 64
# The epoch that mixtures resolve their positions in while a mixture above them reads
# one of its passes over them (None: each its own, the one set_epoch set).
_READ_EPOCH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "torchgrain_mix_read_epoch", default=None
)


def _fractions(weights: Sequence[Any], what: str = "weights") -> list[Fraction]:
    """Normalised exact weights (a float is the decimal it prints as, never re-rounded)."""
    out = []
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, _NUMBERS):
            raise TypeError(f"{what} must be numbers, got {w!r}")
        try:
            finite = math.isfinite(float(w))
        except OverflowError:  # an int or Fraction past a float's range
            finite = False
        if not finite or w < 0:
            raise ValueError(
                f"{what} must be finite and >= 0 (within a float's range), got {_number(w)}"
            )
        # A float is taken as the shortest decimal that reads back as it (0.6 is 3/5,
        # not 0.59999999999999997779...), so that [0.6, 0.4] of 60 records is 100; a
        # numpy float as the one of its own precision (float32 0.9 is 9/10).
        if isinstance(w, (int, np.integer)):
            out.append(Fraction(int(w)))
        elif isinstance(w, Fraction):
            out.append(w)
        else:
            out.append(Fraction(str(w) if isinstance(w, np.floating) else repr(float(w))))
    total = sum(out, Fraction(0))
    if total == 0:
        raise ValueError(f"{what} must not all be 0")
    return [f / total for f in out]


def _number(w: Any) -> str:
    """``w`` for an error message: cut short, an integer too long to print by its size."""
    try:
        return short_repr(w)
    except ValueError:  # past Python's int printing limit (4300 digits)
        return f"an integer of {w.bit_length()} bits"


def mixture_weights(
    sizes: Sequence[int], weights: Sequence[Any] | None = None, temperature: float | None = None
) -> list[Fraction]:
    """The normalised weights of a mixture: ``weights`` as given, else ``n_k ** (1/T)``
    with a ``temperature`` T, else proportional to the sizes ``n_k``.

    Example:
        >>> [str(w) for w in mixture_weights([10, 30])]
        ['1/4', '3/4']
        >>> [round(float(w), 3) for w in mixture_weights([100, 10000], temperature=2)]
        [0.091, 0.909]
    """
    if weights is not None:
        if temperature is not None:
            raise ValueError("give weights or temperature, not both")
        if len(weights) != len(sizes):
            raise ValueError(f"{len(weights)} weights for {len(sizes)} datasets")
        return _fractions(weights)
    if temperature is None:
        return _fractions(list(sizes), "dataset sizes")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    try:
        scaled = [float(n) ** (1.0 / temperature) for n in sizes]
    except OverflowError:
        # Past the float range (a low temperature): the same ratios, to the largest size.
        top = max(sizes)
        scaled = [(n / top) ** (1.0 / temperature) for n in sizes]
    return _fractions(scaled, "dataset sizes")


def mixture_length(
    sizes: Sequence[int], weights: Sequence[Fraction], stopping: str = "first_exhausted"
) -> int:
    """Epoch length by a stopping rule, for normalised ``weights``.

    ``"first_exhausted"``: the largest L at which no source gives more than one pass
    (``floor(min n_k / w_k)``); ``"all_exhausted"``: the smallest L at which every source
    gives at least one pass (``ceil(max n_k / w_k)``). Sources of weight 0 are left out.

    Example:
        >>> w = mixture_weights([100, 50], [0.5, 0.5])
        >>> mixture_length([100, 50], w), mixture_length([100, 50], w, "all_exhausted")
        (100, 200)
    """
    if stopping not in _STOPPING:
        raise ValueError(f"stopping must be one of {_STOPPING}, got {stopping!r}")
    ratios = [Fraction(n) / w for n, w in zip(sizes, weights) if w > 0]
    return math.floor(min(ratios)) if stopping == "first_exhausted" else math.ceil(max(ratios))


def mixture_counts(length: int, weights: Sequence[Fraction]) -> np.ndarray:
    """Exact per-source counts summing to ``length``: ``length * w_k`` rounded by the
    largest-remainder method (ties to the lower source number).

    Example:
        >>> mixture_counts(10, mixture_weights([1, 1, 1], [1, 1, 1])).tolist()
        [4, 3, 3]
    """
    return np.array(largest_remainder([length * w for w in weights], length), dtype=np.int64)


def largest_remainder(shares: Sequence[Fraction], total: int) -> list[int]:
    """``shares`` rounded to integers summing to ``total``: each gets its floor, and the
    largest fractional parts one more (ties to the lower position).

    Example:
        >>> largest_remainder([Fraction(5, 2), Fraction(5, 2), Fraction(1, 2)], 5)
        [3, 2, 0]
    """
    counts = [math.floor(s) for s in shares]
    short = total - sum(counts)
    # Largest fractional part first; sorted() is stable, so ties keep their order.
    by_remainder = sorted(range(len(shares)), key=lambda k: shares[k] - counts[k], reverse=True)
    for k in by_remainder[:short]:
        counts[k] += 1
    return counts


class MixOrder:
    """Position -> (source, draw) of one epoch: the merge of the sources' evenly spaced
    draw times, computed for a batch of positions at once (see the module docstring).

    Args:
        counts: ``c_k``, the draws of each source in the epoch.

    Example:
        >>> order = MixOrder([3, 1])  # times 1/6, 3/6, 5/6 and 1/2 (a tie: 0 first)
        >>> source, draw = order(np.arange(4))
        >>> source.tolist(), draw.tolist()
        ([0, 0, 1, 0], [0, 1, 0, 2])
    """

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.length = int(self.counts.sum())
        self._exact = self.length >= _INT64_LIMIT
        # Search window per source around the proportional estimate: a prefix holds
        # each source's share to within 1/2 + w_k (K - 2) / 2 < K / 2 draws, so the draw
        # at a position is within K // 2 + 2 of the estimate (a wrong window would leave
        # a position with no match, which is checked, never a wrong one).
        self._slack = len(self.counts) // 2 + 2
        self._steps = max(1, (2 * self._slack + 2).bit_length())
        dtype = object if self._exact else np.int64
        self._c = self.counts.astype(dtype)[None, :]  # (1, K), or (1, 1, M) broadcast
        self._ck = np.maximum(self.counts, 1).astype(dtype)[None, :, None]  # (1, K, 1)
        m = np.arange(len(self.counts))
        self._earlier = (m[None, :] < m[:, None])[None]  # [., k, m]: m before k on ties
        self._others = ((m[None, :] != m[:, None]) & (self.counts > 0)[None, :])[None]

    def _rank(self, j: np.ndarray) -> np.ndarray:
        """Number of draws before draw ``j[:, k]`` of source ``k`` in the merged order,
        for a (positions, sources) array ``j``."""
        c, ck = self._c, self._ck
        # Source m's times (2j'+1)/(2c_m) against ours (2j+1)/(2c_k): compare x / c_k.
        x = (2 * j + 1)[:, :, None] * c
        ties = (x // ck + 1) // 2  # m < k: ties go to m, count times <= ours
        strict = (-(-x // ck)) // 2  # m > k: count times < ours
        before = np.minimum(np.where(self._earlier, ties, strict), c) * self._others
        return j + before.sum(axis=2)

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, draw)`` int64 arrays for positions in ``[0, length)``."""
        i = np.asarray(positions, dtype=object if self._exact else np.int64)[:, None]
        # For every source at once, search the number of its draws among positions
        # [0, i]: the largest cnt with rank(cnt - 1) <= i (a few steps in a window
        # around the proportional estimate).
        guess = (i + 1) * self._c[0] // max(self.length, 1)
        lo = np.clip(guess - self._slack, 0, self._c[0])
        hi = np.clip(guess + self._slack + 1, 0, self._c[0])
        for _ in range(self._steps):
            mid = (lo + hi + 1) // 2
            ok = (mid == 0) | (self._rank(np.maximum(mid - 1, 0)) <= i)
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid - 1)
        hit = (lo > 0) & (self._rank(np.maximum(lo - 1, 0)) == i)
        if not hit.any(axis=1).all():  # pragma: no cover - guarded invariant
            raise RuntimeError(f"mixture order found no draw for positions {positions}")
        source = hit.argmax(axis=1)
        draw = np.asarray(lo[np.arange(len(source)), source] - 1, dtype=np.int64)
        return source.astype(np.int64), draw


class _Passes:
    """Draw number ``g`` of source ``k`` -> record index: pass ``p = g // n_k`` of every
    source is member ``k`` of one keyed family of permutations for that pass, so a
    batch's draws from all sources in the same pass are permuted in one vectorised call.
    Keeps a few families per process."""

    def __init__(self, sizes: Sequence[int], seed: int) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.seed = seed
        self.family = functools.lru_cache(_PERMS_KEPT)(self._family)

    def _family(self, p: int) -> KeyedPermutations:
        return KeyedPermutations(self.sizes, self.seed, epoch=p, tag=b"mix")

    def __call__(self, source: np.ndarray, g: np.ndarray) -> np.ndarray:
        if not len(g):  # (a read of no indices)
            return np.zeros(0, dtype=np.int64)
        n = self.sizes[source]
        # (g may be Python integers, at a big epoch: no divmod for those)
        passes, within = g // n, (g % n).astype(np.int64, copy=False)
        if passes.min() == passes.max():  # the common case: one pass
            return self.family(int(passes[0]))(source, within)
        # An upsampled source's draws fall in many of its passes: all at once, a key
        # hash per pass (a family each cost ~1 ms: 185 ms for a batch of 256 passes).
        return self.family(0).at_epochs(passes, source, within)

    def __reduce__(self) -> tuple[Any, ...]:  # (made again: its cache holds no state)
        return _Passes, (self.sizes.tolist(), self.seed)


class Mix(View):
    """A weighted mixture of ``children`` (see :func:`mix`): ``len(counts)`` sources,
    source ``k`` giving ``counts[k]`` records per epoch.

    Its one child is the :class:`~torchgrain.compose.concat.Concat` of the sources (which
    reads a batch with one call per source, checks their schemas and adds
    ``source_field``); position ``i`` of epoch ``e`` resolves to a record of it by
    arithmetic alone. The epoch is the one :meth:`set_epoch` sets (a torchgrain sampler
    calls it), kept in a cell shared with DataLoader workers, persistent ones included.
    ``block_offsets`` is one block (a mixture's positions are not where its sources store
    records together), so :class:`~torchgrain.BlockShuffleSampler` shuffles it whole.
    A source with a mixture under it is read, for its draws in pass ``p``, as at epoch
    ``p`` (see the module docstring).
    """

    def __init__(
        self,
        children: Sequence[Any],
        weights: Sequence[Any] | None = None,
        *,
        names: Sequence[str] | None = None,
        seed: int = 0,
        length: int | None = None,
        stopping: str = "first_exhausted",
        temperature: float | None = None,
        source_field: str | None = None,
    ) -> None:
        sources = Concat(children, names=names, source_field=source_field)
        super().__init__([sources])
        self.sources = sources
        self.seed = operator.index(seed)
        sizes = [len(c) for c in sources.children]
        self.weights = mixture_weights(sizes, weights, temperature)
        for k, (n, w) in enumerate(zip(sizes, self.weights)):
            if n == 0 and w > 0:
                raise ValueError(
                    f"cannot mix {sources.describe_child(k)}: it has no records "
                    "(give it weight 0 or leave it out)"
                )
        if length is None:
            length = mixture_length(sizes, self.weights, stopping)
        elif isinstance(length, bool) or operator.index(length) < 0:
            raise ValueError(f"length must be an integer >= 0, got {length!r}")
        elif stopping not in _STOPPING:
            raise ValueError(f"stopping must be one of {_STOPPING}, got {stopping!r}")
        if length > _MAX_LENGTH:  # past int64 (and what a sampler orders)
            raise ValueError(
                f"a mixture of {length} records per epoch is more than 2**62 (weights "
                f"{[float(w) for w in self.weights]}): give length=, or closer weights"
            )
        self.stopping = stopping
        self.counts = mixture_counts(operator.index(length), self.weights)
        self._order = MixOrder(self.counts)
        self._passes = _Passes(sizes, self.seed)
        self._epoch = EpochCell(0)
        # The sources read as at the epoch of their pass: those with a mixture under them.
        self._by_pass = np.array(
            [changes_with_epoch(c, transforms=False) is not None for c in sources.children]
        )

    def __len__(self) -> int:
        return self._order.length

    @property
    def epoch(self) -> int:
        return self._epoch.get()

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch whose order positions resolve in (reaches DataLoader workers),
        and pass it on to the sources."""
        self._epoch.set(operator.index(epoch))
        super().set_epoch(epoch)

    def draws(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, record)`` of each position in the current epoch: which source it
        reads and that source's record index.

        Example:
            >>> m = Mix([[{"x": 0}] * 4, [{"x": 1}] * 2], [0.5, 0.5])
            >>> m.draws(range(len(m)))[0].tolist()
            [0, 1, 0, 1]
        """
        return self._resolve(check_indices(indices, len(self)))

    def _resolve(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        source, number = self._numbers(indices)
        return source, self._passes(source, number)

    def _numbers(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, draw number over the whole run)`` of each position."""
        source, draw = self._order(indices)
        epoch = _READ_EPOCH.get()  # a pass of a mixture above this one, else its own
        if epoch is None:
            epoch = self._epoch.get()
        # The draw's number over the whole run: this epoch's draws follow the previous
        # epochs' (each had counts[k] of them); in Python integers where int64 would wrap.
        counts = self.counts[source]
        if (abs(epoch) + 1) * self._order.length >= 1 << 63:
            counts = counts.astype(object)
        return source, epoch * counts + draw

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        return read_pairs(*self._readers(check_indices(indices, len(self))))

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        return read_column_pairs(*self._readers(check_indices(indices, len(self))))

    def _readers(self, indices: np.ndarray) -> tuple[list[Any], np.ndarray, np.ndarray]:
        """``(readers, reader, index)``: reader 0 is the sources as they are, reader
        ``1 + q`` the sources as at epoch ``passes[q]``, for the draws in that pass of a
        source with a mixture under it."""
        source, number = self._numbers(indices)
        local = self.sources.offsets[source] + self._passes(source, number)
        if not self._by_pass.any():  # (no mixture under it: one reader)
            return [self.sources], np.zeros(len(indices), dtype=np.int64), local
        by_pass = self._by_pass[source]
        passes, reader = np.unique(
            number[by_pass] // self._passes.sizes[source[by_pass]], return_inverse=True
        )
        which = np.zeros(len(indices), dtype=np.int64)
        which[by_pass] = 1 + reader.reshape(-1)
        readers = [self.sources, *(_AtEpoch(self.sources, int(p)) for p in passes.tolist())]
        return readers, which, local

    def _place(
        self,
        target: Any,
        indices: np.ndarray,
        rows: np.ndarray,
        found: list[tuple[np.ndarray, np.ndarray]],
    ) -> None:
        # A pass plan reads through the readers a read does (the by-pass sources' rows
        # at their pass's epoch), so read-ahead is told the records the reads read.
        readers, which, local = self._readers(check_indices(indices, len(self)))
        for k, reader in enumerate(readers):
            mine = which == k
            if mine.any():
                reader._place(target, local[mine], rows[mine], found)

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        source, record = self._resolve(indices)
        return np.zeros(len(indices), dtype=np.int64), self.sources.offsets[source] + record

    def identity(self) -> Any:
        # (the weights decide nothing beyond the counts: weights that round to the same
        # counts mix the same records in the same order)
        return (self.seed, self.counts.tolist())

    def __repr__(self) -> str:
        inner = ", ".join(repr(c) for c in self.sources.children)
        return f"Mix([{inner}], counts={self.counts.tolist()}, seed={self.seed})"


class _AtEpoch(Source):
    """``source`` read (and planned, for read-ahead) as at ``epoch``: every mixture under
    it resolves its positions in that epoch (its own epoch, the one ``set_epoch`` set, is
    left as it is)."""

    def __init__(self, source: Concat, epoch: int) -> None:
        self.source, self.epoch = source, epoch

    def __len__(self) -> int:
        return len(self.source)

    @property
    def keys(self) -> list[str]:
        return self.source.keys

    @property
    def schema(self) -> dict[str, str]:
        return self.source.schema

    def _at_epoch(self, call: Callable[..., Any], *args: Any) -> Any:
        token = _READ_EPOCH.set(self.epoch)
        try:
            return call(*args)
        finally:
            _READ_EPOCH.reset(token)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        return self._at_epoch(self.source.__getitems__, indices)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        return self._at_epoch(self.source.read_columns, indices)

    def _place(
        self,
        target: Any,
        indices: np.ndarray,
        rows: np.ndarray,
        found: list[tuple[np.ndarray, np.ndarray]],
    ) -> None:
        self._at_epoch(self.source._place, target, indices, rows, found)


def mix(
    datasets: Sequence[Any] | Mapping[str, Any],
    weights: Sequence[float] | Mapping[str, float] | None = None,
    *,
    seed: int = 0,
    length: int | None = None,
    stopping: str = "first_exhausted",
    temperature: float | None = None,
    source_field: str | None = None,
) -> Dataset:
    """A weighted mixture of ``datasets`` as one map-style :class:`~torchgrain.Dataset`.

    Each epoch has ``L`` positions; source ``k`` fills exactly ``c_k`` of them:
    ``L * w_k`` rounded by the largest remainder (each gets the floor, the largest
    fractional parts one more, ties to the earlier dataset), in exact arithmetic. A
    source's draws are spread evenly through the epoch (every prefix of the epoch holds
    each source's share to within ``1/2 + w_k (K - 2) / 2`` records for K sources: under
    one record for two sources), and are its records without replacement, in a keyed
    order: a fresh order each pass, a new pass as soon as a source runs out (an
    upsampled source), every record once per pass, each source's passes advancing
    across epochs on their own. Nothing of size ``L`` is stored anywhere; the mixture is
    a function of ``(seed, epoch, position)``, so any sampler drives it
    (:class:`~torchgrain.GlobalShuffleSampler` for a shuffled epoch, whose windows then
    hold the weights as closely as a uniform shuffle does), whatever the workers and
    ranks, and the sampler's state is the whole state for mid-epoch and elastic resume.
    The sampler's ``set_epoch`` sets the mixture's epoch.

    Args:
        datasets: a list of datasets (any :class:`~torchgrain.Source`,
            :class:`~torchgrain.Dataset`, or what a Dataset accepts), or a dict
            ``name -> dataset``. Keys and schemas must agree, as for
            :func:`~torchgrain.concat`.
        weights: one weight per dataset (any non-negative numbers, normalised; a dict
            by name when ``datasets`` is a dict, naming every dataset: weight 0 leaves
            one out). None: by ``temperature``, else proportional to the datasets' sizes.
        seed: the mixture's seed (64-bit).
        length: records per epoch; None: by ``stopping``.
        stopping: ``"first_exhausted"`` (the longest epoch in which no dataset gives more
            than one pass: ``floor(min n_k / w_k)``) or ``"all_exhausted"`` (the shortest
            in which every dataset gives at least one: ``ceil(max n_k / w_k)``).
        temperature: with no ``weights``, ``w_k`` proportional to ``n_k ** (1 / T)``
            (``T > 1`` flattens the sizes toward uniform).
        source_field: a key added to every record: its dataset's position (or name), as
            in :func:`~torchgrain.concat`.

    Example:
        >>> import torchgrain as tg
        >>> web = [{"text": f"web{i}"} for i in range(6)]
        >>> books = [{"text": f"book{i}"} for i in range(2)]
        >>> ds = tg.mix({"web": web, "books": books}, {"web": 0.5, "books": 0.5},
        ...             stopping="all_exhausted", source_field="source")
        >>> len(ds), [r["source"] for r in ds.__getitems__(range(4))]
        (12, ['web', 'books', 'web', 'books'])
        >>> sorted(r["text"] for r in ds.__getitems__(range(0, 12, 2)))  # web: one pass
        ['web0', 'web1', 'web2', 'web3', 'web4', 'web5']
        >>> ds.source.counts.tolist()
        [6, 6]
    """
    names, children = named_datasets(datasets, "mix")
    if isinstance(weights, Mapping):
        if names is None:
            raise TypeError("weights by name need datasets by name (a dict)")
        unknown = sorted(set(map(str, weights)) - set(names))
        if unknown:
            raise ValueError(f"weights name datasets that are not mixed: {unknown}")
        by_name = {str(k): w for k, w in weights.items()}  # names are str(key)
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ValueError(f"datasets {missing} have no weight (give each one; 0 leaves it out)")
        weights = [by_name[n] for n in names]
    return Dataset(
        Mix(
            children,
            None if weights is None else list(weights),
            names=names,
            seed=seed,
            length=length,
            stopping=stopping,
            temperature=temperature,
            source_field=source_field,
        )
    )
