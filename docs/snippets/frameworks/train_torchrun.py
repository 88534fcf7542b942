"""Your own loop under torchrun: `torchrun --nproc_per_node=2 train_torchrun.py` (run it again to
resume from the checkpoint it saved half-way through the first epoch)."""

import os
import shutil

import numpy as np
import torch
import torch.distributed as dist
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


path, epochs = "checkpoint.pt", 2
resuming = os.path.exists(path)
ds = make_dataset()
# --8<-- [start:recipe]
sampler = tg.GlobalShuffleSampler(ds, seed=0)
dist.init_process_group("gloo")  # "nccl" on GPUs
loader = tg.ResumableLoader(DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2))
if resuming:
    loader.load_state_dict(torch.load(path))  # saved by rank 0: ranks run in lockstep
for epoch in range(loader.epoch, epochs):
    for step, batch in enumerate(loader):
        train_step(batch)
        if epoch == 0 and step == 5 and not resuming and dist.get_rank() == 0:
            torch.save(loader.state_dict(), path)
# --8<-- [end:recipe]
print(f"rank {dist.get_rank()}: done at epoch {loader.epoch}", flush=True)
dist.destroy_process_group()
