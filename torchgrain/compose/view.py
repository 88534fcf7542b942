"""The composition contract: what every composed dataset (a *view*) shares.

A view is a :class:`~torchgrain.Source` whose item ``i`` resolves to a pair (child ``c``,
child index ``j``). A subclass says only how long it is and how positions resolve
(:meth:`View._locate`); this base does the rest for every view: children adapted
(:func:`adapt`), one batched read per child per batch (:func:`read_pairs`), index checks,
keys and schema merged (:func:`merge_schemas`), and ``set_epoch`` / ``read_ahead`` /
``block_offsets`` offered only where they work. A view pickles small (no open handles).

Design notes: docs/design-notes.md#compose-view.

Example:
    >>> import numpy as np
    >>> class Reversed(View):  # item i is item n - 1 - i of the one child
    ...     def __len__(self):
    ...         return len(self.children[0])
    ...     def _locate(self, indices):
    ...         return np.zeros(len(indices), np.int64), len(self) - 1 - indices
    >>> v = Reversed([[{"x": 0}, {"x": 1}, {"x": 2}]])
    >>> v.__getitems__([0, 2]), v.locate([1])[1].tolist(), v.block_offsets().tolist()
    ([{'x': 2}, {'x': 0}], [1], [0, 3])
    >>> v[3]
    Traceback (most recent call last):
    ...
    IndexError: record index 3 out of range for a dataset of 3 records
"""

from __future__ import annotations

import abc
import copy
import hashlib
import itertools
import reprlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchgrain.adapters import checked_batch
from torchgrain.columns import ColumnBatch, column_of
from torchgrain.errors import SchemaMismatchError
from torchgrain.formats.codecs import split_type
from torchgrain.protocols import PlacedOrder, ReadsAhead, SetsEpoch
from torchgrain.sources.base import Source
from torchgrain.sources.index import ShardIndex

__all__ = [
    "Composed",
    "View",
    "adapt",
    "as_records",
    "check_indices",
    "describes_records",
    "join_types",
    "merge_schemas",
    "read_column_pairs",
    "read_columns_of",
    "read_pairs",
    "short_repr",
]


def adapt(child: Any) -> Any:
    """``child`` as a view reads it: a :class:`~torchgrain.Source`, or a
    :class:`~torchgrain.Dataset` whose transforms apply (read as records).

    Example:
        >>> import torchgrain as tg
        >>> type(adapt([1, 2])).__name__, type(adapt(tg.Dataset([1]).map(str))).__name__
        ('SequenceSource', 'Dataset')
    """
    from torchgrain.dataset import Dataset

    if isinstance(child, Source):
        return child
    if not isinstance(child, Dataset):
        return Dataset(child)._source  # how a Dataset would read it
    if not child._ops:
        return child._source  # nothing to apply: read (and read columns) from the source
    return as_records(child)


def as_records(ds: Any) -> Any:
    """The Dataset ``ds`` reading records: itself, or a copy (its epoch cell and stats
    stay shared) when it reads another ``batch_format``.

    Example:
        >>> import torchgrain as tg
        >>> as_records(tg.Dataset([{"x": 1}], batch_format="columns")).batch_format
        'records'
    """
    if ds.batch_format != "records":
        ds = copy.copy(ds)
        ds.batch_format = "records"
    return ds


def describes_records(child: Any) -> bool:
    """Whether ``child``'s ``keys`` and ``schema`` describe the records it returns: a
    source that says what its records hold, not a Dataset whose transforms may change
    them, nor a plain sequence (empty keys)."""
    from torchgrain.dataset import Dataset

    return not isinstance(child, Dataset) and bool(child.keys)


def check_indices(indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``indices`` as int64 once they are known to be integers in ``[0, n)``:
    ``IndexError`` / ``TypeError`` otherwise, as every source raises.

    Example:
        >>> check_indices([2, 0], 3).tolist()
        [2, 0]
        >>> check_indices([1.5], 3)
        Traceback (most recent call last):
        ...
        TypeError: record indices must be integers, got ...
    """
    return ShardIndex(np.array([n], dtype=np.int64)).check(indices)


def read_pairs(children: Sequence[Any], which: np.ndarray, local: np.ndarray) -> list[Any]:
    """The records at (``children[which[k]]``, ``local[k]``) for every ``k``, in that
    order: one ``__getitems__`` call per child that the batch touches (``children``
    adapted by :func:`adapt`).

    Example:
        >>> children = [adapt(["a", "b"]), adapt(["c"])]
        >>> read_pairs(children, np.array([1, 0, 0]), np.array([0, 1, 0]))
        ['c', 'b', 'a']
    """
    groups = _groups(which)
    if not groups:
        return []
    if len(groups) == 1:  # the common case of a block-local order: nothing to put back
        child = children[groups[0][0]]
        return checked_batch(child, child.__getitems__(local.tolist()), local)
    flat: list[Any] = []
    for c, rows in groups:
        child = children[c]
        flat += checked_batch(child, child.__getitems__(local[rows].tolist()), rows)
    return [flat[j] for j in _back(groups, len(which)).tolist()]


def read_column_pairs(children: Sequence[Any], which: np.ndarray, local: np.ndarray) -> ColumnBatch:
    """:func:`read_pairs` as a :class:`~torchgrain.columns.ColumnBatch`: each child's
    rows read by its ``read_columns`` (a Dataset child's records made into columns),
    joined in request order (numeric columns of one dtype and row shape stay arrays).

    Example:
        >>> children = [adapt([{"x": 1}]), adapt([{"x": 2}, {"x": 3}])]
        >>> b = read_column_pairs(children, np.array([1, 0, 1]), np.array([1, 0, 0]))
        >>> b["x"].tolist()
        [3, 1, 2]
    """
    groups = _groups(which)
    if len(groups) <= 1:  # the common case of a block-local order: no join
        return read_columns_of(children[groups[0][0] if groups else 0], local)
    parts = [read_columns_of(children[c], local[rows]) for c, rows in groups]
    back = _back(groups, len(which))
    keys = dict.fromkeys(k for part in parts for k in dict.keys(part))
    columns = {}
    for key in keys:
        cols = [dict.get(part, key) for part in parts]
        first = cols[0]
        if isinstance(first, np.ndarray) and all(
            isinstance(col, np.ndarray)
            and col.dtype == first.dtype
            and col.shape[1:] == first.shape[1:]
            for col in cols
        ):
            columns[key] = np.concatenate(cols)[back]
        else:
            values = [
                v
                for part, col in zip(parts, cols)
                for v in (col if col is not None else [None] * len(part))
            ]
            columns[key] = column_of([values[b] for b in back.tolist()])
    return ColumnBatch(columns, num_rows=len(which))


def _groups(which: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(child, positions in the batch) for each child the batch touches, in child order,
    positions in request order; none for an empty batch."""
    if len(which) == 0:
        return []
    order = np.argsort(which, kind="stable")
    ranked = which[order]
    cuts = (np.flatnonzero(ranked[1:] != ranked[:-1]) + 1).tolist()
    bounds = [0, *cuts, len(which)]
    return [(int(ranked[a]), order[a:b]) for a, b in itertools.pairwise(bounds)]


def _back(groups: list[tuple[int, np.ndarray]], n: int) -> np.ndarray:
    """Where row ``k`` of the batch is in the groups' rows laid end to end."""
    back = np.empty(n, dtype=np.int64)
    back[np.concatenate([rows for _, rows in groups])] = np.arange(n)
    return back


def read_columns_of(child: Any, indices: np.ndarray) -> ColumnBatch:
    """The records of ``child`` (adapted by :func:`adapt`) at int64 ``indices`` as
    columns: a source's ``read_columns`` (given the array: no Python int each), a
    Dataset's records made into columns.

    Example:
        >>> read_columns_of(adapt([{"x": 1}, {"x": 2}]), np.array([1]))["x"].tolist()
        [2]
    """
    if isinstance(child, Source):
        return child.read_columns(indices)
    records = checked_batch(child, child.__getitems__(indices.tolist()), indices)
    return ColumnBatch.from_records(records)


def _join_array(a: str, b: str) -> str | None:
    """``uint8[64,?]`` and ``uint8[32,3]`` -> ``uint8[?,?]``: one dtype and rank, the
    sizes that differ become ``?``; None when they are not such a pair (lists included:
    ``list[int]`` and ``list[str]`` disagree)."""
    if not (a.endswith("]") and b.endswith("]") and "[" in a and "[" in b):
        return None
    da, _, sa = a[:-1].partition("[")
    db, _, sb = b[:-1].partition("[")
    dims_a, dims_b = sa.split(",") if sa else [], sb.split(",") if sb else []
    if da != db or da == "list" or len(dims_a) != len(dims_b):
        return None
    dims = [x if x == y else "?" for x, y in zip(dims_a, dims_b)]
    return f"{da}[{','.join(dims)}]"


def join_types(a: str, b: str) -> str | None:
    """The type that holds values of types ``a`` and ``b`` (in the schema vocabulary of
    :class:`~torchgrain.Source`), or None when they do not agree.

    Example:
        >>> join_types("float32[2]", "float32[?]"), join_types("int", "int|null")
        ('float32[?]', 'int|null')
        >>> join_types("int", "str") is None
        True
        >>> join_types("list|list[int]", "list[int]")  # an empty list beside list[int]
        'list|list[int]'
    """
    if a == b:
        return a
    pa, pb = frozenset(split_type(a)), frozenset(split_type(b))
    na, nb = "null" in pa, "null" in pb
    pa, pb = pa - {"null"}, pb - {"null"}
    if pa == pb:
        return a if na else b
    # A bare 'list' (only empty lists seen) is to list[...] what null is to a type.
    la = {p for p in pa if p.split("[", 1)[0] == "list"}
    lb = {p for p in pb if p.split("[", 1)[0] == "list"}
    ea, eb = la - {"list"}, lb - {"list"}
    if la and lb and pa - la == pb - lb:
        if ea and eb and ea != eb:  # element types join as a type's do
            inner: str | None = None
            for element in sorted(e[5:-1] for e in ea | eb):
                inner = element if inner is None else join_types(inner, element)
                if inner is None:
                    return None
            ea = eb = {f"list[{inner}]"}
        bare = (la | lb) & {"list"}
        return "|".join(sorted((pa - la) | bare | ea | eb | ({"null"} if na or nb else set())))
    array = _join_array(*pa, *pb) if len(pa) == 1 and len(pb) == 1 else None
    return f"{array}|null" if array is not None and (na or nb) else array


def merge_schemas(
    described: Sequence[tuple[str, Sequence[str], dict[str, str]]],
) -> tuple[list[str], dict[str, str]]:
    """The keys and schema of a view whose children are ``described`` (name, keys,
    schema each): the children must have the same keys, of types that agree
    (:func:`join_types`); else a :class:`~torchgrain.SchemaMismatchError` naming the
    first child and the one that differs, with the keys and types that differ.

    Example:
        >>> merge_schemas([("a", ["x"], {"x": "int"}), ("b", ["x"], {"x": "int|null"})])
        (['x'], {'x': 'int|null'})
        >>> merge_schemas([("a", ["x"], {"x": "int"}), ("b", ["x", "y"], {"x": "str"})])
        Traceback (most recent call last):
        ...
        torchgrain.errors.SchemaMismatchError: cannot compose a and b: their records differ: \
keys only in b: ['y']; 'x': int in a, str in b
    """
    if not described:
        return [], {}
    first, keys, schema = described[0]
    keys, schema = list(keys), dict(schema)
    for name, other_keys, other_schema in described[1:]:
        problems = []
        for who, have, lack in ((first, keys, other_keys), (name, other_keys, keys)):
            only = [k for k in have if k not in lack]
            if only:
                problems.append(f"keys only in {who}: {only}")
        for k in keys:
            if k in other_keys:
                a, b = schema.get(k, "?"), other_schema.get(k, "?")
                joined = join_types(a, b)
                if joined is None:
                    problems.append(f"{k!r}: {a} in {first}, {b} in {name}")
                else:
                    schema[k] = joined
        if problems:
            raise SchemaMismatchError(
                f"cannot compose {first} and {name}: their records differ: " + "; ".join(problems)
            )
    return keys, schema


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120


def short_repr(x: Any) -> str:
    """``repr(x)`` cut to about 120 characters, for error messages.

    Example:
        >>> len(short_repr(list(range(1000)))) < 130
        True
    """
    return _SHORT.repr(x)


class Composed(Source):
    """A :class:`~torchgrain.Source` whose reads are reads of other datasets, its
    ``children`` (a :class:`View`, token windows). A subclass says which of their
    records a read of some of its indices reads (:meth:`pass_plan`); this base passes
    ``set_epoch`` and a sampler's pass on: each source under a composition of them is
    told the pass once (``read_ahead``, offered only when something under it reads
    ahead), with its own indices that the pass's positions read, in pass order, through
    every path to it.

    Example:
        >>> import torchgrain as tg
        >>> class Told(list):  # documents that print the pass they are told
        ...     def read_ahead(self, order, start, count, position):
        ...         print(order(start, start + count).tolist())
        >>> docs = tg.Dataset(Told({"t": list(range(n))} for n in (3, 1, 2)))
        >>> ds = tg.concat([docs.windows("t", 2, index_dir=None), docs.select([2, 0])])
        >>> ds.read_ahead(lambda a, b: np.arange(a, b), 0, len(ds), lambda: 0)
        [0, 1, 2, 2, 0]
    """

    #: The datasets it reads (an attribute or a property): every walk of a composition
    #: (``set_epoch``, the pass, what changes with the epoch, what reads files) goes
    #: through it.
    children: tuple[Any, ...]

    @abc.abstractmethod
    def pass_plan(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, child, child index)`` int64 arrays: a read of ``indices`` (int64)
        reads record ``child index[k]`` of ``children[child[k]]`` for
        ``indices[rows[k]]``, in the order of ``indices``."""

    def _place(
        self,
        target: Any,
        indices: np.ndarray,
        rows: np.ndarray,
        found: list[tuple[np.ndarray, np.ndarray]],
    ) -> None:
        """Add to ``found`` the pass positions and indices of ``target``'s records that a
        read of ``indices`` (at the pass positions ``rows``) reads, through every path to
        it: :meth:`pass_plan`'s, one level at a time (a composition that reads some of its
        children's rows otherwise, at another epoch, overrides it)."""
        pick, which, local = self.pass_plan(indices)
        rows = rows[pick]
        for k, child in enumerate(map(_beneath, self.children)):
            mine = which == k
            if child is target:
                found.append((rows[mine], local[mine]))
            elif isinstance(child, Composed) and mine.any():
                child._place(target, local[mine], rows[mine], found)

    def identity(self) -> Any:
        """What else than its children decides which of their records its indices read
        (its options: a mixture's seed and counts, a filter's selection), as a value
        with a stable ``repr``, the same on every machine that reads a copy of the data:
        a sampler's saved state is checked against it. A subclass with options
        overrides it."""
        return ()

    def offers(self, capability: type) -> bool:
        """``read_ahead`` when something under it reads ahead; the others always
        (:class:`~torchgrain.protocols.DeclaresCapabilities`)."""
        return capability is not ReadsAhead or any(isinstance(c, ReadsAhead) for c in self.children)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to every child that has ``set_epoch``."""
        for child in self.children:
            if isinstance(child, SetsEpoch):
                child.set_epoch(epoch)

    def read_ahead(
        self,
        order: Callable[[int, int], np.ndarray] | None,
        start: int,
        count: int,
        position: Callable[[], int],
    ) -> Any:
        """Each source under it told the pass once (docs/design-notes.md#compose-view): the
        cache checks of them together (None when none has any)."""
        fits: list[Any] | None = None
        for target in _reading_ahead(self):
            target_order = None if order is None else _SourceOrder(self, target, order)
            got = target.read_ahead(target_order, start, count, position)
            if got is not None:
                fits = [*(fits or []), *got]
        return fits


class View(Composed):
    """Base of composed datasets: a :class:`~torchgrain.Source` over ``children``.

    A subclass defines ``__len__`` and :meth:`_locate`; reads, index checks, keys and
    schema, ``block_offsets``, ``set_epoch`` and ``read_ahead`` come from here (design
    notes: docs/design-notes.md#compose-view).

    Args:
        children: the datasets composed (any :class:`~torchgrain.Source`,
            :class:`~torchgrain.Dataset`, or what a Dataset accepts), adapted by
            :func:`adapt`.
        names: a name per child, used in errors and by views that label records
            (default ``"0"``, ``"1"``, ...).
        same_keys: the children must describe the same records (:func:`merge_schemas`,
            checked here, at once); False: keys and schema are not compared, and the view
            describes its records only where all children say the same.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        legacy = cls.__dict__.get("_identity")
        if legacy is not None and "identity" not in cls.__dict__:
            # (the hook's earlier name: still honoured, for the derived-index keys too)
            warnings.warn(
                f"{cls.__qualname__} overrides View._identity, whose name is now identity: "
                "rename it (the old name stops being read in a later release)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.identity = legacy  # type: ignore[method-assign]

    def __init__(
        self,
        children: Sequence[Any],
        *,
        names: Sequence[str] | None = None,
        same_keys: bool = True,
    ) -> None:
        self.children: tuple[Any, ...] = tuple(adapt(c) for c in children)
        if not self.children:
            raise ValueError(f"{type(self).__name__} needs at least one dataset")
        if names is None:
            names = [str(k) for k in range(len(self.children))]
        if len(names) != len(self.children):
            raise ValueError(f"{len(names)} names for {len(self.children)} datasets")
        self.names: tuple[str, ...] = tuple(str(n) for n in names)
        if len(set(self.names)) < len(self.names):  # {1: a, "1": b}: errors, labels, weights
            raise ValueError(f"datasets must have distinct names, got {list(self.names)}")
        described = [
            (self.describe_child(k), c.keys, c.schema)
            for k, c in enumerate(self.children)
            if describes_records(c)
        ]
        self._keys: list[str] = []
        self._schema: dict[str, str] = {}
        if len(described) == len(self.children):
            try:
                self._keys, self._schema = merge_schemas(described)
            except SchemaMismatchError:
                if same_keys:
                    raise

    # ------------------------------------------------------------ to define
    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of records of the view."""

    @abc.abstractmethod
    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(child, child index)`` int64 arrays for checked int64 positions."""

    # ---------------------------------------------------------------- reads
    def locate(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(child, child index)`` of each of ``indices`` (checked: ``IndexError``,
        ``TypeError``)."""
        return self._locate(check_indices(indices, len(self)))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        which, local = self.locate(indices)
        return self._label(read_pairs(self.children, which, local), which)

    def read_columns(self, indices: Sequence[int]) -> ColumnBatch:
        which, local = self.locate(indices)
        return self._label_columns(read_column_pairs(self.children, which, local), which)

    def _label(self, records: list[Any], which: np.ndarray) -> list[Any]:
        """Records as the view returns them (a view that adds a field overrides it)."""
        return records

    def _label_columns(self, batch: ColumnBatch, which: np.ndarray) -> ColumnBatch:
        return batch

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    @property
    def schema(self) -> dict[str, str]:
        return dict(self._schema)

    @property
    def reports_stats(self) -> bool:  # type: ignore[override]
        # Time spent in a child that times its own reads (a sharded source, a Dataset)
        # must not be counted again by the Dataset over the view.
        from torchgrain.dataset import Dataset

        return all(isinstance(c, Dataset) or c.reports_stats for c in self.children)

    def fingerprint(self) -> str:
        """A digest of the data the view reads: its type, :meth:`identity` and its
        children's :func:`~torchgrain.sources.node_index.derived.dataset_fingerprint`
        (what keys an index derived from the view, a filter's selection say)."""
        from torchgrain.sources.node_index.derived import dataset_fingerprint

        h = hashlib.blake2b(digest_size=16)
        for part in (type(self).__qualname__, *map(dataset_fingerprint, self.children)):
            h.update(part.encode() + b"\0")
        h.update(repr(self.identity()).encode())
        return h.hexdigest()

    def describe_child(self, k: int) -> str:
        """How errors name child ``k``: its name and what it is."""
        return f"dataset {self.names[k]!r} ({short_repr(self.children[k])})"

    def pass_plan(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each of ``indices`` reads one child's record: :meth:`locate`'s."""
        return np.arange(len(indices)), *self.locate(indices)

    def __repr__(self) -> str:
        inner = ", ".join(short_repr(c) for c in self.children)
        return f"{type(self).__name__}([{inner}])"


def _beneath(x: Any) -> Any:
    """What ``x`` reads through with the same indices: a Dataset's source, an adapted
    sequence; ``x`` itself otherwise."""
    from torchgrain.adapters import SequenceSource
    from torchgrain.dataset import Dataset

    while isinstance(x, (Dataset, SequenceSource)):
        x = x._source if isinstance(x, Dataset) else x.items
    return x


def _reading_ahead(node: Composed) -> list[Any]:
    """The sources that read ahead under ``node``, through compositions and Datasets,
    each once (a source may be under two children, or under two views of it)."""
    found: dict[int, Any] = {}
    for child in map(_beneath, node.children):
        below = _reading_ahead(child) if isinstance(child, Composed) else [child]
        found.update((id(x), x) for x in below if isinstance(x, ReadsAhead))
    return list(found.values())


class _SourceOrder:
    """The pass's order for ``target``, a source under ``node`` (a picklable
    :class:`~torchgrain.protocols.PlacedOrder`): its indices that the positions
    ``[a, b)`` read, in the pass's order, and the position each is read at."""

    def __init__(self, node: Composed, target: Any, order: Callable[[int, int], np.ndarray]):
        self.node, self.target, self.order = node, target, order

    def __call__(self, a: int, b: int) -> np.ndarray:
        return self.placed(a, b)[0]

    def placed(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(self.order, PlacedOrder):
            indices, rows = (np.asarray(x, np.int64) for x in self.order.placed(a, b))
        else:
            indices = np.asarray(self.order(a, b), np.int64)
            rows = np.arange(a, a + len(indices), dtype=np.int64)
        found = [(np.zeros(0, np.int64), np.zeros(0, np.int64))]
        if len(indices):
            self.node._place(self.target, indices, rows, found)
        # Several paths to the target (children of several views) merged in pass order.
        where = np.concatenate([at for at, _ in found])
        keep = np.argsort(where, kind="stable")
        return np.concatenate([got for _, got in found])[keep], where[keep]
