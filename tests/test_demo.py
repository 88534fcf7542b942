"""`torchgrain demo`: the main job end to end, with real DataLoader workers."""

import subprocess
import sys

from torchgrain.cli import main


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
    assert "16 steps" in out  # 256 / 32 x 2 epochs
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
