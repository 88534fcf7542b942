"""What the footers of a Parquet dataset's files say, read once when a source opens.

For every file (in parallel threads; remote footers through the retry policy): its
row-group sizes (checked to agree with the footer's total), its Arrow schema, each row
group's uncompressed size of the selected columns (the estimate of its decoded size
that caches and ``max_row_group_bytes`` use), and what identifies the file's content
(for the decoded disk cache's keys).

Example:
    >>> import os, tempfile, fsspec, pyarrow as pa, pyarrow.parquet as pq
    >>> d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"x": list(range(5))}), f"{d}/a.parquet", row_group_size=2)
    >>> counts, schemas, nbytes, ids = read_footers(
    ...     fsspec.filesystem("file"), [f"{d}/a.parquet"], RetryPolicy())
    >>> counts[0].tolist(), schemas[0].names, len(nbytes[0])
    ([2, 2, 1], ['x'], 3)
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchgrain.errors import CorruptDataError, DatasetNotFoundError, RemoteIOError, UnsafePathError
from torchgrain.formats.parquet_pages import footer_chunks
from torchgrain.io import changes, remote
from torchgrain.io.fs import is_local, map_files
from torchgrain.io.retry import RetryPolicy, retry_call
from torchgrain.io.shard_cache import ShardTooLargeError
from torchgrain.sources.parquet.schema import is_list_type

__all__ = ["MAX_FOOTER_BYTES", "bounded_footer", "local_version", "read_footers"]

#: The longest Parquet footer (its serialized metadata) a file may declare: pyarrow
#: holds all of it before it parses it, whatever the file's bytes on disk (a sparse
#: file may claim a 1 GiB footer in a few KiB). Footers of files with thousands of
#: columns and row groups take a few MiB.
MAX_FOOTER_BYTES = 64 << 20

_TAIL_READ = 64 << 10  # what pyarrow reads first of a file's end


def read_footers(
    fs: fsspec.AbstractFileSystem,
    files: list[str],
    retry: RetryPolicy,
    columns: list[str] | None = None,
    int96_timestamp_unit: str = "ns",
) -> tuple[list[np.ndarray], list[pa.Schema], list[np.ndarray], list[tuple[Any, ...]]]:
    """From the footers of every file (read in parallel): row-group sizes, the Arrow
    schema (INT96 timestamps at ``int96_timestamp_unit``, as the source decodes them),
    each row group's uncompressed size (of ``columns``: an estimate of its decoded size)
    and what identifies the file's content (path, size, modification time and inode,
    or the store's version, and a digest of the footer)."""
    local = is_local(fs)
    opening = uuid.uuid4().hex

    def footer(f: Any, size: int) -> tuple[pq.FileMetaData, pa.Schema, Any]:
        source = bounded_footer(f, size)
        with pq.ParquetFile(source, coerce_int96_timestamp_unit=int96_timestamp_unit) as pf:
            return pf.metadata, pf.schema_arrow, footer_bytes(source, pf.metadata)

    def metadata(shard: int) -> tuple[pq.FileMetaData, pa.Schema, Any, tuple[Any, ...]]:
        path = files[shard]
        try:
            if local:
                # (a FIFO's open would wait for a writer: refused)
                with open(changes.open_regular(path), "rb") as f:
                    st = os.fstat(f.fileno())
                    return *footer(f, st.st_size), local_version(st)
            # An opening reads the file as it is now (not against what an earlier
            # opening in this process pinned of it: a file re-uploaded since).
            # (keyed as every pin of the file is: the path without its protocol)
            rpath = fs._strip_protocol(path)
            with remote.open_input(fs, rpath, url=path, fresh=True) as f:
                md, schema, raw = footer(f, f.seek(0, io.SEEK_END))
            size, version = remote.size_and_version(fs, rpath, url=path)
            # Nothing tells two versions of this file apart: its entries are this
            # opening's own (shared by its workers, never by a later opening).
            unversioned = ("unversioned", opening)
            return md, schema, raw, (size, version if version is not None else unversioned)
        except FileNotFoundError as e:
            raise DatasetNotFoundError(f"Parquet shard {path!r} does not exist") from e
        except (pa.ArrowException, OSError, ValueError) as e:
            cause = _not_the_bytes(e)
            if cause is e:
                raise
            if cause is not None:
                raise cause from e
            raise CorruptDataError(
                f"cannot read the Parquet footer of {path!r} (shard {shard} of {len(files)}): {e}"
            ) from e

    def one(shard: int) -> tuple[np.ndarray, pa.Schema, np.ndarray, tuple[Any, ...]]:
        if local:
            md, schema, footer, version = metadata(shard)
        else:
            md, schema, footer, version = retry_call(
                metadata, shard, url=files[shard], policy=retry, what="footer read"
            )
        groups = [md.row_group(i) for i in range(md.num_row_groups)]
        counts = np.array([g.num_rows for g in groups], dtype=np.int64)
        # A footer's counts index every record: they must be counts, and agree.
        if (counts < 0).any() or float(counts.sum(dtype=np.float64)) != md.num_rows:
            raise CorruptDataError(
                f"the Parquet footer of {files[shard]!r} (shard {shard} of {len(files)}) "
                f"says {md.num_rows} rows but its row groups hold {counts.tolist()[:8]}"
            )
        if columns is None:
            nbytes = [g.total_byte_size for g in groups]
        else:
            leaves = _selected_leaves(schema, set(columns))
            nbytes = _selected_bytes(footer, md.num_row_groups, leaves, files, shard)
        # A digest of the footer (row-group layout, statistics...) identifies the content.
        identity = (files[shard], version, hashlib.sha256(memoryview(footer)).hexdigest())
        return counts, schema, np.array(nbytes, dtype=np.int64), identity

    results = map_files(one, len(files))
    return tuple([r[i] for r in results] for i in range(4))  # type: ignore[return-value]


def bounded_footer(f: Any, size: int) -> Any:
    """What pyarrow opens to read the footer of the Parquet file ``f`` (of ``size``
    bytes): the footer, read here, behind the two magic numbers (the reads pyarrow would
    make: its last 64 KiB, then the rest of a longer footer), or ``f`` itself when its
    tail is not a plain footer's (pyarrow then says what is wrong). Pyarrow reads
    whatever length a footer declares before parsing it: one longer than
    :data:`MAX_FOOTER_BYTES` is refused first.

    Raises:
        CorruptDataError: the footer declares more than :data:`MAX_FOOTER_BYTES`.

    Example:
        >>> import io, pyarrow as pa, pyarrow.parquet as pq
        >>> buf = io.BytesIO(); pq.write_table(pa.table({"x": [1, 2]}), buf)
        >>> f = io.BytesIO(buf.getvalue())
        >>> pq.ParquetFile(bounded_footer(f, len(buf.getvalue()))).metadata.num_rows
        2
        >>> fake = b"PAR1" + bytes(100) + (1 << 30).to_bytes(4, "little") + b"PAR1"
        >>> bounded_footer(io.BytesIO(fake), len(fake))
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: its footer declares 1073741824 bytes (the file holds 112), more than ...
    """
    take = min(size, _TAIL_READ)
    f.seek(size - take)
    tail = _read_exactly(f, take)
    if take < 12 or tail[-4:] not in (b"PAR1", b"PARE"):
        f.seek(0)
        return f  # (not a footer pyarrow reads: its own error names what is wrong)
    n = int.from_bytes(tail[-8:-4], "little")
    if n > MAX_FOOTER_BYTES:
        raise CorruptDataError(
            f"its footer declares {n} bytes (the file holds {size}), more than "
            f"MAX_FOOTER_BYTES={MAX_FOOTER_BYTES} allows"
        )
    if tail[-4:] != b"PAR1" or n > size - 12:  # (encrypted, or longer than the file)
        f.seek(0)
        return f
    if n + 8 > take:
        f.seek(size - 8 - n)
        tail = _read_exactly(f, n + 8 - take) + tail
    return pa.BufferReader(b"PAR1" + tail[-8 - n :])


def footer_bytes(source: Any, md: pq.FileMetaData) -> Any:
    """The serialized footer that :func:`bounded_footer` gave pyarrow as ``source``: the
    file's own bytes (what identifies its content), not serialized again by pyarrow,
    which kills the process (SIGSEGV) on some footers it reads without complaint (a
    column order cut short, pyarrow 26); a ``source`` that is the file itself (a footer
    pyarrow read by its own means) is serialized by pyarrow.

    Example:
        >>> import io, pyarrow as pa, pyarrow.parquet as pq
        >>> buf = io.BytesIO(); pq.write_table(pa.table({"x": [1, 2]}), buf)
        >>> data = buf.getvalue()
        >>> source = bounded_footer(io.BytesIO(data), len(data))
        >>> n = int.from_bytes(data[-8:-4], "little")
        >>> bytes(footer_bytes(source, pq.ParquetFile(source).metadata)) == data[-8 - n : -8]
        True
    """
    if isinstance(source, pa.BufferReader):
        source.seek(0)
        return source.read_buffer()[4:-8]
    return md.__reduce__()[1][0]


def _read_exactly(f: Any, n: int) -> bytes:
    data = f.read(n)
    while len(data) < n:  # (a raw read may return less)
        more = f.read(n - len(data))
        if not more:
            raise CorruptDataError(f"the file ended {n - len(data)} bytes early")
        data += more
    return data


def _selected_bytes(
    footer: bytes, num_row_groups: int, leaves: list[int], files: list[str], shard: int
) -> list[int]:
    """Each row group's uncompressed size of the column chunks ``leaves``, read from the
    serialized footer by torchgrain's own parser: pyarrow's ``RowGroupMetaData.column``
    aborts the process on some hostile footers (statistics that do not fit their
    column's type: a C++ exception it does not catch)."""
    try:
        groups = footer_chunks(bytes(footer))
        if len(groups) != num_row_groups or any(j >= len(g) for g in groups for j in leaves):
            raise CorruptDataError("its row groups do not list every column chunk")
    except CorruptDataError as e:
        raise CorruptDataError(
            f"cannot read the Parquet footer of {files[shard]!r} (shard {shard} of "
            f"{len(files)}): {e}"
        ) from e
    return [sum(g[j].total_uncompressed_size for j in leaves) for g in groups]


#: What a read raises that says nothing of the file's bytes: a refused redirect, access
#: denied (HTTP 401/403), retries run out, a shard too large for the shard cache's budget.
#: Never a corrupt file.
NOT_THE_BYTES = (UnsafePathError, PermissionError, RemoteIOError, ShardTooLargeError)


def _not_the_bytes(exc: BaseException) -> BaseException | None:
    """The error behind ``exc`` that is not about the file's bytes (Arrow re-raises what a
    read raised, or wraps it), if any."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, NOT_THE_BYTES):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _selected_leaves(schema: pa.Schema, wanted: set[str]) -> list[int]:
    """Parquet leaf-column numbers of the top-level fields named in ``wanted``."""

    def leaves(t: pa.DataType) -> int:
        if pa.types.is_struct(t):
            return sum(leaves(f.type) for f in t)
        if pa.types.is_map(t):
            return leaves(t.key_type) + leaves(t.item_type)
        if is_list_type(t):
            return leaves(t.value_type)
        return 1

    out, at = [], 0
    for field in schema:
        n = leaves(field.type)
        if field.name in wanted:
            out.extend(range(at, at + n))
        at += n
    return out


def local_version(st: os.stat_result) -> tuple[int, ...]:
    """What tells versions of a local file apart: its size and modification time, and
    its inode and change time. The last two catch a file replaced under the same name,
    size and modification time (``cp -p``, ``rsync -t``): the kernel sets the change
    time on every write, rename or ``utime``, and no one can set it back."""
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
