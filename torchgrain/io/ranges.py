"""Byte ranges of one file: coalesced remote reads, and a per-process memory map.

Random access reads a few byte ranges per file per batch. Remotely, ranges that touch
or nearly touch are merged and all fetched in one ``cat_ranges`` call (requests in
flight together, latency paid once); locally, a memory map serves slices without a
system call per record.

Example:
    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe("/r/f", b"0123456789")
    >>> [bytes(b) for b in fetch_ranges(fs, "/r/f", [(6, 8), (0, 2)])]
    [b'67', b'01']
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Sequence

import fsspec

from torchgrain.io import process, remote

__all__ = ["MappedFile", "fetch_ranges"]

#: Ranges closer than this are fetched as one request (the bytes between come along).
DEFAULT_GAP = 1 << 16


def fetch_ranges(
    fs: fsspec.AbstractFileSystem,
    path: str,
    ranges: Sequence[tuple[int, int]],
    *,
    gap: int = DEFAULT_GAP,
    name: str | None = None,
) -> list[memoryview]:
    """Bytes ``[start, end)`` of ``path`` for each range, in the order given.

    Raises:
        FileNotFoundError: the file does not exist (its name in the message).
        CorruptDataError: the file is shorter than a range.
        Exception: what a failed request raised (transient ones are retried by the
            operation in progress: :func:`~torchgrain.io.retry.retry_call`).
    """
    label = name or path
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    merged: list[list[int]] = []
    for i in order:
        s, e = ranges[i]
        if merged and s <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    try:
        # Each response is checked to hold exactly the bytes asked for, and the request
        # has a deadline (torchgrain.io.remote).
        blobs = remote.cat_ranges(
            fs, path, [m[0] for m in merged], [m[1] for m in merged], url=label
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{label} does not exist") from e
    out: list[memoryview] = [memoryview(b"")] * len(ranges)
    j = 0
    for i in order:
        s, e = ranges[i]
        while not (merged[j][0] <= s and e <= merged[j][1]):
            j += 1
        out[i] = memoryview(blobs[j])[s - merged[j][0] : e - merged[j][0]]
    return out


class MappedFile:
    """A local file as a read-only memoryview, mapped once per process (remapped after fork).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "m")
        >>> _ = open(p, "wb").write(b"abcdef")
        >>> m = MappedFile(p)
        >>> bytes(m.view()[2:4]), len(m)
        (b'cd', 6)
        >>> m.close()
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._token: tuple[int, int] | None = None
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None

    def view(self) -> memoryview:
        """The whole file (empty files give an empty view)."""
        view = self._view
        if view is not None and self._token == process.token():
            return view
        with self._lock:
            if self._view is None or self._token != process.token():
                # After a fork the parent's map is inherited but not ours to close.
                self._mm = None
                with open(self.path, "rb") as f:
                    size = f.seek(0, 2)
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
                self._token = process.token()
            return self._view

    def __len__(self) -> int:
        return len(self.view())

    def close(self) -> None:
        """Release this process's map (views handed out keep it alive until released)."""
        with self._lock:
            view, mm, token = self._view, self._mm, self._token
            self._view = self._mm = self._token = None
        if token != process.token():
            return  # inherited through fork: the parent's to close
        if view is not None:
            view.release()
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]
