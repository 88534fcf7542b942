"""BlockShuffleSampler: shuffled blocks, rows shuffled within a sliding window of blocks."""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchgrain.errors import check_ceiling
from torchgrain.protocols import HasBlockOffsets
from torchgrain.sampling.base import OrderFn, ResumableSampler
from torchgrain.sampling.permutation import KeyedPermutation, KeyedPermutations
from torchgrain.sampling.split import ContiguousSplit

# Per call of the order, positions are mapped this many at a time: each step builds a
# (stripes in the step) x window table of piece ends.
_ORDER_STEP = 65536 * 8

__all__ = ["BlockShuffleSampler"]


class BlockShuffleSampler(ResumableSampler):
    """Block-local shuffle: shuffled blocks, rows shuffled within a sliding window of blocks.

    Columnar and chunked formats decode whole blocks (a Parquet row group, an ArrayRecord
    chunk), and a global shuffle touches another block for nearly every row. Here the
    blocks' order is shuffled each epoch, a window of ``window`` consecutive blocks slides
    along it (the rows of each *stripe* of ``window`` blocks shuffled among themselves), and
    each rank takes one contiguous run of the order. A reader caching ``window + 1`` blocks
    decodes each block about once per epoch; consecutive samples come from only ``window``
    blocks (256 for a global shuffle), so grow ``window`` to mix more. Memory is O(blocks);
    resume and elastic resume work as for :class:`GlobalShuffleSampler`. Design notes:
    docs/design-notes.md#block-shuffle.

    Args:
        dataset: a dataset with ``block_offsets()`` (int64 prefix offsets starting at
            0 and ending at ``len(dataset)``), or ``None``/a length when
            ``block_offsets`` is given.
        window: blocks in the sliding shuffle window (default 8).
        num_replicas, rank, shuffle, seed, drop_last, pad: as for GlobalShuffleSampler.
        block_offsets: explicit prefix offsets (overrides ``dataset.block_offsets()``).
        deal_to_workers: deal the rank's run to the workers of the DataLoader the sampler
            is bound to (:func:`torchgrain.bind`), each worker reading its own contiguous
            part and decoding about ``1 / num_workers`` of the blocks (default False).
        batch_size, num_workers: deal batches as for a DataLoader with these settings
            (a value left out comes from the bound loader); saved in :meth:`state_dict`.

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

    state_kind = "BlockShuffleSampler"

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
        num_workers: int | None = None,
        deal_to_workers: bool = False,
    ) -> None:
        window = check_ceiling("window", operator.index(window), 1)
        if num_workers is not None:
            num_workers = check_ceiling("num_workers", operator.index(num_workers), 0)
        if batch_size is not None:
            batch_size = check_ceiling("batch_size", operator.index(batch_size), 1)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.deal_to_workers = bool(deal_to_workers)
        if block_offsets is None:
            if not isinstance(dataset, HasBlockOffsets):
                raise TypeError(
                    "BlockShuffleSampler needs a dataset with block_offsets() or "
                    f"block_offsets={_why_no_blocks(dataset)}"
                )
            block_offsets = dataset.block_offsets()
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
        ds = None if dataset is None or isinstance(dataset, (int, np.integer)) else dataset
        dn = n if dataset is None else len(ds) if ds is not None else int(dataset)
        if dn != n:
            raise ValueError(f"block_offsets end at {n} but the dataset has {dn} records")
        self.window = window
        self._offsets = offsets
        self._digest = hashlib.blake2b(offsets.tobytes(), digest_size=16).hexdigest()
        self._tables: tuple[Any, ...] | None = None
        super().__init__(
            n if ds is None else ds,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad=pad,
        )

    @property
    def num_blocks(self) -> int:
        """Number of blocks (including empty ones)."""
        return len(self._offsets) - 1

    # -- the order ---------------------------------------------------------------------
    def order_state(self) -> dict[str, Any]:
        """The window and the block boundaries (by digest) fix the order too."""
        return {
            "window": self.window,
            "window_layout": "sliding",
            "num_blocks": self.num_blocks,
            "blocks_digest": self._digest,
        }

    def load_order_state(self, state: dict[str, Any]) -> None:
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
        window = state.get("window")
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"sampler state field 'window' must be an int >= 1, got {window!r}")
        self.window = int(window)

    def _build_tables(self, seed: int, epoch: int) -> tuple[Any, ...]:
        """Per-epoch block order, stripe offsets and stripe permutations: O(blocks).

        The sliding window is laid out as *stripes*. With ``w = min(window, blocks)``,
        each block (in the epoch's shuffled block order ``0 .. B-1``) is cut into ``w``
        pieces of near-equal size; piece ``k`` of block ``j`` goes to stripe
        ``(j + k) mod B``. Stripe ``s`` therefore holds one piece of each of the ``w``
        blocks ``s, s-1, ..., s-w+1`` (one block enters and one leaves per stripe),
        and its rows are shuffled among themselves. The wrap-around keeps every
        stripe at ``w`` blocks, the first ones included.
        """
        key = (seed, epoch, self.window)
        if self._tables is not None and self._tables[0] == key:
            return self._tables
        nb = self.num_blocks
        sizes = np.diff(self._offsets)
        order = KeyedPermutation(nb, seed, epoch, tag=b"blocks")(np.arange(nb))  # int64
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
        # One permutation per stripe, all evaluated in one vectorised pass.
        perms = KeyedPermutations(stripe_sizes, seed, epoch, tag=b"windows")
        self._tables = (key, order, w, base, rem, stripe_start, perms)
        return self._tables

    def epoch_order(self, seed: int, epoch: int) -> OrderFn:
        """Shuffled blocks, rows shuffled within stripes of ``window`` blocks."""
        _, order, w, base, rem, stripe_start, perms = self._build_tables(seed, epoch)
        offsets = self._offsets
        nb = self.num_blocks
        ks = np.arange(w, dtype=np.int64)
        # Per step, a (stripes in the step) x w table of piece ends: bound it.
        step = max(4096, _ORDER_STEP // w)

        def stream(q: np.ndarray) -> np.ndarray:
            out = np.empty(q.shape, dtype=np.int64)
            for lo in range(0, q.size, step):
                qs = q[lo : lo + step]
                s = np.searchsorted(stripe_start, qs, side="right") - 1
                first = stripe_start[s]
                # Stripes of 1 or 2 rows go through the network too (a or c is 0).
                slot = first + perms(s, qs - first)
                # The piece holding each slot: stripe s is piece 0 of block s, piece 1
                # of block s-1, ... in that order; one searchsorted over the absolute
                # piece ends of the stripes this step touches.
                us, inv = _distinct(s)
                src = (us[:, None] - ks) % nb
                size = base[src] + (rem[src] > ks)
                ends = stripe_start[us][:, None] + np.cumsum(size, axis=1)
                flat = np.searchsorted(ends.ravel(), slot, side="right")
                k = flat - inv.reshape(-1) * w
                blk = src.ravel()[flat]
                before = ends.ravel()[flat] - size.ravel()[flat]
                row = k * base[blk] + np.minimum(k, rem[blk]) + (slot - before)
                out[lo : lo + step] = offsets[order[blk]] + row
            return out

        return stream

    # -- the split ---------------------------------------------------------------------
    def split(self) -> ContiguousSplit:
        """Contiguous runs per rank, dealt to the loader's workers when asked to: by the
        ``batch_size`` and ``num_workers`` given, the rest from the DataLoader the sampler
        is bound to when asked to deal; never under a batch-sharding loader (its
        processes, not workers, take the batches)."""
        if self.sharded_by is not None:
            return ContiguousSplit()
        learn = self.deal_to_workers or self.num_workers is not None or self.batch_size is not None
        loader_batch_size, loader_workers = self.loader_shape()
        batch_size = loader_batch_size if self.batch_size is None and learn else self.batch_size
        num_workers = self.num_workers
        if num_workers is None:
            num_workers = (loader_workers or 0) if self.deal_to_workers else 0
        return ContiguousSplit(batch_size, num_workers)

    def uses_loader_shape(self) -> bool:
        if self.sharded_by is not None:
            return False
        if self.deal_to_workers:
            return self.batch_size is None or self.num_workers is None
        return self.num_workers is not None and self.batch_size is None


def _distinct(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(s, return_inverse=True)``, without a sort when ``s`` is non-decreasing
    (the usual case: a run of consecutive stream positions)."""
    if s.size and bool((s[1:] >= s[:-1]).all()):
        new = np.empty(s.size, dtype=bool)
        new[0] = True
        np.not_equal(s[1:], s[:-1], out=new[1:])
        return s[new], np.cumsum(new) - 1
    return np.unique(s, return_inverse=True)


def _why_no_blocks(dataset: Any) -> str:
    """Why a wrapper that does not offer ``block_offsets`` has none (its method raises
    ``TypeError`` saying so: which input, and what it is); empty for any other object."""
    method = getattr(dataset, "block_offsets", None)
    try:
        if callable(method):
            method()
    except TypeError as e:
        return f": {e}"
    return ""
