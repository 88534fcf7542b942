"""Whole-file checksums: ``blake2b-file:<hex>`` or ``[hashlib algorithm:]<hex>``.

The I/O layer's integrity check (the shard cache verifies downloads with it). Checksums
that need to understand a file's format (``blake2b-records`` over an ArrayRecord file's
records) live in :mod:`torchgrain.formats.checksums`, which falls back to this module.

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "f")
    >>> _ = open(path, "wb").write(b"abc")
    >>> c = file_checksum(path)
    >>> c.startswith("blake2b-file:"), verify_file_hash(path, c)
    (True, 'crc32:352441c2')
"""

from __future__ import annotations

import hashlib
import zlib

from torchgrain.errors import CorruptDataError

__all__ = [
    "FILE_PREFIX",
    "file_checksum",
    "hash_file",
    "hash_file_and_crc",
    "verify_file_hash",
]

FILE_PREFIX = "blake2b-file:"


def hash_file(path: str, algo: str) -> str:
    """Hex digest of a local file with ``algo`` (``blake2b-file`` or a hashlib name)."""
    return _hash(path, algo, crc=False)[0]


def hash_file_and_crc(path: str, algo: str) -> tuple[str, str]:
    """``(hex digest with algo, "crc32:<hex>")`` of a local file, read once: the shard
    cache checks a download against the manifest's hash and records its CRC (what later
    uses check the copy against) from the same pass.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(path, "wb").write(b"abc")
        >>> hash_file_and_crc(path, "sha256")[1]
        'crc32:352441c2'
    """
    return _hash(path, algo, crc=True)


def _hash(path: str, algo: str, *, crc: bool) -> tuple[str, str]:
    h = hashlib.blake2b(digest_size=16) if algo == "blake2b-file" else hashlib.new(algo)
    value = 0
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
            if crc:
                value = zlib.crc32(block, value)
    return h.hexdigest(), f"crc32:{value:08x}" if crc else ""


def file_checksum(path: str) -> str:
    """``blake2b-file`` checksum of a local file."""
    return FILE_PREFIX + hash_file(path, "blake2b-file")


def verify_file_hash(path: str, checksum: str, *, name: str | None = None) -> str:
    """Check a local file against a whole-file checksum; returns the file's
    ``"crc32:<hex>"``, from the same read.

    Raises:
        CorruptDataError: on a mismatch, naming ``name`` (default: the path).
        ValueError: for an algorithm that is not a whole-file hash.
    """
    algo, _, digest = checksum.rpartition(":")
    algo = algo or "sha256"
    try:
        got, crc = hash_file_and_crc(path, algo)
    except ValueError:
        raise ValueError(f"unknown checksum algorithm {algo!r} in {checksum!r}") from None
    if got != digest.lower():
        raise CorruptDataError(
            f"{name or path}: checksum {algo}:{got} does not match the manifest's {checksum}"
        )
    return crc
