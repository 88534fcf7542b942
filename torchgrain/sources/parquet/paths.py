"""Which files make a Parquet dataset, and the hive ``key=value`` directories above them."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any
from urllib.parse import unquote

import fsspec
import numpy as np
import pyarrow as pa

from torchgrain.errors import DatasetNotFoundError, SchemaMismatchError
from torchgrain.io.fs import canonical_local_path, expand_paths, get_filesystem, has_glob, is_local

PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_INT_RE = re.compile(r"0|-?[1-9][0-9]*")


def resolve(
    paths: Any,
    storage_options: dict[str, Any] | None,
    filesystem: fsspec.AbstractFileSystem | None,
    *,
    allow_external: bool = False,
) -> tuple[fsspec.AbstractFileSystem, list[str], list[str]]:
    """Expand ``paths`` to files; also return, per file, the base directory of its item.

    What a listing finds is confined to the item's directory (see
    :func:`~torchgrain.io.fs.expand_paths`) unless ``allow_external``.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise DatasetNotFoundError("no Parquet paths given")
    fs: fsspec.AbstractFileSystem | None = filesystem
    bases: dict[str, str] = {}  # file -> the base directory of its first item
    for item in items:
        item_fs, found = expand_paths(
            item,
            suffixes=PARQUET_SUFFIXES,
            storage_options=storage_options,
            filesystem=filesystem,
            kind="Parquet",
            allow_external=allow_external,
        )
        if fs is None:
            fs = item_fs
        elif item_fs is not fs and item_fs.protocol != fs.protocol:
            raise ValueError(
                f"Parquet paths mix filesystems ({fs.protocol} and {item_fs.protocol}); "
                "give one filesystem's paths"
            )
        text = os.fspath(item)
        if filesystem is None:
            stripped = get_filesystem(text, storage_options, allow_redirects=allow_external)[1]
        else:
            stripped = filesystem._strip_protocol(text)
            if is_local(filesystem):
                stripped = canonical_local_path(stripped)
        stripped = stripped.rstrip("/")
        if has_glob(stripped, item_fs):
            prefix = stripped[: min(stripped.index(c) for c in "*?[" if c in stripped)]
            base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        elif len(found) == 1 and item_fs._strip_protocol(found[0]).rstrip("/") == stripped:
            base = posixpath.dirname(stripped)  # a single file: no partition directories
        else:
            base = stripped
        for f in found:
            bases.setdefault(f, base)
    assert fs is not None
    return fs, list(bases), list(bases.values())


def partitions(
    fs: fsspec.AbstractFileSystem, files: list[str], bases: list[str]
) -> list[dict[str, str | None]]:
    """Hive ``key=value`` directory names between each file and its base directory."""
    out = []
    for f, base in zip(files, bases):
        path = fs._strip_protocol(f)
        rel = path[len(base) :].lstrip("/") if base and path.startswith(base) else path
        parts: dict[str, str | None] = {}
        for seg in rel.split("/")[:-1]:
            if "=" not in seg:
                continue
            key, _, value = seg.partition("=")
            key = unquote(key)
            if key:
                parts[key] = None if value == _HIVE_NULL else unquote(value)
        out.append(parts)
    return out


def check_partition_keys(files: list[str], parts: list[dict[str, str | None]]) -> list[str]:
    if not files:
        return []
    keys = list(parts[0])
    for f, p in zip(files, parts):
        if set(p) != set(keys):
            raise SchemaMismatchError(
                f"hive partition keys differ: {files[0]!r} has {keys} but {f!r} has {list(p)}"
            )
    return keys


def partition_values(values: list[str | None]) -> tuple[np.ndarray, pa.DataType]:
    """Per-shard values of one partition key, as int64 when all are integers."""
    present = [v for v in values if v is not None]
    typ: pa.DataType = pa.string()
    if present and all(_INT_RE.fullmatch(v) and abs(int(v)) < 2**63 for v in present):
        typ = pa.int64()
        values = [None if v is None else int(v) for v in values]
    return np.array(values, dtype=object), typ
