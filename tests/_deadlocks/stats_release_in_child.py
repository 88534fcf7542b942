"""A forked child never runs the parent's stats-slot finalizer as if it were the parent.

A loader's batch sampler left in a reference cycle is freed by a collection in the new
child, before torchgrain's after-fork hook has run, while another parent thread was
inside the same finalizer (holding the slot lock) at the fork. The finalizer must see
that it runs in a copy (and not wait on the copied lock).
Exit 0: the child came out of os.fork(); 3: it was stuck.
"""

import faulthandler
import gc
import os
import signal
import sys
import threading
import time

os.register_at_fork(after_in_child=gc.collect)  # before torchgrain's hooks
faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402
from _child import exited_within  # noqa: E402  (this script's folder)

import torchgrain as tg  # noqa: E402
from torchgrain import diagnostics  # noqa: E402

gc.disable()
ds = tg.Dataset(list(range(40)))


def read_one(loader):
    next(iter(loader))  # the loader's batch sampler gets a stats slot (+ finalizer)


l1 = torch.utils.data.DataLoader(ds, batch_size=4)
read_one(l1)
l1.batch_sampler.me = l1.batch_sampler  # a cycle: only the collector frees it
del l1

l2 = torch.utils.data.DataLoader(ds, batch_size=4)
read_one(l2)
holding = threading.Event()
orig_tags = diagnostics.PipelineStats._tag_array


def slow_tags(self):
    if threading.current_thread().name == "T":
        holding.set()
        time.sleep(5)  # widen: T sits in _release holding _slot_lock
    return orig_tags(self)


diagnostics.PipelineStats._tag_array = slow_tags
box = [l2.batch_sampler]
del l2


def drop():
    box.clear()  # last reference: _release runs here, in T


threading.Thread(target=drop, name="T").start()
holding.wait()
pid = os.fork()
if pid == 0:
    os._exit(0)  # reached only if the hooks returned
if exited_within(pid):
    print("child exited: no deadlock", file=sys.stderr)
    sys.exit(0)
sys.exit(3)
