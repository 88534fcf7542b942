"""Reusable shared-memory slots that carry columns batches from DataLoader workers.

A DataLoader worker normally hands each batch's tensors to torch's pickler, which moves
every storage into a fresh shared-memory segment and passes its file descriptor over a
socket; the main process then maps the segment, and every page of it faults in again
when the training step reads the batch. With 2 workers and batches of 256 images of
3x224x224 bytes (38.5 MB), the main process spends 13 ms of CPU per batch that way
against 5.5 ms through a slot, and the loader delivers 4.7x fewer batches; batches of 256
records of 1 KiB cost it about 1 ms more (``benchmarks/worker_slots.py``).

Here a worker instead keeps a few anonymous shared-memory files ("slots", from
``memfd_create``: no name in ``/dev/shm``, nothing left behind by a killed worker) and
writes each columns batch into a free one. A slot's file descriptor crosses to the main
process with the first batch it carries; after that only the slot's id and, per column,
an offset, a dtype and a shape. The main process maps each slot once, builds the batch's
tensors as views of the mapping (each with a storage of its own bytes: pickled or saved,
a column carries itself, not the slot), and marks the slot free when the last of those
tensors is garbage collected. A slot is written again only after that, so a batch the
training loop keeps stays intact. Small columns (labels, ids, lengths: at most an eighth
of the batch's bytes, and 1 MiB) are copied out of the slot as the batch is rebuilt, each
into memory of its own: a loop that keeps every batch's labels keeps those few
KiB, not every batch's slot. When every slot is busy (a loop that keeps many batches) or no
slot can be made, the batch takes torch's own path: slower, never wrong.

A slot is written again only when both sides are done with it: the worker's own
references to the batch's arrays are gone (a ``map_batch`` may keep them; the queue's
feeder thread pickles the batch after the worker has moved on) and the main process has
released the batch it received. Each slot starts with a header of :data:`_HEADER` bytes:
byte 0 is 1 from the moment a batch in the slot is pickled until the main process has
dropped it, byte 1 is 1 once the worker has given the slot up (the main process may then
unmap it), byte 2 is 1 once the main process has mapped the slot (its descriptor need
not be sent again), byte 3 is 1 once the main process forked while a batch of the slot
was alive (the child may still read it: the worker gives the slot up instead of writing
it again).
"""

from __future__ import annotations

import copy
import itertools
import math
import mmap
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing import reduction, util
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_storage as _torch_reduce_storage
from torch.multiprocessing.reductions import reduce_tensor as _torch_reduce_tensor

from torchgrain.columns import Ragged
from torchgrain.io import process

__all__: list[str] = []

_HEADER = 64
_BUSY = 0
_RETIRED = 1
_MAPPED = 2
_PINNED = 3
#: Slots one worker keeps at most: the batches it has queued (``prefetch_factor``) plus
#: the few the main process holds (current batch, pin-memory thread, CUDA prefetcher).
MAX_SLOTS = 8

#: Whether slots can be made here (Linux memfd).
ENABLED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")

# Column descriptions in a slot batch's pickle.
_IN_SLOT, _RAGGED, _OBJECT = 0, 1, 2

# The dtypes a column in a slot may have, by name (torch >= 2.3 has uint16..uint64;
# there is no float8).
_SIZED = (f"{kind}{bits}" for kind in ("int", "uint", "float") for bits in (8, 16, 32, 64))
_DTYPES = {
    name: getattr(torch, name)
    for name in ("bool", "bfloat16", "complex64", "complex128", *_SIZED)
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}


# ------------------------------------------------------------------ worker side
class Slot:
    """One reusable segment of a worker: ``capacity`` bytes of batch data after the header."""

    __slots__ = ("__weakref__", "address", "capacity", "fd", "header", "in_use", "mm", "name")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            # Reserve the pages now: shared memory that runs out fails here, not later
            # with SIGBUS when the batch is written.
            os.posix_fallocate(fd, 0, _HEADER + capacity)
            self.mm = mmap.mmap(fd, _HEADER + capacity)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.header = np.frombuffer(self.mm, np.uint8, count=_HEADER)
        self.address = self.header.ctypes.data + _HEADER
        self.in_use = False  # the worker still holds arrays of the batch in it

    def arrays(self) -> np.ndarray:
        """The slot's data as a uint8 array for one batch; the slot stays in use by the
        worker until this array and every view of it are gone. (Views are numpy views:
        a tensor made from one keeps it alive, and when torch's pickler moves such a
        tensor's storage to a segment of its own, the views kept elsewhere still pin
        the slot.)"""
        self.in_use = True
        base = np.frombuffer(self.mm, np.uint8, count=self.capacity, offset=_HEADER)
        weakref.finalize(base, setattr, self, "in_use", False).atexit = False
        return base

    @property
    def free(self) -> bool:
        return not self.in_use and not self.header[_BUSY]

    def retire(self) -> None:
        """Give the slot up: no batch will use it again (the main process may unmap it)."""
        self.header[_RETIRED] = 1


# This worker's slots by name (a batch unpickled in the worker that made it is copied out
# of its slot, never mapped or released as the main process does).
_own: weakref.WeakValueDictionary[str, Slot] = weakref.WeakValueDictionary()


class SlotPool:
    """The slots of one worker process; :meth:`take` hands out a free one for a batch."""

    def __init__(self, max_slots: int = MAX_SLOTS) -> None:
        self.max_slots = max_slots
        self.slots: list[Slot] = []
        self._prefix = f"torchgrain-{os.getpid()}-{secrets.token_hex(4)}"
        self._names = itertools.count()
        self.broken = False  # a slot could not be made: no new ones from now on
        util.Finalize(self, _retire_all, args=(self.slots, process.token()), exitpriority=10)

    def take(self, nbytes: int) -> Slot | None:
        """A free slot of at least ``nbytes`` (the caller marks it in use with
        :meth:`Slot.arrays`); None when none can be had."""
        nbytes = -(-max(nbytes, 1) // _HEADER) * _HEADER  # every dtype views it whole
        free = [s for s in self.slots if s.free]
        if any(s.header[_PINNED] for s in free):  # a forked process may read them
            for old in [s for s in free if s.header[_PINNED]]:
                self._drop(old)
            free = [s for s in free if not s.header[_PINNED]]
        fitting = [s for s in free if s.capacity >= nbytes]
        if fitting:
            return min(fitting, key=lambda s: s.capacity)
        if self.broken:
            return None
        if free:  # too small for batches like this one: replace the smallest
            self._drop(min(free, key=lambda s: s.capacity))
        elif len(self.slots) >= self.max_slots:
            return None
        try:
            slot = Slot(f"{self._prefix}-{next(self._names)}", nbytes)
        except OSError:
            self.broken = True
            return None
        self.slots.append(slot)
        _own[slot.name] = slot
        return slot

    def _drop(self, slot: Slot) -> None:
        """Give ``slot`` up for good, freeing its place in the pool."""
        self.slots.remove(slot)
        slot.retire()
        os.close(slot.fd)


def _retire_all(slots: list[Slot], owner: tuple[int, int]) -> None:
    if process.token() != owner:  # a process forked from the worker: not its slots
        return
    for slot in slots:
        slot.retire()  # descriptors close with the process (a batch may still be pickled)


def describe(value: Any, slot: Slot) -> tuple[Any, ...]:
    """How ``value`` (a column of a batch written into ``slot``) crosses to the main
    process: by offset when it is a contiguous CPU tensor inside the slot."""
    if isinstance(value, torch.Tensor):
        nbytes = value.numel() * value.element_size()
        offset = value.data_ptr() - slot.address
        if (
            value.device.type == "cpu"
            and nbytes
            and offset >= 0
            and offset + nbytes <= slot.capacity
            and offset % value.element_size() == 0
            and value.is_contiguous()
            and value.dtype in _DTYPE_NAMES
        ):
            return (_IN_SLOT, offset, _DTYPE_NAMES[value.dtype], tuple(value.shape))
    elif isinstance(value, Ragged):
        return (_RAGGED, value.kind, describe(value.values, slot), describe(value.offsets, slot))
    return (_OBJECT, value)


class SlotBatch(dict):
    """A dict of columns, some of them in a worker's slot, that pickles as the slot's name
    and offsets (see the module's docstring); a plain dict again in the main process."""

    __slots__ = ("slot",)

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self) -> tuple[Any, ...]:
        slot = self.slot
        items = [(k, describe(v, slot)) for k, v in self.items()]
        # Busy until the main process drops what it rebuilds from this (set before the
        # worker's own references go, so the slot is never free in between).
        slot.header[_BUSY] = 1
        # The descriptor goes along until the main process has mapped the slot: a
        # batch of a slot is pickled again only after the main process released the
        # one before, so normally only the first batch carries it.
        fd = None if slot.header[_MAPPED] else reduction.DupFd(slot.fd)
        return (_rebuild, (slot.name, process.token(), _HEADER + slot.capacity, fd, items))


# ------------------------------------------------------------------ main side
class _Mapped:
    __slots__ = ("address", "end", "header", "live", "mm", "pid")

    def __init__(self, mm: mmap.mmap, pid: int) -> None:
        self.mm = mm
        self.pid = pid
        self.header = np.frombuffer(mm, np.uint8, count=_HEADER)
        self.address = self.header.ctypes.data
        self.end = self.address + len(mm)
        # Batches rebuilt from this slot that are still alive here (counted, not weakly
        # referenced: a dying batch's finalizer runs before a weak reference to it clears).
        self.live = 0


_mapped: dict[str, _Mapped] = {}
# Small columns copied out of slots, alive here: address -> end; and those that died
_small: dict[int, int] = {}
_small_dead: list[int] = []
_lock = threading.RLock()


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.RLock()
    _mapped.clear()


def _pin_before_fork() -> None:
    # The child inherits the mappings of the batches alive now and may read them after
    # this process drops them: their workers must not write those slots again.
    with _lock:
        for entry in _mapped.values():
            if entry.live:
                entry.header[_PINNED] = 1


os.register_at_fork(before=_pin_before_fork, after_in_child=_forget_after_fork)


def _ours(address: int) -> bool:
    """Whether ``address`` lies in a slot mapped here or in a small column copied out of
    one."""
    with _lock:
        _purge_small()
        slots, small = tuple(_mapped.values()), list(_small.items())
    return any(e.address <= address < e.end for e in slots) or any(
        a <= address < e for a, e in small
    )


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    # torch's pickler moves a storage it sends into new shared memory in place: one of a
    # slot would leave the slot (freed, then rewritten by its worker) under any numpy
    # view of it. A tensor of a slot (or a small column copied out of one) is sent as a
    # copy of its own elements, made now: what it holds now, however many of its rows
    # are sent one by one; the slot stays as it is. (Other layouts, and what torch
    # refuses to send, are torch's.)
    if (
        (_mapped or _small)
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and (tensor.is_leaf or not tensor.requires_grad)
        and _ours(tensor.data_ptr())
    ):
        tensor = tensor.detach().clone().requires_grad_(tensor.requires_grad)
    return _torch_reduce_tensor(tensor)


def _reduce_storage(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    # (a storage pickled by itself: sent as a copy, as a tensor is)
    if (_mapped or _small) and storage.device.type == "cpu" and _ours(storage.data_ptr()):
        storage = storage.clone()
    return _torch_reduce_storage(storage)


reduction.ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
reduction.ForkingPickler.register(torch.Tensor, _reduce_tensor)


def small_column_bytes(batch_bytes: int) -> int:
    """The most bytes a column of a batch of ``batch_bytes`` may hold and be small (an
    eighth of the batch, 1 MiB at most): kept apart from the batch's shared memory, so
    that a loop keeping it keeps no more than it."""
    return min(1 << 20, batch_bytes // 8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _open(name: str, pid: int, size: int, fd: Any) -> _Mapped:
    with _lock:
        entry = _mapped.get(name)
        if entry is not None:
            if fd is not None:
                os.close(fd.detach())  # sent again before this process said it has it
            entry.live += 1
            return entry
        if fd is None:
            raise RuntimeError(
                f"a batch from DataLoader worker {pid} is in shared memory this process "
                f"never received ({name}): was a batch of that worker lost?"
            )
        _sweep()
        try:
            fd = fd.detach()  # from the worker, which must still be there to hand it over
        except (OSError, EOFError) as e:
            raise RuntimeError(
                f"DataLoader worker {pid} exited before this process received the shared "
                f"memory of its batch ({name})"
            ) from e
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        entry = _mapped[name] = _Mapped(mm, pid)
        entry.header[_MAPPED] = 1
        entry.live += 1  # the batch being rebuilt (under the lock: not swept meanwhile)
        return entry


def _release(entry: _Mapped, owner: tuple[int, int]) -> None:
    if process.token() != owner:  # a process forked while the batch was alive
        return
    with _lock:
        entry.live -= 1
    entry.header[_BUSY] = 0
    if entry.header[_RETIRED]:  # its worker is done: unmap what no batch uses any more
        _sweep()


def _sweep() -> None:
    """Forget slots that no batch here uses any more and whose worker gave them up or is
    gone (their mappings live on in any batch that still uses them)."""
    with _lock:
        for key, old in list(_mapped.items()):
            if not old.live and (old.header[_RETIRED] or not _alive(old.pid)):
                del _mapped[key]


def _materialize(desc: tuple[Any, ...], column: Callable[[int, str, tuple], torch.Tensor]) -> Any:
    tag = desc[0]
    if tag == _IN_SLOT:
        return column(*desc[1:])
    if tag == _RAGGED:
        return Ragged(_materialize(desc[2], column), _materialize(desc[3], column), desc[1])
    return desc[1]


def _sizes(desc: tuple[Any, ...]) -> list[int]:
    """The bytes of each column in the slot that ``desc`` describes."""
    if desc[0] == _IN_SLOT:
        return [math.prod(desc[3]) * _DTYPES[desc[2]].itemsize]
    return _sizes(desc[2]) + _sizes(desc[3]) if desc[0] == _RAGGED else []


def _columns(memory: np.ndarray, items: list[tuple[str, Any]]) -> dict[str, Any]:
    """The batch's columns from its slot's ``memory``, each a tensor with a storage of its
    own bytes: the small ones (at most an eighth of the batch and 1 MiB) copied out."""
    small = small_column_bytes(sum(n for _, desc in items for n in _sizes(desc)))

    def column(offset: int, dtype: str, shape: tuple) -> torch.Tensor:
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        view = torch.from_numpy(memory[offset : offset + nbytes])
        if nbytes <= small:
            view = _small_copy(view)
        return view.view(_DTYPES[dtype]).view(shape)

    return {k: _materialize(desc, column) for k, desc in items}


def _small_copy(column: torch.Tensor) -> torch.Tensor:
    """A copy of ``column`` (uint8) in a buffer of its own, known to :func:`_ours` while
    it lives."""
    array = np.empty(len(column), np.uint8)
    address = array.ctypes.data
    with _lock:
        _purge_small()  # (before: a new buffer may lie where a dead one did)
        _small[address] = address + len(column)
    # (a finalizer may run amid any code, an iteration of _small included: it only notes)
    weakref.finalize(array, _small_dead.append, address).atexit = False
    return torch.from_numpy(array).copy_(column)


def _purge_small() -> None:
    """Forget the small columns that died (under ``_lock``)."""
    while _small_dead:
        _small.pop(_small_dead.pop(), None)


def _rebuild(
    name: str, worker: tuple[int, int], size: int, fd: Any, items: list[tuple[str, Any]]
) -> dict[str, Any]:
    if worker == process.token():  # a copy made in the worker itself (pickle, deepcopy)
        return _copy_out(name, fd, items)
    entry = _open(name, worker[0], size, fd)
    # A new array object per batch: every column is a view of it, so it is collected
    # (and the slot freed for the worker) only once no tensor of this batch is left.
    batch_base = np.frombuffer(entry.mm, np.uint8, count=size - _HEADER, offset=_HEADER)
    weakref.finalize(batch_base, _release, entry, process.token()).atexit = False
    return _columns(batch_base, items)


def _copy_out(name: str, fd: Any, items: list[tuple[str, Any]]) -> dict[str, Any]:
    if fd is not None:
        os.close(fd.detach())
    slot = _own[name]
    data = np.frombuffer(slot.mm, np.uint8, count=slot.capacity, offset=_HEADER)
    return {k: _clone(v) for k, v in _columns(data, items).items()}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value.map_arrays(_clone) if isinstance(value, Ragged) else value
