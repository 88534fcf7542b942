"""Which process is this: the one fork-detection mechanism readers and sources share.

Readers and caches belong to the process that opened them: a forked DataLoader worker
inherits the parent's objects but must not use their file handles, threads or event
loops. Objects remember :func:`token` when they create such state and compare it before
use. ``generation`` is bumped in every child right after ``os.fork()``
(multiprocessing's fork and forkserver included), so hot paths can compare it without
the ``getpid`` syscall (~0.2 us); :func:`token` adds the pid for colder paths. A
``generation`` stamp only suits state that never crosses a pickle (a spawned process
counts from 0 again): module state, and objects stamped afresh when unpickled.

Threads and ``fork``: a child process gets a copy of every lock in the state it was in
at the fork, held or not, but none of the threads that would release them. So no
torchgrain thread runs across a fork: every object that owns threads (I/O pools,
read-ahead) registers with :func:`stop_threads_at_fork`; right before this process
forks (a DataLoader starting its workers, or anything else calling ``os.fork``) each
one stops and joins its threads, and in the parent it starts again where it was at
the next :func:`restart_stopped_threads` (a sampler drawing indices; pools on their
next task), not inside the fork: Python >= 3.12 counts threads after the fork hooks. The child starts none: its objects see a new :func:`token` and build
their own state on first use. (Python 3.12 warns about exactly this hazard when a
process with threads forks.)

Example:
    >>> t = token()
    >>> t == token()
    True
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Protocol

__all__ = [
    "ForkSafeThreadPool",
    "StopsThreadsAtFork",
    "forked_from",
    "forking",
    "generation",
    "note_thread",
    "stop_threads_at_fork",
    "thread_pool",
    "token",
]

logger = logging.getLogger("torchgrain")

#: Forks this process is removed from its first ancestor (0 in a process not forked).
generation = 0


class StopsThreadsAtFork(Protocol):
    """An object whose threads must not run across a fork (see the module docstring)."""

    def _stop_threads_for_fork(self) -> None:
        """Stop and join every thread (no lock of the object held afterwards)."""

    def _restart_threads_after_fork(self) -> None:
        """In the parent, after the fork: start again what was stopped."""


_owners: weakref.WeakSet[Any] = weakref.WeakSet()
# Guards _owners and _to_restart, only ever for a moment: never held while threads are
# stopped (an I/O task being joined may itself wait for a lock whose holder is
# registering a new owner).
_owners_lock = threading.Lock()
# One fork at a time goes through the hooks: held from before a fork until after it.
_fork_lock = threading.Lock()
_stopped: list[Any] = []
_to_restart: list[Any] = []  # stopped for a fork, not yet started again


def stop_threads_at_fork(owner: StopsThreadsAtFork) -> None:
    """Have ``owner``'s threads stopped before this process forks and restarted after
    (in the parent). Held weakly: a collected owner is forgotten."""
    with _owners_lock:
        _owners.add(owner)


def _before_fork() -> None:
    _fork_lock.acquire()  # released by the after-fork hooks
    _stopped.clear()
    with _owners_lock:
        owners = list(_owners)
    for owner in owners:
        try:
            owner._stop_threads_for_fork()
            _stopped.append(owner)
        except Exception:  # pragma: no cover - a fork must go ahead whatever happens
            logger.debug("torchgrain: could not stop %r before a fork", owner, exc_info=True)
    _wait_exited()


# Native ids of the threads torchgrain started in this process (each records itself
# with note_thread), alive or finished but perhaps not yet gone from the kernel's list.
_thread_ids: set[int] = set()
# Longest a fork waits for finished threads to leave the operating system's thread list.
_EXIT_WAIT_SECONDS = 1.0


def note_thread() -> None:
    """Record the calling thread as one of torchgrain's: called first by every thread
    torchgrain starts (:func:`thread_pool` passes it as the pool's initializer), so
    that a fork waits for it to be really gone once it has finished (see
    :func:`_wait_exited`).

    Example:
        >>> import threading
        >>> t = threading.Thread(target=note_thread); t.start(); t.join()
    """
    _thread_ids.add(threading.get_native_id())


def thread_pool(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose threads record themselves with :func:`note_thread`.

    Example:
        >>> with thread_pool(2, "torchgrain-doc") as pool:
        ...     list(pool.map(abs, [-1, 2]))
        [1, 2]
    """
    return ThreadPoolExecutor(max_workers, thread_name_prefix, initializer=note_thread)


def forking() -> bool:
    """Whether a fork of this process is under way (another thread is between the hooks
    that stop torchgrain's threads before it and the parent's after it): an owner that
    would start a thread now does its work in the calling thread instead, as the thread
    would run across the fork.

    Example:
        >>> forking()
        False
    """
    return _fork_lock.locked()


def _wait_exited() -> None:
    """Before a fork: wait (bounded) until torchgrain's finished threads have left the
    kernel's thread list.

    ``Thread.join`` returns once a thread's Python state is gone, which on Python < 3.13
    is before the operating system thread has finished exiting (inside the C library,
    possibly holding its locks). A fork must not copy a thread in that state, and Python
    >= 3.12 counts it (in /proc) when it decides whether to warn about threads at a fork.
    """
    if not _thread_ids or not os.path.isdir("/proc/self/task"):
        return
    import time

    alive = {t.native_id for t in threading.enumerate()}
    deadline = time.monotonic() + _EXIT_WAIT_SECONDS
    while True:
        gone = {t for t in list(_thread_ids) if not os.path.exists(f"/proc/self/task/{t}")}
        _thread_ids.difference_update(gone)
        exiting = [t for t in list(_thread_ids) if t not in alive]
        if not exiting or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _after_fork_in_parent() -> None:
    # Not restarted here: Python >= 3.12 counts the process's threads after these hooks
    # have run, and would warn about threads started in them. The next call of
    # restart_stopped_threads (a sampler drawing its next indices) starts them again.
    try:
        with _owners_lock:
            _to_restart.extend(_stopped)
    finally:
        _stopped.clear()
        _fork_lock.release()


def restart_stopped_threads() -> None:
    """Start again the threads stopped for the last fork of this process (see the module
    docstring); cheap when there are none. Called where torchgrain runs on after a fork
    in the parent: a sampler drawing its next indices.

    Example:
        >>> restart_stopped_threads()  # nothing was stopped: nothing to do
    """
    if not _to_restart:
        return
    with _owners_lock:
        owners = list(_to_restart)
        _to_restart.clear()
    for owner in owners:
        try:
            owner._restart_threads_after_fork()
        except Exception:  # pragma: no cover - read-ahead and pools restart lazily
            logger.debug("torchgrain: could not restart %r after a fork", owner, exc_info=True)


def _after_fork_in_child() -> None:
    global generation, _owners_lock, _fork_lock
    generation += 1
    _stopped.clear()  # the child's objects build their own threads when used
    _to_restart.clear()
    _thread_ids.clear()  # the parent's threads are not this process's
    _owners_lock = threading.Lock()  # another thread may have held it at the fork
    _fork_lock = threading.Lock()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)


class ForkSafeThreadPool(Executor):
    """A :class:`~concurrent.futures.ThreadPoolExecutor` whose threads never run across
    a fork: they are started on first use, shut down (after finishing the tasks
    already submitted) before this process forks, and started again on the next use.
    The pool belongs to the process that made it: a forked child that inherits it
    gets fresh threads of its own.

    Example:
        >>> pool = ForkSafeThreadPool(2, "doc")
        >>> list(pool.map(abs, [-1, -2, 3]))
        [1, 2, 3]
        >>> pool.shutdown()
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "torchgrain") -> None:
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._token = token()
        self._closed = False
        stop_threads_at_fork(self)

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        # Under the lock: a fork's stop hook (which takes it) then waits for this task
        # rather than shutting the pool down between our lookup and our submit.
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if not forking():
                if self._token != token():  # inherited from the parent: no threads here
                    self._token, self._pool = token(), None
                if self._pool is None:
                    self._pool = thread_pool(self._max_workers, self._prefix)
                return self._pool.submit(fn, *args, **kwargs)
        # Another thread is forking: a thread started now would run across the fork.
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to the caller, as a pool thread does
            done.set_exception(e)
        return done

    def stop_threads(self) -> None:
        """Let this pool's threads end once their tasks are done, without waiting; a
        later task starts new ones (unlike :meth:`shutdown`, after which it is refused).

        Example:
            >>> pool = ForkSafeThreadPool(1, "doc")
            >>> pool.stop_threads()
            >>> pool.submit(abs, -2).result()
            2
        """
        self._stop_threads_for_fork(wait=False)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._stop_threads_for_fork(wait, cancel_futures)

    def _stop_threads_for_fork(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._token == token():
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)

    def _restart_threads_after_fork(self) -> None:
        pass  # threads start again with the next task


def token() -> tuple[int, int]:
    """``(pid, fork generation)``: equal only within the same process."""
    return os.getpid(), generation


def forked_from(stamp: tuple[int, int]) -> bool:
    """Whether this process was forked from the one whose :func:`token` is ``stamp``
    (a DataLoader worker looking at state its parent left in its copy of memory).

    Example:
        >>> forked_from(token())
        False
    """
    return stamp == (os.getppid(), generation - 1)
