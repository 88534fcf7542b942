"""The input of a conversion: any registered format, read shard by shard through its source.

The parent process opens the source once (counts, paths, codec); each worker opens its
own from the same arguments on first use, so the job pickles small whatever the
source's index holds (a TFRecord source keeps 8 bytes per record). Records come from
``Source.iter_shard`` in order; a source that stores encoded bytes
(:class:`~torchgrain.sources.base.RecordBytesSource`) hands them over unchanged when
the output encodes records the same way (msgpack), and otherwise decodes them here so
an error can name the input file and record. With ``columns``, a format that selects
columns when reading (Parquet) reads only those; from any other, each record keeps only
those keys (so records are decoded, never passed through).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from torchgrain.errors import CorruptDataError, RecordDecodeError
from torchgrain.formats.checksums import RecordHasher
from torchgrain.formats.codecs import Codec, MsgpackCodec, get_codec
from torchgrain.io.fs import get_filesystem
from torchgrain.io.retry import RetryPolicy, current_policy, using
from torchgrain.sources import registry
from torchgrain.sources.arrayrecord import ArrayRecordSource
from torchgrain.sources.base import RecordBytesSource, Source
from torchgrain.sources.parquet import ParquetSource

__all__ = ["ConvertInput", "open_input"]


class ConvertInput:
    """A picklable description of the source of a conversion (see the module docstring)."""

    def __init__(
        self,
        fmt: str,
        src: Any,
        options: dict[str, Any],
        source: Source | None = None,
        keep: Sequence[str] | None = None,
    ) -> None:
        self.format = fmt
        self.src = src
        self.options = options
        self._source = source
        s = self.source
        self.paths: list[str] = list(s.paths)
        self.counts: list[int] = [int(c) for c in s.shard_counts]
        self.codec: Codec | None = s.codec if isinstance(s, RecordBytesSource) else None
        # The keys each record keeps (a format that cannot select columns reads them all).
        self.keep = list(keep) if keep else None
        if self.keep and s.keys is not None:
            missing = [c for c in self.keep if c not in s.keys]
            if missing:
                raise ValueError(
                    f"column {missing[0]!r} is not in {src!r}; its columns are {list(s.keys)}"
                )
        #: The Arrow types of the records' keys, in order, where the input has them (a
        #: Parquet source: its selected columns and hive partition keys); None otherwise.
        self.arrow_schema: pa.Schema | None = None
        if isinstance(s, ParquetSource):
            schema = s.arrow_schema
            self.arrow_schema = (
                schema if self.keep is None else pa.schema([schema.field(c) for c in self.keep])
            )
        # Records already msgpack-encoded can be copied as they are (all their keys kept).
        self.passthrough = type(self.codec) is MsgpackCodec and self.keep is None
        self.options = {**options, **({"codec": self.codec} if self.codec is not None else {})}

    @property
    def source(self) -> Source:
        if self._source is None:
            self._source = registry.open(self.src, format=self.format, **self.options)
        return self._source

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.options.get("storage_options")

    def filesystem(self) -> Any:
        return get_filesystem(self.paths[0], self.storage_options)[0]

    def strip(self, path: str) -> str:
        return get_filesystem(path, self.storage_options)[1]

    def records(
        self, shard: int, start: int, stop: int | None, bytes_ok: bool
    ) -> Iterator[tuple[Any, int]]:
        """``(record, input bytes)`` pairs of ``[start, stop)`` of one input shard: msgpack
        bytes when they can pass through unchanged, else dicts."""
        if self.keep is not None:
            # A key some records lack (an optional feature) is left out of those, as
            # without ``columns=``; one the whole input lacks was refused at the opening.
            for rec, n in self._records(shard, start, stop, False):
                yield {c: rec[c] for c in self.keep if c in rec}, n
            return
        yield from self._records(shard, start, stop, bytes_ok)

    def _records(
        self, shard: int, start: int, stop: int | None, bytes_ok: bool
    ) -> Iterator[tuple[Any, int]]:
        src = self.source
        if not isinstance(src, RecordBytesSource):
            for rec in src.iter_shard(shard, start, stop):
                yield rec, 0
            return
        raw = src.iter_shard_bytes(shard, start, stop)
        checksum = self._records_checksum(src, shard, start, stop)
        if checksum is not None:
            raw = _matching(raw, checksum, f"input shard {shard} ({self.paths[shard]!r})")
        if self.passthrough and bytes_ok:
            for data in raw:
                yield data, len(data)
            return
        decode = src.codec.decode
        path = self.paths[shard]
        for k, data in enumerate(raw, start):
            try:
                rec = decode(data)
            except Exception as e:
                raise RecordDecodeError(
                    f"cannot decode record {k} of {path!r} with codec {src.codec.name!r}: {e}"
                ) from e
            yield rec, len(data)

    def _records_checksum(
        self, src: Source, shard: int, start: int, stop: int | None
    ) -> str | None:
        """The checksum of the records of ``shard`` that its manifest records, where the
        read covers them all (an ArrayRecord dataset's): what is converted is checked
        against it as it is read, at no read more (records copied as they are would
        otherwise carry a damaged input's bytes into an output whose checksum vouches
        for them)."""
        if not isinstance(src, ArrayRecordSource) or start > 0:
            return None
        if stop is not None and stop < self.counts[shard]:
            return None
        manifest = src.manifest
        checksum = manifest.shards[shard].checksum if manifest is not None else None
        return checksum if checksum and checksum.startswith(RecordHasher.prefix) else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_source"] = None  # each process opens its own (small pickles)
        return state


def open_input(
    src: Any,
    src_format: str,
    codec: Any,
    storage_options: dict[str, Any] | None,
    columns: Sequence[str] | None = None,
    retry: RetryPolicy | None = None,
) -> ConvertInput:
    """Open the source of a conversion through the format registry (``tg.open``): the
    options it needs are asked of the format, and one it does not take is an error
    naming the formats that do. ``columns``: the only columns read (a format that
    selects columns) or kept (any other); one the dataset lacks is a ValueError naming
    it and the dataset's columns. ``retry``: the source's policy (each worker's too)."""
    if src_format == "auto":
        with using(retry or current_policy()):  # its lookups keep to the policy
            src_format = registry.detect_format(src, storage_options=storage_options)
    fmt = registry.get_format(src_format)
    options: dict[str, Any] = {} if retry is None else {"retry": retry}
    if storage_options is not None:
        options["storage_options"] = storage_options
    if codec not in ("auto", None) or fmt.accepts("codec"):
        options["codec"] = codec if isinstance(codec, str) else get_codec(codec)
    if fmt.accepts("cache_bytes"):
        options["cache_bytes"] = 0  # every block is read once: no cache
    if isinstance(columns, str):
        raise TypeError("columns must be a sequence of column names, not a string")
    keep = list(columns) if columns else None
    if keep and fmt.accepts("columns"):
        options["columns"] = keep  # read only these (the source names a missing one)
        keep = None
    source = registry.open(src, format=fmt.name, **options)
    return ConvertInput(fmt.name, src, options, source, keep)


def _matching(records: Iterator[bytes], checksum: str, where: str) -> Iterator[bytes]:
    """``records``, checked once all are read against the manifest's ``checksum`` of them
    (:class:`~torchgrain.formats.checksums.RecordHasher`).

    Raises:
        CorruptDataError: they do not match (damaged, or replaced since the manifest
            was written), naming ``where``.
    """
    hasher = RecordHasher()
    for data in records:
        hasher.update(data)
        yield data
    got = hasher.hexdigest()
    if got != checksum.lower():
        raise CorruptDataError(
            f"{where}: its records' checksum {got} does not match its manifest's {checksum}: "
            "the shard is damaged, or was replaced after the manifest was written"
        )
