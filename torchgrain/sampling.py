"""Samplers that shuffle datasets of any size in O(1) index memory and resume exactly.

Two drop-in replacements for :class:`torch.utils.data.distributed.DistributedSampler`
(same arguments, same ``set_epoch``, same per-rank length and padding rules):

* :class:`GlobalShuffleSampler` draws a uniformly scrambled order of the whole
  dataset from a keyed bijection over ``[0, N)`` (a Feistel network with
  cycle-walking), evaluated in vectorised numpy chunks. Nothing of size ``N`` is
  ever materialised: a billion-record epoch costs a few hundred bytes of state.
* :class:`BlockShuffleSampler` shuffles the order of storage blocks (Parquet row
  groups, ArrayRecord chunks) and then rows within a sliding window of a few consecutive
  blocks, so each DataLoader worker decodes each block about once per epoch while
  batches still mix rows from several blocks.

Both are deterministic in ``(seed, epoch, num_replicas, rank)``, expose a vectorised
``indices(start, stop)``, and have ``state_dict``/``load_state_dict`` for exact
mid-epoch resume, also onto a different number of ranks ("elastic" resume).

Example:
    >>> from torchgrain.sampling import GlobalShuffleSampler
    >>> s = GlobalShuffleSampler(10, num_replicas=2, rank=0, seed=7)
    >>> len(s)
    5
    >>> sorted(list(s) + list(GlobalShuffleSampler(10, num_replicas=2, rank=1, seed=7)))
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

__all__ = ["BlockShuffleSampler", "GlobalShuffleSampler", "KeyedPermutation"]

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
# Multipliers of the splitmix64 finaliser (odd, with good avalanche); the Feistel
# round function is a multiply / xor-shift / multiply hash of (half XOR round key).
_C1 = _U64(0xBF58476D1CE4E5B9)
_C2 = _U64(0x94D049BB133111EB)
_S32 = _U64(32)
_GOLDEN = 0x9E3779B97F4A7C15
# Feistel work happens in slices of this many indices: a few uint64 temporaries of
# 128 KiB stay in L2, which measured ~2x faster than 64k-element slices.
_SLICE = 16384
# Python iteration converts this many indices to ints at a time.
_ITER_CHUNK = 65536


def _rounds_for(bits: int) -> int:
    """Half-updates needed for a domain of ``bits`` bits.

    Four rounds make a Feistel network pseudo-random for wide halves
    (Luby-Rackoff); tiny halves mix slowly, so small domains get more rounds. The
    counts were chosen by chi-square tests of single positions and of pairs of
    positions over 40,000 keys (tests/test_sampling.py keeps a version of them);
    small domains are cheap, so the extra rounds cost nothing measurable.
    """
    if bits <= 3:
        return 18
    if bits <= 5:
        return 12
    if bits <= 9:
        return 8
    return 6


def _to_u64(value: int, what: str) -> int:
    """Reduce a Python int in [-2**63, 2**64) to its 64-bit two's-complement pattern."""
    value = operator.index(value)
    if not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"{what} must fit in 64 bits, got {value}")
    return value & _MASK64


def _mix_array(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array, in place; returns ``x``."""
    t = np.empty_like(x)
    np.right_shift(x, _U64(30), out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _C1, out=x)
    np.right_shift(x, _U64(27), out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _C2, out=x)
    np.right_shift(x, _U64(31), out=t)
    np.bitwise_xor(x, t, out=x)
    return x


def _derive_keys(seed: int, epoch: int, tag: bytes, rounds: int) -> np.ndarray:
    """``rounds`` 64-bit round keys from a cryptographic hash of (seed, epoch, tag).

    Hashing (rather than adding the epoch to the seed, as torch does) makes
    ``(seed, epoch + 1)`` and ``(seed + 1, epoch)`` unrelated orders.
    """
    out = []
    for block in range(-(-rounds // 8)):
        h = hashlib.blake2b(digest_size=64, person=b"torchgrain.perm")
        h.update(_to_u64(seed, "seed").to_bytes(8, "little"))
        h.update(_to_u64(epoch, "epoch").to_bytes(8, "little"))
        h.update(block.to_bytes(4, "little"))
        h.update(tag)
        out.append(np.frombuffer(h.digest(), dtype="<u8"))
    return np.concatenate(out)[:rounds].astype(_U64)


def _split_bits(n: np.ndarray | int) -> tuple[Any, Any]:
    """Half widths (a, c) of the smallest power-of-two domain covering ``[0, n)``.

    The domain has ``b = bit_length(n - 1)`` bits (odd ``b`` gives an unbalanced
    network with halves of ``b // 2`` and ``b - b // 2`` bits), so it is less than
    ``2n`` and cycle-walking needs under 2 evaluations per index on average. An even
    ``b`` would need up to 4 at ``n = 4**k + 1``.
    """
    if isinstance(n, np.ndarray):
        b = np.zeros(n.shape, dtype=_U64)
        m = np.maximum(n.astype(np.int64) - 1, 0)
        nz = m > 0
        # bit_length via frexp: exact for m < 2**53 (window sizes are far smaller).
        b[nz] = np.frexp(m[nz].astype(np.float64))[1].astype(_U64)
        a = b >> _U64(1)
        return a, b - a
    b = max(int(n) - 1, 0).bit_length()
    return _U64(b // 2), _U64(b - b // 2)


def _feistel_once(x: np.ndarray, keys: np.ndarray, a: Any, c: Any, inverse: bool) -> np.ndarray:
    """One pass of an alternating Feistel network over ``[0, 2**(a + c))``.

    ``x = A << c | B``; even half-updates do ``A = A + F(B ^ k) mod 2**a``, odd ones
    ``B = B + F(A ^ k) mod 2**c``, where ``F`` keeps the top bits of a
    multiply / xor-shift / multiply hash. An update leaves its input half alone, so
    subtracting instead of adding, in reverse order, inverts the pass. Addition
    (rather than XOR) also reaches odd permutations, which small domains need to
    become uniform. ``keys`` is (rounds,) or (rounds, len(x)); ``a``/``c`` are
    scalars or arrays of the same length as ``x``.
    """
    one = _U64(1)
    ma = np.left_shift(one, a) - one
    mc = np.left_shift(one, c) - one
    sa = _U64(64) - a  # shifting a uint64 by 64 gives 0 in numpy: zero-width halves work
    sc = _U64(64) - c
    hi = np.right_shift(x, c)
    lo = np.bitwise_and(x, mc)
    t = np.empty_like(x)
    u = np.empty_like(x)
    update = np.subtract if inverse else np.add
    order = range(len(keys) - 1, -1, -1) if inverse else range(len(keys))
    for i in order:
        src, dst, shift, mask = (lo, hi, sa, ma) if i % 2 == 0 else (hi, lo, sc, mc)
        np.bitwise_xor(src, keys[i], out=t)
        np.multiply(t, _C1, out=t)
        np.right_shift(t, _S32, out=u)
        np.bitwise_xor(t, u, out=t)
        np.multiply(t, _C2, out=t)
        np.right_shift(t, shift, out=t)
        update(dst, t, out=dst)
        np.bitwise_and(dst, mask, out=dst)
    np.left_shift(hi, c, out=hi)
    np.bitwise_or(hi, lo, out=hi)
    return hi


def _permute(
    x: np.ndarray, n: Any, keys: np.ndarray, a: Any, c: Any, inverse: bool = False
) -> np.ndarray:
    """Apply the network until every value lands in ``[0, n)``: a bijection of it.

    Cycle-walking (re-applying the network to values that fall in ``[n, 2**b)``)
    restricts a permutation of the power-of-two domain to one of ``[0, n)``. The
    first pass runs in cache-sized slices; the few values that need more passes
    are gathered across the whole input so the extra passes are not dominated by
    per-call overhead. Per-element ``n``/``keys``/``a``/``c`` (arrays) are supported.
    """

    def take(v: Any, idx: Any) -> Any:
        return v[..., idx] if isinstance(v, np.ndarray) else v

    out = np.empty(x.shape, dtype=_U64)
    for s in range(0, x.size, _SLICE):
        sl = slice(s, s + _SLICE)
        out[sl] = _feistel_once(
            x[sl], keys[:, sl] if keys.ndim == 2 else keys, take(a, sl), take(c, sl), inverse
        )
    bad = np.flatnonzero(out >= n)
    while bad.size:
        for s in range(0, bad.size, _SLICE):
            idx = bad[s : s + _SLICE]
            k = keys[:, idx] if keys.ndim == 2 else keys
            out[idx] = _feistel_once(out[idx], k, take(a, idx), take(c, idx), inverse)
        bad = bad[out[bad] >= take(n, bad)]
    return out


class KeyedPermutation:
    """A keyed pseudo-random permutation of ``[0, n)`` evaluated pointwise.

    Memory is O(1) in ``n`` (a few 64-bit round keys). ``n`` may be anything from 0
    to 2**62; every ``n`` gives a true bijection (an alternating Feistel network on
    the smallest power-of-two domain covering ``n``, restricted by cycle-walking).

    Args:
        n: size of the domain.
        seed: any integer that fits in 64 bits (negative values are taken mod 2**64).
        epoch: mixed into the key by hashing, so every epoch is an unrelated order.
        tag: domain separation, so two uses of the same (seed, epoch) differ.

    Example:
        >>> import numpy as np
        >>> p = KeyedPermutation(10, seed=3, epoch=0)
        >>> y = p(np.arange(10))
        >>> sorted(y.tolist()) == list(range(10))
        True
        >>> bool((p.inverse(y) == np.arange(10)).all())
        True
    """

    def __init__(self, n: int, seed: int = 0, epoch: int = 0, tag: bytes = b"global") -> None:
        n = operator.index(n)
        if not 0 <= n <= (1 << 62):
            raise ValueError(f"permutation size must be in [0, 2**62], got {n}")
        self.n = n
        self.seed = seed
        self.epoch = epoch
        self._a, self._c = _split_bits(n)
        self._keys = _derive_keys(seed, epoch, tag, _rounds_for(int(self._a + self._c)))

    def _apply(self, x: Any, inverse: bool) -> np.ndarray:
        x = np.asarray(x)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise IndexError(f"values must be in [0, {self.n}) for a permutation of size {self.n}")
        if self.n <= 1:
            return x.astype(np.int64)
        flat = x.reshape(-1).astype(_U64)
        out = _permute(flat, _U64(self.n), self._keys, self._a, self._c, inverse)
        return out.view(np.int64).reshape(x.shape)

    def __call__(self, x: Any) -> np.ndarray:
        """The images of ``x`` (array-like of ints in ``[0, n)``), as int64."""
        return self._apply(x, inverse=False)

    def inverse(self, y: Any) -> np.ndarray:
        """The preimages of ``y``: ``p.inverse(p(x)) == x``."""
        return self._apply(y, inverse=True)


def _check_world(num_replicas: int, rank: int) -> tuple[int, int]:
    num_replicas, rank = operator.index(num_replicas), operator.index(rank)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _dist_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank, decided now: explicit values, else the initialised process
    group, else torchrun's ``WORLD_SIZE``/``RANK`` environment, else (1, 0).

    A process started by a launcher (``WORLD_SIZE > 1``) without ``RANK`` and without
    a process group cannot know its part of the data: that raises instead of silently
    reading everything, as :class:`~torch.utils.data.DistributedSampler` does.
    """
    import torch.distributed as dist

    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        else:
            env_world = _env_int("WORLD_SIZE")
            if env_world is not None and env_world > 1 and num_replicas is None:
                env_rank = _env_int("RANK")
                if env_rank is None and rank is None:
                    raise RuntimeError(
                        f"WORLD_SIZE={env_world} is set but RANK is not, and no torch.distributed "
                        "process group is initialised, so this process cannot tell which part "
                        "of the data is its own. Call torch.distributed.init_process_group() "
                        "before iterating the sampler, or pass num_replicas= and rank="
                    )
                num_replicas = env_world
                rank = env_rank if rank is None else rank
            num_replicas = 1 if num_replicas is None else num_replicas
            rank = 0 if rank is None else rank
    return _check_world(num_replicas, rank)


# DataLoader wrappers that split batches between processes themselves. A sampler they
# drive must hand out the one global order: splitting it by rank as well would give each
# process 1/W of its own part, and the epoch would cover 1/W of the data.
# (Accelerate's prepared DataLoaders: BatchSamplerShard deals batches round-robin to the
# processes; DataLoaderDispatcher reads every batch on rank 0 and sends out slices.)
_EXTERNAL_SHARDERS = frozenset(
    {
        ("accelerate.data_loader", "BatchSamplerShard"),
        ("accelerate.data_loader", "DataLoaderDispatcher"),
    }
)
_SHARDER_SEARCH_DEPTH = 40


def _external_sharder() -> str | None:
    """Name of the batch-sharding DataLoader wrapper iterating the caller, if any.

    Looked up in the call stack when a sampler starts an iteration or is asked for its
    length (``len(loader)`` reaches ``len(sampler)`` through the wrapper): the wrapper's
    ``__iter__``/``__len__`` is a few frames up. Costs a few microseconds, once per
    pass; nothing is looked up while the ``accelerate`` package is not imported.
    """
    if "accelerate" not in sys.modules:
        return None
    frame = sys._getframe(2)
    for _ in range(_SHARDER_SEARCH_DEPTH):
        if frame is None:
            return None
        if "self" in frame.f_code.co_varnames:
            obj = frame.f_locals.get("self")
            for cls in type(obj).__mro__:
                if (cls.__module__, cls.__name__) in _EXTERNAL_SHARDERS:
                    return f"{cls.__module__}.{cls.__name__}"
        frame = frame.f_back
    return None


def _identity(q: np.ndarray) -> np.ndarray:
    return q


def _complement(intervals: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The parts of ``[0, length)`` not covered by ``intervals`` of virtual positions.

    Positions past the end are padding and stand for ``v mod length`` (as in
    DistributedSampler, whose padding repeats the order's first indices), so a
    padding draw covers the position it repeats.
    """
    covered: list[tuple[int, int]] = []
    for s, e in intervals:
        s = max(0, s)
        if e <= s:
            continue
        if s < length:
            covered.append((s, min(e, length)))
        s = max(s, length)
        if e <= s or length <= 0:
            continue
        if e - s >= length:
            return []
        a, b = s % length, s % length + (e - s)
        covered.extend([(a, b)] if b <= length else [(a, length), (0, b - length)])
    out: list[tuple[int, int]] = []
    pos = 0
    for s, e in sorted(covered):
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < length:
        out.append((pos, length))
    return out


class _ResumableSampler(DistributedSampler):
    """Shared machinery: rank split, padding, iteration, state and (elastic) resume.

    A subclass of :class:`torch.utils.data.distributed.DistributedSampler` (without
    its constructor), so frameworks that check for one (PyTorch Lightning keeps a
    ``DistributedSampler`` in place instead of wrapping it) see what it is.

    World size and rank are decided when the sampler is used (an iteration starts,
    ``len``, ``indices``, ``state_dict``), not when it is built: from explicit
    ``num_replicas``/``rank``, else the process group, else torchrun's environment.
    Driven by a DataLoader wrapper that splits batches between processes itself
    (Accelerate's prepared loaders), the sampler hands out the one global order and
    lets the wrapper split it; it remembers that from then on.

    Vocabulary. The *epoch stream* is the sampler's order of all ``N`` indices for
    the epoch (``stream(q)`` for ``q`` in ``[0, N)``). A *layout* is a list of
    ``[start, stop)`` intervals of stream positions whose concatenation (the
    *virtual stream*, length ``L``) is what the ranks split: ``[[0, N]]`` for a fresh
    epoch, the not-yet-consumed rest after an elastic resume. Rank ``r`` draws
    ``count(L, r)`` virtual positions (``ceil(L / W)`` padded, ``floor`` with
    drop_last, and ``L // W`` plus one for the first ``L % W`` ranks with
    ``pad=False``); virtual positions past ``L`` are padding and wrap around
    (``v mod L``), exactly like DistributedSampler's ``indices += indices[:padding]``.
    """

    _kind = "base"

    def __init__(
        self,
        n: int,
        dataset: Any,
        num_replicas: int | None,
        rank: int | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        pad: bool = True,
    ) -> None:
        self.dataset = dataset
        # Explicit values are checked now; missing ones are looked up at each use.
        if num_replicas is not None and rank is not None:
            _check_world(num_replicas, rank)
        elif num_replicas is not None:
            _check_world(num_replicas, 0)
        elif rank is not None and operator.index(rank) < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be >= 0")
        self._num_replicas_arg = None if num_replicas is None else operator.index(num_replicas)
        self._rank_arg = None if rank is None else operator.index(rank)
        self._external: str | None = None
        self.shuffle = bool(shuffle)
        _to_u64(seed, "seed")
        self.seed = operator.index(seed)
        self.drop_last = bool(drop_last)
        self.pad = bool(pad)
        self.epoch = 0
        self._n = n
        # Layout and start position that the next iteration uses after a resume.
        self._pending: tuple[np.ndarray, int] | None = None
        # The latest iteration: its world, layout, first position, and a probe for how
        # far it got (list iterator of the current chunk and that chunk's first position).
        self._it_world: tuple[int, int] | None = None
        self._it_layout = self._fresh_layout()
        self._it_start = 0
        self._it_chunk_start = 0
        self._it_chunk_len = 0
        self._it_chunk: Any = None

    # -- world ----------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` this sampler splits by, decided now."""
        if self._external is not None:
            return 1, 0
        return _dist_world(self._num_replicas_arg, self._rank_arg)

    def _note_driver(self) -> None:
        """Switch to the global order when a batch-sharding wrapper drives this sampler."""
        if self._external is not None:
            return
        sharder = _external_sharder()
        if sharder is None:
            return
        if self._num_replicas_arg is not None and self._num_replicas_arg > 1:
            raise ValueError(
                f"{type(self).__name__}(num_replicas={self._num_replicas_arg}) splits the data "
                f"between processes itself, but it is driven by {sharder}, which splits batches "
                "between processes too: each process would see 1/num_replicas of its part. "
                "Build the sampler without num_replicas and rank."
            )
        self._external = sharder
        self._it_world = None

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """World size the sampler splits by (1 when an outer wrapper splits batches)."""
        return self._world()[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas_arg = operator.index(value)

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's rank in the split (0 when an outer wrapper splits batches)."""
        return self._world()[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank_arg = operator.index(value)

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        """Indices this rank draws in a full epoch (``len(self)``)."""
        return self._count(self._n, self._world())

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """Draws of all ranks together in a full epoch, padding included."""
        w, _ = self._world()
        if self.pad or self.drop_last:
            return self._count(self._n, (w, 0)) * w
        return self._n

    # -- geometry -----------------------------------------------------------------
    def _fresh_layout(self) -> np.ndarray:
        return np.array([[0, self._n]], dtype=np.int64)

    def _count(self, length: int, world: tuple[int, int]) -> int:
        """Draws of rank ``world[1]`` from a virtual stream of ``length``."""
        return _rank_count(length, world[0], world[1], self.drop_last, self.pad)

    def _virtual(self, j: int, count: int, length: int, world: tuple[int, int]) -> tuple[int, int]:
        """Virtual position of this rank's position ``j`` and the step to ``j + 1``.

        Positions past the virtual stream's end (padding) are wrapped by the caller.
        """
        raise NotImplementedError

    def _rank_positions(
        self, start: int, stop: int, count: int, length: int, world: tuple[int, int]
    ) -> np.ndarray | None:
        """Virtual positions of this rank's positions ``[start, stop)``, when they are
        not the arithmetic progression that :meth:`_virtual` describes (else None)."""
        return None

    def _consumed_virtual(
        self, length: int, replicas: int, pos: int, state: dict[str, Any]
    ) -> list[tuple[int, int]]:
        """Virtual intervals consumed when every one of ``replicas`` ranks drew ``pos``
        (or all it had) in the order that ``state`` (the saved state) describes."""
        raise NotImplementedError

    def _same_order(self, state: dict[str, Any]) -> bool:
        """Whether this sampler's per-rank order equals the one ``state`` was saved in,
        given the same world size and drop_last."""
        return bool(state.get("pad", True)) == self.pad

    def _stream_fn(self) -> Callable[[np.ndarray], np.ndarray]:
        """The current epoch's stream: maps positions ``q`` (int64 in ``[0, N)``) to indices.

        The function is bound to the current seed, epoch and shuffle, so an iterator
        that holds it keeps its order if the sampler changes epoch meanwhile.
        """
        raise NotImplementedError

    def _layout_positions(self, layout: np.ndarray, v: np.ndarray) -> np.ndarray:
        if len(layout) == 1:
            return v + layout[0, 0]
        lengths = layout[:, 1] - layout[:, 0]
        ends = np.cumsum(lengths)
        seg = np.searchsorted(ends, v, side="right")
        return layout[seg, 0] + (v - (ends[seg] - lengths[seg]))

    def _indices_in(
        self,
        layout: np.ndarray,
        start: int,
        stop: int,
        world: tuple[int, int],
        stream: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        length = _layout_length(layout)
        count = self._count(length, world)
        start, stop = max(0, start), min(stop, count)
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        stream = stream or self._stream_fn()
        v = self._rank_positions(start, stop, count, length, world)
        if v is not None:  # an order that is not an arithmetic progression
            if int(v.max()) >= length:  # padding: wrap around the virtual stream
                v %= length
            return stream(self._layout_positions(layout, v))
        first, step = self._virtual(start, count, length, world)
        last = first + step * (stop - start - 1)
        if last < length and len(layout) == 1:  # common case: one arange, no padding
            base = first + int(layout[0, 0])
            return stream(np.arange(base, base + step * (stop - start), step, dtype=np.int64))
        v = np.arange(first, last + 1, step, dtype=np.int64)
        if last >= length:  # padding: wrap around the virtual stream
            v %= length
        return stream(self._layout_positions(layout, v))

    def _current(self) -> tuple[np.ndarray, tuple[int, int]]:
        """Layout and world of the pass that :meth:`indices` and :meth:`state_dict`
        describe: a loaded resume, else the latest iteration, else a fresh epoch."""
        if self._pending is not None:
            return self._pending[0], self._world()
        return self._it_layout, self._it_world or self._world()

    # -- public API -----------------------------------------------------------------
    def __len__(self) -> int:
        """Indices per rank in a full epoch (as DistributedSampler's ``num_samples``)."""
        self._note_driver()
        return self.num_samples

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """This rank's dataset indices at its positions ``[start, stop)``, as int64.

        The range is clipped to ``[0, len(self)]`` like a slice.

        Positions count this rank's draws in the current epoch, ``0 .. len(self)``
        (after a resume onto a different world size, the resumed pass's own
        positions). ``list(sampler) == sampler.indices(0, len(sampler)).tolist()``
        on a fresh epoch.
        """
        layout, world = self._current()
        stop = self._count(_layout_length(layout), world) if stop is None else stop
        return self._indices_in(layout, operator.index(start), operator.index(stop), world)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; also calls ``dataset.set_epoch(epoch)`` if present.

        Setting the epoch already in effect keeps a loaded resume position, so the
        usual ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop works
        unchanged after ``load_state_dict``. A different epoch starts from its
        beginning.
        """
        epoch = operator.index(epoch)
        _to_u64(epoch, "epoch")
        if epoch != self.epoch:
            self.epoch = epoch
            self._pending = None
            self._on_epoch_change()
            self._it_world = None
            self._it_layout = self._fresh_layout()
            self._it_start = self._it_chunk_start = self._it_chunk_len = 0
            self._it_chunk = None
        self._propagate_epoch()

    def _on_epoch_change(self) -> None:
        pass

    def _propagate_epoch(self) -> None:
        hook = getattr(self.dataset, "set_epoch", None)
        if callable(hook):
            hook(self.epoch)

    def __iter__(self) -> Iterator[int]:
        # chain() hands out the ints of each chunk's list iterator at C speed; the
        # Python generator below only runs once per chunk.
        return itertools.chain.from_iterable(self._chunks())

    def _chunks(self) -> Iterator[Iterator[int]]:
        # A generator body runs at the first next(), so iterators created and dropped
        # without being advanced (torchdata's StatefulDataLoader makes one before
        # loading state) do not consume a pending resume position.
        self._note_driver()
        world = self._world()
        if self._pending is not None:
            layout, start = self._pending
            self._pending = None
        else:
            layout, start = self._fresh_layout(), 0
        self._it_world, self._it_layout, self._it_start = world, layout, start
        self._it_chunk_start, self._it_chunk_len, self._it_chunk = start, 0, None
        count = self._count(_layout_length(layout), world)
        # Bind the epoch's order now: a set_epoch or load_state_dict while this
        # iterator is alive must not change the order of its later chunks.
        stream = self._stream_fn()
        for s in range(start, count, _ITER_CHUNK):
            stop = min(s + _ITER_CHUNK, count)
            chunk = self._indices_in(layout, s, stop, world, stream).tolist()
            it = iter(chunk)
            # Keep the list iterator: its __length_hint__ says how far the consumer got.
            self._it_chunk_start, self._it_chunk_len, self._it_chunk = s, len(chunk), it
            yield it

    def _drawn(self) -> int:
        """Position reached by the latest iteration (draws made, incl. the resume offset)."""
        if self._it_chunk is None:
            return self._it_chunk_start + self._it_chunk_len
        return self._it_chunk_start + self._it_chunk_len - self._it_chunk.__length_hint__()

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The sampler's position, to continue exactly where it stopped.

        Args:
            consumed: how many of this rank's indices the training loop has used
                since the current pass over the loader began (``iter(loader)``).
                A DataLoader draws indices ahead of use (``prefetch_factor *
                num_workers`` batches), so the sampler's own count runs ahead;
                pass ``consumed=batches_done * batch_size`` to record what the loop
                has really used. Omit it when the sampler's own count is right:
                iterating the sampler directly, ``num_workers=0``, or torchdata's
                ``StatefulDataLoader`` (it snapshots ``state_dict()`` at the moment
                each batch's indices are drawn, so its saved state is exact).
                :class:`~torchgrain.ResumableLoader` passes it for you.
                Values past the end of the epoch mean "epoch finished".

        Returns a plain dict (ints and lists) safe for ``torch.save`` or JSON. All
        ranks run in lockstep, so rank 0's state describes the whole job: the
        samples consumed globally are every rank's first ``position`` draws of the
        layout (or all of its draws, for a rank that has fewer with ``pad=False``).

        Resume recipe with a plain DataLoader::

            # save, after `step` batches of this epoch's pass over `loader`
            ckpt = {"sampler": sampler.state_dict(consumed=step * batch_size), ...}
            # restore, in a new process (any world size)
            sampler.load_state_dict(ckpt["sampler"])
            for epoch in range(sampler.epoch, epochs):
                sampler.set_epoch(epoch)        # same epoch: keeps the position
                for batch in loader: ...        # continues with the next batch

        With ``num_workers > 0`` use ``step * batch_size`` counted by the loop, not
        ``state_dict()`` alone. With ``drop_last=True`` on the DataLoader the count
        is still ``step * batch_size``; a final partial batch may be counted in full
        (values past the end of the epoch mean "finished").

        Resume recipe with ``torchdata.stateful_dataloader.StatefulDataLoader``
        (it stores this sampler's state inside its own)::

            ckpt = {"loader": loader.state_dict(), "epoch": epoch, ...}
            # restore: same sampler arguments (any world size), then
            loader.load_state_dict(ckpt["loader"])
            for epoch in range(ckpt["epoch"], epochs):
                sampler.set_epoch(epoch)
                for batch in loader: ...

        Example:
            >>> s = GlobalShuffleSampler(100, num_replicas=1, rank=0, seed=1)
            >>> it = iter(s); head = [next(it) for _ in range(30)]
            >>> t = GlobalShuffleSampler(100, num_replicas=1, rank=0)
            >>> t.load_state_dict(s.state_dict())
            >>> head + list(t) == list(s)
            True
        """
        layout, world = self._current()
        if self._pending is not None:
            pos = self._pending[1]
            if consumed not in (None, 0):
                raise ValueError(
                    "consumed must be 0 or None before iteration of a loaded state starts"
                )
        else:
            drawn = self._drawn()
            if consumed is None:
                pos = drawn
            else:
                consumed = operator.index(consumed)
                if consumed < 0:
                    raise ValueError(f"consumed must be >= 0, got {consumed}")
                count = self._count(_layout_length(layout), world)
                pos = min(self._it_start + consumed, count)
                if pos > drawn:
                    raise ValueError(
                        f"consumed={consumed} exceeds the {drawn - self._it_start} indices this "
                        "sampler has produced in the current pass"
                    )
        state = {
            "sampler": self._kind,
            "version": 1,
            "seed": self.seed,
            "epoch": self.epoch,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
            "num_replicas": world[0],
            "dataset_len": self._n,
            "layout": [[int(s), int(e)] for s, e in layout],
            "position": int(pos),
        }
        state.update(self._extra_state())
        return state

    def _finished(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` (saved by this sampler) is at the end of its pass."""
        layout = np.asarray(state["layout"], dtype=np.int64).reshape(-1, 2)
        world = (operator.index(state["num_replicas"]), self._current()[1][1])
        return operator.index(state["position"]) >= self._count(_layout_length(layout), world)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) at the next iteration.

        The state fixes seed, epoch, shuffle and the position. With the same
        ``num_replicas``, ``drop_last`` and ``pad`` the continuation is exact: each
        rank yields what it would have yielded next without the interruption. With a
        different world size, the samples of the epoch not yet consumed globally
        are re-split over the new ranks, each exactly once (plus padding, or minus
        a tail shorter than ``num_replicas`` with drop_last). Also calls
        ``dataset.set_epoch(epoch)`` when the dataset has that method.
        """
        if state.get("sampler") != self._kind:
            raise ValueError(f"state is for {state.get('sampler')!r}, not {self._kind!r}")
        if state.get("version") != 1:
            raise ValueError(f"unsupported sampler state version {state.get('version')!r}")
        if state["dataset_len"] != self._n:
            raise ValueError(
                f"state was saved for a dataset of {state['dataset_len']} records; "
                f"this sampler's dataset has {self._n}"
            )
        self._check_extra_state(state)
        layout = np.asarray(state["layout"], dtype=np.int64).reshape(-1, 2)
        if (
            (layout[:, 0] < 0).any()
            or (layout[:, 1] > self._n).any()
            or (layout[:, 1] < layout[:, 0]).any()
        ):
            raise ValueError(f"invalid layout in sampler state: {state['layout']!r}")
        old_w = operator.index(state["num_replicas"])
        old_drop = bool(state["drop_last"])
        old_pad = bool(state.get("pad", True))
        pos = operator.index(state["position"])
        length = _layout_length(layout)
        old_count = _rank_count(length, old_w, 0, old_drop, old_pad)
        if not 0 <= pos <= old_count:
            raise ValueError(f"position {pos} outside [0, {old_count}] in sampler state")

        self.seed = state["seed"]
        self.shuffle = bool(state["shuffle"])
        epoch_changed = state["epoch"] != self.epoch
        self.epoch = state["epoch"]
        self._load_extra_state(state, epoch_changed)

        world = self._world()
        if old_w == world[0] and old_drop == self.drop_last and self._same_order(state):
            self._pending = (layout, pos)
        else:
            consumed = self._consumed_virtual(length, old_w, pos, state)
            # Padding draws were trained on too: they consume the positions they
            # repeat, so nothing is handed out twice.
            rest = _complement(consumed, length)
            self._pending = (self._compose(layout, rest), 0)
        self._it_world = None
        self._it_layout, self._it_start = self._pending
        self._it_chunk_start, self._it_chunk_len, self._it_chunk = self._pending[1], 0, None
        self._propagate_epoch()

    def _load_extra_state(self, state: dict[str, Any], epoch_changed: bool) -> None:
        if epoch_changed:
            self._on_epoch_change()

    @staticmethod
    def _compose(layout: np.ndarray, virtual: list[tuple[int, int]]) -> np.ndarray:
        """Stream intervals of the given virtual intervals of ``layout``."""
        out: list[tuple[int, int]] = []
        base = 0
        for s, e in layout.tolist():
            seg_len = e - s
            for vs, ve in virtual:
                lo, hi = max(vs, base), min(ve, base + seg_len)
                if lo < hi:
                    a, b = s + lo - base, s + hi - base
                    if out and out[-1][1] == a:
                        out[-1] = (out[-1][0], b)
                    else:
                        out.append((a, b))
            base += seg_len
        if not out:
            out.append((0, 0))
        return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def _layout_length(layout: np.ndarray) -> int:
    return int((layout[:, 1] - layout[:, 0]).sum())


def _rank_count(length: int, w: int, r: int, drop_last: bool, pad: bool) -> int:
    """Draws of rank ``r`` of ``w`` from a virtual stream of ``length``."""
    if drop_last:
        return length // w
    if pad:
        return -(-length // w)
    return length // w + (r < length % w)


def _run_start(length: int, w: int, r: int, drop_last: bool, pad: bool) -> int:
    """First virtual position of rank ``r``'s contiguous run (BlockShuffleSampler)."""
    if pad and not drop_last:
        return r * -(-length // w)
    return r * (length // w) + (0 if drop_last else min(r, length % w))


def _length_of(dataset_or_length: Any) -> int:
    if isinstance(dataset_or_length, (int, np.integer)):
        n = int(dataset_or_length)
    else:
        n = len(dataset_or_length)
    if n < 0:
        raise ValueError(f"dataset length must be >= 0, got {n}")
    return n


class GlobalShuffleSampler(_ResumableSampler):
    """Uniform global shuffle of any dataset size with O(1) index memory.

    A drop-in replacement for :class:`torch.utils.data.distributed.DistributedSampler`
    with the same arguments and the same per-rank split: the epoch's order is a
    sequence of all ``N`` indices, rank ``r`` takes its positions ``r, r + W, r + 2W,
    ...``; without drop_last the sequence is padded with its own first positions to
    ``ceil(N / W) * W`` (so which samples repeat changes every epoch); with drop_last
    it is cut to ``floor(N / W) * W``. ``shuffle=False`` gives exactly
    DistributedSampler's unshuffled order.

    Differences from DistributedSampler, all deliberate:

    * No permutation is materialised: index ``i`` of the order is computed on
      demand by a keyed Feistel network over ``[0, N)``, vectorised over numpy
      chunks (tens of millions of indices per second, constant memory, even at
      ``N = 10**9`` where ``torch.randperm`` needs 8 GB).
    * ``(seed, epoch)`` is hashed into the key: epoch 1 of seed ``s`` is unrelated
      to epoch 0 of seed ``s + 1``. Seeds may be any 64-bit integer.
    * World size and rank are decided at each use, not at construction: explicit
      ``num_replicas``/``rank``, else the process group, else torchrun's
      ``WORLD_SIZE``/``RANK`` environment (built before ``init_process_group``, it
      still splits by rank), else a single replica instead of raising. A launched
      process (``WORLD_SIZE > 1``) with neither ``RANK`` nor a process group raises.
    * Driven by a loader that splits batches between processes itself (HF
      Accelerate's prepared DataLoaders), it hands out the one global order.
    * ``pad=False`` gives every sample exactly once over the ranks (for evaluation).
    * :meth:`state_dict`/:meth:`load_state_dict` resume mid-epoch exactly, also
      onto a different world size, and :meth:`indices` returns a whole range of
      positions as a numpy array.
    * If ``dataset_or_length`` has a callable ``set_epoch``, :meth:`set_epoch` and
      :meth:`load_state_dict` call it, so per-epoch random transforms follow.
    * Arguments after the dataset are keyword-only.

    Memory: O(1) in N (round keys and one chunk of 65,536 indices being iterated).

    Args:
        dataset_or_length: a sized dataset, or its length as an int.
        num_replicas: world size; default from ``torch.distributed`` if initialised,
            else ``WORLD_SIZE``, else 1 (looked up at each use).
        rank: this process's rank in ``[0, num_replicas)``; default likewise
            (``RANK``), else 0.
        shuffle: scramble the order (else ``0 .. N-1`` dealt round-robin).
        seed: shared by all ranks; any integer in ``[-2**63, 2**64)``.
        drop_last: drop the tail instead of padding so ranks get equal counts.
        pad: with ``drop_last=False``, repeat the order's first samples so every rank
            gets ``ceil(N / num_replicas)`` (DistributedSampler's rule, needed for
            training in lockstep); ``False`` gives each sample exactly once, the ranks'
            counts differing by at most one (evaluation).

    Example:
        >>> import torch
        >>> from torchgrain.sampling import GlobalShuffleSampler
        >>> data = list(range(1000))
        >>> sampler = GlobalShuffleSampler(data, num_replicas=4, rank=1, seed=0)
        >>> loader = torch.utils.data.DataLoader(data, batch_size=50, sampler=sampler)
        >>> sampler.set_epoch(0)
        >>> sum(len(b) for b in loader)
        250
        >>> sampler.indices(0, 5).shape
        (5,)
    """

    _kind = "GlobalShuffleSampler"

    def __init__(
        self,
        dataset_or_length: Any,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        n = _length_of(dataset_or_length)
        if n > (1 << 62):
            raise ValueError(f"dataset length {n} exceeds 2**62")
        dataset = None if isinstance(dataset_or_length, (int, np.integer)) else dataset_or_length
        super().__init__(n, dataset, num_replicas, rank, shuffle, seed, drop_last, pad)
        self._perm: KeyedPermutation | None = None

    def _permutation(self) -> KeyedPermutation:
        p = self._perm
        if p is None or (p.seed, p.epoch) != (self.seed, self.epoch):
            p = KeyedPermutation(self._n, self.seed, self.epoch)
            self._perm = p
        return p

    def _virtual(self, j: int, count: int, length: int, world: tuple[int, int]) -> tuple[int, int]:
        return j * world[0] + world[1], world[0]

    def _consumed_virtual(
        self, length: int, replicas: int, pos: int, state: dict[str, Any]
    ) -> list[tuple[int, int]]:
        # Interleaved split: after every rank drew `pos`, the prefix of pos * W
        # virtual positions is consumed.
        return [(0, min(pos * replicas, length))]

    def _stream_fn(self) -> Callable[[np.ndarray], np.ndarray]:
        if not self.shuffle or self._n <= 1:
            return _identity
        p = self._permutation()
        n = _U64(self._n)

        def stream(q: np.ndarray) -> np.ndarray:
            # q is a fresh non-negative int64 array: reinterpret it, no copy or checks.
            return _permute(q.view(_U64), n, p._keys, p._a, p._c).view(np.int64)

        return stream


class BlockShuffleSampler(_ResumableSampler):
    """Block-local shuffle: shuffled blocks, rows shuffled within a sliding window of blocks.

    Columnar and chunked formats decode whole blocks (a Parquet row group, an
    ArrayRecord chunk). A global shuffle touches a different block for nearly every
    row; this sampler keeps reads block-local:

    1. the order of the dataset's blocks is shuffled (a fresh order every epoch);
    2. a window of ``window`` consecutive blocks of that order slides along it: each
       block is cut into ``window`` pieces, and the epoch is a sequence of *stripes*,
       stripe ``s`` holding a piece of each of the blocks ``s - window + 1 .. s``
       (one block enters and one leaves from one stripe to the next; the first
       stripes wrap around to the last blocks, so every stripe mixes ``window``
       blocks). The rows of each stripe are shuffled among themselves (each stripe
       with its own keyed permutation);
    3. the resulting sequence of all ``N`` rows is cut into ``num_replicas``
       contiguous runs of equal length: rank ``r`` takes positions
       ``[r * n, (r + 1) * n)``, where ``n = len(sampler)`` (padding/drop_last as
       in DistributedSampler, the padding wrapping to the sequence's start).

    Any position of the order is computed directly from O(blocks) tables, so
    ``indices(start, stop)`` and exact resume cost nothing extra. A reader whose
    cache holds ``window + 1`` blocks (one more for each further stripe a batch
    spans) decodes each block about once per epoch (the ``window - 1`` blocks that
    wrap around are read at the start and at the end); a cache of exactly
    ``window`` blocks thrashes under LRU eviction. Contiguous runs (instead of
    DistributedSampler's round-robin) keep each rank on about ``1 / num_replicas``
    of the blocks.

    DataLoader workers: the DataLoader hands batch ``b`` to worker
    ``b % num_workers``, so by default every worker reads from every stripe and
    decodes every block of its rank. Pass the DataLoader's ``batch_size`` and
    ``num_workers`` and the rank's run is instead cut into ``num_workers``
    contiguous parts, batch ``b`` coming from part ``b % num_workers``: each worker
    reads its own part and decodes about ``1 / num_workers`` of the blocks.
    Consecutive batches then come from different parts of the epoch; the indices of
    the epoch are the same set. If the loader's ``num_workers`` or ``batch_size``
    differ from the sampler's, the order is still a correct permutation, only the
    decode saving is lost.

    Shuffle quality trade-off: consecutive samples come from only ``window`` blocks
    (about ``window`` distinct blocks in any 256 consecutive samples vs about 256
    for :class:`GlobalShuffleSampler`), and the rows of one block all appear within
    ``window`` consecutive stripes (about ``window`` blocks' worth of samples).
    Rows that sit together in storage (e.g. sorted by class or time) therefore stay
    correlated within a batch; grow ``window`` to mix more blocks per batch, at the
    cost of more decoded blocks held in cache. ``benchmarks/sampler.py`` measures
    both samplers side by side. ``shuffle=False`` yields ``0 .. N-1`` split into the
    same contiguous runs.

    Memory is O(number of blocks), not O(N); resume and elastic resume work as for
    :class:`GlobalShuffleSampler` (the consumed part of each rank's run is known, the
    rest is re-split contiguously over the new ranks).

    Args:
        dataset: a dataset with ``block_offsets()`` (int64 prefix offsets starting at
            0 and ending at ``len(dataset)``), or ``None``/a length when
            ``block_offsets`` is given.
        window: blocks in the sliding shuffle window (default 8).
        num_replicas, rank, shuffle, seed, drop_last, pad: as for GlobalShuffleSampler
            (with ``pad=False`` the first ``L % num_replicas`` ranks' runs are one longer).
        block_offsets: explicit prefix offsets (overrides ``dataset.block_offsets()``).
        batch_size: the DataLoader's ``batch_size``; needed with ``num_workers > 1``.
        num_workers: the DataLoader's ``num_workers``; above 1, each worker's batches
            come from its own part of the rank's run (see above). Saved in
            :meth:`state_dict`; resuming with different values is an exact resume too
            (the rest of the epoch is re-laid out, as for a new world size).

    Example:
        >>> import numpy as np
        >>> from torchgrain.sampling import BlockShuffleSampler
        >>> offsets = np.arange(0, 101, 10)  # 10 blocks of 10 rows
        >>> s = BlockShuffleSampler(None, block_offsets=offsets, window=2,
        ...                         num_replicas=1, rank=0, seed=0)
        >>> order = s.indices()
        >>> sorted(order.tolist()) == list(range(100))
        True
        >>> len({int(i) // 10 for i in order[:10]})  # a stripe: 5 rows from each of 2 blocks
        2
        >>> len({int(i) // 10 for i in order[:50]})  # 5 stripes: the window slid 4 blocks on
        6
        >>> dealt = BlockShuffleSampler(None, block_offsets=offsets, window=2, seed=0,
        ...                             num_replicas=1, rank=0, batch_size=5, num_workers=2)
        >>> sorted(dealt.indices().tolist()) == list(range(100))
        True
        >>> worker0 = np.concatenate([dealt.indices(b * 5, b * 5 + 5) for b in range(0, 20, 2)])
        >>> bool(np.isin(worker0, order[:50]).all())  # worker 0 reads the first half
        True
    """

    _kind = "BlockShuffleSampler"

    def __init__(
        self,
        dataset: Any,
        *,
        window: int = 8,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        block_offsets: Sequence[int] | np.ndarray | None = None,
        batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        window = operator.index(window)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        num_workers = operator.index(num_workers)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if batch_size is not None:
            batch_size = operator.index(batch_size)
            if batch_size < 1:
                raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        elif num_workers > 1:
            raise ValueError(
                "num_workers > 1 needs batch_size (the DataLoader's) to deal whole batches"
            )
        self.batch_size = batch_size
        self.num_workers = num_workers
        if block_offsets is None:
            getter = getattr(dataset, "block_offsets", None)
            if not callable(getter):
                raise TypeError(
                    "BlockShuffleSampler needs a dataset with block_offsets() or block_offsets="
                )
            block_offsets = getter()
        offsets = np.asarray(block_offsets)
        if offsets.ndim != 1 or offsets.size < 1 or not np.issubdtype(offsets.dtype, np.integer):
            raise ValueError("block_offsets must be a 1-D integer array of prefix offsets")
        offsets = offsets.astype(np.int64)
        if offsets[0] != 0:
            raise ValueError(f"block_offsets must start at 0, got {offsets[0]}")
        bad = np.flatnonzero(np.diff(offsets) < 0)
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"block_offsets must be non-decreasing: block {b} ends at {offsets[b + 1]} "
                f"but starts at {offsets[b]}"
            )
        n = int(offsets[-1])
        if dataset is not None and not isinstance(dataset, (int, np.integer)):
            dn = len(dataset)
        elif dataset is not None:
            dn = int(dataset)
        else:
            dn = n
        if dn != n:
            raise ValueError(f"block_offsets end at {n} but the dataset has {dn} records")
        ds = None if dataset is None or isinstance(dataset, (int, np.integer)) else dataset
        self.window = window
        self._offsets = offsets
        self._digest = hashlib.blake2b(offsets.tobytes(), digest_size=16).hexdigest()
        self._tables: tuple[Any, ...] | None = None
        super().__init__(n, ds, num_replicas, rank, shuffle, seed, drop_last, pad)

    @property
    def num_blocks(self) -> int:
        """Number of blocks (including empty ones)."""
        return len(self._offsets) - 1

    def _on_epoch_change(self) -> None:
        self._tables = None

    def _extra_state(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "window_layout": "sliding",
            "num_blocks": self.num_blocks,
            "blocks_digest": self._digest,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
        }

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("window_layout") != "sliding":
            raise ValueError(
                "state was saved by a BlockShuffleSampler with fixed windows (an earlier "
                "torchgrain); its order cannot be continued exactly by this version"
            )
        if state.get("blocks_digest") != self._digest:
            raise ValueError(
                f"state was saved for different block boundaries ({state.get('num_blocks')} "
                f"blocks); this dataset has {self.num_blocks}"
            )

    def _load_extra_state(self, state: dict[str, Any], epoch_changed: bool) -> None:
        self.window = operator.index(state["window"])
        self._tables = None

    def _build_tables(self) -> tuple[Any, ...]:
        """Per-epoch block order, stripe offsets and stripe permutation keys: O(blocks).

        The sliding window is laid out as *stripes*. With ``w = min(window, blocks)``,
        each block (in the epoch's shuffled block order ``0 .. B-1``) is cut into ``w``
        pieces of near-equal size; piece ``k`` of block ``j`` goes to stripe
        ``(j + k) mod B``. Stripe ``s`` therefore holds one piece of each of the ``w``
        blocks ``s, s-1, ..., s-w+1`` (one block enters and one leaves per stripe),
        and its rows are shuffled among themselves. The wrap-around keeps every
        stripe at ``w`` blocks, the first ones included.
        """
        key = (self.seed, self.epoch, self.shuffle, self.window)
        if self._tables is not None and self._tables[0] == key:
            return self._tables
        nb = self.num_blocks
        sizes = np.diff(self._offsets)
        if self.shuffle and nb > 1:
            order = KeyedPermutation(nb, self.seed, self.epoch, tag=b"blocks")(np.arange(nb))
        else:
            order = np.arange(nb, dtype=np.int64)
        w = max(1, min(self.window, nb))
        # Piece k of the j-th block has base[j] + (k < rem[j]) rows and starts at row
        # k * base[j] + min(k, rem[j]) of the block.
        base, rem = np.divmod(sizes[order], w)
        stripe_sizes = np.zeros(nb, dtype=np.int64)
        j = np.arange(nb, dtype=np.int64)
        for k in range(w):
            src = (j - k) % nb
            stripe_sizes += base[src] + (rem[src] > k)
        stripe_start = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(stripe_sizes, out=stripe_start[1:])
        stripe_u64 = stripe_sizes.astype(_U64)
        a, c = _split_bits(stripe_u64)
        # One round count for all stripes (the smallest one with rows to shuffle
        # decides): the network then runs vectorised across stripes of any size.
        bits = a + c
        bits = int(bits[stripe_sizes > 1].min()) if (stripe_sizes > 1).any() else 64
        base_keys = _derive_keys(self.seed, self.epoch, b"windows", _rounds_for(bits))
        g = np.arange(nb, dtype=_U64) * _U64(_GOLDEN)
        keys = np.stack([_mix_array(g + k) for k in base_keys])
        self._tables = (key, order, w, base, rem, stripe_start, stripe_u64, keys, a, c)
        return self._tables

    def _run_start(self, length: int, world: tuple[int, int]) -> int:
        return _run_start(length, world[0], world[1], self.drop_last, self.pad)

    def _virtual(self, j: int, count: int, length: int, world: tuple[int, int]) -> tuple[int, int]:
        return self._run_start(length, world) + j, 1

    def _rank_positions(
        self, start: int, stop: int, count: int, length: int, world: tuple[int, int]
    ) -> np.ndarray | None:
        config = _deal_config(self._extra_state())
        if config is None:
            return None
        j = np.arange(start, stop, dtype=np.int64)
        return self._run_start(length, world) + _deal(j, count, *config)

    def _same_order(self, state: dict[str, Any]) -> bool:
        return super()._same_order(state) and _deal_config(state) == _deal_config(
            self._extra_state()
        )

    def _consumed_virtual(
        self, length: int, replicas: int, pos: int, state: dict[str, Any]
    ) -> list[tuple[int, int]]:
        # Contiguous split: rank r's run starts at start(r) and has count(r) draws;
        # without dealing it consumed the run's first `pos` (or all of it), with
        # dealing a prefix of each worker's part of the run.
        drop, pad = bool(state["drop_last"]), bool(state.get("pad", True))
        config = _deal_config(state)
        out: list[tuple[int, int]] = []
        for r in range(replicas):
            start = _run_start(length, replicas, r, drop, pad)
            count = _rank_count(length, replicas, r, drop, pad)
            drawn = min(pos, count)
            if config is None:
                out.append((start, start + drawn))
            else:
                out.extend(
                    (start + a, start + b) for a, b in _dealt_prefixes(count, drawn, *config)
                )
        return out

    def _stream_fn(self) -> Callable[[np.ndarray], np.ndarray]:
        if not self.shuffle:
            return _identity
        _, order, w, base, rem, stripe_start, stripe_u64, keys, a, c = self._build_tables()
        offsets = self._offsets
        nb = self.num_blocks
        ks = np.arange(w, dtype=np.int64)
        # Per chunk, a (stripes in the chunk) x w table of piece ends: bound it.
        chunk = max(4096, (_ITER_CHUNK * 8) // w)

        def stream(q: np.ndarray) -> np.ndarray:
            out = np.empty(q.shape, dtype=np.int64)
            for lo in range(0, q.size, chunk):
                qs = q[lo : lo + chunk]
                s = np.searchsorted(stripe_start, qs, side="right") - 1
                first = stripe_start[s]
                local = (qs - first).astype(_U64)
                # Stripes of 1 or 2 rows go through the network too (a or c is 0).
                slot = first + _permute(local, stripe_u64[s], keys[:, s], a[s], c[s]).astype(
                    np.int64
                )
                # The piece holding each slot: stripe s is piece 0 of block s, piece 1
                # of block s-1, ... in that order; one searchsorted over the absolute
                # piece ends of the stripes this chunk touches.
                us, inv = _distinct(s)
                src = (us[:, None] - ks) % nb
                size = base[src] + (rem[src] > ks)
                ends = stripe_start[us][:, None] + np.cumsum(size, axis=1)
                flat = np.searchsorted(ends.ravel(), slot, side="right")
                k = flat - inv.reshape(-1) * w
                blk = src.ravel()[flat]
                before = ends.ravel()[flat] - size.ravel()[flat]
                row = k * base[blk] + np.minimum(k, rem[blk]) + (slot - before)
                out[lo : lo + chunk] = offsets[order[blk]] + row
            return out

        return stream


def _distinct(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(s, return_inverse=True)``, without a sort when ``s`` is non-decreasing
    (the usual case: a run of consecutive stream positions)."""
    if s.size and bool((s[1:] >= s[:-1]).all()):
        new = np.empty(s.size, dtype=bool)
        new[0] = True
        np.not_equal(s[1:], s[:-1], out=new[1:])
        return s[new], np.cumsum(new) - 1
    return np.unique(s, return_inverse=True)


def _deal_config(state: dict[str, Any]) -> tuple[int, int] | None:
    """``(batch_size, num_workers)`` when the saved order deals batches to workers."""
    b, w = state.get("batch_size"), state.get("num_workers") or 0
    return (int(b), int(w)) if b is not None and w > 1 else None


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
