"""The samplers inside the frameworks users train with: real 2-process runs.

PyTorch Lightning (``ddp`` and ``ddp_spawn``), HF Accelerate under ``torchrun`` and a
plain ``torchrun`` job (tests/_framework_job.py), on gloo. Per epoch: the ranks cover
the dataset once, disjointly, in an order that changes with the epoch. Mid-epoch
resume, through each framework's own checkpoint in a new process: the interrupted
run and the resumed one together train on exactly the batches of an uninterrupted
run, with the same random_map draws, rank by rank.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys

import pytest

import torchgrain as tg

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "_framework_job.py")
N, VAL_N, BATCH, EPOCHS = 200, 101, 10, 2
STEPS_PER_EPOCH = N // 2 // BATCH


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks")
    train, val = root / "train", root / "val"
    tg.write_array_record([{"id": i} for i in range(N)], str(train), num_shards=2)
    tg.write_array_record([{"id": i} for i in range(VAL_N)], str(val), num_shards=1)
    return str(train), str(val)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(framework, data, out, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, NO_ALBUMENTATIONS_UPDATE="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, JOB, framework, data, str(out), *map(str, args)]
    if framework != "lightning":
        cmd[1:1] = [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def epochs_of(ranks):
    """{epoch: [ids of rank 0 in order, ids of rank 1 in order]}."""
    out = collections.defaultdict(lambda: [[], []])
    for r, payload in enumerate(ranks):
        for batch in payload["batches"]:
            out[batch["epoch"]][r] += batch["ids"]
    return dict(out)


def assert_disjoint_cover_per_epoch(ranks, n=N, epochs=EPOCHS):
    per_epoch = epochs_of(ranks)
    assert sorted(per_epoch) == list(range(epochs))
    orders = []
    for epoch, (a, b) in per_epoch.items():
        assert len(a) == len(b) == n // 2, f"epoch {epoch}: {len(a)} and {len(b)} records"
        assert not set(a) & set(b), f"epoch {epoch}: ranks overlap"
        assert sorted(a + b) == list(range(n)), f"epoch {epoch}: not one cover"
        orders.append(a + b)
    assert orders[0] != orders[1], "both epochs in the same order"


def assert_resumed_equals_reference(reference, before, after):
    for r in range(2):
        ref = reference[r]["batches"]
        joined = before[r]["batches"] + after[r]["batches"]
        assert len(joined) == len(ref)
        for k, (got, want) in enumerate(zip(joined, ref)):
            assert got == want, f"rank {r}, batch {k}: {got} != {want}"


# -------------------------------------------------------------------------- Lightning


@pytest.fixture(scope="module")
def lightning_reference(data, tmp_path_factory):
    """Default Trainer settings, sampler built in __init__, StatefulDataLoader with 2
    workers, and an unpadded validation loader."""
    out = tmp_path_factory.mktemp("lightning-ref")
    train, val = data
    args = ["--where", "init", "--loader", "stateful", "--workers", 2, "--val-data", val]
    return run("lightning", train, out, *args)


def test_lightning_default_trainer_covers_each_epoch(lightning_reference):
    assert lightning_reference[0]["world"] == 2
    assert_disjoint_cover_per_epoch(lightning_reference)


def test_lightning_validation_sees_every_sample_once(lightning_reference):
    for epoch in range(EPOCHS):
        ids = [
            [i for b in rank["val"] if b["epoch"] == epoch for i in b["ids"]]
            for rank in lightning_reference
        ]
        assert sorted(ids[0] + ids[1]) == list(range(VAL_N))
        assert abs(len(ids[0]) - len(ids[1])) == 1


@pytest.mark.parametrize(
    "args",
    [
        ("--strategy", "ddp_spawn", "--where", "init"),
        ("--where", "hook", "--sampler", "block"),
        ("--where", "datamodule", "--no-distributed-sampler", "--workers", 2),
        ("--where", "init", "--no-distributed-sampler"),
    ],
    ids=["ddp_spawn-init", "hook-block", "datamodule-no-ds-2workers", "init-no-ds"],
)
def test_lightning_placements_cover_each_epoch(data, tmp_path, args):
    assert_disjoint_cover_per_epoch(run("lightning", data[0], tmp_path, *args))


@pytest.mark.parametrize("loader", ["stateful", "resumable"])
def test_lightning_mid_epoch_checkpoint_resumes_exactly(
    data, tmp_path, lightning_reference, loader
):
    train = data[0]
    ckpt = tmp_path / "step.ckpt"
    common = ["--where", "init", "--loader", loader, "--workers", 2]
    before = run("lightning", train, tmp_path / "a", *common, "--stop-step", 7, "--ckpt", ckpt)
    after = run("lightning", train, tmp_path / "b", *common, "--resume", ckpt)
    assert len(before[0]["batches"]) == 7
    assert_resumed_equals_reference(lightning_reference, before, after)


# ------------------------------------------------------------------------- Accelerate


@pytest.fixture(scope="module")
def accelerate_reference(data, tmp_path_factory):
    """Sampler built before Accelerator(), loader prepared, 2 workers, no set_epoch."""
    out = tmp_path_factory.mktemp("accelerate-ref")
    return run("accelerate", data[0], out, "--where", "before", "--workers", 2, "--resumable")


def test_accelerate_prepared_loader_covers_each_epoch(accelerate_reference):
    assert accelerate_reference[0]["len"] == STEPS_PER_EPOCH
    assert_disjoint_cover_per_epoch(accelerate_reference)


@pytest.mark.parametrize("stop", [7, STEPS_PER_EPOCH + 3])
def test_accelerate_save_state_resumes_exactly(data, tmp_path, accelerate_reference, stop):
    # Sampler built after Accelerator(), no workers: the order is the same.
    train, ckpt = data[0], tmp_path / "state"
    common = ["--where", "after", "--resumable"]
    before = run("accelerate", train, tmp_path / "a", *common, "--stop-step", stop, "--ckpt", ckpt)
    after = run("accelerate", train, tmp_path / "b", *common, "--workers", 2, "--resume", ckpt)
    assert_resumed_equals_reference(accelerate_reference, before, after)
    assert_disjoint_cover_per_epoch(
        [{"batches": b["batches"] + a["batches"]} for b, a in zip(before, after)]
    )


# --------------------------------------------------------------------------- torchrun


def test_torchrun_sampler_built_before_the_process_group(data, tmp_path):
    train, ckpt = data[0], tmp_path / "loader.pt"
    reference = run("torchrun", train, tmp_path / "ref", "--workers", 2)
    assert_disjoint_cover_per_epoch(reference)
    before = run("torchrun", train, tmp_path / "a", "--stop-step", 7, "--ckpt", ckpt)
    after = run("torchrun", train, tmp_path / "b", "--workers", 2, "--resume", ckpt)
    assert_resumed_equals_reference(reference, before, after)
