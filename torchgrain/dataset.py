"""Dataset: a lazily loaded, map-style ``torch.utils.data.Dataset`` over a source.

Transforms are recorded, not applied eagerly: ``Dataset(src).map(f).random_map(g)``
returns a new Dataset whose ``__getitems__`` reads a whole batch from the source in one
call (grouped by shard) and then runs ``f`` and ``g`` on each record. ``map_batch(h)``
runs ``h`` once on the whole list of records instead (a vectorised map).

Random transforms get a :class:`numpy.random.Generator` derived from
``(seed, epoch, record index, transform position)`` only, so augmentation is identical
whatever the number of DataLoader workers, the batch size, the prefetch depth or the
point a run was resumed from, and differs between epochs.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import multiprocessing.context
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from torchgrain import shm
from torchgrain._worker_batches import (
    WORKER_PIPE_BYTES,
    collate_columns,
    grow_pipe_once,
    start_columns_batch,
)
from torchgrain.adapters import SequenceSource, checked_batch
from torchgrain.columns import ColumnBatch, Ragged
from torchgrain.diagnostics import COUNTER, PipelineStats, local_counters
from torchgrain.protocols import ReadsAhead, SetsEpoch
from torchgrain.sources.base import Source

__all__ = ["Dataset", "EpochCell", "collate_columns", "describe_fn", "record_rng"]

_MASK64 = (1 << 64) - 1


_RNG_PERSON = b"torchgrain.rng"
_PACK6 = struct.Struct("<6Q").pack
_SEED_SEQUENCE = np.random.SeedSequence(0)
_tls = threading.local()


def _pcg_state(seed: int, epoch: int, index: int, stream: int) -> dict[str, Any]:
    """Hash (seed, epoch, index, stream) into a full 128-bit PCG64 state and increment."""
    msg = _PACK6(
        seed & _MASK64,
        (seed >> 64) & _MASK64,
        epoch & _MASK64,
        (epoch >> 64) & _MASK64,
        index & _MASK64,
        stream & _MASK64,
    )
    d = hashlib.blake2b(msg, digest_size=32, person=_RNG_PERSON).digest()
    return {
        "bit_generator": "PCG64",
        "state": {
            "state": int.from_bytes(d[:16], "little"),
            "inc": int.from_bytes(d[16:], "little") | 1,
        },
        "has_uint32": 0,
        "uinteger": 0,
    }


def record_rng(seed: int, epoch: int, index: int, stream: int = 0) -> np.random.Generator:
    """The generator ``random_map`` hands to its function for one record.

    Derived from ``(seed, epoch, index, stream)`` alone, by hashing (BLAKE2b) into a full
    PCG64 state, never from global random state. Seeds may be any 128-bit integer;
    ``stream`` tells apart several random transforms in one chain.

    Example:
        >>> a = record_rng(0, 1, 42).integers(1 << 30)
        >>> b = record_rng(0, 1, 42).integers(1 << 30)
        >>> bool(a == b), bool(a == record_rng(0, 2, 42).integers(1 << 30))
        (True, False)
    """
    bg = np.random.PCG64(_SEED_SEQUENCE)
    bg.state = _pcg_state(seed, epoch, index, stream)
    return np.random.Generator(bg)


def _call_with_rng(
    fn: Callable[[Any, np.random.Generator], Any],
    rec: Any,
    seed: int,
    epoch: int,
    index: int,
    stream: int,
) -> Any:
    """``fn(rec, rng)`` with :func:`record_rng`'s generator, re-using one bit generator
    per thread (~5 us per record less than a fresh one).

    The bit generator leaves the thread's slot for the call: a function that reads another
    augmented dataset (a mixup partner) seeds one of its own there, not this record's.
    """
    bg = _tls.__dict__.pop("bg", None) or np.random.PCG64(_SEED_SEQUENCE)
    bg.state = _pcg_state(seed, epoch, index, stream)
    try:
        return fn(rec, np.random.Generator(bg))
    finally:
        _tls.bg = bg


class EpochCell:
    """The current epoch, shared with DataLoader worker processes.

    Persistent workers keep the Dataset they were started with, so a plain attribute
    set in the main process would never reach them. The value lives in a shared-memory
    int64 that forked workers inherit and spawned workers receive while being started;
    pickled any other way (e.g. ``copy.deepcopy``), the cell becomes a private copy.

    Example:
        >>> cell = EpochCell(3)
        >>> cell.set(4)
        >>> cell.get()
        4
    """

    __slots__ = ("_shared", "_value")

    def __init__(self, epoch: int = 0) -> None:
        self._value = int(epoch)
        try:
            self._shared = multiprocessing.RawValue("q", int(epoch))
        except OSError:  # pragma: no cover - no shared memory available
            self._shared = None

    def get(self) -> int:
        return int(self._shared.value) if self._shared is not None else self._value

    def set(self, epoch: int) -> None:
        self._value = int(epoch)
        if self._shared is not None:
            self._shared.value = int(epoch)

    def __getstate__(self) -> tuple[int, Any]:
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return self.get(), (self._shared if spawning else None)

    def __setstate__(self, state: tuple[int, Any]) -> None:
        self._value, self._shared = state


def _call_columns_fn(fn: Callable[[ColumnBatch], Any], batch: ColumnBatch) -> ColumnBatch:
    rows = len(batch)
    keys = list(dict.keys(batch))  # before fn, which may add to the batch in place
    out = fn(batch)
    if not isinstance(out, dict):
        raise TypeError(
            f"map_batch function {_name_of(fn)} must return the "
            f"batch's columns (a ColumnBatch or dict), got {type(out).__name__}"
        )
    if not isinstance(out, ColumnBatch):
        out = ColumnBatch(out, num_rows=rows)
    if len(out) != rows:
        raise TypeError(
            f"map_batch function {_name_of(fn)} returned {len(out)} rows for a batch of {rows}"
        )
    for key in keys:
        # A column of the batch that lost rows would pair its values with other records'
        # (a new key may hold the whole batch's values, of any length).
        col = dict.get(out, key)
        if (isinstance(col, (Ragged, list)) or getattr(col, "ndim", 0)) and len(col) != rows:
            raise TypeError(
                f"map_batch function {_name_of(fn)} returned column {key!r} of "
                f"{len(col)} rows for a batch of {rows}"
            )
    return out


def _call_batch_fn(fn: Callable[[list[Any]], Any], records: list[Any]) -> list[Any]:
    out = fn(records)
    if not isinstance(out, list) or len(out) != len(records):
        got = f"a list of {len(out)}" if isinstance(out, list) else type(out).__name__
        raise TypeError(
            f"map_batch function {_name_of(fn)} must return a "
            f"list of {len(records)} records (one per input record), got {got}"
        )
    return out


def _name_of(fn: Any) -> str:
    """A function's ``__name__``, else its type's name (a callable object, a partial)."""
    return getattr(fn, "__name__", type(fn).__name__)


def describe_fn(fn: Any) -> str:
    """``module.qualname (file:line)`` of a function, a callable object or a partial: how
    errors name a user's function.

    Example:
        >>> describe_fn(describe_fn).split(" ")[0]
        'torchgrain.dataset.describe_fn'
    """
    target = fn.func if isinstance(fn, functools.partial) else fn
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object: where its class defines __call__
        code = getattr(type(target).__call__, "__code__", None)
        name = getattr(target, "__qualname__", None) or type(target).__qualname__
        module = getattr(target, "__module__", None) or type(target).__module__
    else:
        name, module = target.__qualname__, target.__module__
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{module}.{name}{where}"


class Dataset(torch.utils.data.Dataset):
    """Map-style dataset over a torchgrain source (or anything indexable with a length).

    Args:
        source: a :class:`~torchgrain.Source` (:class:`~torchgrain.ArrayRecordSource`,
            :class:`~torchgrain.ParquetSource`, ...), or any object with ``__len__`` and
            ``__getitem__`` (a list, a torch dataset, another Dataset), which is adapted
            once by :class:`~torchgrain.adapters.SequenceSource` (its
            ``__getitems__`` is used when present, for batched reads).
        worker_pipe_bytes: in a DataLoader worker (on Linux), grow the pipe that carries
            the worker's batches to the main process to this size at the first batch
            (default 1 MiB, the usual system limit; ``0`` leaves it alone). Batches of
            raw bytes then reach the main process about 1.5x faster.
        batch_format: ``"records"`` (default): ``__getitems__`` returns a list of records
            and the DataLoader's collate stacks them. ``"columns"``: a batch is read as
            columns (:class:`~torchgrain.columns.ColumnBatch`: one array per key,
            built by the source straight from the bytes it decodes where it can) and
            the DataLoader's default collate hands it over as a dict of tensors without
            copying (:class:`~torchgrain.columns.Ragged` for variable-length values),
            from workers through shared memory. ``map``/``random_map`` still see one
            record at a time; ``map_batch`` gets the :class:`ColumnBatch`.
        worker_slots: with ``batch_format="columns"``, each DataLoader worker (on Linux)
            writes batches into up to this many reusable shared-memory buffers that the
            main process maps once, and reuses a buffer only after the main process has
            dropped every tensor of the batch in it and the worker holds none of its
            arrays (default 8). Receiving a batch then
            costs the main process a few microseconds instead of a fresh shared-memory
            segment per batch. Batches beyond that (a loop that keeps many) and ``0``
            take torch's own path.

    Capabilities (:mod:`torchgrain.protocols`) are the source's: ``block_offsets()``
    (what :class:`~torchgrain.BlockShuffleSampler` keeps its reads inside; a
    ``TypeError`` saying why over a plain sequence) and ``read_ahead(...)`` (samplers hand
    it each pass; a no-op over a source without it) are offered (:meth:`offers`) only
    when its source has them, so ``isinstance(ds, HasBlockOffsets)`` and
    ``isinstance(ds, ReadsAhead)`` say so.

    Example:
        >>> import tempfile, numpy as np, torch, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": np.full(3, i, np.float32)} for i in range(8)], d)
        >>> def jitter(rec, rng):
        ...     return {"x": rec["x"] + rng.normal(size=3).astype(np.float32)}
        >>> ds = tg.Dataset(tg.ArrayRecordSource(d)).map(lambda r: {"x": r["x"] * 2})
        >>> ds = ds.random_map(jitter, seed=0)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=4)
        >>> next(iter(loader))["x"].shape
        torch.Size([4, 3])
        >>> bool((ds[3]["x"] == ds[3]["x"]).all())   # same seed, epoch, index: same result
        True
    """

    def __init__(
        self,
        source: Any,
        *,
        worker_pipe_bytes: int = WORKER_PIPE_BYTES,
        batch_format: str = "records",
        worker_slots: int = shm.MAX_SLOTS,
    ) -> None:
        # Adapted once, here (SequenceSource refuses what has no __len__ and __getitem__):
        # from now on the source is read through the Source contract.
        self._source: Source = (
            source
            if isinstance(source, Source)
            else SequenceSource(source, describes_records=isinstance(source, Dataset))
        )
        for name, value in (
            ("worker_pipe_bytes", worker_pipe_bytes),
            ("worker_slots", worker_slots),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if batch_format not in ("records", "columns"):
            raise ValueError(f"batch_format must be 'records' or 'columns', got {batch_format!r}")
        self._worker_slots = worker_slots
        self._worker_pipe_bytes = worker_pipe_bytes
        self.batch_format = batch_format
        self._ops: tuple[tuple[Any, ...], ...] = ()
        self._epoch = EpochCell(0)
        self._stats = PipelineStats()

    def offers(self, capability: type) -> bool:
        """Whether ``capability`` (:mod:`torchgrain.protocols`) works here: the source's
        (``set_epoch`` always does: random transforms follow the epoch).

        Example:
            >>> from torchgrain.protocols import HasBlockOffsets, SetsEpoch
            >>> Dataset([1, 2]).offers(HasBlockOffsets), Dataset([1, 2]).offers(SetsEpoch)
            (False, True)
        """
        return capability is SetsEpoch or isinstance(self._source, capability)

    # ---------------------------------------------------------- composition
    def _derive(self, op: tuple[Any, ...]) -> Dataset:
        """A Dataset that applies ``op`` (a name, its callable and its arguments) too."""
        if not callable(op[1]):
            raise TypeError(f"{op[0]} needs a callable")
        child = Dataset.__new__(Dataset)  # a plain Dataset, whatever the class of self
        child._source = self._source
        child._worker_pipe_bytes = self._worker_pipe_bytes
        child._worker_slots = self._worker_slots
        child.batch_format = self.batch_format
        child._ops = (*self._ops, op)
        child._epoch = EpochCell(self._epoch.get())
        child._stats = PipelineStats()
        return child

    def map(self, fn: Callable[[dict[str, Any]], Any]) -> Dataset:
        """Return a Dataset that applies ``fn(record)`` to every record.

        Example:
            >>> ds = Dataset([{"a": 1}, {"a": 2}]).map(lambda r: r["a"] * 10)
            >>> ds[1]
            20
        """
        return self._derive(("map", fn))

    def random_map(
        self, fn: Callable[[Any, np.random.Generator], Any], *, seed: int = 0
    ) -> Dataset:
        """Return a Dataset that applies ``fn(record, rng)`` with a per-record generator.

        ``rng`` is derived from ``(seed, epoch, record index)``; the epoch is the one set
        with :meth:`set_epoch`, which torchgrain samplers call from their own
        ``set_epoch``. Seeds may be any 64-bit (or larger) integer. The generator is
        only valid during the call (it is re-seeded for the next record); keep no
        reference to it.

        Example:
            >>> ds = Dataset(list(range(4))).random_map(lambda r, rng: r + rng.random(), seed=7)
            >>> ds[2] == ds[2], 2 < ds[2] < 3
            (True, True)
        """
        if not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
        stream = sum(1 for op in self._ops if op[0] == "random_map")
        return self._derive(("random_map", fn, int(seed), stream))

    def map_batch(self, fn: Callable[[list[Any]], list[Any]]) -> Dataset:
        """Return a Dataset that applies ``fn(records)`` once to each batch of records.

        ``fn`` gets the list of records ``__getitems__`` is about to return and must
        return a list of the same length (one output record per input record, in order),
        so work that numpy can do on a stacked array is paid once per batch rather than
        once per record. Per-record transforms before and after it run as usual; random
        transforms keep their per-record generators. ``__getitem__`` calls ``fn`` with a
        one-element list, so results never depend on how records were batched, only the
        speed does: the saving needs the DataLoader to call ``__getitems__``, which it
        does when ``batch_size`` is set and automatic batching is on (not with
        ``batch_size=None``).

        Example:
            >>> import numpy as np
            >>> def center(records):  # one vectorised subtraction per batch
            ...     x = np.stack([r["x"] for r in records])
            ...     return [{**r, "x": row} for r, row in zip(records, x - 1.0)]
            >>> ds = Dataset([{"x": np.full(2, float(i))} for i in range(4)]).map_batch(center)
            >>> [r["x"].tolist() for r in ds.__getitems__([1, 3])]
            [[0.0, 0.0], [2.0, 2.0]]
            >>> ds[2]["x"].tolist()
            [1.0, 1.0]
        """
        return self._derive(("map_batch", fn))

    # ---------------------------------------------------------------- views
    def filter(self, predicate: Any, **options: Any) -> Dataset:
        """The records for which ``predicate(record)`` is true, as a new Dataset.

        The kept indices are found once, by a parallel pass, and kept in a node-shared,
        memory-mapped selection index; see :func:`torchgrain.compose.filter.filter_dataset`
        for the options (a name for the predicate, workers, the index directory) and
        for pyarrow expressions pushed down to Parquet.
        """
        from torchgrain.compose.filter import filter_dataset

        return filter_dataset(self, predicate, **options)

    def select(self, indices: Any) -> Dataset:
        """The records at ``indices`` (any integer array), in that order, as a new
        Dataset; see :func:`torchgrain.compose.subset.select`."""
        from torchgrain.compose.subset import select

        return select(self, indices)

    def windows(self, column: str, seq_len: int, **options: Any) -> Dataset:
        """Fixed-length token windows over the documents of ``column``, as a new Dataset;
        see :func:`torchgrain.tokens.windows.windows`.

        A null token list (Parquet) or None (in memory, ArrayRecord) counts as an empty
        document. Transforms before the windows must keep each document's token count
        from epoch to epoch (a ``random_map`` that changes it fails when read).

        Example:
            >>> ds = Dataset([{"t": [1, 2, 3]}, {"t": None}, {"t": [4, 5]}])
            >>> [w["input_ids"].tolist() for w in ds.windows("t", 2, index_dir=None)]
            [[1, 2], [3, 4]]
        """
        from torchgrain.tokens.windows import windows

        return windows(self, column, seq_len, **options)

    # ---------------------------------------------------------------- epoch
    def read_ahead(self, order: Any, start: int, count: int, position: Any) -> Any:
        """Forwarded to the source (remote shards downloaded ahead of use, the pass
        checked against the caches; see
        :meth:`torchgrain.sources.base.ShardedSource.read_ahead`). Samplers call it at
        the start of each pass; over a source without read-ahead it does nothing (and
        :meth:`offers` says so). What the source found of the caches is kept for
        :func:`tg.stats <torchgrain.stats>`.

        Example:
            >>> ds = Dataset([{"x": 1}, {"x": 2}])
            >>> ds.read_ahead(lambda a, b: list(range(a, b)), 0, 2, lambda: 0)  # no-op here
        """
        if not isinstance(self._source, ReadsAhead):
            return None
        fits = self._source.read_ahead(order, start, count, position)
        if fits is not None:
            self._stats.cache_fit = list(fits)  # what tg.stats reports of the pass
        return fits

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch random transforms use (also reaches running DataLoader workers).

        A source with its own ``set_epoch`` (e.g. another Dataset) gets it too.
        """
        self._epoch.set(epoch)
        if isinstance(self._source, SetsEpoch):
            self._source.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._epoch.get()

    # ------------------------------------------------------------- contract
    @property
    def source(self) -> Any:
        """What the Dataset was built over (a Source, or the object it adapted)."""
        source = self._source
        return source.items if isinstance(source, SequenceSource) else source

    def __len__(self) -> int:
        return len(self._source)

    @property
    def keys(self) -> list[str]:
        """Keys of the source's records (before transforms); empty unless it is a
        :class:`~torchgrain.Source` (or a Dataset over one)."""
        return list(self._source.keys)

    @property
    def schema(self) -> dict[str, str]:
        """Schema of the source's records (before transforms); see :attr:`keys`."""
        return dict(self._source.schema)

    def block_offsets(self) -> np.ndarray:
        """Block boundaries of the source, for :class:`~torchgrain.BlockShuffleSampler`
        (one block per shard for a source with no finer blocks); ``TypeError`` saying
        why over a plain sequence."""
        return self._source.block_offsets()

    def __getitem__(self, index: int) -> Any:
        return self._fetch([index], single=True)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The records at ``indices`` (a list), or with ``batch_format="columns"`` a
        one-element list holding their :class:`~torchgrain.columns.ColumnBatch` (the
        DataLoader's default collate turns it into a dict of tensors)."""
        if self.batch_format == "columns":
            return [self._fetch_columns(indices)]
        return self._fetch(indices)

    def _fetch_columns(self, indices: Sequence[int]) -> ColumnBatch:
        grow_pipe_once(self._worker_pipe_bytes)
        start_columns_batch(self._worker_slots)
        count = _BatchCount(self._source.reports_stats)
        ops = self._ops
        # Leading map_batch ops work on columns.
        k = next((k for k, op in enumerate(ops) if op[0] != "map_batch"), len(ops))
        batch = self._source.read_columns(indices) if k or not ops else None
        count.read_done()  # any op after this may decode
        for op in ops[:k]:
            batch = _call_columns_fn(op[1], batch)
        if k < len(ops):
            # Per-record ops see records; a later map_batch gets the columns again.
            records = batch.records() if batch is not None else self._read(indices)
            records = self._apply_many(records, indices, self._epoch.get(), ops[k:], columns=True)
            batch = (
                records if isinstance(records, ColumnBatch) else ColumnBatch.from_records(records)
            )
        count.transformed()
        count.done(len(batch), self._stats)
        return batch

    def _read(self, indices: Sequence[int]) -> list[Any]:
        return checked_batch(self.source, self._source.__getitems__(indices), indices)

    def _fetch(self, indices: Sequence[int], single: bool = False) -> list[Any]:
        grow_pipe_once(self._worker_pipe_bytes)
        count = _BatchCount(self._source.reports_stats)
        records = [self._source[indices[0]]] if single else self._read(indices)
        count.read_done()
        if self._ops:
            records = self._apply_many(records, indices, self._epoch.get(), self._ops)
            count.transformed()
        count.done(len(records), self._stats)
        return records

    def _apply(
        self, rec: Any, index: int, epoch: int, ops: tuple[Any, ...], then: str | None = None
    ) -> Any:
        """Run the per-record ``ops`` on one record. ``then`` names what needs the result
        as a record (a map_batch, a column batch); None: the result is the record."""
        op: tuple[Any, ...] = ()
        needs: str | None = None
        try:
            for k, op in enumerate(ops):
                if op[0] == "map":
                    rec = op[1](rec)
                else:
                    _, fn, seed, stream = op
                    rec = _call_with_rng(fn, rec, seed, epoch, index, stream)
                if rec is None:
                    # What comes next would fail on None, far from the cause. (None from
                    # the last function is the record: a collate_fn may drop it.)
                    needs = "the next function" if k + 1 < len(ops) else then
                    if needs is not None:
                        break
        except Exception as e:
            # Name the record: the transform itself never sees its index.
            if hasattr(e, "add_note"):
                name = _name_of(op[1])
                e.add_note(f"in {op[0]}({name}) of record index {index} (epoch {epoch})")
            raise
        if needs is not None:
            raise TypeError(
                f"{op[0]} function {describe_fn(op[1])} returned None for record index "
                f"{index} (epoch {epoch}); {needs} needs a record: does it lack a `return`?"
            )
        return rec

    def _apply_many(
        self,
        records: Sequence[Any],
        indices: Sequence[int],
        epoch: int,
        ops: tuple[tuple[Any, ...], ...],
        columns: bool = False,
    ) -> Any:
        """Run the ops: per-record ops record by record, each map_batch on the whole batch
        (a list of records, or with ``columns`` a ColumnBatch)."""
        # Records that become a column batch must be records, None included.
        last = "the column batch" if columns else None
        start = 0
        for k, op in enumerate(ops):
            if op[0] != "map_batch":
                continue
            if k > start:
                run, then = ops[start:k], "the next function (map_batch)"
                records = [
                    self._apply(r, int(i), epoch, run, then) for r, i in zip(records, indices)
                ]
            if columns:
                batch = _call_columns_fn(op[1], ColumnBatch.from_records(list(records)))
                records = batch.records() if k + 1 < len(ops) else batch
            else:
                records = _call_batch_fn(op[1], list(records))
            start = k + 1
        if start < len(ops):
            run = ops[start:]
            records = [self._apply(r, int(i), epoch, run, last) for r, i in zip(records, indices)]
        return records

    def __repr__(self) -> str:
        ops = "".join(f".{op[0]}({_name_of(op[1])})" for op in self._ops)
        return f"Dataset({self.source!r}){ops}"


class _BatchCount:
    """The counters of one batch read by a :class:`Dataset`: the read's time (unless the
    source counts its own), the transforms' time less the decoding inside them
    (:func:`~torchgrain.transforms.decode_image` counts itself as decode), the records
    and the batch; :meth:`done` publishes the batch's change to :func:`tg.stats
    <torchgrain.stats>`."""

    __slots__ = ("_before", "_counters", "_decoded", "_reports", "_t0", "_t1")

    def __init__(self, source_reports_stats: bool) -> None:
        self._counters = local_counters()
        self._before = self._counters.copy()
        self._reports = source_reports_stats
        self._t0 = self._t1 = time.perf_counter()
        self._decoded = 0.0

    def read_done(self) -> None:
        """The source's read ended: what follows is transforms."""
        self._t1 = time.perf_counter()
        if not self._reports:
            self._counters[_READ_SECONDS] += self._t1 - self._t0
        self._decoded = self._counters[_DECODE_SECONDS]

    def transformed(self) -> None:
        """The transforms ended."""
        decoding = self._counters[_DECODE_SECONDS] - self._decoded
        self._counters[_TRANSFORM_SECONDS] += time.perf_counter() - self._t1 - decoding

    def done(self, records: int, stats: PipelineStats) -> None:
        self._counters[_RECORDS] += records
        self._counters[_BATCHES] += 1
        stats.publish(self._counters - self._before)


_READ_SECONDS = COUNTER["read_seconds"]
_DECODE_SECONDS = COUNTER["decode_seconds"]
_TRANSFORM_SECONDS = COUNTER["transform_seconds"]
_RECORDS = COUNTER["records"]
_BATCHES = COUNTER["batches"]
