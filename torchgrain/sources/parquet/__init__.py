"""Parquet: ``ParquetSource`` (source), file and hive resolution (paths), schema merging
(schema) and the conversion of Arrow columns to records and batch columns (values)."""

from torchgrain.sources.parquet.paths import PARQUET_SUFFIXES
from torchgrain.sources.parquet.schema import arrow_type_name, common_type, merge_types
from torchgrain.sources.parquet.source import ParquetSource

__all__ = ["PARQUET_SUFFIXES", "ParquetSource", "arrow_type_name", "common_type", "merge_types"]
