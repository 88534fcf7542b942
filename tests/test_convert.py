"""tg.convert / `torchgrain convert`: lossless, verified, parallel, resumable."""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.cli import main
from torchgrain.convert import JOURNAL_DIR, RecordHasher, records_to_table, verify_shard
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import index_tfrecord, write_tfrecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_same(a, b, where=""):
    """Deep equality that also checks numpy dtypes (0-d arrays equal numpy scalars)."""
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {a} != {b}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def all_records(src):
    return src.__getitems__(list(range(len(src))))


def value_table(n: int, offset: int = 0) -> pa.Table:
    """Every value type torchgrain round-trips through msgpack, with nulls."""
    i = np.arange(offset, offset + n)
    return pa.table(
        {
            "i8": pa.array(i.astype(np.int8)),
            "u16": pa.array(i.astype(np.uint16)),
            "i64": pa.array(i * 1_000_000_007),
            "u64": pa.array(i.astype(np.uint64) + np.uint64(2**63)),
            "f32": pa.array(i.astype(np.float32) / 3),
            "f64": pa.array(np.where(i % 5 == 0, np.nan, i / 7)),
            "flag": pa.array(i % 2 == 0),
            "text": pa.array([f"héllo {k}" if k % 4 else None for k in i]),
            "blob": pa.array([bytes([k % 256]) * (k % 5) for k in i], pa.binary()),
            "vec": pa.array(
                [np.arange(k % 4, dtype=np.float32) for k in i], pa.list_(pa.float32())
            ),
            "mat": pa.array(
                [[[k, k + 1], [k + 2, k + 3]] for k in i], pa.list_(pa.list_(pa.int16()))
            ),
            "tags": pa.array([[f"t{k}", "u"] for k in i], pa.list_(pa.string())),
            "pt": pa.array([{"x": int(k), "y": f"{k}"} for k in i]),
            "ts": pa.array(
                [datetime.datetime(2024, 1, 1) + datetime.timedelta(seconds=int(k)) for k in i],
                pa.timestamp("us"),
            ),
            "none": pa.nulls(n),
        }
    )


@pytest.fixture
def parquet_dir(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    for s, n in enumerate([37, 0, 50, 13]):
        pq.write_table(value_table(n, s * 100), d / f"part-{s}.parquet", row_group_size=16)
    return str(d)


def test_parquet_to_array_record_is_lossless(parquet_dir, tmp_path):
    src = tg.ParquetSource(parquet_dir)
    m = tg.convert(parquet_dir, tmp_path / "out")
    out = tg.ArrayRecordSource(tmp_path / "out")
    assert len(out) == len(src) == 100 and m.num_records == 100
    assert [s.num_records for s in m.shards] == [37, 0, 50, 13]  # match_shards by default
    for k, (a, b) in enumerate(zip(all_records(src), all_records(out))):
        assert_same(a, b, f"record {k}")
    assert out.schema["vec"].startswith("float32[") and out.schema["text"] == "null|str"


def test_num_shards_contiguous_and_match_shards(parquet_dir, tmp_path):
    a = tg.convert(parquet_dir, tmp_path / "a", num_shards=3)
    b = tg.convert(parquet_dir, tmp_path / "b", match_shards=True)
    assert [s.num_records for s in a.shards] == [33, 33, 34]
    assert len(b.shards) == 4
    ra, rb = (
        all_records(tg.ArrayRecordSource(tmp_path / "a")),
        all_records(tg.ArrayRecordSource(tmp_path / "b")),
    )
    for k, (x, y) in enumerate(zip(ra, rb)):
        assert_same(x, y, f"record {k}")
    with pytest.raises(ValueError, match="either"):
        tg.convert(parquet_dir, tmp_path / "c", num_shards=2, match_shards=True)
    with pytest.raises(ValueError, match="holds input files"):
        tg.convert(parquet_dir, parquet_dir)


def test_checksums_are_stored_and_verified(parquet_dir, tmp_path):
    m = tg.convert(parquet_dir, tmp_path / "out", num_shards=2)
    manifest = json.loads((tmp_path / "out" / "torchgrain.json").read_text())
    assert all(s["checksum"].startswith("blake2b-records:") for s in manifest["shards"])
    from torchgrain.formats.arrayrecord_file import ArrayRecordFile

    for s in m.shards:
        path = str(tmp_path / "out" / s.path)
        verify_shard(path, s.num_records, s.checksum)
        f = ArrayRecordFile(path)
        assert RecordHasher.of(list(f.read(np.arange(s.num_records)))) == s.checksum
        with pytest.raises(tg.CorruptDataError, match="expected"):
            verify_shard(path, s.num_records + 1)
        with pytest.raises(tg.CorruptDataError, match="checksum"):
            verify_shard(path, s.num_records, RecordHasher.of([b"x"]))


def test_two_workers_equal_one(parquet_dir, tmp_path):
    m1 = tg.convert(parquet_dir, tmp_path / "w1", num_shards=5, workers=1)
    m2 = tg.convert(parquet_dir, tmp_path / "w2", num_shards=5, workers=2)
    assert [(s.path, s.num_records, s.checksum) for s in m1.shards] == [
        (s.path, s.num_records, s.checksum) for s in m2.shards
    ]
    for s in m1.shards:
        assert (tmp_path / "w1" / s.path).read_bytes() == (tmp_path / "w2" / s.path).read_bytes()


def test_parquet_output_round_trips(parquet_dir, tmp_path):
    m = tg.convert(parquet_dir, tmp_path / "ar", num_shards=2)
    mp = tg.convert(tmp_path / "ar", tmp_path / "pqout", to="parquet", workers=2)
    assert [s.num_records for s in mp.shards] == [s.num_records for s in m.shards]
    assert all(s.checksum.startswith("blake2b-file:") for s in mp.shards)
    files = sorted(glob.glob(str(tmp_path / "pqout" / "*.parquet")))
    assert [os.path.basename(f) for f in files] == [
        "data-00000-of-00002.parquet",
        "data-00001-of-00002.parquet",
    ]
    back = tg.ParquetSource(tmp_path / "pqout")
    src = tg.ParquetSource(parquet_dir)
    for k, (a, b) in enumerate(zip(all_records(src), all_records(back))):
        # Struct and timestamp columns come back from msgpack as map / 0-d datetime64.
        for key in ("i8", "u16", "i64", "f32", "f64", "flag", "text", "blob", "vec", "tags"):
            assert_same(a[key], b[key], f"record {k}.{key}")
        assert np.array_equal(np.asarray(b["mat"]), np.asarray(a["mat"]))


def test_records_to_table_arrays_and_row_groups(tmp_path):
    recs = [{"x": np.full((2, 3), k, np.uint8), "s": np.float32(k)} for k in range(5)]
    recs.append({"x": None, "s": None})
    t = records_to_table(recs)
    assert t.schema.field("x").type == pa.list_(pa.list_(pa.uint8()))
    assert t.schema.field("s").type == pa.float32()
    assert t.column("x")[1].as_py() == [[1, 1, 1], [1, 1, 1]] and t.column("x")[5].as_py() is None
    with pytest.raises(TypeError, match="'x'"):
        records_to_table([{"x": np.zeros(2, np.uint8)}, {"x": np.zeros(2, np.int64)}])
    # Many small records: row groups bounded by bytes.
    d = tmp_path / "ar"
    tg.write_array_record([{"v": np.zeros(1000, np.uint8)} for _ in range(3000)], d)
    tg.convert(d, tmp_path / "pq", to="parquet", row_group_bytes=1 << 20)
    md = pq.read_metadata(glob.glob(str(tmp_path / "pq" / "*.parquet"))[0])
    assert md.num_rows == 3000 and md.num_row_groups >= 2


# ------------------------------------------------------------------------- TFRecord
def write_tf_shards(d, sizes, *, gz=False):
    d.mkdir(parents=True, exist_ok=True)
    k = 0
    paths = []
    for s, n in enumerate(sizes):
        recs = []
        for _ in range(n):
            recs.append(encode_tf_example({"id": k, "x": np.arange(k % 3, dtype=np.float32)}))
            k += 1
        p = d / f"train-{s:05d}-of-{len(sizes):05d}.tfrecord{'.gz' if gz else ''}"
        write_tfrecord(recs, p)
        paths.append(p)
    return paths


@pytest.mark.parametrize("gz", [False, True])
def test_tfrecord_to_array_record_resharded(tmp_path, gz):
    write_tf_shards(tmp_path / "tf", [10, 25, 0, 7], gz=gz)
    m = tg.convert(tmp_path / "tf", tmp_path / "out", num_shards=5, workers=2 if gz else 1)
    assert [s.num_records for s in m.shards] == [8, 8, 9, 8, 9]
    out = tg.ArrayRecordSource(tmp_path / "out")
    ids = [int(r["id"][0]) for r in all_records(out)]
    assert ids == list(range(42))
    assert out[5]["x"].dtype == np.float32 and out[5]["x"].tolist() == [0.0, 1.0]


def test_tfrecord_raw_codec_keeps_bytes(tmp_path):
    p = tmp_path / "tf" / "a.tfrecord"
    p.parent.mkdir()
    write_tfrecord([b"\xffnot a proto", b"abc"], p)
    tg.convert(p, tmp_path / "out", codec="raw")
    assert [r["bytes"] for r in all_records(tg.ArrayRecordSource(tmp_path / "out"))] == [
        b"\xffnot a proto",
        b"abc",
    ]


def test_tfrecord_bad_crc_names_file_and_offset_and_leaves_no_shard(tmp_path):
    paths = write_tf_shards(tmp_path / "tf", [5, 6])
    offsets = index_tfrecord(paths[1])
    raw = bytearray(paths[1].read_bytes())
    raw[int(offsets[3]) + 14] ^= 0xFF  # a data byte of record 3
    paths[1].write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(tg.CorruptDataError) as e:
        tg.convert(tmp_path / "tf", out)
    msg = str(e.value)
    assert str(paths[1]) in msg and f"byte offset {offsets[3]}" in msg
    names = sorted(os.listdir(out))
    assert names == [JOURNAL_DIR, "data-00000-of-00002.array_record"]  # shard 0 finished
    assert not (out / "torchgrain.json").exists()
    with pytest.raises(tg.CorruptDataError):  # a rerun fails the same way, still no shard 1
        tg.convert(tmp_path / "tf", out, workers=2)
    assert sorted(os.listdir(out)) == names


# ------------------------------------------------------------------------- resume
def test_resume_skips_finished_shards(parquet_dir, tmp_path):
    out = tmp_path / "out"
    m = tg.convert(parquet_dir, out, num_shards=4)
    first = out / m.shards[0].path
    stamp = first.stat().st_mtime_ns
    # Simulate a crash after shard 0: drop the others and the manifest.
    for s in m.shards[1:]:
        (out / s.path).unlink()
        (out / JOURNAL_DIR / f"shard-{m.shards.index(s):05d}.json").unlink()
    (out / "torchgrain.json").unlink()
    (out / f".{m.shards[2].path}.tmp-1-dead").write_bytes(b"partial")
    m2 = tg.convert(parquet_dir, out, num_shards=4)
    assert first.stat().st_mtime_ns == stamp
    assert [s.checksum for s in m2.shards] == [s.checksum for s in m.shards]
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    with pytest.raises(FileExistsError, match="other inputs or options"):
        tg.convert(parquet_dir, out, num_shards=3)
    m3 = tg.convert(parquet_dir, out, num_shards=3, overwrite=True)
    assert len(m3.shards) == 3 and len(glob.glob(str(out / "*.array_record"))) == 3


def test_refuses_to_overwrite_a_dataset(tmp_path, parquet_dir):
    tg.write_array_record([{"a": 1}], tmp_path / "ds")
    with pytest.raises(FileExistsError):
        tg.convert(parquet_dir, tmp_path / "ds")
    tg.convert(parquet_dir, tmp_path / "ds", overwrite=True)
    assert len(tg.ArrayRecordSource(tmp_path / "ds")) == 100


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies excluded)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(name))
    return pids


def _wait_until_gone(sid: int, timeout: float) -> list[int]:
    """Wait for session ``sid`` to end; kill and return what is still there at ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


KILL_SCRIPT = """
import sys, numpy as np, torchgrain as tg
tg.convert(sys.argv[1], sys.argv[2], num_shards=int(sys.argv[3]), workers=2, progress=False)
"""


def test_kill_9_mid_run_then_rerun(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    recs = [{"x": rng.integers(0, 255, 20_000, dtype=np.uint8), "i": k} for k in range(1200)]
    tg.write_array_record(recs, src, num_shards=4)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(src), str(out), "24"],
        env=env,
        start_new_session=True,
    )
    journal = out / JOURNAL_DIR
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.is_dir() and any(n.startswith("shard-") for n in os.listdir(journal)):
            break
        time.sleep(0.005)
    killed = proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed, "the conversion finished before it could be killed"
    # Its worker processes (forked from a fork server, not from it) end with it.
    left = _wait_until_gone(proc.pid, timeout=120)
    assert not left, f"processes {left} outlived the converting process"
    assert not (out / "torchgrain.json").exists()
    done_before = {n for n in os.listdir(journal) if n.startswith("shard-")}
    assert done_before
    m = tg.convert(src, out, num_shards=24, workers=2)
    ref = tg.convert(src, tmp_path / "ref", num_shards=24)
    assert [(s.num_records, s.checksum) for s in m.shards] == [
        (s.num_records, s.checksum) for s in ref.shards
    ]
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    back = tg.ArrayRecordSource(out)
    assert [r["i"] for r in back.__getitems__([0, 599, 1199])] == [0, 599, 1199]


def test_sigterm_mid_run_cleans_up_as_ctrl_c_does(tmp_path):
    # A job scheduler stops a job with SIGTERM: the first run's half-written shard and
    # the folders it created go, as after Ctrl-C, and the status says which signal.
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(10_000) for _ in range(64)]
    table = pa.table({"b": [blobs[k % 64] for k in range(6000)], "i": np.arange(6000)})
    pq.write_table(table, src / "a.parquet", row_group_size=500)
    out = tmp_path / "new" / "out"
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torchgrain", "convert", str(src), str(out), "-q"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.is_dir() and any(".tmp-" in n for n in os.listdir(out)):
            break
        time.sleep(0.002)
    running = proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    assert running, "the conversion finished before it could be stopped"
    assert rc == 128 + signal.SIGTERM
    assert not (tmp_path / "new").exists(), [str(p) for p in (tmp_path / "new").rglob("*")]
    assert not _wait_until_gone(proc.pid, timeout=60)


# ------------------------------------------------------------------------- CLI
def test_cli_convert_and_inspect(parquet_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", parquet_dir, str(out), "--num-shards", "2", "-q"]) == 0
    assert main(["inspect", str(out), "--json", "--samples", "1"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_records"] == 100 and info["format"] == "array_record"
    assert [s["num_records"] for s in info["shards"]] == [50, 50]
    assert info["keys"]["vec"] == "float32[0]" and info["samples"][0]["i64"] == "0"
    assert all(s["checksum"].startswith("blake2b") for s in info["shards"])
    assert main(["convert", parquet_dir, str(out), "--num-shards", "3"]) == 2
    assert "overwrite" in capsys.readouterr().err
    # inspect on Parquet and TFRecord inputs
    assert main(["inspect", parquet_dir, "--samples", "1"]) == 0
    text = capsys.readouterr().out
    assert "format      parquet" in text and "part-2.parquet" in text
    write_tf_shards(tmp_path / "tf", [3, 4])
    assert main(["inspect", str(tmp_path / "tf"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "tfrecord" and info["codec"] == "tf_example"
    assert info["num_records"] == 7 and info["keys"]["id"] == "int64[1]"
    assert main(["convert", str(tmp_path / "tf"), str(tmp_path / "o2"), "--to", "parquet"]) == 0
    assert "wrote 7 records in 2 parquet shard(s)" in capsys.readouterr().out
