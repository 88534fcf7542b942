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


def _array_record_without_index(data: str, n: int) -> str:
    import torchgrain as tg

    tg.write_array_record([{"x": i} for i in range(n)], data, num_shards=2)
    for name in os.listdir(data):  # no manifest, no index beside the shards: one is built
        if not name.endswith(".array_record"):
            os.unlink(os.path.join(data, name))
    return data


def test_a_killed_give_up_builder_leaves_no_lock_file(tmp_path) -> None:
    import warnings

    import torchgrain as tg
    from torchgrain.sources.node_index import store as node_index

    idx = str(tmp_path / "idx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg.ArrayRecordSource(
            _array_record_without_index(str(tmp_path / "a"), 10), codec="msgpack", index_dir=idx
        )
        # What a builder that gave up on the shared lock leaves when killed mid-build:
        # its own lock file and its reserved temp file (cached_index's names).
        store = node_index.index_store(idx)
        own = "0a1b2c3d-arrayrecord-0123456789abcdef0123456789abcdef.tgindex"
        with store._lock(own):
            tmp = store._reserve(own, 0, evict=False)
        tg.ArrayRecordSource(
            _array_record_without_index(str(tmp_path / "b"), 12), codec="msgpack", index_dir=idx
        )
    assert not os.path.exists(tmp)  # (swept: its writer is gone)
    assert not os.path.exists(store._lock_path(own))


@pytest.mark.parametrize(
    "pattern", ["train-*.parquet", "*.parquet", "[ab].parquet", "s*/*.parquet"]
)
def test_a_glob_names_no_linked_folder_it_does_not_pass(tmp_path, pattern) -> None:
    import warnings

    import pyarrow.parquet as pq

    from torchgrain.io import fs as tgfs

    ds = tmp_path / "ds"
    (ds / "sub").mkdir(parents=True)
    (tmp_path / "archive").mkdir()
    for path in (ds / "a.parquet", ds / "train-0.parquet", ds / "sub" / "b.parquet"):
        pq.write_table(pa.table({"x": [1]}), path)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "archive" / "c.parquet")
    os.symlink(tmp_path / "archive", ds / "archive")  # matches no segment of the pattern
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _, files = tgfs.expand_paths(f"{ds}/{pattern}", suffixes=[".parquet"])
    assert files  # (the pattern's files are found)
    assert [str(w.message) for w in got if "linked folder" in str(w.message)] == []


def _parquet_bytes(n: int) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(n))}), buf)
    return buf.getvalue()


@pytest.mark.parametrize("second", ["s3://{b}/data/c.parquet", "s3://{b}/data/c*.parquet"])
@pytest.mark.parametrize("change", ["added", "rewritten"])
def test_an_s3_shard_changed_since_a_listing_is_seen_by_a_narrower_opening(
    moto_s3, second, change
) -> None:
    import contextlib

    import torchgrain as tg

    client, endpoint = moto_s3
    bucket = f"rf52-{change}-{'glob' if '*' in second else 'name'}"
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    so = {"endpoint_url": endpoint}
    client.put_object(Bucket=bucket, Key="data/a.parquet", Body=_parquet_bytes(2))
    if change == "rewritten":
        client.put_object(Bucket=bucket, Key="data/c.parquet", Body=_parquet_bytes(3))
    assert len(tg.ParquetSource(f"s3://{bucket}/data/", storage_options=so)) in (2, 5)
    client.put_object(Bucket=bucket, Key="data/c.parquet", Body=_parquet_bytes(50))
    src = tg.ParquetSource(second.format(b=bucket), storage_options=so)
    assert len(src) == 50 and src[49]["x"] == 49
