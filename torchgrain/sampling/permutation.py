"""Keyed pseudo-random permutations of ``[0, n)`` in O(1) memory (Feistel + cycle-walking).

The order behind :class:`~torchgrain.GlobalShuffleSampler` and the stripes of
:class:`~torchgrain.BlockShuffleSampler`: a bijection evaluated pointwise, vectorised
over numpy slices, for any ``n`` up to 2**62.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any

import numpy as np

__all__ = ["KeyedPermutation", "KeyedPermutations", "to_u64"]

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


def _rounds_for(bits: int) -> int:
    """Half-updates needed for a domain of ``bits`` bits.

    Four rounds make a Feistel network pseudo-random for wide halves
    (Luby-Rackoff); tiny halves mix slowly, so small domains get more rounds. The
    counts were chosen by chi-square tests of single positions and of pairs of
    positions over 40,000 keys (tests/test_sampling.py keeps a version of them);
    small domains are cheap, so the extra rounds cost nothing measurable.
    """
    return next((rounds for top, rounds in ((3, 18), (5, 12), (9, 8)) if bits <= top), 6)


def to_u64(value: int, what: str) -> int:
    """Reduce a Python int in [-2**63, 2**64) to its 64-bit two's-complement pattern
    (``ValueError`` naming ``what`` outside it): how a seed or an epoch is hashed.

    Example:
        >>> to_u64(-1, "seed") == 2**64 - 1, to_u64(7, "epoch")
        (True, 7)
    """
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
        h.update(to_u64(seed, "seed").to_bytes(8, "little"))
        h.update(to_u64(epoch, "epoch").to_bytes(8, "little"))
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

    def _apply(self, x: Any, inverse: bool, check: bool = True) -> np.ndarray:
        x = np.asarray(x)
        # check=False on 1-D int64: non-negative int64 reinterpreted as uint64, no copy,
        # no range pass.
        fast = not check and x.dtype == np.int64 and x.ndim == 1
        if not fast and x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise IndexError(f"values must be in [0, {self.n}) for a permutation of size {self.n}")
        if self.n <= 1:
            return x if fast else x.astype(np.int64)
        flat = x.view(_U64) if fast else x.reshape(-1).astype(_U64)
        out = _permute(flat, _U64(self.n), self._keys, self._a, self._c, inverse)
        return out.view(np.int64).reshape(x.shape)

    def __call__(self, x: Any, *, check: bool = True) -> np.ndarray:
        """The images of ``x`` (array-like of ints in ``[0, n)``), as int64.

        ``check=False`` is for positions a sampler computed itself: a 1-D int64 array
        whose values are known to lie in ``[0, n)`` is permuted without the range check
        (values outside give wrong results, not an error).
        """
        return self._apply(x, inverse=False, check=check)

    def inverse(self, y: Any) -> np.ndarray:
        """The preimages of ``y``: ``p.inverse(p(x)) == x``."""
        return self._apply(y, inverse=True)


class KeyedPermutations:
    """A family of keyed permutations, member ``m`` a permutation of ``[0, sizes[m])``,
    evaluated together in one vectorised pass.

    What :class:`~torchgrain.BlockShuffleSampler` shuffles the rows of its stripes with:
    one member per stripe, millions of positions across thousands of members in one
    call. Memory is O(members). The members' round keys come from one hash of
    ``(seed, epoch, tag)`` spread over the members, and all members run the same number
    of rounds (that of the smallest member with two or more values: small domains need
    the most), so the network runs across members of any sizes at once.

    Args:
        sizes: the members' domain sizes (a 1-D integer array).
        seed, epoch, tag: as for :class:`KeyedPermutation`.

    Example:
        >>> import numpy as np
        >>> p = KeyedPermutations(np.array([3, 5]), seed=1, epoch=0)
        >>> member = np.array([0, 0, 0, 1, 1, 1, 1, 1])
        >>> x = np.array([0, 1, 2, 0, 1, 2, 3, 4])
        >>> y = p(member, x)
        >>> sorted(y[:3].tolist()), sorted(y[3:].tolist())
        ([0, 1, 2], [0, 1, 2, 3, 4])
    """

    def __init__(self, sizes: Any, seed: int = 0, epoch: int = 0, tag: bytes = b"windows") -> None:
        sizes = np.asarray(sizes)
        if sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer):
            raise ValueError("sizes must be a 1-D integer array")
        if sizes.size and int(sizes.min()) < 0:
            raise ValueError("sizes must be >= 0")
        self.sizes = sizes.astype(np.int64)
        self.seed, self.tag = seed, tag
        self._n = self.sizes.astype(_U64)
        self._a, self._c = _split_bits(self._n)
        bits = self._a + self._c
        many = self.sizes > 1
        self._rounds = _rounds_for(int(bits[many].min()) if many.any() else 64)
        self._keys = self._member_keys(
            _derive_keys(seed, epoch, tag, self._rounds)[None, :],
            np.arange(len(self.sizes), dtype=np.int64),
        )

    @staticmethod
    def _member_keys(base: np.ndarray, member: np.ndarray) -> np.ndarray:
        """Round keys ``(rounds, len(member))`` of each ``member``, from its epoch's base
        keys (a row of ``base`` each, or one row for all)."""
        g = member.astype(_U64) * _U64(_GOLDEN)
        return np.stack([_mix_array(g + base[:, r]) for r in range(base.shape[1])])

    def at_epochs(self, epoch: np.ndarray, member: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The images of ``x[i]`` under member ``member[i]`` of this family at epoch
        ``epoch[i]`` (``KeyedPermutations(sizes, seed, epoch[i], tag)``), for many epochs
        in one vectorised pass: one key hash per distinct epoch.

        Example:
            >>> import numpy as np
            >>> p = KeyedPermutations(np.array([3, 5]), seed=1)
            >>> m, x, e = np.array([0, 1, 1]), np.array([2, 4, 4]), np.array([0, 0, 7])
            >>> got = p.at_epochs(e, m, x)
            >>> got[:2].tolist() == p(m[:2], x[:2]).tolist()
            True
            >>> int(got[2]) == int(KeyedPermutations(np.array([3, 5]), seed=1, epoch=7)(m[2:], x[2:])[0])
            True
        """
        epochs, which = np.unique(epoch, return_inverse=True)  # (int64, or Python ints)
        base = np.stack([_derive_keys(self.seed, int(e), self.tag, self._rounds) for e in epochs])
        keys = self._member_keys(base[which], member)
        out = _permute(x.astype(_U64), self._n[member], keys, self._a[member], self._c[member])
        return out.astype(np.int64)

    def __call__(self, member: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The images of ``x[i]`` under member ``member[i]``, as int64.

        ``member`` and ``x`` are int64 arrays of one shape with ``0 <= x[i] <
        sizes[member[i]]``; like ``check=False`` of :class:`KeyedPermutation`, values out
        of range give wrong results, not an error.
        """
        local = x.astype(_U64)
        out = _permute(
            local, self._n[member], self._keys[:, member], self._a[member], self._c[member]
        )
        return out.astype(np.int64)
