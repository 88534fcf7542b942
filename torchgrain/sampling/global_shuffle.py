"""GlobalShuffleSampler: a uniform global shuffle of any dataset size in O(1) memory."""

from __future__ import annotations

import functools
from typing import Any

from torchgrain.sampling.base import OrderFn, ResumableSampler
from torchgrain.sampling.permutation import KeyedPermutation

__all__ = ["GlobalShuffleSampler"]


class GlobalShuffleSampler(ResumableSampler):
    """Uniform global shuffle of any dataset size with O(1) index memory.

    A drop-in replacement for :class:`torch.utils.data.distributed.DistributedSampler`
    (same arguments, per-rank split and padding; ``shuffle=False`` gives its order).
    Index ``i`` of the order is computed on demand by a keyed Feistel network over
    ``[0, N)`` (tens of millions of indices a second, constant memory: ``torch.randperm``
    needs 8 GB at ``N = 10**9``). World size and rank are looked up at each use;
    :meth:`state_dict` resumes mid-epoch exactly, also onto another world size; a dataset's
    ``set_epoch`` is called. Arguments after the dataset are keyword-only. Design notes:
    docs/design-notes.md#global-shuffle.

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

    state_kind = "GlobalShuffleSampler"

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
        super().__init__(
            dataset_or_length,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad=pad,
        )
        if self.dataset_len > (1 << 62):
            raise ValueError(f"dataset length {self.dataset_len} exceeds 2**62")
        self._perm: KeyedPermutation | None = None

    def epoch_order(self, seed: int, epoch: int) -> OrderFn:
        """A keyed Feistel permutation of ``[0, N)`` for ``(seed, epoch)``."""
        p = self._perm
        if p is None or (p.seed, p.epoch) != (seed, epoch):
            p = KeyedPermutation(self.dataset_len, seed, epoch)
            self._perm = p
        # Positions are fresh in-range int64 arrays: no range pass, no copy.
        return functools.partial(p, check=False)
