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

from torchgrain.convert import convert
from torchgrain.dataset import Dataset, record_rng
from torchgrain.diagnostics import stats, timed
from torchgrain.errors import (
    CorruptDataError,
    DatasetNotFoundError,
    RecordDecodeError,
    RemoteIOError,
    SchemaMismatchError,
    TorchgrainError,
)
from torchgrain.prefetch import CudaPrefetcher
from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler
from torchgrain.sources._index import ShardIndex
from torchgrain.sources.arrayrecord import ArrayRecordSource
from torchgrain.sources.codecs import register_codec
from torchgrain.sources.parquet import ParquetSource
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
from torchgrain.writers import write_array_record

__version__ = "0.1.0"

__all__ = [
    "Albumentations",
    "ArrayRecordSource",
    "BlockShuffleSampler",
    "CorruptDataError",
    "CudaPrefetcher",
    "Dataset",
    "DatasetNotFoundError",
    "GlobalShuffleSampler",
    "LabelToIndex",
    "MaskTokens",
    "ParquetSource",
    "RandomImageTransform",
    "RecordDecodeError",
    "RemoteIOError",
    "RenameKeys",
    "SchemaMismatchError",
    "SelectKeys",
    "ShardIndex",
    "ToTensor",
    "TorchgrainError",
    "convert",
    "decode_image",
    "record_rng",
    "register_codec",
    "stack_key",
    "stats",
    "timed",
    "unstack_key",
    "write_array_record",
]
