"""How a batch leaves a DataLoader worker: a bigger pipe, and columns in shared memory.

Used by :class:`~torchgrain.Dataset` at the start of each batch it reads in a worker:

* :func:`grow_pipe_once` enlarges, once per process, the pipe that carries the worker's
  batches to the main process;
* :func:`start_columns_batch` gives a ``batch_format="columns"`` batch a shared-memory
  arena its columns are carved from, and :func:`collate_columns` (registered with
  torch's default collate) turns the batch into tensors over that memory.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.utils.data

from torchgrain import shm
from torchgrain.columns import ColumnBatch, Ragged, set_allocator
from torchgrain.frameworks import dataloader as _dataloader
from torchgrain.tokens.collate import collate_records

__all__ = ["WORKER_PIPE_BYTES", "collate_columns", "grow_pipe_once", "start_columns_batch"]

# Linux: fcntl(F_SETPIPE_SZ) sets a pipe's buffer size, up to /proc/sys/fs/pipe-max-size
# (1 MiB by default) for an unprivileged process.
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032
#: Default buffer asked for the pipe that carries a DataLoader worker's batches.
WORKER_PIPE_BYTES = 1 << 20
_pipe_checked = False  # per process: reset in forked children, fresh in spawned ones


def _grow_worker_pipe(size: int) -> int | None:
    """Enlarge the pipe that carries this DataLoader worker's batches to the main process.

    A worker pickles each batch into a pipe whose buffer is 64 KiB by default, so a
    batch of 256 records of 1 KiB crosses in five rounds, each waking the main process
    and then the worker again; with a 1 MiB buffer it goes in one. Records already in
    memory then move from two workers to the main process 1.5x faster (measured on 2
    cores). The pipe is the one torch's worker loop (or torchdata's StatefulDataLoader's)
    sends through (:func:`torchgrain.frameworks.dataloader.worker_result_pipe`);
    outside a worker, off Linux, or when anything is not as expected, nothing changes.
    Only ever grows the pipe. Returns the pipe's new size, or None.
    """
    global _pipe_checked
    _pipe_checked = True
    if size <= 0 or not sys.platform.startswith("linux"):
        return None
    if torch.utils.data.get_worker_info() is None:
        return None
    fd = _dataloader.worker_result_pipe()
    if fd is None:
        return None
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = min(size, int(f.read()))
        if fcntl.fcntl(fd, _F_GETPIPE_SZ) < size:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
        return int(fcntl.fcntl(fd, _F_GETPIPE_SZ))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------- batches as columns
# In a DataLoader worker, a batch's columns are carved out of one shared-memory arena
# (sized by the batch before), so the batch crosses to the main process as a name plus a
# few bytes of metadata per column, not as bytes, and not as one segment per column.
# The arena is one of the worker's reusable slots (torchgrain.shm: mapped once by the
# main process, freed when the batch's tensors are collected); when no slot can be had,
# a fresh torch shared-memory segment that torch's own pickler moves. The allocator
# hands out numpy views of the arena; the collate finds each column's tensor again by
# its data address.
_ARENA_ALIGN = 64
_ARENA_MIN_BYTES = 64 << 10
_shared: dict[int, tuple[np.ndarray, torch.Tensor | None]] = {}
_worker_checked = False
_in_worker = False


class _Arena:
    __slots__ = ("base", "capacity", "sent", "slot", "tensor", "used", "wanted")

    def __init__(self, capacity: int, slot: shm.Slot | None = None) -> None:
        self.slot = slot
        if slot is not None:
            self.capacity = slot.capacity
            self.base = slot.arrays()  # the slot stays the worker's while any view lives
            self.tensor = None
        else:
            self.capacity = capacity
            self.base = None
            self.tensor = torch.empty(capacity, dtype=torch.uint8).share_memory_()
        self.used = 0
        self.wanted = 0  # bytes this batch asked for, fitting or not (sizes the next)
        self.sent = False  # a slot arena is handed to the main process at most once


_arena: _Arena | None = None
_small_bytes = 0  # shm.small_column_bytes of the batch before (see _shared_empty)
_slot_pool: shm.SlotPool | None = None


def _forget_after_fork() -> None:
    global _pipe_checked, _worker_checked, _in_worker, _arena, _slot_pool
    _pipe_checked = _worker_checked = _in_worker = False
    _arena = _slot_pool = None
    _shared.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _new_arena(capacity: int, max_slots: int) -> _Arena:
    global _slot_pool
    if shm.ENABLED and max_slots:
        if _slot_pool is None:
            _slot_pool = shm.SlotPool(max_slots)
        _slot_pool.max_slots = max_slots
        return _Arena(capacity, _slot_pool.take(capacity))  # (None: a torch segment)
    return _Arena(capacity)


def _shared_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    nbytes = math.prod(shape) * dtype.itemsize
    arena = _arena
    if arena is None:
        return None
    try:
        torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    except (TypeError, ValueError):  # a dtype torch does not have (or byte order)
        return None
    if arena.base is None and nbytes <= _small_bytes:
        # Not into a torch segment's arena (no slot): a loop that keeps a small column
        # (labels) would keep the whole batch's segment; it goes in a segment of its own.
        return None
    size = -(-max(nbytes, 1) // _ARENA_ALIGN) * _ARENA_ALIGN
    arena.wanted += size
    if arena.used + size > arena.capacity:
        return None  # plain numpy: torch moves it into a segment of its own when sent
    start = arena.used
    arena.used += size
    if arena.base is not None:  # a numpy view of the slot: it alone keeps the slot pinned
        out = arena.base[start : start + nbytes].view(dtype).reshape(shape)
        _shared[out.ctypes.data] = (out, None)
        return out
    tensor = arena.tensor[start : start + nbytes].view(torch_dtype).view(shape)
    out = tensor.numpy()
    _shared[out.ctypes.data] = (out, tensor)
    return out


def start_columns_batch(max_slots: int) -> None:
    """At the start of a columns batch: in a worker, a fresh arena for its columns (in
    one of up to ``max_slots`` reusable shared-memory slots)."""
    global _worker_checked, _in_worker, _arena, _small_bytes
    _shared.clear()  # columns of a batch that was never collated
    if not _worker_checked:
        _worker_checked = True
        _in_worker = torch.utils.data.get_worker_info() is not None
        if _in_worker:
            set_allocator(_shared_empty)
    if _in_worker:
        last = _arena
        wanted = last.wanted if last is not None else 0
        # Sized by the batch before (batches of one dataset are alike), with room to grow.
        capacity = max(_ARENA_MIN_BYTES, wanted + wanted // 4)
        _small_bytes = shm.small_column_bytes(wanted)
        if last is not None and last.used == 0 and not last.sent and last.capacity >= capacity:
            last.wanted = 0  # never handed out: reuse it
        else:
            _arena = _new_arena(capacity, max_slots)


def _as_tensor(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if not value.dtype.isnative:  # (a map_batch's ">i4": the same values, native)
            value = value.astype(value.dtype.newbyteorder("="))
        # The very array the allocator handed out (a view of it, e.g. transposed, is
        # not: its strides or dtype differ).
        made = _shared.pop(value.ctypes.data, None) if value.size else None
        if made is not None and made[0] is value:
            return made[1] if made[1] is not None else torch.from_numpy(value)
        if _in_worker and value.size:  # into the batch's arena (small: a cheap copy)
            out = _shared_empty(value.shape, value.dtype)
            if out is not None:
                out[...] = value
                return _as_tensor(out)  # (the array the allocator handed out)
        try:
            return torch.from_numpy(value)
        except TypeError:  # a dtype torch does not have (str, bytes): stays numpy
            return value
    if isinstance(value, Ragged):
        return value.map_arrays(_as_tensor)
    return value


def collate_columns(batch: Sequence[ColumnBatch], *, collate_fn_map: Any = None) -> dict[str, Any]:
    """What the DataLoader's default collate makes of a columns batch: a dict of tensors
    (zero-copy; :class:`~torchgrain.columns.Ragged` holding tensors; lists as they are).

    Registered with torch's default collate, so ``DataLoader(ds, batch_size=...)`` over a
    ``Dataset(..., batch_format="columns")`` needs no ``collate_fn``. A custom
    ``collate_fn`` receives ``[ColumnBatch]`` and may call this.
    """
    if len(batch) != 1:
        raise TypeError(
            f"a columns batch is one ColumnBatch per DataLoader batch, got {len(batch)}: use "
            "batch_size= (automatic batching), not batch_size=None"
        )
    out = {k: _as_tensor(v) for k, v in batch[0].items()}
    arena = _arena
    if arena is not None and arena.slot is not None and arena.used and not arena.sent:
        arena.sent = True
        shipped = shm.SlotBatch(out)
        shipped.slot = arena.slot
        return shipped
    return out


_dataloader.register_collate(ColumnBatch, collate_columns)
# Records (dicts) collate as torch collates them, but values of different lengths under
# one key raise an error that names the key and the fix (tg.pad_collate).
_dataloader.register_collate(dict, collate_records)


def grow_pipe_once(size: int) -> None:
    """In a DataLoader worker, grow its result pipe to ``size`` bytes the first time this
    process asks (see :func:`_grow_worker_pipe`); later calls cost one check."""
    if not _pipe_checked:
        _grow_worker_pipe(size)
