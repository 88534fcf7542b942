"""Whether a pass fits a sharded source's caches, and the shard sizes it needs.

Part of :class:`~torchgrain.sources.base.ShardedSource` (a base class of it, not an API of
its own): :meth:`CacheFitting.check_cache_fit` replays the start of a sampler's pass
through each cache the source reads through (:meth:`CacheFitting.cache_blocks`: the shard
cache here; formats add their decoded-block cache) and warns once when it cannot fit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from torchgrain.errors import CacheThrashWarning
from torchgrain.io import process, remote
from torchgrain.sources.block_cache import CacheBlocks, CacheFit, check_fit

__all__ = ["CacheFitting"]


class CacheFitting:
    """The cache-fit checks of :class:`~torchgrain.sources.base.ShardedSource`, and the
    shard sizes they use."""

    def _describe(self) -> str:
        """A short name of the dataset for messages: the class and its first shard."""
        more = f" and {self.num_shards - 1:,} more" if self.num_shards > 1 else ""
        first = repr(self._paths[0]) if self._paths else "no files"
        return f"{type(self).__name__}({first}{more})"

    def cache_blocks(self) -> list[CacheBlocks]:
        """The caches a pass over this source goes through, for :meth:`check_cache_fit`:
        the shard cache (``cache_dir``) for remote shards; formats add their decoded-
        block cache."""
        if self.cache is None or not self._remote:
            return []
        return [
            CacheBlocks(
                cache="shard cache (cache_dir)",
                unit="shard",
                offsets=self.index.offsets,
                nbytes=lambda shards: np.array([self.shard_nbytes(int(s)) for s in shards]),
                capacity=self.cache.max_bytes,
                per_process=False,
                remedies=(
                    "raise cache_dir_bytes above the working set",
                    "use BlockShuffleSampler (a few shards at a time, each read once a pass)",
                    "rewrite the data in fewer, larger passes' worth of shards "
                    "(torchgrain convert)",
                ),
            )
        ]

    def check_cache_fit(
        self, order: Callable[[int, int], np.ndarray], start: int, count: int
    ) -> list[CacheFit]:
        """Whether a pass (``order``, ``start``, ``count`` as in :meth:`read_ahead`) fits
        each of :meth:`cache_blocks`, replaying its start through a simulated cache (see
        :func:`~torchgrain.sources.block_cache.check_fit`). A cache it does not fit gets
        a :class:`~torchgrain.CacheThrashWarning`, once per source, cache and process.

        Example:
            >>> import tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> tg.ArrayRecordSource(d).check_cache_fit(lambda a, b: range(a, b), 0, 4)
            []
        """
        fits = []
        for blocks in self.cache_blocks():
            fit = check_fit(self._describe(), blocks, order, start, count)
            if fit is None:
                continue
            fits.append(fit)
            warned = self._thrash_warned
            if not fit.fits and (process.token(), blocks.cache) not in warned:
                warned.add((process.token(), blocks.cache))
                warnings.warn(CacheThrashWarning(fit.message(), fit), stacklevel=4)
        return fits

    def shard_nbytes(self, shard: int) -> int:
        """Size of a shard file in bytes (from the dataset's records, else from one
        listing of the shards' directories, else asked for this shard).

        Example:
            >>> import os, tempfile, torchgrain as tg
            >>> d = tempfile.mkdtemp()
            >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d, num_shards=2)
            >>> src = tg.ArrayRecordSource(d)
            >>> src.shard_nbytes(0) == os.path.getsize(src.paths[0])
            True
        """
        size = self._sizes.get(shard)
        if size is None:
            size = self.shard_integrity(shard)[0]
            if size is None and not self._sizes:
                self._sizes.update(self._listed_sizes())
                size = self._sizes.get(shard)
            if size is None:
                size = self._io(
                    lambda: remote.file_size(self._fs, self._paths[shard]), shard, "size"
                )
            self._sizes[shard] = size
        return size

    def _listed_sizes(self) -> dict[int, int]:
        """Sizes of the shards from listings of their directories (one request each)."""
        fs = self._fs
        where: dict[str, list[int]] = {}
        for k, path in enumerate(self._paths):
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
                size = listing.get(fs._strip_protocol(self._paths[k]))
                if isinstance(size, int) and size >= 0:
                    out[k] = size
        return out
