"""A new user's first hour: their own Parquet dataset of PNG images and text, through the CLI.

The main commands run in a process of their own, as a user types them; the wrong-path
messages go through the same entry point in this process. The dataset is many times the
workers' block cache (``--cache-bytes 0``, row groups of 20 rows), as real datasets are, so
that a shuffled read decodes whole row groups for a few rows. The README's first example
runs as written. ``make newcomer`` (scripts/newcomer.sh) runs the README's two commands
from a clean clone first, then the whole suite, this file included.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.cli import main

cv2 = pytest.importorskip("cv2")

ROOT = Path(__file__).resolve().parents[1]
ROWS, FILES, ROW_GROUP = 2_000, 4, 20
ERROR_LINE = re.compile(r"^torchgrain (inspect|convert|bench): error: \S.*$")


def _env() -> dict[str, str]:
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def torchgrain(*args: str, cwd: Path, umask: int | None = None) -> subprocess.CompletedProcess:
    """``torchgrain ARGS`` in a new process (under ``umask`` when given)."""
    boot = "import os, runpy, sys; "
    if umask is not None:
        boot += f"os.umask({umask:#o}); "
    boot += "sys.argv[0] = 'torchgrain'; runpy.run_module('torchgrain', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", boot, *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def write_png_text_parquet(directory: Path) -> None:
    """2,000 rows of a PNG image (32x32 RGB), a caption and a label, in 4 files."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    for f in range(FILES):
        rows = range(f * ROWS // FILES, (f + 1) * ROWS // FILES)
        images = [
            cv2.imencode(".png", rng.integers(0, 64, (32, 32, 3), dtype=np.uint8) + 16 * (i % 10))[
                1
            ].tobytes()
            for i in rows
        ]
        table = pa.table(
            {
                "image": images,
                "caption": [f"a picture of thing {i % 10}, number {i}" for i in rows],
                "label": [i % 10 for i in rows],
            }
        )
        pq.write_table(table, directory / f"part-{f}.parquet", row_group_size=ROW_GROUP)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A working directory holding ``data/``, the user's Parquet dataset."""
    home = tmp_path_factory.mktemp("newcomer")
    write_png_text_parquet(home / "data")
    return home


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*"))
    }


def test_inspect_convert_and_bench_a_parquet_dataset_of_images_and_text(home):
    r = torchgrain("inspect", "data", cwd=home)
    assert r.returncode == 0, r.stderr
    assert "format      parquet" in r.stdout and "2,000 in 4 shard(s)" in r.stdout
    assert re.search(r"image\s+bytes", r.stdout) and re.search(r"caption\s+str", r.stdout)

    # `torchgrain inspect data | head -0`: the reader is gone before the first line.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchgrain", "inspect", "data"],
        cwd=home,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    assert proc.stderr.read() == b"" and proc.wait(timeout=300) == 141

    # Convert, under a group-writable umask: what a shared project directory uses.
    r = torchgrain("convert", "data", "train", "-q", cwd=home, umask=0o002)
    assert r.returncode == 0, r.stderr
    modes = _modes(home / "train")
    assert "torchgrain.json" in modes and "data-00000-of-00004.array_record" in modes
    for name, mode in modes.items():
        expected = 0o775 if (home / "train" / name).is_dir() else 0o664
        assert mode == expected, f"{name} is {mode:o}, a plain open gives {expected:o}"
    r = torchgrain("inspect", "train", "--samples", "1", cwd=home)
    assert r.returncode == 0 and "2,000 in 4 shard(s)" in r.stdout

    # bench, twice. Each run's advice is what its own numbers bear out: a sampler is
    # recommended only when every round of it beat every round of the other. Between
    # runs the numbers move with the machine's other work, so the advice may go from
    # "faster" to "within the spread", but never turns round.
    args = ["bench", "data", "--batch-size", "64", "--seconds", "2", "--cache-bytes", "0"]
    beats = []
    for _ in range(2):
        r = torchgrain(*args, "--json", cwd=home)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["num_workers"] == min(len(os.sched_getaffinity(0)), 16)
        modes = {m["mode"]: m for m in rep["modes"]}
        for m in modes.values():
            assert len(m["runs"]) == 3
            assert m["records_per_s"] == pytest.approx(sorted(m["runs"])[1], abs=0.1)
            assert (m["records_per_s_min"], m["records_per_s_max"]) == pytest.approx(
                (min(m["runs"]), max(m["runs"])), abs=0.1
            )
        shuffled, block = modes["shuffled"], modes["block-shuffled"]
        won = (
            "block"
            if block["records_per_s_min"] > shuffled["records_per_s_max"]
            else "global"
            if shuffled["records_per_s_min"] > block["records_per_s_max"]
            else "neither"
        )
        beats.append(won)
        named = [t for t in rep["suggestions"] if "ShuffleSampler" in t.split(":")[0]]
        assert len(named) == 1, rep["suggestions"]
        if won == "block":
            assert rep["recommendation"] == "BlockShuffleSampler"
            assert named[0].startswith("use BlockShuffleSampler")
        else:
            assert rep["recommendation"] == "GlobalShuffleSampler"
            assert named[0].startswith("use GlobalShuffleSampler")
            said = "faster than BlockShuffleSampler" if won == "global" else "less than the spread"
            assert said in named[0], named[0]
    assert not {"block", "global"} <= set(beats), beats


def test_every_wrong_path_gets_one_message_naming_the_path_and_the_flag(
    home, tmp_path, monkeypatch, capsys
):
    # One real process, as typed; the other cases run the same entry point in this
    # process (a process each only adds start-up time).
    r = torchgrain("inspect", "nope", cwd=home)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "torchgrain inspect: error: argument PATH: 'nope' does not exist\n"

    mixed = tmp_path / "mixed"
    shutil.copytree(home / "data", mixed)
    tg.write_array_record([{"i": i} for i in range(4)], mixed / "copy")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "part-0.parquet").write_bytes((home / "data" / "part-0.parquet").read_bytes())
    _damage_a_data_page(broken / "part-0.parquet")
    monkeypatch.chdir(home)
    assert main(["convert", "data", str(tmp_path / "taken"), "-q"]) == 0

    cases = [
        (["bench", "nope"], "bench: error: argument PATH: 'nope' does not exist"),
        (["convert", "nope", "out"], "convert: error: argument SRC: 'nope' does not exist"),
        (["inspect", "data/*.pq"], "inspect: error: argument PATH: 'data/*.pq' matches no file"),
        (
            ["inspect", str(mixed)],
            "holds files of several formats (array_record, parquet); open them separately or "
            "pass --format",
        ),
        (["bench", str(mixed)], "several formats (array_record, parquet)"),
        (["convert", str(mixed), "out"], "several formats (array_record, parquet)"),
        (
            ["convert", "data", "data/out"],
            "convert: error: argument DST: the output directory 'data/out' is inside the input "
            "directory 'data'",
        ),
        (["convert", "data", str(tmp_path / "taken"), "--to", "parquet"], "pass --overwrite"),
        (["convert", "data", "out", "--codec", "raw"], "--codec applies to"),
        (["convert", str(broken), "out"], "cannot decode row group"),
    ]
    for args, expected in cases:
        assert main(args) == 2, args
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 1 and ERROR_LINE.match(lines[0]), (args, err)
        assert expected in lines[0], (args, lines[0])
        assert "=" not in lines[0].split("error: ", 1)[1].replace("==", ""), lines[0]
        assert out == ""
    assert not (home / "out").exists()  # no failed convert left a folder behind
    assert not (home / "data" / "out").exists()
    assert sorted(os.listdir(home / "data")) == [f"part-{f}.parquet" for f in range(FILES)]

    with pytest.raises(SystemExit) as e:
        main(["bench", "data", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: torchgrain bench")
    assert "torchgrain bench: error: unrecognized arguments: --bogus" in err

    for command in ("inspect", "convert", "bench", "demo"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0 and "(default: " in capsys.readouterr().out, command


def _damage_a_data_page(path: Path) -> None:
    """Overwrite bytes inside row group 3's first data page (the footer stays valid)."""
    column = pq.ParquetFile(path).metadata.row_group(3).column(0)
    raw = bytearray(path.read_bytes())
    for k in range(column.data_page_offset + 20, column.data_page_offset + 60):
        raw[k] ^= 0xFF
    path.write_bytes(bytes(raw))


def readme_first_example() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n", text.index("\n## Use it")) + len("```python\n")
    return text[start : text.index("```\n", start)]


def test_the_readme_first_example_runs_as_written(tmp_path):
    (tmp_path / "example.py").write_text(readme_first_example())
    r = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "512 ['image', 'label']" in r.stdout
    assert "last batch: (64, 3, 56, 56) torch.uint8 (64,) torch.int64" in r.stdout
    assert "Warning" not in r.stderr, r.stderr  # e.g. pin_memory without a GPU
    assert (tmp_path / "out" / "train" / "torchgrain.json").is_file()


# ------------------------------------------------ errors that point at the right place
def _forgot_return(record):
    record["label"] = record["label"] + 1  # and no `return`


def test_a_map_function_returning_none_is_named_before_the_next_one_runs():
    ds = tg.Dataset([{"label": 1}, {"label": 2}]).map(_forgot_return)
    ds = ds.random_map(lambda r, rng: {**r, "x": rng.random()}, seed=0)
    with pytest.raises(TypeError) as e:
        ds[1]
    msg = str(e.value)
    assert "map function tests.test_newcomer._forgot_return" in msg or "_forgot_return (" in msg
    line = _forgot_return.__code__.co_firstlineno
    assert f"{__file__}:{line}" in msg
    assert "returned None for record index 1" in msg
    assert "not subscriptable" not in msg


def test_none_from_the_last_function_is_the_record():
    # A collate_fn may drop such records: None from the last function is not an error.
    assert tg.Dataset([{"a": 1}]).map(lambda r: None)[0] is None


def _decode_batch(batch):
    """A map_batch decoding every image of a column batch with tg.decode_image."""
    decode = tg.decode_image("image")
    return {**batch, "image": [decode({"image": b})["image"] for b in batch["image"]]}


@pytest.mark.parametrize(
    ("batch_format", "how"),
    [("records", "map"), ("columns", "map"), ("columns", "map_batch")],
)
def test_png_decoding_inside_a_map_counts_as_decode_not_transform(batch_format, how):
    rng = np.random.default_rng(0)
    pngs = [
        {"image": cv2.imencode(".png", rng.integers(0, 256, (384, 384, 3), np.uint8))[1].tobytes()}
        for _ in range(12)
    ]
    ds = tg.Dataset(pngs, batch_format=batch_format)
    ds = ds.map(tg.decode_image("image")) if how == "map" else ds.map_batch(_decode_batch)
    t0 = time.perf_counter()
    ds.__getitems__(list(range(12)))
    wall = time.perf_counter() - t0
    row = tg.stats(ds).total
    # The source (a list) decodes nothing: all of this is tg.decode_image's.
    assert row["decode_seconds"] > 0
    # Counted once: under decode, not also under transform.
    assert row["decode_seconds"] + row["transform_seconds"] <= wall, (row, wall)


def test_the_stats_table_says_what_each_column_counts():
    ds = tg.Dataset([{"a": 1}] * 4)
    ds.__getitems__([0, 1])
    text = str(tg.stats(ds))
    header = text.splitlines()[:3]
    assert header[0].startswith("read MB, read s: bytes the source read (after decompression")
    assert "decode s: bytes to records and images" in header[1]
    assert "transform s: the other map functions" in header[1]
    assert header[2].split() == [
        "process", "records", "read", "MB", "read", "s", "decode", "s", "transform", "s",
        "cache", "hit/miss",
    ]  # fmt: skip


def _same_batch(batch):
    return batch


@pytest.mark.parametrize(
    ("batch_format", "then"),
    [("records", "map_batch"), ("columns", "map_batch"), ("columns", None)],
    ids=["before-map_batch", "before-map_batch-columns", "last-of-columns"],
)
def test_none_is_named_wherever_a_record_is_needed_after_it(batch_format, then):
    # Before a map_batch, or as the last record of a column batch, None is no record.
    ds = tg.Dataset([{"label": 1}, {"label": 2}], batch_format=batch_format).map(_forgot_return)
    if then:
        ds = ds.map_batch(_same_batch)
    named = (
        r"map function (tests\.)?test_newcomer\._forgot_return .* returned None for record index"
    )
    with pytest.raises(TypeError, match=named + " 0 "):
        ds.__getitems__([0, 1])
    if then:
        with pytest.raises(TypeError, match=named + " 1 "):
            ds[1]
