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

Writing a sampler. Both are built on the public base :class:`ResumableSampler`, and a
new sampler is one small module that uses only the names below: an *order*
(:meth:`ResumableSampler.epoch_order`: for a seed and an epoch, a function from positions
to dataset indices, a permutation evaluated on demand in O(1) memory, e.g. with
:class:`KeyedPermutation` or :class:`KeyedPermutations`) plus a *split strategy*
(:meth:`ResumableSampler.split`: :class:`InterleavedSplit`, :class:`ContiguousSplit` or
a :class:`Split` of its own, given each rank's :class:`Shares`). The base handles
``set_epoch``, resume state, binding (:class:`LoaderBinding`), padding and world
discovery; :mod:`torchgrain.sampling.base` has a complete example.

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
