"""Shard checksums: written into the manifest, checked by converters and the shard cache.

Two kinds, both BLAKE2b with a 16-byte digest:

* ``"blake2b-records:<hex>"`` for ArrayRecord shards: over every record in order, its
  length as a little-endian uint64 followed by its bytes. It does not depend on the
  ArrayRecord compression or group size, so a shard rewritten with other options keeps
  its checksum.
* ``"blake2b-file:<hex>"`` over a file's bytes (Parquet shards).

Any ``"<hashlib algorithm>:<hex>"`` (e.g. ``sha256:...``) is accepted for whole files too.

Example:
    >>> h = RecordHasher()
    >>> h.update(b"a"); h.update(b"bc")
    >>> h.hexdigest() == RecordHasher.of([b"a", b"bc"])
    True
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from collections.abc import Iterable

from torchgrain.errors import CorruptDataError
from torchgrain.io.file_hash import FILE_PREFIX, file_checksum, verify_file_hash

__all__ = ["FILE_PREFIX", "RecordHasher", "file_checksum", "verify_file", "verify_shard"]

RECORDS_PREFIX = "blake2b-records:"
_LEN = struct.Struct("<Q")
_READ_BATCH = 1024  # records read per call while verifying


class RecordHasher:
    """Incremental ``blake2b-records`` checksum of a shard's records."""

    prefix = RECORDS_PREFIX

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, record: bytes) -> None:
        self._h.update(_LEN.pack(len(record)))
        self._h.update(record)

    def hexdigest(self) -> str:
        return self.prefix + self._h.hexdigest()

    @classmethod
    def of(cls, records: Iterable[bytes]) -> str:
        h = cls()
        for r in records:
            h.update(r)
        return h.hexdigest()


def _records_checksum(path: str) -> tuple[int, str]:
    from torchgrain.formats.arrayrecord_file import ArrayRecordFile

    with ArrayRecordFile(path) as f:
        n = f.num_records
        batches = (f.read_range(a, a + _READ_BATCH) for a in range(0, n, _READ_BATCH))
        return n, RecordHasher.of(itertools.chain.from_iterable(batches))


def verify_file(path: str, checksum: str, *, name: str | None = None) -> str | None:
    """Check a local file against a manifest checksum of any supported kind; returns
    the file's ``"crc32:<hex>"`` when the check read the whole file (a whole-file hash),
    else None.

    Raises:
        CorruptDataError: on a mismatch, naming ``name`` (default: the path).
        ValueError: for an unknown checksum algorithm.
    """
    if not checksum.startswith(RECORDS_PREFIX):
        return verify_file_hash(path, checksum, name=name)
    got = _records_checksum(path)[1]
    if got != checksum.lower():
        raise CorruptDataError(
            f"{name or path}: checksum {got} does not match the manifest's {checksum}"
        )
    return None


def verify_shard(path: str, num_records: int, checksum: str | None = None) -> None:
    """Check a written shard's record count (and checksum, when given).

    Raises:
        CorruptDataError: a mismatch, naming the file.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> m = tg.convert(tg.write_array_record([{"a": 1}], d + "/in"), d + "/out")
        >>> verify_shard(f"{d}/out/{m.shards[0].path}", 1, m.shards[0].checksum)
    """
    if ".parquet" in os.path.basename(path):
        import pyarrow.parquet as pq

        n, got = pq.read_metadata(path).num_rows, None
    elif checksum is not None and checksum.startswith(RECORDS_PREFIX):
        n, got = _records_checksum(path)
    else:
        from torchgrain.formats.arrayrecord_file import read_num_records

        n, got = int(read_num_records([path])[0]), None
    if n != num_records:
        raise CorruptDataError(f"{path}: holds {n} records, expected {num_records}")
    if checksum is not None:
        if got is None:
            verify_file(path, checksum)
        elif got != checksum:
            raise CorruptDataError(
                f"{path}: record checksum {got} read back differs from the {checksum} "
                "computed while writing"
            )
