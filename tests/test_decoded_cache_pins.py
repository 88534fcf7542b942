"""A decoded-cache entry's pin: its LRU touches never read as a change, a rewrite does."""

from __future__ import annotations

import os
import sys

import pyarrow as pa
import pytest

from torchgrain.io import changes
from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux files")


@pytest.fixture
def no_inotify(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stat of the path at each check, as where inotify is missing."""
    monkeypatch.setattr(changes, "libc", lambda: None)
    monkeypatch.setattr(changes, "_watcher", None)


def _entry(tmp_path) -> tuple[DecodedCache, str, changes.Pin]:
    cache = DecodedCache(str(tmp_path), max_bytes=1 << 20, min_free_bytes=0)
    t = pa.table({"x": [1, 2]})
    _, path, pin = cache.get_or_build_pinned(
        entry_key("p", 0), lambda: t, schema=t.schema, num_rows=2
    )
    assert path is not None and pin is not None
    return cache, path, pin


def test_another_process_touch_keeps_the_pin(tmp_path, no_inotify) -> None:
    _, path, pin = _entry(tmp_path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns + 10**9, st.st_mtime_ns))  # (its LRU time only)
    assert changes.changed(pin) is None


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "no-inotify"])
def test_an_entry_written_in_place_still_reads_as_changed(tmp_path, inotify, request) -> None:
    if not inotify:
        request.getfixturevalue("no_inotify")
    _, path, pin = _entry(tmp_path)
    st = os.stat(path)
    with open(path, "r+b") as f:  # same size, a later modification time
        f.write(b"\0")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert changes.changed(pin) is not None


def test_a_shard_pin_still_compares_the_change_time(tmp_path, no_inotify) -> None:
    p = str(tmp_path / "shard")
    with open(p, "wb") as f:
        f.write(b"abc")
    fd = os.open(p, os.O_RDONLY)
    pin = changes.Pin(fd, p)
    os.close(fd)
    os.chmod(p, 0o600)  # only the change time moves
    st = os.stat(p)
    assert (st.st_ctime_ns != pin.ident[4]) == (changes.changed(pin) is not None)
