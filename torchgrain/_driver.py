"""What the call stack says about who drives a sampler or a dataset.

A sampler does not know the DataLoader it is attached to, and a dataset does not know
which loader's worker it runs in. Both can be read off the frames of the caller: the
DataLoader iterator (its ``num_workers`` and batch sampler) or a wrapper that splits
batches between processes itself (Accelerate's prepared loaders). A forked DataLoader
worker still holds the frames that started it (``_MultiProcessingDataLoaderIter``'s
constructor in the parent), so a worker can tell which loader it belongs to. Each lookup
walks a bounded number of frames, once per pass or per process, and finds nothing when
it is not there.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any, NamedTuple

__all__ = [
    "Driver",
    "driver",
    "external_sharder",
    "loader_iterator",
    "loader_key",
    "reads_here",
]

# DataLoader wrappers that split batches between processes themselves. A sampler they
# drive must hand out the one global order: splitting it by rank as well would give each
# process 1/W of its own part, and the epoch would cover 1/W of the data.
# (Accelerate's prepared loaders: BatchSamplerShard deals batches round-robin to the
# processes; DataLoaderDispatcher reads every batch on rank 0 and sends out slices.)
_EXTERNAL_SHARDERS = frozenset(
    {
        ("accelerate.data_loader", "BatchSamplerShard"),
        ("accelerate.data_loader", "DataLoaderDispatcher"),
    }
)
_SEARCH_DEPTH = 48


class Driver(NamedTuple):
    """Who iterates a sampler: a batch-sharding wrapper, and/or a DataLoader iterator."""

    sharder: str | None  # "module.Class" of a wrapper that splits batches itself
    num_workers: int | None  # the DataLoader's worker processes
    batch_size: int | None  # the batch sampler's batch size over this sampler


def _self_of(frame: FrameType) -> Any:
    if "self" not in frame.f_code.co_varnames:
        return None
    return frame.f_locals.get("self")


def _sharder_name(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        if (cls.__module__, cls.__name__) in _EXTERNAL_SHARDERS:
            return f"{cls.__module__}.{cls.__name__}"
    return None


def _iterator_class() -> type | None:
    module = sys.modules.get("torch.utils.data.dataloader")
    return getattr(module, "_BaseDataLoaderIter", None)


def driver(sampler: Any, *, skip: int = 2) -> Driver:
    """The DataLoader iterator and batch-sharding wrapper iterating ``sampler`` now.

    Called when the sampler starts an iteration (or is asked for its length: a
    wrapper's ``len`` reaches ``len(sampler)`` through it).
    """
    iterator_cls = _iterator_class()
    check_sharders = "accelerate" in sys.modules
    found: Driver = Driver(None, None, None)
    frame: FrameType | None = sys._getframe(skip)
    for _ in range(_SEARCH_DEPTH):
        if frame is None:
            break
        obj = _self_of(frame)
        if obj is not None:
            if check_sharders and found.sharder is None:
                name = _sharder_name(obj)
                if name is not None:
                    found = found._replace(sharder=name)
            if iterator_cls is not None and isinstance(obj, iterator_cls):
                index_sampler = getattr(obj, "_index_sampler", None)
                if getattr(index_sampler, "sampler", None) is sampler:
                    found = found._replace(
                        num_workers=int(getattr(obj, "_num_workers", 0)),
                        batch_size=getattr(index_sampler, "batch_size", None),
                    )
                break  # the loader iterator is the outermost thing that matters
        frame = frame.f_back
    return found


def external_sharder() -> str | None:
    """Name of the batch-sharding wrapper iterating the caller, if any (see :func:`driver`)."""
    if "accelerate" not in sys.modules:
        return None
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_SEARCH_DEPTH):
        if frame is None:
            return None
        obj = _self_of(frame)
        if obj is not None:
            name = _sharder_name(obj)
            if name is not None:
                return name
        frame = frame.f_back
    return None


def loader_iterator(*, skip: int = 2, depth: int = _SEARCH_DEPTH * 2) -> Any | None:
    """The innermost DataLoader iterator (a ``_BaseDataLoaderIter``) on the call stack.

    Found from the caller's caller (``skip`` frames up) within ``depth`` frames: the
    iterator fetching a batch in this process, or the one starting this DataLoader
    worker (a forked worker still holds its parent's frames), or the one starting a
    worker process now (while it pickles the dataset for a spawned worker, or forks).
    None when there is none.
    """
    iterator_cls = _iterator_class()
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
            obj = _self_of(frame)
            if obj is not None and isinstance(obj, iterator_cls):
                if kind is None:
                    _remember(code, True)
                return obj
            if kind is None and (obj is not None or "self" not in code.co_varnames):
                _remember(code, False)
        frame = frame.f_back
    return None


# Code objects seen by loader_iterator: True when their ``self`` was a DataLoader
# iterator. A method's code runs with instances of its own class, so one look tells;
# a lookup at every batch then reads the locals of one frame only, not of each frame.
_ITERATOR_CODE: dict[CodeType, bool] = {}
_CODE_CACHE_SIZE = 4096  # code objects are few, unless code is compiled on the fly


def _remember(code: CodeType, is_iterator: bool) -> None:
    if len(_ITERATOR_CODE) >= _CODE_CACHE_SIZE:
        _ITERATOR_CODE.clear()
    _ITERATOR_CODE[code] = is_iterator


def loader_key(dataset: Any, *, skip: int = 2) -> int | None:
    """An id of the DataLoader whose iterator (in this process, or in the parent that
    forked this worker, or is pickling the dataset for a spawned one) reads ``dataset``.

    The id of the loader's batch sampler (its ``_index_sampler``): the same object for
    every pass over one loader, different for each loader; a forked worker sees the
    parent's objects at their parent addresses. None when the innermost DataLoader
    iterator on the stack reads another dataset, or there is none.
    """
    it = loader_iterator(skip=skip + 1)
    if it is None or getattr(it, "_dataset", None) is not dataset:
        return None
    return id(getattr(it, "_index_sampler", it))


def reads_here() -> bool:
    """Whether the batches asked for now are read in this process: no DataLoader
    iterator on the call stack (a dataset read directly), or one with no worker
    processes. Read-ahead into memory is of use only there."""
    it = loader_iterator(skip=3)
    return it is None or int(getattr(it, "_num_workers", 0)) == 0
