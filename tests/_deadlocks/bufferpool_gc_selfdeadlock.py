"""A pooled buffer freed by a collection that starts inside the pool's own bookkeeping.

BufferPool._give_back runs as a finalizer. If it allocated a GC-tracked object while
holding the pool's lock, a collection starting there could free another pooled array
(one kept alive only by a reference cycle) whose finalizer calls _give_back again, in
the same thread, on the lock that thread holds. The collection is made to happen at
that point by giving the pool an ``_idle`` dict whose setdefault() collects first.
Exit 0: no deadlock.
"""

import faulthandler
import gc
import sys

import numpy as np

from torchgrain import columns

faulthandler.dump_traceback_later(10, exit=False)


class CollectingDict(dict):
    def setdefault(self, key, default=None):
        gc.collect()  # the collection the allocation of `default` may start
        return super().setdefault(key, default)


pool = columns.BufferPool(min_bytes=1024)
pool._idle = CollectingDict()


class Holder:
    pass


h = Holder()
h.me = h  # a reference cycle: only the collector frees h.arr
h.arr = pool.empty((2048,), np.uint8)
del h
b = pool.empty((4096,), np.uint8)
print("freeing a pooled array...", file=sys.stderr)
del b  # _give_back (lock held) -> collection -> finalizer of h.arr -> _give_back -> lock
print("no deadlock", file=sys.stderr)
