"""Exception types raised by torchgrain.

Every error about data names the file, the shard and the record index it concerns,
so a failure inside a DataLoader worker deep in a long job can be traced to a byte
range on disk.

Example:
    >>> import torchgrain as tg
    >>> try:
    ...     tg.ArrayRecordSource("/nonexistent/dir")
    ... except tg.DatasetNotFoundError as e:
    ...     print(type(e).__name__)
    DatasetNotFoundError
"""

from __future__ import annotations

__all__ = [
    "CacheThrashWarning",
    "CorruptDataError",
    "DatasetNotFoundError",
    "RecordDecodeError",
    "RemoteIOError",
    "SchemaMismatchError",
    "TorchgrainError",
    "UnsafePathError",
]


class TorchgrainError(Exception):
    """Base class of every torchgrain error."""


class DatasetNotFoundError(TorchgrainError, FileNotFoundError):
    """A path, directory or glob matched no readable shard."""


class CorruptDataError(TorchgrainError, ValueError):
    """A shard is truncated, not of the expected format, or fails an integrity check."""


class RecordDecodeError(CorruptDataError):
    """A record's bytes could not be decoded by the chosen codec."""


class SchemaMismatchError(TorchgrainError, ValueError):
    """Shards of one dataset have incompatible schemas."""


class UnsafePathError(TorchgrainError, ValueError):
    """A dataset's manifest names a shard outside the dataset's own directory or prefix."""


class RemoteIOError(TorchgrainError, OSError):
    """Reading remote storage kept failing with transient errors until retries ran out."""


class CacheThrashWarning(UserWarning):
    """A sampler's pass cannot fit a cache: each of its blocks (Parquet row groups,
    ArrayRecord chunks, remote shards) would be loaded many times instead of once.

    Issued once per source, cache and process, at the start of the pass, by the process
    that runs the sampler (not by every DataLoader worker). ``fit`` holds the numbers
    (a :class:`~torchgrain.sources.block_cache.CacheFit`); :func:`tg.stats
    <torchgrain.stats>` reports them too.
    """

    def __init__(self, message: str, fit: object = None) -> None:
        super().__init__(message)
        self.fit = fit


def check_ceiling(name: str, value: object, minimum: int) -> int:
    """``value`` of the ceiling option ``name`` (a decoder's most bytes), checked: an int
    (not a bool) of at least ``minimum``, else a ``TypeError`` / ``ValueError`` naming it.

    Example:
        >>> check_ceiling("max_chunk_bytes", 1 << 20, 1)
        1048576
        >>> check_ceiling("max_chunk_bytes", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: max_chunk_bytes must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
