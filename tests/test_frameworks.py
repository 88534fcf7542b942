"""The samplers inside the frameworks users train with: real 2-process runs.

PyTorch Lightning (``ddp`` and ``ddp_spawn``), HF Accelerate under ``torchrun`` (every
dataloader mode), HF ``Trainer`` under ``torchrun``, Ray Train on a local Ray cluster
and a plain ``torchrun`` job (tests/_framework_job.py), on gloo. Per epoch: the ranks
cover the dataset once, disjointly, in an order that changes with the epoch. Mid-epoch
resume, through each framework's own checkpoint: the interrupted run and the resumed
one together train on exactly the batches of an uninterrupted run, with the same
random_map draws, rank by rank. The table in docs/frameworks/index.md is these tests'
results.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys

import pytest

import torchgrain as tg
from tests import _procs

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
import _framework_job as job  # tests/ is on sys.path

# Each test starts 2-process jobs (a Ray cluster, a torchrun launch): minutes on a busy
# 2-core machine. A job has 300 s, and one that hangs is run once more (reported with
# its stacks at the end of the run: tests/_procs.py run_job_again_if_hung).
pytestmark = pytest.mark.timeout(1500)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "_framework_job.py")
N, VAL_N, BATCH, EPOCHS = 200, 101, 10, 2
STEPS_PER_EPOCH = N // 2 // BATCH
SAVE_STEP = STEPS_PER_EPOCH + 3  # a checkpoint in the middle of epoch 1


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
    cmd = [sys.executable, JOB, framework, str(data), str(out), *map(str, args)]
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
    proc = _procs.run_job_again_if_hung(cmd, env=env, timeout=300)
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
    workers, and an unpadded validation loader; a checkpoint saved in epoch 1."""
    out = tmp_path_factory.mktemp("lightning-ref")
    train, val = data
    args = ["--where", "init", "--loader", "stateful", "--workers", 2, "--val-data", val]
    ckpt = out / "step.ckpt"
    ranks = run("lightning", train, out, *args, "--save-step", SAVE_STEP, "--ckpt", ckpt)
    return ranks, ckpt


@pytest.fixture(scope="module")
def lightning_plain(data, tmp_path_factory):
    """A plain DataLoader, sampler built in __init__ (before the process group exists),
    use_distributed_sampler=False; a checkpoint saved in epoch 1."""
    out = tmp_path_factory.mktemp("lightning-plain")
    ckpt = out / "step.ckpt"
    args = ["--where", "init", "--no-distributed-sampler", "--save-step", SAVE_STEP]
    return run("lightning", data[0], out, *args, "--ckpt", ckpt), ckpt


def test_lightning_default_trainer_covers_each_epoch(lightning_reference):
    ranks, _ = lightning_reference
    assert ranks[0]["world"] == 2
    assert_disjoint_cover_per_epoch(ranks)


def test_lightning_validation_sees_every_sample_once(lightning_reference):
    ranks, _ = lightning_reference
    for epoch in range(EPOCHS):
        ids = [[i for b in rank["val"] if b["epoch"] == epoch for i in b["ids"]] for rank in ranks]
        assert sorted(ids[0] + ids[1]) == list(range(VAL_N))
        assert abs(len(ids[0]) - len(ids[1])) == 1


@pytest.mark.parametrize(
    "args",
    [
        ("--strategy", "ddp_spawn", "--where", "init"),
        ("--where", "hook", "--sampler", "block"),
        ("--where", "datamodule", "--no-distributed-sampler", "--workers", 2),
    ],
    ids=["ddp_spawn-init", "hook-block", "datamodule-no-ds-2workers"],
)
def test_lightning_placements_cover_each_epoch(data, tmp_path, args):
    assert_disjoint_cover_per_epoch(run("lightning", data[0], tmp_path, *args))


def test_lightning_sampler_built_before_the_process_group_covers_each_epoch(lightning_plain):
    assert_disjoint_cover_per_epoch(lightning_plain[0])


def test_lightning_stateful_dataloader_resumes_exactly(data, tmp_path, lightning_reference):
    reference, ckpt = lightning_reference
    args = ["--where", "init", "--loader", "stateful", "--workers", 2, "--resume", ckpt]
    after = run("lightning", data[0], tmp_path, *args)
    head = [{"batches": r["batches"][:SAVE_STEP]} for r in reference]
    assert_resumed_equals_reference(reference, head, after)


def test_lightning_resumable_loader_resumes_exactly(data, tmp_path, lightning_reference):
    train, ckpt = data[0], tmp_path / "step.ckpt"
    common = ["--where", "init", "--loader", "resumable", "--workers", 2]
    before = run("lightning", train, tmp_path / "a", *common, "--stop-step", 7, "--ckpt", ckpt)
    after = run("lightning", train, tmp_path / "b", *common, "--resume", ckpt)
    assert len(before[0]["batches"]) == 7
    assert_resumed_equals_reference(lightning_reference[0], before, after)


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_plain_dataloader_resume_restarts_an_epoch(
    data, tmp_path, lightning_plain, workers
):
    # What the Lightning page says happens: Lightning counts on from the checkpoint's step, but a
    # plain DataLoader has no position to restore, so the pass starts at the first batch
    # of an epoch: the resumed one with num_workers=0; with workers, epoch 0's order,
    # because Lightning starts the loader's iterator (and the workers draw indices)
    # before it sets the resumed epoch. Use StatefulDataLoader or tg.ResumableLoader.
    reference, ckpt = lightning_plain
    args = ["--where", "init", "--no-distributed-sampler", "--workers", workers]
    after = run("lightning", data[0], tmp_path, *args, "--resume", ckpt)
    replayed = 0 if workers else 1
    for r in range(2):
        got = [b["ids"] for b in after[r]["batches"]]
        assert len(got) == STEPS_PER_EPOCH * EPOCHS - SAVE_STEP
        assert {b["epoch"] for b in after[r]["batches"]} == {1}
        epoch = [b["ids"] for b in reference[r]["batches"] if b["epoch"] == replayed]
        assert got == epoch[: len(got)]


# ------------------------------------------------------------------------- Accelerate


@pytest.fixture(scope="module")
def accelerate_reference(data, tmp_path_factory):
    """Sampler built before Accelerator(), loader prepared, 2 workers, no set_epoch."""
    out = tmp_path_factory.mktemp("accelerate-ref")
    return run("accelerate", data[0], out, "--where", "before", "--workers", 2, "--resumable")


def test_accelerate_prepared_loader_covers_each_epoch(accelerate_reference):
    assert accelerate_reference[0]["len"] == STEPS_PER_EPOCH
    assert_disjoint_cover_per_epoch(accelerate_reference)


def test_accelerate_save_state_resumes_exactly_in_a_new_process(
    data, tmp_path, accelerate_reference
):
    # Sampler built after Accelerator(), no workers before the stop, 2 after: the same order.
    train, ckpt = data[0], tmp_path / "state"
    common = ["--where", "after", "--resumable"]
    before = run(
        "accelerate", train, tmp_path / "a", *common, "--stop-step", SAVE_STEP, "--ckpt", ckpt
    )
    after = run("accelerate", train, tmp_path / "b", *common, "--workers", 2, "--resume", ckpt)
    assert_resumed_equals_reference(accelerate_reference, before, after)
    assert_disjoint_cover_per_epoch(
        [{"batches": b["batches"] + a["batches"]} for b, a in zip(before, after)]
    )


@pytest.fixture(scope="module")
def accelerate_modes(tmp_path_factory):
    """Every Accelerate dataloader mode x 1,000/1,001 records x 0/2 workers, in one
    launch (tests/_framework_job.py: run_accelerate_modes)."""
    return run("accelerate-modes", "-", tmp_path_factory.mktemp("accelerate-modes"))


MODE_CONFIGS = [
    (mode, n, workers)
    for mode in job.ACCELERATE_MODES
    for n in job.MODE_SIZES
    for workers in job.MODE_WORKERS
]


@pytest.mark.parametrize(
    "mode,n,workers", MODE_CONFIGS, ids=[f"{m}-{n}-w{w}" for m, n, w in MODE_CONFIGS]
)
def test_accelerate_mode_covers_each_epoch_and_resumes_exactly(accelerate_modes, mode, n, workers):
    ranks = [r[f"{mode}-{n}-w{workers}"] for r in accelerate_modes]
    step_size = job.BATCH if "split" in mode else job.BATCH * 2
    for epoch in range(job.MODE_EPOCHS):
        # As many steps as len(loader) said (25 of 50 under dispatch_batches before).
        assert [len(r["cover"][epoch]) for r in ranks] == [r["len"] for r in ranks]
        seen = collections.Counter(i for r in ranks for b in r["cover"][epoch] for i in b["ids"])
        assert set(seen) == set(range(n)), f"epoch {epoch}: {n - len(seen)} records missing"
        extra = sum(seen.values()) - n  # the loader's own padding of its last step
        assert (
            extra == 0 if n % step_size == 0 or mode == "even_batches_false" else extra < step_size
        )
    assert ranks[0]["cover"][0] != ranks[0]["cover"][1], "both epochs in the same order"
    for r, rank in enumerate(ranks):
        # save_state in epoch 1, load_state into new objects: the same batches, padding too.
        assert len(rank["head"]) == len(rank["cover"][0]) + job.MODE_STOP[1]
        assert rank["head"] + rank["tail"] == rank["cover"][0] + rank["cover"][1], f"rank {r}"


# --------------------------------------------------------------------------- HF Trainer


@pytest.fixture(scope="module")
def trainer_run(data, tmp_path_factory):
    pytest.importorskip("transformers")
    return run("trainer", data[0], tmp_path_factory.mktemp("trainer"), "--workers", 2)


def test_trainer_covers_each_epoch(trainer_run):
    ranks = [
        {"batches": [{**b, "epoch": k // STEPS_PER_EPOCH} for k, b in enumerate(r["reference"])]}
        for r in trainer_run
    ]
    assert_disjoint_cover_per_epoch(ranks)
    for r in trainer_run:
        # Set once to each epoch, before its first index (the repeated calls with the
        # same number come from Trainer and Accelerate themselves).
        assert [
            e
            for k, e in enumerate(r["reference_set_epoch"])
            if k == 0 or e != r["reference_set_epoch"][k - 1]
        ] == list(range(EPOCHS))


def test_trainer_resumes_mid_epoch_exactly(trainer_run):
    if trainer_run[0]["resumed"] is None:
        pytest.skip("transformers resumes a Trainer checkpoint only under torch >= 2.6")
    for r in trainer_run:
        assert r["resumed"] == r["reference"][job.TRAINER_SAVE_STEP :]
        assert set(r["resumed_set_epoch"]) == {1}  # the resumed epoch's order, not epoch 0's


def test_trainer_under_dispatch_batches_resumes_mid_epoch_exactly(data, tmp_path):
    # dispatch_batches=True: process 0 reads both ranks' batches of a step, while the
    # Trainer's resume skips one loader batch per micro-batch trained (half of them
    # before the fix: records trained twice, others never). Gradient accumulation 2,
    # checkpoint at optimizer step 7: 4 micro-batches into epoch 1.
    pytest.importorskip("transformers")
    if not job.trainer_can_resume():
        pytest.skip("transformers resumes a Trainer checkpoint only under torch >= 2.6")
    ranks = run("trainer", data[0], tmp_path, "--dispatch", "--grad-accum", 2, "--save-step", 7)
    per_rank = [
        {"batches": [{**b, "epoch": k // STEPS_PER_EPOCH} for k, b in enumerate(r["reference"])]}
        for r in ranks
    ]
    assert_disjoint_cover_per_epoch(per_rank)
    for r in ranks:
        assert r["resumed"] == r["reference"][7 * 2 :]


# ---------------------------------------------------------------------------- Ray Train


def _ray_processes() -> list[_procs.Proc]:
    """The Ray processes below this one (its actors, raylet, GCS)."""
    out = []
    for p in _procs.descendants(os.getpid()):
        cmd = _procs.describe(p.pid).split(": ", 1)[-1]
        if cmd.startswith("ray::") or "/ray/" in cmd:
            out.append(p)
    return out


def test_ray_train_covers_each_epoch_and_resumes_from_its_checkpoint(
    data, tmp_path_factory, monkeypatch
):
    ray = pytest.importorskip("ray")
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tmp = tmp_path_factory.mktemp("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token written to the home directory
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    for name in ("NO_ALBUMENTATIONS_UPDATE", "TORCHGRAIN_TEST_START_METHOD"):
        if name in os.environ:
            env[name] = os.environ[name]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(tmp / "ray"),
        runtime_env={"env_vars": env},
    )
    try:

        def fit(name, **config):
            config = {
                "data": data[0],
                "out": str(tmp / name),
                "workers": 2,
                "epochs": EPOCHS,
                **config,
            }
            trainer = TorchTrainer(
                job.ray_loop,
                train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(storage_path=str(tmp / "runs"), name=name),
            )
            result = trainer.fit()
            return [
                json.loads((tmp / name / f"rank{r}.json").read_text()) for r in range(2)
            ], result

        reference, result = fit("reference", save_step=SAVE_STEP)
        resumed, _ = fit("resumed", resume=result.checkpoint)
    finally:
        ray.shutdown()
        # Its actors (ray::TrainController...) exit after shutdown returns, in their own
        # time (over 20 s on a busy machine): the cluster this test made goes with it.
        _procs.kill(_procs.wait_gone(_ray_processes, 30.0))
    assert reference[0]["world"] == 2
    assert_disjoint_cover_per_epoch(reference)
    for ref, res in zip(reference, resumed):
        assert ref["set_epoch"] == [1, 2]  # tg.ResumableLoader, once at the end of each pass
        assert res["batches"] == ref["batches"][SAVE_STEP:]


# --------------------------------------------------------------------------- torchrun


def test_torchrun_sampler_built_before_the_process_group(data, tmp_path):
    train, ckpt = data[0], tmp_path / "loader.pt"
    reference = run("torchrun", train, tmp_path / "ref", "--workers", 2)
    assert_disjoint_cover_per_epoch(reference)
    before = run("torchrun", train, tmp_path / "a", "--stop-step", 7, "--ckpt", ckpt)
    after = run("torchrun", train, tmp_path / "b", "--workers", 2, "--resume", ckpt)
    assert_resumed_equals_reference(reference, before, after)
