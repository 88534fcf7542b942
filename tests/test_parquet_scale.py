"""Parquet bigger than the cache: records built from the Arrow-compact cache, the
node-shared decoded disk cache (built once per node, atomic, checked, bounded), and the
warning when a sampler's pass cannot fit the caches."""

from __future__ import annotations

import ast
import datetime
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parquet_source import all_types_table, write

import torchgrain as tg
from torchgrain.sources.block_cache import CacheBlocks, check_fit
from torchgrain.sources.parquet import decoded_cache
from torchgrain.sources.parquet import loading as parquet_loading
from torchgrain.sources.parquet.decoded_cache import (
    DecodedCache,
    default_min_free_bytes,
    entry_key,
)
from torchgrain.sources.parquet.values import convert_column

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------- helpers
def old_conversion(path, columns=None):
    """Each row's values as the previous code made them: every row group converted
    whole with convert_column, rows taken from the converted columns."""
    pf = pq.ParquetFile(path)
    out = []
    for g in range(pf.num_row_groups):
        table = pf.read_row_group(g, columns=columns)
        cols = [convert_column(c) for c in table.columns]
        for r in range(table.num_rows):
            out.append({name: col.take([r])[0] for name, col in zip(table.column_names, cols)})
    return out


def assert_same_values(got, expected, where):
    """Same Python types, equal values; arrays fresh, writable, of one dtype and shape."""
    assert type(got) is type(expected), (where, got, expected)
    if isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert (got == expected).all() or (np.isnan(got) == np.isnan(expected)).all(), where
        assert got.flags.writeable and got.flags.owndata, where
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for a, b in zip(got, expected):
            assert_same_values(a, b, where)
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for k in expected:
            assert_same_values(got[k], expected[k], (where, k))
    elif isinstance(expected, float) and expected != expected:
        assert got != got, where
    else:
        assert got == expected, (where, got, expected)
        if isinstance(expected, float):
            assert np.signbit(got) == np.signbit(expected), where


def ids_table(start, n):
    ids = np.arange(start, start + n, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "x": ids.astype(np.float64) / 2,
            "s": pa.array([f"s{i}" for i in ids]),
            "v": pa.array([[float(i)] * (i % 3) for i in ids], pa.list_(pa.float32())),
        }
    )


def make_ids(tmp_path, files=3, rows=40, rg=8, name="ids"):
    d = tmp_path / name
    for f in range(files):
        write(str(d / f"part-{f}.parquet"), ids_table(f * rows, rows), row_group_size=rg)
    return str(d)


def check_ids(recs, idx):
    assert [r["id"] for r in recs] == list(idx)
    for r in recs:
        i = r["id"]
        assert r["x"] == i / 2 and r["s"] == f"s{i}"
        assert r["v"].tolist() == [float(i)] * (i % 3) and r["v"].dtype == np.float32


def entries(cache_dir):
    return sorted(
        os.path.join(d, f)
        for d, _, files in os.walk(cache_dir)
        for f in files
        if f.endswith(".arrow")
    )


# ----------------------------------------------- records from the compact cache
def on_path(src, path):
    """Make ``src`` build records from the compact data (``"built"``) or copy them from
    row groups converted whole (``"converted"``, what it does when they fit the cache)."""
    src._convert_rows = path == "converted"
    return src


@pytest.mark.parametrize("path", ["built", "converted", "mapped"])
def test_records_from_the_compact_cache_equal_the_old_conversion_for_every_type(tmp_path, path):
    file = write(str(tmp_path / "t.parquet"), all_types_table(), row_group_size=4)
    expected = old_conversion(file)
    cache = str(tmp_path / "decoded") if path == "mapped" else False
    src = on_path(tg.ParquetSource(file, decoded_cache=cache), path)
    orders = [list(range(6)), [5, 0, 3, 1, 4, 2], [2], [4, 4, 1]]
    for order in orders:  # one batch each: a row's value never depends on the others
        got = src.__getitems__(order)
        for i, rec in zip(order, got):
            assert list(rec) == list(expected[i])
            for key in rec:
                assert_same_values(rec[key], expected[i][key], (order, i, key))
    # Arrays are the caller's: writing to them reaches no later read.
    a = src[0]["vec"]
    a[:] = -1
    assert src[0]["vec"].tolist() == [1.0, 2.0]
    if path == "mapped":
        assert src.decoded_cache is not None and src.io_stats["decoded_builds"] == 2
        assert not src._convert_rows  # data bigger than the cache is never converted


def test_torchgrain_never_compiles_or_executes_code_at_run_time():
    # "Never execute code found in data": no code is generated either, so that nothing
    # from a dataset (a column name, a value) could ever reach the compiler.
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "torchgrain")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("exec", "eval", "compile")
                ):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.func.id}")
    assert found == []


_SCALARS = {
    "i8": (pa.int8(), st.integers(-128, 127)),
    "u32": (pa.uint32(), st.integers(0, 2**32 - 1)),
    "i64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "f32": (pa.float32(), st.floats(width=32, allow_nan=False)),
    "f64": (pa.float64(), st.floats()),
    "f16": (pa.float16(), st.sampled_from([0.5, -2.0, 65504.0])),
    "b": (pa.bool_(), st.booleans()),
    "s": (pa.string(), st.text(max_size=5)),
    "ls": (pa.large_string(), st.text(max_size=3)),
    "bin": (pa.binary(), st.binary(max_size=5)),
    "fsb": (pa.binary(2), st.binary(min_size=2, max_size=2)),
    "ts": (pa.timestamp("us"), st.datetimes(datetime.datetime(1990, 1, 1))),
    "d": (pa.date32(), st.dates(datetime.date(1990, 1, 1))),
}
_SMALL_INT = st.integers(-50, 50)


def _column_strategy(kind):
    """(arrow type, values strategy for one row) of a column kind."""
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "list":
        return pa.list_(pa.int32()), st.lists(_SMALL_INT | st.none(), max_size=3)
    if kind == "flist":
        return pa.list_(pa.float64(), 2), st.lists(
            st.floats(allow_nan=False), min_size=2, max_size=2
        )
    if kind == "lstr":
        return pa.list_(pa.string()), st.lists(st.text(max_size=2) | st.none(), max_size=2)
    if kind == "nested":
        return pa.list_(pa.list_(pa.int16())), st.lists(
            st.lists(st.integers(-5, 5) | st.none(), max_size=2) | st.none(), max_size=2
        )
    if kind == "struct":
        t = pa.struct([("a", pa.int64()), ("b", pa.string())])
        return t, st.fixed_dictionaries({"a": _SMALL_INT | st.none(), "b": st.text(max_size=2)})
    raise AssertionError(kind)


_KINDS = [*_SCALARS, "list", "flist", "lstr", "nested", "struct"]


@settings(max_examples=40)
@given(data=st.data())
def test_records_equal_the_old_conversion_for_random_schemas(tmp_path_factory, data):
    kinds = data.draw(st.lists(st.sampled_from(_KINDS), min_size=1, max_size=4, unique=True))
    n = data.draw(st.integers(1, 12))
    columns = {}
    for kind in kinds:
        typ, values = _column_strategy(kind)
        nullable = data.draw(st.booleans())
        cells = data.draw(
            st.lists(values | st.none() if nullable else values, min_size=n, max_size=n)
        )
        columns[kind] = pa.array(cells, typ)
    path = write(
        str(tmp_path_factory.mktemp("schema") / "t.parquet"),
        pa.table(columns),
        row_group_size=data.draw(st.integers(1, 5)),
    )
    expected = old_conversion(path)
    src = on_path(
        tg.ParquetSource(path, decoded_cache=False),
        data.draw(st.sampled_from(["built", "converted"])),
    )
    order = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12))
    for i, rec in zip(order, src.__getitems__(order)):
        assert list(rec) == kinds
        for key in kinds:
            assert_same_values(rec[key], expected[i][key], (i, key))


def test_a_list_row_with_null_items_is_a_list_and_the_others_arrays(tmp_path):
    # The form of a row's value depends on that row alone, not on the rows read with it
    # (the whole row group used to turn into Python lists).
    t = pa.table({"v": pa.array([[1, None], [2], None, [3, 4]], pa.list_(pa.int64()))})
    src = on_path(tg.ParquetSource(write(str(tmp_path / "n.parquet"), t)), "built")
    got = [r["v"] for r in src.__getitems__([0, 1, 2, 3])]
    assert got[0] == [1, None] and got[2] is None
    assert isinstance(got[1], np.ndarray) and got[1].tolist() == [2]
    assert isinstance(src[1]["v"], np.ndarray) and src[3]["v"].tolist() == [3, 4]


def test_records_too_big_to_convert_are_built_from_a_compact_cache(tmp_path):
    # Records converted whole would take ~180 KB: more than the cache, which then holds
    # the Arrow data only, and builds the records' Python objects per batch.
    d = make_ids(tmp_path, files=2, rows=200, rg=50)
    src = tg.ParquetSource(d, decoded_cache=False, cache_bytes=100_000)
    assert not src._convert_rows
    src.__getitems__(range(len(src)))
    compact = src.cache_info().current_bytes
    arrow = sum(pq.read_table(os.path.join(d, f)).nbytes for f in os.listdir(d))
    assert compact < arrow + 8 * 8192  # the tables and their views' bookkeeping
    order = np.random.default_rng(0).permutation(len(src))
    check_ids(src.__getitems__(order), order.tolist())
    info = src.cache_info()
    assert info.current_bytes == compact and info.evictions == 0
    # With room for them, row groups are converted whole once, and records copied.
    roomy = tg.ParquetSource(d, decoded_cache=False)
    assert roomy._convert_rows
    check_ids(roomy.__getitems__(order), order.tolist())
    assert roomy.cache_info().current_bytes > 2 * compact


def test_conversion_stops_at_the_first_eviction(tmp_path):
    # An estimate too low must not make converted row groups thrash the cache: a
    # process converts no more once its cache has evicted (and reads stay right).
    d = make_ids(tmp_path, files=2, rows=200, rg=50)
    src = on_path(tg.ParquetSource(d, decoded_cache=False, cache_bytes=150_000), "converted")
    order = np.random.default_rng(0).permutation(len(src))
    for k in range(0, 400, 32):
        check_ids(src.__getitems__(order[k : k + 32]), order[k : k + 32].tolist())
    info = src.cache_info()
    assert info.evictions >= 1 and info.current_bytes <= 150_000
    assert info.misses <= 8 + 8  # each row group loaded again once, when it stopped


# ------------------------------------------------------------ the decoded cache
def _read_all(args):
    """Read every record (a shuffled order) in a fresh process; report the counters."""
    d, cache, seed = args
    if not isinstance(cache, DecodedCache):
        cache = DecodedCache(cache, min_free_bytes=0)
    src = tg.ParquetSource(d, decoded_cache=cache)
    order = np.random.default_rng(seed).permutation(len(src))
    for k in range(0, len(order), 16):
        check_ids(src.__getitems__(order[k : k + 16]), order[k : k + 16].tolist())
    return dict(src.decoded_cache.stats)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_decoded_cache_is_built_once_per_node_by_concurrent_processes(tmp_path, method):
    d = make_ids(tmp_path)
    num_groups = tg.ParquetSource(d).num_row_groups
    cache_dir = str(tmp_path / "decoded")
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(3) as pool:
        stats = pool.map(_read_all, [(d, cache_dir, seed) for seed in range(3)])
    assert sum(s["builds"] for s in stats) == num_groups, stats
    assert all(s["corrupt"] == 0 for s in stats)
    assert len(entries(cache_dir)) == num_groups
    again = _read_all((d, cache_dir, 7))  # a later run: everything mapped, nothing decoded
    assert again["builds"] == 0 and again["hits"] == num_groups


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_share_the_decoded_cache(tmp_path, method):
    d = make_ids(tmp_path, files=2, rows=48, rg=6)
    cache_dir = str(tmp_path / "decoded")
    src = tg.ParquetSource(d, decoded_cache=cache_dir)
    src[0]  # read in the parent first: workers map what it built
    ds = tg.Dataset(src).map(_TagBuilds(src))
    sampler = tg.GlobalShuffleSampler(ds, num_replicas=1, rank=0, seed=1)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=8,
        sampler=sampler,
        num_workers=2,
        collate_fn=_as_list,
        multiprocessing_context=method,
    )
    recs = [r for batch in loader for r in batch]
    check_ids(recs, list(sampler))
    builds = {}
    for r in recs:
        builds[r["worker"]] = max(builds.get(r["worker"], 0), r["builds"])
    # Each row group decoded once for the machine: the parent's first, the rest shared.
    assert sum(builds.values()) + src.decoded_cache.stats["builds"] == src.num_row_groups
    assert len(entries(cache_dir)) == src.num_row_groups


class _TagBuilds:
    """Tags each record with the reading worker and its decoded-cache builds so far (the
    source is the Dataset's own: pickled with it into a spawned worker, forked with it)."""

    def __init__(self, src):
        self.src = src

    def __call__(self, rec):
        rec["worker"] = torch.utils.data.get_worker_info().id
        rec["builds"] = self.src.decoded_cache.stats["builds"]
        return rec


def _as_list(batch):
    return batch


_KILLED_WRITER = """
import os, sys, time
import torchgrain as tg
from torchgrain.sources.parquet import decoded_cache

def stall(self, tmp, table, key):
    with open(tmp, "wb") as f:
        f.write(b"ARROW1" + b"x" * 4096)   # half an entry
        f.flush()
    print("writing", flush=True)
    time.sleep(600)

decoded_cache.DecodedCache._write = stall
src = tg.ParquetSource(
    sys.argv[1], decoded_cache=decoded_cache.DecodedCache(sys.argv[2], min_free_bytes=0)
)
src[0]
"""


def test_a_build_killed_mid_write_leaves_no_entry_and_is_redone(tmp_path):
    d = make_ids(tmp_path, files=1, rows=16, rg=8)
    cache_dir = str(tmp_path / "decoded")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, d, cache_dir],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        temps = os.listdir(os.path.join(cache_dir, ".tmp"))
        assert len(temps) == 1  # the half-written entry, under its temp name only
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    assert entries(cache_dir) == []  # nothing under a final name
    src = tg.ParquetSource(d, decoded_cache=cache_dir)  # the lock died with the writer
    check_ids(src.__getitems__([3, 12, 0]), [3, 12, 0])
    assert src.decoded_cache.stats["builds"] == 2 and len(entries(cache_dir)) == 2
    assert os.listdir(os.path.join(cache_dir, ".tmp")) == []  # the stale temp is gone


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize(
    "damage", ["flip-data", "flip-trailer", "truncate", "garbage", "other-entry", "empty"]
)
def test_a_corrupted_cache_file_is_rebuilt_never_served(tmp_path, damage):
    d = make_ids(tmp_path, files=1, rows=16, rg=8)
    cache_dir = str(tmp_path / "decoded")
    tg.ParquetSource(d, decoded_cache=cache_dir).__getitems__(range(16))
    first, second = entries(cache_dir)
    size = os.path.getsize(first)
    if damage == "flip-data":
        _flip(first, size // 2)  # a value's byte: the structure still reads
    elif damage == "flip-trailer":
        _flip(first, size - 40)  # the stored checksum
    elif damage == "truncate":
        with open(first, "r+b") as f:
            f.truncate(size - 100)
    elif damage == "garbage":
        with open(first, "wb") as f:
            f.write(os.urandom(size))
    elif damage == "other-entry":
        os.replace(second, first)  # a valid entry of another row group, renamed
    else:
        open(first, "wb").close()
    src = tg.ParquetSource(d, decoded_cache=cache_dir)  # a new process would do the same
    check_ids(src.__getitems__(range(16)), list(range(16)))
    stats = src.decoded_cache.stats
    assert stats["corrupt"] == 1 and stats["builds"] == (2 if damage == "other-entry" else 1)
    # Rebuilt: a later reader finds every entry valid.
    again = tg.ParquetSource(d, decoded_cache=cache_dir)
    check_ids(again.__getitems__(range(16)), list(range(16)))
    assert again.decoded_cache.stats["corrupt"] == 0 and again.decoded_cache.stats["builds"] == 0


def test_a_changed_parquet_file_is_never_served_from_a_stale_entry(tmp_path):
    d = tmp_path / "chg"
    path = write(str(d / "a.parquet"), ids_table(0, 16), row_group_size=8)
    cache_dir = str(tmp_path / "decoded")
    src = tg.ParquetSource(str(d), decoded_cache=cache_dir)
    assert src[3]["id"] == 3
    # The same shape and size, other values: a new key (modification time, footer).
    write(path, ids_table(100, 16), row_group_size=8)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    fresh = tg.ParquetSource(str(d), decoded_cache=cache_dir)
    check_ids(fresh.__getitems__([3, 12]), [103, 112])
    assert fresh.decoded_cache.stats["builds"] == 2
    # A source opened before the change refuses to cache (or serve) what it now holds.
    with pytest.raises(tg.CorruptDataError, match=r"a\.parquet.*changed since"):
        src[12]


def _write_permuted(path, ids):
    # Uncompressed, plain-encoded: the same ids in another order within each row group
    # give a file of the same size and the same footer (sizes, offsets, min/max).
    t = pa.table({"id": pa.array(ids, pa.int64())})
    pq.write_table(t, path, row_group_size=4, compression="none", use_dictionary=False)


def test_a_file_replaced_with_the_same_size_time_and_footer_is_never_served_stale(tmp_path):
    d = tmp_path / "same"
    d.mkdir()
    path = str(d / "a.parquet")
    _write_permuted(path, list(range(8)))
    before = os.stat(path)
    cache_dir = str(tmp_path / "decoded")
    src = tg.ParquetSource(str(d), decoded_cache=cache_dir)
    assert [r["id"] for r in src.__getitems__(range(8))] == list(range(8))
    footer = pq.read_metadata(path).to_dict()
    _write_permuted(path + ".new", [3, 2, 1, 0, 7, 6, 5, 4])
    os.replace(path + ".new", path)  # what a copy that keeps times (cp -p, rsync -t) does
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert pq.read_metadata(path).to_dict() == footer
    fresh = tg.ParquetSource(str(d), decoded_cache=cache_dir)
    assert [r["id"] for r in fresh.__getitems__(range(8))] == [3, 2, 1, 0, 7, 6, 5, 4]
    assert fresh.decoded_cache.stats["hits"] == 0


def test_a_remote_file_without_a_version_is_never_served_stale(tmp_path):
    # The test server sends no ETag and no Last-Modified: nothing tells two versions of
    # a file of one size and footer apart, so entries are never reused across openings.
    from tests.servers import RangeHTTPServer

    root = tmp_path / "www"
    root.mkdir()
    path = str(root / "a.parquet")
    _write_permuted(path, list(range(8)))
    cache_dir = str(tmp_path / "decoded")
    with RangeHTTPServer(str(root)) as srv:
        srv.etags = False
        url = srv.url + "/a.parquet"
        src = tg.ParquetSource(url, decoded_cache=cache_dir)
        assert [r["id"] for r in src.__getitems__(range(8))] == list(range(8))
        again = [r["id"] for r in src.__getitems__(range(8))]  # one opening: shared
        assert again == list(range(8)) and src.decoded_cache.stats["builds"] == 2
        _write_permuted(path, [3, 2, 1, 0, 7, 6, 5, 4])
        fresh = tg.ParquetSource(url, decoded_cache=cache_dir)
        assert [r["id"] for r in fresh.__getitems__(range(8))] == [3, 2, 1, 0, 7, 6, 5, 4]


def test_a_process_keeps_a_bounded_number_of_maps_whatever_its_cache_bytes(tmp_path, monkeypatch):
    # Each mapped row group is a memory map; a process may hold at most
    # vm.max_map_count (65,530) of them before every later mmap, malloc's included,
    # fails. A large cache_bytes must not raise the number of maps it keeps.
    monkeypatch.setattr(parquet_loading, "_MAX_MAPS", 8)
    d = make_ids(tmp_path, files=2, rows=64, rg=2)
    src = tg.ParquetSource(d, decoded_cache=str(tmp_path / "decoded"), cache_bytes=1 << 30)
    order = np.random.default_rng(0).permutation(len(src))
    for k in range(0, len(order), 16):
        check_ids(src.__getitems__(order[k : k + 16]), order[k : k + 16].tolist())
        assert src.cache_info().entries <= 8
    assert src.io_stats["decoded_hits"] + src.io_stats["decoded_builds"] > 64


def test_a_cache_directory_deleted_while_reading_is_made_again(tmp_path):
    # (rm -rf ~/.cache/torchgrain to free space while a job runs)
    d = make_ids(tmp_path, files=2, rows=64, rg=8)
    cache_dir = str(tmp_path / "decoded")
    src = tg.ParquetSource(d, decoded_cache=cache_dir)
    check_ids(src.__getitems__(range(40)), list(range(40)))
    shutil.rmtree(cache_dir)
    check_ids(src.__getitems__(range(40, 128)), list(range(40, 128)))
    assert len(entries(cache_dir)) == 11  # stored again, where they were
    assert src.decoded_cache._read_usage() == src.decoded_cache.total_bytes()


_UNWRITABLE = """
import resource, signal, sys, warnings
import numpy as np
import torchgrain as tg
from torchgrain.sources.parquet.decoded_cache import DecodedCache
if sys.argv[3] == "fsize":  # a filesystem that refuses large files (EFBIG)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache = DecodedCache(sys.argv[2], min_free_bytes=0)
    src = tg.ParquetSource(sys.argv[1], decoded_cache=cache)
    ids = [r["id"] for r in src.__getitems__(np.arange(len(src))[::-1])]
    ids += [r["id"] for r in src.__getitems__(np.arange(len(src)))]
assert ids == list(range(len(src)))[::-1] + list(range(len(src))), ids
stats = src.decoded_cache.stats
print(stats["hits"], stats["builds"], stats["not_stored"])
print(sum("decoded Parquet cache" in str(w.message) for w in caught))
"""


@pytest.mark.parametrize("refusal", ["fsize", "read-only"])
def test_a_cache_directory_that_refuses_writes_still_reads_right(tmp_path, refusal):
    d = make_ids(tmp_path, files=1, rows=32, rg=8)
    cache_dir = str(tmp_path / "decoded")
    prefix = []
    if refusal == "read-only":
        # Another user's cache: two entries stored, then nothing writable.
        tg.ParquetSource(d, decoded_cache=cache_dir).__getitems__([0, 8])
        for dirpath, dirs, files in os.walk(cache_dir):
            for name in dirs + files:
                os.chmod(os.path.join(dirpath, name), 0o555 if name in dirs else 0o444)
        os.chmod(cache_dir, 0o555)
        if os.geteuid() == 0:  # root writes anywhere: run it without that privilege
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv")
            prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", _UNWRITABLE, d, cache_dir, refusal],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for dirpath, _, _ in os.walk(cache_dir):
            os.chmod(dirpath, 0o755)
    assert out.returncode == 0, out.stderr
    counts, warned = out.stdout.split("\n")[:2]
    hits, builds, not_stored = map(int, counts.split())
    assert builds == 0 and not_stored >= 1
    if refusal == "read-only":
        assert hits >= 2  # what is there is still used
    assert warned == "1"  # said once, not at every row group


def test_the_decoded_cache_never_fills_the_disk(tmp_path, monkeypatch):
    # It stores an entry only while the filesystem keeps min_free_bytes free, and deletes
    # its own least recently used entries first to make room.
    d = make_ids(tmp_path, files=2, rows=64, rg=8)
    cache_dir = str(tmp_path / "decoded")
    roomy = DecodedCache(cache_dir, max_bytes=1 << 30, min_free_bytes=0)
    check_ids(tg.ParquetSource(d, decoded_cache=roomy).__getitems__(range(64)), list(range(64)))
    assert len(entries(cache_dir)) == 8
    free = shutil.disk_usage(cache_dir).free
    full = DecodedCache(cache_dir, max_bytes=1 << 30, min_free_bytes=free + (1 << 30))
    with pytest.warns(UserWarning, match="decoded Parquet cache"):
        src = tg.ParquetSource(d, decoded_cache=full)
        check_ids(src.__getitems__(range(128)), list(range(128)))
    assert full.stats["builds"] == 0 and full.stats["bytes_written"] == 0
    assert full.stats["not_stored"] >= 8 and full.stats["evictions"] == 8
    assert entries(cache_dir) == [] and os.listdir(os.path.join(cache_dir, ".tmp")) == []
    # The default keeps 5% of the filesystem free, at most 8 GiB.
    total = shutil.disk_usage(cache_dir).total
    assert default_min_free_bytes(total) == min(total // 20, 8 << 30)
    assert default_min_free_bytes(100 << 30) == 5 << 30
    assert default_min_free_bytes(1 << 40) == 8 << 30
    monkeypatch.setattr(decoded_cache, "default_min_free_bytes", default_min_free_bytes)
    assert DecodedCache(cache_dir).min_free_bytes == min(total // 20, 8 << 30)


def test_the_decoded_cache_keeps_its_byte_budget(tmp_path):
    d = make_ids(tmp_path, files=2, rows=64, rg=8)
    probe = str(tmp_path / "probe")
    tg.ParquetSource(d, decoded_cache=probe)[0]
    entry = os.path.getsize(entries(probe)[0])
    budget = 5 * entry + entry // 2
    cache = DecodedCache(str(tmp_path / "decoded"), max_bytes=budget)
    src = tg.ParquetSource(d, decoded_cache=cache)
    order = np.random.default_rng(0).permutation(len(src))
    for k in range(0, len(order), 8):
        check_ids(src.__getitems__(order[k : k + 8]), order[k : k + 8].tolist())
        assert cache.total_bytes() <= budget
    assert cache.stats["evictions"] > 0 and cache.stats["builds"] >= src.num_row_groups
    assert cache._read_usage() == cache.total_bytes()  # the running total is right
    # Two processes sharing it keep it too.
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(_read_all, [(d, cache, seed) for seed in (1, 2)])
    assert cache.total_bytes() <= budget


def test_an_entry_larger_than_the_budget_is_served_not_stored(tmp_path):
    d = make_ids(tmp_path, files=1, rows=16, rg=16)
    cache = DecodedCache(str(tmp_path / "decoded"), max_bytes=64)
    src = tg.ParquetSource(d, decoded_cache=cache)
    check_ids(src.__getitems__([5, 1]), [5, 1])
    assert cache.stats["not_stored"] == 1 and entries(cache.directory) == []


def test_an_entry_of_another_schema_or_length_is_rebuilt(tmp_path):
    cache = DecodedCache(str(tmp_path / "c"), max_bytes=1 << 20)
    key = entry_key("x", 1)
    ints = pa.table({"x": pa.array([1, 2, 3], pa.int64())})
    cache.get_or_build(key, lambda: ints, schema=ints.schema, num_rows=3)
    floats = pa.table({"x": pa.array([1.5, 2.5, 3.5])})
    got, _ = cache.get_or_build(key, lambda: floats, schema=floats.schema, num_rows=3)
    assert got.equals(floats) and cache.stats["corrupt"] == 1
    fewer = floats.slice(0, 2)
    got, _ = cache.get_or_build(key, lambda: fewer, schema=fewer.schema, num_rows=2)
    assert got.num_rows == 2 and cache.stats["corrupt"] == 2


def test_an_entry_whose_checksum_matches_but_whose_offsets_lie_is_rebuilt(tmp_path):
    # A hostile file can carry a right checksum: string offsets beyond the data must
    # still never be read (Arrow's full validation), only rebuilt.
    from torchgrain.sources.parquet import decoded_cache as dc

    cache = DecodedCache(str(tmp_path / "c"), max_bytes=1 << 20)
    key = entry_key("s", 1)
    good = pa.table({"s": pa.array(["ab", "cd"])})
    # Offsets that go backwards (the quick validation checks only the last one).
    offsets = pa.py_buffer(np.array([0, 3, 2], np.int32).tobytes())
    bad_arr = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"abcd")])
    bad = pa.table({"s": bad_arr})
    path = cache.path_of(key)
    os.makedirs(os.path.dirname(path))
    dc.DecodedCache._write(cache, path, bad, key)  # a well-formed entry of lying data
    got, _ = cache.get_or_build(key, lambda: good, schema=good.schema, num_rows=2)
    assert got.column("s").to_pylist() == ["ab", "cd"] and cache.stats["corrupt"] == 1


def test_decoded_cache_keys_name_what_was_decoded():
    assert entry_key("a.parquet", 10, 5) != entry_key("a.parquet", 10, 6)
    with pytest.raises(ValueError):
        DecodedCache("/tmp", max_bytes=0)


def test_auto_turns_the_decoded_cache_on_only_for_data_bigger_than_the_caches(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "home"))
    monkeypatch.setattr(parquet_loading, "_AUTO_MIN_BYTES", 1000)
    d = make_ids(tmp_path, files=2, rows=64, rg=8)
    big = tg.ParquetSource(d, cache_bytes=1000)  # the data's ~3 KB exceed 1000 bytes
    assert big.decoded_cache is not None
    assert big.decoded_cache.directory == str(tmp_path / "home" / "parquet-decoded")
    check_ids(big.__getitems__([100, 3]), [100, 3])
    assert tg.ParquetSource(d).decoded_cache is None  # fits the default 256 MiB
    assert tg.ParquetSource(d, cache_bytes=1000, decoded_cache=False).decoded_cache is None
    assert tg.ParquetSource(d, cache_bytes=0).decoded_cache is None  # caching refused
    assert tg.ParquetSource(d, decoded_cache=True).decoded_cache is not None


def test_the_default_budget_takes_at_most_half_of_the_free_disk(tmp_path):
    # 64 GiB on a laptop with 40 GB free would leave it nearly full: the default is half
    # of the free space (plus what the cache already holds, which it may keep).
    d = make_ids(tmp_path, files=1, rows=16, rg=8)
    cache_dir = str(tmp_path / "decoded")
    src = tg.ParquetSource(d, decoded_cache=cache_dir)
    check_ids(src.__getitems__(range(16)), list(range(16)))
    held = src.decoded_cache.total_bytes()
    assert held > 0
    again = tg.ParquetSource(d, decoded_cache=cache_dir).decoded_cache
    free = shutil.disk_usage(cache_dir).free
    expected = min(64 << 30, (free + held) // 2)
    assert abs(again.max_bytes - expected) < (1 << 20)  # (the disk moves meanwhile)
    chosen = tg.ParquetSource(d, decoded_cache=cache_dir, decoded_cache_bytes=12345)
    assert chosen.decoded_cache.max_bytes == 12345


_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 253:1 / / rw,relatime - ext4 /dev/vda rw
31 27 0:45 / /home rw,relatime - nfs4 server:/home rw,vers=4.2
32 31 0:46 / /home/scratch rw,relatime - xfs /dev/nvme0n1 rw
"""


def test_auto_never_puts_the_decoded_cache_on_a_network_filesystem(tmp_path, monkeypatch):
    # A home directory on NFS (clusters): its quota would fill, and flock is unsafe there.
    from torchgrain.sources.parquet import decoded_cache as dc

    assert dc.filesystem_type("/home/u/.cache/torchgrain", _MOUNTINFO) == "nfs4"
    assert dc.filesystem_type("/home/scratch/x", _MOUNTINFO) == "xfs"
    assert dc.filesystem_type("/homework", _MOUNTINFO) == "ext4"
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "home"))
    monkeypatch.setattr(parquet_loading, "_AUTO_MIN_BYTES", 1000)
    d = make_ids(tmp_path, files=2, rows=64, rg=8)
    assert tg.ParquetSource(d, cache_bytes=1000).decoded_cache is not None
    monkeypatch.setattr(dc, "filesystem_type", lambda path, mountinfo=None: "nfs4")
    with pytest.warns(UserWarning, match="network filesystem"):
        src = tg.ParquetSource(d, cache_bytes=1000)
    assert src.decoded_cache is None
    assert tg.ParquetSource(d, decoded_cache=True).decoded_cache is not None  # asked for


# --------------------------------------------------------------- thrash warnings
def _fit_of(src, order):
    return src.check_cache_fit(lambda a, b: order[a:b], 0, len(order))


def test_check_fit_replays_the_pass_through_an_lru_cache():
    offsets = np.arange(0, 10_001, 100)  # 100 blocks of 100 records, 1 KB each
    blocks = CacheBlocks("c", "block", offsets, lambda b: np.full(len(b), 1000), 20_000, True, ())
    shuffled = np.random.default_rng(0).permutation(10_000)
    fit = check_fit("s", blocks, lambda a, b: shuffled[a:b], 0, 10_000)
    assert not fit.fits and fit.blocks == 100 and fit.working_set_bytes == 100_000
    assert 0.1 < fit.hit_rate < 0.3  # 20 of 100 blocks fit
    assert fit.loads_per_block > 50
    local = np.arange(10_000).reshape(100, 100)
    local = local[np.random.default_rng(1).permutation(100)]  # blocks shuffled, rows kept
    fit = check_fit("s", blocks, lambda a, b: local.ravel()[a:b], 0, 10_000)
    assert fit.fits and fit.loads_per_block == 1.0
    roomy = CacheBlocks("c", "block", offsets, lambda b: np.full(len(b), 1000), 10**6, True, ())
    assert check_fit("s", roomy, lambda a, b: shuffled[a:b], 0, 10_000).hit_rate == 1.0


class _PassOnly(torch.utils.data.Dataset):
    """A dataset of ``n`` indices whose blocks are ``offsets``: it records the sampler's
    pass checks (what a source's read_ahead does), reading nothing."""

    def __init__(self, n, offsets, cost, capacity):
        self.n = n
        self.blocks = CacheBlocks(
            "c", "block", offsets, lambda b: np.full(len(b), cost), capacity, True, ()
        )
        self.fits = []

    def __len__(self):
        return self.n

    def block_offsets(self):
        return self.blocks.offsets

    def read_ahead(self, order, start, count, position):
        if order is not None:
            self.fits.append(check_fit("s", self.blocks, order, start, count))


@pytest.mark.parametrize("blocks", [10**5, 10**6])
def test_a_global_shuffle_over_many_small_row_groups_is_found_to_thrash(blocks):
    # 10^7 records, data 10x the cache. With a million row groups the start of the pass
    # sees each about once: the check must judge the pass from the cache's steady state,
    # not from how often its start happens to repeat a row group.
    n = 10**7
    offsets = np.linspace(0, n, blocks + 1).astype(np.int64)
    data = _PassOnly(n, offsets, 1000, blocks * 1000 // 10)
    iter(tg.GlobalShuffleSampler(data, num_replicas=1, rank=0, seed=0)).__next__()
    (fit,) = data.fits
    assert not fit.fits and 0.05 < fit.hit_rate < 0.2
    assert 0.8 < fit.loads_per_record < 1.0  # ~9 in 10 records load their row group
    assert fit.loads_per_block > 0.8 * n / blocks  # ~9 in 10 of its records load it
    # What it replays is what the steady state needs, not the whole budget of indices.
    assert fit.sampled <= 3 * (blocks // 10) + (1 << 16)
    # A block shuffle of the same data fits (each row group loaded about once).
    blockwise = _PassOnly(n, offsets, 1000, 16 * 1000)
    iter(tg.BlockShuffleSampler(blockwise, window=4, num_replicas=1, rank=0, seed=0)).__next__()
    (fit,) = blockwise.fits
    assert fit.fits and fit.loads_per_block < 1.2 and fit.sampled <= 1 << 17
    # One that a local order would take long to fill is not replayed to the end.
    roomy = _PassOnly(n, offsets, 1000, 10**5 * 1000)
    iter(tg.BlockShuffleSampler(roomy, window=4, num_replicas=1, rank=0, seed=0)).__next__()
    (fit,) = roomy.fits
    assert fit.fits and fit.hit_rate == 1.0 and fit.sampled <= 1 << 17


def _thrashing_loader(tmp_path, workers):
    d = make_ids(tmp_path, files=2, rows=200, rg=20)
    src = tg.ParquetSource(d, cache_bytes=2000, decoded_cache=False)
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, num_replicas=1, rank=0, seed=0)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=16,
        sampler=sampler,
        num_workers=workers,
        collate_fn=_as_list,
        multiprocessing_context="fork" if workers else None,
    )
    return sampler, loader


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_that_cannot_fit_the_cache_warns_once_with_numbers(tmp_path, workers, capfd):
    sampler, loader = _thrashing_loader(tmp_path, workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            sampler.set_epoch(epoch)
            ids = [r["id"] for batch in loader for r in batch]
            assert sorted(ids) == list(range(400))
    thrash = [w for w in caught if issubclass(w.category, tg.CacheThrashWarning)]
    assert len(thrash) == 1, [str(w.message) for w in caught]
    msg = str(thrash[0].message)
    for part in (
        "ParquetSource(",
        "does not fit the row-group cache",
        "2.0 KiB per process",
        "touch 20 row groups",
        "% of the time",
        "per batch of 256",
        "BlockShuffleSampler",
        "decoded_cache=True",
        "torchgrain convert",
    ):
        assert part in msg, (part, msg)
    fit = thrash[0].message.fit
    assert not fit.fits and fit.blocks == 20 and fit.working_set_bytes > fit.capacity_bytes
    # Workers never warn: the sampler's process does, once.
    assert "CacheThrashWarning" not in capfd.readouterr().err
    report = tg.stats(loader)
    assert report.thrashing and report.thrashing[0].cache == "row-group cache"
    assert report.cache_hit_rate < 0.5 and report.misses_per_batch > 4
    assert "cache thrash: ParquetSource(" in str(report)


def test_no_warning_when_the_pass_fits(tmp_path):
    d = make_ids(tmp_path, files=2, rows=200, rg=20)
    for sampler_kind, kw in (
        ("global", {}),  # small data: fits the default cache
        ("block", {"cache_bytes": 25_000}),  # a block shuffle: ~5 row groups (of 20) fit
    ):
        src = tg.ParquetSource(d, decoded_cache=False, **kw)
        ds = tg.Dataset(src)
        if sampler_kind == "global":
            sampler = tg.GlobalShuffleSampler(ds, num_replicas=1, rank=0, seed=0)
        else:
            sampler = tg.BlockShuffleSampler(ds, window=2, num_replicas=1, rank=0, seed=0)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=16, sampler=sampler, collate_fn=_as_list
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", tg.CacheThrashWarning)
            assert sorted(r["id"] for b in loader for r in b) == list(range(400))
        report = tg.stats(loader)
        assert report.cache_fit and not report.thrashing, sampler_kind
        assert "cache thrash" not in str(report)
    # The block shuffle's cache is too small for a global shuffle (the check is not vacuous).
    src = tg.ParquetSource(d, decoded_cache=False, cache_bytes=25_000)
    with pytest.warns(tg.CacheThrashWarning):
        (fit,) = _fit_of(src, np.random.default_rng(0).permutation(400))
    assert not fit.fits


def test_the_decoded_cache_is_what_a_pass_must_fit_when_on(tmp_path):
    d = make_ids(tmp_path, files=2, rows=200, rg=20)
    order = np.random.default_rng(0).permutation(400)
    roomy = tg.ParquetSource(d, cache_bytes=2000, decoded_cache=str(tmp_path / "a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.CacheThrashWarning)
        (fit,) = _fit_of(roomy, order)
    assert fit.cache == "decoded disk cache" and fit.fits
    small = DecodedCache(str(tmp_path / "b"), max_bytes=3000)
    tight = tg.ParquetSource(d, decoded_cache=small)
    with pytest.warns(tg.CacheThrashWarning, match="decoded disk cache.*decoded_cache_bytes"):
        _fit_of(tight, order)


def test_a_remote_shard_cache_too_small_for_the_pass_warns(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/tg-thrash-shards"
    if fs.exists(root):
        fs.rm(root, recursive=True)
    for f in range(6):
        with fs.open(f"{root}/p{f}.parquet", "wb") as fh:
            pq.write_table(ids_table(f * 50, 50), fh, row_group_size=50)
    src = tg.ParquetSource(
        f"memory://{root}", cache_dir=str(tmp_path / "shards"), cache_dir_bytes=6000
    )
    order = np.random.default_rng(0).permutation(len(src))
    with pytest.warns(tg.CacheThrashWarning, match="shard cache.*cache_dir_bytes"):
        fits = _fit_of(src, order)
    assert [f.cache for f in fits if not f.fits] == ["shard cache (cache_dir)"]
    fs.rm(root, recursive=True)


def test_an_arrayrecord_chunk_cache_too_small_for_the_pass_warns(tmp_path):
    recs = [{"x": np.full(64, i, np.int64)} for i in range(2000)]
    grouped = str(tmp_path / "grouped")
    tg.write_array_record(recs, grouped, num_shards=2, group_size=50, compression="uncompressed")
    order = np.random.default_rng(0).permutation(2000)
    src = tg.ArrayRecordSource(grouped, cache_bytes=50_000)  # 40 chunks of ~26 KB
    with pytest.warns(tg.CacheThrashWarning, match="chunk cache.*group_size=1"):
        fits = _fit_of(src, order)
    (fit,) = fits
    assert fit.cache == "chunk cache" and fit.blocks == 40 and not fit.fits
    # A block shuffle fits; files of one record per chunk never use the cache.
    local = np.arange(2000).reshape(40, 50)[np.random.default_rng(1).permutation(40)].ravel()
    assert _fit_of(src, local)[0].fits
    single = str(tmp_path / "single")
    tg.write_array_record(recs, single, num_shards=2)
    assert _fit_of(tg.ArrayRecordSource(single, cache_bytes=50_000), order) == []


def test_reading_a_file_in_order_neither_needs_nor_fills_the_caches(tmp_path):
    d = make_ids(tmp_path, files=2, rows=40, rg=8)
    cache_dir = str(tmp_path / "decoded")
    src = tg.ParquetSource(d, decoded_cache=cache_dir)
    check_ids(list(src.iter_shard(1, 3, 30)), list(range(43, 70)))
    check_ids(list(src.iter_shard(0, 35, 99)), list(range(35, 40)))  # stop past the end
    assert entries(cache_dir) == [] and src.cache_info().misses == 0
    # Every type, as random access reads it.
    file = write(str(tmp_path / "t.parquet"), all_types_table(), row_group_size=4)
    types = on_path(tg.ParquetSource(file), "built")
    for got, want in zip(types.iter_shard(0), types.__getitems__(range(6))):
        for key in want:
            assert_same_values(got[key], want[key], key)
