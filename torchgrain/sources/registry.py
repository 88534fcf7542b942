"""The formats torchgrain reads, in one registry: found by name, by file names, or by path.

Each :class:`Format` names its :class:`~torchgrain.Source` class, the name fragments of
its files, an optional marker file that identifies a dataset directory, and a writer
(used by examples and the test suite's conformance checks). ``tg.open``, ``torchgrain
inspect``/``convert``/``bench`` and :func:`detect_format` all read this registry, so a
new format is one module and one :func:`register_format` call. Formats of other packages
are found through the ``torchgrain.formats`` entry-point group (:func:`load_plugins`).

Example:
    >>> import tempfile, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_parquet([{"id": i} for i in range(3)], d)
    >>> detect_format(d), sorted(formats())
    ('parquet', ['array_record', 'parquet', 'tfrecord'])
    >>> src = tg.open(d)
    >>> type(src).__name__, src[2]
    ('ParquetSource', {'id': 2})
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchgrain.errors import DatasetNotFoundError, warn_empty, warn_once
from torchgrain.io import remote
from torchgrain.io.fs import (
    describe_files,
    expand_paths,
    get_filesystem,
    has_glob,
    is_local,
    list_files,
    non_data_files,
)
from torchgrain.io.retry import using
from torchgrain.sources.base import ShardedSource, Source
from torchgrain.sources.options import ReadOptions

if TYPE_CHECKING:
    from torchgrain.sources.format import FormatSource
    from torchgrain.writers import OutputFormat

__all__ = [
    "ALLOW_EXTERNAL_PATHS_ENV",
    "Format",
    "detect_format",
    "formats",
    "get_format",
    "get_output",
    "load_plugins",
    "open",
    "output_formats",
    "register_format",
]


#: Set to ``1`` (as ``torchgrain ... --allow-external-paths`` does for itself and the
#: processes it starts), :func:`open` reads every dataset as ``allow_external_paths=True``.
ALLOW_EXTERNAL_PATHS_ENV = "TORCHGRAIN_ALLOW_EXTERNAL_PATHS"


@dataclass(frozen=True)
class Format:
    """One dataset format.

    Attributes:
        name: the registry key (``"array_record"``, ``"parquet"``, ``"tfrecord"``).
        source: the :class:`~torchgrain.Source` class, called as
            ``source(paths, options=ReadOptions(...), **format_options)`` (``options=``
            only when given, and only for a format that takes them).
        suffixes: name fragments of the format's files (``.parquet`` also finds
            ``x.parquet.zst``; ``.tfrecord`` finds ``x.tfrecord-00000-of-00008``).
        marker: a file whose presence in a directory makes it a dataset of this format
            (``torchgrain.json`` for torchgrain's ArrayRecord datasets).
        write: ``write(records, directory, num_shards=1)`` writes records in this format
            as ``num_shards`` files of contiguous slices (optional; examples and tests).
        description: one line for ``torchgrain inspect`` and error messages.
        options: the format's own keyword options (``codec``, ``columns``...).
        read_options: whether the source takes a :class:`~torchgrain.ReadOptions` as
            ``options=`` and its fields as keywords (every
            :class:`~torchgrain.sources.base.ShardedSource` does).
        output: how ``torchgrain convert`` writes this format (``--to``), an
            :class:`~torchgrain.writers.OutputFormat`; None: not an output format.
    """

    name: str
    source: Callable[..., Source]
    suffixes: tuple[str, ...]
    marker: str | None = None
    write: Callable[..., Any] | None = None
    description: str = ""
    options: tuple[str, ...] = ()
    read_options: bool = True
    output: OutputFormat | None = None

    @classmethod
    def for_source(cls, source: type[FormatSource], **fields: Any) -> Format:
        """The format of a :class:`~torchgrain.FormatSource` subclass: its name and
        suffixes are those of its ``format``; ``fields`` are the others (``write=``,
        ``description=``, ``output=``...).

        Example:
            >>> import torchgrain as tg
            >>> class Lines:
            ...     name, suffixes = "lines", (".lines",)
            >>> class LinesSource(tg.FormatSource):
            ...     format = Lines()
            >>> f = Format.for_source(LinesSource, description="text, one record a line")
            >>> f.name, f.suffixes, f.source is LinesSource
            ('lines', ('.lines',), True)
        """
        return cls(source.format.name, source, tuple(source.format.suffixes), **fields)

    @property
    def convert_output(self) -> bool:
        """Whether ``torchgrain convert`` can write this format (it has an ``output``)."""
        return self.output is not None

    def matches(self, file_name: str) -> bool:
        """Whether a file name (no directory) is one of this format's files."""
        return not file_name.startswith((".", "_")) and any(s in file_name for s in self.suffixes)

    def accepts(self, option: str) -> bool:
        """Whether the format's source takes ``option`` as a keyword argument.

        Example:
            >>> get_format("parquet").accepts("columns"), get_format("parquet").accepts("codec")
            (True, False)
            >>> get_format("tfrecord").accepts("cache_bytes")
            True
        """
        return option in self.options or (
            self.read_options and (option == "options" or option in ReadOptions.names())
        )

    def check_options(self, options: Iterable[str]) -> None:
        """Raise ``ValueError`` for an option this format does not take, naming the
        formats that do.

        Example:
            >>> get_format("parquet").check_options(["codec"])
            Traceback (most recent call last):
            ...
            ValueError: codec= applies to array_record, tfrecord, not parquet
        """
        for option in options:
            if self.accepts(option):
                continue
            others = [f.name for f in _FORMATS.values() if f.accepts(option)]
            if others:
                raise ValueError(f"{option}= applies to {', '.join(others)}, not {self.name}")
            raise ValueError(
                f"{self.name} takes no option {option}= (it takes: "
                + ", ".join(sorted(self.options) + (["options"] if self.read_options else []))
                + ")"
            )


_FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> None:
    """Add (or replace) a format in the registry: ``tg.open``, :func:`detect_format`
    and ``torchgrain inspect``/``bench``/``convert`` (as an input) then know it.

    Example:
        >>> import torchgrain as tg
        >>> register_format(Format("ten", tg.ParquetSource, (".ten",)))
        >>> detect_format("x.ten"), "ten" in formats()
        ('ten', True)
        >>> del _FORMATS["ten"]
    """
    if not fmt.name or not fmt.suffixes:
        raise ValueError("a format needs a name and at least one file-name suffix")
    _FORMATS[fmt.name] = fmt


#: The entry-point group other packages declare their formats in.
PLUGIN_GROUP = "torchgrain.formats"
_PLUGINS: dict[str, list[str]] | None = None  # entry-point name -> formats it added
_PLUGINS_LOCK = threading.RLock()


def load_plugins() -> dict[str, list[str]]:
    """Load the formats other packages declare in the ``torchgrain.formats`` entry-point
    group, once per process; the formats each entry point added, by its name.

    An entry point's object is a :class:`Format` (registered as it is) or a callable
    taking no argument that calls :func:`register_format` itself or returns a
    :class:`Format`. The registry's readers (:func:`formats`, :func:`get_format`,
    :func:`detect_format`, :func:`open` and the ``torchgrain`` command) call this first,
    so an installed format is there without an import. A plugin that fails to load,
    returns something else, or would replace a format already registered (the built-in
    ones included) is skipped with a warning naming it and its package; nothing it
    registered stays. Cost: one scan of the installed packages' metadata, once (0.1 s
    with 185 packages installed, on a loaded 2-core machine).

    A package declares its format in its ``pyproject.toml``::

        [project.entry-points."torchgrain.formats"]
        jsonl = "my_package.jsonl:FORMAT"

    Example:
        >>> load_plugins()   # no plugin installed here
        {}
    """
    global _PLUGINS
    with _PLUGINS_LOCK:
        if _PLUGINS is None:
            _PLUGINS = {}  # set first: a plugin that reads the registry does not load again
            from importlib.metadata import entry_points

            try:
                found = list(entry_points(group=PLUGIN_GROUP))
            except Exception as e:  # a damaged metadata file must not stop the registry
                warn_once(("plugins", PLUGIN_GROUP), f"torchgrain: cannot list plugins: {e!r}")
                found = []
            for ep in found:
                _PLUGINS[ep.name] = _load_plugin(ep)
        return {name: added for name, added in _PLUGINS.items() if added}


def _load_plugin(ep: Any) -> list[str]:
    """Register one entry point's format; the names it added ([] and a warning when
    it is broken, with the registry as it was before)."""
    dist = getattr(getattr(ep, "dist", None), "name", None) or "an unknown package"
    where = f"format plugin {ep.name!r} ({ep.value}, from {dist})"
    before = dict(_FORMATS)
    try:
        obj = ep.load()
        if not isinstance(obj, Format) and not callable(obj):
            raise TypeError(f"it is a {type(obj).__name__}, not a Format or a callable")
        made = obj if isinstance(obj, Format) else obj()
        if isinstance(made, Format):
            register_format(made)
        elif made is not None:
            raise TypeError(f"it returned a {type(made).__name__}, not a Format or None")
        replaced = sorted(n for n, f in before.items() if _FORMATS.get(n) is not f)
        if replaced:
            raise ValueError(f"it would replace the registered format(s) {replaced}")
    except (Exception, SystemExit) as e:  # any plugin failure: skip it, never fail the caller
        _FORMATS.clear()
        _FORMATS.update(before)
        warn_once(("plugin", ep.name, ep.value), f"torchgrain: skipped {where}: {e!r}")
        return []
    return [n for n in _FORMATS if n not in before]


def formats() -> dict[str, Format]:
    """The registered formats, by name (in the order they were registered)."""
    load_plugins()
    return dict(_FORMATS)


def output_formats() -> list[str]:
    """The formats ``torchgrain convert`` writes (``--to``).

    Example:
        >>> output_formats()
        ['array_record', 'parquet']
    """
    load_plugins()
    return [f.name for f in _FORMATS.values() if f.output is not None]


def get_output(name: str) -> OutputFormat:
    """How ``torchgrain convert`` writes the format called ``name``; ``ValueError``
    naming the formats it writes.

    Example:
        >>> get_output("parquet").suffix
        '.parquet'
        >>> get_output("tfrecord")
        Traceback (most recent call last):
        ...
        ValueError: to must be one of array_record, parquet, got 'tfrecord'
    """
    load_plugins()
    fmt = _FORMATS.get(name)
    if fmt is None or fmt.output is None:
        raise ValueError(f"to must be one of {', '.join(output_formats())}, got {name!r}")
    return fmt.output


def get_format(name: str) -> Format:
    """The registered format called ``name``; ``ValueError`` naming the known ones.

    Example:
        >>> get_format("tfrecord").suffixes
        ('.tfrecord', '.tfrecords')
    """
    load_plugins()
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown format {name!r}; registered formats: {sorted(_FORMATS)}")
    return fmt


def detect_format(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_external_paths: bool = False,
) -> str:
    """The format of a path, glob, directory, URL or list of them, from file names.

    A directory holding a format's marker file (``torchgrain.json``) is of that format;
    otherwise the names of the files found decide. Only when the names given cannot tell
    is anything looked up: whether a path exists, what a glob matches.
    ``allow_external_paths`` (or :data:`ALLOW_EXTERNAL_PATHS_ENV` set to ``1``) lets a
    listing name files outside the directory, as for a source.

    Raises:
        DatasetNotFoundError: a path that does not exist, a glob that matches nothing, a
            directory holding no file of a registered format (naming what it holds).
        ValueError: files of no registered format, or of several formats.

    Example:
        >>> detect_format("data/train-00000-of-00004.tfrecord.gz")
        'tfrecord'
        >>> detect_format("/no/such/dir")
        Traceback (most recent call last):
        ...
        torchgrain.errors.DatasetNotFoundError: path '/no/such/dir' does not exist
    """
    load_plugins()
    allow_external_paths = allow_external_paths or os.environ.get(ALLOW_EXTERNAL_PATHS_ENV) == "1"
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    suffixes = [s for f in _FORMATS.values() for s in f.suffixes]
    found: set[str] = set()
    for item in items:
        fs, p = get_filesystem(item, storage_options, allow_redirects=allow_external_paths)
        where = os.fspath(item)
        glob = has_glob(p, fs)
        if not glob and remote.isdir(fs, p, url=where):
            marked = [
                f.name
                for f in _FORMATS.values()
                if f.marker and remote.isfile(fs, f"{p.rstrip('/')}/{f.marker}")
            ]
            if marked:
                found.update(marked)
                continue
            listed = list_files(fs, p, suffixes, where=where, allow_external=allow_external_paths)
            names = [f.rsplit("/", 1)[-1] for f in listed]
            if not any(_of_a_format(name) for name in names):
                raise DatasetNotFoundError(
                    f"directory {where!r} holds no file of a registered format (names "
                    f"containing {', '.join(suffixes)})"
                    + describe_files(p, non_data_files(p, listed, suffixes), "; it holds ")
                )
        else:
            # A "?" outside a glob starts an HTTP(S) URL's query: the name is before it.
            names = [(where if glob else where.split("?")[0]).rstrip("/").rsplit("/", 1)[-1]]
            if not _of_a_format(names[0]):
                # The name cannot tell: a typo, a glob over other names, a file of
                # another format. Only now is anything asked of the filesystem.
                if glob:
                    names = [
                        f.rsplit("/", 1)[-1]
                        for f in expand_paths(
                            item,
                            suffixes=suffixes,
                            storage_options=storage_options,
                            kind="data",
                            allow_external=allow_external_paths,
                        )[1]
                    ]
                elif not remote.exists(fs, p, url=where):
                    relative = is_local(fs) and not where.startswith(("/", "file:"))
                    cwd = f" (in {os.getcwd()})" if relative else ""  # where it was looked for
                    raise DatasetNotFoundError(f"path {where!r} does not exist{cwd}")
        for name in names:
            found.update(f.name for f in _FORMATS.values() if f.matches(name))
    if len(found) == 1:
        return found.pop()
    if not found:
        raise ValueError(
            f"cannot tell the format of {paths!r} from its file names (known: "
            + ", ".join(f"{f.name} {'/'.join(f.suffixes)}" for f in _FORMATS.values())
            + "); pass format="
        )
    raise ValueError(
        f"{paths!r} holds files of several formats ({', '.join(sorted(found))}); "
        "open them separately or pass format="
    )


def _of_a_format(name: str) -> bool:
    return any(f.matches(name) for f in _FORMATS.values())


def open(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    format: str = "auto",
    options: ReadOptions | None = None,
    **format_options: Any,
) -> Source:
    """Open a dataset of any registered format by its path or URL: the one way every
    command (``inspect``, ``convert``, ``bench``) opens data.

    ``format="auto"`` detects it (:func:`detect_format`). ``options`` says how it is read
    (:class:`~torchgrain.ReadOptions`, the same for every format); ``format_options`` go
    to the format's source (``columns=`` for Parquet, ``codec=`` for ArrayRecord and
    TFRecord; the fields of ``ReadOptions`` are accepted by name too).

    Raises:
        DatasetNotFoundError: a path that does not exist, a glob that matches nothing, a
            directory with no data file (:func:`detect_format`, or the format's source).
        ValueError: the format is unknown or cannot be told, or takes no such option
            (the message names the formats that do).

    A dataset of no records opens with a :class:`~torchgrain.errors.DatasetWarning`
    (once per process), as do files of a dataset directory that are not data (skipped)
    and Parquet files missing a column that others have.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": 1}, {"x": 2}], d)
        >>> src = tg.open(d, options=tg.ReadOptions(cache_bytes=0))
        >>> isinstance(src, tg.Source), len(src), src[1], src.cache_bytes
        (True, 2, {'x': 2}, 0)
        >>> tg.open(d, columns=["x"])
        Traceback (most recent call last):
        ...
        ValueError: columns= applies to parquet, not array_record
    """

    def given(name: str) -> Any:  # an option, as a keyword or in ``options``
        value = format_options.get(name)
        return getattr(options, name, None) if value is None else value

    trusted = bool(given("allow_external_paths"))
    # The command line's --allow-external-paths, carried to the processes it starts.
    from_env = not trusted and os.environ.get(ALLOW_EXTERNAL_PATHS_ENV) == "1"
    if format == "auto":  # (detect_format reads the environment too)
        storage = given("storage_options")
        with using(given("retry")):  # its lookups keep to the source's deadlines
            format = detect_format(paths, storage_options=storage, allow_external_paths=trusted)
    fmt = get_format(format)
    if from_env and fmt.accepts("allow_external_paths"):
        format_options["allow_external_paths"] = True
    fmt.check_options([*format_options, *(["options"] if options is not None else [])])
    if options is not None:
        format_options["options"] = options
    src = fmt.source(paths, **format_options)
    if not isinstance(src, ShardedSource) and len(src) == 0:  # (sharded ones say it)
        warn_empty(f"{type(src).__name__} {paths!r}")
    return src


def _write_tfrecord(
    records: Iterable[dict[str, Any]], directory: str, *, num_shards: int = 1
) -> list[str]:
    """Records as ``tf.train.Example`` in ``num_shards`` TFRecord files (contiguous slices)."""
    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfrecord import write_tfrecord
    from torchgrain.writers import shard_name

    records, paths = list(records), []
    os.makedirs(directory, exist_ok=True)
    for i in range(num_shards):
        name = shard_name(i, num_shards).replace(".array_record", ".tfrecord")
        paths.append(os.path.join(directory, name))
        part = records[len(records) * i // num_shards : len(records) * (i + 1) // num_shards]
        write_tfrecord((encode_tf_example(r) for r in part), paths[-1])
    return paths


def _register_builtins() -> None:
    from torchgrain.formats.manifest import MANIFEST_NAME
    from torchgrain.sources.arrayrecord import ARRAY_RECORD_SUFFIXES, ArrayRecordSource
    from torchgrain.sources.parquet import PARQUET_SUFFIXES, ParquetSource
    from torchgrain.sources.tfrecord import TFRECORD_SUFFIXES, TFRecordSource
    from torchgrain.writers import (
        ARRAY_RECORD_OUTPUT,
        PARQUET_OUTPUT,
        write_array_record,
        write_parquet,
    )

    for fmt in (
        Format(
            "array_record",
            ArrayRecordSource,
            ARRAY_RECORD_SUFFIXES,
            marker=MANIFEST_NAME,
            write=write_array_record,
            description="ArrayRecord shards (torchgrain's, with a manifest, or TFDS's)",
            options=("codec", "max_chunk_bytes", "index_dir", "max_mapped_shards"),
            output=ARRAY_RECORD_OUTPUT,
        ),
        Format(
            "parquet",
            ParquetSource,
            PARQUET_SUFFIXES,
            write=write_parquet,
            description="Parquet files (hive-partitioned directories included)",
            options=(
                "columns",
                "decoded_cache",
                "decoded_cache_bytes",
                "partitioning",
                "max_row_group_bytes",
                "int96_timestamp_unit",
            ),
            output=PARQUET_OUTPUT,
        ),
        Format(
            "tfrecord",
            TFRecordSource,
            TFRECORD_SUFFIXES,
            write=_write_tfrecord,
            description="TFRecord files of tf.train.Example (or raw) records",
            options=("codec", "index_dir", "max_record_bytes"),
        ),
    ):
        register_format(fmt)


_register_builtins()
