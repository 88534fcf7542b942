"""LoaderBinding: what the loader that iterates a sampler tells it about itself."""

from __future__ import annotations

import dataclasses
import operator

__all__ = ["LoaderBinding"]


@dataclasses.dataclass(frozen=True)
class LoaderBinding:
    """How the loader that iterates a sampler uses it: what :func:`torchgrain.bind`
    tells the sampler (:meth:`ResumableSampler.bind_loader`).

    Attributes:
        batch_size: indices the DataLoader takes from the sampler per batch (None
            without automatic batching).
        num_workers: the DataLoader's worker processes.
        sharder: what splits the loader's batches between processes, when the loader
            does that itself (e.g. ``"accelerate.data_loader.BatchSamplerShard"``).
            The sampler then hands out the one global order (``num_replicas`` 1)
            instead of its rank's part. None for a loader that does not.
        step: positions of the sampler's order one step of the training loop takes
            (all processes together, under a sharder); default ``batch_size``.
        reads_for_all: one process reads every batch and sends each process its part
            (Accelerate's ``dispatch_batches``): the other processes' samplers draw
            nothing, and only the steps taken tell where they are.
        pad_to: under a ``sharder``, the sampler pads its order to a multiple of this
            by repeating the order's first positions (as ``DistributedSampler`` pads),
            the way the loader would fill its last step itself. The loader then never
            fills from the first batches of the current pass, which after a resume are
            other samples, so a resume stays exact at the end of the epoch too. 1 (no
            padding) for a loader that drops or does not even out its last step, and
            for a sampler built with ``pad=False`` or ``drop_last=True``.

    Example:
        >>> from torchgrain.sampling import GlobalShuffleSampler
        >>> s = GlobalShuffleSampler(40, seed=1)
        >>> s.bind_loader(LoaderBinding(batch_size=5, sharder="my.Sharder", step=10))
        >>> (s.num_replicas, len(s))  # the sharder splits: the sampler keeps the whole order
        (1, 40)
    """

    batch_size: int | None = None
    num_workers: int = 0
    sharder: str | None = None
    step: int | None = None
    reads_for_all: bool = False
    pad_to: int = 1

    def __post_init__(self) -> None:
        if operator.index(self.pad_to) < 1:
            raise ValueError(f"pad_to must be >= 1, got {self.pad_to}")
        for name in ("batch_size", "step"):
            value = getattr(self, name)
            if value is not None and (operator.index(value) < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if operator.index(self.num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")

    @property
    def positions_per_step(self) -> int | None:
        """Positions of the sampler's order one step of the training loop takes."""
        return self.step if self.step is not None else self.batch_size
