"""ShardRegion's module lock is made anew in every forked child.

A process that is itself forked (a rank started by a forking launcher, a worker that
forks) forks while another of its threads is inside ShardRegion._own() (holding the
module's fork lock; a slow Lock() widens that window). The grandchild's first read of
the inherited region must not block on the copy of that held lock.
Exit 0: the grandchild read; 3: it was stuck.
"""

import faulthandler
import os
import signal
import sys
import threading
import time

import numpy as np
from _child import exited_within  # this script's folder is on sys.path

from torchgrain.io import region

faulthandler.register(signal.SIGUSR1, all_threads=True)
d = sys.argv[1]  # a directory the test made
paths = []
for k in range(2):
    p = os.path.join(d, str(k))
    with open(p, "wb") as f:
        f.write(bytes([65 + k]) * 100)
    paths.append(p)
r = region.ShardRegion(paths, np.full(2, 100))
r.release() if r.acquire(np.array([0])) is not None else None  # mapped in generation 0


class SlowThreading:  # region.threading with a slow Lock(): inside `with _fork_lock`
    def __getattr__(self, name):
        return getattr(threading, name)

    @staticmethod
    def Lock():
        inside.set()
        time.sleep(3)
        return threading.Lock()


inside = threading.Event()
if os.fork() == 0:  # generation 1 (e.g. a rank forked by its launcher)
    region.threading = SlowThreading()
    threading.Thread(target=lambda: r.acquire(np.array([1])), daemon=True).start()
    inside.wait()  # another thread is in _own(), holding _fork_lock
    pid = os.fork()  # generation 2 (e.g. its DataLoader worker)
    if pid == 0:
        region.threading = threading
        r.acquire(np.array([0]))  # _own() -> _fork_lock (held in the copy): hangs
        os._exit(0)
    if exited_within(pid):
        print("grandchild read fine: no deadlock", file=sys.stderr)
        os._exit(0)
    os._exit(3)
_, status = os.wait()
sys.exit(os.waitstatus_to_exitcode(status))
