"""HF ``transformers.Trainer`` with its training loader ordered by a torchgrain sampler.

``Trainer`` has no argument for a sampler. :class:`SamplerMixin` overrides the method
``Trainer`` documents for this, ``get_train_dataloader``, and builds the same loader around
a torchgrain sampler bound to the Trainer's ``accelerator`` (public ``Trainer`` API only):
each epoch is one exact cover in an order that changes with the epoch, and a mid-epoch
``resume_from_checkpoint`` continues exactly (skipping re-draws indices: about 3 s per ten
million samples). Batches keep every key of the records: have ``Dataset.map`` return what
the model's ``forward`` takes.

Design notes: docs/design-notes.md#frameworks-transformers.

Example:
    >>> from torchgrain.frameworks.transformers import SamplerMixin, Trainer
    >>> import transformers
    >>> issubclass(Trainer, transformers.Trainer) and issubclass(Trainer, SamplerMixin)
    True
"""

from __future__ import annotations

from typing import Any

import torch.utils.data
import transformers
from transformers import TrainerCallback

from torchgrain.loader import bind
from torchgrain.sampling.base import ResumableSampler
from torchgrain.sampling.global_shuffle import GlobalShuffleSampler

__all__ = ["SamplerMixin", "Trainer"]


class SamplerMixin:
    """Mix into a ``transformers.Trainer`` (first among the bases): the training loader
    is ordered by ``train_sampler``.

    Args:
        train_sampler: a :class:`~torchgrain.GlobalShuffleSampler` or
            :class:`~torchgrain.BlockShuffleSampler` over ``train_dataset``, built
            without ``num_replicas``/``rank`` (Accelerate splits its batches). Default:
            ``GlobalShuffleSampler(train_dataset, seed=args.seed)``.

    Every other argument is the Trainer's. The loader takes ``args.train_batch_size``,
    the ``dataloader_*`` arguments (workers, pinning, persistent workers, prefetch,
    drop_last, start method) and ``data_collator`` as the Trainer's own would.
    """

    def __init__(self, *args: Any, train_sampler: ResumableSampler | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if train_sampler is not None and not isinstance(train_sampler, ResumableSampler):
            raise TypeError(
                f"train_sampler must be a torchgrain sampler, got {type(train_sampler).__name__}"
            )
        self.train_sampler = train_sampler
        trainer: Any = self
        trainer.add_callback(_SamplerEpoch(self))

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The training loader: a ``DataLoader`` over ``train_dataset`` ordered by
        ``train_sampler``, prepared by the Trainer's accelerator and bound to the
        sampler."""
        trainer: Any = self
        dataset = trainer.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = trainer.args
        if self.train_sampler is None:
            self.train_sampler = GlobalShuffleSampler(dataset, seed=args.seed)
        kwargs: dict[str, Any] = {
            "batch_size": args.train_batch_size,
            "sampler": self.train_sampler,
            "collate_fn": trainer.data_collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "drop_last": args.dataloader_drop_last,
        }
        if args.dataloader_num_workers > 0:
            kwargs["persistent_workers"] = args.dataloader_persistent_workers
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
            context = getattr(args, "dataloader_multiprocessing_context", None)
            if context is not None:
                kwargs["multiprocessing_context"] = context
        accelerator = trainer.accelerator
        config = accelerator.dataloader_config
        dispatch = config.dispatch_batches is True and not config.split_batches
        if split := dispatch and accelerator.num_processes > 1:
            # Under dispatch_batches process 0 reads num_processes batches per step, but
            # the Trainer's resume skips (with accelerate.skip_first_batches) as many
            # batches of the loader under the dispatcher as steps were trained: 1/P of
            # what was read, so records were trained twice and others never. One batch
            # of P * batch_size split between the processes (split_batches) hands each
            # process the same records per step, and makes one step one batch to skip.
            kwargs["batch_size"] = args.train_batch_size * accelerator.num_processes
            config.split_batches = True
        try:
            loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, **kwargs))
        finally:
            if split:
                config.split_batches = False
        return bind(loader, sampler=self.train_sampler)


class _SamplerEpoch(TrainerCallback):
    """Sets the training sampler's epoch when the Trainer begins an epoch."""

    def __init__(self, owner: SamplerMixin) -> None:
        self.owner = owner

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sampler = self.owner.train_sampler
        if sampler is not None:
            # state.epoch is the epoch in progress plus the fraction done (a resumed one
            # included): its whole part is the epoch beginning now.
            sampler.set_epoch(int(state.epoch))


class Trainer(SamplerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose training loader is ordered by a torchgrain sampler
    (``train_sampler=``; see :class:`SamplerMixin`)."""
