"""PyTorch Lightning with a torchgrain sampler: `python train_lightning.py` trains on 2 CPU
processes (ddp) with a checkpoint every 3 steps; run it again to resume from the last one."""

import glob
import os
import shutil

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

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


# --8<-- [start:recipe]
class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.train_ds, self.val_ds = make_dataset(), make_dataset()
        self.layer = torch.nn.Linear(4, 1)

    def train_dataloader(self):
        sampler = tg.GlobalShuffleSampler(self.train_ds, seed=0)
        return StatefulDataLoader(self.train_ds, batch_size=256, sampler=sampler, num_workers=2)

    def val_dataloader(self):  # every validation sample exactly once over the ranks
        sampler = tg.GlobalShuffleSampler(self.val_ds, shuffle=False, pad=False)
        return DataLoader(self.val_ds, batch_size=256, sampler=sampler, num_workers=2)

    # --8<-- [end:recipe]

    def training_step(self, batch, batch_idx):
        return (self.layer(batch["x"]).squeeze(1) - batch["y"]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        loss = (self.layer(batch["x"]).squeeze(1) - batch["y"]).pow(2).mean()
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    checkpoints = sorted(glob.glob("checkpoints/*.ckpt"), key=os.path.getmtime)
    last_checkpoint = checkpoints[-1] if checkpoints else None
    # --8<-- [start:fit]
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        callbacks=[ModelCheckpoint("checkpoints", every_n_train_steps=3, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(Model(), ckpt_path=last_checkpoint)  # None for a fresh run
    # --8<-- [end:fit]
