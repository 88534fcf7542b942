"""benchmarks/scale.py at a tiny size: the data it makes reads back as written, its
record check catches what it must, its memory model recovers known costs, and a whole
run writes results of the documented shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import torchgrain as tg
from benchmarks import scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _expected(ids: np.ndarray) -> list[bytes]:
    return [p.tobytes() for p in scale.payloads(ids)]


def test_generated_arrayrecord_reads_back_as_the_records_written(tmp_path):
    d = str(tmp_path / "ar")
    info = scale.make_arrayrecord(d, 1000, 3, workers=1)
    assert info["params"]["records"] == 1000 and info["bytes"] > 0
    src = tg.ArrayRecordSource(d)
    assert len(src) == 1000 and src.num_shards == 3
    recs = src.__getitems__(list(range(1000)))
    assert [r["id"] for r in recs] == list(range(1000))
    assert [r["payload"] for r in recs] == _expected(np.arange(1000))
    # A second call reuses the files (same parameters): nothing is rewritten.
    mtime = os.path.getmtime(src.paths[0])
    assert scale.make_arrayrecord(d, 1000, 3, workers=1)["write_s"] == info["write_s"]
    assert os.path.getmtime(src.paths[0]) == mtime


def test_generated_parquet_and_tfrecord_read_back_as_the_records_written(tmp_path):
    scale.make_parquet(str(tmp_path / "pq"), 2500, 2, 300)
    src = tg.ParquetSource(str(tmp_path / "pq"))
    assert len(src) == 2500 and len(src.block_offsets()) - 1 == 10  # 2 x 1250 rows, 300 a group
    recs = src.__getitems__(list(range(2500)))
    assert [r["id"] for r in recs] == list(range(2500))
    assert [r["payload"] for r in recs] == _expected(np.arange(2500))

    scale.make_tfrecord(str(tmp_path / "tfr"), 700, 4, workers=1)
    src = tg.TFRecordSource(str(tmp_path / "tfr"), codec="raw", index_dir=None)
    raw = [r["bytes"] for r in src.__getitems__(list(range(700)))]
    assert [int.from_bytes(b[:8], "little") for b in raw] == list(range(700))
    assert [b[8:] for b in raw] == _expected(np.arange(700))


def test_the_record_check_counts_wrong_ids_bytes_and_lengths():
    ids = np.arange(100, 140)
    good = _expected(ids)
    assert scale.bad_records(ids, good, 1000) == 0
    flipped = list(good)
    flipped[3] = bytes([good[3][0] ^ 1]) + good[3][1:]
    assert scale.bad_records(ids, flipped, 1000) == 1
    assert scale.bad_records(ids, [*good[:-1], good[-1][:-1]], 1000) == 1
    swapped = ids.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert scale.bad_records(swapped, good, 1000) == 2
    assert scale.bad_records(ids, good, 120) == 20  # ids past the dataset's end
    assert scale.bad_records(ids, good[:-1], 1000) == 40  # a record missing


def test_the_msgpack_records_decode_as_torchgrain_writes_them():
    from torchgrain.formats.codecs import get_codec

    codec = get_codec("msgpack")
    ids = np.array([0, 1, 2**40, 2**63 - 1])
    for i, raw in zip(ids, scale.msgpack_records(ids)):
        rec = codec.decode(raw.tobytes())
        assert rec == {"id": int(i), "payload": scale.payloads(np.array([i]))[0].tobytes()}


def test_the_memory_fit_recovers_fixed_per_record_and_per_shard_costs():
    def cost(n: int, s: int) -> float:
        return 5e6 + 42 * n + 3000 * s

    pts = [(10**6, 8, cost(10**6, 8)), (10**6, 1000, cost(10**6, 1000))]
    pts.append((125_000, 8, cost(125_000, 8)))
    fixed, per_record, per_shard, note = scale._fit(pts)
    assert fixed == pytest.approx(5e6) and per_record == pytest.approx(42)
    assert per_shard == pytest.approx(3000) and note == ""
    # One record count: the fixed part cannot be told apart, and is said to be counted.
    fixed, per_record, per_shard, note = scale._fit(pts[:2])
    assert fixed == 0 and per_shard == pytest.approx(3000) and "fixed" in note


class _Repeats(scale.Bare):
    """Record ``i`` is the one written as ``min(i, n - 2)``: intact, but one id twice."""

    def __getitems__(self, idx):
        return super().__getitems__([min(i, self.n - 2) for i in idx])


class _Beyond(scale.Bare):
    """The last record carries an id past the dataset's end (with its own payload)."""

    def __getitems__(self, idx):
        return [{**r, "id": self.n + 5} if i == self.n - 1 else r for i, r in zip(idx, super().__getitems__(idx))]  # fmt: skip


@pytest.mark.parametrize(("faulty", "bad"), [(None, 0), (_Repeats, 0), (_Beyond, 2)])
def test_an_epoch_that_misses_or_repeats_a_record_is_not_exact(monkeypatch, faulty, bad):
    n = 1000
    if faulty is not None:
        monkeypatch.setattr(scale, "open_case", lambda spec: faulty(spec["records"]))
    spec = {"loader": "bare", "format": "none", "path": "", "records": n, "workers": 0,
            "sampler": "global", "warmup": 1, "measure": 1, "epochs": 2, "epoch_budget": 60}  # fmt: skip
    out = scale.child(spec)
    assert out["bad"] == bad and len(out["epochs"]) == 2  # one bad record per epoch
    assert out["exact_epochs"] is (faulty is None)
    assert out["rate"] > 0 and out["dirty_main"] > 0


def test_a_tiny_run_writes_results_of_the_documented_shape(tmp_path):
    out = tmp_path / "results"
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--scale", "tiny",
        "--records", "3000", "--ar-shards", "2,8", "--parquet-ratios", "4",
        "--parquet-cache-mib", "0.02", "--row-group-rows", "500", "--tfrecord-records", "800",
        "--tfrecord-shards", "4", "--workers", "0,2", "--rounds", "1", "--warmup", "1",
        "--measure", "3", "--epoch-budget", "60", "--no-peers", "--no-plot",
        "--only", "ar2/tg", "ar8/tg", "pq4x/tg-global",
        "--data-dir", str(tmp_path / "data"), "--out", str(out), "--json", "scale_test",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "scale_test.json").read_text())
    assert doc["benchmark"] == "scale_test" and doc["machine"]["cpu_count"]
    cases = {"bare", "ar2/tg", "ar8/tg", "pq4x/tg-global"}
    assert {(r["case"], r["workers"]) for r in doc["results"]} == {
        (c, w) for c in cases for w in (0, 2)
    }
    for r in doc["results"]:
        assert r["check"] == "ok", r
        assert r["rate"] > 0 and r["first_batch_s"] > 0 and r["pss_total_mib"] > 0
        assert r["epoch1_rate"] > 0  # two whole epochs at this size
    for run in doc["runs"]:
        # every record read was the one written, and each epoch read each id once
        assert run["bad"] == 0 and run["exact_epochs"] and len(run["epochs"]) == 2
        assert len(run["uss_workers"]) == len(run["dirty_workers"]) == run["workers"]
    assert {k: doc["data"][k]["records"] for k in ("ar2", "ar8")} == {"ar2": 3000, "ar8": 3000}
    assert doc["decode_once"]["pq4x"]["rows"] == doc["data"]["pq4x"]["rows"]
    assert set(doc["first_open_s"]) == {"ar2", "ar8", "pq4x"}
    model = {m["loader"]: m for m in doc["memory_model"]}
    assert set(model) == {"arrayrecord/tg"}  # Parquet's memory is a cache, not an index
    assert model["arrayrecord/tg"]["model_records"] == 10**9
    assert model["arrayrecord/tg"]["node_vs_one_proc"] >= 1
    targets = {(t["target"], t["workers"]): t for t in doc["targets"]}
    assert ("ArrayRecord 2,048 shards / 2 shards rate", 0) in targets
    assert ("ArrayRecord private index bytes per record per process", None) in targets
    assert all(t["status"] in ("met", "missed", "not measured") for t in targets.values())
