"""Decode and encode serialized ``tf.train.Example`` protos without TensorFlow or protobuf.

TFDS datasets (ArrayRecord or TFRecord) store each record as a ``tf.train.Example``. This
module reads the wire format directly, accepting exactly what a conforming protobuf parser
accepts. Decoded values: ``bytes_list`` -> ``list[bytes]``, ``int64_list`` -> ``int64``
array, ``float_list`` -> ``float32`` array, no kind set -> ``[]`` (``squeeze=True`` makes
one-element lists scalars). Malformed input raises
:class:`~torchgrain.errors.RecordDecodeError`, with work and memory bounded by its size.

Design notes: docs/design-notes.md#formats-tf-example.

Example:
    >>> import numpy as np
    >>> data = encode_tf_example({"label": 3, "image": b"\\x89PNG", "score": [0.5, 1.0]})
    >>> ex = decode_tf_example(data)
    >>> ex["label"], ex["image"], ex["score"]
    (array([3]), [b'\\x89PNG'], array([0.5, 1. ], dtype=float32))
    >>> decode_tf_example(data, squeeze=True)["label"]
    np.int64(3)
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from torchgrain.errors import RecordDecodeError
from torchgrain.formats._proto import VarintError, decode_varints
from torchgrain.formats.codecs import BaseCodec

__all__ = ["TFExampleCodec", "decode_tf_example", "encode_tf_example"]

_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63
_MAX_DEPTH = 100  # protobuf's default recursion limit
_F32 = np.dtype("<f4")

# Wire types.
_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5

# Feature kinds (the oneof field numbers).
_BYTES, _FLOAT, _INT64 = 1, 2, 3


def _err(msg: str, pos: int) -> RecordDecodeError:
    return RecordDecodeError(f"malformed tf.train.Example: {msg} at byte {pos}")


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Decode a varint starting at ``pos``; at most 10 bytes, bits past 64 dropped."""
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise _err("truncated varint", start)
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise _err("varint longer than 10 bytes", start)


def _tag(buf: bytes, pos: int, end: int, in_group: bool = False) -> tuple[int, int]:
    """A field's tag and the position after it. Field number 0 is malformed, except
    inside a skipped group, where protobuf's parser (upb) skips it too."""
    b = buf[pos]
    if b < 0x80:
        tag, pos = b, pos + 1
    else:
        start = pos
        tag, pos = _varint(buf, pos, end)
        if pos - start > 5 or tag > 0xFFFFFFFF:
            raise _err("field tag out of range", start)
    if tag >> 3 == 0 and not in_group:
        raise _err("field number 0", pos - 1)
    return tag, pos


def _length(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Decode a length prefix and check the delimited bytes lie within ``[pos, end)``."""
    if pos < end and buf[pos] < 0x80:
        n, p = buf[pos], pos + 1
    else:
        n, p = _varint(buf, pos, end)
    if n > end - p:
        raise _err(f"length {n} runs past the end of its message", pos)
    return p + n, p


def _skip(buf: bytes, pos: int, end: int, tag: int, depth: int) -> int:
    """Skip the value of an unknown field whose tag was just read; return the new position."""
    wt = tag & 7
    if wt == _VARINT:
        return _varint(buf, pos, end)[1]
    if wt == _LEN:
        return _length(buf, pos, end)[0]
    if wt in (_I32, _I64):
        width = 4 if wt == _I32 else 8
        if pos + width > end:
            raise _err("truncated fixed-width field", pos)
        return pos + width
    if wt == _SGROUP:
        # Walk the group without recursion; each nested group counts toward the depth.
        stack = [tag >> 3]
        while stack:
            if depth + len(stack) > _MAX_DEPTH:
                raise _err("groups nested too deeply", pos)
            if pos >= end:
                raise _err("unterminated group", pos)
            t, pos = _tag(buf, pos, end, in_group=True)
            w = t & 7
            if w == _EGROUP:
                if t >> 3 != stack.pop():
                    raise _err("mismatched end-group", pos)
            elif w == _SGROUP:
                stack.append(t >> 3)
            else:
                pos = _skip(buf, pos, end, t, depth)
        return pos
    if wt == _EGROUP:
        raise _err("end-group without a matching start-group", pos)
    raise _err(f"invalid wire type {wt}", pos)


def _packed_varints(buf: bytes, start: int, end: int) -> np.ndarray:
    """Decode packed varints in ``buf[start:end]`` to int64 (two's complement)."""
    n = end - start
    if n <= 48:
        out = []
        pos = start
        while pos < end:
            b = buf[pos]
            if b < 0x80:
                out.append(b)
                pos += 1
            else:
                v, pos = _varint(buf, pos, end)
                out.append(v - (1 << 64) if v & _SIGN64 else v)
        return np.array(out, dtype=np.int64)
    # Vectorised (torchgrain.formats._proto).
    b = np.frombuffer(buf, dtype=np.uint8, count=n, offset=start)
    try:
        values, _ = decode_varints(b)
    except VarintError as e:
        msg = "truncated packed varint" if e.truncated else str(e)
        raise _err(msg, start + e.pos) from None
    return values.view(np.int64)


def _parse_feature(buf: bytes, pos: int, end: int, feat: list[Any], depth: int) -> None:
    """Parse one ``Feature`` into ``feat``: ``[oneof kind, the pieces collected so far]``."""
    while pos < end:
        tag, pos = _tag(buf, pos, end)
        kind = tag >> 3
        if tag & 7 != _LEN or kind > 3:
            pos = _skip(buf, pos, end, tag, depth)
            continue
        sub_end, pos = _length(buf, pos, end)
        if feat[0] != kind:
            # Setting a different member of a oneof discards the previous one; setting
            # the same member again merges (concatenates the repeated values).
            feat[:] = kind, []
        parts = feat[1]
        sub_depth = depth + 1
        if sub_depth > _MAX_DEPTH:
            raise _err("messages nested too deeply", pos)
        # Floats are gathered as bytes in one buffer, unpacked ints as ints made one
        # array: a piece each cost ~50 bytes of memory per byte of input (~100 per 2).
        floats = bytearray()
        loose: list[int] = []
        while pos < sub_end:
            tag, pos = _tag(buf, pos, sub_end)
            if tag == 0x0A:  # a bytes value, or a packed run of numbers
                e, s = _length(buf, pos, sub_end)
                if kind == _BYTES:
                    parts.append(buf[s:e])
                elif kind == _FLOAT:
                    if (e - s) & 3:
                        raise _err("packed float list length is not a multiple of 4", s)
                    floats += buf[s:e]
                else:
                    if loose:
                        parts.append(np.array(loose, dtype=np.int64))
                        loose = []
                    parts.append(_packed_varints(buf, s, e))
                pos = e
            elif tag == 0x0D and kind == _FLOAT:  # one unpacked float
                if pos + 4 > sub_end:
                    raise _err("truncated float", pos)
                floats += buf[pos : pos + 4]
                pos += 4
            elif tag == 0x08 and kind == _INT64:  # one unpacked varint
                v, pos = _varint(buf, pos, sub_end)
                loose.append(v - (1 << 64) if v & _SIGN64 else v)
            else:
                pos = _skip(buf, pos, sub_end, tag, sub_depth)
        if kind == _FLOAT:
            parts.append(floats)
        elif loose:
            parts.append(np.array(loose, dtype=np.int64))
        pos = sub_end


def _finish(kind: int, parts: list[Any], squeeze: bool) -> Any:
    if kind == _BYTES:
        return parts[0] if squeeze and len(parts) == 1 else parts
    if kind == _INT64:
        arr = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    elif kind == _FLOAT:
        arr = np.frombuffer(b"".join(parts), dtype=_F32).astype(np.float32)
    else:
        return []
    return arr[0] if squeeze and len(arr) == 1 else arr


_SLOW = object()  # the fast path saw a layout it does not handle
_I64_ONE = np.zeros(1, dtype=np.int64)
_F32_ONE = np.zeros(1, dtype=np.float32)
_U32 = struct.Struct("<I")


def _fast_list(kind_tag: int, buf: bytes, s: int, e: int) -> Any:
    """Decode the one list message of a canonically encoded ``Feature`` in ``buf[s:e]``.

    Handles what serializers write (one packed run; bytes values in order) and returns
    ``_SLOW`` for anything else, before consuming anything, so the general parser can
    take over from the same position with the same result.
    """
    if kind_tag == 0x0A:  # bytes_list
        values = []
        while s < e:
            if buf[s] != 0x0A:
                return _SLOW
            ve, vs = _length(buf, s + 1, e)
            values.append(buf[vs:ve])
            s = ve
        return values
    if s == e:
        return np.empty(0, dtype=np.float32 if kind_tag == 0x12 else np.int64)
    if buf[s] != 0x0A:
        return _SLOW
    de, ds = _length(buf, s + 1, e)
    if de != e:
        return _SLOW
    if kind_tag == 0x12:  # float_list, packed
        n = de - ds
        if n & 3:
            raise _err("packed float list length is not a multiple of 4", ds)
        if n == 4:
            # Copying a 1-element template is several times cheaper than frombuffer +
            # copy; the bits go in as uint32 so NaN payloads survive unchanged.
            arr = _F32_ONE.copy()
            arr.view(np.uint32)[0] = _U32.unpack_from(buf, ds)[0]
            return arr
        return np.frombuffer(buf, dtype=_F32, count=n >> 2, offset=ds).astype(np.float32)
    # int64_list, packed (an empty run is an empty list: _packed_varints)
    if ds < de and de - ds <= 10 and buf[de - 1] < 0x80:
        v, p = _varint(buf, ds, de)
        if p == de:  # exactly one value: the common scalar feature
            arr = _I64_ONE.copy()
            arr[0] = v - (1 << 64) if v & _SIGN64 else v
            return arr
    return _packed_varints(buf, ds, de)


def _parse_features(
    buf: bytes,
    pos: int,
    end: int,
    out: dict[str, Any],
    keys: Collection[str] | None,
    squeeze: bool,
) -> None:
    depth = 2  # Example -> Features
    while pos < end:
        if buf[pos] == 0x0A:
            pos += 1
        else:
            tag, pos = _tag(buf, pos, end)
            if tag != 0x0A:
                pos = _skip(buf, pos, end, tag, depth)
                continue
        # Lengths below 128 (one byte) are decoded inline: this loop runs once per
        # feature and function calls dominate its cost.
        n = buf[pos] if pos < end else 0x80
        if n < 0x80 and pos + 1 + n <= end:
            pos += 1
            entry_end = pos + n
        else:
            entry_end, pos = _length(buf, pos, end)
        # Fast path for the layout every serializer writes: key, then a Feature holding
        # exactly one list. Anything else falls through to the general parser, which
        # starts again from the same position.
        if pos < entry_end and buf[pos] == 0x0A:
            p = pos + 1
            n = buf[p] if p < entry_end else 0x80
            if n < 0x80 and p + 1 + n <= entry_end:
                ks = p + 1
                ke = ks + n
            else:
                ke, ks = _length(buf, p, entry_end)
            if ke < entry_end and buf[ke] == 0x12:
                p = ke + 1
                n = buf[p] if p < entry_end else 0x80
                if n < 0x80 and p + 1 + n <= entry_end:
                    fs = p + 1
                    fe = fs + n
                else:
                    fe, fs = _length(buf, p, entry_end)
                if fe == entry_end:
                    try:
                        key = buf[ks:ke].decode("utf-8")
                    except UnicodeDecodeError:
                        raise _err("feature name is not valid UTF-8", ks) from None
                    if keys is not None and key not in keys:
                        pos = entry_end
                        continue
                    value: Any = _SLOW
                    if fs == fe:
                        value = []  # no kind set
                    else:
                        kt = buf[fs]
                        if kt in (0x0A, 0x12, 0x1A):
                            le, ls = _length(buf, fs + 1, fe)
                            if le == fe:
                                value = _fast_list(kt, buf, ls, le)
                    if value is not _SLOW:
                        if squeeze and len(value) == 1:
                            value = value[0]
                        out[key] = value
                        pos = entry_end
                        continue
        # One map entry: key = 1 (string), value = 2 (Feature). Fields may come in any
        # order or repeat, so collect the value ranges first and parse them once the
        # key is known (and wanted).
        key = ""
        ranges = []
        while pos < entry_end:
            tag, pos = _tag(buf, pos, entry_end)
            if tag == 0x0A:
                e, s = _length(buf, pos, entry_end)
                try:
                    key = buf[s:e].decode("utf-8")
                except UnicodeDecodeError:
                    raise _err("feature name is not valid UTF-8", s) from None
                pos = e
            elif tag == 0x12:
                e, s = _length(buf, pos, entry_end)
                ranges.append((s, e))
                pos = e
            else:
                pos = _skip(buf, pos, entry_end, tag, depth + 1)
        if keys is not None and key not in keys:
            continue
        feat: list[Any] = [0, []]
        for s, e in ranges:
            _parse_feature(buf, s, e, feat, depth + 2)
        out[key] = _finish(*feat, squeeze)  # a repeated key replaces, as in a map


def decode_tf_example(
    data: bytes | bytearray | memoryview,
    *,
    squeeze: bool = False,
    keys: Collection[str] | None = None,
) -> dict[str, Any]:
    """Decode one serialized ``tf.train.Example`` into ``{feature name: value}``.

    Args:
        data: the serialized proto.
        squeeze: turn one-element lists into scalars (see the module docstring).
        keys: decode only these features (others are skipped after a bounds check,
            which is faster when a record holds many features you do not need).

    Raises:
        RecordDecodeError: ``data`` is not a valid ``Example`` encoding.

    Example:
        >>> d = encode_tf_example({"id": [1, -2], "txt": ["héllo"]})
        >>> decode_tf_example(d)
        {'id': array([ 1, -2]), 'txt': [b'h\\xc3\\xa9llo']}
    """
    buf = data if type(data) is bytes else bytes(data)
    end = len(buf)
    feats: dict[str, Any] = {}
    pos = 0
    try:
        while pos < end:
            tag, pos = _tag(buf, pos, end)
            if tag == 0x0A:
                sub_end, pos = _length(buf, pos, end)
                _parse_features(buf, pos, sub_end, feats, keys, squeeze)
                pos = sub_end
            elif tag == 0x12:  # (an Example has no field 2: skipping it loses data)
                raise _err(
                    "field 2, a tf.train.SequenceExample's feature_lists, which an Example "
                    "decode would drop: read these records with codec='raw'",
                    pos,
                )
            else:
                pos = _skip(buf, pos, end, tag, 1)
    except IndexError:  # pragma: no cover - every read is bounds-checked first
        raise _err("unexpected end of data", pos) from None
    return feats


# --------------------------------------------------------------------------- encoding


def _put_varint(out: bytearray, v: int) -> None:
    v &= _MASK64
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _put_len(out: bytearray, field_tag: int, payload: bytes | bytearray) -> bytearray:
    """Append a length-delimited field to ``out``; returns ``out``."""
    out.append(field_tag)
    _put_varint(out, len(payload))
    out += payload
    return out


def _int64_payload(values: np.ndarray) -> bytes:
    if values.size and values.min() >= 0 and values.max() < 0x80:
        return values.astype(np.uint8).tobytes()
    out = bytearray()
    for v in values.tolist():
        _put_varint(out, v)
    return bytes(out)


def _float32(name: str, values: Any) -> np.ndarray:
    """``values`` as a float32 array; a ValueError for a finite value past its range
    (a float_list holds float32: it would be written as inf)."""
    try:
        src = np.asarray(values)
        if src.dtype.kind != "f":
            src = src.astype(np.float64)
    except OverflowError:
        raise ValueError(f"feature {name!r}: a value does not fit in float32") from None
    with np.errstate(over="ignore"):
        out = src.astype(_F32)
    lost = np.isinf(out) & ~np.isinf(src)
    if lost.any():
        raise ValueError(
            f"feature {name!r}: value {src[lost][0]} does not fit in float32 (an Example's "
            "float_list); scale it, or store it as bytes"
        )
    return out


def _utf8(name: str, text: str) -> bytes:
    """``text`` in UTF-8; a ValueError naming feature ``name`` where it holds what UTF-8
    cannot encode (a lone surrogate)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"feature {name!r}: text UTF-8 cannot encode: {e}") from None


def _classify(name: str, value: Any) -> tuple[int, Any]:
    """Return (kind, normalised values) for one feature value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _BYTES, [bytes(value)]
    if isinstance(value, str):
        return _BYTES, [_utf8(name, value)]
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        return _classify(name, [value])
    if isinstance(value, (float, np.floating)):
        return _FLOAT, _float32(name, [value])
    if isinstance(value, np.ndarray):
        flat = value.ravel()
        k = flat.dtype.kind
        if k in "iub":
            # (against a uint64: numpy 1 compares a uint64 scalar with a Python int as floats)
            if k == "u" and flat.size and flat.max() > np.uint64(np.iinfo(np.int64).max):
                raise ValueError(f"feature {name!r}: uint64 value does not fit in int64")
            return _INT64, flat.astype(np.int64)
        if k == "f":
            return _FLOAT, _float32(name, flat)
        if k in "SUO":  # bytes, str or objects: as a list of them
            return _classify(name, flat.tolist())
        raise TypeError(f"feature {name!r}: cannot store a {flat.dtype} array in an Example")
    if isinstance(value, (list, tuple)):
        if not value:
            return _BYTES, []
        if all(isinstance(x, (bytes, bytearray, memoryview, str)) for x in value):
            return _BYTES, [_utf8(name, x) if isinstance(x, str) else bytes(x) for x in value]
        if all(isinstance(x, (bool, int, np.integer, np.bool_)) for x in value):
            try:
                return _INT64, np.array([int(x) for x in value], dtype=np.int64)
            except OverflowError:
                raise ValueError(f"feature {name!r}: integer does not fit in int64") from None
        if all(isinstance(x, (bool, int, float, np.integer, np.floating)) for x in value):
            return _FLOAT, _float32(name, value)
        raise TypeError(f"feature {name!r}: a list must hold only bytes/str, ints or floats")
    raise TypeError(
        f"feature {name!r}: cannot store a {type(value).__name__} in an Example "
        "(use bytes, str, int, float, a list of one of those, or a numpy array)"
    )


def _encode_feature(kind: int, values: Any) -> bytearray:
    inner = bytearray()
    if kind == _BYTES:
        for v in values:
            _put_len(inner, 0x0A, v)
    elif len(values):  # one packed list
        _put_len(inner, 0x0A, values.tobytes() if kind == _FLOAT else _int64_payload(values))
    return _put_len(bytearray(), kind << 3 | _LEN, inner)


def encode_tf_example(features: Mapping[str, Any]) -> bytes:
    """Serialize ``{name: value}`` as a ``tf.train.Example`` (entries in mapping order).

    Values map to feature kinds as: ``bytes``/``str`` (UTF-8) and lists of them ->
    ``bytes_list``; ``int``/``bool``/integer arrays -> ``int64_list``; ``float``/float
    arrays -> ``float_list`` (float32); an empty list -> an empty ``bytes_list``.
    Arrays are flattened. Numeric lists are written packed, as TensorFlow does.

    Raises:
        TypeError: a value of a type an Example cannot hold.
        ValueError: an integer outside the int64 range.

    Example:
        >>> encode_tf_example({"a": 1}).hex()
        '0a0c0a0a0a016112051a030a0101'
    """
    body = bytearray()
    for name, value in features.items():
        if not isinstance(name, str):
            raise TypeError(f"feature names must be str, got {type(name).__name__}")
        entry = _put_len(bytearray(), 0x0A, name.encode("utf-8"))
        _put_len(entry, 0x12, _encode_feature(*_classify(name, value)))
        _put_len(body, 0x0A, entry)
    # (no features: an empty Features message, 0a 00, as TensorFlow writes it)
    return bytes(_put_len(bytearray(), 0x0A, body))


class TFExampleCodec(BaseCodec):
    """Record codec for serialized ``tf.train.Example`` protos (registry name ``"tf_example"``).

    Args:
        squeeze: one-element lists decode to scalars.
        keys: decode only these feature names.

    Example:
        >>> codec = TFExampleCodec(squeeze=True)
        >>> codec.decode(codec.encode({"label": 7, "text": "hi"}))
        {'label': np.int64(7), 'text': b'hi'}
    """

    name = "tf_example"

    def __init__(self, *, squeeze: bool = False, keys: Collection[str] | None = None) -> None:
        self.squeeze = squeeze
        self.keys = frozenset(keys) if keys is not None else None

    def decode(self, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Decode one record; raises :class:`~torchgrain.errors.RecordDecodeError`."""
        return decode_tf_example(data, squeeze=self.squeeze, keys=self.keys)

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """Encode one record with :func:`encode_tf_example`."""
        return encode_tf_example(record)

    def __repr__(self) -> str:
        return f"TFExampleCodec(squeeze={self.squeeze}, keys={self.keys})"
