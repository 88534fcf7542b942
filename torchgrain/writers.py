"""Writers: turn an iterable of record dicts into a torchgrain ArrayRecord dataset."""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Iterable, Sized
from typing import Any

from torchgrain.checksums import RecordHasher
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.io.fs import get_filesystem, is_local
from torchgrain.sources.codecs import get_codec, merge_schema
from torchgrain.sources.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    atomic_write_text,
    read_manifest,
)

__all__ = ["shard_name", "write_array_record"]


def shard_name(index: int, num_shards: int, prefix: str = "data") -> str:
    """File name of shard ``index`` of ``num_shards``.

    Example:
        >>> shard_name(3, 8)
        'data-00003-of-00008.array_record'
    """
    return f"{prefix}-{index:05d}-of-{num_shards:05d}.array_record"


def _writer_options(group_size: int, compression: str) -> str:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    allowed = ("zstd", "snappy", "brotli", "uncompressed")
    base = compression.split(":", 1)[0]
    if base not in allowed:
        raise ValueError(f"compression must be one of {allowed} (optionally 'zstd:LEVEL')")
    return f"group_size:{group_size},{compression}"


def write_array_record(
    records: Iterable[dict[str, Any]],
    directory: str | os.PathLike,
    *,
    num_shards: int = 1,
    group_size: int = 1,
    codec: str = "msgpack",
    compression: str = "zstd:3",
    prefix: str = "data",
    overwrite: bool = False,
) -> list[str]:
    """Write records as ``num_shards`` ArrayRecord files plus a JSON manifest.

    Values may be numpy arrays of any numeric/bool/bytes dtype and shape, int, float,
    str, bytes, bool, None, and lists of these. Shard sizes differ by at most one:
    when ``records`` has a length (a list, a Dataset) shard ``i`` gets a contiguous
    slice, so the dataset's global order is the input order; a plain iterator is dealt
    round-robin (record ``k`` goes to shard ``k % num_shards``).

    Every shard is written under a hidden temporary name and renamed when complete, and
    the manifest is written last, so a crash never leaves a partial shard that looks
    complete.

    Args:
        records: iterable of dicts with str keys.
        directory: output directory (created if needed). Local paths only.
        num_shards: number of shard files.
        group_size: records per ArrayRecord chunk. 1 gives the fastest random access;
            larger groups compress better and suit sequential or block-shuffled reads.
        codec: record codec name (``"msgpack"`` by default).
        compression: ``zstd[:LEVEL]``, ``snappy``, ``brotli`` or ``uncompressed``.
        prefix: shard file name prefix.
        overwrite: replace an existing torchgrain dataset in ``directory``.

    Returns:
        The shard paths, in dataset order.

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> recs = [{"x": np.full(2, i, np.uint8), "label": i} for i in range(5)]
        >>> paths = tg.write_array_record(recs, d, num_shards=2)
        >>> [p.rsplit("/", 1)[-1] for p in paths]
        ['data-00000-of-00002.array_record', 'data-00001-of-00002.array_record']
        >>> tg.ArrayRecordSource(d)[4]["label"]
        4
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    fs, root = get_filesystem(directory)
    if not is_local(fs):
        raise NotImplementedError(
            f"write_array_record writes local directories; write locally and upload {directory!r}"
        )
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    manifest_path = os.path.join(root, MANIFEST_NAME)
    if os.path.exists(manifest_path) and not overwrite:
        raise FileExistsError(
            f"{root} already holds a torchgrain dataset ({MANIFEST_NAME}); pass overwrite=True"
        )
    try:
        old = read_manifest(fs, root)
    except CorruptDataError:
        old = None  # overwriting a damaged dataset: its manifest is replaced below
    enc = get_codec(codec)
    if not callable(getattr(enc, "encode", None)):
        raise ValueError(f"codec {codec!r} cannot encode records")
    options = _writer_options(group_size, compression)

    names = [shard_name(i, num_shards, prefix) for i in range(num_shards)]
    finals = [os.path.join(root, n) for n in names]
    temps = [os.path.join(root, f".{n}.tmp-{os.getpid()}") for n in names]
    counts = [0] * num_shards
    hashers = [RecordHasher() for _ in range(num_shards)]
    schema: dict[str, str] = {}
    writers: list[Any] = []
    try:
        if isinstance(records, Sized):
            total = len(records)
            bounds = [total * i // num_shards for i in range(1, num_shards + 1)]

            def shard_of(k: int) -> int:  # contiguous slices keep the input order
                return bisect.bisect_right(bounds, k)
        else:
            total = -1

            def shard_of(k: int) -> int:  # round-robin for iterators of unknown length
                return k % num_shards

        writers = [ArrayRecordWriter(t, options) for t in temps]
        k = -1
        for k, rec in enumerate(records):
            if total >= 0 and k >= total:
                raise TorchgrainError(f"records yielded more than its length {total}")
            try:
                data = enc.encode(rec)
            except (TypeError, ValueError) as e:
                raise TypeError(f"cannot encode record {k}: {e}") from e
            s = shard_of(k)
            writers[s].write(data)
            hashers[s].update(data)
            counts[s] += 1
            if k < 10_000 or k % 1009 == 0:
                # The schema is sampled: every record early on, then a spread of them.
                schema = merge_schema(schema, rec)
        if total >= 0 and k + 1 != total:
            raise TorchgrainError(f"records yielded {k + 1} items but its length is {total}")
        for w in writers:
            w.close()
        writers = []
        # Replacing a dataset: first retire the old manifest, then every old shard, and
        # only then publish the new shards. A crash in between leaves either complete new
        # shards without a manifest (still readable, counted from their footers) or an
        # incomplete -of-N shard set, which sources refuse: never old and new mixed.
        if os.path.exists(manifest_path):
            os.unlink(manifest_path)
        if old is not None:
            for info in old.shards:
                stale = os.path.join(root, info.path)
                if os.path.exists(stale):
                    os.unlink(stale)
        shards = []
        for t, f, n, c, h in zip(temps, finals, names, counts, hashers):
            os.replace(t, f)
            shards.append(
                ShardInfo(
                    path=n, num_records=c, num_bytes=os.path.getsize(f), checksum=h.hexdigest()
                )
            )
        manifest = Manifest(codec=enc.name, shards=shards, schema=schema, group_size=group_size)
        manifest.extra["compression"] = compression
        atomic_write_text(manifest_path, manifest.to_json())
    finally:
        for w in writers:
            with contextlib.suppress(Exception):
                w.close()
        for t in temps:
            if os.path.exists(t):
                os.unlink(t)
    return finals
