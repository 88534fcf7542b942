"""Filters: the records of a dataset for which a predicate holds, as a view.

The result is a :class:`~torchgrain.Dataset` over a :class:`FilterView`: item ``i`` is
record ``selection[i]`` of ``ds``, batched reads stay batched, ``set_epoch`` and
``read_ahead`` reach ``ds`` (the pass's order mapped through the selection), and
``block_offsets`` are ``ds``'s blocks as they fall in the selection.

The kept indices are found once, by a parallel pass over ``ds``, and stored as a
*selection index* file per machine, memory-mapped by every process (4 bytes per kept
record) and checked when opened (a :class:`~torchgrain.CorruptDataError` naming it).
A predicate is a function of one record, a vectorised one over columns (:func:`columns`),
or a :class:`pyarrow.compute.Expression` pushed down to Parquet files.

Design notes: docs/design-notes.md#compose-filter.

Example:
    >>> import tempfile, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_parquet(({"x": i} for i in range(10)), d)
    >>> ds = tg.Dataset(tg.ParquetSource(d))
    >>> odd = ds.filter(lambda r: r["x"] % 2 == 1, index_dir=tempfile.mkdtemp(), progress=False)
    >>> len(odd), [r["x"] for r in odd.__getitems__([0, 4])]
    (5, [1, 9])
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from torchgrain.columns import ColumnBatch
from torchgrain.compose.view import Composed, View, adapt, read_columns_of, short_repr
from torchgrain.dataset import Dataset, describe_fn
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.protocols import Fingerprinted, HasBlockOffsets
from torchgrain.sources.base import Source
from torchgrain.sources.node_index.derived import (
    DEFAULT,
    DerivedIndex,
    callable_fingerprint,
    dataset_fingerprint,
    derived_index,
    hash_parts,
)

__all__ = ["FilterView", "changes_with_epoch", "columns", "filter_dataset", "identified"]

_RANGES_PER_WORKER = 8  # ranges a pass is cut into, per worker (a balanced finish)
_MAX_RANGE_BATCHES = 64  # batches per range at most (what a worker hands back at once)
_CHECK_CHUNK = 1 << 20  # selection entries checked at a time (bounded temporaries)


class columns:
    """Mark ``fn`` as a vectorised predicate: called with a
    :class:`~torchgrain.columns.ColumnBatch` of up to ``batch_size`` records, it returns
    one bool per row (an array or a list). The filter's pass then reads columns, with no
    Python object per record where the source can (Parquet, ArrayRecord's numbers).
    ``keys`` names the only keys ``fn`` reads: a ParquetSource read without transforms
    then decodes only those columns for the pass (the batch holds only them).

    Example:
        >>> import numpy as np, torchgrain as tg
        >>> ds = tg.Dataset([{"x": i} for i in range(6)])
        >>> big = ds.filter(columns(lambda b: np.asarray(b["x"]) >= 4), index_dir=None,
        ...                 progress=False)
        >>> [r["x"] for r in big]
        [4, 5]
    """

    def __init__(self, fn: Callable[[ColumnBatch], Any], keys: Sequence[str] | None = None) -> None:
        if not callable(fn):
            raise TypeError("columns() needs a callable")
        if isinstance(keys, str):
            raise TypeError("keys must be a sequence of keys, not a string")
        self.fn = fn
        self.keys = None if keys is None else list(keys)

    def __call__(self, batch: ColumnBatch) -> Any:
        return self.fn(batch)


def filter_dataset(
    ds: Any,
    predicate: Any,
    *,
    name: str | None = None,
    batched: bool = False,
    num_workers: int | None = None,
    batch_size: int = 1024,
    index_dir: str | os.PathLike | None = DEFAULT,
    progress: bool = True,
) -> Dataset:
    """The records of ``ds`` for which ``predicate`` holds, in order, as a new Dataset
    (what ``Dataset.filter(predicate, **options)`` returns; see the module docstring).

    Args:
        ds: a :class:`~torchgrain.Dataset`, a :class:`~torchgrain.Source`, or anything a
            Dataset accepts. Its transforms apply before the predicate sees a record.
        predicate: ``fn(record) -> bool``; a vectorised one (:func:`columns`, or with
            ``batched=True``): ``fn(ColumnBatch) -> bools``; or a
            :class:`pyarrow.compute.Expression` when ``ds`` is a ParquetSource (or a
            Dataset over one without transforms): pushed down to the files.
        name: what the predicate is called in the selection's key, instead of its
            fingerprint (code, constants, closure values; not the globals it reads):
            name a predicate whose behaviour depends on something else, and change the
            name when that changes.
        batched: ``predicate`` takes a ColumnBatch (as if wrapped in :func:`columns`).
        num_workers: processes of the pass (default: one per CPU this process may use,
            fewer for a small dataset; ``0``: in this process). They are DataLoader
            workers (the default start method; a spawned one needs a picklable
            predicate).
        batch_size: records read (and tested) per call.
        index_dir: the directory of selection files (default ``<torchgrain
            cache>/filter-index``, for data read from files: records held in memory, a
            list, are known by their type and length only, so their selection is kept in
            memory unless a directory is given); ``None`` keeps the selection in this
            process's memory (built every time).
        progress: a progress bar (tqdm) on stderr while the selection is built.

    Returns:
        A :class:`~torchgrain.Dataset` over a :class:`FilterView` (same ``batch_format``).

    Raises:
        TorchgrainError: the predicate raised (``filter predicate NAME failed on record
            I of DATASET``, the predicate's exception as its cause).
        CorruptDataError: a selection file that fails its checks, naming it.

    Example:
        >>> import torchgrain as tg
        >>> ds = tg.Dataset([{"x": i} for i in range(8)]).map(lambda r: {"x": r["x"] * 10})
        >>> kept = filter_dataset(ds, lambda r: r["x"] >= 50, index_dir=None, progress=False)
        >>> len(kept), kept[0], kept.source.selection.tolist()
        (3, {'x': 50}, [5, 6, 7])
    """
    ds = ds if isinstance(ds, Dataset) else Dataset(ds)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise ValueError(f"num_workers must be an integer >= 0 or None, got {num_workers!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    changes = changes_with_epoch(ds)
    if changes is not None:
        raise TypeError(
            f"cannot filter {changes}: its records change with the epoch, and a selection "
            "is found once (the predicate would not hold at other epochs); filter the "
            "data before random_map, or each dataset before mixing them"
        )
    if index_dir is DEFAULT and not identified(ds):
        # Records held in memory (a list) are fingerprinted by type and length only: a
        # file in the shared cache could be the selection of another list of that length.
        index_dir = None
    n = len(ds)
    if _is_expression(predicate):
        from torchgrain.sources.parquet.source import ParquetSource

        if ds._ops or not isinstance(ds._source, ParquetSource):
            raise TypeError(
                "a pyarrow expression filters a ParquetSource read without transforms "
                f"(this is {ds!r}); filter it before the transforms, or give a function"
            )
        what = f"expression {predicate}"
        ident = name if name is not None else _expression_key(predicate)
        mode = "pushdown"
    else:
        if not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
        vectorised = batched or isinstance(predicate, columns)
        keys = predicate.keys if isinstance(predicate, columns) else None
        fn = predicate.fn if isinstance(predicate, columns) else predicate
        what = name if name is not None else describe_fn(fn)
        ident = name if name is not None else callable_fingerprint(fn)
        mode = "columns" if vectorised else "records"
        if keys is not None:
            mode += f" of {keys}"
    dtype = "<u4" if n < 2**32 else "<u8"
    # ("pushdown 3": selections an older pruning built may lack rows of nested columns, or
    # rows of an expression with a cast)
    kind = "pushdown 3" if mode == "pushdown" else mode
    key = "filter-" + hash_parts(dataset_fingerprint(ds), kind, ident, dtype)
    label = f"filter predicate {what}"

    def fill(sink: Any) -> dict[str, Any]:
        count = 0
        stats: dict[str, int] = {}
        if mode == "pushdown":
            from torchgrain.sources.parquet.pushdown import matching_rows

            chunks: Iterator[np.ndarray] = matching_rows(ds._source, predicate, progress, stats)
        else:
            reader = _reader(ds, keys)
            chunks = _pass(reader, predicate, vectorised, label, batch_size, num_workers, progress)
        try:
            for kept in chunks:
                sink.append("selection", kept.astype(dtype))
                count += len(kept)
        finally:
            if mode != "pushdown" and reader is not ds:
                reader._source.close()  # the files opened again for the pass
        # (a pushdown adds the row groups it read, of how many)
        return {"count": count, "length": n, "predicate": what[:200], **stats}

    def fits(ix: DerivedIndex) -> str | None:
        return None if ix.meta.get("length") == n else "it was made for another length"

    ix = derived_index(
        "filter", key, {"selection": (dtype, ())}, fill, index_dir=index_dir, fits=fits
    )
    return Dataset(FilterView(ds, ix, label=what), batch_format=ds.batch_format)


def _reader(ds: Dataset, keys: list[str] | None) -> Any:
    """What the pass reads: ``ds``, or for a vectorised predicate that names its keys, a
    ParquetSource read without transforms opened again for those columns only."""
    from torchgrain.sources.parquet.source import ParquetSource

    source = ds._source
    if keys is None or ds._ops or not isinstance(source, ParquetSource):
        return ds
    missing = [k for k in keys if k not in source.keys]
    if missing:
        raise KeyError(f"columns() names keys {missing} that {source!r} does not have")
    if any(k in source._part_keys for k in keys):
        return ds  # (hive partition keys are not in the files)
    from torchgrain.sources.parquet.pushdown import column_source

    return Dataset(column_source(source, keys))


def changes_with_epoch(ds: Any, transforms: bool = True) -> str | None:
    """What makes ``ds``'s records depend on the epoch, anywhere under it: a mixture
    (which records its positions read), or with ``transforms`` a ``random_map`` (their
    values); None when nothing does. A filter, a split and anything else found once
    refuse what it names.

    Example:
        >>> import torchgrain as tg
        >>> noisy = tg.Dataset([{"x": 1}]).random_map(lambda r, rng: r)
        >>> changes_with_epoch(tg.Dataset(noisy)) is None, changes_with_epoch(noisy, False)
        (False, None)
    """
    from torchgrain.adapters import SequenceSource
    from torchgrain.compose.mix import Mix

    if isinstance(ds, Dataset):
        if transforms and any(op[0] == "random_map" for op in ds._ops):
            return f"{short_repr(ds)} (random_map)"
        return changes_with_epoch(ds._source, transforms)
    if isinstance(ds, SequenceSource):  # tg.Dataset(a Dataset) reads it as a sequence
        return changes_with_epoch(ds.items, transforms)
    if isinstance(ds, Mix):
        return f"the mixture {short_repr(ds)}"
    if isinstance(ds, Composed):  # a view, token windows: what it reads is its children's
        found = (changes_with_epoch(child, transforms) for child in ds.children)
        return next((f for f in found if f is not None), None)
    return None


def identified(ds: Any) -> bool:
    """Whether every source under ``ds`` reads the files it lists in ``paths`` (so that
    its fingerprint changes with its records) or states its own fingerprint
    (:class:`~torchgrain.protocols.Fingerprinted`), not records held in memory or a
    source that lists no files: an index derived from ``ds`` may go to the shared cache
    only then.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_parquet(({"x": i} for i in range(3)), d)
        >>> files, listed = tg.Dataset(tg.ParquetSource(d)), tg.Dataset([{"x": 0}])
        >>> identified(files), identified(listed), identified(tg.concat([files, listed]))
        (True, False, False)
    """
    from torchgrain.adapters import SequenceSource

    if isinstance(ds, Dataset):
        return identified(ds._source)
    if isinstance(ds, Composed):
        return all(identified(c) for c in ds.children)
    if isinstance(ds, SequenceSource):  # (a map-style dataset tg.Dataset wraps)
        ds = ds.items
    if isinstance(ds, Fingerprinted):  # (it states what tells its data apart)
        return True
    # A source is known by its files: one that lists none (records made in memory or
    # fetched otherwise) is known by its type and length only, as a list is.
    return isinstance(ds, Source) and len(ds.paths) > 0


def _expression_key(expr: Any) -> str:
    """What keys a pushed-down expression's selection: a hash of its serialized form
    (Arrow's, holding every value and type, the same in every process), not its
    ``str``, which elides long ``is_in`` sets and prints ``float32(0.1)`` as ``0.1``."""
    import pickle

    try:
        data = pickle.dumps(expr, protocol=4)
    except Exception as e:
        raise TypeError(
            f"cannot key the selection of expression {short_repr(str(expr))}: it does not "
            f"serialize ({type(e).__name__}: {e}); give the filter a name="
        ) from e
    return hash_parts("expression", data)


def _is_expression(predicate: Any) -> bool:
    if "pyarrow" not in sys.modules:
        return False
    import pyarrow.compute as pc

    return isinstance(predicate, pc.Expression)


# ----------------------------------------------------------------- the view
class FilterView(View):
    """Item ``i`` is record ``selection[i]`` of the filtered dataset (see the module
    docstring; :func:`filter_dataset` makes it).

    Args:
        parent: the dataset filtered.
        index: its selection index (a :class:`DerivedIndex` with a ``"selection"``
            array), checked here (see :func:`check_selection`).
        label: how errors and ``repr`` name the predicate.

    Example:
        >>> import torchgrain as tg
        >>> from torchgrain.sources.node_index.derived import derived_index
        >>> ix = derived_index("filter", "doc", {"selection": ("<u4", ())},
        ...                    lambda sink: sink.append("selection", np.array([1, 3], np.uint32))
        ...                    or {"count": 2}, index_dir=None)
        >>> v = FilterView([{"x": 0}, {"x": 1}, {"x": 2}, {"x": 3}], ix, label="odd")
        >>> len(v), v.__getitems__([1, 0]), v.block_offsets().tolist()
        (2, [{'x': 3}, {'x': 1}], [0, 2])
    """

    def __init__(self, parent: Any, index: DerivedIndex, *, label: str = "") -> None:
        super().__init__([parent])
        self.index = index
        self.label = label
        self._count = check_selection(index, len(self.children[0]))

    @property
    def selection(self) -> np.ndarray:
        """The kept indices of the parent, increasing (a read-only mapped array)."""
        return self.index.arrays["selection"]

    def __len__(self) -> int:
        return self._count

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # A selection file written or truncated since it was mapped is refused
        # (ChangedWhileOpen, a CorruptDataError naming it): its entries would be other
        # bytes, and a page past a truncated end kills the process with SIGBUS.
        self.index.check_unchanged()
        return np.zeros(len(indices), np.int64), self.selection[indices].astype(np.int64)

    def block_offsets(self) -> np.ndarray:
        """The parent's blocks as they fall in the selection (empty ones left out), so a
        block-local order over a filtered Parquet source still reads row group by row
        group; one block when the parent has none."""
        parent = self.children[0]
        if not isinstance(parent, HasBlockOffsets):
            return super().block_offsets()
        blocks = np.asarray(parent.block_offsets(), np.int64)
        out = np.searchsorted(self.selection, blocks).astype(np.int64)
        out[-1] = len(self)
        return np.unique(np.r_[0, out])

    def identity(self) -> Any:
        """The selection's :attr:`~torchgrain.sources.node_index.derived.DerivedIndex.digest`."""
        return ("selection", self.index.digest)

    def fingerprint(self) -> str:
        """The parent's identity and the selection's key."""
        return hash_parts(dataset_fingerprint(self.children[0]), self.index.meta.get("key"))

    def __repr__(self) -> str:
        return f"FilterView({self.children[0]!r}, {self.label}: {len(self)} kept)"


def check_selection(index: DerivedIndex, n: int) -> int:
    """The number of kept records of a selection index over a dataset of ``n``
    records, once its entries are known to be strictly increasing, below ``n`` and as
    many as its metadata says; else a :class:`~torchgrain.CorruptDataError` naming the
    file. Reads the selection once, in chunks of a million entries.

    Example:
        >>> from torchgrain.sources.node_index.derived import derived_index
        >>> ix = derived_index("filter", "bad", {"selection": ("<u4", ())},
        ...                    lambda s: s.append("selection", np.array([2, 1], np.uint32))
        ...                    or {"count": 2}, index_dir=None)
        >>> check_selection(ix, 3)
        Traceback (most recent call last):
        ...
        torchgrain.errors.CorruptDataError: selection index (in memory) is damaged: \
entry 1 (1) is not above the one before it (2)
    """
    sel = index.arrays.get("selection")
    where = f"selection index {index.path or '(in memory)'}"

    def bad(why: str) -> CorruptDataError:
        return CorruptDataError(f"{where} is damaged: {why}")

    if sel is None or sel.ndim != 1:
        raise bad("it holds no selection array")
    count = index.meta.get("count")
    if count != len(sel):
        raise bad(f"it holds {len(sel)} entries, its metadata says {count}")
    prev = -1
    for a in range(0, len(sel), _CHECK_CHUNK):
        chunk = sel[a : a + _CHECK_CHUNK].astype(np.int64)  # "<u8" above 2^63: negative
        steps = np.diff(np.r_[prev, chunk])
        if (steps <= 0).any():
            k = int(np.flatnonzero(steps <= 0)[0])
            before = prev if k == 0 else int(chunk[k - 1])
            raise bad(f"entry {a + k} ({int(chunk[k])}) is not above the one before it ({before})")
        prev = int(chunk[-1])
    if prev >= n:
        raise bad(f"entry {len(sel) - 1} ({prev}) is out of range for a dataset of {n} records")
    return len(sel)


# ----------------------------------------------------------------- the pass
def _pass(
    ds: Dataset,
    predicate: Callable[[Any], Any],
    vectorised: bool,
    label: str,
    batch_size: int,
    num_workers: int | None,
    progress: bool,
) -> Iterator[np.ndarray]:
    """The kept indices of ``ds``, in order, a range at a time, from a pass by
    DataLoader workers over contiguous ranges (each hands back a packed bitmap)."""
    n = len(ds)
    if num_workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # a worker costs a process start: only where it has several batches to test
        num_workers = min(cpus or 1, n // (4 * batch_size))
    parts = max(1, num_workers) * _RANGES_PER_WORKER
    step = min(max(batch_size, math.ceil(n / parts)), batch_size * _MAX_RANGE_BATCHES)
    tester = _RangeTester(adapt(ds), repr(ds), predicate, vectorised, label, batch_size, step, n)
    loader = torch.utils.data.DataLoader(
        tester, batch_size=None, num_workers=num_workers, collate_fn=as_is
    )
    from tqdm import tqdm

    with tqdm(
        total=n, unit="rec", desc=label[:60], file=sys.stderr, leave=False, disable=not progress
    ) as bar:
        for start, stop, bits in loader:
            mask = np.unpackbits(bits, count=stop - start).view(bool)
            yield np.flatnonzero(mask) + start
            bar.update(stop - start)


def as_is(item: Any) -> Any:
    """A DataLoader's ``collate_fn`` for items that are whole batches already (picklable
    to spawned workers, unlike a lambda).

    Example:
        >>> as_is([1, 2])
        [1, 2]
    """
    return item


@dataclasses.dataclass(eq=False)
class _RangeTester(torch.utils.data.Dataset):
    """Item ``k``: range ``[k * step, (k + 1) * step)`` of the ``n`` records of ``child``
    (the dataset :func:`adapt` made of the one ``name`` names) tested, as ``(start, stop,
    packed bits)`` (one bit per record: 1 kept)."""

    child: Any
    name: str
    predicate: Callable[[Any], Any]
    vectorised: bool
    label: str
    batch_size: int
    step: int
    n: int

    def __len__(self) -> int:
        return -(-self.n // self.step)

    def __getitem__(self, k: int) -> tuple[int, int, np.ndarray]:
        start = k * self.step
        stop = min(start + self.step, self.n)
        mask = np.zeros(stop - start, dtype=bool)
        for a in range(start, stop, self.batch_size):
            b = min(a + self.batch_size, stop)
            mask[a - start : b - start] = self._test(a, b)
        return start, stop, np.packbits(mask)

    def _test(self, a: int, b: int) -> np.ndarray:
        if self.vectorised:
            batch = read_columns_of(self.child, np.arange(a, b))
            try:
                got = self.predicate(batch)
            except Exception as e:
                raise self._failed(f"records [{a}, {b})", e) from e
            out = np.asarray(got)
            if out.shape != (b - a,) or out.dtype != bool:
                raise TypeError(
                    f"{self.label} must return one bool per row of its batch: got "
                    f"{type(got).__name__} of shape {out.shape} and dtype {out.dtype} for "
                    f"{b - a} rows (records [{a}, {b}) of {self.name})"
                )
            return out
        records = self.child.__getitems__(list(range(a, b)))
        out = np.zeros(b - a, dtype=bool)
        test = self.predicate
        for k, rec in enumerate(records):
            try:
                out[k] = bool(test(rec))
            except Exception as e:
                raise self._failed(f"record {a + k}", e) from e
        return out

    def _failed(self, which: str, e: Exception) -> TorchgrainError:
        return TorchgrainError(
            f"{self.label} failed on {which} of {self.name}: {type(e).__name__}: {e}"
        )
