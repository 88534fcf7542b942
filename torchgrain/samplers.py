"""Samplers: O(1)-memory global shuffles that resume exactly, and how to write one.

The public face of :mod:`torchgrain.sampling`. :class:`GlobalShuffleSampler` and
:class:`BlockShuffleSampler` are drop-in replacements for torch's
``DistributedSampler``; :class:`~torchgrain.ResumableLoader` and
:func:`~torchgrain.bind` bind one to its DataLoader (:class:`LoaderBinding`). A new
sampler subclasses :class:`ResumableSampler` with an *order* (a keyed permutation such
as :class:`KeyedPermutation`, or :data:`OrderFn` of its own) and a *split strategy*
(:class:`InterleavedSplit`, :class:`ContiguousSplit`, or a :class:`Split` given each
rank's :class:`Shares`), using only the names here; see "Writing a sampler" in the
documentation.

Example:
    >>> import torchgrain as tg
    >>> s = tg.samplers.GlobalShuffleSampler(8, num_replicas=2, rank=1, seed=3)
    >>> s.set_epoch(1)
    >>> len(s), len(set(s)) == 4
    (4, True)
    >>> import numpy as np
    >>> order = tg.samplers.KeyedPermutation(5, seed=3)(np.arange(5))
    >>> sorted(order.tolist())
    [0, 1, 2, 3, 4]
"""

# Exactly the public names of torchgrain.sampling (its __all__), one list to keep.
from torchgrain.sampling import *  # noqa: F403
from torchgrain.sampling import __all__ as __all__
