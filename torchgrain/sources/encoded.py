"""EncodedSource: sharded sources whose records are encoded bytes (ArrayRecord, TFRecord).

A codec turns each record's bytes into a dict. What such sources share is written
here once: a batch read (one read per shard, shards of a remote batch in parallel, the
shard cache's downloads overlapped), decoding with errors that name the shard, row and
record index, reading a shard in order (``iter_shard``, ``iter_shard_bytes``), and the
schema from the first record. A format adds ``_read_rows`` (the raw records at some rows
of one shard) and ``iter_shard_bytes``, and may add ``_read_batch`` and ``_read_single``
(a faster path for the records it covers). Errors that a read raises get the shard and
record index from one helper, :func:`~torchgrain.sources.format.name_error`.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from torchgrain.columns import ColumnBatch
from torchgrain.diagnostics import count_decode, count_read
from torchgrain.errors import CorruptDataError
from torchgrain.formats.codecs import Codec, describe_value
from torchgrain.io import changes
from torchgrain.sources.base import ShardedSource, shard_rows
from torchgrain.sources.format import (
    decode_columns,
    decode_record,
    decode_records,
    name_error,
    shard_where,
)

__all__ = ["EncodedSource"]


class EncodedSource(ShardedSource):
    """Base of sharded sources of encoded records (see the module docstring)."""

    codec: Codec
    #: The format's name in errors ("ArrayRecord", "TFRecord").
    format_name: str
    _schema: dict[str, str] | None = None
    _mapped: Any = None  # the format's map of the shards in this process (not pickled)
    # Each local shard's change time (st_ctime_ns) at the dataset's opening (8 bytes a
    # shard, pickled with the source); None for remote shards.
    _ctimes: np.ndarray | None = None

    # ------------------------------------------------------------ for formats
    @abc.abstractmethod
    def _read_rows(self, shard: int, rows: np.ndarray, index: int, reader: Any) -> list[bytes]:
        """Raw records at ``rows`` of ``shard`` in one call, through :meth:`_io`.

        ``index`` is the first requested record's global index (for messages);
        ``reader`` an already opened reader of the shard, or None.
        """

    @abc.abstractmethod
    def iter_shard_bytes(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[bytes]:
        """The raw records ``[start, stop)`` of one shard, in order."""

    def _read_batch(self, idx: np.ndarray) -> list[bytes] | None:
        """Raw records at checked global indices ``idx``, in request order, read for the
        whole batch at once, with no Python work per shard (a dataset-wide index and
        all shards in one address space); None (the default) reads shard by shard.
        Errors name the shard, file and record index."""
        return None

    def _read_single(self, shard: int, row: int, index: int) -> bytes | None:
        """The raw record at ``row`` of ``shard`` (global ``index``) by the format's
        fastest way for one record, or None (the default) to read it as a batch of one.
        Errors name the shard, file and record index."""
        return None

    def _check_readable(self, shard: int, index: int) -> None:
        """Refuse random access to a shard that has none (e.g. a compressed file)."""

    # ------------------------------------------------------------ the contract
    @property
    def schema(self) -> dict[str, str]:
        """Record key -> type description, from the first record unless recorded."""
        if self._schema is None:
            nonempty = np.flatnonzero(self.shard_counts)
            first = next(self.iter_shard(int(nonempty[0]), 0, 1), None) if len(nonempty) else None
            self._schema = {} if first is None else {k: describe_value(v) for k, v in first.items()}
        return dict(self._schema)

    def _check_index(self) -> None:
        """Read this process's file events once for the operation
        (:func:`torchgrain.io.changes.poll`: the reads that follow check their maps
        against it), and raise if the node-shared index file the source maps changed
        since it was opened (reading its arrays could kill the process with SIGBUS)."""
        changes.poll()
        ix = self._node_index()
        if ix is not None:
            ix.check_unchanged(polled=True)

    def _check_opened(self, shard: int) -> None:
        """Raise if local ``shard`` is not the file the dataset's opening saw (its change
        time differs: :func:`~torchgrain.io.changes.changed_since_opening`). Called once
        a process's reader has pinned the file (a change from then on is the pin's to
        see), not per read."""
        ctimes = self._ctimes
        if ctimes is None:
            return
        path = self._paths[shard]
        if os.stat(path).st_ctime_ns != ctimes[shard]:
            raise changes.changed_since_opening(shard, path)

    def _node_index(self) -> Any:
        """The source's node-shared index (:mod:`torchgrain.sources.node_index`), if any."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_mapped"] = None  # maps belong to one process
        return state

    def __getitem__(self, index: int) -> dict[str, Any]:
        self._check_index()
        shard, row = self.index.locate_one(index)
        self._check_readable(shard, index)
        t0 = time.perf_counter()
        index = int(index)
        data = self._read_single(shard, row, index)
        if data is not None:
            return self._decode_blobs([data], t0, lambda: ([shard], [row], [index]))[0]
        return self._read_decode(shard, np.array([row]), np.array([index]))[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Read a batch: each shard once, the remote ones concurrently; request order."""
        self._check_index()
        idx = self.index.check(indices)
        t0 = time.perf_counter()
        blobs = self._read_batch(idx) if len(idx) else None
        if blobs is not None:
            return self._decode_blobs(blobs, t0, lambda: self._where(idx))
        return self._read_groups(idx, self._read_decode)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        """The records at ``indices`` as columns, decoded for the whole batch at once when
        the codec has a column form (``decode_columns``: msgpack, raw), else built from
        the decoded records."""
        self._check_index()
        idx = self.index.check(indices)
        if len(idx) == 0:
            return ColumnBatch.from_records([])
        t0 = time.perf_counter()
        blobs = self._read_batch(idx)
        if blobs is None:
            blobs = self._read_groups(idx, self._read_named)
        t1 = time.perf_counter()
        count_read(t1 - t0, sum(map(len, blobs)))
        batch = decode_columns(
            self.codec, blobs, lambda: self._decode_all(blobs, lambda: self._where(idx))
        )
        count_decode(time.perf_counter() - t1)
        return batch

    def iter_shard(
        self, shard: int, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records ``[start, stop)`` of one shard, in order (compressed files too)."""
        start, stop = shard_rows(self.index.counts, shard, start, stop)
        base = int(self.index.offsets[shard])
        for row, data in enumerate(self.iter_shard_bytes(shard, start, stop), start):
            yield self._decode(data, shard, row, base + row)

    # ---------------------------------------------------------------- reading
    def _where(self, idx: np.ndarray) -> tuple[list, list, list]:
        """The shard, row and index of each of checked indices ``idx`` (for messages)."""
        shards, rows = self.index._locate(idx)
        return shards.tolist(), rows.tolist(), idx.tolist()

    def _read_groups(
        self, idx: np.ndarray, read: Callable[[int, np.ndarray, np.ndarray, Any], list[Any]]
    ) -> list[Any]:
        """The reader path of a batch: ``read(shard, rows, indices, reader)`` once per
        shard (remote ones concurrently, the shard cache's downloads overlapped; without
        one, the batch's ranges fetched across its shards at once and each shard read as
        soon as its ranges are in, while the rest arrive), in request order."""
        groups = self.index.split(idx)

        def one(g: tuple[int, np.ndarray, Any], reader: Any = None) -> list[Any]:
            return read(g[0], g[1], idx if g[2] is None else idx[g[2]], reader)

        for shard, _, positions in groups:
            self._check_readable(shard, int(idx[0 if positions is None else positions[0]]))
        return self._read_shard_groups(groups, len(idx), one)

    def _read_decode(
        self, shard: int, rows: np.ndarray, indices: np.ndarray, reader: Any = None
    ) -> list[dict[str, Any]]:
        """Read rows of one shard (one call) and decode them; errors name file and index."""
        t0 = time.perf_counter()
        blobs = self._read_named(shard, rows, indices, reader)
        return self._decode_blobs(
            blobs, t0, lambda: ([shard] * len(blobs), rows.tolist(), indices.tolist())
        )

    def _read_named(
        self, shard: int, rows: np.ndarray, indices: np.ndarray, reader: Any
    ) -> list[bytes]:
        """:meth:`_read_rows`, its errors naming the shard and the record: of bad data in
        several rows, the first row that fails alone (read again one by one)."""
        try:
            return self._read_rows(shard, rows, int(indices[0]), reader)
        except CorruptDataError as e:
            at = int(indices[0])
            for j in range(len(rows) if len(rows) > 1 else 0):
                try:
                    self._read_rows(shard, rows[j : j + 1], int(indices[j]), reader)
                except CorruptDataError:
                    at = int(indices[j])
                    break
            raise self._named(e, shard, at) from e

    def _in_order(self, shard: int, start: int, records: Iterable[bytes]) -> Iterator[bytes]:
        """``records`` of ``shard`` from row ``start`` on (a format's read in order), a
        read error naming the shard and the index of the record read from."""
        index = int(self.index.offsets[shard]) + max(start, 0)
        try:
            for data in records:
                yield data
                index += 1
        except CorruptDataError as e:
            raise self._named(e, shard, index) from e

    def _shard_where(self, shard: int) -> str:
        return shard_where(self.format_name, shard, self.num_shards, self._paths[shard])

    def _named(self, e: CorruptDataError, shard: int, index: int | None) -> CorruptDataError:
        """``e`` naming the shard, file and record index it was reading (when not yet
        said; ``index`` None: the shard alone, a later read adds its record), as every
        read of every format does (:func:`name_error`), the formats' own fast paths too."""
        return name_error(e, self._shard_where(shard), index) or e  # type: ignore[return-value]

    def _decode_blobs(
        self, blobs: list[bytes], t0: float, where: Callable[[], tuple[list, list, list]]
    ) -> list[dict[str, Any]]:
        """Count the read that began at ``t0`` and decode ``blobs`` (in one call where
        the codec has a batch decode). On a failure the records are decoded again one
        by one, so that the error names the record: ``where()`` gives each blob's
        shard, row and index."""
        t1 = time.perf_counter()
        count_read(t1 - t0, sum(map(len, blobs)))
        out = self._decode_all(blobs, where)
        count_decode(time.perf_counter() - t1)
        return out

    def _decode_all(
        self, blobs: list[bytes], where: Callable[[], tuple[list, list, list]]
    ) -> list[dict[str, Any]]:
        """Decode ``blobs`` (:func:`decode_records`; ``where()`` gives each blob's shard,
        row and index)."""

        def named() -> Iterator[tuple[str, int, int]]:
            for shard, row, index in zip(*where()):
                yield self._shard_where(shard), row, index

        return decode_records(self.codec, blobs, named)

    def _decode(self, data: bytes, shard: int, row: int, index: int) -> dict[str, Any]:
        return decode_record(self.codec, data, self._shard_where(shard), row, index)
