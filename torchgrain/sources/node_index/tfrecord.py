"""The TFRecord node index: where every record of a TFRecord dataset starts.

Built once per machine from the shards' record offsets (:func:`tfrecord_index`); see
:mod:`torchgrain.sources.node_index`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchgrain.formats.index_file import INDEX_SUFFIX
from torchgrain.io.fs import map_files
from torchgrain.sources.node_index.store import (
    _BATCH,
    _VERSION,
    COUNTERS,
    _bad,
    _build,
    _cached,
    _Index,
    _key,
    _prefix,
    _shape,
)

__all__ = ["TFRecordIndex", "tfrecord_index"]

_TF_COLUMNS = {
    "rec_base": ("<i8", ()),
    "file_size": ("<i8", ()),
    "mtime_ns": ("<i8", ()),
    "compressed": ("<i8", ()),
    "offsets": ("<i8", ()),
}


class TFRecordIndex(_Index):
    """Where every record of a TFRecord dataset starts, in one set of arrays.

    ``rec_base`` (``S + 1``), per shard ``file_size``, ``mtime_ns`` and ``compressed``
    (1: a gzip/zlib file, whose records are only counted), and per shard its records'
    byte offsets followed by its size (``offsets``: record ``i`` of shard ``s`` spans
    ``offsets[base[s] + i]`` to the next entry, ``base[s]`` counting the entries of the
    shards before it). A compressed shard has no offsets (no random access into a
    stream): only its size, so a stream of many tiny records costs nothing per record.
    """

    kind = "tfrecord"

    def _derive(self) -> None:
        a, _, where, s, n = self._counts()
        self.rec_base = _shape(a, where, "rec_base", (s + 1,))
        self.file_size = _shape(a, where, "file_size", (s,))
        self.mtime_ns = _shape(a, where, "mtime_ns", (s,))
        self.compressed = _shape(a, where, "compressed", (s,))
        counts = _prefix(self.rec_base, n, where, "rec_base")
        plain = self.compressed == 0
        entries = np.where(plain, counts, 0) + 1  # offsets, then the size
        base = np.zeros(s, np.int64)
        np.cumsum(entries[:-1], out=base[1:])
        self.offsets = _shape(a, where, "offsets", (int(entries.sum()),))
        if (
            bool((self.offsets[base + entries - 1] != self.file_size).any())
            or bool((plain & (counts > 0) & (self.offsets[base] != 0)).any())
            or bool((self.file_size < 0).any())
        ):
            raise _bad(
                where,
                "its per-shard entries are inconsistent (damaged or not made for these files)",
            )
        self.counts = counts
        #: Entry in :attr:`offsets` of each shard's first record (a private copy).
        self.base = base


def tfrecord_index(
    paths: Sequence[str],
    infos: Sequence[tuple[int, str]],
    offsets_of: Callable[[int], np.ndarray],
    compressed: np.ndarray,
    *,
    index_dir: str | None,
) -> TFRecordIndex:
    """The index of TFRecord files ``paths``: ``infos[i]`` is file ``i``'s ``(size,
    version stamp)`` (its modification time or ETag), ``offsets_of(i)`` walks (or reads
    from a per-file cache) its record offsets (its record count, ``[n]``, for a
    compressed file). Built once per machine into ``index_dir``
    (in memory when None)."""
    s = len(paths)
    sizes = np.array([size for size, _ in infos], np.int64)
    key = _key("tfrecord", [(p, size, stamp) for p, (size, stamp) in zip(paths, infos)])

    def build(out: str | None) -> TFRecordIndex:
        def fill(sink: Any) -> dict[str, Any]:
            counts = np.zeros(s, np.int64)
            for a in range(0, s, _BATCH):
                part = map_files(lambda i, a=a: offsets_of(a + i), min(_BATCH, s - a))
                for i, offs in enumerate(part):
                    if compressed[a + i]:  # its count: a stream has no offsets
                        counts[a + i] = int(offs[0])
                        sink.append("offsets", sizes[a + i : a + i + 1])
                    else:
                        counts[a + i] = len(offs)
                        sink.append("offsets", np.append(offs, sizes[a + i]))
            base = np.zeros(s + 1, np.int64)
            np.cumsum(counts, out=base[1:])
            sink.append("rec_base", base)
            sink.append("file_size", sizes)
            sink.append("mtime_ns", np.zeros(s, np.int64))
            sink.append("compressed", np.asarray(compressed, np.int64))
            meta = {
                "version": _VERSION,
                "num_shards": s,
                "num_records": int(counts.sum()),
                "key": key,
            }
            COUNTERS["tfrecord_builds"] += 1
            return meta

        return _build(TFRecordIndex, out, _TF_COLUMNS, fill)

    if index_dir is None:
        return build(None)

    def fits(ix: TFRecordIndex) -> str | None:
        why = ix.not_made_for(key, sizes)
        if why is not None:
            return why
        if not np.array_equal(ix.compressed != 0, np.asarray(compressed, bool)):
            return "it describes other files"
        return None

    name = "tfrecord-" + key + INDEX_SUFFIX
    return _cached(os.fspath(index_dir), name, TFRecordIndex, build, fits)
