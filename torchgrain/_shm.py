"""Reusable shared-memory slots that carry columns batches from DataLoader workers.

A DataLoader worker normally hands each batch's tensors to torch's pickler, which moves
every storage into a fresh shared-memory segment and passes its file descriptor over a
socket; the main process then maps the segment, and every page of it faults in again
when the training step reads the batch. That costs the main process about a millisecond
per batch here, whatever the batch's size.

Here a worker instead keeps a few anonymous shared-memory files ("slots", from
``memfd_create``: no name in ``/dev/shm``, nothing left behind by a killed worker) and
writes each columns batch into a free one. A slot's file descriptor crosses to the main
process with the first batch it carries; after that only the slot's id and, per column,
an offset, a dtype and a shape. The main process maps each slot once, builds the batch's
tensors as views of the mapping, and marks the slot free when the last of those tensors
is garbage collected. A slot is written again only after that, so a batch the training
loop keeps stays intact. When every slot is busy (a loop that keeps many batches) or no
slot can be made, the batch takes torch's own path: slower, never wrong.

Each slot starts with a header of :data:`_HEADER` bytes: byte 0 is 1 while a batch in
the slot may still be read by the main process, byte 1 is 1 once the worker has dropped
the slot (the main process may then unmap it).
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import sys
import threading
import weakref
from multiprocessing import reduction, util
from typing import Any

import numpy as np
import torch

from torchgrain.columns import Ragged

__all__: list[str] = []

_HEADER = 64
_BUSY = 0
_RETIRED = 1
#: Slots one worker keeps at most: the batches it has queued (``prefetch_factor``) plus
#: the few the main process holds (current batch, pin-memory thread, CUDA prefetcher).
MAX_SLOTS = 8

_ENABLED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")

# Column descriptions in a slot batch's pickle.
_IN_SLOT, _RAGGED, _OBJECT = 0, 1, 2

_DTYPE_NAMES = {
    dt: str(dt).removeprefix("torch.")
    for dt in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
_DTYPES = {name: dt for dt, name in _DTYPE_NAMES.items()}


# ------------------------------------------------------------------ worker side
class Slot:
    """One reusable segment of a worker: ``capacity`` bytes of batch data after the header."""

    __slots__ = ("address", "announced", "capacity", "fd", "header", "mm", "name", "u8")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.announced = False  # its descriptor went to the main process
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
        u8 = np.frombuffer(self.mm, np.uint8)
        self.header = u8[:_HEADER]
        self.u8 = u8[_HEADER:]
        self.address = self.u8.ctypes.data

    def retire(self) -> None:
        """Give the slot up: no batch will use it again (the main process may unmap it)."""
        self.header[_RETIRED] = 1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotPool:
    """The slots of one worker process; :meth:`take` hands out a free one for a batch."""

    def __init__(self, max_slots: int = MAX_SLOTS) -> None:
        self.max_slots = max_slots
        self.slots: list[Slot] = []
        self._prefix = f"torchgrain-{os.getpid()}-{secrets.token_hex(4)}"
        self._names = itertools.count()
        self.broken = False  # no slot could be made: torch's path from now on
        util.Finalize(self, _retire_all, args=(self.slots, os.getpid()), exitpriority=10)

    def take(self, nbytes: int) -> Slot | None:
        """A free slot of at least ``nbytes``, marked busy; None when none can be had."""
        if self.broken:
            return None
        nbytes = -(-max(nbytes, 1) // _HEADER) * _HEADER  # every dtype views it whole
        free = [s for s in self.slots if not s.header[_BUSY]]
        fitting = [s for s in free if s.capacity >= nbytes]
        if fitting:
            slot = min(fitting, key=lambda s: s.capacity)
        else:
            if free:  # too small for batches like this one: replace the smallest
                old = min(free, key=lambda s: s.capacity)
                self.slots.remove(old)
                old.retire()
            elif len(self.slots) >= self.max_slots:
                return None
            try:
                slot = Slot(f"{self._prefix}-{next(self._names)}", nbytes)
            except OSError:
                self.broken = True
                return None
            self.slots.append(slot)
        slot.header[_BUSY] = 1
        return slot


def _retire_all(slots: list[Slot], owner: int) -> None:
    if os.getpid() != owner:  # a process forked from the worker: not its slots
        return
    for slot in slots:
        slot.retire()
    slots.clear()


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

    def __reduce__(self) -> tuple[Any, ...]:
        slot = self.slot
        items = [(k, describe(v, slot)) for k, v in self.items()]
        fd = None
        if not slot.announced:
            # Sent with the slot's first batch (which the main process unpickles before
            # any later batch of this worker); a copy of the descriptor, taken now.
            fd = reduction.DupFd(slot.fd)
            slot.announced = True
        return (_rebuild, (slot.name, os.getpid(), _HEADER + slot.capacity, fd, items))


# ------------------------------------------------------------------ main side
class _Mapped:
    __slots__ = ("header", "mm", "pid")

    def __init__(self, mm: mmap.mmap, pid: int) -> None:
        self.mm = mm
        self.pid = pid
        self.header = np.frombuffer(mm, np.uint8, count=_HEADER)


_mapped: dict[str, _Mapped] = {}
_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _mapped.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


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
            return entry
        if fd is None:
            raise RuntimeError(
                f"a batch from DataLoader worker {pid} is in shared memory this process "
                f"never received ({name}): was a batch of that worker lost?"
            )
        # Forget slots their workers dropped, or whose worker is gone, and that no
        # batch still uses (their mappings live on in any batch that does).
        for key, old in list(_mapped.items()):
            if not old.header[_BUSY] and (old.header[_RETIRED] or not _alive(old.pid)):
                del _mapped[key]
        fd = fd.detach()
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        entry = _mapped[name] = _Mapped(mm, pid)
        return entry


def _release(header: np.ndarray) -> None:
    header[_BUSY] = 0


def _materialize(desc: tuple[Any, ...], typed: dict[str, torch.Tensor]) -> Any:
    tag = desc[0]
    if tag == _IN_SLOT:
        _, offset, dtype, shape = desc
        flat = typed[dtype]  # the batch's memory as this dtype (offsets are aligned)
        stride = []
        step = 1
        for n in reversed(shape):
            stride.append(step)
            step *= n
        return flat.as_strided(shape, stride[::-1], offset // flat.element_size())
    if tag == _RAGGED:
        return Ragged(_materialize(desc[2], typed), _materialize(desc[3], typed), desc[1])
    return desc[1]


class _Typed(dict):
    """The batch's uint8 tensor viewed as each dtype a column asks for, made on demand."""

    __slots__ = ("flat",)

    def __missing__(self, dtype: str) -> torch.Tensor:
        out = self[dtype] = self.flat.view(_DTYPES[dtype])
        return out


def _rebuild(
    name: str, pid: int, size: int, fd: Any, items: list[tuple[str, Any]]
) -> dict[str, Any]:
    entry = _mapped.get(name) or _open(name, pid, size, fd)
    # A new array object per batch: every column is a view of it, so it is collected
    # (and the slot freed for the worker) only once no tensor of this batch is left.
    batch_base = np.frombuffer(entry.mm, np.uint8, count=size - _HEADER, offset=_HEADER)
    weakref.finalize(batch_base, _release, entry.header)
    typed = _Typed()
    typed.flat = torch.from_numpy(batch_base)
    return {k: _materialize(desc, typed) for k, desc in items}
