"""The TFRecord node index: where every record of a TFRecord dataset starts.

Built once per machine from the shards' record offsets (:func:`tfrecord_index`); see
:mod:`torchgrain.sources.node_index`. The offsets are streamed into the index file as
each shard is walked, a chunk at a time: the build holds a bounded number of bytes
whatever the number of records, and nothing per record once the index is published.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from torchgrain.formats.index_file import INDEX_SUFFIX
from torchgrain.io.libc import trim_heap
from torchgrain.sources.node_index import store
from torchgrain.sources.node_index.store import (
    COUNTERS,
    VERSION,
    BuildProgress,
    NodeIndex,
    build_index,
    cached_index,
    check_shape,
    dataset_name,
    in_order,
    index_error,
    index_key,
)

__all__ = ["TFRecordIndex", "tfrecord_index"]

_TF_COLUMNS = dict.fromkeys(
    ("rec_base", "file_size", "mtime_ns", "compressed", "offsets"), ("<i8", ())
)


# What a file walked as it is written holds at once: about one chunk of offsets.
_CHUNK_COST = 1 << 20


class TFRecordIndex(NodeIndex):
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
        a, _, where, s, counts = self._counts()
        self.compressed = check_shape(a, where, "compressed", (s,))
        plain = self.compressed == 0
        entries = np.where(plain, counts, 0) + 1  # offsets, then the size
        base = np.zeros(s, np.int64)
        np.cumsum(entries[:-1], out=base[1:])
        self.offsets = check_shape(a, where, "offsets", (int(entries.sum()),))
        if (
            bool((self.offsets[base + entries - 1] != self.file_size).any())
            or bool((plain & (counts > 0) & (self.offsets[base] != 0)).any())
            or bool((self.file_size < 0).any())
        ):
            raise index_error(
                where,
                "its per-shard entries are inconsistent (damaged or not made for these files)",
            )
        self.counts = counts
        #: Entry in :attr:`offsets` of each shard's first record (a private copy).
        self.base = base


def tfrecord_index(
    paths: Sequence[str],
    infos: Sequence[tuple[int, str]],
    offsets_of: Callable[[int], Iterable[np.ndarray]],
    compressed: np.ndarray,
    *,
    index_dir: str | None,
    lock_wait: float | None = None,
) -> TFRecordIndex:
    """The index of TFRecord files ``paths``: ``infos[i]`` is file ``i``'s ``(size,
    version stamp)`` (its modification and change times and inode, or ETag), ``offsets_of(i)`` walks (or reads
    from a per-file cache) its record offsets, as int64 arrays in order (a chunked walk:
    :func:`~torchgrain.formats.tfrecord.iter_tfrecord_offsets`); a compressed file's
    gives its record count, ``[n]``. Built once per machine into ``index_dir`` (in
    memory when None); ``lock_wait`` bounds a wait for another process's build (see
    :func:`~torchgrain.sources.node_index.store.cached_index`).

    Built in bounded memory: files are walked in parallel threads, each file's offsets
    written into the index file as soon as the files before it are, while the offsets
    walked and not yet written stay within
    :data:`~torchgrain.sources.node_index.store.BUILD_BYTES` (a file's offsets take at
    most 8 bytes per 16 bytes of file); a file whose offsets may take more than a
    quarter of that is walked as it is written, a chunk at a time. A build of more than
    a few seconds reports its progress on stderr.

    Example:
        >>> import numpy as np
        >>> ix = tfrecord_index(["a", "b"], [(40, "1"), (16, "2")],
        ...                     lambda i: [np.array([0, 20])] if i == 0 else [np.array([0])],
        ...                     np.zeros(2, bool), index_dir=None)
        >>> ix.counts.tolist(), ix.offsets.tolist()
        ([2, 1], [0, 20, 40, 0, 16])
    """
    s = len(paths)
    sizes = np.array([size for size, _ in infos], np.int64)
    key = index_key("tfrecord", [(p, size, stamp) for p, (size, stamp) in zip(paths, infos)])

    def build(out: str | None) -> TFRecordIndex:
        budget = store.BUILD_BYTES

        def peek(i: int) -> tuple[int, int]:
            cost = 8 if compressed[i] else int(sizes[i]) // 2
            # A file too large to hold is walked as it is written (its cost: a chunk).
            return (i, cost) if cost <= budget // 4 else (-1 - i, _CHUNK_COST)

        def walk(i: int) -> Iterable[np.ndarray]:
            return list(offsets_of(i)) if i >= 0 else offsets_of(-1 - i)

        def fill(sink: Any) -> dict[str, Any]:
            counts = np.zeros(s, np.int64)
            progress = BuildProgress(s, dataset_name(paths))
            for k, parts in enumerate(in_order(s, peek, walk, budget=budget)):
                n = 0
                for part in parts:
                    if compressed[k]:  # its count: a stream has no offsets
                        n = int(part[0])
                    else:
                        n += len(part)
                        sink.append("offsets", part)
                    del part
                del parts  # its chunks go now, not when the next file comes
                counts[k] = n
                sink.append("offsets", sizes[k : k + 1])
                progress.update(k + 1)
            progress.close()
            sink.append("rec_base", np.concatenate([[0], np.cumsum(counts)]))
            sink.append("file_size", sizes)
            sink.append("mtime_ns", np.zeros(s, np.int64))
            sink.append("compressed", np.asarray(compressed, np.int64))
            COUNTERS["tfrecord_builds"] += 1
            return {
                "version": VERSION,
                "num_shards": s,
                "num_records": int(counts.sum()),
                "key": key,
            }

        ix = build_index(TFRecordIndex, out, _TF_COLUMNS, fill)
        trim_heap()  # what the walks freed in the build threads' malloc arenas
        return ix

    if index_dir is None:
        return build(None)

    def fits(ix: TFRecordIndex) -> str | None:
        same = np.array_equal(ix.compressed != 0, np.asarray(compressed, bool))
        return ix.not_made_for(key, sizes) or (None if same else "it describes other files")

    name = "tfrecord-" + key + INDEX_SUFFIX
    return cached_index(os.fspath(index_dir), name, TFRecordIndex, build, fits, deadline=lock_wait)
