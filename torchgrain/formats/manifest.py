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

import json
from dataclasses import dataclass, field
from typing import Any

import fsspec

from torchgrain.errors import CorruptDataError

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
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
            if int(doc.get("version", 0)) > MANIFEST_VERSION:
                raise ValueError(f"manifest version {doc['version']} is newer than this torchgrain")
            shards = []
            for s in doc["shards"]:
                n = int(s["num_records"])
                if n < 0 or not isinstance(s["path"], str):
                    raise ValueError(f"bad shard entry {s!r}")
                shards.append(
                    ShardInfo(
                        path=s["path"],
                        num_records=n,
                        num_bytes=int(s.get("num_bytes", -1)),
                        checksum=s.get("checksum"),
                        file_checksum=s.get("file_checksum"),
                    )
                )
            schema = doc.get("schema") or {}
            if not isinstance(schema, dict):
                raise ValueError("schema must be an object")
            known = {"format", "version", "codec", "group_size", "num_records", "schema", "shards"}
            return cls(
                codec=str(doc["codec"]),
                shards=shards,
                schema={str(k): str(v) for k, v in schema.items()},
                group_size=int(doc.get("group_size", 1)),
                extra={k: v for k, v in doc.items() if k not in known},
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptDataError(f"invalid manifest {where}: {e}") from None


def read_manifest(fs: fsspec.AbstractFileSystem, directory: str) -> Manifest | None:
    """Read ``directory/torchgrain.json`` if present, else return None."""
    path = f"{directory.rstrip('/')}/{MANIFEST_NAME}"
    if not fs.isfile(path):
        return None
    size = fs.size(path)
    if size is not None and size > _MAX_MANIFEST_BYTES:
        raise CorruptDataError(f"manifest {path} is {size} bytes: too large to be a manifest")
    return Manifest.from_json(fs.cat_file(path), where=path)
