"""Which process is this: the one fork-detection mechanism readers and sources share.

Readers and caches belong to the process that opened them: a forked DataLoader worker
inherits the parent's objects but must not use their file handles, threads or event
loops. Objects remember :func:`token` when they create such state and compare it before
use. ``generation`` is bumped in every child right after ``os.fork()``
(multiprocessing's fork and forkserver included), so hot paths can compare it without
the ``getpid`` syscall (~0.2 us); :func:`token` adds the pid for colder paths.

Example:
    >>> t = token()
    >>> t == token()
    True
"""

from __future__ import annotations

import os

__all__ = ["generation", "token"]

#: Forks this process is removed from its first ancestor (0 in a process not forked).
generation = 0


def _after_fork_in_child() -> None:
    global generation
    generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def token() -> tuple[int, int]:
    """``(pid, fork generation)``: equal only within the same process."""
    return os.getpid(), generation
