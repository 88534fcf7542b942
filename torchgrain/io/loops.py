"""A forked child leaves its parent's connections alone.

Async fsspec filesystems (HTTP(S), s3fs, gcsfs) share one event loop per process,
running in a thread of fsspec's. On Linux that loop waits on an ``epoll`` instance, and a
forked DataLoader worker inherits it: not a copy, the very same kernel object, whose
interest list says which sockets wake the parent's loop. The worker cannot run the
inherited loop (its thread did not survive the fork) and builds its own filesystems, but
the parent's are still in its memory; when a garbage collection in the worker frees one,
fsspec closes its pooled connections, asyncio unregisters each socket from the inherited
epoll, and so from the parent's. The parent's next request on such a connection is sent
and its answer arrives, but the loop never hears of it: the request waits out its read
timeout (20 s with torchgrain's defaults) and is retried, once per pooled connection, and
a filesystem the user built without a read timeout hangs.

So in a forked child the inherited loop gets an epoll instance of its own, empty, before
any code of the child's can run; what the child does with the parent's objects no longer
reaches the parent. The hook is installed when this module is imported (by
:mod:`torchgrain.io.remote`).

Example:
    >>> import asyncio
    >>> loop = asyncio.new_event_loop()
    >>> detach_inherited_loop(loop)  # what a forked child does with the parent's loop
    True
    >>> loop.run_until_complete(asyncio.sleep(0))  # still a working loop, of its own
    >>> loop.close()
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import selectors
from typing import Any

import fsspec.asyn

__all__ = ["detach_inherited_loop"]

logger = logging.getLogger("torchgrain")


def detach_inherited_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Give ``loop`` (inherited from the parent process through a fork) a new, empty
    epoll instance, so that registering or unregistering sockets in this process no
    longer changes the parent's. Returns whether there was an epoll instance to replace
    (selector loops on Linux); other loops share no kernel state with the parent's.

    Example:
        >>> import asyncio
        >>> loop = asyncio.new_event_loop()
        >>> detach_inherited_loop(loop)
        True
        >>> loop.close()
    """
    if not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
        return False
    selector = loop._selector  # asyncio's selector loops keep their selector here
    if not isinstance(selector, selectors.EpollSelector):
        return False  # select() and poll() keep no state in the kernel
    inherited = selector._selector  # the select.epoll object shared with the parent
    selector._selector = select.epoll()
    inherited.close()  # this process's descriptor only: the parent's instance lives on
    return True


_loop_at_fork: list[Any] = []


def _note_loop_before_fork() -> None:
    loop = fsspec.asyn.loop[0]  # fsspec's loop, if this process has started it
    _loop_at_fork[:] = [] if loop is None else [loop]


def _detach_after_fork_in_child() -> None:
    loops = list(_loop_at_fork)
    _loop_at_fork.clear()
    for loop in loops:
        try:
            detach_inherited_loop(loop)
        except Exception:  # pragma: no cover - a fork must go ahead whatever happens
            logger.warning("torchgrain: could not detach an inherited event loop", exc_info=True)


def _forget_after_fork_in_parent() -> None:
    _loop_at_fork.clear()


os.register_at_fork(
    before=_note_loop_before_fork,
    after_in_parent=_forget_after_fork_in_parent,
    after_in_child=_detach_after_fork_in_child,
)
