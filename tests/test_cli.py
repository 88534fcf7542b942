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
from torchgrain.bench import recommend, record_nbytes, suggest
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


def test_bench_prints_rates_spread_stats_and_suggestions(ar_dataset, capsys):
    rc = main(["bench", ar_dataset, "--workers", "2", "--batch-size", "16", "--seconds", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "200 records in 3 shard(s)" in out
    for word in ("sequential", "shuffled", "records/s", "spread", "record MB/s", "worker 1"):
        assert word in out
    # a line per measurement (3 rounds of each order), before the table
    assert out.count("round 3/3") == 2 and out.index("round 1/3") < out.index("spread")
    assert "suggestions" in out
    tips = out.split("suggestions", 1)[1]
    assert "  - " in tips


def test_bench_json_reports_every_round_and_the_median(ar_dataset, capsys):
    rc = main(
        ["bench", ar_dataset, "--workers", "1", "--batch-size", "8", "--seconds", "0.6", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["format"] == "array_record"
    assert report["num_records"] == 200
    assert report["recommendation"] == "GlobalShuffleSampler"  # no block shuffle measured
    modes = {m["mode"]: m for m in report["modes"]}
    assert {"sequential", "shuffled"} <= set(modes)
    for m in modes.values():
        assert m["records"] > 0 and m["records_per_s"] > 0
        assert len(m["runs"]) == 3
        assert m["records_per_s_min"] <= m["records_per_s"] <= m["records_per_s_max"]
        assert sorted(m["runs"])[1] == pytest.approx(m["records_per_s"], abs=0.1)
        # 64 float32 + one int per record
        assert m["bytes_per_record"] == pytest.approx(64 * 4 + 8)
        assert "worker 0" in m["workers"]
    assert isinstance(report["suggestions"], list) and report["suggestions"]


def test_bench_without_workers_suggests_workers(ar_dataset, capsys):
    rc = main(["bench", ar_dataset, "--workers", "0", "--batch-size", "32", "--seconds", "0.4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "use worker processes" in out


def test_bench_uses_one_worker_per_cpu_this_process_may_use(ar_dataset, capsys):
    from torchgrain.bench import MAX_DEFAULT_WORKERS

    rc = main(["bench", ar_dataset, "--batch-size", "32", "--seconds", "0.3", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["num_workers"] == min(len(os.sched_getaffinity(0)), MAX_DEFAULT_WORKERS)


def test_bench_prints_each_measurement_as_it_finishes(ar_dataset):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTHONUNBUFFERED", None)  # stdout into a pipe is block-buffered, as for users
    cmd = [sys.executable, "-m", "torchgrain", "bench", ar_dataset, "--workers", "0"]
    cmd += ["--batch-size", "8", "--seconds", "6"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env) as proc:
        seen = b""
        while b"round 1/3" not in seen:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            assert chunk, "no progress line"
            seen += chunk
        # What had arrived with the first measurement's line: not the rest of the run
        # (about 5 s more of measuring), as it would be if output were held back.
        assert b"round 2/3" not in seen and b"suggestions" not in seen
        rest = proc.stdout.read()
    assert proc.returncode == 0 and b"suggestions" in rest


def test_bench_rejects_bad_arguments_with_its_own_usage(ar_dataset, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", ar_dataset, "--batch-size", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage: torchgrain bench" in err and "argument --batch-size" in err
    with pytest.raises(SystemExit) as e:
        main(["bench", ar_dataset, "--bogus", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage: torchgrain bench" in err and "unrecognized arguments: --bogus 1" in err


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "{p}"],
        ["bench", "{p}"],
        ["convert", "{p}", "{tmp}/out"],
        ["inspect", "{tmp}/*.parquet"],
    ],
    ids=["inspect", "bench", "convert", "inspect-glob"],
)
def test_a_missing_path_gets_one_message_naming_the_path_and_the_argument(
    command, tmp_path, capsys
):
    missing = str(tmp_path / "nope")
    args = [a.format(p=missing, tmp=tmp_path) for a in command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    arg = "SRC" if command[0] == "convert" else "PATH"
    if "*" in args[1]:
        assert err == f"torchgrain {command[0]}: error: argument {arg}: {args[1]!r} matches no file"
    else:
        assert err == f"torchgrain {command[0]}: error: argument {arg}: {missing!r} does not exist"
    assert not (tmp_path / "out").exists()  # a failed convert creates nothing


def test_a_folder_of_several_formats_is_never_read_as_one_of_them(tmp_path, capsys):
    d = tmp_path / "mixed"
    tg.write_parquet([{"i": i} for i in range(4)], d)
    tg.write_array_record([{"i": i} for i in range(4)], d / "sub")
    for cmd in (["inspect", str(d)], ["bench", str(d)], ["convert", str(d), str(tmp_path / "o")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "array_record, parquet" in err and "--format" in err, err
        assert "format=" not in err
    assert main(["inspect", str(d), "--format", "parquet", "--samples", "0"]) == 0
    assert "format      parquet" in capsys.readouterr().out


def test_cli_errors_name_flags_not_python_arguments(tmp_path, capsys):
    src = tmp_path / "src"
    tg.write_parquet([{"i": i} for i in range(4)], src)
    assert main(["convert", str(src), str(tmp_path / "out"), "-q"]) == 0
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=" not in err
    assert main(["convert", str(src), str(tmp_path / "o2"), "--codec", "raw"]) == 2
    err = capsys.readouterr().err
    assert "--codec" in err and "codec=" not in err
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["inspect", "{src}", "--codec", "raw"], "--codec applies to"),
        (["convert", "{src}", "{tmp}/o", "--to", "parquet", "--compression", "zstd:3"], "zstd:3"),
        (["convert", "{src}", "{tmp}/o", "--to", "parquet", "--compression", "lzo"], "'lzo'"),
        (["convert", "{src}", "{tmp}/file"], "argument DST: '{tmp}/file' is not a directory"),
        (["convert", "{src}", "{tmp}/file/o"], "argument DST: '{tmp}/file/o' is not a directory"),
    ],
    ids=["codec-on-parquet", "parquet-level", "parquet-lzo", "dst-a-file", "dst-under-a-file"],
)
def test_an_option_or_output_that_cannot_apply_is_a_one_line_error(
    args, expected, tmp_path, capsys
):
    src = tmp_path / "src"
    tg.write_parquet([{"i": i} for i in range(4)], src)
    (tmp_path / "file").write_text("mine")
    args = [a.format(src=src, tmp=tmp_path) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"torchgrain {args[0]}: error: "), err
    assert expected.format(tmp=tmp_path) in err
    assert not (tmp_path / "o").exists() and (tmp_path / "file").read_text() == "mine"


def test_convert_refuses_an_output_inside_its_input(tmp_path, capsys):
    data = tmp_path / "data"
    tg.write_parquet([{"i": i} for i in range(4)], data)
    before = sorted(os.listdir(data))
    assert main(["convert", str(data), str(data / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchgrain convert: error: argument DST: ")
    assert repr(str(data / "out")) in err and repr(str(data)) in err
    assert sorted(os.listdir(data)) == before  # nothing created
    with pytest.raises(ValueError, match="inside the input directory"):
        tg.convert(data, data / "sub" / "out")
    with pytest.raises(ValueError, match="inside the output directory"):
        tg.convert(data, tmp_path)
    assert sorted(os.listdir(data)) == before


def test_convert_refuses_an_output_holding_an_input_file_however_it_is_named(tmp_path, capsys):
    data = tmp_path / "data"
    tg.write_parquet([{"i": i} for i in range(4)], data)
    (tmp_path / "link").symlink_to(data)
    outer = tmp_path / "outer"
    tg.write_parquet([{"i": i} for i in range(4)], outer / "in")
    name = os.listdir(data)[0]
    cases = [
        (tmp_path / "link" / name, data),  # the file's folder, through a link
        (outer / "in" / name, outer),  # a file deeper inside the output
        (outer / "in" / "*.parquet", outer),  # a glob's files
    ]
    for src, dst in cases:
        before = sorted(os.listdir(dst))
        assert main(["convert", str(src), str(dst), "-q"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("torchgrain convert: error: argument DST: "), (src, err)
        assert "inside the output directory" in err and len(err.splitlines()) == 1, err
        assert sorted(os.listdir(dst)) == before  # nothing written


def test_a_failed_convert_removes_only_the_folders_it_created(tmp_path):
    from torchgrain.formats.tfrecord import index_tfrecord, write_tfrecord

    src = tmp_path / "tf"
    src.mkdir()
    path = src / "a.tfrecord"
    write_tfrecord([b"record %d" % i for i in range(5)], path)
    raw = bytearray(path.read_bytes())
    raw[int(index_tfrecord(path)[2]) + 14] ^= 0xFF  # a data byte of record 2
    path.write_bytes(bytes(raw))
    out = tmp_path / "new" / "out"
    with pytest.raises(tg.CorruptDataError):
        tg.convert(src, out, codec="raw")
    assert not (tmp_path / "new").exists()  # both levels were created by the failed run
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(tg.CorruptDataError):
        tg.convert(src, kept, codec="raw")
    assert kept.is_dir() and os.listdir(kept) == []  # existed before: stays, emptied of ours


def test_a_failed_parallel_convert_never_leaves_shards_without_their_journal(tmp_path):
    # One worker fails at once on a corrupt file while the other is still writing a
    # large shard, which it finishes: the journal must stay with it (a rerun resumes),
    # never be removed as if nothing had been done.
    from torchgrain.formats.tfrecord import index_tfrecord, write_tfrecord

    src = tmp_path / "tf"
    src.mkdir()
    blob = bytes(range(256)) * 40
    write_tfrecord([blob + b"%d" % i for i in range(4000)], src / "a.tfrecord")
    bad = src / "b.tfrecord"
    write_tfrecord([b"record %d" % i for i in range(5)], bad)
    raw = bytearray(bad.read_bytes())
    raw[int(index_tfrecord(bad)[0]) + 14] ^= 0xFF  # a data byte of record 0
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(tg.CorruptDataError):
        tg.convert(src, out, codec="raw", workers=2, progress=False)
    shards = [n for n in os.listdir(out) if n.endswith(".array_record")] if out.exists() else []
    if shards:
        assert (out / ".torchgrain-convert" / "plan.json").is_file(), os.listdir(out)
    else:
        assert not out.exists()


def test_inspect_into_a_closed_pipe_ends_quietly_like_a_unix_tool(ar_dataset):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchgrain", "inspect", ar_dataset, "--samples", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # the reader is gone before the first line (as `| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, as a shell reports `yes | head`
    assert err == ""


def test_help_shows_defaults(capsys):
    for command, default in (("bench", "(default: 256)"), ("demo", "(default: 10000)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert default in " ".join(capsys.readouterr().out.split())


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


def _spread(m, lo, hi):
    return {**m, "records_per_s_min": lo, "records_per_s_max": hi}


def test_suggest_slow_parquet_shuffle_names_the_remedies():
    tips = suggest(
        [_mode("sequential", 1000.0), _mode("shuffled", 100.0), _mode("block-shuffled", 800.0)],
        fmt="parquet",
        num_workers=4,
        batch_size=256,
        cpu_count=4,
    )
    text = " ".join(tips)
    assert "use BlockShuffleSampler" in text and "it read 800 records/s, 8.0x" in text
    assert "group_size 1" in text and "cache_bytes" in text


def test_suggest_follows_the_measured_shuffles_whatever_the_sequential_rate():
    # The run: a sequential rate far below both shuffles (a disturbed round).
    modes = [
        _mode("sequential", 254.0),
        _mode("shuffled", 160.0),
        _mode("block-shuffled", 18_500.0),
    ]
    tips = suggest(modes, fmt="parquet", num_workers=2, batch_size=256, cpu_count=2)
    assert recommend(modes) == "BlockShuffleSampler"
    assert not any("GlobalShuffleSampler" in t.split(":")[0] for t in tips)


@pytest.mark.parametrize(
    ("shuffled", "block", "expected", "says"),
    [
        ((100, 90, 110), (900, 850, 950), "BlockShuffleSampler", "use BlockShuffleSampler"),
        ((900, 850, 950), (100, 90, 110), "GlobalShuffleSampler", "faster than BlockShuffle"),
        ((100, 60, 140), (120, 90, 160), "GlobalShuffleSampler", "less than the spread"),
        ((120, 90, 160), (100, 60, 140), "GlobalShuffleSampler", "less than the spread"),
    ],
    ids=["block-faster", "global-faster", "block-ahead-within-spread", "global-ahead-within"],
)
def test_suggest_never_recommends_what_measured_slower(shuffled, block, expected, says):
    modes = [
        _spread(_mode("sequential", 1000.0), 900.0, 1100.0),
        _spread(_mode("shuffled", float(shuffled[0])), *map(float, shuffled[1:])),
        _spread(_mode("block-shuffled", float(block[0])), *map(float, block[1:])),
    ]
    tips = suggest(modes, fmt="parquet", num_workers=2, batch_size=256, cpu_count=2)
    assert recommend(modes) == expected
    advice = [t for t in tips if "ShuffleSampler" in t.split(":")[0]]
    assert len(advice) == 1 and expected in advice[0].split(":")[0] and says in advice[0]


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
    assert any(
        t.startswith("use GlobalShuffleSampler: a global shuffle costs little") for t in tips
    )
    assert any(t.startswith("raise the batch size") for t in tips)


def test_record_nbytes_counts_payloads():
    rec = {"a": np.zeros((2, 3), np.float64), "s": "abcd", "n": [1, 2], "t": None}
    assert record_nbytes(rec) == 48 + 4 + 16 + 8
