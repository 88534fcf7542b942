"""Whether a pass fits a sharded source's caches, and the shard sizes it needs.

:class:`CacheFitting` is a helper a :class:`~torchgrain.sources.base.ShardedSource` holds
(``src.cache_fit``): given the caches a pass goes through (the source's
:meth:`~torchgrain.sources.base.ShardedSource.cache_blocks`), :meth:`CacheFitting.check`
replays the start of a sampler's pass through each and warns once when it cannot fit;
:meth:`CacheFitting.nbytes` knows the shards' sizes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import CacheThrashWarning
from torchgrain.io import process, remote
from torchgrain.sources.block_cache import CacheBlocks, CacheFit, check_fit

__all__ = ["CacheFitting", "listed_sizes"]


class CacheFitting:
    """The cache-fit checks of the source ``kind`` over ``paths``, and its shards' sizes
    (``sizes``: shard -> bytes, those known; the rest are found on first use).

    Example:
        >>> fit = CacheFitting("MySource", ["a.rec", "b.rec"], {0: 10})
        >>> fit.name, fit.nbytes(0, fsspec.filesystem("file"), lambda k: (None, None), int)
        ("MySource('a.rec' and 1 more)", 10)
    """

    def __init__(self, kind: str, paths: Sequence[str], sizes: Mapping[int, int] | None = None):
        more = f" and {len(paths) - 1:,} more" if len(paths) > 1 else ""
        #: The dataset's name in messages: the class and its first shard.
        self.name = f"{kind}({repr(paths[0]) if len(paths) else 'no files'}{more})"
        self.paths = paths
        self.sizes: dict[int, int] = dict(sizes or {})
        # (process, cache) pairs already warned of a pass that cannot fit
        self.warned: set[tuple[Any, str]] = set()

    def check(
        self,
        caches: Sequence[CacheBlocks],
        order: Callable[[int, int], np.ndarray],
        start: int,
        count: int,
    ) -> list[CacheFit]:
        """Whether a pass (``order``, ``start``, ``count`` as in ``read_ahead``) fits each
        of ``caches`` (see :func:`~torchgrain.sources.block_cache.check_fit`); one it does
        not fit gets a :class:`~torchgrain.CacheThrashWarning`, once per cache and process.
        A cache whose shards' sizes cannot be learnt (the server fails) is not checked: the
        read that needs the shard raises the error, naming it."""
        fits = []
        for b in caches:
            try:
                fit = check_fit(self.name, b, order, start, count)
            except OSError:
                continue
            if fit:
                fits.append(fit)
        for fit in fits:
            key = (process.token(), fit.cache)
            if not fit.fits and key not in self.warned:
                self.warned.add(key)
                warnings.warn(CacheThrashWarning(fit.message(), fit), stacklevel=5)
        return fits

    def nbytes(
        self,
        shard: int,
        filesystem: fsspec.AbstractFileSystem,
        integrity: Callable[[int], tuple[int | None, str | None]],
        ask: Callable[[], int],
    ) -> int:
        """Size of ``shard`` in bytes: known, else from the dataset's records
        (``integrity(shard)``), else from one listing of the shards' directories on
        ``filesystem``, else ``ask()``."""
        size = self.sizes.get(shard)
        if size is None:
            size = integrity(shard)[0]
            if size is None and not self.sizes:
                self.sizes.update(listed_sizes(filesystem, self.paths))
                size = self.sizes.get(shard)
            if size is None:
                size = ask()
            self.sizes[shard] = size
        return size


def listed_sizes(fs: fsspec.AbstractFileSystem, paths: Sequence[str]) -> dict[int, int]:
    """Sizes of the files ``paths`` (by position) from listings of their directories (one
    request each; none where they lie in more than 16)."""
    where: dict[str, list[int]] = {}
    for k, path in enumerate(paths):
        where.setdefault(fs._parent(path), []).append(k)
    if len(where) > 16:
        return {}
    out = {}
    for parent, shards in where.items():
        try:
            listing = {
                fs._strip_protocol(e["name"]): e.get("size")
                for e in remote.call(fs, "ls", parent, detail=True, what="listing")
            }
        except Exception:  # a store that cannot list: sizes are asked one by one
            continue
        for k in shards:
            size = listing.get(fs._strip_protocol(paths[k]))
            if isinstance(size, int) and size >= 0:
                out[k] = size
    return out
