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

from torchgrain.sampling.base import LoaderBinding, ResumableSampler
from torchgrain.sampling.block_shuffle import BlockShuffleSampler
from torchgrain.sampling.global_shuffle import GlobalShuffleSampler
from torchgrain.sampling.permutation import KeyedPermutation

__all__ = [
    "BlockShuffleSampler",
    "GlobalShuffleSampler",
    "KeyedPermutation",
    "LoaderBinding",
    "ResumableSampler",
]
