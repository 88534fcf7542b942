"""The framework programs of the documentation (docs/snippets/frameworks/), run as a user runs
them: on two CPU processes, then once more to resume from the checkpoint the first run took in
the middle of an epoch. The framework pages include these files; tests/test_frameworks.py
checks the behaviour they rely on (exact covers and resumes) batch by batch."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _procs

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "docs" / "snippets" / "frameworks"

# Two-process jobs (a Ray cluster, torchrun launches): minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(program: str, cwd: Path, *, torchrun: bool = False) -> str:
    """Run ``program`` in ``cwd`` (under torchrun with 2 processes); its stdout + stderr."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "RAY_AUTH_MODE": "disabled",  # no token written to the home directory
    }
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, str(PROGRAMS / program)]
    if torchrun:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd[5:5] = ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    proc = _procs.run_job_again_if_hung(cmd, cwd=str(cwd), env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def test_the_torchrun_program_trains_and_resumes(tmp_path):
    first = run("train_torchrun.py", tmp_path, torchrun=True)
    assert (tmp_path / "checkpoint.pt").is_file()
    second = run("train_torchrun.py", tmp_path, torchrun=True)
    for out in (first, second):
        assert "rank 0: done at epoch 2" in out and "rank 1: done at epoch 2" in out


def test_the_accelerate_program_resumes_to_the_loss_of_an_uninterrupted_run(tmp_path):
    pytest.importorskip("accelerate")
    first = run("train_accelerate.py", tmp_path, torchrun=True)
    assert (tmp_path / "accelerate-state").is_dir()
    second = run("train_accelerate.py", tmp_path, torchrun=True)
    loss = re.compile(r"done at epoch 2, loss (\S+)")
    # The resumed run replays the rest of the epoch from the saved model, optimizer and
    # loader position: it ends where the uninterrupted first run ended.
    assert loss.findall(first) and loss.findall(first) == loss.findall(second)


def test_the_hf_trainer_program_trains_and_resumes_mid_epoch(tmp_path):
    pytest.importorskip("transformers")
    import torch

    first = run("train_hf_trainer.py", tmp_path, torchrun=True)
    assert "done at step 32" in first
    out = tmp_path / "trainer-out"
    assert {"checkpoint-10", "checkpoint-20", "checkpoint-30"} <= set(os.listdir(out))
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
        pytest.skip("resuming a Trainer checkpoint needs torch >= 2.6 (transformers' own limit)")
    # Keep the checkpoint in the middle of the second epoch (16 steps an epoch) only.
    for name in os.listdir(out):
        if name != "checkpoint-20":
            subprocess.run(["rm", "-rf", str(out / name)], check=True)
    second = run("train_hf_trainer.py", tmp_path, torchrun=True)
    assert "done at step 32" in second


def test_the_lightning_program_trains_and_resumes_mid_epoch(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("torchdata")
    first = run("train_lightning.py", tmp_path)
    checkpoints = sorted(os.listdir(tmp_path / "checkpoints"))
    # 2,000 records, batches of 256 on 2 ranks: 4 steps an epoch; step 6 is mid-epoch 1.
    assert checkpoints == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    second = run("train_lightning.py", tmp_path)
    for out in (first, second):
        assert "`max_epochs=2` reached" in out
    assert "Restoring states from the checkpoint path" in second and "step=6" in second


def test_the_ray_train_program_trains_then_resumes_from_its_checkpoint(tmp_path):
    pytest.importorskip("ray")
    out = run("train_ray.py", tmp_path)
    assert "resumed from" in out and "checkpoint_" in out
