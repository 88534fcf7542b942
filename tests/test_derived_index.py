"""Derived indexes (torchgrain/sources/node_index/derived.py): built once per machine,
mapped by every process, rebuilt when damaged or made for other data."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.sources.node_index.derived import (
    callable_fingerprint,
    dataset_fingerprint,
    derived_index,
)

COLUMNS = {"kept": ("<u4", ()), "pairs": ("<i8", (2,))}


def _filler(calls: list[int], n: int = 5):
    def fill(sink):
        calls.append(1)
        sink.append("kept", np.arange(n, dtype=np.uint32))
        sink.append("pairs", np.arange(2 * n, dtype=np.int64).reshape(n, 2))
        return {"n": n}

    return fill


def test_built_once_then_mapped(tmp_path):
    calls: list[int] = []
    a = derived_index("t", "key1", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    b = derived_index("t", "key1", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    assert calls == [1]
    assert a.path == b.path and a.path.startswith(str(tmp_path))
    assert b.arrays["kept"].dtype == np.uint32 and b.arrays["kept"].tolist() == list(range(5))
    assert b.arrays["pairs"].shape == (5, 2) and b.meta["n"] == 5
    assert not b.arrays["kept"].flags.writeable
    # another key: another file
    derived_index("t", "key2", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    assert calls == [1, 1]


def test_another_process_reuses_the_file(tmp_path):
    calls: list[int] = []
    derived_index("t", "k", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    code = textwrap.dedent(f"""
        import numpy as np
        from torchgrain.sources.node_index.derived import derived_index
        def fill(sink):
            raise SystemExit("rebuilt")
        ix = derived_index("t", "k", {COLUMNS!r}, fill, index_dir={str(tmp_path)!r})
        print(ix.arrays["kept"].sum())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "10"


def test_pickles_as_its_file_and_refuses_a_replaced_one(tmp_path):
    ix = derived_index("t", "k", COLUMNS, _filler([]), index_dir=str(tmp_path))
    blob = pickle.dumps(ix)
    assert len(blob) < 1000  # the name, not the arrays
    assert pickle.loads(blob).arrays["kept"].tolist() == list(range(5))
    os.unlink(ix.path)
    derived_index("t", "k", COLUMNS, _filler([], n=7), index_dir=str(tmp_path))
    with pytest.raises(tg.CorruptDataError, match="replaced"):
        pickle.loads(blob)


def test_a_damaged_file_is_rebuilt(tmp_path):
    calls: list[int] = []
    ix = derived_index("t", "k", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    path = ix.path
    del ix
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.warns(UserWarning, match="rebuilding"):
        again = derived_index("t", "k", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    assert calls == [1, 1] and again.arrays["kept"].tolist() == list(range(5))


def test_a_misfit_is_rebuilt_and_memory_when_no_directory(tmp_path):
    calls: list[int] = []
    derived_index("t", "k", COLUMNS, _filler(calls), index_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="rebuilding"):
        derived_index(
            "t",
            "k",
            COLUMNS,
            _filler(calls, n=6),
            index_dir=str(tmp_path),
            fits=lambda ix: None if ix.meta["n"] == 6 else "other length",
        )
    mem = derived_index("t", "k", COLUMNS, _filler(calls), index_dir=None)
    assert mem.path is None and calls == [1, 1, 1]
    assert pickle.loads(pickle.dumps(mem)).arrays["kept"].tolist() == list(range(5))
    with pytest.raises(ValueError, match="key"):
        derived_index("t", "../x", COLUMNS, _filler(calls), index_dir=str(tmp_path))


def test_fingerprints_follow_the_data(tmp_path):
    d = str(tmp_path / "ds")
    tg.write_array_record([{"x": np.int64(i)} for i in range(6)], d, num_shards=2)
    src = tg.ArrayRecordSource(d)
    a = dataset_fingerprint(tg.Dataset(src))
    assert a == dataset_fingerprint(tg.Dataset(tg.ArrayRecordSource(d)))
    assert a != dataset_fingerprint(tg.Dataset(src).map(lambda r: r))
    shard = src.paths[-1]
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert a != dataset_fingerprint(tg.Dataset(tg.ArrayRecordSource(d)))
    k = 3
    assert callable_fingerprint(lambda r: r > k) != callable_fingerprint(lambda r: r > 4)


class _Above:
    def __init__(self, k):
        self.k = k

    def keep(self, r):
        return r["x"] > self.k


def test_a_bound_method_predicate_is_keyed_by_its_object(tmp_path):
    assert callable_fingerprint(_Above(1).keep) != callable_fingerprint(_Above(5).keep)
    assert callable_fingerprint(_Above(1).keep) == callable_fingerprint(_Above(1).keep)
    ds = tg.Dataset([{"x": i} for i in range(10)])
    opts = {"index_dir": str(tmp_path / "ix"), "progress": False, "num_workers": 0}
    assert len(ds.filter(_Above(1).keep, **opts)) == 8
    assert [r["x"] for r in ds.filter(_Above(5).keep, **opts)] == [6, 7, 8, 9]  # was 2..9


_RELEASE = """
class Base:
    def above(self, r):
        return r["x"] > {limit}


class Keep(Base):
    def __call__(self, r):
        return self.above(r)

    def keep(self, r):
        return self.above(r)
"""


def _release(limit: int, monkeypatch) -> type:
    """Class ``Keep`` of one module, whose base's helper method compares with ``limit``
    (the same names whatever ``limit``: another release of the module)."""
    module = types.ModuleType("tg_test_release")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(_RELEASE.format(limit=limit), module.__dict__)
    return module.Keep


def test_a_changed_method_of_a_callables_class_or_base_is_another_key(monkeypatch):
    ds = tg.Dataset([{"x": i} for i in range(10)])
    keep = _release(1, monkeypatch)
    one = callable_fingerprint(keep()), callable_fingerprint(keep().keep)
    mapped = dataset_fingerprint(ds.map(keep()))
    assert one == (callable_fingerprint(keep()), callable_fingerprint(keep().keep))
    keep = _release(5, monkeypatch)
    two = callable_fingerprint(keep()), callable_fingerprint(keep().keep)
    assert one[0] != two[0] and one[1] != two[1]
    assert mapped != dataset_fingerprint(ds.map(keep()))


def test_a_nested_function_that_calls_itself_is_keyed():
    def make(k):
        def count(n):
            return k if n == 0 else count(n - 1)

        return count

    assert callable_fingerprint(make(1)) == callable_fingerprint(make(1))
    assert callable_fingerprint(make(1)) != callable_fingerprint(make(2))


def test_a_filter_over_other_columns_of_the_same_files_is_not_reused(tmp_path):
    d = str(tmp_path / "p")
    tg.write_parquet([{"x": i, "y": None if i % 2 else i} for i in range(10)], d)
    no_y = lambda r: r.get("y") is None  # noqa: E731
    opts = {"index_dir": str(tmp_path / "ix"), "progress": False, "num_workers": 0}
    only_x = tg.Dataset(tg.ParquetSource(d, columns=["x"])).filter(no_y, **opts)
    both = tg.Dataset(tg.ParquetSource(d)).filter(no_y, **opts)
    assert len(only_x) == 10  # no 'y' read: every record passes
    assert [r["x"] for r in both] == [1, 3, 5, 7, 9]  # was the 10 of the other selection


def _first_byte_even(r) -> bool:
    return r["bytes"][0] % 2 == 0


def test_a_remote_tfrecord_shard_is_keyed_by_the_version_its_opening_indexed(tmp_path):
    """A remote file's key holds its version as the source's opening read it (here its
    ETag): the same on a later opening of the same files (its index reused, nothing
    read), another once a file is replaced by one of as many records and bytes."""
    from servers import RangeHTTPServer

    from torchgrain.formats.tfrecord import write_tfrecord
    from torchgrain.io import responses

    www = tmp_path / "www"
    www.mkdir()
    names = [f"d-{s}.tfrecord" for s in range(2)]
    for s, n in enumerate(names):
        write_tfrecord([bytes([s * 20 + i]) * 8 for i in range(20)], www / n)
    opts = {"index_dir": str(tmp_path / "sel"), "num_workers": 0, "progress": False}

    def opened(url: str) -> tg.TFRecordSource:
        responses._PINS.clear()  # as in a fresh process: no version remembered
        urls = [f"{url}/{n}" for n in names]
        return tg.TFRecordSource(urls, codec="raw", index_dir=str(tmp_path / "ix"))

    def kept(url: str) -> list[int]:
        f = tg.Dataset(opened(url)).filter(_first_byte_even, **opts)
        return [f[i]["bytes"][0] for i in range(len(f))]

    with RangeHTTPServer(www) as srv:
        key = dataset_fingerprint(opened(srv.url))
        assert key == dataset_fingerprint(opened(srv.url))
        assert kept(srv.url) == list(range(0, 40, 2))
        for s, n in enumerate(names):  # as many records and bytes, a later version
            st = os.stat(www / n)
            write_tfrecord([bytes([s * 20 + i + 1]) * 8 for i in range(20)], www / n)
            os.utime(www / n, (st.st_atime + 10, st.st_mtime + 10))
        assert key != dataset_fingerprint(opened(srv.url))
        assert kept(srv.url) == list(range(2, 41, 2))
