"""torchgrain: fast, deterministic, key-value data loading for PyTorch.

The top level holds the everyday names (``tg.Dataset``, ``tg.open``, the sources and
samplers, ``tg.ResumableLoader``, ``tg.ReadOptions``, ``tg.stats``, the errors); the rest
lives in topic namespaces, each with its extension points: :mod:`torchgrain.sources`
(formats, the registry, ``ShardedSource``, codecs), :mod:`torchgrain.samplers` (the
samplers and the contract of a new one), :mod:`torchgrain.transforms` and
:mod:`torchgrain.columns` (``ColumnBatch``, ``Ragged``). Names that moved out of the top
level's ``__all__`` (``tg.ShardIndex``, ``tg.ToTensor``...) still work as ``tg.NAME``.

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

from torchgrain import columns, sources
from torchgrain.convert import convert
from torchgrain.diagnostics import stats, timed
from torchgrain.errors import (
    CacheDiskFullError,
    CacheThrashWarning,
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    RemoteIOError,
    SchemaMismatchError,
    TorchgrainError,
    UnsafePathError,
)
from torchgrain.formats.codecs import register_codec as register_codec
from torchgrain.sources.arrayrecord import ArrayRecordSource
from torchgrain.sources.base import Source
from torchgrain.sources.format import FormatSource
from torchgrain.sources.index import ShardIndex as ShardIndex
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
    "concat": "torchgrain.compose.concat",
    "mix": "torchgrain.compose.mix",
    "split": "torchgrain.compose.subset",
    "pad_collate": "torchgrain.tokens.collate",
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
    # Out of __all__ (see the end), still tg.NAME: hence the noqa marks.
    from torchgrain.compose.concat import concat  # noqa: F401
    from torchgrain.compose.mix import mix  # noqa: F401
    from torchgrain.compose.subset import split  # noqa: F401
    from torchgrain.dataset import Dataset, record_rng  # noqa: F401
    from torchgrain.loader import ResumableLoader, bind
    from torchgrain.prefetch import CudaPrefetcher
    from torchgrain.sampling import (
        BlockShuffleSampler,
        GlobalShuffleSampler,
        LoaderBinding,  # noqa: F401
    )
    from torchgrain.tokens.collate import pad_collate  # noqa: F401
    from torchgrain.transforms import (
        Albumentations,  # noqa: F401
        LabelToIndex,  # noqa: F401
        MaskTokens,  # noqa: F401
        RandomImageTransform,  # noqa: F401
        RenameKeys,  # noqa: F401
        SelectKeys,  # noqa: F401
        ToTensor,  # noqa: F401
        decode_image,  # noqa: F401
        stack_key,  # noqa: F401
        unstack_key,  # noqa: F401
    )


# Namespaces that need torch, likewise loaded on first use (``tg.samplers.X``).
_TORCH_MODULES = {"samplers", "transforms"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _TORCH_MODULES:
        return importlib.import_module(f"torchgrain.{name}")
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'torchgrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TORCH_NAMES) | _TORCH_MODULES)


__version__ = "0.1.0"

# The everyday names and the namespaces. Also importable from here, out of ``__all__``:
# the transforms (tg.transforms), LoaderBinding (tg.samplers), ShardIndex and
# register_codec (tg.sources), and record_rng (torchgrain.dataset).
__all__ = [
    "ArrayRecordSource",
    "BlockShuffleSampler",
    "CacheDiskFullError",
    "CacheThrashWarning",
    "CorruptDataError",
    "CudaPrefetcher",
    "Dataset",
    "DatasetNotFoundError",
    "FormatSource",
    "GlobalShuffleSampler",
    "ParquetSource",
    "ReadOptions",
    "RecordDecodeError",
    "RemoteIOError",
    "ResumableLoader",
    "SchemaMismatchError",
    "Source",
    "TFRecordSource",
    "TorchgrainError",
    "UnsafePathError",
    "bind",
    "columns",
    "convert",
    "open",
    "samplers",
    "sources",
    "stats",
    "timed",
    "transforms",
    "write_array_record",
    "write_parquet",
]
