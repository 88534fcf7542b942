"""Sources: random access to sharded datasets, one module per format, one registry.

Every source implements :class:`Source` (``len``, ``src[i]``, ``__getitems__``,
``keys``, ``schema``); the sharded ones build on :class:`ShardedSource` (paths,
per-process readers, retry, parallel extraction, counters), read as one
:class:`ReadOptions` says, and find records through a :class:`ShardIndex`. The registry
finds a format by name or file names: :func:`open` opens any registered format, and a
new format is a :class:`ShardFormat` (open a :class:`ShardFile`, read rows with a
:class:`ShardReader`, optionally :class:`ReadsByteRanges`, :class:`IndexesShards`,
:class:`ReadsBatches` and :class:`EncodedFormat`) that :class:`FormatSource`
reads with all of the above, plus a :func:`register_format` call with its :class:`Format`
(``torchgrain inspect``, ``bench`` and ``convert`` then know it). Codecs turn an
encoded record's bytes into a dict; :func:`get_codec` finds one by name and
:func:`register_codec` adds one. Other packages'
formats load through the ``torchgrain.formats`` entry-point group (:func:`load_plugins`),
and :func:`merge_schema` builds a source's ``schema`` from its records. :func:`read_column`
reads one column of any source or dataset the cheapest way (a Parquet column alone).

Example:
    >>> import tempfile, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_array_record([{"x": i} for i in range(3)], d)
    >>> src = tg.sources.open(d, options=tg.sources.ReadOptions(cache_bytes=0))
    >>> isinstance(src, tg.sources.ArrayRecordSource), src[2]
    (True, {'x': 2})
    >>> sorted(tg.sources.formats())
    ['array_record', 'parquet', 'tfrecord']
"""

from torchgrain.formats.codecs import get_codec, merge_schema, register_codec
from torchgrain.sources.arrayrecord import ArrayRecordSource
from torchgrain.sources.base import ShardedSource, Source
from torchgrain.sources.column import read_column
from torchgrain.sources.format import (
    EncodedFormat,
    FormatSource,
    IndexesShards,
    ReadsBatches,
    ReadsByteRanges,
    ShardCounts,
    ShardFile,
    ShardFormat,
    ShardReader,
)
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.options import ReadOptions
from torchgrain.sources.parquet import ParquetSource
from torchgrain.sources.registry import (
    Format,
    detect_format,
    formats,
    get_format,
    load_plugins,
    open,
    output_formats,
    register_format,
)
from torchgrain.sources.tfrecord import TFRecordFormat, TFRecordSource

__all__ = [
    "ArrayRecordSource",
    "EncodedFormat",
    "Format",
    "FormatSource",
    "IndexesShards",
    "ParquetSource",
    "ReadOptions",
    "ReadsBatches",
    "ReadsByteRanges",
    "ShardCounts",
    "ShardFile",
    "ShardFormat",
    "ShardIndex",
    "ShardReader",
    "ShardedSource",
    "Source",
    "TFRecordFormat",
    "TFRecordSource",
    "detect_format",
    "formats",
    "get_codec",
    "get_format",
    "load_plugins",
    "merge_schema",
    "open",
    "output_formats",
    "read_column",
    "register_codec",
    "register_format",
]
