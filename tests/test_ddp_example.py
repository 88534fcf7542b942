"""benchmarks/ddp_train.py under torchrun: checkpoint mid-epoch, resume on 2 and 3 ranks."""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "ddp_train.py")


def torchrun(nproc, *args):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        SCRIPT,
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def consumed(data, run, epoch):
    ids = []
    for path in glob.glob(os.path.join(data, f"consumed-rank*-{run}.txt")):
        with open(path) as f:
            for line in f:
                e, *rest = line.split()
                if int(e) == epoch:
                    ids += [int(x) for x in rest]
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("resume_world", [2, 3])
def test_ddp_checkpoint_and_elastic_resume(tmp_path, resume_world):
    data = str(tmp_path / "ddp")
    common = ["--data", data, "--num-records", "512", "--batch-size", "16", "--workers", "0"]
    torchrun(2, *common, "--stop-after", "5")
    torchrun(resume_world, *common, "--resume")
    first, rest = consumed(data, "first", 1), consumed(data, "resume", 1)
    epoch1 = first + rest
    # epoch 1 (512 samples) was stopped after 5 steps x 16 x 2 ranks, then resumed
    assert len(first) == 0  # the stop happened in epoch 0 (16 steps per epoch)
    e0 = consumed(data, "first", 0) + consumed(data, "resume", 0)
    # every sample once; an uneven split of the rest over the new ranks pads < world repeats
    assert set(e0) == set(range(512))
    assert 0 <= len(e0) - 512 < resume_world
    assert set(epoch1) == set(range(512))
    assert 0 <= len(epoch1) - 512 < resume_world
