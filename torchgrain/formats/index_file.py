"""Index files: a dataset's per-record offsets in one file that every process maps.

A billion-record dataset has a billion record offsets. Held in each process's heap they
cost gigabytes per DataLoader worker per rank; held in one file that every process maps
read-only, they cost the page cache once per machine, and opening the dataset is a map,
not a parse. This module is the container: named numpy arrays behind a small JSON
header, each array 64-byte aligned, written atomically (a temporary name, then a rename)
and validated on open as untrusted input (sizes, types and bounds of every array; what
the arrays hold is checked by their users: :mod:`torchgrain.sources.node_index`).

Layout (little-endian)::

    0   8   magic b"TGINDEX1"
    8   8   header length H (uint64)
    16  H   header: JSON {"kind": str, "meta": {...}, "checksum": "blake2b:<hex>",
                          "arrays": [[name, dtype, shape, offset], ...]}
    ...     the arrays, at their offsets (64-byte aligned, inside the file, disjoint)

``checksum`` is a BLAKE2b digest of every byte after the header: :meth:`IndexFile.verify`
tells a damaged file (a flipped bit in an offset would send a read to another record)
from a whole one, at the cost of reading it once.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.tgindex")
    >>> w = IndexFileWriter(path, "demo", {"a": ("<i8", ()), "b": ("|u1", (2,))})
    >>> w.append("a", np.arange(3)); w.append("a", np.arange(2))
    >>> w.append("b", np.ones((1, 2), np.uint8))
    >>> w.publish({"n": 5})
    >>> f = IndexFile.open(path, "demo")
    >>> f["a"].tolist(), f["b"].shape, f.meta, f.verify()
    ([0, 1, 2, 0, 1], (1, 2), {'n': 5}, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import mmap
import os
import struct
import uuid
from typing import Any

import numpy as np

from torchgrain.errors import CorruptDataError
from torchgrain.io import changes
from torchgrain.io.atomic import publish
from torchgrain.io.cache_records import file_identity

__all__ = ["INDEX_SUFFIX", "IndexFile", "IndexFileWriter"]

MAGIC = b"TGINDEX1"
INDEX_SUFFIX = ".tgindex"
_PREAMBLE = struct.Struct("<8sQ")
_ALIGN = 64
_MAX_HEADER = 1 << 24  # 16 MiB of JSON: far more than any index's table of arrays
_DTYPES = {k: np.dtype(k) for k in ("<i8", "<u8", "<i4", "<u4", "|u1")}
_COPY = 8 << 20


@dataclasses.dataclass(eq=False, repr=False)
class IndexFile:
    """A validated, read-only, memory-mapped index file.

    Arrays are numpy views of one map of the file (no copy; pages are shared with every
    other process mapping it). ``identity`` is the file's
    :func:`~torchgrain.io.cache_records.file_identity` when opened (device, inode, size,
    modification and change times: a rewrite in place changes it). The file is pinned
    when opened: :meth:`check` says whether it changed since (call it before reading the
    arrays again).
    """

    path: str
    kind: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    identity: tuple[int, int, int, int, int]
    _mm: mmap.mmap | None = None
    _body: int = 0
    checksum: str | None = None
    _pin: changes.Pin | None = None

    def check(self, *, polled: bool = False) -> None:
        """Raise :class:`~torchgrain.io.changes.ChangedWhileOpen` if the file was written
        or truncated since it was mapped (:mod:`torchgrain.io.changes`): its arrays would
        then be other bytes, and reading a page past a truncated end kills the process
        with SIGBUS. Readers call it before each batch that reads the arrays
        (``polled``: as :func:`torchgrain.io.changes.changed` takes it).

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "c.tgindex")
            >>> w = IndexFileWriter(path, "demo", {"a": ("<i8", ())})
            >>> w.append("a", np.arange(3)); w.publish({})
            >>> f = IndexFile.open(path, "demo")
            >>> f.check()
            >>> os.truncate(path, 8)
            >>> try:
            ...     f.check()
            ... except changes.ChangedWhileOpen as e:
            ...     print("changed while open" in str(e))
            True
        """
        if self._pin is not None:
            changes.check(self._pin, f"index file {self.path!r}", polled=polled)

    def verify(self) -> bool:
        """Whether the bytes after the header match the header's checksum (reads the
        whole file once)."""
        if self._mm is None or not isinstance(self.checksum, str):
            return False
        h = hashlib.blake2b(digest_size=16)
        view = memoryview(self._mm)
        try:
            for a in range(self._body, len(view), _COPY):
                h.update(view[a : a + _COPY])
        finally:
            view.release()
        return self.checksum == "blake2b:" + h.hexdigest()

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    @property
    def nbytes(self) -> int:
        return self.identity[2]

    @classmethod
    def open(cls, path: str, kind: str) -> IndexFile:
        """Map and validate ``path``, an index of ``kind``.

        Raises:
            FileNotFoundError: no such file.
            IsADirectoryError: a directory is there.
            CorruptDataError: not an index file of ``kind``, truncated, with an array
                table that does not fit the file, or not a regular file (a FIFO there
                is never waited on); the message names the file.
        """
        try:
            fd = changes.open_regular(path)
        except CorruptDataError:
            raise _bad(path, "not a regular file") from None
        with open(fd, "rb") as fh:
            pin = changes.Pin(fh.fileno(), path)  # before its bytes are read
            st = os.fstat(fh.fileno())
            size = st.st_size
            if size < _PREAMBLE.size:
                raise _bad(path, f"{size} bytes, too short for an index file")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            magic, hlen = _PREAMBLE.unpack_from(mm, 0)
            if magic != MAGIC:
                raise _bad(path, "not a torchgrain index file (bad magic number)")
            if hlen > _MAX_HEADER or _PREAMBLE.size + hlen > size:
                raise _bad(path, f"header of {hlen} bytes does not fit the file")
            try:
                header = json.loads(bytes(mm[_PREAMBLE.size : _PREAMBLE.size + hlen]))
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                raise _bad(path, f"unreadable header: {e}") from None
            if not isinstance(header, dict) or header.get("kind") != kind:
                got = header.get("kind") if isinstance(header, dict) else None
                raise _bad(path, f"an index of kind {got!r}, expected {kind!r}")
            meta = header.get("meta")
            table = header.get("arrays")
            if not isinstance(meta, dict) or not isinstance(table, list):
                raise _bad(path, "header lacks its meta or array table")
            arrays = _arrays(path, mm, table, _PREAMBLE.size + hlen, size)
        except BaseException:
            with contextlib.suppress(BufferError):
                mm.close()
            raise
        identity = file_identity(st)
        body = _PREAMBLE.size + hlen
        return cls(path, kind, meta, arrays, identity, mm, body, header.get("checksum"), pin)

    def __repr__(self) -> str:
        return f"IndexFile({self.path!r}, kind={self.kind!r}, arrays={sorted(self.arrays)})"


def _bad(path: str, msg: str) -> CorruptDataError:
    return CorruptDataError(f"index file {path!r}: {msg}")


def _arrays(
    path: str, mm: mmap.mmap, table: list[Any], start: int, size: int
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    spans = []
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise _bad(path, f"bad array entry {entry!r:.80}")
        name, dtype, shape, offset = entry
        if not isinstance(name, str) or name in out:
            raise _bad(path, f"bad or repeated array name {name!r:.40}")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise _bad(path, f"array {name!r} has unsupported dtype {dtype!r:.20}")
        if (
            not isinstance(shape, list)
            or not 1 <= len(shape) <= 2
            or not all(type(d) is int and 0 <= d < 1 << 48 for d in shape)
        ):
            raise _bad(path, f"array {name!r} has a bad shape {shape!r:.40}")
        dt = _DTYPES[dtype]
        count = math.prod(shape)  # (exact: numpy's product wraps around past 2**63)
        nbytes = count * dt.itemsize
        if type(offset) is not int or offset < start or offset % _ALIGN or offset + nbytes > size:
            raise _bad(
                path,
                f"array {name!r} ({nbytes} bytes at offset {offset!r:.20}) lies outside the "
                f"file's {size} bytes (truncated?)",
            )
        spans.append((offset, offset + nbytes, name))
        out[name] = np.frombuffer(mm, dtype=dt, count=count, offset=offset).reshape(shape)
    spans.sort()
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            raise _bad(path, f"arrays {a!r} and {b!r} overlap")
    return out


class IndexFileWriter:
    """Writes an index file column by column, then publishes it atomically.

    Args:
        path: the final path; nothing exists there until :meth:`publish` renames the
            finished file into place (a reader sees the old file, or the whole new one).
        kind: what the index describes (checked by :meth:`IndexFile.open`).
        columns: ``name -> (dtype, trailing shape)``; rows are appended with
            :meth:`append` (any number of calls) and kept in temporary files beside
            ``path`` meanwhile, so an index larger than memory can be written.
    """

    def __init__(self, path: str, kind: str, columns: dict[str, tuple[str, tuple[int, ...]]]):
        self.path = os.fspath(path)
        self.kind = kind
        self._tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._columns: dict[str, list[Any]] = {}
        self.checksum: str | None = None
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        base = os.path.join(directory, "." + os.path.basename(self.path))
        self._tmp = base + self._tag
        try:
            for name, (dtype, trailing) in columns.items():
                if dtype not in _DTYPES:
                    raise ValueError(f"unsupported dtype {dtype!r}")
                tmp = f"{base}.{name}{self._tag}"
                self._columns[name] = [open(tmp, "wb"), tmp, dtype, tuple(trailing), 0]  # noqa: SIM115
        except BaseException:
            self.abort()
            raise

    def append(self, name: str, rows: np.ndarray) -> None:
        fh, _, dtype, trailing, _ = col = self._columns[name]
        rows = np.ascontiguousarray(rows, dtype=_DTYPES[dtype])
        if rows.shape[1:] != trailing:
            raise ValueError(
                f"column {name!r} takes rows of shape {trailing}, got {rows.shape[1:]}"
            )
        fh.write(rows.tobytes())
        col[4] += len(rows)

    def publish(self, meta: dict[str, Any]) -> None:
        """Write the header and the columns into one file, fsync it and rename it into
        place; the temporary files are removed."""
        table = []
        for name, (fh, _, dtype, trailing, n) in self._columns.items():
            fh.flush()
            table.append([name, dtype, [n, *trailing], 10**15])
        # Offsets depend on the header's length, which depends on the offsets' digits:
        # size the header with offsets longer than any real one.
        unknown = "blake2b:" + "0" * 32  # as long as the real one, written at the end
        header = self._header(meta, table, unknown)
        start = -(-(_PREAMBLE.size + len(header)) // _ALIGN) * _ALIGN
        pos = start
        for entry in table:
            entry[3] = pos
            nbytes = int(np.prod(entry[2])) * _DTYPES[entry[1]].itemsize
            pos = -(-(pos + nbytes) // _ALIGN) * _ALIGN
        header = self._header(meta, table, unknown)
        assert _PREAMBLE.size + len(header) <= start
        tmp = self._tmp
        h = hashlib.blake2b(digest_size=16)
        try:
            with open(tmp, "wb") as out:
                out.write(_PREAMBLE.pack(MAGIC, len(header)))
                out.write(header)
                for entry, (fh, cpath, *_rest) in zip(table, self._columns.values()):
                    pad = b"\0" * (entry[3] - out.tell())
                    out.write(pad)
                    h.update(pad)
                    fh.close()
                    with open(cpath, "rb") as src:
                        while block := src.read(_COPY):
                            out.write(block)
                            h.update(block)
                self.checksum = "blake2b:" + h.hexdigest()
                final = self._header(meta, table, self.checksum)
                assert len(final) == len(header)
                out.seek(_PREAMBLE.size)
                out.write(final)
            # Flushed to disk, renamed into place, the directory entry flushed: after a
            # crash, the old index or the whole new one.
            publish(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            self.abort()

    def _header(self, meta: dict[str, Any], table: list[Any], checksum: str) -> bytes:
        doc = {"kind": self.kind, "meta": meta, "checksum": checksum, "arrays": table}
        return json.dumps(doc).encode()

    def abort(self) -> None:
        """Remove the temporary column files (publishing does this too)."""
        for fh, tmp, *_ in self._columns.values():
            with contextlib.suppress(OSError):
                fh.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._columns = {}

    def __enter__(self) -> IndexFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
