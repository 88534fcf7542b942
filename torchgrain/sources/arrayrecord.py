"""ArrayRecordSource: random access, key-value records over sharded ArrayRecord files."""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from torchgrain.diagnostics import COUNTER, local_counters
from torchgrain.errors import CorruptDataError, DatasetNotFoundError, RecordDecodeError
from torchgrain.io.fs import expand_paths, get_filesystem, is_local
from torchgrain.sources._index import ShardIndex, group_by_shard
from torchgrain.sources.arrayrecord_file import ArrayRecordFile, read_num_records
from torchgrain.sources.codecs import Codec, describe_value, get_codec, sniff_codec
from torchgrain.sources.manifest import Manifest, read_manifest
from torchgrain.sources.tfds import tfds_codec_for

__all__ = ["ArrayRecordSource"]

ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")


class ArrayRecordSource:
    """Random-access, key-value view of one or many ArrayRecord shards.

    Args:
        paths: a dataset directory (with or without a ``torchgrain.json`` manifest), a
            glob, a single file, a list of these, or fsspec URLs (``s3://``, ``gs://``,
            ``http(s)://``, ...).
        codec: ``"auto"`` (the manifest's codec, else sniffed from the first record),
            ``"msgpack"``, ``"raw"`` (records as ``{"bytes": b}``), ``"tf_example"``,
            or any registered codec name or codec object. For TFDS output (a directory
            with ``features.json``), ``"auto"`` and ``"tf_example"`` decode records per
            the feature spec (:class:`~torchgrain.sources.tfds.TFDSCodec`: images to
            arrays, scalars squeezed, tensors reshaped); the files must be of one split.
        storage_options: fsspec options for remote paths (e.g. ``endpoint_url``).
        filesystem: an fsspec filesystem to use instead of inferring one.
        verify_checksums: verify Riegeli chunk hashes on every read.

    Opening reads the manifest (one small file) or, without one, every shard's footer
    (in parallel). No file handle is kept in the object: each process opens its own
    readers on first use, so the source is safe to use before forking DataLoader
    workers, pickles small, and works with ``spawn``/``forkserver``.

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record(
        ...     [{"image": np.zeros((2, 2), np.uint8), "label": i} for i in range(10)], d,
        ...     num_shards=3)
        >>> src = tg.ArrayRecordSource(d)
        >>> len(src), src.keys, src.schema["image"]
        (10, ['image', 'label'], 'uint8[2,2]')
        >>> [r["label"] for r in src.__getitems__([9, 0, 5])]
        [9, 0, 5]
    """

    #: Tells :class:`~torchgrain.Dataset` that this source times its own reads.
    reports_stats = True

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        codec: str | Codec = "auto",
        storage_options: dict[str, Any] | None = None,
        filesystem: fsspec.AbstractFileSystem | None = None,
        verify_checksums: bool = False,
    ) -> None:
        self._verify = verify_checksums
        manifest, fs, files = self._resolve(paths, storage_options, filesystem)
        self._fs = fs
        self.paths: list[str] = files
        if manifest is not None:
            counts = np.array([s.num_records for s in manifest.shards], dtype=np.int64)
        else:
            counts = read_num_records(files, filesystem=fs)
        self.index = ShardIndex(counts)
        self.manifest = manifest
        self._files: list[ArrayRecordFile | None] = [None] * len(files)
        if manifest is None and isinstance(codec, str) and codec in ("auto", "tf_example"):
            # TFDS output: decode per its features.json (images, shapes, scalars).
            codec = tfds_codec_for(files, fs) or codec
        if codec == "auto":
            codec = manifest.codec if manifest is not None else self._sniff()
        self.codec: Codec = get_codec(codec)
        self._schema: dict[str, str] | None = (
            dict(manifest.schema) if manifest is not None and manifest.schema else None
        )

    # ----------------------------------------------------------------- opening
    @staticmethod
    def _resolve(
        paths: Any,
        storage_options: dict[str, Any] | None,
        filesystem: fsspec.AbstractFileSystem | None,
    ) -> tuple[Manifest | None, fsspec.AbstractFileSystem, list[str]]:
        if isinstance(paths, (str, os.PathLike)):
            if filesystem is not None:
                fs, root = filesystem, filesystem._strip_protocol(os.fspath(paths))
            else:
                fs, root = get_filesystem(paths, storage_options)
            if not any(ch in root for ch in "*?[") and fs.isdir(root):
                manifest = read_manifest(fs, root)
                if manifest is not None:
                    files = [posixpath.join(root, s.path) for s in manifest.shards]
                    if not is_local(fs):
                        files = [fs.unstrip_protocol(f) for f in files]
                    missing = [f for f in files[:1] + files[-1:] if not fs.exists(f)]
                    if missing:
                        raise DatasetNotFoundError(
                            f"shard {missing[0]!r} listed in the manifest of {os.fspath(paths)!r} "
                            "does not exist"
                        )
                    return manifest, fs, files
        fs, files = expand_paths(
            paths,
            suffixes=ARRAY_RECORD_SUFFIXES,
            storage_options=storage_options,
            filesystem=filesystem,
            kind="ArrayRecord",
        )
        return None, fs, files

    def _sniff(self) -> str:
        if len(self.index) == 0:
            return "msgpack"
        shard, row = self.index.locate_one(0)
        return sniff_codec(self._file(shard).read([row])[0])

    def _file(self, shard: int) -> ArrayRecordFile:
        f = self._files[shard]
        if f is None:
            f = ArrayRecordFile(
                self.paths[shard],
                filesystem=None if is_local(self._fs) else self._fs,
                verify_checksums=self._verify,
            )
            self._files[shard] = f
        return f

    # ------------------------------------------------------------ the contract
    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_shards(self) -> int:
        return self.index.num_shards

    @property
    def schema(self) -> dict[str, str]:
        """Record key -> type description (e.g. ``uint8[64,64,3]``, ``int``, ``str``)."""
        if self._schema is None:
            if len(self) == 0:
                self._schema = {}
            else:
                self._schema = {k: describe_value(v) for k, v in self[0].items()}
        return dict(self._schema)

    @property
    def keys(self) -> list[str]:
        """The record keys (column names)."""
        return list(self.schema)

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, row = self.index.locate_one(index)
        return self._read_decode(shard, [row], [index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Read a batch: each shard is read once, records come back in request order."""
        idx = self.index.check(indices)
        if len(idx) == 0:
            return []
        shards, rows = self.index.locate(idx)
        out: list[Any] = [None] * len(idx)
        for shard, shard_rows, positions in group_by_shard(shards, rows):
            records = self._read_decode(shard, shard_rows, idx[positions].tolist())
            for p, rec in zip(positions.tolist(), records):
                out[p] = rec
        return out

    def block_offsets(self) -> np.ndarray:
        """Global record offsets of ArrayRecord chunks (for :class:`BlockShuffleSampler`).

        Starts at 0 and ends at ``len(self)``; reads every shard's footer.
        """
        parts = [np.zeros(1, dtype=np.int64)]
        for shard in range(self.num_shards):
            offs = self._file(shard).record_offsets
            parts.append(offs[1:] + self.index.offsets[shard])
        return np.concatenate(parts)

    def close(self) -> None:
        """Close any open readers of this process (they reopen on next use)."""
        for f in self._files:
            if f is not None:
                f.close()

    # ---------------------------------------------------------------- helpers
    def _read_decode(
        self, shard: int, rows: Sequence[int] | np.ndarray, indices: list[int]
    ) -> list[dict[str, Any]]:
        """Read rows of one shard (one call) and decode them; errors name file and index."""
        counters = local_counters()
        t0 = time.perf_counter()
        try:
            blobs = self._file(shard).read(rows)
        except CorruptDataError as e:
            raise type(e)(
                f"{e} (shard {shard} of {self.num_shards}, reading record index {indices[0]})"
            ) from e
        t1 = time.perf_counter()
        counters[COUNTER["bytes_read"]] += sum(len(b) for b in blobs)
        counters[COUNTER["read_seconds"]] += t1 - t0
        decode = self.codec.decode
        try:
            out = [decode(b) for b in blobs]
        except Exception:
            # Find the culprit (the fast path above does not track positions).
            for b, row, index in zip(blobs, np.asarray(rows).tolist(), indices):
                self._decode_one(b, shard, row, index)
            raise
        counters[COUNTER["decode_seconds"]] += time.perf_counter() - t1
        return out

    def _decode_one(self, data: bytes, shard: int, row: int, index: int) -> dict[str, Any]:
        try:
            return self.codec.decode(data)
        except Exception as e:
            detail = str(e) if isinstance(e, RecordDecodeError) else f"{type(e).__name__}: {e}"
            raise RecordDecodeError(
                f"cannot decode record {index} (shard {shard} {self.paths[shard]!r}, row {row}) "
                f"with codec {getattr(self.codec, 'name', self.codec)!r}: {detail}"
            ) from (None if isinstance(e, RecordDecodeError) else e)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = [None] * len(self.paths)  # readers are per process
        return state

    def __repr__(self) -> str:
        return (
            f"ArrayRecordSource(num_records={len(self)}, num_shards={self.num_shards}, "
            f"codec={self.codec.name!r}, keys={self.keys if self._schema else '?'})"
        )
