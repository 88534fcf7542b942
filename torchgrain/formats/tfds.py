"""Read TensorFlow Datasets (TFDS) output without TensorFlow.

``tfds build`` (ArrayRecord or TFRecord) writes shards of ``tf.train.Example`` records next
to ``dataset_info.json`` and ``features.json``; this module reads the feature spec and
decodes each record as ``tfds.load`` would: tensors to numpy arrays, images to ``H x W x C``
arrays (Pillow or OpenCV), class labels to ``int64``, text to ``str``, sequences with a
leading length dimension. Both ``features.json`` layouts are read.

Design notes: docs/design-notes.md#formats-tfds.

Example:
    >>> import json, os, tempfile
    >>> from torchgrain.formats.tf_example import encode_tf_example
    >>> d = tempfile.mkdtemp()
    >>> spec = {"featuresDict": {"features": {
    ...     "label": {"classLabel": {"numClasses": "10"}},
    ...     "xy": {"tensor": {"shape": {"dimensions": ["2"]}, "dtype": "float32"}}}}}
    >>> codec = TFDSCodec(spec)
    >>> rec = codec.decode(encode_tf_example({"label": 7, "xy": [0.5, 2.0]}))
    >>> rec["label"], rec["xy"]
    (np.int64(7), array([0.5, 2. ], dtype=float32))
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import posixpath
import re
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np

from torchgrain.errors import CorruptDataError, RecordDecodeError
from torchgrain.formats.codecs import BaseCodec
from torchgrain.formats.tf_example import decode_tf_example
from torchgrain.io import remote
from torchgrain.io.paths import is_http

__all__ = ["TFDSCodec", "check_single_split", "read_tfds_features", "tfds_codec_for"]

FEATURES_JSON = "features.json"
DATASET_INFO_JSON = "dataset_info.json"
# "<name>-<split>.<format>-00000-of-00008" (the shard suffix is absent for one-file splits).
_SHARD_RE = re.compile(
    r"^(?P<name>.+?)-(?P<split>[^-.]+)\.(?P<fmt>array_record|tfrecord|riegeli)"
    r"(?:-(?P<i>\d+)-of-(?P<n>\d+))?$"
)


#: Bytes read of a TFDS metadata file at most (real ones are a few KiB to a few MiB).
MAX_METADATA_BYTES = 64 << 20


def _read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any | None:
    """A TFDS metadata file, parsed; None when there is none.

    A file that is there but is not JSON (or too large, or nested without end) is the
    dataset's error, not a reason to decode its records differently: CorruptDataError.
    """
    if not remote.isfile(fs, path):
        return None
    text = remote.cat_file(fs, path, url=path, what="metadata read", limit=MAX_METADATA_BYTES)
    try:
        return json.loads(text)
    except RecursionError:
        raise CorruptDataError(f"TFDS metadata {path}: JSON nested too deeply") from None
    except ValueError as e:
        raise CorruptDataError(f"TFDS metadata {path} is not JSON: {e}") from None


def read_tfds_features(
    fs: fsspec.AbstractFileSystem, directory: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Return ``(features spec, dataset info)`` of a TFDS directory (None when absent).

    Example:
        >>> import tempfile
        >>> read_tfds_features(fsspec.filesystem("file"), tempfile.mkdtemp())
        (None, None)
    """
    d = directory.rstrip("/")
    info = _read_json(fs, f"{d}/{DATASET_INFO_JSON}")
    features = _read_json(fs, f"{d}/{FEATURES_JSON}")
    if features is None and isinstance(info, dict) and isinstance(info.get("features"), dict):
        features = info["features"]
    return (
        features if isinstance(features, dict) else None,
        info if isinstance(info, dict) else None,
    )


def check_single_split(files: list[str], info: dict[str, Any] | None) -> None:
    """Raise if ``files`` mix several splits of a TFDS directory (e.g. train and test).

    Example:
        >>> check_single_split(["d/mnist-train.array_record-00000-of-00001"], None)
        >>> check_single_split(["d/m-train.tfrecord", "d/m-test.tfrecord"], None)
        Traceback (most recent call last):
        ...
        ValueError: the files hold several TFDS splits (test, train); pick one, e.g. 'd/m-test.tfrecord*'
    """
    splits: dict[str, str] = {}
    for f in files:
        m = _SHARD_RE.match(posixpath.basename(f))
        if m is None:
            return  # not TFDS naming: nothing to check
        splits.setdefault(
            m["split"], f"{posixpath.dirname(f)}/{m['name']}-{m['split']}.{m['fmt']}*"
        )
    if len(splits) > 1:
        names = sorted(splits)
        raise ValueError(
            f"the files hold several TFDS splits ({', '.join(names)}); pick one, e.g. "
            f"{splits[names[0]]!r}"
        )


def tfds_codec_for(
    files: list[str], fs: fsspec.AbstractFileSystem, *, decode_images: bool = True
) -> TFDSCodec | None:
    """A :class:`TFDSCodec` when the files' directory holds TFDS feature metadata.

    Also checks that the files belong to a single split.

    Example:
        >>> import tempfile
        >>> tfds_codec_for([tempfile.mkdtemp() + "/x.array_record"], fsspec.filesystem("file"))
    """
    if not files:
        return None
    stripped = fs._strip_protocol(files[0])
    if is_http(fs):  # a signed URL's query may hold '/': the directory is the path's
        stripped = stripped.split("?", 1)[0]
    directory = posixpath.dirname(stripped)
    features, info = read_tfds_features(fs, directory)
    if features is None:
        return None
    check_single_split(files, info)
    try:
        return TFDSCodec(features, decode_images=decode_images)
    except (
        AttributeError,
        KeyError,
        TypeError,
        ValueError,
        OverflowError,
        SyntaxError,
        RecursionError,
    ) as e:  # (numpy parses some dtype strings as Python: a SyntaxError)
        raise CorruptDataError(
            f"TFDS features of {directory} ({FEATURES_JSON}) are not a feature spec "
            f"torchgrain can read: {type(e).__name__}: {e}"
        ) from None


# --------------------------------------------------------------------------- the spec
def _dims(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, dict):
        shape = shape.get("dimensions", [])
    return tuple(-1 if d is None else int(d) for d in (shape or []))


# The older layout's feature types, by the key the newer one gives their content (the
# type's name, lower camel case).
_LEGACY_KINDS = {
    t: t[0].lower() + t[1:] for t in ("FeaturesDict", "Image", "Tensor", "ClassLabel", "Text")
}


def _parse(spec: dict[str, Any]) -> tuple[Any, ...]:
    """Turn one feature's JSON into a small tuple tree."""
    if "type" in spec and "content" in spec:  # the older layout
        kind = _LEGACY_KINDS.get(str(spec["type"]).rsplit(".", 1)[-1])
        return ("raw",) if kind is None else _parse({kind: spec.get("content") or {}})
    if "featuresDict" in spec:
        feats = spec["featuresDict"].get("features", {})
        return ("dict", {k: _parse(v) for k, v in feats.items()})
    if "sequence" in spec:
        return ("sequence", _parse(spec["sequence"].get("feature", {})))
    if "image" in spec:
        im = spec["image"]
        dtype = np.dtype(im.get("dtype", "uint8"))
        if dtype.kind not in "biuf" or dtype.itemsize > 8:  # (TFDS: uint8, uint16, float32)
            raise ValueError(f"an image's dtype must be a number, not {dtype}")
        return ("image", dtype, _dims(im.get("shape")))
    if "tensor" in spec:
        t = spec["tensor"]
        return ("tensor", t.get("dtype", "float32"), _dims(t.get("shape")), t.get("encoding"))
    return ("label",) if "classLabel" in spec else ("text",) if "text" in spec else ("raw",)


def _decode_pil(data: bytes) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im)
    except Image.DecompressionBombError as e:  # over Pillow's pixel limit (~179 M)
        raise ValueError(str(e)) from None


def _decode_cv2(data: bytes) -> np.ndarray:
    import cv2

    try:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error as e:  # e.g. over OpenCV's pixel limit (2**30)
        raise ValueError(f"OpenCV cannot decode the image: {e}") from None
    if arr is None:
        raise ValueError("OpenCV cannot decode the image")
    if arr.ndim == 3 and arr.shape[2] >= 3:  # OpenCV is BGR(A)
        arr = arr[..., [2, 1, 0, *range(3, arr.shape[2])]]
    return arr


def _image_decoder() -> Any:
    """PNG/JPEG bytes -> ndarray with Pillow, else OpenCV, else None."""
    for module, fn in (("PIL.Image", _decode_pil), ("cv2", _decode_cv2)):
        with contextlib.suppress(ImportError):
            __import__(module)
            return fn
    return None


class TFDSCodec(BaseCodec):
    """Decode TFDS ``tf.train.Example`` records per the dataset's feature spec.

    Args:
        features: the parsed ``features.json`` (docs/design-notes.md#formats-tfds).
        decode_images: decode encoded images to arrays (needs Pillow or OpenCV).

    Records are nested dicts shaped like ``tfds.load``'s elements. Use it through
    ``tg.ArrayRecordSource(tfds_dir, codec="tf_example")`` (or ``codec="auto"``), which
    finds ``features.json`` beside the files; pass ``codec=TFExampleCodec()`` to get the
    plain ``tf_example`` decoding instead.
    """

    name = "tfds"

    def __init__(self, features: dict[str, Any], *, decode_images: bool = True) -> None:
        self.features = features
        self._tree = _parse(features)
        if self._tree[0] != "dict":
            self._tree = ("dict", {})
        self._decoder = _image_decoder() if decode_images else None
        leaves = list(_leaves(self._tree, ""))
        # The features the spec decodes, and the list kind each is stored as.
        self._kinds = {k: _list_kind(leaf) for k, leaf in leaves}
        has_images = any(leaf[0] == "image" for _, leaf in leaves)
        if decode_images and self._decoder is None and has_images:
            warnings.warn(
                "neither Pillow nor OpenCV is installed: TFDS images are returned as encoded bytes",
                stacklevel=2,
            )

    def decode(self, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        flat = decode_tf_example(data)
        out = self._build(self._tree, "", flat, ())
        for k, v in flat.items():  # features not in the spec are kept, undecoded
            if k not in self._kinds:
                out[k] = v
        return out

    def _build(self, node: tuple[Any, ...], key: str, flat: dict[str, Any], lead: tuple) -> Any:
        kind = node[0]
        if kind == "dict":
            return {
                k: self._build(child, f"{key}/{k}" if key else k, flat, lead)
                for k, child in node[1].items()
            }
        if kind == "sequence":
            return self._build(node[1], key, flat, (*lead, -1))
        if key not in flat:
            return None
        value = flat[key]
        try:
            want, got = self._kinds[key], _stored_kind(value)
            if want and got and got != want:
                # Refused, as by tf.io.parse_example: a cast gave wrong values (a float
                # label truncated, bytes(n) of an int a text of n NULs).
                raise ValueError(f"stored as {got}, its spec wants {want}")
            if kind == "tensor":
                return _tensor(value, node[1], (*lead, *node[2]), node[3])
            if kind == "label":
                return _tensor(value, "int64", (*lead,), None)
            if kind == "text":
                return [bytes(v).decode("utf-8") for v in value] if lead else _one(value).decode()
            if kind == "image":
                return self._image(value, node[1], node[2], lead)
        except (ValueError, TypeError, UnicodeDecodeError, OSError) as e:
            raise RecordDecodeError(f"TFDS feature {key!r}: {e}") from e
        return value

    def _image(self, value: list[bytes], dtype: np.dtype, shape: tuple, lead: tuple) -> Any:
        if self._decoder is None:
            return value if lead else _one(value)
        images = [self._decode_image(b, dtype, shape) for b in value]
        if not lead:
            if len(images) != 1:
                raise ValueError(f"expected one encoded image, found {len(images)}")
            return images[0]
        if not images:
            return np.zeros((0, *[max(d, 0) for d in shape]), dtype)
        if len({im.shape for im in images}) == 1:
            return np.stack(images)
        return images

    def _decode_image(self, data: bytes, dtype: np.dtype, shape: tuple) -> np.ndarray:
        arr = self._decoder(data)
        if arr.ndim == 2 and len(shape) == 3:
            arr = arr[:, :, None]
        # As tfds.load: an image of another height or width than its spec's is refused
        # (its channels are left as decoded: tfds.load converts them to the spec's).
        if len(shape) == 3 and any(0 <= d != n for d, n in zip(shape[:2], arr.shape[:2])):
            raise ValueError(f"an image of shape {arr.shape} where the spec says {shape}")
        return np.ascontiguousarray(arr, dtype=dtype)

    def __repr__(self) -> str:
        return f"TFDSCodec(keys={sorted(self._kinds)})"


_NUMBER_LIST = {"f": "float_list", "i": "int64_list", "u": "int64_list", "b": "int64_list"}
_LEAF_LIST = {"text": "bytes_list", "image": "bytes_list", "label": "int64_list"}


def _list_kind(node: tuple[Any, ...]) -> str | None:
    """The list kind TFDS stores a leaf of the spec as (None: any)."""
    if node[0] != "tensor":
        return _LEAF_LIST.get(node[0])
    if node[1] in ("string", "str", "object") or node[3] in ("bytes", "zlib"):
        return "bytes_list"
    try:
        return _NUMBER_LIST.get(np.dtype(node[1]).kind)
    except (TypeError, SyntaxError):  # a dtype numpy does not know: decoding says so
        return None


def _stored_kind(value: Any) -> str | None:
    """The list kind of a decoded feature (None: an empty list, of no kind or bytes)."""
    if isinstance(value, list):
        return "bytes_list" if value else None
    return _NUMBER_LIST[value.dtype.kind]


def _leaves(node: tuple[Any, ...], key: str) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """``(flat key, leaf node)`` of each feature of a parsed spec."""
    if node[0] == "dict":
        for k, c in node[1].items():
            yield from _leaves(c, f"{key}/{k}" if key else k)
    elif node[0] == "sequence":
        yield from _leaves(node[1], key)
    else:
        yield key, node


def _one(value: Any) -> bytes:
    if not isinstance(value, list) or len(value) != 1:
        raise ValueError(f"expected one bytes value, found {len(value)}")
    return value[0]


def _reshape(arr: np.ndarray, shape: tuple[int, ...]) -> Any:
    if shape == ():
        if arr.size != 1:
            raise ValueError(f"expected a scalar, found {arr.size} values")
        return arr.reshape(())[()]
    if sum(d < 0 for d in shape) > 1:
        return arr  # ragged: several unknown dims cannot be inferred from a flat list
    return arr.reshape(shape)


#: The most bytes one tensor may decode to: a zlib-encoded one inflate to (less when its
#: spec's shape says so), a list of values widened to its dtype (any width: "S1000000000").
_MAX_TENSOR_BYTES = 1 << 30


def _inflate(blobs: list[bytes], limit: int) -> list[bytes]:
    """zlib-decompress each of ``blobs``, refusing output beyond ``limit`` bytes in all
    (a few KiB of zlib can hold gigabytes) without inflating more than ``limit + 1``."""
    out = []
    left = limit
    for data in blobs:
        d = zlib.decompressobj()
        try:
            raw = d.decompress(data, left + 1)  # (a max_length of 0 would mean no limit)
        except zlib.error as e:
            raise ValueError(f"bad zlib-encoded tensor: {e}") from None
        if len(raw) > left:
            raise ValueError(f"a zlib-encoded tensor inflates to more than its {limit} bytes")
        if not d.eof:
            raise ValueError("truncated zlib-encoded tensor")
        left -= len(raw)
        out.append(raw)
    return out


def _tensor(value: Any, dtype: str, shape: tuple[int, ...], encoding: str | None) -> Any:
    if dtype in ("string", "str", "object"):
        return _one(value) if shape == () else list(value)
    dt = np.dtype(dtype)
    if encoding in ("bytes", "zlib"):
        blobs = value if isinstance(value, list) else [value]
        if encoding == "zlib":
            # All the blobs of one tensor together hold at most its shape's bytes.
            limit = _MAX_TENSOR_BYTES
            if all(d >= 0 for d in shape):
                limit = min(limit, math.prod(shape) * dt.itemsize)
            blobs = _inflate(blobs, limit)
        parts = [np.frombuffer(b, dtype=dt) for b in blobs]
        arr = np.concatenate(parts) if parts else np.zeros(0, dt)
    else:
        arr = np.asarray(value)
        if arr.dtype != dt:  # (not asarray(value, dt): its errors name no value)
            if arr.size * dt.itemsize > _MAX_TENSOR_BYTES:
                raise ValueError(
                    f"{arr.size} values of dtype {dt} are more than the {_MAX_TENSOR_BYTES} "
                    "bytes a tensor may decode to"
                )
            arr = arr.astype(dt)
    return _reshape(np.ascontiguousarray(arr), shape)
