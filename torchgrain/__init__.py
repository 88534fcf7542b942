"""torchgrain: fast, deterministic, key-value data loading for PyTorch.

Example:
    >>> import tempfile, numpy as np, torch, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_array_record([{"x": np.full(2, i, np.int64)} for i in range(6)], d)
    >>> ds = tg.Dataset(tg.ArrayRecordSource(d))
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=False)
    >>> [b["x"][:, 0].tolist() for b in loader]
    [[0, 1, 2], [3, 4, 5]]
"""

from typing import TYPE_CHECKING, Any

from torchgrain.convert import convert
from torchgrain.diagnostics import stats, timed
from torchgrain.errors import (
    CacheThrashWarning,
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    RemoteIOError,
    SchemaMismatchError,
    TorchgrainError,
    UnsafePathError,
)
from torchgrain.formats.codecs import register_codec
from torchgrain.sources.arrayrecord import ArrayRecordSource
from torchgrain.sources.base import Source
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.options import ReadOptions
from torchgrain.sources.parquet import ParquetSource
from torchgrain.sources.registry import open
from torchgrain.sources.tfrecord import TFRecordSource
from torchgrain.writers import write_array_record, write_parquet

# The names below need torch, whose import takes seconds. They load on first use, so
# processes that only read or convert data (e.g. `torchgrain convert`'s worker pool)
# start without importing torch; `import torchgrain` stays cheap.
_TORCH_NAMES = {
    "Dataset": "torchgrain.dataset",
    "record_rng": "torchgrain.dataset",
    "CudaPrefetcher": "torchgrain.prefetch",
    "BlockShuffleSampler": "torchgrain.sampling",
    "GlobalShuffleSampler": "torchgrain.sampling",
    "ResumableLoader": "torchgrain.loader",
    "bind": "torchgrain.loader",
    "LoaderBinding": "torchgrain.sampling",
    "Albumentations": "torchgrain.transforms",
    "LabelToIndex": "torchgrain.transforms",
    "MaskTokens": "torchgrain.transforms",
    "RandomImageTransform": "torchgrain.transforms",
    "RenameKeys": "torchgrain.transforms",
    "SelectKeys": "torchgrain.transforms",
    "ToTensor": "torchgrain.transforms",
    "decode_image": "torchgrain.transforms",
    "stack_key": "torchgrain.transforms",
    "unstack_key": "torchgrain.transforms",
}

if TYPE_CHECKING:
    from torchgrain.dataset import Dataset, record_rng
    from torchgrain.loader import ResumableLoader, bind
    from torchgrain.prefetch import CudaPrefetcher
    from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler, LoaderBinding
    from torchgrain.transforms import (
        Albumentations,
        LabelToIndex,
        MaskTokens,
        RandomImageTransform,
        RenameKeys,
        SelectKeys,
        ToTensor,
        decode_image,
        stack_key,
        unstack_key,
    )


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'torchgrain' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TORCH_NAMES))


__version__ = "0.1.0"

__all__ = [
    "Albumentations",
    "ArrayRecordSource",
    "BlockShuffleSampler",
    "CacheThrashWarning",
    "CorruptDataError",
    "CudaPrefetcher",
    "Dataset",
    "DatasetNotFoundError",
    "GlobalShuffleSampler",
    "LabelToIndex",
    "LoaderBinding",
    "MaskTokens",
    "ParquetSource",
    "RandomImageTransform",
    "ReadOptions",
    "RecordDecodeError",
    "RemoteIOError",
    "RenameKeys",
    "ResumableLoader",
    "SchemaMismatchError",
    "SelectKeys",
    "ShardIndex",
    "Source",
    "TFRecordSource",
    "ToTensor",
    "TorchgrainError",
    "UnsafePathError",
    "bind",
    "convert",
    "decode_image",
    "open",
    "record_rng",
    "register_codec",
    "stack_key",
    "stats",
    "timed",
    "unstack_key",
    "write_array_record",
    "write_parquet",
]
