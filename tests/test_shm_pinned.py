"""Slots pinned by a fork of the main process: given up by the worker, never written again."""

from __future__ import annotations

import gc

import pytest

from torchgrain import shm as _shm

pytestmark = pytest.mark.skipif(not _shm.ENABLED, reason="slots need Linux memfd")


def test_a_pinned_slot_is_given_up_and_frees_its_place_in_the_pool():
    pool = _shm.SlotPool(max_slots=2)
    a = pool.take(100)
    ta = a.arrays()
    b = pool.take(100)
    tb = b.arrays()
    a.header[_shm._PINNED] = 1  # the main process forked while a's batch was alive
    del ta, tb
    gc.collect()
    c = pool.take(100)
    assert c is b  # a is not reused ...
    tc = c.arrays()
    d = pool.take(100)
    assert d is not a and d is not b  # ... but given up, making room for a new slot
    assert a.header[_shm._RETIRED] == 1 and a not in pool.slots and len(pool.slots) == 2
    del tc


def test_forking_pins_the_slots_of_live_batches_only():
    pool = _shm.SlotPool(max_slots=2)
    live = pool.take(100)
    held = live.arrays()
    dropped = pool.take(100)
    assert dropped is not live
    entries = {}
    for slot, n in ((live, 1), (dropped, 0)):
        entry = _shm._Mapped(slot.mm, 0)
        entry.live = n
        entries[slot.name] = entry
    _shm._mapped.update(entries)
    try:
        _shm._pin_before_fork()
    finally:
        for name in entries:
            del _shm._mapped[name]
    assert (live.header[_shm._PINNED], dropped.header[_shm._PINNED]) == (1, 0)
    del held
