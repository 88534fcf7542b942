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

import os
import re
import threading
import traceback
import warnings
from collections.abc import Hashable

__all__ = [
    "CacheDiskFullError",
    "CacheThrashWarning",
    "CorruptDataError",
    "DatasetNotFoundError",
    "DatasetWarning",
    "EpochNotSetWarning",
    "RaggedBatchError",
    "RecordDecodeError",
    "RemoteIOError",
    "SchemaMismatchError",
    "TorchgrainError",
    "UnsafePathError",
    "warn_empty",
    "warn_once",
]


class TorchgrainError(Exception):
    """Base class of every torchgrain error."""


class DatasetNotFoundError(TorchgrainError, FileNotFoundError):
    """A path, directory or glob matched no readable shard."""


class CorruptDataError(TorchgrainError, ValueError):
    """A shard is truncated, not of the expected format, or fails an integrity check."""


class RecordDecodeError(CorruptDataError):
    """A record's bytes could not be decoded by the chosen codec."""


class RaggedBatchError(TorchgrainError, RuntimeError):
    """Values of one key differ in length within a batch, and the collate can only stack
    equal shapes (torch's default collate): the message names the key, the lengths and
    the fixes (``tg.pad_collate``, ``Dataset.windows``). A ``RuntimeError``, as torch's own
    message was."""


class SchemaMismatchError(TorchgrainError, ValueError):
    """Shards of one dataset have incompatible schemas."""


class UnsafePathError(TorchgrainError, ValueError):
    """A dataset's manifest names a shard outside the dataset's own directory or prefix."""


class RemoteIOError(TorchgrainError, OSError):
    """Reading remote storage kept failing with transient errors until retries ran out."""


class CacheDiskFullError(TorchgrainError, OSError):
    """A cache on local disk could not write a file: its filesystem is full (``ENOSPC``),
    the user's disk quota is spent (``EDQUOT``) or the file outgrew a size limit (``EFBIG``:
    the filesystem's largest file, or the process's ``ulimit -f``), or (``ENOENT``) the
    shard cache's directory was deleted during a download, made again and deleted again.

    An ``OSError`` with the ``errno`` of the failed write (``except OSError`` still
    catches it). The message names the cache, its directory, the file it was writing and
    what to do; :attr:`directory` and :attr:`path` hold the last two. Nothing partial is
    left under the file's name. Sources that can read without the cache do so (and warn
    once per cache and process) instead of raising it.

    Example:
        >>> import errno
        >>> e = CacheDiskFullError(errno.ENOSPC, "the shard cache in '/c' cannot write "
        ...                        "'/c/x'", directory="/c", path="/c/x")
        >>> isinstance(e, OSError), e.errno == errno.ENOSPC, e.directory
        (True, True, '/c')
        >>> CacheDiskFullError("Caught in a worker: [Errno 28] No space...").errno
        28
    """

    def __init__(
        self,
        code: int | str | None,
        message: str | None = None,
        *,
        directory: str | None = None,
        path: str | None = None,
    ) -> None:
        if message is None:
            # One text: how a DataLoader re-raises a worker's error in the main process
            # (its message, holding the worker's; any other signature turns it into a
            # RuntimeError). The errno is the worker's, read back from it.
            message = str(code)
            found = re.search(r"\[Errno (\d+)\]", message)
            code = int(found.group(1)) if found else None
        if code is None:
            super().__init__(message)
        else:
            super().__init__(code, message)
        self.directory = directory
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        # (a DataLoader worker's error may be pickled to the main process)
        message = self.strerror if self.errno is not None else str(self)
        return (_disk_full, (self.errno, message, self.directory, self.path))


def _disk_full(code: int | None, message: str, directory: str | None, path: str | None) -> OSError:
    return CacheDiskFullError(code, message, directory=directory, path=path)


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


class DatasetWarning(UserWarning):
    """Something about a dataset's files a user should know, though it is not an error:
    files in a dataset directory that are not data and were skipped (a stray
    ``stats.csv``), a column some files lack (read as None there), a dataset of no
    records. Issued once per dataset and process (:func:`warn_once`).
    """


class EpochNotSetWarning(UserWarning):
    """A shuffling sampler started a second pass at the same seed and epoch, with no
    ``set_epoch`` (or ``load_state_dict``) in between: every epoch would repeat one
    order and the same random transforms. Issued once per sampler.
    """


_WARNED: set[Hashable] = set()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# torch's DataLoader iterating a sampler stands between the user's loop and a sampler.
_DATALOADER_DIR = os.sep + os.path.join("torch", "utils", "data") + os.sep


def _ours(file_name: str) -> bool:
    return file_name.startswith(_PACKAGE_DIR) or _DATALOADER_DIR in file_name


_WARNED_LOCK = threading.Lock()


def warn_once(key: Hashable, message: str, category: type[Warning] = DatasetWarning) -> bool:
    """``warnings.warn(message, category)`` the first time this process sees ``key``
    (whatever the user's warning filters would repeat); whether it warned. The warning
    names the line of the user's code that called into torchgrain. ``key=None`` warns
    every time.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_once(("example", 1), "said once"), warn_once(("example", 1), "said once")
        (True, False)
        >>> [str(w.message) for w in seen]
        ['said once']
    """
    if key is not None:  # None: the caller keeps its own count
        with _WARNED_LOCK:
            if key in _WARNED:
                return False
            _WARNED.add(key)
    # The innermost frame outside torchgrain (and torch's DataLoader): stacklevel k is
    # stack[-k], this function being 1 (a rare event: the cost of the walk does not matter).
    stack = traceback.extract_stack()
    level = 2
    while level < len(stack) and _ours(stack[-level].filename):
        level += 1
    warnings.warn(message, category, stacklevel=level)
    return True


def warn_empty(dataset: str) -> None:
    """Say once per process that ``dataset`` (its description: the class and the path) has
    no records: training over it runs no step, which nothing else would say.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_empty("ParquetSource '/d/empty.parquet'")
        >>> print(seen[0].message)
        ParquetSource '/d/empty.parquet' holds no records: iterating it yields nothing (a DataLoader over it runs 0 batches)
    """
    warn_once(
        ("empty dataset", dataset),
        f"{dataset} holds no records: iterating it yields nothing (a DataLoader over it "
        "runs 0 batches)",
    )


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
