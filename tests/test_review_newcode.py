"""Reproducers for the newest code: a process's Parquet reader against files changed
after the dataset opened, Parquet output's column types across batches and shards, and
the retry policy's seconds (--deadline, --request-timeout)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.io.ranges import RangeStore, fetch_batch
from torchgrain.io.retry import RetryPolicy, using


def test_a_long_deadline_waits_for_another_fetch_of_the_same_ranges() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/rn/a", b"0123456789")
    store = RangeStore()
    url = "memory://rn/a"
    mine, others = store.claim(url, [(0, 4)])  # a read-ahead bringing them
    assert mine == [(0, 4)] and not others
    timer = threading.Timer(0.3, store.release, (url, mine))
    timer.start()
    try:
        # 1e10 s: finite and more than 0, as the command line's --deadline asks.
        with using(RetryPolicy(deadline=1e10, request_timeout=1e10)):
            made = fetch_batch(fs, [("/rn/a", url, [(0, 4)])], store=store, owner=None)
    finally:
        timer.cancel()
        store.release(url, mine)
    assert made == 1
    assert bytes(store.take(url, [(0, 4)])[0]) == b"0123"


def _same_size_shard(path: str, base: int) -> None:
    """Eight int64s in two row groups, plain and uncompressed, no statistics: files of
    other values are of one size and one footer."""
    table = pa.table({"x": pa.array([base + i for i in range(8)], pa.int64())})
    pq.write_table(
        table,
        path,
        row_group_size=4,
        compression="none",
        write_statistics=False,
        use_dictionary=False,
    )


def test_a_shard_rewritten_in_place_with_its_size_and_mtime_kept_is_refused(tmp_path) -> None:
    path = str(tmp_path / "ds" / "a.parquet")
    os.makedirs(os.path.dirname(path))
    _same_size_shard(path, 0)
    src = tg.ParquetSource(str(tmp_path / "ds"), decoded_cache=str(tmp_path / "dc"), cache_bytes=0)
    assert src[0] == {"x": 0}  # its reader is open; row group 1 not decoded yet
    before = os.stat(path)
    other = str(tmp_path / "other.parquet")
    _same_size_shard(other, 100)
    with open(other, "rb") as f:
        data = f.read()
    assert len(data) == before.st_size
    with open(path, "r+b") as f:  # what cp -p onto the file does: in place, mtime kept
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    with pytest.raises(tg.CorruptDataError, match="changed since the dataset was opened"):
        src[5]


def test_an_int_past_2_53_before_a_float_in_one_shard_is_an_error_naming_its_key(
    tmp_path,
) -> None:
    records = [{"k": 2**53 + 1}] * 512 + [{"k": 1.5}]
    tg.write_array_record(records, str(tmp_path / "in"))
    with pytest.raises((TypeError, ValueError)) as got:
        tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=1)
    assert "'k'" in str(got.value)


def test_int8_and_int16_arrays_in_two_batches_of_one_shard_are_refused(tmp_path) -> None:
    records = [{"a": np.arange(3, dtype=np.int8)}] * 512 + [{"a": np.arange(3, dtype=np.int16)}]
    tg.write_array_record(records, str(tmp_path / "in"))
    with pytest.raises((TypeError, tg.SchemaMismatchError), match="'a'"):
        tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=1)


def test_dicts_of_the_same_keys_in_another_order_in_two_shards_convert(tmp_path) -> None:
    records = [{"m": {"a": 1, "b": 2}}, {"m": {"b": 3, "a": 4}}]
    tg.write_array_record(records, str(tmp_path / "in"))
    tg.convert(str(tmp_path / "in"), str(tmp_path / "out"), to="parquet", num_shards=2)
    src = tg.ParquetSource(str(tmp_path / "out"))
    assert [src[i] for i in range(2)] == [{"m": {"a": 1, "b": 2}}, {"m": {"a": 4, "b": 3}}]


def test_a_policy_of_more_than_1024_retries_retries_them_all() -> None:
    from torchgrain.io.retry import retry_call

    policy = RetryPolicy(attempts=1100, base_delay=0.0, max_delay=0.0, deadline=60)
    calls = []

    def reset() -> None:
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    with pytest.raises(tg.RemoteIOError):
        retry_call(reset, url="http://127.0.0.1:9/a.parquet", policy=policy, what="read")
    assert len(calls) == 1100
