"""HF Accelerate's prepared loaders: what torchgrain needs to know about them.

``accelerator.prepare(loader)`` returns a loader that splits batches between the
processes itself, in one of two ways:

* ``DataLoaderShard`` over a ``BatchSamplerShard`` (the default): every process runs
  the loader's batch sampler and keeps every ``num_processes``-th batch (or, with
  ``split_batches=True``, its slice of every batch);
* ``DataLoaderDispatcher`` (``dispatch_batches=True``, the default for iterable
  datasets): process 0 alone reads ``num_processes`` batches (one with
  ``split_batches=True``), concatenates them and sends each process its slice.

Either way the sampler under it must hand out the one global order: split by rank as
well, each process would get 1/``num_processes`` of its own part, and an epoch would
cover 1/``num_processes`` of the data. Accelerate tells the sampler nothing, so:

* :func:`describe` reads a prepared loader (``tg.bind`` and ``tg.ResumableLoader`` call
  it): whether it splits batches, its batch size and workers, and how many positions of
  the sampler's order one step of the training loop consumes over all processes.
* :func:`sharder_driving` is the safety net for a sampler nobody bound (a bare
  ``accelerator.prepare(loader)``, or the loaders ``transformers.Trainer`` and
  ``accelerate.skip_first_batches`` build): at the start of a pass (and in ``len``)
  the sampler looks up its call stack for the Accelerate object iterating it, and
  checks that this object really draws from it.

This module imports nothing from Accelerate: it looks only when the program has
imported ``accelerate.data_loader`` itself.

Example:
    >>> import torch
    >>> loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    >>> describe(loader) is None   # not an Accelerate loader
    True
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["describe", "sharder_driving"]

_MODULE = "accelerate.data_loader"
_SEARCH_DEPTH = 48


def _name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__name__}"


def _shard_sampler(loader: Any, mod: Any) -> Any | None:
    """The ``BatchSamplerShard`` a ``DataLoaderShard`` draws its batches from, also
    under the ``SkipBatchSampler`` that ``skip_first_batches`` puts around it."""
    for attr in ("batch_sampler", "sampler"):
        obj = getattr(loader, attr, None)
        for _ in range(3):
            if obj is None:
                break
            if isinstance(obj, mod.BatchSamplerShard):
                return obj
            obj = getattr(obj, "batch_sampler", None)
    return None


def describe(loader: Any) -> dict[str, Any] | None:
    """How an Accelerate prepared loader uses its sampler, or None for any other loader.

    Returns the fields of a :class:`~torchgrain.LoaderBinding`: the class that splits
    batches between processes, the batch size of the DataLoader it wraps (the one over
    the sampler), its worker processes, the positions of the sampler's global order
    one step of the training loop consumes over all processes, and whether one process
    reads for all (``dispatch_batches``), and what the loader fills its last step up
    to. None for a loader that splits nothing (one process).
    """
    mod = sys.modules.get(_MODULE)
    if mod is None:
        return None
    num_workers = int(getattr(loader, "num_workers", 0) or 0)
    if isinstance(loader, mod.DataLoaderDispatcher):
        # Process 0 reads with the original batch sampler: num_processes batches per
        # step, or one that it splits; it fills the last step up to a multiple of
        # num_processes with the first samples of the pass.
        inner = getattr(loader, "batch_sampler", None)
        sharder, batch_size = loader, getattr(inner, "batch_size", None)
        processes, split = int(loader.state.num_processes), loader.split_batches
    elif isinstance(loader, mod.DataLoaderShard):
        sharder = _shard_sampler(loader, mod)
        if sharder is None:  # one process: the loader splits nothing
            return None
        batch_size = sharder.batch_size
        processes, split = sharder.num_processes, sharder.split_batches
    else:
        return None
    step = None if batch_size is None else batch_size * (1 if split else processes)
    out = {"sharder": _name(sharder), "batch_size": batch_size, "num_workers": num_workers}
    if sharder is loader:
        pad_to = 1 if getattr(inner, "drop_last", False) else processes
        return {**out, "step": step, "reads_for_all": True, "pad_to": pad_to}
    # Every process keeps its batches of the one order; with even_batches (the default)
    # the last step is filled up to full batches with the first samples of the pass.
    even = bool(sharder.even_batches) and not bool(sharder.drop_last)
    return {**out, "step": step, "pad_to": step if even and step is not None else 1}


def _drives(obj: Any, sampler: Any, mod: Any) -> bool:
    """Whether the Accelerate object ``obj`` splits batches drawn from ``sampler``."""
    if isinstance(obj, mod.BatchSamplerShard):
        inner = obj.batch_sampler
        return inner is sampler or getattr(inner, "sampler", None) is sampler
    if isinstance(obj, mod.DataLoaderDispatcher):
        return mod.get_sampler(obj) is sampler
    return False


def sharder_driving(sampler: Any, *, skip: int = 2) -> str | None:
    """Name of the Accelerate object on the call stack that splits the batches drawn
    from ``sampler`` between processes (``module.Class``), or None.

    Looked up from the caller's caller (``skip`` frames up) within a bounded number of
    frames. Under ``dispatch_batches`` the DataLoader's own iterator sits between the
    sampler and the dispatcher, so the walk goes past it.
    """
    mod = sys.modules.get(_MODULE)
    if mod is None:
        return None
    frame: FrameType | None = sys._getframe(skip)
    for _ in range(_SEARCH_DEPTH):
        if frame is None:
            return None
        if "self" in frame.f_code.co_varnames:
            obj = frame.f_locals.get("self")
            if obj is not None and _drives(obj, sampler, mod):
                return _name(obj)
        frame = frame.f_back
    return None
