"""torchgrain: fast, deterministic, key-value data loading for PyTorch."""

__version__ = "0.1.0"

from torchgrain.prefetch import CudaPrefetcher  # noqa: F401 - public re-export
