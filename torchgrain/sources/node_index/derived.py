"""Derived indexes: arrays computed once from a dataset, shared by every process of a machine.

A filter's kept indices, the document offsets of token windows, a large selection: each
is computed from a dataset by a pass over it, is needed by every rank and DataLoader
worker of the machine, and must be recomputed when the dataset changes. They go through
the same store as the ArrayRecord and TFRecord indexes (:mod:`.store`): an index file
per key in an index directory, built by one process of the machine under a lock,
published atomically, memory-mapped read-only by every process (the page cache holds it
once per machine), least-recently-used files pruned, and kept in the process's memory
with a warning when the directory cannot be written.

The key names what the arrays were computed from: :func:`dataset_fingerprint` (the
source's files and their versions, its length, the transforms applied) and
whatever else the computation depends on (:func:`callable_fingerprint` of a predicate,
a column name, options). Another dataset, a changed shard or another predicate gives
another key, hence another file.

Example:
    >>> import tempfile, numpy as np
    >>> def fill(sink):
    ...     sink.append("kept", np.array([1, 4, 5], np.uint32))
    ...     return {"n": 3}
    >>> ix = derived_index("demo", "k1", {"kept": ("<u4", ())}, fill, index_dir=tempfile.mkdtemp())
    >>> ix.arrays["kept"].tolist(), ix.meta["n"], ix.path.endswith(".tgindex")
    ([1, 4, 5], 3, True)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pickle
import re
import types
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from torchgrain.formats.index_file import INDEX_SUFFIX
from torchgrain.io import remote
from torchgrain.io.fs import is_local, map_files
from torchgrain.io.retry import using
from torchgrain.protocols import Fingerprinted
from torchgrain.sources.base import ShardedSource, Source
from torchgrain.sources.node_index.store import (
    IndexArrays,
    NodeIndex,
    build_index,
    cached_index,
    default_index_dir,
)
from torchgrain.sources.options import check_dir_option

__all__ = [
    "DerivedIndex",
    "callable_fingerprint",
    "composition_fingerprint",
    "dataset_fingerprint",
    "derived_index",
    "layout_fingerprint",
]


class _Default:
    def __repr__(self) -> str:
        return "<the torchgrain cache's <kind>-index directory>"


#: ``index_dir`` default: ``<torchgrain cache>/<kind>-index``.
DEFAULT: Any = _Default()


class DerivedIndex(NodeIndex):
    """Named read-only arrays of a derived index, and the metadata they were built with.

    Mapped from an index file every process of the machine shares (or held in memory
    when the index directory could not be written); :attr:`path` and
    :meth:`check_unchanged` as every node index's. Pickles as the file's name: a
    spawned worker maps the same file, and refuses one replaced since it was opened.
    """

    def _derive(self) -> None:
        """Nothing: the arrays are what ``fill`` appended, checked by their index's ``fits``."""

    @property
    def kind(self) -> str:
        return self._a.kind

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Name -> read-only array."""
        return self._a.arrays

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata ``fill`` returned, plus ``key`` and ``digest``."""
        return self._a.meta

    @functools.cached_property
    def digest(self) -> str:
        """A hex digest of the arrays' contents (names, dtypes, shapes, values), the same
        on every machine that derives them from a copy of the data (the key is not: it
        names the files' local versions). Taken as the index is built; an index of an
        earlier release, without it, is read whole once."""
        saved = self.meta.get("digest")
        if isinstance(saved, str):
            return saved
        sink = _Digests({name: arr.dtype for name, arr in self.arrays.items()})
        for name, arr in self.arrays.items():
            for a in range(0, len(arr), 1 << 20):
                sink.append(name, arr[a : a + (1 << 20)])
        return sink.hexdigest()

    def __repr__(self) -> str:
        where = self.path or "(in memory)"
        shapes = {k: v.shape for k, v in self.arrays.items()}
        return f"DerivedIndex({self.kind!r}, {where!r}, {shapes})"


class _Digests:
    """A sink that digests each column's rows as the index stores them and passes them
    on (to ``sink``, when one is given)."""

    def __init__(self, dtypes: dict[str, np.dtype], sink: Any = None) -> None:
        self.sink, self.dtypes = sink, dtypes
        self.hashes = {name: hashlib.blake2b(digest_size=16) for name in dtypes}

    def append(self, name: str, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtypes[name])
        self.hashes[name].update(rows.tobytes())
        if self.sink is not None:
            self.sink.append(name, rows)

    def hexdigest(self) -> str:
        parts = [(n, self.dtypes[n].str, h.hexdigest()) for n, h in sorted(self.hashes.items())]
        return hash_parts("arrays", parts)


class _Maker:
    """What the store calls a index class: a ``kind`` and a constructor from arrays."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, arrays: IndexArrays) -> DerivedIndex:
        return DerivedIndex(arrays)


def derived_index(
    kind: str,
    key: str,
    columns: dict[str, tuple[str, tuple[int, ...]]],
    fill: Callable[[Any], dict[str, Any]],
    *,
    index_dir: str | None = DEFAULT,
    fits: Callable[[DerivedIndex], str | None] | None = None,
) -> DerivedIndex:
    """The derived index ``kind``/``key``: opened when it exists, else built once per machine.

    Args:
        kind: what the arrays are (``"filter"``, ``"windows"``...): the index file's kind,
            checked when it is opened, and the default directory's name.
        key: what they were computed from (a hash of :func:`dataset_fingerprint` and
            the options); the file's name. At most 128 characters of ``[0-9a-zA-Z_.-]``.
        columns: ``name -> (dtype, trailing shape)``; dtypes ``"<i8"``, ``"<u8"``,
            ``"<i4"``, ``"<u4"``, ``"|u1"``.
        fill: called with a sink when the index must be built: appends each column's
            rows with ``sink.append(name, array)`` (any number of calls; an index larger
            than memory streams to disk) and returns the metadata (JSON values).
        index_dir: where the index file lives; ``None`` builds it in this process's
            memory, every time.
        fits: why an opened index does not describe the data (e.g. its metadata
            disagrees with the dataset's length), or None; a misfit is rebuilt.

    Raises:
        ValueError: a bad ``key``.
        CorruptDataError: an index file that another process published and that fails
            its checks is rebuilt with a warning; one that fails after being built
            here raises.
    """
    if not isinstance(key, str) or not re.fullmatch(r"(?!\.)[\w.-]{1,128}", key, re.ASCII):
        raise ValueError(f"bad derived-index key {key!r:.140}")
    maker = _Maker(kind)

    def fill_keyed(sink: Any) -> dict[str, Any]:
        digests = _Digests({name: np.dtype(c[0]) for name, c in columns.items()}, sink)
        meta = dict(fill(digests))
        return {**meta, "key": key, "version": 1, "digest": digests.hexdigest()}

    def build(path: str | None) -> DerivedIndex:
        return build_index(maker, path, columns, fill_keyed)

    def check(ix: DerivedIndex) -> str | None:
        if ix.meta.get("key") != key:
            return "it was made for other data"
        if set(ix.arrays) != set(columns):
            return "it holds other arrays"
        # (the file is untrusted: a fits() check indexes the arrays as built here)
        for name, (dtype, shape) in columns.items():
            a = ix.arrays[name]
            if a.dtype != np.dtype(dtype) or a.shape[1:] != tuple(shape):
                return f"its array {name!r} is {a.dtype.str}{list(a.shape[1:])}, not {dtype}{list(shape)}"
        return fits(ix) if fits is not None else None

    if index_dir is None:
        return build(None)
    if index_dir is DEFAULT:
        index_dir = default_index_dir(kind)
    path = check_dir_option("index_dir", index_dir)
    return cached_index(path, key + INDEX_SUFFIX, maker, build, check)


# ----------------------------------------------------------------- fingerprints
def hash_parts(*parts: Any) -> str:
    """A key from ``parts``: the hex blake2b (16 bytes) of their reprs (bytes as they are).

    Example:
        >>> hash_parts("filter", 3) == hash_parts("filter", 3) != hash_parts("filter", 4)
        True
    """
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(repr(p).encode() if not isinstance(p, bytes) else p)
        h.update(b"\0")
    return h.hexdigest()


def _code_parts(code: types.CodeType, seen: set[int]) -> list[Any]:
    parts: list[Any] = [code.co_name, code.co_code, code.co_names, code.co_varnames]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            if id(c) not in seen:
                seen.add(id(c))
                parts.extend(_code_parts(c, seen))
        else:
            parts.append(_const_repr(c))
    return parts


def _const_repr(c: Any) -> str:
    """``repr`` of a code constant, a frozenset's elements sorted (its own order follows
    the process's string hash seed: ``x in {"a", "b"}``)."""
    if isinstance(c, frozenset):
        return "frozenset({" + ", ".join(sorted(map(_const_repr, c))) + "})"
    if isinstance(c, tuple):
        inner = [_const_repr(x) for x in c]
        return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"
    return repr(c)


def callable_fingerprint(fn: Any) -> str:
    """A hex digest of what a function computes: its code (and that of nested
    functions), constants, defaults and closure values; for a partial, its function and
    arguments; for a callable object or a bound method, its class's code (every method
    of it and of the classes it inherits from) and the object's pickled state.

    Globals a function reads are not part of it: name a predicate (``filter(...,
    name=...)``) when it depends on a global that changes. A function holding a value
    that does not pickle (a lock, an open file) gets a digest of its own at each call,
    shared with no other: name it to share its selection between calls and processes.
    A dict's order is part of it (a predicate may read it): one built from a set, whose
    order follows the string hash seed, keys each process apart unless named.

    Example:
        >>> callable_fingerprint(lambda r: r["x"] > 1) == callable_fingerprint(lambda r: r["x"] > 1)
        True
        >>> callable_fingerprint(lambda r: r["x"] > 1) == callable_fingerprint(lambda r: r["x"] > 2)
        False
    """
    return _fingerprint(fn, set())


def _fingerprint(fn: Any, active: set[int]) -> str:
    """:func:`callable_fingerprint` of ``fn``, met again inside one of the callables in
    ``active`` (being keyed): a nested function that calls itself is in its own closure."""
    if id(fn) in active:
        return hash_parts("itself")
    active.add(id(fn))
    try:
        return _keyed(fn, active)
    finally:
        active.discard(id(fn))


def _keyed(fn: Any, active: set[int]) -> str:
    if isinstance(fn, functools.partial):
        return hash_parts(
            "partial", _fingerprint(fn.func, active), _value(fn.args), _value(fn.keywords)
        )
    if isinstance(fn, types.MethodType):  # its object's class and state, not only its code
        owner = fn.__self__ if isinstance(fn.__self__, type) else type(fn.__self__)
        code = _class_code(owner)
        return hash_parts("method", _fingerprint(fn.__func__, active), *code, _value(fn.__self__))
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        cells = [_fingerprint(v, active) if callable(v) else _value(v) for v in _cells(fn)]
        return hash_parts(
            "function",
            fn.__module__,
            fn.__qualname__,
            *_code_parts(code, set()),
            _value(fn.__defaults__),
            _value(fn.__kwdefaults__),
            *cells,
        )
    if isinstance(fn, (types.BuiltinFunctionType, type)):
        return hash_parts("named", getattr(fn, "__module__", ""), fn.__qualname__)
    return hash_parts("object", *_class_code(type(fn)), _value(fn))


def _class_code(cls: type) -> list[Any]:
    """The name and code of ``cls`` and of each class it inherits from (builtins' left
    out): the code of every function it defines (methods, static and class methods,
    properties' accessors) and of the functions their closures hold (a decorator's
    wrapped method), in name order: a changed helper method is another class. Only code:
    other values a method holds (a decorator's lock, typing's caches) key nothing, as
    they would key each call apart.

    Example:
        >>> class K:
        ...     def f(self): return 1
        >>> before = _class_code(K)
        >>> class K:
        ...     def f(self): return 2
        >>> before == _class_code(K)
        False
    """
    parts = []
    for c in cls.__mro__:
        if c.__module__ == "builtins":
            continue
        parts += [c.__module__, c.__qualname__]
        for name, v in sorted(vars(c).items()):
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            fns = (v.fget, v.fset, v.fdel) if isinstance(v, property) else (v,)
            for f in fns:
                if isinstance(f, types.FunctionType):
                    parts += [name, *_function_code(f, set())]
    return parts


def _function_code(f: types.FunctionType, seen: set[int]) -> list[Any]:
    """The code of ``f`` and of the functions its closure holds, recursively."""
    parts = _code_parts(f.__code__, set())
    for v in _cells(f):
        if isinstance(v, types.FunctionType) and id(v) not in seen:
            seen.add(id(v))
            parts += _function_code(v, seen)
    return parts


def _cells(fn: Any) -> list[Any]:
    """The values ``fn``'s closure holds (``"<empty>"`` for an empty cell)."""
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append("<empty>")
    return out


def _value(v: Any) -> str:
    """A stable digest of a value: its pickle (the elements of sets anywhere in it
    sorted). A value that does not pickle gets a digest of its own,
    shared with no other value: its ``repr`` may leave parts out (a large array's
    middle) or name a memory address another object takes later.

    Example:
        >>> _value({"en", "de"}) == _value({"de", "en"}) != _value({"en"})
        True
        >>> _value(dict.fromkeys("ab")) == _value(dict.fromkeys("ba"))  # (its order read)
        False
        >>> import threading; lock = threading.Lock()
        >>> _value(lock) == _value(lock)
        False
    """
    if isinstance(v, np.ndarray):
        return hash_parts(v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes())
    try:
        out = io.BytesIO()
        _Canonical(out, protocol=4).dump(v)
        return hash_parts(out.getvalue())
    except Exception:
        return hash_parts("unpicklable", type(v).__qualname__, uuid.uuid4().hex)


class _Canonical(pickle.Pickler):
    """A pickler that writes a set or frozenset as its type and its elements' digests,
    sorted: a set's own order follows the process's string hash seed. (A subclass
    pickles as it says, its state included; a dict keeps its order, which a predicate
    may read: one built from a set, ``dict.fromkeys(a_set)``, keys each process apart.)"""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in (set, frozenset):
            return (type(obj).__name__, sorted(map(_element_key, obj)))
        return None


_ATOMIC = frozenset({str, bytes, int, float, complex, bool, type(None)})


def _element_key(x: Any) -> bytes:
    """What a set's element is sorted and keyed by: its pickle (a str, a number), else
    its digest (:func:`_value`)."""
    return pickle.dumps(x, protocol=4) if type(x) in _ATOMIC else _value(x).encode()


def _file_identity(path: str, version: tuple | None) -> tuple[Any, ...]:
    """A local file's size, modification and change times and inode; a remote one's name
    and ``version`` (what tells apart the version its source reads: size, ETag, checksum,
    see :func:`_remote_version`). (The change time, which no user can set, moves when a
    file is rewritten in place with its modification time restored: ``rsync --inplace
    -t``.)"""
    if "://" in path and not path.startswith("file://"):
        return (path, version)
    local = path[len("file://") :] if path.startswith("file://") else path
    try:
        st = os.stat(local)
    except OSError:
        return (path, "missing")
    return (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _remote_version(src: ShardedSource, shard: int, path: str) -> tuple[Any, ...]:
    """What tells the version of remote ``shard`` of ``src`` apart, the same before and
    after the source reads it: the checksum its dataset records (a manifest's), else the
    version its opening pinned (size, ETag, Last-Modified), else (a manifest without
    checksums: the shard's version is pinned at its first read) the version its store
    gives now, asked under the source's retry policy."""
    checksum = src.shard_integrity(shard)[1]
    if checksum is not None:
        return ("checksum", checksum)
    version = src.shard_version(shard)
    if version is not None and any(version[1:]):
        return ("pinned", version)
    fs = src.filesystem
    with using(src.options.retry_policy):
        return ("asked", remote.size_and_version(fs, fs._strip_protocol(path), url=path))


def layout_fingerprint(ds: Any, *, checksums: bool = False) -> str | None:
    """A hex digest of which records a dataset's indices name, the same on every machine
    that reads a copy of it (what a sampler's saved state is checked against when it is
    loaded: a dataset re-converted or with a shard swapped since, of the same length,
    would otherwise resume at other records). None where nothing under ``ds`` is a
    sharded source.

    Per shard of each sharded source under ``ds`` (through a
    :class:`~torchgrain.Dataset` and composed datasets' ``children``): its file's name
    and record count, with the composition's types and lengths; with ``checksums``, also
    the checksum its manifest records (None where a shard has none: the same files
    opened without their manifest, by a list of files, have none). Nothing a copy
    changes (paths, times, inodes), and nothing one process may know and another not.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": i} for i in range(4)], d)
        >>> a = layout_fingerprint(tg.ArrayRecordSource(d), checksums=True)
        >>> a == layout_fingerprint(tg.Dataset(tg.ArrayRecordSource(d)), checksums=True)
        True
        >>> _ = tg.write_array_record([{"x": -i} for i in range(4)], d, overwrite=True)
        >>> a == layout_fingerprint(tg.ArrayRecordSource(d), checksums=True)
        False
        >>> layout_fingerprint(tg.ArrayRecordSource(d)) is not None, layout_fingerprint([1])
        (True, None)
    """
    from torchgrain.compose.view import Composed
    from torchgrain.dataset import Dataset

    if isinstance(ds, Dataset):
        return layout_fingerprint(ds.source, checksums=checksums)
    if isinstance(ds, ShardedSource):
        shards = []
        for k, path in enumerate(ds.paths):
            shard = (os.path.basename(path.rstrip("/")), int(ds.shard_counts[k]))
            if checksums:
                checksum = ds.shard_integrity(k)[1]
                if checksum is None:
                    return None
                shard += (checksum,)
            shards.append(shard)
        return hash_parts("shards", type(ds).__qualname__, shards)
    if isinstance(ds, Composed):
        children = [layout_fingerprint(c, checksums=checksums) for c in ds.children]
        if any(c is None for c in children) if checksums else all(c is None for c in children):
            return None
        return hash_parts("composed", type(ds).__qualname__, len(ds), children)
    return None


def composition_fingerprint(ds: Any) -> str | None:
    """A hex digest of the compositions under ``ds``: each one's type, length and
    :meth:`~torchgrain.compose.view.Composed.identity` (a mixture's seed and weights, a
    split's seed and counts, a filter's selection) and where each child sits (the
    length of each that is not composed); None where nothing is composed. With :func:`layout_fingerprint`, what
    a sampler's saved state is checked against: a mixture of the same files with other
    weights has the same length and files, and its indices name other records.

    Example:
        >>> import torchgrain as tg
        >>> a, b = tg.Dataset(list(range(5))), tg.Dataset(list(range(9)))
        >>> mixed = tg.mix([a, b], [0.5, 0.5], seed=0)
        >>> composition_fingerprint(mixed) == composition_fingerprint(tg.mix([a, b], [0.5, 0.5], seed=0))
        True
        >>> composition_fingerprint(mixed) == composition_fingerprint(tg.mix([a, b], [0.5, 0.5], seed=1))
        False
        >>> composition_fingerprint(a) is None
        True
    """
    from torchgrain.compose.view import Composed
    from torchgrain.dataset import Dataset

    composed = False

    def tree(d: Any) -> Any:  # (where each composition and each other dataset sits)
        nonlocal composed
        if isinstance(d, Dataset):
            return tree(d.source)
        if not isinstance(d, Composed):
            return ("data", len(d))
        composed = True
        return (type(d).__qualname__, len(d), repr(d.identity()), [tree(c) for c in d.children])

    parts = tree(ds)
    return hash_parts("compositions", parts) if composed else None


def dataset_fingerprint(ds: Any) -> str:
    """A hex digest that changes when the data under ``ds`` changes.

    ``ds`` is a :class:`~torchgrain.Dataset` (its source and its transforms), an object
    that states its own (:class:`~torchgrain.protocols.Fingerprinted`: the composed
    datasets), a :class:`~torchgrain.Source` (its type, length, records per shard, keys,
    schema and :meth:`~torchgrain.Source.record_settings`, and each local file's size, modification and change times and inode; a remote
    file's name, the version its opening read, ``shard_version``: size, ETag and
    Last-Modified as the server gave them, and the checksum its manifest records; a remote
    file known by neither, the version its store gives now), or a plain sequence (its type
    and length: give a
    filter a ``name`` that says what it holds).

    Example:
        >>> import tempfile, numpy as np, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_array_record([{"x": np.int64(i)} for i in range(4)], d)
        >>> a = dataset_fingerprint(tg.Dataset(tg.ArrayRecordSource(d)))
        >>> a == dataset_fingerprint(tg.Dataset(tg.ArrayRecordSource(d)))
        True
        >>> a == dataset_fingerprint(tg.Dataset(tg.ArrayRecordSource(d)).map(lambda r: r))
        False
    """
    from torchgrain.adapters import SequenceSource
    from torchgrain.dataset import Dataset

    if isinstance(ds, SequenceSource):
        return dataset_fingerprint(ds.items)
    if isinstance(ds, Dataset):
        ops = [(op[0], callable_fingerprint(op[1]), *op[2:]) for op in ds._ops]
        return hash_parts("dataset", dataset_fingerprint(ds.source), ops)
    if isinstance(ds, Fingerprinted):
        return hash_parts("stated", type(ds).__qualname__, ds.fingerprint())
    if isinstance(ds, Source):
        paths = ds.paths
        versions: list[Any] = [None] * len(paths)
        if isinstance(ds, ShardedSource) and not is_local(ds.filesystem):
            # (a store asked for versions it has not given: once per file, on threads)
            versions = map_files(lambda k: _remote_version(ds, k, paths[k]), len(paths))
        elif isinstance(ds, ShardedSource):
            # What the source reads may be the version it opened (mapped, cached), not the
            # file's now: a selection computed from it must not be keyed by the new one.
            for k in range(len(paths)):
                with contextlib.suppress(FileNotFoundError):  # ("missing", below)
                    ds.check_unchanged(k)
        files = [_file_identity(p, v) for p, v in zip(paths, versions)]
        counts = np.asarray(ds.shard_counts, np.int64).tobytes()
        # What its records hold: the same files read with other columns (or another
        # codec) are other records, and a predicate may see the difference.
        records = (list(ds.keys), sorted(ds.schema.items()), ds.record_settings())
        return hash_parts(
            "source", type(ds).__module__, type(ds).__qualname__, len(ds), counts, files, records
        )
    return hash_parts("sequence", type(ds).__module__, type(ds).__qualname__, len(ds))
