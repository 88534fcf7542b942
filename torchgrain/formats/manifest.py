"""The JSON manifest torchgrain writes beside its ArrayRecord shards.

With a manifest, opening a 10,000-shard dataset reads one small file instead of every
shard's footer. Layout (``torchgrain.json`` in the dataset directory)::

    {"format": "torchgrain/array_record", "version": 1, "codec": "msgpack",
     "group_size": 1, "num_records": 1000, "schema": {"image": "uint8[64,64,3]"},
     "shards": [{"path": "data-00000-of-00002.array_record", "num_records": 500,
                 "num_bytes": 65536}, ...]}

Shard paths are relative to the directory, so a dataset can be moved or uploaded whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from torchgrain.errors import CorruptDataError
from torchgrain.io import remote

# Kept importable from here (older code writes manifests with it).
from torchgrain.io.atomic import atomic_write_text as atomic_write_text

MANIFEST_NAME = "torchgrain.json"
MANIFEST_FORMAT = "torchgrain/array_record"
MANIFEST_VERSION = 1
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024


@dataclass
class ShardInfo:
    """One shard as the manifest lists it."""

    path: str
    num_records: int
    num_bytes: int = -1
    checksum: str | None = None
    #: ``blake2b-file:<hex>`` of the shard file's bytes: what a downloaded copy is
    #: checked against when present (hashing a file is about 10x cheaper than
    #: decoding every record for ``checksum``).
    file_checksum: str | None = None


@dataclass
class Manifest:
    """A dataset directory's manifest.

    Example:
        >>> m = Manifest(codec="msgpack", shards=[ShardInfo("a.array_record", 3)])
        >>> Manifest.from_json(m.to_json()).num_records
        3
    """

    codec: str
    shards: list[ShardInfo]
    schema: dict[str, str] = field(default_factory=dict)
    group_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_records(self) -> int:
        return sum(s.num_records for s in self.shards)

    def to_json(self) -> str:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "codec": self.codec,
            "group_size": self.group_size,
            "num_records": self.num_records,
            "schema": self.schema,
            "shards": [{k: v for k, v in vars(s).items() if v is not None} for s in self.shards],
        }
        doc.update(self.extra)
        return json.dumps(doc, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest: every field of the type and range it must have.

        Raises:
            CorruptDataError: naming ``where`` and, for a bad shard entry, the shard's
                number and path.

        Example:
            >>> Manifest.from_json('{"format": "torchgrain/array_record", "codec": "msgpack", '
            ...                    '"shards": [{"path": "", "num_records": 1}]}', where="m.json")
            Traceback (most recent call last):
            ...
            torchgrain.errors.CorruptDataError: invalid manifest m.json: shard 0 (''): path is empty
        """
        try:
            doc = json.loads(text)
        except RecursionError:
            raise CorruptDataError(f"invalid manifest {where}: JSON nested too deeply") from None
        except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            raise CorruptDataError(f"invalid manifest {where}: not JSON ({e})") from None
        try:
            return cls._from_doc(doc)
        except _Invalid as e:
            raise CorruptDataError(f"invalid manifest {where}: {e}") from None

    @classmethod
    def _from_doc(cls, doc: Any) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise _Invalid(f"not a {MANIFEST_FORMAT} manifest")
        version = _int(doc.get("version", 0), "version", 0, 2**31)
        if version > MANIFEST_VERSION:
            raise _Invalid(f"manifest version {version} is newer than this torchgrain")
        codec = doc.get("codec")
        if not isinstance(codec, str) or not codec:
            raise _Invalid(f"codec must be a non-empty string, not {codec!r}")
        entries = doc.get("shards")
        if not isinstance(entries, list):
            raise _Invalid(f"shards must be a list, not {type(entries).__name__}")
        shards = []
        seen: dict[str, int] = {}
        for k, s in enumerate(entries):
            shard = _shard(k, s)
            first = seen.setdefault(shard.path, k)
            if first != k:
                raise _Invalid(
                    f"shard {k} ({shard.path!r}) is listed twice (also as shard {first})"
                )
            shards.append(shard)
        total = sum(s.num_records for s in shards)
        if total > MAX_RECORDS:
            raise _Invalid(f"the shards hold {total} records in all, more than {MAX_RECORDS}")
        if (
            "num_records" in doc
            and _int(doc["num_records"], "num_records", 0, MAX_RECORDS) != total
        ):
            raise _Invalid(
                f"num_records is {doc['num_records']} but the shards hold {total} records"
            )
        schema = doc.get("schema") or {}
        if not isinstance(schema, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in schema.items()
        ):
            raise _Invalid("schema must be an object of strings")
        known = {"format", "version", "codec", "group_size", "num_records", "schema", "shards"}
        return cls(
            codec=codec,
            shards=shards,
            schema=dict(schema),
            group_size=_int(doc.get("group_size", 1), "group_size", 1, MAX_RECORDS),
            extra={k: v for k, v in doc.items() if k not in known},
        )


#: Records one manifest may declare (per shard and in all): beyond any real dataset, and
#: far from int64 overflow in the prefix sums of the index.
MAX_RECORDS = 2**48
#: Bytes one shard may declare.
MAX_SHARD_BYTES = 2**50


class _Invalid(ValueError):
    """What is wrong with a manifest (the caller names the manifest)."""


def _int(value: Any, field: str, lo: int, hi: int) -> int:
    """``value`` if it is an integer in ``[lo, hi]`` (JSON ``true`` and ``1.0`` are not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"{field} must be an integer, not {value!r:.60}")
    if not lo <= value <= hi:
        raise _Invalid(f"{field} is {value}, outside [{lo}, {hi}]")
    return value


#: Checksum algorithms a manifest may name (``ALGORITHM:HEX``; a bare digest is sha256):
#: what the shard cache can verify a download against.
CHECKSUM_ALGORITHMS = frozenset(
    {"blake2b-records", "blake2b-file"}
    | {a for a in hashlib.algorithms_guaranteed if not a.startswith("shake_")}
)
_CHECKSUM = re.compile(r"(?:([A-Za-z0-9_-]+):)?([0-9a-fA-F]{8,256})")


def _checksum(value: Any, field: str) -> None:
    """Refuse a checksum the cache could not verify (it would fail at download, unnamed)."""
    if not isinstance(value, str):
        raise _Invalid(f"{field} must be a string, not {value!r:.60}")
    m = _CHECKSUM.fullmatch(value)
    if m is None:
        raise _Invalid(f"{field} {value!r:.80} is not ALGORITHM:HEX_DIGEST")
    if m[1] is not None and m[1] not in CHECKSUM_ALGORITHMS:
        raise _Invalid(
            f"{field} {value!r:.80} names an unknown algorithm; known: "
            f"{', '.join(sorted(CHECKSUM_ALGORITHMS))}"
        )


def _shard(k: int, s: Any) -> ShardInfo:
    if not isinstance(s, dict):
        raise _Invalid(f"shard {k} must be an object, not {type(s).__name__}")
    path = s.get("path")
    try:
        if not isinstance(path, str):
            raise _Invalid("path must be a string")
        if not path:
            raise _Invalid("path is empty")
        if "\0" in path:
            raise _Invalid("path contains a NUL character")
        n = _int(s.get("num_records"), "num_records", 0, MAX_RECORDS)
        num_bytes = _int(s.get("num_bytes", -1), "num_bytes", -1, MAX_SHARD_BYTES)
        checksum, file_checksum = s.get("checksum"), s.get("file_checksum")
        for name, value in (("checksum", checksum), ("file_checksum", file_checksum)):
            if value is not None:
                _checksum(value, name)
    except _Invalid as e:
        raise _Invalid(f"shard {k} ({path!r:.200}): {e}") from None
    return ShardInfo(path, n, num_bytes, checksum, file_checksum)


def read_manifest(fs: fsspec.AbstractFileSystem, directory: str) -> Manifest | None:
    """Read ``directory/torchgrain.json`` if present, else return None.

    At most ``_MAX_MANIFEST_BYTES`` are read, whatever the file's reported size.
    """
    path = f"{directory.rstrip('/')}/{MANIFEST_NAME}"
    if not remote.isfile(fs, path):
        return None
    text = remote.cat_file(fs, path, url=path, what="manifest read", limit=_MAX_MANIFEST_BYTES)
    return Manifest.from_json(text, where=path)
