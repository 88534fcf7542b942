"""The tools that measure and tell: convert --columns, the bytes a read counts, the
caches listed, cleared and announced, bench's rounds and collation."""

from __future__ import annotations

import json
import os
import warnings

import pytest

import torchgrain as tg
from torchgrain.cli import main


def _data(tmp_path, n=20):
    rows = [{"a": i, "b": str(i), "c": float(i)} for i in range(n)]
    tg.write_parquet(rows, str(tmp_path / "pq"))
    tg.write_array_record(rows, str(tmp_path / "ar"))
    return str(tmp_path / "pq"), str(tmp_path / "ar")


def test_convert_columns(tmp_path, capsys):
    pq, ar = _data(tmp_path)
    assert main(["convert", pq, str(tmp_path / "o1"), "--columns", "a,c", "-q"]) == 0
    assert tg.open(str(tmp_path / "o1"))[3] == {"a": 3, "c": 3.0}
    tg.convert(ar, str(tmp_path / "o2"), to="parquet", columns=["b"])
    assert tg.open(str(tmp_path / "o2"))[4] == {"b": "4"}
    for src in (pq, ar):
        with pytest.raises(ValueError, match=r"'zz'.*\['a', 'b', 'c'\]"):
            tg.convert(src, str(tmp_path / "o3"), columns=["a", "zz"])
    assert main(["convert", ar, str(tmp_path / "o4"), "--columns", "zz", "-q"]) != 0
    assert "'zz'" in capsys.readouterr().err


def test_decoded_cache_reads_count_their_bytes(tmp_path):
    """A row group mapped from the decoded disk cache counts its bytes as read (the
    stats showed read MB 0.0 beside seconds of reading)."""
    from torchgrain.diagnostics import COUNTER, local_counters

    pq, _ = _data(tmp_path)
    src = tg.ParquetSource(pq, decoded_cache=str(tmp_path / "decoded"))
    before = local_counters().copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src.__getitems__([1, 2])
    assert (local_counters() - before)[COUNTER["bytes_read"]] > 0


def _plant(cache, outside):
    """Links inside the cache pointing out of it: a folder and a file."""
    outside.mkdir()
    (outside / "precious").write_text("keep")
    os.symlink(outside, cache / "parquet-decoded" / "out-dir")
    os.symlink(outside / "precious", cache / "filter-index" / "out.tgindex")
    os.symlink(outside, cache / "linked-root")


def test_cache_list_announce_and_clear(tmp_path, monkeypatch, capsys):
    from torchgrain.caches import CacheNotice, list_caches

    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(cache))
    pq, ar = _data(tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tg.ParquetSource(pq, decoded_cache=True).__getitems__([0, 5])
        ds = tg.Dataset(tg.open(ar)).filter(
            lambda r: r["a"] % 2 == 0, num_workers=0, progress=False
        )
        assert len(ds) == 10
        tg.write_parquet([{"z": 1}], str(tmp_path / "pq2"))
        tg.ParquetSource(str(tmp_path / "pq2"), decoded_cache=True)[0]  # writes: not said again
    notes = [str(w.message) for w in seen if w.category is CacheNotice]
    decoded = [n for n in notes if str(cache / "parquet-decoded") in n]
    assert len(decoded) == 1 and "budget" in decoded[0], notes  # once, though written twice
    assert len([n for n in notes if str(cache / "filter-index") in n]) == 1, notes

    assert main(["cache", "list", "--json"]) == 0
    listed = {c["name"]: c for c in json.loads(capsys.readouterr().out)["caches"]}
    assert listed["parquet-decoded"]["entries"] == 2 and listed["parquet-decoded"]["bytes"] > 0
    assert listed["filter-index"]["entries"] == 1

    _plant(cache, tmp_path / "outside")
    assert "linked-root" not in [c["name"] for c in list_caches()]
    assert main(["cache", "clear", "filter-index"]) == 0
    assert main(["cache", "clear", "--all"]) == 0
    assert main(["cache", "clear", "nope"]) == 2
    assert main(["cache", "clear", str(tmp_path / "outside")]) == 2  # not a cache
    assert (tmp_path / "outside" / "precious").read_text() == "keep"
    assert os.path.islink(cache / "linked-root")  # (not a cache: left alone)
    assert all(c["bytes"] == 0 for c in list_caches())
    # The caches work again after being cleared.
    assert tg.ParquetSource(pq, decoded_cache=True)[3]["a"] == 3


def test_bench_rounds_settle_and_batches_are_collated(tmp_path):
    import numpy as np

    from torchgrain.bench import run_bench
    from torchgrain.errors import RaggedBatchError

    path = str(tmp_path / "ar")
    tg.write_array_record([{"x": np.full(4, i, np.float32)} for i in range(64)], path)
    common = {"batch_size": 8, "num_workers": 0, "repeats": 2, "round_seconds": 0.05, "out": None}
    # Rounds go on until the last ones agree (never, at settle=0: the cap), or stop at once.
    never = run_bench(path, settle=0.0, **common)
    assert [m["rounds"] for m in never["modes"]] == [4, 4]
    assert not any(m["settled"] for m in never["modes"])
    assert all(len(m["runs"]) == 2 for m in never["modes"])  # the last rounds reported
    once = run_bench(path, settle=10.0, **common)
    assert [m["rounds"] for m in once["modes"]] == [2, 2] and once["collate"] == "default"
    assert once["modes"][0]["bytes_per_record"] == 16  # counted in the collate

    ragged = str(tmp_path / "ragged")
    tg.write_array_record([{"ids": np.arange(i % 5 + 1)} for i in range(64)], ragged)
    with pytest.raises(RaggedBatchError, match=r"'ids'.*--collate pad"):
        run_bench(ragged, **common)
    padded = run_bench(ragged, collate="pad", settle=10.0, **common)
    assert padded["modes"][0]["records_per_s"] > 0
