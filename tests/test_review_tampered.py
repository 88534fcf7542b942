"""Node-local files a later run trusts, tampered with: a dataset index, a filter's selection.

Each test writes a small dataset, lets torchgrain write its index (or selection) into
``index_dir``, replaces that file, and reads again: the records must be the true ones, or
the read a named :class:`~torchgrain.TorchgrainError`; never other records, another
exception or a wait forever.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

import torchgrain as tg
from tests.test_cache_audit_review import _finishes as _finishes_or_raise
from torchgrain.formats.tfrecord import write_tfrecord


def _finishes(fn, fifo: str | None = None, seconds: float = 8.0):
    """``(fn(), None)``, or ``(None, error)`` when it raised; it must end within
    ``seconds`` (one stuck opening ``fifo`` is let go, and the test fails)."""
    try:
        return _finishes_or_raise(fn, fifo, seconds), None
    except AssertionError:
        raise
    except Exception as e:
        return None, e


def _tfrecord(tmp_path):
    d = tmp_path / "tf"
    d.mkdir()
    for s in range(3):
        write_tfrecord([f"tf-{s}-{i:04d}".encode() * 3 for i in range(100)], d / f"d-{s}.tfrecord")
    return lambda idx: tg.TFRecordSource(d, index_dir=idx)


def _arrayrecord(tmp_path):
    recs = [{"x": np.full(8, i % 251, np.uint8), "i": i} for i in range(300)]
    paths = tg.write_array_record(recs, tmp_path / "ar", num_shards=3, group_size=4)
    return lambda idx: tg.ArrayRecordSource(paths, index_dir=idx)  # (no manifest: index_dir)


def _selection(tmp_path):
    recs = [{"i": i} for i in range(300)]
    tg.write_array_record(recs, tmp_path / "sel", num_shards=3)
    ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "sel", index_dir=None))
    return lambda idx: ds.filter(_even_i, index_dir=idx, num_workers=0, progress=False)


def _even_i(r) -> bool:
    return int(r["i"]) % 2 == 0


_MAKERS = {"tfrecord": _tfrecord, "arrayrecord": _arrayrecord, "selection": _selection}


def _records(src) -> list:
    out = []
    for i in range(len(src)):
        r = src[i]
        out.append({k: np.asarray(v).tolist() for k, v in r.items()} if isinstance(r, dict) else r)
    return out


def _the_index(idx) -> str:
    (name,) = [n for n in os.listdir(idx) if n.endswith(".tgindex") and ".offsets." not in n]
    return os.path.join(idx, name)


@pytest.mark.parametrize("fmt", sorted(_MAKERS))
def test_a_fifo_under_a_dataset_index_name_is_never_waited_on(tmp_path, fmt):
    open_source = _MAKERS[fmt](tmp_path)
    idx = str(tmp_path / "idx")
    truth = _records(open_source(idx))
    path = _the_index(idx)
    os.unlink(path)
    os.mkfifo(path)
    got, error = _finishes(lambda: _records(open_source(idx)), path)
    assert error is None or isinstance(error, tg.TorchgrainError), repr(error)
    assert error is not None or got == truth


@pytest.mark.parametrize("fmt", sorted(_MAKERS))
def test_a_directory_under_a_dataset_index_name_is_rebuilt_or_named(tmp_path, fmt):
    open_source = _MAKERS[fmt](tmp_path)
    idx = str(tmp_path / "idx")
    truth = _records(open_source(idx))
    path = _the_index(idx)
    os.unlink(path)
    os.mkdir(path)
    got, error = _finishes(lambda: _records(open_source(idx)))
    if error is not None:
        assert isinstance(error, tg.TorchgrainError), repr(error)
        assert path in str(error)
    else:
        assert got == truth


_PREDICATE = """
class Keep:
    def __call__(self, r):
        return self.keep(r)

    def keep(self, r):
        return int(r["i"]) % {m} == 0


PREDICATE = Keep()
"""


def test_a_predicate_objects_changed_method_gets_a_new_selection(tmp_path, monkeypatch):
    recs = [{"i": i} for i in range(60)]
    tg.write_array_record(recs, tmp_path / "ar", num_shards=2)
    idx = tmp_path / "idx"
    name = "tg_review_tampered_predicate"
    kept = []
    for m in (2, 3):  # the same module and class, its helper method changed (a new release)
        where = tmp_path / f"v{m}"
        where.mkdir()
        (where / f"{name}.py").write_text(_PREDICATE.format(m=m))
        monkeypatch.syspath_prepend(str(where))
        sys.modules.pop(name, None)
        module = importlib.import_module(name)
        ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "ar"))
        f = ds.filter(module.PREDICATE, index_dir=idx, num_workers=0, progress=False)
        kept.append([int(f[i]["i"]) for i in range(len(f))])
    sys.modules.pop(name, None)
    assert kept[0] == list(range(0, 60, 2))
    assert kept[1] == list(range(0, 60, 3))


def test_a_remote_shard_replaced_gets_a_new_selection(tmp_path):
    from servers import RangeHTTPServer

    from torchgrain.io import responses

    www = tmp_path / "www"
    tg.write_parquet([{"v": i} for i in range(40)], www, num_shards=2, row_group_size=10)
    tg.write_parquet([{"v": i + 1} for i in range(40)], tmp_path / "new", num_shards=2)
    idx = tmp_path / "idx"
    names = sorted(os.listdir(www))

    def kept(url: str) -> list[int]:
        responses._PINS.clear()  # as in a fresh process: no version remembered
        src = tg.ParquetSource([f"{url}/{n}" for n in names])
        f = tg.Dataset(src).filter(_even, index_dir=idx, num_workers=0, progress=False)
        return [int(f[i]["v"]) for i in range(len(f))]

    with RangeHTTPServer(www) as srv:
        assert kept(srv.url) == list(range(0, 40, 2))
        for n in names:  # the objects replaced: other values, as many rows, a later version
            st = os.stat(www / n)
            os.replace(tmp_path / "new" / n, www / n)
            os.utime(www / n, (st.st_atime + 10, st.st_mtime + 10))
        assert kept(srv.url) == list(range(2, 41, 2))


def _even(r) -> bool:
    return int(r["v"]) % 2 == 0


def test_a_directory_under_a_copys_record_name_is_named_as_the_record(tmp_path):
    import uuid

    import fsspec

    from torchgrain.io.shard_cache import ShardCache

    url = f"memory://tampered-{uuid.uuid4().hex}/shard-0"
    fsspec.filesystem("memory").pipe(url, b"r" * 100)
    cache_dir = tmp_path / "cache"
    path = ShardCache(str(cache_dir), max_bytes=1000).fetch(url, size=100)
    record = cache_dir / ".sums" / os.path.basename(path)
    os.unlink(record)
    os.mkdir(record)
    try:
        got = ShardCache(str(cache_dir), max_bytes=1000).fetch(url, size=100)
    except tg.TorchgrainError as e:
        assert str(record) in str(e), str(e)
    else:
        with open(got, "rb") as f:
            assert f.read() == b"r" * 100


def _gzip_tfrecord(path, records) -> None:
    import gzip

    raw = str(path) + ".raw"
    write_tfrecord(records, raw)
    with open(raw, "rb") as f:  # (stored, not deflated: its size is the records')
        path.write_bytes(gzip.compress(f.read(), compresslevel=0, mtime=0))
    os.unlink(raw)


def test_a_compressed_shards_count_from_another_files_entry_loses_no_record(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _gzip_tfrecord(a / "d-0.tfrecord.gz", [b"a%029d" % i for i in range(100)])
    _gzip_tfrecord(b / "d-0.tfrecord.gz", [b"b%075d" % i for i in range(50)])  # same size
    assert os.path.getsize(a / "d-0.tfrecord.gz") == os.path.getsize(b / "d-0.tfrecord.gz")
    idx_a, idx_b = tmp_path / "idx_a", tmp_path / "idx_b"
    assert len(tg.TFRecordSource(a, index_dir=idx_a, codec="raw")) == 100
    assert len(tg.TFRecordSource(b, index_dir=idx_b, codec="raw")) == 50
    (entry_a,) = [n for n in os.listdir(idx_a) if n.endswith(".offsets.tgindex")]
    (entry_b,) = [n for n in os.listdir(idx_b) if n.endswith(".offsets.tgindex")]
    os.replace(idx_b / entry_b, idx_a / entry_a)  # b's entry under a's name
    for n in os.listdir(idx_a):
        if n.startswith("tfrecord-") and n.endswith(".tgindex"):
            os.unlink(idx_a / n)  # the dataset index made again from the entries
    try:
        got = list(tg.TFRecordSource(a, index_dir=idx_a, codec="raw").iter_shard(0))
    except tg.TorchgrainError:
        return
    assert [r["bytes"] for r in got] == [b"a%029d" % i for i in range(100)]


@pytest.mark.parametrize(
    "what", ["lock-dir", "evict-lock-dir", "sums-fifo", "sums-file"], ids=lambda w: w
)
def test_a_shard_caches_own_file_of_the_wrong_kind_is_named_or_worked_around(tmp_path, what):
    import uuid

    import fsspec

    from torchgrain.io.shard_cache import ShardCache

    url = f"memory://tampered-{uuid.uuid4().hex}/shard-0"
    fsspec.filesystem("memory").pipe(url, b"r" * 100)
    cache_dir = tmp_path / "cache"
    path = ShardCache(str(cache_dir), max_bytes=1000).fetch(url, size=100)
    os.unlink(path)  # (fetched again: every lock and record is needed)
    target = {
        "lock-dir": cache_dir / ".locks" / (os.path.basename(path) + ".lock"),
        "evict-lock-dir": cache_dir / ".locks" / "evict.lock",
        "sums-fifo": cache_dir / ".sums",
        "sums-file": cache_dir / ".sums",
    }[what]
    if target.is_dir():
        for f in target.iterdir():
            f.unlink()
        target.rmdir()
    elif target.exists():
        target.unlink()
    if what.endswith("-dir"):
        target.mkdir()
    elif what == "sums-fifo":
        os.mkfifo(target)
    else:
        target.write_bytes(b"")

    def fetch() -> bytes:
        got = ShardCache(str(cache_dir), max_bytes=1000).fetch(url, size=100)
        with open(got, "rb") as f:
            return f.read()

    data, error = _finishes(fetch, str(target) if what == "sums-fifo" else None)
    if error is not None:
        assert isinstance(error, tg.TorchgrainError), repr(error)
        assert str(target) in str(error)
    else:
        assert data == b"r" * 100


@pytest.mark.parametrize("name", [".tmp", ".locks"])
def test_a_decoded_cache_whose_own_folder_is_a_file_never_fails_a_read(tmp_path, name):
    recs = [{"i": i, "s": f"r{i}"} for i in range(60)]
    tg.write_parquet(recs, tmp_path / "pq", num_shards=2, row_group_size=10)
    cache = tmp_path / "decoded"

    def read() -> list:
        src = tg.ParquetSource(tmp_path / "pq", decoded_cache=str(cache), cache_bytes=0)
        return [(int(r["i"]), r["s"]) for r in (src[i] for i in range(len(src)))]

    truth = read()
    assert truth == [(i, f"r{i}") for i in range(60)]
    folder = cache / name
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.write_bytes(b"")
    got, error = _finishes(read)
    assert error is None, repr(error)
    assert got == truth
