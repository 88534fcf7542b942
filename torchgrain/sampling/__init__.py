"""Samplers that shuffle datasets of any size in O(1) index memory and resume exactly.

Two drop-in replacements for :class:`torch.utils.data.distributed.DistributedSampler`
(same arguments, same ``set_epoch``, same per-rank length and padding rules).

:class:`GlobalShuffleSampler` is a keyed bijection over ``[0, N)`` (a few hundred bytes of
state for a billion records); :class:`BlockShuffleSampler` shuffles storage blocks and rows
within a sliding window of blocks. A new sampler builds on :class:`ResumableSampler`
(:mod:`torchgrain.sampling.base` has an example).

Both are deterministic in ``(seed, epoch, num_replicas, rank)``, expose a vectorised
``indices(start, stop)``, and have ``state_dict``/``load_state_dict`` for exact
mid-epoch resume, also onto a different number of ranks ("elastic" resume).

Design notes: docs/design-notes.md#sampling.

Example:
    >>> from torchgrain.sampling import GlobalShuffleSampler
    >>> s = GlobalShuffleSampler(10, num_replicas=2, rank=0, seed=7)
    >>> len(s)
    5
    >>> sorted(list(s) + list(GlobalShuffleSampler(10, num_replicas=2, rank=1, seed=7)))
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
"""

from torchgrain.sampling.base import OrderFn, ResumableSampler, identity_order
from torchgrain.sampling.binding import LoaderBinding
from torchgrain.sampling.block_shuffle import BlockShuffleSampler
from torchgrain.sampling.global_shuffle import GlobalShuffleSampler
from torchgrain.sampling.permutation import KeyedPermutation, KeyedPermutations
from torchgrain.sampling.split import ContiguousSplit, InterleavedSplit, Shares, Split
from torchgrain.sampling.world import resolve_world

__all__ = [
    "BlockShuffleSampler",
    "ContiguousSplit",
    "GlobalShuffleSampler",
    "InterleavedSplit",
    "KeyedPermutation",
    "KeyedPermutations",
    "LoaderBinding",
    "OrderFn",
    "ResumableSampler",
    "Shares",
    "Split",
    "identity_order",
    "resolve_world",
]
