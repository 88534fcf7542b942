"""ShardRegion: the local shard files of a dataset mapped into one range of addresses.

A batch of a global shuffle reads a record or two from each of hundreds of files. A process
reserves one range of addresses (``PROT_NONE``, no memory) per dataset and maps each shard
into a 64 KiB-aligned slot of it, so one numpy array spans every mapped shard: a batch's
headers are one fancy index, whatever the number of files. Mapped shards hold no file
descriptor and are bounded by ``vm.max_map_count``; Linux x86-64/arm64 only
(:func:`supported`). Callers bound every offset by the shard's size (an unmapped address is
a segfault), and :meth:`ShardRegion.acquire` checks the batch's shards for changes first.

Design notes: docs/design-notes.md#io-region.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> for k in range(3):
    ...     _ = open(os.path.join(d, f"{k}"), "wb").write(bytes([65 + k]) * 10)
    >>> paths = [os.path.join(d, f"{k}") for k in range(3)]
    >>> r = ShardRegion(paths, np.full(3, 10)) if supported() else None
    >>> if r is not None:
    ...     at = r.acquire(np.array([2, 0]))
    ...     print(bytes(r.view[at[0] : at[0] + 3]), bytes(r.view[at[1] : at[1] + 1]))
    ...     r.release()
    ... else:
    ...     print(b"CCC", b"A")
    b'CCC' b'A'
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchgrain.errors import CorruptDataError, DatasetNotFoundError
from torchgrain.io import changes, process
from torchgrain.io.libc import libc
from torchgrain.io.limits import free_maps

__all__ = ["SLOT_ALIGN", "RegionUnavailable", "ShardRegion", "acquired", "supported"]

SLOT_ALIGN = 1 << 16
_MAP_FIXED = 0x10  # the same on every Linux architecture :func:`supported` accepts
_ADDRESS_BUDGET = 1 << 42  # at most 4 TiB of addresses per region (halved until it fits)
_MIN_RESERVATION = 1 << 26
_fork_lock = threading.Lock()


def _new_fork_lock() -> None:
    # Another thread may have held it at the fork (a process that is itself a forked
    # child, e.g. a ddp_fork rank starting DataLoader workers): the child's copy would
    # stay held forever.
    global _fork_lock
    _fork_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_fork_lock)


def supported() -> bool:
    """Whether this platform can map files at fixed addresses (Linux, x86-64 or arm64)."""
    return (
        sys.platform.startswith("linux")
        and platform.machine() in ("x86_64", "aarch64", "arm64")
        and _mmap_fn() is not None
    )


def _mmap_fn() -> Any:
    lib = libc()
    return lib.mmap if lib is not None else None


_MAP_FAILED = ctypes.c_void_p(-1).value
_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)


class RegionUnavailable(OSError):
    """No address range could be reserved (address-space limit, unsupported platform)."""


class _Guard:
    """Unmaps the reservation once neither the region nor any view of it is left."""


class ShardRegion:
    """Shards of one dataset mapped into slots of one reserved address range.

    Args:
        paths: the shard files (local paths), in dataset order.
        sizes: each file's size in bytes, as the dataset's index records it; a file of
            another size is refused when mapped.
        max_maps: shards mapped at once, at most (default: what ``vm.max_map_count``
            leaves free, two map entries per shard).
        check: called as ``check(shard, stat, view)`` after mapping a shard (``view``:
            the file's bytes; do not keep it); raising refuses the shard (it is
            unmapped and the error propagates).
        ctimes: each file's change time (``st_ctime_ns``) when the dataset was opened;
            a file whose change time differs when a process maps it is refused
            (:func:`~torchgrain.io.changes.changed_since_opening`), before its map.

    Raises:
        RegionUnavailable: on an unsupported platform, or when no address range can be
            reserved.
    """

    def __init__(
        self,
        paths: Sequence[str],
        sizes: np.ndarray,
        *,
        max_maps: int | None = None,
        check: Callable[[int, os.stat_result, memoryview], None] | None = None,
        ctimes: np.ndarray | None = None,
    ) -> None:
        if not supported():
            raise RegionUnavailable("mapping files at fixed addresses needs Linux x86-64/arm64")
        self.paths = paths
        self.sizes = np.asarray(sizes, dtype=np.int64)
        n = len(self.sizes)
        biggest = int(self.sizes.max()) if n else 0
        self.slot_size = max(SLOT_ALIGN, -(-biggest // SLOT_ALIGN) * SLOT_ALIGN)
        if max_maps is None:
            max_maps = free_maps() // 2
        slots = min(n, max(1, int(max_maps)), max(1, _ADDRESS_BUDGET // self.slot_size))
        mm = _mmap_fn()
        base = None
        while slots >= 1:
            length = slots * self.slot_size + SLOT_ALIGN
            addr = mm(None, length, 0, _RESERVE_FLAGS, -1, 0)  # PROT_NONE
            if addr not in (None, _MAP_FAILED):
                base = addr
                break
            if length <= _MIN_RESERVATION or slots == 1:
                break
            slots //= 2
        if base is None:
            raise RegionUnavailable(
                f"cannot reserve {slots * self.slot_size} bytes of addresses for "
                f"{n} shards: {os.strerror(ctypes.get_errno())}"
            )
        self.num_slots = slots
        self.capacity = slots  # slots that may be mapped at once (lowered on ENOMEM)
        self._start = start = -(-base // SLOT_ALIGN) * SLOT_ALIGN
        size = slots * self.slot_size
        guard = _Guard()
        weakref.finalize(guard, libc().munmap, base, length).atexit = False
        mem = type("_Mapped", (ctypes.c_ubyte * size,), {}).from_address(start)
        mem.guard = guard  # views of the region keep the reservation alive
        #: The whole region as uint8 (read-only); slot ``k`` is ``[k * slot_size, ...)``.
        self.u8 = np.frombuffer(mem, dtype=np.uint8)
        self.u8.flags.writeable = False
        #: The region as (unaligned, overlapping) little-endian uint64 words, one
        #: starting at every byte: gathering 8 bytes costs one element.
        self.words = np.ndarray((max(size - 7, 0),), dtype="<u8", buffer=mem, strides=(1,))
        self.words.flags.writeable = False
        self.view = memoryview(self.u8)
        self._check = check
        self._ctimes = ctimes
        # Per shard and slot: 4 + 12 bytes (what a process keeps per shard).
        self.slot_of = np.full(n, -1, dtype=np.int32)
        self.owner = np.full(slots, -1, dtype=np.int32)
        self.used = np.zeros(slots, dtype=np.int64)  # the read that last used a slot
        self.mapped = 0
        self.maps_done = 0  # shards mapped by this process (a counter for tests and stats)
        # Per slot: the mapped file's pin, and whether it is watched (changes are then
        # seen by one poll for every slot; unwatched ones are stat-ed at each use).
        self._pins: list[changes.Pin | None] = [None] * slots
        self._watched = np.zeros(slots, dtype=bool)
        self._seen = -1  # the changes this process had seen when every slot was checked
        self._gone: dict[int, str] = {}  # shards that changed while mapped: refused
        self._stale: set[int] = set()  # of those, left mapped until the last release
        self._tick = 0
        self._inflight = 0
        self._lock = threading.Lock()
        self._generation = process.generation

    # ------------------------------------------------------------------ per process
    def _own(self) -> None:
        """After a fork: the maps are inherited and valid, the lock and readers are not.
        (Each fork bumps the child's generation; a spawned child never has this object.)"""
        if self._generation != process.generation:
            with _fork_lock:
                if self._generation != process.generation:
                    self._lock = threading.Lock()
                    self._inflight = 0
                    self._seen = -1  # the pins are the parent's: watched again here
                    self._watched[:] = False
                    self._generation = process.generation

    def __getstate__(self) -> None:
        raise TypeError("a ShardRegion belongs to one process and is not pickled")

    # ------------------------------------------------------------------ reading
    def acquire(self, shards: np.ndarray, *, polled: bool = False) -> np.ndarray | None:
        """Offsets into :attr:`u8` of the slots of ``shards`` (one per entry), mapping
        the shards not mapped yet; None when they cannot all be mapped at once (more
        distinct shards than slots, or the system's map limit reached). After a
        non-None result, call :meth:`release` when done reading: no shard is unmapped
        while any reader holds the region.

        Raises :class:`~torchgrain.io.changes.ChangedWhileOpen` for a shard that
        changed since it was mapped. ``polled``: the caller has just called
        :func:`torchgrain.io.changes.poll` (saves a system call)."""
        self._own()
        with self._lock:
            # A shard seen changed is refused first: while another read held the region
            # it was left mapped, and its map may now end past the file (SIGBUS).
            if self._gone:
                self._refuse_gone(shards)
            slots = self.slot_of[shards]
            missing = slots < 0
            if missing.any():
                if not self._map_missing(np.unique(shards[missing]), shards):
                    return None
                slots = self.slot_of[shards]
            self._verify(slots, changes.seen() if polled else changes.poll())
            self._tick += 1  # (a count that never reaches 2**63)
            self.used[slots] = self._tick
            self._inflight += 1
        return slots * np.int64(self.slot_size)

    def acquire_one(self, shard: int, *, polled: bool = False) -> int | None:
        """:meth:`acquire` for one shard: the offset of its slot, or None."""
        self._own()
        with self._lock:
            if shard in self._gone:  # (mapped or not: see acquire)
                self._refuse_gone(np.array([shard]))
            k = int(self.slot_of[shard])
            if k < 0:
                if not self._map_missing(np.array([shard]), np.array([shard])):
                    return None
                k = int(self.slot_of[shard])
            seen = changes.seen() if polled else changes.poll()
            if seen != self._seen or not self._watched[k]:  # (else nothing to look at)
                self._verify(np.array([k]), seen)
            self._tick += 1
            self.used[k] = self._tick
            self._inflight += 1
        return k * self.slot_size

    def _verify(self, slots: np.ndarray, seen: int) -> None:
        """Raise :class:`~torchgrain.io.changes.ChangedWhileOpen` if a shard of ``slots``
        changed since it was mapped (we hold the lock; ``seen``: what the last poll
        returned). Without a change anywhere, and every slot of the batch watched,
        this looks at nothing more."""
        if seen == self._seen and self._watched[slots].all():
            return
        batch = self.owner[slots]
        if seen != self._seen:  # something changed: check every mapped shard once
            check = np.flatnonzero(self.owner >= 0)
        else:
            check = np.unique(slots[~self._watched[slots]])
        for k in check.tolist():
            pin = self._pins[k]
            if pin is None:
                continue
            why = changes.changed(pin)
            self._watched[k] = pin.wd >= 0
            if why is not None:
                self._gone[int(self.owner[k])] = why
                if not self._inflight:
                    self._unmap_slot(k)
                else:  # another read holds it: unmapped at the last release
                    self._stale.add(int(self.owner[k]))
        self._seen = seen
        if self._gone:
            self._refuse_gone(batch)

    def _refuse_gone(self, shards: np.ndarray) -> None:
        gone = [s for s in np.unique(shards).tolist() if s in self._gone]
        if gone:
            raise changes.ChangedWhileOpen(
                f"shard {gone[0]} {self.paths[gone[0]]!r} changed while open "
                f"({self._gone[gone[0]]} after it was memory-mapped): not read, as its bytes "
                "are no longer the ones its index describes (a shard rewritten in place under "
                "a running job, e.g. by cp or rsync --inplace); open the dataset again"
            )

    def release(self) -> None:
        """End a read begun by a non-None :meth:`acquire`."""
        with self._lock:
            self._inflight -= 1
            if not self._inflight and self._stale:
                # Shards seen changed while a read held the region: unmapped now that
                # nothing reads them (they stay refused).
                for shard in self._stale:
                    k = int(self.slot_of[shard])
                    if k >= 0:
                        self._unmap_slot(k)
                self._stale.clear()

    def close(self) -> None:
        """Unmap every shard (when no read is in progress); the region stays usable."""
        self._own()
        with self._lock:
            if self._inflight:
                return
            for k in np.flatnonzero(self.owner >= 0).tolist():
                self._unmap_slot(k)

    # ------------------------------------------------------------------ mapping
    def _map_missing(self, need: np.ndarray, batch: np.ndarray) -> bool:
        room = self.capacity - self.mapped
        if room < len(need):
            if self._inflight:
                return False  # another thread reads: nothing may be unmapped now
            in_batch = self.slot_of[batch]
            mask = self.owner >= 0
            mask[in_batch[in_batch >= 0]] = False
            candidates = np.flatnonzero(mask)
            m = len(need) - room
            if len(candidates) < m:
                return False
            if m < len(candidates):
                candidates = candidates[np.argpartition(self.used[candidates], m - 1)[:m]]
            for k in candidates.tolist():
                self._unmap_slot(k)
        free = np.flatnonzero(self.owner < 0)
        return all(self._map(shard, k) for shard, k in zip(need.tolist(), free.tolist()))

    def _map(self, shard: int, k: int) -> bool:
        path = self.paths[shard]
        try:
            fd = changes.open_regular(path)  # (a FIFO a manifest names: refused)
        except FileNotFoundError:
            raise DatasetNotFoundError(f"shard {shard} {path!r} does not exist") from None
        except IsADirectoryError:
            raise CorruptDataError(f"shard {shard} {path!r} is a directory") from None
        try:
            pin = changes.Pin(fd, path)  # before the size is checked: changes from now on
            st = os.fstat(fd)
            size = int(self.sizes[shard])
            if st.st_size != size:
                # Offsets were bounded by the recorded size: a file of another size is
                # another file (and a shorter one would leave unmapped holes).
                if self._check is not None:
                    self._check(shard, st, memoryview(b""))  # names the change
                raise CorruptDataError(
                    f"shard {shard} {path!r} is {st.st_size} bytes, its index says {size}: "
                    "the file changed after its index was made"
                )
            if self._ctimes is not None and st.st_ctime_ns != self._ctimes[shard]:
                raise changes.changed_since_opening(shard, path)
            addr = self._start + k * self.slot_size
            if size:
                got = _mmap_fn()(addr, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
                if got in (None, _MAP_FAILED):
                    err = ctypes.get_errno()
                    if err == errno.ENOMEM:  # the system's map limit: use fewer slots
                        self.capacity = max(1, self.mapped)
                        return False
                    raise OSError(err, f"cannot map shard {shard} {path!r}: {os.strerror(err)}")
        finally:
            os.close(fd)
        self.owner[k] = shard
        self.slot_of[shard] = k
        self._pins[k] = pin
        self._watched[k] = pin.wd >= 0
        self.mapped += 1
        self.maps_done += 1
        if self._check is not None:
            at = k * self.slot_size
            try:
                self._check(shard, st, self.view[at : at + size])
            except BaseException:
                self._unmap_slot(k)
                raise
        return True

    def _unmap_slot(self, k: int) -> None:
        addr = self._start + k * self.slot_size
        got = _mmap_fn()(addr, self.slot_size, 0, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)
        if got in (None, _MAP_FAILED):  # pragma: no cover - replacing a map of our own
            err = ctypes.get_errno()
            raise OSError(err, f"cannot unmap a shard: {os.strerror(err)}")
        shard = int(self.owner[k])
        self.owner[k] = -1
        pin, self._pins[k] = self._pins[k], None
        self._watched[k] = False
        if pin is not None:
            pin.release()
        if shard >= 0:
            self.slot_of[shard] = -1
            self.mapped -= 1

    def __repr__(self) -> str:
        return (
            f"ShardRegion(shards={len(self.slot_of)}, slots={self.num_slots}, "
            f"slot_size={self.slot_size}, mapped={self.mapped})"
        )


def acquired(region: ShardRegion, shards: int | np.ndarray) -> Any:
    """Where ``shards`` (one, or a batch's array) are mapped in ``region`` (release it
    after reading), or None to read them through their readers: a shard that cannot be
    mapped now (its reader names the error), or more than may be mapped at once. A file
    changed while open raises: a reader may not see a same-size rewrite. The caller has
    just called :func:`torchgrain.io.changes.poll`."""
    try:
        if isinstance(shards, int):
            return region.acquire_one(shards, polled=True)
        return region.acquire(shards, polled=True)
    except changes.ChangedWhileOpen:
        raise
    except (CorruptDataError, FileNotFoundError):
        return None
