"""The writers of output shards: ArrayRecord (encoded records) and Parquet (row groups)."""

from __future__ import annotations

import contextlib
from typing import Any

from torchgrain.writers import array_record_options, records_to_table

__all__ = ["PARQUET_COMPRESSIONS", "ArrayRecordOut", "ParquetOut", "output_options"]

#: The codecs Arrow writes Parquet with (any case).
PARQUET_COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "lz4_raw", "none")

PARQUET_MAX_ROWS = 1 << 16  # rows per output row group at most


def output_options(to: str, group_size: int, compression: str | None) -> tuple[str, str]:
    """``(compression, ArrayRecord writer options)`` of an output format, defaults filled in.

    Example:
        >>> output_options("array_record", 1, None), output_options("parquet", 1, None)
        (('zstd:3', 'group_size:1,zstd:3'), ('zstd', ''))
    """
    if to == "array_record":
        compression = compression or "zstd:3"
        return compression, array_record_options(group_size, compression)
    if to == "parquet":
        compression = compression or "zstd"
        if compression.lower() not in PARQUET_COMPRESSIONS:
            # Checked here: Arrow would refuse it only when a worker opens a shard.
            raise ValueError(
                f"Parquet compression must be one of {', '.join(PARQUET_COMPRESSIONS)}, "
                f"not {compression!r}"
            )
        return compression, ""
    from torchgrain.sources.registry import output_formats

    raise ValueError(f"to must be one of {', '.join(output_formats())}, got {to!r}")


class ArrayRecordOut:
    """Writes one output ArrayRecord shard (records already encoded)."""

    def __init__(self, path: str, options: str) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        self._w = ArrayRecordWriter(path, options)

    def write(self, data: bytes) -> None:
        self._w.write(data)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class ParquetOut:
    """Writes one output Parquet file, a row group of about ``row_group_bytes`` at a time."""

    def __init__(self, path: str, compression: str, row_group_bytes: int) -> None:
        self._path = path
        self._compression = compression
        self._target = row_group_bytes
        self._writer: Any = None
        self._pending: list[dict[str, Any]] = []
        self._tables: list[Any] = []
        self._bytes = 0

    def add(self, rec: dict[str, Any]) -> None:
        self._pending.append(rec)
        if len(self._pending) >= 512:
            self._convert()

    def _convert(self) -> None:
        if self._pending:
            t = records_to_table(self._pending)
            self._pending = []
            self._tables.append(t)
            self._bytes += t.nbytes
            if self._bytes >= self._target or sum(x.num_rows for x in self._tables) >= (
                PARQUET_MAX_ROWS
            ):
                self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._tables:
            return
        table = pa.concat_tables(self._tables, promote_options="permissive")
        self._tables, self._bytes = [], 0
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._path, table.schema, compression=self._compression)
        elif not table.schema.equals(self._writer.schema):
            table = table.cast(self._writer.schema)
        self._writer.write_table(table, row_group_size=table.num_rows)

    def close(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._convert()
        self._flush()
        if self._writer is None:  # no records: an empty file with an empty schema
            pq.write_table(pa.table({}), self._path, compression=self._compression)
        else:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
