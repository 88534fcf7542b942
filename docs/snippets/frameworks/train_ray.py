"""Ray Train: `python train_ray.py` trains on 2 Ray workers, then resumes from the
checkpoint reported half-way through the first epoch."""

import os
import shutil
import tempfile

import numpy as np
import ray.train
import ray.train.torch
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader

import torchgrain as tg


def make_dataset(path="data/train", n=2000):
    """``n`` records ``{"x": float32[4], "y": float}`` as ArrayRecord shards, made by the
    first process of the job that gets there (the others find it complete)."""
    if not os.path.exists(path):
        x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
        records = [{"x": x[i], "y": float(x[i].sum())} for i in range(n)]
        tmp = f"{path}.{os.getpid()}"
        tg.write_array_record(records, tmp, num_shards=4)
        try:
            os.rename(tmp, path)  # whole, or not at all
        except OSError:  # another process was first
            shutil.rmtree(tmp)
    return tg.Dataset(tg.ArrayRecordSource(path))


def train_step(batch):
    """A stand-in for the model's step."""
    return batch["x"].sum()


DATA = os.path.abspath("data/train")
epochs = 2


# --8<-- [start:recipe]
def train_loop(config):
    ds = make_dataset(DATA)
    sampler = tg.GlobalShuffleSampler(ds, seed=0)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2)
    )
    loader = tg.ResumableLoader(loader)
    checkpoint = ray.train.get_checkpoint() or config.get("resume")  # a ray.train.Checkpoint
    if checkpoint:
        with checkpoint.as_directory() as d:
            loader.load_state_dict(torch.load(os.path.join(d, "loader.pt")))
    for epoch in range(loader.epoch, epochs):
        for step, batch in enumerate(loader):
            train_step(batch)
            if epoch == 0 and step == 5 and not checkpoint:
                with tempfile.TemporaryDirectory() as d:
                    torch.save(loader.state_dict(), os.path.join(d, "loader.pt"))
                    rank0 = ray.train.get_context().get_world_rank() == 0
                    ckpt = ray.train.Checkpoint.from_directory(d) if rank0 else None
                    ray.train.report({"epoch": epoch, "step": step}, checkpoint=ckpt)


if __name__ == "__main__":
    make_dataset(DATA)
    run = RunConfig(storage_path=os.path.abspath("ray-results"))
    scaling = ScalingConfig(num_workers=2)
    result = TorchTrainer(train_loop, scaling_config=scaling, run_config=run).fit()
    # resume:
    TorchTrainer(
        train_loop,
        train_loop_config={"resume": result.checkpoint},
        scaling_config=scaling,
        run_config=run,
    ).fit()
    # --8<-- [end:recipe]
    print("resumed from", result.checkpoint.path)
