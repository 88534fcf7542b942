"""HF Accelerate: `accelerate launch --num_processes 2 train_accelerate.py` (or torchrun); run it
again to resume from the state it saved half-way through the first epoch."""

import os
import shutil

import numpy as np
import torch
import torch.distributed.nn  # before the process group exists: see the end
from accelerate import Accelerator
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


checkpoint_dir, epochs = "accelerate-state", 2
resuming = os.path.exists(checkpoint_dir)
ds = make_dataset()
# --8<-- [start:recipe]
accelerator = Accelerator(cpu=True)  # any DataLoaderConfiguration: split/dispatch/even_batches
sampler = tg.GlobalShuffleSampler(ds, seed=0)
loader = accelerator.prepare(DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2))
loader = tg.ResumableLoader(loader)  # or tg.bind(loader) if you never checkpoint mid-epoch
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.register_for_checkpointing(loader)
if resuming:
    accelerator.load_state(checkpoint_dir)  # the epoch and position come back too
for epoch in range(loader.epoch, epochs):
    for step, batch in enumerate(loader):
        loss = (model(batch["x"]).squeeze(1) - batch["y"]).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if epoch == 0 and step == 5 and not resuming:
            accelerator.save_state(checkpoint_dir)
# --8<-- [end:recipe]
accelerator.print(f"done at epoch {loader.epoch}, loss {loss.item():.3f}", flush=True)
# Free the DDP model, then end the group. A gloo group left to the interpreter's exit can
# abort it, and the DDP model holds the group. The other order can hang: a collection
# that frees the last hold on an ended group joins its threads while holding the GIL,
# which a thread freeing a finished collective's tensors waits for. torch.distributed.nn
# is imported above: first imported after the group exists (DDP does), its functions
# keep the group as their default argument.
model, optimizer = accelerator.free_memory(model, optimizer)
accelerator.end_training()
