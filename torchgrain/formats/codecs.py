"""Record codecs: how one record's bytes become a ``dict[str, value]`` and back.

* ``msgpack`` (torchgrain's own): a msgpack map from str keys to values. numpy arrays
  are a msgpack extension (type 1) holding dtype, shape and the raw C-order bytes, and
  decode with :func:`numpy.frombuffer` into writable arrays (one memcpy of the payload).
  ``MsgpackCodec(zero_copy=True)`` skips that copy and returns read-only views of the
  record buffer instead; torch warns when such an array becomes a tensor, which is why
  writable arrays are the default.
* ``raw``: the record is returned as ``{"bytes": data}``, for files written by other tools.
* ``tf_example``: serialized ``tf.train.Example`` protos (see
  :mod:`torchgrain.formats.tf_example`), decoded without TensorFlow.

Decoding never executes code from the data: there is no pickle codec unless a user
registers one by name with :func:`register_codec`.

Example:
    >>> import numpy as np
    >>> c = get_codec("msgpack")
    >>> rec = c.decode(c.encode({"x": np.arange(3, dtype=np.int16), "y": "cat"}))
    >>> rec["x"].dtype, rec["x"].tolist(), rec["y"]
    (dtype('int16'), [0, 1, 2], 'cat')
"""

from __future__ import annotations

import abc
import functools
import math
import struct
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from torchgrain.errors import RecordDecodeError

__all__ = [
    "BaseCodec",
    "Codec",
    "MsgpackCodec",
    "RawCodec",
    "as_codec",
    "available_codecs",
    "describe_value",
    "get_codec",
    "merge_schema",
    "register_codec",
    "schema_sampled",
    "sniff_codec",
    "split_type",
]

_NDARRAY_EXT = 1
# ext payload: u8 len(dtype.str) | dtype.str | u8 ndim | ndim x u64 shape | raw bytes
_MAX_NDIM = 32
# msgpack's own guards against length fields larger than the input.
_UNPACK_LIMITS: dict[str, int] = {}
_DICT = {dict}
_BYTES = {bytes}
#: Value types that hold no map: a record of these alone needs no look at nested keys.
_FLAT = frozenset({str, int, float, bool, bytes, type(None), np.ndarray})


@runtime_checkable
class Codec(Protocol):
    """Turns a record's bytes into a dict (and, optionally, back with ``encode``).

    Every codec the sources use has the three decoding methods: a codec that subclasses
    :class:`BaseCodec` writes ``decode`` and inherits the two batch forms; any other
    object with ``name`` and ``decode`` is given them by :func:`get_codec`.
    """

    name: str

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        """One record; raises :class:`~torchgrain.RecordDecodeError` (or any error) on
        bytes it cannot decode."""
        ...

    def decode_batch(self, blobs: list[Any]) -> list[dict[str, Any]] | None:
        """Many records at once; None (or an error) when some record does not decode:
        the caller then decodes them one by one to name it."""
        ...

    def decode_columns(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Any:
        """The records ``buf[starts[i]:ends[i]]`` as a
        :class:`~torchgrain.columns.ColumnBatch`, or None when this codec (or this
        batch) has no column form: the caller then builds columns from the records.
        ``buf`` is a scratch buffer reused by the next batch: columns must not keep
        views of it."""
        ...


class BaseCodec(abc.ABC):
    """Base of codecs: a subclass names itself and writes :meth:`decode`; the batch forms
    default to a loop over it (:meth:`decode_batch`) and to no column form
    (:meth:`decode_columns`), and a codec that can do better overrides them.

    Example:
        >>> class Upper(BaseCodec):
        ...     name = "upper"
        ...     def decode(self, data):
        ...         return {"text": bytes(data).decode().upper()}
        >>> c = Upper()
        >>> c.decode_batch([b"a", b"b"]), c.decode_columns(np.zeros(2, np.uint8), [0], [1])
        ([{'text': 'A'}, {'text': 'B'}], None)
        >>> isinstance(c, Codec)
        True
    """

    name: str = ""

    @abc.abstractmethod
    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        """One record (see :meth:`Codec.decode`)."""

    def decode_batch(self, blobs: list[Any]) -> list[dict[str, Any]] | None:
        """Many records: :meth:`decode` on each (an error propagates)."""
        decode = self.decode
        return [decode(b) for b in blobs]

    def decode_columns(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Any:
        """No column form by default (None): the caller builds columns from records."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class _DecodeOnly(BaseCodec):
    """A codec object with only ``name`` and ``decode`` (the earlier contract), given
    the batch forms; every other attribute (``encode``...) is the object's own."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self.name = getattr(codec, "name", type(codec).__name__)

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        return self.codec.decode(data)

    def __getattr__(self, attr: str) -> Any:
        if attr == "codec":  # not set yet (unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self.codec, attr)

    def __repr__(self) -> str:
        return repr(self.codec)


def as_codec(codec: Any) -> Codec:
    """``codec`` as a complete :class:`Codec`: itself when it has the batch forms, else
    wrapped to get them.

    Raises:
        TypeError: ``codec`` has no ``decode`` method.

    Example:
        >>> class Plain:
        ...     name = "plain"
        ...     def decode(self, data):
        ...         return {"n": len(data)}
        >>> c = as_codec(Plain())
        >>> c.name, c.decode_batch([b"ab"]), isinstance(c, Codec)
        ('plain', [{'n': 2}], True)
    """
    if not callable(getattr(codec, "decode", None)):
        raise TypeError("a codec needs a decode(data) method")
    if isinstance(codec, BaseCodec) or (
        callable(getattr(codec, "decode_batch", None))
        and callable(getattr(codec, "decode_columns", None))
    ):
        return codec
    return _DecodeOnly(codec)


def _encode_ndarray(arr: np.ndarray) -> msgpack.ExtType:
    if arr.dtype.hasobject:
        raise TypeError("object arrays cannot be stored; convert them to a numeric or bytes dtype")
    if arr.dtype.names is not None:
        # The header stores dtype.str, which for a structured dtype is a bare "|V<n>":
        # the fields would come back as anonymous void bytes.
        raise TypeError(
            f"structured arrays cannot be stored (dtype {arr.dtype}); store each field "
            "under its own key"
        )
    if arr.ndim > _MAX_NDIM:
        raise ValueError(f"arrays of more than {_MAX_NDIM} dimensions are not supported")
    if not arr.dtype.isnative:
        # Stored in native order: torch (and the default collate) refuses big-endian data.
        arr = arr.astype(arr.dtype.newbyteorder("="))
    dt = arr.dtype.str.encode("ascii")
    header = struct.pack(f"<B{len(dt)}sB{arr.ndim}Q", len(dt), dt, arr.ndim, *arr.shape)
    return msgpack.ExtType(_NDARRAY_EXT, header + np.ascontiguousarray(arr).tobytes())


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _encode_ndarray(obj)
    if isinstance(obj, np.generic):
        # numpy scalars keep their dtype as 0-d arrays.
        return _encode_ndarray(np.asarray(obj))
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    raise TypeError(f"cannot encode value of type {type(obj).__name__}")


#: Levels of nesting past which a record is read back once at encode: msgpack packs an
#: empty list or map one level deeper than it unpacks (511 levels is msgpack 1.0's limit).
_DEEP = 500


def _check_map_keys(value: Any, path: tuple[Any, ...]) -> int:
    """Refuse a map inside a record value whose key the reader cannot decode (msgpack
    reads back str and bytes keys only), naming the key's path (``['meta'][1]``); else
    the length of the deepest path it holds."""
    deepest = len(path)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, bytes)):
                raise _key_error((*path, k))
            if type(v) not in _FLAT and (d := _check_map_keys(v, (*path, k))) > deepest:
                deepest = d
    elif isinstance(value, (list, tuple)) and not set(map(type, value)) <= _FLAT:
        for i, v in enumerate(value):
            if (d := _check_map_keys(v, (*path, i))) > deepest:
                deepest = d
    return deepest


def _key_error(path: tuple[Any, ...]) -> TypeError:
    where = "".join(f"[{p!r}]" for p in path)
    return TypeError(
        f"record key {where} is not str or bytes ({type(path[-1]).__name__}): the keys "
        "of a record's maps must be, or the record cannot be read back"
    )


def _check_deep_map_keys(record: dict[str, Any]) -> None:
    """:func:`_check_map_keys` of every value of ``record`` without recursion, for a
    record deeper than Python's stack that msgpack packed (so acyclic, and at most its
    nesting limit deep: 1024 levels in msgpack 1.2, 511 in 1.0).

    Example:
        >>> v = {1: "x"}
        >>> for _ in range(1010):
        ...     v = [v]
        >>> _check_deep_map_keys({"a": v})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: record key ['a'][0][0]...[0][1] is not str or bytes (int): ...
    """
    # (value, its parent's entry, its key there): a path is built only when refused
    stack: list[tuple[Any, Any, Any]] = [(v, None, k) for k, v in reversed(record.items())]
    while stack:
        entry = stack.pop()
        value = entry[0]
        if isinstance(value, dict):
            items = list(value.items())
            for k in value:
                if not isinstance(k, (str, bytes)):
                    path = [k]
                    while entry is not None:
                        path.append(entry[2])
                        entry = entry[1]
                    raise _key_error(tuple(reversed(path)))
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            continue
        stack.extend((v, entry, k) for k, v in reversed(items) if type(v) not in _FLAT)


def _decode_ndarray(writable: bool, code: int, data: bytes) -> Any:
    if code != _NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension type {code}")
    view = memoryview(data)
    n = view[0] if len(view) else 0
    if len(view) < 2 + n:
        raise ValueError("truncated ndarray header")
    dtype = np.dtype(bytes(view[1 : 1 + n]).decode("ascii"))
    if dtype.hasobject:
        raise ValueError("object dtype is not allowed in records")
    ndim = view[1 + n]
    if ndim > _MAX_NDIM:
        raise ValueError(f"ndarray with {ndim} dimensions")
    start = 2 + n + 8 * ndim
    if len(view) < start:
        raise ValueError("truncated ndarray shape")
    shape = struct.unpack_from(f"<{ndim}Q", data, 2 + n)
    count = math.prod(shape)
    if count * dtype.itemsize != len(view) - start:
        raise ValueError(
            f"ndarray payload of {len(view) - start} bytes does not match shape {shape} {dtype}"
        )
    payload = bytearray(view[start:]) if writable else data
    arr = np.frombuffer(payload, dtype=dtype, count=count, offset=0 if writable else start)
    return arr.reshape(shape)


class MsgpackCodec(BaseCodec):
    """torchgrain's default record codec (see module docstring).

    Example:
        >>> c = MsgpackCodec()
        >>> c.decode(c.encode({"label": 3, "tags": ["a", "b"], "none": None}))
        {'label': 3, 'tags': ['a', 'b'], 'none': None}
    """

    name = "msgpack"

    def __init__(self, *, zero_copy: bool = False) -> None:
        self.zero_copy = zero_copy
        self._hook = functools.partial(_decode_ndarray, not zero_copy)

    def encode(self, record: dict[str, Any]) -> bytes:
        if not isinstance(record, dict):
            raise TypeError(f"a record must be a dict, got {type(record).__name__}")
        for k in record:  # before packing, which would blame a key it cannot pack as a value
            if not isinstance(k, str):
                raise TypeError(f"record keys must be str, got {k!r}")
        depth = 0
        try:  # nested keys too
            for k, v in record.items():
                if type(v) not in _FLAT and (d := _check_map_keys(v, (k,))) > depth:
                    depth = d
        except RecursionError:
            # A cyclic value, or one deeper than msgpack's limit: packb refuses it;
            # else one deeper than Python's stack allows, checked without recursion.
            packed = msgpack.packb(record, default=_default, use_bin_type=True)
            _check_deep_map_keys(record)
            return self._read_back(packed)
        packed = msgpack.packb(record, default=_default, use_bin_type=True)
        return packed if depth <= _DEEP else self._read_back(packed)

    def _read_back(self, packed: bytes) -> bytes:
        """``packed``, a deep record, once it is read back (msgpack packs an empty list
        or map at a level it does not unpack)."""
        try:
            self.decode(packed)
        except RecordDecodeError as e:
            raise ValueError(f"a record nested too deeply to be read back: {e}") from None
        return packed

    def decode_columns(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Any:
        """A batch of records (``buf[starts[i]:ends[i]]``) as columns, or None when they
        are not flat maps of one layout (see :mod:`torchgrain.formats.msgpack_columns`)."""
        from torchgrain.formats.msgpack_columns import decode_columns

        return decode_columns(buf, starts, ends)

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        try:
            out = msgpack.unpackb(
                data, ext_hook=self._hook, raw=False, strict_map_key=True, use_list=True
            )
        except Exception as e:
            raise RecordDecodeError(
                f"undecodable msgpack record: {str(e) or type(e).__name__}"
            ) from None
        if not isinstance(out, dict):
            raise RecordDecodeError(f"msgpack record is a {type(out).__name__}, not a map")
        return out

    def decode_batch(self, blobs: list[Any]) -> list[dict[str, Any]] | None:
        """Many records at once, with no Python code per record; None when one of them
        does not decode to a map (decode them one by one to learn which and why).

        Example:
            >>> c = MsgpackCodec()
            >>> c.decode_batch([c.encode({"a": 1}), c.encode({"a": 2})])
            [{'a': 1}, {'a': 2}]
            >>> c.decode_batch([c.encode({"a": 1}), b"\\xc1"]) is None
            True
        """
        unpack = functools.partial(
            msgpack.unpackb, ext_hook=self._hook, raw=False, strict_map_key=True, use_list=True
        )
        try:
            out = list(map(unpack, blobs))
        except Exception:
            return None
        return out if set(map(type, out)) <= _DICT else None


class RawCodec(BaseCodec):
    """Returns each record's bytes unchanged as ``{"bytes": data}``.

    Example:
        >>> RawCodec().decode(b"abc")
        {'bytes': b'abc'}
    """

    name = "raw"

    def encode(self, record: dict[str, Any]) -> bytes:
        return bytes(record["bytes"])

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        return {"bytes": bytes(data) if isinstance(data, memoryview) else data}

    def decode_batch(self, blobs: list[Any]) -> list[dict[str, Any]]:
        """Many records at once (what :meth:`decode` gives for each).

        Example:
            >>> RawCodec().decode_batch([b"a", memoryview(b"b")])
            [{'bytes': b'a'}, {'bytes': b'b'}]
        """
        if set(map(type, blobs)) <= _BYTES:
            return [{"bytes": b} for b in blobs]
        return [{"bytes": bytes(b) if isinstance(b, memoryview) else b} for b in blobs]

    def decode_columns(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Any:
        """A batch of records as one ``bytes`` column (a :class:`~torchgrain.columns.Ragged`)."""
        from torchgrain.columns import ColumnBatch, Ragged, empty, gather_ranges

        lengths = ends - starts
        offsets = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = empty((int(offsets[-1]),), np.uint8)
        gather_ranges(buf, starts, lengths, values)
        return ColumnBatch({"bytes": Ragged(values, offsets, "bytes")}, num_rows=len(starts))


_REGISTRY: dict[str, Codec] = {"msgpack": MsgpackCodec(), "raw": RawCodec()}


def register_codec(name: str, codec: Codec) -> None:
    """Make ``codec`` available to sources as ``codec=name``.

    Example:
        >>> class Upper:
        ...     name = "upper"
        ...     def decode(self, data):
        ...         return {"text": bytes(data).decode().upper()}
        >>> register_codec("upper", Upper())
        >>> get_codec("upper").decode(b"hi")
        {'text': 'HI'}
    """
    _REGISTRY[name] = as_codec(codec)


def get_codec(name: str | Codec) -> Codec:
    """Look a codec up by name (or pass a codec object through): what a format encodes
    and decodes its records with (``tg.sources.get_codec``).

    Example:
        >>> codec = get_codec("msgpack")
        >>> codec.decode(codec.encode({"a": 1}))
        {'a': 1}
    """
    if not isinstance(name, str):
        if not callable(getattr(name, "decode", None)):
            raise TypeError("codec must be a name or an object with a decode(data) method")
        return as_codec(name)
    codec = _REGISTRY.get(name)
    if codec is None and name == "tf_example":  # imported on first use
        from torchgrain.formats.tf_example import TFExampleCodec

        codec = _REGISTRY[name] = TFExampleCodec()
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    return codec


def available_codecs() -> list[str]:
    """Names accepted by ``codec=``."""
    return sorted(set(_REGISTRY) | {"tf_example"})


def sniff_codec(sample: bytes | memoryview) -> str:
    """Guess the codec of a record written by an unknown tool.

    A record that decodes as a msgpack map with str keys is ``msgpack``; anything else is
    ``raw`` (the safe choice: bytes pass through untouched).

    Example:
        >>> sniff_codec(MsgpackCodec().encode({"a": 1})), sniff_codec(b"\\x0a\\x00")
        ('msgpack', 'raw')
    """
    try:
        MsgpackCodec().decode(sample)
    except RecordDecodeError:
        return "raw"
    return "msgpack"


def describe_value(value: Any) -> str:
    """A short type description used in schemas, e.g. ``uint8[64,64,3]`` or ``str``.

    Example:
        >>> describe_value(np.zeros((2, 3), np.float32)), describe_value(b"x"), describe_value([1])
        ('float32[2,3]', 'bytes', 'list[int]')
    """
    if isinstance(value, np.ndarray):
        return f"{value.dtype.name}[{','.join(str(s) for s in value.shape)}]"
    if isinstance(value, np.generic):
        return value.dtype.name
    if isinstance(value, (list, tuple)):
        inner = sorted({describe_value(v) for v in value[:16]})
        return f"list[{'|'.join(inner)}]" if inner else "list"
    # (bool before int: a bool is an int)
    return next((t for types, t in _TYPE_NAMES if isinstance(value, types)), type(value).__name__)


_TYPE_NAMES = (
    (type(None), "null"),
    (bool, "bool"),
    (int, "int"),
    (float, "float"),
    (str, "str"),
    ((bytes, bytearray, memoryview), "bytes"),
    (dict, "map"),
)


def split_type(t: str) -> list[str]:
    """A type's alternatives (see :func:`describe_value`): ``t`` split at each ``|``
    outside brackets, so a list's element types stay in their ``list[...]``.

    Example:
        >>> split_type("list[int|null]|null|uint8[2,3]")
        ['list[int|null]', 'null', 'uint8[2,3]']
    """
    if "[" not in t:
        return t.split("|")
    out, depth, start = [], 0, 0
    for i, ch in enumerate(t):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "|" and depth == 0:
            out.append(t[start:i])
            start = i + 1
    out.append(t[start:])
    return out


def union_type(a: str, b: str) -> str:
    """The type of values of types ``a`` or ``b`` (see :func:`describe_value`): their
    alternatives joined by ``|``, an array dtype's differing shapes as one with ``?``
    where they differ (``...`` where their dimensions do).

    Example:
        >>> union_type("int", "null|str"), union_type("uint8[2,3]", "uint8[2,4]")
        ('int|null|str', 'uint8[2,?]')
        >>> union_type("list[bool|float]", "list[int]")
        'list[bool|float]|list[int]'
    """
    if a == b:
        return a
    parts = {*split_type(a), *split_type(b)}
    # Arrays of one dtype but different shapes: keep the dtype, mark varying dims with '?'.
    arrays = [p for p in parts if p.endswith("]") and "[" in p and not p.startswith("list")]
    by_dtype: dict[str, list[str]] = {}
    for p in arrays:
        by_dtype.setdefault(p.split("[", 1)[0], []).append(p)
    for dtype, specs in by_dtype.items():
        if len(specs) < 2:
            continue
        shapes = [s[len(dtype) + 1 : -1].split(",") for s in specs]
        if len({len(s) for s in shapes}) == 1:
            dims = ["?" if len(set(col)) > 1 else col[0] for col in zip(*shapes)]
            merged = f"{dtype}[{','.join(dims)}]"
        else:
            merged = f"{dtype}[...]"
        parts -= set(specs)
        parts.add(merged)
    return "|".join(sorted(parts))


#: Writers fold every record up to this one into the schema they record, then one in
#: :data:`SCHEMA_SAMPLE_EVERY`. Per output shard in a conversion (a 64-shard conversion
#: samples 64 times as many), per dataset in ``write_array_record``. Folding one record
#: costs ~4 us (~3 us more to decode a record that passes through a conversion as bytes):
#: a few ms per shard, where every record would cost more than the write itself.
SCHEMA_SAMPLE_FIRST = 1000
SCHEMA_SAMPLE_EVERY = 1009  # a prime: no periodic pattern in the data lines up with it


def schema_sampled(k: int) -> bool:
    """Whether record ``k`` (0-based, in writing order) goes into a written schema: the
    one rule of every dataset writer (``write_array_record``, ``torchgrain convert``).

    Example:
        >>> [k for k in (0, 999, 1000, 1009, 2018, 2019) if schema_sampled(k)]
        [0, 999, 1009, 2018]
    """
    return k < SCHEMA_SAMPLE_FIRST or k % SCHEMA_SAMPLE_EVERY == 0


def merge_schema(schema: dict[str, str], record: dict[str, Any]) -> dict[str, str]:
    """Fold one record into a running ``key -> type`` schema: what a source's ``schema``
    is built from (``tg.sources.merge_schema``).

    Types are :func:`describe_value`'s; where records differ they join with ``|`` (a key
    missing from some records is ``|null``), and an array dimension that varies becomes
    ``?``. Start from ``{}``; the input is not changed. A format author folds the records
    they sample (``schema_sampled(k)`` says which: the writers' rule) into the
    ``schema`` property of their :class:`~torchgrain.Source`.

    Example:
        >>> s = merge_schema({}, {"x": np.zeros(2, np.uint8), "y": 1})
        >>> merge_schema(s, {"x": np.zeros(3, np.uint8)})
        {'x': 'uint8[?]', 'y': 'int|null'}
        >>> records = [{"id": 1, "text": "a"}, {"id": 2, "text": None}, {"id": 3.5}]
        >>> schema = {}
        >>> for k, rec in enumerate(records):
        ...     if schema_sampled(k):
        ...         schema = merge_schema(schema, rec)
        >>> schema
        {'id': 'float|int', 'text': 'null|str'}
    """
    out = dict(schema)
    first = not schema
    for k, v in record.items():
        t = describe_value(v)
        if k in out:
            out[k] = union_type(out[k], t)
        else:
            out[k] = t if first else union_type("null", t)
    for k in schema:
        if k not in record:
            out[k] = union_type(out[k], "null")
    return out
