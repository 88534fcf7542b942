"""The before-fork hook must not hold the owners' lock while it stops threads.

The forking thread stops a ForkSafeThreadPool (waiting for the remote read in flight);
that read waits for the source's per-process lock; a third thread holds that lock while
it registers a new read-ahead (an owner). If the hook held the registry lock while
joining, os.fork() would never return. Events and one timer fix the interleaving.
Exit 0: the fork returned.
"""

import faulthandler
import os
import sys
import threading

import fsspec

import torchgrain as tg
from torchgrain.io import process

faulthandler.dump_traceback_later(15, exit=True)

d = sys.argv[1]  # a directory the test made
tg.write_array_record([{"x": i} for i in range(40)], d, num_shards=4)
store = fsspec.filesystem("memory")
for f in os.listdir(d):
    with open(os.path.join(d, f), "rb") as fh:
        store.pipe(f"/deadlock-inv/{f}", fh.read())
src = tg.ArrayRecordSource("memory://deadlock-inv", max_inflight=4)
pool = src._pool()  # a ForkSafeThreadPool: an owner stopped by every fork

in_hook = threading.Event()  # the forking thread is inside _before_fork, holding _owners_lock
go_read = threading.Event()
orig_stop = process.ForkSafeThreadPool._stop_threads_for_fork


def stop(self):
    in_hook.set()
    orig_stop(self)


process.ForkSafeThreadPool._stop_threads_for_fork = stop


def remote_read():  # an io task in flight when the fork starts
    go_read.wait()
    return src._io(lambda: b"", 0, "a remote read")  # takes st.lock


fut = pool.submit(remote_read)


def first_pass():  # e.g. a sampler's pass starting in another thread
    in_hook.wait()
    # holds st.lock while it registers a new RangeReadAhead (-> _owners_lock)
    src._range_read_ahead(lambda a, b: list(range(a, b)), 0, len(src), lambda: 0)


t = threading.Thread(target=first_pass, daemon=True)
t.start()
threading.Timer(1.0, go_read.set).start()  # the task reaches st.lock after T holds it
print("forking...", file=sys.stderr)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("fork returned: no deadlock", file=sys.stderr)
