"""Reproducers for holes in the newest fixes (each a strict xfail until fixed)."""

from __future__ import annotations

import os
import sys
import time

import pyarrow as pa
import pytest

from torchgrain.io import changes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux files")


@pytest.fixture
def no_inotify(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stat of the path at each check, as where inotify is missing."""
    monkeypatch.setattr(changes, "libc", lambda: None)
    monkeypatch.setattr(changes, "_watcher", None)


@pytest.mark.xfail(
    strict=True,
    reason="a Pin's identity now holds the change time, and DecodedCache.touch's utime "
    "(its LRU access time) moves it: without inotify a touched entry reads as changed",
)
def test_decoded_cache_touch_keeps_its_pin(tmp_path, no_inotify) -> None:
    from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

    cache = DecodedCache(str(tmp_path), max_bytes=1 << 20, min_free_bytes=0)
    t = pa.table({"x": [1, 2]})
    _, path, pin = cache.get_or_build_pinned(
        entry_key("p", 0), lambda: t, schema=t.schema, num_rows=2
    )
    assert changes.changed(pin) is None
    time.sleep(0.01)
    cache.touch(path)  # what a hit does once a minute (ParquetSource, DecodedCache._open)
    assert changes.changed(pin) is None


@pytest.mark.xfail(
    strict=True,
    reason="DecodedCache._open touches an entry whose access time is old after pinning "
    "it: without inotify the pin a hit returns already reads as changed",
)
def test_decoded_cache_hit_on_old_entry_returns_a_sound_pin(tmp_path, no_inotify) -> None:
    from torchgrain.sources.parquet.decoded_cache import DecodedCache, entry_key

    cache = DecodedCache(str(tmp_path), max_bytes=1 << 20, min_free_bytes=0)
    t = pa.table({"x": [1, 2]})
    key = entry_key("p", 0)
    _, path, _ = cache.get_or_build_pinned(key, lambda: t, schema=t.schema, num_rows=2)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns - 3600 * 10**9, st.st_mtime_ns))  # used an hour ago
    time.sleep(0.01)
    got, path2, pin = cache.get_or_build_pinned(key, lambda: t, schema=t.schema, num_rows=2)
    assert path2 == path and got.equals(t)
    assert changes.changed(pin) is None
