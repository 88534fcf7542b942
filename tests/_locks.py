"""Set-up for the lock tests: a lock held as another process holds it, and a dataset that
builds its index (under a lock) when opened."""

from __future__ import annotations

import fcntl
import os

import torchgrain as tg


def hold_flock(path) -> int:
    """Hold an exclusive flock on ``path`` through a descriptor of its own (another
    process, as far as flock tells); returns the descriptor (close it to let go)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def array_record_without_index(tmp_path) -> str:
    """Two ArrayRecord shards of 10 records in ``tmp_path/ds``, with no manifest and no
    index beside them: opening them builds an index."""
    data = str(tmp_path / "ds")
    tg.write_array_record([{"x": i} for i in range(10)], data, num_shards=2)
    for n in os.listdir(data):
        if not n.endswith(".array_record"):
            os.unlink(os.path.join(data, n))
    return data
