"""A forked child leaves its parent's connections alone.

A forked DataLoader worker inherits the parent's fsspec event loop's ``epoll`` instance
and sockets: freeing the parent's filesystems in the child would unregister the parent's
sockets (its requests then wait out a 20 s read timeout) or write TLS ``close_notify`` into
its streams. So, in a forked child, before any of its code runs, every socket of the
inherited loop is replaced by an unconnected one under the same descriptor, and the loop
gets its own epoll. The hook is installed on import (by :mod:`torchgrain.io.remote`).

Design notes: docs/design-notes.md#io-loops.

Example:
    >>> import asyncio
    >>> loop = asyncio.new_event_loop()
    >>> detach_inherited_loop(loop)  # what a forked child does with the parent's loop
    True
    >>> loop.close()  # closing it now touches nothing of another process's
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import selectors
import socket
import stat
from typing import Any

import fsspec.asyn

__all__ = ["detach_inherited_loop"]

logger = logging.getLogger("torchgrain")


def detach_inherited_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Cut ``loop`` (inherited from the parent process through a fork) off from the
    parent's kernel objects: each of its sockets (connections and wake-up pipe) is
    replaced by an unconnected one under the same descriptor, and its epoll instance by a
    new one that holds the same registrations, of those replacements. Nothing this
    process then does through the loop's objects (closing, writing, unregistering)
    reaches the parent's connections, and the loop no longer reports itself running (its
    thread is the parent's), so fsspec closes what the child frees at once. Returns
    whether ``loop`` was a selector loop to detach (the kind that shares such state);
    this process must not run it afterwards.

    Example:
        >>> import asyncio
        >>> loop = asyncio.new_event_loop()
        >>> detach_inherited_loop(loop)
        True
        >>> loop.close()
    """
    if not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop) or loop.is_closed():
        return False
    fds = _socket_fds(loop)
    if fds:
        with socket.socket() as placeholder:
            for fd in fds:
                # The parent's socket is untouched; close-on-exec, as the one replaced.
                os.dup2(placeholder.fileno(), fd, inheritable=False)
    selector = loop._selector  # asyncio's selector loops keep their selector here
    if isinstance(selector, selectors.EpollSelector):  # poll/select keep no kernel state
        inherited = selector._selector  # the select.epoll object shared with the parent
        fresh = select.epoll()
        for key in selector.get_map().values():  # so that modify() finds them, as before
            mask = (select.EPOLLIN if key.events & selectors.EVENT_READ else 0) | (
                select.EPOLLOUT if key.events & selectors.EVENT_WRITE else 0
            )
            with contextlib.suppress(OSError):
                fresh.register(key.fd, mask)
        selector._selector = fresh
        inherited.close()  # this process's descriptor only: the parent's lives on
    loop._thread_id = None  # not running here: is_running() is False in this process
    return True


def _socket_fds(loop: asyncio.selector_events.BaseSelectorEventLoop) -> list[int]:
    """The descriptors of ``loop``'s open sockets: its transports' (connections, idle
    ones in a pool included) and those registered with its selector (the wake-up pipe)."""
    candidates = set(loop._selector.get_map())
    for sock in (loop._ssock, loop._csock):  # the wake-up pipe: only one end is registered
        if sock is not None and sock.fileno() >= 0:
            candidates.add(sock.fileno())
    for fd, transport in list(loop._transports.items()):
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.fileno() == fd:  # -1 once closed
            candidates.add(fd)
    out = []
    for fd in sorted(candidates):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                out.append(fd)
        except OSError:
            continue  # closed already
    return out


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


os.register_at_fork(
    before=_note_loop_before_fork,
    after_in_parent=_loop_at_fork.clear,
    after_in_child=_detach_after_fork_in_child,
)
