"""benchmarks/augmentation.py's fresh-process rounds: the round script, and the row's
fallback when the other environment can't run them (no torchvision venv is made here)."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("albumentations")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND_SCRIPT = os.path.join(ROOT, "benchmarks", "_augmentation_round.py")


def _load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "augmentation_bench", os.path.join(ROOT, "benchmarks", "augmentation.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**kw):
    base = {"runs": 32, "rounds": 1, "group": 16, "size": 64, "threads": 1}
    return argparse.Namespace(**{**base, **kw})


def test_round_script_writes_times_per_group(tmp_path):
    out = tmp_path / "round.json"
    cmd = [sys.executable, ROUND_SCRIPT, "--library=albumentations", "--images=32"]
    cmd += ["--group=16", "--size=64", f"--json-out={out}"]
    subprocess.run(cmd, check=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    got = json.loads(out.read_text())
    assert got["library"] == "albumentations"
    assert len(got["seconds_per_image"]) == 2
    assert all(t > 0 for t in got["seconds_per_image"])
    assert got["versions"]["albumentations"]


def test_missing_interpreter_is_named(tmp_path):
    bench = _load_benchmark()
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(bench.RoundFailed, match="no-venv"):
        bench.fresh_process_rounds(missing, _args())


def test_interpreter_without_the_library_says_why():
    # This environment has no torchvision: the round fails, and the error says how.
    pytest.importorskip("cv2")
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here")
    bench = _load_benchmark()
    with pytest.raises(bench.RoundFailed, match="torchvision round: ModuleNotFoundError"):
        bench.fresh_process_rounds(sys.executable, _args())


def test_worker_times_groups_on_request(tmp_path):
    bench = _load_benchmark()
    w = bench._Worker(sys.executable, "albumentations", _args(), seed=0, log_dir=str(tmp_path))
    try:
        assert w.hello()["versions"]["albumentations"]
        times = [w.timed_group() for _ in range(3)]
    finally:
        w.close()
    assert all(t > 0 for t in times)
    assert w.proc.returncode == 0
