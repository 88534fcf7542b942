"""The command line: ``torchgrain bench`` on small datasets (real worker processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.bench import record_nbytes, suggest
from torchgrain.cli import main

_WRITE = """
import sys, numpy as np, torchgrain as tg
recs = [{"x": np.full(64, i, np.float32), "label": i % 5} for i in range(200)]
tg.write_array_record(recs, sys.argv[1], num_shards=3)
"""


@pytest.fixture(scope="module")
def ar_dataset(tmp_path_factory):
    # Written by a child process: this process then holds no ArrayRecord C++ state when
    # the DataLoader forks its workers (see DESIGN.md, "array_record's C++ reader and fork").
    d = tmp_path_factory.mktemp("cli") / "ar"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", _WRITE, str(d)], check=True, env=env)
    return str(d)


def test_bench_prints_rates_stats_and_suggestions(ar_dataset, capsys):
    rc = main(["bench", ar_dataset, "--workers", "2", "--batch-size", "16", "--seconds", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "200 records in 3 shard(s)" in out
    for word in ("sequential", "shuffled", "records/s", "MB/s", "worker 0", "worker 1"):
        assert word in out
    assert "suggestions" in out
    tips = out.split("suggestions", 1)[1]
    assert "  - " in tips


def test_bench_json(ar_dataset, capsys):
    rc = main(
        ["bench", ar_dataset, "--workers", "1", "--batch-size", "8", "--seconds", "0.6", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["format"] == "array_record"
    assert report["num_records"] == 200
    modes = {m["mode"]: m for m in report["modes"]}
    assert {"sequential", "shuffled"} <= set(modes)
    for m in modes.values():
        assert m["records"] > 0 and m["records_per_s"] > 0
        # 64 float32 + one int per record
        assert m["bytes_per_record"] == pytest.approx(64 * 4 + 8)
        assert "worker 0" in m["workers"]
    assert isinstance(report["suggestions"], list) and report["suggestions"]


def test_bench_without_workers_suggests_workers(ar_dataset, capsys):
    rc = main(["bench", ar_dataset, "--workers", "0", "--batch-size", "32", "--seconds", "0.4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "use worker processes" in out


def test_bench_missing_dataset_is_a_clear_error(tmp_path, capsys):
    rc = main(["bench", str(tmp_path / "nope"), "--seconds", "0.1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nope" in err


def test_bench_rejects_bad_arguments(ar_dataset, capsys):
    assert main(["bench", ar_dataset, "--batch-size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(tg, "ParquetSource"), reason="needs ParquetSource")
def test_bench_parquet_is_detected_by_suffix(tmp_path, capsys):
    d = tmp_path / "pq"
    d.mkdir()
    for s in range(2):
        ids = np.arange(s * 100, (s + 1) * 100)
        table = pa.table({"id": ids, "v": pa.array([np.ones(8, np.float32)] * 100)})
        pq.write_table(table, d / f"part-{s}.parquet", row_group_size=25)
    rc = main(["bench", str(d), "--workers", "1", "--batch-size", "16", "--seconds", "0.6"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "format    parquet, 200 records" in out
    assert "shuffled" in out


def _mode(name, rate, busy=0.5, first=0.1):
    return {
        "mode": name,
        "records_per_s": rate,
        "busy_fraction": busy,
        "first_batch_s": first,
        "bytes_per_record": 100.0,
    }


def test_suggest_slow_parquet_shuffle_names_the_remedies():
    tips = suggest(
        [_mode("sequential", 1000.0), _mode("shuffled", 100.0), _mode("block-shuffled", 800.0)],
        fmt="parquet",
        num_workers=4,
        batch_size=256,
        cpu_count=4,
    )
    text = " ".join(tips)
    assert "BlockShuffleSampler read 800 records/s" in text
    assert "group_size 1" in text and "cache_bytes" in text


def test_suggest_grouped_array_record_and_saturated_workers():
    tips = suggest(
        [_mode("sequential", 1000.0, busy=0.95), _mode("shuffled", 200.0, busy=0.97)],
        fmt="array_record",
        num_workers=2,
        batch_size=256,
        group_size=64,
        cpu_count=8,
    )
    assert tips[0].startswith("increase num_workers")
    assert "--workers 4" in tips[0]
    assert any("group_size 64" in t and "group_size 1" in t for t in tips)


def test_suggest_cheap_shuffle_and_cpu_bound():
    tips = suggest(
        [_mode("sequential", 1000.0, busy=0.9), _mode("shuffled", 950.0, busy=0.9)],
        fmt="array_record",
        num_workers=8,
        batch_size=8,
        cpu_count=8,
    )
    assert tips[0].startswith("CPU-bound")
    assert any("GlobalShuffleSampler is the right default" in t for t in tips)
    assert any("batch size 8 is small" in t for t in tips)


def test_record_nbytes_counts_payloads():
    rec = {"a": np.zeros((2, 3), np.float64), "s": "abcd", "n": [1, 2], "t": None}
    assert record_nbytes(rec) == 48 + 4 + 16 + 8
