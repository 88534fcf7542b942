"""ReadOptions: the options every sharded source shares, as one frozen value.

How a dataset is read (its storage, caches, threads, retries, limits and trust) is the
same question for every format: :class:`ReadOptions` answers it once, and
:class:`~torchgrain.ArrayRecordSource`, :class:`~torchgrain.ParquetSource`,
:class:`~torchgrain.TFRecordSource` and ``tg.open`` take it as ``options=``, beside
their own format options (``codec=``, ``columns=``...). One value opens any format,
can be kept in a config, compared and pickled; ``dataclasses.replace`` makes a variant.

The same names are still accepted as keyword arguments of the sources (the older way):
each one given replaces that field of ``options``.

Example:
    >>> import tempfile, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_parquet([{"i": i} for i in range(4)], d)
    >>> opts = tg.ReadOptions(cache_bytes=64 << 20, io_threads=4)
    >>> src = tg.open(d, options=opts)
    >>> src.options == opts, src.cache_bytes
    (True, 67108864)
    >>> tg.ParquetSource(d, cache_bytes=64 << 20, io_threads=4).options == opts
    True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torchgrain.io.retry import RetryPolicy

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_CACHE_DIR_BYTES", "DEFAULT_MAX_INFLIGHT", "ReadOptions"]

#: Default budget of a process's in-memory cache of decoded blocks (``cache_bytes``).
DEFAULT_CACHE_BYTES = 256 * 2**20
#: Default budget of a ``cache_dir`` (local copies of remote shards).
DEFAULT_CACHE_DIR_BYTES = 16 * 2**30
#: Default requests in flight per process when a batch is read from remote shards
#: without a shard cache. Measured (benchmarks/remote_global.py, 1 KiB records, 30 ms,
#: batches of 256, 2 shared cores): 64, 128 and 256 read 1,471 / 2,011 / 1,743
#: records/s with 0 workers and 2,806 / 2,949 / 1,888 with 2.
DEFAULT_MAX_INFLIGHT = 128


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_dir_option(name: str, value: Any) -> Any:
    """A source's directory option ``name`` (``index_dir``...), checked: a path as a
    ``str`` (a leading ``~`` expanded), or ``None`` / ``...`` (off / the default) as
    given; a ``TypeError`` naming the option otherwise.

    Example:
        >>> import pathlib
        >>> check_dir_option("index_dir", pathlib.Path("/tmp/ix")), check_dir_option("index_dir", None)
        ('/tmp/ix', None)
        >>> check_dir_option("index_dir", 5)
        Traceback (most recent call last):
        ...
        TypeError: index_dir must be a directory path, None or ..., got int 5
    """
    if value is None or value is ...:
        return value
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str):
            return os.path.expanduser(path)  # '~' is the home directory, as in dataset paths
    raise TypeError(
        f"{name} must be a directory path, None or ..., got {type(value).__name__} {value!r}"
    )


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a sharded dataset is read, whatever its format (see the module docstring).

    The table of fields, defaults and their reasons: docs/sources.md (the options table).

    Attributes:
        storage_options: fsspec options for remote paths (copied when the value is made).
        filesystem: a ready fsspec filesystem to use instead of one inferred from the paths.
        cache_bytes: this process's in-memory cache of decoded blocks, in bytes (``None``:
            the format's default, :data:`DEFAULT_CACHE_BYTES`; ``0`` disables it).
        cache_dir: a local directory (or a :class:`~torchgrain.io.shard_cache.ShardCache`)
            for whole copies of *remote* shards, each downloaded once per machine.
        cache_dir_bytes: byte budget of ``cache_dir`` (:data:`DEFAULT_CACHE_DIR_BYTES`).
        read_ahead_bytes: with ``cache_dir``, bytes of shards a sampler's future order may
            have downloaded ahead of use (``None``: half of ``cache_dir_bytes``; ``0``: none).
        io_threads: threads per process reading a batch's remote shards (default 8).
        max_inflight: remote range requests in flight per process without a shard cache
            (:data:`DEFAULT_MAX_INFLIGHT`; ``1``: one at a time).
        multi_range: over ``http(s)://``, up to 64 ranges of one shard in one request
            (default on; object stores always get one range per request).
        retry: attempts and deadlines of remote reads (``None``:
            :class:`~torchgrain.io.retry.RetryPolicy()`).
        max_open_files: shard readers kept open per process: ``"auto"`` (default), a
            number, or ``None`` for no limit.
        allow_external_paths: let a manifest or listing name files outside the dataset,
            and a server redirect (off by default: see :mod:`torchgrain.io.paths`).
        verify_checksums: check the format's stored checksums on every read (``None``: the
            format's default: TFRecord on, ArrayRecord and Parquet off, for measured costs).

    Raises:
        ValueError: a value out of range, naming the option.
        TypeError: a value of the wrong type, naming the option.

    Example:
        >>> import dataclasses
        >>> opts = ReadOptions(cache_dir="/tmp/shards", io_threads=16)
        >>> opts.cache_dir_bytes == DEFAULT_CACHE_DIR_BYTES, opts.max_open_files
        (True, 'auto')
        >>> dataclasses.replace(opts, io_threads=4).io_threads
        4
        >>> ReadOptions(io_threads=0)
        Traceback (most recent call last):
        ...
        ValueError: io_threads must be an integer >= 1, got 0
    """

    storage_options: Mapping[str, Any] | None = None
    filesystem: Any = None
    cache_bytes: int | None = None
    cache_dir: str | os.PathLike | Any | None = None
    cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES
    read_ahead_bytes: int | None = None
    io_threads: int = 8
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    multi_range: bool = True
    retry: RetryPolicy | None = None
    max_open_files: int | Literal["auto"] | None = "auto"
    allow_external_paths: bool = False
    verify_checksums: bool | None = None

    def __post_init__(self) -> None:
        import fsspec

        from torchgrain.io.shard_cache import ShardCache

        for name, kinds, what in (
            ("storage_options", Mapping, "a mapping of fsspec options"),
            ("filesystem", fsspec.AbstractFileSystem, "an fsspec filesystem"),
            ("cache_dir", (str, os.PathLike, ShardCache), "a directory path or a ShardCache"),
            ("retry", RetryPolicy, "a RetryPolicy"),
        ):
            v = getattr(self, name)
            if v is not None and not isinstance(v, kinds):
                raise TypeError(f"{name} must be {what}, got {type(v).__name__}")
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", dict(self.storage_options))
        if isinstance(self.cache_dir, (str, os.PathLike)):
            object.__setattr__(self, "cache_dir", check_dir_option("cache_dir", self.cache_dir))
        optional = ("cache_bytes", "read_ahead_bytes")  # (None: the default)
        for name in (*optional, "cache_dir_bytes", "io_threads", "max_inflight"):
            v, low = getattr(self, name), 0 if name in optional else 1
            if (v is not None or low) and (not _is_int(v) or v < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        m = self.max_open_files
        if m is ...:  # the earlier spelling of "auto"
            object.__setattr__(self, "max_open_files", "auto")
        elif m is not None and m != "auto" and (not _is_int(m) or m < 1):
            raise ValueError(f"max_open_files must be an integer >= 1, 'auto' or None, got {m!r}")
        for name in ("allow_external_paths", "multi_range"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        v = self.verify_checksums
        if v is not None and not isinstance(v, bool):
            raise TypeError(f"verify_checksums must be True, False or None, got {v!r}")

    # ------------------------------------------------------------------ helpers
    @classmethod
    def names(cls) -> frozenset[str]:
        """The option names (what the sources also take as keyword arguments).

        Example:
            >>> "cache_bytes" in ReadOptions.names(), "codec" in ReadOptions.names()
            (True, False)
        """
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def build(
        cls, options: ReadOptions | None = None, keywords: Mapping[str, Any] | None = None
    ) -> ReadOptions:
        """``options`` (default: all defaults) with the fields named in ``keywords``
        replaced: how a source combines ``options=`` with the older keyword arguments.

        Raises:
            TypeError: ``options`` is not a ReadOptions, or a keyword is no option
                (named, as Python names an unexpected keyword argument).

        Example:
            >>> ReadOptions.build(ReadOptions(io_threads=2), {"cache_bytes": 0})
            ... # doctest: +ELLIPSIS
            ReadOptions(storage_options=None, ..., cache_bytes=0, ..., io_threads=2, ...)
        """
        if options is None:
            options = cls()
        elif not isinstance(options, ReadOptions):
            raise TypeError(f"options must be a ReadOptions, got {type(options).__name__}")
        if not keywords:
            return options
        unknown = sorted(set(keywords) - cls.names())
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(options, **keywords)

    @property
    def retry_policy(self) -> RetryPolicy:
        """:attr:`retry`, or the default policy when it is None."""
        return self.retry if self.retry is not None else RetryPolicy()

    def cache_bytes_or(self, default: int) -> int:
        """:attr:`cache_bytes`, or a format's ``default`` when it is None."""
        return default if self.cache_bytes is None else self.cache_bytes

    def verify_or(self, default: bool) -> bool:
        """:attr:`verify_checksums`, or a format's ``default`` when it is None."""
        return default if self.verify_checksums is None else self.verify_checksums

    def _expand(self, paths: Any, suffixes: Sequence[str], kind: str) -> tuple[Any, list[str]]:
        """The filesystem and files of a source's ``paths`` (its files: names holding one of
        ``suffixes``), listed through this storage, within the retry policy's deadlines
        (:func:`~torchgrain.io.fs.expand_paths`)."""
        from torchgrain.io.fs import expand_paths
        from torchgrain.io.retry import using

        with using(self.retry_policy):  # the transport and listing keep to its deadlines
            return expand_paths(
                paths,
                suffixes=suffixes,
                storage_options=self.storage_options,
                filesystem=self.filesystem,
                kind=kind,
                allow_external=self.allow_external_paths,
            )
