"""Record transforms: image decoding, seeded augmentation and key-based helpers.

Everything here is a small picklable object meant for :meth:`Dataset.map`,
:meth:`Dataset.random_map` or :meth:`Dataset.map_batch`, so it travels to DataLoader
workers under any start method. Random transforms draw only from the per-record
generator ``random_map`` hands them, derived from ``(seed, epoch, index)``: the same
record gets the same augmentation whatever the worker, batch size or resume point.

Example:
    >>> import numpy as np, torchgrain as tg
    >>> records = [{"ids": np.arange(5, 15), "label": "cat"}, {"ids": np.arange(8), "label": "dog"}]
    >>> ds = (
    ...     tg.Dataset(records)
    ...     .map(tg.LabelToIndex("label", ["cat", "dog"]))
    ...     .random_map(tg.MaskTokens("ids", mask_id=103, vocab_size=1000), seed=0)
    ...     .map(tg.ToTensor())
    ... )
    >>> sorted(ds[0]), ds[1]["label"]
    (['ids', 'label', 'labels'], 1)
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torchgrain.diagnostics import COUNTER, local_counters
from torchgrain.errors import RecordDecodeError
from torchgrain.tokens.collate import exact_numpy, holds_tensor

__all__ = [
    "Albumentations",
    "DecodeImage",
    "LabelToIndex",
    "MaskTokens",
    "RandomImageTransform",
    "RenameKeys",
    "SelectKeys",
    "ToTensor",
    "decode_image",
    "stack_key",
    "unstack_key",
]

_AUGMENT_HINT = "pip install 'torchgrain[augment]'"


def augment_import_error(module: str, cause: BaseException | None = None) -> ImportError:
    """The ImportError raised when an optional augmentation dependency is missing.

    Example:
        >>> print(augment_import_error("albumentations"))
        torchgrain.Albumentations needs the optional package 'albumentations', which is not installed; install it with: pip install 'torchgrain[augment]'
    """
    what = {"albumentations": "torchgrain.Albumentations", "cv2": "decode_image(backend='cv2')"}
    err = ImportError(
        f"{what.get(module, 'this transform')} needs the optional package "
        f"{'opencv-python-headless' if module == 'cv2' else module!r}, which is not "
        f"installed; install it with: {_AUGMENT_HINT}"
    )
    err.__cause__ = cause
    return err


def _require(module: str) -> Any:
    """The optional ``module`` (albumentations, cv2), or the ImportError saying how to
    install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise augment_import_error(module, e) from e


def _missing_key(record: Any, key: str, what: str) -> KeyError:
    keys = sorted(record) if isinstance(record, Mapping) else type(record).__name__
    return KeyError(f"{what}: record has no key {key!r} (keys: {keys})")


# --------------------------------------------------------------------- augmentation
class _GeneratorRandom(random.Random):
    """A ``random.Random`` whose bits come from the current record's numpy Generator.

    Albumentations draws from a ``random.Random`` as well as a numpy Generator. Pointing
    both at the record's generator costs nothing per record (re-seeding a Mersenne
    Twister costs ~5 us) and keeps every draw a function of (seed, epoch, index).
    Overriding ``random`` and ``getrandbits`` routes every other method through them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gen: np.random.Generator | None = None

    def seed(self, a: Any = None, version: int = 2) -> None:
        """Called by ``random.Random.__init__``; there is no state of our own to seed."""

    def random(self) -> float:
        return float(self.gen.random())  # type: ignore[union-attr]

    def getrandbits(self, k: int) -> int:
        if k <= 0:  # numpy's gen.bytes(0) still advances the generator
            if k < 0:
                raise ValueError("number of bits must be non-negative")
            return 0
        n = (k + 7) // 8
        return int.from_bytes(self.gen.bytes(n), "little") >> (8 * n - k)  # type: ignore[union-attr]

    def getstate(self, *state: Any) -> Any:
        raise TypeError("_GeneratorRandom has no state of its own")

    setstate = getstate

    def __reduce__(self) -> tuple[Any, ...]:
        return (_GeneratorRandom, ())


class Albumentations:
    """Run an albumentations pipeline on records, seeded by ``Dataset.random_map``.

    Every random draw of the pipeline comes from the generator ``random_map`` passes
    (``(seed, epoch, index)`` alone), never from global ``random``/``np.random`` state
    or the pipeline's own seed, so augmentation is reproducible across workers and
    resumes and changes with the epoch. The pipeline is copied at construction: the
    object you pass is left untouched.

    Args:
        transform: an ``albumentations.Compose`` (albumentations >= 2.0, or a compatible
            fork: anything with ``set_random_state(np_generator, py_random)`` that is
            called as ``transform(image=..., **targets)`` and returns a dict), or a list
            of albumentations transforms (wrapped in ``Compose``).
        image_key: the record key holding the HWC ``uint8``/``float32`` image.
        targets: extra pipeline arguments and the record keys they are read from and
            written back to, e.g. ``{"mask": "seg"}`` or
            ``{"bboxes": "boxes", "class_labels": "labels"}`` (with ``bbox_params``).

    Like albumentations itself, one instance must not be called from several threads
    at once (DataLoader worker processes are fine). Set ``NO_ALBUMENTATIONS_UPDATE=1``
    to stop albumentations checking online for updates when each worker imports it.

    Example:
        >>> import albumentations as A, numpy as np, torchgrain as tg
        >>> aug = tg.Albumentations(
        ...     A.Compose([A.RandomCrop(32, 32), A.HorizontalFlip()]), targets={"mask": "seg"}
        ... )
        >>> recs = [{"image": np.zeros((48, 48, 3), np.uint8), "seg": np.zeros((48, 48), np.uint8)}]
        >>> ds = tg.Dataset(recs).random_map(aug, seed=0)
        >>> ds[0]["image"].shape, ds[0]["seg"].shape
        ((32, 32, 3), (32, 32))
    """

    def __init__(
        self,
        transform: Any,
        *,
        image_key: str = "image",
        targets: Mapping[str, str] | None = None,
    ) -> None:
        alb = _require("albumentations")
        if isinstance(transform, (list, tuple)):
            transform = alb.Compose(list(transform))
        if not callable(transform) or not callable(getattr(transform, "set_random_state", None)):
            raise TypeError(
                "Albumentations needs an albumentations Compose with set_random_state "
                f"(albumentations >= 2.0), got {type(transform).__name__}; for any other "
                "augmentation function use tg.RandomImageTransform(fn)"
            )
        targets = dict(targets or {})
        if "image" in targets:
            raise ValueError("the image is given by image_key, not by targets['image']")
        for name, key in targets.items():
            if not isinstance(name, str) or not isinstance(key, str):
                raise TypeError(f"targets must map str to str, got {name!r}: {key!r}")
        self.transform = copy.deepcopy(transform)
        self.image_key = image_key
        self.targets = targets
        # (pipeline argument, record key) pairs, the image first.
        self._pairs = (("image", image_key), *targets.items())
        self._py_random = _GeneratorRandom()

    def __call__(self, record: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        try:
            data = {name: record[key] for name, key in self._pairs}
        except KeyError:
            missing = next(k for _, k in self._pairs if k not in record)
            raise _missing_key(record, missing, "Albumentations") from None
        self._py_random.gen = rng
        self._py_random.gauss_next = None  # gauss() keeps a second normal: not for this record
        self.transform.set_random_state(rng, self._py_random)
        out = self.transform(**data)
        return {**record, **{key: out[name] for name, key in self._pairs}}

    def __repr__(self) -> str:
        names = [type(t).__name__ for t in getattr(self.transform, "transforms", ())]
        return f"Albumentations([{', '.join(names)}], image_key={self.image_key!r}, targets={self.targets!r})"


class RandomImageTransform:
    """Apply any ``fn(image, rng) -> image`` to one key of each record.

    The backend-neutral way to plug an augmentation library (or your own numpy code)
    into ``Dataset.random_map``: ``fn`` must draw all its randomness from ``rng``.

    Example:
        >>> import numpy as np, torchgrain as tg
        >>> def flip(image, rng):
        ...     return image[:, ::-1] if rng.random() < 0.5 else image
        >>> ds = tg.Dataset([{"image": np.arange(6).reshape(1, 6, 1)}])
        >>> ds = ds.random_map(tg.RandomImageTransform(flip), seed=0)
        >>> ds[0]["image"].shape
        (1, 6, 1)
    """

    def __init__(
        self, fn: Callable[[Any, np.random.Generator], Any], *, key: str = "image"
    ) -> None:
        if not callable(fn):
            raise TypeError("RandomImageTransform needs a callable fn(image, rng)")
        self.fn = fn
        self.key = key

    def __call__(self, record: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        if self.key not in record:
            raise _missing_key(record, self.key, "RandomImageTransform")
        return {**record, self.key: self.fn(record[self.key], rng)}


# -------------------------------------------------------------------------- decoding
_MODES = ("RGB", "BGR", "L")
_EXIF_ORIENTATION = 0x0112


class DecodeImage:
    """Decode JPEG/PNG/... bytes under ``key`` into an HWC ``uint8`` numpy array.

    Use :func:`decode_image` to build one. ``mode`` is ``"RGB"``, ``"BGR"`` or ``"L"``
    (grayscale, shape ``(H, W, 1)``). Both backends apply the EXIF orientation of JPEGs.
    Bytes that are not an image raise :class:`~torchgrain.RecordDecodeError`.
    """

    def __init__(self, key: str = "image", *, mode: str = "RGB", backend: str = "auto") -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if backend not in ("auto", "cv2", "pillow"):
            raise ValueError(f"backend must be 'auto', 'cv2' or 'pillow', got {backend!r}")
        if backend == "auto":
            backend = _auto_backend()
        else:
            _BACKENDS[backend]()
        self.key = key
        self.mode = mode
        self.backend = backend

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        if self.key not in record:
            raise _missing_key(record, self.key, "decode_image")
        return {**record, self.key: self.decode(record[self.key])}

    def decode(self, data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
        """Decode one encoded image (the per-record work of ``__call__``)."""
        if isinstance(data, np.ndarray):
            if data.dtype != np.uint8 or data.ndim != 1:
                raise TypeError(
                    f"decode_image: key {self.key!r} holds a {data.dtype} array of shape "
                    f"{data.shape}; expected encoded bytes (already decoded?)"
                )
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"decode_image: key {self.key!r} holds {type(data).__name__}, expected bytes"
            )
        t0 = time.perf_counter()
        image = (self._decode_cv2 if self.backend == "cv2" else self._decode_pillow)(data)
        # tg.stats counts image decoding as decode, not as the map's transform time.
        local_counters()[COUNTER["decode_seconds"]] += time.perf_counter() - t0
        if image is None:
            buf = memoryview(data).cast("B")
            raise RecordDecodeError(
                f"decode_image: key {self.key!r} holds {buf.nbytes} bytes that {self.backend} "
                f"cannot decode as an image (first bytes: {bytes(buf[:8]).hex(' ')})"
            )
        return image

    def _decode_cv2(self, data: Any) -> np.ndarray | None:
        cv2 = _require("cv2")
        buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        if buf.size == 0:
            return None
        rgb_flag = getattr(cv2, "IMREAD_COLOR_RGB", None)
        try:
            if self.mode == "L":
                image = cv2.imdecode(buf, cv2.IMREAD_GRAYSCALE)
                return None if image is None else image[:, :, None]
            if self.mode == "RGB" and rgb_flag is not None:
                return cv2.imdecode(buf, rgb_flag)  # decodes straight to RGB: no extra pass
            image = cv2.imdecode(buf, cv2.IMREAD_COLOR)
        except cv2.error:
            return None
        if image is not None and self.mode == "RGB":
            image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
        return image

    def _decode_pillow(self, data: Any) -> np.ndarray | None:
        Image, ImageOps = _import_pil()
        try:
            with Image.open(io.BytesIO(data)) as im:
                # Match cv2, which applies the EXIF orientation; exif_transpose would copy
                # every image, so call it only when there is a rotation to apply.
                if im.getexif().get(_EXIF_ORIENTATION, 1) != 1:
                    im = ImageOps.exif_transpose(im)
                target = "RGB" if self.mode == "BGR" else self.mode
                image = np.asarray(im if im.mode == target else im.convert(target))
        except (OSError, ValueError, Image.DecompressionBombError):
            # UnidentifiedImageError and truncated files are OSErrors
            return None
        if self.mode == "L":
            return image[:, :, None]
        if self.mode == "BGR":
            return np.ascontiguousarray(image[:, :, ::-1])
        return image

    def __repr__(self) -> str:
        return f"decode_image({self.key!r}, mode={self.mode!r}, backend={self.backend!r})"


def decode_image(key: str = "image", *, mode: str = "RGB", backend: str = "auto") -> DecodeImage:
    """A ``Dataset.map`` callable decoding encoded image bytes under ``key`` to HWC uint8.

    ``backend="auto"`` uses OpenCV (``cv2.imdecode``) when installed, which decoded
    JPEGs 1.3-1.6x and PNGs 1.05-1.25x faster than Pillow here (one thread, see
    ``benchmarks/decode_image.py``), and Pillow otherwise.

    Example:
        >>> import cv2, numpy as np, torchgrain as tg
        >>> png = cv2.imencode(".png", np.zeros((4, 6, 3), np.uint8))[1].tobytes()
        >>> ds = tg.Dataset([{"image": png, "label": 1}]).map(tg.decode_image("image"))
        >>> ds[0]["image"].shape, ds[0]["image"].dtype
        ((4, 6, 3), dtype('uint8'))
    """
    return DecodeImage(key, mode=mode, backend=backend)


def _import_pil() -> Any:
    try:
        from PIL import Image, ImageOps
    except ImportError as e:
        raise ImportError("decode_image(backend='pillow') needs Pillow: pip install Pillow") from e
    return Image, ImageOps


# Each backend's import, raising ImportError (saying how to install it) when it is missing.
_BACKENDS: dict[str, Callable[[], Any]] = {"cv2": lambda: _require("cv2"), "pillow": _import_pil}


def _auto_backend() -> str:
    for backend, load in _BACKENDS.items():  # cv2 first: it decodes faster
        with contextlib.suppress(ImportError):
            load()
            return backend
    raise ImportError(
        f"decode_image needs OpenCV or Pillow, neither is installed; install one with: {_AUGMENT_HINT}"
    )


# --------------------------------------------------------------------- key helpers
class SelectKeys:
    """Keep only the given keys of each record (in the given order).

    Example:
        >>> SelectKeys("image", "label")({"image": 1, "label": 2, "id": "a"})
        {'image': 1, 'label': 2}
    """

    def __init__(self, *keys: str) -> None:
        if not keys:
            raise ValueError("SelectKeys needs at least one key")
        self.keys = keys

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return {k: record[k] for k in self.keys}
        except KeyError:
            missing = next(k for k in self.keys if k not in record)
            raise _missing_key(record, missing, "SelectKeys") from None


class RenameKeys:
    """Rename record keys with an ``{old: new}`` mapping; other keys are kept.

    Example:
        >>> RenameKeys({"img": "image"})({"img": 1, "label": 2})
        {'image': 1, 'label': 2}
    """

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)
        targets = list(self.mapping.values())
        if len(set(targets)) != len(targets):
            raise ValueError(f"RenameKeys maps two keys to one name: {self.mapping}")

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        for old in self.mapping:
            if old not in record:
                raise _missing_key(record, old, "RenameKeys")
        out: dict[str, Any] = {}
        for k, v in record.items():
            new = self.mapping.get(k, k)
            if new in out:
                raise ValueError(
                    f"RenameKeys: renaming onto {new!r} would overwrite an existing key"
                )
            out[new] = v
        return out


_RAISE: Any = object()


class LabelToIndex:
    """Replace a string label by its integer index in a vocabulary.

    Args:
        key: the record key holding the label (``str``, or UTF-8 ``bytes``).
        vocabulary: a sequence of labels (index = position) or a ``{label: index}`` dict.
        unknown: index for labels not in the vocabulary; by default they raise ``KeyError``.

    Example:
        >>> to_index = LabelToIndex("label", ["cat", "dog"], unknown=-1)
        >>> to_index({"label": "dog"}), to_index({"label": b"cat"}), to_index({"label": "cow"})
        ({'label': 1}, {'label': 0}, {'label': -1})
    """

    def __init__(
        self, key: str, vocabulary: Sequence[str] | Mapping[str, int], *, unknown: int = _RAISE
    ) -> None:
        if isinstance(vocabulary, Mapping):
            table = {str(k): int(v) for k, v in vocabulary.items()}
        elif isinstance(vocabulary, (str, bytes)):
            raise TypeError("vocabulary must be a sequence of labels or a dict, not a string")
        else:
            labels = [str(v) for v in vocabulary]
            table = {label: i for i, label in enumerate(labels)}
            if len(table) != len(labels):
                dups = sorted({x for x in labels if labels.count(x) > 1})
                raise ValueError(f"vocabulary has repeated labels: {dups[:10]}")
        self.key = key
        self.table = table
        self.unknown = unknown

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        try:
            label = record[self.key]
        except KeyError:
            raise _missing_key(record, self.key, "LabelToIndex") from None
        if isinstance(label, (bytes, np.bytes_)):
            label = label.decode("utf-8")
        index = self.table.get(label)
        if index is None:
            if self.unknown is _RAISE:
                raise KeyError(
                    f"LabelToIndex: label {label!r} under key {self.key!r} is not in the "
                    f"vocabulary of {len(self.table)} labels (pass unknown=... to map it)"
                )
            index = self.unknown
        return {**record, self.key: index}


def _to_tensor(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (str, bytes)):
        raise TypeError(f"ToTensor: key {key!r} holds {type(value).__name__}")
    try:
        if isinstance(value, (list, tuple)) and holds_tensor(value):
            # numpy has no bfloat16 and refuses tensors requiring grad: torch keeps them
            if all(isinstance(v, torch.Tensor) for v in value):
                return torch.stack(value)
            value = [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
        if not isinstance(value, np.ndarray):  # Python floats stay float64, as default_collate's
            value = exact_numpy(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"ToTensor: key {key!r} cannot be made a tensor: {e}") from None
    if value.dtype.kind in "OUSV":
        raise TypeError(f"ToTensor: key {key!r} holds a {value.dtype} array")
    # torch.from_numpy shares memory but refuses negative strides (flips) and
    # warns on read-only buffers (zero-copy decoded records): copy those.
    if not value.flags.writeable or any(s < 0 for s in value.strides):
        value = value.copy()
    return torch.from_numpy(value)


class ToTensor:
    """Turn numpy arrays in a record into torch tensors (zero-copy where possible).

    Args:
        keys: keys to convert; by default every numpy array value (others are kept).
            A number or list converts with numpy's dtype (Python floats float64, as
            torch's default collate makes them), except ints past int64, which numpy
            would round: uint64 as they are (beside a negative int or a float, or past
            2**64, a TypeError naming the key); a list of tensors is stacked in theirs.
        dtype: optional torch dtype to cast converted values to (no rescaling).
        channels_first: move the last axis of 3-D arrays first (HWC -> CHW): ``True``
            for every converted key, or a collection of keys.

    Example:
        >>> import numpy as np
        >>> t = ToTensor(channels_first=["image"])({"image": np.zeros((4, 5, 3)), "id": "a"})
        >>> t["image"].shape, t["id"]
        (torch.Size([3, 4, 5]), 'a')
    """

    def __init__(
        self,
        keys: Iterable[str] | None = None,
        *,
        dtype: torch.dtype | None = None,
        channels_first: bool | Iterable[str] = False,
    ) -> None:
        if isinstance(keys, str):
            keys = [keys]
        self.keys = None if keys is None else tuple(keys)
        self.dtype = dtype
        if isinstance(channels_first, str):
            channels_first = [channels_first]
        self.channels_first = (
            channels_first if isinstance(channels_first, bool) else frozenset(channels_first)
        )

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(record)
        if self.keys is None:
            keys = [k for k, v in record.items() if isinstance(v, np.ndarray)]
        else:
            keys = self.keys
            for k in keys:
                if k not in record:
                    raise _missing_key(record, k, "ToTensor")
        first = self.channels_first
        for k in keys:
            t = _to_tensor(record[k], k)
            if self.dtype is not None:
                t = t.to(self.dtype)
            if t.ndim == 3 and (first is True or (first is not False and k in first)):
                t = t.permute(2, 0, 1)
            out[k] = t
        return out


class MaskTokens:
    """BERT-style masking of a token-id array, for ``Dataset.random_map``.

    Each token not in ``special_ids`` is chosen with ``probability``; a chosen token is
    replaced by ``mask_id`` with probability ``mask_replace_prob``, by a random id in
    ``[0, vocab_size)`` with probability ``random_replace_prob``, and kept otherwise.
    The record gets the masked ids under ``key`` and, under ``labels_key``, an int64
    array holding the original id at chosen positions and ``ignore_index`` elsewhere.

    Example:
        >>> import numpy as np, torchgrain as tg
        >>> mask = tg.MaskTokens("ids", mask_id=103, vocab_size=30522, special_ids=[0])
        >>> ds = tg.Dataset([{"ids": np.arange(1, 41)}]).random_map(mask, seed=0)
        >>> r = ds[0]
        >>> chosen = r["labels"] != -100
        >>> bool((r["labels"][chosen] == np.arange(1, 41)[chosen]).all())
        True
        >>> bool((ds[0]["ids"] == r["ids"]).all())  # same seed, epoch, index
        True
    """

    def __init__(
        self,
        key: str,
        *,
        mask_id: int,
        vocab_size: int | None = None,
        probability: float = 0.15,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        special_ids: Iterable[int] = (),
        labels_key: str = "labels",
        ignore_index: int = -100,
    ) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        if mask_replace_prob < 0 or random_replace_prob < 0:
            raise ValueError("replace probabilities must be >= 0")
        if mask_replace_prob + random_replace_prob > 1.0 + 1e-12:
            raise ValueError("mask_replace_prob + random_replace_prob must be <= 1")
        if random_replace_prob > 0 and (vocab_size is None or vocab_size <= 0):
            raise ValueError("random replacement needs vocab_size (or random_replace_prob=0)")
        self.key = key
        self.mask_id = int(mask_id)
        self.vocab_size = vocab_size
        self.probability = float(probability)
        self.mask_replace_prob = float(mask_replace_prob)
        self.random_replace_prob = float(random_replace_prob)
        self.special_ids = np.unique(np.asarray(list(special_ids), dtype=np.int64))
        self.labels_key = labels_key
        self.ignore_index = int(ignore_index)

    def __call__(self, record: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        try:
            ids = np.asarray(record[self.key])
        except KeyError:
            raise _missing_key(record, self.key, "MaskTokens") from None
        if ids.dtype.kind not in "iu":
            raise TypeError(f"MaskTokens: key {self.key!r} holds {ids.dtype}, expected int ids")
        chosen = rng.random(ids.shape) < self.probability
        if self.special_ids.size:
            chosen &= ~np.isin(ids, self.special_ids)
        labels = np.where(chosen, ids, self.ignore_index).astype(np.int64)
        # One uniform draw per token splits chosen tokens into mask / random / keep.
        action = rng.random(ids.shape)
        masked = ids.copy()
        to_mask = chosen & (action < self.mask_replace_prob)
        masked[to_mask] = self.mask_id
        if self.random_replace_prob > 0:
            below = self.mask_replace_prob + self.random_replace_prob
            to_random = chosen & ~to_mask & (action < below)
            n = int(to_random.sum())
            if n:
                masked[to_random] = rng.integers(0, self.vocab_size, n)
        return {**record, self.key: masked, self.labels_key: labels}


# ------------------------------------------------------------------ batch helpers
def stack_key(records: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """Stack ``key`` across a list of records into one array (first axis = record).

    For :meth:`Dataset.map_batch` functions that do their work on a whole batch.

    Example:
        >>> import numpy as np
        >>> stack_key([{"x": np.zeros(3)}, {"x": np.ones(3)}], "x").shape
        (2, 3)
    """
    try:
        return np.stack([r[key] for r in records])
    except KeyError:
        missing = next(r for r in records if key not in r)
        raise _missing_key(missing, key, "stack_key") from None


def unstack_key(
    records: Sequence[Mapping[str, Any]], key: str, values: Sequence[Any] | np.ndarray
) -> list[dict[str, Any]]:
    """Return copies of ``records`` with ``key`` set to the matching row of ``values``.

    The inverse of :func:`stack_key`; rows of an array are views, not copies.

    Example:
        >>> import numpy as np
        >>> recs = [{"x": np.zeros(2), "id": "a"}, {"x": np.ones(2), "id": "b"}]
        >>> out = unstack_key(recs, "x", stack_key(recs, "x") * 10 + 1)
        >>> [(r["id"], r["x"].tolist()) for r in out]
        [('a', [1.0, 1.0]), ('b', [11.0, 11.0])]
    """
    if len(values) != len(records):
        raise ValueError(f"unstack_key: {len(values)} values for {len(records)} records")
    return [{**r, key: v} for r, v in zip(records, values)]
