"""`torchgrain demo`: the main job end to end, with real DataLoader workers."""

import subprocess
import sys

import pytest

from torchgrain.cli import main
from torchgrain.demo import EpochResult, explain_first_epoch, run_demo


def test_demo_cli_trains_and_reports(tmp_path, capsys):
    args = [
        "demo",
        "--data-dir",
        str(tmp_path / "d"),
        "--num-records",
        "256",
        "--batch-size",
        "32",
        "--workers",
        "2",
        "--epochs",
        "2",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "data wait" in out and "worker 1" in out
    assert "over 16 steps" in out  # 256 / 32 x 2 epochs
    assert "epoch 0: 8 steps in " in out and "epoch 1: 8 steps in " in out
    # a second run reuses the dataset: not one of its files is written again
    files = sorted((tmp_path / "d").iterdir())
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in files}
    assert main(args) == 0
    assert "16 steps" in capsys.readouterr().out
    files = sorted((tmp_path / "d").iterdir())
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in files} == before


def test_console_script_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "torchgrain", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for cmd in ("demo", "inspect", "convert"):
        assert cmd in out


def test_demo_shows_progress_within_each_epoch_and_explains_the_first(tmp_path):
    lines = []
    result = run_demo(
        str(tmp_path / "d"),
        num_records=192,
        batch_size=32,
        num_workers=2,
        epochs=3,
        log=lines.append,
        progress_every=0.0,  # a progress line after every step
    )
    text = "\n".join(lines)
    progress = [x for x in lines if x.startswith("  epoch ")]
    assert len(progress) == 3 * 6
    assert all("steps/s" in x and "samples/s" in x and "data wait" in x for x in progress)
    assert [e.steps for e in result.epochs] == [6, 6, 6]
    assert all(len(e.step_seconds) == 6 for e in result.epochs)
    for k in range(3):
        assert f"epoch {k}: 6 steps in " in text
    # One line says how the first epoch compares with the pace of the later ones.
    why = [x for x in lines if x.startswith("epoch 0 ") and "later epochs" in x]
    assert len(why) == 1
    assert result.epochs[0].first_batch_seconds > 0


def test_the_first_epoch_is_explained_part_by_part():
    def epoch(i, waits, steps, first):
        return EpochResult(i, len(steps), 32 * len(steps), waits + sum(steps), waits, steps, first)

    later = epoch(1, 0.1, [0.1] * 10, 0.01)
    slow_start = epoch(0, 2.1, [0.1] * 10, 2.0)
    assert "2.0s starting 2 workers until the first batch" in explain_first_epoch(
        [slow_start, later], 2
    )
    busy_cpu = epoch(0, 0.1, [0.3] * 10, 0.01)
    text = explain_first_epoch([busy_cpu, later], 2)
    assert "in the steps themselves" in text and "starting" not in text
    same = epoch(0, 0.1, [0.1] * 10, 0.01)
    assert "ran at the pace of the later epochs" in explain_first_epoch([same, later], 2)


def test_the_parts_of_the_first_epoch_add_up_to_its_extra_time():
    def epoch(i, waits, steps, first):
        return EpochResult(i, len(steps), 32 * len(steps), waits + sum(steps), waits, steps, first)

    # Later epochs with one slow step: their pace is their mean step, not the median.
    later = epoch(1, 0.1, [0.1] * 9 + [1.0], 0.01)
    first = epoch(0, 0.1, [0.25] * 10, 0.01)
    text = explain_first_epoch([first, later], 2)
    extra = float(text.split(" took ")[1].split("s ")[0])
    parts = [float(p.split("s ")[0]) for p in text.split(": ", 1)[1].split(", ")]
    assert extra == 0.6 and sum(parts) == pytest.approx(extra, abs=0.1), text
