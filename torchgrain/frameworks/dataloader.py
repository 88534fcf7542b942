"""What torch's ``DataLoader`` does not expose, and where torchgrain reads it anyway.

A ``DataLoader`` says publicly what it is (``batch_size``, ``num_workers``,
``batch_sampler``, ``sampler``), and a worker learns which worker it is from
:func:`torch.utils.data.get_worker_info`. Three things have no public signal; this
module is the only place in torchgrain that reads torch's private attributes or frames
to get them, and tests/test_frameworks_internals.py checks each against the installed
torch:

* **Which loader a batch is read for** (:func:`loader_iterator`,
  :func:`iterator_dataset`, :func:`iterator_key`): :func:`torchgrain.stats` counts each
  loader over one Dataset apart. The reading process finds the loader's iterator (a
  ``_BaseDataLoaderIter``) on its call stack; a forked worker still holds the frames
  of the parent that started it. Keyed like :func:`loader_key`, which needs only
  public attributes.
* **A worker's result pipe** (:func:`worker_result_pipe`): a DataLoader worker sends
  its batches through a pipe whose 64 KiB buffer makes large batches cross in many
  rounds; torchgrain grows it (see ``Dataset(worker_pipe_bytes=)``).
* **The loader that drives an unbound sampler** (:func:`driving_loader_shape`): the
  deprecated way a ``BlockShuffleSampler(deal_to_workers=True)`` learned its
  loader's batch size and workers; :func:`torchgrain.bind` tells it instead.
* **The default collate's table of types** (:func:`register_collate`): torch documents
  extending ``default_collate`` by adding to ``default_collate_fn_map``, which lives in
  a private module; a columns batch is collated that way.

Every lookup walks a bounded number of frames and returns None when what it looks for
is not there (another torch release, another loader class): statistics then count
the batch for the Dataset only, and the pipe keeps its size.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any

__all__ = [
    "driving_loader_shape",
    "iterator_dataset",
    "iterator_key",
    "loader_iterator",
    "loader_key",
    "register_collate",
    "worker_result_pipe",
]

_SEARCH_DEPTH = 96


def loader_key(loader: Any) -> Any | None:
    """What names a DataLoader for :func:`torchgrain.stats`: the object it draws each
    batch's indices from (its ``batch_sampler``, or its ``sampler`` without automatic
    batching). The same object for every pass over one loader, and the one its
    iterators hold (:func:`iterator_key`). Public attributes only, so it also works
    through wrappers that pass attributes on (``tg.ResumableLoader``, Accelerate's
    prepared loaders). None when ``loader`` has neither.

    Example:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
        >>> loader_key(loader) is loader.batch_sampler
        True
    """
    try:
        key = getattr(loader, "batch_sampler", None)
        if key is None and hasattr(loader, "batch_size"):
            key = getattr(loader, "sampler", None)
    except Exception:  # a property that cannot answer: not a loader
        return None
    return key


def iterator_key(it: Any) -> Any | None:
    """:func:`loader_key` of the loader whose iterator ``it`` is (private attribute)."""
    return getattr(it, "_index_sampler", None)


def iterator_dataset(it: Any) -> Any | None:
    """The dataset the DataLoader iterator ``it`` reads (private attribute)."""
    return getattr(it, "_dataset", None)


def loader_iterator(*, skip: int = 2, depth: int = _SEARCH_DEPTH) -> Any | None:
    """The innermost DataLoader iterator (a ``_BaseDataLoaderIter``) on the call stack.

    Found from the caller's caller (``skip`` frames up) within ``depth`` frames: the
    iterator fetching a batch in this process, or the one starting this DataLoader
    worker (a forked worker still holds its parent's frames), or the one starting a
    worker process now (while it pickles the dataset for a spawned worker, or forks).
    None when there is none.
    """
    module = sys.modules.get("torch.utils.data.dataloader")
    iterator_cls = getattr(module, "_BaseDataLoaderIter", None)
    if iterator_cls is None:
        return None
    kinds = _ITERATOR_CODE
    frame: FrameType | None = sys._getframe(skip)
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        kind = kinds.get(code)
        if kind is not False:
            has_self = "self" in code.co_varnames  # (reading f_locals costs more)
            obj = frame.f_locals.get("self") if has_self else None
            found = isinstance(obj, iterator_cls)
            if kind is None and (obj is not None or not has_self):
                if len(kinds) >= _CODE_CACHE_SIZE:
                    kinds.clear()
                kinds[code] = found
            if found:
                return obj
        frame = frame.f_back
    return None


# Code objects seen by loader_iterator: True when their ``self`` was a DataLoader
# iterator. A method's code runs with instances of its own class, so one look tells;
# a lookup at every batch then reads the locals of one frame only, not of each frame.
_ITERATOR_CODE: dict[CodeType, bool] = {}
_CODE_CACHE_SIZE = 4096  # code objects are few, unless code is compiled on the fly


def worker_result_pipe() -> int | None:
    """File descriptor of the pipe this DataLoader worker sends its batches through.

    The ``data_queue`` of the worker loop on the call stack (torch's ``_worker_loop``,
    or torchdata's ``StatefulDataLoader``'s, which has the same name and argument).
    None outside a worker or when the loop is not found.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_worker_loop" and "data_queue" in code.co_varnames:
            writer = getattr(frame.f_locals.get("data_queue"), "_writer", None)
            try:
                return int(writer.fileno())  # type: ignore[union-attr]
            except (AttributeError, OSError, TypeError, ValueError):
                return None
        frame = frame.f_back
    return None


def driving_loader_shape(sampler: Any, *, skip: int = 2) -> tuple[int | None, int] | None:
    """``(batch_size, num_workers)`` of the DataLoader whose iterator is drawing from
    ``sampler`` on the call stack now, or None.

    Deprecated route (see :func:`torchgrain.bind`): only a sampler that was not bound
    to its loader asks.
    """
    it = loader_iterator(skip=skip + 1, depth=48)
    if it is None:
        return None
    index_sampler = iterator_key(it)
    if getattr(index_sampler, "sampler", None) is not sampler:
        return None
    return getattr(index_sampler, "batch_size", None), int(getattr(it, "_num_workers", 0))


def register_collate(kind: type, fn: Any) -> bool:
    """Have torch's ``default_collate`` (the DataLoader's default ``collate_fn``) collate a
    batch of ``kind`` with ``fn(batch, *, collate_fn_map)``; whether it could."""
    from torch.utils.data._utils.collate import default_collate_fn_map  # (torch >= 1.13)

    default_collate_fn_map[kind] = fn
    return True


def collate(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """torch's recursive collate (what ``default_collate`` runs), with the type table
    ``collate_fn_map`` (None: torch's default one)."""
    from torch.utils.data._utils.collate import collate as torch_collate
    from torch.utils.data._utils.collate import default_collate_fn_map

    table = default_collate_fn_map if collate_fn_map is None else collate_fn_map
    return torch_collate(batch, collate_fn_map=table)
